//! Issue 34: nothing waits for a timer on a run's way through a host.
//! Assignments and destroy orders reach the host on its WatchOrders stream
//! (heartbeats here are ten minutes apart, so a run that got anywhere got
//! there by the stream).

use std::time::Duration;

use cairn_e2e::fleet::{Fleet, FleetTiming, HostOptions};
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

#[test]
fn assignments_and_destroy_orders_reach_the_host_without_waiting_for_a_heartbeat() {
    let mut fleet = Fleet::start_with(heartbeats_far_apart());
    fleet.start_host("a", HostOptions::default());

    let created = fleet.create_run(fleet.run_request(
        "pushed",
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
