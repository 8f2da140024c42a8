//! The Claude Code adapter (`claude`), per ../shared/reference/harnesses.md.
//!
//! - State: `CLAUDE_CONFIG_DIR=<root>/.cairn/state/claude`, so transcripts
//!   (`projects/<slug of the cwd>/<uuid>.jsonl`) live in the workspace and
//!   travel with its checkpoints.
//! - First turn: `-p --output-format stream-json --verbose --session-id
//!   <new uuid> <prompt>`; every later turn, and every turn after a restore:
//!   `-p --output-format stream-json --verbose --resume <id> <message>`
//!   (never `--session-id` once the transcript exists: Claude Code refuses
//!   it with `Session ID X is already in use.`). The first turn of a forked
//!   workspace adds `--fork-session`: Claude Code copies the conversation
//!   to a new id (reported in the init event) and leaves the original alone.
//! - The session id comes from the stream's first event
//!   `{"type":"system","subtype":"init","session_id":…}`; the turn's summary
//!   from the final `{"type":"result","result":…}` event (`is_error` marks a
//!   failed turn). `No conversation found with session ID: X` means the
//!   conversation is gone.
//! - Credentials (`.credentials.json`, `.claude.json` in the config dir) are
//!   never checkpointed; they are copied in fresh from `credentials_dir`
//!   (default `$HOME/.claude`, outside the workspace) before the first turn.
//!
//! Settings: `binary` (default `claude`), `model`, `args` (extra arguments,
//! split like a shell would), `cwd`, `credentials_dir`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::{
    Cli, CliSpec, CliTurns, HarnessError, Invocation, Observed, TurnRequest, new_session_id,
    non_empty,
};

const CLI: CliSpec = CliSpec {
    name: "claude",
    settings: cairn_proto::runs::CLAUDE_SETTINGS,
    state_dir: ".cairn/state/claude",
    state_env: Some("CLAUDE_CONFIG_DIR"),
    credentials_subdir: None,
    credential_files: &[".credentials.json", ".claude.json"],
    // Claude Code keeps copies of .claude.json next to it and in backups/.
    // Copies of `.claude.json`, and the shell environments Claude Code
    // snapshots (secret variables included).
    more_excludes: &[
        ".claude.json.backup*",
        "backups/.claude.json*",
        "shell-snapshots/**",
    ],
    home_credentials: ".claude",
    // What Claude Code prints when `--resume` names no transcript under the
    // cwd's slug.
    session_lost: &["No conversation found with session ID:"],
    can_fork: true,
};

/// Claude Code, configured for one run.
#[derive(Debug, Clone)]
pub struct Claude(Cli);

impl Claude {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        Cli::new(&CLI, config, root).map(Self)
    }
}

impl CliTurns for Claude {
    fn cli(&self) -> &Cli {
        &self.0
    }

    fn invocation(&self, turn: &TurnRequest, _cwd: &Path) -> Invocation {
        let mut args: Vec<String> = ["-p", "--output-format", "stream-json", "--verbose"]
            .map(String::from)
            .into();
        match turn {
            TurnRequest::Start { .. } => args.extend(["--session-id".into(), new_session_id()]),
            TurnRequest::Resume {
                session_id, fork, ..
            } => {
                args.extend(["--resume".into(), session_id.clone()]);
                if *fork {
                    args.push("--fork-session".into());
                }
            }
        }
        args.extend(self.0.options());
        let message = turn.message();
        if message.starts_with('-') {
            // Otherwise the message would be read as an option.
            args.push("--".into());
        }
        args.push(message.to_owned());
        args.into()
    }

    fn observe_event(&self, event: &Value, observed: &mut Observed) {
        match (event["type"].as_str(), event["subtype"].as_str()) {
            (Some("system"), Some("init")) => {
                if let Some(id) = non_empty(&event["session_id"]) {
                    observed.session_id = Some(id.to_owned());
                }
            }
            (Some("result"), subtype) => {
                if event["is_error"].as_bool() == Some(true) {
                    let text = non_empty(&event["result"]).map(str::to_owned);
                    observed.error = Some(text.unwrap_or_else(|| {
                        format!("claude reported {}", subtype.unwrap_or("an error"))
                    }));
                } else {
                    observed.summary = event["result"].as_str().map(str::to_owned);
                }
                if let Some(id) = non_empty(&event["session_id"]) {
                    observed.session_id.get_or_insert_with(|| id.to_owned());
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt as _;

    use super::super::testing::*;
    use super::*;

    fn claude(config: &[(&str, &str)]) -> Claude {
        Claude::new(&settings(config), Path::new("/workspace")).unwrap()
    }

    #[test]
    fn turns_use_the_exact_flags() {
        let c = claude(&[
            ("model", "opus"),
            ("args", "--permission-mode 'accept Edits'"),
        ]);
        let start = start_turn(&c, "fix it", "/workspace/app");
        assert_eq!(start.program, "claude");
        assert_eq!(
            &start.args[..5],
            [
                "-p",
                "--output-format",
                "stream-json",
                "--verbose",
                "--session-id"
            ]
        );
        assert!(is_uuid(&start.args[5]), "{:?}", start.args);
        assert_eq!(
            &start.args[6..],
            [
                "--model",
                "opus",
                "--permission-mode",
                "accept Edits",
                "fix it"
            ]
        );
        assert_eq!(
            start.env,
            [(
                "CLAUDE_CONFIG_DIR".to_owned(),
                "/workspace/.cairn/state/claude".to_owned()
            )]
        );
        assert_eq!(start.cwd, Path::new("/workspace/app"));

        let plain = claude(&[("binary", "/opt/claude")]);
        let resume = resume_turn(&plain, "s-1", "-v please", false).unwrap();
        assert_eq!(resume.program, "/opt/claude");
        let resume_s1 = [
            "-p",
            "--output-format",
            "stream-json",
            "--verbose",
            "--resume",
            "s-1",
        ];
        assert_eq!(&resume.args[..6], resume_s1);
        assert_eq!(&resume.args[6..], ["--", "-v please"]);
        let fork = resume_turn(&plain, "s-1", "go on", true).unwrap();
        assert_eq!(&fork.args[..6], resume_s1);
        assert_eq!(&fork.args[6..], ["--fork-session", "go on"]);
    }

    #[test]
    fn the_stream_gives_session_summary_and_errors() {
        let c = claude(&[]);
        let seen = observe_lines(
            &c,
            Stream::Stdout,
            &[
                r#"{"type":"system","subtype":"init","session_id":"abc","tools":[]}"#,
                r#"{"type":"assistant","message":{"content":[]}}"#,
                "not json",
                r#"{"type":"result","subtype":"success","is_error":false,"result":"did it","session_id":"abc"}"#,
            ],
        );
        assert_eq!(
            seen,
            Observed {
                session_id: Some("abc".into()),
                summary: Some("did it".into()),
                ..Observed::default()
            }
        );

        let failed = observe_lines(
            &c,
            Stream::Stdout,
            &[r#"{"type":"result","subtype":"error_max_turns","is_error":true}"#],
        );
        assert_eq!(
            failed.error.as_deref(),
            Some("claude reported error_max_turns")
        );

        let lost = observe_lines(
            &c,
            Stream::Stderr,
            &["No conversation found with session ID: 1234"],
        );
        assert!(lost.session_lost);
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let (root, c) = prepared(Claude::new, &[(".credentials.json", "{\"token\":1}")]);
        let copied = root.path().join(".cairn/state/claude/.credentials.json");
        assert_eq!(fs::read_to_string(&copied).unwrap(), "{\"token\":1}");
        assert_eq!(
            fs::metadata(&copied).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(
            !root
                .path()
                .join(".cairn/state/claude/.claude.json")
                .exists()
        );

        let excludes = c.excludes();
        assert!(excludes.contains(&"/.cairn/state/claude/.credentials.json".to_owned()));
        assert!(excludes.contains(&"/.cairn/state/claude/.claude.json".to_owned()));
        assert_excluded(
            &c,
            root.path(),
            &[
                (".cairn/state/claude/.credentials.json", true),
                (".cairn/state/claude/.claude.json", true),
                (".cairn/state/claude/.claude.json.backup.1700000000", true),
                (
                    ".cairn/state/claude/shell-snapshots/snapshot-bash-1.sh",
                    true,
                ),
                (".cairn/state/claude/projects/-workspace/abc.jsonl", false),
                ("app/.claude.json", false),
            ],
        );
    }
}
