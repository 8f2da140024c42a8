//! The Aider adapter (`aider`), per ../shared/reference/harnesses.md.
//!
//! - Aider has no conversation ids and cannot continue a conversation by
//!   id ([`Harness::can_resume`](super::Harness::can_resume) is false): the
//!   runner starts every conversation after the first with the handoff
//!   briefing, labelled as a lossy handoff. So that a workspace's station
//!   still records that there was a conversation (and its next run knows
//!   to brief), the runner names each new conversation with a new UUID of
//!   its own, known as the turn starts.
//! - State: Aider has no state variable; its history files are pointed into
//!   `<root>/.cairn/state/aider/` by flags — `--chat-history-file
//!   .aider.chat.history.md`, `--input-history-file .aider.input.history` —
//!   and `--restore-chat-history` has Aider read the chat history back, so
//!   a new conversation (on any host, after a restore) still sees what was
//!   said before, as far as Aider restores it.
//! - Every turn: `--chat-history-file <f> --input-history-file <f>
//!   --restore-chat-history --env-file <state>/.env --yes-always
//!   --no-gitignore [model and args] --message <message>` (`--yes-always`:
//!   nobody is there to answer Aider's confirmations; `--no-gitignore`:
//!   else Aider writes `.aider*` into the user's `.gitignore`). A message
//!   starting with `-` is passed as `--message=<message>`.
//! - Output is plain text: the turn's summary is the last non-empty line of
//!   stdout that is not Aider's own bookkeeping after the reply (`Tokens: …
//!   sent, … received.`, `Cost: …`, `Applied edit to …`, `Commit …`).
//!   Aider exits 0 when the provider refused it, so `The API provider is not
//!   able to authenticate you` marks a failed turn. With no model and no
//!   key it offers a browser login and waits minutes for it: `No LLM model
//!   was specified and no API keys were provided.` stops the turn at once
//!   as failed.
//! - Credentials: the keys file `.env` (Aider's `.env` format) is copied
//!   from `credentials_dir` (default `$HOME/.aider`) into
//!   `.cairn/state/aider/.env`, passed with `--env-file`, and never
//!   checkpointed. (Aider's other key files, `~/.aider/oauth-keys.env` and
//!   keys in `~/.aider.conf.yml`, live under the sandbox's home, outside
//!   the workspace, and are never checkpointed either.)
//!
//! Settings: `binary` (default `aider`), `model`, `args`, `cwd`,
//! `credentials_dir`.

use std::collections::BTreeMap;
use std::path::Path;

use super::{
    Cli, CliSpec, CliTurns, HarnessError, Invocation, Observed, Stream, TurnRequest,
    message_option, new_session_id,
};

const CLI: CliSpec = CliSpec {
    name: "aider",
    settings: cairn_proto::runs::AIDER_SETTINGS,
    state_dir: ".cairn/state/aider",
    // Aider is pointed at its files by flags.
    state_env: None,
    credentials_subdir: None,
    credential_files: &[".env"],
    more_excludes: &[],
    home_credentials: ".aider",
    // Aider has no ids, so no conversation of its can be lost.
    session_lost: &[],
    can_fork: false,
};

/// The chat history, in the state directory.
pub const CHAT_HISTORY: &str = ".aider.chat.history.md";
/// The input history, in the state directory.
pub const INPUT_HISTORY: &str = ".aider.input.history";

/// Aider, configured for one run.
#[derive(Debug, Clone)]
pub struct Aider(Cli);

impl Aider {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        Cli::new(&CLI, config, root).map(Self)
    }
}

/// What Aider prints (and exits 0) when the provider refused its key.
const AUTH_FAILED: &str = "The API provider is not able to authenticate you";
/// How the lines Aider prints about a turn, after the model's reply, begin.
const BOOKKEEPING: &[&str] = &[
    "Tokens: ",
    "Cost: ",
    "Applied edit to ",
    "Commit ",
    "You can use /undo",
    "Added .aider",
];

/// What Aider prints before it waits for a browser login.
const NO_MODEL: &str = "No LLM model was specified and no API keys were provided.";

/// Aider prints only text for people: the runner keeps the last line of
/// stdout as the summary, and reads only the texts of failures Aider does
/// not report in its exit status (no JSON events, no `session_lost` text).
impl CliTurns for Aider {
    fn cli(&self) -> &Cli {
        &self.0
    }

    fn resumes(&self) -> bool {
        false
    }

    fn invocation(&self, turn: &TurnRequest, _cwd: &Path) -> Invocation {
        let state = |name: &str| self.0.state_dir.join(name).to_string_lossy().into_owned();
        let mut args = vec![
            "--chat-history-file".to_owned(),
            state(CHAT_HISTORY),
            "--input-history-file".into(),
            state(INPUT_HISTORY),
            "--restore-chat-history".into(),
            "--env-file".into(),
            state(".env"),
            "--yes-always".into(),
            "--no-gitignore".into(),
        ];
        args.extend(self.0.options());
        args.extend(message_option("--message", "--message=", turn.message()));
        Invocation {
            args,
            env: Vec::new(),
            session_at_start: Some(new_session_id()),
        }
    }

    fn observe_line(&self, stream: Stream, line: &str, observed: &mut Observed) {
        let text = line.trim();
        if stream == Stream::Stdout
            && !text.is_empty()
            && !BOOKKEEPING.iter().any(|prefix| text.starts_with(prefix))
        {
            observed.summary = Some(text.to_owned());
        }
        if line.contains(AUTH_FAILED) {
            observed.error = Some(line.trim().to_owned());
        } else if line.contains(NO_MODEL) {
            observed.stuck = Some(format!(
                "aider: {NO_MODEL} It would wait for a browser login; set the harness's `model` \
                 setting and give it a key (credentials_dir/.env)"
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::super::testing::*;
    use super::*;

    fn aider(config: &[(&str, &str)], root: &Path) -> Aider {
        Aider::new(&settings(config), root).unwrap()
    }

    #[test]
    fn every_turn_is_a_new_conversation_with_the_history_restored() {
        let a = aider(
            &[("model", "sonnet"), ("args", "--no-auto-commits")],
            Path::new("/workspace"),
        );
        assert!(!a.can_resume());
        assert!(!a.can_fork());
        let start = start_turn(&a, "fix it", "/workspace/app");
        assert_eq!(start.program, "aider");
        assert_eq!(
            start.args,
            [
                "--chat-history-file",
                "/workspace/.cairn/state/aider/.aider.chat.history.md",
                "--input-history-file",
                "/workspace/.cairn/state/aider/.aider.input.history",
                "--restore-chat-history",
                "--env-file",
                "/workspace/.cairn/state/aider/.env",
                "--yes-always",
                "--no-gitignore",
                "--model",
                "sonnet",
                "--no-auto-commits",
                "--message",
                "fix it"
            ]
        );
        assert!(start.env.is_empty(), "{:?}", start.env);
        let id = start.session_at_start.expect("the runner names it");
        assert!(is_uuid(&id), "{id}");
        let again = start_turn(&a, "-v please", "/workspace/app");
        assert_ne!(again.session_at_start.unwrap(), id, "a new conversation");
        assert_eq!(again.args.last().unwrap(), "--message=-v please");

        let err = resume_turn(&a, &id, "go on", false).unwrap_err();
        assert!(
            err.to_string().contains("cannot continue a conversation"),
            "{err}"
        );
    }

    #[test]
    fn aider_is_read_only_for_the_failures_it_exits_0_on() {
        let a = aider(&[], Path::new("/workspace"));
        // Seen from aider 0.86.2: the reply, then the turn's bookkeeping.
        let lines = [
            "Aider v0.86.2",
            "Model: openai/stub-model with whole edit format",
            "Renamed the button.                                 ",
            "",
            "Tokens: 598 sent, 7 received.",
            "Applied edit to notes.md",
        ];
        assert_eq!(
            observe_lines(&a, Stream::Stdout, &lines),
            Observed {
                summary: Some("Renamed the button.".into()),
                ..Observed::default()
            }
        );
        let refused = observe_lines(
            &a,
            Stream::Stdout,
            &[
                "litellm.AuthenticationError: AnthropicException - invalid x-api-key",
                "The API provider is not able to authenticate you. Check your API key.",
            ],
        );
        assert_eq!(
            refused.error.as_deref(),
            Some("The API provider is not able to authenticate you. Check your API key.")
        );
        let waiting = observe_lines(
            &a,
            Stream::Stdout,
            &["No LLM model was specified and no API keys were provided."],
        );
        assert!(
            waiting
                .stuck
                .as_deref()
                .is_some_and(|w| w.contains("browser login")),
            "{waiting:?}"
        );
    }

    #[test]
    fn the_keys_file_is_excluded_and_copied_in_fresh() {
        let (root, a) = prepared(Aider::new, &[(".env", "ANTHROPIC_API_KEY=k\n")]);
        let copied = root.path().join(".cairn/state/aider/.env");
        assert_eq!(
            fs::read_to_string(&copied).unwrap(),
            "ANTHROPIC_API_KEY=k\n"
        );
        assert_excluded(
            &a,
            root.path(),
            &[
                (".cairn/state/aider/.env", true),
                (".cairn/state/aider/.aider.chat.history.md", false),
                (".cairn/state/aider/.aider.input.history", false),
                ("app/.env", false),
            ],
        );
    }
}
