//! A real CLI's turn on one real host, suspended in the middle of the turn,
//! answered, and resumed on another host: the provider stub then sees the
//! first turn's words in the resumed request. Claude Code (Anthropic
//! Messages) and codex (OpenAI Responses) resume the same conversation. pi
//! (OpenAI Chat Completions) writes nothing of a turn cut before the
//! answer: it says it has no such session, and the runner briefs a new
//! conversation, which carries the task; the run's events say so. opencode
//! (Chat Completions) says nothing, its id included, before the answer: the
//! next attempt starts over with the task and the answer. For both, a turn
//! that finished on one host is continued by the next run on another.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use cairn_e2e::fleet::{Fleet, HostOptions, on_workspace};
use cairn_e2e::{git, tempdir};
use cairn_proto::pb;
use cairn_proto::runs::{RunState, to_proto_duration};

use crate::support::{RealCli, Stub, clis_dir, last_model_call};

const CODEWORD: &str = "The codeword is OSPREY-9083.";
const ANSWER: &str = "What was the codeword?";

/// A workspace holding a repository and the provider's settings where the
/// adapter points the CLI (the sandbox restores them); its id.
fn seed_workspace(fleet: &Fleet, cli: RealCli, stub: &Stub, dir: &Path) -> String {
    let seed = dir.join("seed");
    fs::create_dir_all(seed.join("app")).unwrap();
    git(&seed.join("app"), &["init", "-q"]);
    fs::write(seed.join("app/README.md"), "# app\n").unwrap();
    git(&seed.join("app"), &["add", "README.md"]);
    git(&seed.join("app"), &["commit", "-q", "-m", "first"]);
    cli.configure(&seed.join(".cairn/state").join(cli.name()), stub);
    let workspace = fleet
        .coordinator
        .create_workspace(&format!("hosts-{}", cli.name()));
    fleet.coordinator.client().checkpoint(&seed, &workspace);
    workspace
}

/// A run of the real CLI on `workspace` with `prompt`.
fn run_request(cli: RealCli, workspace: &str, prompt: &str) -> pb::CreateRunRequest {
    let mut config: std::collections::HashMap<String, String> = cli
        .settings()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let binary = clis_dir().join("bin").join(cli.name());
    config.insert("binary".into(), binary.display().to_string());
    on_workspace(
        pb::CreateRunRequest {
            harness: Some(pb::HarnessSpec {
                name: cli.name().into(),
                config,
            }),
            prompt: prompt.into(),
            ..Default::default()
        },
        workspace,
    )
}

/// How the conversation goes on after a turn cut short.
#[derive(Debug, PartialEq)]
enum Continues {
    /// The same conversation, resumed.
    Resumed,
    /// A new one, briefed (the CLI kept nothing of the cut turn).
    Briefed,
    /// A new one with the task again (no id was ever reported).
    Restarted,
}

fn suspended_on_a_resumes_on_b(cli: RealCli, continues: Continues) {
    let tmp = tempdir(&format!("hosts-{}", cli.name()));
    let release = tmp.path().join("release-first-call");
    let stub = Stub::start(tmp.path(), "STUB-ANSWER", Some(&release));

    let mut fleet = Fleet::start();
    let options = HostOptions {
        env: cli.env(&stub, None),
        grace: Duration::from_secs(20),
        ..HostOptions::default()
    };
    let host_a = fleet.start_host("a", options.clone()).id.clone();
    let host_b = fleet.start_host("b", options).id.clone();
    fleet.cordon("b");

    let workspace = seed_workspace(&fleet, cli, &stub, tmp.path());
    let mut request = run_request(cli, &workspace, CODEWORD);
    request.hold = Some(to_proto_duration(Duration::from_secs(300)));
    let run_id = fleet.create_run(request).id;

    // Turn 1 is with the provider, which holds its answer: suspend now.
    let deadline = Instant::now() + Duration::from_secs(120);
    while last_model_call(&stub).is_none() {
        assert!(
            Instant::now() < deadline,
            "{} never called the provider:\n{}",
            cli.name(),
            fleet.diagnose(&run_id)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    fleet.suspend(&run_id);
    let suspended = fleet.wait_for_state(&run_id, RunState::Suspended);
    assert_eq!(suspended.attempts[0].host_id, host_a);
    let session = suspended.harness_session_id.clone();
    assert_eq!(
        session.is_empty(),
        continues == Continues::Restarted,
        "whether the first turn's session was known before the suspend: {suspended:?}"
    );
    fs::write(&release, "").unwrap();

    fleet.cordon("a");
    fleet.uncordon("b");
    fleet
        .answer(&run_id, ANSWER)
        .unwrap_or_else(|s| panic!("AnswerRun failed: {s}"));
    let done = fleet.wait_for_state(&run_id, RunState::Succeeded);
    let second = done.attempts.last().unwrap();
    assert_eq!(second.host_id, host_b, "the answer ran on b");
    match continues {
        Continues::Resumed => {
            assert_eq!(done.harness_session_id, session, "the same conversation");
        }
        Continues::Briefed => {
            assert_ne!(done.harness_session_id, session, "a new conversation");
            let said = fleet
                .events(&run_id)
                .iter()
                .map(|e| e.detail.clone())
                .collect::<Vec<_>>();
            assert!(
                said.iter().any(|d| d.contains(&format!(
                    "{} has no conversation {session} any more; started a new conversation with a handoff briefing",
                    cli.name()
                ))),
                "the run's events say the conversation was lost: {said:#?}"
            );
        }
        Continues::Restarted => assert!(!done.harness_session_id.is_empty()),
    }
    let resumed = last_model_call(&stub).unwrap();
    assert!(
        resumed.contains("OSPREY-9083") && resumed.contains(ANSWER),
        "the resumed request on b must carry turn 1's words and the answer: {}",
        &resumed[..resumed.len().min(3000)]
    );
    assert_eq!(done.summary, "STUB-ANSWER", "{done:?}");
}

#[test]
fn claude_suspended_on_one_host_resumes_on_another() {
    suspended_on_a_resumes_on_b(RealCli::Claude, Continues::Resumed);
}

#[test]
fn codex_suspended_on_one_host_resumes_on_another() {
    suspended_on_a_resumes_on_b(RealCli::Codex, Continues::Resumed);
}

#[test]
fn opencode_suspended_on_one_host_starts_over_on_another() {
    suspended_on_a_resumes_on_b(RealCli::Opencode, Continues::Restarted);
}

#[test]
fn pi_suspended_on_one_host_is_briefed_on_another() {
    suspended_on_a_resumes_on_b(RealCli::Pi, Continues::Briefed);
}

/// A run's turn completes on host A; the next run on the same station lands
/// on host B and continues that conversation: the provider is sent the
/// first run's words. opencode and pi (OpenAI Chat Completions), whose cut
/// turns leave nothing to resume (above), resume a finished one.
fn next_run_on_b_continues_the_conversation(cli: RealCli) {
    let tmp = tempdir(&format!("next-run-{}", cli.name()));
    let stub = Stub::start(tmp.path(), "STUB-ANSWER", None);
    let mut fleet = Fleet::start();
    let options = HostOptions {
        env: cli.env(&stub, None),
        ..HostOptions::default()
    };
    let host_a = fleet.start_host("a", options.clone()).id.clone();
    let host_b = fleet.start_host("b", options).id.clone();
    fleet.cordon("b");

    let workspace = seed_workspace(&fleet, cli, &stub, tmp.path());
    let first = fleet.create_run(run_request(cli, &workspace, CODEWORD)).id;
    let first = fleet.wait_for_state(&first, RunState::Succeeded);
    assert_eq!(first.attempts[0].host_id, host_a);
    assert!(!first.harness_session_id.is_empty());

    fleet.cordon("a");
    fleet.uncordon("b");
    let second = fleet.create_run(run_request(cli, &workspace, ANSWER)).id;
    let second = fleet.wait_for_state(&second, RunState::Succeeded);
    assert_eq!(second.attempts[0].host_id, host_b);
    assert_eq!(
        second.harness_session_id, first.harness_session_id,
        "the station's conversation, continued on b"
    );
    let resumed = last_model_call(&stub).unwrap();
    assert!(
        resumed.contains("OSPREY-9083") && resumed.contains(ANSWER),
        "the request on b must carry the first run's words: {}",
        &resumed[..resumed.len().min(3000)]
    );
}

#[test]
fn opencode_next_run_on_another_host_continues_the_conversation() {
    next_run_on_b_continues_the_conversation(RealCli::Opencode);
}

#[test]
fn pi_next_run_on_another_host_continues_the_conversation() {
    next_run_on_b_continues_the_conversation(RealCli::Pi);
}
