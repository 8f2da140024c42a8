//! Hosts: lost hosts and what happens to their runs, re-registration,
//! cordon and drain; host tokens bound to their host; orders told to a
//! watching host as they are made.

use std::time::Duration;

use cairn_proto::pb;
use cairn_proto::pb::host_service_client::HostServiceClient;
use cairn_proto::pb::runner_service_client::RunnerServiceClient;
use cairn_proto::refusal::{Refusal, TokenRefusal};

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

/// An enrollment token (a host token an admin created, bound to no host).
async fn enrollment_token(clients: &mut Clients) -> String {
    clients
        .admin
        .create_token(pb::CreateTokenRequest {
            scope: "host".into(),
            description: "enroll".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .token
}

/// A HostService client speaking with `token`.
async fn host_service(
    server: &TestServer,
    token: &str,
) -> HostServiceClient<cairn_engine::client::AuthChannel> {
    HostServiceClient::new(server.channel(token).await)
}

fn wrong_host(status: &tonic::Status) -> Option<(String, String)> {
    match Refusal::of(status) {
        Some(Refusal::WrongHost { bound, asked }) => Some((bound.to_string(), asked.to_string())),
        _ => None,
    }
}

#[tokio::test]
async fn a_host_token_acts_only_as_the_host_it_is_bound_to() {
    let dir = data_dir();
    let server = start_patient(dir.path()).await;
    let mut clients = Clients::admin(&server).await;
    let enroll = enrollment_token(&mut clients).await;
    let mut a = FakeHost::register(&server, &enroll, "a", &[("pool", "a")], 1).await;
    let mut b = FakeHost::register(&server, &enroll, "b", &[("pool", "b")], 1).await;
    let a_token = a
        .bound_token
        .clone()
        .expect("enrollment answers a bound token");
    let b_token = b
        .bound_token
        .clone()
        .expect("enrollment answers a bound token");
    assert_ne!(a_token, enroll);
    assert_ne!(a_token, b_token);
    assert!(a_token.starts_with("cairn_host_"));

    // b is assigned a run; a tries to get it by heartbeating as b.
    let run = clients.create_run(&[("pool", "b")]).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while clients.get(&run.id).await.state != pb::RunState::Assigned as i32 {
        assert!(
            std::time::Instant::now() < deadline,
            "the run was never assigned"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut as_a = host_service(&server, &a_token).await;
    let refused = as_a
        .heartbeat(pb::HeartbeatRequest {
            host_id: b.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    assert_eq!(wrong_host(&refused), Some((a.id.clone(), b.id.clone())));

    // Nor can a claim it: the runner service takes the attempt's run token,
    // which only b's heartbeat carries.
    let refused = RunnerServiceClient::new(server.channel(&a_token).await)
        .claim_attempt(pb::ClaimAttemptRequest {})
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    assert_eq!(
        clients.get(&run.id).await.state,
        pb::RunState::Assigned as i32,
        "nobody claimed b's assignment"
    );

    // a may not re-register b with other slots either.
    let refused = as_a
        .register_host(pb::RegisterHostRequest {
            host_id: b.id.clone(),
            name: "b".into(),
            slots: 99,
            driver: "local".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    assert_eq!(wrong_host(&refused), Some((a.id.clone(), b.id.clone())));
    let listed = clients.hosts().await;
    let listed_b = listed.iter().find(|h| h.id == b.id).unwrap();
    assert_eq!(listed_b.slots, 1, "b keeps its slots");

    // b itself gets its assignment, with its token.
    let assignment = b.beat_until_assigned(&run.id).await;
    assert_eq!(assignment.run_id, run.id);

    // Each host re-registers itself (a restart) with its bound token, and
    // is given no new token: it keeps the one it has.
    let old_a = a.id.clone();
    let again = a.register_again().await;
    assert_eq!(again.host_id, old_a);
    assert!(again.host_token.is_empty(), "a bound host keeps its token");
    // Asking for no id, the bound token registers its own host.
    let own = as_a
        .register_host(pb::RegisterHostRequest {
            slots: 1,
            driver: "local".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(own.host_id, a.id);
    a.beat().await;

    // Admin tokens still act as any host.
    let mut as_admin = host_service(&server, &server.admin_token).await;
    as_admin
        .heartbeat(pb::HeartbeatRequest {
            host_id: a.id.clone(),
            sandboxes: Vec::new(),
            ..Default::default()
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn an_enrollment_token_registers_only_new_hosts() {
    let dir = data_dir();
    let server = start_patient(dir.path()).await;
    let mut clients = Clients::admin(&server).await;
    let enroll = enrollment_token(&mut clients).await;
    let a = FakeHost::register(&server, &enroll, "a", &[], 2).await;
    let mut as_enroll = host_service(&server, &enroll).await;

    // Re-registering a known host (to take over its slots and assignments)
    // is refused, and the host is unchanged.
    let refused = as_enroll
        .register_host(pb::RegisterHostRequest {
            host_id: a.id.clone(),
            name: "a".into(),
            slots: 50,
            driver: "local".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains(&a.id), "{}", refused.message());
    let listed = clients.hosts().await;
    assert_eq!(listed.iter().find(|h| h.id == a.id).unwrap().slots, 2);

    // Nor may it heartbeat as any host.
    let refused = as_enroll
        .heartbeat(pb::HeartbeatRequest {
            host_id: a.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);

    // A new host it may register, under a new id or one it names.
    let named = cairn_proto::ids::HostId::generate();
    let fresh = as_enroll
        .register_host(pb::RegisterHostRequest {
            host_id: named.to_string(),
            slots: 1,
            driver: "local".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fresh.host_id, named.as_str());
    assert!(fresh.host_token.starts_with("cairn_host_"));

    // The list shows the enrollment token and the bound ones.
    let tokens = clients.tokens().await;
    let hosts: Vec<&str> = tokens
        .iter()
        .filter(|t| t.scope == "host")
        .map(|t| t.host_id.as_str())
        .collect();
    assert_eq!(
        hosts.iter().filter(|h| h.is_empty()).count(),
        1,
        "{hosts:?}"
    );
    assert!(hosts.contains(&a.id.as_str()), "{hosts:?}");
    assert!(hosts.contains(&named.as_str()), "{hosts:?}");
}

#[tokio::test]
async fn a_revoked_host_token_stops_its_host_at_once() {
    let dir = data_dir();
    let server = start_patient(dir.path()).await;
    let mut clients = Clients::admin(&server).await;
    let enroll = enrollment_token(&mut clients).await;
    let mut a = FakeHost::register(&server, &enroll, "a", &[], 1).await;
    a.beat().await;
    let tokens = clients.tokens().await;
    let bound = tokens.iter().find(|t| t.host_id == a.id).unwrap();
    clients
        .admin
        .revoke_token(pb::RevokeTokenRequest {
            id: bound.id.clone(),
        })
        .await
        .unwrap();
    let refused = a.client_heartbeat().await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    assert_eq!(
        Refusal::of(&refused),
        Some(Refusal::Token(TokenRefusal::Revoked))
    );
}

/// The next notice on `notices`, within the test's patience.
async fn next_notice(notices: &mut tonic::Streaming<pb::OrdersNotice>) -> pb::OrdersNotice {
    tokio::time::timeout(Duration::from_secs(30), notices.message())
        .await
        .expect("a notice within 30 s")
        .expect("the stream is open")
        .expect("the stream did not end")
}

#[tokio::test]
async fn a_host_watching_for_orders_hears_of_each_as_it_is_made() {
    let (server, mut clients, mut h) = patient_fleet("h", 1).await;
    let enroll = enrollment_token(&mut clients).await;
    let mut other = FakeHost::register(&server, &enroll, "other", &[("pool", "x")], 1).await;
    let mut notices = h.watch_orders().await.unwrap();
    let mut others = other.watch_orders().await.unwrap();
    // The first notice comes at once: orders made before the host watched.
    assert_eq!(next_notice(&mut notices).await.sequence, 1);
    assert_eq!(next_notice(&mut others).await.sequence, 1);

    // An assignment rings h's bell, before h heartbeats.
    clients.host_request("cordon", &other.id).await.unwrap();
    let run = clients.create_run(&[]).await;
    assert_eq!(next_notice(&mut notices).await.sequence, 2);
    let assignment = h.beat_until_assigned(&run.id).await;
    // A destroy order too.
    clients.cancel(&run.id, "no longer needed").await;
    assert_eq!(next_notice(&mut notices).await.sequence, 3);
    h.beat().await;
    assert_eq!(
        h.destroy_orders()
            .get(&assignment.sandbox_id)
            .map(String::as_str),
        Some("cancelled")
    );
    // Neither was the other host's business.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), others.message())
            .await
            .is_err(),
        "the other host heard of orders that were not its own"
    );

    // A host's token watches only its own host.
    let other_token = other
        .bound_token
        .clone()
        .expect("enrolled hosts get a bound token");
    let mut as_other = host_service(&server, &other_token).await;
    let refused = as_other
        .watch_orders(pb::WatchOrdersRequest {
            host_id: h.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    assert_eq!(wrong_host(&refused), Some((other.id.clone(), h.id.clone())));
}
