//! The `codex` and `gemini` adapters driven by the run state machine
//! (`cairn_runner::run::run`), against the same fake RunnerService and
//! snapshotting store as run_attempt.rs (both in attempt_support/), with the
//! Python test doubles in tests/doubles/ as the harnesses. The doubles honour
//! each CLI's documented contract (flags, files, id reports, refusals) and
//! remember earlier turns by reading their own transcripts; each turn also
//! records its arguments and the credential files it saw (as SHA-256) in the
//! transcript.

mod attempt_support;

use std::fs;
use std::ops::Deref;

use attempt_support::*;
use cairn_proto::domain::CheckpointReason;
use cairn_proto::pb::{self, AttemptPhase};
use cairn_runner::run::Finished;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

/// Which harness a test drives.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Codex,
    Gemini,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Codex => "codex",
            Self::Gemini => "gemini",
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

    /// Where the credential file lives, relative to the root.
    fn credential_path(self) -> String {
        match self {
            Self::Codex => ".cairn/state/codex/auth.json".into(),
            Self::Gemini => ".cairn/state/gemini/.gemini/oauth_creds.json".into(),
        }
    }

    fn credential_file(self) -> &'static str {
        match self {
            Self::Codex => "auth.json",
            Self::Gemini => "oauth_creds.json",
        }
    }

    /// Whether `path` (relative to the root) is the transcript of `session`.
    fn is_transcript(self, path: &str, content: &[u8], session: &str) -> bool {
        match self {
            Self::Codex => {
                path.starts_with(".cairn/state/codex/sessions/")
                    && path.ends_with(&format!("-{session}.jsonl"))
            }
            Self::Gemini => {
                path.starts_with(".cairn/state/gemini/.gemini/tmp/app/chats/session-")
                    && path.ends_with(&format!("-{}.jsonl", &session[..8]))
                    && String::from_utf8_lossy(content)
                        .lines()
                        .next()
                        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                        .is_some_and(|v| v["sessionId"] == session)
            }
        }
    }

    /// The test double's own record of each turn (arguments, credentials seen).
    fn records(self, transcript: &str) -> Vec<serde_json::Value> {
        transcript
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["type"] == "cairn_double")
            .map(|v| match self {
                Self::Codex => v["payload"].clone(),
                Self::Gemini => v,
            })
            .collect()
    }
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
        let harness = self.harness(self.kind.name(), &self.kind.double());
        self.harnessed.attempt(attempt, prompt, harness)
    }

    async fn run(&self) -> Finished {
        self.run_until(CancellationToken::new()).await
    }

    /// Runs one attempt; `shutdown` plays the host's SIGTERM.
    async fn run_until(&self, shutdown: CancellationToken) -> Finished {
        self.harnessed.run(shutdown).await.unwrap()
    }

    /// The transcript of `session` in the newest checkpoint.
    fn transcript(&self, session: &str) -> String {
        let newest = self.store.committed().pop().expect("a checkpoint");
        newest
            .files
            .iter()
            .find(|(p, c)| self.kind.is_transcript(p, c, session))
            .map(|(_, c)| String::from_utf8(c.clone()).unwrap())
            .unwrap_or_else(|| {
                panic!(
                    "no transcript of {session} in {:?}",
                    newest.files.keys().collect::<Vec<_>>()
                )
            })
    }
}

const PROMPT: &str = "The codeword is PELICAN.\n\
                      commit notes.md first line\n\
                      edit notes.md second line\n\
                      ask Which colour should the button be?";

/// (1) The first turn records the id the harness reported; a question is
/// answered in the same sandbox by resuming that conversation.
async fn first_turn_records_the_session(kind: Kind) {
    let s = Sandbox::new(kind);
    s.next(s.attempt(1, PROMPT));
    s.answer(vec![input(2, "answer", "Blue.")]);
    assert_eq!(s.run().await, Finished::Succeeded);

    let sessions = s.fake.sessions();
    assert_eq!(sessions.len(), 1, "{:#?}", s.fake.calls());
    let session = &sessions[0];
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
    let pause = &s.store.committed()[0];
    assert_eq!(pause.session.as_ref(), Some(session));
    assert_eq!(
        pause.text("app/notes.md").as_deref(),
        Some("first line\nsecond line\n")
    );
    let repo = git2::Repository::open(s.root.join("app")).unwrap();
    let head = repo.head().unwrap().peel_to_commit().unwrap();
    assert_eq!(head.message().map(str::trim), Some("test double: notes.md"));

    let transcript = s.transcript(session);
    let records = kind.records(&transcript);
    let argv: Vec<Vec<String>> = records
        .iter()
        .map(|r| serde_json::from_value(r["argv"].clone()).unwrap())
        .collect();
    match kind {
        Kind::Codex => assert_eq!(
            argv,
            [
                vec!["exec".to_owned(), PROMPT.into(), "--json".into()],
                vec![
                    "exec".to_owned(),
                    "resume".into(),
                    session.clone(),
                    "Blue.".into(),
                    "--json".into()
                ],
            ]
        ),
        Kind::Gemini => {
            assert_eq!(
                argv,
                [
                    vec![
                        "-p".to_owned(),
                        PROMPT.into(),
                        "--output-format".into(),
                        "stream-json".into(),
                        "--session-id".into(),
                        session.clone()
                    ],
                    vec![
                        "-p".to_owned(),
                        "Blue.".into(),
                        "--output-format".into(),
                        "stream-json".into(),
                        "--resume".into(),
                        session.clone()
                    ],
                ]
            );
            let end = s.store.committed().pop().unwrap();
            let projects: serde_json::Value = serde_json::from_str(
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
        }
    }
}

/// (2) On "another host" (the workspace wiped and restored at the same
/// root), the next attempt resumes the same conversation, which remembers
/// the first turn.
async fn another_host_resumes_the_conversation(kind: Kind) {
    let s = Sandbox::new(kind);
    s.next(s.attempt(1, PROMPT));
    // The question goes unanswered; the host stops the sandbox.
    let shutdown = stop_once_waiting(&s.fake);
    assert_eq!(s.run_until(shutdown).await, Finished::Interrupted);
    let session = s.fake.sessions().pop().expect("a session was reported");

    fs::remove_dir_all(&s.root).unwrap();
    let mut second = s.attempt(2, PROMPT);
    second.inputs = vec![input(2, "answer", "recall codeword")];
    second.resume_session_id = session.clone();
    second.prompt_delivered = true;
    second.question = "Which colour should the button be?".into();
    s.next(second);
    assert_eq!(s.run().await, Finished::Succeeded);

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
    let records = kind.records(&s.transcript(&session));
    let last: Vec<String> =
        serde_json::from_value(records.last().unwrap()["argv"].clone()).unwrap();
    let resume_form: Vec<String> = match kind {
        Kind::Codex => vec![
            "exec".into(),
            "resume".into(),
            session.clone(),
            "recall codeword".into(),
            "--json".into(),
        ],
        Kind::Gemini => vec![
            "-p".into(),
            "recall codeword".into(),
            "--output-format".into(),
            "stream-json".into(),
            "--resume".into(),
            session.clone(),
        ],
    };
    assert_eq!(last, resume_form);
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
    assert!(
        running.contains(&format!(
            "{} has no conversation {gone} any more; started a new conversation with a handoff \
             briefing (lossy handoff)",
            kind.name()
        )),
        "{running:#?}"
    );
    let sessions = s.fake.sessions();
    assert_eq!(sessions.len(), 1);
    assert_ne!(sessions[0], gone, "a new conversation");
    let outcome = s.fake.outcome();
    assert_eq!(outcome.summary, "the codeword was HERON");
    assert_eq!(outcome.consumed_inputs, [7]);
    let transcript = s.transcript(&sessions[0]);
    assert!(
        transcript.contains("lossy handoff: the earlier conversation could not be resumed"),
        "{transcript}"
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
    }
    let secret = fs::read(s.credentials.join(kind.credential_file())).unwrap();
    let records = kind.records(&s.transcript(&session));
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
