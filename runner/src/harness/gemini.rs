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
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{
    Harness, HarnessCommand, HarnessError, Observed, Stream, TurnRequest, check_settings,
    copy_credentials, cwd_setting, home_subdir, new_session_id, split_args,
};

const NAME: &str = "gemini";
const SETTINGS: &[&str] = cairn_proto::runs::GEMINI_SETTINGS;
/// `GEMINI_CLI_HOME`, relative to the root.
pub const STATE_DIR: &str = ".cairn/state/gemini";
/// Where Gemini CLI keeps its files under `GEMINI_CLI_HOME`.
pub const GEMINI_DIR: &str = ".gemini";
/// Files in `$GEMINI_CLI_HOME/.gemini` that hold credentials.
pub const CREDENTIAL_FILES: &[&str] = &[
    "oauth_creds.json",
    "google_accounts.json",
    "mcp-oauth-tokens.json",
    "a2a-oauth-tokens.json",
    "gemini-credentials.json",
];
/// What `gemini --resume` prints (exit 42) when no chat has the id.
pub const SESSION_LOST: &str = "Error resuming session: Invalid session identifier";

/// Gemini CLI, configured for one run.
#[derive(Debug, Clone)]
pub struct Gemini {
    binary: String,
    model: Option<String>,
    extra_args: Vec<String>,
    cwd: Option<PathBuf>,
    home: PathBuf,
    credentials_dir: Option<PathBuf>,
}

impl Gemini {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        check_settings(NAME, config, SETTINGS)?;
        let setting = |key: &str| {
            config
                .get(key)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        Ok(Self {
            binary: setting("binary").unwrap_or_else(|| "gemini".to_owned()),
            model: setting("model"),
            extra_args: split_args(NAME, setting("args"))?,
            cwd: cwd_setting(NAME, config, root)?,
            home: root.join(STATE_DIR),
            credentials_dir: setting("credentials_dir")
                .map(PathBuf::from)
                .or_else(|| home_subdir(GEMINI_DIR)),
        })
    }

    /// `GEMINI_CLI_HOME` of the run.
    pub fn home(&self) -> &Path {
        &self.home
    }
}

impl Harness for Gemini {
    fn name(&self) -> &str {
        NAME
    }

    fn can_resume(&self) -> bool {
        true
    }

    fn excludes(&self) -> Vec<String> {
        CREDENTIAL_FILES
            .iter()
            .map(|f| format!("/{STATE_DIR}/{GEMINI_DIR}/{f}"))
            .collect()
    }

    fn prepare(&self) -> Result<(), HarnessError> {
        copy_credentials(
            NAME,
            &self.home,
            &self.home.join(GEMINI_DIR),
            self.credentials_dir.as_deref(),
            CREDENTIAL_FILES,
        )
    }

    fn configured_cwd(&self) -> Option<PathBuf> {
        self.cwd.clone()
    }

    fn command(&self, turn: &TurnRequest, cwd: &Path) -> Result<HarnessCommand, HarnessError> {
        let message = turn.message();
        let mut args = if message.starts_with('-') {
            // Otherwise the message would be read as an option.
            vec![format!("--prompt={message}")]
        } else {
            vec!["-p".to_owned(), message.to_owned()]
        };
        args.push("--output-format".into());
        args.push("stream-json".into());
        match turn {
            TurnRequest::Start { .. } => {
                args.push("--session-id".into());
                args.push(new_session_id());
            }
            TurnRequest::Resume { fork: true, .. } => {
                return Err(HarnessError::BadSetting {
                    harness: NAME,
                    key: "binary",
                    reason: "the gemini adapter cannot fork a conversation".into(),
                });
            }
            TurnRequest::Resume { session_id, .. } => {
                args.push("--resume".into());
                args.push(session_id.clone());
            }
        }
        if let Some(model) = &self.model {
            args.push("--model".into());
            args.push(model.clone());
        }
        args.extend(self.extra_args.iter().cloned());
        Ok(HarnessCommand {
            program: self.binary.clone(),
            args,
            env: vec![(
                "GEMINI_CLI_HOME".into(),
                self.home.to_string_lossy().into_owned(),
            )],
            cwd: cwd.to_path_buf(),
            session_at_start: None,
        })
    }

    fn observe(&self, stream: Stream, line: &str, observed: &mut Observed) {
        if line.contains(SESSION_LOST) {
            observed.session_lost = true;
        }
        if stream != Stream::Stdout || !line.starts_with('{') {
            return;
        }
        let Ok(event) = serde_json::from_str::<Value>(line) else {
            return;
        };
        match event["type"].as_str() {
            Some("init") => {
                if let Some(id) = event["session_id"].as_str().filter(|id| !id.is_empty()) {
                    observed.session_id.get_or_insert_with(|| id.to_owned());
                }
            }
            Some("result") => {
                if event["status"] == "error" {
                    let message = event["error"]["message"]
                        .as_str()
                        .filter(|m| !m.is_empty())
                        .unwrap_or("gemini reported an error");
                    observed.error = Some(message.to_owned());
                } else if let Some(text) = event["response"].as_str() {
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

    use super::*;

    fn gemini(config: &[(&str, &str)], root: &Path) -> Gemini {
        let config = config
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Gemini::new(&config, root).unwrap()
    }

    #[test]
    fn turns_use_the_exact_flags() {
        let g = gemini(
            &[("model", "gemini-2.5-pro"), ("args", "--yolo")],
            Path::new("/workspace"),
        );
        let start = g
            .command(
                &TurnRequest::Start {
                    message: "fix it".into(),
                },
                Path::new("/workspace/app"),
            )
            .unwrap();
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
        assert!(super::super::is_uuid(&start.args[5]), "{:?}", start.args);
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
        let resume = plain
            .command(
                &TurnRequest::Resume {
                    session_id: "s-1".into(),
                    message: "-v please".into(),
                    fork: false,
                },
                Path::new("/w"),
            )
            .unwrap();
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
        let mut seen = Observed::default();
        for line in [
            r#"{"type":"init","timestamp":"t","session_id":"abc","model":"m"}"#,
            r#"{"type":"message","role":"assistant","content":"did","delta":true}"#,
            r#"{"type":"result","status":"success","response":"did it","stats":{}}"#,
        ] {
            g.observe(Stream::Stdout, line, &mut seen);
        }
        assert_eq!(
            seen,
            Observed {
                session_id: Some("abc".into()),
                summary: Some("did it".into()),
                ..Observed::default()
            }
        );
        let mut failed = Observed::default();
        g.observe(
            Stream::Stdout,
            r#"{"type":"result","status":"error","error":{"type":"x","message":"quota"}}"#,
            &mut failed,
        );
        assert_eq!(failed.error.as_deref(), Some("quota"));
        let mut lost = Observed::default();
        g.observe(
            Stream::Stderr,
            r#"Error resuming session: Invalid session identifier "1234". Use --list-sessions"#,
            &mut lost,
        );
        assert!(lost.session_lost);
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let root = tempfile::tempdir().unwrap();
        let home = tempfile::tempdir().unwrap();
        fs::write(home.path().join("oauth_creds.json"), "{\"token\":1}").unwrap();
        let g = gemini(
            &[("credentials_dir", &home.path().to_string_lossy())],
            root.path(),
        );
        g.prepare().unwrap();
        let copied = root
            .path()
            .join(".cairn/state/gemini/.gemini/oauth_creds.json");
        assert_eq!(fs::read_to_string(&copied).unwrap(), "{\"token\":1}");
        assert!(!g.home().join(".gemini/google_accounts.json").exists());
        let matcher = crate::scan::exclude_matcher(root.path(), &g.excludes())
            .unwrap()
            .unwrap();
        for (path, excluded) in [
            (".cairn/state/gemini/.gemini/oauth_creds.json", true),
            (".cairn/state/gemini/.gemini/gemini-credentials.json", true),
            (".cairn/state/gemini/.gemini/projects.json", false),
            (
                ".cairn/state/gemini/.gemini/tmp/app/chats/session-x.jsonl",
                false,
            ),
            ("app/oauth_creds.json", false),
        ] {
            assert_eq!(
                matcher.matched(root.path().join(path), false).is_ignore(),
                excluded,
                "{path}"
            );
        }
    }
}
