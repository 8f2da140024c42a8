//! The demo agent honours the Claude Code contract (flags, transcript path,
//! stream-json, refusals with Claude Code's words), and `cairn-runner ask`
//! writes the outcome file. Real processes, real files.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const DEMO: &str = env!("CARGO_BIN_EXE_cairn-demo-agent");

/// A workspace-like directory with a config dir, like a sandbox's /workspace.
struct Sandbox {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl Sandbox {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(dir.path()).unwrap().join("workspace");
        fs::create_dir_all(root.join("app")).unwrap();
        Self { _dir: dir, root }
    }

    fn config_dir(&self) -> PathBuf {
        self.root.join(".cairn/state/claude")
    }

    fn outcome_file(&self) -> PathBuf {
        self.root.join(".cairn/outcome.json")
    }

    /// Runs the demo agent in `cwd` (relative to the root) with `args`.
    fn agent(&self, cwd: &str, args: &[&str]) -> Output {
        Command::new(DEMO)
            .args(args)
            .current_dir(self.root.join(cwd))
            .env("CLAUDE_CONFIG_DIR", self.config_dir())
            .env("CAIRN_OUTCOME_FILE", self.outcome_file())
            .output()
            .unwrap()
    }

    fn turn(&self, cwd: &str, session: (&str, &str), message: &str) -> Output {
        self.agent(
            cwd,
            &[
                "-p",
                "--output-format",
                "stream-json",
                "--verbose",
                session.0,
                session.1,
                message,
            ],
        )
    }
}

fn events(output: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).trim().to_owned()
}

fn result_text(output: &Output) -> String {
    let events = events(output);
    let result = events.last().expect("a result event");
    assert_eq!(result["type"], "result", "{events:?}");
    result["result"].as_str().unwrap().to_owned()
}

const SESSION: &str = "3f2b6c1e-8a4d-4e0f-9b7a-1c2d3e4f5a6b";

#[test]
fn a_first_turn_writes_the_transcript_at_the_slug_path_and_reports_the_session() {
    let sandbox = Sandbox::new();
    let out = sandbox.turn(
        "app",
        ("--session-id", SESSION),
        "The codeword is PELICAN.\ncommit notes.md hello",
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let events = events(&out);
    assert_eq!(events[0]["type"], "system");
    assert_eq!(events[0]["subtype"], "init");
    assert_eq!(events[0]["session_id"], SESSION);
    assert_eq!(result_text(&out), "committed notes.md");

    let slug = sandbox
        .root
        .join("app")
        .to_string_lossy()
        .replace(|c: char| !c.is_ascii_alphanumeric(), "-");
    let transcript = sandbox
        .config_dir()
        .join("projects")
        .join(&slug)
        .join(format!("{SESSION}.jsonl"));
    let lines: Vec<Value> = fs::read_to_string(&transcript)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "the user's message and the answer");
    assert_eq!(lines[0]["type"], "user");
    assert_eq!(
        lines[0]["message"]["content"],
        "The codeword is PELICAN.\ncommit notes.md hello"
    );
    assert_eq!(lines[1]["type"], "assistant");
    assert_eq!(lines[0]["sessionId"], SESSION);
    assert!(
        sandbox.root.join("app/.git").is_dir(),
        "the commit made a repository in the cwd"
    );
}

#[test]
fn session_id_on_an_existing_transcript_is_refused_with_claude_codes_words() {
    let sandbox = Sandbox::new();
    assert!(
        sandbox
            .turn("app", ("--session-id", SESSION), "hello")
            .status
            .success()
    );
    let again = sandbox.turn("app", ("--session-id", SESSION), "hello again");
    assert_eq!(again.status.code(), Some(1));
    assert_eq!(
        stderr(&again),
        format!("Error: Session ID {SESSION} is already in use.")
    );
    assert!(again.stdout.is_empty(), "nothing ran");
}

#[test]
fn resume_of_an_unknown_conversation_fails_like_claude_code() {
    let sandbox = Sandbox::new();
    let out = sandbox.turn("app", ("--resume", SESSION), "hello");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        format!("No conversation found with session ID: {SESSION}")
    );

    // A conversation is only found from the directory it started in.
    assert!(
        sandbox
            .turn("app", ("--session-id", SESSION), "hello")
            .status
            .success()
    );
    let elsewhere = sandbox.turn("", ("--resume", SESSION), "hello");
    assert_eq!(elsewhere.status.code(), Some(1));
    assert_eq!(
        stderr(&elsewhere),
        format!("No conversation found with session ID: {SESSION}")
    );
}

#[test]
fn a_resumed_conversation_recalls_its_first_turn_even_after_moving() {
    let sandbox = Sandbox::new();
    let first = sandbox.turn(
        "app",
        ("--session-id", SESSION),
        "Remember: the codeword is PELICAN.",
    );
    assert!(first.status.success(), "{}", stderr(&first));
    assert_eq!(
        result_text(&first),
        "nothing to do: the message had no directives"
    );

    // Another "host": the workspace is moved away and restored at the same path.
    let parked = sandbox.root.with_file_name("parked");
    fs::rename(&sandbox.root, &parked).unwrap();
    fs::rename(&parked, &sandbox.root).unwrap();

    let resumed = sandbox.turn("app", ("--resume", SESSION), "recall codeword");
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(
        events(&resumed)[0]["session_id"],
        SESSION,
        "the same conversation"
    );
    assert_eq!(result_text(&resumed), "the codeword was PELICAN");
    let projects = sandbox.config_dir().join("projects");
    let files: Vec<_> = fs::read_dir(
        projects.join(
            fs::read_dir(&projects)
                .unwrap()
                .next()
                .unwrap()
                .unwrap()
                .file_name(),
        ),
    )
    .unwrap()
    .collect();
    assert_eq!(files.len(), 1, "one transcript, appended to");
}

#[test]
fn ask_and_fail_directives_end_the_turn_as_claude_would_report_them() {
    let sandbox = Sandbox::new();
    let asked = sandbox.turn(
        "app",
        ("--session-id", SESSION),
        "edit a.txt x\nask Which colour?",
    );
    assert!(asked.status.success());
    assert_eq!(result_text(&asked), "edited a.txt; asked: Which colour?");
    let outcome: Value =
        serde_json::from_str(&fs::read_to_string(sandbox.outcome_file()).unwrap()).unwrap();
    assert_eq!(
        outcome,
        serde_json::json!({"status": "needs_input", "question": "Which colour?"})
    );

    let failed = sandbox.turn("app", ("--resume", SESSION), "fail the disk is full");
    assert_eq!(failed.status.code(), Some(1));
    let result = events(&failed).pop().unwrap();
    assert_eq!(result["is_error"], true);
    assert_eq!(result["result"], "the disk is full");
}

#[test]
fn flags_are_checked_like_claude_code_checks_them() {
    let sandbox = Sandbox::new();
    let cases: &[(&[&str], &str)] = &[
        (
            &["-p", "--output-format", "stream-json", "hi"],
            "Error: When using --print, --output-format=stream-json requires --verbose",
        ),
        (
            &["-p", "--session-id", "nope", "hi"],
            "Error: Invalid session ID. Must be a valid UUID.",
        ),
        (
            &["-p", "--session-id", SESSION, "--resume", SESSION, "hi"],
            "Error: --session-id can only be used with --continue or --resume if --fork-session is also specified.",
        ),
        (
            &["-p", "--frobnicate", "hi"],
            "error: unknown option '--frobnicate'",
        ),
    ];
    for (args, expected) in cases {
        let out = sandbox.agent("app", args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert_eq!(stderr(&out), *expected, "{args:?}");
    }
    let text = sandbox.agent("app", &["-p", "--model", "opus", "recall nothing"]);
    assert!(text.status.success());
    assert_eq!(
        String::from_utf8_lossy(&text.stdout).trim(),
        "the first message said nothing about nothing"
    );
}

fn ask(outcome_file: &Path, args: &[&str]) -> Output {
    Command::new(cairn_utils::testing::sibling_binary("cairn-runner"))
        .arg("ask")
        .args(args)
        .env("CAIRN_OUTCOME_FILE", outcome_file)
        .output()
        .unwrap()
}

#[test]
fn cairn_runner_ask_writes_the_outcome_file() {
    let sandbox = Sandbox::new();
    let out = ask(&sandbox.outcome_file(), &["Which", "colour should it be?"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("asked: Which colour should it be?\n"),
        "{stdout}"
    );
    assert!(stdout.contains("waits for an answer"), "{stdout}");
    assert_eq!(
        fs::read_to_string(sandbox.outcome_file()).unwrap(),
        "{\"status\":\"needs_input\",\"question\":\"Which colour should it be?\"}\n"
    );

    let again = ask(&sandbox.outcome_file(), &["Or green?"]);
    assert!(
        String::from_utf8_lossy(&again.stdout)
            .starts_with("replaced the earlier outcome (needs_input)")
    );

    let empty = ask(&sandbox.outcome_file(), &["  "]);
    assert_eq!(empty.status.code(), Some(1));
    assert_eq!(
        stderr(&empty),
        format!(
            "error: the outcome file {} is invalid: the question is empty",
            sandbox.outcome_file().display()
        )
    );
    let missing = ask(&sandbox.outcome_file(), &[]);
    assert_eq!(
        missing.status.code(),
        Some(2),
        "clap refuses a missing question"
    );
}
