//! WorkspaceService: create, get by id or name, paginated lists.

use cairn_proto::pb;
use tonic::Code;

use crate::harness::*;

#[tokio::test]
async fn workspaces_are_created_and_found_by_id_or_name() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let named = create_workspace(&mut client, "fix-login").await;
    assert!(named.id.starts_with("ws-"));
    assert_eq!(named.name, "fix-login");
    assert_eq!(named.tenant, "default");
    assert_eq!(named.state, pb::WorkspaceState::Active as i32);
    assert_eq!(named.checkpoint_count, 0);
    assert!(named.latest_checkpoint.is_none());
    let unnamed = create_workspace(&mut client, "").await;
    assert_eq!(unnamed.name, "");

    for reference in [named.id.as_str(), "fix-login"] {
        let found = client
            .workspaces
            .get_workspace(pb::GetWorkspaceRequest {
                workspace: reference.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(found, named, "{reference}");
    }

    let duplicate = client
        .workspaces
        .create_workspace(pb::CreateWorkspaceRequest {
            name: "fix-login".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(duplicate.code(), Code::AlreadyExists);
    assert!(
        duplicate.message().contains("fix-login"),
        "{}",
        duplicate.message()
    );

    let invalid = client
        .workspaces
        .create_workspace(pb::CreateWorkspaceRequest {
            name: "../etc".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument);

    let missing = client
        .workspaces
        .get_workspace(pb::GetWorkspaceRequest {
            workspace: "no-such-thing".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    assert!(
        missing.message().contains("no-such-thing"),
        "{}",
        missing.message()
    );

    let status = client
        .checkpoints
        .begin_checkpoint(pb::BeginCheckpointRequest {
            workspace: "no-such-thing".into(),
            generation: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
}

#[tokio::test]
async fn workspaces_list_in_pages_of_the_requested_size() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let mut created = Vec::new();
    for i in 0..5 {
        created.push(create_workspace(&mut client, &format!("ws{i}")).await.id);
    }
    let with_checkpoint = created[3].clone();
    let committed = checkpoint(&mut client, &with_checkpoint, b"work").await;

    let mut listed = Vec::new();
    let mut page_token = String::new();
    let mut pages = 0;
    loop {
        let page = client
            .workspaces
            .list_workspaces(pb::ListWorkspacesRequest {
                page_size: 2,
                page_token,
            })
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        assert!(page.workspaces.len() <= 2);
        listed.extend(page.workspaces);
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    assert_eq!(pages, 3);
    assert_eq!(
        listed.iter().map(|w| w.id.clone()).collect::<Vec<_>>(),
        created
    );
    let summarized = listed.iter().find(|w| w.id == with_checkpoint).unwrap();
    assert_eq!(summarized.checkpoint_count, 1);
    assert_eq!(
        summarized.latest_checkpoint.as_ref().unwrap().id,
        committed.id
    );

    let all = client
        .workspaces
        .list_workspaces(pb::ListWorkspacesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.workspaces.len(), 5);
    assert!(all.next_page_token.is_empty());

    let bad = client
        .workspaces
        .list_workspaces(pb::ListWorkspacesRequest {
            page_size: 2,
            page_token: "garbage".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
}
