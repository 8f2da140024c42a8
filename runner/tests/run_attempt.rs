//! The run state machine (`cairn_runner::run::run`) against a fake
//! RunnerService served over real gRPC (it honours the proto contract and
//! records every call) and a store that snapshots the workspace at every
//! checkpoint and restores snapshots — with the real demo agent as the
//! harness, through the `claude` adapter (and once through `command`).

mod attempt_support;

use std::fs;
use std::time::Duration;

use attempt_support::*;
use cairn_proto::domain::CheckpointReason;
use cairn_proto::pb::{self, AttemptPhase};
use cairn_runner::run::{self, Finished};
use cairn_utils::process::read_stat;
use sha2::Digest as _;
use tokio_util::sync::CancellationToken;

const RUNNER: &str = env!("CARGO_BIN_EXE_cairn-runner");

impl Harnessed {
    /// A sandbox for the `claude` adapter, with its credentials at ~/.claude.
    fn claude_sandbox() -> Self {
        Self::new(
            "home/.claude",
            ".credentials.json",
            "{\"secret\":\"do not checkpoint\"}",
        )
    }

    /// The `claude` adapter running the demo agent.
    fn claude(&self) -> pb::HarnessSpec {
        self.harness("claude", &demo_agent_binary())
    }

    /// Runs one attempt to its end, with no SIGTERM on the way.
    async fn run_to_end(&self) -> Finished {
        self.run(CancellationToken::new()).await.unwrap()
    }
}

const PROMPT: &str = "The codeword is PELICAN.\n\
                      commit notes.md first line\n\
                      edit notes.md second line\n\
                      untracked scratch.txt draft\n\
                      ask Which colour should the button be?";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_asks_waits_and_resumes_the_same_conversation_with_the_answer() {
    let h = Harnessed::claude_sandbox();
    git2::Repository::init(h.root.join("app")).unwrap();
    h.next(h.attempt(1, PROMPT, h.claude()));
    h.answer(vec![input(2, "answer", "Blue.\nrecall codeword")]);

    let finished = h.run_to_end().await;
    assert_eq!(finished, Finished::Succeeded);

    let calls = h.fake.calls();
    assert_eq!(calls[0], Call::Claim);
    assert_eq!(
        h.fake.details(AttemptPhase::Preparing),
        ["workspace has no checkpoint: started empty"]
    );
    let sessions = h.fake.sessions();
    assert_eq!(
        sessions.len(),
        1,
        "one conversation, reported once: {calls:#?}"
    );
    let session = &sessions[0];

    // The turn ended in a question: a pause checkpoint holding the work, then waiting.
    let committed = h.store.committed();
    assert_eq!(
        h.store.reasons(),
        [CheckpointReason::Pause, CheckpointReason::End]
    );
    let pause = &committed[0];
    assert_eq!(pause.session.as_ref(), Some(session));
    assert_eq!(
        pause.text("app/notes.md").as_deref(),
        Some("first line\nsecond line\n")
    );
    assert_eq!(pause.text("app/scratch.txt").as_deref(), Some("draft\n"));
    assert!(
        pause
            .files
            .keys()
            .any(|p| p.starts_with(".cairn/state/claude/projects/")
                && p.ends_with(&format!("{session}.jsonl")))
    );
    assert!(
        !pause
            .files
            .contains_key(".cairn/state/claude/.credentials.json"),
        "credentials are never checkpointed"
    );
    assert!(
        h.root
            .join(".cairn/state/claude/.credentials.json")
            .exists(),
        "but they were copied in for the harness"
    );
    assert!(
        !pause.files.contains_key(".cairn/outcome.json"),
        "the outcome file was read and removed"
    );
    let waiting = calls
        .iter()
        .find_map(|c| match c {
            Call::Waiting {
                question,
                checkpoint,
                consumed,
            } => Some((question.clone(), checkpoint.clone(), consumed.clone())),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        waiting,
        (
            "Which colour should the button be?".to_owned(),
            pause.id.clone(),
            vec![1]
        )
    );
    let checkpointed = h.fake.progress(AttemptPhase::Checkpointed);
    assert!(
        matches!(&checkpointed[0], Call::Progress { checkpoint, .. } if *checkpoint == pause.id)
    );

    // The answer went to the same conversation (--resume), which remembered turn one.
    let running = h.fake.details(AttemptPhase::Running);
    assert!(
        running
            .iter()
            .any(|d| *d == format!("answered; resuming conversation {session}")),
        "{running:#?}"
    );
    assert!(
        running
            .iter()
            .any(|d| d.starts_with(&format!("claude resumed conversation {session} in "))),
        "{running:#?}"
    );
    let outcome = h.fake.outcome();
    assert_eq!(outcome.outcome, pb::Outcome::Succeeded as i32);
    assert_eq!(outcome.summary, "the codeword was PELICAN");
    assert_eq!(outcome.checkpoint_id, committed[1].id, "the end checkpoint");
    assert_eq!(outcome.consumed_inputs, [1, 2]);
    assert!(
        matches!(calls.last(), Some(Call::Outcome(_))),
        "the outcome is the last word"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_waiting_cuts_a_destroy_checkpoint_and_reports_interrupted() {
    let h = Harnessed::claude_sandbox();
    h.next(h.attempt(1, PROMPT, h.claude()));
    let shutdown = stop_once_waiting(&h.fake);

    let finished = h.run(shutdown).await.unwrap();
    assert_eq!(finished, Finished::Interrupted);
    assert_eq!(
        h.store.reasons(),
        [CheckpointReason::Pause, CheckpointReason::Destroy]
    );
    let outcome = h.fake.outcome();
    assert_eq!(outcome.outcome, pb::Outcome::Interrupted as i32);
    assert_eq!(outcome.checkpoint_id, h.store.committed()[1].id);
    assert_eq!(outcome.consumed_inputs, [1], "the prompt was heard");
    assert_eq!(outcome.error, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_turn_stops_the_harness_then_checkpoints() {
    let h = Harnessed::claude_sandbox();
    h.next(h.attempt(
        1,
        "edit work.txt half done\nsleep 120\nedit work.txt never written",
        h.claude(),
    ));
    let shutdown = CancellationToken::new();
    let stopper = shutdown.clone();
    let work = h.root.join("work.txt");
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + LIMIT;
        while !work.exists() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stopper.cancel();
    });

    let finished = h.run(shutdown).await.unwrap();
    assert_eq!(finished, Finished::Interrupted);
    assert_eq!(h.store.reasons(), [CheckpointReason::Destroy]);
    let destroy = &h.store.committed()[0];
    assert_eq!(
        destroy.text("work.txt").as_deref(),
        Some("half done\n"),
        "the agent was stopped mid-sleep"
    );
    assert_eq!(h.fake.outcome().outcome, pb::Outcome::Interrupted as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_run_resumes_after_a_restore_and_recalls_the_first_turn() {
    let h = Harnessed::claude_sandbox();
    git2::Repository::init(h.root.join("app")).unwrap();
    h.next(h.attempt(1, PROMPT, h.claude()));
    let shutdown = stop_once_waiting(&h.fake);
    assert_eq!(h.run(shutdown).await.unwrap(), Finished::Interrupted);
    let session = h.fake.sessions().pop().unwrap();

    // The sandbox is gone; the next attempt restores the newest checkpoint at the same path.
    fs::remove_dir_all(&h.root).unwrap();
    let mut second = h.attempt(2, PROMPT, h.claude());
    second.inputs = vec![input(2, "answer", "Blue.\nrecall codeword")];
    second.resume_session_id = session.clone();
    second.prompt_delivered = true;
    second.question = "Which colour should the button be?".into();
    h.next(second);

    assert_eq!(h.run_to_end().await, Finished::Succeeded);
    assert_eq!(
        h.fake.progress(AttemptPhase::Restoring),
        [Call::Progress {
            phase: AttemptPhase::Restoring,
            detail: format!("restored checkpoint {}", checkpoint_id(2)),
            checkpoint: checkpoint_id(2),
        }]
    );
    assert_eq!(h.fake.sessions(), [session], "the same conversation");
    let outcome = h.fake.outcome();
    assert_eq!(outcome.summary, "the codeword was PELICAN");
    assert_eq!(outcome.consumed_inputs, [2]);
    let end = h.store.committed().pop().unwrap();
    assert_eq!(end.reason, CheckpointReason::End);
    assert_eq!(
        end.text("app/notes.md").as_deref(),
        Some("first line\nsecond line\n"),
        "the work came along"
    );
    assert_eq!(h.store.targets_generations(), [1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_conversation_is_replaced_by_a_briefed_one() {
    let h = Harnessed::claude_sandbox();
    let gone = "0f0e0d0c-0b0a-4908-8706-050403020100";
    let mut spec = h.attempt(2, "The codeword is HERON. Build the thing.", h.claude());
    spec.inputs = vec![input(7, "answer", "recall codeword")];
    spec.resume_session_id = gone.into();
    spec.prompt_delivered = true;
    spec.question = "What should I remember?".into();
    h.next(spec);

    assert_eq!(h.run_to_end().await, Finished::Succeeded);
    let running = h.fake.details(AttemptPhase::Running);
    assert!(
        running.contains(&format!(
            "claude has no conversation {gone} any more; started a new conversation with a handoff briefing (lossy handoff)"
        )),
        "{running:#?}"
    );
    let sessions = h.fake.sessions();
    assert_eq!(sessions.len(), 1);
    assert_ne!(sessions[0], gone, "a new conversation");
    let outcome = h.fake.outcome();
    // The briefing carried the task, so even the new conversation knows the codeword.
    assert_eq!(outcome.summary, "the codeword was HERON");
    assert_eq!(outcome.consumed_inputs, [7]);

    let transcript = h
        .store
        .committed()
        .pop()
        .unwrap()
        .files
        .into_iter()
        .find(|(p, _)| p.ends_with(&format!("{}.jsonl", sessions[0])))
        .map(|(_, c)| String::from_utf8(c).unwrap())
        .unwrap();
    let first: serde_json::Value =
        serde_json::from_str(transcript.lines().next().unwrap()).unwrap();
    let briefing = first["message"]["content"].as_str().unwrap();
    assert!(
        briefing.starts_with("lossy handoff: the earlier conversation could not be resumed"),
        "{briefing}"
    );
    assert!(
        briefing.contains("The question you asked:\nWhat should I remember?"),
        "{briefing}"
    );
    assert!(
        briefing.contains("The answer:\nrecall codeword"),
        "{briefing}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_checkpoints_are_cut_only_when_something_changed() {
    let h = Harnessed::claude_sandbox();
    let mut spec = h.attempt(
        1,
        "edit a.txt one\nsleep 3\nedit a.txt two\nsleep 3",
        h.claude(),
    );
    spec.checkpoint_interval = Some(cairn_proto::runs::to_proto_duration(Duration::from_millis(
        250,
    )));
    h.next(spec);

    assert_eq!(h.run_to_end().await, Finished::Succeeded);
    let committed = h.store.committed();
    let intervals: Vec<&Snapshot> = committed
        .iter()
        .filter(|s| s.reason == CheckpointReason::Interval)
        .collect();
    assert!(
        !intervals.is_empty(),
        "six seconds of work span several intervals"
    );
    for pair in committed
        .windows(2)
        .filter(|w| w[1].reason == CheckpointReason::Interval)
    {
        assert_ne!(
            pair[0].files, pair[1].files,
            "an interval checkpoint is cut only after a change"
        );
    }
    assert!(
        h.store.state.lock().unwrap().skipped > 0,
        "unchanged intervals were skipped"
    );
    assert_eq!(committed.last().unwrap().reason, CheckpointReason::End);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_asks_the_runner_for_checkpoints_through_its_socket() {
    let h = Harnessed::claude_sandbox();
    let answers = h.root.with_file_name("asked.json");
    let prompt = format!(
        "edit a.txt one\n\
         run {RUNNER} checkpoint --output json > {answers}\n\
         run {RUNNER} checkpoint --if-changed\n\
         run {RUNNER} checkpoint --workspace someone-else",
        answers = answers.display()
    );
    h.next(h.attempt(1, &prompt, h.claude()));

    assert_eq!(h.run_to_end().await, Finished::Succeeded);
    let committed = h.store.committed();
    assert_eq!(
        committed.iter().map(|s| s.reason).collect::<Vec<_>>(),
        [CheckpointReason::Manual, CheckpointReason::End],
        "the agent's checkpoint, then the run's own; the unchanged one commits nothing"
    );
    assert!(
        committed[0].files.contains_key("a.txt"),
        "cut after the edit"
    );
    let asked: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&answers).unwrap()).unwrap();
    assert_eq!(asked["checkpoint_id"], committed[0].id.as_str(), "{asked}");
    assert_eq!(asked["reason"], "manual", "{asked}");
    assert!(
        h.fake.progress(AttemptPhase::Checkpointed).iter().any(
            |c| matches!(c, Call::Progress { checkpoint, .. } if *checkpoint == committed[0].id)
        ),
        "the run's timeline shows the agent's checkpoint"
    );
    let summary = h.fake.outcome().summary;
    assert!(
        summary.contains(&format!(
            "unchanged since checkpoint {}: nothing committed",
            committed[0].id
        )),
        "{summary}"
    );
    assert!(
        summary.contains("which exited with status 1")
            && summary.contains(&format!(
                "this run checkpoints workspace {WORKSPACE_ID}, not someone-else"
            )),
        "another workspace is refused, naming both: {summary}"
    );
    assert!(
        !h.control_socket().exists(),
        "the socket is gone with the attempt"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_attempt_stops_without_another_write() {
    let h = Harnessed::claude_sandbox();
    h.next(h.attempt(1, "edit a.txt one\nask Anything?", h.claude()));
    h.store.state.lock().unwrap().fenced = true;

    let err = h.run(CancellationToken::new()).await.unwrap_err();
    assert!(matches!(err, run::RunError::Superseded(_)), "{err}");
    assert!(err.to_string().contains("generation 1 is older"), "{err}");
    assert!(h.store.committed().is_empty());
    assert!(
        !h.fake
            .calls()
            .iter()
            .any(|c| matches!(c, Call::Waiting { .. } | Call::Outcome(_))),
        "nothing reported after the refusal"
    );

    let h = Harnessed::claude_sandbox();
    h.next(h.attempt(1, "edit a.txt one", h.claude()));
    h.fake.0.lock().unwrap().superseded = true;
    let err = h.run(CancellationToken::new()).await.unwrap_err();
    assert!(
        err.to_string().contains("was superseded by attempt 2"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_adapter_drives_a_templated_harness_through_a_question() {
    let h = Harnessed::claude_sandbox();
    let state = h
        .root
        .join(".cairn/state/demo")
        .to_string_lossy()
        .into_owned();
    let demo = demo_agent_binary();
    let command = pb::HarnessSpec {
        name: "command".into(),
        config: [
            ("start".to_owned(), format!("env CLAUDE_CONFIG_DIR={state} {demo} -p --output-format stream-json --verbose {{message}}")),
            ("resume".to_owned(), format!("env CLAUDE_CONFIG_DIR={state} {demo} -p --output-format stream-json --verbose --resume {{session_id}} {{message}}")),
            ("session_regex".to_owned(), r#""session_id":"(?P<id>[0-9a-f-]{36})""#.to_owned()),
        ]
        .into(),
    };
    h.next(h.attempt(1, PROMPT, command));
    h.answer(vec![input(2, "answer", "recall codeword")]);

    assert_eq!(h.run_to_end().await, Finished::Succeeded);
    let sessions = h.fake.sessions();
    assert_eq!(sessions.len(), 1, "the regex found the conversation once");
    assert!(sessions.iter().all(|s| s.len() == 36));
    let summary = h.fake.outcome().summary;
    assert!(
        summary.starts_with(r#"{"duration_api_ms""#),
        "the last line of stdout: {summary}"
    );
    assert!(
        summary.contains(r#""result":"the codeword was PELICAN""#),
        "{summary}"
    );
    assert_eq!(
        h.store.reasons(),
        [CheckpointReason::Pause, CheckpointReason::End]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspace_services_start_before_the_agent_and_stop_after_it() {
    let h = Harnessed::claude_sandbox();
    fs::create_dir_all(h.root.join(".cairn")).unwrap();
    fs::write(
        h.root.join(".cairn/services.toml"),
        r#"
[[service]]
name = "sleeper"
command = "sh -c 'echo $$ > sleeper.pid; exec sleep 600'"
health = { command = "test -s sleeper.pid", interval = "50ms" }
"#,
    )
    .unwrap();
    h.next(h.attempt(1, "edit a.txt one", h.claude()));
    assert_eq!(h.run_to_end().await, Finished::Succeeded);
    let preparing = h.fake.details(AttemptPhase::Preparing);
    assert!(
        preparing
            .iter()
            .any(|d| d.starts_with("service sleeper: healthy after ")),
        "{preparing:#?}"
    );
    let pid: i32 = fs::read_to_string(h.root.join("sleeper.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let alive = read_stat(pid).is_some_and(|s| !s.is_zombie());
    assert!(!alive, "the service outlived its attempt");
    let end = h.store.committed().pop().unwrap();
    assert!(end.files.contains_key(".cairn/services.toml"));
    assert!(
        !end.files.keys().any(|p| p.starts_with(".cairn/logs/")),
        "service logs are not checkpointed: {:?}",
        end.files.keys().collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_harness_fails_the_run_with_its_reason() {
    let h = Harnessed::claude_sandbox();
    h.next(h.attempt(
        1,
        "edit a.txt one\nfail the licence server is down",
        h.claude(),
    ));
    assert_eq!(h.run_to_end().await, Finished::Failed);
    let outcome = h.fake.outcome();
    assert_eq!(outcome.outcome, pb::Outcome::Failed as i32);
    assert_eq!(outcome.error, "the licence server is down");
    assert_eq!(
        h.store.reasons(),
        [CheckpointReason::End],
        "the work so far is kept"
    );

    let h = Harnessed::claude_sandbox();
    let mut missing = h.claude();
    missing
        .config
        .insert("binary".into(), "/nonexistent/claude".into());
    h.next(h.attempt(1, "hello", missing));
    assert_eq!(h.run_to_end().await, Finished::Failed);
    assert!(
        h.fake
            .outcome()
            .error
            .starts_with("cannot start \"/nonexistent/claude\": "),
        "{}",
        h.fake.outcome().error
    );

    let h = Harnessed::claude_sandbox();
    h.next(h.attempt(
        1,
        "hello",
        pb::HarnessSpec {
            name: "nonesuch".into(),
            config: Default::default(),
        },
    ));
    assert_eq!(h.run_to_end().await, Finished::Failed);
    let error = h.fake.outcome().error;
    assert!(
        error.starts_with("unknown harness \"nonesuch\" (this runner has: claude, codex, "),
        "{error}"
    );
    assert_eq!(
        h.store.state.lock().unwrap().restores,
        0,
        "nothing was restored for a run that cannot start"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_station_clears_leftovers_lays_its_files_is_briefed_and_ends_with_a_note() {
    let h = Harnessed::claude_sandbox();
    git2::Repository::init(h.root.join("app")).unwrap();
    // What station implement left: a skill it laid, and an outcome file.
    let implement_skill = ".cairn/state/claude/skills/implement/SKILL.md";
    fs::create_dir_all(h.root.join(".cairn/state/claude/skills/implement")).unwrap();
    fs::write(h.root.join(implement_skill), "# implement\n").unwrap();
    fs::write(
        h.root.join(".cairn/laid.json"),
        format!(
            r#"{{"station":"implement","run_id":"run-0","files":[{{"path":"{implement_skill}","sha256":"{}"}}]}}"#,
            hex::encode(sha2::Sha256::digest(b"# implement\n"))
        ),
    )
    .unwrap();
    fs::write(h.root.join(".cairn/outcome.json"), r#"{"status":"done"}"#).unwrap();

    let review_skill = ".cairn/state/claude/skills/review/SKILL.md";
    let mut spec = h.attempt(1, "Review it.\ncommit review.md looks good", h.claude());
    spec.station = "review".into();
    spec.lay = [(review_skill.to_owned(), b"# review\n".to_vec())].into();
    spec.notes = vec![pb::HandoffNote {
        run_id: "run-0".into(),
        station: "implement".into(),
        attempt: 1,
        outcome: "succeeded".into(),
        text: Some(pb::HandoffText {
            summary: "Implemented the feature.".into(),
            next: "review the feature".into(),
            ..Default::default()
        }),
        ..Default::default()
    }];
    h.next(spec);

    assert_eq!(h.run_to_end().await, Finished::Succeeded);
    assert_eq!(
        h.fake.details(AttemptPhase::Preparing),
        [
            "workspace has no checkpoint: started empty".to_owned(),
            "cleared 1 file laid by station implement, an outcome file left by an earlier agent"
                .to_owned(),
            format!("laid 1 file for station review: {review_skill}"),
        ]
    );
    let end = h.store.committed().pop().unwrap();
    assert!(!end.files.contains_key(implement_skill));
    assert_eq!(end.text(review_skill).as_deref(), Some("# review\n"));
    let laid = end.text(".cairn/laid.json").unwrap();
    assert!(laid.contains("\"station\": \"review\""), "{laid}");
    // The new conversation's first message was the handover briefing.
    let transcript = end
        .files
        .iter()
        .find(|(p, _)| p.starts_with(".cairn/state/claude/projects/") && p.ends_with(".jsonl"))
        .map(|(_, c)| String::from_utf8_lossy(c).into_owned())
        .expect("a transcript");
    assert!(
        transcript.contains(
            "Handover from station implement: this is the first conversation at station review."
        ) && transcript.contains("next: review the feature"),
        "{transcript}"
    );

    // The note: the agent wrote none, so the runner composed it.
    let note = h.fake.outcome().handoff.expect("a handoff note");
    assert!(
        note.changed.starts_with("app: 1 new commit (")
            && note.changed.contains("demo agent: review.md"),
        "{note:?}"
    );
    assert!(note.changed.ends_with("; nothing uncommitted"), "{note:?}");
    assert_eq!(note.next, "not stated");
    assert_eq!(note.composed, ["changed", "checked", "uncertain", "next"]);
    assert_eq!(note.summary, h.fake.outcome().summary);
}
