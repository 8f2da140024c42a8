//! The coordinator's Prometheus metrics, served at `/metrics` on
//! `--metrics-listen` (off unless given), in Prometheus' text format.
//!
//! Two kinds: what the coordinator counts as it answers (checkpoint
//! commits, refusals by reason, commit latency, pack bytes committed),
//! and what it reads from the database at each scrape (runs and hosts by
//! state, how long the oldest queued run has waited, and each active run's
//! recovery point: the age of its workspace's newest checkpoint, the work a
//! crash would lose). Counters are this replica's; the database figures
//! are the same on every replica.

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
    runs: Family<StateLabel, Gauge>,
    hosts: Family<StateLabel, Gauge>,
    oldest_queued: SecondsGauge,
    checkpoint_age: Family<RunLabel, SecondsGauge>,
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
        // 1 ms to about 65 s.
        let commit_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 17));
        registry.register(
            "cairn_checkpoint_commit_duration_seconds",
            "Time to answer a checkpoint commit that succeeded",
            commit_seconds.clone(),
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
        Self {
            registry,
            commits,
            refusals,
            commit_seconds,
            committed_bytes,
            runs,
            hosts,
            oldest_queued,
            checkpoint_age,
        }
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

    use cairn_proto::ids::{RunId, WorkspaceId};

    use super::*;
    use crate::db::ActiveRun;

    fn encoded(metrics: &Metrics) -> Vec<String> {
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &metrics.registry).unwrap();
        text.lines()
            .filter(|line| line.starts_with("cairn_run_checkpoint_age_seconds{"))
            .map(str::to_owned)
            .collect()
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
