//! Runs and the hosts under them: a host that crashes mid-run, a stale
//! runner that tries to commit after its run moved on, SIGTERM and cancel
//! (both through the destroy path, which checkpoints), and placement by
//! labels and slots.

use std::time::Duration;

use cairn_e2e::fleet::{
    Fleet, HostOptions, checkpoint_reason, describe_event, event_state, is_alive, on_workspace,
    process_cmdline, run_token_of, sandbox_processes, signal, state_of, state_of_host,
};
use cairn_e2e::{block_on, git, ids_with_prefix, json_str, run, tempdir, write};
use cairn_proto::pb;
use cairn_proto::pb::runner_service_client::RunnerServiceClient;
use cairn_proto::runs::{HostState, RunState, to_proto_duration};

/// Periodic checkpoints every second while the workspace changes.
fn every_second(mut request: pb::CreateRunRequest) -> pb::CreateRunRequest {
    request.checkpoint_interval = Some(to_proto_duration(Duration::from_secs(1)));
    request
}

/// Waits until the run has an attempt with a sandbox and returns it.
fn wait_for_sandbox(fleet: &Fleet, run_id: &str, attempt: u32) -> pb::Attempt {
    let run = fleet.wait_for_run(run_id, &format!("attempt {attempt} has a sandbox"), |run| {
        run.attempts
            .iter()
            .any(|a| a.number == attempt && !a.sandbox_id.is_empty())
    });
    run.attempts
        .into_iter()
        .find(|a| a.number == attempt)
        .expect("just seen")
}

#[test]
fn a_crashed_host_s_run_resumes_on_another_host_from_the_last_checkpoint() {
    let mut fleet = Fleet::start();
    fleet.start_host("a", HostOptions::default());
    let host_b = fleet.start_host("b", HostOptions::default()).id.clone();
    fleet.cordon("b");

    let prompt = "commit work/before.txt written before the crash\n\
                  untracked work/draft.txt drafted before the crash\n\
                  sleep 600";
    let created = fleet.create_run(every_second(fleet.run_request("crash", prompt)));
    let (run_id, workspace) = (created.id.clone(), created.workspace_id.clone());
    let first = wait_for_sandbox(&fleet, &run_id, 1);
    let first_turn = fleet.wait_for_agent_turn(&first.sandbox_id);
    let before_crash = fleet.wait_for_event(&run_id, "a periodic checkpoint of attempt 1", |e| {
        e.reason == "checkpoint" && e.attempt == 1 && !e.checkpoint_id.is_empty()
    });
    let running = fleet.wait_for_run(&run_id, "the harness session is known", |r| {
        !r.harness_session_id.is_empty()
    });
    assert_eq!(
        state_of(&running),
        Some(RunState::Running),
        "the agent sleeps: {running:?}"
    );
    let newest = fleet.checkpoints(&workspace)[0].clone();
    assert_eq!(
        newest.id, before_crash.checkpoint_id,
        "the event names the newest checkpoint"
    );
    assert_eq!(checkpoint_reason(&newest), pb::CheckpointReason::Interval);

    // The machine dies: host agent, runner and agent, without a word.
    fleet.uncordon("b");
    fleet.host_mut("a").crash();
    fleet.wait_for_host("a", "lost", |h| state_of_host(h) == Some(HostState::Lost));
    let done = fleet.wait_for_state(&run_id, RunState::Succeeded);

    assert_eq!(done.attempts.len(), 2, "{done:?}");
    let (lost, resumed) = (&done.attempts[0], &done.attempts[1]);
    assert!(
        lost.end_reason.contains("host"),
        "attempt 1 ended because its host was lost: {:?}",
        lost.end_reason
    );
    assert_eq!(resumed.host_id, host_b);
    assert!(
        resumed.generation > lost.generation,
        "generation {} after {}",
        resumed.generation,
        lost.generation
    );
    assert_eq!(
        resumed.restored_checkpoint_id, newest.id,
        "attempt 2 restored the last checkpoint before the crash"
    );
    // The run says what the crash cost: attempt 1's work after that
    // checkpoint.
    let events = fleet.events(&run_id);
    let lost_work: Vec<_> = events.iter().filter(|e| e.reason == "work_lost").collect();
    assert_eq!(lost_work.len(), 1, "{events:?}");
    assert_eq!(
        (lost_work[0].attempt, lost_work[0].checkpoint_id.as_str()),
        (2, newest.id.as_str())
    );
    assert!(
        lost_work[0]
            .detail
            .starts_with("attempt 1 ended (host_lost) ")
            && lost_work[0]
                .detail
                .contains(&format!("after checkpoint {}", newest.id)),
        "{}",
        lost_work[0].detail
    );

    let turns = fleet.agent_turns_in(&resumed.sandbox_id);
    assert_eq!(turns.len(), 1, "one turn on b");
    let session = first_turn
        .flag("--session-id")
        .expect("a new conversation on a");
    assert_eq!(
        turns[0].flag("--resume"),
        Some(session),
        "attempt 2 continues the conversation: {:?}",
        turns[0].argv
    );
    let on_b = &turns[0].workspace;
    assert_eq!(
        std::fs::read_to_string(on_b.join("work/before.txt"))
            .ok()
            .as_deref(),
        Some("written before the crash\n"),
        "the committed file on b"
    );
    assert_eq!(
        std::fs::read_to_string(on_b.join("work/draft.txt"))
            .ok()
            .as_deref(),
        Some("drafted before the crash\n"),
        "the untracked file on b"
    );
    assert!(
        git(on_b, &["log", "--format=%s"]).contains("demo agent: work/before.txt"),
        "the commit on b"
    );

    let events = fleet.events(&run_id);
    let shown: Vec<String> = events.iter().map(describe_event).collect();
    let lost_event = events
        .iter()
        .position(|e| e.reason == "host_lost")
        .unwrap_or_else(|| panic!("no host_lost event:\n{}", shown.join("\n")));
    assert_eq!(events[lost_event].attempt, 1, "{}", shown.join("\n"));
    assert!(
        events[lost_event..]
            .iter()
            .any(|e| event_state(e) == Some(RunState::Queued)),
        "the run was queued again after the host was lost:\n{}",
        shown.join("\n")
    );
}

#[test]
fn a_stale_runner_cannot_commit_after_its_run_moved_on() {
    let mut fleet = Fleet::start();
    fleet.start_host("a", HostOptions::default());
    fleet.start_host("b", HostOptions::default());
    fleet.cordon("b");

    let created = fleet.create_run(every_second(fleet.run_request(
        "stale",
        "commit one.txt from attempt one\nask Shall I go on?",
    )));
    let (run_id, workspace) = (created.id.clone(), created.workspace_id.clone());
    let waiting = fleet.wait_for_state(&run_id, RunState::Waiting);
    let old = waiting.attempts[0].clone();
    let old_token = fleet.wait_for(&format!("the run token of {}", old.sandbox_id), || {
        run_token_of(&old.sandbox_id)
    });

    // a dies while its run waits: the run is suspended, not failed.
    fleet.host_mut("a").crash();
    let suspended = fleet.wait_for_state(&run_id, RunState::Suspended);
    assert!(
        suspended.attempts[0].end_reason.contains("host"),
        "{:?}",
        suspended.attempts[0].end_reason
    );
    fleet.uncordon("b");
    fleet
        .answer(&run_id, "commit two.txt from attempt two\nsleep 600")
        .unwrap_or_else(|s| panic!("AnswerRun failed: {s}"));
    let newer = fleet.wait_for_event(&run_id, "a checkpoint of attempt 2", |e| {
        e.reason == "checkpoint" && e.attempt == 2 && !e.checkpoint_id.is_empty()
    });
    let current = fleet.get_run(&run_id).attempts[1].clone();
    assert!(current.generation > old.generation);

    // The old attempt's runner wakes up and commits what it has.
    let tmp = tempdir("stale");
    let stale_root = tmp.path().join("stale");
    write(&stale_root.join("one.txt"), "what the stale runner had\n");
    let client = fleet.coordinator.client_with_token(Some(&old_token));
    let refused = run(client
        .runner()
        .arg("checkpoint")
        .arg("--root")
        .arg(&stale_root)
        .args(["--workspace", &workspace]))
    .assert_exit(1);
    assert!(
        refused.stderr.contains(&format!(
            "attempt {} of run {run_id} is superseded",
            old.number
        )),
        "the refusal says the token's attempt was superseded: {refused}"
    );
    let newest = fleet.checkpoints(&workspace)[0].clone();
    assert_eq!(
        (newest.id.as_str(), newest.generation),
        (newer.checkpoint_id.as_str(), current.generation),
        "the newer attempt's checkpoint stays newest"
    );
    let listed = fleet
        .coordinator
        .client()
        .ctl_json(&["checkpoints", &workspace]);
    assert_eq!(
        ids_with_prefix(&listed, "ck-").first(),
        Some(&newer.checkpoint_id),
        "cairnctl checkpoints: {listed}"
    );

    // Its reports are refused too.
    let superseded = block_on(async {
        let channel = fleet
            .coordinator
            .connect(Some(&old_token))
            .await
            .auth_channel();
        RunnerServiceClient::new(channel)
            .report_progress(pb::ReportProgressRequest {
                phase: pb::AttemptPhase::Running as i32,
                detail: "still here".into(),
                checkpoint_id: String::new(),
            })
            .await
    })
    .expect_err("a superseded attempt's report must be refused");
    assert_eq!(
        superseded.code(),
        tonic::Code::PermissionDenied,
        "{superseded}"
    );
    assert!(
        matches!(
            cairn_proto::refusal::Refusal::of(&superseded),
            Some(cairn_proto::refusal::Refusal::AttemptNotCurrent {
                why: cairn_proto::refusal::NotCurrent::Superseded,
                ..
            })
        ),
        "the refusal's typed reason says superseded: {superseded}"
    );
    assert!(
        superseded.message().contains("superseded"),
        "the refusal says the attempt was superseded: {superseded}"
    );

    // The same command with the current attempt's token is accepted: the
    // refusal above was about the attempt, not the command.
    let current_token = run_token_of(&current.sandbox_id).expect("attempt 2's runner is alive");
    let accepted = fleet
        .coordinator
        .client_with_token(Some(&current_token))
        .checkpoint(&stale_root, &workspace);
    assert_ne!(json_str(&accepted, "checkpoint_id"), newer.checkpoint_id);
    fleet.cancel(&run_id);
}

#[test]
fn sigterm_to_a_runner_checkpoints_before_it_exits_and_cancel_destroys_the_sandbox() {
    let mut fleet = Fleet::start();
    fleet.start_host(
        "a",
        HostOptions {
            slots: 2,
            ..HostOptions::default()
        },
    );
    let terminated = fleet.create_run(fleet.run_request(
        "sigterm",
        "commit kept.txt written before SIGTERM\nsleep 600",
    ));
    let cancelled = fleet.create_run(fleet.run_request(
        "cancel",
        "commit other.txt written before the cancel\nsleep 600",
    ));
    let term_attempt = wait_for_sandbox(&fleet, &terminated.id, 1);
    let cancel_attempt = wait_for_sandbox(&fleet, &cancelled.id, 1);
    fleet.wait_for_agent_turn(&term_attempt.sandbox_id);
    fleet.wait_for_agent_turn(&cancel_attempt.sandbox_id);

    // SIGTERM straight to the runner (not through the host).
    let runner = fleet.wait_for(
        &format!("the runner pid of {}", term_attempt.sandbox_id),
        || fleet.host("a").runner_pid(&term_attempt.sandbox_id),
    );
    let cmdline = process_cmdline(runner);
    assert!(
        cmdline.contains("cairn-runner") && cmdline.contains("run"),
        "pid {runner} is not the sandbox's runner: {cmdline:?}"
    );
    assert!(
        fleet
            .checkpoints(&terminated.workspace_id)
            .iter()
            .all(|c| checkpoint_reason(c) != pb::CheckpointReason::Destroy),
        "no destroy checkpoint before the signal"
    );
    signal(&[runner], "TERM");
    fleet.wait_for("the runner to exit after SIGTERM", || {
        (!is_alive(runner)).then_some(())
    });
    let after_exit = fleet.checkpoints(&terminated.workspace_id);
    let destroy = after_exit
        .iter()
        .find(|c| checkpoint_reason(c) == pb::CheckpointReason::Destroy)
        .unwrap_or_else(|| {
            panic!(
                "the runner exited without a destroy checkpoint; checkpoints: {:?}\n{}",
                after_exit
                    .iter()
                    .map(|c| (c.id.clone(), checkpoint_reason(c)))
                    .collect::<Vec<_>>(),
                fleet.diagnose(&terminated.id)
            )
        });
    assert_eq!(
        destroy.generation, term_attempt.generation,
        "cut by the signalled attempt"
    );
    let (_tmp, checkout) = fleet.checkout(&terminated.workspace_id, &destroy.id);
    assert_eq!(
        std::fs::read_to_string(checkout.join("kept.txt"))
            .ok()
            .as_deref(),
        Some("written before SIGTERM\n"),
        "the destroy checkpoint holds the work"
    );

    // Cancel: cancelled at once, then the sandbox is destroyed (after a
    // destroy checkpoint) and its processes are gone.
    let answer = fleet.cancel(&cancelled.id);
    assert_eq!(state_of(&answer), Some(RunState::Cancelled), "{answer:?}");
    fleet.wait_for_sandbox_gone("a", &cancel_attempt.sandbox_id);
    let run = fleet.get_run(&cancelled.id);
    assert_eq!(state_of(&run), Some(RunState::Cancelled));
    assert_eq!(
        run.attempts.len(),
        1,
        "a cancelled run is not retried: {run:?}"
    );
    assert!(
        fleet
            .checkpoints(&cancelled.workspace_id)
            .iter()
            .any(|c| checkpoint_reason(c) == pb::CheckpointReason::Destroy
                && c.generation == cancel_attempt.generation),
        "cancel destroys through SIGTERM and a destroy checkpoint\n{}",
        fleet.diagnose(&cancelled.id)
    );
    let events = fleet.events(&cancelled.id);
    assert!(
        events.iter().any(|e| e.reason == "cancelled"),
        "{}",
        events
            .iter()
            .map(describe_event)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(sandbox_processes(&cancel_attempt.sandbox_id).is_empty());
}

#[test]
fn a_run_no_host_can_take_stays_queued_and_says_why() {
    let mut fleet = Fleet::start();
    fleet.start_host(
        "cpu",
        HostOptions {
            labels: "pool=cpu".into(),
            ..HostOptions::default()
        },
    );

    let mut request = fleet.run_request("gpu", "commit never.txt should not run");
    request.labels = [("gpu".to_owned(), "a100".to_owned())].into();
    let gpu = fleet.create_run(request);
    let queued = fleet.wait_for_run(&gpu.id, "a reason naming gpu=a100", |r| {
        r.state_reason.contains("gpu=a100")
    });
    assert_eq!(state_of(&queued), Some(RunState::Queued), "{queued:?}");

    // Busy the only cpu host; the next cpu run waits for its slot.
    let mut busy = fleet.run_request("busy", "sleep 600");
    busy.labels = [("pool".to_owned(), "cpu".to_owned())].into();
    let busy = fleet.create_run(busy);
    let busy_attempt = wait_for_sandbox(&fleet, &busy.id, 1);
    let mut next = fleet.run_request("next", "commit next.txt ran once the slot was free");
    next.labels = [("pool".to_owned(), "cpu".to_owned())].into();
    let next = fleet.create_run(next);
    let full = fleet.wait_for_run(&next.id, "a reason saying the host is full", |r| {
        r.state_reason.contains("full")
    });
    assert_eq!(state_of(&full), Some(RunState::Queued), "{full:?}");

    // Many scheduler passes and heartbeats later, nothing has changed for gpu.
    let beats = fleet.host_info("cpu").last_heartbeat_at;
    fleet.wait_for_host("cpu", "heartbeat again", |h| h.last_heartbeat_at != beats);
    std::thread::sleep(Duration::from_secs(2));
    let still = fleet.get_run(&gpu.id);
    assert_eq!(state_of(&still), Some(RunState::Queued), "{still:?}");
    assert!(still.attempts.is_empty(), "{still:?}");
    assert!(still.state_reason.contains("gpu=a100"), "{still:?}");
    let events = fleet.events(&gpu.id);
    assert!(
        events
            .iter()
            .any(|e| e.detail.contains("gpu=a100") || e.reason.contains("gpu=a100")),
        "the reason is an event too:\n{}",
        events
            .iter()
            .map(describe_event)
            .collect::<Vec<_>>()
            .join("\n")
    );

    // What a user sees.
    let client = fleet.coordinator.client();
    let shown = client.ctl_json(&["runs", "show", &gpu.id]);
    let text = shown.to_string();
    assert!(
        text.contains("\"queued\"") && text.contains("gpu=a100"),
        "cairnctl runs show --output json must say queued and why: {shown}"
    );
    let table = run(client.ctl().args(["runs", "show", &gpu.id])).assert_success();
    assert!(
        table.stdout.contains("queued") && table.stdout.contains("gpu=a100"),
        "{table}"
    );

    // The slot frees up: the waiting cpu run goes next; the gpu run still waits.
    fleet.cancel(&busy.id);
    fleet.wait_for_sandbox_gone("cpu", &busy_attempt.sandbox_id);
    fleet.wait_for_state(&next.id, RunState::Succeeded);
    assert_eq!(state_of(&fleet.get_run(&gpu.id)), Some(RunState::Queued));
    let cancelled = fleet.cancel(&gpu.id);
    assert_eq!(
        state_of(&cancelled),
        Some(RunState::Cancelled),
        "a queued run is cancelled at once"
    );
}

#[test]
fn the_next_run_of_a_workspace_goes_to_the_host_that_kept_its_tree_and_starts_on_it() {
    let mut fleet = Fleet::start();
    let host_a = fleet
        .start_host(
            "a",
            HostOptions {
                slots: 2,
                ..HostOptions::default()
            },
        )
        .id
        .clone();
    fleet.start_host("b", HostOptions::default());
    fleet.cordon("b");

    let first = fleet.create_run(fleet.run_request(
        "kept",
        "commit work/one.txt written by the first run\n\
         untracked work/draft.txt drafted by the first run",
    ));
    let first = fleet.wait_for_state(&first.id, RunState::Succeeded);
    let workspace = first.workspace_id.clone();
    fleet.wait_for_sandbox_gone("a", &first.attempts[0].sandbox_id);
    let kept = fleet.host("a").data_dir().join("kept").join(&workspace);
    assert!(
        kept.join("kept.json").is_file() && kept.join("workspace/work/one.txt").is_file(),
        "the host kept the first sandbox's tree in {}",
        kept.display()
    );
    // What happened to the tree after its last checkpoint must not come back.
    write(
        &kept.join("workspace/work/draft.txt"),
        "changed after the checkpoint\n",
    );
    write(&kept.join("workspace/stray.txt"), "never checkpointed\n");
    // a is now busier than b: by load alone, the next run would go to b.
    let busy = fleet.create_run(fleet.run_request("busy", "sleep 600"));
    let busy_attempt = wait_for_sandbox(&fleet, &busy.id, 1);
    assert_eq!(busy_attempt.host_id, host_a);
    fleet.uncordon("b");
    // The coordinator hears of the kept tree in a's heartbeats.
    fleet.wait_for_host("a", "listing the kept workspace", |h| {
        h.kept_workspaces == [workspace.clone()]
    });

    let second = fleet.create_run(on_workspace(
        fleet.run_request("", "untracked work/two.txt written by the second run"),
        &workspace,
    ));
    let second = fleet.wait_for_state(&second.id, RunState::Succeeded);
    assert_eq!(
        second.attempts[0].host_id, host_a,
        "the run went to the host that keeps its workspace's tree"
    );
    let restored = fleet
        .events(&second.id)
        .into_iter()
        .find(|e| e.reason == "restored")
        .unwrap_or_else(|| panic!("no restored event: {second:?}"));
    let reused: u64 = restored
        .detail
        .split("reused ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no reuse count in {:?}", restored.detail));
    assert!(
        reused >= 2,
        "the restore kept the files of the kept tree it could vouch for: {}",
        restored.detail
    );
    assert!(
        restored.detail.contains("removed 1 stale entries"),
        "the file the checkpoint lacks was removed: {}",
        restored.detail
    );

    let turns = fleet.agent_turns_in(&second.attempts[0].sandbox_id);
    assert_eq!(turns.len(), 1, "one turn in the second run");
    let seen = &turns[0].workspace;
    assert_eq!(
        std::fs::read_to_string(seen.join("work/one.txt")).unwrap(),
        "written by the first run\n"
    );
    assert_eq!(
        std::fs::read_to_string(seen.join("work/draft.txt")).unwrap(),
        "drafted by the first run\n",
        "the checkpoint's content, not the kept tree's later change"
    );
    assert!(
        !seen.join("stray.txt").exists(),
        "the stray file was removed"
    );
    assert!(
        git(seen, &["log", "--format=%s"]).contains("demo agent: work/one.txt"),
        "the commit is there"
    );

    // The second run's tree replaced the first one's.
    fleet.wait_for_sandbox_gone("a", &second.attempts[0].sandbox_id);
    assert_eq!(
        std::fs::read_to_string(kept.join("workspace/work/two.txt")).unwrap(),
        "written by the second run\n"
    );
    fleet.cancel(&busy.id);
}

#[test]
fn a_running_attempt_shows_the_work_no_checkpoint_holds_yet() {
    let mut fleet = Fleet::start();
    fleet.start_host("a", HostOptions::default());
    let first = fleet
        .create_run(fleet.run_request("unsaved", "commit work/one.txt written by the first run"));
    let first = fleet.wait_for_state(&first.id, RunState::Succeeded);

    // The second run restores the first's checkpoint, writes a file and
    // works on; no checkpoint comes before its turn ends (the interval is
    // ten minutes).
    let draft = "thirteen bytes\n";
    let second = fleet.create_run(on_workspace(
        fleet.run_request("", "untracked work/draft.txt thirteen bytes\nsleep 600"),
        &first.workspace_id,
    ));
    let reported = fleet.wait_for_run(&second.id, "the runner reports unsaved work", |run| {
        run.attempts
            .last()
            .and_then(|a| a.unsaved)
            .is_some_and(|u| u.files > 0)
    });
    let unsaved = reported.attempts[0].unsaved.expect("just seen");
    assert!(unsaved.complete, "{unsaved:?}");
    // The draft, and whatever the agent wrote of its own transcript.
    assert!(
        unsaved.bytes >= draft.len() as u64,
        "the draft's bytes are counted: {unsaved:?}"
    );
    assert!(unsaved.reported_at.is_some());
    let draft_at = fleet
        .host("a")
        .sandbox_dir(&reported.attempts[0].sandbox_id);
    assert_eq!(
        std::fs::read_to_string(draft_at.join("workspace/work/draft.txt")).unwrap(),
        draft
    );
    // cairnctl shows it: AT RISK in the list, a line in show, and JSON.
    let client = fleet.coordinator.client();
    let shown = run(client.ctl().args(["runs", "show", &second.id])).assert_success();
    let at_risk = shown
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("at risk "))
        .map(str::trim)
        .unwrap_or_default()
        .to_owned();
    assert!(
        at_risk.contains(" in no checkpoint (counted ") && at_risk.contains("file"),
        "{}",
        shown.stdout
    );
    let listed = run(client.ctl().args(["runs", "list"])).assert_success();
    assert!(
        listed.stdout.lines().next().unwrap().contains("AT RISK"),
        "{}",
        listed.stdout
    );
    let json = client.ctl_json(&["runs", "show", &second.id]);
    assert_eq!(json["attempts"][0]["unsaved"]["complete"], true, "{json}");
    assert!(json["attempts"][0]["unsaved"]["bytes"].as_u64().unwrap() >= draft.len() as u64);

    // Cancelling checkpoints the workspace: nothing is unsaved any more.
    fleet.cancel(&second.id);
    fleet.wait_for_run(
        &second.id,
        "the destroy checkpoint clears the unsaved work",
        |run| {
            run.attempts[0]
                .unsaved
                .is_some_and(|u| (u.files, u.bytes) == (0, 0))
        },
    );
    let newest = fleet.checkpoints(&first.workspace_id)[0].clone();
    let (_tmp, checkout) = fleet.checkout(&first.workspace_id, &newest.id);
    assert_eq!(
        std::fs::read_to_string(checkout.join("work/draft.txt")).unwrap(),
        draft,
        "the destroy checkpoint holds what was unsaved"
    );
    // A checkout of it warns once it is older than asked.
    std::thread::sleep(Duration::from_millis(1100));
    let dest = tempdir("old-checkout");
    let checkout = run(client.ctl().args([
        "checkout",
        &first.workspace_id,
        &dest.path().join("tree").display().to_string(),
        "--warn-older-than",
        "1s",
    ]))
    .assert_success();
    assert!(
        checkout.stderr.contains("warning: the restored checkpoint"),
        "{}",
        checkout.stderr
    );
}
