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
    let found = client
        .workspaces
        .get_workspace(pb::GetWorkspaceRequest {
            workspace: "durable".into(),
        })
        .await
        .unwrap()
        .into_inner();
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
