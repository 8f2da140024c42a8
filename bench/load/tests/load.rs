//! A tiny fleet and a tiny commits phase against the real
//! `cairn-coordinator` binary (built by `cargo build -p cairn-coordinator`
//! or `--workspace --bins`; its absence fails the test, never skips it), on
//! SQLite, or on the PostgreSQL database `CAIRN_TEST_DATABASE` names.

use std::time::Duration;

use cairn_load::{ClusterOptions, CommitsOptions, FleetOptions, ReplicaReport, SchemaReport};
use sqlx::Connection as _;

fn postgres() -> Option<String> {
    std::env::var("CAIRN_TEST_DATABASE").ok()
}

fn cluster() -> ClusterOptions {
    let mut options =
        ClusterOptions::new(cairn_utils::testing::sibling_binary("cairn-coordinator"));
    options.channels_per_replica = 2;
    options.database = postgres();
    options
}

/// On PostgreSQL, the run had a schema of its own and dropped it.
async fn left_no_schema(schema: Option<&SchemaReport>) {
    let Some(url) = postgres() else {
        assert!(schema.is_none(), "{schema:?}");
        return;
    };
    let schema = schema.expect("a schema of its own");
    assert!(schema.dropped, "{schema:?}");
    let mut conn = sqlx::postgres::PgConnection::connect(&url).await.unwrap();
    let left: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.schemata WHERE schema_name = $1",
    )
    .bind(&schema.name)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(left, 0, "schema {} is still there", schema.name);
}

fn stopped_cleanly(coordinators: &[ReplicaReport]) {
    assert_eq!(coordinators.len(), 1);
    let coordinator = &coordinators[0];
    assert!(coordinator.alive_at_end, "{coordinator:#?}");
    assert_eq!(coordinator.exit, "exited with status 0", "{coordinator:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_run_of_a_small_fleet_reaches_one_host_once() {
    let report = cairn_load::fleet(FleetOptions {
        cluster: cluster(),
        hosts: 5,
        slots: 2,
        runs: 8,
        heartbeat_interval: Duration::from_millis(200),
        lease: Duration::from_secs(10),
        create_concurrency: 4,
        watch_orders: true,
        duration_limit: Duration::from_secs(30),
    })
    .await
    .expect("the fleet phase runs");
    assert!(!report.timed_out, "{report:#?}");
    assert_eq!(report.hosts_registered, 5, "{report:#?}");
    assert_eq!(report.heartbeat_interval_ms, 200, "{report:#?}");
    assert_eq!(report.runs_created, 8, "{report:#?}");
    assert_eq!(report.create_errors.total, 0, "{report:#?}");
    assert_eq!(report.runs_assigned, 8, "{report:#?}");
    assert_eq!(report.runs_assigned_more_than_once, 0, "{report:#?}");
    assert_eq!(report.runs_unassigned, 0, "{report:#?}");
    assert_eq!(report.create_to_assign.count, 8, "{report:#?}");
    assert!(report.assignments_per_second > 0.0, "{report:#?}");
    // Five hosts beat for at least two intervals after the last assignment.
    assert!(report.heartbeats.count >= 10, "{report:#?}");
    assert_eq!(report.heartbeat_errors.total, 0, "{report:#?}");
    // Each host hears at least the notice its stream opens with.
    assert!(report.order_notices >= 5, "{report:#?}");
    assert_eq!(report.watch_errors.total, 0, "{report:#?}");
    assert_eq!(report.destroy_orders, 0, "{report:#?}");
    assert_eq!(report.lost_answers, 0, "{report:#?}");
    assert_eq!(report.over_capacity, 0, "{report:#?}");
    // The coordinator timed every heartbeat the hosts had answered (and
    // those of their registrations' first beats, if any were cut off).
    let served = report.coordinators[0]
        .served_heartbeats
        .as_ref()
        .unwrap_or_else(|| panic!("no served heartbeats: {report:#?}"));
    assert!(served.count >= report.heartbeats.count, "{report:#?}");
    assert!(
        served.p50_ms > 0.0 && served.p50_ms <= served.p99_ms,
        "{report:#?}"
    );
    assert!(
        report.coordinators[0].served_commits.is_none(),
        "{report:#?}"
    );
    stopped_cleanly(&report.coordinators);
    left_no_schema(report.database_schema.as_ref()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commits_all_succeed_in_sequence() {
    let report = cairn_load::commits(CommitsOptions {
        cluster: cluster(),
        workspaces: 2,
        concurrency: 2,
        commits: 20,
        duration_limit: Duration::from_secs(30),
    })
    .await
    .expect("the commits phase runs");
    assert!(!report.timed_out, "{report:#?}");
    assert_eq!(report.workers, 2, "{report:#?}");
    assert_eq!(report.commits_ok, 20, "{report:#?}");
    assert_eq!(report.errors.total, 0, "{report:#?}");
    assert_eq!(report.commit.count, 20, "{report:#?}");
    // Every answer's sequence was its workspace's previous one plus one.
    // The workers share one count of commits to issue, so the faster one
    // may take more than half: its workspace ends between 1 + 10 and 1 + 20.
    assert_eq!(report.sequence_errors, 0, "{report:#?}");
    assert!((11..=21).contains(&report.max_sequence), "{report:#?}");
    assert!(report.commits_per_second > 0.0, "{report:#?}");
    // The coordinator timed the 20 and the two first checkpoints.
    let served = report.coordinators[0]
        .served_commits
        .as_ref()
        .unwrap_or_else(|| panic!("no served commits: {report:#?}"));
    assert_eq!(served.count, 22, "{report:#?}");
    stopped_cleanly(&report.coordinators);
    left_no_schema(report.database_schema.as_ref()).await;
}
