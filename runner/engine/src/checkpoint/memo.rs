//! What a resident runner's last committed checkpoint worked out for each
//! directory listing, so the next one costs what changed, not the workspace.
//!
//! The change tracker hands a walk back with the very listings
//! (`Arc<ScannedDir>`) of the walk before for every directory in which it
//! saw no event. Such a directory holds what it held when its listing was
//! taken: any write to one of its files since would have been an event, and
//! would have made a new listing. So for a listing the last checkpoint also
//! saw, this checkpoint takes what that one found without looking again:
//! - the files' chunk lists, instead of comparing each fingerprint with the
//!   cache (a file changed too recently to be cached is not read again
//!   either: the tracker vouches for it, not its timestamps);
//! - the directory's tree id, when its subdirectories' ids are unchanged
//!   too, instead of encoding and hashing it;
//! - the packs its blobs are in, instead of locating every chunk.
//!
//! A directory listed again since (an event named it) takes from the memo
//! every file whose fingerprint is the one read then, and was stable then,
//! as the cache would, without a lookup per path; it places those files in
//! the packs of the earlier listing, a superset of what they need
//! (referencing a pack costs nothing). A loose git tree stored as a delta is
//! not taken so: its base is found again. Trees are encoded only on the
//! paths to a directory whose tree changed.
//!
//! Only what a committed checkpoint (or one found equal to the committed
//! one) held is remembered, so every blob it names is in a pack the store
//! keeps. A loose git tree stored as a delta is taken only while its base is
//! the one found again for this checkpoint. A checkpoint that redoes its
//! work after a refused commit uses no memo: a pack it names may be gone.
//! The next memo is worked out after the commit answers, in the background
//! with the cache write, which the next checkpoint waits for.

use std::collections::HashMap;
use std::sync::Arc;

use cairn_proto::ids::{BlobId, PackId, WorkspaceId};

use super::dir::{DirFiles, DirTree, FileContent};
use crate::cache::{FastMap, Fingerprint, FingerprintCache};
use crate::format::TenantKeys;
use crate::gitobj::GitStored;
use crate::scan::{NodeKind, Scan, ScannedDir, join_rel_into};

/// One directory as the last checkpoint held it.
#[derive(Debug, Clone)]
pub struct DirOutcome {
    /// The listing it was worked out from; held so that its address, the
    /// key it is found by, is not reused by another listing.
    listing: Arc<ScannedDir>,
    pub files: DirFiles,
    pub tree: DirTree,
    /// Every pack holding one of its file chunks, its tree or its pages.
    pub packs: Arc<[PackId]>,
    /// Whether a file in it is a git tree stored as a delta.
    pub has_tree_deltas: bool,
    /// Whether a file in it was read too recently to be cached.
    pub uncached: bool,
}

impl DirOutcome {
    /// What was found for the file `name` when it had `fingerprint` too, and
    /// was stable then (so cacheable, as the cache would have it). `from`
    /// is a cursor into the listing for callers that ask in name order.
    pub fn same_file(
        &self,
        name: &[u8],
        fingerprint: &Fingerprint,
        from: &mut usize,
    ) -> Option<&FileContent> {
        let nodes = &self.listing.nodes;
        while *from < nodes.len() && nodes[*from].name[..] < *name {
            *from += 1;
        }
        let node = nodes.get(*from).filter(|node| *node.name == *name)?;
        let NodeKind::File(was) = &node.kind else {
            return None;
        };
        let file = self.files.get(*from)?.as_ref()?;
        (was == fingerprint && file.cacheable.as_ref() == Some(fingerprint)).then_some(file)
    }

    /// `flags` (has_tree_deltas, uncached) when they are known already.
    fn of(
        listing: Arc<ScannedDir>,
        files: DirFiles,
        tree: DirTree,
        packs: Arc<[PackId]>,
        flags: Option<(bool, bool)>,
    ) -> Self {
        let (has_tree_deltas, uncached) = flags.unwrap_or_else(|| {
            let mut found = files.iter().flatten();
            (
                found.clone().any(FileContent::is_tree_delta),
                found.any(|f| f.cacheable.is_none()),
            )
        });
        Self {
            has_tree_deltas,
            uncached,
            listing,
            files,
            tree,
            packs,
        }
    }
}

/// The outcomes of a workspace's last checkpoint, by listing.
#[derive(Debug, Default)]
pub struct Memo {
    workspace: Option<WorkspaceId>,
    key_id: String,
    by_listing: FastMap<usize, DirOutcome>,
    /// The walk the listings are from, to find one by its path.
    walk: Option<Arc<Scan>>,
}

fn key(listing: &Arc<ScannedDir>) -> usize {
    Arc::as_ptr(listing) as usize
}

impl Memo {
    /// Remembers a checkpoint of `workspace` (tenant key `key_id`) cut from
    /// `scan`; the other slices are indexed like `scan.dirs`. What
    /// `previous` (the memo this checkpoint was cut with) says of a listing
    /// whose files this checkpoint took from it is not worked out again.
    pub fn new(
        workspace: WorkspaceId,
        key_id: String,
        scan: &Arc<Scan>,
        files: &[DirFiles],
        trees: &[DirTree],
        packs: &[Arc<[PackId]>],
        previous: Option<&Memo>,
    ) -> Self {
        let outcomes = scan.dirs.iter().zip(files).zip(trees).zip(packs);
        let by_listing = outcomes
            .map(|(((listing, files), tree), packs)| {
                let flags = previous
                    .and_then(|memo| memo.get(listing))
                    .filter(|was| Arc::ptr_eq(&was.files, files))
                    .map(|was| (was.has_tree_deltas, was.uncached));
                let outcome = DirOutcome::of(
                    listing.clone(),
                    files.clone(),
                    tree.clone(),
                    packs.clone(),
                    flags,
                );
                (key(listing), outcome)
            })
            .collect();
        Self {
            workspace: Some(workspace),
            key_id,
            by_listing,
            walk: Some(scan.clone()),
        }
    }

    /// What the newest checkpoint of `workspace` held for the listings of
    /// `scan`, as far as the fingerprint cache alone tells, nothing read: a
    /// directory is remembered when the cache knows every file in it as it
    /// is now, with every chunk committed, every subdirectory is remembered
    /// too, and its tree is one the cache places in a pack. Loose git trees
    /// stored as deltas are left to the checkpoint, which finds their bases.
    pub fn prime(
        workspace: WorkspaceId,
        scan: &Arc<Scan>,
        cache: &FingerprintCache,
        keys: &TenantKeys,
    ) -> Self {
        let mut trees: HashMap<&[u8], BlobId> = HashMap::new();
        let mut by_listing = FastMap::default();
        let mut path = Vec::new();
        for listing in scan.dirs.iter().rev() {
            let Some(KnownEntries { files, subtrees }) =
                known_entries(listing, cache, &trees, &mut path)
            else {
                continue;
            };
            let mut committed = true;
            let tree = DirTree::encode(listing, &files, subtrees, keys, &mut |id, _| {
                committed &= cache.knows_blob(&id);
            });
            if !committed {
                continue;
            }
            let located = packs_of(Vec::new(), files.iter().flatten(), &tree, |id| {
                cache.blob_pack(id)
            });
            let Ok(packs) = located else {
                continue;
            };
            trees.insert(&listing.path, tree.id);
            let outcome =
                DirOutcome::of(listing.clone(), Arc::new(files), tree, packs.into(), None);
            by_listing.insert(key(listing), outcome);
        }
        Self {
            workspace: Some(workspace),
            key_id: keys.key_id().to_owned(),
            by_listing,
            walk: Some(scan.clone()),
        }
    }

    /// Whether this memo is of `workspace` under tenant key `key_id`.
    pub fn is_of(&self, workspace: &WorkspaceId, key_id: &str) -> bool {
        self.workspace.as_ref() == Some(workspace) && self.key_id == key_id
    }

    /// What the last checkpoint found for this very listing.
    pub fn get(&self, listing: &Arc<ScannedDir>) -> Option<&DirOutcome> {
        self.by_listing
            .get(&key(listing))
            .filter(|outcome| Arc::ptr_eq(&outcome.listing, listing))
    }

    /// What the last checkpoint found for the directory at `path`, listed
    /// as it was then: for a directory listed again since, what it found
    /// for each file that is still the same.
    pub fn earlier(&self, path: &[u8]) -> Option<&DirOutcome> {
        self.get(self.walk.as_ref()?.listing(path)?)
    }

    /// How many listings it remembers.
    pub fn listings(&self) -> usize {
        self.by_listing.len()
    }
}

/// A directory's entries as the cache knows them.
struct KnownEntries {
    /// Per node, like [`DirFiles`].
    files: Vec<Option<FileContent>>,
    /// Per subdirectory, in entry order.
    subtrees: Vec<Option<BlobId>>,
}

/// The files of `listing` as the cache knows them, and its subdirectories'
/// trees; None when a file is not known as it is, or is a git tree stored
/// as a delta, or a subdirectory has no known tree.
fn known_entries(
    listing: &ScannedDir,
    cache: &FingerprintCache,
    trees: &HashMap<&[u8], BlobId>,
    path: &mut Vec<u8>,
) -> Option<KnownEntries> {
    let mut files = Vec::with_capacity(listing.nodes.len());
    let mut subtrees = Vec::new();
    for node in &listing.nodes {
        join_rel_into(path, &listing.path, &node.name);
        match &node.kind {
            NodeKind::File(fingerprint) => {
                let known = cache.lookup(path, fingerprint).filter(|known| {
                    !matches!(known.git, Some(GitStored::TreeDelta { .. }))
                        && known.chunks.iter().all(|c| cache.knows_blob(&c.id))
                })?;
                files.push(Some(FileContent {
                    chunks: known.chunks.clone(),
                    size: fingerprint.size,
                    meta: node.meta,
                    cacheable: Some(*fingerprint),
                    git: known.git,
                }));
            }
            NodeKind::Dir => {
                subtrees.push(Some(*trees.get(&path[..])?));
                files.push(None);
            }
            NodeKind::Symlink(_) => files.push(None),
        }
    }
    Some(KnownEntries { files, subtrees })
}

/// The packs holding a directory's file chunks, its tree and its pages, as
/// `locate` places them, after the packs already in `packs`; Err names a
/// blob it cannot place.
pub fn packs_of<'a, 'f>(
    mut packs: Vec<PackId>,
    files: impl Iterator<Item = &'f FileContent>,
    tree: &DirTree,
    locate: impl Fn(&BlobId) -> Option<&'a PackId>,
) -> Result<Vec<PackId>, BlobId> {
    let chunks = files.flat_map(|f| f.chunks.iter().map(|c| &c.id));
    let trees = std::iter::once(&tree.id).chain(&tree.pages);
    for id in chunks.chain(trees) {
        let pack = locate(id).ok_or(*id)?;
        if !packs.contains(pack) {
            packs.push(pack.clone());
        }
    }
    Ok(packs)
}
