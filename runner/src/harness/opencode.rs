//! The opencode adapter (`opencode`), per ../shared/reference/harnesses.md.
//!
//! - State: opencode follows the XDG base directories, so all three point
//!   into `<root>/.cairn/state/opencode`: `XDG_DATA_HOME=…/data`,
//!   `XDG_CONFIG_HOME=…/config`, `XDG_STATE_HOME=…/state`. Its
//!   conversations are a SQLite database, `$XDG_DATA_HOME/opencode/opencode.db`,
//!   in WAL mode: the `-wal` (and `-shm`) files belong with it, and the
//!   runner checkpoints only between turns, when opencode is not running,
//!   so a checkpoint carries the database and its WAL as one.
//! - First turn: `run <message> --format json` (opencode chooses the id);
//!   every later turn, and every turn after a restore: `run -s <id>
//!   <message> --format json`. The first turn of a forked workspace adds
//!   `--fork`: opencode continues a copy of the conversation under a new
//!   id and leaves the original alone. `model` (`--model`) and `args`
//!   follow. opencode reads an argument starting with `-` as an option, so
//!   such a message gets a leading space.
//! - Every JSON line carries `sessionID` (the first one seen is the
//!   conversation's, which after a fork is the new one); the turn's summary
//!   is the `part.text` of the last `{"type":"text"}` event, and
//!   `{"type":"error"}` marks a failed turn (`error.data.message`, else
//!   `error.message`, else `error.name`, says why). `Session not found`
//!   (exit 1) means the conversation is gone.
//! - Credentials (`auth.json`, `mcp-auth.json` in `$XDG_DATA_HOME/opencode`)
//!   are never checkpointed; they are copied in fresh from `credentials_dir`
//!   (default `$HOME/.local/share/opencode`) before the first turn.
//!
//! Settings: `binary` (default `opencode`), `model`, `args`, `cwd`,
//! `credentials_dir`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::{
    Cli, CliSpec, CliTurns, HarnessError, Invocation, Observed, Stream, TurnRequest, json_event,
    message_word, non_empty,
};

const CLI: CliSpec = CliSpec {
    name: "opencode",
    settings: cairn_proto::runs::OPENCODE_SETTINGS,
    // `XDG_DATA_HOME`; `XDG_CONFIG_HOME` and `XDG_STATE_HOME` are its
    // siblings `config` and `state`.
    state_dir: ".cairn/state/opencode/data",
    state_env: Some("XDG_DATA_HOME"),
    // Where opencode keeps its data under `XDG_DATA_HOME`.
    credentials_subdir: Some("opencode"),
    credential_files: &["auth.json", "mcp-auth.json"],
    more_excludes: &[],
    home_credentials: ".local/share/opencode",
    // What `opencode run -s` prints (exit 1) when no session has the id.
    session_lost: &["Session not found"],
    can_fork: true,
};

/// opencode, configured for one run.
#[derive(Debug, Clone)]
pub struct Opencode(Cli);

impl Opencode {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        Cli::new(&CLI, config, root).map(Self)
    }
}

impl CliTurns for Opencode {
    fn cli(&self) -> &Cli {
        &self.0
    }

    fn invocation(&self, turn: &TurnRequest, _cwd: &Path) -> Invocation {
        let mut args = vec!["run".to_owned()];
        if let TurnRequest::Resume {
            session_id, fork, ..
        } = turn
        {
            args.extend(["-s".to_owned(), session_id.clone()]);
            if *fork {
                args.push("--fork".into());
            }
        }
        args.push(message_word(turn.message()));
        args.extend(["--format".into(), "json".into()]);
        args.extend(self.0.options());
        let env = [("XDG_CONFIG_HOME", "config"), ("XDG_STATE_HOME", "state")]
            .map(|(name, dir)| {
                let path = self.0.state_dir.with_file_name(dir);
                (name.to_owned(), path.to_string_lossy().into_owned())
            })
            .into();
        Invocation {
            args,
            env,
            session_at_start: None,
        }
    }

    fn observe_line(&self, stream: Stream, line: &str, observed: &mut Observed) {
        // A line that is not an event is opencode's own output.
        if let Some(event) = json_event(stream, line) {
            self.observe_event(&event, observed);
        } else if self.0.says_lost(line) {
            observed.session_lost = true;
        }
    }

    fn observe_event(&self, event: &Value, observed: &mut Observed) {
        if let Some(id) = non_empty(&event["sessionID"]) {
            observed.session_id.get_or_insert_with(|| id.to_owned());
        }
        match event["type"].as_str() {
            Some("text") => {
                if let Some(text) = event["part"]["text"].as_str() {
                    observed.summary = Some(text.to_owned());
                }
            }
            Some("error") => {
                let error = &event["error"];
                let why = non_empty(&error["data"]["message"])
                    .or_else(|| non_empty(&error["message"]))
                    .or_else(|| non_empty(&error["name"]))
                    .unwrap_or("opencode reported an error");
                if self.0.says_lost(why) {
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

    fn opencode(config: &[(&str, &str)], root: &Path) -> Opencode {
        Opencode::new(&settings(config), root).unwrap()
    }

    #[test]
    fn turns_use_the_exact_flags() {
        let o = opencode(
            &[
                ("model", "anthropic/claude-sonnet-4"),
                ("args", "--agent build"),
            ],
            Path::new("/workspace"),
        );
        let start = start_turn(&o, "fix it", "/workspace/app");
        assert_eq!(start.program, "opencode");
        assert_eq!(
            start.args,
            [
                "run",
                "fix it",
                "--format",
                "json",
                "--model",
                "anthropic/claude-sonnet-4",
                "--agent",
                "build"
            ]
        );
        assert_eq!(start.session_at_start, None, "opencode chooses the id");
        let env = |name: &str, dir: &str| {
            (
                name.to_owned(),
                format!("/workspace/.cairn/state/opencode/{dir}"),
            )
        };
        assert_eq!(
            start.env,
            [
                env("XDG_DATA_HOME", "data"),
                env("XDG_CONFIG_HOME", "config"),
                env("XDG_STATE_HOME", "state"),
            ]
        );
        assert_eq!(start.cwd, Path::new("/workspace/app"));

        let plain = opencode(&[], Path::new("/workspace"));
        let resume =
            |message: &str, fork| resume_turn(&plain, "ses_1", message, fork).unwrap().args;
        assert_eq!(
            resume("go on", false),
            ["run", "-s", "ses_1", "go on", "--format", "json"]
        );
        assert_eq!(
            resume("-v please", true),
            [
                "run",
                "-s",
                "ses_1",
                "--fork",
                " -v please",
                "--format",
                "json"
            ]
        );
        assert!(plain.can_fork());
    }

    #[test]
    fn every_line_carries_the_session() {
        let o = opencode(&[], Path::new("/workspace"));
        let seen = observe_lines(
            &o,
            Stream::Stdout,
            &[
                r#"{"type":"step_start","timestamp":1,"sessionID":"ses_abc","part":{"type":"step-start"}}"#,
                r#"{"type":"text","timestamp":2,"sessionID":"ses_abc","part":{"type":"text","text":"first"}}"#,
                r#"{"type":"tool_use","timestamp":3,"sessionID":"ses_abc","part":{"type":"tool","tool":"bash"}}"#,
                r#"{"type":"text","timestamp":4,"sessionID":"ses_abc","part":{"type":"text","text":"did it"}}"#,
                r#"{"type":"step_finish","timestamp":5,"sessionID":"ses_abc","part":{"type":"step-finish"}}"#,
            ],
        );
        assert_eq!(
            seen,
            Observed {
                session_id: Some("ses_abc".into()),
                summary: Some("did it".into()),
                ..Observed::default()
            }
        );
        let failed = observe_lines(
            &o,
            Stream::Stdout,
            &[
                r#"{"type":"error","sessionID":"ses_abc","error":{"name":"APIError","data":{"message":"rate limited"}}}"#,
            ],
        );
        assert_eq!(failed.error.as_deref(), Some("rate limited"));
        assert!(!failed.session_lost);

        let lost = observe_lines(&o, Stream::Stderr, &["Error: Session not found"]);
        assert!(lost.session_lost);
        let said = observe_lines(
            &o,
            Stream::Stdout,
            &[
                r#"{"type":"text","sessionID":"ses_abc","part":{"type":"text","text":"Session not found is an error"}}"#,
            ],
        );
        assert!(!said.session_lost, "the agent's words are not opencode's");
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let (root, o) = prepared(Opencode::new, &[("auth.json", "{\"anthropic\":1}")]);
        let data = root.path().join(".cairn/state/opencode/data/opencode");
        assert_eq!(
            fs::read_to_string(data.join("auth.json")).unwrap(),
            "{\"anthropic\":1}"
        );
        assert!(!data.join("mcp-auth.json").exists());
        assert_excluded(
            &o,
            root.path(),
            &[
                (".cairn/state/opencode/data/opencode/auth.json", true),
                (".cairn/state/opencode/data/opencode/mcp-auth.json", true),
                (".cairn/state/opencode/data/opencode/opencode.db", false),
                (".cairn/state/opencode/data/opencode/opencode.db-wal", false),
                (".cairn/state/opencode/config/opencode/opencode.json", false),
                ("app/auth.json", false),
            ],
        );
    }
}
