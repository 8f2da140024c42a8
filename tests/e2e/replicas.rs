//! Two `cairn-coordinator` processes on one PostgreSQL database and one S3
//! bucket (`s3s-fs`), a real `cairn-host` given both addresses, runs that
//! commit and checkpoint every second: the leading replica is killed
//! (SIGKILL) mid-run and the other carries on. No run is lost or assigned
//! twice, no committed checkpoint is lost, and the checkpoints committed
//! through the survivor restore. And orders the leading replica makes reach
//! a host that watches only the other one. Runs where `scripts/test` runs
//! the end-to-end tests on PostgreSQL (`CAIRN_TEST_DATABASE`).

use std::time::Duration;

use cairn_e2e::fleet::{Fleet, FleetTiming, HostOptions, state_of_host};
use cairn_e2e::{Coordinator, tempdir};
use cairn_proto::pb;
use cairn_proto::runs::{HostState, RunState, to_proto_duration};
use cairn_utils::testing::S3sFs;

const BUCKET: &str = "cairn-replicas";
const RUNS: usize = 4;

/// Whether the tests here can run: replicas share a PostgreSQL database.
fn have_postgres() -> bool {
    if std::env::var_os("CAIRN_TEST_DATABASE").is_none() {
        eprintln!(
            "skipped here: replicas share a PostgreSQL database (CAIRN_TEST_DATABASE); scripts/test runs this on one"
        );
        return false;
    }
    true
}

#[test]
fn orders_made_on_the_leading_replica_reach_a_host_watching_the_other() {
    if !have_postgres() {
        return;
    }
    let timing = crate::resume::heartbeats_far_apart();
    let lease = format!("{}ms", timing.host_lease.as_millis());
    let heartbeat = format!("{}ms", timing.heartbeat_interval.as_millis());
    let args = ["--host-lease", &lease, "--heartbeat-interval", &heartbeat];
    // The first replica starts alone, so it leads and schedules; the host
    // (and its sandboxes) know only the second.
    let first = Coordinator::start_with(&args);
    let second = Coordinator::start_replica_of(&first, &args, &[]);
    let follower = second.grpc_url().to_owned();
    let mut fleet = Fleet::around_replicas(first, second);
    fleet.start_host(
        "h",
        HostOptions {
            coordinator: Some(follower),
            ..HostOptions::default()
        },
    );
    crate::resume::ask_suspend_answer(&fleet, "across");
}

#[test]
fn killing_the_leading_replica_under_load_loses_no_run_and_no_checkpoint() {
    if !have_postgres() {
        return;
    }
    let s3_dir = tempdir("s3s-fs");
    let s3 = S3sFs::start(s3_dir.path(), &[BUCKET]);
    let env = s3.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let timing = FleetTiming::default();
    let lease = format!("{}ms", timing.host_lease.as_millis());
    let heartbeat = format!("{}ms", timing.heartbeat_interval.as_millis());
    let store = format!("s3://{BUCKET}/fleet");
    let args = [
        "--store",
        &store,
        "--host-lease",
        &lease,
        "--heartbeat-interval",
        &heartbeat,
    ];
    // The first replica starts alone, so it leads.
    let first = Coordinator::start_with_env(&args, &env);
    let second = Coordinator::start_replica_of(&first, &args, &env);
    let mut fleet = Fleet::around_replicas(first, second);
    fleet.start_host(
        "h",
        HostOptions {
            slots: RUNS as u32,
            ..HostOptions::default()
        },
    );

    let prompt = "commit work/before.txt written before the kill\n\
                  sleep 6\n\
                  commit work/after.txt written after the kill";
    let runs: Vec<pb::Run> = (0..RUNS)
        .map(|i| {
            let mut request = fleet.run_request(&format!("replica-{i}"), prompt);
            request.checkpoint_interval = Some(to_proto_duration(Duration::from_secs(1)));
            fleet.create_run(request)
        })
        .collect();
    let mut before_kill = Vec::new();
    for run in &runs {
        fleet.wait_for_event(&run.id, "a checkpoint of attempt 1", |e| {
            e.reason == "checkpoint" && e.attempt == 1 && !e.checkpoint_id.is_empty()
        });
        before_kill.push(fleet.checkpoints(&run.workspace_id));
    }

    // The leader dies without a word, under load: four runs committing.
    fleet.coordinator.kill();
    let survivor = fleet.replica.as_ref().expect("a fleet of replicas");
    // The call the dead replica was to answer fails; the ones after go to
    // the survivor.
    fleet.wait_for("a call to reach the surviving replica", || {
        fleet.try_get_run(&runs[0].id).ok()
    });

    for (run, before) in runs.iter().zip(&before_kill) {
        let done = fleet.wait_for_state(&run.id, RunState::Succeeded);
        assert_eq!(
            done.attempts.len(),
            1,
            "run {} was neither lost nor assigned again: {done:?}",
            run.id
        );
        let after = survivor.list_checkpoints(&run.workspace_id);
        for checkpoint in before {
            assert!(
                after.iter().any(|c| c.id == checkpoint.id),
                "checkpoint {} committed before the kill is still there",
                checkpoint.id
            );
        }
        assert!(
            after.len() > before.len(),
            "checkpoints went on through the survivor"
        );
        let restored = tempdir("restored");
        survivor
            .client()
            .restore(restored.path(), &run.workspace_id);
        assert_eq!(
            std::fs::read_to_string(restored.path().join("work/after.txt")).unwrap(),
            "written after the kill\n",
            "the last checkpoint of run {} holds the work done after the kill",
            run.id
        );
    }
    let host = fleet.host_info("h");
    assert_eq!(
        state_of_host(&host),
        Some(HostState::Ready),
        "the host moved to the survivor within its lease: {host:?}"
    );
}
