//! The Codex CLI adapter (`codex`), per ../shared/reference/harnesses.md.
//!
//! - State: `CODEX_HOME=<root>/.cairn/state/codex` (created before the first
//!   turn: Codex refuses to start when it does not exist), so rollouts
//!   (`sessions/YYYY/MM/DD/rollout-<ts>-<uuid>.jsonl`) live in the workspace
//!   and travel with its checkpoints. Codex rebuilds its state DB from them.
//! - First turn: `exec --json <message>` (Codex chooses the id); every later
//!   turn, and every turn after a restore: `exec resume <id> <message>
//!   --json`. `model` and `args` follow `--json`; a message starting with
//!   `-` moves the options first and puts the id and message after `--`.
//! - The session id comes from `{"type":"thread.started","thread_id":…}`;
//!   the turn's summary is the text of the last
//!   `{"type":"item.completed","item":{"type":"agent_message","text":…}}`
//!   (else the runner takes the last non-empty stdout line);
//!   `{"type":"turn.failed","error":{"message":…}}` marks a failed turn.
//!   `no rollout found for thread id <id>` means the conversation is gone.
//! - Credentials (`auth.json` in `CODEX_HOME`) are never checkpointed; they
//!   are copied in fresh from `credentials_dir` (default `$HOME/.codex`)
//!   before the first turn.
//! - No fork: a forked workspace's first turn gets the handoff briefing.
//!
//! Settings: `binary` (default `codex`), `model`, `args`, `cwd`,
//! `credentials_dir`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{
    Harness, HarnessCommand, HarnessError, Observed, Stream, TurnRequest, check_settings,
    copy_credentials, cwd_setting, home_subdir, split_args,
};

const NAME: &str = "codex";
const SETTINGS: &[&str] = cairn_proto::runs::CODEX_SETTINGS;
/// `CODEX_HOME`, relative to the root.
pub const STATE_DIR: &str = ".cairn/state/codex";
/// Files in `CODEX_HOME` that hold credentials.
pub const CREDENTIAL_FILES: &[&str] = &["auth.json"];
/// What `codex exec resume` prints when no rollout has the id.
pub const SESSION_LOST: &str = "no rollout found for thread id";

/// Codex, configured for one run.
#[derive(Debug, Clone)]
pub struct Codex {
    binary: String,
    model: Option<String>,
    extra_args: Vec<String>,
    cwd: Option<PathBuf>,
    home: PathBuf,
    credentials_dir: Option<PathBuf>,
}

impl Codex {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        check_settings(NAME, config, SETTINGS)?;
        let setting = |key: &str| {
            config
                .get(key)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        Ok(Self {
            binary: setting("binary").unwrap_or_else(|| "codex".to_owned()),
            model: setting("model"),
            extra_args: split_args(NAME, setting("args"))?,
            cwd: cwd_setting(NAME, config, root)?,
            home: root.join(STATE_DIR),
            credentials_dir: setting("credentials_dir")
                .map(PathBuf::from)
                .or_else(|| home_subdir(".codex")),
        })
    }

    /// `CODEX_HOME` of the run.
    pub fn home(&self) -> &Path {
        &self.home
    }
}

impl Harness for Codex {
    fn name(&self) -> &str {
        NAME
    }

    fn can_resume(&self) -> bool {
        true
    }

    fn excludes(&self) -> Vec<String> {
        CREDENTIAL_FILES
            .iter()
            .map(|f| format!("/{STATE_DIR}/{f}"))
            .collect()
    }

    fn prepare(&self) -> Result<(), HarnessError> {
        copy_credentials(
            NAME,
            &self.home,
            &self.home,
            self.credentials_dir.as_deref(),
            CREDENTIAL_FILES,
        )
    }

    fn configured_cwd(&self) -> Option<PathBuf> {
        self.cwd.clone()
    }

    fn command(&self, turn: &TurnRequest, cwd: &Path) -> Result<HarnessCommand, HarnessError> {
        let message = turn.message().to_owned();
        let mut options = vec!["--json".to_owned()];
        if let Some(model) = &self.model {
            options.push("--model".into());
            options.push(model.clone());
        }
        options.extend(self.extra_args.iter().cloned());
        let mut args = vec!["exec".to_owned()];
        let positionals = match turn {
            TurnRequest::Start { .. } => vec![message],
            // Codex cannot fork non-interactively; the runner never asks
            // (can_fork is false), and continuing the source's conversation
            // instead would be wrong.
            TurnRequest::Resume { fork: true, .. } => {
                return Err(HarnessError::BadSetting {
                    harness: NAME,
                    key: "binary",
                    reason: "the codex adapter cannot fork a conversation".into(),
                });
            }
            TurnRequest::Resume { session_id, .. } => {
                args.push("resume".into());
                vec![session_id.clone(), message]
            }
        };
        if positionals.iter().any(|p| p.starts_with('-')) {
            // Otherwise the id or message would be read as an option.
            args.extend(options);
            args.push("--".into());
            args.extend(positionals);
        } else {
            args.extend(positionals);
            args.extend(options);
        }
        Ok(HarnessCommand {
            program: self.binary.clone(),
            args,
            env: vec![(
                "CODEX_HOME".into(),
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
            Some("thread.started") => {
                if let Some(id) = event["thread_id"].as_str().filter(|id| !id.is_empty()) {
                    observed.session_id.get_or_insert_with(|| id.to_owned());
                }
            }
            Some("item.completed") if event["item"]["type"] == "agent_message" => {
                if let Some(text) = event["item"]["text"].as_str() {
                    observed.summary = Some(text.to_owned());
                }
            }
            Some("turn.failed") => {
                let message = event["error"]["message"]
                    .as_str()
                    .filter(|m| !m.is_empty())
                    .unwrap_or("codex reported a failed turn");
                observed.error = Some(message.to_owned());
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn codex(config: &[(&str, &str)], root: &Path) -> Codex {
        let config = config
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Codex::new(&config, root).unwrap()
    }

    #[test]
    fn turns_use_the_exact_flags() {
        let c = codex(
            &[("model", "gpt-5"), ("args", "--sandbox 'workspace-write'")],
            Path::new("/workspace"),
        );
        let start = c
            .command(
                &TurnRequest::Start {
                    message: "fix it".into(),
                },
                Path::new("/workspace/app"),
            )
            .unwrap();
        assert_eq!(start.program, "codex");
        assert_eq!(
            start.args,
            [
                "exec",
                "fix it",
                "--json",
                "--model",
                "gpt-5",
                "--sandbox",
                "workspace-write"
            ]
        );
        assert_eq!(
            start.env,
            [(
                "CODEX_HOME".to_owned(),
                "/workspace/.cairn/state/codex".to_owned()
            )]
        );
        assert_eq!(start.cwd, Path::new("/workspace/app"));

        let plain = codex(&[("binary", "/opt/codex")], Path::new("/workspace"));
        let resume = |message: &str| {
            plain
                .command(
                    &TurnRequest::Resume {
                        session_id: "t-1".into(),
                        message: message.into(),
                        fork: false,
                    },
                    Path::new("/w"),
                )
                .unwrap()
                .args
        };
        assert_eq!(
            resume("go on"),
            ["exec", "resume", "t-1", "go on", "--json"]
        );
        assert_eq!(
            resume("-v please"),
            ["exec", "resume", "--json", "--", "t-1", "-v please"]
        );
        assert!(!plain.can_fork());
    }

    #[test]
    fn the_stream_gives_session_summary_and_errors() {
        let c = codex(&[], Path::new("/workspace"));
        let mut seen = Observed::default();
        for line in [
            r#"{"type":"thread.started","thread_id":"0199a213-81c0-7800-8aa1-bbab2a035a53"}"#,
            r#"{"type":"turn.started"}"#,
            r#"{"type":"item.completed","item":{"id":"item_0","type":"reasoning","text":"hmm"}}"#,
            r#"{"type":"item.completed","item":{"id":"item_1","type":"agent_message","text":"first"}}"#,
            r#"{"type":"item.completed","item":{"id":"item_2","type":"agent_message","text":"did it"}}"#,
            r#"{"type":"turn.completed","usage":{"input_tokens":1}}"#,
            "not json",
        ] {
            c.observe(Stream::Stdout, line, &mut seen);
        }
        assert_eq!(
            seen,
            Observed {
                session_id: Some("0199a213-81c0-7800-8aa1-bbab2a035a53".into()),
                summary: Some("did it".into()),
                ..Observed::default()
            }
        );
        let mut failed = Observed::default();
        c.observe(
            Stream::Stdout,
            r#"{"type":"turn.failed","error":{"message":"quota exceeded"}}"#,
            &mut failed,
        );
        assert_eq!(failed.error.as_deref(), Some("quota exceeded"));
        let mut lost = Observed::default();
        c.observe(
            Stream::Stderr,
            "Error: thread/resume failed: no rollout found for thread id 1234",
            &mut lost,
        );
        assert!(lost.session_lost);
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let root = tempfile::tempdir().unwrap();
        let home = tempfile::tempdir().unwrap();
        fs::write(home.path().join("auth.json"), "{\"token\":1}").unwrap();
        let c = codex(
            &[("credentials_dir", &home.path().to_string_lossy())],
            root.path(),
        );
        c.prepare().unwrap();
        assert!(c.home().is_dir(), "CODEX_HOME exists before the first turn");
        let copied = root.path().join(".cairn/state/codex/auth.json");
        assert_eq!(fs::read_to_string(&copied).unwrap(), "{\"token\":1}");
        assert_eq!(
            fs::metadata(&copied).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let matcher = crate::scan::exclude_matcher(root.path(), &c.excludes())
            .unwrap()
            .unwrap();
        for (path, excluded) in [
            (".cairn/state/codex/auth.json", true),
            (
                ".cairn/state/codex/sessions/2026/01/01/rollout-x.jsonl",
                false,
            ),
            ("app/auth.json", false),
        ] {
            assert_eq!(
                matcher.matched(root.path().join(path), false).is_ignore(),
                excluded,
                "{path}"
            );
        }
    }
}
