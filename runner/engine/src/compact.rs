//! Compaction: rewriting data packs that are mostly dead.
//!
//! A checkpoint references whole packs, and a pack stays as long as any
//! kept checkpoint references it, so a pack holding one live file among
//! many dead ones keeps them all. Only a holder of the keys can tell live
//! blobs from dead (they are named in encrypted trees), so compaction runs
//! here, where the key is, never in the coordinator. [`compact`]:
//!
//! 1. walks the trees of every checkpoint of the workspace (through their
//!    restore manifests, with the restore's own checks) to learn which
//!    blobs are live;
//! 2. reads the index of every DATA pack they reference and works out its
//!    live share (sealed bytes of live blobs over all of them);
//! 3. for each pack whose share is below the threshold, copies its live
//!    sealed blobs as they are (no decryption: a blob is sealed to its id,
//!    not to its pack) into new packs of the same key, uploads them through
//!    signed URLs, and
//! 4. asks the coordinator to record them and move the references of the
//!    walked checkpoints from each old pack to its new ones
//!    (CompactPacks), in one transaction.
//!
//! It is crash-safe by order: new packs are uploaded, then recorded, before
//! anything refers to them and before the old packs lose a reference; a
//! crash before the record leaves uploads no commit recorded (garbage
//! collection deletes them after its grace), and the old packs go only
//! when garbage collection finds them unreferenced. META packs (trees) are
//! left whole: they are small, and every tree of a kept checkpoint is live.
//!
//! Nothing of it is on a checkpoint's path: it is an operator's job
//! (`cairnctl compact`), run when `cairnctl gc` leaves more stored than the
//! kept checkpoints need.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;
use cairn_proto::domain::PackKind;
use cairn_proto::ids::{BlobId, CheckpointId, PackId};
use cairn_proto::pb;
use cairn_utils::failpoint;

use crate::client::CoordinatorClient;
use crate::format::{FinishedPack, PackBuilder, TenantKeys};
use crate::restore::fetch::{self, PackFetcher};
use crate::restore::{
    Manifest, ManifestError, MetaBlobs, PackInfo, PlanError, TreeBounds, build_plan,
};
use crate::task::blocking;
use crate::transfer::{BlobTransfer, TransferError};

/// Where compaction stops after uploading its packs, before recording them.
pub const FAILPOINT_BEFORE_RECORD: &str = "compact-before-record";

/// New packs are closed at about this size.
const TARGET_PACK_BYTES: u64 = 32 << 20;

/// What to compact, and how eagerly.
#[derive(Debug, Clone)]
pub struct CompactOptions {
    /// Workspace id or name.
    pub workspace: String,
    /// A data pack whose live share (by sealed bytes) is below this is
    /// rewritten (0.0–1.0; 0.5: more dead than live).
    pub threshold: f64,
    /// Only say what would be rewritten.
    pub dry_run: bool,
}

/// What a compaction did (or, dry, would do).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CompactReport {
    pub dry_run: bool,
    /// Checkpoints whose trees were walked.
    pub checkpoints: usize,
    /// Data packs they reference, and their bytes.
    pub data_packs: usize,
    pub data_bytes: u64,
    /// Of those, sealed bytes of live blobs.
    pub live_bytes: u64,
    /// Packs rewritten, their bytes, and the bytes of the packs that
    /// replace them.
    pub packs_rewritten: usize,
    pub bytes_rewritten: u64,
    pub bytes_written: u64,
    pub new_packs: usize,
    /// Checkpoints whose references moved to the new packs.
    pub checkpoints_updated: u32,
}

/// Why a compaction stopped. Nothing is recorded unless it succeeds.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    #[error("{call}: {status}")]
    Rpc {
        call: &'static str,
        status: tonic::Status,
    },
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error("checkpoint {checkpoint}: {reason}")]
    Checkpoint { checkpoint: String, reason: String },
    #[error("checkpoint {checkpoint}: its trees cannot be read: {source}")]
    Trees {
        checkpoint: CheckpointId,
        source: PlanError,
    },
    #[error(transparent)]
    Index(#[from] fetch::IndexError),
    #[error(transparent)]
    Fetch(#[from] fetch::FetchError),
    #[error(transparent)]
    Corrupt(#[from] fetch::CorruptPack),
    #[error("uploading pack {pack}: {source}")]
    Upload { pack: PackId, source: TransferError },
    #[error("writing a pack: {0}")]
    Write(#[from] std::io::Error),
    #[error("the coordinator gave no upload URL for pack {0}")]
    NoUploadUrl(PackId),
    #[error("threshold {0} is not between 0 and 1")]
    BadThreshold(f64),
    #[error(transparent)]
    Failpoint(#[from] failpoint::FailpointError),
}

fn rpc(call: &'static str) -> impl FnOnce(tonic::Status) -> CompactError {
    move |status| CompactError::Rpc { call, status }
}

/// A data pack as the walk found it.
struct DataPack {
    info: PackInfo,
    keys: Arc<TenantKeys>,
    /// A checkpoint whose manifest signs a URL for it.
    via: CheckpointId,
    entries: Vec<crate::format::IndexEntry>,
}

/// The live blobs of every checkpoint of the workspace, and the data packs
/// they reference.
struct Walked {
    checkpoints: Vec<CheckpointId>,
    live: HashSet<BlobId>,
    data: BTreeMap<PackId, DataPack>,
}

/// The restore manifest of `checkpoint` alone, and the request that
/// produced it (for fresh URLs).
async fn manifest_of(
    coordinator: &CoordinatorClient,
    workspace: &str,
    checkpoint: &str,
) -> Result<(Manifest, pb::GetRestoreManifestRequest), CompactError> {
    let request = manifest_request(workspace, checkpoint);
    let manifest = coordinator
        .checkpoints
        .clone()
        .get_restore_manifest(request.clone())
        .await
        .map_err(rpc("GetRestoreManifest"))?
        .into_inner();
    Ok((Manifest::parse(manifest)?, request))
}

fn manifest_request(workspace: &str, checkpoint: &str) -> pb::GetRestoreManifestRequest {
    pb::GetRestoreManifestRequest {
        workspace: workspace.to_owned(),
        checkpoint_id: checkpoint.to_owned(),
        max_candidates: 1,
    }
}

async fn walk(
    coordinator: &CoordinatorClient,
    transfer: &BlobTransfer,
    workspace: &str,
) -> Result<Walked, CompactError> {
    let mut walked = Walked {
        checkpoints: Vec::new(),
        live: HashSet::new(),
        data: BTreeMap::new(),
    };
    let checkpoints = coordinator
        .all_checkpoints(workspace)
        .await
        .map_err(rpc("ListCheckpoints"))?;
    for checkpoint in checkpoints {
        let (manifest, request) = manifest_of(coordinator, workspace, &checkpoint.id).await?;
        let candidate = manifest
            .candidates
            .iter()
            .find(|c| c.id == checkpoint.id)
            .ok_or_else(|| CompactError::Checkpoint {
                checkpoint: checkpoint.id.clone(),
                reason: "the coordinator has no restore manifest for it".into(),
            })?;
        let resolved = manifest
            .resolve(candidate)
            .map_err(|reason| CompactError::Checkpoint {
                checkpoint: checkpoint.id.clone(),
                reason,
            })?;
        let fetcher = PackFetcher::new(
            transfer.clone(),
            coordinator,
            request,
            manifest.urls.clone(),
        );
        let mut meta = MetaBlobs::new();
        for info in &resolved.packs {
            match info.kind {
                PackKind::Meta => {
                    let (bytes, index) =
                        fetch::fetch_whole_pack(&fetcher, info, &resolved.keys).await?;
                    meta.add_pack(bytes, &index);
                }
                PackKind::Data if !walked.data.contains_key(&info.id) => {
                    let index = fetch::fetch_index(&fetcher, info, &resolved.keys).await?;
                    walked.data.insert(
                        info.id.clone(),
                        DataPack {
                            info: info.clone(),
                            keys: resolved.keys.clone(),
                            via: resolved.id.clone(),
                            entries: index.entries,
                        },
                    );
                }
                PackKind::Data => {}
            }
        }
        let (keys, root, id) = (
            resolved.keys.clone(),
            resolved.root_tree,
            resolved.id.clone(),
        );
        let chunks = blocking(move || {
            build_plan(&meta, &keys, root, &TreeBounds::default())
                .map(|plan| plan.chunks().map(|c| c.id).collect::<Vec<_>>())
        })
        .await
        .map_err(|source| CompactError::Trees {
            checkpoint: id,
            source,
        })?;
        walked.live.extend(chunks);
        walked.checkpoints.push(resolved.id);
    }
    Ok(walked)
}

/// New packs being filled, one per key.
struct Rewriter {
    keys: Arc<TenantKeys>,
    open: Option<PackBuilder<Vec<u8>>>,
    /// Blobs already copied into a pack of this key, and which.
    placed: HashMap<BlobId, usize>,
    finished: Vec<FinishedPack<Vec<u8>>>,
}

impl Rewriter {
    fn new(keys: Arc<TenantKeys>) -> Self {
        Self {
            keys,
            open: None,
            placed: HashMap::new(),
            finished: Vec::new(),
        }
    }

    /// Copies one live sealed blob; returns the ordinal of the new pack it
    /// is (or already was) in.
    fn copy(&mut self, id: BlobId, sealed: &[u8], plain_len: u32) -> std::io::Result<usize> {
        if let Some(&ordinal) = self.placed.get(&id) {
            return Ok(ordinal);
        }
        if self
            .open
            .as_ref()
            .is_some_and(|p| p.len() >= TARGET_PACK_BYTES)
        {
            self.close()?;
        }
        if self.open.is_none() {
            self.open = Some(PackBuilder::new(PackKind::Data, Vec::new())?);
        }
        self.open
            .as_mut()
            .expect("a pack is open")
            .add(id, sealed, plain_len)?;
        let ordinal = self.finished.len();
        self.placed.insert(id, ordinal);
        Ok(ordinal)
    }

    fn close(&mut self) -> std::io::Result<()> {
        if let Some(pack) = self.open.take().filter(|p| !p.is_empty()) {
            self.finished.push(pack.finish(&self.keys)?);
        }
        Ok(())
    }
}

/// Compacts the data packs of `opts.workspace` whose live share is below
/// `opts.threshold` (see the module doc).
pub async fn compact(
    coordinator: &CoordinatorClient,
    transfer: &BlobTransfer,
    opts: &CompactOptions,
) -> Result<CompactReport, CompactError> {
    if !(0.0..=1.0).contains(&opts.threshold) {
        return Err(CompactError::BadThreshold(opts.threshold));
    }
    let walked = walk(coordinator, transfer, &opts.workspace).await?;
    let mut report = CompactReport {
        dry_run: opts.dry_run,
        checkpoints: walked.checkpoints.len(),
        data_packs: walked.data.len(),
        ..CompactReport::default()
    };
    let mut candidates = Vec::new();
    for (id, pack) in &walked.data {
        let total: u64 = pack.entries.iter().map(|e| u64::from(e.sealed_len)).sum();
        let live: u64 = pack
            .entries
            .iter()
            .filter(|e| walked.live.contains(&e.id))
            .map(|e| u64::from(e.sealed_len))
            .sum();
        report.data_bytes += pack.info.size;
        report.live_bytes += live;
        if total > 0 && (live as f64) < opts.threshold * total as f64 {
            candidates.push(id.clone());
            report.packs_rewritten += 1;
            report.bytes_rewritten += pack.info.size;
        }
    }
    if candidates.is_empty() || opts.dry_run {
        return Ok(report);
    }

    // Copy the live blobs of each candidate into new packs of its key.
    let mut rewriters: BTreeMap<String, Rewriter> = BTreeMap::new();
    // Old pack → (key id, ordinals of the new packs its live blobs went to).
    let mut moved: Vec<(PackId, String, HashSet<usize>)> = Vec::new();
    for id in &candidates {
        let pack = &walked.data[id];
        let (manifest, request) =
            manifest_of(coordinator, &opts.workspace, pack.via.as_str()).await?;
        let fetcher = PackFetcher::new(transfer.clone(), coordinator, request, manifest.urls);
        let bytes: Bytes = fetcher.get(id).await?;
        let (info, keys) = (pack.info.clone(), pack.keys.clone());
        let checked = bytes.clone();
        let index = blocking(move || fetch::open_whole_pack(&info, &checked, &keys)).await?;
        let key_id = pack.keys.key_id().to_owned();
        let rewriter = rewriters
            .entry(key_id.clone())
            .or_insert_with(|| Rewriter::new(pack.keys.clone()));
        let mut ordinals = HashSet::new();
        for entry in index.entries.iter().filter(|e| walked.live.contains(&e.id)) {
            let start = entry.offset as usize;
            let sealed = &bytes[start..start + entry.sealed_len as usize];
            ordinals.insert(rewriter.copy(entry.id, sealed, entry.plain_len)?);
        }
        moved.push((id.clone(), key_id, ordinals));
    }
    for rewriter in rewriters.values_mut() {
        rewriter.close()?;
    }

    // Upload them through signed URLs.
    let new_packs: Vec<&FinishedPack<Vec<u8>>> =
        rewriters.values().flat_map(|r| &r.finished).collect();
    let urls = coordinator
        .checkpoints
        .clone()
        .prepare_uploads(pb::PrepareUploadsRequest {
            workspace: opts.workspace.clone(),
            packs: new_packs
                .iter()
                .map(|p| pb::PackUpload {
                    pack_id: p.id.to_string(),
                    size: p.size,
                    kind: pb::PackKind::from(p.kind) as i32,
                })
                .collect(),
        })
        .await
        .map_err(rpc("PrepareUploads"))?
        .into_inner()
        .urls;
    for pack in &new_packs {
        let url = urls
            .iter()
            .find(|u| u.pack_id == pack.id.as_str())
            .ok_or_else(|| CompactError::NoUploadUrl(pack.id.clone()))?;
        transfer
            .put(&url.url, &url.headers, Bytes::from(pack.sink.clone()))
            .await
            .map_err(|source| CompactError::Upload {
                pack: pack.id.clone(),
                source,
            })?;
        report.bytes_written += pack.size;
    }
    report.new_packs = new_packs.len();
    failpoint::hit(FAILPOINT_BEFORE_RECORD)?;

    // Record them, and move the walked checkpoints' references.
    let replacements = moved
        .iter()
        .map(|(old, key_id, ordinals)| {
            let finished = &rewriters[key_id].finished;
            let mut news: Vec<String> = ordinals
                .iter()
                .map(|&o| finished[o].id.to_string())
                .collect();
            news.sort();
            pb::PackReplacement {
                old_pack_id: old.to_string(),
                new_pack_ids: news,
            }
        })
        .collect();
    let compacted = coordinator
        .checkpoints
        .clone()
        .compact_packs(pb::CompactPacksRequest {
            workspace: opts.workspace.clone(),
            new_packs: new_packs
                .iter()
                .map(|p| pb::NewPack {
                    pack_id: p.id.to_string(),
                    kind: pb::PackKind::from(p.kind) as i32,
                    size: p.size,
                    index_offset: p.index_offset,
                    index_length: p.index_length,
                    blob_ids: p.blob_ids.iter().map(|b| b.as_bytes().to_vec()).collect(),
                })
                .collect(),
            replacements,
            checkpoint_ids: walked.checkpoints.iter().map(ToString::to_string).collect(),
        })
        .await
        .map_err(rpc("CompactPacks"))?
        .into_inner();
    report.checkpoints_updated = compacted.checkpoints_updated;
    Ok(report)
}
