//! The host agent's Prometheus metrics, served at `/metrics` on
//! `--metrics-listen` (off unless given), in Prometheus' text format.
//!
//! What the agent sees itself: its sandboxes by state and how they ended,
//! whether a sandbox started on a kept workspace tree, and its exchanges
//! with the coordinator. What its runners report
//! ([`cairn_engine::host_reports`]): restore and checkpoint durations,
//! and how many restored pack bytes came from the host's pack cache
//! rather than the object store. Those come from inside the sandboxes, so
//! they are what the runners say; lines that are not reports are counted
//! as rejected.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use cairn_engine::host_reports::{HostReport, NewReports};
use cairn_proto::runs::SandboxState;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// The content type of Prometheus' text format.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: &'static str,
}

/// The states a sandbox is in while it holds a slot.
const LIVE: [SandboxState; 2] = [SandboxState::Starting, SandboxState::Running];
/// The ways a sandbox ends.
const ENDED: [SandboxState; 3] = [
    SandboxState::Exited,
    SandboxState::Destroyed,
    SandboxState::Failed,
];

/// The registry and the metrics in it; cheap to share.
#[derive(Debug)]
pub struct HostMetrics {
    registry: Registry,
    slots: Gauge,
    sandboxes: Family<StateLabel, Gauge>,
    started: Counter,
    ended: Family<StateLabel, Counter>,
    kept_takes: Family<OutcomeLabel, Counter>,
    kept_trees: Gauge,
    heartbeats: Family<OutcomeLabel, Counter>,
    restore_seconds: Histogram,
    restore_pack_bytes: Family<SourceLabel, Counter>,
    restore_written_bytes: Counter,
    checkpoint_seconds: Histogram,
    checkpoint_uploaded_bytes: Counter,
    reports_rejected: Counter,
}

impl Default for HostMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl HostMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let slots = Gauge::default();
        registry.register(
            "cairn_host_slots",
            "Sandboxes this host may run at once (--slots)",
            slots.clone(),
        );
        let sandboxes = Family::<StateLabel, Gauge>::default();
        registry.register(
            "cairn_host_sandboxes",
            "Sandboxes holding a slot, by state: starting or running",
            sandboxes.clone(),
        );
        let started = Counter::default();
        registry.register(
            "cairn_host_sandboxes_started",
            "Sandboxes the driver started",
            started.clone(),
        );
        let ended = Family::<StateLabel, Counter>::default();
        registry.register(
            "cairn_host_sandboxes_ended",
            "Sandboxes gone, by how: exited (the runner ended), destroyed (an order or the host stopping) or failed (could not run)",
            ended.clone(),
        );
        let kept_takes = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "cairn_host_kept_tree_takes",
            "Sandboxes started with keeping on: hit if one started on the tree an earlier sandbox of its workspace left, else miss",
            kept_takes.clone(),
        );
        let kept_trees = Gauge::default();
        registry.register(
            "cairn_host_kept_trees",
            "Workspace trees this host keeps for the next sandbox of their workspace",
            kept_trees.clone(),
        );
        let heartbeats = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "cairn_host_heartbeats",
            "Exchanges with the coordinator (registration or heartbeat), by outcome: ok or failed",
            heartbeats.clone(),
        );
        let restore_seconds = Histogram::new(duration_buckets());
        registry.register(
            "cairn_host_restore_duration_seconds",
            "Time a runner took to restore its workspace, as it reported",
            restore_seconds.clone(),
        );
        let restore_pack_bytes = Family::<SourceLabel, Counter>::default();
        registry.register(
            "cairn_host_restore_pack_bytes",
            "Pack bytes restores read, by source: store (downloaded) or pack_cache (this host's pack cache)",
            restore_pack_bytes.clone(),
        );
        let restore_written_bytes = Counter::default();
        registry.register(
            "cairn_host_restore_written_bytes",
            "File content restores wrote (files already right on disk are not written)",
            restore_written_bytes.clone(),
        );
        let checkpoint_seconds = Histogram::new(duration_buckets());
        registry.register(
            "cairn_host_checkpoint_duration_seconds",
            "Time a runner took to cut and commit a checkpoint, as it reported",
            checkpoint_seconds.clone(),
        );
        let checkpoint_uploaded_bytes = Counter::default();
        registry.register(
            "cairn_host_checkpoint_uploaded_bytes",
            "Pack bytes checkpoints uploaded to the object store",
            checkpoint_uploaded_bytes.clone(),
        );
        let reports_rejected = Counter::default();
        registry.register(
            "cairn_host_sandbox_reports_rejected",
            "Lines of a sandbox's reports file that were not reports, or files refused (a symlink, say)",
            reports_rejected.clone(),
        );
        let metrics = Self {
            registry,
            slots,
            sandboxes,
            started,
            ended,
            kept_takes,
            kept_trees,
            heartbeats,
            restore_seconds,
            restore_pack_bytes,
            restore_written_bytes,
            checkpoint_seconds,
            checkpoint_uploaded_bytes,
            reports_rejected,
        };
        // Every series from the first scrape, zero or not.
        metrics.set_sandboxes(0, std::iter::empty());
        for state in ENDED {
            metrics
                .ended
                .get_or_create(&StateLabel {
                    state: state.as_str(),
                })
                .inc_by(0);
        }
        for outcome in ["hit", "miss"] {
            metrics
                .kept_takes
                .get_or_create(&OutcomeLabel { outcome })
                .inc_by(0);
        }
        for outcome in ["ok", "failed"] {
            metrics
                .heartbeats
                .get_or_create(&OutcomeLabel { outcome })
                .inc_by(0);
        }
        for source in ["store", "pack_cache"] {
            metrics
                .restore_pack_bytes
                .get_or_create(&SourceLabel { source })
                .inc_by(0);
        }
        metrics
    }

    /// Sets the slots and the states of the sandboxes the agent tracks.
    pub fn set_sandboxes(&self, slots: u32, states: impl Iterator<Item = SandboxState>) {
        self.slots.set(i64::from(slots));
        let mut counts: HashMap<SandboxState, i64> = HashMap::new();
        for state in states {
            *counts.entry(state).or_default() += 1;
        }
        for state in LIVE {
            self.sandboxes
                .get_or_create(&StateLabel {
                    state: state.as_str(),
                })
                .set(counts.get(&state).copied().unwrap_or(0));
        }
    }

    pub fn sandbox_started(&self) {
        self.started.inc();
    }

    pub fn sandbox_ended(&self, state: SandboxState) {
        self.ended
            .get_or_create(&StateLabel {
                state: state.as_str(),
            })
            .inc();
    }

    /// A sandbox started with keeping on: on a kept tree (`hit`) or not.
    pub fn kept_take(&self, hit: bool) {
        let outcome = if hit { "hit" } else { "miss" };
        self.kept_takes
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    pub fn set_kept_trees(&self, count: usize) {
        self.kept_trees
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    pub fn exchange(&self, ok: bool) {
        let outcome = if ok { "ok" } else { "failed" };
        self.heartbeats
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// Counts what a sandbox's runner reported since the last read.
    pub fn runner_reports(&self, new: &NewReports) {
        self.reports_rejected.inc_by(new.rejected);
        for report in &new.reports {
            match *report {
                HostReport::Restore {
                    duration_ms,
                    bytes_downloaded,
                    bytes_from_cache,
                    bytes_written,
                } => {
                    self.restore_seconds.observe(seconds(duration_ms));
                    self.restore_pack_bytes
                        .get_or_create(&SourceLabel { source: "store" })
                        .inc_by(bytes_downloaded);
                    self.restore_pack_bytes
                        .get_or_create(&SourceLabel {
                            source: "pack_cache",
                        })
                        .inc_by(bytes_from_cache);
                    self.restore_written_bytes.inc_by(bytes_written);
                }
                HostReport::Checkpoint {
                    duration_ms,
                    bytes_uploaded,
                } => {
                    self.checkpoint_seconds.observe(seconds(duration_ms));
                    self.checkpoint_uploaded_bytes.inc_by(bytes_uploaded);
                }
            }
        }
    }

    /// Every metric in Prometheus' text format.
    pub fn render(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }
}

/// 1 ms to about 9 min: a restore of a large workspace on a slow link
/// takes minutes.
fn duration_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 20)
}

fn seconds(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

async fn scrape(State(metrics): State<Arc<HostMetrics>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, TEXT_FORMAT)], metrics.render())
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<HostMetrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = Router::new()
        .route("/metrics", get(scrape))
        .with_state(metrics);
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(metrics: &HostMetrics, prefix: &str) -> Vec<String> {
        let mut lines: Vec<String> = metrics
            .render()
            .lines()
            .filter(|line| line.starts_with(prefix))
            .map(str::to_owned)
            .collect();
        lines.sort();
        lines
    }

    #[test]
    fn runner_reports_become_durations_and_bytes_by_source() {
        let metrics = HostMetrics::new();
        metrics.runner_reports(&NewReports {
            reports: vec![
                HostReport::Restore {
                    duration_ms: 1500,
                    bytes_downloaded: 100,
                    bytes_from_cache: 900,
                    bytes_written: 50,
                },
                HostReport::Checkpoint {
                    duration_ms: 40,
                    bytes_uploaded: 7,
                },
                HostReport::Checkpoint {
                    duration_ms: 60,
                    bytes_uploaded: 3,
                },
            ],
            rejected: 2,
        });
        assert_eq!(
            samples(&metrics, "cairn_host_restore_pack_bytes"),
            [
                "cairn_host_restore_pack_bytes_total{source=\"pack_cache\"} 900",
                "cairn_host_restore_pack_bytes_total{source=\"store\"} 100",
            ]
        );
        assert_eq!(
            samples(&metrics, "cairn_host_restore_duration_seconds_sum"),
            ["cairn_host_restore_duration_seconds_sum 1.5"]
        );
        assert_eq!(
            samples(&metrics, "cairn_host_checkpoint_duration_seconds_count"),
            ["cairn_host_checkpoint_duration_seconds_count 2"]
        );
        assert_eq!(
            samples(&metrics, "cairn_host_checkpoint_uploaded_bytes"),
            ["cairn_host_checkpoint_uploaded_bytes_total 10"]
        );
        assert_eq!(
            samples(&metrics, "cairn_host_sandbox_reports_rejected"),
            ["cairn_host_sandbox_reports_rejected_total 2"]
        );
    }

    #[test]
    fn only_sandboxes_holding_a_slot_are_counted_by_state() {
        let metrics = HostMetrics::new();
        assert_eq!(
            samples(&metrics, "cairn_host_sandboxes{"),
            [
                "cairn_host_sandboxes{state=\"running\"} 0",
                "cairn_host_sandboxes{state=\"starting\"} 0",
            ]
        );
        metrics.set_sandboxes(
            4,
            [
                SandboxState::Running,
                SandboxState::Running,
                SandboxState::Starting,
                SandboxState::Exited,
                SandboxState::Destroyed,
            ]
            .into_iter(),
        );
        assert_eq!(
            samples(&metrics, "cairn_host_sandboxes{"),
            [
                "cairn_host_sandboxes{state=\"running\"} 2",
                "cairn_host_sandboxes{state=\"starting\"} 1",
            ]
        );
        assert_eq!(
            samples(&metrics, "cairn_host_slots "),
            ["cairn_host_slots 4"]
        );
    }
}
