//! What a checkpoint teaches the next ones: the fingerprint cache learns
//! which files are stable and which pack holds each blob, and a resident
//! runner's memo what was found per directory listing. The provider
//! ([`super::recall::Recall`]) decides when and where that is worked out.

use std::sync::Arc;
use std::time::Instant;

use cairn_proto::ids::{BlobId, PackId, WorkspaceId};

use super::content::Content;
use super::dir::{DirTree, FileContent};
use super::memo::Memo;
use crate::cache::{FastMap, FingerprintCache};
use crate::scan::{Scan, join_rel};

/// What a checkpoint worked out, for the cache and the memo.
#[derive(Debug)]
pub(crate) struct Learned {
    /// The walk it was cut from, before the limits left files out.
    pub walk: Arc<Scan>,
    /// Its root tree.
    pub root: BlobId,
    /// The fingerprint cache it was cut with; held by nothing else.
    pub cache: Arc<FingerprintCache>,
    /// What it held: the walk as the limits left it, and per directory of
    /// it, the files, the tree and the packs of both.
    pub scan: Arc<Scan>,
    pub content: Content,
    pub trees: Vec<DirTree>,
    pub packs: Vec<Arc<[PackId]>>,
    /// Blobs of this checkpoint found in the store or written to a new pack.
    pub located: FastMap<BlobId, PackId>,
    pub workspace: WorkspaceId,
    pub key_id: String,
    /// The memo it was cut with.
    pub memo: Option<Arc<Memo>>,
}

impl Learned {
    /// What it found per directory listing, for the next checkpoint.
    pub fn memo(&self) -> Memo {
        Memo::new(
            self.workspace.clone(),
            self.key_id.clone(),
            &self.scan,
            &self.content.files,
            &self.trees,
            &self.packs,
            self.memo.as_deref(),
        )
    }

    /// Teaches the cache what this committed checkpoint holds and saves
    /// it. A cache that cannot be saved only makes the next checkpoint
    /// slower. Returns the cache, for a resident runner to keep.
    pub fn save_cache(self) -> Option<FingerprintCache> {
        let Self {
            cache,
            scan,
            content,
            trees,
            located,
            ..
        } = self;
        let started = Instant::now();
        let Ok(mut cache) = Arc::try_unwrap(cache) else {
            tracing::warn!("the fingerprint cache is still in use; not updating it");
            return None;
        };
        let mut files = FastMap::default();
        for (dir, results) in scan.dirs.iter().zip(&content.files) {
            for (node, result) in dir.nodes.iter().zip(results.iter()) {
                if let Some(entry) = result.as_ref().and_then(FileContent::cache_entry) {
                    files.insert(join_rel(&dir.path, &node.name), entry);
                }
            }
        }
        cache.replace_files(files);
        // The cache places only this checkpoint's blobs: a pack only an older
        // checkpoint holds may be collected.
        let mut reachable: FastMap<BlobId, PackId> = FastMap::default();
        let chunks = content
            .files
            .iter()
            .flat_map(|files| files.iter().flatten());
        let ids = chunks.flat_map(|f| f.chunks.iter().map(|c| c.id));
        let tree_ids = trees
            .iter()
            .flat_map(|tree| std::iter::once(tree.id).chain(tree.pages.iter().copied()));
        for id in ids.chain(tree_ids) {
            if reachable.contains_key(&id) {
                continue;
            }
            // A blob a remembered directory holds that the cache forgot is
            // only read again by a later checkpoint that has no memo.
            if let Some(pack) = located.get(&id).or_else(|| cache.blob_pack(&id)) {
                reachable.insert(id, pack.clone());
            }
        }
        cache.forget_blobs();
        for (id, pack) in &reachable {
            cache.insert_blob(*id, pack);
        }
        if let Err(e) = cache.save() {
            tracing::warn!(error = %e, "cannot save the fingerprint cache; the next checkpoint reads every file");
        }
        tracing::debug!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            "fingerprint cache written"
        );
        // What the checkpoint read is dropped here too, off its path.
        drop(content);
        Some(cache)
    }
}
