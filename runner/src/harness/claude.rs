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
use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{
    Harness, HarnessCommand, HarnessError, Observed, Stream, TurnRequest, check_settings,
    cwd_setting, new_session_id, template,
};

const NAME: &str = "claude";
const SETTINGS: &[&str] = cairn_proto::runs::CLAUDE_SETTINGS;
/// The config dir, relative to the root.
pub const STATE_DIR: &str = ".cairn/state/claude";
/// Files in the config dir that hold credentials.
pub const CREDENTIAL_FILES: &[&str] = &[".credentials.json", ".claude.json"];
/// What Claude Code prints when `--resume` names no transcript under the cwd's slug.
pub const SESSION_LOST: &str = "No conversation found with session ID:";

/// Claude Code, configured for one run.
#[derive(Debug, Clone)]
pub struct Claude {
    binary: String,
    model: Option<String>,
    extra_args: Vec<String>,
    cwd: Option<PathBuf>,
    config_dir: PathBuf,
    credentials_dir: Option<PathBuf>,
}

impl Claude {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        check_settings(NAME, config, SETTINGS)?;
        let setting = |key: &str| {
            config
                .get(key)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let extra_args = match setting("args") {
            Some(args) => template::split(&args).map_err(|source| HarnessError::Template {
                harness: NAME,
                key: "args",
                source,
            })?,
            None => Vec::new(),
        };
        let credentials_dir = setting("credentials_dir").map(PathBuf::from).or_else(|| {
            std::env::var_os("HOME")
                .filter(|h| !h.is_empty())
                .map(|h| PathBuf::from(h).join(".claude"))
        });
        Ok(Self {
            binary: setting("binary").unwrap_or_else(|| "claude".to_owned()),
            model: setting("model"),
            extra_args,
            cwd: cwd_setting(NAME, config, root)?,
            config_dir: root.join(STATE_DIR),
            credentials_dir,
        })
    }

    /// `CLAUDE_CONFIG_DIR` of the run.
    pub fn config_dir(&self) -> &Path {
        &self.config_dir
    }
}

impl Harness for Claude {
    fn name(&self) -> &str {
        NAME
    }

    fn can_resume(&self) -> bool {
        true
    }

    fn can_fork(&self) -> bool {
        true
    }

    fn excludes(&self) -> Vec<String> {
        let mut patterns: Vec<String> = CREDENTIAL_FILES
            .iter()
            .map(|f| format!("/{STATE_DIR}/{f}"))
            .collect();
        // Claude Code keeps copies of .claude.json next to it and in backups/.
        patterns.push(format!("/{STATE_DIR}/.claude.json.backup*"));
        patterns.push(format!("/{STATE_DIR}/backups/.claude.json*"));
        patterns
    }

    fn prepare(&self) -> Result<(), HarnessError> {
        let prepare_error = |path: &Path| {
            let path = path.to_path_buf();
            move |source| HarnessError::Prepare { path, source }
        };
        fs::create_dir_all(&self.config_dir).map_err(prepare_error(&self.config_dir))?;
        fs::set_permissions(&self.config_dir, fs::Permissions::from_mode(0o700))
            .map_err(prepare_error(&self.config_dir))?;
        let Some(source_dir) = &self.credentials_dir else {
            return Ok(());
        };
        for file in CREDENTIAL_FILES {
            let from = source_dir.join(file);
            if !from.is_file() {
                continue;
            }
            let to = self.config_dir.join(file);
            fs::copy(&from, &to).map_err(prepare_error(&to))?;
            fs::set_permissions(&to, fs::Permissions::from_mode(0o600))
                .map_err(prepare_error(&to))?;
            tracing::debug!(file, from = %source_dir.display(), "claude credentials copied in");
        }
        Ok(())
    }

    fn configured_cwd(&self) -> Option<PathBuf> {
        self.cwd.clone()
    }

    fn command(&self, turn: &TurnRequest, cwd: &Path) -> Result<HarnessCommand, HarnessError> {
        let mut args: Vec<String> = ["-p", "--output-format", "stream-json", "--verbose"]
            .map(String::from)
            .into();
        match turn {
            TurnRequest::Start { .. } => {
                args.push("--session-id".into());
                args.push(new_session_id());
            }
            TurnRequest::Resume {
                session_id, fork, ..
            } => {
                args.push("--resume".into());
                args.push(session_id.clone());
                if *fork {
                    args.push("--fork-session".into());
                }
            }
        }
        if let Some(model) = &self.model {
            args.push("--model".into());
            args.push(model.clone());
        }
        args.extend(self.extra_args.iter().cloned());
        let message = turn.message();
        if message.starts_with('-') {
            // Otherwise the message would be read as an option.
            args.push("--".into());
        }
        args.push(message.to_owned());
        Ok(HarnessCommand {
            program: self.binary.clone(),
            args,
            env: vec![(
                "CLAUDE_CONFIG_DIR".into(),
                self.config_dir.to_string_lossy().into_owned(),
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
        match (event["type"].as_str(), event["subtype"].as_str()) {
            (Some("system"), Some("init")) => {
                if let Some(id) = event["session_id"].as_str().filter(|id| !id.is_empty()) {
                    observed.session_id = Some(id.to_owned());
                }
            }
            (Some("result"), subtype) => {
                let text = event["result"].as_str().map(str::to_owned);
                if event["is_error"].as_bool() == Some(true) {
                    observed.error = Some(text.filter(|t| !t.is_empty()).unwrap_or_else(|| {
                        format!("claude reported {}", subtype.unwrap_or("an error"))
                    }));
                } else {
                    observed.summary = text;
                }
                if let Some(id) = event["session_id"].as_str().filter(|id| !id.is_empty()) {
                    observed.session_id.get_or_insert_with(|| id.to_owned());
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claude(config: &[(&str, &str)]) -> Claude {
        let config = config
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Claude::new(&config, Path::new("/workspace")).unwrap()
    }

    #[test]
    fn turns_use_the_exact_flags() {
        let c = claude(&[
            ("model", "opus"),
            ("args", "--permission-mode 'accept Edits'"),
        ]);
        let start = c
            .command(
                &TurnRequest::Start {
                    message: "fix it".into(),
                },
                Path::new("/workspace/app"),
            )
            .unwrap();
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
        assert!(super::super::is_uuid(&start.args[5]), "{:?}", start.args);
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
        assert_eq!(resume.program, "/opt/claude");
        assert_eq!(
            resume.args,
            [
                "-p",
                "--output-format",
                "stream-json",
                "--verbose",
                "--resume",
                "s-1",
                "--",
                "-v please"
            ]
        );
        let fork = plain
            .command(
                &TurnRequest::Resume {
                    session_id: "s-1".into(),
                    message: "go on".into(),
                    fork: true,
                },
                Path::new("/w"),
            )
            .unwrap();
        assert_eq!(
            fork.args,
            [
                "-p",
                "--output-format",
                "stream-json",
                "--verbose",
                "--resume",
                "s-1",
                "--fork-session",
                "go on"
            ]
        );
    }

    #[test]
    fn the_stream_gives_session_summary_and_errors() {
        let c = claude(&[]);
        let mut seen = Observed::default();
        c.observe(
            Stream::Stdout,
            r#"{"type":"system","subtype":"init","session_id":"abc","tools":[]}"#,
            &mut seen,
        );
        c.observe(
            Stream::Stdout,
            r#"{"type":"assistant","message":{"content":[]}}"#,
            &mut seen,
        );
        c.observe(Stream::Stdout, "not json", &mut seen);
        c.observe(Stream::Stdout, r#"{"type":"result","subtype":"success","is_error":false,"result":"did it","session_id":"abc"}"#, &mut seen);
        assert_eq!(
            seen,
            Observed {
                session_id: Some("abc".into()),
                summary: Some("did it".into()),
                ..Observed::default()
            }
        );

        let mut failed = Observed::default();
        c.observe(
            Stream::Stdout,
            r#"{"type":"result","subtype":"error_max_turns","is_error":true}"#,
            &mut failed,
        );
        assert_eq!(
            failed.error.as_deref(),
            Some("claude reported error_max_turns")
        );

        let mut lost = Observed::default();
        c.observe(
            Stream::Stderr,
            "No conversation found with session ID: 1234",
            &mut lost,
        );
        assert!(lost.session_lost);
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let root = tempfile::tempdir().unwrap();
        let home = tempfile::tempdir().unwrap();
        fs::write(home.path().join(".credentials.json"), "{\"token\":1}").unwrap();
        let config = BTreeMap::from([(
            "credentials_dir".to_owned(),
            home.path().to_string_lossy().into_owned(),
        )]);
        let c = Claude::new(&config, root.path()).unwrap();
        c.prepare().unwrap();
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
        let matcher = crate::scan::exclude_matcher(root.path(), &excludes)
            .unwrap()
            .unwrap();
        for (path, excluded) in [
            (".cairn/state/claude/.credentials.json", true),
            (".cairn/state/claude/.claude.json", true),
            (".cairn/state/claude/.claude.json.backup.1700000000", true),
            (".cairn/state/claude/projects/-workspace/abc.jsonl", false),
            ("app/.claude.json", false),
        ] {
            assert_eq!(
                matcher.matched(root.path().join(path), false).is_ignore(),
                excluded,
                "{path}"
            );
        }
    }
}
