//! Git loose blobs stored by their content, so they cost nothing twice.
//!
//! `git add` writes every staged file again as a loose object:
//! `.git/objects/ab/cdef…`, the zlib stream of `blob <len>\0<content>`.
//! Compressed, it shares no bytes with the working-tree file it copies, so a
//! commit turn would upload every staged file twice. Instead, a loose blob
//! that this runner can re-create byte for byte (same zlib, same level) is
//! stored as its *content*, cut into chunks exactly like a workspace file
//! ([`crate::chunker::Granularity::Standard`]): those are the chunks the
//! working-tree file already produced, so they dedupe. Restore deflates the
//! content again at the recorded level and writes the identical file.
//!
//! Anything else — trees, commits, a blob git compressed another way, a
//! stream this runner's zlib does not reproduce — is stored as the plain
//! file it is. The check is made on the bytes at checkpoint time, so
//! fidelity never rests on an assumption about git's settings.

use std::io::{self, Read, Write};

use flate2::Compression;
use flate2::read::ZlibDecoder;
use flate2::write::ZlibEncoder;

/// Loose objects bigger than this (compressed) are stored as plain files:
/// git streams big blobs, and holding them inflated would cost memory.
pub const MAX_STORED: u64 = 4 << 20;
/// The most a blob's content may inflate to before it is left alone.
pub const MAX_CONTENT: u64 = 32 << 20;
/// zlib levels to try, most likely first: git's default for loose objects
/// (`core.looseCompression`, default 1), zlib's default (what
/// `core.compression=-1` means), then the ends of the range.
const LEVELS: [u8; 4] = [1, 6, 9, 0];

/// Whether `rel` (path bytes relative to the root) names a loose object:
/// `…/objects/<2 hex>/<38 hex>` (SHA-1) or `<62 hex>` (SHA-256).
pub fn is_loose_object_path(rel: &[u8]) -> bool {
    let mut parts = rel.rsplit(|b| *b == b'/');
    let (Some(name), Some(fanout), Some(objects)) = (parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let hex = |s: &[u8]| s.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    objects == b"objects"
        && fanout.len() == 2
        && hex(fanout)
        && matches!(name.len(), 38 | 62)
        && hex(name)
}

/// Whether a file of `size` bytes at `rel` may be a loose blob worth opening.
pub fn is_candidate(rel: &[u8], size: u64) -> bool {
    size > 0 && size <= MAX_STORED && is_loose_object_path(rel)
}

/// The content of the loose blob `stored` and the zlib level that
/// re-creates `stored` from it exactly; None when `stored` is not such a
/// blob.
pub fn unpack(stored: &[u8]) -> Option<(u8, Vec<u8>)> {
    let mut inflater = ZlibDecoder::new(stored).take(MAX_CONTENT + 64);
    let mut inflated = Vec::with_capacity(stored.len() * 3);
    // Trees and commits (most loose objects) are told apart by their
    // header, before anything else is inflated.
    (&mut inflater).take(5).read_to_end(&mut inflated).ok()?;
    if inflated != b"blob " {
        return None;
    }
    inflater.read_to_end(&mut inflated).ok()?;
    let nul = inflated.iter().position(|b| *b == 0)?;
    let declared: usize = std::str::from_utf8(inflated[..nul].strip_prefix(b"blob ")?)
        .ok()?
        .parse()
        .ok()?;
    let content = inflated.split_off(nul + 1);
    if declared != content.len() {
        return None;
    }
    let level = LEVELS
        .into_iter()
        .find(|&level| pack(level, &content).is_ok_and(|again| again == stored))?;
    Some((level, content))
}

/// The loose object file of a blob with `content`, deflated at `level`.
pub fn pack(level: u8, content: &[u8]) -> io::Result<Vec<u8>> {
    let header = format!("blob {}\0", content.len());
    let mut encoder = ZlibEncoder::new(
        Vec::with_capacity(content.len() / 2 + 64),
        Compression::new(u32::from(level.min(9))),
    );
    encoder.write_all(header.as_bytes())?;
    encoder.write_all(content)?;
    encoder.finish()
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::process::Command;

    use super::*;

    #[test]
    fn loose_object_paths_are_recognised() {
        // The 38 hex digits after the two of the fan-out directory.
        let sha1 = "18e512dba79e4c8300dd08aeb37f8e728b8dad";
        assert!(is_loose_object_path(
            format!("app/.git/objects/ab/{sha1}").as_bytes()
        ));
        assert!(is_loose_object_path(
            format!("mirror.git/objects/00/{sha1}").as_bytes()
        ));
        assert!(!is_loose_object_path(b"app/.git/objects/pack/pack-1.pack"));
        assert!(!is_loose_object_path(
            format!("app/.git/objects/AB/{sha1}").as_bytes()
        ));
        assert!(!is_loose_object_path(
            format!("app/.git/other/ab/{sha1}").as_bytes()
        ));
        assert!(!is_loose_object_path(b"objects/ab/short"));
        assert!(!is_candidate(
            format!("objects/ab/{sha1}").as_bytes(),
            MAX_STORED + 1
        ));
    }

    fn git(dir: &Path, args: &[&str]) -> String {
        let out = Command::new("git")
            .args(args)
            .current_dir(dir)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("HOME", dir)
            .output()
            .expect("git runs");
        assert!(out.status.success(), "git {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// The saving rests on re-creating git's own bytes: if this fails, the
    /// runner's zlib no longer matches git's and every commit turn uploads
    /// staged files twice.
    #[test]
    fn blobs_git_wrote_are_recreated_byte_for_byte() {
        let tmp = tempfile::tempdir().unwrap();
        let repo = tmp.path();
        git(repo, &["init", "-q"]);
        let text: String = (0..4000)
            .map(|i| format!("line {i} of the file\n"))
            .collect();
        std::fs::write(repo.join("a.txt"), &text).unwrap();
        std::fs::write(repo.join("empty"), "").unwrap();
        git(repo, &["add", "a.txt", "empty"]);
        for (name, content) in [("a.txt", text.as_bytes()), ("empty", &b""[..])] {
            let id = git(repo, &["rev-parse", &format!(":{name}")]);
            let id = id.trim();
            let stored =
                std::fs::read(repo.join(".git/objects").join(&id[..2]).join(&id[2..])).unwrap();
            let (level, unpacked) = unpack(&stored).expect("git's loose blob is recognised");
            assert_eq!(level, 1, "git's default loose compression");
            assert_eq!(unpacked, content);
            assert_eq!(pack(level, &unpacked).unwrap(), stored);
        }
    }

    #[test]
    fn other_levels_are_found_and_other_objects_left_alone() {
        let content = b"some content\n".repeat(100);
        for level in [6, 9, 0] {
            let stored = pack(level, &content).unwrap();
            assert_eq!(unpack(&stored), Some((level, content.clone())));
        }
        let mut tree = ZlibEncoder::new(Vec::new(), Compression::new(1));
        tree.write_all(b"tree 0\0").unwrap();
        assert_eq!(unpack(&tree.finish().unwrap()), None, "not a blob");
        let mut lying = ZlibEncoder::new(Vec::new(), Compression::new(1));
        lying.write_all(b"blob 99\0short").unwrap();
        assert_eq!(unpack(&lying.finish().unwrap()), None, "wrong length");
        assert_eq!(unpack(b"not zlib at all"), None);
        // A stream this zlib would not write (here: a preset flush) is kept raw.
        let mut odd = ZlibEncoder::new(Vec::new(), Compression::new(1));
        odd.write_all(b"blob 3\0").unwrap();
        odd.flush().unwrap();
        odd.write_all(b"abc").unwrap();
        assert_eq!(unpack(&odd.finish().unwrap()), None);
    }
}
