//! One directory as the stages of a checkpoint hand it on: its files'
//! contents ([`DirFiles`], from the content stage or the memo) and its tree
//! ([`DirTree`], from the trees stage or the memo). Every stage module and
//! the memo depend on this one, which depends on none of them.

use std::sync::Arc;

use cairn_proto::ids::BlobId;

use crate::cache::{CachedFile, Fingerprint};
use crate::format::{ChunkRef, Entry, EntryKind, TenantKeys, Tree};
use crate::gitobj::GitStored;
use crate::scan::{Meta, NodeKind, ScannedDir};

/// A file as it goes into the checkpoint.
#[derive(Debug, Clone)]
pub struct FileContent {
    pub chunks: Arc<[ChunkRef]>,
    pub size: u64,
    pub meta: Meta,
    /// The fingerprint under which the cache may remember `chunks` (None
    /// when the file changed too recently, or while it was read).
    pub cacheable: Option<Fingerprint>,
    /// A git loose object stored by what it holds ([`crate::gitobj`]).
    pub git: Option<GitStored>,
}

impl FileContent {
    /// Whether it is a loose git tree stored as a delta against a base.
    pub fn is_tree_delta(&self) -> bool {
        matches!(self.git, Some(GitStored::TreeDelta { .. }))
    }

    /// What the fingerprint cache learns about this file, if anything.
    pub fn cache_entry(&self) -> Option<CachedFile> {
        self.cacheable.map(|fingerprint| CachedFile {
            fingerprint,
            chunks: self.chunks.clone(),
            git: self.git,
        })
    }
}

/// One directory's files, per node: the file's content (None for other
/// kinds and for files that vanished or could not be read). Shared with the
/// [`Memo`](super::memo::Memo) when the next checkpoint finds the same listing.
pub type DirFiles = Arc<Vec<Option<FileContent>>>;

/// What the tree holds, entry by entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    pub total_bytes: u64,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, other: Self) {
        self.files += other.files;
        self.directories += other.directories;
        self.symlinks += other.symlinks;
        self.total_bytes += other.total_bytes;
    }
}

/// One directory's tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirTree {
    pub id: BlobId,
    /// Its pages, when it is a large directory, and the chunk-list parts of
    /// its long files (see format::tree).
    pub pages: Vec<BlobId>,
    /// The tree of each subdirectory, in entry order (None: it vanished
    /// during the walk, and is left out): the tree can be taken again only
    /// while these are the same.
    pub subtrees: Arc<[Option<BlobId>]>,
    /// Its own entries, not those below its subdirectories.
    pub counts: Counts,
}

impl DirTree {
    /// Encodes one directory whose subdirectories have the trees `subtrees`
    /// (one per subdirectory, in entry order); every page and the tree itself
    /// go to `offer`.
    pub fn encode(
        dir: &ScannedDir,
        files: &[Option<FileContent>],
        subtrees: Vec<Option<BlobId>>,
        keys: &TenantKeys,
        offer: &mut dyn FnMut(BlobId, Vec<u8>),
    ) -> DirTree {
        let mut counts = Counts::default();
        let mut entries = Vec::with_capacity(dir.nodes.len());
        let mut next_subtree = subtrees.iter();
        for (node, file) in dir.nodes.iter().zip(files) {
            let (kind, meta) = match &node.kind {
                NodeKind::File(_) => {
                    let Some(file) = file else { continue };
                    counts.files += 1;
                    counts.total_bytes += file.size;
                    let kind = match file.git {
                        Some(stored) => EntryKind::Git {
                            size: file.size,
                            stored,
                            chunks: file.chunks.to_vec(),
                        },
                        None => EntryKind::File {
                            size: file.size,
                            chunks: file.chunks.to_vec(),
                        },
                    };
                    (kind, &file.meta)
                }
                NodeKind::Dir => match next_subtree.next().copied().flatten() {
                    Some(tree) => {
                        counts.directories += 1;
                        (EntryKind::Dir { tree }, &node.meta)
                    }
                    None => continue,
                },
                NodeKind::Symlink(target) => {
                    counts.symlinks += 1;
                    let kind = EntryKind::Symlink {
                        target: target.clone(),
                    };
                    (kind, &node.meta)
                }
            };
            entries.push(Entry {
                name: node.name.to_vec(),
                kind,
                mode: meta.mode,
                mtime_sec: meta.mtime_sec,
                mtime_nsec: meta.mtime_nsec,
                uid: meta.uid,
                gid: meta.gid,
            });
        }
        let encoded = Tree { entries }.encode_paged(&|bytes| keys.blob_id(bytes));
        let mut pages = Vec::with_capacity(encoded.pages.len() + encoded.parts.len());
        for (page, bytes) in encoded.pages.into_iter().chain(encoded.parts) {
            pages.push(page);
            offer(page, bytes);
        }
        let id = keys.blob_id(&encoded.root);
        offer(id, encoded.root);
        DirTree {
            id,
            pages,
            subtrees: subtrees.into(),
            counts,
        }
    }
}
