//! Cutting a checkpoint.
//!
//! `Cut::attempt` runs the stages in order, each a module with its input
//! and output:
//!
//! ```text
//!  walk::walk               BeginCheckpoint ─► tenant keys, generation, parent    (remote)
//!    Walking ─► Walked      walk the root in parallel ──► git metadata, own thread (git)
//!  content::store_contents  per file: memo or cache knows it? reuse chunks : read, cut, hash
//!    Reading ─► Content        └─ new chunks, ~16 MiB batches ─► FindMissingBlobs
//!                                   └─ missing ones sealed in parallel ─► DATA packs ─► upload
//!  trees::store_trees       one tree per directory, deepest first ─► FindMissingBlobs
//!    Building ─► Trees         └─ missing trees sealed ─► META packs ─► upload
//!  upload::Store::finish    all uploads done (they start as packs fill, 4 at a time)
//!    ─► Uploaded
//!  commit::place            the pack of every blob the checkpoint reaches
//!  commit::commit           failpoint checkpoint-before-commit ─► CommitCheckpoint
//!    Committing, Learned    committed ─► the fingerprint cache learns stable files and
//!      ─► CheckpointReport  blob → pack (learn), a resident runner's memo what it found
//! ```
//!
//! The `upload::Store` that uploads is made before the content
//! stage and fed by it and by the trees stage: packs upload while later
//! batches are read. The stages ask a `recall::Recall` for all
//! that earlier checkpoints can spare them (the connection, the walk, the
//! repositories' last readings, the fingerprint cache, the memo) and hand
//! it what this one learned: `recall::OneShot` remembers
//! nothing, a [`Resident`] runner everything. The modules the stages share
//! depend on none of them: `dir` (a directory's files and tree), `memo`,
//! `treebases`, `remote`, `limits`.
//!
//! Memory stays bounded by the batch size, not the workspace: chunks the
//! cache or this checkpoint already know are dropped as soon as they are
//! hashed, a batch is sealed only after the store said which of its blobs it
//! lacks, and packs are written to spool files and streamed from there.
//!
//! A commit refused because a referenced pack is gone (the cache remembered
//! a pack that was collected, or the store lost it) is cut again with the
//! cache's blob map forgotten, which re-reads and re-asks about everything;
//! blobs the store still places in a pack the refusal named are sent again.
//! Further redos happen only while each refusal names a pack not seen before.
//!
//! [`checkpoint_if_changed`] cuts a checkpoint only when the workspace
//! differs from a known one (the runner's periodic checkpoints): the root
//! tree id is a keyed digest of the whole tree, so equal ids mean equal
//! content. Nothing new is uploaded for an unchanged workspace (every blob
//! is already in the store), and the commit is skipped. A resident runner
//! whose tracker saw no change since that checkpoint's walk settles it
//! right after the walk (`Recall::cut_from`), reading nothing.

mod commit;
mod content;
mod dir;
mod learn;
pub mod limits;
mod memo;
mod recall;
mod remote;
mod resident;
mod treebases;
mod trees;
mod upload;
mod walk;

use std::collections::HashSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use cairn_proto::domain::CheckpointReason;
use cairn_proto::ids::{BlobId, CheckpointId, Generation, PackId, WorkspaceId};
use cairn_proto::pb;
use cairn_proto::refusal::Refusal;
use cairn_proto::runs::CheckpointLimits;

use serde::Serialize;
use tonic::Code;

use self::learn::Learned;
use self::memo::Memo;
use self::recall::{Known, OneShot, Recall};
use self::remote::Session;
use self::upload::{Store, Uploaded};
use self::walk::Walked;
use crate::cache::FingerprintCache;
use crate::client::{ConnectError, CoordinatorClient};
use crate::git::RepoState;
use crate::scan::{self, ScanError, ScanOptions};
use cairn_utils::failpoint::FailpointError;

pub use self::resident::Resident;
use crate::transfer::TransferError;

/// What to checkpoint and where to send it.
#[derive(Debug, Clone)]
pub struct CheckpointOptions {
    /// Coordinator gRPC address, e.g. `http://127.0.0.1:7400`.
    pub coordinator: String,
    pub token: Option<String>,
    /// Workspace id or name.
    pub workspace: String,
    pub root: PathBuf,
    pub reason: CheckpointReason,
    /// Where the fingerprint cache and the spool live.
    pub cache_dir: PathBuf,
    /// Leave out what git ignores.
    pub skip_ignored: bool,
    /// Gitignore-style patterns relative to the root.
    pub excludes: Vec<String>,
    /// The attempt's generation (None: the workspace's current one).
    pub generation: Option<Generation>,
    /// The harness session the checkpoint belongs to, if any.
    pub harness: Option<pb::HarnessSession>,
    /// What one checkpoint may hold; files above are left out, with warnings.
    pub limits: CheckpointLimits,
    /// What a resident runner keeps between checkpoints (None: every
    /// checkpoint walks the whole workspace and loads the cache from disk).
    pub resident: Option<Arc<Resident>>,
}

impl CheckpointOptions {
    /// The walk of `root` (resolved) that these options ask for, leaving
    /// out the cache directory `cache_dir` (canonical) if it lies inside.
    pub fn scan_options(&self, root: &Path, cache_dir: &Path) -> ScanOptions {
        ScanOptions {
            root: root.to_path_buf(),
            skip_ignored: self.skip_ignored,
            excludes: self.excludes.clone(),
            exclude_paths: vec![cache_dir.to_path_buf()],
        }
    }
}

/// Sizes and counts of one checkpoint (the `stats` of the JSON output).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    /// Logical size of all file contents.
    pub total_bytes: u64,
    /// Files whose contents were read (not known from the fingerprint cache).
    pub files_read: u64,
    pub bytes_read: u64,
    /// Blobs the store did not have, and their plaintext bytes.
    pub new_blobs: u64,
    pub new_bytes: u64,
    /// Sealed pack bytes uploaded.
    pub uploaded_bytes: u64,
    pub packs_uploaded: u32,
    pub duration_ms: u64,
    /// The part of `duration_ms` spent waiting for uploads to finish (all
    /// upload slots busy, or the last packs still on their way).
    pub upload_wait_ms: u64,
    /// When the walk began ([`pb::CheckpointStats::scan_started_at`]).
    #[serde(skip)]
    pub scan_started: Option<std::time::SystemTime>,
}

impl From<&Stats> for pb::CheckpointStats {
    fn from(s: &Stats) -> Self {
        Self {
            files: s.files,
            directories: s.directories,
            symlinks: s.symlinks,
            total_bytes: s.total_bytes,
            files_read: s.files_read,
            bytes_read: s.bytes_read,
            new_blobs: s.new_blobs,
            new_bytes: s.new_bytes,
            uploaded_bytes: s.uploaded_bytes,
            packs_uploaded: s.packs_uploaded,
            duration_ms: s.duration_ms,
            scan_started_at: s.scan_started.map(cairn_proto::domain::to_timestamp),
        }
    }
}

/// A committed checkpoint (the JSON output of `cairn-runner checkpoint`).
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointReport {
    pub checkpoint_id: CheckpointId,
    pub workspace_id: WorkspaceId,
    pub sequence: u64,
    pub reason: CheckpointReason,
    pub stats: Stats,
    pub warnings: Vec<String>,
    pub repos: Vec<RepoState>,
    /// Keyed id of the root tree (not part of the JSON output).
    #[serde(skip)]
    pub root_tree: BlobId,
}

/// A committed checkpoint that a later one is compared with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Baseline {
    pub checkpoint_id: CheckpointId,
    pub root_tree: BlobId,
}

/// Why a checkpoint was not committed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Scan(#[from] ScanError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("workspace {0} not found")]
    WorkspaceNotFound(String),
    #[error("{call} failed: {} ({:?})", .status.message(), .status.code())]
    Rpc {
        call: &'static str,
        status: tonic::Status,
    },
    #[error("the coordinator's answer to {call} is unusable: {reason}")]
    BadResponse { call: &'static str, reason: String },
    #[error("cache directory {path}: {source}")]
    CacheDir { path: PathBuf, source: io::Error },
    #[error("spool file {path}: {source}")]
    Spool { path: PathBuf, source: io::Error },
    #[error("uploading pack {pack}: {source}")]
    Upload { pack: PackId, source: TransferError },
    #[error("blob {0} of this checkpoint is in no known pack")]
    UnlocatedBlob(BlobId),
    #[error(transparent)]
    Failpoint(#[from] FailpointError),
    #[error("{0}")]
    Task(String),
}

impl CheckpointError {
    /// Whether running the same checkpoint again later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Connect(ConnectError::Unreachable { .. }) => true,
            Self::Rpc { status, .. } => {
                matches!(
                    status.code(),
                    Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted
                ) || remote::cut_off(status)
            }
            Self::Upload { source, .. } => {
                source.is_retryable() || matches!(source, TransferError::Forbidden { .. })
            }
            _ => false,
        }
    }

    /// The coordinator's typed reason for refusing a call, if it gave one.
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            Self::Rpc { status, .. } => Refusal::of(status),
            _ => None,
        }
    }

    /// The coordinator refused the commit because a referenced pack is not
    /// in the store (the cache named a pack that has been collected).
    pub fn is_missing_pack(&self) -> bool {
        matches!(
            self,
            Self::Rpc {
                call: "CommitCheckpoint",
                ..
            }
        ) && matches!(self.refusal(), Some(Refusal::PacksMissing { .. }))
    }

    /// The packs a missing-pack refusal names.
    pub fn named_packs(&self) -> Vec<PackId> {
        match self.refusal() {
            Some(Refusal::PacksMissing { packs }) => packs,
            _ => Vec::new(),
        }
    }

    /// The coordinator fenced this writer: a newer attempt owns the
    /// workspace, this attempt is no longer current, or the workspace was
    /// finished or deleted under it.
    pub fn is_fenced(&self) -> bool {
        matches!(
            self.refusal(),
            Some(
                Refusal::StaleGeneration { .. }
                    | Refusal::AttemptNotCurrent { .. }
                    | Refusal::WorkspaceNotActive { .. }
            )
        )
    }
}

/// Redos after a commit refused for a lost pack (each must name a new pack).
const MAX_REDOS: u32 = 3;

/// Cuts a checkpoint of `opts.root` and commits it.
pub async fn checkpoint(opts: CheckpointOptions) -> Result<CheckpointReport, CheckpointError> {
    let report = cut(opts, None).await?;
    Ok(report.expect("without a baseline every checkpoint is committed"))
}

/// Cuts a checkpoint of `opts.root` and commits it, unless the workspace's
/// newest checkpoint is still `baseline` and the content has not changed
/// since (then `None`).
pub async fn checkpoint_if_changed(
    opts: CheckpointOptions,
    baseline: &Baseline,
) -> Result<Option<CheckpointReport>, CheckpointError> {
    cut(opts, Some(baseline)).await
}

async fn cut(
    opts: CheckpointOptions,
    baseline: Option<&Baseline>,
) -> Result<Option<CheckpointReport>, CheckpointError> {
    match opts.resident.clone() {
        Some(resident) => cut_with(&resident, &opts, baseline).await,
        None => cut_with(&OneShot, &opts, baseline).await,
    }
}

/// Cuts the checkpoint with what `recall` remembers, again while the
/// commit is refused for a pack that is gone (see the module doc).
async fn cut_with(
    recall: &impl Recall,
    opts: &CheckpointOptions,
    baseline: Option<&Baseline>,
) -> Result<Option<CheckpointReport>, CheckpointError> {
    let started = Instant::now();
    let root = scan::resolve_root(&opts.root)?;
    scan::exclude_matcher(&root, &opts.excludes)?;
    let coordinator = recall
        .coordinator(&opts.coordinator, opts.token.as_deref())
        .await?;
    let cut = Cut {
        recall,
        coordinator: &coordinator,
        opts,
        root: &root,
        baseline,
        started,
    };
    let mut lost: HashSet<PackId> = HashSet::new();
    let mut redos = 0;
    loop {
        match cut.attempt(redos > 0, &lost).await {
            Err(e) if e.is_missing_pack() && redos < MAX_REDOS => {
                let named = e.named_packs();
                if redos > 0 && named.iter().all(|p| lost.contains(p)) {
                    return Err(e);
                }
                tracing::warn!(error = %e, "a pack this checkpoint relied on is gone; checkpointing again without it");
                lost.extend(named);
                redos += 1;
            }
            other => return other,
        }
    }
}

/// One checkpoint being cut: what each attempt at it shares.
struct Cut<'a, R> {
    recall: &'a R,
    coordinator: &'a CoordinatorClient,
    opts: &'a CheckpointOptions,
    /// The root, resolved.
    root: &'a Path,
    /// Commit only if the workspace differs from this one.
    baseline: Option<&'a Baseline>,
    started: Instant,
}

impl<R: Recall> Cut<'_, R> {
    /// Cuts the checkpoint, stage by stage (see the module doc). A redo
    /// (`redo`) trusts no blob the cache or the memo places, and sends
    /// again every blob the store places in a `lost` pack.
    async fn attempt(
        &self,
        redo: bool,
        lost: &HashSet<PackId>,
    ) -> Result<Option<CheckpointReport>, CheckpointError> {
        let Self {
            recall,
            coordinator,
            opts,
            root,
            baseline,
            started,
        } = *self;
        let ms = || started.elapsed().as_millis() as u64;
        let cache_dir = cache_dir(opts)?;

        // BeginCheckpoint and the walk; git metadata on a thread of its own.
        let walking = walk::Walking {
            coordinator,
            opts,
            root,
            cache_dir: &cache_dir,
            only_if_changed: baseline.is_some(),
            started,
        };
        let Walked {
            session,
            spool,
            walk,
            repos,
        } = walk::walk(recall, walking).await?;
        if let Some(baseline) = baseline
            && session.parent.as_ref() == Some(&baseline.checkpoint_id)
            && recall.cut_from(baseline, &walk)
        {
            // The very walk the newest checkpoint was cut from: nothing to read.
            tracing::debug!(parent = ?session.parent, elapsed_ms = ms(), "no change since the last checkpoint; nothing committed");
            return Ok(None);
        }
        let repos = repos.follow(recall, &walk).await;
        let (cache, memo) = known(recall, &cache_dir, &session, redo, started).await;
        let (scan, limit_warnings) = limits::apply(walk.clone(), &opts.limits);

        // Contents, then trees; their packs upload as they fill.
        let mut store = Store::new(&session, &spool, lost);
        let reading = content::Reading {
            scan: scan.clone(),
            cache: cache.clone(),
            memo: memo.clone(),
            keys: session.keys.clone(),
            git_trees: repos.trees(),
            started,
        };
        let content = content::store_contents(&mut store, reading).await?;
        let building = trees::Building {
            scan: scan.clone(),
            content,
            cache: cache.clone(),
            memo: memo.clone(),
            keys: session.keys.clone(),
            started,
        };
        let (mut trees, content) = trees::store_trees(&mut store, building).await?;
        let Uploaded {
            new_packs,
            located,
            stats,
        } = store.finish(started).await?;

        // The commit, unless the workspace is the baseline's.
        let placed = commit::place(&scan, &content, &trees, &located, &cache, memo.as_deref())?;
        let inspected = repos.finish(recall, &walk, started).await;
        let learned = Learned {
            walk,
            root: trees.root,
            cache,
            scan,
            content,
            trees: std::mem::take(&mut trees.dirs),
            packs: placed.per_dir,
            located,
            workspace: session.workspace_id.clone(),
            key_id: session.keys.key_id().to_owned(),
            memo,
        };
        if let Some(baseline) = baseline
            && session.parent.as_ref() == Some(&baseline.checkpoint_id)
            && baseline.root_tree == trees.root
        {
            tracing::debug!(parent = ?session.parent, elapsed_ms = ms(), "workspace unchanged; nothing committed");
            recall.unchanged(baseline.clone(), learned).await;
            return Ok(None);
        }
        let committing = commit::Committing {
            session: &session,
            opts,
            trees: &trees,
            stats,
            new_packs,
            referenced: &placed.referenced,
            repos: inspected.repos,
            limit_warnings,
            git_warnings: inspected.warnings,
            started,
        };
        let report = commit::commit(recall, committing, learned).await?;
        drop(spool);
        Ok(Some(report))
    }
}

/// The cache directory, made if need be, canonical.
fn cache_dir(opts: &CheckpointOptions) -> Result<PathBuf, CheckpointError> {
    let cache_dir_error = |source| CheckpointError::CacheDir {
        path: opts.cache_dir.clone(),
        source,
    };
    fs::create_dir_all(&opts.cache_dir).map_err(cache_dir_error)?;
    fs::canonicalize(&opts.cache_dir).map_err(cache_dir_error)
}

/// What earlier checkpoints tell this one; a redo after a refused commit
/// trusts no blob they place (a remembered pack may be gone).
async fn known(
    recall: &impl Recall,
    cache_dir: &Path,
    session: &Session,
    redo: bool,
    started: Instant,
) -> (Arc<FingerprintCache>, Option<Arc<Memo>>) {
    let Known { mut cache, memo } = recall
        .known(cache_dir, &session.workspace_id, session.keys.key_id())
        .await;
    if redo {
        // Which of the remembered blobs sat in a lost pack is not known.
        cache.forget_blobs();
    }
    tracing::debug!(
        files = cache.file_count(),
        blobs = cache.blob_count(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "fingerprint cache loaded"
    );
    (Arc::new(cache), memo.filter(|_| !redo))
}

/// The newest checkpoint of a workspace: what a later one is compared
/// with, and whose fingerprint cache a resident runner can load early.
#[derive(Debug, Clone)]
pub struct Newest {
    pub baseline: Baseline,
    pub workspace_id: WorkspaceId,
    pub key_id: String,
}

/// The workspace's newest checkpoint (None: it has none).
pub async fn newest_checkpoint(
    options: &CheckpointOptions,
) -> Result<Option<Newest>, CheckpointError> {
    let coordinator =
        CoordinatorClient::connect_retrying(&options.coordinator, options.token.as_deref()).await?;
    let listed = coordinator
        .checkpoints
        .clone()
        .list_checkpoints(pb::ListCheckpointsRequest {
            workspace: options.workspace.clone(),
            page_size: 1,
            page_token: String::new(),
        })
        .await
        .map_err(|status| match status.code() {
            Code::NotFound => CheckpointError::WorkspaceNotFound(options.workspace.clone()),
            _ => CheckpointError::Rpc {
                call: "ListCheckpoints",
                status,
            },
        })?
        .into_inner();
    let Some(newest) = listed.checkpoints.into_iter().next() else {
        return Ok(None);
    };
    let bad = |what: &str, e: &dyn std::fmt::Display| CheckpointError::BadResponse {
        call: "ListCheckpoints",
        reason: format!("checkpoint {} has a malformed {what}: {e}", newest.id),
    };
    let root_tree = BlobId::from_slice(&newest.root_tree).map_err(|e| bad("root tree", &e))?;
    let workspace_id = newest
        .workspace_id
        .parse()
        .map_err(|e| bad("workspace id", &e))?;
    Ok(Some(Newest {
        baseline: Baseline {
            checkpoint_id: newest.id.parse().map_err(|e| bad("id", &e))?,
            root_tree,
        },
        workspace_id,
        key_id: newest.key_id,
    }))
}

/// Readies a resident runner (`opts.resident`) for its first checkpoint
/// of `workspace`, whose newest checkpoint is under tenant key `key_id`:
/// loads the fingerprint cache and works out what that checkpoint holds per
/// listing (see [`Resident::preload`]), in the background. When the
/// coordinator cannot say which tenant key hashes the trees, only the cache
/// is loaded.
pub async fn prime(
    opts: &CheckpointOptions,
    workspace: WorkspaceId,
    key_id: String,
    cache_dir: PathBuf,
) {
    let Some(resident) = &opts.resident else {
        return;
    };
    let session =
        match CoordinatorClient::connect_retrying(&opts.coordinator, opts.token.as_deref()).await {
            Ok(coordinator) => Session::begin(&coordinator, &opts.workspace, opts.generation)
                .await
                .ok(),
            Err(_) => None,
        };
    let memo_from = match (session, scan::resolve_root(&opts.root)) {
        (Some(session), Ok(root))
            if session.workspace_id == workspace && session.keys.key_id() == key_id =>
        {
            Some((session.keys, opts.scan_options(&root, &cache_dir)))
        }
        _ => None,
    };
    resident
        .preload(cache_dir, workspace, key_id, memo_from)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_refused_for_a_missing_pack_is_told_apart_by_its_refusal() {
        let pack: PackId = "0123abcd".repeat(8).parse().unwrap();
        let missing = CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: Refusal::PacksMissing {
                packs: vec![pack.clone()],
            }
            .into_status("reworded at will"),
        };
        assert!(missing.is_missing_pack() && !missing.is_fenced());
        assert_eq!(missing.named_packs(), std::slice::from_ref(&pack));
        let worded = CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: tonic::Status::failed_precondition(format!(
                "pack {pack} is not in the store (never uploaded, or lost)"
            )),
        };
        assert!(
            !worded.is_missing_pack() && worded.named_packs().is_empty() && !worded.is_fenced(),
            "the message is never read"
        );
        let stale = CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: Refusal::StaleGeneration {
                given: cairn_proto::ids::Generation(2),
                current: cairn_proto::ids::Generation(3),
            }
            .into_status("pack pack pack"),
        };
        assert!(!stale.is_missing_pack() && stale.is_fenced());
        let unavailable = CheckpointError::Rpc {
            call: "FindMissingBlobs",
            status: tonic::Status::unavailable("down"),
        };
        assert!(unavailable.is_retryable() && !stale.is_retryable());
    }

    #[test]
    fn a_call_cut_off_in_the_transport_is_retried_and_a_sent_unknown_is_not() {
        let broken = std::io::Error::new(io::ErrorKind::ConnectionReset, "connection reset");
        let cut = CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: tonic::Status::from_error(Box::new(broken)),
        };
        assert!(cut.is_retryable(), "a reset connection is retried");
        let sent = CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: tonic::Status::unknown("the coordinator said so"),
        };
        assert!(
            !sent.is_retryable(),
            "a status the coordinator sent is final"
        );
    }
}
