//! WorkspaceService: create, get by id or name, paginated lists, forks.

use cairn_proto::pb;
use tonic::Code;

use crate::fleet::{Clients, FakeHost, FakeRunner, patient_fleet, run_on};
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
        let found = get_workspace(&mut client, reference).await;
        // GetWorkspace adds what it stores: nothing yet.
        assert_eq!(found.storage, Some(pb::WorkspaceStorage::default()));
        assert_eq!(
            pb::Workspace {
                storage: None,
                ..found
            },
            named,
            "{reference}"
        );
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

fn fork_request(workspace: &str, checkpoint: &str, count: u32) -> pb::ForkWorkspaceRequest {
    pb::ForkWorkspaceRequest {
        workspace: workspace.into(),
        checkpoint_id: checkpoint.into(),
        count,
        name_prefix: String::new(),
    }
}

/// Files under `dir`, at any depth.
fn files_under(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| {
                    if e.path().is_dir() {
                        files_under(&e.path())
                    } else {
                        1
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

fn pack_ids(manifest: &pb::RestoreManifest) -> Vec<String> {
    let mut ids: Vec<String> = manifest.packs.iter().map(|p| p.pack_id.clone()).collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn a_fork_of_three_shares_the_checkpoint_without_copying() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let source = create_workspace(&mut client, "task").await;
    let first = checkpoint(&mut client, &source.id, b"first").await;
    let second = checkpoint(&mut client, &source.id, b"second").await;
    let source_manifest = manifest(&mut client, &source.id, &first.id).await;
    let objects_before = files_under(&server.object_file(""));

    let forked = client
        .workspaces
        .fork_workspace(fork_request("task", &first.id, 3))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(forked.checkpoint_id, first.id);
    let names: Vec<&str> = forked.workspaces.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(names, ["task-fork-1", "task-fork-2", "task-fork-3"]);
    let mut checkpoint_ids = Vec::new();
    for fork in &forked.workspaces {
        assert_ne!(fork.id, source.id);
        assert_eq!(fork.tenant, source.tenant);
        assert_eq!(fork.state, pb::WorkspaceState::Active as i32);
        assert_eq!(fork.checkpoint_count, 1, "{}", fork.name);
        let only = fork.latest_checkpoint.clone().unwrap();
        assert_ne!(only.id, first.id, "a checkpoint of its own");
        assert_eq!(only.workspace_id, fork.id);
        assert_eq!(only.sequence, 1);
        assert_eq!(only.parent_checkpoint_id, "");
        assert_eq!(only.root_tree, first.root_tree);
        assert_eq!(only.key_id, first.key_id);
        assert_eq!(only.reason, first.reason);
        assert_eq!(only.stats, first.stats);
        assert_eq!(only.pack_count, first.pack_count);
        assert_eq!(only.stored_bytes, first.stored_bytes);
        checkpoint_ids.push(only.id.clone());

        // Restorable from the very packs the source's checkpoint uses.
        let restore = manifest(&mut client, &fork.id, "").await;
        assert_eq!(restore.workspace_id, fork.id);
        assert_eq!(restore.keys, source_manifest.keys);
        assert_eq!(restore.candidates.len(), 1);
        assert_eq!(
            restore.candidates[0].checkpoint.as_ref().unwrap().id,
            only.id
        );
        assert_eq!(pack_ids(&restore), pack_ids(&source_manifest));

        // Each fork goes on by itself.
        let next = checkpoint(&mut client, &fork.id, fork.name.as_bytes()).await;
        assert_eq!(next.sequence, 2);
    }
    checkpoint_ids.sort();
    checkpoint_ids.dedup();
    assert_eq!(checkpoint_ids.len(), 3);
    assert_eq!(
        files_under(&server.object_file("")),
        objects_before + 3 * 2,
        "the fork itself wrote nothing to the store (each follow-up wrote two packs)"
    );

    // The source is unchanged.
    let after: Vec<String> = list_checkpoints(&mut client, &source.id)
        .await
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(after, [second.id.clone(), first.id.clone()]);

    // Without a checkpoint id the newest is forked; a prefix names them.
    let newest = client
        .workspaces
        .fork_workspace(pb::ForkWorkspaceRequest {
            name_prefix: "try".into(),
            ..fork_request(&source.id, "", 1)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(newest.checkpoint_id, second.id);
    assert_eq!(newest.workspaces[0].name, "try-1");
    assert_eq!(
        newest.workspaces[0]
            .latest_checkpoint
            .as_ref()
            .unwrap()
            .root_tree,
        second.root_tree
    );
}

#[tokio::test]
async fn a_fork_is_refused_whole_with_precise_codes() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let source = create_workspace(&mut client, "task").await;
    let empty = create_workspace(&mut client, "empty").await;
    checkpoint(&mut client, &source.id, b"first").await;
    let count = |client: &mut cairn_engine::client::CoordinatorClient| {
        let mut client = client.workspaces.clone();
        async move {
            client
                .list_workspaces(pb::ListWorkspacesRequest::default())
                .await
                .unwrap()
                .into_inner()
                .workspaces
                .len()
        }
    };
    let before = count(&mut client).await;

    let unknown_checkpoint = cairn_proto::ids::CheckpointId::generate().to_string();
    let cases = [
        (fork_request("task", "", 0), Code::InvalidArgument, "count"),
        (fork_request("task", "", 65), Code::InvalidArgument, "count"),
        (
            fork_request("task", "not-an-id", 1),
            Code::InvalidArgument,
            "not-an-id",
        ),
        (
            fork_request("task", &unknown_checkpoint, 1),
            Code::NotFound,
            unknown_checkpoint.as_str(),
        ),
        (fork_request("nope", "", 1), Code::NotFound, "nope"),
        (
            fork_request("empty", "", 1),
            Code::FailedPrecondition,
            "no checkpoint",
        ),
    ];
    for (request, code, words) in cases {
        let status = client
            .workspaces
            .fork_workspace(request.clone())
            .await
            .unwrap_err();
        assert_eq!(status.code(), code, "{request:?}: {}", status.message());
        assert!(status.message().contains(words), "{}", status.message());
    }
    // Refused as a source, the empty workspace is as it was.
    let shown = get_workspace(&mut client, &empty.id).await;
    assert_eq!(
        pb::Workspace {
            storage: None,
            ..shown
        },
        empty
    );

    // A name clash in the middle of the batch leaves nothing behind.
    create_workspace(&mut client, "task-fork-2").await;
    let clash = client
        .workspaces
        .fork_workspace(fork_request("task", "", 3))
        .await
        .unwrap_err();
    assert_eq!(clash.code(), Code::AlreadyExists, "{}", clash.message());
    assert_eq!(count(&mut client).await, before + 1, "all or nothing");
}

/// Creates a run on `workspace`, waits until the host is assigned it, and
/// starts its runner (before the host reports the sandbox).
async fn start_run_on(
    (server, clients, host): (&TestServer, &mut Clients, &mut FakeHost),
    workspace: &str,
) -> (pb::Assignment, FakeRunner, pb::AttemptSpec) {
    let run = clients.create(run_on(workspace)).await;
    let assignment = host.beat_until_assigned(&run.id).await;
    let mut runner = FakeRunner::connect(server, &assignment).await;
    let spec = runner.start().await;
    (assignment, runner, spec)
}

/// The runner reports success, and the host that its sandbox exited.
async fn succeed(host: &mut FakeHost, assignment: &pb::Assignment, runner: &mut FakeRunner) {
    runner.outcome(pb::Outcome::Succeeded, &[]).await.unwrap();
    host.beat().await;
    host.sandbox_gone(&assignment.sandbox_id, pb::SandboxState::Exited, 0);
    host.beat().await;
}

#[tokio::test]
async fn a_forks_first_run_forks_the_station_conversation_once() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let mut client = server.client().await;

    // A run on the source records its conversation, then a checkpoint.
    let source = create_workspace(&mut client, "src").await;
    let (assignment, mut runner, spec) =
        start_run_on((&server, &mut clients, &mut host), &source.id).await;
    assert!(!spec.fork_session);
    runner.report_session("session-source").await;
    checkpoint(&mut client, &source.id, b"work").await;
    succeed(&mut host, &assignment, &mut runner).await;

    let fork = client
        .workspaces
        .fork_workspace(fork_request("src", "", 1))
        .await
        .unwrap()
        .into_inner()
        .workspaces
        .remove(0);

    // The fork's first run forks the source's conversation …
    let (assignment, mut runner, spec) =
        start_run_on((&server, &mut clients, &mut host), &fork.id).await;
    assert_eq!(spec.resume_session_id, "session-source");
    assert!(spec.fork_session, "{spec:?}");
    runner.report_session("session-fork").await;
    succeed(&mut host, &assignment, &mut runner).await;

    // … and its next run continues the fork's own; the source keeps its own.
    for (workspace, session) in [(&fork.id, "session-fork"), (&source.id, "session-source")] {
        let (assignment, mut runner, spec) =
            start_run_on((&server, &mut clients, &mut host), workspace).await;
        assert_eq!(spec.resume_session_id, session);
        assert!(!spec.fork_session, "{spec:?}");
        succeed(&mut host, &assignment, &mut runner).await;
    }
}
