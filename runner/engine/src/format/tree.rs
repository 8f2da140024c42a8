//! Tree objects: one per directory, split into pages when it is large.
//!
//! ```text
//! v2+: "CTRE" │ version u8 (2 to 5) │ layout u8 │ body
//!        layout 0 (entries): count varint │ entry*
//!        layout 1 (pages):   page count varint │ page blob id[32]*
//!                            each page is a layout-0 tree object; the
//!                            directory is their entries, in page order
//! v1:  "CTRE" │ version u8 (=1) │ count varint │ entry*
//! entry = name bytes │ kind u8 │ mode varint │ mtime_sec zigzag │ mtime_nsec varint
//!         │ uid varint │ gid varint │ body
//! body  = file:    size varint │ chunk count varint │ (blob id[32] │ len varint)*
//!         dir:     subtree blob id[32]
//!         symlink: target bytes
//!         git blob (v3): size varint │ zlib level u8 │ chunk count varint
//!                  │ (blob id[32] │ len varint)*
//!                  the chunks hold the *content* of a git loose blob; the
//!                  file is zlib(level, "blob <content len>\0" ‖ content),
//!                  `size` bytes long (see crate::gitobj)
//!         git tree delta (v4): size varint │ zlib level u8 │ base tree id[20]
//!                  │ chunk count varint │ (blob id[32] │ len varint)*
//!                  the chunks hold a delta (crate::gitobj::tree_delta)
//!                  against the SHA-1 tree `base`, which a pack of the same
//!                  repository holds; the file is zlib(level, "tree <len>\0"
//!                  ‖ the tree), `size` bytes long
//!         file in parts (v5): size varint │ part count varint │ part blob id[32]*
//!                  a file of more than 256 chunks: its chunk list is cut
//!                  into parts (after a chunk whose id's first byte has its
//!                  low 4 bits clear, 4 to 64 chunks each), each its own blob
//!                  "CCKL" │ version u8 │ chunk count varint │ (blob id[32] │ len varint)*
//!         fifo/char/block/socket: empty (never written by cairn; readers refuse them)
//! bytes = len varint │ raw
//! ```
//! Entries are sorted by name bytes and unique ([`Tree::validate`]), across
//! pages too.
//!
//! Why pages: a tree object's bytes are mostly blob ids, which do not
//! compress, so a change to one file of a 300-entry directory would re-send
//! the whole ~20 KiB listing. Pages end where an entry name's hash says so
//! (content-defined, like file chunks), so adding, removing or changing an
//! entry rewrites one page of a few dozen entries and the short page list.
//! A long chunk list is cut into parts for the same reason: a git index of
//! 80k entries is 3,500 chunks, 120 KiB of ids, of which a commit changes a
//! few dozen chunks; in parts it re-sends those parts and the part list.

use cairn_proto::ids::BlobId;

use super::varint::{Reader, put_bytes, put_i64, put_u64};
use super::{FORMAT_VERSION, FormatError, MAX_CHUNK_LEN};
use crate::gitobj::GitStored;

const MAGIC: &[u8; 4] = b"CTRE";
const LAYOUT_ENTRIES: u8 = 0;
const LAYOUT_PAGES: u8 = 1;
/// Files with more chunks than this have their chunk list written in parts.
pub const PARTED_ABOVE: usize = 256;
/// Fewest chunks in a part (but the last).
const PART_MIN: usize = 4;
/// Most chunks in a part.
const PART_MAX: usize = 64;
/// A part ends after a chunk whose id's first byte has these bits clear
/// (past PART_MIN): about 16 chunks on average.
const PART_CUT_MASK: u8 = 15;
const PART_MAGIC: &[u8; 4] = b"CCKL";
/// The entry kind of a file whose chunk list is in parts.
const CODE_PARTED: u8 = 10;
/// Directories with more entries than this are written as pages.
pub const PAGED_ABOVE: usize = 64;
/// Fewest entries in a page (but the last).
const PAGE_MIN: usize = 16;
/// Most entries in a page.
const PAGE_MAX: usize = 128;
/// A page ends after an entry whose name hash has these bits clear (past
/// PAGE_MIN): about 32 more entries on average.
const PAGE_CUT_MASK: u64 = 31;
/// Most pages one directory may list (MAX_ENTRIES / PAGE_MIN, rounded up).
const MAX_PAGES: u64 = 250_000;
const MAX_NAME_LEN: usize = 255;
const MAX_TARGET_LEN: usize = 4095;
const MAX_ENTRIES: u64 = 4_000_000;

/// One chunk of a file's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkRef {
    pub id: BlobId,
    pub len: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    File {
        size: u64,
        chunks: Vec<ChunkRef>,
    },
    /// A git loose object stored by what it holds ([`crate::gitobj`]): a
    /// blob's content (format v3) or a tree's delta against a packed tree
    /// (format v4). The file is `size` bytes of zlib over the object.
    Git {
        size: u64,
        stored: GitStored,
        chunks: Vec<ChunkRef>,
    },
    /// A file whose chunk list is in parts (format v5), as decoded: a
    /// reader turns it into [`EntryKind::File`] with [`EntryKind::file`]
    /// over the chunks of its parts ([`decode_part`]).
    /// Writers give the whole chunk list as a `File`; encoding cuts it.
    Parted {
        size: u64,
        parts: Vec<BlobId>,
    },
    Dir {
        tree: BlobId,
    },
    Symlink {
        target: Vec<u8>,
    },
    Fifo,
    CharDevice,
    BlockDevice,
    Socket,
}

impl EntryKind {
    /// A file of `size` bytes held by `chunks`, which must add up to it.
    pub fn file(size: u64, chunks: Vec<ChunkRef>) -> Result<Self, FormatError> {
        let sum: u64 = chunks.iter().map(|c| u64::from(c.len)).sum();
        if sum != size {
            return Err(FormatError::MalformedTree(format!(
                "file declares {size} bytes but its chunks hold {sum}"
            )));
        }
        Ok(Self::File { size, chunks })
    }

    fn code(&self) -> u8 {
        match self {
            Self::File { .. } => 1,
            Self::Dir { .. } => 2,
            Self::Symlink { .. } => 3,
            Self::Fifo => 4,
            Self::CharDevice => 5,
            Self::BlockDevice => 6,
            Self::Socket => 7,
            Self::Git {
                stored: GitStored::Blob { .. },
                ..
            } => 8,
            Self::Git {
                stored: GitStored::TreeDelta { .. },
                ..
            } => 9,
            Self::Parted { .. } => CODE_PARTED,
        }
    }

    /// A word for messages.
    pub fn describe(&self) -> &'static str {
        match self {
            Self::File { .. } | Self::Git { .. } | Self::Parted { .. } => "file",
            Self::Dir { .. } => "directory",
            Self::Symlink { .. } => "symlink",
            Self::Fifo => "fifo",
            Self::CharDevice => "character device",
            Self::BlockDevice => "block device",
            Self::Socket => "socket",
        }
    }
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// One path component, as raw bytes (Unix file names need not be UTF-8).
    pub name: Vec<u8>,
    pub kind: EntryKind,
    /// Permission bits, including setuid/setgid/sticky (`st_mode & 0o7777`).
    pub mode: u32,
    pub mtime_sec: i64,
    pub mtime_nsec: u32,
    pub uid: u32,
    pub gid: u32,
}

impl Entry {
    /// Why this name cannot be a single, safe path component, if it cannot.
    pub fn name_problem(&self) -> Option<&'static str> {
        let name = &self.name[..];
        if name.is_empty() {
            Some("the name is empty")
        } else if name == b"." || name == b".." {
            Some("the name is a relative directory reference")
        } else if name.contains(&b'/') {
            Some("the name contains '/' (a path, not a name)")
        } else if name.contains(&0) {
            Some("the name contains a NUL byte")
        } else if name.len() > MAX_NAME_LEN {
            Some("the name is longer than 255 bytes")
        } else {
            None
        }
    }
}

/// A directory listing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tree {
    pub entries: Vec<Entry>,
}

/// A decoded tree object: a listing, or the pages that hold one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TreeObject {
    Entries(Tree),
    Pages(Vec<BlobId>),
}

/// A directory encoded for the store: the object its parent names, and the
/// pages it lists (empty for a small directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedTree {
    pub root: Vec<u8>,
    pub pages: Vec<(BlobId, Vec<u8>)>,
    /// The chunk-list parts of its long files.
    pub parts: Vec<(BlobId, Vec<u8>)>,
}

/// FNV-1a: a fixed, fast hash of an entry name for page boundaries. Not a
/// secret: the boundaries are only visible inside encrypted objects.
fn name_hash(name: &[u8]) -> u64 {
    name.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Tree {
    /// Encodes the tree. Callers keep entries sorted; the encoder writes what
    /// it is given so that tests can build hostile trees.
    pub fn encode(&self) -> Vec<u8> {
        Self::encode_entries(&self.entries, None)
    }

    /// Encodes the tree as the store keeps it: one object, or, above
    /// [`PAGED_ABOVE`] entries, a page list and its pages; a file of more
    /// than [`PARTED_ABOVE`] chunks with its chunk list in parts (`id_of`
    /// names a page or a part by its bytes).
    pub fn encode_paged(&self, id_of: &dyn Fn(&[u8]) -> BlobId) -> EncodedTree {
        let mut parts = Vec::new();
        if self.entries.len() <= PAGED_ABOVE {
            return EncodedTree {
                root: Self::encode_entries(&self.entries, Some((id_of, &mut parts))),
                pages: Vec::new(),
                parts,
            };
        }
        let mut pages = Vec::new();
        let mut start = 0;
        for (i, entry) in self.entries.iter().enumerate() {
            let len = i + 1 - start;
            let last = i + 1 == self.entries.len();
            let cut = len >= PAGE_MIN && name_hash(&entry.name) & PAGE_CUT_MASK == 0;
            if last || cut || len == PAGE_MAX {
                let bytes =
                    Self::encode_entries(&self.entries[start..=i], Some((id_of, &mut parts)));
                pages.push((id_of(&bytes), bytes));
                start = i + 1;
            }
        }
        let mut root = Vec::with_capacity(16 + pages.len() * 32);
        root.extend_from_slice(MAGIC);
        root.push(FORMAT_VERSION as u8);
        root.push(LAYOUT_PAGES);
        put_u64(&mut root, pages.len() as u64);
        for (id, _) in &pages {
            root.extend_from_slice(id.as_bytes());
        }
        EncodedTree { root, pages, parts }
    }

    /// With `parting`, a long chunk list is written in parts, each added
    /// to the list.
    #[allow(clippy::type_complexity)]
    fn encode_entries(
        entries: &[Entry],
        mut parting: Option<(&dyn Fn(&[u8]) -> BlobId, &mut Vec<(BlobId, Vec<u8>)>)>,
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + entries.len() * 64);
        out.extend_from_slice(MAGIC);
        out.push(FORMAT_VERSION as u8);
        out.push(LAYOUT_ENTRIES);
        put_u64(&mut out, entries.len() as u64);
        for e in entries {
            put_bytes(&mut out, &e.name);
            let parted = match (&e.kind, parting.as_mut()) {
                (EntryKind::File { chunks, .. }, Some((id_of, found)))
                    if chunks.len() > PARTED_ABOVE =>
                {
                    let mut ids = Vec::new();
                    for part in cut_parts(chunks) {
                        let mut bytes = Vec::with_capacity(8 + part.len() * 36);
                        bytes.extend_from_slice(PART_MAGIC);
                        bytes.push(FORMAT_VERSION as u8);
                        put_chunks(&mut bytes, part);
                        let id = id_of(&bytes);
                        found.push((id, bytes));
                        ids.push(id);
                    }
                    Some(ids)
                }
                _ => None,
            };
            out.push(if parted.is_some() {
                CODE_PARTED
            } else {
                e.kind.code()
            });
            put_u64(&mut out, u64::from(e.mode));
            put_i64(&mut out, e.mtime_sec);
            put_u64(&mut out, u64::from(e.mtime_nsec));
            put_u64(&mut out, u64::from(e.uid));
            put_u64(&mut out, u64::from(e.gid));
            match (&e.kind, parted) {
                (EntryKind::File { size, .. }, Some(ids)) => {
                    put_u64(&mut out, *size);
                    put_part_ids(&mut out, &ids);
                }
                (EntryKind::File { size, chunks }, None) => {
                    put_u64(&mut out, *size);
                    put_chunks(&mut out, chunks);
                }
                (EntryKind::Parted { size, parts }, _) => {
                    put_u64(&mut out, *size);
                    put_part_ids(&mut out, parts);
                }
                (
                    EntryKind::Git {
                        size,
                        stored,
                        chunks,
                    },
                    _,
                ) => {
                    put_u64(&mut out, *size);
                    out.push(stored.level());
                    if let GitStored::TreeDelta { base, .. } = stored {
                        out.extend_from_slice(base);
                    }
                    put_chunks(&mut out, chunks);
                }
                (EntryKind::Dir { tree }, _) => out.extend_from_slice(tree.as_bytes()),
                (EntryKind::Symlink { target }, _) => put_bytes(&mut out, target),
                (
                    EntryKind::Fifo
                    | EntryKind::CharDevice
                    | EntryKind::BlockDevice
                    | EntryKind::Socket,
                    _,
                ) => {}
            }
        }
        out
    }

    /// Decodes a listing (a small directory's tree or one page), checking
    /// its structure (not its names; see [`Tree::validate`]).
    pub fn decode(bytes: &[u8]) -> Result<Tree, FormatError> {
        match TreeObject::decode(bytes)? {
            TreeObject::Entries(tree) => Ok(tree),
            TreeObject::Pages(_) => Err(FormatError::MalformedTree(
                "a page list where a listing was expected (pages do not nest)".into(),
            )),
        }
    }

    fn decode_entries(bytes: &[u8], version: u32, mut r: Reader<'_>) -> Result<Tree, FormatError> {
        let count = r.u64()?;
        if count > MAX_ENTRIES {
            return Err(FormatError::MalformedTree(format!(
                "{count} entries in one directory"
            )));
        }
        let mut entries = Vec::with_capacity(count.min(65_536) as usize);
        for _ in 0..count {
            // Names are length-checked by validate() so its message can name them.
            let name = r.bytes(4096)?.to_vec();
            let code = r.u8()?;
            let mode = r.u32()?;
            let mtime_sec = r.i64()?;
            let mtime_nsec = r.u32()?;
            let uid = r.u32()?;
            let gid = r.u32()?;
            let kind = match code {
                1 => {
                    let size = r.u64()?;
                    EntryKind::file(size, read_chunks(bytes, &mut r)?)?
                }
                // git blobs from version 3, tree deltas from version 4
                code @ (8 | 9) if version >= u32::from(code == 9) + 3 => {
                    let size = r.u64()?;
                    let level = r.u8()?;
                    if level > 9 {
                        return Err(FormatError::MalformedTree(format!(
                            "git object with zlib level {level}"
                        )));
                    }
                    let stored = if code == 8 {
                        GitStored::Blob { level }
                    } else {
                        let base = r.take(20)?.try_into().expect("20 bytes");
                        GitStored::TreeDelta { level, base }
                    };
                    let chunks = read_chunks(bytes, &mut r)?;
                    EntryKind::Git {
                        size,
                        stored,
                        chunks,
                    }
                }
                CODE_PARTED if version >= 5 => {
                    let size = r.u64()?;
                    let n = r.u64()?;
                    if n > (bytes.len() as u64) / 32 || n == 0 {
                        return Err(FormatError::MalformedTree(format!("{n} chunk-list parts")));
                    }
                    let parts = (0..n)
                        .map(|_| Ok(BlobId::from_slice(r.take(32)?).expect("32 bytes")))
                        .collect::<Result<Vec<_>, FormatError>>()?;
                    EntryKind::Parted { size, parts }
                }
                2 => EntryKind::Dir {
                    tree: BlobId::from_slice(r.take(32)?).expect("32 bytes"),
                },
                3 => EntryKind::Symlink {
                    target: r.bytes(MAX_TARGET_LEN)?.to_vec(),
                },
                4 => EntryKind::Fifo,
                5 => EntryKind::CharDevice,
                6 => EntryKind::BlockDevice,
                7 => EntryKind::Socket,
                other => {
                    return Err(FormatError::MalformedTree(format!(
                        "unknown entry kind {other}"
                    )));
                }
            };
            entries.push(Entry {
                name,
                kind,
                mode,
                mtime_sec,
                mtime_nsec,
                uid,
                gid,
            });
        }
        if !r.is_empty() {
            return Err(FormatError::MalformedTree("trailing bytes".into()));
        }
        Ok(Tree { entries })
    }

    /// The listing of a paged directory: its decoded pages' entries, in
    /// order (sorting and uniqueness across pages are [`Tree::validate`]'s).
    pub fn concat(pages: impl IntoIterator<Item = Tree>) -> Result<Tree, FormatError> {
        let mut entries = Vec::new();
        for page in pages {
            if page.entries.is_empty() {
                return Err(FormatError::MalformedTree("an empty page".into()));
            }
            if entries.len() as u64 + page.entries.len() as u64 > MAX_ENTRIES {
                return Err(FormatError::MalformedTree(format!(
                    "more than {MAX_ENTRIES} entries in one directory"
                )));
            }
            entries.extend(page.entries);
        }
        Ok(Tree { entries })
    }

    /// Checks names: each a safe single component, sorted, unique. Returns the
    /// offending name (lossy) and the reason.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let mut previous: Option<&[u8]> = None;
        for e in &self.entries {
            let shown = String::from_utf8_lossy(&e.name).into_owned();
            if let Some(problem) = e.name_problem() {
                return Err((shown, problem.to_owned()));
            }
            if let Some(prev) = previous {
                if prev == &e.name[..] {
                    return Err((shown, "the name appears twice in one directory".into()));
                }
                if prev > &e.name[..] {
                    return Err((shown, "entries are not in sorted order".into()));
                }
            }
            if let EntryKind::Symlink { target } = &e.kind
                && (target.is_empty() || target.contains(&0))
            {
                return Err((shown, "the symlink target is empty or contains NUL".into()));
            }
            previous = Some(&e.name);
        }
        Ok(())
    }
}

/// The chunks a chunk-list part holds (see [`EntryKind::Parted`]).
pub fn decode_part(bytes: &[u8]) -> Result<Vec<ChunkRef>, FormatError> {
    let mut r = Reader::new(bytes);
    if r.take(4)? != PART_MAGIC {
        return Err(FormatError::MalformedTree(
            "a chunk-list part has a bad magic".into(),
        ));
    }
    let version = u32::from(r.u8()?);
    if !(5..=FORMAT_VERSION).contains(&version) {
        return Err(FormatError::MalformedTree(format!(
            "a chunk-list part of version {version}"
        )));
    }
    let chunks = read_chunks(bytes, &mut r)?;
    if chunks.is_empty() || !r.is_empty() {
        return Err(FormatError::MalformedTree(
            "a chunk-list part is empty or has trailing bytes".into(),
        ));
    }
    Ok(chunks)
}

/// The parts a long chunk list is cut into: content-defined, so a changed
/// chunk changes its own part (and, at most, where the next one begins).
fn cut_parts(chunks: &[ChunkRef]) -> Vec<&[ChunkRef]> {
    let mut parts = Vec::new();
    let mut start = 0;
    for (i, chunk) in chunks.iter().enumerate() {
        let len = i + 1 - start;
        let cut = len >= PART_MIN && chunk.id.as_bytes()[0] & PART_CUT_MASK == 0;
        if i + 1 == chunks.len() || cut || len == PART_MAX {
            parts.push(&chunks[start..=i]);
            start = i + 1;
        }
    }
    parts
}

fn put_part_ids(out: &mut Vec<u8>, parts: &[BlobId]) {
    put_u64(out, parts.len() as u64);
    for id in parts {
        out.extend_from_slice(id.as_bytes());
    }
}

/// Writes a file's chunk list: count, then (id, length) pairs.
fn put_chunks(out: &mut Vec<u8>, chunks: &[ChunkRef]) {
    put_u64(out, chunks.len() as u64);
    for c in chunks {
        out.extend_from_slice(c.id.as_bytes());
        put_u64(out, u64::from(c.len));
    }
}

/// Reads a file's chunk list, as [`put_chunks`] wrote it.
fn read_chunks(bytes: &[u8], r: &mut Reader<'_>) -> Result<Vec<ChunkRef>, FormatError> {
    let n = r.u64()?;
    // Every chunk takes at least 33 bytes: a cheap bound before allocating.
    if n > (bytes.len() as u64) / 33 {
        return Err(FormatError::MalformedTree(format!("{n} chunks cannot fit")));
    }
    let mut chunks = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let id = BlobId::from_slice(r.take(32)?).expect("32 bytes");
        let len = r.u32()?;
        if len == 0 || len > MAX_CHUNK_LEN {
            return Err(FormatError::MalformedTree(format!("chunk of {len} bytes")));
        }
        chunks.push(ChunkRef { id, len });
    }
    Ok(chunks)
}

impl TreeObject {
    /// Decodes any tree object, of any version up to this build's.
    pub fn decode(bytes: &[u8]) -> Result<TreeObject, FormatError> {
        let mut r = Reader::new(bytes);
        if r.take(4)? != MAGIC {
            return Err(FormatError::MalformedTree("bad magic".into()));
        }
        let version = u32::from(r.u8()?);
        if version > FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        if version < 2 {
            return Tree::decode_entries(bytes, version, r).map(TreeObject::Entries);
        }
        match r.u8()? {
            LAYOUT_ENTRIES => Tree::decode_entries(bytes, version, r).map(TreeObject::Entries),
            LAYOUT_PAGES => {
                let count = r.u64()?;
                if count == 0 || count > MAX_PAGES {
                    return Err(FormatError::MalformedTree(format!(
                        "a page list of {count} pages"
                    )));
                }
                let mut pages = Vec::with_capacity(count.min(4096) as usize);
                for _ in 0..count {
                    pages.push(BlobId::from_slice(r.take(32)?).expect("32 bytes"));
                }
                if !r.is_empty() {
                    return Err(FormatError::MalformedTree("trailing bytes".into()));
                }
                Ok(TreeObject::Pages(pages))
            }
            other => Err(FormatError::MalformedTree(format!(
                "unknown layout {other}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, kind: EntryKind) -> Entry {
        Entry {
            name: name.into(),
            kind,
            mode: 0o644,
            mtime_sec: -5,
            mtime_nsec: 999,
            uid: 1000,
            gid: 1000,
        }
    }

    #[test]
    fn trees_round_trip() {
        let id = BlobId([3; 32]);
        let tree = Tree {
            entries: vec![
                entry(
                    "a file",
                    EntryKind::File {
                        size: 7,
                        chunks: vec![ChunkRef { id, len: 7 }],
                    },
                ),
                entry("dir", EntryKind::Dir { tree: id }),
                entry(
                    "empty",
                    EntryKind::File {
                        size: 0,
                        chunks: vec![],
                    },
                ),
                entry(
                    "link",
                    EntryKind::Symlink {
                        target: b"../x".to_vec(),
                    },
                ),
                entry(
                    "loose",
                    EntryKind::Git {
                        size: 5,
                        stored: GitStored::Blob { level: 1 },
                        chunks: vec![ChunkRef { id, len: 7 }],
                    },
                ),
                entry(
                    "loose-tree",
                    EntryKind::Git {
                        size: 40,
                        stored: GitStored::TreeDelta {
                            level: 6,
                            base: [7; 20],
                        },
                        chunks: vec![ChunkRef { id, len: 9 }],
                    },
                ),
                entry("ünïcode", EntryKind::Fifo),
            ],
        };
        let decoded = Tree::decode(&tree.encode()).unwrap();
        assert_eq!(decoded, tree);
        assert!(decoded.validate().is_ok());
    }

    #[test]
    fn git_blobs_exist_from_version_3_and_tree_deltas_from_version_4() {
        let blob = |level| EntryKind::Git {
            size: 5,
            stored: GitStored::Blob { level },
            chunks: vec![],
        };
        let delta = EntryKind::Git {
            size: 5,
            stored: GitStored::TreeDelta {
                level: 1,
                base: [3; 20],
            },
            chunks: vec![],
        };
        for (kind, code, first_version) in [(blob(1), 8, 3), (delta, 9, 4)] {
            let tree = Tree {
                entries: vec![entry("loose", kind)],
            };
            let mut bytes = tree.encode();
            assert_eq!(bytes[4], FORMAT_VERSION as u8);
            bytes[4] = first_version;
            assert_eq!(Tree::decode(&bytes).unwrap(), tree);
            bytes[4] = first_version - 1;
            let err = Tree::decode(&bytes).unwrap_err();
            assert!(
                err.to_string()
                    .contains(&format!("unknown entry kind {code}")),
                "{err}"
            );
        }
        let bad_level = Tree {
            entries: vec![entry("loose", blob(12))],
        };
        let err = Tree::decode(&bad_level.encode()).unwrap_err();
        assert!(err.to_string().contains("zlib level 12"), "{err}");
    }

    #[test]
    fn hostile_names_are_named_in_the_error() {
        for bad in ["..", ".", "a/b", "/etc", ""] {
            let tree = Tree {
                entries: vec![entry(bad, EntryKind::Fifo)],
            };
            let (name, _) = Tree::decode(&tree.encode())
                .unwrap()
                .validate()
                .unwrap_err();
            assert_eq!(name, bad);
        }
        let dup = Tree {
            entries: vec![entry("a", EntryKind::Fifo), entry("a", EntryKind::Fifo)],
        };
        assert!(dup.validate().unwrap_err().1.contains("twice"));
    }

    #[test]
    fn inconsistent_sizes_and_garbage_are_refused() {
        let id = BlobId([1; 32]);
        let lie = Tree {
            entries: vec![entry(
                "f",
                EntryKind::File {
                    size: 1 << 50,
                    chunks: vec![ChunkRef { id, len: 10 }],
                },
            )],
        };
        assert!(Tree::decode(&lie.encode()).is_err());
        assert!(Tree::decode(b"CTRE\x01\xff\xff\xff\xff\x0f").is_err());
        assert!(Tree::decode(b"nope").is_err());
        let mut future = Tree::default().encode();
        future[4] = 9;
        assert!(matches!(
            Tree::decode(&future),
            Err(FormatError::UnsupportedVersion { .. })
        ));
    }

    fn listing(n: usize) -> Tree {
        let mut entries: Vec<Entry> = (0..n)
            .map(|i| {
                entry(
                    &format!("file-{i:05}.rs"),
                    EntryKind::File {
                        size: 1,
                        chunks: vec![ChunkRef {
                            id: BlobId([(i % 251) as u8; 32]),
                            len: 1,
                        }],
                    },
                )
            })
            .collect();
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Tree { entries }
    }

    fn id_of(bytes: &[u8]) -> BlobId {
        let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
        BlobId::from_slice(digest.as_ref()).unwrap()
    }

    fn open_pages(encoded: &EncodedTree) -> Tree {
        let TreeObject::Pages(ids) = TreeObject::decode(&encoded.root).unwrap() else {
            panic!("a page list")
        };
        assert_eq!(
            ids,
            encoded.pages.iter().map(|(id, _)| *id).collect::<Vec<_>>()
        );
        let page = |id: &BlobId| {
            let (_, bytes) = encoded.pages.iter().find(|(i, _)| i == id).unwrap();
            Tree::decode(bytes).unwrap()
        };
        Tree::concat(ids.iter().map(page)).unwrap()
    }

    #[test]
    fn small_directories_are_one_object_and_large_ones_pages() {
        let small = listing(PAGED_ABOVE);
        let encoded = small.encode_paged(&id_of);
        assert!(encoded.pages.is_empty());
        assert_eq!(Tree::decode(&encoded.root).unwrap(), small);

        let large = listing(1000);
        let encoded = large.encode_paged(&id_of);
        assert!(encoded.pages.len() > 5, "{} pages", encoded.pages.len());
        for (i, (_, page)) in encoded.pages.iter().enumerate() {
            let n = Tree::decode(page).unwrap().entries.len();
            assert!(n <= PAGE_MAX, "page {i}: {n} entries");
            assert!(
                n >= PAGE_MIN || i + 1 == encoded.pages.len(),
                "page {i}: {n} entries"
            );
        }
        assert_eq!(open_pages(&encoded), large);
        assert!(
            Tree::decode(&encoded.root).is_err(),
            "a page list is not a page, so pages cannot nest"
        );
    }

    #[test]
    fn a_change_rewrites_one_page() {
        let before = listing(300);
        let old = before.encode_paged(&id_of);
        let changed_page = |after: &Tree| {
            let new = after.encode_paged(&id_of);
            assert_ne!(new.root, old.root);
            new.pages.iter().filter(|p| !old.pages.contains(p)).count()
        };
        let mut touched = before.clone();
        touched.entries[150].mtime_sec += 1;
        assert_eq!(changed_page(&touched), 1);
        let mut grown = before.clone();
        grown.entries.insert(
            100,
            entry(
                "file-00099a.rs",
                EntryKind::Symlink {
                    target: b"x".to_vec(),
                },
            ),
        );
        assert!(changed_page(&grown) <= 2, "an insertion stays local");
    }

    /// A file of thousands of chunks (a git index) keeps its chunk list in
    /// parts: one changed chunk re-sends its part and the short part list,
    /// and a reader gets the whole list back from the parts.
    #[test]
    fn a_long_chunk_list_is_kept_in_parts_and_a_change_rewrites_one() {
        let chunks: Vec<ChunkRef> = (0..3500u32)
            .map(|i| ChunkRef {
                id: id_of(&i.to_le_bytes()),
                len: 2048,
            })
            .collect();
        let file = |name: &str, chunks: &[ChunkRef]| {
            entry(
                name,
                EntryKind::File {
                    size: chunks.iter().map(|c| u64::from(c.len)).sum(),
                    chunks: chunks.to_vec(),
                },
            )
        };
        let tree = Tree {
            entries: vec![
                file("a-short", &chunks[..PARTED_ABOVE]),
                file("index", &chunks),
            ],
        };
        let encoded = tree.encode_paged(&id_of);
        assert!(encoded.pages.is_empty());
        let parts = encoded.parts.len();
        assert!(
            (3500 / PART_MAX..=3500 / PART_MIN).contains(&parts),
            "{parts} parts"
        );
        assert!(
            encoded.root.len() < 3500 * 33 / 4,
            "{} bytes",
            encoded.root.len()
        );
        let mut decoded = Tree::decode(&encoded.root).unwrap();
        assert!(
            matches!(decoded.entries[0].kind, EntryKind::File { .. }),
            "256 chunks stay inline"
        );
        assert!(matches!(decoded.entries[1].kind, EntryKind::Parted { .. }));
        let resolve = |tree: &mut Tree| -> Result<(), FormatError> {
            for entry in &mut tree.entries {
                if let EntryKind::Parted { size, parts } = &entry.kind {
                    let mut chunks = Vec::new();
                    for part in parts {
                        let (_, bytes) = encoded.parts.iter().find(|(i, _)| i == part).unwrap();
                        chunks.extend(decode_part(bytes)?);
                    }
                    entry.kind = EntryKind::file(*size, chunks)?;
                }
            }
            Ok(())
        };
        resolve(&mut decoded).unwrap();
        assert_eq!(decoded, tree);

        let mut changed = chunks.clone();
        changed[1700].id = id_of(b"changed");
        let again = Tree {
            entries: vec![tree.entries[0].clone(), file("index", &changed)],
        }
        .encode_paged(&id_of);
        let new_parts = again
            .parts
            .iter()
            .filter(|p| !encoded.parts.contains(p))
            .count();
        assert!((1..=2).contains(&new_parts), "{new_parts} parts rewritten");

        // A part whose chunks do not add up to the file is refused.
        let mut short = Tree::decode(&encoded.root).unwrap();
        if let EntryKind::Parted { parts, .. } = &mut short.entries[1].kind {
            parts.pop();
        }
        assert!(resolve(&mut short).is_err());
    }

    #[test]
    fn version_1_trees_still_read() {
        // "CTRE" │ 1 │ one entry "a": fifo, mode 0o644, mtime 0.0, uid 0, gid 0
        let v1 = b"CTRE\x01\x01\x01a\x04\xa4\x03\x00\x00\x00\x00";
        let tree = Tree::decode(v1).unwrap();
        assert_eq!(tree.entries.len(), 1);
        assert_eq!(tree.entries[0].name, b"a");
        assert_eq!(tree.entries[0].kind, EntryKind::Fifo);
        assert_eq!(tree.entries[0].mode, 0o644);
    }

    #[test]
    fn empty_or_oversized_page_lists_are_refused() {
        assert!(TreeObject::decode(b"CTRE\x02\x01\x00").is_err());
        assert!(TreeObject::decode(b"CTRE\x02\x07\x00").is_err());
        let err = Tree::concat([Tree::default()]).unwrap_err();
        assert!(err.to_string().contains("an empty page"), "{err}");
    }
}
