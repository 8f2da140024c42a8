//! Runs on hosts: placement, the attempt lifecycle, waiting, holds, answers,
//! suspension and cancellation, driven through HostService and
//! RunnerService as cairn-host and the runner drive them.

use std::time::Duration;

use cairn_proto::pb;
use cairn_proto::refusal::{NotCurrent, Refusal};
use tokio_stream::StreamExt;
use tonic::Code;

use crate::fleet::*;
use crate::harness::*;

#[tokio::test]
async fn runs_go_to_hosts_with_their_labels_and_a_free_slot_or_say_why_not() {
    let dir = data_dir();
    let server = start_patient(dir.path()).await;
    let mut clients = Clients::admin(&server).await;
    let mut eu =
        FakeHost::register(&server, &server.admin_token, "eu-1", &[("zone", "eu")], 1).await;
    let mut us =
        FakeHost::register(&server, &server.admin_token, "us-1", &[("zone", "us")], 2).await;

    let first = clients.create_run(&[("zone", "eu")]).await;
    assert_eq!(first.state, pb::RunState::Queued as i32);
    let assignment = eu.beat_until_assigned(&first.id).await;
    assert!(assignment.sandbox_id.starts_with("sbx-"), "{assignment:?}");
    assert_eq!(assignment.attempt, 1);
    assert_eq!(assignment.workspace_id, first.workspace_id);
    assert!(assignment.run_token.starts_with("cairn_run_"));
    let assigned = clients.get(&first.id).await;
    assert_eq!(assigned.state, pb::RunState::Assigned as i32);
    let attempt = &assigned.attempts[0];
    assert_eq!(attempt.host_id, eu.id);
    assert_eq!(attempt.generation, assignment.generation);
    assert!(us.beat().await.assignments.is_empty());

    // A level-triggered answer: the assignment repeats until the host reports the sandbox.
    let repeated = eu.client_beat_without_reports().await;
    assert_eq!(repeated.assignments.len(), 1);
    assert_eq!(repeated.assignments[0].run_token, assignment.run_token);
    eu.beat().await;
    assert!(eu.beat().await.assignments.is_empty());

    // eu-1's only slot is taken: the next eu run waits and says so.
    let second = clients.create_run(&[("zone", "eu")]).await;
    let gpu = clients.create_run(&[("gpu", "a100")]).await;
    let mut deadline = Deadline::new("queue reasons");
    let (second_now, gpu_now) = loop {
        let second_now = clients.get(&second.id).await;
        let gpu_now = clients.get(&gpu.id).await;
        if second_now.state_reason.contains("full") && gpu_now.state_reason.contains("labels") {
            break (second_now, gpu_now);
        }
        deadline.tick().await;
    };
    assert_eq!(second_now.state, pb::RunState::Queued as i32);
    assert_eq!(second_now.state_reason, "the only matching host is full");
    assert_eq!(gpu_now.state, pb::RunState::Queued as i32);
    assert_eq!(gpu_now.state_reason, "no ready host has labels gpu=a100");
    let events = clients.events(&gpu.id).await;
    let placement = events.iter().find(|e| e.reason == "placement").unwrap();
    assert_eq!(placement.detail, "no ready host has labels gpu=a100");
    assert_eq!(placement.state, pb::RunState::Queued as i32);

    // The first run ends and its sandbox is gone: the slot goes to the second.
    let mut runner = FakeRunner::connect(&server, &assignment).await;
    runner.start().await;
    runner.outcome(pb::Outcome::Succeeded, &[]).await.unwrap();
    assert_eq!(
        clients.get(&first.id).await.state,
        pb::RunState::Succeeded as i32
    );
    eu.sandbox_gone(&assignment.sandbox_id, pb::SandboxState::Exited, 0);
    let answer = eu.beat().await;
    assert_eq!(answer.forget, [assignment.sandbox_id.as_str()]);
    let next = eu.beat_until_assigned(&second.id).await;
    assert_eq!(next.attempt, 1);
    assert_eq!(
        clients.get(&gpu.id).await.state,
        pb::RunState::Queued as i32,
        "no host has the label"
    );
}

#[tokio::test]
async fn a_run_goes_to_the_host_that_keeps_its_workspace_tree() {
    let dir = data_dir();
    let server = start_patient(dir.path()).await;
    let mut clients = Clients::admin(&server).await;
    let mut a = FakeHost::register(&server, &server.admin_token, "a", &[], 2).await;
    let mut b = FakeHost::register(&server, &server.admin_token, "b", &[], 2).await;

    // Equally loaded: the first run goes to the host registered first.
    let first = clients.create_run(&[]).await;
    let (assignment, mut runner) = a.launch(&server, &first.id).await;
    runner.start().await;
    runner.outcome(pb::Outcome::Succeeded, &[]).await.unwrap();
    a.sandbox_gone(&assignment.sandbox_id, pb::SandboxState::Exited, 0);
    a.beat().await;

    // b says it keeps the workspace's tree (as if the run had been there).
    // The heartbeat is answered before its report is written: the
    // scheduler places by what is written.
    b.kept = vec![first.workspace_id.clone()];
    b.beat().await;
    clients.wait_for_kept(&b.id, &first.workspace_id).await;
    let second = clients.create(run_on(&first.workspace_id)).await;
    let placed = b.beat_until_assigned(&second.id).await;
    assert_eq!(placed.workspace_id, first.workspace_id);
    assert!(a.beat().await.assignments.is_empty());
    assert_eq!(clients.get(&second.id).await.attempts[0].host_id, b.id);

    // Another workspace's run still goes by load: a is idle, b is not.
    let other = clients.create_run(&[]).await;
    a.beat_until_assigned(&other.id).await;

    // A heartbeat that names no workspace is refused with the cause.
    b.kept = vec!["not-a-workspace".into()];
    let refused = b
        .client_heartbeat()
        .await
        .expect_err("an invalid kept workspace id");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("kept_workspaces"), "{refused}");
}

impl FakeHost {
    /// A heartbeat that reports nothing (as if the answer was lost and the
    /// host had not started anything yet).
    async fn client_beat_without_reports(&mut self) -> pb::HeartbeatResponse {
        let saved = std::mem::take(&mut self.sandboxes);
        let response = self.beat().await;
        for assignment in &response.assignments {
            self.sandboxes.remove(&assignment.sandbox_id);
        }
        self.sandboxes = saved;
        response
    }
}

#[tokio::test]
async fn the_attempt_lifecycle_is_recorded_as_events() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients.create_run(&[]).await;
    let (assignment, mut runner) = host.launch(&server, &run.id).await;

    let spec = runner.claim().await;
    assert_eq!(spec.run_id, run.id);
    assert_eq!(spec.attempt, 1);
    assert_eq!(spec.generation, assignment.generation);
    assert_eq!(spec.workspace_id, run.workspace_id);
    assert_eq!(spec.station, "default");
    assert_eq!(spec.prompt, "remember the codeword PELICAN");
    assert_eq!(spec.harness.unwrap().name, "claude");
    assert_eq!(spec.resume_session_id, "");
    assert!(spec.inputs.is_empty());
    assert_eq!(
        clients.get(&run.id).await.state,
        pb::RunState::Starting as i32
    );

    runner
        .progress(
            pb::AttemptPhase::Preparing,
            "workspace has no checkpoint: started empty",
            "",
        )
        .await
        .unwrap();
    runner
        .progress(pb::AttemptPhase::Running, "", "")
        .await
        .unwrap();
    runner.report_session("0f8e-session").await;
    let checkpoint = checkpoint(&mut runner.coordinator, &run.workspace_id, b"turn one").await;
    assert_eq!(checkpoint.generation, assignment.generation);
    runner
        .progress(pb::AttemptPhase::Checkpointed, "turn", &checkpoint.id)
        .await
        .unwrap();
    runner.outcome(pb::Outcome::Succeeded, &[]).await.unwrap();

    let done = clients.get(&run.id).await;
    assert_eq!(done.state, pb::RunState::Succeeded as i32);
    assert_eq!(done.summary, "did the work");
    assert_eq!(done.harness_session_id, "0f8e-session");
    assert_eq!(done.last_checkpoint_id, checkpoint.id);
    let attempt = &done.attempts[0];
    assert_eq!(attempt.state, pb::AttemptState::Ended as i32);
    assert_eq!(attempt.end_reason, "succeeded");
    assert_eq!(
        attempt.prepare,
        "workspace has no checkpoint: started empty"
    );

    let events = clients.events(&run.id).await;
    assert_eq!(
        reasons(&events),
        [
            "created",
            "assigned",
            "claimed",
            "prepared",
            "harness_started",
            "harness_session",
            "checkpoint",
            "succeeded"
        ]
    );
    let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
    assert_eq!(sequences, (1..=8).collect::<Vec<_>>());
    let checkpoint_event = &events[6];
    assert_eq!(checkpoint_event.checkpoint_id, checkpoint.id);
    assert_eq!(checkpoint_event.host_id, host.id);
    assert_eq!(checkpoint_event.attempt, 1);
    assert_eq!(checkpoint_event.generation, assignment.generation);
    assert_eq!(events[7].state, pb::RunState::Succeeded as i32);

    // Events after a sequence; the run has ended, so following stops at once.
    let later: Vec<_> = clients.watch(&run.id, 6, true).await.collect().await;
    assert_eq!(
        later.len(),
        2,
        "the run ended, so following stops: {later:?}"
    );
}

#[tokio::test]
async fn a_held_sandbox_is_destroyed_when_the_hold_expires_and_the_run_is_suspended() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients
        .create(pb::CreateRunRequest {
            hold: Some(duration(Duration::from_millis(500))),
            ..run_request(&[])
        })
        .await;
    let (assignment, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;
    let held = runner.wait_for_person("which database?").await;
    assert!(held.hold_until.is_some());
    let waiting = clients.get(&run.id).await;
    assert_eq!(waiting.state, pb::RunState::Waiting as i32);
    assert_eq!(waiting.question, "which database?");
    assert_eq!(waiting.hold_until, held.hold_until);

    let mut deadline = Deadline::new("the destroy order after the hold");
    let orders = loop {
        host.beat().await;
        let orders = host.destroy_orders();
        if !orders.is_empty() {
            break orders;
        }
        deadline.tick().await;
    };
    assert_eq!(
        orders.get(&assignment.sandbox_id).map(String::as_str),
        Some("hold_expired")
    );
    // Until the sandbox is gone the run still waits; the order repeats.
    assert_eq!(
        clients.get(&run.id).await.state,
        pb::RunState::Waiting as i32
    );
    host.beat().await;
    assert_eq!(host.destroy_orders(), orders);

    // The runner checkpoints and reports before the host kills it.
    runner.outcome(pb::Outcome::Interrupted, &[]).await.unwrap();
    host.sandbox_gone(&assignment.sandbox_id, pb::SandboxState::Destroyed, 0);
    let answer = host.beat().await;
    assert_eq!(answer.forget, [assignment.sandbox_id.as_str()]);
    let suspended = clients.get(&run.id).await;
    assert_eq!(suspended.state, pb::RunState::Suspended as i32);
    assert_eq!(suspended.question, "which database?");
    assert_eq!(suspended.hold_until, None);
    assert_eq!(suspended.attempts[0].end_reason, "hold_expired");
    let events = clients.events(&run.id).await;
    let tail: Vec<_> = reasons(&events).into_iter().rev().take(4).rev().collect();
    assert_eq!(
        tail,
        ["waiting", "hold_expired", "interrupted", "sandbox_released"]
    );
    // The ended attempt's runner is refused from now on.
    let refused = runner
        .progress(pb::AttemptPhase::Running, "", "")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(
        matches!(
            Refusal::of(&refused),
            Some(Refusal::AttemptNotCurrent {
                why: NotCurrent::Ended,
                attempt: 1,
                ..
            })
        ),
        "{refused}"
    );
}

#[tokio::test]
async fn an_answer_within_the_hold_reaches_the_same_attempt() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients.create_run(&[]).await;
    let (_, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;

    let refused = clients.answer(&run.id, "too early").await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(
        refused.message().contains("running"),
        "{}",
        refused.message()
    );

    runner.wait_for_person("postgres or sqlite?").await;
    let mut waiter = runner.runner.clone();
    let pending = tokio::spawn(async move { wait_for_input(&mut waiter).await });
    let answered = clients.answer(&run.id, "sqlite").await.unwrap();
    assert_eq!(answered.state, pb::RunState::Waiting as i32);
    let events = clients.events(&run.id).await;
    let last = events.last().unwrap();
    assert_eq!(
        (last.reason.as_str(), last.detail.as_str()),
        ("answered", "delivered to the held sandbox")
    );
    let delivered = pending.await.unwrap();
    assert_eq!(delivered.inputs.len(), 1);
    let input = &delivered.inputs[0];
    assert_eq!(
        (input.kind.as_str(), input.text.as_str()),
        ("answer", "sqlite")
    );

    runner
        .progress(pb::AttemptPhase::Running, "answer sent", "")
        .await
        .unwrap();
    let running = clients.get(&run.id).await;
    assert_eq!(running.state, pb::RunState::Running as i32);
    assert_eq!(running.attempts.len(), 1, "same attempt, no new sandbox");
    assert_eq!(running.question, "");
    assert!(host.beat().await.destroy.is_empty());
    // Only inputs of the run can be heard; a refused report changes nothing.
    let unknown = runner
        .outcome(pb::Outcome::Succeeded, &[99])
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::InvalidArgument);
    assert!(
        unknown.message().contains("no input 99"),
        "{}",
        unknown.message()
    );
    assert_eq!(
        clients.get(&run.id).await.state,
        pb::RunState::Running as i32
    );
    runner
        .outcome(pb::Outcome::Succeeded, &[input.id])
        .await
        .unwrap();
    assert_eq!(
        clients.get(&run.id).await.state,
        pb::RunState::Succeeded as i32
    );
}

#[tokio::test]
async fn an_answer_to_a_suspended_run_starts_the_next_attempt_resuming_the_conversation() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients.create_run(&[]).await;
    let (first, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;
    runner.report_session("session-one").await;
    runner.wait_for_person("which port?").await;

    let suspending = clients
        .runs
        .suspend_run(pb::SuspendRunRequest {
            run_id: run.id.clone(),
            reason: "end of day".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(suspending.state, pb::RunState::Waiting as i32);
    host.beat().await;
    assert_eq!(host.destroy_order(&first.sandbox_id), Some("suspended"));
    host.sandbox_gone(&first.sandbox_id, pb::SandboxState::Destroyed, -15);
    host.beat().await;
    let suspended = clients.get(&run.id).await;
    assert_eq!(suspended.state, pb::RunState::Suspended as i32);
    assert_eq!(suspended.attempts[0].end_reason, "suspended");

    let queued = clients.answer(&run.id, "port 8080").await.unwrap();
    assert_eq!(queued.state, pb::RunState::Queued as i32);
    assert_eq!(queued.state_reason, "answered; waiting for a host");
    let second = host.beat_until_assigned(&run.id).await;
    assert_eq!(second.attempt, 2);
    assert!(second.generation > first.generation);
    assert_ne!(second.run_token, first.run_token);
    let mut next = FakeRunner::connect(&server, &second).await;
    let spec = next.claim().await;
    assert_eq!(spec.attempt, 2);
    assert_eq!(spec.resume_session_id, "session-one");
    assert_eq!(spec.question, "which port?");
    let texts: Vec<_> = spec.inputs.iter().map(|i| i.text.as_str()).collect();
    assert_eq!(texts, ["port 8080"]);

    // The first attempt's runner is superseded.
    let refused = runner.claim_err().await;
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(
        matches!(
            Refusal::of(&refused),
            Some(Refusal::AttemptNotCurrent {
                why: NotCurrent::Superseded,
                attempt: 1,
                ..
            })
        ),
        "{refused}"
    );
}

impl FakeRunner {
    async fn claim_err(&mut self) -> tonic::Status {
        self.runner
            .claim_attempt(pb::ClaimAttemptRequest {})
            .await
            .unwrap_err()
    }
}

#[tokio::test]
async fn cancel_ends_the_run_at_once_and_destroys_its_sandbox() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients.create_run(&[]).await;
    let (assignment, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;

    let cancelled = clients.cancel(&run.id, "wrong task").await;
    assert_eq!(cancelled.state, pb::RunState::Cancelled as i32);
    assert_eq!(cancelled.state_reason, "cancelled: wrong task");
    host.beat().await;
    assert_eq!(
        host.destroy_order(&assignment.sandbox_id),
        Some("cancelled")
    );
    // The runner still checkpoints and reports on its way out.
    runner.outcome(pb::Outcome::Interrupted, &[]).await.unwrap();
    host.sandbox_gone(&assignment.sandbox_id, pb::SandboxState::Destroyed, 0);
    assert_eq!(host.beat().await.forget, [assignment.sandbox_id.as_str()]);
    let done = clients.get(&run.id).await;
    assert_eq!(done.state, pb::RunState::Cancelled as i32);
    assert_eq!(done.attempts[0].end_reason, "cancelled");
    assert!(host.beat().await.assignments.is_empty());

    let again = clients.answer(&run.id, "hello?").await.unwrap_err();
    assert_eq!(again.code(), Code::FailedPrecondition);
    assert!(again.message().contains("cancelled"), "{}", again.message());
}

#[tokio::test]
async fn a_runner_that_crashes_is_retried_until_max_attempts() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients.create_with_max_attempts(2).await;
    let (first, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;
    host.sandbox_gone(&first.sandbox_id, pb::SandboxState::Exited, 3);
    host.beat().await;
    let requeued = clients.get(&run.id).await;
    assert_ne!(requeued.state, pb::RunState::Failed as i32);
    assert_eq!(
        requeued.attempts[0].end_reason,
        "runner exited with status 3"
    );

    let second = host.beat_until_assigned(&run.id).await;
    assert_eq!(second.attempt, 2);
    host.beat().await;
    host.sandbox_gone(&second.sandbox_id, pb::SandboxState::Exited, -9);
    host.beat().await;
    let failed = clients.get(&run.id).await;
    assert_eq!(failed.state, pb::RunState::Failed as i32);
    assert!(
        failed.state_reason.contains("2 failed attempts")
            && failed.state_reason.contains("killed by signal 9"),
        "{}",
        failed.state_reason
    );
    assert!(host.beat().await.assignments.is_empty());
}

#[tokio::test]
async fn watching_a_run_follows_its_events_live_until_it_ends() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let run = clients.create_run(&[]).await;
    let mut stream = clients.watch(&run.id, 0, true).await;
    let created = stream.next().await.unwrap().unwrap();
    assert_eq!(created.reason, "created");

    let assignment = host.beat_until_assigned(&run.id).await;
    let assigned = stream.next().await.unwrap().unwrap();
    assert_eq!(assigned.reason, "assigned");
    assert_eq!(assigned.host_id, host.id);
    assert_eq!(assigned.state, pb::RunState::Assigned as i32);

    host.beat().await;
    let mut runner = FakeRunner::connect(&server, &assignment).await;
    runner.claim().await;
    assert_eq!(stream.next().await.unwrap().unwrap().reason, "claimed");
    runner.wait_for_person("ready?").await;
    let waiting = stream.next().await.unwrap().unwrap();
    assert_eq!(
        (
            waiting.reason.as_str(),
            waiting.state,
            waiting.detail.as_str()
        ),
        ("waiting", pb::RunState::Waiting as i32, "ready?")
    );
    clients.answer(&run.id, "yes").await.unwrap();
    assert_eq!(stream.next().await.unwrap().unwrap().reason, "answered");
    runner.outcome(pb::Outcome::Failed, &[1]).await.unwrap();
    let failed = stream.next().await.unwrap().unwrap();
    assert_eq!(
        (failed.reason.as_str(), failed.state),
        ("failed", pb::RunState::Failed as i32)
    );
    assert!(
        stream.next().await.is_none(),
        "the stream ends with the run"
    );
}

#[tokio::test]
async fn run_requests_are_checked_and_runs_list_newest_first_in_pages() {
    let dir = data_dir();
    let server = start_patient(dir.path()).await;
    let mut clients = Clients::admin(&server).await;

    let invalid = [
        pb::CreateRunRequest {
            target: None,
            ..run_request(&[])
        },
        pb::CreateRunRequest {
            prompt: "  ".into(),
            ..run_request(&[])
        },
        pb::CreateRunRequest {
            harness: None,
            ..run_request(&[])
        },
        pb::CreateRunRequest {
            station: "../review".into(),
            ..run_request(&[])
        },
        run_request(&[("bad key!", "x")]),
        pb::CreateRunRequest {
            max_attempts: 1000,
            ..run_request(&[])
        },
    ];
    for request in invalid {
        let status = clients.runs.create_run(request.clone()).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{request:?}");
    }

    let named = clients
        .create(pb::CreateRunRequest {
            target: Some(pb::create_run_request::Target::NewWorkspace(
                pb::NewWorkspace {
                    name: "fix-login".into(),
                },
            )),
            station: "implement".into(),
            ..run_request(&[])
        })
        .await;
    assert_eq!(named.station, "implement");
    assert_eq!(named.max_attempts, 3);
    assert_eq!(named.hold.unwrap().seconds, 300);
    let taken = clients
        .runs
        .create_run(pb::CreateRunRequest {
            target: Some(pb::create_run_request::Target::NewWorkspace(
                pb::NewWorkspace {
                    name: "fix-login".into(),
                },
            )),
            ..run_request(&[])
        })
        .await
        .unwrap_err();
    assert_eq!(taken.code(), Code::AlreadyExists);
    // One live run per workspace: a second would fence the first off.
    let busy = clients
        .runs
        .create_run(run_on("fix-login"))
        .await
        .unwrap_err();
    assert_eq!(busy.code(), Code::FailedPrecondition);
    assert!(busy.message().contains(&named.id), "{}", busy.message());
    clients.cancel(&named.id, "").await;
    let follow_up = clients.create(run_on("fix-login")).await;
    assert_eq!(follow_up.workspace_id, named.workspace_id);
    let other = clients.create_run(&[]).await;

    let mut seen = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = clients
            .runs
            .list_runs(pb::ListRunsRequest {
                page_size: 2,
                page_token: page_token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        seen.extend(page.runs.into_iter().map(|r| r.id));
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    assert_eq!(
        seen,
        [other.id.clone(), follow_up.id.clone(), named.id.clone()]
    );
    let in_workspace = clients
        .runs
        .list_runs(pb::ListRunsRequest {
            workspace: "fix-login".into(),
            state: pb::RunState::Cancelled as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .runs;
    let ids: Vec<_> = in_workspace.iter().map(|r| r.id.clone()).collect();
    assert_eq!(ids, [named.id.as_str()]);
}

#[tokio::test]
async fn runs_are_shown_with_when_their_workspace_was_last_checkpointed() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let checkpoint = checkpoint(&mut client, &ws.id, b"state").await;

    let mut clients = Clients::admin(&server).await;
    let on_checkpointed = clients.create(run_on(&ws.id)).await;
    let on_new = clients.create_run(&[]).await;
    assert_eq!(
        on_checkpointed.workspace_checkpointed_at, None,
        "CreateRun does not look it up"
    );
    let shown = clients.get(&on_checkpointed.id).await;
    assert_eq!(shown.workspace_checkpointed_at, checkpoint.created_at);
    assert_eq!(
        clients.get(&on_new.id).await.workspace_checkpointed_at,
        None
    );

    let listed = clients
        .runs
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    let by_id = |id: &str| listed.iter().find(|run| run.id == id).unwrap().clone();
    assert_eq!(
        by_id(&on_checkpointed.id).workspace_checkpointed_at,
        checkpoint.created_at
    );
    assert_eq!(by_id(&on_new.id).workspace_checkpointed_at, None);
}
