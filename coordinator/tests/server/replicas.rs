//! Several coordinators on one PostgreSQL database: each serves every call,
//! one leads (schedules); run events and run tokens reach across replicas,
//! and a replica takes the place of a leader that died.

use std::time::Duration;

use cairn_proto::pb;
use tokio_stream::StreamExt;

use crate::fleet::{Clients, FakeHost, FakeRunner};
use crate::harness::{TestServer, data_dir, test_location};

/// Replicas need the database to be PostgreSQL; `scripts/test` runs this
/// suite on it too.
fn on_postgres() -> bool {
    let set = std::env::var_os("CAIRN_TEST_DATABASE").is_some();
    if !set {
        eprintln!(
            "skipped here: several coordinators share a PostgreSQL database (CAIRN_TEST_DATABASE); scripts/test runs this on one"
        );
    }
    set
}

const LEASE: Duration = Duration::from_secs(3);

#[tokio::test]
async fn replicas_share_runs_events_and_tokens_and_replace_a_dead_leader() {
    if !on_postgres() {
        return;
    }
    let (dir_a, dir_b) = (data_dir(), data_dir());
    let database = test_location(dir_a.path());
    let timing = |config: &mut cairn_coordinator::ServerConfig| {
        config.host_lease = LEASE;
        config.heartbeat_interval = LEASE / 4;
    };
    let a = TestServer::start_with(dir_a.path(), timing).await;

    // A alone: it leads, and schedules the first run.
    let mut on_a = Clients::admin(&a).await;
    let mut host_on_a = FakeHost::register(&a, &a.admin_token, "h", &[], 4).await;
    let first = on_a.create_run(&[]).await;
    host_on_a.beat_until_assigned(&first.id).await;

    let b = TestServer::start_with(dir_b.path(), |config| {
        timing(config);
        config.database = Some(database.clone());
    })
    .await;
    assert_ne!(
        a.admin_token, b.admin_token,
        "each replica has its own data directory"
    );
    let mut on_b = Clients::admin(&b).await;
    // The host moves to B, as after a failover.
    let mut host = host_on_a;
    host.reconnect(&b, &b.admin_token).await;

    // A run created on B is placed by A's scheduler and reaches the host
    // through B; B's watchers hear what happens through A.
    let second = on_b.create_run(&[]).await;
    let mut events_on_b = on_b.watch(&second.id, 0, true).await;
    let assignment = host.beat_until_assigned(&second.id).await;
    host.beat().await;
    // The run token B handed out works on A: both derive it from the key
    // in the database.
    let mut runner = FakeRunner::connect(&a, &assignment).await;
    runner.start().await;
    let running = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(event) = events_on_b.next().await {
            let event = event.unwrap();
            if event.state == pb::RunState::Running as i32 {
                return event;
            }
        }
        panic!("the watch on B ended before the run ran");
    })
    .await
    .expect("B's watcher hears of the claim made through A");
    assert_eq!(running.attempt, assignment.attempt);

    // A dies without a word: its lease runs out and B takes over.
    drop(a);
    let third = on_b.create_run(&[]).await;
    let assigned = host.beat_until_assigned(&third.id).await;
    assert_eq!(assigned.attempt, 1);

    // Nothing was lost or assigned twice.
    for run in [&first.id, &second.id, &third.id] {
        let run = on_b.get(run).await;
        assert_eq!(run.attempts.len(), 1, "run {} has one attempt", run.id);
    }
    let lost = on_b.hosts().await;
    assert!(
        lost.iter().all(|h| h.state != pb::HostState::Lost as i32),
        "the host kept heartbeating through B: {lost:?}"
    );
}

#[tokio::test]
async fn a_client_given_several_addresses_moves_to_the_next_when_one_is_gone() {
    let (dir_a, dir_b) = (data_dir(), data_dir());
    let a = TestServer::start(dir_a.path()).await;
    let b = TestServer::start(dir_b.path()).await;
    let names = |workspaces: Vec<pb::Workspace>| -> Vec<String> {
        workspaces.into_iter().map(|w| w.name).collect()
    };
    crate::harness::create_workspace(&mut a.client().await, "on-a").await;
    crate::harness::create_workspace(&mut b.client().await, "on-b").await;
    // Two separate coordinators: what a call lists names the one it
    // reached (and A's token is unknown to B).
    let dead = "http://127.0.0.1:1";
    let both = format!("{dead},{},{}", a.grpc_url, b.grpc_url);
    let mut client = cairn_engine::client::CoordinatorClient::connect(&both, Some(&a.admin_token))
        .await
        .expect("the first address that answers is used");
    let list = |client: &mut cairn_engine::client::CoordinatorClient| {
        let mut workspaces = client.workspaces.clone();
        async move {
            workspaces
                .list_workspaces(pb::ListWorkspacesRequest::default())
                .await
                .map(|r| r.into_inner().workspaces)
        }
    };
    assert_eq!(names(list(&mut client).await.unwrap()), ["on-a"]);

    a.stop().await;
    let failed = list(&mut client)
        .await
        .expect_err("the call A was to answer fails");
    assert_eq!(failed.code(), tonic::Code::Unavailable, "{failed:?}");
    // The next calls go to B (A's admin token is unknown there).
    let refused = list(&mut client)
        .await
        .expect_err("B does not know A's token");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    let mut client = cairn_engine::client::CoordinatorClient::connect(&both, Some(&b.admin_token))
        .await
        .unwrap();
    assert_eq!(names(list(&mut client).await.unwrap()), ["on-b"]);
}

#[tokio::test]
async fn a_token_revoked_on_one_replica_is_refused_by_the_others() {
    use cairn_proto::refusal::TokenRefusal;

    use crate::tokens::{client_token, list_workspaces, token_refusal};

    if !on_postgres() {
        return;
    }
    let (dir_a, dir_b) = (data_dir(), data_dir());
    let database = test_location(dir_a.path());
    let a = TestServer::start(dir_a.path()).await;
    let b = TestServer::start_with(dir_b.path(), |config| {
        config.database = Some(database.clone());
    })
    .await;
    let mut admin = Clients::admin(&a).await;
    let client = client_token(&mut admin, None).await;
    // B authenticates the token, and keeps it for its next calls.
    for _ in 0..3 {
        list_workspaces(&b, &client.token).await.unwrap();
    }

    admin
        .admin
        .revoke_token(pb::RevokeTokenRequest {
            id: client.id.clone(),
        })
        .await
        .unwrap();
    // B hears of it with A's commit, long before its kept copy would
    // be read again (TOKEN_CACHE_TTL).
    let refused = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            match list_workspaces(&b, &client.token).await {
                Err(refused) => return refused,
                Ok(()) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await
    .expect("B refuses the token A revoked within moments");
    assert_eq!(token_refusal(&refused), Some(TokenRefusal::Revoked));
    assert!(
        cairn_coordinator::db::TOKEN_CACHE_TTL > Duration::from_secs(2),
        "the wait above is shorter than a kept token's life"
    );
}
