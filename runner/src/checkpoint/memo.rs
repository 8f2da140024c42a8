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
//! Only what a committed checkpoint (or one found equal to the committed
//! one) held is remembered, so every blob it names is in a pack the store
//! keeps. A loose git tree stored as a delta is taken only while its base is
//! the one found again for this checkpoint. A checkpoint that redoes its
//! work after a refused commit uses no memo: a pack it names may be gone.

use std::collections::HashMap;
use std::sync::Arc;

use cairn_proto::ids::{BlobId, PackId, WorkspaceId};

use super::content::{DirFiles, FileContent};
use super::trees::{self, DirTree};
use crate::cache::{Cache, FastMap, Fingerprint};
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
        let node = nodes.get(*from).filter(|node| node.name == name)?;
        let NodeKind::File(was) = &node.kind else {
            return None;
        };
        let file = self.files.get(*from)?.as_ref()?;
        (was == fingerprint && file.cacheable.as_ref() == Some(fingerprint)).then_some(file)
    }

    fn of(listing: Arc<ScannedDir>, files: DirFiles, tree: DirTree, packs: Arc<[PackId]>) -> Self {
        Self {
            has_tree_deltas: files.iter().flatten().any(FileContent::is_tree_delta),
            uncached: files.iter().flatten().any(|f| f.cacheable.is_none()),
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
    /// The keys of `by_listing`, by the listing's path.
    by_path: Vec<(Arc<ScannedDir>, usize)>,
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
        scan: &Scan,
        files: &[DirFiles],
        trees: &[DirTree],
        packs: &[Arc<[PackId]>],
        previous: Option<&Memo>,
    ) -> Self {
        let outcomes = scan.dirs.iter().zip(files).zip(trees).zip(packs);
        let by_listing = outcomes
            .map(|(((listing, files), tree), packs)| {
                let taken = previous
                    .and_then(|memo| memo.get(listing))
                    .filter(|was| Arc::ptr_eq(&was.files, files));
                let outcome = match taken {
                    Some(was) => DirOutcome {
                        listing: listing.clone(),
                        files: files.clone(),
                        tree: tree.clone(),
                        packs: packs.clone(),
                        ..*was
                    },
                    None => {
                        DirOutcome::of(listing.clone(), files.clone(), tree.clone(), packs.clone())
                    }
                };
                (key(listing), outcome)
            })
            .collect();
        Self::with(workspace, key_id, by_listing)
    }

    fn with(
        workspace: WorkspaceId,
        key_id: String,
        by_listing: FastMap<usize, DirOutcome>,
    ) -> Self {
        let mut by_path: Vec<_> = by_listing
            .iter()
            .map(|(key, outcome)| (outcome.listing.clone(), *key))
            .collect();
        by_path.sort_unstable_by(|a, b| a.0.path.cmp(&b.0.path));
        Self {
            workspace: Some(workspace),
            key_id,
            by_listing,
            by_path,
        }
    }

    fn of(
        workspace: WorkspaceId,
        key_id: String,
        outcomes: impl Iterator<Item = (Arc<ScannedDir>, DirFiles, DirTree, Arc<[PackId]>)>,
    ) -> Self {
        let by_listing = outcomes
            .map(|(listing, files, tree, packs)| {
                let outcome = DirOutcome::of(listing, files, tree, packs);
                (key(&outcome.listing), outcome)
            })
            .collect();
        Self::with(workspace, key_id, by_listing)
    }

    /// What the newest checkpoint of `workspace` held for the listings of
    /// `scan`, as far as the fingerprint cache alone tells, nothing read: a
    /// directory is remembered when the cache knows every file in it as it
    /// is now, with every chunk committed, every subdirectory is remembered
    /// too, and its tree is one the cache places in a pack. Loose git trees
    /// stored as deltas are left to the checkpoint, which finds their bases.
    pub fn prime(workspace: WorkspaceId, scan: &Scan, cache: &Cache, keys: &TenantKeys) -> Self {
        let mut trees: HashMap<&[u8], BlobId> = HashMap::new();
        let mut outcomes = Vec::new();
        let mut path = Vec::new();
        for listing in scan.dirs.iter().rev() {
            let Some(KnownEntries { files, subtrees }) =
                known_entries(listing, cache, &trees, &mut path)
            else {
                continue;
            };
            let mut committed = true;
            let tree = trees::encode(listing, &files, subtrees, keys, &mut |id, _| {
                committed &= cache.knows_blob(&id);
            });
            if !committed {
                continue;
            }
            let located = packs_of(files.iter().flatten(), &tree, |id| cache.blob_pack(id));
            let Ok(packs) = located else {
                continue;
            };
            trees.insert(&listing.path, tree.id);
            outcomes.push((listing.clone(), Arc::new(files), tree, packs.into()));
        }
        Self::of(workspace, keys.key_id().to_owned(), outcomes.into_iter())
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
        let at = self
            .by_path
            .binary_search_by(|(listing, _)| listing.path[..].cmp(path))
            .ok()?;
        self.by_listing.get(&self.by_path[at].1)
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
    cache: &Cache,
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
/// `locate` places them; Err names a blob it cannot place.
pub fn packs_of<'a, 'f>(
    files: impl Iterator<Item = &'f FileContent>,
    tree: &DirTree,
    locate: impl Fn(&BlobId) -> Option<&'a PackId>,
) -> Result<Vec<PackId>, BlobId> {
    let chunks = files.flat_map(|f| f.chunks.iter().map(|c| &c.id));
    let trees = std::iter::once(&tree.id).chain(&tree.pages);
    let mut packs: Vec<PackId> = Vec::new();
    for id in chunks.chain(trees) {
        let pack = locate(id).ok_or(*id)?;
        if !packs.contains(pack) {
            packs.push(pack.clone());
        }
    }
    Ok(packs)
}
