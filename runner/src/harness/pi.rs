//! The pi adapter (`pi`), per ../shared/reference/harnesses.md.
//!
//! - State: `PI_CODING_AGENT_DIR=<root>/.cairn/state/pi`, so sessions
//!   (`sessions/--<cwd, leading / dropped, / → ->--/<ts>_<uuid>.jsonl`, whose
//!   header line carries the cwd) live in the workspace and travel with its
//!   checkpoints.
//! - First turn: `--mode json --session <path> <message>`, where the runner
//!   chooses the path: a new file under the cwd's directory, named
//!   `<ts>_<new uuid>.jsonl` as pi names its own. pi creates the file
//!   there; the conversation's id is that uuid, known as the turn starts.
//!   (pi writes an id of its own into the file's header; cairn does not use
//!   it.)
//! - Later turns, and every turn after a restore: `--mode json --session
//!   <path of the conversation's file> <message>` when the file is there;
//!   when it is not, `--session <id>`, so that pi looks the id up and says
//!   `No session found matching '<id>'` (exit 1) when it has no such
//!   conversation — the conversation is gone. (Passing a path that does
//!   not exist would silently start a new conversation.)
//! - `model` and `args` come before the message. pi reads an argument
//!   starting with `-` as an option and one starting with `@` as a file to
//!   attach, so such a message gets a leading space.
//! - `--mode json` prints pi's events as JSON lines, the first being the
//!   session header `{"type":"session","id":…}` (its id is taken only when
//!   the runner did not choose one); the turn's summary is the text of the
//!   last `{"type":"message_end"}` assistant message, and an assistant
//!   message with `"stopReason":"error"` marks a failed turn (its
//!   `errorMessage` says why).
//! - Credentials (`auth.json` in `PI_CODING_AGENT_DIR`) are never
//!   checkpointed; they are copied in fresh from `credentials_dir` (default
//!   `$HOME/.pi/agent`) before the first turn.
//! - No fork: pi forks only interactively, so a forked workspace's first
//!   turn gets the handoff briefing.
//!
//! Settings: `binary` (default `pi`), `model`, `args`, `cwd`,
//! `credentials_dir`.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde_json::Value;

use super::{
    Cli, CliSpec, CliTurns, HarnessError, Invocation, Observed, Stream, TurnRequest, json_event,
    message_word, new_session_id, non_empty, text_items,
};

const CLI: CliSpec = CliSpec {
    name: "pi",
    settings: cairn_proto::runs::PI_SETTINGS,
    state_dir: ".cairn/state/pi",
    state_env: Some("PI_CODING_AGENT_DIR"),
    credentials_subdir: None,
    credential_files: &["auth.json"],
    more_excludes: &[],
    home_credentials: ".pi/agent",
    // What `pi --session <id>` prints (exit 1) when no session has the id.
    session_lost: Some("No session found matching '"),
    // pi forks only in its interactive session picker.
    can_fork: false,
};

/// pi, configured for one run.
#[derive(Debug, Clone)]
pub struct Pi(Cli);

impl Pi {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        Cli::new(&CLI, config, root).map(Self)
    }

    fn sessions_dir(&self) -> PathBuf {
        self.0.state_dir.join("sessions")
    }

    /// Where pi files the conversations of `cwd`: `--<cwd without its
    /// leading />--`, with every `/`, `\` and `:` made a `-`.
    fn project_dir(&self, cwd: &Path) -> PathBuf {
        let cwd = cwd.to_string_lossy();
        let trimmed = cwd.strip_prefix(['/', '\\']).unwrap_or(&cwd);
        let safe = trimmed.replace(['/', '\\', ':'], "-");
        self.sessions_dir().join(format!("--{safe}--"))
    }

    /// The file of a new conversation `id` in `cwd`, named as pi names its
    /// own: the ISO time with `:` and `.` made `-`, then the id.
    fn new_session_file(&self, cwd: &Path, id: &str) -> PathBuf {
        let time = humantime::format_rfc3339_millis(SystemTime::now())
            .to_string()
            .replace([':', '.'], "-");
        self.project_dir(cwd).join(format!("{time}_{id}.jsonl"))
    }

    /// The file of conversation `id`, in whichever cwd's directory it is.
    fn session_file(&self, id: &str) -> Option<PathBuf> {
        if id.is_empty() || id.contains(['/', '\\']) {
            return None;
        }
        let suffix = format!("_{id}.jsonl");
        let projects = fs::read_dir(self.sessions_dir()).ok()?;
        let mut found: Vec<PathBuf> = projects
            .filter_map(Result::ok)
            .filter_map(|project| fs::read_dir(project.path()).ok())
            .flatten()
            .filter_map(Result::ok)
            .filter(|f| f.file_name().to_string_lossy().ends_with(&suffix))
            .map(|f| f.path())
            .filter(|p| p.is_file())
            .collect();
        found.sort();
        found.pop()
    }
}

impl CliTurns for Pi {
    fn cli(&self) -> &Cli {
        &self.0
    }

    fn invocation(&self, turn: &TurnRequest, cwd: &Path) -> Invocation {
        let (session, session_at_start) = match turn {
            TurnRequest::Start { .. } => {
                let id = new_session_id();
                (self.new_session_file(cwd, &id), Some(id))
            }
            TurnRequest::Resume { session_id, .. } => match self.session_file(session_id) {
                Some(file) => (file, Some(session_id.clone())),
                // pi looks the id up, and says so when it has none.
                None => (PathBuf::from(session_id), None),
            },
        };
        let mut args: Vec<String> = ["--mode", "json", "--session"].map(String::from).into();
        args.push(session.to_string_lossy().into_owned());
        args.extend(self.0.options());
        args.push(message_word(turn.message()));
        Invocation {
            args,
            env: Vec::new(),
            session_at_start,
        }
    }

    fn observe_line(&self, stream: Stream, line: &str, observed: &mut Observed) {
        // pi says so on stderr; its events may quote anything.
        if stream == Stream::Stderr && self.0.says_lost(line) {
            observed.session_lost = true;
        }
        if let Some(event) = json_event(stream, line) {
            self.observe_event(&event, observed);
        }
    }

    fn observe_event(&self, event: &Value, observed: &mut Observed) {
        match event["type"].as_str() {
            Some("session") => {
                if let Some(id) = non_empty(&event["id"]) {
                    observed.session_id.get_or_insert_with(|| id.to_owned());
                }
            }
            Some("message_end") if event["message"]["role"] == "assistant" => {
                let message = &event["message"];
                if message["stopReason"] == "error" {
                    let why = non_empty(&message["errorMessage"]).unwrap_or("pi reported an error");
                    observed.error = Some(why.to_owned());
                } else if let Some(text) = text_of(&message["content"]) {
                    observed.summary = Some(text);
                }
            }
            _ => {}
        }
    }
}

/// The text blocks of a pi message's content, joined (or the content, when
/// it is a plain string); `None` when there is no text.
fn text_of(content: &Value) -> Option<String> {
    match content.as_str() {
        Some(text) => Some(text.to_owned()),
        None => text_items(content),
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    fn pi(config: &[(&str, &str)], root: &Path) -> Pi {
        Pi::new(&settings(config), root).unwrap()
    }

    #[test]
    fn a_new_conversation_is_a_session_file_the_runner_chooses() {
        let p = pi(
            &[("model", "sonnet"), ("args", "--thinking high")],
            Path::new("/workspace"),
        );
        let start = start_turn(&p, "fix it", "/workspace/app");
        assert_eq!(start.program, "pi");
        assert_eq!(&start.args[..3], ["--mode", "json", "--session"]);
        let id = start.session_at_start.clone().expect("the id is known");
        assert!(is_uuid(&id), "{id}");
        let file = Path::new(&start.args[3]);
        assert_eq!(
            file.parent().unwrap(),
            Path::new("/workspace/.cairn/state/pi/sessions/--workspace-app--")
        );
        let name = file.file_name().unwrap().to_string_lossy();
        let (time, rest) = name.split_once('_').unwrap();
        assert_eq!(rest, format!("{id}.jsonl"));
        assert_eq!(time.len(), "2026-01-01T12-00-00-000Z".len(), "{time}");
        assert!(!time.contains([':', '.']), "{time}");
        assert_eq!(
            &start.args[4..],
            ["--model", "sonnet", "--thinking", "high", "fix it"]
        );
        assert_eq!(
            start.env,
            [(
                "PI_CODING_AGENT_DIR".to_owned(),
                "/workspace/.cairn/state/pi".to_owned()
            )]
        );
        assert_eq!(start.cwd, Path::new("/workspace/app"));
        assert_eq!(
            start_turn(&p, "-v please", "/w").args.last().unwrap(),
            " -v please"
        );
        assert_eq!(
            start_turn(&p, "@notes.md", "/w").args.last().unwrap(),
            " @notes.md"
        );
        assert!(!p.can_fork());
        assert!(resume_turn(&p, "x", "m", true).is_err());
    }

    #[test]
    fn a_conversation_resumes_by_its_file_else_by_its_id() {
        let root = tempfile::tempdir().unwrap();
        let p = pi(&[], root.path());
        let id = "0199a213-81c0-7800-8aa1-bbab2a035a53";
        let gone = resume_turn(&p, id, "go on", false).unwrap();
        assert_eq!(gone.args, ["--mode", "json", "--session", id, "go on"]);
        assert_eq!(gone.session_at_start, None, "pi says whether it has it");

        let dir = root.path().join(".cairn/state/pi/sessions/--elsewhere--");
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join(format!("2026-01-01T12-00-00-000Z_{id}.jsonl"));
        fs::write(&file, "{\"type\":\"session\"}\n").unwrap();
        let found = resume_turn(&p, id, "go on", false).unwrap();
        assert_eq!(
            found.args,
            [
                "--mode",
                "json",
                "--session",
                file.to_str().unwrap(),
                "go on"
            ]
        );
        assert_eq!(found.session_at_start.as_deref(), Some(id));
        let other = resume_turn(&p, "0199a213", "go on", false).unwrap();
        assert_eq!(other.args[3], "0199a213", "only a whole id names a file");
    }

    #[test]
    fn the_events_give_session_summary_and_errors() {
        let p = pi(&[], Path::new("/workspace"));
        let seen = observe_lines(
            &p,
            Stream::Stdout,
            &[
                r#"{"type":"session","version":3,"id":"abc","timestamp":"t","cwd":"/workspace/app"}"#,
                r#"{"type":"agent_start"}"#,
                r#"{"type":"message_end","message":{"role":"user","content":[{"type":"text","text":"hi"}]}}"#,
                r#"{"type":"message_end","message":{"role":"assistant","content":[{"type":"thinking","thinking":"hmm"},{"type":"text","text":"did it"}],"stopReason":"stop"}}"#,
                r#"{"type":"agent_end","messages":[]}"#,
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
        let mut chosen = Observed {
            session_id: Some("mine".into()),
            ..Observed::default()
        };
        p.observe(
            Stream::Stdout,
            r#"{"type":"session","id":"header"}"#,
            &mut chosen,
        );
        assert_eq!(
            chosen.session_id.as_deref(),
            Some("mine"),
            "the runner's id holds"
        );

        let failed = observe_lines(
            &p,
            Stream::Stdout,
            &[
                r#"{"type":"message_end","message":{"role":"assistant","content":[],"stopReason":"error","errorMessage":"401 unauthorized"}}"#,
            ],
        );
        assert_eq!(failed.error.as_deref(), Some("401 unauthorized"));
        let lost = observe_lines(
            &p,
            Stream::Stderr,
            &["No session found matching '0199a213-81c0'"],
        );
        assert!(lost.session_lost);
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let (root, p) = prepared(Pi::new, &[("auth.json", "{\"anthropic\":1}")]);
        let copied = root.path().join(".cairn/state/pi/auth.json");
        assert_eq!(fs::read_to_string(&copied).unwrap(), "{\"anthropic\":1}");
        assert_eq!(p.excludes(), ["/.cairn/state/pi/auth.json"]);
        assert_excluded(
            &p,
            root.path(),
            &[
                (".cairn/state/pi/auth.json", true),
                (".cairn/state/pi/sessions/--w--/t_x.jsonl", false),
                (".cairn/state/pi/settings.json", false),
                ("app/auth.json", false),
            ],
        );
    }
}
