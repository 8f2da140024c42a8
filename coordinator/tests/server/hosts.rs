//! Hosts: lost hosts and what happens to their runs, re-registration,
//! cordon and drain.

use std::time::Duration;

use cairn_proto::pb;

use crate::fleet::*;
use crate::harness::*;

/// Short enough that tests lose hosts quickly, long enough that a host that
/// beats in every polling round is never lost.
const SHORT_LEASE: Duration = Duration::from_secs(3);

#[tokio::test]
async fn a_lost_host_ends_its_attempts_and_its_runs_resume_elsewhere_until_max_attempts() {
    let (server, mut clients, mut a) = fleet_with_lease(SHORT_LEASE, "a", 1).await;
    let run = clients.create_with_max_attempts(2).await;
    let (first, mut runner) = a.launch(&server, &run.id).await;
    runner.start().await;
    let mut b = FakeHost::register(&server, &server.admin_token, "b", &[], 1).await;

    // a falls silent; b keeps beating and gets the run back.
    let second = b.beat_until_assigned(&run.id).await;
    assert_eq!(second.attempt, 2);
    assert!(
        second.generation > first.generation,
        "{} > {}",
        second.generation,
        first.generation
    );
    let moved = clients.get(&run.id).await;
    assert_eq!(moved.state, pb::RunState::Assigned as i32);
    let lost_attempt = &moved.attempts[0];
    assert_eq!(lost_attempt.state, pb::AttemptState::Ended as i32);
    assert_eq!(lost_attempt.end_reason, "host_lost");
    assert_eq!(moved.attempts[1].host_id, b.id);
    let events = clients.events(&run.id).await;
    let lost = events.iter().find(|e| e.reason == "host_lost").unwrap();
    assert_eq!(lost.state, pb::RunState::Queued as i32);
    assert_eq!(lost.host_id, a.id);
    assert_eq!(lost.attempt, 1);

    // a comes back: it is told it was lost and to destroy what it runs.
    let answer = a.beat().await;
    assert_eq!(answer.state, pb::HostState::Lost as i32);
    assert_eq!(a.destroy_order(&first.sandbox_id), Some("superseded"));
    assert!(answer.assignments.is_empty());
    a.sandbox_gone(&first.sandbox_id, pb::SandboxState::Destroyed, -15);
    let old_id = a.id.clone();
    a.register_again().await;
    assert_eq!(a.id, old_id, "a host registers again under its old id");
    assert_eq!(a.beat().await.forget, [first.sandbox_id.as_str()]);
    let hosts = clients.hosts().await;
    let listed_a = hosts.iter().find(|h| h.id == a.id).unwrap();
    assert_eq!(listed_a.state, pb::HostState::Ready as i32);
    assert_eq!(listed_a.used_slots, 0);

    // b is lost too: the second infrastructure failure fails the run.
    b.beat().await;
    let mut deadline = Deadline::new("the run to fail after b is lost");
    let failed = loop {
        a.beat().await;
        let current = clients.get(&run.id).await;
        if current.state == pb::RunState::Failed as i32 {
            break current;
        }
        deadline.tick().await;
    };
    assert!(
        failed
            .state_reason
            .starts_with("gave up after 2 failed attempts"),
        "{}",
        failed.state_reason
    );
    assert_eq!(failed.attempts.len(), 2);
    assert!(a.beat().await.assignments.is_empty());
}

#[tokio::test]
async fn a_run_waiting_for_a_person_on_a_lost_host_is_suspended() {
    let (server, mut clients, mut host) = fleet_with_lease(SHORT_LEASE, "h", 1).await;
    let run = clients.create_with_max_attempts(1).await;
    let (_, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;
    runner.wait_for_person("shall I deploy?").await;

    let suspended = wait_for_state(&mut clients, &run.id, pb::RunState::Suspended).await;
    assert_eq!(suspended.attempts[0].end_reason, "host_lost");
    assert_eq!(suspended.question, "shall I deploy?");
    // Not a failure: with max_attempts 1 an answer still resumes it.
    let queued = clients.answer(&run.id, "yes").await.unwrap();
    assert_eq!(queued.state, pb::RunState::Queued as i32);
}

#[tokio::test]
async fn a_cordoned_host_gets_no_new_runs_until_uncordoned() {
    let (_server, mut clients, mut alpha) = patient_fleet("alpha", 2).await;

    let cordoned = clients.host_request("cordon", "alpha").await.unwrap();
    assert_eq!(cordoned.id, alpha.id);
    assert_eq!(cordoned.state, pb::HostState::Cordoned as i32);
    let run = clients.create_run(&[]).await;
    let mut deadline = Deadline::new("the queue reason");
    loop {
        assert!(alpha.beat().await.assignments.is_empty());
        if clients.get(&run.id).await.state_reason == "no host is ready" {
            break;
        }
        deadline.tick().await;
    }
    assert_eq!(alpha.last.state, pb::HostState::Cordoned as i32);

    let ready = clients.host_request("uncordon", &alpha.id).await.unwrap();
    assert_eq!(ready.state, pb::HostState::Ready as i32);
    let assignment = alpha.beat_until_assigned(&run.id).await;
    alpha.beat().await;
    let hosts = clients.hosts().await;
    assert_eq!(hosts.len(), 1);
    assert_eq!(hosts[0].name, "alpha");
    assert_eq!((hosts[0].slots, hosts[0].used_slots), (2, 1));
    assert_eq!(hosts[0].run_ids, [run.id.as_str()]);
    assert_eq!(assignment.attempt, 1);

    let unknown = clients.host_request("cordon", "nowhere").await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn draining_releases_every_sandbox_running_runs_queue_again_and_waiting_ones_suspend() {
    let (server, mut clients, mut host) = patient_fleet("h", 2).await;
    let working = clients.create_with_max_attempts(1).await;
    let asking = clients.create_run(&[]).await;
    let working_sandbox = host.beat_until_assigned(&working.id).await;
    let asking_sandbox = host.beat_until_assigned(&asking.id).await;
    host.beat().await;
    FakeRunner::connect(&server, &working_sandbox)
        .await
        .start()
        .await;
    let mut asker = FakeRunner::connect(&server, &asking_sandbox).await;
    asker.start().await;
    asker.wait_for_person("tabs or spaces?").await;

    let draining = clients.host_request("drain", "h").await.unwrap();
    assert_eq!(draining.state, pb::HostState::Draining as i32);
    host.beat().await;
    let orders = host.destroy_orders();
    assert_eq!(
        orders.get(&working_sandbox.sandbox_id).map(String::as_str),
        Some("draining")
    );
    assert_eq!(
        orders.get(&asking_sandbox.sandbox_id).map(String::as_str),
        Some("draining")
    );
    host.sandbox_gone(&working_sandbox.sandbox_id, pb::SandboxState::Destroyed, 0);
    host.sandbox_gone(&asking_sandbox.sandbox_id, pb::SandboxState::Destroyed, 0);
    host.beat().await;

    // Drained, not failed: max_attempts 1 does not count it.
    let requeued = clients.get(&working.id).await;
    assert_eq!(requeued.state, pb::RunState::Queued as i32);
    assert_eq!(requeued.attempts[0].end_reason, "draining");
    let suspended = clients.get(&asking.id).await;
    assert_eq!(suspended.state, pb::RunState::Suspended as i32);
    assert!(
        host.beat().await.assignments.is_empty(),
        "a drained host gets nothing new"
    );

    let mut other = FakeHost::register(&server, &server.admin_token, "other", &[], 1).await;
    let resumed = other.beat_until_assigned(&working.id).await;
    assert_eq!(resumed.attempt, 2);
}

#[tokio::test]
async fn a_stopping_host_gets_nothing_new_and_its_runs_go_elsewhere() {
    let (server, mut clients, mut host) = patient_fleet("h", 2).await;
    let working = clients.create_with_max_attempts(1).await;
    let (sandbox, mut runner) = host.launch(&server, &working.id).await;
    runner.start().await;

    host.stopping = true;
    let answer = host.beat().await;
    assert_eq!(answer.state, pb::HostState::Stopping as i32);
    assert_eq!(
        host.destroy_order(&sandbox.sandbox_id),
        Some("host_stopping")
    );
    let listed = clients.host_request("uncordon", "h").await.unwrap();
    assert_eq!(
        listed.state,
        pb::HostState::Stopping as i32,
        "the operator's state does not hide that the host is stopping"
    );
    let queued_meanwhile = clients.create_run(&[]).await;
    host.sandbox_gone(&sandbox.sandbox_id, pb::SandboxState::Destroyed, 0);
    host.beat().await;
    assert!(
        host.beat().await.assignments.is_empty(),
        "a stopping host gets nothing new though it has free slots"
    );
    // Stopped, not failed: max_attempts 1 does not count it.
    let requeued = clients.get(&working.id).await;
    assert_eq!(requeued.state, pb::RunState::Queued as i32);
    assert_eq!(requeued.attempts[0].end_reason, "host_stopping");
    assert!(
        reasons(&clients.events(&working.id).await).contains(&"host_stopping"),
        "the shutdown is an event of the run"
    );

    let mut other = FakeHost::register(&server, &server.admin_token, "other", &[], 2).await;
    assert_eq!(other.beat_until_assigned(&working.id).await.attempt, 2);
    other.beat_until_assigned(&queued_meanwhile.id).await;

    // Started again, the host registers and is ready.
    host.stopping = false;
    host.register_again().await;
    assert_eq!(host.beat().await.state, pb::HostState::Ready as i32);
}

#[tokio::test]
async fn a_host_that_restarts_or_forgets_a_sandbox_gives_the_run_back() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients.create_run(&[]).await;
    let (first, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;

    // The host agent restarts: its runner got SIGTERM, checkpoints and
    // reports; the new agent process still reports the sandbox until it is
    // gone, and the attempt lasts until then.
    host.register_again().await;
    host.beat().await;
    assert_eq!(
        clients.get(&run.id).await.state,
        pb::RunState::Running as i32
    );
    runner.outcome(pb::Outcome::Interrupted, &[]).await.unwrap();
    host.sandbox_gone(&first.sandbox_id, pb::SandboxState::Destroyed, -15);
    host.beat().await;
    let requeued = clients.get(&run.id).await;
    assert_eq!(requeued.attempts[0].end_reason, "interrupted");
    let second = host.beat_until_assigned(&run.id).await;
    assert_eq!(second.attempt, 2);
    host.beat().await;

    // A host that lost track of a sandbox leaves it out: it is gone.
    host.sandboxes.remove(&second.sandbox_id);
    host.register_again().await;
    host.beat().await;
    let forgotten = clients.get(&run.id).await;
    assert_eq!(
        forgotten.attempts[1].end_reason,
        "sandbox failed: the host stopped reporting it"
    );
    assert_ne!(forgotten.state, pb::RunState::Failed as i32);
    let third = host.beat_until_assigned(&run.id).await;
    assert_eq!(third.attempt, 3);
}

#[tokio::test]
async fn a_heartbeat_interval_not_below_the_lease_is_refused_at_start() {
    let dir = data_dir();
    let mut config = cairn_coordinator::ServerConfig::new(dir.path());
    config.host_lease = Duration::from_secs(1);
    config.heartbeat_interval = Duration::from_secs(1);
    let err = cairn_coordinator::Coordinator::open(config)
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "the heartbeat interval (1s) must be positive and shorter than the host lease (1s)"
    );
}
