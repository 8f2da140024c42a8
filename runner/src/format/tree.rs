//! Tree objects: one per directory.
//!
//! ```text
//! "CTRE" │ version u8 (=1) │ count varint │ entry*
//! entry = name bytes │ kind u8 │ mode varint │ mtime_sec zigzag │ mtime_nsec varint
//!         │ uid varint │ gid varint │ body
//! body  = file:    size varint │ chunk count varint │ (blob id[32] │ len varint)*
//!         dir:     subtree blob id[32]
//!         symlink: target bytes
//!         fifo/char/block/socket: empty (never written by cairn; readers refuse them)
//! bytes = len varint │ raw
//! ```
//! Entries are sorted by name bytes and unique ([`Tree::validate`]).

use cairn_proto::ids::BlobId;

use super::varint::{Reader, put_bytes, put_i64, put_u64};
use super::{FORMAT_VERSION, FormatError, MAX_CHUNK_LEN};

const MAGIC: &[u8; 4] = b"CTRE";
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
    File { size: u64, chunks: Vec<ChunkRef> },
    Dir { tree: BlobId },
    Symlink { target: Vec<u8> },
    Fifo,
    CharDevice,
    BlockDevice,
    Socket,
}

impl EntryKind {
    fn code(&self) -> u8 {
        match self {
            Self::File { .. } => 1,
            Self::Dir { .. } => 2,
            Self::Symlink { .. } => 3,
            Self::Fifo => 4,
            Self::CharDevice => 5,
            Self::BlockDevice => 6,
            Self::Socket => 7,
        }
    }

    /// A word for messages.
    pub fn describe(&self) -> &'static str {
        match self {
            Self::File { .. } => "file",
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

impl Tree {
    /// Encodes the tree. Callers keep entries sorted; the encoder writes what
    /// it is given so that tests can build hostile trees.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.entries.len() * 64);
        out.extend_from_slice(MAGIC);
        out.push(FORMAT_VERSION as u8);
        put_u64(&mut out, self.entries.len() as u64);
        for e in &self.entries {
            put_bytes(&mut out, &e.name);
            out.push(e.kind.code());
            put_u64(&mut out, u64::from(e.mode));
            put_i64(&mut out, e.mtime_sec);
            put_u64(&mut out, u64::from(e.mtime_nsec));
            put_u64(&mut out, u64::from(e.uid));
            put_u64(&mut out, u64::from(e.gid));
            match &e.kind {
                EntryKind::File { size, chunks } => {
                    put_u64(&mut out, *size);
                    put_u64(&mut out, chunks.len() as u64);
                    for c in chunks {
                        out.extend_from_slice(c.id.as_bytes());
                        put_u64(&mut out, u64::from(c.len));
                    }
                }
                EntryKind::Dir { tree } => out.extend_from_slice(tree.as_bytes()),
                EntryKind::Symlink { target } => put_bytes(&mut out, target),
                EntryKind::Fifo | EntryKind::CharDevice | EntryKind::BlockDevice | EntryKind::Socket => {}
            }
        }
        out
    }

    /// Decodes a tree, checking its structure (not its names; see [`Tree::validate`]).
    pub fn decode(bytes: &[u8]) -> Result<Tree, FormatError> {
        let mut r = Reader::new(bytes);
        if r.take(4)? != MAGIC {
            return Err(FormatError::MalformedTree("bad magic".into()));
        }
        let version = u32::from(r.u8()?);
        if version > FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion { found: version, supported: FORMAT_VERSION });
        }
        let count = r.u64()?;
        if count > MAX_ENTRIES {
            return Err(FormatError::MalformedTree(format!("{count} entries in one directory")));
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
                    let n = r.u64()?;
                    // Every chunk takes at least 33 bytes: a cheap bound before allocating.
                    if n > (bytes.len() as u64) / 33 {
                        return Err(FormatError::MalformedTree(format!("{n} chunks cannot fit")));
                    }
                    let mut chunks = Vec::with_capacity(n as usize);
                    let mut sum: u64 = 0;
                    for _ in 0..n {
                        let id = BlobId::from_slice(r.take(32)?).expect("32 bytes");
                        let len = r.u32()?;
                        if len == 0 || len > MAX_CHUNK_LEN {
                            return Err(FormatError::MalformedTree(format!("chunk of {len} bytes")));
                        }
                        sum += u64::from(len);
                        chunks.push(ChunkRef { id, len });
                    }
                    if sum != size {
                        return Err(FormatError::MalformedTree(format!(
                            "file declares {size} bytes but its chunks hold {sum}"
                        )));
                    }
                    EntryKind::File { size, chunks }
                }
                2 => EntryKind::Dir { tree: BlobId::from_slice(r.take(32)?).expect("32 bytes") },
                3 => EntryKind::Symlink { target: r.bytes(MAX_TARGET_LEN)?.to_vec() },
                4 => EntryKind::Fifo,
                5 => EntryKind::CharDevice,
                6 => EntryKind::BlockDevice,
                7 => EntryKind::Socket,
                other => {
                    return Err(FormatError::MalformedTree(format!("unknown entry kind {other}")));
                }
            };
            entries.push(Entry { name, kind, mode, mtime_sec, mtime_nsec, uid, gid });
        }
        if !r.is_empty() {
            return Err(FormatError::MalformedTree("trailing bytes".into()));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, kind: EntryKind) -> Entry {
        Entry { name: name.into(), kind, mode: 0o644, mtime_sec: -5, mtime_nsec: 999, uid: 1000, gid: 1000 }
    }

    #[test]
    fn trees_round_trip() {
        let id = BlobId([3; 32]);
        let tree = Tree {
            entries: vec![
                entry("a file", EntryKind::File { size: 7, chunks: vec![ChunkRef { id, len: 7 }] }),
                entry("dir", EntryKind::Dir { tree: id }),
                entry("empty", EntryKind::File { size: 0, chunks: vec![] }),
                entry("link", EntryKind::Symlink { target: b"../x".to_vec() }),
                entry("ünïcode", EntryKind::Fifo),
            ],
        };
        let decoded = Tree::decode(&tree.encode()).unwrap();
        assert_eq!(decoded, tree);
        assert!(decoded.validate().is_ok());
    }

    #[test]
    fn hostile_names_are_named_in_the_error() {
        for bad in ["..", ".", "a/b", "/etc", ""] {
            let tree = Tree { entries: vec![entry(bad, EntryKind::Fifo)] };
            let (name, _) = Tree::decode(&tree.encode()).unwrap().validate().unwrap_err();
            assert_eq!(name, bad);
        }
        let dup = Tree { entries: vec![entry("a", EntryKind::Fifo), entry("a", EntryKind::Fifo)] };
        assert!(dup.validate().unwrap_err().1.contains("twice"));
    }

    #[test]
    fn inconsistent_sizes_and_garbage_are_refused() {
        let id = BlobId([1; 32]);
        let lie = Tree {
            entries: vec![entry("f", EntryKind::File { size: 1 << 50, chunks: vec![ChunkRef { id, len: 10 }] })],
        };
        assert!(Tree::decode(&lie.encode()).is_err());
        assert!(Tree::decode(b"CTRE\x01\xff\xff\xff\xff\x0f").is_err());
        assert!(Tree::decode(b"nope").is_err());
        let mut future = Tree::default().encode();
        future[4] = 9;
        assert!(matches!(Tree::decode(&future), Err(FormatError::UnsupportedVersion { .. })));
    }
}
