//! A restarted coordinator keeps its data, its token and its signing key.

use cairn_proto::pb;

use crate::harness::*;

#[tokio::test]
async fn a_restart_keeps_workspaces_checkpoints_the_token_and_signed_urls() {
    let dir = data_dir();
    let first = TestServer::start(dir.path()).await;
    let token = first.admin_token.clone();
    assert!(token.starts_with("cairn_admin_"));
    let mut client = first.client().await;
    let ws = create_workspace(&mut client, "durable").await;
    let committed = checkpoint(&mut client, &ws.id, b"survives restarts").await;
    let before = manifest(&mut client, &ws.id, "").await;
    let secret = std::fs::read(dir.path().join("url-signing.key")).unwrap();
    // Stopping drains calls in flight; an idle client connection does not hold it up.
    first.stop().await;
    drop(client);

    let second = TestServer::start(dir.path()).await;
    assert_eq!(second.admin_token, token);
    assert_eq!(
        std::fs::read(dir.path().join("url-signing.key")).unwrap(),
        secret
    );
    let mut client = second.client().await;
    let found = get_workspace(&mut client, "durable").await;
    assert_eq!(found.id, ws.id);
    assert_eq!(found.latest_checkpoint.unwrap().id, committed.id);
    let after = manifest(&mut client, &ws.id, "").await;
    assert_eq!(after.keys, before.keys, "the tenant key survives");

    // A URL signed before the restart still reads (from the new blob port).
    let old_url = &before.packs[0].url;
    let (_, path_and_query) = old_url.split_once("/o/").unwrap();
    let moved = format!("{}/o/{path_and_query}", second.blob_url);
    let response = reqwest::get(&moved).await.unwrap();
    assert_eq!(response.status(), 200);

    let next = checkpoint(&mut client, &ws.id, b"after the restart").await;
    assert_eq!(next.sequence, 2);
    second.stop().await;
}

#[tokio::test]
async fn stopping_ends_open_watches_and_a_restart_keeps_runs_and_their_tokens() {
    use tokio_stream::StreamExt;

    use crate::fleet::{Clients, FakeRunner, fleet_on, start_patient};

    let dir = data_dir();
    let (first, mut clients, mut host) = fleet_on(start_patient(dir.path()).await, "h", 1).await;
    let run = clients.create_run(&[]).await;
    let assignment = host.beat_until_assigned(&run.id).await;
    let mut watch = clients.watch(&run.id, 0, true).await;
    for expected in ["created", "assigned"] {
        assert_eq!(watch.next().await.unwrap().unwrap().reason, expected);
    }

    // A graceful stop does not wait for the follower; the follower learns why it ends.
    first.stop().await;
    let ended = watch.next().await.unwrap().unwrap_err();
    assert_eq!(
        ended.code(),
        tonic::Code::Unavailable,
        "{}",
        ended.message()
    );

    let second = start_patient(dir.path()).await;
    host.reconnect(&second, &second.admin_token).await;
    host.sandboxes.clear();
    let again = host.beat().await;
    assert_eq!(again.assignments.len(), 1);
    assert_eq!(
        again.assignments[0].run_token, assignment.run_token,
        "run tokens are derived, so a restart repeats them"
    );
    let mut runner = FakeRunner::connect(&second, &assignment).await;
    assert_eq!(runner.claim().await.run_id, run.id);
    let mut clients = Clients::admin(&second).await;
    assert_eq!(
        clients.get(&run.id).await.state,
        pb::RunState::Starting as i32
    );
    second.stop().await;
}
