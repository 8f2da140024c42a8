//! The goose adapter (`goose`), per ../shared/reference/harnesses.md.
//!
//! - State: `GOOSE_PATH_ROOT=<root>/.cairn/state/goose` (goose then keeps
//!   its `config/`, `data/` and `state/` under it). Its conversations are a
//!   SQLite database, `data/sessions/sessions.db`, with its `-wal` and
//!   `-shm` files; the runner checkpoints only between turns, when goose is
//!   not running, so a checkpoint carries the database and its WAL as one.
//! - Credentials: with `GOOSE_DISABLE_KEYRING=1` goose keeps its secrets in
//!   `config/secrets.yaml` rather than the OS keyring (which a sandbox does
//!   not have); that file is never checkpointed and is copied in fresh from
//!   `credentials_dir` (default `$HOME/.config/goose`) before the first turn.
//! - First turn: `run -t <message> --output-format stream-json` (goose
//!   chooses the id, e.g. `20260101_1`); every later turn, and every turn
//!   after a restore: `run --resume --session-id <id> -t <message>
//!   --output-format stream-json`. `model` (`--model`) and `args` follow. A
//!   message starting with `-` is passed as `--text=<message>`.
//! - Unverified (the reference says so; the test double does this): the
//!   conversation's id is the top-level `session_id` of the stream-json
//!   events (the first one seen); the summary is the text of the last
//!   `{"type":"message"}` event whose message is the assistant's;
//!   `{"type":"error","error":…}` marks a failed turn. A line that is not
//!   an event, or an error event, that says the session was not found
//!   (`Session '<id>' not found`) means the conversation is gone.
//! - No fork: goose forks only in an interactive `goose session`, so a
//!   forked workspace's first turn gets the handoff briefing.
//!
//! Settings: `binary` (default `goose`), `model`, `args`, `cwd`,
//! `credentials_dir`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use super::{
    Cli, CliSpec, CliTurns, HarnessError, Invocation, Observed, Stream, TurnRequest, json_event,
    message_option, non_empty, text_items,
};

const CLI: CliSpec = CliSpec {
    name: "goose",
    settings: cairn_proto::runs::GOOSE_SETTINGS,
    state_dir: ".cairn/state/goose",
    state_env: Some("GOOSE_PATH_ROOT"),
    // Where goose keeps its configuration under `GOOSE_PATH_ROOT`.
    credentials_subdir: Some("config"),
    credential_files: &["secrets.yaml"],
    more_excludes: &[],
    home_credentials: ".config/goose",
    // Unverified, and a pattern: see LOST.
    session_lost: &[],
    // goose forks only in an interactive session.
    can_fork: false,
};

/// Unverified: what `goose run --resume --session-id` prints for an
/// unknown id.
static LOST: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\bsession\b.*\bnot found\b").expect("a valid regular expression")
});

/// goose, configured for one run.
#[derive(Debug, Clone)]
pub struct Goose(Cli);

impl Goose {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        Cli::new(&CLI, config, root).map(Self)
    }
}

impl CliTurns for Goose {
    fn cli(&self) -> &Cli {
        &self.0
    }

    fn invocation(&self, turn: &TurnRequest, _cwd: &Path) -> Invocation {
        let mut args = vec!["run".to_owned()];
        if let TurnRequest::Resume { session_id, .. } = turn {
            args.extend(["--resume".into(), "--session-id".into(), session_id.clone()]);
        }
        args.extend(message_option("-t", "--text=", turn.message()));
        args.extend(["--output-format".into(), "stream-json".into()]);
        args.extend(self.0.options());
        Invocation {
            args,
            env: vec![("GOOSE_DISABLE_KEYRING".into(), "1".into())],
            session_at_start: None,
        }
    }

    fn observe_line(&self, stream: Stream, line: &str, observed: &mut Observed) {
        // A line that is not an event is goose's own output.
        if let Some(event) = json_event(stream, line) {
            self.observe_event(&event, observed);
        } else if LOST.is_match(line) {
            observed.session_lost = true;
        }
    }

    fn observe_event(&self, event: &Value, observed: &mut Observed) {
        if let Some(id) = non_empty(&event["session_id"]) {
            observed.session_id.get_or_insert_with(|| id.to_owned());
        }
        match event["type"].as_str() {
            Some("message") if event["message"]["role"] == "assistant" => {
                if let Some(text) = text_items(&event["message"]["content"]) {
                    observed.summary = Some(text);
                }
            }
            Some("error") => {
                let why = non_empty(&event["error"])
                    .or_else(|| non_empty(&event["error"]["message"]))
                    .unwrap_or("goose reported an error");
                if LOST.is_match(why) {
                    observed.session_lost = true;
                }
                observed.error = Some(why.to_owned());
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::super::testing::*;
    use super::*;

    fn goose(config: &[(&str, &str)], root: &Path) -> Goose {
        Goose::new(&settings(config), root).unwrap()
    }

    #[test]
    fn turns_use_the_exact_flags() {
        let g = goose(
            &[("model", "gpt-4o"), ("args", "--provider openai")],
            Path::new("/workspace"),
        );
        let start = start_turn(&g, "fix it", "/workspace/app");
        assert_eq!(start.program, "goose");
        assert_eq!(
            start.args,
            [
                "run",
                "-t",
                "fix it",
                "--output-format",
                "stream-json",
                "--model",
                "gpt-4o",
                "--provider",
                "openai"
            ]
        );
        assert_eq!(
            start.env,
            [
                (
                    "GOOSE_PATH_ROOT".to_owned(),
                    "/workspace/.cairn/state/goose".to_owned()
                ),
                ("GOOSE_DISABLE_KEYRING".to_owned(), "1".to_owned()),
            ]
        );
        assert_eq!(start.session_at_start, None);

        let plain = goose(&[], Path::new("/workspace"));
        let resume = |message: &str| {
            resume_turn(&plain, "20260101_1", message, false)
                .unwrap()
                .args
        };
        assert_eq!(
            resume("go on"),
            [
                "run",
                "--resume",
                "--session-id",
                "20260101_1",
                "-t",
                "go on",
                "--output-format",
                "stream-json"
            ]
        );
        assert_eq!(resume("-v please")[4], "--text=-v please");
        assert!(!plain.can_fork());
        assert!(resume_turn(&plain, "20260101_1", "m", true).is_err());
    }

    #[test]
    fn the_stream_gives_session_summary_and_errors() {
        let g = goose(&[], Path::new("/workspace"));
        let seen = observe_lines(
            &g,
            Stream::Stdout,
            &[
                r#"{"type":"message","session_id":"20260101_1","message":{"role":"user","content":[{"type":"text","text":"hi"}]}}"#,
                r#"{"type":"message","session_id":"20260101_1","message":{"role":"assistant","content":[{"type":"text","text":"did it"}]}}"#,
                r#"{"type":"complete","session_id":"20260101_1","total_tokens":12}"#,
            ],
        );
        assert_eq!(
            seen,
            Observed {
                session_id: Some("20260101_1".into()),
                summary: Some("did it".into()),
                ..Observed::default()
            }
        );
        let failed = observe_lines(
            &g,
            Stream::Stdout,
            &[r#"{"type":"error","error":"provider refused"}"#],
        );
        assert_eq!(failed.error.as_deref(), Some("provider refused"));
        let lost = observe_lines(
            &g,
            Stream::Stderr,
            &["Error: Session '20260101_9' not found"],
        );
        assert!(lost.session_lost);
        let said = observe_lines(
            &g,
            Stream::Stdout,
            &[
                r#"{"type":"message","message":{"role":"assistant","content":[{"type":"text","text":"session not found"}]}}"#,
            ],
        );
        assert!(!said.session_lost, "the agent's words are not goose's");
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let (root, g) = prepared(Goose::new, &[("secrets.yaml", "OPENAI_API_KEY: k\n")]);
        let copied = root.path().join(".cairn/state/goose/config/secrets.yaml");
        assert_eq!(fs::read_to_string(&copied).unwrap(), "OPENAI_API_KEY: k\n");
        assert_excluded(
            &g,
            root.path(),
            &[
                (".cairn/state/goose/config/secrets.yaml", true),
                (".cairn/state/goose/config/config.yaml", false),
                (".cairn/state/goose/data/sessions/sessions.db", false),
                (".cairn/state/goose/data/sessions/sessions.db-wal", false),
                ("app/secrets.yaml", false),
            ],
        );
    }
}
