//! The OpenHands CLI adapter (`openhands`), per
//! ../shared/reference/harnesses.md.
//!
//! - State: `OPENHANDS_PERSISTENCE_DIR=<root>/.cairn/state/openhands`, so
//!   conversations (`conversations/<id>/`: `base_state.json` and
//!   `events/event-*.json`) live in the workspace and travel with its
//!   checkpoints.
//! - First turn: `--headless --json -t <message>` (OpenHands chooses the
//!   id); every later turn, and every turn after a restore: `--headless
//!   --json -t <message> --resume <id>`. `args` follow. A message starting
//!   with `-` is passed attached, as `-t<message>`.
//! - The conversation's id is printed when the CLI exits: `Conversation ID:
//!   <hex>` (so it is reported at the end of a turn, not at its start).
//! - With `--json` each event is a JSON line with a `kind`; the turn's
//!   summary is the `message` of an `ActionEvent` whose action is a
//!   `FinishAction`, else the text of the last agent `MessageEvent`; a
//!   `ConversationErrorEvent` (`detail`) or `AgentErrorEvent` (`error`)
//!   marks a failed turn — OpenHands exits 0 even then. So does `Headless
//!   mode requires existing settings…` (no LLM configured: OpenHands exits
//!   0 and still prints a `Conversation ID` with nothing behind it).
//! - `--resume <unknown id>` silently opens a new, empty conversation under
//!   that id and says nothing, so the runner looks before it resumes: a
//!   conversation is there only if `conversations/<id>/events/` holds an
//!   event. Otherwise it is lost, and the new conversation gets the handoff
//!   briefing.
//! - Credentials: `agent_settings.json` (it holds the LLM key) and
//!   `cloud/api_key.txt` in the persistence dir are never checkpointed;
//!   they are copied in fresh from `credentials_dir` (default
//!   `$HOME/.openhands`) before the first turn.
//! - No fork: a forked workspace's first turn gets the handoff briefing.
//!
//! Settings: `binary` (default `openhands`), `args`, `cwd`,
//! `credentials_dir` (OpenHands takes its model from `agent_settings.json`).

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
    name: "openhands",
    settings: cairn_proto::runs::OPENHANDS_SETTINGS,
    state_dir: ".cairn/state/openhands",
    state_env: Some("OPENHANDS_PERSISTENCE_DIR"),
    credentials_subdir: None,
    credential_files: &["agent_settings.json", "cloud/api_key.txt"],
    more_excludes: &[],
    home_credentials: ".openhands",
    // OpenHands never says so: see `has_conversation`.
    session_lost: &[],
    can_fork: false,
};

/// What OpenHands prints as it exits.
static CONVERSATION_ID: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"Conversation ID:\s*([0-9A-Fa-f][0-9A-Fa-f-]*)")
        .expect("a valid regular expression")
});

/// What headless OpenHands prints (exit 0) when no LLM is configured.
const NO_SETTINGS: &str = "Headless mode requires existing settings";

/// OpenHands CLI, configured for one run.
#[derive(Debug, Clone)]
pub struct OpenHands(Cli);

impl OpenHands {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        Cli::new(&CLI, config, root).map(Self)
    }
}

impl CliTurns for OpenHands {
    fn cli(&self) -> &Cli {
        &self.0
    }

    fn invocation(&self, turn: &TurnRequest, _cwd: &Path) -> Invocation {
        let mut args: Vec<String> = ["--headless", "--json"].map(String::from).into();
        // A message starting with `-` is attached: `-t-v please`.
        args.extend(message_option("-t", "-t", turn.message()));
        if let TurnRequest::Resume { session_id, .. } = turn {
            args.extend(["--resume".into(), session_id.clone()]);
        }
        args.extend(self.0.options());
        args.into()
    }

    fn observe_line(&self, stream: Stream, line: &str, observed: &mut Observed) {
        // A line that is not an event is OpenHands' own output.
        if let Some(event) = json_event(stream, line) {
            self.observe_event(&event, observed);
        } else if let Some(id) = CONVERSATION_ID.captures(line).and_then(|c| c.get(1)) {
            observed
                .session_id
                .get_or_insert_with(|| id.as_str().to_owned());
        } else if line.contains(NO_SETTINGS) {
            observed.error = Some(line.trim().to_owned());
        }
    }

    fn has_conversation(&self, session_id: &str) -> Option<bool> {
        // An id is hex (dashes allowed); anything else names no directory.
        let plausible = !session_id.is_empty()
            && session_id
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == '-');
        let events = self
            .0
            .state_dir
            .join("conversations")
            .join(session_id)
            .join("events");
        let has_events = plausible
            && std::fs::read_dir(&events).is_ok_and(|mut entries| {
                entries.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".json")))
            });
        Some(has_events)
    }

    fn observe_event(&self, event: &Value, observed: &mut Observed) {
        match event["kind"].as_str() {
            Some("ActionEvent") if event["action"]["kind"] == "FinishAction" => {
                if let Some(text) = event["action"]["message"].as_str() {
                    observed.summary = Some(text.to_owned());
                }
            }
            Some("MessageEvent") if event["source"] == "agent" => {
                if let Some(text) = text_items(&event["llm_message"]["content"]) {
                    observed.summary = Some(text);
                }
            }
            Some("ConversationErrorEvent") => {
                let why = non_empty(&event["detail"]).unwrap_or("openhands reported an error");
                observed.error = Some(why.to_owned());
            }
            Some("AgentErrorEvent") => {
                let why = non_empty(&event["error"]).unwrap_or("the agent reported an error");
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

    fn openhands(config: &[(&str, &str)], root: &Path) -> OpenHands {
        OpenHands::new(&settings(config), root).unwrap()
    }

    #[test]
    fn turns_use_the_exact_flags() {
        let o = openhands(&[("args", "--always-approve")], Path::new("/workspace"));
        let start = start_turn(&o, "fix it", "/workspace/app");
        assert_eq!(start.program, "openhands");
        assert_eq!(
            start.args,
            ["--headless", "--json", "-t", "fix it", "--always-approve"]
        );
        assert_eq!(
            start.env,
            [(
                "OPENHANDS_PERSISTENCE_DIR".to_owned(),
                "/workspace/.cairn/state/openhands".to_owned()
            )]
        );
        assert_eq!(start.session_at_start, None);

        let plain = openhands(&[], Path::new("/workspace"));
        let resume = |message: &str| resume_turn(&plain, "a1b2c3", message, false).unwrap().args;
        assert_eq!(
            resume("go on"),
            ["--headless", "--json", "-t", "go on", "--resume", "a1b2c3"]
        );
        assert_eq!(
            resume("-v please"),
            ["--headless", "--json", "-t-v please", "--resume", "a1b2c3"]
        );
        assert!(!plain.can_fork());
        let err = OpenHands::new(&settings(&[("model", "x")]), Path::new("/w")).unwrap_err();
        assert!(
            err.to_string().contains("unknown setting \"model\""),
            "{err}"
        );
    }

    #[test]
    fn the_id_comes_at_exit_and_the_events_give_summary_and_errors() {
        let o = openhands(&[], Path::new("/workspace"));
        let seen = observe_lines(
            &o,
            Stream::Stdout,
            &[
                r#"{"kind":"MessageEvent","source":"user","llm_message":{"role":"user","content":[{"type":"text","text":"hi"}]}}"#,
                r#"{"kind":"MessageEvent","source":"agent","llm_message":{"role":"assistant","content":[{"type":"text","text":"working"}]}}"#,
                r#"{"kind":"ActionEvent","source":"agent","action":{"kind":"FinishAction","message":"did it"}}"#,
                "Goodbye!",
                "Conversation ID: 4f1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e",
            ],
        );
        assert_eq!(
            seen,
            Observed {
                session_id: Some("4f1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e".into()),
                summary: Some("did it".into()),
                ..Observed::default()
            }
        );
        let failed = observe_lines(
            &o,
            Stream::Stdout,
            &[r#"{"kind":"ConversationErrorEvent","code":"LLMError","detail":"no API key"}"#],
        );
        assert_eq!(failed.error.as_deref(), Some("no API key"));
        let unconfigured = observe_lines(
            &o,
            Stream::Stdout,
            &[
                "Headless mode requires existing settings. Run `openhands` interactively once to configure your LLM settings.",
                "Conversation ID: 4f1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e",
            ],
        );
        assert!(
            unconfigured
                .error
                .as_deref()
                .is_some_and(|e| e.starts_with("Headless mode requires existing settings")),
            "{unconfigured:?}"
        );
    }

    #[test]
    fn a_conversation_without_events_is_not_resumed() {
        let root = tempfile::tempdir().unwrap();
        let o = openhands(&[], root.path());
        let o: &dyn Harness = &o;
        let id = "4f1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e";
        assert_eq!(o.has_conversation(id), Some(false), "nothing there");
        let events = root
            .path()
            .join(".cairn/state/openhands/conversations")
            .join(id)
            .join("events");
        fs::create_dir_all(&events).unwrap();
        assert_eq!(o.has_conversation(id), Some(false), "an empty conversation");
        fs::write(events.join("event-00000-x.json"), "{}").unwrap();
        assert_eq!(o.has_conversation(id), Some(true));
        assert_eq!(o.has_conversation("../../etc"), Some(false));
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let (root, o) = prepared(
            OpenHands::new,
            &[
                ("agent_settings.json", "{\"llm\":1}"),
                ("cloud/api_key.txt", "key"),
            ],
        );
        let state = root.path().join(".cairn/state/openhands");
        assert_eq!(
            fs::read_to_string(state.join("agent_settings.json")).unwrap(),
            "{\"llm\":1}"
        );
        assert_eq!(
            fs::read_to_string(state.join("cloud/api_key.txt")).unwrap(),
            "key"
        );
        assert_excluded(
            &o,
            root.path(),
            &[
                (".cairn/state/openhands/agent_settings.json", true),
                (".cairn/state/openhands/cloud/api_key.txt", true),
                (
                    ".cairn/state/openhands/conversations/abc/base_state.json",
                    false,
                ),
                ("app/agent_settings.json", false),
            ],
        );
    }
}
