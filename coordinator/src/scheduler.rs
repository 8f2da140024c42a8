//! The scheduler and reconciler: one background task of the coordinator.
//!
//! Each pass, in order:
//! 1. hosts whose last heartbeat is older than the lease are marked lost;
//!    their attempts end and their runs are requeued, suspended or failed;
//! 2. waiting runs whose hold ran out get their sandbox destroyed;
//! 3. queued runs, oldest first, are assigned to ready hosts whose labels
//!    satisfy theirs and that have a free slot: a host that keeps the run's
//!    workspace tree from an earlier sandbox first (its restore writes only
//!    what differs), else least-loaded first; a run no host can take keeps a
//!    `state_reason` saying why (an event when it changes).
//!
//! Only the replica holding the leader lease ([`crate::leader`]) runs
//! passes. A pass runs when something wakes it ([`SchedulerHandle::wake`]: a new run,
//! an answer, a freed slot, a host), when the next hold runs out (a suspend
//! waits for no timer), and at least every [`MAX_PASS_INTERVAL`].
//! A pass's assignments are written in batches, a transaction each, in
//! [`crate::db`], which re-checks every run and host under the write lock;
//! a failed pass is logged and retried by the next.

use std::cmp::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use cairn_proto::ids::{HostId, RunId};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::db::{Assignment, DbError, HostCapacity, MetadataStore, QueuedRun};
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::tokens::RunTokenKey;

/// Longest time between two passes.
pub const MAX_PASS_INTERVAL: Duration = Duration::from_millis(200);

/// Assignments (or queue reasons) written in one transaction.
const ASSIGNMENTS_PER_TRANSACTION: usize = 200;

/// Wakes the scheduler; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct SchedulerHandle {
    wake: Arc<Notify>,
}

impl SchedulerHandle {
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks for a pass soon (several wakes before it runs make one pass).
    pub fn wake(&self) {
        self.wake.notify_one();
    }
}

/// What the scheduler decided for one queued run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    Assign {
        run: RunId,
        attempt_count: u32,
        host: HostId,
    },
    /// No host can take the run now, and why.
    Wait { run: RunId, reason: String },
}

/// Whether host `a` is less loaded than `b`: a smaller share of its slots
/// used, then more free slots.
fn load_order(a: &HostCapacity, b: &HostCapacity) -> Ordering {
    let share_a = u64::from(a.used) * u64::from(b.slots);
    let share_b = u64::from(b.used) * u64::from(a.slots);
    share_a.cmp(&share_b).then_with(|| {
        let free_a = a.slots.saturating_sub(a.used);
        let free_b = b.slots.saturating_sub(b.used);
        free_b.cmp(&free_a)
    })
}

/// Places `queued` (oldest first) on `hosts` (ready hosts with their usage).
/// Pure: the caller carries the decisions out.
pub fn place(queued: &[QueuedRun], hosts: &[HostCapacity]) -> Vec<Placement> {
    let mut hosts: Vec<HostCapacity> = hosts.to_vec();
    let mut placements = Vec::with_capacity(queued.len());
    for run in queued {
        let matching: Vec<usize> = hosts
            .iter()
            .enumerate()
            .filter(|(_, h)| h.tenant == run.tenant && run.labels.satisfied_by(&h.labels))
            .map(|(i, _)| i)
            .collect();
        let keeps = |i: usize| hosts[i].kept.contains(&run.workspace);
        let best = matching
            .iter()
            .copied()
            .filter(|&i| hosts[i].used < hosts[i].slots)
            .min_by(|&a, &b| {
                keeps(b)
                    .cmp(&keeps(a))
                    .then_with(|| load_order(&hosts[a], &hosts[b]))
            });
        match best {
            Some(i) => {
                hosts[i].used += 1;
                placements.push(Placement::Assign {
                    run: run.id.clone(),
                    attempt_count: run.attempt_count,
                    host: hosts[i].id.clone(),
                });
            }
            None => {
                let reason = match matching.len() {
                    0 if run.labels.is_empty() => "no host is ready".to_owned(),
                    0 => format!("no ready host has labels {}", run.labels),
                    1 => "the only matching host is full".to_owned(),
                    n => format!("all {n} matching hosts are full"),
                };
                placements.push(Placement::Wait {
                    run: run.id.clone(),
                    reason,
                });
            }
        }
    }
    placements
}

/// The scheduler's settings.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// A host silent for longer is lost.
    pub lease: Duration,
    /// Longest time between passes.
    pub pass_interval: Duration,
}

/// Runs passes until `stop` is cancelled, while this replica leads.
pub async fn run(
    db: Arc<MetadataStore>,
    run_tokens: RunTokenKey,
    config: SchedulerConfig,
    handle: SchedulerHandle,
    leadership: Arc<Leadership>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    // Hosts get a full lease from when this replica began to lead before
    // they count as lost: a coordinator that was down, or a replica that
    // took over, must not declare every host lost at once.
    let mut leading_since = None;
    loop {
        let leads = match leadership.lead(&db).await {
            Ok(leads) => leads,
            Err(e) => {
                tracing::warn!(error = %e, "could not read or renew the leader lease; retrying");
                false
            }
        };
        if !leads {
            leading_since = None;
        }
        let mut next_pass = config.pass_interval;
        if leads {
            let since = *leading_since.get_or_insert_with(SystemTime::now);
            let started = Instant::now();
            match pass(&db, &run_tokens, &config, since).await {
                Ok(done) => {
                    metrics.scheduler_pass(started.elapsed(), &done.first_waits);
                    next_pass = until_next_pass(
                        config.pass_interval,
                        done.next_hold_expiry,
                        SystemTime::now(),
                    );
                }
                Err(e) if e.is_retryable() => {
                    tracing::warn!(error = %e, "scheduler pass failed; retrying");
                }
                Err(e) => tracing::error!(error = %e, "scheduler pass failed"),
            }
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = handle.wake.notified() => {}
            () = tokio::time::sleep(next_pass) => {}
        }
    }
}

/// How long the scheduler sleeps after a pass: the pass interval, or less
/// when a hold runs out sooner (a millisecond after it, as holds are kept
/// in milliseconds).
fn until_next_pass(
    pass_interval: Duration,
    next_hold_expiry: Option<SystemTime>,
    now: SystemTime,
) -> Duration {
    match next_hold_expiry {
        Some(at) => {
            let until = at.duration_since(now).unwrap_or_default() + Duration::from_millis(1);
            until.min(pass_interval)
        }
        None => pass_interval,
    }
}

/// What a pass did.
#[derive(Debug, Default)]
struct PassDone {
    /// How long each run assigned for the first time waited since it was
    /// created.
    first_waits: Vec<Duration>,
    /// When the next hold runs out.
    next_hold_expiry: Option<SystemTime>,
}

/// One pass: lost hosts, expired holds, placements.
async fn pass(
    db: &MetadataStore,
    run_tokens: &RunTokenKey,
    config: &SchedulerConfig,
    started: SystemTime,
) -> Result<PassDone, DbError> {
    for host in db.mark_lost_hosts(config.lease, started).await? {
        tracing::warn!(%host, lease = %humantime::format_duration(config.lease), "host lost: no heartbeat within the lease");
    }
    for run in db.expire_holds().await? {
        tracing::info!(%run, "hold expired; releasing the sandbox");
    }
    let mut done = PassDone {
        next_hold_expiry: db.next_hold_expiry().await?,
        ..PassDone::default()
    };
    let queued = db.queued_runs().await?;
    if queued.is_empty() {
        return Ok(done);
    }
    let hosts = db.ready_hosts().await?;
    let mut assignments = Vec::new();
    let mut reasons = Vec::new();
    // One placement per queued run, in the same order.
    for (queued_run, placement) in queued.iter().zip(place(&queued, &hosts)) {
        match placement {
            Placement::Assign {
                run,
                attempt_count,
                host,
            } => {
                let token = run_tokens.token(&run, attempt_count + 1);
                assignments.push(Assignment {
                    run,
                    attempt_count,
                    host,
                    token_hash: token.hash,
                });
            }
            Placement::Wait { run, reason } => {
                if queued_run.state_reason != reason {
                    reasons.push((run, reason));
                }
            }
        }
    }
    // A transaction a batch: one write lock and one sync for many runs,
    // short enough that heartbeats and commits get the lock in between.
    for batch in assignments.chunks(ASSIGNMENTS_PER_TRANSACTION) {
        for run in db.assign_runs(batch).await? {
            let attempt = run.current_attempt();
            if let Some(first) = attempt.filter(|a| a.number == 1) {
                done.first_waits.push(
                    first
                        .started_at
                        .duration_since(run.created_at)
                        .unwrap_or_default(),
                );
            }
            tracing::info!(
                run = %run.id,
                host = %attempt.map_or_else(String::new, |a| a.host_id.to_string()),
                attempt = attempt.map_or(0, |a| a.number),
                generation = attempt.map_or(0, |a| a.generation.0),
                "run assigned"
            );
        }
    }
    for batch in reasons.chunks(ASSIGNMENTS_PER_TRANSACTION) {
        for (run, reason) in db.set_queue_reasons(batch).await? {
            tracing::info!(%run, %reason, "run waits for a host");
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use cairn_proto::ids::{TenantId, WorkspaceId};
    use cairn_proto::runs::Labels;

    use super::*;

    #[test]
    fn the_scheduler_wakes_when_the_next_hold_runs_out_within_its_interval() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let interval = Duration::from_millis(200);
        assert_eq!(until_next_pass(interval, None, now), interval);
        assert_eq!(
            until_next_pass(interval, Some(now + Duration::from_millis(30)), now),
            Duration::from_millis(31)
        );
        assert_eq!(
            until_next_pass(interval, Some(now + Duration::from_secs(5)), now),
            interval
        );
        assert_eq!(
            until_next_pass(interval, Some(now - Duration::from_millis(5)), now),
            Duration::from_millis(1),
            "a hold already out: the next pass at once"
        );
    }

    fn run(labels: &str) -> QueuedRun {
        QueuedRun {
            id: RunId::generate(),
            tenant: TenantId::default_tenant(),
            workspace: WorkspaceId::generate(),
            labels: labels.parse().unwrap(),
            state_reason: String::new(),
            attempt_count: 0,
        }
    }

    fn host(labels: &str, slots: u32, used: u32) -> HostCapacity {
        HostCapacity {
            id: HostId::generate(),
            tenant: TenantId::default_tenant(),
            labels: labels.parse::<Labels>().unwrap(),
            slots,
            used,
            kept: Default::default(),
        }
    }

    fn assigned_host(p: &Placement) -> Option<&HostId> {
        match p {
            Placement::Assign { host, .. } => Some(host),
            Placement::Wait { .. } => None,
        }
    }

    #[test]
    fn runs_go_to_matching_hosts_least_loaded_first() {
        let busy = host("zone=eu", 4, 3);
        let idle = host("zone=eu", 2, 0);
        let other = host("zone=us", 8, 0);
        let runs = [run("zone=eu"), run("zone=eu"), run("zone=eu")];
        let placements = place(&runs, &[busy.clone(), idle.clone(), other]);
        let hosts: Vec<_> = placements.iter().map(assigned_host).collect();
        // idle (0/2) → idle (1/2 beats busy's 3/4) → busy (3/4 beats idle's full 2/2).
        assert_eq!(hosts, [Some(&idle.id), Some(&idle.id), Some(&busy.id)]);
    }

    #[test]
    fn a_run_goes_to_the_host_that_keeps_its_workspace_tree_while_it_has_a_slot() {
        let resumed = run("");
        let idle = host("", 2, 0);
        let mut keeper = host("", 2, 1);
        keeper.kept = [WorkspaceId::generate(), resumed.workspace.clone()].into();
        let other = run("");
        let placements = place(
            &[other.clone(), resumed.clone()],
            &[idle.clone(), keeper.clone()],
        );
        let hosts: Vec<_> = placements.iter().map(assigned_host).collect();
        // The other run goes by load; the resumed one to the busier keeper.
        assert_eq!(hosts, [Some(&idle.id), Some(&keeper.id)]);

        keeper.used = 2;
        let placements = place(&[resumed], &[idle.clone(), keeper]);
        assert_eq!(
            assigned_host(&placements[0]),
            Some(&idle.id),
            "a full keeper does not hold the run back"
        );
    }

    #[test]
    fn a_run_nobody_can_take_says_why() {
        let full = host("gpu=a100", 1, 1);
        let placements = place(&[run("gpu=h100"), run("gpu=a100")], &[full]);
        let reason = |p: &Placement| match p {
            Placement::Wait { reason, .. } => reason.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(reason(&placements[0]), "no ready host has labels gpu=h100");
        assert_eq!(reason(&placements[1]), "the only matching host is full");
        let two_full = [host("", 1, 1), host("", 2, 2)];
        assert_eq!(
            reason(&place(&[run("")], &two_full)[0]),
            "all 2 matching hosts are full"
        );
        assert_eq!(reason(&place(&[run("")], &[])[0]), "no host is ready");
    }

    #[test]
    fn the_oldest_run_gets_the_last_slot_and_tenants_stay_apart() {
        let only = host("", 1, 0);
        let mut stranger = run("");
        stranger.tenant = "other".parse().unwrap();
        let runs = [stranger, run(""), run("")];
        let placements = place(&runs, std::slice::from_ref(&only));
        assert_eq!(assigned_host(&placements[0]), None);
        assert_eq!(assigned_host(&placements[1]), Some(&only.id));
        assert_eq!(assigned_host(&placements[2]), None);
    }
}
