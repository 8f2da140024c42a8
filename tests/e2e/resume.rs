//! Issue 34: nothing waits for a timer on a run's way through a host.
//! Assignments and destroy orders reach the host on its WatchOrders stream
//! (heartbeats here are ten minutes apart, so a run that got anywhere got
//! there by the stream), and the runner starts the harness while its change
//! tracking arms, losing no write made meanwhile.

use std::fs;
use std::time::Duration;

use cairn_e2e::fleet::{Fleet, FleetTiming, HostOptions, checkpoint_reason};
use cairn_proto::pb;
use cairn_proto::runs::RunState;

const QUESTION: &str = "Which colour should the button be?";

/// Heartbeats far apart, and a lease longer still: whatever reaches a host
/// within a test's patience came on its orders stream.
pub fn heartbeats_far_apart() -> FleetTiming {
    FleetTiming {
        host_lease: Duration::from_secs(3600),
        heartbeat_interval: Duration::from_secs(600),
    }
}

/// A run on `workspace` asks, is suspended, is answered and ends: every
/// step needs an order to reach the fleet's host (an assignment, a destroy
/// order, an assignment again).
pub fn ask_suspend_answer(fleet: &Fleet, workspace: &str) {
    let created = fleet.create_run(fleet.run_request(
        workspace,
        &format!("commit notes/plan.md first plan\nask {QUESTION}"),
    ));
    // Assigned, started, claimed: the assignment came on the stream.
    fleet.wait_for_state(&created.id, RunState::Waiting);
    // SuspendRun orders the held sandbox destroyed: the order too.
    fleet.suspend(&created.id);
    let suspended = fleet.wait_for_state(&created.id, RunState::Suspended);
    assert_eq!(suspended.attempts.len(), 1, "{suspended:?}");
    // The answer starts the next attempt on the host, once more by the stream.
    fleet
        .answer(&created.id, "blue\ncommit notes/colour.md blue")
        .expect("the suspended run takes the answer");
    let done = fleet.wait_for_state(&created.id, RunState::Succeeded);
    assert_eq!(done.attempts.len(), 2, "{done:?}");
}

#[test]
fn assignments_and_destroy_orders_reach_the_host_without_waiting_for_a_heartbeat() {
    let mut fleet = Fleet::start_with(heartbeats_far_apart());
    fleet.start_host("a", HostOptions::default());
    ask_suspend_answer(&fleet, "pushed");
}

#[test]
fn a_write_made_while_change_tracking_arms_is_in_the_next_checkpoint() {
    let mut fleet = Fleet::start();
    fleet.start_host("a", HostOptions::default());
    // Thousands of directories: watching them all takes the runner a while
    // after the restore, while the harness already runs.
    let first_turn = format!(
        "run for i in $(seq 1 3000); do mkdir -p tree/d$i; echo $i > tree/d$i/f; done\n\
         ask {QUESTION}"
    );
    let created = fleet.create_run(fleet.run_request("armed", &first_turn));
    let run_id = created.id.clone();
    let workspace = created.workspace_id.clone();
    fleet.wait_for_state(&run_id, RunState::Waiting);
    fleet.suspend(&run_id);
    fleet.wait_for_state(&run_id, RunState::Suspended);

    // The resumed turn writes first thing, then asks again: the pause
    // checkpoint after it is the first one of the restored workspace.
    fleet
        .answer(
            &run_id,
            "edit tree/d1/f written right after the harness started\n\
             untracked late.txt also right after the start\n\
             ask Anything else?",
        )
        .expect("the suspended run takes the answer");
    let waiting = fleet.wait_for_event(&run_id, "the second attempt waits again", |e| {
        e.reason == "waiting" && e.attempt == 2
    });
    let checkpoints = fleet.checkpoints(&workspace);
    let pause = checkpoints
        .iter()
        .find(|c| c.id == waiting.checkpoint_id)
        .unwrap_or_else(|| panic!("the second pause checkpoint is listed: {checkpoints:?}"));
    assert_eq!(checkpoint_reason(pause), pb::CheckpointReason::Pause);
    let (_dir, root) = fleet.checkout(&workspace, &pause.id);
    assert_eq!(
        fs::read_to_string(root.join("tree/d1/f")).unwrap(),
        "1\nwritten right after the harness started\n"
    );
    assert_eq!(
        fs::read_to_string(root.join("late.txt")).unwrap(),
        "also right after the start\n"
    );
    assert_eq!(
        fs::read_to_string(root.join("tree/d3000/f")).unwrap(),
        "3000\n"
    );
}
