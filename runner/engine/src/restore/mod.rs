//! Restoring a checkpoint into a directory, verified, newest-first.
//!
//! ```text
//! GetRestoreManifest ─► candidates, newest first (or exactly --checkpoint)
//!   for each candidate until one succeeds:
//!     at once: META packs, whole ─► verify ─► trees ─► plan (plan.rs:
//!                                                 refuses unsafe entries)
//!              DATA pack indexes (ranged GETs)
//!              the runner's fingerprint cache (which files need no write)
//!     every chunk located
//!     ── nothing has been written up to here ──
//!     survey, prepare, download + write, git trees rebuilt   (apply.rs)
//!     at once: finish (links, directory metadata) and the fingerprint
//!              cache saved (written straight from the plan, no map built)
//!     the plan, maps and cache freed on a thread of their own, unwaited
//!   (with a host pack cache, packcache.rs, every read above tries the cache
//!    first; cached bytes pass the same checks, and what fails them is
//!    dropped and fetched from the store)
//!   a failure of the checkpoint's own (corrupt or missing pack, bad tree,
//!   blob that does not verify) is recorded and the next candidate restores
//!   over what the failed one left; a local failure (disk full, permission)
//!   stops the restore, since an older checkpoint would not fix it
//! the fingerprint cache records what was written, so the next checkpoint
//! does not read the restored files again
//! ```
//!
//! A restore writes tens of thousands of files, so the per-file work is kept
//! small: blobs are opened with one zstd context and reused buffers per
//! thread ([`crate::format::Opener`]), cache pieces are read into one buffer
//! per thread, and a file is created with its final permission bits and
//! checked with the one `fstat` its fingerprint needs anyway; owner and mode
//! are set only where that check shows creation did not give them.
//!
//! A restore never presents an empty directory as a restored workspace: no
//! candidates is an error, and when every candidate fails the error lists
//! each with its reason.

mod apply;
pub mod fetch;
pub(crate) mod fsops;
pub mod manifest;
pub mod packcache;
pub mod plan;
mod space;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use cairn_proto::domain::PackKind;
use cairn_proto::ids::{BlobId, CheckpointId, PackId, WorkspaceId};
use cairn_proto::pb;
use cairn_proto::size::human_bytes;
use futures::{StreamExt, TryStreamExt, stream};

use crate::cache::{FastMap, FileRecord, Fingerprint, FingerprintCache};
use crate::client::ConnectError;
use crate::format::{IndexEntry, PackIndex};
use crate::task::blocking;
use crate::transfer::BlobTransfer;

pub use apply::GitTreeError;
use apply::{BadBlob, LocalError, NeededBlob, SpanDone, SpanError, Target, Writers};
use fetch::{CorruptPack, FetchError, IndexError, MAX_GAP, MAX_REQUEST, PackFetcher, coalesce};
pub use fsops::SpaceFree;
pub use manifest::{Manifest, ManifestError, ManifestSource, PackInfo, ResolvedCandidate};
pub use packcache::{DEFAULT_PACK_CACHE_SIZE, PackCache, PackCacheConfig};
pub use plan::{MetaBlobs, Plan, PlanError, TreeBounds, build_plan};
pub use space::{INCOMPLETE_MARKER, SpaceNeeded};

/// Ranged GETs in flight at once.
const PARALLEL_REQUESTS: usize = 8;

/// What to restore, and where.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// The directory to restore into; created if missing.
    pub root: PathBuf,
    /// Workspace id or name.
    pub workspace: String,
    /// Restore exactly this checkpoint, with no fallback.
    pub checkpoint: Option<CheckpointId>,
    /// The runner's fingerprint cache: consulted to reuse files and updated
    /// afterwards. `None` leaves every cache alone (e.g. `cairnctl checkout`).
    pub cache_dir: Option<PathBuf>,
    /// How many candidates to ask for (0: the coordinator's default).
    pub max_candidates: u32,
    pub tree_bounds: TreeBounds,
    /// The host's pack cache, shared with other restores; `None`: none.
    pub pack_cache: Option<PackCacheConfig>,
    /// Read every file already in the root that the fingerprint cache does
    /// not vouch for, instead of keeping one whose size and mtime match the
    /// checkpoint's (see [`apply::survey`]).
    pub verify_existing: bool,
}

impl RestoreOptions {
    pub fn new(root: impl Into<PathBuf>, workspace: impl Into<String>) -> Self {
        Self {
            root: root.into(),
            workspace: workspace.into(),
            checkpoint: None,
            cache_dir: None,
            max_candidates: 0,
            tree_bounds: TreeBounds::default(),
            pack_cache: None,
            verify_existing: false,
        }
    }
}

/// A candidate that was not restored, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SkippedCheckpoint {
    pub checkpoint_id: String,
    pub reason: String,
}

/// What a successful restore did.
#[derive(Debug, Clone)]
pub struct RestoreReport {
    pub checkpoint_id: CheckpointId,
    pub workspace_id: WorkspaceId,
    /// The restored checkpoint's record, as the coordinator sent it.
    pub checkpoint: pb::Checkpoint,
    /// Newer candidates that failed, newest first.
    pub fell_back_from: Vec<SkippedCheckpoint>,
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    /// Logical size of the checkpoint's files.
    pub total_bytes: u64,
    /// File content written (files already on disk that matched are not).
    pub bytes_written: u64,
    /// Bytes received from the store, over every candidate tried.
    pub bytes_downloaded: u64,
    /// Pack bytes taken from the host's pack cache (and verified) instead.
    pub bytes_from_cache: u64,
    pub files_reused: u64,
    /// Entries on disk the checkpoint does not have, removed.
    pub entries_removed: u64,
    pub duration_ms: u64,
}

#[derive(serde::Serialize)]
struct ReportJson<'a> {
    checkpoint_id: &'a str,
    workspace_id: &'a str,
    /// When the restored checkpoint was taken (RFC 3339), if recorded.
    checkpoint_created_at: Option<String>,
    fell_back_from: &'a [SkippedCheckpoint],
    files: u64,
    directories: u64,
    symlinks: u64,
    bytes_written: u64,
    bytes_downloaded: u64,
    bytes_from_cache: u64,
    files_reused: u64,
    entries_removed: u64,
    duration_ms: u64,
}

impl RestoreReport {
    /// When the restored checkpoint was taken, if its record says.
    pub fn checkpoint_created_at(&self) -> Option<std::time::SystemTime> {
        self.checkpoint
            .created_at
            .as_ref()
            .map(cairn_proto::domain::from_timestamp)
    }

    /// The report as the JSON object of `--output json`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(ReportJson {
            checkpoint_id: self.checkpoint_id.as_str(),
            workspace_id: self.workspace_id.as_str(),
            checkpoint_created_at: self
                .checkpoint_created_at()
                .map(|t| humantime::format_rfc3339_millis(t).to_string()),
            fell_back_from: &self.fell_back_from,
            files: self.files,
            directories: self.directories,
            symlinks: self.symlinks,
            bytes_written: self.bytes_written,
            bytes_downloaded: self.bytes_downloaded,
            bytes_from_cache: self.bytes_from_cache,
            files_reused: self.files_reused,
            entries_removed: self.entries_removed,
            duration_ms: self.duration_ms,
        })
        .expect("the report serialises")
    }
}

/// Progress of a restore, for progress bars. Every method has a no-op default.
pub trait RestoreProgress: Send + Sync {
    /// Starting on a candidate.
    fn trying(&self, _checkpoint: &CheckpointId) {}
    /// A candidate failed; the next one follows.
    fn skipped(&self, _checkpoint: &str, _reason: &str) {}
    /// The candidate's work is known.
    fn planned(&self, _work: &PlannedWork) {}
    fn downloaded(&self, _bytes: u64) {}
    fn written(&self, _bytes: u64, _files: u64) {}
}

/// What restoring one candidate takes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlannedWork {
    pub files: u64,
    pub files_to_write: u64,
    pub files_reused: u64,
    pub bytes_to_write: u64,
    /// Bytes of the ranged reads from the store.
    pub bytes_to_download: u64,
    /// Bytes of the reads from the host's pack cache.
    pub bytes_from_cache: u64,
}

/// Reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl RestoreProgress for NoProgress {}

/// The failpoint a restore passes once its space check passed and it
/// marked the root, before it writes anything else.
pub const FAILPOINT_AFTER_MARK: &str = "restore-after-mark";

/// Why a restore failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("workspace {workspace} has no checkpoints")]
    NoCheckpoints { workspace: String },
    #[error("checkpoint {checkpoint} is not a checkpoint of workspace {workspace}")]
    CheckpointNotFound {
        workspace: String,
        checkpoint: CheckpointId,
    },
    #[error("no checkpoint of workspace {workspace} could be restored: {}", list_failures(.failures))]
    NothingRestorable {
        workspace: String,
        failures: Vec<SkippedCheckpoint>,
    },
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("coordinator: {}", describe_status(.0))]
    CoordinatorClient(tonic::Status),
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error(transparent)]
    Local(#[from] LocalError),
    #[error(transparent)]
    Failpoint(#[from] cairn_utils::failpoint::FailpointError),
    #[error(
        "checkpoint {checkpoint} needs {} on the filesystem of {}, which has {}; nothing was written",
        describe_needed(.needed), .root.display(), describe_free(.free)
    )]
    NoSpace {
        checkpoint: CheckpointId,
        root: PathBuf,
        needed: SpaceNeeded,
        free: SpaceFree,
    },
    /// The restore failed after it began writing: the root is not the
    /// checkpoint, and `left` says what was done about it.
    #[error("checkpoint {checkpoint} was not restored into {}: {cause}{}; {left}", .root.display(), describe_shortage(.cause, .space))]
    Incomplete {
        /// As the coordinator sent it.
        checkpoint: String,
        root: PathBuf,
        cause: Box<RestoreError>,
        /// What the check before writing found, when the cause is a full disk.
        space: Option<(SpaceNeeded, SpaceFree)>,
        left: Left,
    },
}

/// What a restore that failed halfway left in its root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Left {
    /// The root held nothing before: everything the restore wrote is gone.
    Removed,
    /// The root is marked incomplete with this file (`run` refuses it; the
    /// next restore reads every file in it and removes the mark when done).
    Marked(PathBuf),
}

impl std::fmt::Display for Left {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Removed => f.write_str("what it wrote was removed"),
            Self::Marked(marker) => write!(
                f,
                "the tree there is partial, marked by {}",
                marker.display()
            ),
        }
    }
}

fn describe_needed(needed: &SpaceNeeded) -> String {
    format!(
        "{} in whole blocks and {} inodes",
        human_bytes(needed.bytes),
        needed.inodes
    )
}

fn describe_free(free: &SpaceFree) -> String {
    match free.inodes {
        Some(inodes) => format!("{} and {inodes} inodes free", human_bytes(free.bytes)),
        None => format!("{} free (no inode limit)", human_bytes(free.bytes)),
    }
}

fn describe_shortage(cause: &RestoreError, space: &Option<(SpaceNeeded, SpaceFree)>) -> String {
    match space {
        Some((needed, free)) if cause.is_out_of_space() => format!(
            " (the filesystem filled up: the restore needs {}, and had {} when it began)",
            describe_needed(needed),
            describe_free(free)
        ),
        _ => String::new(),
    }
}

impl RestoreError {
    /// What went wrong, under an [`RestoreError::Incomplete`].
    pub fn cause(&self) -> &RestoreError {
        match self {
            Self::Incomplete { cause, .. } => cause.cause(),
            other => other,
        }
    }

    /// Whether the filesystem (or a quota) was too small: before writing, or
    /// a write that failed with ENOSPC or EDQUOT.
    pub fn is_out_of_space(&self) -> bool {
        match self.cause() {
            Self::NoSpace { .. } => true,
            Self::Local(local) => space::is_out_of_space(&local.source),
            _ => false,
        }
    }

    /// Whether running the same restore again later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Connect(ConnectError::Unreachable { .. }) => true,
            Self::CoordinatorClient(status) => matches!(
                status.code(),
                tonic::Code::Unavailable
                    | tonic::Code::DeadlineExceeded
                    | tonic::Code::ResourceExhausted
            ),
            _ => false,
        }
    }
}

fn list_failures(failures: &[SkippedCheckpoint]) -> String {
    failures
        .iter()
        .map(|f| format!("{}: {}", f.checkpoint_id, f.reason))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A gRPC status in words: the code spelled out, then the message, e.g.
/// `not found: workspace "x" does not exist`.
pub fn describe_status(status: &tonic::Status) -> String {
    use tonic::Code;
    let words = match status.code() {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown error",
        Code::InvalidArgument => "invalid argument",
        Code::DeadlineExceeded => "deadline exceeded",
        Code::NotFound => "not found",
        Code::AlreadyExists => "already exists",
        Code::PermissionDenied => "permission denied",
        Code::ResourceExhausted => "resource exhausted",
        Code::FailedPrecondition => "failed precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out of range",
        Code::Unimplemented => "not implemented",
        Code::Internal => "internal error",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data loss",
        Code::Unauthenticated => "unauthenticated",
    };
    let message = status.message().trim();
    if message.is_empty() {
        words.to_owned()
    } else if message.to_lowercase().contains(words) {
        message.to_owned()
    } else {
        format!("{words}: {message}")
    }
}

/// Why one candidate could not be restored.
#[derive(Debug, thiserror::Error)]
pub enum CandidateError {
    #[error("{0}")]
    Manifest(String),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Corrupt(#[from] CorruptPack),
    #[error(transparent)]
    Fetch(FetchError),
    #[error("blob {blob} is in none of the checkpoint's packs")]
    MissingBlob { blob: BlobId },
    #[error("the checkpoint holds {INCOMPLETE_MARKER}, a name the restore keeps for itself")]
    ReservedName,
    #[error("blob {blob} holds {actual} bytes in pack {pack} but the tree says {expected}")]
    BlobLength {
        blob: BlobId,
        pack: PackId,
        actual: u32,
        expected: u32,
    },
    #[error("pack {pack}: {source}")]
    Blob {
        pack: PackId,
        source: crate::format::FormatError,
    },
    #[error(transparent)]
    GitTree(#[from] apply::GitTreeError),
}

/// A failed attempt: the candidate's fault (try the next) or not (stop).
#[derive(Debug)]
enum AttemptError {
    Candidate(CandidateError),
    Fatal(RestoreError),
}

impl<E: Into<CandidateError>> From<E> for AttemptError {
    fn from(e: E) -> Self {
        Self::Candidate(e.into())
    }
}

impl From<FetchError> for CandidateError {
    fn from(e: FetchError) -> Self {
        Self::Fetch(e)
    }
}

impl AttemptError {
    fn fetch(e: FetchError) -> Self {
        match e {
            FetchError::Refresh(status) => Self::Fatal(RestoreError::CoordinatorClient(status)),
            other => Self::Candidate(CandidateError::Fetch(other)),
        }
    }

    fn index(e: IndexError) -> Self {
        match e {
            IndexError::Fetch(f) => Self::fetch(f),
            IndexError::Corrupt(c) => Self::Candidate(c.into()),
        }
    }

    fn span(e: SpanError) -> Self {
        match e {
            SpanError::Local(local) => Self::Fatal(local.into()),
            SpanError::Blob { pack, source } => {
                Self::Candidate(CandidateError::Blob { pack, source })
            }
        }
    }

    fn local(e: LocalError) -> Self {
        Self::Fatal(e.into())
    }
}

/// Restores the newest restorable checkpoint of `opts.workspace` (or exactly
/// `opts.checkpoint`) into `opts.root`.
pub async fn restore(
    source: &dyn ManifestSource,
    opts: &RestoreOptions,
    progress: &dyn RestoreProgress,
) -> Result<RestoreReport, RestoreError> {
    let started = Instant::now();
    let started_at = SystemTime::now();
    let request = pb::GetRestoreManifestRequest {
        workspace: opts.workspace.clone(),
        checkpoint_id: opts
            .checkpoint
            .as_ref()
            .map(|c| c.to_string())
            .unwrap_or_default(),
        max_candidates: opts.max_candidates,
    };
    let manifest = source
        .restore_manifest(request.clone())
        .await
        .map_err(RestoreError::CoordinatorClient)?;
    let manifest = Manifest::parse(manifest)?;
    let mut candidates = manifest.candidates.clone();
    if let Some(wanted) = &opts.checkpoint {
        candidates.retain(|c| c.id == wanted.as_str());
        if candidates.is_empty() {
            return Err(RestoreError::CheckpointNotFound {
                workspace: opts.workspace.clone(),
                checkpoint: wanted.clone(),
            });
        }
    }
    if candidates.is_empty() {
        return Err(RestoreError::NoCheckpoints {
            workspace: opts.workspace.clone(),
        });
    }

    let pack_cache = match opts.pack_cache.clone() {
        Some(config) => match blocking(move || PackCache::open(&config)).await {
            Ok(cache) => Some(Arc::new(cache)),
            Err(e) => {
                // The cache only saves downloads; the store has every byte.
                tracing::warn!(error = %e, "restoring without the host's pack cache");
                None
            }
        },
        None => None,
    };
    let fetcher = PackFetcher::new(
        BlobTransfer::default(),
        source,
        request,
        manifest.urls.clone(),
    )
    .with_pack_cache(pack_cache);
    let mut protected = match &opts.cache_dir {
        Some(dir) => apply::protected_paths(&opts.root, dir),
        None => Vec::new(),
    };
    // The mark stays through every candidate, until one is restored.
    protected.push(INCOMPLETE_MARKER.as_bytes().to_vec());
    let marker = opts.root.join(INCOMPLETE_MARKER);
    let (was_marked, held_nothing) = {
        let (root, marker, protected) = (opts.root.clone(), marker.clone(), protected.clone());
        blocking(move || {
            (
                fs_exists(&marker),
                space::holds_nothing(&root, &protected).unwrap_or(false),
            )
        })
        .await
    };
    // A tree an earlier restore left partial: nothing in it is vouched for
    // by its size and mtime (the fingerprint cache still vouches by inode
    // and ctime, which only a finished write of that file gave it).
    let marked_opts;
    let opts = if was_marked {
        tracing::warn!(marker = %marker.display(), "an earlier restore into this root did not complete: every file there is read");
        marked_opts = RestoreOptions {
            verify_existing: true,
            ..opts.clone()
        };
        &marked_opts
    } else {
        opts
    };
    let attempt_ctx = AttemptContext {
        fetcher: &fetcher,
        opts,
        progress,
        workspace_id: &manifest.workspace_id,
        protected,
        set_owner: fsops::running_as_root(),
        started_at,
        space: std::sync::Mutex::new(None),
        wrote: AtomicBool::new(false),
    };
    let mut skipped = Vec::new();
    for candidate in &candidates {
        let outcome = match manifest.resolve(candidate) {
            Ok(resolved) => {
                progress.trying(&resolved.id);
                attempt(&attempt_ctx, &resolved)
                    .await
                    .map(|outcome| (resolved, outcome))
            }
            Err(reason) => Err(AttemptError::Candidate(CandidateError::Manifest(reason))),
        };
        match outcome {
            Ok((resolved, outcome)) => {
                // Only now is the tree the checkpoint.
                let removing = marker.clone();
                match blocking(move || std::fs::remove_file(&removing)).await {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(source) => {
                        return Err(RestoreError::Local(LocalError {
                            action: "removing",
                            path: marker,
                            source,
                        }));
                    }
                }
                return Ok(RestoreReport {
                    checkpoint_id: resolved.id,
                    workspace_id: manifest.workspace_id.clone(),
                    checkpoint: candidate.checkpoint.clone(),
                    fell_back_from: skipped,
                    files: outcome.plan_files,
                    directories: outcome.plan_directories,
                    symlinks: outcome.plan_symlinks,
                    total_bytes: outcome.plan_bytes,
                    bytes_written: outcome.bytes_written,
                    bytes_downloaded: fetcher.downloaded_bytes(),
                    bytes_from_cache: fetcher.cached_bytes(),
                    files_reused: outcome.files_reused,
                    entries_removed: outcome.entries_removed,
                    duration_ms: started.elapsed().as_millis() as u64,
                });
            }
            Err(AttemptError::Candidate(e)) => {
                let reason = e.to_string();
                tracing::warn!(checkpoint = %candidate.id, %reason, "checkpoint cannot be restored; trying the next one");
                progress.skipped(&candidate.id, &reason);
                skipped.push(SkippedCheckpoint {
                    checkpoint_id: candidate.id.clone(),
                    reason,
                });
            }
            Err(AttemptError::Fatal(e)) => {
                return Err(left_behind(&attempt_ctx, &candidate.id, e, held_nothing).await);
            }
        }
    }
    let failed = RestoreError::NothingRestorable {
        workspace: opts.workspace.clone(),
        failures: skipped,
    };
    let newest = &candidates[0].id;
    Err(left_behind(&attempt_ctx, newest, failed, held_nothing).await)
}

fn fs_exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// The error of a restore that failed: as it is when nothing was written;
/// otherwise [`RestoreError::Incomplete`], after removing what was written
/// into a root that `held_nothing` before, or with the root left marked.
async fn left_behind(
    ctx: &AttemptContext<'_>,
    checkpoint: &str,
    error: RestoreError,
    held_nothing: bool,
) -> RestoreError {
    if !ctx.wrote.load(Ordering::Acquire) {
        return error;
    }
    let root = ctx.opts.root.clone();
    let marker = root.join(INCOMPLETE_MARKER);
    let left = if held_nothing {
        let (root, protected) = (root.clone(), ctx.protected.clone());
        let cleared = blocking(move || {
            space::clear(&root, &protected)?;
            std::fs::remove_file(root.join(INCOMPLETE_MARKER))
        })
        .await;
        match cleared {
            Ok(()) => Left::Removed,
            Err(e) => {
                tracing::warn!(root = %ctx.opts.root.display(), error = %e, "cannot remove what the failed restore wrote");
                Left::Marked(marker)
            }
        }
    } else {
        Left::Marked(marker)
    };
    let space = *ctx.space.lock().unwrap_or_else(|e| e.into_inner());
    let error = RestoreError::Incomplete {
        checkpoint: checkpoint.to_owned(),
        root,
        cause: Box::new(error),
        space,
        left,
    };
    tracing::error!(error = %error, "restore failed after it began writing");
    error
}

struct AttemptContext<'a> {
    fetcher: &'a PackFetcher<'a>,
    opts: &'a RestoreOptions,
    progress: &'a dyn RestoreProgress,
    workspace_id: &'a WorkspaceId,
    protected: Vec<Vec<u8>>,
    set_owner: bool,
    started_at: SystemTime,
    /// What the last space check found (for the error of a disk that fills).
    space: std::sync::Mutex<Option<(SpaceNeeded, SpaceFree)>>,
    /// Whether an attempt began changing the root.
    wrote: AtomicBool,
}

#[derive(Debug)]
struct AttemptOutcome {
    plan_files: u64,
    plan_directories: u64,
    plan_symlinks: u64,
    plan_bytes: u64,
    bytes_written: u64,
    files_reused: u64,
    entries_removed: u64,
}

async fn attempt(
    ctx: &AttemptContext<'_>,
    candidate: &ResolvedCandidate,
) -> Result<AttemptOutcome, AttemptError> {
    // The trees, the DATA packs' indexes and the runner's fingerprint cache
    // do not depend on each other: read at once.
    let phase = Instant::now();
    let (plan, located, cache) = tokio::join!(
        read_plan(ctx.fetcher, candidate, &ctx.opts.tree_bounds),
        fetch_indexes(ctx.fetcher, candidate),
        load_cache(ctx, candidate),
    );
    let (plan, mut blob_packs) = plan?;
    if plan.child(None, INCOMPLETE_MARKER.as_bytes()).is_some() {
        return Err(CandidateError::ReservedName.into());
    }
    let mut located = located?;
    located.check(&plan)?;
    blob_packs.append(&mut located.blob_packs);
    tracing::debug!(checkpoint = %candidate.id, entries = plan.entries.len(), blobs = located.blobs.len(), elapsed = ?phase.elapsed(), "trees and pack indexes read and checked");

    // Nothing has been written so far; from here on the root changes.
    let phase = Instant::now();
    let (target, prepared, cache) = prepare_root(ctx, candidate, &plan, cache).await?;
    tracing::debug!(reused = prepared.reused.len(), to_write = prepared.jobs.len(), stale_removed = prepared.removed, elapsed = ?phase.elapsed(), "root surveyed and prepared");

    let phase = Instant::now();
    let files_reused = prepared.reused.len() as u64;
    let entries_removed = prepared.removed;
    let (writers, bytes_written) =
        download(ctx, candidate, &plan, prepared.jobs, files_reused, &located).await?;
    tracing::debug!(bytes_written, elapsed = ?phase.elapsed(), "downloaded and written");

    let phase = Instant::now();
    let rebuilding = writers.clone();
    let rebuilt = blocking(move || apply::rebuild_git_trees(&rebuilding))
        .await
        .map_err(|e| match e {
            apply::RebuildError::Tree(tree) => AttemptError::Candidate(tree.into()),
            apply::RebuildError::Local(local) => AttemptError::local(local),
        })?;
    ctx.progress.written(0, rebuilt);
    tracing::debug!(rebuilt, elapsed = ?phase.elapsed(), "git trees rebuilt");

    // Every file is final now, so the fingerprint cache is updated and
    // saved while the directories get their metadata. Should that fail, the
    // files the cache lists are still on disk as it says.
    let phase = Instant::now();
    let restored = Restored {
        plan: plan.clone(),
        reused: prepared.reused,
        created_empty: prepared.created_empty,
        writers,
        started_at: ctx.started_at,
    };
    let ((finished, target), saved) = tokio::join!(
        blocking(move || (apply::finish(&target), target)),
        blocking(move || {
            let mut cache = cache;
            if let Some(cache) = &mut cache {
                let started = Instant::now();
                restored.save_in(cache, &blob_packs);
                tracing::debug!(elapsed = ?started.elapsed(), "fingerprint cache saved");
            }
            (restored, blob_packs, cache)
        }),
    );
    finished.map_err(AttemptError::local)?;
    tracing::debug!(elapsed = ?phase.elapsed(), "links, directory metadata and the fingerprint cache done");

    let outcome = AttemptOutcome {
        plan_files: plan.files,
        plan_directories: plan.directories,
        plan_symlinks: plan.symlinks,
        plan_bytes: plan.total_bytes,
        bytes_written,
        files_reused,
        entries_removed,
    };
    drop_in_background((plan, located, target, saved));
    Ok(outcome)
}

/// Frees `value` on a thread of its own. A restore's plan, maps and cache
/// hold hundreds of thousands of small allocations, and freeing them takes
/// tens of milliseconds the restore need not wait for: the command-line
/// restore exits without waiting, a resident runner frees them meanwhile.
fn drop_in_background<T: Send + 'static>(value: T) {
    // Should no thread start, the value comes back and is freed here.
    let _ = std::thread::Builder::new()
        .name("cairn-free".into())
        .spawn(move || drop(value));
}

/// The files a restore left as the plan says, for the fingerprint cache.
struct Restored {
    plan: Arc<Plan>,
    reused: Vec<(usize, Fingerprint)>,
    created_empty: Vec<(usize, Fingerprint)>,
    writers: Arc<Writers>,
    started_at: SystemTime,
}

impl Restored {
    /// Records the restored files whose fingerprint is stable (see
    /// [`restored_fingerprint_is_stable`]), and where their blobs live, in
    /// `cache`, and saves it.
    fn save_in(&self, cache: &mut FingerprintCache, blob_packs: &BlobPacks) {
        for (pack, blobs) in blob_packs {
            cache.insert_blobs(pack, blobs.iter().copied());
        }
        let written = self.writers.jobs.iter().map(|job| {
            let fingerprint = job
                .fingerprint
                .get()
                .expect("every downloaded file was finished");
            (job.plan_index, fingerprint)
        });
        let records: Vec<FileRecord<'_>> = self
            .reused
            .iter()
            .chain(&self.created_empty)
            .map(|(i, fingerprint)| (*i, fingerprint))
            .chain(written)
            .filter(|(_, fingerprint)| restored_fingerprint_is_stable(fingerprint, self.started_at))
            .filter_map(|(i, fingerprint)| {
                let entry = &self.plan.entries[i];
                // Only files are restored with a fingerprint.
                let plan::PlanKind::File { chunks, git, .. } = &entry.kind else {
                    return None;
                };
                Some(FileRecord {
                    path: &entry.path,
                    fingerprint,
                    chunks,
                    git: *git,
                })
            })
            .collect();
        if let Err(e) = cache.save_with_files(records.into_iter()) {
            // The cache only saves work; the restore itself succeeded.
            tracing::warn!(path = %cache.path().display(), error = %e, "cannot save the fingerprint cache");
        }
    }
}

/// Downloads and verifies the candidate's META packs and checks its trees.
/// Also returns which pack holds each tree blob, for the cache.
async fn read_plan(
    fetcher: &PackFetcher<'_>,
    candidate: &ResolvedCandidate,
    bounds: &TreeBounds,
) -> Result<(Arc<Plan>, BlobPacks), AttemptError> {
    let meta_infos = candidate
        .packs
        .iter()
        .filter(|p| p.kind == PackKind::Meta)
        .cloned();
    let opened: Vec<(PackInfo, Bytes, PackIndex)> = stream::iter(meta_infos)
        .map(|info| {
            let keys = &candidate.keys;
            async move {
                let (bytes, index) = fetch::fetch_whole_pack(fetcher, &info, keys)
                    .await
                    .map_err(AttemptError::index)?;
                Ok::<_, AttemptError>((info, bytes, index))
            }
        })
        .buffer_unordered(PARALLEL_REQUESTS)
        .try_collect()
        .await?;
    let fetched = Instant::now();
    let mut meta = MetaBlobs::new();
    let mut blob_packs = Vec::new();
    for (info, bytes, index) in opened {
        blob_packs.push((info.id, index.entries.iter().map(|e| e.id).collect()));
        meta.add_pack(bytes, &index);
    }
    let keys = candidate.keys.clone();
    let root_tree = candidate.root_tree;
    let bounds = bounds.clone();
    let plan = blocking(move || build_plan(&meta, &keys, root_tree, &bounds)).await?;
    tracing::debug!(packs = blob_packs.len(), elapsed = ?fetched.elapsed(), "trees opened and checked");
    Ok((Arc::new(plan), blob_packs))
}

/// Every blob of some packs, by pack, for the fingerprint cache: one pack
/// id per pack rather than a copy of it per blob.
type BlobPacks = Vec<(PackId, Vec<BlobId>)>;

/// Where every chunk of a plan lies in the candidate's DATA packs.
struct Located {
    packs: Vec<PackInfo>,
    /// Blob → (index into `packs`, where in that pack).
    blobs: FastMap<BlobId, (usize, IndexEntry)>,
    blob_packs: BlobPacks,
}

/// Reads every DATA pack's index and maps each blob to where it lies; built
/// off the async threads while the trees are opened.
async fn fetch_indexes(
    fetcher: &PackFetcher<'_>,
    candidate: &ResolvedCandidate,
) -> Result<Located, AttemptError> {
    let packs: Vec<PackInfo> = candidate
        .packs
        .iter()
        .filter(|p| p.kind == PackKind::Data)
        .cloned()
        .collect();
    let keys = &candidate.keys;
    let indexes: Vec<(usize, PackIndex)> = stream::iter(packs.iter().enumerate())
        .map(|(i, info)| async move {
            let index = fetch::fetch_index(fetcher, info, keys)
                .await
                .map_err(AttemptError::index)?;
            Ok::<_, AttemptError>((i, index))
        })
        .buffer_unordered(PARALLEL_REQUESTS)
        .try_collect()
        .await?;
    Ok(blocking(move || Located::new(packs, &indexes)).await)
}

impl Located {
    /// `indexes`: for some of `packs` (by position), its index.
    fn new(packs: Vec<PackInfo>, indexes: &[(usize, PackIndex)]) -> Self {
        let count = indexes.iter().map(|(_, index)| index.entries.len()).sum();
        let mut blobs: FastMap<BlobId, (usize, IndexEntry)> =
            FastMap::with_capacity_and_hasher(count, Default::default());
        let mut blob_packs = Vec::with_capacity(indexes.len());
        for (i, index) in indexes {
            for entry in &index.entries {
                blobs.entry(entry.id).or_insert((*i, *entry));
            }
            let ids = index.entries.iter().map(|e| e.id).collect();
            blob_packs.push((packs[*i].id.clone(), ids));
        }
        Self {
            packs,
            blobs,
            blob_packs,
        }
    }

    /// Checks that each chunk the plan needs is in one of the DATA packs,
    /// with the length the tree says.
    fn check(&self, plan: &Plan) -> Result<(), AttemptError> {
        for chunk in plan.chunks() {
            let Some((pack, entry)) = self.blobs.get(&chunk.id) else {
                return Err(CandidateError::MissingBlob { blob: chunk.id }.into());
            };
            if entry.plain_len != chunk.len {
                return Err(CandidateError::BlobLength {
                    blob: chunk.id,
                    pack: self.packs[*pack].id.clone(),
                    actual: entry.plain_len,
                    expected: chunk.len,
                }
                .into());
            }
        }
        Ok(())
    }
}

/// Surveys the root, refuses a restore the filesystem cannot hold, and
/// readies directories and files.
async fn prepare_root(
    ctx: &AttemptContext<'_>,
    candidate: &ResolvedCandidate,
    plan: &Arc<Plan>,
    cache: Option<FingerprintCache>,
) -> Result<(Arc<Target>, apply::Prepared, Option<FingerprintCache>), AttemptError> {
    let target = Arc::new(Target {
        root: ctx.opts.root.clone(),
        plan: plan.clone(),
        keys: candidate.keys.clone(),
        set_owner: ctx.set_owner,
        protected: ctx.protected.clone(),
        mtimes_settled_before: candidate
            .scan_started
            .filter(|_| !ctx.opts.verify_existing)
            .map(crate::cache::settled_before),
    });
    let surveying = Instant::now();
    let (survey, cache) = {
        let target = target.clone();
        blocking(move || (apply::survey(&target, cache.as_ref()), cache)).await
    };
    let survey = survey.map_err(AttemptError::local)?;
    tracing::debug!(stale = survey.stale.len(), elapsed = ?surveying.elapsed(), "root surveyed");
    let root = ctx.opts.root.clone();
    match blocking(move || fsops::free_space(&root)).await {
        Ok(free) => {
            let needed = space::space_needed(plan, &survey, free.block_size);
            *ctx.space.lock().unwrap_or_else(|e| e.into_inner()) = Some((needed, free));
            tracing::debug!(?needed, ?free, "space check");
            if !space::fits(needed, free) {
                return Err(AttemptError::Fatal(RestoreError::NoSpace {
                    checkpoint: candidate.id.clone(),
                    root: ctx.opts.root.clone(),
                    needed,
                    free,
                }));
            }
        }
        Err(e) => tracing::debug!(error = %e, "cannot tell the free space of the restore root"),
    }
    // From here on the root changes: marked until the restore completes.
    ctx.wrote.store(true, Ordering::Release);
    let root = ctx.opts.root.clone();
    blocking(move || mark_incomplete(&root))
        .await
        .map_err(AttemptError::local)?;
    // Tests stop the restore here to fill its disk after the check passed.
    if let Err(e) = cairn_utils::failpoint::hit(FAILPOINT_AFTER_MARK) {
        return Err(AttemptError::Fatal(RestoreError::Failpoint(e)));
    }
    let prepared = {
        let target = target.clone();
        blocking(move || apply::prepare(&target, survey))
            .await
            .map_err(AttemptError::local)?
    };
    Ok((target, prepared, cache))
}

/// Creates the root (if missing) and the mark that it is not yet restored.
fn mark_incomplete(root: &Path) -> Result<(), LocalError> {
    std::fs::create_dir_all(root).map_err(|source| LocalError {
        action: "creating",
        path: root.to_owned(),
        source,
    })?;
    let marker = root.join(INCOMPLETE_MARKER);
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&marker)
        .and_then(|mut file| {
            use std::io::Write as _;
            file.write_all(
                b"a cairn restore into this directory did not complete: it is not a checkpoint\n",
            )
        });
    created.map_err(|source| LocalError {
        action: "marking",
        path: marker,
        source,
    })
}

/// The runner's fingerprint cache, which tells files on disk that need no
/// rewrite (`None` without a cache directory). The restore records what it
/// wrote in this copy and saves it.
async fn load_cache(
    ctx: &AttemptContext<'_>,
    candidate: &ResolvedCandidate,
) -> Option<FingerprintCache> {
    let dir = ctx.opts.cache_dir.clone()?;
    let workspace_id = ctx.workspace_id.clone();
    let key_id = candidate.keys.key_id().to_owned();
    Some(blocking(move || FingerprintCache::load(&dir, &workspace_id, &key_id)).await)
}

/// Fetches the chunks of the files to write, coalesced per pack, and writes
/// them. Returns the writers (with each file's final fingerprint) and the
/// bytes written.
async fn download(
    ctx: &AttemptContext<'_>,
    candidate: &ResolvedCandidate,
    plan: &Plan,
    jobs: Vec<apply::FileJob>,
    files_reused: u64,
    located: &Located,
) -> Result<(Arc<Writers>, u64), AttemptError> {
    // Most files are one chunk: sized for that, the map is not regrown
    // (and rehashed) a dozen times on the way to the download.
    let mut needed: FastMap<BlobId, NeededBlob> =
        FastMap::with_capacity_and_hasher(jobs.len(), Default::default());
    let mut bytes_to_write = 0;
    for (job_index, job) in jobs.iter().enumerate() {
        let plan::PlanKind::File { chunks, .. } = &plan.entries[job.plan_index].kind else {
            unreachable!("jobs are made for files only")
        };
        let mut offset = 0u64;
        for chunk in chunks {
            needed
                .entry(chunk.id)
                .or_insert_with(|| NeededBlob {
                    id: chunk.id,
                    plain_len: chunk.len,
                    targets: Vec::new(),
                })
                .targets
                .push((job_index, offset));
            offset += u64::from(chunk.len);
        }
        // What the writes put on disk: a git blob's content, before it is deflated.
        bytes_to_write += offset;
    }
    let mut per_pack: HashMap<usize, Vec<(u64, u64, NeededBlob)>> = HashMap::new();
    for blob in needed.into_values() {
        let (pack, entry) = located.blobs[&blob.id];
        per_pack
            .entry(pack)
            .or_default()
            .push((entry.offset, u64::from(entry.sealed_len), blob));
    }
    let spans = plan_spans(ctx.fetcher.pack_cache(), located, per_pack);
    let span_bytes = |store: bool| -> u64 {
        spans
            .iter()
            .filter(|s| matches!(s.source, Source::Store) == store)
            .map(|s| s.span.end - s.span.start)
            .sum()
    };
    ctx.progress.planned(&PlannedWork {
        files: plan.files,
        files_to_write: jobs.len() as u64,
        files_reused,
        bytes_to_write,
        bytes_to_download: span_bytes(true),
        bytes_from_cache: span_bytes(false),
    });

    let writers = Arc::new(Writers {
        jobs,
        keys: candidate.keys.clone(),
        set_owner: ctx.set_owner,
        cancelled: AtomicBool::new(false),
    });
    let (mut bytes_written, refetch) = write_spans(ctx, located, &writers, spans).await?;
    if !refetch.is_empty() {
        // Blobs of cache pieces that were gone or failed their checks: from
        // the store, like any blob the cache did not hold.
        let spans = refetch_spans(located, refetch);
        let (written, left) = write_spans(ctx, located, &writers, spans).await?;
        debug_assert!(left.is_empty(), "store spans are never handed back");
        bytes_written += written;
    }
    Ok((writers, bytes_written))
}

/// Where the bytes of a span come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Store,
    /// This piece of the host's pack cache holds the whole span.
    FingerprintCache(packcache::Piece),
}

/// One read of blob bytes: which pack, from where, which blobs.
struct PlannedSpan {
    pack: usize,
    source: Source,
    span: fetch::Span<NeededBlob>,
}

/// Coalesces each pack's blobs into reads. With a pack cache, a blob lying
/// entirely inside a cached piece is read from that piece (spans never cross
/// pieces); the rest come from the store.
fn plan_spans(
    cache: Option<&Arc<PackCache>>,
    located: &Located,
    per_pack: HashMap<usize, Vec<(u64, u64, NeededBlob)>>,
) -> Vec<PlannedSpan> {
    let mut spans = Vec::new();
    for (pack, items) in per_pack {
        let pieces = cache.map(|c| c.pieces(&located.packs[pack].id));
        let mut remote = Vec::new();
        let mut cached: HashMap<packcache::Piece, Vec<(u64, u64, NeededBlob)>> = HashMap::new();
        for item in items {
            let holder = pieces.as_deref().and_then(|pieces| {
                pieces
                    .iter()
                    .filter(|p| p.covers(item.0, item.0 + item.1))
                    .max_by_key(|p| p.len())
            });
            match holder {
                Some(piece) => cached.entry(*piece).or_default().push(item),
                None => remote.push(item),
            }
        }
        for (piece, items) in cached {
            spans.extend(
                coalesce(items, MAX_GAP, MAX_REQUEST)
                    .into_iter()
                    .map(|span| PlannedSpan {
                        pack,
                        source: Source::FingerprintCache(piece),
                        span,
                    }),
            );
        }
        spans.extend(
            coalesce(remote, MAX_GAP, MAX_REQUEST)
                .into_iter()
                .map(|span| PlannedSpan {
                    pack,
                    source: Source::Store,
                    span,
                }),
        );
    }
    spans
}

/// A blob of a pack: (offset, sealed length, blob).
type PackItem = (u64, u64, NeededBlob);

/// A blob to fetch again from the store: pack, the blob, and the damaged
/// piece it was read from, if it was dropped.
type Refetch = (usize, PackItem, Option<packcache::Piece>);

/// Reads for blobs the cache could not give. A dropped piece is fetched
/// whole (it was one read of the store before), so that the cache gets all
/// of it back, not only the blobs that failed; a piece is only trusted that
/// far if it is no larger than one read and lies before the pack's index.
fn refetch_spans(located: &Located, refetch: Vec<Refetch>) -> Vec<PlannedSpan> {
    let mut whole: HashMap<(usize, packcache::Piece), Vec<PackItem>> = HashMap::new();
    let mut per_pack: HashMap<usize, Vec<(u64, u64, NeededBlob)>> = HashMap::new();
    for (pack, item, dropped) in refetch {
        let data_end = located.packs[pack].index_offset;
        match dropped {
            Some(piece) if piece.len() <= MAX_REQUEST && piece.end <= data_end => {
                whole.entry((pack, piece)).or_default().push(item);
            }
            _ => per_pack.entry(pack).or_default().push(item),
        }
    }
    let mut spans = plan_spans(None, located, per_pack);
    spans.extend(whole.into_iter().map(|((pack, piece), mut items)| {
        items.sort_by_key(|(offset, _, _)| *offset);
        PlannedSpan {
            pack,
            source: Source::Store,
            span: fetch::Span {
                start: piece.start,
                end: piece.end,
                items,
            },
        }
    }));
    spans
}

thread_local! {
    /// The bytes of one cache piece read by a blocking writer: one buffer per
    /// thread for the hundreds of pieces a restore reads (at most
    /// [`MAX_REQUEST`] each), not a freshly faulted-in allocation per piece.
    static PIECE_BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Reads the spans (store spans in parallel ranged GETs, cache spans from
/// disk), verifies and writes every blob. Store bytes go into the pack cache
/// once they verified. Returns the bytes written and the blobs of cache
/// pieces that were gone or failed a check, for the store.
async fn write_spans(
    ctx: &AttemptContext<'_>,
    located: &Located,
    writers: &Arc<Writers>,
    spans: Vec<PlannedSpan>,
) -> Result<(u64, Vec<Refetch>), AttemptError> {
    let cache = ctx.fetcher.pack_cache();
    let mut reads = stream::iter(spans)
        .map(|planned| {
            let writers = writers.clone();
            let pack_index = planned.pack;
            let pack = located.packs[pack_index].id.clone();
            let cache = cache.cloned();
            async move {
                if writers.cancelled.load(Ordering::Relaxed) {
                    return Ok((SpanDone::default(), Vec::new()));
                }
                let span = planned.span;
                let result = match planned.source {
                    Source::Store => {
                        let bytes = ctx
                            .fetcher
                            .get_range(&pack, span.start, span.end - span.start)
                            .await
                            .map_err(AttemptError::fetch)?;
                        ctx.progress.downloaded(bytes.len() as u64);
                        blocking(move || {
                            let done = apply::write_span(
                                &writers,
                                &pack,
                                span.start,
                                &bytes,
                                &span.items,
                                BadBlob::Fail,
                            )?;
                            if let Some(cache) = cache {
                                cache.insert(&pack, span.start, &bytes);
                            }
                            Ok::<_, SpanError>((done, Vec::new(), None))
                        })
                        .await
                        .map_err(AttemptError::span)
                    }
                    Source::FingerprintCache(piece) => {
                        let cache = cache.expect("cache spans are planned only with a cache");
                        let (done, bad, from_cache, dropped) = blocking(move || {
                            PIECE_BUFFER.with_borrow_mut(|bytes| {
                                if !cache.read_into(&pack, piece, span.start, span.end, bytes) {
                                    let all = span.items;
                                    return Ok::<_, SpanError>((SpanDone::default(), all, 0, None));
                                }
                                let mut done = apply::write_span(
                                    &writers,
                                    &pack,
                                    span.start,
                                    bytes,
                                    &span.items,
                                    BadBlob::Collect,
                                )?;
                                let bad = std::mem::take(&mut done.bad);
                                Ok(match bad.first() {
                                    Some((_, _, blob)) => {
                                        let reason =
                                            format!("blob {} in it does not verify", blob.id);
                                        cache.discard(&pack, piece, &reason);
                                        (done, bad, 0, Some(piece))
                                    }
                                    None => (done, bad, bytes.len() as u64, None),
                                })
                            })
                        })
                        .await
                        .map_err(AttemptError::span)?;
                        ctx.fetcher.note_cached(from_cache);
                        Ok((done, bad, dropped))
                    }
                };
                result.map(|(done, refetch, dropped)| {
                    let refetch = refetch
                        .into_iter()
                        .map(|item| (pack_index, item, dropped))
                        .collect::<Vec<Refetch>>();
                    (done, refetch)
                })
            }
        })
        .buffer_unordered(PARALLEL_REQUESTS);
    let mut bytes_written = 0;
    let mut refetch = Vec::new();
    let mut failure = None;
    // Drain every read even after a failure: the blocking writers of this
    // candidate must be done before the next candidate starts writing.
    while let Some(result) = reads.next().await {
        match result {
            Ok((done, again)) => {
                bytes_written += done.bytes;
                ctx.progress.written(done.bytes, done.files);
                refetch.extend(again);
            }
            Err(e) => {
                writers.cancelled.store(true, Ordering::Relaxed);
                failure.get_or_insert(e);
            }
        }
    }
    drop(reads);
    match failure {
        Some(e) => Err(e),
        None => Ok((bytes_written, refetch)),
    }
}

/// Whether a restored file's fingerprint can go into the cache. Its ctime is
/// always "just now" (the restore wrote it), so [`Fingerprint::is_stable`]
/// would refuse it; but its mtime was set by the restore to the recorded one,
/// and any later write moves the mtime to the present. An mtime safely older
/// than the restore therefore still tells a change apart.
fn restored_fingerprint_is_stable(fingerprint: &Fingerprint, restore_started: SystemTime) -> bool {
    let guard = restore_started
        .checked_sub(Duration::from_secs(2))
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs() as i64);
    fingerprint.mtime_sec < guard
}
