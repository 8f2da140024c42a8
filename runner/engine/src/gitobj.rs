//! Git loose objects stored by what they hold, so they cost nothing twice.
//!
//! `git add` writes every staged file again as a loose object:
//! `.git/objects/ab/cdef…`, the zlib stream of `blob <len>\0<content>`.
//! Compressed, it shares no bytes with the working-tree file it copies, so a
//! commit turn would upload every staged file twice. Instead, a loose blob
//! that this runner can re-create byte for byte (same zlib, same level) is
//! stored as its *content* (format v3), cut into chunks exactly like a
//! workspace file ([`crate::chunker::Granularity::Standard`]): those are the
//! chunks the working-tree file already produced, so they dedupe. Restore
//! deflates the content again at the recorded level and writes the
//! identical file.
//!
//! A commit also writes one loose tree per directory on each changed path,
//! kilobytes of object ids of which only an entry or two differ from the
//! same directory's tree one commit earlier. Such a tree is stored as a
//! [`tree_delta`] against a tree that a pack of the same repository holds,
//! so the base is in the same checkpoint (format v4; the base is chosen in
//! `checkpoint::treebases`). Restore rebuilds the tree from the restored
//! base, checks that it hashes to the id its file's name says, and deflates
//! it again.
//!
//! Either is stored so only when this runner's zlib re-creates the stored
//! bytes exactly and, for a tree, the delta gives the tree back. Anything
//! else — commits, a tree without a base, a blob git compressed another
//! way, a stream this runner's zlib does not reproduce — is stored as the
//! plain file it is. The check is made on the bytes at checkpoint time, so
//! fidelity never rests on an assumption about git's settings.
//!
//! The git trees of the last commits are read once per checkpoint
//! ([`TreeCache`], raw and in git's order) for the tree bases, the status's
//! diff of HEAD and its lookups in HEAD. The tree bases are found on their
//! own thread while every file outside the loose-object directories is
//! read; only the loose objects wait for them.

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

/// Whether `rel` is a directory of loose objects (`…/objects/<2 hex>`).
pub fn is_loose_object_dir(rel: &[u8]) -> bool {
    let mut parts = rel.rsplit(|b| *b == b'/');
    let (Some(fanout), Some(objects)) = (parts.next(), parts.next()) else {
        return false;
    };
    objects == b"objects"
        && fanout.len() == 2
        && fanout
            .iter()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether `rel` names a git pack (`…/objects/pack/pack-<hex>.pack`).
///
/// Git never rewrites a pack in place (a new pack is written under a
/// temporary name and renamed), and every pack ends with a checksum of all
/// the bytes before it. Git does move a pack's mtime, though, whenever it
/// "freshens" an object it would otherwise write again (a commit whose
/// unchanged trees are already packed does), so a 70 MiB pack looks
/// changed after every commit. A pack whose inode and size are unchanged
/// and whose last bytes (the checksum) are too holds the same content.
pub fn is_pack_path(rel: &[u8]) -> bool {
    let mut parts = rel.rsplit(|b| *b == b'/');
    let (Some(name), Some(pack), Some(objects)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    objects == b"objects"
        && pack == b"pack"
        && name.starts_with(b"pack-")
        && name.ends_with(b".pack")
}

/// The trailing checksum of a pack is at most this long (SHA-256).
pub const PACK_CHECKSUM_LEN: u64 = 32;

/// Whether a file of `size` bytes at `rel` may be a loose blob worth opening.
pub fn is_candidate(rel: &[u8], size: u64) -> bool {
    size > 0 && size <= MAX_STORED && is_loose_object_path(rel)
}

/// How a loose object is stored by what it holds rather than as its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GitStored {
    /// The chunks are the blob's content (format v3); the file is
    /// zlib(level, `blob <len>\0` ‖ content).
    Blob { level: u8 },
    /// The chunks are a [`tree_delta`] against the tree `base`, an object
    /// the repository's packs hold (format v4); the file is zlib(level,
    /// `tree <len>\0` ‖ the tree the delta gives).
    TreeDelta { level: u8, base: [u8; 20] },
}

impl GitStored {
    pub fn level(&self) -> u8 {
        match self {
            Self::Blob { level } | Self::TreeDelta { level, .. } => *level,
        }
    }
}

/// The content of the loose blob `stored` and the zlib level that
/// re-creates `stored` from it exactly; None when `stored` is not such a
/// blob.
pub fn unpack(stored: &[u8]) -> Option<(u8, Vec<u8>)> {
    unpack_object("blob", stored)
}

/// [`unpack`] for a loose tree.
pub fn unpack_tree(stored: &[u8]) -> Option<(u8, Vec<u8>)> {
    unpack_object("tree", stored)
}

fn unpack_object(kind: &str, stored: &[u8]) -> Option<(u8, Vec<u8>)> {
    let mut inflater = ZlibDecoder::new(stored).take(MAX_CONTENT + 64);
    let mut inflated = Vec::with_capacity(stored.len() * 3);
    // Objects of other kinds are told apart by their header, before
    // anything else is inflated.
    (&mut inflater).take(5).read_to_end(&mut inflated).ok()?;
    if inflated.strip_suffix(b" ") != Some(kind.as_bytes()) {
        return None;
    }
    inflater.read_to_end(&mut inflated).ok()?;
    let nul = inflated.iter().position(|b| *b == 0)?;
    let declared: usize = std::str::from_utf8(&inflated[5..nul]).ok()?.parse().ok()?;
    let content = inflated.split_off(nul + 1);
    if declared != content.len() {
        return None;
    }
    let level = LEVELS
        .into_iter()
        .find(|&level| pack_object(kind, level, &content).is_ok_and(|again| again == stored))?;
    Some((level, content))
}

/// The loose object file of a blob with `content`, deflated at `level`.
pub fn pack(level: u8, content: &[u8]) -> io::Result<Vec<u8>> {
    pack_object("blob", level, content)
}

thread_local! {
    /// One zlib encoder per level, reset between objects: setting one up
    /// allocates and clears a few hundred KiB, which costs more than
    /// deflating a typical tree or small blob.
    static ENCODERS: std::cell::RefCell<[Option<ZlibEncoder<Vec<u8>>>; 10]> =
        const { std::cell::RefCell::new([const { None }; 10]) };
}

/// The loose object file of a `kind` object with `content`: the bytes of a
/// fresh [`ZlibEncoder`] at `level`, which [`unpack`] compares against.
pub fn pack_object(kind: &str, level: u8, content: &[u8]) -> io::Result<Vec<u8>> {
    let header = format!("{kind} {}\0", content.len());
    let level = level.min(9);
    ENCODERS.with_borrow_mut(|encoders| {
        let encoder = encoders[usize::from(level)].get_or_insert_with(|| {
            ZlibEncoder::new(Vec::new(), Compression::new(u32::from(level)))
        });
        let written = encoder
            .write_all(header.as_bytes())
            .and_then(|()| encoder.write_all(content));
        // Finishes the stream and leaves the encoder fresh, also after a
        // failed write.
        let out = encoder.reset(Vec::new());
        written?;
        out
    })
}

/// The SHA-1 object id of a tree with `content`.
pub fn tree_id(content: &[u8]) -> Option<[u8; 20]> {
    let id = git2::Oid::hash_object(git2::ObjectType::Tree, content).ok()?;
    id.as_bytes().try_into().ok()
}

/// The object id a SHA-1 loose object path names (`…/ab/cdef…`).
pub fn loose_object_id(rel: &[u8]) -> Option<[u8; 20]> {
    if !is_loose_object_path(rel) {
        return None;
    }
    let mut parts = rel.rsplit(|b| *b == b'/');
    let (name, fanout) = (parts.next()?, parts.next()?);
    let hex: Vec<u8> = fanout.iter().chain(name).copied().collect();
    let mut id = [0u8; 20];
    hex::decode_to_slice(&hex, &mut id).ok()?;
    Some(id)
}

/// One entry of a SHA-1 tree, borrowed from the tree's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeEntry<'a> {
    /// The octal mode as git wrote it (`40000` for a subtree).
    pub mode: &'a [u8],
    pub name: &'a [u8],
    pub id: &'a [u8; 20],
    /// The whole `<mode> <name>\0<id>` record.
    pub raw: &'a [u8],
}

impl TreeEntry<'_> {
    /// The mode as written.
    fn raw_mode(&self) -> u32 {
        let digit = |mode: u32, digit: &u8| (mode << 3) | u32::from(digit.wrapping_sub(b'0') & 7);
        self.mode.iter().fold(0, digit)
    }

    pub fn is_tree(&self) -> bool {
        self.raw_mode() & 0o170000 == 0o040000
    }

    /// The mode as git and libgit2 read it, whatever an old tree wrote.
    pub fn canonical_mode(&self) -> u32 {
        let mode = self.raw_mode();
        match mode & 0o170000 {
            0o040000 => 0o040000,
            _ if mode & 0o100 != 0 => 0o100755,
            0o160000 => 0o160000,
            0o120000 => 0o120000,
            _ => 0o100644,
        }
    }

    /// Git's order of tree entries: by name, a subtree's name as if it
    /// ended in `/`.
    pub fn git_order(&self, other: &Self) -> std::cmp::Ordering {
        let common = self.name.len().min(other.name.len());
        match self.name[..common].cmp(&other.name[..common]) {
            std::cmp::Ordering::Equal => {}
            unequal => return unequal,
        }
        let next = |entry: &Self| match entry.name.get(common) {
            Some(byte) => *byte,
            None if entry.is_tree() => b'/',
            None => 0,
        };
        next(self).cmp(&next(other))
    }
}

/// The entries of a SHA-1 tree (`<mode> <name>\0<20-byte id>` each), in
/// its order; None when it is malformed.
pub fn tree_entries(tree: &[u8]) -> Option<Vec<TreeEntry<'_>>> {
    let mut entries = Vec::new();
    let mut rest = tree;
    while !rest.is_empty() {
        let nul = rest.iter().position(|b| *b == 0)?;
        let end = nul + 1 + 20;
        if end > rest.len() {
            return None;
        }
        let (raw, after) = rest.split_at(end);
        let space = raw[..nul].iter().position(|b| *b == b' ')?;
        entries.push(TreeEntry {
            mode: &raw[..space],
            name: &raw[space + 1..nul],
            id: raw[nul + 1..].try_into().expect("20 bytes"),
            raw,
        });
        rest = after;
    }
    Some(entries)
}

/// The entries of `tree`, or an error for libgit2's callers.
pub fn parse_tree(tree: &[u8]) -> Result<Vec<TreeEntry<'_>>, git2::Error> {
    tree_entries(tree).ok_or_else(|| git2::Error::from_str("a git tree cannot be parsed"))
}

/// The git trees read during one checkpoint, by id, for whoever reads them
/// next. The tree bases, the status's diff of the last commits and its
/// lookups in HEAD walk the same few trees on the changed paths, each
/// thousands of entries that libgit2 would inflate every time. Ids name
/// contents, so one cache serves every repository of the workspace.
#[derive(Debug, Default)]
pub struct TreeCache {
    trees: std::sync::Mutex<std::collections::HashMap<git2::Oid, std::sync::Arc<[u8]>>>,
}

impl TreeCache {
    /// The content of tree `id`, read from `odb` unless already read.
    pub fn read(
        &self,
        odb: &git2::Odb<'_>,
        id: git2::Oid,
    ) -> Result<std::sync::Arc<[u8]>, git2::Error> {
        if let Some(tree) = self.trees.lock().expect("tree cache lock").get(&id) {
            return Ok(tree.clone());
        }
        // Read without the lock: the other readers go on meanwhile.
        let object = odb.read(id)?;
        if object.kind() != git2::ObjectType::Tree {
            return Err(git2::Error::from_str(&format!("{id} is not a tree")));
        }
        let tree: std::sync::Arc<[u8]> = object.data().into();
        let mut trees = self.trees.lock().expect("tree cache lock");
        Ok(trees.entry(id).or_insert(tree).clone())
    }

    /// The id and mode of what is at `path` (`/`-separated) in tree `root`
    /// when it is not a tree itself; None when nothing is.
    pub fn entry_at(
        &self,
        odb: &git2::Odb<'_>,
        root: git2::Oid,
        path: &[u8],
    ) -> Result<Option<(git2::Oid, u32)>, git2::Error> {
        let mut tree = root;
        let mut names = path.split(|b| *b == b'/').peekable();
        while let Some(name) = names.next() {
            let content = self.read(odb, tree)?;
            let entries = parse_tree(&content)?;
            let Some(entry) = entries.iter().find(|e| e.name == name) else {
                return Ok(None);
            };
            let id = git2::Oid::from_bytes(entry.id)?;
            match (entry.is_tree(), names.peek()) {
                (true, Some(_)) => tree = id,
                (true, None) | (false, Some(_)) => return Ok(None),
                (false, None) => return Ok(Some((id, entry.canonical_mode()))),
            }
        }
        Ok(None)
    }
}

const COPY: u8 = 0;
const INSERT: u8 = 1;

/// `tree` as edits of `base`, both SHA-1 tree contents: entries `base`
/// has are copied from it, the others inserted. A commit changes a few
/// entries of each tree on its paths, so this is tens of bytes where the
/// tree is kilobytes of incompressible ids.
///
/// ```text
/// delta = op*
/// op    = 0 │ offset varint │ length varint     copy from the base
///       │ 1 │ length varint │ bytes             insert
/// ```
pub fn tree_delta(base: &[u8], tree: &[u8]) -> Option<Vec<u8>> {
    use crate::format::varint_pub::put_u64;
    let mut at = std::collections::HashMap::new();
    let mut offset = 0;
    for entry in tree_entries(base)? {
        at.entry(entry.raw).or_insert(offset);
        offset += entry.raw.len();
    }
    enum Op<'a> {
        Copy(usize, usize),
        Insert(Vec<&'a [u8]>),
    }
    let mut ops: Vec<Op<'_>> = Vec::new();
    for entry in tree_entries(tree)? {
        let entry = entry.raw;
        match (at.get(entry), ops.last_mut()) {
            (Some(&from), Some(Op::Copy(start, len))) if *start + *len == from => {
                *len += entry.len();
            }
            (Some(&from), _) => ops.push(Op::Copy(from, entry.len())),
            (None, Some(Op::Insert(entries))) => entries.push(entry),
            (None, _) => ops.push(Op::Insert(vec![entry])),
        }
    }
    let mut delta = Vec::new();
    for op in ops {
        match op {
            Op::Copy(from, len) => {
                delta.push(COPY);
                put_u64(&mut delta, from as u64);
                put_u64(&mut delta, len as u64);
            }
            Op::Insert(entries) => {
                delta.push(INSERT);
                put_u64(&mut delta, entries.iter().map(|e| e.len() as u64).sum());
                for entry in entries {
                    delta.extend_from_slice(entry);
                }
            }
        }
    }
    Some(delta)
}

/// Why a tree delta could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum DeltaError {
    #[error("the tree delta is malformed: {0}")]
    Malformed(String),
    #[error("the tree delta copies beyond its base ({base_len} bytes)")]
    OutOfBase { base_len: usize },
    #[error("the tree delta gives more than {0} bytes")]
    TooLarge(usize),
}

/// The tree [`tree_delta`] made `delta` from, given its `base`; at most
/// `max_len` bytes.
pub fn apply_delta(base: &[u8], delta: &[u8], max_len: usize) -> Result<Vec<u8>, DeltaError> {
    use crate::format::varint_pub::Reader;
    let malformed = |e: crate::format::FormatError| DeltaError::Malformed(e.to_string());
    let mut reader = Reader::new(delta);
    let mut tree = Vec::new();
    while !reader.is_empty() {
        let op = reader.u8().map_err(malformed)?;
        let grows_to = |len: u64| {
            usize::try_from(len)
                .ok()
                .and_then(|len| tree.len().checked_add(len))
                .filter(|total| *total <= max_len)
                .ok_or(DeltaError::TooLarge(max_len))
        };
        match op {
            COPY => {
                let from = reader.u64().map_err(malformed)?;
                let len = reader.u64().map_err(malformed)?;
                grows_to(len)?;
                let range = usize::try_from(from)
                    .ok()
                    .and_then(|from| Some(from..from.checked_add(len as usize)?))
                    .filter(|r| r.end <= base.len())
                    .ok_or(DeltaError::OutOfBase {
                        base_len: base.len(),
                    })?;
                tree.extend_from_slice(&base[range]);
            }
            INSERT => {
                let len = reader.u64().map_err(malformed)?;
                grows_to(len)?;
                tree.extend_from_slice(reader.take(len as usize).map_err(malformed)?);
            }
            other => return Err(DeltaError::Malformed(format!("unknown operation {other}"))),
        }
    }
    Ok(tree)
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
        assert!(is_pack_path(b"app/.git/objects/pack/pack-1a2b.pack"));
        assert!(!is_pack_path(b"app/.git/objects/pack/pack-1a2b.idx"));
        assert!(!is_pack_path(b"app/.git/objects/pack/other.pack"));
        assert!(!is_pack_path(b"app/pack/pack-1a2b.pack"));
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
    fn a_reused_encoder_writes_the_bytes_of_a_fresh_one() {
        let text: Vec<u8> = (0..200_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        for level in [0u8, 1, 6, 9] {
            for content in [&b""[..], b"x", &text[..1000], &text[..]] {
                let mut fresh = ZlibEncoder::new(Vec::new(), Compression::new(u32::from(level)));
                fresh
                    .write_all(format!("tree {}\0", content.len()).as_bytes())
                    .unwrap();
                fresh.write_all(content).unwrap();
                let fresh = fresh.finish().unwrap();
                // Twice: the second goes through the encoder the first left.
                for _ in 0..2 {
                    let packed = pack_object("tree", level, content).unwrap();
                    assert!(packed == fresh, "level {level}, {} bytes", content.len());
                }
            }
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

    /// A real repository's tree before and after a commit that changed one
    /// file of a large directory: the delta is tens of bytes, rebuilds the
    /// new tree exactly, and git's loose tree file is re-created from it.
    #[test]
    fn a_tree_delta_rebuilds_the_next_tree_from_a_few_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let repo = tmp.path();
        git(repo, &["init", "-q"]);
        git(repo, &["config", "user.email", "t@example.com"]);
        git(repo, &["config", "user.name", "t"]);
        for i in 0..300 {
            std::fs::write(
                repo.join(format!("f{i:03}.rs")),
                format!("fn f{i}() {{}}\n"),
            )
            .unwrap();
        }
        git(repo, &["add", "."]);
        git(repo, &["commit", "-qm", "one"]);
        git(repo, &["gc", "-q"]);
        let old_id = git(repo, &["rev-parse", "HEAD^{tree}"]).trim().to_owned();
        std::fs::write(repo.join("f150.rs"), "fn changed() {}\n").unwrap();
        std::fs::write(repo.join("f299.rs"), "fn changed_too() {}\n").unwrap();
        git(repo, &["commit", "-qam", "two"]);
        let new_id = git(repo, &["rev-parse", "HEAD^{tree}"]).trim().to_owned();
        let raw = |id: &str| {
            let out = Command::new("git")
                .args(["cat-file", "tree", id])
                .current_dir(repo)
                .output()
                .unwrap();
            out.stdout
        };
        let (base, tree) = (raw(&old_id), raw(&new_id));
        assert!(tree.len() > 10_000, "{}", tree.len());

        let delta = tree_delta(&base, &tree).expect("both are trees");
        assert!(delta.len() < 200, "the delta is {} bytes", delta.len());
        assert_eq!(apply_delta(&base, &delta, tree.len()).unwrap(), tree);
        let id = tree_id(&tree).unwrap();
        assert_eq!(hex::encode(id), new_id);
        let path = format!(".git/objects/{}/{}", &new_id[..2], &new_id[2..]);
        assert_eq!(loose_object_id(path.as_bytes()), Some(id));
        let stored = std::fs::read(repo.join(&path)).expect("the new tree is loose");
        let (level, unpacked) = unpack_tree(&stored).expect("git's loose tree is recognised");
        assert_eq!(unpacked, tree);
        assert_eq!(pack_object("tree", level, &unpacked).unwrap(), stored);

        // What a hostile or damaged delta gets.
        assert!(matches!(
            apply_delta(&base, &[COPY, 0x80, 0x80, 0x04, 10], usize::MAX),
            Err(DeltaError::OutOfBase { .. })
        ));
        assert!(matches!(
            apply_delta(&base, &delta, tree.len() - 1),
            Err(DeltaError::TooLarge(_))
        ));
        assert!(matches!(
            apply_delta(&base, &[7], usize::MAX),
            Err(DeltaError::Malformed(_))
        ));
        assert_eq!(tree_delta(&base, b"not a tree"), None);
    }

    /// Names git orders by a subtree's trailing `/` ("a-b" and "a.c"
    /// before the directory "a", "a0" after it), a file that became a
    /// directory, an executable and a link: the raw entries, the lookups
    /// and the tree diff see what git sees.
    #[test]
    fn raw_trees_are_read_in_git_order_and_agree_with_git() {
        use crate::git::testing;
        let tmp = tempfile::tempdir().unwrap();
        let repo = tmp.path();
        testing::git(repo, &["init", "-q"]);
        let write = |path: &str, content: &str| {
            let path = repo.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, content).unwrap();
        };
        for path in ["a/x.rs", "a-b", "a.c", "a0", "f", "deep/er/y.rs"] {
            write(path, path);
        }
        std::os::unix::fs::symlink("a.c", repo.join("link")).unwrap();
        write("run.sh", "#!/bin/sh\n");
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(repo.join("run.sh"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        testing::git(repo, &["add", "-A"]);
        testing::git(repo, &["commit", "-qm", "one"]);
        std::fs::remove_file(repo.join("f")).unwrap();
        write("f/inside.rs", "now a directory");
        write("a/x.rs", "changed");
        write("deep/er/z.rs", "new");
        testing::git(repo, &["add", "-A"]);
        testing::git(repo, &["commit", "-qm", "two"]);

        crate::git::init();
        let opened = git2::Repository::open(repo).unwrap();
        let odb = opened.odb().unwrap();
        let cache = TreeCache::default();
        let head = opened.head().unwrap().peel_to_tree().unwrap();
        let root = cache.read(&odb, head.id()).unwrap();
        let entries = tree_entries(&root).unwrap();
        let names: Vec<&[u8]> = entries.iter().map(|e| e.name).collect();
        let listed = testing::git(repo, &["ls-tree", "--name-only", "HEAD"]);
        assert_eq!(names, listed.lines().map(str::as_bytes).collect::<Vec<_>>());
        assert!(entries.windows(2).all(|w| w[0].git_order(&w[1]).is_lt()));

        for path in [
            "a/x.rs",
            "a-b",
            "run.sh",
            "link",
            "f/inside.rs",
            "deep/er/z.rs",
            "f",
            "a",
            "nope",
            "a/nope",
        ] {
            let ours = cache.entry_at(&odb, head.id(), path.as_bytes()).unwrap();
            let theirs = match head.get_path(std::path::Path::new(path)) {
                Ok(e) if e.kind() != Some(git2::ObjectType::Tree) => {
                    Some((e.id(), e.filemode() as u32))
                }
                _ => None,
            };
            assert_eq!(ours, theirs, "{path}");
        }
        assert_eq!(
            cache
                .entry_at(&odb, head.id(), b"run.sh")
                .unwrap()
                .unwrap()
                .1,
            0o100755
        );
    }
}
