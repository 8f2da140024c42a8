//! The entries of a git index file, to learn which paths' entries changed.
//!
//! A resident runner re-reads `git status` only for the paths that changed
//! since its last reading. When `.git/index` itself changed (an add, a
//! commit, a merge), [`IndexEntries::changed_paths`] of the two readings
//! names the paths whose entries differ, so only those are read again.
//!
//! It reads index versions 2, 3 and 4 of SHA-1 repositories, and keeps of
//! each entry what `git status` depends on: the path, stage, object id,
//! mode, the assume-valid, skip-worktree and intent-to-add bits, and apart
//! from them the stat data, which tells whether the working file is as it
//! was added ([`crate::git::derive`]). The stat data is not compared by
//! [`IndexEntries::changed_paths`]: `git add`, `git commit` and a refresh
//! rewrite it for many entries whose status does not change, and those must
//! not count as changed.
//!
//! It refuses ([`IndexError::Unsupported`]) what it cannot list the entries
//! of on its own: a split index (most entries live in a shared index file), a
//! sparse index (one entry stands for a whole directory), the index of a
//! SHA-256 repository, other index versions, entry flags of a newer git, and
//! extensions git itself must understand to read the index (the lowercase
//! ones). A truncated or garbled file gives [`IndexError::Malformed`] where
//! its structure shows it (the trailing checksum is not checked: git
//! replaces the file by a rename, so a reader never sees it half-written),
//! and no input makes it panic.

use std::cmp::Ordering;
use std::io::Read as _;
use std::ops::Range;
use std::path::Path;

use ring::digest;

/// Bytes of a SHA-1 object id, and of the file's trailing checksum.
const HASH_LEN: usize = 20;
/// Signature, version and entry count.
const HEADER_LEN: usize = 12;
/// The smallest an entry can be (version 2, a one-byte path), to bound
/// what a corrupt entry count makes us reserve.
const MIN_ENTRY_LEN: usize = 64;

const FLAG_ASSUME_VALID: u16 = 0x8000;
const FLAG_EXTENDED: u16 = 0x4000;
const NAME_MASK: u16 = 0x0FFF;
const EXT_SKIP_WORKTREE: u16 = 0x4000;
const EXT_INTENT_TO_ADD: u16 = 0x2000;

/// A sparse index's entry for a directory outside the sparse cone.
const MODE_SPARSE_DIR: u32 = 0o040_000;

/// What an entry keeps besides its path (28 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct EntryState {
    oid: [u8; HASH_LEN],
    mode: u32,
    /// The stage in the low two bits, then the `BIT_` flags.
    bits: u8,
}

const STAGE_MASK: u8 = 0b11;
const BIT_ASSUME_VALID: u8 = 1 << 2;
const BIT_SKIP_WORKTREE: u8 = 1 << 3;
const BIT_INTENT_TO_ADD: u8 = 1 << 4;

impl EntryState {
    fn stage(self) -> u8 {
        self.bits & STAGE_MASK
    }
}

/// The stat data of an entry that git compares with its file: each field
/// cut to 32 bits, as the index holds it. Git as built by default (without
/// USE_NSEC or USE_STDEV) leaves the nanoseconds and the device out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatData {
    pub ctime_sec: u32,
    pub mtime_sec: u32,
    pub ino: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u32,
}

/// One entry, as [`IndexEntries::entry`] gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'a> {
    pub path: &'a [u8],
    pub oid: [u8; HASH_LEN],
    /// Git's normalized mode: 0o100644, 0o100755, 0o120000 or 0o160000.
    pub mode: u32,
    pub stage: u8,
    pub assume_valid: bool,
    pub skip_worktree: bool,
    pub intent_to_add: bool,
    pub stat: StatData,
}

/// The entries of one git index, as far as `git status` depends on them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IndexEntries {
    /// Every entry's path, one after another: one allocation instead of one
    /// per entry, as this stays in memory for the life of a resident runner.
    paths: Vec<u8>,
    /// Where each entry's path ends in `paths`.
    ends: Vec<u32>,
    /// In the index's order: by path bytes, then stage.
    states: Vec<EntryState>,
    /// Each entry's stat data, in the same order.
    stats: Vec<StatData>,
    /// The index file's modification time, in seconds, when it was read
    /// (None when only its bytes were parsed): an entry whose file changed
    /// in the same second may look unchanged by its stat data ("racily
    /// clean").
    pub written: Option<i64>,
}

#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Truncated, a bad signature or checksum, a bad path: says what.
    #[error("not a git index ({0})")]
    Malformed(&'static str),
    #[error("{0} is not read here")]
    Unsupported(&'static str),
}

impl IndexEntries {
    /// Reads and parses the index file at `path`.
    pub fn read(path: &Path) -> Result<Self, IndexError> {
        use std::os::unix::fs::MetadataExt as _;
        let failed = |source| IndexError::Read {
            path: path.display().to_string(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(failed)?;
        let meta = file.metadata().map_err(failed)?;
        let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
        file.read_to_end(&mut bytes).map_err(failed)?;
        let mut entries = Self::parse(&bytes)?;
        entries.written = Some(meta.mtime());
        Ok(entries)
    }

    /// Parses the bytes of an index file.
    pub fn parse(bytes: &[u8]) -> Result<Self, IndexError> {
        match parse_sha1_index(bytes) {
            // Only on failure: a SHA-256 index fails as a SHA-1 one (its
            // object ids are longer), in whatever way its bytes happen to
            // give; saying why beats calling it corrupt.
            Err(_) if is_sha256_index(bytes) => {
                Err(IndexError::Unsupported("the index of a SHA-256 repository"))
            }
            parsed => parsed,
        }
    }

    /// The number of entries (each stage of a path in conflict counts).
    pub fn len(&self) -> usize {
        self.states.len()
    }

    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// The paths (bytes, relative to the work tree, `/`-separated, as in the
    /// index) whose entries differ between `self` (the older index) and
    /// `newer`: added, removed, or with another object id, mode, stage set,
    /// or status-relevant flag. Sorted, without duplicates.
    pub fn changed_paths(&self, newer: &Self) -> Vec<Vec<u8>> {
        let mut changed: Vec<Vec<u8>> = Vec::new();
        let (mut i, mut j) = (0, 0);
        while i < self.len() || j < newer.len() {
            let order = if i == self.len() {
                Ordering::Greater
            } else if j == newer.len() {
                Ordering::Less
            } else {
                self.key(i).cmp(&newer.key(j))
            };
            match order {
                Ordering::Less => {
                    push_once(&mut changed, self.path(i));
                    i += 1;
                }
                Ordering::Greater => {
                    push_once(&mut changed, newer.path(j));
                    j += 1;
                }
                Ordering::Equal => {
                    if self.states[i] != newer.states[j] {
                        push_once(&mut changed, self.path(i));
                    }
                    i += 1;
                    j += 1;
                }
            }
        }
        changed
    }

    /// The `i`th entry (in path, then stage, order).
    pub fn entry(&self, i: usize) -> Entry<'_> {
        let state = self.states[i];
        Entry {
            path: self.path(i),
            oid: state.oid,
            mode: state.mode,
            stage: state.stage(),
            assume_valid: state.bits & BIT_ASSUME_VALID != 0,
            skip_worktree: state.bits & BIT_SKIP_WORKTREE != 0,
            intent_to_add: state.bits & BIT_INTENT_TO_ADD != 0,
            stat: self.stats[i],
        }
    }

    /// The entries of `path`: one, or one per stage of a path in conflict,
    /// or none.
    pub fn find(&self, path: &[u8]) -> Range<usize> {
        let start = self.first_at_or_after(path);
        let mut end = start;
        while end < self.len() && self.path(end) == path {
            end += 1;
        }
        start..end
    }

    /// The entries directly in the directory `dir` ("" for the top), in
    /// order, skipping over the subdirectories' entries instead of reading
    /// them.
    pub fn children(&self, dir: &[u8]) -> Vec<usize> {
        // "dir/", or "" for the top.
        let prefix = crate::scan::join_rel(dir, b"");
        let mut found = Vec::new();
        let mut i = self.first_at_or_after(&prefix);
        while i < self.len() {
            let path = self.path(i);
            let Some(rest) = path.strip_prefix(&prefix[..]) else {
                break;
            };
            match rest.iter().position(|b| *b == b'/') {
                None => {
                    found.push(i);
                    i += 1;
                }
                Some(slash) => {
                    // Every path in that subdirectory sorts before `sub0`
                    // ('0' follows '/').
                    let mut past = path[..prefix.len() + slash + 1].to_vec();
                    *past.last_mut().expect("holds the slash") = b'/' + 1;
                    i = self.first_at_or_after(&past);
                }
            }
        }
        found
    }

    /// Whether any entry is below the directory `dir`.
    pub fn has_below(&self, dir: &[u8]) -> bool {
        let prefix = crate::scan::join_rel(dir, b"");
        let i = self.first_at_or_after(&prefix);
        i < self.len() && self.path(i).starts_with(&prefix)
    }

    /// The first entry whose path is not before `path`.
    fn first_at_or_after(&self, path: &[u8]) -> usize {
        let (mut low, mut high) = (0, self.len());
        while low < high {
            let mid = low + (high - low) / 2;
            if self.path(mid) < path {
                low = mid + 1;
            } else {
                high = mid;
            }
        }
        low
    }

    fn path(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.paths[start..self.ends[i] as usize]
    }

    fn key(&self, i: usize) -> (&[u8], u8) {
        (self.path(i), self.states[i].stage())
    }

    /// Each entry as (path, mode, object id, stage).
    #[cfg(test)]
    fn entries(&self) -> impl Iterator<Item = (&[u8], u32, [u8; HASH_LEN], u8)> {
        self.states
            .iter()
            .enumerate()
            .map(|(i, s)| (self.path(i), s.mode, s.oid, s.stage()))
    }
}

/// Entries come in (path, stage) order, so a path's repeats are adjacent.
fn push_once(changed: &mut Vec<Vec<u8>>, path: &[u8]) {
    if changed.last().map(Vec::as_slice) != Some(path) {
        changed.push(path.to_vec());
    }
}

fn parse_sha1_index(bytes: &[u8]) -> Result<IndexEntries, IndexError> {
    let mut header = Reader { bytes, pos: 0 };
    if header.take(4, "truncated header")? != b"DIRC" {
        return Err(IndexError::Malformed("no DIRC signature"));
    }
    let version = header.u32("truncated header")?;
    match version {
        2..=4 => {}
        0 | 1 => return Err(IndexError::Unsupported("an index version below 2")),
        5 => return Err(IndexError::Unsupported("index version 5")),
        _ => return Err(IndexError::Unsupported("an index version above 5")),
    }
    let count = header.u32("truncated header")?;
    let body_len = bytes
        .len()
        .checked_sub(HASH_LEN)
        .filter(|&len| len >= HEADER_LEN)
        .ok_or(IndexError::Malformed("truncated before its checksum"))?;
    let body = &bytes[..body_len];
    let mut r = Reader {
        bytes: body,
        pos: HEADER_LEN,
    };

    let count = usize::try_from(count).unwrap_or(usize::MAX);
    let reserve = count.min(body.len() / MIN_ENTRY_LEN);
    let mut entries = IndexEntries {
        paths: Vec::new(),
        ends: Vec::with_capacity(reserve),
        states: Vec::with_capacity(reserve),
        stats: Vec::with_capacity(reserve),
        written: None,
    };
    // Kept to report after the extensions: a split index has entries with
    // empty paths out of order, and is to be refused as a split index.
    let mut flaw = None;
    for _ in 0..count {
        if let Err(found) = read_entry(&mut r, version, &mut entries) {
            match found {
                Flaw::Fatal(e) => return Err(e),
                Flaw::Deferred(what) => {
                    flaw.get_or_insert(what);
                }
            }
        }
    }

    while r.pos < body.len() {
        let signature = r.take(4, "truncated extension")?;
        let size = r.u32("truncated extension")?;
        match signature {
            b"link" => return Err(IndexError::Unsupported("a split index")),
            b"sdir" => return Err(IndexError::Unsupported("a sparse index")),
            // Git's rule: an extension named in uppercase is optional to
            // understand; any other carries what the entries need.
            [b'A'..=b'Z', ..] => {}
            _ => {
                return Err(IndexError::Unsupported(
                    "an index extension git must understand to read the index",
                ));
            }
        }
        r.take(
            usize::try_from(size).unwrap_or(usize::MAX),
            "truncated extension",
        )?;
    }

    // The trailing checksum is not checked: git replaces the file by a
    // rename, so it is never seen half-written, and hashing 10 MB would
    // cost a checkpoint ~25 ms for each commit of a large repository.
    if let Some(what) = flaw {
        return Err(IndexError::Malformed(what));
    }
    entries.paths.shrink_to_fit();
    entries.ends.shrink_to_fit();
    entries.states.shrink_to_fit();
    entries.stats.shrink_to_fit();
    Ok(entries)
}

fn is_sha256_index(bytes: &[u8]) -> bool {
    const SHA256_LEN: usize = 32;
    bytes.starts_with(b"DIRC")
        && bytes
            .len()
            .checked_sub(SHA256_LEN)
            .filter(|&body_len| body_len >= HEADER_LEN)
            .is_some_and(|body_len| {
                let (body, checksum) = bytes.split_at(body_len);
                digest::digest(&digest::SHA256, body).as_ref() == checksum
            })
}

enum Flaw {
    /// Nothing after it can be read.
    Fatal(IndexError),
    /// The entry was read and kept, but is not a valid one.
    Deferred(&'static str),
}

impl From<IndexError> for Flaw {
    fn from(e: IndexError) -> Self {
        Self::Fatal(e)
    }
}

/// Reads one entry at `r` and appends it to `entries`.
fn read_entry(r: &mut Reader<'_>, version: u32, entries: &mut IndexEntries) -> Result<(), Flaw> {
    const TRUNCATED: &str = "truncated entry";
    let start = r.pos;
    // Each time is seconds, then nanoseconds; the device precedes the inode.
    let ctime_sec = r.u32(TRUNCATED)?;
    r.take(4, TRUNCATED)?;
    let mtime_sec = r.u32(TRUNCATED)?;
    r.take(8, TRUNCATED)?;
    let ino = r.u32(TRUNCATED)?;
    let mode = r.u32(TRUNCATED)?;
    let (uid, gid, size) = (r.u32(TRUNCATED)?, r.u32(TRUNCATED)?, r.u32(TRUNCATED)?);
    let oid: [u8; HASH_LEN] = r
        .take(HASH_LEN, TRUNCATED)?
        .try_into()
        .map_err(|_| IndexError::Malformed(TRUNCATED))?;
    let flags = r.u16(TRUNCATED)?;
    if mode == MODE_SPARSE_DIR {
        return Err(IndexError::Unsupported("a sparse index").into());
    }
    // Two bits: the cast keeps all of them.
    let mut bits = ((flags >> 12) & 3) as u8;
    if flags & FLAG_ASSUME_VALID != 0 {
        bits |= BIT_ASSUME_VALID;
    }
    if flags & FLAG_EXTENDED != 0 {
        if version < 3 {
            return Err(IndexError::Malformed("extended flags in a version 2 index").into());
        }
        let extended = r.u16(TRUNCATED)?;
        if extended & !(EXT_SKIP_WORKTREE | EXT_INTENT_TO_ADD) != 0 {
            return Err(IndexError::Unsupported("an entry flag of a newer git").into());
        }
        if extended & EXT_SKIP_WORKTREE != 0 {
            bits |= BIT_SKIP_WORKTREE;
        }
        if extended & EXT_INTENT_TO_ADD != 0 {
            bits |= BIT_INTENT_TO_ADD;
        }
    }

    let previous_start = entries
        .ends
        .len()
        .checked_sub(2)
        .map_or(0, |i| entries.ends[i] as usize);
    let this_start = entries.paths.len();
    if version == 4 {
        let strip = r.varint()?;
        let previous_len = this_start - previous_start;
        let keep = usize::try_from(strip)
            .ok()
            .and_then(|strip| previous_len.checked_sub(strip))
            .ok_or(IndexError::Malformed(
                "a path strips more than the previous path has",
            ))?;
        let suffix = r.until_nul()?;
        entries
            .paths
            .extend_from_within(previous_start..previous_start + keep);
        entries.paths.extend_from_slice(suffix);
    } else {
        let path = r.until_nul()?;
        entries.paths.extend_from_slice(path);
        // The path's end is at most 7 NULs after its own NUL, so that the
        // entry's length is a multiple of 8.
        let padded = (r.pos - 1 - start + 8) & !7;
        r.pos = start;
        r.take(padded, TRUNCATED)?;
    }
    let path_len = entries.paths.len() - this_start;
    // Git writes the length, or 0xFFF for any longer path.
    let name_len = usize::from(flags & NAME_MASK);
    if name_len != path_len.min(usize::from(NAME_MASK)) {
        return Err(IndexError::Malformed("a path's length differs from its entry's").into());
    }
    let end = u32::try_from(entries.paths.len())
        .map_err(|_| IndexError::Unsupported("an index of over 4 GiB of paths"))?;
    entries.ends.push(end);
    entries.states.push(EntryState { oid, mode, bits });
    entries.stats.push(StatData {
        ctime_sec,
        mtime_sec,
        ino,
        uid,
        gid,
        size,
    });

    if path_len == 0 {
        return Err(Flaw::Deferred("an entry without a path"));
    }
    let path = &entries.paths[this_start..];
    let previous = &entries.paths[previous_start..this_start];
    let previous_stage = entries
        .states
        .len()
        .checked_sub(2)
        .map(|i| entries.states[i].stage());
    if let Some(previous_stage) = previous_stage
        && (previous, previous_stage) >= (path, bits & STAGE_MASK)
    {
        return Err(Flaw::Deferred("entries out of order"));
    }
    Ok(())
}

/// Bounds-checked reading: every step past the end is `Malformed`.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], IndexError> {
        let taken = self
            .pos
            .checked_add(n)
            .and_then(|end| self.bytes.get(self.pos..end))
            .ok_or(IndexError::Malformed(what))?;
        self.pos += n;
        Ok(taken)
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, IndexError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, IndexError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// Git's offset varint (`decode_varint`): each continuation adds one,
    /// so that no value has two encodings.
    fn varint(&mut self) -> Result<u64, IndexError> {
        const BAD: &str = "a bad path prefix length";
        let mut c = self.take(1, BAD)?[0];
        let mut value = u64::from(c & 0x7F);
        while c & 0x80 != 0 {
            c = self.take(1, BAD)?[0];
            value = value
                .checked_add(1)
                .filter(|&v| v <= u64::MAX >> 7)
                .ok_or(IndexError::Malformed(BAD))?;
            value = (value << 7) | u64::from(c & 0x7F);
        }
        Ok(value)
    }

    /// The bytes up to the next NUL, which is consumed too.
    fn until_nul(&mut self) -> Result<&'a [u8], IndexError> {
        const BAD: &str = "a path without its terminating NUL";
        let rest = self.bytes.get(self.pos..).unwrap_or_default();
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(IndexError::Malformed(BAD))?;
        let path = &rest[..len];
        self.pos += len + 1;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::{PermissionsExt, symlink};
    use std::path::Path;
    use std::process::Command;
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::git::testing::git;

    type Listed = (Vec<u8>, String, String, u8);

    /// `git ls-files -s -z`: (path, mode, object id, stage) of each entry.
    fn ls_files(dir: &Path) -> Vec<Listed> {
        git(dir, &["ls-files", "-s", "-z"])
            .split('\0')
            .filter(|record| !record.is_empty())
            .map(|record| {
                let (info, path) = record.split_once('\t').unwrap();
                let mut fields = info.split(' ');
                let mode = fields.next().unwrap().to_owned();
                let oid = fields.next().unwrap().to_owned();
                let stage = fields.next().unwrap().parse().unwrap();
                (path.as_bytes().to_vec(), mode, oid, stage)
            })
            .collect()
    }

    fn listed(entries: &IndexEntries) -> Vec<Listed> {
        entries
            .entries()
            .map(|(path, mode, oid, stage)| {
                (
                    path.to_vec(),
                    format!("{mode:06o}"),
                    hex::encode(oid),
                    stage,
                )
            })
            .collect()
    }

    fn index_path(dir: &Path) -> std::path::PathBuf {
        dir.join(".git/index")
    }

    fn read(dir: &Path) -> IndexEntries {
        IndexEntries::read(&index_path(dir)).unwrap()
    }

    fn index_version(dir: &Path) -> u8 {
        fs::read(index_path(dir)).unwrap()[7]
    }

    fn init(dir: &Path) {
        git(dir, &["init", "-q"]);
    }

    fn write(dir: &Path, path: &str, content: &str) {
        let path = dir.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, content).unwrap();
    }

    fn paths(list: &[&str]) -> Vec<Vec<u8>> {
        list.iter().map(|p| p.as_bytes().to_vec()).collect()
    }

    fn assert_matches_git(dir: &Path, version: u8) {
        assert_eq!(index_version(dir), version);
        let entries = read(dir);
        let expected = ls_files(dir);
        assert_eq!(listed(&entries), expected, "index version {version}");
        assert_eq!(entries.len(), expected.len());
    }

    /// A repository of nested directories, odd names, an executable, a
    /// symlink and a submodule, all added.
    fn varied_repo(dir: &Path) {
        init(dir);
        write(dir, "a.txt", "a\n");
        write(dir, "dir/sub/deep.txt", "deep\n");
        write(dir, "dir/sub/deeper/x", "x\n");
        write(dir, "dir/y", "y\n");
        write(dir, "dir-z", "z\n");
        write(dir, "with space.txt", "space\n");
        write(dir, "ünïcødé/名前.txt", "utf-8\n");
        write(dir, "run.sh", "#!/bin/sh\n");
        let run = dir.join("run.sh");
        fs::set_permissions(&run, fs::Permissions::from_mode(0o755)).unwrap();
        symlink("a.txt", dir.join("link")).unwrap();
        git(dir, &["add", "."]);
        git(dir, &["commit", "-qm", "base"]);
        let commit = git(dir, &["rev-parse", "HEAD"]);
        let gitlink = format!("160000,{commit},vendor/sub");
        git(dir, &["update-index", "--add", "--cacheinfo", &gitlink]);
    }

    #[test]
    fn entries_are_those_git_lists_in_index_versions_2_3_and_4() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        varied_repo(dir);
        assert_matches_git(dir, 2);
        let listed = ls_files(dir);
        assert!(
            listed
                .iter()
                .any(|(p, mode, _, _)| p == b"run.sh" && mode == "100755")
        );
        assert!(
            listed
                .iter()
                .any(|(p, mode, _, _)| p == b"link" && mode == "120000")
        );
        assert!(listed.iter().any(|(_, mode, _, _)| mode == "160000"));

        // An intent-to-add entry has extended flags: git writes version 3.
        write(dir, "dir/new.txt", "new\n");
        git(dir, &["add", "-N", "dir/new.txt"]);
        assert_matches_git(dir, 3);

        git(dir, &["update-index", "--index-version", "4"]);
        assert_matches_git(dir, 4);
        git(dir, &["rm", "-q", "--cached", "dir/sub/deep.txt"]);
        assert_matches_git(dir, 4);
    }

    #[test]
    fn an_index_git_wrote_without_a_checksum_is_read() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        init(dir);
        git(dir, &["config", "index.skipHash", "true"]);
        write(dir, "a", "a\n");
        write(dir, "b/c", "c\n");
        git(dir, &["add", "."]);
        let bytes = fs::read(index_path(dir)).unwrap();
        assert!(bytes.ends_with(&[0; HASH_LEN]));
        assert_matches_git(dir, 2);
    }

    #[test]
    fn a_path_longer_than_the_name_length_field_is_read_in_versions_2_and_4() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        init(dir);
        write(dir, "a.txt", "a\n");
        git(dir, &["add", "a.txt"]);
        let oid = git(dir, &["hash-object", "-w", "a.txt"]);
        // Too long for the file system: git takes it without a file.
        let component = "c".repeat(240);
        let long_dir = (0..18)
            .map(|i| format!("{i:02}{component}"))
            .collect::<Vec<_>>()
            .join("/");
        assert!(long_dir.len() > 0xFFF);
        for name in ["long-a", "long-b", "x"] {
            let info = format!("100644,{oid},{long_dir}/{name}");
            git(dir, &["update-index", "--add", "--cacheinfo", &info]);
        }
        let info = format!("100644,{oid},zz");
        git(dir, &["update-index", "--add", "--cacheinfo", &info]);
        assert_matches_git(dir, 2);
        assert_eq!(read(dir).len(), 5);
        git(dir, &["update-index", "--index-version", "4"]);
        assert_matches_git(dir, 4);
    }

    #[test]
    fn changed_paths_names_exactly_the_added_removed_restaged_and_reflagged_paths() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        init(dir);
        for path in ["a", "b", "c", "d/e", "d/f", "g"] {
            write(dir, path, path);
        }
        git(dir, &["add", "."]);
        git(dir, &["commit", "-qm", "base"]);
        let old = read(dir);
        assert!(old.changed_paths(&old).is_empty());

        write(dir, "a", "changed");
        git(dir, &["add", "a"]);
        git(dir, &["rm", "-q", "--cached", "b"]);
        write(dir, "n", "new");
        git(dir, &["add", "n"]);
        write(dir, "d/m", "intent");
        git(dir, &["add", "-N", "d/m"]);
        git(dir, &["update-index", "--assume-unchanged", "c"]);
        git(dir, &["update-index", "--skip-worktree", "d/e"]);
        let new = read(dir);
        let changed = paths(&["a", "b", "c", "d/e", "d/m", "n"]);
        assert_eq!(old.changed_paths(&new), changed);
        assert_eq!(new.changed_paths(&old), changed);
        assert_eq!(
            IndexEntries::default().changed_paths(&new),
            paths(&["a", "c", "d/e", "d/f", "d/m", "g", "n"])
        );
    }

    #[test]
    fn stat_only_rewrites_of_the_index_change_no_paths() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        init(dir);
        for path in ["a", "b", "d/e"] {
            write(dir, path, path);
        }
        git(dir, &["add", "."]);
        git(dir, &["commit", "-qm", "base"]);
        let old_bytes = fs::read(index_path(dir)).unwrap();
        let old = read(dir);

        let long_ago = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        for path in ["a", "b", "d/e"] {
            let file = fs::File::options()
                .write(true)
                .open(dir.join(path))
                .unwrap();
            file.set_modified(long_ago).unwrap();
        }
        git(dir, &["update-index", "--really-refresh"]);
        let refreshed_bytes = fs::read(index_path(dir)).unwrap();
        assert_ne!(
            refreshed_bytes, old_bytes,
            "the refresh rewrote no stat data"
        );
        let refreshed = read(dir);
        assert!(old.changed_paths(&refreshed).is_empty());

        write(dir, "a", "a");
        write(dir, "d/e", "d/e");
        git(dir, &["add", "-u"]);
        assert_ne!(fs::read(index_path(dir)).unwrap(), refreshed_bytes);
        assert!(old.changed_paths(&read(dir)).is_empty());
        // The same entries, with the stat data of the files as they are now.
        let now = read(dir);
        assert!(old.entries().eq(now.entries()));
        assert_ne!(old.entry(1).stat, now.entry(1).stat);
    }

    #[test]
    fn a_merge_conflict_changes_the_conflicted_path_only() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        init(dir);
        write(dir, "f", "base\n");
        write(dir, "g", "same\n");
        git(dir, &["add", "."]);
        git(dir, &["commit", "-qm", "base"]);
        git(dir, &["checkout", "-qb", "other"]);
        write(dir, "f", "other\n");
        git(dir, &["commit", "-qam", "other"]);
        git(dir, &["checkout", "-q", "main"]);
        write(dir, "f", "main\n");
        git(dir, &["commit", "-qam", "main"]);
        let before = read(dir);

        // The helper panics on failure, and a conflicted merge fails.
        let merge = Command::new("git")
            .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
            .args(["merge", "-q", "other"])
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(!merge.status.success(), "the merge did not conflict");
        let after = read(dir);
        let stages: Vec<(&[u8], u8)> = after.entries().map(|(p, _, _, s)| (p, s)).collect();
        let expected: Vec<(&[u8], u8)> = vec![(b"f", 1), (b"f", 2), (b"f", 3), (b"g", 0)];
        assert_eq!(stages, expected);
        assert_eq!(listed(&after), ls_files(dir));
        assert_eq!(before.changed_paths(&after), paths(&["f"]));
        assert_eq!(after.changed_paths(&before), paths(&["f"]));
    }

    fn must_fail(bytes: &[u8], what: &str) {
        assert!(
            IndexEntries::parse(bytes).is_err(),
            "{what} ({} bytes) was read",
            bytes.len()
        );
    }

    #[test]
    fn truncated_or_corrupt_indexes_never_panic_and_truncations_lose_no_entries() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        varied_repo(dir);
        git(dir, &["commit", "-qm", "sub"]);
        // A TREE extension and an untracked cache (UNTR), so that
        // truncations fall on extension boundaries too.
        write(dir, "untracked", "u\n");
        git(dir, &["update-index", "--untracked-cache"]);
        git(dir, &["status", "--porcelain"]);
        for version in ["2", "4"] {
            git(dir, &["update-index", "--index-version", version]);
            let bytes = fs::read(index_path(dir)).unwrap();
            let whole = IndexEntries::parse(&bytes).unwrap();
            for len in 0..bytes.len() {
                // Cut in its extensions it may still parse, to every entry
                // (they come first); never to fewer.
                if let Ok(entries) = IndexEntries::parse(&bytes[..len]) {
                    assert_eq!(entries, whole, "cut at {len} of {}", bytes.len());
                }
            }
            for at in 0..bytes.len() {
                let mut corrupt = bytes.clone();
                corrupt[at] ^= 0x41;
                let _ = IndexEntries::parse(&corrupt);
            }
        }
    }

    #[test]
    fn garbage_is_an_error() {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut noise = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()[0]
        };
        for len in [0, 1, 4, 12, 31, 32, 64, 100, 1000, 5000] {
            let random: Vec<u8> = (0..len).map(|_| noise()).collect();
            must_fail(&random, "noise");
            let mut headed = b"DIRC\0\0\0\x02".to_vec();
            headed.extend(&random);
            must_fail(&headed, "noise after a header");
            let mut v4 = b"DIRC\0\0\0\x04".to_vec();
            v4.extend(&random);
            must_fail(&v4, "noise after a version 4 header");
        }
        let mut huge_count = b"DIRC\0\0\0\x02\xff\xff\xff\xff".to_vec();
        huge_count.extend([0; 100]);
        must_fail(&huge_count, "an entry count past the end");
        for (version, refused) in [(1, "an index version below 2"), (5, "index version 5")] {
            let mut bytes = b"DIRC\0\0\0".to_vec();
            bytes.push(version);
            bytes.extend([0; 24]);
            assert!(matches!(
                IndexEntries::parse(&bytes),
                Err(IndexError::Unsupported(what)) if what == refused
            ));
        }
        let missing = IndexEntries::read(Path::new("/nonexistent/.git/index"));
        assert!(matches!(missing, Err(IndexError::Read { .. })));
    }

    #[test]
    fn split_sparse_and_sha256_indexes_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let split = tmp.path().join("split");
        fs::create_dir(&split).unwrap();
        varied_repo(&split);
        git(&split, &["update-index", "--split-index"]);
        write(&split, "a.txt", "changed\n");
        git(&split, &["add", "a.txt"]);
        assert!(matches!(
            IndexEntries::read(&index_path(&split)),
            Err(IndexError::Unsupported("a split index"))
        ));

        let sparse = tmp.path().join("sparse");
        fs::create_dir(&sparse).unwrap();
        init(&sparse);
        write(&sparse, "in/a", "a\n");
        write(&sparse, "out/b", "b\n");
        git(&sparse, &["add", "."]);
        git(&sparse, &["commit", "-qm", "base"]);
        git(
            &sparse,
            &["sparse-checkout", "set", "--cone", "--sparse-index", "in"],
        );
        assert!(matches!(
            IndexEntries::read(&index_path(&sparse)),
            Err(IndexError::Unsupported("a sparse index"))
        ));

        let sha256 = tmp.path().join("sha256");
        fs::create_dir(&sha256).unwrap();
        git(&sha256, &["init", "-q", "--object-format=sha256"]);
        write(&sha256, "a", "a\n");
        write(&sha256, "b", "b\n");
        git(&sha256, &["add", "a"]);
        git(&sha256, &["add", "-N", "b"]);
        for version in ["3", "4"] {
            git(&sha256, &["update-index", "--index-version", version]);
            assert!(matches!(
                IndexEntries::read(&index_path(&sha256)),
                Err(IndexError::Unsupported("the index of a SHA-256 repository"))
            ));
        }
    }
}
