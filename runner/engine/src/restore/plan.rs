//! From a checkpoint's root tree to a restore plan: every entry to create,
//! checked for safety before a single byte is written.
//!
//! The trees come from the checkpoint's META packs (downloaded whole and
//! verified, see [`super::fetch`]). Each tree blob is opened (AEAD tag and
//! keyed digest), decoded and validated, then walked breadth-first from the
//! root, so a directory's entries sit next to each other in the plan and
//! every parent comes before its children.
//!
//! Refused, with the path and the reason: names that are not one safe path
//! component (`..`, `.`, `/`, NUL, empty, duplicates, unsorted), fifos,
//! devices and sockets, empty symlink targets, files above the size limit,
//! nesting deeper than the depth limit, a directory whose tree is one of its
//! own ancestors, and more entries than the entry limit (shared subtrees are
//! counted every time they appear, so a small hostile tree cannot expand into
//! billions of entries).

use crate::cache::{FastMap, FastSet};
use crate::gitobj::GitStored;
use crate::scan::join_rel;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use cairn_proto::ids::BlobId;
use rayon::prelude::*;

use crate::format::{
    self, ChunkRef, EntryKind, FormatError, IndexEntry, PackIndex, TenantKeys, Tree, TreeObject,
};

use super::fsops::EntryMeta;

/// Bounds that make a checkpoint "absurd" rather than merely big.
#[derive(Debug, Clone)]
pub struct TreeBounds {
    /// Largest single file (default 1 TiB).
    pub max_file_size: u64,
    /// Most entries in the whole checkpoint, counted after expansion.
    pub max_entries: u64,
    /// Deepest directory nesting below the root.
    pub max_depth: usize,
}

impl Default for TreeBounds {
    fn default() -> Self {
        Self {
            max_file_size: 1 << 40,
            max_entries: 20_000_000,
            max_depth: 256,
        }
    }
}

/// Why a checkpoint's trees cannot be turned into a plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("unsafe entry {path:?}: {reason}")]
    Unsafe { path: String, reason: String },
    #[error("the tree of directory {path:?} is in none of the checkpoint's META packs")]
    MissingTree { path: String },
    #[error("the tree of directory {path:?} is corrupt: {source}")]
    CorruptTree { path: String, source: FormatError },
    #[error("the checkpoint has more than {limit} entries")]
    TooManyEntries { limit: u64 },
}

/// The tree blobs of a checkpoint: its META packs, kept whole in memory.
#[derive(Debug, Default)]
pub struct MetaBlobs {
    packs: Vec<Bytes>,
    blobs: FastMap<BlobId, (usize, IndexEntry)>,
}

impl MetaBlobs {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a verified META pack and its opened index.
    pub fn add_pack(&mut self, bytes: Bytes, index: &PackIndex) {
        let ordinal = self.packs.len();
        self.packs.push(bytes);
        for entry in &index.entries {
            self.blobs.entry(entry.id).or_insert((ordinal, *entry));
        }
    }

    /// Opens (decrypts and verifies) one tree blob; `None` if no pack has it.
    pub fn open(&self, keys: &TenantKeys, id: &BlobId) -> Option<Result<Vec<u8>, FormatError>> {
        let (pack, entry) = self.blobs.get(id)?;
        let bytes = &self.packs[*pack];
        let start = entry.offset as usize;
        let end = start + entry.sealed_len as usize;
        let Some(sealed) = bytes.get(start..end) else {
            return Some(Err(FormatError::MalformedBlob {
                id: *id,
                reason: "its range lies outside its pack".into(),
            }));
        };
        Some(format::open(keys, id, sealed, entry.plain_len as usize))
    }
}

/// What one planned entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanKind {
    /// `children` indexes this directory's entries in [`Plan::entries`].
    Dir {
        tree: BlobId,
        children: Range<usize>,
    },
    /// `size` is the file's length on disk; with `git` it is a git loose
    /// object stored by what it holds ([`crate::gitobj`]).
    File {
        size: u64,
        chunks: Vec<ChunkRef>,
        git: Option<GitStored>,
    },
    Symlink {
        target: Vec<u8>,
    },
}

/// One entry to restore.
#[derive(Debug, Clone)]
pub struct PlanEntry {
    /// Path relative to the root, components joined by `/`.
    pub path: Vec<u8>,
    /// Where the last component starts in `path`.
    pub name_start: usize,
    /// The directory entry holding this one (`None`: the root).
    pub parent: Option<usize>,
    pub kind: PlanKind,
    pub(crate) meta: EntryMeta,
}

impl PlanEntry {
    pub fn name(&self) -> &[u8] {
        &self.path[self.name_start..]
    }

    /// The path for messages.
    pub fn display(&self) -> String {
        String::from_utf8_lossy(&self.path).into_owned()
    }
}

/// A checked restore plan.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Breadth-first: parents before children, siblings contiguous and sorted.
    pub entries: Vec<PlanEntry>,
    pub root_children: Range<usize>,
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    pub total_bytes: u64,
}

impl Plan {
    /// The entries directly inside directory `dir` (`None`: the root).
    pub fn children(&self, dir: Option<usize>) -> Range<usize> {
        match dir {
            None => self.root_children.clone(),
            Some(i) => match &self.entries[i].kind {
                PlanKind::Dir { children, .. } => children.clone(),
                _ => 0..0,
            },
        }
    }

    /// The path of directory `dir` (`None`: the root, an empty path).
    pub fn dir_path(&self, dir: Option<usize>) -> &[u8] {
        dir.map_or(&[], |i| &self.entries[i].path)
    }

    /// The entry called `name` directly inside directory `dir`, if any.
    pub fn child(&self, dir: Option<usize>, name: &[u8]) -> Option<usize> {
        let range = self.children(dir);
        let k = self.entries[range.clone()]
            .binary_search_by(|e| e.name().cmp(name))
            .ok()?;
        Some(range.start + k)
    }

    /// Every chunk the plan's files need, in plan order.
    pub fn chunks(&self) -> impl Iterator<Item = &ChunkRef> {
        self.entries.iter().flat_map(|e| match &e.kind {
            PlanKind::File { chunks, .. } => &chunks[..],
            _ => &[],
        })
    }
}

fn shown(path: &[u8]) -> String {
    if path.is_empty() {
        ".".to_owned()
    } else {
        String::from_utf8_lossy(path).into_owned()
    }
}

/// Walks the trees from `root` and checks every entry.
pub fn build_plan(
    meta: &MetaBlobs,
    keys: &TenantKeys,
    root: BlobId,
    bounds: &TreeBounds,
) -> Result<Plan, PlanError> {
    let mut plan = Plan::default();
    let mut decoded: FastMap<BlobId, Arc<Tree>> = FastMap::default();
    // The directories of one depth, in plan order: (directory entry or
    // root, its tree). Breadth-first, one depth at a time, so that the trees
    // of a depth can be opened together.
    let mut level = vec![(None::<usize>, root)];
    let mut depth = 0usize;
    while !level.is_empty() {
        if depth > bounds.max_depth {
            return Err(PlanError::Unsafe {
                path: shown(plan.dir_path(level[0].0)),
                reason: format!(
                    "directories are nested deeper than {} levels",
                    bounds.max_depth
                ),
            });
        }
        for &(dir, tree_id) in &level {
            if is_own_ancestor(&plan, dir, &tree_id, &root) {
                return Err(PlanError::Unsafe {
                    path: shown(plan.dir_path(dir)),
                    reason: "the directory contains itself (its tree is one of its ancestors)"
                        .into(),
                });
            }
        }
        // Opening a tree (AEAD, keyed digest, zstd, decoding, validation) is
        // most of a plan's work: the trees of a depth not opened before are
        // opened in parallel, each once. The first failure in plan order is
        // the one reported.
        let mut listed = FastSet::default();
        let to_open: Vec<(BlobId, Option<usize>)> = level
            .iter()
            .filter(|(_, id)| !decoded.contains_key(id) && listed.insert(*id))
            .map(|&(dir, id)| (id, dir))
            .collect();
        let opened: Vec<Result<Tree, PlanError>> = to_open
            .par_iter()
            .map(|(id, dir)| open_tree(meta, keys, id, plan.dir_path(*dir)))
            .collect();
        for ((id, _), tree) in to_open.into_iter().zip(opened) {
            decoded.insert(id, Arc::new(tree?));
        }
        let mut next_level = Vec::new();
        for (dir, tree_id) in level {
            let dir_path = plan.dir_path(dir).to_vec();
            let tree = &decoded[&tree_id];
            if plan.entries.len() as u64 + tree.entries.len() as u64 > bounds.max_entries {
                return Err(PlanError::TooManyEntries {
                    limit: bounds.max_entries,
                });
            }
            add_children(&mut plan, dir, &dir_path, tree, bounds, &mut next_level)?;
        }
        level = next_level;
        depth += 1;
    }
    Ok(plan)
}

/// Adds the entries of `tree`, the tree of directory `dir` (at `dir_path`),
/// to the plan, checking each; its directories go to `next_level`.
fn add_children(
    plan: &mut Plan,
    dir: Option<usize>,
    dir_path: &[u8],
    tree: &Tree,
    bounds: &TreeBounds,
    next_level: &mut Vec<(Option<usize>, BlobId)>,
) -> Result<(), PlanError> {
    let first = plan.entries.len();
    for entry in &tree.entries {
        let path = join_rel(dir_path, &entry.name);
        let unsafe_entry = |reason: String| PlanError::Unsafe {
            path: shown(&path),
            reason,
        };
        let kind = match &entry.kind {
            EntryKind::File { size, chunks } => {
                if *size > bounds.max_file_size {
                    return Err(unsafe_entry(format!(
                        "the file declares {size} bytes, more than the limit of {}",
                        bounds.max_file_size
                    )));
                }
                plan.files += 1;
                plan.total_bytes += size;
                PlanKind::File {
                    size: *size,
                    chunks: chunks.clone(),
                    git: None,
                }
            }
            EntryKind::Git {
                size,
                stored,
                chunks,
            } => {
                if matches!(stored, GitStored::TreeDelta { .. })
                    && crate::gitobj::loose_object_id(&path).is_none()
                {
                    return Err(unsafe_entry(
                        "a git tree delta that is not a SHA-1 loose object file".into(),
                    ));
                }
                let content: u64 = chunks.iter().map(|c| u64::from(c.len)).sum();
                if content > crate::gitobj::MAX_CONTENT || *size > crate::gitobj::MAX_STORED {
                    return Err(unsafe_entry(format!(
                        "the git object declares {content} bytes of content in {size} bytes, \
                     more than a loose object cairn stores by content"
                    )));
                }
                plan.files += 1;
                plan.total_bytes += size;
                PlanKind::File {
                    size: *size,
                    chunks: chunks.clone(),
                    git: Some(*stored),
                }
            }
            EntryKind::Dir { tree } => {
                plan.directories += 1;
                next_level.push((Some(plan.entries.len()), *tree));
                PlanKind::Dir {
                    tree: *tree,
                    children: 0..0,
                }
            }
            EntryKind::Symlink { target } => {
                plan.symlinks += 1;
                PlanKind::Symlink {
                    target: target.clone(),
                }
            }
            // open_tree resolved every part it could open.
            EntryKind::Parted { .. } => {
                return Err(unsafe_entry(
                    "its chunk list is in parts that were not read".into(),
                ));
            }
            special @ (EntryKind::Fifo
            | EntryKind::CharDevice
            | EntryKind::BlockDevice
            | EntryKind::Socket) => {
                return Err(unsafe_entry(format!(
                    "it is a {}; restore creates only files, directories and symlinks",
                    special.describe()
                )));
            }
        };
        let name_start = path.len() - entry.name.len();
        plan.entries.push(PlanEntry {
            path,
            name_start,
            parent: dir,
            kind,
            meta: EntryMeta {
                mode: entry.mode & 0o7777,
                mtime_sec: entry.mtime_sec,
                mtime_nsec: entry.mtime_nsec,
                uid: entry.uid,
                gid: entry.gid,
            },
        });
    }
    let range = first..plan.entries.len();
    match dir {
        None => plan.root_children = range,
        Some(i) => {
            if let PlanKind::Dir { children, .. } = &mut plan.entries[i].kind {
                *children = range;
            }
        }
    }
    Ok(())
}

fn open_tree(
    meta: &MetaBlobs,
    keys: &TenantKeys,
    id: &BlobId,
    dir_path: &[u8],
) -> Result<Tree, PlanError> {
    let corrupt = |source| PlanError::CorruptTree {
        path: shown(dir_path),
        source,
    };
    let open = |id: &BlobId| {
        meta.open(keys, id)
            .ok_or_else(|| PlanError::MissingTree {
                path: shown(dir_path),
            })?
            .map_err(corrupt)
    };
    let mut tree = match TreeObject::decode(&open(id)?).map_err(corrupt)? {
        TreeObject::Entries(tree) => tree,
        TreeObject::Pages(pages) => {
            let pages = pages
                .iter()
                .map(|page| Tree::decode(&open(page)?).map_err(corrupt))
                .collect::<Result<Vec<_>, _>>()?;
            Tree::concat(pages).map_err(corrupt)?
        }
    };
    for entry in &mut tree.entries {
        if let EntryKind::Parted { size, parts } = &entry.kind {
            let mut chunks = Vec::new();
            for part in parts {
                chunks.extend(format::decode_part(&open(part)?).map_err(corrupt)?);
            }
            entry.kind = EntryKind::file(*size, chunks).map_err(corrupt)?;
        }
    }
    tree.validate()
        .map_err(|(name, reason)| PlanError::Unsafe {
            path: shown(&join_rel(dir_path, name.as_bytes())),
            reason,
        })?;
    Ok(tree)
}

fn is_own_ancestor(plan: &Plan, dir: Option<usize>, tree: &BlobId, root: &BlobId) -> bool {
    let Some(mut at) = dir else { return false };
    if tree == root {
        return true;
    }
    while let Some(parent) = plan.entries[at].parent {
        if matches!(&plan.entries[parent].kind, PlanKind::Dir { tree: t, .. } if t == tree) {
            return true;
        }
        at = parent;
    }
    false
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::format::{Entry, PackBuilder, seal};
    use cairn_proto::domain::PackKind;

    pub(crate) fn keys() -> TenantKeys {
        TenantKeys::derive("k1", &[42; 32]).unwrap()
    }

    pub(crate) fn entry(name: &[u8], kind: EntryKind) -> Entry {
        Entry {
            name: name.to_vec(),
            kind,
            mode: 0o755,
            mtime_sec: 1_600_000_000,
            mtime_nsec: 0,
            uid: 0,
            gid: 0,
        }
    }

    /// Seals trees into one META pack and returns its blobs.
    pub(crate) fn meta_of(keys: &TenantKeys, trees: &[Tree]) -> (MetaBlobs, Vec<BlobId>) {
        let objects: Vec<Vec<u8>> = trees.iter().map(Tree::encode).collect();
        meta_of_objects(keys, &objects)
    }

    /// Seals tree objects (any bytes) into one META pack.
    pub(crate) fn meta_of_objects(
        keys: &TenantKeys,
        objects: &[Vec<u8>],
    ) -> (MetaBlobs, Vec<BlobId>) {
        let mut builder = PackBuilder::new(PackKind::Meta, Vec::new()).unwrap();
        let mut ids = Vec::new();
        for bytes in objects {
            let id = keys.blob_id(bytes);
            let mut sealed = Vec::new();
            seal(keys, &id, bytes, &mut sealed);
            builder.add(id, &sealed, bytes.len() as u32).unwrap();
            ids.push(id);
        }
        let pack = builder.finish(keys).unwrap();
        let bytes = Bytes::from(pack.sink);
        let range =
            pack.index_offset as usize..(pack.index_offset + u64::from(pack.index_length)) as usize;
        let index = PackIndex::open(
            keys,
            &pack.id,
            PackKind::Meta,
            pack.index_offset,
            &bytes[range],
        )
        .unwrap();
        let mut meta = MetaBlobs::new();
        meta.add_pack(bytes, &index);
        (meta, ids)
    }

    #[test]
    fn a_plan_lists_parents_before_children_and_siblings_together() {
        let keys = keys();
        let chunk = ChunkRef {
            id: BlobId([1; 32]),
            len: 3,
        };
        let inner = Tree {
            entries: vec![entry(
                b"f",
                EntryKind::File {
                    size: 3,
                    chunks: vec![chunk],
                },
            )],
        };
        let inner_id = keys.blob_id(&inner.encode());
        let root = Tree {
            entries: vec![
                entry(b"a", EntryKind::Dir { tree: inner_id }),
                entry(b"b", EntryKind::Dir { tree: inner_id }),
                entry(
                    b"link",
                    EntryKind::Symlink {
                        target: b"a/f".to_vec(),
                    },
                ),
            ],
        };
        let (meta, ids) = meta_of(&keys, &[inner, root]);
        let plan = build_plan(&meta, &keys, ids[1], &TreeBounds::default()).unwrap();
        let paths: Vec<String> = plan.entries.iter().map(|e| e.display()).collect();
        assert_eq!(paths, ["a", "b", "link", "a/f", "b/f"]);
        assert_eq!(
            (
                plan.files,
                plan.directories,
                plan.symlinks,
                plan.total_bytes
            ),
            (2, 2, 1, 6)
        );
        assert_eq!(plan.child(None, b"link"), Some(2));
        assert_eq!(plan.child(Some(1), b"f"), Some(4), "b/f");
        assert_eq!(plan.child(Some(1), b"g"), None);
        assert_eq!(plan.chunks().count(), 2);
    }

    fn refused(root_entries: Vec<Entry>, bounds: &TreeBounds) -> PlanError {
        let keys = keys();
        let root = Tree {
            entries: root_entries,
        };
        let (meta, ids) = meta_of(&keys, &[root]);
        build_plan(&meta, &keys, ids[0], bounds).unwrap_err()
    }

    #[test]
    fn special_files_and_oversized_files_are_refused_by_path() {
        let err = refused(
            vec![entry(b"pipe", EntryKind::Fifo)],
            &TreeBounds::default(),
        );
        assert!(err.to_string().contains("\"pipe\""), "{err}");
        assert!(err.to_string().contains("fifo"), "{err}");
        let err = refused(
            vec![entry(b"dev", EntryKind::BlockDevice)],
            &TreeBounds::default(),
        );
        assert!(err.to_string().contains("block device"), "{err}");

        let chunk = ChunkRef {
            id: BlobId([1; 32]),
            len: 4096,
        };
        let big = EntryKind::File {
            size: 8192,
            chunks: vec![chunk, chunk],
        };
        let bounds = TreeBounds {
            max_file_size: 4096,
            ..TreeBounds::default()
        };
        let err = refused(vec![entry(b"big", big)], &bounds);
        assert!(
            err.to_string().contains("\"big\"") && err.to_string().contains("8192"),
            "{err}"
        );
    }

    #[test]
    fn deep_nesting_and_entry_floods_are_refused() {
        let keys = keys();
        let mut trees = vec![Tree::default()];
        for _ in 0..5 {
            let below = keys.blob_id(&trees.last().unwrap().encode());
            trees.push(Tree {
                entries: vec![entry(b"d", EntryKind::Dir { tree: below })],
            });
        }
        let (meta, ids) = meta_of(&keys, &trees);
        let bounds = TreeBounds {
            max_depth: 3,
            ..TreeBounds::default()
        };
        let err = build_plan(&meta, &keys, *ids.last().unwrap(), &bounds).unwrap_err();
        assert!(err.to_string().contains("nested deeper than 3"), "{err}");

        // Ten directories sharing one subtree of ten entries: 110 entries, not 20.
        let leaf = Tree {
            entries: (0..10u8)
                .map(|i| {
                    entry(
                        &[b'a' + i],
                        EntryKind::Symlink {
                            target: b"x".to_vec(),
                        },
                    )
                })
                .collect(),
        };
        let leaf_id = keys.blob_id(&leaf.encode());
        let root = Tree {
            entries: (0..10u8)
                .map(|i| entry(&[b'a' + i], EntryKind::Dir { tree: leaf_id }))
                .collect(),
        };
        let (meta, ids) = meta_of(&keys, &[leaf, root]);
        let bounds = TreeBounds {
            max_entries: 100,
            ..TreeBounds::default()
        };
        assert!(matches!(
            build_plan(&meta, &keys, ids[1], &bounds),
            Err(PlanError::TooManyEntries { limit: 100 })
        ));
    }

    #[test]
    fn a_missing_or_foreign_tree_fails_the_plan() {
        let keys = keys();
        let (meta, _) = meta_of(&keys, &[Tree::default()]);
        assert!(matches!(
            build_plan(&meta, &keys, BlobId([9; 32]), &TreeBounds::default()),
            Err(PlanError::MissingTree { .. })
        ));
        let stranger = TenantKeys::derive("k2", &[1; 32]).unwrap();
        let (meta, ids) = meta_of(&stranger, &[Tree::default()]);
        assert!(matches!(
            build_plan(&meta, &keys, ids[0], &TreeBounds::default()),
            Err(PlanError::CorruptTree { .. })
        ));
    }

    #[test]
    fn a_large_directory_is_read_from_its_pages_and_a_missing_page_names_it() {
        let keys = keys();
        let big = Tree {
            entries: (0..300)
                .map(|i| {
                    entry(
                        format!("f{i:03}").as_bytes(),
                        EntryKind::Symlink {
                            target: b"t".to_vec(),
                        },
                    )
                })
                .collect(),
        };
        let encoded = big.encode_paged(&|b| keys.blob_id(b));
        assert!(encoded.pages.len() > 1);
        let root = Tree {
            entries: vec![entry(
                b"big",
                EntryKind::Dir {
                    tree: keys.blob_id(&encoded.root),
                },
            )],
        };
        let mut objects: Vec<Vec<u8>> = encoded.pages.iter().map(|(_, b)| b.clone()).collect();
        objects.push(encoded.root.clone());
        objects.push(root.encode());
        let (meta, ids) = meta_of_objects(&keys, &objects);
        let plan = build_plan(&meta, &keys, *ids.last().unwrap(), &TreeBounds::default()).unwrap();
        assert_eq!(plan.entries.len(), 301);
        assert!(plan.entries.iter().any(|e| e.path == b"big/f299"));

        // Without its second page the directory cannot be read, and the error says which.
        let without: Vec<Vec<u8>> = objects
            .iter()
            .filter(|b| **b != encoded.pages[1].1)
            .cloned()
            .collect();
        let (meta, ids) = meta_of_objects(&keys, &without);
        let err =
            build_plan(&meta, &keys, *ids.last().unwrap(), &TreeBounds::default()).unwrap_err();
        assert!(
            matches!(&err, PlanError::MissingTree { path } if path == "big"),
            "{err:?}"
        );
    }
}
