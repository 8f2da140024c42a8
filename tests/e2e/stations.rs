//! Stations (issue 4): one workspace passes from station `implement` to
//! `review` to `fix`. Each run leaves a handoff note; the next station opens
//! a new conversation briefed with the notes; before its harness starts the
//! runner clears what the earlier station laid and an outcome file left
//! behind, fast-forwards the checkout to what a person pushed meanwhile —
//! or, once the branch has diverged, leaves it as it is and says why.
//!
//! The agent is `cairn-demo-agent` as harness `claude` (through the fleet's
//! recording script, so the test sees each turn's arguments and the
//! workspace as the agent found it). The project's remote is a bare
//! repository on this machine; "a person" works in a checkout of the
//! workspace made with `cairnctl checkout`.

use std::fs;
use std::path::Path;

use cairn_e2e::fleet::{AgentTurn, Fleet, HostOptions, describe_run, on_workspace};
use cairn_e2e::{git, tempdir, write};
use cairn_proto::pb;
use cairn_proto::runs::RunState;
use serde_json::Value;
use tempfile::TempDir;

const IMPLEMENT_SKILL: &str = ".cairn/state/claude/skills/implement/SKILL.md";
const REVIEW_SKILL: &str = ".cairn/state/claude/skills/review/SKILL.md";

/// A bare repository with one commit on `main`.
struct Remote {
    _dir: TempDir,
    url: String,
}

impl Remote {
    fn new() -> Self {
        let dir = tempdir("remote");
        let origin = dir.path().join("origin.git");
        fs::create_dir(&origin).unwrap();
        git(&origin, &["init", "-q", "--bare", "--initial-branch=main"]);
        let url = origin.display().to_string();
        git(dir.path(), &["clone", "-q", &url, "person"]);
        let person = dir.path().join("person");
        write(&person.join("README.md"), "the project\n");
        git(&person, &["add", "README.md"]);
        git(&person, &["commit", "-qm", "start the project"]);
        git(&person, &["push", "-q", "origin", "HEAD:main"]);
        Self { _dir: dir, url }
    }
}

/// A person commits `file` in the checkout `repo` and pushes it.
fn push_a_fix(repo: &Path, file: &str, subject: &str) -> String {
    write(&repo.join(file), format!("{subject}\n"));
    git(repo, &["add", file]);
    git(repo, &["commit", "-qm", subject]);
    git(repo, &["push", "-q", "origin", "HEAD:main"]);
    head_of(repo)
}

fn run_at(
    fleet: &Fleet,
    workspace: &str,
    station: &str,
    prompt: &str,
    lay: &[(&str, &str)],
) -> pb::CreateRunRequest {
    let mut request = fleet.run_request(workspace, prompt);
    request.station = station.to_owned();
    request.lay = lay
        .iter()
        .map(|(path, content)| ((*path).to_owned(), content.as_bytes().to_vec()))
        .collect();
    request
}

/// The one turn the run's (only) attempt ran.
#[track_caller]
fn only_turn(fleet: &Fleet, run: &pb::Run) -> AgentTurn {
    assert_eq!(run.attempts.len(), 1, "{}", describe_run(run));
    let turns = fleet.agent_turns_in(&run.attempts[0].sandbox_id);
    assert_eq!(turns.len(), 1, "{}", describe_run(run));
    turns.into_iter().next().unwrap()
}

/// `cairnctl workspace notes WS --output json`.
fn notes(fleet: &Fleet, workspace: &str) -> Vec<Value> {
    let notes = fleet
        .coordinator
        .client()
        .ctl_json(&["workspace", "notes", workspace]);
    notes
        .as_array()
        .unwrap_or_else(|| panic!("not a list of notes: {notes}"))
        .clone()
}

fn head_of(repo: &Path) -> String {
    git(repo, &["rev-parse", "HEAD"]).trim().to_owned()
}

/// Each of `steps` is a line of the run's (only) attempt's prepare step.
#[track_caller]
fn assert_prepared(run: &pb::Run, steps: &[String]) {
    let prepare = &run.attempts[0].prepare;
    for step in steps {
        assert!(
            prepare.contains(step),
            "no {step:?} in the prepare step: {prepare:?}"
        );
    }
}

#[test]
fn a_station_handover_clears_leftovers_fast_forwards_and_briefs_a_new_conversation() {
    let mut fleet = Fleet::start();
    fleet.start_host("a", HostOptions::default());
    let client = fleet.coordinator.client();
    let remote = Remote::new();

    // 1. Station implement: the agent commits the feature; a skill is laid
    //    for it.
    let mut request = run_at(
        &fleet,
        "task",
        "implement",
        "Implement the feature.\ncommit feature.txt the feature",
        &[(IMPLEMENT_SKILL, "# implement: small commits\n")],
    );
    request.repos = vec![pb::RepoSpec {
        name: "app".into(),
        url: remote.url.clone(),
        branch: String::new(),
    }];
    let first = fleet.create_run(request);
    let first = fleet.wait_for_state(&first.id, RunState::Succeeded);
    let turn = only_turn(&fleet, &first);
    assert!(
        turn.workspace.join(IMPLEMENT_SKILL).is_file(),
        "the implement skill was laid before the agent started"
    );
    assert_prepared(
        &first,
        &[format!(
            "laid 1 file for station implement: {IMPLEMENT_SKILL}"
        )],
    );
    let listed = notes(&fleet, "task");
    assert_eq!(listed.len(), 1, "{listed:#?}");
    assert_eq!(listed[0]["run_id"], first.id.as_str());
    assert_eq!(listed[0]["station"], "implement");
    assert_eq!(listed[0]["outcome"], "succeeded");
    let changed = listed[0]["changed"].as_str().unwrap();
    assert!(
        changed.starts_with("app: 1 new commit (") && changed.contains("demo agent: feature.txt"),
        "the runner composed what changed from git: {changed:?}"
    );
    assert_eq!(listed[0]["next"], "not stated");

    // 2. Meanwhile a person pushes the agent's commit with a fix on top, and
    //    an outcome file is left in the workspace (cut into a checkpoint).
    let newest = fleet.checkpoints("task")[0].id.clone();
    let (_checkout, dir) = fleet.checkout("task", &newest);
    assert!(
        dir.join(".cairn/laid.json").is_file(),
        "the record of laid files travels"
    );
    write(
        &dir.join(".cairn/outcome.json"),
        r#"{"status":"done","summary":"an answer nobody asked for"}"#,
    );
    client.checkpoint(&dir, "task");
    let agents_commit = head_of(&dir.join("app"));
    let fix = push_a_fix(&dir.join("app"), "fix.txt", "a person's fix");

    // 3. Station review: a new conversation, briefed with run 1's note, in a
    //    workspace cleared of implement's skill and the outcome file and
    //    brought up to date with the person's fix.
    let second = fleet.create_run(on_workspace(
        run_at(
            &fleet,
            "",
            "review",
            "Review the feature.\ncommit review.txt looks good",
            &[(REVIEW_SKILL, "# review: be strict\n")],
        ),
        "task",
    ));
    let second = fleet.wait_for_state(&second.id, RunState::Succeeded);
    assert_prepared(
        &second,
        &[
            "cleared 1 file laid by station implement, an outcome file left by an earlier agent"
                .to_owned(),
            format!(
                "app: fast-forwarded main 1 commit ({}..{})",
                &agents_commit[..7],
                &fix[..7]
            ),
            format!("laid 1 file for station review: {REVIEW_SKILL}"),
        ],
    );
    assert_ne!(
        second.harness_session_id, first.harness_session_id,
        "a new station opens a new conversation"
    );
    let turn = only_turn(&fleet, &second);
    assert_eq!(turn.flag("--resume"), None, "{:?}", turn.argv);
    assert_eq!(
        turn.flag("--session-id"),
        Some(second.harness_session_id.as_str())
    );
    let briefing = turn.message();
    assert!(
        briefing.starts_with(
            "Handover from station implement: this is the first conversation at station review."
        ),
        "{briefing}"
    );
    assert!(
        !briefing.contains("lossy handoff"),
        "nothing was lost: {briefing}"
    );
    assert!(
        briefing.contains("Review the feature.")
            && briefing.contains(&format!(
                "Run {} at station implement (attempt 1, succeeded",
                first.id
            ))
            && briefing.contains("demo agent: feature.txt"),
        "the briefing carries the task and run 1's note: {briefing}"
    );
    // What the agent found.
    let seen = &turn.workspace;
    assert!(
        !seen.join(IMPLEMENT_SKILL).exists(),
        "implement's skill was cleared"
    );
    assert_eq!(
        fs::read_to_string(seen.join(REVIEW_SKILL)).unwrap(),
        "# review: be strict\n"
    );
    assert!(
        !seen.join(".cairn/outcome.json").exists(),
        "the stale outcome file was cleared"
    );
    assert_eq!(
        head_of(&seen.join("app")),
        fix,
        "the checkout was fast-forwarded"
    );
    assert_eq!(
        fs::read_to_string(seen.join("app/fix.txt")).unwrap(),
        "a person's fix\n"
    );
    let listed = notes(&fleet, "task");
    let stations: Vec<&str> = listed
        .iter()
        .map(|n| n["station"].as_str().unwrap())
        .collect();
    assert_eq!(stations, ["implement", "review"], "oldest first");

    // 4. Station fix, after the person pushed again: the review's commit was
    //    never pushed, so the branch has diverged and is left as it is.
    let second_fix = push_a_fix(&dir.join("app"), "fix2.txt", "another fix");
    let reviewed = {
        let root = tempdir("reviewed");
        client.restore(root.path(), "task");
        head_of(&root.path().join("app"))
    };
    let third = fleet.create_run(on_workspace(
        run_at(&fleet, "", "fix", "Fix what the review found.", &[]),
        "task",
    ));
    let third = fleet.wait_for_state(&third.id, RunState::Succeeded);
    assert_prepared(
        &third,
        &[
            "cleared 1 file laid by station review".to_owned(),
            "app: left as it is: main has diverged from origin/main (1 local, 1 remote commits)"
                .to_owned(),
        ],
    );
    let turn = only_turn(&fleet, &third);
    assert_eq!(
        head_of(&turn.workspace.join("app")),
        reviewed,
        "nothing moved"
    );
    assert!(!turn.workspace.join("app/fix2.txt").exists());
    assert_ne!(head_of(&turn.workspace.join("app")), second_fix);
    let briefing = turn.message();
    assert!(
        briefing.starts_with("Handover from station review:")
            && briefing.contains(&format!("Run {} at station implement", first.id))
            && briefing.contains(&format!("Run {} at station review", second.id)),
        "{briefing}"
    );

    // The notes, for people.
    let table = cairn_e2e::run(client.ctl().args(["workspace", "notes", "task"]))
        .assert_success()
        .stdout;
    for run in [&first.id, &second.id, &third.id] {
        assert!(table.contains(&format!("run {run}  station ")), "{table}");
    }
}
