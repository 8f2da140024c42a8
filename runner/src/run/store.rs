//! Where the run's workspace is restored from and checkpointed to.
//!
//! [`WorkspaceStore`] is the seam between the run's state machine and the
//! checkpoint engine: [`RemoteStore`] is the real one (the checkpoint and
//! restore libraries, against the coordinator, fenced by the attempt's
//! generation); tests count calls through their own implementation.

use std::path::PathBuf;
use std::sync::Arc;

use cairn_proto::domain::CheckpointReason;
use cairn_proto::ids::{BlobId, CheckpointId, Generation, WorkspaceId};
use cairn_proto::pb;
use cairn_proto::size::human_bytes;
use futures::future::BoxFuture;

use cairn_engine::checkpoint::{
    self, Baseline, CheckpointError, CheckpointOptions, CheckpointReport, Resident,
};
use cairn_engine::client::CoordinatorClient;
use cairn_engine::git::RepoState;
use cairn_engine::host_reports::{self, HostReport};
use cairn_engine::restore::{self, NoProgress, RestoreError, RestoreOptions};
use cairn_engine::scan::ScanOptions;
use cairn_engine::tracker::{ChangeTracker, DEFAULT_FULL_SCAN_INTERVAL, Unsaved};

/// What the workspace was prepared from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restored {
    /// A checkpoint was restored.
    Checkpoint {
        id: CheckpointId,
        /// Its root tree, when the record carried a well-formed one.
        root_tree: Option<BlobId>,
        /// What the restore did, in one line.
        summary: String,
    },
    /// The workspace has no checkpoint yet.
    NoCheckpoint,
}

/// A checkpoint the run asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRequest {
    pub reason: CheckpointReason,
    pub harness: Option<pb::HarnessSession>,
    /// Commit only if the workspace changed since this checkpoint.
    pub unless_unchanged: Option<Baseline>,
}

/// A committed checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpointed {
    pub id: CheckpointId,
    pub root_tree: BlobId,
    /// Sizes and times in one line, for the run's timeline.
    pub summary: String,
    /// The JSON of `cairn-runner checkpoint --output json`, for the agent
    /// that asked for it.
    pub report: serde_json::Value,
    /// Each repository's state as the checkpoint read it.
    pub repos: Vec<RepoState>,
}

impl Checkpointed {
    pub fn baseline(&self) -> Baseline {
        Baseline {
            checkpoint_id: self.id.clone(),
            root_tree: self.root_tree,
        }
    }
}

/// Why a restore or checkpoint failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceStoreError {
    #[error(transparent)]
    Restore(#[from] RestoreError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

impl WorkspaceStoreError {
    /// The coordinator refuses this attempt's writes: a newer attempt owns
    /// the workspace now (or the run token stopped counting).
    pub fn is_fenced(&self) -> bool {
        match self {
            Self::Checkpoint(e) => e.is_fenced(),
            _ => false,
        }
    }

    /// The attempt fails with this error instead of the runner: the
    /// workspace's checkpoints themselves are unusable, or the disk is too
    /// small for them.
    pub fn is_permanent(&self) -> bool {
        let Self::Restore(e) = self else {
            return false;
        };
        // A disk too small for the workspace fails the attempt with the
        // space it needs; the restore left no tree that passes for it.
        e.is_out_of_space()
            || matches!(
                e.cause(),
                RestoreError::NothingRestorable { .. }
                    | RestoreError::CheckpointNotFound { .. }
                    | RestoreError::Manifest(_)
            )
    }
}

/// Restores and checkpoints the run's workspace.
pub trait WorkspaceStore: Send + Sync {
    /// Restores the newest restorable checkpoint into the root.
    fn restore(&self) -> BoxFuture<'_, Result<Restored, WorkspaceStoreError>>;
    /// Cuts a checkpoint of the root; `None` when `unless_unchanged` held.
    fn checkpoint(
        &self,
        request: CheckpointRequest,
    ) -> BoxFuture<'_, Result<Option<Checkpointed>, WorkspaceStoreError>>;
    /// What the root holds that no checkpoint has yet, when the store can
    /// tell without walking it (`None`: it cannot, or not now).
    fn unsaved(&self) -> BoxFuture<'_, Option<Unsaved>> {
        Box::pin(async { None })
    }
}

/// What a store is for: one attempt's workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreTarget {
    pub workspace_id: WorkspaceId,
    pub generation: Generation,
    /// Gitignore-style patterns (relative to the root) never checkpointed.
    pub excludes: Vec<String>,
    /// The run's own limits on each checkpoint (AttemptSpec.checkpoint_limits).
    pub limits: cairn_proto::runs::CheckpointLimits,
}

/// The checkpoint engine against the coordinator.
#[derive(Debug, Clone)]
pub struct RemoteStore {
    pub coordinator: String,
    pub token: String,
    pub root: PathBuf,
    pub cache_dir: PathBuf,
    /// The host's pack cache, for the restore.
    pub pack_cache: Option<restore::PackCacheConfig>,
    pub target: StoreTarget,
    /// What one checkpoint may hold, by the runner's own flags; the run's
    /// limits ([`StoreTarget::limits`]) can only tighten them.
    pub limits: cairn_proto::runs::CheckpointLimits,
    /// Made after the restore (whose writes the change tracker need not
    /// see), or by the first checkpoint, and kept for the later ones.
    pub resident: Arc<tokio::sync::OnceCell<Arc<Resident>>>,
    /// Readying the runner for its first checkpoint after the restore
    /// (change tracking armed, the cache loaded), while the run goes on.
    pub arming: Arc<Arming>,
}

/// The readying that follows a restore, in the background: the restore is
/// reported and the harness starts meanwhile. A checkpoint waits for it.
///
/// Nothing the harness changes meanwhile is lost, though no watch sees
/// it: the first walk of the workspace, which the readying makes once the
/// watches are in place, stats every file and compares it with what the
/// restore wrote; the watches then see everything after it.
#[derive(Debug, Default)]
pub struct Arming(tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>);

impl Arming {
    async fn begin(&self, task: tokio::task::JoinHandle<()>) {
        *self.0.lock().await = Some(task);
    }

    /// Waits until the readying, if one was begun, is done.
    async fn done(&self) {
        let mut task = self.0.lock().await;
        if let Some(running) = task.take()
            && let Err(e) = running.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

impl RemoteStore {
    async fn resident(&self) -> Arc<Resident> {
        let root = self.root.clone();
        self.resident
            .get_or_init(|| async move {
                let started = tokio::task::spawn_blocking(move || {
                    ChangeTracker::start(&root, DEFAULT_FULL_SCAN_INTERVAL)
                        .map_err(|e| e.to_string())
                })
                .await
                .unwrap_or_else(|e| Err(e.to_string()));
                let tracker = started
                    .inspect_err(|error| {
                        tracing::warn!(%error, "change tracking is off; every checkpoint walks the whole workspace");
                    })
                    .ok();
                Arc::new(Resident::new(tracker))
            })
            .await
            .clone()
    }
}

impl RemoteStore {
    /// Arms change tracking, then loads the fingerprint cache of the
    /// checkpoint the restore wrote and works out what it holds per listing
    /// (from a first walk made after the watches are in place: see
    /// [`Arming`]), so that the first checkpoint finds it all in memory.
    async fn ready_after_restore(&self, workspace: WorkspaceId, key_id: String) {
        let started = std::time::Instant::now();
        let opts = self.checkpoint_options(CheckpointReason::Turn, None).await;
        // As the checkpoint will name it.
        let cache_dir =
            std::fs::canonicalize(&self.cache_dir).unwrap_or_else(|_| self.cache_dir.clone());
        checkpoint::prime(&opts, workspace, key_id, cache_dir).await;
        tracing::debug!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            "change tracking armed after the restore"
        );
    }

    /// Reports a restore or checkpoint to the host, if it asked for
    /// reports ([`host_reports`]); the run goes on whatever happens.
    fn tell_host(&self, report: &HostReport) {
        if let Err(e) = host_reports::append(&self.cache_dir, report) {
            tracing::debug!(error = %e, "cannot append to the host's reports file");
        }
    }

    /// How this store checkpoints the workspace.
    async fn checkpoint_options(
        &self,
        reason: CheckpointReason,
        harness: Option<pb::HarnessSession>,
    ) -> CheckpointOptions {
        CheckpointOptions {
            coordinator: self.coordinator.clone(),
            token: Some(self.token.clone()),
            workspace: self.target.workspace_id.to_string(),
            root: self.root.clone(),
            reason,
            cache_dir: self.cache_dir.clone(),
            skip_ignored: false,
            excludes: self.target.excludes.clone(),
            generation: Some(self.target.generation),
            harness,
            limits: self.limits.stricter(self.target.limits),
            resident: Some(self.resident().await),
        }
    }
}

/// Entries an unsaved count looks at before it stops (its figures are
/// then a floor): a bound on the work of one count.
const UNSAVED_COUNT_AT_MOST: usize = 100_000;

impl WorkspaceStore for RemoteStore {
    fn unsaved(&self) -> BoxFuture<'_, Option<Unsaved>> {
        Box::pin(async move {
            // Only once the first checkpoint made the resident state: its
            // walk is what the count compares with.
            let resident = self.resident.get()?.clone();
            let cache_dir =
                std::fs::canonicalize(&self.cache_dir).unwrap_or_else(|_| self.cache_dir.clone());
            let opts = ScanOptions {
                root: self.root.clone(),
                skip_ignored: false,
                excludes: self.target.excludes.clone(),
                exclude_paths: vec![cache_dir],
            };
            tokio::task::spawn_blocking(move || {
                resident.tracker()?.unsaved(&opts, UNSAVED_COUNT_AT_MOST)
            })
            .await
            .ok()
            .flatten()
        })
    }

    fn restore(&self) -> BoxFuture<'_, Result<Restored, WorkspaceStoreError>> {
        let (address, token) = (self.coordinator.clone(), self.token.clone());
        let root = self.root.clone();
        let opts = RestoreOptions {
            cache_dir: Some(self.cache_dir.clone()),
            pack_cache: self.pack_cache.clone(),
            ..RestoreOptions::new(self.root.clone(), self.target.workspace_id.clone())
        };
        Box::pin(async move {
            // The restore future is not Send (its pack streams borrow across
            // awaits), so it runs to completion on a blocking thread.
            let runtime = tokio::runtime::Handle::current();
            let restored = tokio::task::spawn_blocking(move || {
                runtime.block_on(async {
                    let coordinator = CoordinatorClient::connect(&address, Some(&token)).await?;
                    restore::restore(&coordinator, &opts, &NoProgress).await
                })
            })
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
            match restored {
                Ok(report) => {
                    self.tell_host(&HostReport::Restore {
                        duration_ms: report.duration_ms,
                        bytes_downloaded: report.bytes_downloaded,
                        bytes_from_cache: report.bytes_from_cache,
                        bytes_written: report.bytes_written,
                    });
                    // The restore recorded what it wrote in the cache: the
                    // first checkpoint finds it in memory, with what the
                    // restored checkpoint holds worked out meanwhile. None
                    // of it is needed to report the restore or to start
                    // the harness, so it happens beside them.
                    if let Ok(workspace) = report.checkpoint.workspace_id.parse::<WorkspaceId>() {
                        let store = self.clone();
                        let key_id = report.checkpoint.key_id.clone();
                        self.arming
                            .begin(tokio::spawn(async move {
                                store.ready_after_restore(workspace, key_id).await;
                            }))
                            .await;
                    }
                    Ok(Restored::Checkpoint {
                        id: report.checkpoint_id.clone(),
                        root_tree: BlobId::from_slice(&report.checkpoint.root_tree).ok(),
                        summary: crate::report::restore_summary(&report, &root)
                            .replace("\n  ", "; "),
                    })
                }
                Err(RestoreError::NoCheckpoints { .. }) => Ok(Restored::NoCheckpoint),
                Err(e) => Err(e.into()),
            }
        })
    }

    fn checkpoint(
        &self,
        request: CheckpointRequest,
    ) -> BoxFuture<'_, Result<Option<Checkpointed>, WorkspaceStoreError>> {
        Box::pin(async move {
            self.arming.done().await;
            let opts = self
                .checkpoint_options(request.reason, request.harness)
                .await;
            let report = match &request.unless_unchanged {
                Some(baseline) => checkpoint::checkpoint_if_changed(opts, baseline).await?,
                None => Some(checkpoint::checkpoint(opts).await?),
            };
            if let Some(report) = &report {
                self.tell_host(&HostReport::Checkpoint {
                    duration_ms: report.stats.duration_ms,
                    bytes_uploaded: report.stats.uploaded_bytes,
                });
            }
            Ok(report.map(|report| Checkpointed {
                id: report.checkpoint_id.clone(),
                root_tree: report.root_tree,
                summary: describe(&report),
                report: serde_json::to_value(&report).unwrap_or_default(),
                repos: report.repos,
            }))
        })
    }
}

/// `pause checkpoint #4: 12 files, 1.2 MiB; uploaded 3 KiB in 85 ms`.
pub fn describe(report: &CheckpointReport) -> String {
    let s = &report.stats;
    format!(
        "{} checkpoint #{}: {} files, {}; uploaded {} in {} ms",
        report.reason,
        report.sequence,
        s.files,
        human_bytes(s.total_bytes),
        human_bytes(s.uploaded_bytes),
        s.duration_ms
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_proto::ids::{Generation, PackId};
    use cairn_proto::refusal::Refusal;

    #[test]
    fn fencing_and_permanent_failures_are_told_apart() {
        let stale = WorkspaceStoreError::Checkpoint(CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: Refusal::StaleGeneration {
                given: Generation(2),
                current: Generation(3),
            }
            .into_status("generation 2 is older than the workspace's generation 3"),
        });
        assert!(stale.is_fenced() && !stale.is_permanent());
        let lost_pack = WorkspaceStoreError::Checkpoint(CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: Refusal::PacksMissing {
                packs: vec![PackId::from_digest(&[0xff; 32])],
            }
            .into_status("pack 00ff is not in the store"),
        });
        assert!(
            !lost_pack.is_fenced(),
            "a lost pack is the engine's to redo, not a fence"
        );
        let untyped = WorkspaceStoreError::Checkpoint(CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: tonic::Status::failed_precondition("generation 2 is older"),
        });
        assert!(
            !untyped.is_fenced(),
            "a refusal without a typed reason is a failure, whatever its message"
        );
        let unrestorable = WorkspaceStoreError::Restore(RestoreError::NothingRestorable {
            workspace: "w".into(),
            failures: vec![],
        });
        assert!(unrestorable.is_permanent() && !unrestorable.is_fenced());
        let down = WorkspaceStoreError::Restore(RestoreError::CoordinatorClient(
            tonic::Status::unavailable("down"),
        ));
        assert!(!down.is_permanent());
    }
}
