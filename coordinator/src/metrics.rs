//! The coordinator's Prometheus metrics, served at `/metrics` on
//! `--metrics-listen` (off unless given), in Prometheus' text format.
//!
//! Two kinds: what the coordinator counts as it works (checkpoint commits,
//! refusals by reason, commit and restore-manifest latency, pack bytes
//! committed, heartbeat latency and failures, scheduler passes and how
//! long runs waited for their first host, garbage collection cycles and
//! what they deleted), and what it
//! reads from the database at each scrape (runs and hosts by state, how
//! long the oldest queued run has waited, what each tenant's packs hold,
//! and each active run's recovery point: the age of its workspace's newest
//! checkpoint, the work a crash would lose). Counters are this replica's
//! (the scheduler and the interval collector count only on the replica
//! that leads); the database figures are the same on every replica.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use cairn_proto::refusal::Refusal;
use cairn_proto::runs::{HostState, RunState};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tonic::{Code, Status};

use crate::db::{DbError, MetadataStore, Tally};
use crate::gc::GcReport;

/// The content type of Prometheus' text format.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoredLabel {
    tenant: String,
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabel {
    run: String,
    workspace: String,
}

type SecondsGauge = Gauge<f64, AtomicU64>;

/// The registry and the metrics in it; cheap to share.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    commits: Counter,
    refusals: Family<ReasonLabel, Counter>,
    commit_seconds: Histogram,
    committed_bytes: Counter,
    heartbeat_seconds: Histogram,
    heartbeats_failed: Family<ReasonLabel, Counter>,
    runs: Family<StateLabel, Gauge>,
    hosts: Family<StateLabel, Gauge>,
    oldest_queued: SecondsGauge,
    checkpoint_age: Family<RunLabel, SecondsGauge>,
    restore_manifest_seconds: Histogram,
    stored_packs: Family<StoredLabel, Gauge>,
    stored_bytes: Family<StoredLabel, Gauge>,
    scheduler_pass_seconds: Histogram,
    first_assignment_wait: Histogram,
    gc_cycles: Family<OutcomeLabel, Counter>,
    gc_cycle_seconds: Histogram,
    gc_last_success: SecondsGauge,
    gc_checkpoints_deleted: Counter,
    gc_workspaces_expired: Counter,
    gc_packs_deleted: Counter,
    gc_bytes_freed: Counter,
}

/// 1 ms to about 85 s, each bucket half again as wide as the one before,
/// so that a quantile read from them (`histogram_quantile`) is off by less
/// than a quarter: doubling buckets cannot tell 35 ms from 60.
fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 1.5, 29)
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let commits = Counter::default();
        registry.register(
            "cairn_checkpoints_committed",
            "Checkpoint commits answered with a checkpoint",
            commits.clone(),
        );
        let refusals = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "cairn_checkpoint_commits_refused",
            "Checkpoint commits refused, by reason (a typed refusal's kind, else the status code)",
            refusals.clone(),
        );
        let commit_seconds = Histogram::new(latency_buckets());
        registry.register(
            "cairn_checkpoint_commit_duration_seconds",
            "Time to answer a checkpoint commit that succeeded",
            commit_seconds.clone(),
        );
        let heartbeat_seconds = Histogram::new(latency_buckets());
        registry.register(
            "cairn_heartbeat_duration_seconds",
            "Time to answer a host's heartbeat that succeeded",
            heartbeat_seconds.clone(),
        );
        let heartbeats_failed = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "cairn_heartbeats_failed",
            "Heartbeats answered with an error, by status code",
            heartbeats_failed.clone(),
        );
        let committed_bytes = Counter::default();
        registry.register(
            "cairn_checkpoint_pack_bytes_committed",
            "Bytes of the new packs committed checkpoints brought into the store",
            committed_bytes.clone(),
        );
        let runs = Family::<StateLabel, Gauge>::default();
        registry.register("cairn_runs", "Runs by state", runs.clone());
        let hosts = Family::<StateLabel, Gauge>::default();
        registry.register("cairn_hosts", "Registered hosts by state", hosts.clone());
        let oldest_queued = SecondsGauge::default();
        registry.register(
            "cairn_queued_run_oldest_age_seconds",
            "How long the oldest queued run has waited for a host (0: none queued)",
            oldest_queued.clone(),
        );
        let checkpoint_age = Family::<RunLabel, SecondsGauge>::default();
        registry.register(
            "cairn_run_checkpoint_age_seconds",
            "Per active run, the age of its workspace's newest checkpoint (since the run was created, if the workspace has none): the work a crash would lose",
            checkpoint_age.clone(),
        );
        let restore_manifest_seconds = Histogram::new(latency_buckets());
        registry.register(
            "cairn_restore_manifest_duration_seconds",
            "Time to answer a restore manifest request that succeeded",
            restore_manifest_seconds.clone(),
        );
        let stored_packs = Family::<StoredLabel, Gauge>::default();
        registry.register(
            "cairn_stored_packs",
            "Packs in the object store per tenant; state is live, or condemned (unreferenced, deleted once the grace has passed)",
            stored_packs.clone(),
        );
        let stored_bytes = Family::<StoredLabel, Gauge>::default();
        registry.register(
            "cairn_stored_bytes",
            "Bytes of packs in the object store per tenant; state is live or condemned",
            stored_bytes.clone(),
        );
        let scheduler_pass_seconds = Histogram::new(latency_buckets());
        registry.register(
            "cairn_scheduler_pass_duration_seconds",
            "Time a scheduler pass took: lost hosts, expired holds, placements",
            scheduler_pass_seconds.clone(),
        );
        // 10 ms to about 45 min.
        let first_assignment_wait = Histogram::new(exponential_buckets(0.01, 2.0, 19));
        registry.register(
            "cairn_run_first_assignment_wait_seconds",
            "Time from a run's creation to its first assignment to a host",
            first_assignment_wait.clone(),
        );
        let gc_cycles = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "cairn_gc_cycles",
            "Garbage collection cycles run (not dry runs), by outcome: ok or failed",
            gc_cycles.clone(),
        );
        let gc_cycle_seconds = Histogram::new(latency_buckets());
        registry.register(
            "cairn_gc_cycle_duration_seconds",
            "Time a garbage collection cycle that succeeded took",
            gc_cycle_seconds.clone(),
        );
        let gc_last_success = SecondsGauge::default();
        registry.register(
            "cairn_gc_last_success_timestamp_seconds",
            "When this replica last finished a garbage collection cycle (Unix time; 0: never)",
            gc_last_success.clone(),
        );
        let gc_checkpoints_deleted = Counter::default();
        registry.register(
            "cairn_gc_checkpoints_deleted",
            "Checkpoints retention let go and garbage collection deleted",
            gc_checkpoints_deleted.clone(),
        );
        let gc_workspaces_expired = Counter::default();
        registry.register(
            "cairn_gc_workspaces_expired",
            "Finished workspaces deleted past their expiry",
            gc_workspaces_expired.clone(),
        );
        let gc_packs_deleted = Counter::default();
        registry.register(
            "cairn_gc_packs_deleted",
            "Packs garbage collection deleted from the object store (swept and orphaned uploads)",
            gc_packs_deleted.clone(),
        );
        let gc_bytes_freed = Counter::default();
        registry.register(
            "cairn_gc_freed_bytes",
            "Bytes garbage collection deleted from the object store",
            gc_bytes_freed.clone(),
        );
        Self {
            registry,
            commits,
            refusals,
            commit_seconds,
            committed_bytes,
            heartbeat_seconds,
            heartbeats_failed,
            runs,
            hosts,
            oldest_queued,
            checkpoint_age,
            restore_manifest_seconds,
            stored_packs,
            stored_bytes,
            scheduler_pass_seconds,
            first_assignment_wait,
            gc_cycles,
            gc_cycle_seconds,
            gc_last_success,
            gc_checkpoints_deleted,
            gc_workspaces_expired,
            gc_packs_deleted,
            gc_bytes_freed,
        }
    }

    /// Records a restore manifest answered in `took`.
    pub fn restore_manifest(&self, took: Duration) {
        self.restore_manifest_seconds.observe(took.as_secs_f64());
    }

    /// Records a scheduler pass and, for every run it assigned for the
    /// first time, how long that run waited since it was created.
    pub fn scheduler_pass(&self, took: Duration, first_assignment_waits: &[Duration]) {
        self.scheduler_pass_seconds.observe(took.as_secs_f64());
        for wait in first_assignment_waits {
            self.first_assignment_wait.observe(wait.as_secs_f64());
        }
    }

    /// Records a garbage collection cycle (not a dry run) that finished
    /// at `now`, and what it deleted.
    pub fn gc_cycle_done(&self, report: &GcReport, now: SystemTime) {
        self.gc_cycles
            .get_or_create(&OutcomeLabel { outcome: "ok" })
            .inc();
        self.gc_cycle_seconds.observe(report.took.as_secs_f64());
        let unix = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        self.gc_last_success.set(unix.as_secs_f64());
        self.gc_checkpoints_deleted
            .inc_by(report.checkpoints_deleted);
        self.gc_workspaces_expired.inc_by(report.workspaces_expired);
        self.gc_packs_deleted
            .inc_by(report.swept.packs + report.orphans_swept.packs);
        self.gc_bytes_freed.inc_by(
            report
                .swept
                .bytes
                .saturating_add(report.orphans_swept.bytes),
        );
    }

    /// Records a garbage collection cycle that failed.
    pub fn gc_cycle_failed(&self) {
        self.gc_cycles
            .get_or_create(&OutcomeLabel { outcome: "failed" })
            .inc();
    }

    /// Records a checkpoint commit's answer: the bytes of the new packs it
    /// committed, or the status it was refused with.
    pub fn checkpoint_commit(&self, took: Duration, answer: Result<u64, &Status>) {
        match answer {
            Ok(bytes) => {
                self.commits.inc();
                self.committed_bytes.inc_by(bytes);
                self.commit_seconds.observe(took.as_secs_f64());
            }
            Err(status) => {
                let reason = match Refusal::of(status) {
                    Some(refusal) => refusal.kind(),
                    None => code_label(status.code()),
                };
                self.refusals.get_or_create(&ReasonLabel { reason }).inc();
            }
        }
    }

    /// Records a heartbeat answered in `took`, or the status it failed
    /// with. A host whose heartbeats take near its lease, or fail, is
    /// about to be taken for lost.
    pub fn heartbeat(&self, took: Duration, answer: Result<(), &Status>) {
        match answer {
            Ok(()) => self.heartbeat_seconds.observe(took.as_secs_f64()),
            Err(status) => {
                self.heartbeats_failed
                    .get_or_create(&ReasonLabel {
                        reason: code_label(status.code()),
                    })
                    .inc();
            }
        }
    }

    /// Sets the database figures from `tally`, read at `now`.
    fn set(&self, tally: &Tally, now: SystemTime) {
        let age = |since: SystemTime| now.duration_since(since).unwrap_or_default().as_secs_f64();
        for state in RunState::ALL {
            let count = tally.runs.get(state).copied().unwrap_or(0);
            self.runs
                .get_or_create(&StateLabel {
                    state: state.as_str(),
                })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
        for state in HostState::ALL {
            let count = tally.hosts.get(state).copied().unwrap_or(0);
            self.hosts
                .get_or_create(&StateLabel {
                    state: state.as_str(),
                })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
        self.oldest_queued
            .set(tally.oldest_queued_since.map_or(0.0, age));
        // Runs that ended since the last scrape leave no series behind.
        self.checkpoint_age.clear();
        for run in &tally.active {
            let label = RunLabel {
                run: run.run.to_string(),
                workspace: run.workspace.to_string(),
            };
            let since = run.newest_checkpoint_at.unwrap_or(run.created_at);
            self.checkpoint_age.get_or_create(&label).set(age(since));
        }
        // A tenant whose packs are all gone leaves no series behind.
        self.stored_packs.clear();
        self.stored_bytes.clear();
        for stored in &tally.stored {
            for (state, packs) in [("live", stored.live), ("condemned", stored.condemned)] {
                let label = StoredLabel {
                    tenant: stored.tenant.to_string(),
                    state,
                };
                self.stored_packs
                    .get_or_create(&label)
                    .set(i64::try_from(packs.packs).unwrap_or(i64::MAX));
                self.stored_bytes
                    .get_or_create(&label)
                    .set(i64::try_from(packs.bytes).unwrap_or(i64::MAX));
            }
        }
    }

    /// Reads the database figures and encodes every metric.
    pub async fn render(&self, db: &MetadataStore) -> Result<String, DbError> {
        let tally = db.tally().await?;
        self.set(&tally, SystemTime::now());
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        Ok(text)
    }
}

/// The label a status without a typed refusal counts under.
fn code_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

struct Scrape {
    metrics: Arc<Metrics>,
    db: Arc<MetadataStore>,
}

async fn scrape(State(scrape): State<Arc<Scrape>>) -> Response {
    match scrape.metrics.render(&scrape.db).await {
        Ok(text) => ([(header::CONTENT_TYPE, TEXT_FORMAT)], text).into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "could not read the database for a metrics scrape");
            let body = format!("could not read the database: {e}\n");
            (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
        }
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    db: Arc<MetadataStore>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = Router::new()
        .route("/metrics", get(scrape))
        .with_state(Arc::new(Scrape { metrics, db }));
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use cairn_proto::ids::{RunId, TenantId, WorkspaceId};

    use super::*;
    use crate::db::{ActiveRun, PackTally, StoredPacks};

    fn lines_of(metrics: &Metrics, prefix: &str) -> Vec<String> {
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &metrics.registry).unwrap();
        text.lines()
            .filter(|line| line.starts_with(prefix))
            .map(str::to_owned)
            .collect()
    }

    fn encoded(metrics: &Metrics) -> Vec<String> {
        lines_of(metrics, "cairn_run_checkpoint_age_seconds{")
    }

    #[test]
    fn gc_counters_add_up_what_each_cycle_deleted() {
        let metrics = Metrics::new();
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let report = GcReport {
            checkpoints_deleted: 3,
            workspaces_expired: 1,
            swept: PackTally {
                packs: 4,
                bytes: 4000,
            },
            orphans_swept: PackTally {
                packs: 1,
                bytes: 500,
            },
            took: Duration::from_millis(20),
            ..GcReport::default()
        };
        metrics.gc_cycle_done(&report, at);
        metrics.gc_cycle_done(&report, at + Duration::from_secs(60));
        metrics.gc_cycle_failed();
        let mut lines = lines_of(&metrics, "cairn_gc_");
        lines.retain(|line| !line.contains("_bucket") && !line.contains("duration"));
        lines.sort();
        assert_eq!(
            lines,
            [
                "cairn_gc_checkpoints_deleted_total 6",
                "cairn_gc_cycles_total{outcome=\"failed\"} 1",
                "cairn_gc_cycles_total{outcome=\"ok\"} 2",
                "cairn_gc_freed_bytes_total 9000",
                "cairn_gc_last_success_timestamp_seconds 1700000060.0",
                "cairn_gc_packs_deleted_total 10",
                "cairn_gc_workspaces_expired_total 2",
            ]
        );
    }

    #[test]
    fn stored_figures_are_per_tenant_and_state_and_vanish_with_the_tenants_packs() {
        let metrics = Metrics::new();
        let tenant = TenantId::default_tenant();
        let tally = Tally {
            stored: vec![StoredPacks {
                tenant: tenant.clone(),
                live: PackTally {
                    packs: 5,
                    bytes: 5_000,
                },
                condemned: PackTally {
                    packs: 1,
                    bytes: 700,
                },
            }],
            ..Tally::default()
        };
        metrics.set(&tally, SystemTime::now());
        let mut lines = lines_of(&metrics, "cairn_stored_bytes{");
        lines.sort();
        assert_eq!(
            lines,
            [
                format!("cairn_stored_bytes{{tenant=\"{tenant}\",state=\"condemned\"}} 700"),
                format!("cairn_stored_bytes{{tenant=\"{tenant}\",state=\"live\"}} 5000"),
            ]
        );
        metrics.set(&Tally::default(), SystemTime::now());
        assert!(lines_of(&metrics, "cairn_stored_").is_empty());
    }

    #[test]
    fn recovery_points_age_from_the_newest_checkpoint_and_vanish_with_their_run() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let checkpointed = ActiveRun {
            run: RunId::generate(),
            workspace: WorkspaceId::generate(),
            created_at: now - Duration::from_secs(600),
            newest_checkpoint_at: Some(now - Duration::from_secs(90)),
        };
        let fresh = ActiveRun {
            run: RunId::generate(),
            workspace: WorkspaceId::generate(),
            created_at: now - Duration::from_secs(30),
            newest_checkpoint_at: None,
        };
        let metrics = Metrics::new();
        let tally = Tally {
            active: vec![checkpointed.clone(), fresh.clone()],
            ..Tally::default()
        };
        metrics.set(&tally, now);
        let mut lines = encoded(&metrics);
        lines.sort();
        let mut expected = vec![
            format!(
                "cairn_run_checkpoint_age_seconds{{run=\"{}\",workspace=\"{}\"}} 90.0",
                checkpointed.run, checkpointed.workspace
            ),
            format!(
                "cairn_run_checkpoint_age_seconds{{run=\"{}\",workspace=\"{}\"}} 30.0",
                fresh.run, fresh.workspace
            ),
        ];
        expected.sort();
        assert_eq!(lines, expected);

        // The checkpointed run ended: its series goes with it.
        let tally = Tally {
            active: vec![fresh.clone()],
            ..Tally::default()
        };
        metrics.set(&tally, now);
        assert_eq!(encoded(&metrics).len(), 1);
        assert!(encoded(&metrics)[0].contains(fresh.run.as_str()));
    }
}
