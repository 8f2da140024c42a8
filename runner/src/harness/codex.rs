//! The Codex CLI adapter (`codex`), per ../shared/reference/harnesses.md.
//!
//! - State: `CODEX_HOME=<root>/.cairn/state/codex` (created before the first
//!   turn: Codex refuses to start when it does not exist), so rollouts
//!   (`sessions/YYYY/MM/DD/rollout-<ts>-<uuid>.jsonl`) live in the workspace
//!   and travel with its checkpoints. Codex rebuilds its state DB from them.
//! - First turn: `exec <message> --json --skip-git-repo-check` (Codex
//!   chooses the id); every later turn, and every turn after a restore:
//!   `exec resume <id> <message> --json --skip-git-repo-check`; a forked
//!   workspace's first turn: `exec fork <id> <message> --json
//!   --skip-git-repo-check`, which continues a copy under a new id (reported
//!   as usual) and leaves the source as it is. `--skip-git-repo-check`:
//!   Codex refuses to run outside a git repository (exit 1, `Not inside a
//!   trusted directory …`), which the cwd is when the workspace holds no
//!   repository or several. `model` and `args` follow; a message starting
//!   with `-` moves the options first and puts the id and message after
//!   `--`.
//! - The session id comes from `{"type":"thread.started","thread_id":…}`;
//!   the turn's summary is the text of the last
//!   `{"type":"item.completed","item":{"type":"agent_message","text":…}}`
//!   (else the runner takes the last non-empty stdout line);
//!   `{"type":"turn.failed","error":{"message":…}}` marks a failed turn.
//!   `{"type":"error"}` events alone do not: Codex sends them for retries it
//!   then gets past (`Reconnecting...`). `no rollout found for thread id
//!   <id>` means the conversation is gone.
//! - Credentials (`auth.json` in `CODEX_HOME`) are never checkpointed; they
//!   are copied in fresh from `credentials_dir` (default `$HOME/.codex`)
//!   before the first turn. Nor is `shell_snapshots/`: Codex snapshots the
//!   shell's environment there, secret variables included.
//!
//! Settings: `binary` (default `codex`), `model`, `args`, `cwd`,
//! `credentials_dir`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::{Cli, CliSpec, CliTurns, HarnessError, Invocation, Observed, TurnRequest, non_empty};

const CLI: CliSpec = CliSpec {
    name: "codex",
    settings: cairn_proto::runs::CODEX_SETTINGS,
    state_dir: ".cairn/state/codex",
    state_env: Some("CODEX_HOME"),
    credentials_subdir: None,
    credential_files: &["auth.json"],
    // The shell's environment, secrets included, in plain text.
    more_excludes: &["shell_snapshots/**"],
    home_credentials: ".codex",
    // What `codex exec resume` prints when no rollout has the id.
    session_lost: &["no rollout found for thread id"],
    // `codex exec fork <id>`.
    can_fork: true,
};

/// Codex, configured for one run.
#[derive(Debug, Clone)]
pub struct Codex(Cli);

impl Codex {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        Cli::new(&CLI, config, root).map(Self)
    }
}

impl CliTurns for Codex {
    fn cli(&self) -> &Cli {
        &self.0
    }

    fn invocation(&self, turn: &TurnRequest, _cwd: &Path) -> Invocation {
        let message = turn.message().to_owned();
        let options = ["--json".to_owned(), "--skip-git-repo-check".to_owned()]
            .into_iter()
            .chain(self.0.options());
        let (mut args, positionals) = match turn {
            TurnRequest::Start { .. } => (vec!["exec".to_owned()], vec![message]),
            TurnRequest::Resume {
                session_id, fork, ..
            } => (
                vec![
                    "exec".to_owned(),
                    if *fork { "fork" } else { "resume" }.to_owned(),
                ],
                vec![session_id.clone(), message],
            ),
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
        args.into()
    }

    fn observe_event(&self, event: &Value, observed: &mut Observed) {
        match event["type"].as_str() {
            Some("thread.started") => {
                if let Some(id) = non_empty(&event["thread_id"]) {
                    observed.session_id.get_or_insert_with(|| id.to_owned());
                }
            }
            Some("item.completed") if event["item"]["type"] == "agent_message" => {
                if let Some(text) = event["item"]["text"].as_str() {
                    observed.summary = Some(text.to_owned());
                }
            }
            Some("turn.failed") => {
                let message =
                    non_empty(&event["error"]["message"]).unwrap_or("codex reported a failed turn");
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

    use super::super::testing::*;
    use super::*;

    fn codex(config: &[(&str, &str)], root: &Path) -> Codex {
        Codex::new(&settings(config), root).unwrap()
    }

    #[test]
    fn turns_use_the_exact_flags() {
        let c = codex(
            &[("model", "gpt-5"), ("args", "--sandbox 'workspace-write'")],
            Path::new("/workspace"),
        );
        let start = start_turn(&c, "fix it", "/workspace/app");
        assert_eq!(start.program, "codex");
        assert_eq!(
            start.args,
            [
                "exec",
                "fix it",
                "--json",
                "--skip-git-repo-check",
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
        let resume = |message: &str| resume_turn(&plain, "t-1", message, false).unwrap().args;
        assert_eq!(
            resume("go on"),
            [
                "exec",
                "resume",
                "t-1",
                "go on",
                "--json",
                "--skip-git-repo-check"
            ]
        );
        assert_eq!(
            resume("-v please"),
            [
                "exec",
                "resume",
                "--json",
                "--skip-git-repo-check",
                "--",
                "t-1",
                "-v please"
            ]
        );
        assert!(plain.can_fork());
        assert_eq!(
            resume_turn(&plain, "t-1", "go on", true).unwrap().args,
            [
                "exec",
                "fork",
                "t-1",
                "go on",
                "--json",
                "--skip-git-repo-check"
            ]
        );
    }

    #[test]
    fn the_stream_gives_session_summary_and_errors() {
        let c = codex(&[], Path::new("/workspace"));
        let seen = observe_lines(
            &c,
            Stream::Stdout,
            &[
                r#"{"type":"thread.started","thread_id":"0199a213-81c0-7800-8aa1-bbab2a035a53"}"#,
                r#"{"type":"turn.started"}"#,
                r#"{"type":"item.completed","item":{"id":"item_0","type":"reasoning","text":"hmm"}}"#,
                r#"{"type":"item.completed","item":{"id":"item_1","type":"agent_message","text":"first"}}"#,
                r#"{"type":"item.completed","item":{"id":"item_2","type":"agent_message","text":"did it"}}"#,
                r#"{"type":"turn.completed","usage":{"input_tokens":1}}"#,
                "not json",
            ],
        );
        assert_eq!(
            seen,
            Observed {
                session_id: Some("0199a213-81c0-7800-8aa1-bbab2a035a53".into()),
                summary: Some("did it".into()),
                ..Observed::default()
            }
        );
        let failed = observe_lines(
            &c,
            Stream::Stdout,
            &[r#"{"type":"turn.failed","error":{"message":"quota exceeded"}}"#],
        );
        assert_eq!(failed.error.as_deref(), Some("quota exceeded"));
        // Seen from the real CLI: retries it gets past are no failure.
        let retried = observe_lines(
            &c,
            Stream::Stdout,
            &[
                r#"{"type":"error","message":"Reconnecting... waiting for network (Connection failed: error sending request)"}"#,
                r#"{"type":"item.completed","item":{"id":"item_1","type":"agent_message","text":"did it"}}"#,
                r#"{"type":"turn.completed","usage":{}}"#,
            ],
        );
        assert_eq!(retried.error, None);
        assert_eq!(retried.summary.as_deref(), Some("did it"));
        let lost = observe_lines(
            &c,
            Stream::Stderr,
            &["Error: thread/resume failed: no rollout found for thread id 1234"],
        );
        assert!(lost.session_lost);
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let (root, c) = prepared(Codex::new, &[("auth.json", "{\"token\":1}")]);
        let home = root.path().join(".cairn/state/codex");
        assert!(home.is_dir(), "CODEX_HOME exists before the first turn");
        let copied = home.join("auth.json");
        assert_eq!(fs::read_to_string(&copied).unwrap(), "{\"token\":1}");
        assert_eq!(
            fs::metadata(&copied).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_excluded(
            &c,
            root.path(),
            &[
                (".cairn/state/codex/auth.json", true),
                (".cairn/state/codex/shell_snapshots/abc.sh", true),
                (
                    ".cairn/state/codex/sessions/2026/01/01/rollout-x.jsonl",
                    false,
                ),
                ("app/auth.json", false),
            ],
        );
    }
}
