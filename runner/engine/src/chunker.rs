//! Cutting file content into chunks, the unit of deduplication.
//!
//! Small files are one chunk: a blob per file is the cheapest unit to store
//! and to ask about. Larger files are cut by content (FastCDC, 2020 variant),
//! so an insertion or an append moves only the boundaries next to the edit
//! and every other chunk keeps its id. The choice depends on the bytes that
//! are actually read, not on a size seen earlier, so a file that grows while
//! it is read is still cut within the format's chunk limit.
//!
//! Content is streamed: at most one chunk plus FastCDC's window of
//! [`MAX_CHUNK`] bytes is in memory per file.

use std::io::{self, Read};

use fastcdc::v2020::StreamCDC;

/// Files up to this size are stored whole, as one chunk.
pub const WHOLE_FILE_MAX: usize = 128 << 10;
/// FastCDC's smallest chunk.
pub const MIN_CHUNK: u32 = 16 << 10;
/// FastCDC's target chunk size.
pub const AVG_CHUNK: u32 = 64 << 10;
/// FastCDC's largest chunk.
pub const MAX_CHUNK: u32 = 256 << 10;

const _: () = assert!(MAX_CHUNK <= crate::format::MAX_CHUNK_LEN);
const _: () = assert!(WHOLE_FILE_MAX as u32 <= crate::format::MAX_CHUNK_LEN);

/// How finely a file is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// Whole up to 128 KiB, else FastCDC 16/64/256 KiB.
    Standard,
    /// Whole up to 16 KiB, else FastCDC 2/8/32 KiB: for files rewritten in
    /// place with a few scattered changes (SQLite pages), where standard
    /// chunks would re-send 64 KiB around every changed record.
    Fine,
    /// Whole up to 4 KiB, else FastCDC 1/2/8 KiB: a git index, whose
    /// ~90-byte entries (mostly hashes and times, which do not compress)
    /// change a few dozen at a time, scattered over the whole file. Smaller
    /// chunks mean longer chunk lists (32 bytes of id per chunk in the
    /// directory's tree), which 2 KiB still repays several times.
    GitIndex,
}

impl Granularity {
    /// The granularity for a file at `rel` (path bytes relative to the root).
    pub fn for_path(rel: &[u8]) -> Self {
        let name = rel.rsplit(|b| *b == b'/').next().unwrap_or(rel);
        let in_git_dir = rel
            .split(|b| *b == b'/')
            .rev()
            .nth(1)
            .is_some_and(|parent| parent == b".git");
        let sqlite = [
            &b".db"[..],
            b".sqlite",
            b".sqlite3",
            b".db-wal",
            b".sqlite-wal",
            b".sqlite3-wal",
        ]
        .iter()
        .any(|ext| name.ends_with(ext));
        if in_git_dir && name == b"index" {
            Self::GitIndex
        } else if sqlite {
            Self::Fine
        } else {
            Self::Standard
        }
    }

    /// (whole-file limit, FastCDC min, avg, max).
    fn params(self) -> (usize, u32, u32, u32) {
        match self {
            Self::Standard => (WHOLE_FILE_MAX, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK),
            Self::Fine => (16 << 10, 2 << 10, 8 << 10, 32 << 10),
            Self::GitIndex => (4 << 10, 1 << 10, 2 << 10, 8 << 10),
        }
    }
}

/// Calls `on_chunk` with each chunk of `source`, cut at `granularity`, in
/// order. An empty source has no chunks. `size_hint` is the size the source
/// is expected to have (it sizes buffers exactly; a wrong hint costs only
/// copies). Returns how many bytes were read.
pub fn for_each_chunk<R, F>(
    granularity: Granularity,
    mut source: R,
    size_hint: u64,
    mut on_chunk: F,
) -> io::Result<u64>
where
    R: Read,
    F: FnMut(Vec<u8>) -> io::Result<()>,
{
    let (whole_file_max, min, avg, max) = granularity.params();
    // Read one byte past the whole-file limit to learn which way to cut. The
    // buffer is sized for the file so that a whole-file chunk wastes no
    // capacity: thousands of them wait in memory for the store's answer.
    let mut head = Vec::with_capacity(size_hint.min(whole_file_max as u64) as usize + 1);
    (&mut source)
        .take(whole_file_max as u64 + 1)
        .read_to_end(&mut head)?;
    if head.len() <= whole_file_max {
        let len = head.len() as u64;
        if !head.is_empty() {
            on_chunk(head)?;
        }
        return Ok(len);
    }
    let mut total = 0u64;
    let chunker = StreamCDC::new(io::Cursor::new(head).chain(source), min, avg, max);
    for chunk in chunker {
        let chunk = chunk.map_err(io::Error::from)?;
        total += chunk.data.len() as u64;
        on_chunk(chunk.data)?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use rand::{RngCore, SeedableRng};
    use sha2::{Digest, Sha256};

    use super::*;

    fn chunk_digests(data: &[u8]) -> Vec<([u8; 32], usize)> {
        chunk_digests_with(Granularity::Standard, data)
    }

    fn chunk_digests_with(granularity: Granularity, data: &[u8]) -> Vec<([u8; 32], usize)> {
        let mut out = Vec::new();
        for_each_chunk(granularity, data, data.len() as u64, |c| {
            out.push((Sha256::digest(&c).into(), c.len()));
            Ok(())
        })
        .unwrap();
        out
    }

    fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut data = vec![0u8; len];
        rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut data);
        data
    }

    #[test]
    fn git_indexes_and_sqlite_files_are_cut_finely() {
        for index in [&b".git/index"[..], b"app/.git/index"] {
            assert_eq!(Granularity::for_path(index), Granularity::GitIndex);
        }
        for fine in [&b"state/x/history.db"[..], b"s.sqlite3-wal"] {
            assert_eq!(Granularity::for_path(fine), Granularity::Fine, "{fine:?}");
        }
        for standard in [
            &b"index"[..],
            b"src/index",
            b".git/objects/index",
            b"notes.dbx",
        ] {
            assert_eq!(
                Granularity::for_path(standard),
                Granularity::Standard,
                "{standard:?}"
            );
        }
        // A few scattered record changes re-send a few small chunks.
        let mut data = random_bytes(2 << 20, 9);
        let before = chunk_digests_with(Granularity::Fine, &data);
        assert!(before.iter().all(|(_, len)| *len <= 32 << 10));
        for at in [100_000, 700_000, 1_500_000] {
            data[at] ^= 0xff;
        }
        let after = chunk_digests_with(Granularity::Fine, &data);
        let new_bytes: usize = after
            .iter()
            .filter(|c| !before.contains(c))
            .map(|(_, len)| len)
            .sum();
        assert!(new_bytes <= 3 * (32 << 10), "{new_bytes} new bytes");

        // A git index: thirty scattered entries re-send about thirty 2 KiB chunks.
        let mut index = random_bytes(2 << 20, 10);
        let before = chunk_digests_with(Granularity::GitIndex, &index);
        assert!(before.iter().all(|(_, len)| *len <= 8 << 10));
        for entry in 0..30 {
            index[entry * 69_000 + 500] ^= 0xff;
        }
        let after = chunk_digests_with(Granularity::GitIndex, &index);
        let new_bytes: usize = after
            .iter()
            .filter(|c| !before.contains(c))
            .map(|(_, len)| len)
            .sum();
        assert!(new_bytes <= 30 * (6 << 10), "{new_bytes} new bytes");
    }

    #[test]
    fn small_files_are_one_chunk_and_empty_files_none() {
        assert!(chunk_digests(b"").is_empty());
        let exactly_limit = random_bytes(WHOLE_FILE_MAX, 1);
        let chunks = chunk_digests(&exactly_limit);
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0].1, WHOLE_FILE_MAX);
    }

    #[test]
    fn large_files_are_cut_within_the_limits_and_cover_every_byte() {
        let data = random_bytes(3 << 20, 2);
        let mut rebuilt = Vec::new();
        let read = for_each_chunk(Granularity::Standard, &data[..], 0, |c| {
            assert!(c.len() <= MAX_CHUNK as usize);
            rebuilt.extend_from_slice(&c);
            Ok(())
        })
        .unwrap();
        assert_eq!(read, data.len() as u64);
        assert_eq!(rebuilt, data);
        let chunks = chunk_digests(&data);
        assert!(
            chunks.len() > 3 << 20 >> 18,
            "3 MiB must need more than 12 chunks, got {}",
            chunks.len()
        );
        // Every chunk but the last respects the minimum.
        assert!(
            chunks[..chunks.len() - 1]
                .iter()
                .all(|(_, len)| *len >= MIN_CHUNK as usize)
        );
    }

    #[test]
    fn appending_to_a_large_file_changes_only_its_last_chunks() {
        let original = random_bytes(5_000_000, 3);
        let mut appended = original.clone();
        appended.extend_from_slice(&random_bytes(10_000, 4));
        let before = chunk_digests(&original);
        let after = chunk_digests(&appended);
        let shared = before
            .iter()
            .zip(&after)
            .take_while(|(a, b)| a == b)
            .count();
        assert!(
            shared + 2 >= before.len(),
            "only the last chunk(s) may change: {shared} of {} kept",
            before.len()
        );
        assert!(before.len() > 20);
    }

    #[test]
    fn an_insertion_in_the_middle_keeps_the_chunks_after_it() {
        let original = random_bytes(4_000_000, 5);
        let mut edited = original[..2_000_000].to_vec();
        edited.extend_from_slice(b"an inserted line\n");
        edited.extend_from_slice(&original[2_000_000..]);
        let before: std::collections::HashSet<_> = chunk_digests(&original).into_iter().collect();
        let after = chunk_digests(&edited);
        let new = after.iter().filter(|c| !before.contains(c)).count();
        assert!(
            new <= 3,
            "an insertion should touch at most a few chunks, {new} are new"
        );
    }
}
