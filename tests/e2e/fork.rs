//! Fork (issue 4): one workspace forked three ways with `cairnctl workspace
//! fork`, each fork's first run forking the conversation (`--resume <id>
//! --fork-session`), and each fork going on by itself.
//!
//! The agent is `cairn-demo-agent` as harness `claude` (through the fleet's
//! recording script), which forks a conversation the way Claude Code does:
//! a copy of the transcript under a new session id.

use cairn_e2e::fleet::{Fleet, HostOptions, codeword, on_workspace};
use cairn_e2e::{json_str, tempdir};
use cairn_proto::runs::RunState;

#[test]
fn a_fork_of_three_goes_three_ways_and_each_remembers_the_conversation() {
    let mut fleet = Fleet::start();
    // Room for the three follow-ups at once.
    fleet.start_host(
        "a",
        HostOptions {
            slots: 3,
            ..HostOptions::default()
        },
    );
    let client = fleet.coordinator.client();

    // The source: one run that says a codeword and commits a file.
    let word = codeword("HERON");
    let source_run = fleet.create_run(fleet.run_request(
        "origin",
        &format!("The codeword is {word}.\ncommit a.txt one"),
    ));
    let source_run = fleet.wait_for_state(&source_run.id, RunState::Succeeded);
    let source_session = source_run.harness_session_id.clone();
    assert!(!source_session.is_empty(), "{source_run:?}");
    let source_checkpoints: Vec<String> = fleet
        .checkpoints("origin")
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert!(!source_checkpoints.is_empty());

    // Three forks, made with cairnctl.
    let forked = client.ctl_json(&["workspace", "fork", "origin", "--count", "3"]);
    assert_eq!(json_str(&forked, "checkpoint_id"), source_checkpoints[0]);
    let forks: Vec<String> = forked["workspaces"]
        .as_array()
        .unwrap_or_else(|| panic!("no workspaces in {forked}"))
        .iter()
        .map(|w| json_str(w, "name").to_owned())
        .collect();
    assert_eq!(forks, ["origin-fork-1", "origin-fork-2", "origin-fork-3"]);

    // A different follow-up on each.
    let mut runs = Vec::new();
    for (i, fork) in forks.iter().enumerate() {
        let request = fleet.run_request("", &format!("commit b{i}.txt fork {i}\nrecall codeword"));
        runs.push(fleet.create_run(on_workspace(request, fork)).id);
    }
    let mut sessions = Vec::new();
    for (i, (fork, run_id)) in forks.iter().zip(&runs).enumerate() {
        let done = fleet.wait_for_state(run_id, RunState::Succeeded);
        assert!(
            done.summary.contains(&word),
            "{fork}: the forked conversation does not remember the codeword {word}: {:?}",
            done.summary
        );
        let attempt = done.attempts.last().expect("an attempt");
        let turns = fleet.agent_turns_in(&attempt.sandbox_id);
        assert_eq!(turns.len(), 1, "{fork}: one turn");
        assert_eq!(
            turns[0].flag("--resume"),
            Some(source_session.as_str()),
            "{fork}: {:?}",
            turns[0].argv
        );
        assert!(
            turns[0].argv.iter().any(|a| a == "--fork-session"),
            "{fork}: the first turn of a fork forks the conversation: {:?}",
            turns[0].argv
        );
        sessions.push(done.harness_session_id.clone());

        // The fork's newest checkpoint has its own file and not the others'.
        let root = tempdir(&format!("fork-{i}"));
        client.restore(root.path(), fork);
        assert_eq!(
            std::fs::read_to_string(root.path().join("a.txt")).unwrap(),
            "one\n",
            "{fork}: the source's work"
        );
        for j in 0..forks.len() {
            let file = root.path().join(format!("b{j}.txt"));
            assert_eq!(file.exists(), i == j, "{fork}: {}", file.display());
        }
    }
    let mut distinct = sessions.clone();
    distinct.push(source_session.clone());
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        4,
        "each fork has a conversation of its own: source {source_session}, forks {sessions:?}"
    );

    // The source is as it was: same checkpoints, same conversation, and its
    // newest checkpoint has none of the forks' files.
    let after: Vec<String> = fleet
        .checkpoints("origin")
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(after, source_checkpoints);
    let root = tempdir("origin");
    client.restore(root.path(), "origin");
    for j in 0..forks.len() {
        assert!(!root.path().join(format!("b{j}.txt")).exists());
    }
    let again = fleet.get_run(&source_run.id);
    assert_eq!(again.harness_session_id, source_session);
}
