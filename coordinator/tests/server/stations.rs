//! Stations: the handoff note each run leaves is stored per run and listed
//! with its workspace, the next attempts get the newest notes with their
//! spec, the files a run lays travel with it, a fork keeps the notes of the
//! work it was forked from, and a station conversation of another harness
//! is named rather than resumed.

use cairn_engine::client::AuthChannel;
use cairn_proto::pb;
use cairn_proto::pb::workspace_service_client::WorkspaceServiceClient;
use tonic::Code;

use crate::fleet::{Clients, FakeHost, FakeRunner, patient_fleet, run_on, run_request};
use crate::harness::{TestServer, checkpoint};

async fn notes(
    client: &mut WorkspaceServiceClient<AuthChannel>,
    workspace: &str,
) -> Vec<pb::HandoffNote> {
    client
        .list_handoff_notes(pb::ListHandoffNotesRequest {
            workspace: workspace.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .notes
}

fn handoff(summary: &str, next: &str) -> pb::HandoffText {
    pb::HandoffText {
        summary: summary.into(),
        changed: "app: 1 new commit (abc1234 add the form); nothing uncommitted".into(),
        checked: "cargo test".into(),
        uncertain: "not stated".into(),
        next: next.into(),
        composed: vec!["changed".into(), "uncertain".into()],
    }
}

/// A run request at `station` on `workspace`.
fn at_station(workspace: &str, station: &str) -> pb::CreateRunRequest {
    pb::CreateRunRequest {
        station: station.into(),
        ..run_on(workspace)
    }
}

/// Reports the end of an attempt with `outcome`, a checkpoint and a note.
async fn end_with_note(
    runner: &mut FakeRunner,
    outcome: pb::Outcome,
    checkpoint: &str,
    note: pb::HandoffText,
) -> Result<(), tonic::Status> {
    runner
        .runner
        .report_outcome(pb::ReportOutcomeRequest {
            outcome: outcome as i32,
            summary: note.summary.clone(),
            checkpoint_id: checkpoint.into(),
            handoff: Some(note),
            ..Default::default()
        })
        .await
        .map(drop)
}

/// Runs `request` to its end on `host`: claimed, a checkpoint committed with
/// the run token, succeeded with `note`, its sandbox gone. Returns the run,
/// the spec its runner got and the checkpoint.
async fn run_to_end(
    server: &TestServer,
    clients: &mut Clients,
    host: &mut FakeHost,
    request: pb::CreateRunRequest,
    note: pb::HandoffText,
) -> (pb::Run, pb::AttemptSpec, pb::Checkpoint) {
    let run = clients.create(request).await;
    let (assignment, mut runner) = host.launch(server, &run.id).await;
    let spec = runner.start().await;
    let committed = checkpoint(
        &mut runner.coordinator,
        &run.workspace_id,
        run.id.as_bytes(),
    )
    .await;
    end_with_note(&mut runner, pb::Outcome::Succeeded, &committed.id, note)
        .await
        .unwrap();
    host.sandbox_gone(&assignment.sandbox_id, pb::SandboxState::Exited, 0);
    host.beat().await;
    (run, spec, committed)
}

#[tokio::test]
async fn handoff_notes_are_stored_per_run_listed_and_handed_to_the_next_station() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let mut ws = server.client().await.workspaces;
    let (first, spec, one) = run_to_end(
        &server,
        &mut clients,
        &mut host,
        pb::CreateRunRequest {
            station: "implement".into(),
            ..run_request(&[])
        },
        handoff("Added the form.", "review it"),
    )
    .await;
    assert!(spec.notes.is_empty(), "a new workspace has no notes");
    let workspace = first.workspace_id.clone();

    let listed = notes(&mut ws, &workspace).await;
    assert_eq!(listed.len(), 1, "{listed:#?}");
    let note = &listed[0];
    assert_eq!(
        (
            note.run_id.as_str(),
            note.station.as_str(),
            note.attempt,
            note.outcome.as_str(),
            note.harness.as_str(),
            note.checkpoint_id.as_str(),
            note.workspace_id.as_str(),
        ),
        (
            first.id.as_str(),
            "implement",
            1,
            "succeeded",
            "claude",
            one.id.as_str(),
            workspace.as_str(),
        )
    );
    assert!(note.created_at.is_some());
    assert_eq!(note.text, Some(handoff("Added the form.", "review it")));

    // The next station's runner gets the note with its spec.
    let (second, spec, _) = run_to_end(
        &server,
        &mut clients,
        &mut host,
        at_station(&workspace, "review"),
        handoff("Two comments.", "fix them"),
    )
    .await;
    assert_eq!(spec.station, "review");
    assert_eq!(spec.resume_session_id, "", "a new station resumes nothing");
    assert_eq!(spec.notes.len(), 1);
    assert_eq!(spec.notes[0].run_id, first.id);
    assert_eq!(spec.notes[0].text, note.text);

    // Oldest first.
    let runs: Vec<String> = notes(&mut ws, &workspace)
        .await
        .into_iter()
        .map(|n| n.run_id)
        .collect();
    assert_eq!(runs, [first.id.clone(), second.id.clone()]);
}

#[tokio::test]
async fn a_later_attempt_replaces_its_runs_note_and_attempts_get_the_newest_ten() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let mut ws = server.client().await.workspaces;
    let first = clients.create_run(&[]).await;
    let workspace = first.workspace_id.clone();

    // Attempt 1 is interrupted and leaves a note; attempt 2 ends the run.
    let (one, mut runner) = host.launch(&server, &first.id).await;
    runner.start().await;
    end_with_note(
        &mut runner,
        pb::Outcome::Interrupted,
        "",
        handoff("interrupted", "carry on"),
    )
    .await
    .unwrap();
    host.sandbox_gone(&one.sandbox_id, pb::SandboxState::Failed, 1);
    host.beat().await;
    let listed = notes(&mut ws, &workspace).await;
    assert_eq!(
        listed
            .iter()
            .map(|n| (n.attempt, n.outcome.as_str()))
            .collect::<Vec<_>>(),
        [(1, "interrupted")]
    );
    let two = host.beat_until_assigned(&first.id).await;
    let mut runner = FakeRunner::connect(&server, &two).await;
    let spec = runner.start().await;
    assert_eq!(spec.notes.len(), 1, "the interrupted attempt's note");
    end_with_note(
        &mut runner,
        pb::Outcome::Failed,
        "",
        handoff("failed: no key", "get a key"),
    )
    .await
    .unwrap();
    host.sandbox_gone(&two.sandbox_id, pb::SandboxState::Exited, 0);
    host.beat().await;
    let listed = notes(&mut ws, &workspace).await;
    assert_eq!(listed.len(), 1, "one note per run: {listed:#?}");
    assert_eq!(
        (listed[0].attempt, listed[0].outcome.as_str()),
        (2, "failed")
    );

    // Eleven more runs: an attempt gets the ten newest notes, oldest first.
    let mut ids = vec![first.id.clone()];
    for i in 0..11 {
        let (run, _, _) = run_to_end(
            &server,
            &mut clients,
            &mut host,
            at_station(&workspace, &format!("s{i}")),
            handoff(&format!("run {i}"), "next"),
        )
        .await;
        ids.push(run.id);
    }
    assert_eq!(notes(&mut ws, &workspace).await.len(), 12);
    let last = clients.create(run_on(&workspace)).await;
    let (_, mut runner) = host.launch(&server, &last.id).await;
    let spec = runner.claim().await;
    let given: Vec<&str> = spec.notes.iter().map(|n| n.run_id.as_str()).collect();
    let newest: Vec<&str> = ids[2..].iter().map(String::as_str).collect();
    assert_eq!(given, newest);
}

#[tokio::test]
async fn notes_are_validated_on_receipt() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients.create_run(&[]).await;
    let (_, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;
    let mut bad = handoff("done", "next");
    bad.composed = vec!["summary".into()];
    let status = end_with_note(&mut runner, pb::Outcome::Succeeded, "", bad)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("handoff.composed"), "{status:?}");
    let mut long = handoff("done", "next");
    long.next = "x".repeat(cairn_proto::stations::MAX_NOTE_FIELD_BYTES + 1);
    let status = end_with_note(&mut runner, pb::Outcome::Succeeded, "", long)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // Refused reports change nothing: the run still takes a good one.
    end_with_note(
        &mut runner,
        pb::Outcome::Succeeded,
        "",
        handoff("done", "next"),
    )
    .await
    .unwrap();
    let mut ws = server.client().await.workspaces;
    assert_eq!(notes(&mut ws, &run.workspace_id).await.len(), 1);
}

#[tokio::test]
async fn laid_files_travel_with_the_run_and_bad_paths_are_refused() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let skill = ".cairn/state/claude/skills/review/SKILL.md";
    let run = clients
        .create(pb::CreateRunRequest {
            station: "review".into(),
            lay: [
                (skill.to_owned(), b"# review\n".to_vec()),
                ("AGENTS.md".to_owned(), b"be strict\n".to_vec()),
            ]
            .into(),
            ..run_request(&[])
        })
        .await;
    assert_eq!(run.laid_paths, [skill, "AGENTS.md"], "in path order");
    let events = clients.events(&run.id).await;
    assert!(
        events[0].detail.ends_with(", lays 2 files"),
        "{:?}",
        events[0].detail
    );
    let (assignment, mut runner) = host.launch(&server, &run.id).await;
    let spec = runner.claim().await;
    assert_eq!(spec.lay.len(), 2);
    assert_eq!(spec.lay[skill], b"# review\n");
    assert_eq!(clients.get(&run.id).await.laid_paths, run.laid_paths);

    // The most a run may lay travels whole, both ways.
    let most: std::collections::HashMap<String, Vec<u8>> = (0..4)
        .map(|i| {
            (
                format!("skills/s{i}.md"),
                vec![b'a' + i as u8; cairn_proto::stations::MAX_LAID_FILE_BYTES],
            )
        })
        .collect();
    let big = clients
        .create(pb::CreateRunRequest {
            lay: most.clone(),
            ..run_request(&[])
        })
        .await;
    runner.outcome(pb::Outcome::Succeeded, &[]).await.unwrap();
    host.sandbox_gone(&assignment.sandbox_id, pb::SandboxState::Exited, 0);
    host.beat().await;
    let (_, mut big_runner) = host.launch(&server, &big.id).await;
    assert_eq!(big_runner.claim().await.lay, most);
    let too_much = [(
        "skills/extra.md".to_owned(),
        vec![0; cairn_proto::stations::MAX_LAID_FILE_BYTES],
    )];
    let status = clients
        .runs
        .create_run(pb::CreateRunRequest {
            lay: most.into_iter().chain(too_much).collect(),
            ..run_request(&[])
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    for (path, words) in [
        ("../escape.md", "leaves the workspace"),
        ("/etc/passwd", "is absolute"),
        ("app/.git/hooks/pre-commit", "inside a .git directory"),
        (".cairn/outcome.json", "belongs to the runner"),
    ] {
        let status = clients
            .runs
            .create_run(pb::CreateRunRequest {
                lay: [(path.to_owned(), b"x".to_vec())].into(),
                ..run_request(&[])
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{path}: {status:?}");
        assert!(status.message().contains(words), "{path}: {status:?}");
    }
}

#[tokio::test]
async fn a_fork_keeps_the_notes_of_the_work_it_was_forked_from() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let mut ws = server.client().await.workspaces;
    let (first, _, one) = run_to_end(
        &server,
        &mut clients,
        &mut host,
        pb::CreateRunRequest {
            station: "implement".into(),
            ..run_request(&[])
        },
        handoff("Added the form.", "review it"),
    )
    .await;
    let workspace = first.workspace_id.clone();
    let (second, _, _) = run_to_end(
        &server,
        &mut clients,
        &mut host,
        at_station(&workspace, "review"),
        handoff("Two comments.", "fix them"),
    )
    .await;

    let fork = |checkpoint: String| pb::ForkWorkspaceRequest {
        workspace: workspace.clone(),
        checkpoint_id: checkpoint,
        count: 1,
        name_prefix: String::new(),
    };
    let early = ws
        .fork_workspace(fork(one.id.clone()))
        .await
        .unwrap()
        .into_inner();
    let early = &early.workspaces[0];
    let kept: Vec<String> = notes(&mut ws, &early.id)
        .await
        .into_iter()
        .map(|n| n.run_id)
        .collect();
    assert_eq!(
        kept,
        [first.id.as_str()],
        "the review came after the fork's checkpoint"
    );
    let late = ws
        .fork_workspace(fork(String::new()))
        .await
        .unwrap()
        .into_inner();
    let late = &late.workspaces[0];
    let copied = notes(&mut ws, &late.id).await;
    assert_eq!(
        copied.iter().map(|n| n.run_id.as_str()).collect::<Vec<_>>(),
        [first.id.as_str(), second.id.as_str()]
    );
    assert!(copied.iter().all(|n| n.workspace_id == late.id));

    // The fork's first run is briefed with them.
    let run = clients.create(at_station(&late.id, "fix")).await;
    let (_, mut runner) = host.launch(&server, &run.id).await;
    let spec = runner.claim().await;
    assert_eq!(spec.notes.len(), 2);
}

#[tokio::test]
async fn a_station_conversation_of_another_harness_is_named_not_resumed() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let first = clients.create_run(&[]).await;
    let (one, mut runner) = host.launch(&server, &first.id).await;
    runner.start().await;
    runner.report_session("claude-session-1").await;
    runner.outcome(pb::Outcome::Succeeded, &[]).await.unwrap();
    host.sandbox_gone(&one.sandbox_id, pb::SandboxState::Exited, 0);
    host.beat().await;

    let switched = clients
        .create(pb::CreateRunRequest {
            harness: Some(pb::HarnessSpec {
                name: "codex".into(),
                config: Default::default(),
            }),
            ..run_on(&first.workspace_id)
        })
        .await;
    let (_, mut runner) = host.launch(&server, &switched.id).await;
    let spec = runner.claim().await;
    assert_eq!(spec.resume_session_id, "");
    assert_eq!(spec.station_session_harness, "claude");
}
