//! A run that asks a person: the hold, suspension, and the answer — either
//! to the same held sandbox, or (once suspended) to a new attempt on another
//! host that restores the workspace and resumes the same conversation.
//!
//! The agent is `cairn-demo-agent` as harness `claude`, started through the
//! harness's recording script (see `cairn_e2e::fleet`), so each test sees the
//! flags the runner gave it and the workspace it found on the host it ran on.

use std::fs;
use std::time::Duration;

use cairn_e2e::fleet::{
    Fleet, HostOptions, checkpoint_reason, codeword, describe_event, event_state, git_status,
    sandbox_processes, state_of,
};
use cairn_e2e::git;
use cairn_proto::pb;
use cairn_proto::runs::{AttemptState, RunState, to_proto_duration};

const QUESTION: &str = "Which colour should the button be?";

/// Long enough to look at the held sandbox, short enough to wait out.
const SHORT_HOLD: Duration = Duration::from_secs(6);

/// The first turn: commit, leave a change and an untracked file, write a
/// credentials file the way a logged-in Claude Code would, say a codeword,
/// ask.
fn first_turn(codeword: &str) -> String {
    format!(
        "The codeword is {codeword}.\n\
         commit notes/plan.md first plan\n\
         edit notes/plan.md second thought, not committed\n\
         untracked scratch/todo.txt buy milk\n\
         untracked .cairn/state/claude/.credentials.json {{\"secret\":\"never-checkpoint-me\"}}\n\
         ask {QUESTION}"
    )
}

/// What the first turn leaves in a workspace, seen through git and the files.
#[track_caller]
fn assert_first_turn_work(root: &std::path::Path, seen_as: &str) {
    let log = git(root, &["log", "--format=%s"]);
    assert!(
        log.contains("demo agent: notes/plan.md"),
        "{seen_as}: the commit is missing from git log: {log:?}"
    );
    let status = git_status(root);
    assert_eq!(
        status,
        vec![
            " M notes/plan.md".to_owned(),
            "?? scratch/todo.txt".to_owned()
        ],
        "{seen_as}: git status (uncommitted change + untracked file expected)"
    );
    assert_eq!(
        fs::read_to_string(root.join("notes/plan.md")).unwrap(),
        "first plan\nsecond thought, not committed\n",
        "{seen_as}: notes/plan.md"
    );
    assert_eq!(
        fs::read_to_string(root.join("scratch/todo.txt")).unwrap(),
        "buy milk\n",
        "{seen_as}: scratch/todo.txt"
    );
}

#[test]
fn hold_expiry_suspends_and_the_answer_resumes_the_conversation_on_another_host() {
    let mut fleet = Fleet::start();
    let host_a = fleet.start_host("a", HostOptions::default()).id.clone();
    let host_b = fleet.start_host("b", HostOptions::default()).id.clone();
    // The first attempt must land on a.
    fleet.cordon("b");

    let word = codeword("PELICAN");
    let mut request = fleet.run_request("held", &first_turn(&word));
    request.hold = Some(to_proto_duration(SHORT_HOLD));
    let created = fleet.create_run(request);
    let run_id = created.id.clone();
    let workspace = created.workspace_id.clone();

    // 1. The agent works, asks, and the run waits with its sandbox held.
    let waiting = fleet.wait_for_state(&run_id, RunState::Waiting);
    assert_eq!(waiting.question, QUESTION, "{waiting:?}");
    assert!(
        waiting.hold_until.is_some(),
        "a waiting run says until when it is held: {waiting:?}"
    );
    assert_eq!(waiting.attempts.len(), 1, "{waiting:?}");
    let first = waiting.attempts[0].clone();
    assert_eq!(first.host_id, host_a, "the first attempt ran on a");
    let sandbox_a = first.sandbox_id.clone();
    assert!(sandbox_a.starts_with("sbx-"), "sandbox id {sandbox_a:?}");
    assert!(
        fleet
            .host("a")
            .sandbox_dir(&sandbox_a)
            .join("workspace")
            .is_dir(),
        "the held sandbox's directory exists on a ({})",
        fleet.host("a").sandbox_dir(&sandbox_a).display()
    );
    assert!(
        !sandbox_processes(&sandbox_a).is_empty(),
        "the held sandbox's runner is alive while the run waits"
    );
    let pause = fleet.checkpoints(&workspace);
    assert_eq!(
        pause.first().map(|c| (c.id.as_str(), checkpoint_reason(c))),
        Some((
            waiting.last_checkpoint_id.as_str(),
            pb::CheckpointReason::Pause
        )),
        "the run's last checkpoint is the pause checkpoint cut before waiting"
    );

    // 2. The hold expires: the sandbox is destroyed, then the run is suspended.
    let suspended = fleet.wait_for_state(&run_id, RunState::Suspended);
    assert!(
        !fleet.host("a").sandbox_dir(&sandbox_a).exists(),
        "the sandbox directory outlived the hold: {}",
        fleet.host("a").sandbox_dir(&sandbox_a).display()
    );
    assert_eq!(
        sandbox_processes(&sandbox_a),
        Vec::<u32>::new(),
        "processes of the released sandbox are still running"
    );
    let ended = &suspended.attempts[0];
    assert_eq!(
        AttemptState::try_from(ended.state).ok(),
        Some(AttemptState::Ended),
        "{suspended:?}"
    );
    assert!(
        ended.end_reason.contains("hold"),
        "the attempt's end reason names the hold: {:?}",
        ended.end_reason
    );
    assert_eq!(
        suspended.question, QUESTION,
        "the open question stays on the suspended run"
    );
    let newest_before_answer = fleet.checkpoints(&workspace)[0].clone();

    // 3. Answer with a cordoned: the next attempt must run on b.
    fleet.cordon("a");
    fleet.uncordon("b");
    let answered = fleet
        .answer(&run_id, "recall codeword")
        .unwrap_or_else(|s| panic!("AnswerRun on a suspended run failed: {s}"));
    assert_eq!(state_of(&answered), Some(RunState::Queued), "{answered:?}");
    let done = fleet.wait_for_state(&run_id, RunState::Succeeded);

    assert_eq!(done.attempts.len(), 2, "{done:?}");
    let second = &done.attempts[1];
    assert_eq!(second.host_id, host_b, "the resumed attempt ran on b");
    assert!(
        second.generation > first.generation,
        "attempt 2 has generation {} after attempt 1's {}",
        second.generation,
        first.generation
    );
    assert_eq!(
        second.restored_checkpoint_id, newest_before_answer.id,
        "attempt 2 restored the newest checkpoint"
    );
    // cairn-host gave its runner the host's pack cache (DATA_DIR/pack-cache
    // by default), and the restore filled it for the host's next sandboxes.
    let cached = cairn_e2e::dir_names(&fleet.host("b").data_dir().join("pack-cache"));
    assert!(
        cached.iter().any(|name| name.starts_with("p1-")),
        "host b's pack cache holds no pieces after a restore there: {cached:?}"
    );
    assert!(
        done.summary.contains(&word),
        "the resumed agent did not recall the codeword {word} from the first turn: summary {:?}",
        done.summary
    );

    // The agent's view: the same conversation, resumed with --resume, and
    // the workspace on b as the first turn left it.
    let turns_a = fleet.agent_turns_in(&sandbox_a);
    let turns_b = fleet.agent_turns_in(&second.sandbox_id);
    assert_eq!(
        (turns_a.len(), turns_b.len()),
        (1, 1),
        "one turn per attempt"
    );
    let session = turns_a[0]
        .flag("--session-id")
        .unwrap_or_else(|| panic!("the first turn had no --session-id: {:?}", turns_a[0].argv))
        .to_owned();
    assert!(
        turns_a[0].message().contains(&word),
        "{:?}",
        turns_a[0].argv
    );
    assert_eq!(
        turns_b[0].flag("--resume"),
        Some(session.as_str()),
        "the resumed attempt must continue conversation {session}: {:?}",
        turns_b[0].argv
    );
    assert_eq!(
        turns_b[0].flag("--session-id"),
        None,
        "{:?}",
        turns_b[0].argv
    );
    assert_eq!(turns_b[0].message(), "recall codeword");
    assert_eq!(done.harness_session_id, session);
    assert_eq!(
        (turns_a[0].cwd.as_str(), turns_b[0].cwd.as_str()),
        ("/workspace", "/workspace"),
        "both turns ran at /workspace (the conversation's slug depends on it)"
    );
    assert_first_turn_work(&turns_b[0].workspace, "the workspace on host b");
    assert!(
        !turns_b[0]
            .workspace
            .join(".cairn/state/claude/.credentials.json")
            .exists(),
        "the credentials file travelled with the checkpoint"
    );
    assert!(
        turns_a[0].workspace.join(".cairn/state/claude").is_dir(),
        "the agent's config dir is /workspace/.cairn/state/claude"
    );

    // The checkpoint itself, checked out by a user.
    let (_tmp, checkout) = fleet.checkout(&workspace, &newest_before_answer.id);
    assert_first_turn_work(&checkout, "the checkout of the restored checkpoint");
    let transcript = checkout
        .join(".cairn/state/claude/projects/-workspace")
        .join(format!("{session}.jsonl"));
    assert!(
        transcript.is_file(),
        "the conversation's transcript is in the checkpoint at {}",
        transcript.display()
    );
    assert!(
        !checkout
            .join(".cairn/state/claude/.credentials.json")
            .exists(),
        "a checkpoint holds the credentials file"
    );

    // The timeline, as events.
    let events = fleet.events(&run_id);
    let shown: Vec<String> = events.iter().map(describe_event).collect();
    // The states it went through, each change once, in order.
    let mut states: Vec<RunState> = Vec::new();
    for state in events.iter().filter_map(event_state) {
        if states.last() != Some(&state) {
            states.push(state);
        }
    }
    use RunState::*;
    assert_eq!(
        states,
        [
            Queued, Assigned, Starting, Running, Waiting, Suspended, Queued, Assigned, Starting,
            Running, Succeeded
        ],
        "the run's transitions:\n{}",
        shown.join("\n")
    );
    let position = |reason: &str| {
        events
            .iter()
            .position(|e| e.reason == reason)
            .unwrap_or_else(|| panic!("no {reason} event:\n{}", shown.join("\n")))
    };
    assert!(
        position("waiting") < position("hold_expired")
            && position("hold_expired") < position("answered")
            && position("answered") < position("restored"),
        "waiting, hold_expired, answered, restored in that order:\n{}",
        shown.join("\n")
    );
    for pair in events.windows(2) {
        assert!(pair[0].sequence < pair[1].sequence, "{}", shown.join("\n"));
    }
    assert!(
        events.iter().all(|e| e.at.is_some()),
        "every event has a time:\n{}",
        shown.join("\n")
    );
    let restored = events
        .iter()
        .find(|e| e.reason == "restored")
        .expect("checked above");
    assert_eq!(
        (
            restored.attempt,
            restored.host_id.as_str(),
            restored.checkpoint_id.as_str()
        ),
        (2, host_b.as_str(), newest_before_answer.id.as_str()),
        "the restore event names attempt 2, host b and the checkpoint:\n{}",
        shown.join("\n")
    );
    assert!(
        events.iter().all(|e| e.reason != "work_lost"),
        "attempt 1 checkpointed as it stopped: nothing was lost:\n{}",
        shown.join("\n")
    );
}

#[test]
fn an_answer_within_the_hold_goes_to_the_same_sandbox_without_a_restore() {
    let mut fleet = Fleet::start();
    let host_a = fleet.start_host("a", HostOptions::default()).id.clone();
    let word = codeword("HERON");
    let created = fleet.create_run(fleet.run_request("warm", &first_turn(&word)));
    let run_id = created.id.clone();

    let waiting = fleet.wait_for_state(&run_id, RunState::Waiting);
    let attempt = waiting.attempts[0].clone();
    assert_eq!(attempt.host_id, host_a);
    fleet
        .answer(&run_id, "recall codeword")
        .unwrap_or_else(|s| panic!("AnswerRun on a waiting run failed: {s}"));
    let done = fleet.wait_for_state(&run_id, RunState::Succeeded);

    assert_eq!(
        done.attempts.len(),
        1,
        "an answer within the hold must not start another attempt: {done:?}"
    );
    assert_eq!(
        (
            done.attempts[0].sandbox_id.as_str(),
            done.attempts[0].generation
        ),
        (attempt.sandbox_id.as_str(), attempt.generation),
        "same sandbox, same generation"
    );
    assert!(done.summary.contains(&word), "summary {:?}", done.summary);

    let turns = fleet.agent_turns_in(&attempt.sandbox_id);
    assert_eq!(turns.len(), 2, "both turns ran in the held sandbox");
    let session = turns[0]
        .flag("--session-id")
        .expect("first turn opens a conversation");
    assert_eq!(
        turns[1].flag("--resume"),
        Some(session),
        "{:?}",
        turns[1].argv
    );
    assert_eq!(turns[1].message(), "recall codeword");
    assert_first_turn_work(&turns[1].workspace, "the held sandbox at the second turn");
    assert!(
        turns[1]
            .workspace
            .join(".cairn/state/claude/.credentials.json")
            .is_file(),
        "the held sandbox keeps what the agent wrote, credentials included"
    );

    let events = fleet.events(&run_id);
    let shown: Vec<String> = events.iter().map(describe_event).collect();
    assert!(
        events
            .iter()
            .all(|e| e.reason != "restored" && e.attempt <= 1),
        "no restore and no second attempt:\n{}",
        shown.join("\n")
    );
    assert_eq!(
        events.iter().filter(|e| e.reason == "claimed").count(),
        1,
        "claimed once:\n{}",
        shown.join("\n")
    );
    assert!(
        events
            .iter()
            .any(|e| e.reason == "answered" && e.attempt == 1),
        "the answer is an event of attempt 1:\n{}",
        shown.join("\n")
    );
    fleet.wait_for_sandbox_gone("a", &attempt.sandbox_id);
}
