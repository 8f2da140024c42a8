//! What a runner remembers between checkpoints, behind one interface.
//!
//! The stages of a checkpoint ask a [`Recall`] for everything an earlier
//! checkpoint can spare them, and hand it what this one learned; none of
//! them asks whether the runner is resident. Two providers:
//! - [`OneShot`] (`cairn-runner checkpoint`, and every runner not told to
//!   keep anything) remembers nothing: a fresh connection, a whole walk,
//!   every repository read in full, the fingerprint cache loaded from disk
//!   and written back while the coordinator commits, no memo;
//! - a resident runner's [`Resident`](super::Resident) (see resident.rs)
//!   keeps the connection, the change tracker, the repositories' last
//!   readings, the cache in memory and the memo of its last checkpoint.

use std::future::Future;
use std::io;
use std::path::Path;
use std::sync::Arc;

use cairn_proto::ids::WorkspaceId;

use super::learn::Learned;
use super::memo::Memo;
use super::remote::Committed;
use super::{Baseline, CheckpointError};
use crate::cache::FingerprintCache;
use crate::client::{ConnectError, CoordinatorClient};
use crate::git::StatusMemory;
use crate::scan::{self, RepoFound, Scan, ScanError, ScanOptions};
use crate::tracker::ScanKind;

/// What a runner remembers between checkpoints: where a checkpoint's
/// stages get what an earlier one can spare them, and what they hand on
/// for the next. Each call stands for one of them; see the module doc for
/// the two providers.
pub(crate) trait Recall: Clone + Send + Sync + 'static {
    /// The connection to the coordinator at `address` with `token`.
    async fn coordinator(
        &self,
        address: &str,
        token: Option<&str>,
    ) -> Result<CoordinatorClient, ConnectError>;

    /// Whether the walk goes on while the coordinator answers
    /// BeginCheckpoint: a short walk, for an unchanged workspace to be
    /// settled in one round trip's time. Otherwise a whole walk waits until
    /// the coordinator has vouched for the workspace, so that a mistyped
    /// one is refused at once.
    fn walk_beside_begin(&self) -> bool;

    /// How the walk hands each repository it finds to the git reader;
    /// `only_if_changed`: the checkpoint may be settled from the walk alone.
    fn repo_reading(&self, only_if_changed: bool) -> RepoReading;

    /// Walks the workspace (on a blocking thread), calling `on_repo` for
    /// each repository found.
    fn walk(
        &self,
        options: &ScanOptions,
        on_repo: &(dyn Fn(RepoFound) + Sync),
    ) -> Result<(Arc<Scan>, ScanKind), ScanError>;

    /// Whether `baseline` was cut from `walk` itself: nothing changed since.
    fn cut_from(&self, baseline: &Baseline, walk: &Arc<Scan>) -> bool;

    /// The last reading of each repository's status, once a reading that
    /// goes on in the background has ended ([`RepoReading::AfterWalk`]).
    async fn repo_statuses(&self) -> Option<StatusMemory>;

    /// Keeps this checkpoint's reading of each repository for the next.
    fn remember_statuses(&self, memory: StatusMemory);

    /// What earlier checkpoints of `workspace` (tenant key `key_id`) tell
    /// this one: the fingerprint cache under `cache_dir`, and the memo. No
    /// other checkpoint gets the cache until this one hands it back
    /// ([`Recall::unchanged`], [`Recall::commit`]).
    async fn known(&self, cache_dir: &Path, workspace: &WorkspaceId, key_id: &str) -> Known;

    /// The checkpoint found the workspace equal to `baseline`, its newest
    /// one, and commits nothing; `learned` is what it worked out.
    async fn unchanged(&self, baseline: Baseline, learned: Learned);

    /// Commits the checkpoint (`committing`) and has the fingerprint cache
    /// (and the memo) learn what it holds; when that is worked out and
    /// written, beside the commit or after it, is the provider's choice.
    async fn commit(
        &self,
        committing: impl Future<Output = Result<Committed, CheckpointError>> + Send,
        learned: Learned,
    ) -> Result<Committed, CheckpointError>;
}

/// How the walk hands the repositories it finds to the git reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RepoReading {
    /// Each is read in full at once, beside the walk; nothing is kept.
    AtOnce,
    /// Each is read in full at once, beside the walk, and the reading is
    /// kept for the next checkpoint's.
    AtOnceRemembered,
    /// Each waits for the end of the walk, and is then read for only what
    /// changed since its last reading ([`Recall::repo_statuses`]), which
    /// needs the whole walk; the checkpoint may also be settled from the
    /// walk alone, reading no repository.
    AfterWalk,
}

/// What earlier checkpoints tell this one ([`Recall::known`]).
#[derive(Debug)]
pub(crate) struct Known {
    pub cache: FingerprintCache,
    /// What the last checkpoint found per directory listing.
    pub memo: Option<Arc<Memo>>,
}

/// A runner that remembers nothing between checkpoints.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OneShot;

impl Recall for OneShot {
    async fn coordinator(
        &self,
        address: &str,
        token: Option<&str>,
    ) -> Result<CoordinatorClient, ConnectError> {
        CoordinatorClient::connect_retrying(address, token).await
    }

    fn walk_beside_begin(&self) -> bool {
        false
    }

    fn repo_reading(&self, _only_if_changed: bool) -> RepoReading {
        RepoReading::AtOnce
    }

    fn walk(
        &self,
        options: &ScanOptions,
        on_repo: &(dyn Fn(RepoFound) + Sync),
    ) -> Result<(Arc<Scan>, ScanKind), ScanError> {
        scan::scan(options, on_repo).map(|scan| {
            let kind = ScanKind::Full {
                reason: "no change tracker".into(),
            };
            (Arc::new(scan), kind)
        })
    }

    fn cut_from(&self, _baseline: &Baseline, _walk: &Arc<Scan>) -> bool {
        false
    }

    async fn repo_statuses(&self) -> Option<StatusMemory> {
        None
    }

    fn remember_statuses(&self, _memory: StatusMemory) {}

    async fn known(&self, cache_dir: &Path, workspace: &WorkspaceId, key_id: &str) -> Known {
        Known {
            cache: FingerprintCache::load(cache_dir, workspace, key_id),
            memo: None,
        }
    }

    async fn unchanged(&self, _baseline: Baseline, _learned: Learned) {}

    /// Writes the cache while the coordinator commits: it only records
    /// what this checkpoint read and where its blobs are, all known now.
    async fn commit(
        &self,
        committing: impl Future<Output = Result<Committed, CheckpointError>> + Send,
        learned: Learned,
    ) -> Result<Committed, CheckpointError> {
        let cache_path = learned.cache.path().to_path_buf();
        let saving = tokio::task::spawn_blocking(move || learned.save_cache());
        match committing.await {
            Ok(committed) => {
                saving.await.map_err(|e| {
                    CheckpointError::Task(format!("a checkpoint worker failed: {e}"))
                })?;
                Ok(committed)
            }
            Err(e) => {
                // The saved cache places blobs in packs no checkpoint
                // holds; start the next checkpoint from nothing rather
                // than be refused.
                let _ = saving.await;
                if let Err(remove) = std::fs::remove_file(&cache_path)
                    && remove.kind() != io::ErrorKind::NotFound
                {
                    tracing::warn!(error = %remove, path = %cache_path.display(), "cannot remove the fingerprint cache of a failed commit");
                }
                Err(e)
            }
        }
    }
}
