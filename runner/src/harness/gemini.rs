//! The Gemini CLI adapter (`gemini`), per ../shared/reference/harnesses.md.
//!
//! - State: `GEMINI_CLI_HOME=<root>/.cairn/state/gemini` (Gemini CLI uses it
//!   in place of the home directory), so chats
//!   (`.gemini/tmp/<slug>/chats/session-<ts>-<id8>.jsonl`, with the slug
//!   registry `.gemini/projects.json`) live in the workspace and travel with
//!   its checkpoints.
//! - First turn: `-p <message> --output-format stream-json --session-id
//!   <new uuid>` (the runner chooses the id); every later turn, and every
//!   turn after a restore: `-p <message> --output-format stream-json
//!   --resume <id>` (never both flags). `model` and `args` follow. A message
//!   starting with `-` is passed as `--prompt=<message>`.
//! - The session id comes from `{"type":"init","session_id":…}`; the turn's
//!   summary is the `response` of the final `{"type":"result"}` event (the
//!   field Gemini CLI's `--output-format json` uses for the answer), else
//!   the runner takes the last non-empty stdout line; a result with
//!   `"status":"error"` marks a failed turn (`error.message` says why).
//!   `Error resuming session: Invalid session identifier "<id>"` (exit 42)
//!   means the conversation is gone.
//! - Credentials (`oauth_creds.json`, `google_accounts.json`,
//!   `mcp-oauth-tokens.json`, `a2a-oauth-tokens.json`,
//!   `gemini-credentials.json` under `$GEMINI_CLI_HOME/.gemini/`) are never
//!   checkpointed; they are copied in fresh from `credentials_dir` (default
//!   `$HOME/.gemini`) before the first turn.
//! - No fork: a forked workspace's first turn gets the handoff briefing.
//!
//! Settings: `binary` (default `gemini`), `model`, `args`, `cwd`,
//! `credentials_dir`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::{
    Cli, CliSpec, CliTurns, HarnessError, Invocation, Observed, TurnRequest, message_option,
    new_session_id, non_empty,
};

const CLI: CliSpec = CliSpec {
    name: "gemini",
    settings: cairn_proto::runs::GEMINI_SETTINGS,
    state_dir: ".cairn/state/gemini",
    state_env: Some("GEMINI_CLI_HOME"),
    // Where Gemini CLI keeps its files under `GEMINI_CLI_HOME`.
    credentials_subdir: Some(".gemini"),
    credential_files: &[
        "oauth_creds.json",
        "google_accounts.json",
        "mcp-oauth-tokens.json",
        "a2a-oauth-tokens.json",
        "gemini-credentials.json",
    ],
    more_excludes: &[],
    home_credentials: ".gemini",
    // What `gemini --resume` prints (exit 42) when no chat has the id.
    session_lost: Some("Error resuming session: Invalid session identifier"),
    can_fork: false,
};

/// Gemini CLI, configured for one run.
#[derive(Debug, Clone)]
pub struct Gemini(Cli);

impl Gemini {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        Cli::new(&CLI, config, root).map(Self)
    }
}

impl CliTurns for Gemini {
    fn cli(&self) -> &Cli {
        &self.0
    }

    fn invocation(&self, turn: &TurnRequest, _cwd: &Path) -> Invocation {
        let mut args = message_option("-p", "--prompt=", turn.message());
        args.extend(["--output-format".into(), "stream-json".into()]);
        match turn {
            TurnRequest::Start { .. } => args.extend(["--session-id".into(), new_session_id()]),
            TurnRequest::Resume { session_id, .. } => {
                args.extend(["--resume".into(), session_id.clone()]);
            }
        }
        args.extend(self.0.options());
        args.into()
    }

    fn observe_event(&self, event: &Value, observed: &mut Observed) {
        match event["type"].as_str() {
            Some("init") => {
                if let Some(id) = non_empty(&event["session_id"]) {
                    observed.session_id.get_or_insert_with(|| id.to_owned());
                }
            }
            Some("result") if event["status"] == "error" => {
                let message =
                    non_empty(&event["error"]["message"]).unwrap_or("gemini reported an error");
                observed.error = Some(message.to_owned());
            }
            Some("result") => {
                if let Some(text) = event["response"].as_str() {
                    observed.summary = Some(text.to_owned());
                }
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

    fn gemini(config: &[(&str, &str)], root: &Path) -> Gemini {
        Gemini::new(&settings(config), root).unwrap()
    }

    #[test]
    fn turns_use_the_exact_flags() {
        let g = gemini(
            &[("model", "gemini-2.5-pro"), ("args", "--yolo")],
            Path::new("/workspace"),
        );
        let start = start_turn(&g, "fix it", "/workspace/app");
        assert_eq!(start.program, "gemini");
        assert_eq!(
            &start.args[..5],
            [
                "-p",
                "fix it",
                "--output-format",
                "stream-json",
                "--session-id"
            ]
        );
        assert!(is_uuid(&start.args[5]), "{:?}", start.args);
        assert_eq!(&start.args[6..], ["--model", "gemini-2.5-pro", "--yolo"]);
        assert!(!start.args.contains(&"--resume".to_owned()));
        assert_eq!(
            start.env,
            [(
                "GEMINI_CLI_HOME".to_owned(),
                "/workspace/.cairn/state/gemini".to_owned()
            )]
        );

        let plain = gemini(&[], Path::new("/workspace"));
        let resume = resume_turn(&plain, "s-1", "-v please", false).unwrap();
        assert_eq!(
            resume.args,
            [
                "--prompt=-v please",
                "--output-format",
                "stream-json",
                "--resume",
                "s-1"
            ]
        );
        assert!(!plain.can_fork());
    }

    #[test]
    fn the_stream_gives_session_summary_and_errors() {
        let g = gemini(&[], Path::new("/workspace"));
        let seen = observe_lines(
            &g,
            Stream::Stdout,
            &[
                r#"{"type":"init","timestamp":"t","session_id":"abc","model":"m"}"#,
                r#"{"type":"message","role":"assistant","content":"did","delta":true}"#,
                r#"{"type":"result","status":"success","response":"did it","stats":{}}"#,
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
            &g,
            Stream::Stdout,
            &[r#"{"type":"result","status":"error","error":{"type":"x","message":"quota"}}"#],
        );
        assert_eq!(failed.error.as_deref(), Some("quota"));
        let lost = observe_lines(
            &g,
            Stream::Stderr,
            &[r#"Error resuming session: Invalid session identifier "1234". Use --list-sessions"#],
        );
        assert!(lost.session_lost);
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let (root, g) = prepared(Gemini::new, &[("oauth_creds.json", "{\"token\":1}")]);
        let dot_gemini = root.path().join(".cairn/state/gemini/.gemini");
        let copied = dot_gemini.join("oauth_creds.json");
        assert_eq!(fs::read_to_string(&copied).unwrap(), "{\"token\":1}");
        assert!(!dot_gemini.join("google_accounts.json").exists());
        assert_excluded(
            &g,
            root.path(),
            &[
                (".cairn/state/gemini/.gemini/oauth_creds.json", true),
                (".cairn/state/gemini/.gemini/gemini-credentials.json", true),
                (".cairn/state/gemini/.gemini/projects.json", false),
                (
                    ".cairn/state/gemini/.gemini/tmp/app/chats/session-x.jsonl",
                    false,
                ),
                ("app/oauth_creds.json", false),
            ],
        );
    }
}
