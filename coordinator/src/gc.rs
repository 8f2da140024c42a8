//! Garbage collection: retention carried out, then mark and sweep of packs,
//! without ever reading a byte of one.
//!
//! A [`Collector::cycle`] (on an interval, or `cairnctl gc`) does, in order:
//!
//! 1. finishes the deletions an earlier sweep left written (it was cut
//!    short: the process died between its transaction and the store);
//! 2. **retention**: per workspace, deletes the checkpoints
//!    [`crate::retention::decide`] lets go, and deletes finished workspaces
//!    past their expiry;
//! 3. **mark**: condemns the packs no checkpoint references (and absolves
//!    condemned ones a commit referenced since);
//! 4. **sweep**: packs condemned at least the grace period ago and still
//!    unreferenced lose their records and deletions are written in one
//!    transaction, then their objects are deleted, then the deletions are
//!    forgotten;
//! 5. **orphans**: objects under `packs/` that no record names (uploads no
//!    commit recorded) and older than the grace go the same way.
//!
//! The grace is longer than any signed URL lives (`serve` refuses less), so
//! a restore or upload that got its URLs before a pack was condemned has
//! finished with them before the pack can go. Why a commit racing a sweep
//! never references a deleted pack is told in `db/gc.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use cairn_proto::domain::WorkspaceState;
use cairn_proto::ids::{CheckpointId, TenantId};
use cairn_utils::failpoint;
use futures::{StreamExt as _, TryStreamExt as _};

use crate::clock::Clock;
use crate::db::{DbError, MetadataStore, PackDeletion, PackTally};
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::retention::{self, Policy};
use crate::store::{ObjectKey, ObjectStore, ObjectStoreError};

/// Where a sweep stops between its transaction and the store (tests pause
/// it there, or crash the process there).
pub const FAILPOINT_BEFORE_STORE_DELETES: &str = "gc-before-store-deletes";
/// Where a cycle stops after marking, before it sweeps.
pub const FAILPOINT_AFTER_MARK: &str = "gc-after-mark";

/// Packs one sweep transaction takes at most.
const SWEEP_BATCH: u32 = 1000;
/// Objects deleted from the store at once.
const DELETE_CONCURRENCY: usize = 16;

/// How garbage collection runs.
#[derive(Debug, Clone)]
pub struct GcConfig {
    /// The server's retention defaults.
    pub policy: Policy,
    /// How long a condemned pack (or an uncommitted upload) stays before it
    /// is deleted; longer than any signed URL lives.
    pub grace: Duration,
    /// How often a cycle runs on its own (`None`: only when asked).
    pub interval: Option<Duration>,
}

impl Default for GcConfig {
    fn default() -> Self {
        Self {
            policy: Policy::default(),
            grace: Duration::from_secs(2 * 3600),
            interval: Some(Duration::from_secs(600)),
        }
    }
}

/// Why a cycle stopped.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Store(#[from] ObjectStoreError),
    #[error(transparent)]
    Failpoint(#[from] failpoint::FailpointError),
}

/// What a cycle did (or, dry, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub dry_run: bool,
    pub checkpoints_deleted: u64,
    pub workspaces_expired: u64,
    pub condemned: PackTally,
    pub swept: PackTally,
    pub orphans_swept: PackTally,
    pub awaiting_grace: PackTally,
    pub grace: Duration,
    pub took: Duration,
}

/// Runs garbage collection cycles over one metadata store and object store.
#[derive(Clone)]
pub struct Collector {
    db: Arc<MetadataStore>,
    store: Arc<dyn ObjectStore>,
    config: GcConfig,
    clock: Clock,
    metrics: Arc<Metrics>,
    /// One cycle at a time: two sweeps would race over the same deletions.
    running: Arc<tokio::sync::Mutex<()>>,
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collector")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Collector {
    pub fn new(
        db: Arc<MetadataStore>,
        store: Arc<dyn ObjectStore>,
        config: GcConfig,
        clock: Clock,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            db,
            store,
            config,
            clock,
            metrics,
            running: Arc::default(),
        }
    }

    pub fn config(&self) -> &GcConfig {
        &self.config
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Runs one cycle over `tenant` (or every tenant); with `dry_run`, only
    /// works out what it would do.
    pub async fn cycle(
        &self,
        tenant: Option<&TenantId>,
        dry_run: bool,
    ) -> Result<GcReport, GcError> {
        let _one_at_a_time = self.running.lock().await;
        let cycled = self.cycle_alone(tenant, dry_run).await;
        if !dry_run {
            match &cycled {
                Ok(report) => self.metrics.gc_cycle_done(report, self.clock.now()),
                Err(_) => self.metrics.gc_cycle_failed(),
            }
        }
        cycled
    }

    /// [`Self::cycle`], while no other cycle runs.
    async fn cycle_alone(
        &self,
        tenant: Option<&TenantId>,
        dry_run: bool,
    ) -> Result<GcReport, GcError> {
        let started = Instant::now();
        let now = self.clock.now();
        let cutoff = now
            .checked_sub(self.config.grace)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let mut report = GcReport {
            dry_run,
            grace: self.config.grace,
            ..GcReport::default()
        };
        if dry_run {
            self.dry_run(tenant, now, cutoff, &mut report).await?;
        } else {
            let pending = self.db.pending_pack_deletions(tenant).await?;
            if !pending.is_empty() {
                tracing::info!(
                    packs = pending.len(),
                    "finishing the pack deletions an earlier sweep left"
                );
                report.swept = self.delete_objects(&pending).await?;
            }
            self.apply_retention(tenant, now, &mut report).await?;
            let marked = self.db.condemn_unreferenced(tenant, now).await?;
            report.condemned.absorb(marked);
            failpoint::hit_async(FAILPOINT_AFTER_MARK).await?;
            loop {
                let batch = self
                    .db
                    .begin_pack_deletions(tenant, cutoff, SWEEP_BATCH, now)
                    .await?;
                if batch.is_empty() {
                    break;
                }
                failpoint::hit_async(FAILPOINT_BEFORE_STORE_DELETES).await?;
                let swept = self.delete_objects(&batch).await?;
                report.swept.packs += swept.packs;
                report.swept.bytes += swept.bytes;
            }
            let orphans = self.orphans(tenant, cutoff).await?;
            let started_orphans = self.db.begin_orphan_deletions(&orphans, now).await?;
            if !started_orphans.is_empty() {
                failpoint::hit_async(FAILPOINT_BEFORE_STORE_DELETES).await?;
            }
            report.orphans_swept = self.delete_objects(&started_orphans).await?;
            report.awaiting_grace = self.db.condemned_packs(tenant, cutoff).await?.1;
        }
        report.took = started.elapsed();
        Ok(report)
    }

    /// Deletes what retention lets go, counting it into `report`.
    async fn apply_retention(
        &self,
        tenant: Option<&TenantId>,
        now: SystemTime,
        report: &mut GcReport,
    ) -> Result<(), GcError> {
        for workspace in self.db.retained_workspaces(tenant).await? {
            let policy = self.config.policy.with_overrides(&workspace.overrides);
            if retention::expired(&policy, workspace.state, workspace.finished_at, now) {
                match self
                    .db
                    .delete_workspace(&workspace.tenant, &workspace.id, now)
                    .await
                {
                    Ok(deleted) => {
                        tracing::info!(workspace = %workspace.id, checkpoints = deleted.checkpoints, "deleted a finished workspace past its retention");
                        report.workspaces_expired += 1;
                        report.checkpoints_deleted += deleted.checkpoints;
                        report.condemned.absorb(deleted.condemned);
                    }
                    // Runs that have not ended hold it; the next cycle tries again.
                    Err(DbError::WorkspaceHasRuns { runs, .. }) => {
                        tracing::warn!(workspace = %workspace.id, runs = runs.len(), "an expired workspace still has runs; kept for now");
                    }
                    Err(e) => return Err(e.into()),
                }
                continue;
            }
            let doomed = self.doomed(&workspace.id, &policy, now).await?;
            if doomed.is_empty() {
                continue;
            }
            let deleted = self
                .db
                .delete_expired_checkpoints(&workspace.id, &doomed, policy.run_start_hold, now)
                .await?;
            if deleted.checkpoints > 0 {
                tracing::info!(workspace = %workspace.id, deleted = deleted.checkpoints, "retention deleted checkpoints");
            }
            report.checkpoints_deleted += deleted.checkpoints;
            report.condemned.absorb(deleted.condemned);
        }
        Ok(())
    }

    /// The checkpoints of `workspace` nothing keeps at `now`.
    async fn doomed(
        &self,
        workspace: &cairn_proto::ids::WorkspaceId,
        policy: &Policy,
        now: SystemTime,
    ) -> Result<Vec<CheckpointId>, GcError> {
        let facts = self.db.retention_facts(workspace).await?;
        Ok(retention::decide(
            policy,
            &facts.checkpoints,
            &facts.pins,
            &facts.run_starts,
            now,
        )
        .into_iter()
        .filter(|v| !v.is_kept())
        .map(|v| v.checkpoint)
        .collect())
    }

    /// What a cycle would do, without changing anything.
    async fn dry_run(
        &self,
        tenant: Option<&TenantId>,
        now: SystemTime,
        cutoff: SystemTime,
        report: &mut GcReport,
    ) -> Result<(), GcError> {
        let mut doomed = Vec::new();
        for workspace in self.db.retained_workspaces(tenant).await? {
            let policy = self.config.policy.with_overrides(&workspace.overrides);
            if retention::expired(&policy, workspace.state, workspace.finished_at, now) {
                let facts = self.db.retention_facts(&workspace.id).await?;
                report.workspaces_expired += 1;
                doomed.extend(facts.checkpoints.into_iter().map(|c| c.id));
            } else if workspace.state != WorkspaceState::Deleted {
                doomed.extend(self.doomed(&workspace.id, &policy, now).await?);
            }
        }
        report.checkpoints_deleted = doomed.len() as u64;
        report.condemned = self.db.packs_freed_by(tenant, &doomed).await?;
        let (due, waiting) = self.db.condemned_packs(tenant, cutoff).await?;
        report.swept = due;
        report.awaiting_grace = waiting;
        for orphan in self.orphans(tenant, cutoff).await? {
            report.orphans_swept.add(orphan.size);
        }
        Ok(())
    }

    /// Objects under `packs/` (of `tenant`) older than `cutoff` that no
    /// pack record names.
    async fn orphans(
        &self,
        tenant: Option<&TenantId>,
        cutoff: SystemTime,
    ) -> Result<Vec<PackDeletion>, GcError> {
        let prefix = match tenant {
            Some(tenant) => format!("packs/{tenant}/"),
            None => "packs/".to_owned(),
        };
        let mut old: Vec<PackDeletion> = Vec::new();
        for object in self.store.list(&prefix).await? {
            if object.modified > cutoff {
                continue;
            }
            let Some((tenant, pack)) = object.key.pack() else {
                tracing::warn!(key = %object.key, "an object under packs/ that names no pack; left alone");
                continue;
            };
            old.push(PackDeletion {
                tenant,
                pack,
                size: object.size,
            });
        }
        let mut orphans = Vec::new();
        let mut by_tenant: std::collections::BTreeMap<TenantId, Vec<PackDeletion>> =
            Default::default();
        for candidate in old {
            by_tenant
                .entry(candidate.tenant.clone())
                .or_default()
                .push(candidate);
        }
        for (tenant, candidates) in by_tenant {
            let ids: Vec<_> = candidates.iter().map(|c| c.pack.clone()).collect();
            let recorded = self.db.recorded_packs(&tenant, &ids).await?;
            orphans.extend(
                candidates
                    .into_iter()
                    .filter(|c| !recorded.contains(&c.pack)),
            );
        }
        Ok(orphans)
    }

    /// Deletes the objects of `deletions` from the store, then forgets the
    /// deletions. A store failure leaves them written for the next cycle.
    async fn delete_objects(&self, deletions: &[PackDeletion]) -> Result<PackTally, GcError> {
        let keys: Vec<ObjectKey> = deletions
            .iter()
            .map(|d| ObjectKey::for_pack(&d.tenant, &d.pack))
            .collect();
        futures::stream::iter(keys)
            .map(|key| {
                let store = self.store.clone();
                async move { store.delete(&key).await }
            })
            .buffer_unordered(DELETE_CONCURRENCY)
            .try_collect::<Vec<()>>()
            .await?;
        self.db.finish_pack_deletions(deletions).await?;
        let mut tally = PackTally::default();
        for deletion in deletions {
            tally.add(deletion.size);
        }
        Ok(tally)
    }

    /// Runs a cycle every interval until `shutdown` (nothing without an
    /// interval) while this replica leads. A failed cycle is logged; the
    /// next one tries again.
    pub async fn run(
        self,
        leadership: Arc<Leadership>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let Some(interval) = self.config.interval else {
            return;
        };
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = ticker.tick() => match leadership.lead(&self.db).await {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "could not read or renew the leader lease; no garbage collection cycle now");
                        continue;
                    }
                },
            }
            match self.cycle(None, false).await {
                Ok(report) => tracing::info!(
                    checkpoints_deleted = report.checkpoints_deleted,
                    workspaces_expired = report.workspaces_expired,
                    packs_swept = report.swept.packs + report.orphans_swept.packs,
                    bytes_freed = report.swept.bytes + report.orphans_swept.bytes,
                    took_ms = report.took.as_millis() as u64,
                    "garbage collection cycle"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "a garbage collection cycle failed; the next one tries again")
                }
            }
        }
    }
}
