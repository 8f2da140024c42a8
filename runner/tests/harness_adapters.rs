//! The harness adapters other than `claude` (codex, gemini, pi, opencode,
//! goose, openhands, aider) driven by the run state machine
//! (`cairn_runner::run::run`), against the same fake RunnerService and
//! snapshotting store as run_attempt.rs (both in attempt_support/), with the
//! Python test doubles in tests/doubles/ as the harnesses. The doubles honour
//! each CLI's documented contract (flags, files, id reports, refusals) and
//! remember earlier turns by reading their own transcripts (for opencode and
//! goose: a SQLite database in WAL mode, left with its WAL); each turn also
//! records its arguments and the credential files it saw (as SHA-256) in the
//! transcript.
//!
//! Every adapter runs the same five tests: the first turn, a resume on
//! "another host" (the workspace wiped and restored), a lost conversation,
//! credentials that never reach a checkpoint, and a turn the model
//! provider refused (the `api-error` directive), which must fail the
//! attempt even where the real CLI exits 0. Aider has no ids, so its
//! versions check the lossy-handoff briefing instead of a resumed id. The
//! doubles behave as the real CLIs were seen to (../shared/reference/
//! harnesses.md, "Checked against the real CLIs"): gemini's trust check,
//! its two "gone" texts and a failed first chat deleted; codex refusing to
//! run outside a repository; pi's own header ids; OpenHands resuming an
//! unknown id silently; Aider's exit 0 on a refused key and its wait for a
//! browser login; codex and pi forks.

mod attempt_support;

use std::collections::BTreeMap;
use std::fs;
use std::ops::Deref;
use std::path::Path;
use std::process::Command;

use attempt_support::*;
use cairn_proto::domain::CheckpointReason;
use cairn_proto::pb::{self, AttemptPhase};
use cairn_runner::run::Finished;
use cairn_runner::run::messages::LOSSY_HANDOFF;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

/// Which harness a test drives.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Codex,
    Gemini,
    Pi,
    Opencode,
    Goose,
    OpenHands,
    Aider,
}

/// A conversation as a checkpoint holds it.
#[derive(Debug)]
struct Conversation {
    /// Everything said in it, in order.
    text: String,
    /// The test double's own record of each turn (arguments, credentials seen).
    records: Vec<Value>,
}

impl Conversation {
    /// The arguments of each turn, in order.
    fn argv(&self) -> Vec<Vec<String>> {
        self.records
            .iter()
            .map(|r| serde_json::from_value(r["argv"].clone()).unwrap())
            .collect()
    }
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Codex => "codex",
            Self::Gemini => "gemini",
            Self::Pi => "pi",
            Self::Opencode => "opencode",
            Self::Goose => "goose",
            Self::OpenHands => "openhands",
            Self::Aider => "aider",
        }
    }

    fn double(self) -> String {
        format!(
            "{}/../tests/doubles/{}",
            env!("CARGO_MANIFEST_DIR"),
            self.name()
        )
    }

    /// The state directory, relative to the root.
    fn state(self) -> String {
        format!(".cairn/state/{}", self.name())
    }

    /// The credential file the test gives the harness (it holds the canary).
    fn credential_file(self) -> &'static str {
        match self {
            Self::Codex | Self::Pi | Self::Opencode => "auth.json",
            Self::Gemini => "oauth_creds.json",
            Self::Goose => "secrets.yaml",
            Self::OpenHands => "agent_settings.json",
            Self::Aider => ".env",
        }
    }

    /// Where that file must reach the harness, relative to the root.
    fn credential_path(self) -> String {
        let inside = match self {
            Self::Codex | Self::Pi | Self::OpenHands | Self::Aider => "",
            Self::Gemini => ".gemini/",
            Self::Opencode => "data/opencode/",
            Self::Goose => "config/",
        };
        format!("{}/{inside}{}", self.state(), self.credential_file())
    }

    /// Whether the harness continues a conversation by its id (all but Aider).
    fn resumes(self) -> bool {
        self != Self::Aider
    }

    /// The SQLite database of its conversations, relative to the root.
    fn database(self) -> Option<&'static str> {
        match self {
            Self::Opencode => Some(".cairn/state/opencode/data/opencode/opencode.db"),
            Self::Goose => Some(".cairn/state/goose/data/sessions/sessions.db"),
            _ => None,
        }
    }

    /// Conversation `session` as `snapshot` holds it.
    fn conversation(self, snapshot: &Snapshot, session: &str) -> Conversation {
        if let Some(db) = self.database() {
            return self.conversation_in_database(&snapshot.files, db, session);
        }
        let files = &snapshot.files;
        let file = |wanted: &dyn Fn(&str, &[u8]) -> bool| -> String {
            files
                .iter()
                .find(|(path, content)| wanted(path, content))
                .map(|(_, content)| String::from_utf8(content.clone()).unwrap())
                .unwrap_or_else(|| {
                    panic!(
                        "no transcript of {session} in {:?}",
                        files.keys().collect::<Vec<_>>()
                    )
                })
        };
        // A JSON-lines transcript, and the records among its lines.
        let transcript = |text: String, record: &dyn Fn(&Value) -> Option<Value>| {
            let records = text
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter_map(|v| record(&v))
                .collect();
            Conversation { text, records }
        };
        match self {
            Self::Codex => transcript(
                file(&|path, _| {
                    path.starts_with(".cairn/state/codex/sessions/")
                        && path.ends_with(&format!("-{session}.jsonl"))
                }),
                &|v| (v["type"] == "cairn_double").then(|| v["payload"].clone()),
            ),
            Self::Gemini => transcript(
                file(&|path, content| {
                    path.starts_with(".cairn/state/gemini/.gemini/tmp/app/chats/session-")
                        && path.ends_with(&format!("-{}.jsonl", &session[..8]))
                        && String::from_utf8_lossy(content)
                            .lines()
                            .next()
                            .and_then(|l| serde_json::from_str::<Value>(l).ok())
                            .is_some_and(|v| v["sessionId"] == session)
                }),
                &|v| (v["type"] == "cairn_double").then(|| v.clone()),
            ),
            Self::Pi => transcript(
                file(&|path, content| {
                    path.starts_with(".cairn/state/pi/sessions/--")
                        && pi_header_id(content) == session
                }),
                &|v| {
                    (v["type"] == "custom" && v["customType"] == "cairn_double")
                        .then(|| v["data"].clone())
                },
            ),
            Self::OpenHands => {
                let events = format!(".cairn/state/openhands/conversations/{session}/events/");
                let texts: Vec<String> = files
                    .iter()
                    .filter(|(path, _)| path.starts_with(&events))
                    .map(|(_, content)| String::from_utf8(content.clone()).unwrap())
                    .collect();
                assert!(!texts.is_empty(), "no events of {session}");
                let records = texts
                    .iter()
                    .map(|t| serde_json::from_str::<Value>(t).unwrap())
                    .filter(|v| v["kind"] == "cairn_double")
                    .collect();
                Conversation {
                    text: texts.join("\n"),
                    records,
                }
            }
            Self::Aider => {
                // One chat history, whatever the conversation.
                let text = file(&|path, _| path == ".cairn/state/aider/.aider.chat.history.md");
                let records = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("> cairn_double "))
                    .map(|r| serde_json::from_str(r).unwrap())
                    .collect();
                Conversation { text, records }
            }
            Self::Opencode | Self::Goose => unreachable!("kept in a database"),
        }
    }

    fn conversation_in_database(
        self,
        files: &BTreeMap<String, Vec<u8>>,
        db: &str,
        session: &str,
    ) -> Conversation {
        let messages = match self {
            Self::Opencode => {
                "SELECT text FROM message WHERE session_id = ? ORDER BY time_created, rowid"
            }
            _ => "SELECT content_json FROM messages WHERE session_id = ? ORDER BY id",
        };
        let texts: Vec<String> = query(files, db, true, messages, &[session])
            .into_iter()
            .map(|row| {
                let cell = row[0].as_str().unwrap();
                match self {
                    // goose keeps a message's content as JSON items.
                    Self::Goose => serde_json::from_str::<Value>(cell).unwrap()[0]["text"]
                        .as_str()
                        .unwrap()
                        .to_owned(),
                    _ => cell.to_owned(),
                }
            })
            .collect();
        let records = query(
            files,
            db,
            true,
            "SELECT record FROM cairn_double WHERE session_id = ? ORDER BY id",
            &[session],
        )
        .into_iter()
        .map(|row| serde_json::from_str(row[0].as_str().unwrap()).unwrap())
        .collect();
        Conversation {
            text: texts.join("\n"),
            records,
        }
    }

    /// The user messages of `session` in the database of `files`.
    fn user_messages(self, files: &BTreeMap<String, Vec<u8>>, session: &str) -> Vec<String> {
        let db = self.database().expect("a database");
        let sql = match self {
            Self::Opencode => {
                "SELECT text FROM message WHERE session_id = ? AND role = 'user' \
                 ORDER BY time_created, rowid"
            }
            _ => {
                "SELECT json_extract(content_json, '$[0].text') FROM messages \
                 WHERE session_id = ? AND role = 'user' ORDER BY id"
            }
        };
        query(files, db, true, sql, &[session])
            .into_iter()
            .map(|row| row[0].as_str().unwrap().to_owned())
            .collect()
    }

    /// The arguments of a turn that opens a conversation with `message`
    /// (`session` names it where the arguments do).
    fn start_args(self, s: &Sandbox, session: &str, message: &str) -> Vec<String> {
        match self {
            Self::Codex => strings(&["exec", message, "--json", "--skip-git-repo-check"]),
            Self::Gemini => strings(&[
                "-p",
                message,
                "--output-format",
                "stream-json",
                "--session-id",
                session,
            ]),
            Self::Pi => strings(&["--mode", "json", "--session", &s.pi_file(session), message]),
            Self::Opencode => strings(&["run", message, "--format", "json"]),
            Self::Goose => strings(&["run", "-t", message, "--output-format", "stream-json"]),
            Self::OpenHands => strings(&["--headless", "--json", "-t", message]),
            Self::Aider => {
                let state = |f: &str| s.root.join(".cairn/state/aider").join(f);
                strings(&[
                    "--chat-history-file",
                    state(".aider.chat.history.md").to_str().unwrap(),
                    "--input-history-file",
                    state(".aider.input.history").to_str().unwrap(),
                    "--restore-chat-history",
                    "--env-file",
                    state(".env").to_str().unwrap(),
                    "--yes-always",
                    "--no-gitignore",
                    "--model",
                    AIDER_MODEL,
                    "--message",
                    message,
                ])
            }
        }
    }

    /// The arguments of a turn that continues conversation `session`.
    fn resume_args(self, s: &Sandbox, session: &str, message: &str) -> Vec<String> {
        match self {
            Self::Codex => strings(&[
                "exec",
                "resume",
                session,
                message,
                "--json",
                "--skip-git-repo-check",
            ]),
            Self::Gemini => strings(&[
                "-p",
                message,
                "--output-format",
                "stream-json",
                "--resume",
                session,
            ]),
            // pi is given the conversation's file, as for its first turn.
            Self::Pi => self.start_args(s, session, message),
            Self::Opencode => strings(&["run", "-s", session, message, "--format", "json"]),
            Self::Goose => strings(&[
                "run",
                "--resume",
                "--session-id",
                session,
                "-t",
                message,
                "--output-format",
                "stream-json",
            ]),
            Self::OpenHands => {
                strings(&["--headless", "--json", "-t", message, "--resume", session])
            }
            Self::Aider => unreachable!("aider does not resume"),
        }
    }
}

/// The `id` of a pi session file's header line.
fn pi_header_id(content: &[u8]) -> String {
    String::from_utf8_lossy(content)
        .lines()
        .next()
        .and_then(|l| serde_json::from_str::<Value>(l).ok())
        .and_then(|v| v["id"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// Owned copies of `args`.
fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// Runs `sql` (with `params`) on a copy of the SQLite database `db` as
/// `files` hold it — with its `-wal` file, or without it — and returns the
/// rows. Python's sqlite3 reads it, as the doubles write it.
fn query(
    files: &BTreeMap<String, Vec<u8>>,
    db: &str,
    with_wal: bool,
    sql: &str,
    params: &[&str],
) -> Vec<Vec<Value>> {
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("copy.db");
    fs::write(&copy, files.get(db).unwrap_or_else(|| panic!("no {db}"))).unwrap();
    if with_wal && let Some(wal) = files.get(&format!("{db}-wal")) {
        fs::write(dir.path().join("copy.db-wal"), wal).unwrap();
    }
    let script = "import json, sqlite3, sys\n\
                  db = sqlite3.connect(sys.argv[1])\n\
                  rows = db.execute(sys.argv[2], json.loads(sys.argv[3])).fetchall()\n\
                  print(json.dumps([list(r) for r in rows]))\n";
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&copy)
        .arg(sql)
        .arg(serde_json::to_string(params).unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A run's sandbox (see `Harnessed`) for one kind of harness.
struct Sandbox {
    harnessed: Harnessed,
    kind: Kind,
}

impl Deref for Sandbox {
    type Target = Harnessed;

    fn deref(&self) -> &Harnessed {
        &self.harnessed
    }
}

const CANARY: &str = "CANARY-7f3c9e1d-never-checkpoint-me";

/// The model Aider's tests name.
const AIDER_MODEL: &str = "sonnet";

impl Sandbox {
    fn new(kind: Kind) -> Self {
        let harnessed = Harnessed::new(
            &format!("home/.{}", kind.name()),
            kind.credential_file(),
            &format!("{{\"secret\":\"{CANARY}\"}}"),
        );
        git2::Repository::init(harnessed.root.join("app")).unwrap();
        Self { harnessed, kind }
    }

    fn attempt(&self, attempt: u32, prompt: &str) -> pb::AttemptSpec {
        let mut harness = self.harness(self.kind.name(), &self.kind.double());
        if self.kind == Kind::Aider {
            // Without one (and no key) Aider waits for a browser login.
            harness.config.insert("model".into(), AIDER_MODEL.into());
        }
        self.harnessed.attempt(attempt, prompt, harness)
    }

    async fn run(&self) -> Finished {
        self.run_until(CancellationToken::new()).await
    }

    /// Runs one attempt; `shutdown` plays the host's SIGTERM.
    async fn run_until(&self, shutdown: CancellationToken) -> Finished {
        self.harnessed.run(shutdown).await.unwrap()
    }

    /// Runs the first attempt, with PROMPT, until its question goes
    /// unanswered and the host stops the sandbox; returns the conversation.
    async fn stop_at_the_question(&self) -> String {
        self.next(self.attempt(1, PROMPT));
        let shutdown = stop_once_waiting(&self.fake);
        assert_eq!(self.run_until(shutdown).await, Finished::Interrupted);
        self.fake.sessions().pop().expect("a session was reported")
    }

    /// On "another host" (the workspace wiped, to be restored at the same
    /// root), runs the second attempt: it continues `session` with the
    /// answer "recall codeword".
    async fn answer_on_another_host(&self, session: &str) {
        fs::remove_dir_all(&self.root).unwrap();
        let mut second = self.attempt(2, PROMPT);
        second.inputs = vec![input(2, "answer", "recall codeword")];
        second.resume_session_id = session.to_owned();
        second.prompt_delivered = true;
        second.question = "Which colour should the button be?".into();
        self.next(second);
        assert_eq!(self.run().await, Finished::Succeeded);
    }

    /// Conversation `session` in the newest checkpoint.
    fn conversation(&self, session: &str) -> Conversation {
        let newest = self.store.committed().pop().expect("a checkpoint");
        self.kind.conversation(&newest, session)
    }

    /// pi's file of conversation `session` (absolute; the one whose header
    /// carries the id), as the runner chose it: under the directory of the
    /// cwd (`<root>/app`).
    fn pi_file(&self, session: &str) -> String {
        let newest = self.store.committed().pop().expect("a checkpoint");
        let file = newest
            .files
            .iter()
            .find(|(p, content)| {
                p.starts_with(".cairn/state/pi/sessions/") && pi_header_id(content) == session
            })
            .map(|(p, _)| p)
            .unwrap_or_else(|| panic!("no session file of {session}"));
        assert!(
            !file.ends_with(&format!("_{session}.jsonl")),
            "pi's own id is not the one in the file name the runner chose: {file}"
        );
        let cwd = self.root.join("app");
        let project = format!(
            "--{}--",
            cwd.to_str()
                .unwrap()
                .trim_start_matches('/')
                .replace('/', "-")
        );
        assert_eq!(
            Path::new(file).parent().unwrap(),
            Path::new(".cairn/state/pi/sessions").join(project),
            "filed under the cwd"
        );
        self.root.join(file).to_string_lossy().into_owned()
    }
}

const PROMPT: &str = "The codeword is PELICAN.\n\
                      commit notes.md first line\n\
                      edit notes.md second line\n\
                      ask Which colour should the button be?";

/// Aider's conversations after the first start with a briefing that quotes
/// the task, and the doubles act on every directive they are given, so
/// Aider's tests give it no question to ask (it would ask again).
const PROMPT_WITHOUT_QUESTION: &str = "The codeword is PELICAN.\n\
                                       commit notes.md first line\n\
                                       edit notes.md second line";

/// (1) The first turn records the id the harness reported; a question is
/// answered in the same sandbox by resuming that conversation. (Aider: the
/// turn runs with its history files in the state directory.)
async fn first_turn_records_the_session(kind: Kind) {
    let s = Sandbox::new(kind);
    let prompt = if kind.resumes() {
        s.answer(vec![input(2, "answer", "Blue.")]);
        PROMPT
    } else {
        PROMPT_WITHOUT_QUESTION
    };
    s.next(s.attempt(1, prompt));
    assert_eq!(s.run().await, Finished::Succeeded);

    let sessions = s.fake.sessions();
    assert_eq!(sessions.len(), 1, "{:#?}", s.fake.calls());
    let session = &sessions[0];
    let checkpoints = s.store.committed();
    let done = checkpoints.first().unwrap();
    if kind.resumes() {
        assert!(
            s.fake.calls().iter().any(|c| matches!(
                c,
                Call::Waiting { question, .. } if question == "Which colour should the button be?"
            )),
            "the double asked through the outcome file"
        );
        assert_eq!(
            s.store.reasons(),
            [CheckpointReason::Pause, CheckpointReason::End]
        );
    } else {
        assert_eq!(s.store.reasons(), [CheckpointReason::End]);
    }
    assert_eq!(done.session.as_ref(), Some(session));
    assert_eq!(
        done.text("app/notes.md").as_deref(),
        Some("first line\nsecond line\n")
    );
    let repo = git2::Repository::open(s.root.join("app")).unwrap();
    let head = repo.head().unwrap().peel_to_commit().unwrap();
    assert_eq!(head.message().map(str::trim), Some("test double: notes.md"));

    let conversation = s.conversation(session);
    let mut expected = vec![kind.start_args(&s, session, prompt)];
    if kind.resumes() {
        expected.push(kind.resume_args(&s, session, "Blue."));
    }
    assert_eq!(conversation.argv(), expected);
    let end = s.store.committed().pop().unwrap();
    let first = &conversation.records[0];
    match kind {
        Kind::Gemini => {
            let projects: Value = serde_json::from_str(
                &end.text(".cairn/state/gemini/.gemini/projects.json")
                    .unwrap(),
            )
            .unwrap();
            assert_eq!(
                projects["projects"][s.root.join("app").to_str().unwrap()],
                "app"
            );
            assert!(
                end.files
                    .contains_key(".cairn/state/gemini/.gemini/tmp/app/.project_root")
            );
            // Given only the OAuth files, gemini would refuse (exit 41).
            assert_eq!(first["auth_type"], "oauth-personal", "{first}");
        }
        Kind::Opencode => {
            for (name, dir) in [
                ("XDG_DATA_HOME", "data"),
                ("XDG_CONFIG_HOME", "config"),
                ("XDG_STATE_HOME", "state"),
            ] {
                assert_eq!(
                    first["xdg"][name],
                    s.root
                        .join(".cairn/state/opencode")
                        .join(dir)
                        .to_str()
                        .unwrap(),
                    "{name}"
                );
            }
        }
        Kind::Goose => assert_eq!(first["keyring_disabled"], true),
        Kind::Aider => {
            assert!(
                conversation.text.contains("#### The codeword is PELICAN."),
                "{}",
                conversation.text
            );
            assert!(
                end.files
                    .contains_key(".cairn/state/aider/.aider.input.history")
            );
            assert!(
                !end.files.contains_key("app/.gitignore"),
                "aider wrote into the user's .gitignore"
            );
        }
        Kind::Codex | Kind::Pi | Kind::OpenHands => {}
    }
}

/// (2) On "another host" (the workspace wiped and restored at the same
/// root), the next attempt resumes the same conversation, which remembers
/// the first turn.
async fn another_host_resumes_the_conversation(kind: Kind) {
    if !kind.resumes() {
        return another_host_gets_a_lossy_briefing(kind).await;
    }
    let s = Sandbox::new(kind);
    let session = s.stop_at_the_question().await;
    s.answer_on_another_host(&session).await;

    assert_eq!(
        s.fake.sessions(),
        [session.as_str()],
        "the same conversation"
    );
    let running = s.fake.details(AttemptPhase::Running);
    assert!(
        running.iter().any(|d| d.starts_with(&format!(
            "{} resumed conversation {session} in ",
            kind.name()
        ))),
        "{running:#?}"
    );
    assert_eq!(s.fake.outcome().summary, "the codeword was PELICAN");
    assert_eq!(s.fake.outcome().consumed_inputs, [2]);
    let argv = s.conversation(&session).argv();
    assert_eq!(
        argv.last().unwrap(),
        &kind.resume_args(&s, &session, "recall codeword")
    );
}

/// (2, Aider) Aider cannot continue a conversation: the next run on the
/// station, on another host, opens a new one with the briefing labelled as
/// a lossy handoff, and Aider's restored chat history still holds the first
/// run's words.
async fn another_host_gets_a_lossy_briefing(kind: Kind) {
    let s = Sandbox::new(kind);
    s.next(s.attempt(1, PROMPT_WITHOUT_QUESTION));
    assert_eq!(s.run().await, Finished::Succeeded);
    let first = s
        .fake
        .sessions()
        .pop()
        .expect("a conversation was recorded");

    fs::remove_dir_all(&s.root).unwrap();
    // A new run on the same station: its task, and the station's conversation.
    let mut second = s.attempt(1, "recall codeword");
    second.run_id = "run-2".into();
    second.resume_session_id = first.clone();
    second.prompt_delivered = false;
    s.next(second);
    assert_eq!(s.run().await, Finished::Succeeded);

    let sessions = s.fake.sessions();
    assert_eq!(sessions.len(), 1);
    assert_ne!(sessions[0], first, "a new conversation");
    let running = s.fake.details(AttemptPhase::Running);
    assert!(
        running
            .iter()
            .any(|d| d.starts_with(&format!("{} started a new conversation in ", kind.name()))),
        "{running:#?}"
    );
    assert_eq!(s.fake.outcome().summary, "the codeword was PELICAN");
    let argv = s.conversation(&sessions[0]).argv();
    assert_eq!(argv.len(), 2);
    let message = argv[1].last().unwrap();
    assert!(
        message.starts_with(&format!(
            "{LOSSY_HANDOFF} (this harness cannot continue conversation {first})"
        )),
        "{message}"
    );
    assert!(message.contains("recall codeword"), "{message}");
    let mut briefed = kind.start_args(&s, &sessions[0], message);
    briefed.pop();
    assert_eq!(argv[1][..argv[1].len() - 1], briefed);
}

/// (3) A conversation the harness does not know is replaced by a new one
/// with the handoff briefing, which carries the task.
async fn a_lost_conversation_gets_the_briefing(kind: Kind) {
    let s = Sandbox::new(kind);
    let gone = "0f0e0d0c-0b0a-4908-8706-050403020100";
    let mut spec = s.attempt(2, "The codeword is HERON. Build the thing.");
    spec.inputs = vec![input(7, "answer", "recall codeword")];
    spec.resume_session_id = gone.into();
    spec.prompt_delivered = true;
    spec.question = "What should I remember?".into();
    s.next(spec);
    assert_eq!(s.run().await, Finished::Succeeded);

    let running = s.fake.details(AttemptPhase::Running);
    let (said, why) = if kind.resumes() {
        (
            format!(
                "{} has no conversation {gone} any more; started a new conversation with a \
                 handoff briefing (lossy handoff)",
                kind.name()
            ),
            format!("{} has no conversation {gone} any more", kind.name()),
        )
    } else {
        (
            format!(
                "{} started a new conversation in {}",
                kind.name(),
                s.root.join("app").display()
            ),
            format!("this harness cannot continue conversation {gone}"),
        )
    };
    assert!(running.contains(&said), "{running:#?}");
    let sessions = s.fake.sessions();
    assert_eq!(sessions.len(), 1, "{:#?}", s.fake.calls());
    assert_ne!(sessions[0], gone, "a new conversation");
    let outcome = s.fake.outcome();
    assert_eq!(outcome.summary, "the codeword was HERON");
    assert_eq!(outcome.consumed_inputs, [7]);
    let conversation = s.conversation(&sessions[0]);
    assert!(
        conversation
            .text
            .contains(&format!("{LOSSY_HANDOFF} ({why})")),
        "{}",
        conversation.text
    );
}

/// (4) Credentials reach the harness at the documented path and never a
/// checkpoint.
async fn credentials_are_injected_and_never_checkpointed(kind: Kind) {
    let s = Sandbox::new(kind);
    s.next(s.attempt(1, "edit a.txt one"));
    assert_eq!(s.run().await, Finished::Succeeded);
    let session = s.fake.sessions().pop().unwrap();

    let committed = s.store.committed();
    assert!(!committed.is_empty());
    for snapshot in &committed {
        for (path, content) in &snapshot.files {
            assert!(
                !String::from_utf8_lossy(content).contains(CANARY),
                "{path} in {} holds the credential",
                snapshot.id
            );
        }
        assert!(snapshot.files.keys().any(|p| p.starts_with(&kind.state())));
        assert!(!snapshot.files.contains_key(&kind.credential_path()));
    }
    let secret = fs::read(s.credentials.join(kind.credential_file())).unwrap();
    let records = s.conversation(&session).records;
    let seen = &records[0]["credentials"][kind.credential_file()];
    assert_eq!(
        seen["path"],
        s.root.join(kind.credential_path()).to_str().unwrap(),
        "{records:#?}"
    );
    assert_eq!(seen["sha256"], hex::encode(Sha256::digest(&secret)));
    assert_eq!(
        fs::read(s.root.join(kind.credential_path())).unwrap(),
        secret,
        "copied in fresh"
    );
}

/// (5, opencode and goose) The harness keeps its conversations in SQLite in
/// WAL mode and the turn leaves its writes in the `-wal` file: the
/// checkpoint taken between turns carries it, and the database restored on
/// another host has every turn.
async fn the_wal_travels_with_the_checkpoint(kind: Kind) {
    let db = kind.database().expect("a SQLite-backed harness");
    let wal = format!("{db}-wal");
    let s = Sandbox::new(kind);
    let session = s.stop_at_the_question().await;

    let pause = s.store.committed().into_iter().next().unwrap();
    assert_eq!(pause.reason, CheckpointReason::Pause);
    assert!(
        pause.files.get(&wal).is_some_and(|w| !w.is_empty()),
        "the WAL is in the checkpoint: {:?}",
        pause.files.keys().collect::<Vec<_>>()
    );
    let tables = "SELECT count(*) FROM sqlite_master WHERE type = 'table'";
    assert_eq!(
        query(&pause.files, db, false, tables, &[]),
        [[Value::from(0)]],
        "without its WAL the database has nothing yet"
    );
    assert_eq!(kind.user_messages(&pause.files, &session), [PROMPT]);

    s.answer_on_another_host(&session).await;
    assert_eq!(
        s.fake.outcome().summary,
        "the codeword was PELICAN",
        "the restored database answers"
    );
    let end = s.store.committed().pop().unwrap();
    assert!(end.files.get(&wal).is_some_and(|w| !w.is_empty()));
    assert_eq!(
        kind.user_messages(&end.files, &session),
        [PROMPT, "recall codeword"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_first_turn_records_the_session() {
    first_turn_records_the_session(Kind::Codex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_another_host_resumes_the_conversation() {
    another_host_resumes_the_conversation(Kind::Codex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_a_lost_conversation_gets_the_briefing() {
    a_lost_conversation_gets_the_briefing(Kind::Codex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_credentials_are_injected_and_never_checkpointed() {
    credentials_are_injected_and_never_checkpointed(Kind::Codex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_first_turn_records_the_session() {
    first_turn_records_the_session(Kind::Gemini).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_another_host_resumes_the_conversation() {
    another_host_resumes_the_conversation(Kind::Gemini).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_a_lost_conversation_gets_the_briefing() {
    a_lost_conversation_gets_the_briefing(Kind::Gemini).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_credentials_are_injected_and_never_checkpointed() {
    credentials_are_injected_and_never_checkpointed(Kind::Gemini).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pi_first_turn_records_the_session() {
    first_turn_records_the_session(Kind::Pi).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pi_another_host_resumes_the_conversation() {
    another_host_resumes_the_conversation(Kind::Pi).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pi_a_lost_conversation_gets_the_briefing() {
    a_lost_conversation_gets_the_briefing(Kind::Pi).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pi_credentials_are_injected_and_never_checkpointed() {
    credentials_are_injected_and_never_checkpointed(Kind::Pi).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_first_turn_records_the_session() {
    first_turn_records_the_session(Kind::Opencode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_another_host_resumes_the_conversation() {
    another_host_resumes_the_conversation(Kind::Opencode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_a_lost_conversation_gets_the_briefing() {
    a_lost_conversation_gets_the_briefing(Kind::Opencode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_credentials_are_injected_and_never_checkpointed() {
    credentials_are_injected_and_never_checkpointed(Kind::Opencode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_the_wal_travels_with_the_checkpoint() {
    the_wal_travels_with_the_checkpoint(Kind::Opencode).await;
}

/// The first run on a forked workspace forks the source's conversation:
/// a new id that remembers the source's turns, the source left as it was
/// (opencode keeps its conversations in SQLite: read them there too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_a_forked_workspace_forks_the_conversation() {
    let (end, source, forked) = a_forked_workspace_forks_the_conversation(Kind::Opencode).await;
    assert_eq!(
        Kind::Opencode.user_messages(&end.files, &forked),
        ["The codeword is PELICAN.", "recall codeword"]
    );
    assert_eq!(
        Kind::Opencode.user_messages(&end.files, &source),
        ["The codeword is PELICAN."],
        "the source is left as it was"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goose_first_turn_records_the_session() {
    first_turn_records_the_session(Kind::Goose).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goose_another_host_resumes_the_conversation() {
    another_host_resumes_the_conversation(Kind::Goose).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goose_a_lost_conversation_gets_the_briefing() {
    a_lost_conversation_gets_the_briefing(Kind::Goose).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goose_credentials_are_injected_and_never_checkpointed() {
    credentials_are_injected_and_never_checkpointed(Kind::Goose).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goose_the_wal_travels_with_the_checkpoint() {
    the_wal_travels_with_the_checkpoint(Kind::Goose).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openhands_first_turn_records_the_session() {
    first_turn_records_the_session(Kind::OpenHands).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openhands_another_host_resumes_the_conversation() {
    another_host_resumes_the_conversation(Kind::OpenHands).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openhands_a_lost_conversation_gets_the_briefing() {
    a_lost_conversation_gets_the_briefing(Kind::OpenHands).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openhands_credentials_are_injected_and_never_checkpointed() {
    credentials_are_injected_and_never_checkpointed(Kind::OpenHands).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_first_turn_records_the_session() {
    first_turn_records_the_session(Kind::Aider).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_another_host_gets_a_lossy_briefing_and_its_history() {
    another_host_resumes_the_conversation(Kind::Aider).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_a_lost_conversation_gets_the_briefing() {
    a_lost_conversation_gets_the_briefing(Kind::Aider).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_credentials_are_injected_and_never_checkpointed() {
    credentials_are_injected_and_never_checkpointed(Kind::Aider).await;
}

/// (6) A turn the model provider refused fails the attempt, with the
/// harness's reason, even where the CLI exits 0 (pi, OpenHands, Aider).
async fn an_api_error_fails_the_attempt(kind: Kind) {
    let s = Sandbox::new(kind);
    s.next(s.attempt(1, "The codeword is WREN.\napi-error"));
    assert_eq!(s.run().await, Finished::Failed);
    let outcome = s.fake.outcome();
    assert!(
        !outcome.error.is_empty() && outcome.summary.is_empty(),
        "{outcome:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_an_api_error_fails_the_attempt() {
    an_api_error_fails_the_attempt(Kind::Codex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_an_api_error_fails_the_attempt() {
    an_api_error_fails_the_attempt(Kind::Gemini).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pi_an_api_error_fails_the_attempt() {
    an_api_error_fails_the_attempt(Kind::Pi).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_an_api_error_fails_the_attempt() {
    an_api_error_fails_the_attempt(Kind::Opencode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goose_an_api_error_fails_the_attempt() {
    an_api_error_fails_the_attempt(Kind::Goose).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openhands_an_api_error_fails_the_attempt() {
    an_api_error_fails_the_attempt(Kind::OpenHands).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_an_api_error_fails_the_attempt() {
    an_api_error_fails_the_attempt(Kind::Aider).await;
}

/// A first gemini turn that failed leaves a chat gemini deletes at its
/// next start; resuming it then says "No previous sessions found", which
/// is a lost conversation: the next attempt starts over with the briefing
/// instead of failing the same way forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_a_failed_first_turn_is_resumed_as_lost() {
    let s = Sandbox::new(Kind::Gemini);
    s.next(s.attempt(1, "The codeword is WREN.\napi-error"));
    assert_eq!(s.run().await, Finished::Failed);
    let failed = s.fake.sessions().pop().expect("gemini reported its id");

    let mut second = s.attempt(2, "The codeword is WREN.");
    second.inputs = vec![input(3, "answer", "recall codeword")];
    second.resume_session_id = failed.clone();
    second.prompt_delivered = true;
    second.question = "What should I remember?".into();
    s.next(second);
    assert_eq!(s.run().await, Finished::Succeeded);
    let running = s.fake.details(AttemptPhase::Running);
    assert!(
        running.contains(&format!(
            "gemini has no conversation {failed} any more; started a new conversation with a \
             handoff briefing (lossy handoff)"
        )),
        "{running:#?}"
    );
    assert_eq!(s.fake.outcome().summary, "the codeword was WREN");
}

/// Codex refuses to run outside a git repository unless told not to: a
/// workspace with no repository (the cwd is the root) still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_runs_in_a_workspace_without_a_repository() {
    let s = Sandbox::new(Kind::Codex);
    fs::remove_dir_all(s.root.join("app")).unwrap();
    s.next(s.attempt(1, "edit notes.md one line"));
    assert_eq!(s.run().await, Finished::Succeeded, "{:#?}", s.fake.calls());
    let running = s.fake.details(AttemptPhase::Running);
    assert!(
        running.iter().any(|d| d.starts_with(&format!(
            "codex started a new conversation in {}",
            s.root.display()
        ))),
        "{running:#?}"
    );
}

/// OpenHands without LLM settings exits 0 and prints a conversation id
/// with nothing behind it: the turn fails, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openhands_without_settings_fails_the_turn() {
    let s = Sandbox::new(Kind::OpenHands);
    fs::remove_file(s.credentials.join(Kind::OpenHands.credential_file())).unwrap();
    s.next(s.attempt(1, "edit a.txt one"));
    assert_eq!(s.run().await, Finished::Failed);
    let outcome = s.fake.outcome();
    assert!(
        outcome
            .error
            .starts_with("Headless mode requires existing settings"),
        "{outcome:?}"
    );
}

/// Aider with no model and no key would wait minutes for a browser login:
/// the turn is stopped at once and fails, saying what to set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_without_model_or_key_fails_at_once() {
    let s = Sandbox::new(Kind::Aider);
    let harness = s.harness("aider", &Kind::Aider.double());
    s.next(s.harnessed.attempt(1, "edit a.txt one", harness));
    let started = std::time::Instant::now();
    assert_eq!(s.run().await, Finished::Failed);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "the runner waited for the browser login"
    );
    let outcome = s.fake.outcome();
    assert!(
        outcome.error.contains("No LLM model was specified") && outcome.error.contains("`model`"),
        "{outcome:?}"
    );
}

/// The first run on a forked workspace forks the source's conversation
/// (codex `exec fork`, pi `--fork`, opencode `--fork`): a new id that
/// remembers the source's turns, the source left as it was. Returns the
/// last checkpoint, the source's id and the fork's.
async fn a_forked_workspace_forks_the_conversation(kind: Kind) -> (Snapshot, String, String) {
    let s = Sandbox::new(kind);
    s.next(s.attempt(1, "The codeword is PELICAN."));
    assert_eq!(s.run().await, Finished::Succeeded);
    let source = s.fake.sessions().pop().unwrap();

    let mut fork = s.attempt(1, "recall codeword");
    fork.run_id = "run-2".into();
    fork.workspace_id = "ws-00000000000000000000000002".into();
    fork.resume_session_id = source.clone();
    fork.prompt_delivered = false;
    fork.fork_session = true;
    s.next(fork);
    assert_eq!(s.run().await, Finished::Succeeded, "{:#?}", s.fake.calls());

    let forked = s.fake.sessions().pop().unwrap();
    assert_ne!(forked, source, "a new id");
    let running = s.fake.details(AttemptPhase::Running);
    assert!(
        running
            .iter()
            .any(|d| d.starts_with(&format!("{} forked conversation {source} in ", kind.name()))),
        "{running:#?}"
    );
    assert_eq!(s.fake.outcome().summary, "the codeword was PELICAN");
    let end = s.store.committed().pop().unwrap();
    let source_text = kind.conversation(&end, &source).text;
    assert!(
        !source_text.contains("recall codeword"),
        "the source is left as it was: {source_text}"
    );
    let forked_conversation = kind.conversation(&end, &forked);
    assert!(forked_conversation.text.contains("recall codeword"));
    let last = forked_conversation.argv().pop().unwrap();
    let expected = match kind {
        Kind::Codex => strings(&[
            "exec",
            "fork",
            &source,
            "recall codeword",
            "--json",
            "--skip-git-repo-check",
        ]),
        Kind::Pi => {
            let source_file = s.root.join(
                end.files
                    .iter()
                    .find(|(p, content)| {
                        p.starts_with(".cairn/state/pi/sessions/")
                            && pi_header_id(content) == source
                    })
                    .map(|(p, _)| p.clone())
                    .unwrap(),
            );
            strings(&[
                "--mode",
                "json",
                "--fork",
                source_file.to_str().unwrap(),
                "recall codeword",
            ])
        }
        Kind::Opencode => strings(&[
            "run",
            "-s",
            &source,
            "--fork",
            "recall codeword",
            "--format",
            "json",
        ]),
        _ => unreachable!("{kind:?} cannot fork"),
    };
    assert_eq!(last, expected);
    (end, source, forked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_a_forked_workspace_forks_the_conversation() {
    a_forked_workspace_forks_the_conversation(Kind::Codex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pi_a_forked_workspace_forks_the_conversation() {
    a_forked_workspace_forks_the_conversation(Kind::Pi).await;
}
