//! The pi adapter (`pi`), per ../shared/reference/harnesses.md.
//!
//! - State: `PI_CODING_AGENT_DIR=<root>/.cairn/state/pi`, so sessions
//!   (`sessions/--<cwd, leading / dropped, / → ->--/<ts>_<uuid>.jsonl`, whose
//!   header line carries the cwd) live in the workspace and travel with its
//!   checkpoints.
//! - First turn: `--mode json --session <path> <message>`, where the runner
//!   chooses the path: a new file under the cwd's directory, named
//!   `<ts>_<uuid>.jsonl` as pi names its own. pi creates the file there and
//!   writes an id of its own into its header line; that id, reported in
//!   the first event, is the conversation's id (pi looks sessions up by it,
//!   never by the file name).
//! - Later turns, and every turn after a restore: `--mode json --session
//!   <path of the conversation's file> <message>` when a file's header
//!   holds the id (or, for conversations recorded before cairn used pi's
//!   own ids, the file's name does); when none does, `--session <id>`, so
//!   that pi looks the id up and says `No session found matching '<id>'`
//!   (exit 1) when it has no such conversation — the conversation is gone.
//!   (Passing a path that does not exist would silently start a new
//!   conversation.)
//! - A session file that holds no message has nothing to resume: the runner
//!   treats it as lost, so the agent gets the handoff briefing rather than
//!   an empty conversation. (pi 0.73.1 writes no file at all for a turn cut
//!   before its answer, by a suspend or a lost host, and says it has no
//!   such session.)
//! - A forked workspace's first turn: `--mode json --fork <file or id>
//!   <message>`: pi writes a new file whose header has a new id (and names
//!   the source as `parentSession`), leaving the source as it is.
//! - `model` and `args` come before the message. pi reads an argument
//!   starting with `-` as an option and one starting with `@` as a file to
//!   attach, so such a message gets a leading space.
//! - `--mode json` prints pi's events as JSON lines, the first being the
//!   session header `{"type":"session","id":…}` (its id is taken only when
//!   the runner did not choose one); the turn's summary is the text of the
//!   last `{"type":"message_end"}` assistant message, and an assistant
//!   message with `"stopReason":"error"` marks a failed turn (its
//!   `errorMessage` says why): pi exits 0 even then.
//! - Credentials (`auth.json` in `PI_CODING_AGENT_DIR`) are never
//!   checkpointed; they are copied in fresh from `credentials_dir` (default
//!   `$HOME/.pi/agent`) before the first turn.
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
    session_lost: &["No session found matching '"],
    // `pi --fork <file|id>`.
    can_fork: true,
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

    /// Every session file, in every cwd's directory.
    fn session_files(&self) -> Vec<PathBuf> {
        let Ok(projects) = fs::read_dir(self.sessions_dir()) else {
            return Vec::new();
        };
        let mut files: Vec<PathBuf> = projects
            .filter_map(Result::ok)
            .filter_map(|project| fs::read_dir(project.path()).ok())
            .flatten()
            .filter_map(Result::ok)
            .map(|f| f.path())
            .filter(|p| p.extension().is_some_and(|e| e == "jsonl") && p.is_file())
            .collect();
        files.sort();
        files
    }

    /// The file of conversation `id`, in whichever cwd's directory it is:
    /// the one whose header line carries the id, else (a conversation
    /// recorded by an older cairn, which used the name's uuid) the one
    /// named for it.
    fn session_file(&self, id: &str) -> Option<PathBuf> {
        if id.is_empty() || id.contains(['/', '\\']) {
            return None;
        }
        let files = self.session_files();
        let by_header = files
            .iter()
            .rev()
            .find(|f| header_id(f).as_deref() == Some(id));
        let suffix = format!("_{id}.jsonl");
        by_header
            .or_else(|| {
                files
                    .iter()
                    .rev()
                    .find(|f| f.to_string_lossy().ends_with(&suffix))
            })
            .cloned()
    }
}

impl CliTurns for Pi {
    fn cli(&self) -> &Cli {
        &self.0
    }

    fn invocation(&self, turn: &TurnRequest, cwd: &Path) -> Invocation {
        let (flag, session, session_at_start) = match turn {
            // pi reports the id it wrote into the file's header.
            TurnRequest::Start { .. } => (
                "--session",
                self.new_session_file(cwd, &new_session_id()),
                None,
            ),
            TurnRequest::Resume {
                session_id, fork, ..
            } => {
                let flag = if *fork { "--fork" } else { "--session" };
                match self.session_file(session_id) {
                    // A fork's id is new; pi reports it.
                    Some(file) => (flag, file, (!fork).then(|| session_id.clone())),
                    // pi looks the id up, and says so when it has none.
                    None => (flag, PathBuf::from(session_id), None),
                }
            }
        };
        let mut args: Vec<String> = ["--mode", "json", flag].map(String::from).into();
        args.push(session.to_string_lossy().into_owned());
        args.extend(self.0.options());
        args.push(message_word(turn.message()));
        Invocation {
            args,
            env: Vec::new(),
            session_at_start,
        }
    }

    fn has_conversation(&self, session_id: &str) -> Option<bool> {
        // A file with no message has nothing to resume. Without a file, pi
        // itself says it has none.
        let file = self.session_file(session_id)?;
        Some(holds_a_message(&file))
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

/// The `id` of a session file's header line (`{"type":"session","id":…}`).
fn header_id(file: &Path) -> Option<String> {
    use std::io::{BufRead as _, Read as _};
    let mut line = String::new();
    let mut reader = std::io::BufReader::new(fs::File::open(file).ok()?);
    // A header is one short line; a file that starts otherwise is no session.
    reader.by_ref().take(64 << 10).read_line(&mut line).ok()?;
    let header: Value = serde_json::from_str(line.trim_end()).ok()?;
    (header["type"] == "session")
        .then(|| non_empty(&header["id"]).map(str::to_owned))
        .flatten()
}

/// Whether a session file holds any message (a `{"type":"message"}` entry)
/// besides its header and settings.
fn holds_a_message(file: &Path) -> bool {
    use std::io::BufRead as _;
    let Ok(f) = fs::File::open(file) else {
        return false;
    };
    std::io::BufReader::new(f)
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| serde_json::from_str::<Value>(&line).ok())
        .any(|entry| entry["type"] == "message")
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
        assert_eq!(start.session_at_start, None, "pi reports its header's id");
        let file = Path::new(&start.args[3]);
        assert_eq!(
            file.parent().unwrap(),
            Path::new("/workspace/.cairn/state/pi/sessions/--workspace-app--")
        );
        let name = file.file_name().unwrap().to_string_lossy();
        let (time, rest) = name.split_once('_').unwrap();
        assert!(is_uuid(rest.trim_end_matches(".jsonl")), "{rest}");
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
        assert!(p.can_fork());
    }

    #[test]
    fn a_conversation_resumes_by_its_file_else_by_its_id() {
        let root = tempfile::tempdir().unwrap();
        let p = pi(&[], root.path());
        let id = "0199a213-81c0-7800-8aa1-bbab2a035a53";
        let gone = resume_turn(&p, id, "go on", false).unwrap();
        assert_eq!(gone.args, ["--mode", "json", "--session", id, "go on"]);
        assert_eq!(gone.session_at_start, None, "pi says whether it has it");

        // The header names the conversation, whatever the file is called.
        let dir = root.path().join(".cairn/state/pi/sessions/--elsewhere--");
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("2026-01-01T12-00-00-000Z_5f0c2a8e-1111-4222-8333-944455556666.jsonl");
        fs::write(
            &file,
            format!("{{\"type\":\"session\",\"version\":3,\"id\":\"{id}\"}}\n"),
        )
        .unwrap();
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

        // A fork starts from the same file; pi reports the new id.
        let fork = resume_turn(&p, id, "go on", true).unwrap();
        assert_eq!(
            fork.args,
            ["--mode", "json", "--fork", file.to_str().unwrap(), "go on"]
        );
        assert_eq!(fork.session_at_start, None);

        // A conversation an older cairn recorded under its file's uuid.
        let legacy = "7d1f0e2c-aaaa-4bbb-8ccc-0123456789ab";
        let old = dir.join(format!("2025-12-01T12-00-00-000Z_{legacy}.jsonl"));
        fs::write(&old, "{\"type\":\"session\",\"id\":\"pi-own-id\"}\n").unwrap();
        let resumed = resume_turn(&p, legacy, "go on", false).unwrap();
        assert_eq!(resumed.args[3], old.to_str().unwrap());
    }

    #[test]
    fn a_file_without_a_message_is_no_conversation_to_resume() {
        let root = tempfile::tempdir().unwrap();
        let p = pi(&[], root.path());
        let p: &dyn Harness = &p;
        let id = "01a24387-342b-7765-81a5-837bf9489290";
        assert_eq!(p.has_conversation(id), None, "no file: pi says so itself");
        let dir = root.path().join(".cairn/state/pi/sessions/--w--");
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("2026-01-01T12-00-00-000Z_x.jsonl");
        // A header and settings, no message.
        fs::write(
            &file,
            format!(
                "{{\"type\":\"session\",\"version\":3,\"id\":\"{id}\"}}\n\
                 {{\"type\":\"model_change\",\"provider\":\"stub\"}}\n"
            ),
        )
        .unwrap();
        assert_eq!(p.has_conversation(id), Some(false));
        let mut text = fs::read_to_string(&file).unwrap();
        text.push_str("{\"type\":\"message\",\"message\":{\"role\":\"user\"}}\n");
        fs::write(&file, text).unwrap();
        assert_eq!(p.has_conversation(id), Some(true));
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
