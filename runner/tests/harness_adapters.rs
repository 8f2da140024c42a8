//! The `codex` and `gemini` adapters driven by the run state machine
//! (`cairn_runner::run::run`), against the same fake RunnerService and
//! snapshotting store as run_attempt.rs (copied here), with the Python test
//! doubles in tests/doubles/ as the harnesses. The doubles honour each CLI's
//! documented contract (flags, files, id reports, refusals) and remember
//! earlier turns by reading their own transcripts; each turn also records its
//! arguments and the credential files it saw (as SHA-256) in the transcript.

use std::collections::{BTreeMap, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cairn_proto::domain::CheckpointReason;
use cairn_proto::ids::BlobId;
use cairn_proto::pb::runner_service_server::{RunnerService, RunnerServiceServer};
use cairn_proto::pb::{self, AttemptPhase};
use cairn_runner::checkpoint::{Baseline, CheckpointError};
use cairn_runner::client::Coordinator;
use cairn_runner::run::{
    self, CheckpointRequest, Checkpointed, Control, Finished, Restored, RunOptions, StoreError,
    StoreTarget, WorkspaceStore,
};
use futures::future::BoxFuture;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

const TOKEN: &str = "run-token-1";
const LIMIT: Duration = Duration::from_secs(60);

/// One call the runner made.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    Claim,
    Progress {
        phase: AttemptPhase,
        detail: String,
        checkpoint: String,
    },
    Session {
        harness: String,
        id: String,
    },
    Waiting {
        question: String,
        checkpoint: String,
        consumed: Vec<u64>,
    },
    WaitForInput,
    Outcome(pb::ReportOutcomeRequest),
}

#[derive(Default)]
struct FakeState {
    spec: pb::AttemptSpec,
    calls: Vec<Call>,
    /// Answers handed out by WaitForInput, one batch per call, once waiting.
    answers: VecDeque<Vec<pb::RunInput>>,
    /// When set, every call after the claim is refused as superseded.
    superseded: bool,
}

#[derive(Clone, Default)]
struct FakeRunnerService(Arc<Mutex<FakeState>>);

impl FakeRunnerService {
    fn check<T>(&self, request: &Request<T>, call: Call) -> Result<(), Status> {
        let auth = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        if auth != Some(&format!("Bearer {TOKEN}")) {
            return Err(Status::unauthenticated("no run token"));
        }
        let mut state = self.0.lock().unwrap();
        let superseded = state.superseded && call != Call::Claim;
        state.calls.push(call);
        if superseded {
            return Err(Status::failed_precondition(
                "attempt 1 of run run-1 was superseded by attempt 2",
            ));
        }
        Ok(())
    }

    fn calls(&self) -> Vec<Call> {
        self.0.lock().unwrap().calls.clone()
    }

    fn outcome(&self) -> pb::ReportOutcomeRequest {
        self.calls()
            .into_iter()
            .find_map(|c| match c {
                Call::Outcome(o) => Some(o),
                _ => None,
            })
            .expect("an outcome was reported")
    }

    fn details(&self, phase: AttemptPhase) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Progress {
                    phase: p, detail, ..
                } if p == phase => Some(detail),
                _ => None,
            })
            .collect()
    }

    fn sessions(&self) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Session { id, .. } => Some(id),
                _ => None,
            })
            .collect()
    }

    /// Waits (bounded) until `done` holds for the calls so far.
    async fn until(&self, what: &str, done: impl Fn(&[Call]) -> bool) {
        let deadline = tokio::time::Instant::now() + LIMIT;
        while !done(&self.calls()) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "gave up waiting for {what}: {:#?}",
                self.calls()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tonic::async_trait]
impl RunnerService for FakeRunnerService {
    async fn claim_attempt(
        &self,
        request: Request<pb::ClaimAttemptRequest>,
    ) -> Result<Response<pb::AttemptSpec>, Status> {
        self.check(&request, Call::Claim)?;
        Ok(Response::new(self.0.lock().unwrap().spec.clone()))
    }

    async fn report_progress(
        &self,
        request: Request<pb::ReportProgressRequest>,
    ) -> Result<Response<pb::ReportAck>, Status> {
        let r = request.get_ref();
        let phase = AttemptPhase::try_from(r.phase).unwrap();
        let call = Call::Progress {
            phase,
            detail: r.detail.clone(),
            checkpoint: r.checkpoint_id.clone(),
        };
        self.check(&request, call)?;
        Ok(Response::new(pb::ReportAck {}))
    }

    async fn report_harness_session(
        &self,
        request: Request<pb::ReportHarnessSessionRequest>,
    ) -> Result<Response<pb::ReportAck>, Status> {
        let r = request.get_ref();
        self.check(
            &request,
            Call::Session {
                harness: r.harness.clone(),
                id: r.session_id.clone(),
            },
        )?;
        Ok(Response::new(pb::ReportAck {}))
    }

    async fn report_waiting(
        &self,
        request: Request<pb::ReportWaitingRequest>,
    ) -> Result<Response<pb::ReportWaitingResponse>, Status> {
        let r = request.get_ref();
        let call = Call::Waiting {
            question: r.question.clone(),
            checkpoint: r.checkpoint_id.clone(),
            consumed: r.consumed_inputs.clone(),
        };
        self.check(&request, call)?;
        Ok(Response::new(pb::ReportWaitingResponse {
            hold_until: None,
        }))
    }

    async fn wait_for_input(
        &self,
        request: Request<pb::WaitForInputRequest>,
    ) -> Result<Response<pb::WaitForInputResponse>, Status> {
        self.check(&request, Call::WaitForInput)?;
        let timeout = cairn_proto::runs::from_proto_duration(
            request.get_ref().timeout.as_ref().unwrap(),
            "timeout",
        )
        .unwrap();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(inputs) = self.0.lock().unwrap().answers.pop_front() {
                return Ok(Response::new(pb::WaitForInputResponse { inputs }));
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(Response::new(pb::WaitForInputResponse { inputs: vec![] }));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn report_outcome(
        &self,
        request: Request<pb::ReportOutcomeRequest>,
    ) -> Result<Response<pb::ReportAck>, Status> {
        let call = Call::Outcome(request.get_ref().clone());
        self.check(&request, call)?;
        Ok(Response::new(pb::ReportAck {}))
    }
}

/// Serves the fake on a free local port; returns a Control carrying the run token.
async fn serve(fake: &FakeRunnerService) -> Control {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let incoming = futures::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| stream);
        Some((accepted, listener))
    });
    let service = RunnerServiceServer::new(fake.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming),
    );
    let coordinator = Coordinator::connect(&address, Some(TOKEN)).await.unwrap();
    Control::new(coordinator.auth_channel())
}

/// A checkpoint the store took: the reason and the workspace's files then.
#[derive(Debug, Clone)]
struct Snapshot {
    id: String,
    reason: CheckpointReason,
    session: Option<String>,
    files: BTreeMap<String, Vec<u8>>,
}

impl Snapshot {
    fn text(&self, path: &str) -> Option<String> {
        self.files
            .get(path)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }
}

#[derive(Default)]
struct StoreState {
    committed: Vec<Snapshot>,
    /// Interval checkpoints skipped because nothing changed.
    skipped: usize,
    restores: usize,
    targets: Vec<StoreTarget>,
    /// Commits are refused as from a stale generation.
    fenced: bool,
}

/// Checkpoints by copying every file's content (the root tree id is a
/// digest of them); restores the newest copy into an emptied root.
#[derive(Clone)]
struct SnapshotStore {
    root: PathBuf,
    state: Arc<Mutex<StoreState>>,
}

fn read_tree(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
    for entry in fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let path = entry.path();
        let kind = entry.file_type().unwrap();
        if kind.is_dir() {
            read_tree(root, &path, out);
        } else if kind.is_file() {
            let relative = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            out.insert(relative, fs::read(&path).unwrap());
        }
    }
}

fn digest(files: &BTreeMap<String, Vec<u8>>) -> BlobId {
    let mut hasher = Sha256::new();
    for (path, content) in files {
        hasher.update(path.as_bytes());
        hasher.update([0]);
        hasher.update(Sha256::digest(content));
    }
    BlobId(hasher.finalize().into())
}

impl SnapshotStore {
    fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            state: Arc::default(),
        }
    }

    fn committed(&self) -> Vec<Snapshot> {
        self.state.lock().unwrap().committed.clone()
    }

    fn reasons(&self) -> Vec<CheckpointReason> {
        self.committed().iter().map(|s| s.reason).collect()
    }

    fn excluded(&self, path: &str) -> bool {
        let state = self.state.lock().unwrap();
        let target = state
            .targets
            .last()
            .expect("the store was made for an attempt");
        target.excludes.iter().any(|pattern| {
            let pattern = pattern.trim_start_matches('/');
            match pattern.strip_suffix('*') {
                Some(prefix) => path.starts_with(prefix),
                // A trailing '/' names a directory and all below it.
                None if pattern.ends_with('/') => path.starts_with(pattern),
                None => path == pattern,
            }
        })
    }
}

impl WorkspaceStore for SnapshotStore {
    fn restore(&self) -> BoxFuture<'_, Result<Restored, StoreError>> {
        Box::pin(async move {
            let mut state = self.state.lock().unwrap();
            state.restores += 1;
            let Some(newest) = state.committed.last().cloned() else {
                return Ok(Restored::NoCheckpoint);
            };
            if self.root.exists() {
                fs::remove_dir_all(&self.root).unwrap();
            }
            for (path, content) in &newest.files {
                let full = self.root.join(path);
                fs::create_dir_all(full.parent().unwrap()).unwrap();
                fs::write(full, content).unwrap();
            }
            Ok(Restored::Checkpoint {
                id: newest.id.clone(),
                root_tree: Some(digest(&newest.files)),
                summary: format!("restored checkpoint {}", newest.id),
            })
        })
    }

    fn checkpoint(
        &self,
        request: CheckpointRequest,
    ) -> BoxFuture<'_, Result<Option<Checkpointed>, StoreError>> {
        Box::pin(async move {
            let mut files = BTreeMap::new();
            read_tree(&self.root, &self.root, &mut files);
            files.retain(|path, _| !self.excluded(path));
            let root_tree = digest(&files);
            let mut state = self.state.lock().unwrap();
            if state.fenced {
                return Err(StoreError::Checkpoint(CheckpointError::Rpc {
                    call: "CommitCheckpoint",
                    status: Status::failed_precondition(
                        "generation 1 is older than the workspace's generation 2",
                    ),
                }));
            }
            let newest = state
                .committed
                .last()
                .map(|s| s.id.clone())
                .unwrap_or_default();
            if let Some(Baseline {
                checkpoint_id,
                root_tree: before,
            }) = &request.unless_unchanged
                && *checkpoint_id == newest
                && *before == root_tree
            {
                state.skipped += 1;
                return Ok(None);
            }
            let id = format!("ck-{}", state.committed.len() + 1);
            state.committed.push(Snapshot {
                id: id.clone(),
                reason: request.reason,
                session: request.harness.map(|h| h.session_id),
                files,
            });
            Ok(Some(Checkpointed {
                id: id.clone(),
                root_tree,
                summary: format!("{} checkpoint {id}", request.reason),
            }))
        })
    }
}

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

/// A run's sandbox: a workspace root, the fake coordinator and the store.
struct Sandbox {
    _dir: tempfile::TempDir,
    kind: Kind,
    root: PathBuf,
    credentials: PathBuf,
    fake: FakeRunnerService,
    store: SnapshotStore,
}

const CANARY: &str = "CANARY-7f3c9e1d-never-checkpoint-me";

impl Sandbox {
    fn new(kind: Kind) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let base = fs::canonicalize(dir.path()).unwrap();
        let root = base.join("workspace");
        let credentials = base.join(format!("home/.{}", kind.name()));
        fs::create_dir_all(&credentials).unwrap();
        fs::write(
            credentials.join(kind.credential_file()),
            format!("{{\"secret\":\"{CANARY}\"}}"),
        )
        .unwrap();
        git2::Repository::init(root.join("app")).unwrap();
        let store = SnapshotStore::new(&root);
        Self {
            _dir: dir,
            kind,
            root,
            credentials,
            fake: FakeRunnerService::default(),
            store,
        }
    }

    fn harness(&self) -> pb::HarnessSpec {
        pb::HarnessSpec {
            name: self.kind.name().into(),
            config: [
                ("binary".to_owned(), self.kind.double()),
                (
                    "credentials_dir".to_owned(),
                    self.credentials.to_string_lossy().into_owned(),
                ),
            ]
            .into(),
        }
    }

    fn attempt(&self, attempt: u32, prompt: &str) -> pb::AttemptSpec {
        pb::AttemptSpec {
            run_id: "run-1".into(),
            attempt,
            generation: u64::from(attempt),
            workspace_id: "ws-1".into(),
            station: "default".into(),
            harness: Some(self.harness()),
            prompt: prompt.into(),
            inputs: vec![input(1, "prompt", prompt)],
            hold: Some(cairn_proto::runs::to_proto_duration(Duration::from_secs(
                300,
            ))),
            ..Default::default()
        }
    }

    fn next(&self, spec: pb::AttemptSpec) {
        let mut state = self.fake.0.lock().unwrap();
        state.spec = spec;
        state.calls.clear();
    }

    fn answer(&self, inputs: Vec<pb::RunInput>) {
        self.fake.0.lock().unwrap().answers.push_back(inputs);
    }

    async fn run(&self) -> Finished {
        self.run_until(CancellationToken::new()).await
    }

    /// Runs one attempt; `shutdown` plays the host's SIGTERM.
    async fn run_until(&self, shutdown: CancellationToken) -> Finished {
        let control = serve(&self.fake).await;
        let store = self.store.clone();
        let stores = move |target: StoreTarget| -> Arc<dyn WorkspaceStore> {
            store.state.lock().unwrap().targets.push(target);
            Arc::new(store.clone())
        };
        let options = RunOptions {
            wait_timeout: Duration::from_millis(300),
            ..RunOptions::new(&self.root)
        };
        tokio::time::timeout(LIMIT, run::run(control, &stores, options, shutdown))
            .await
            .expect("the attempt ends")
            .unwrap()
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

fn input(id: u64, kind: &str, text: &str) -> pb::RunInput {
    pb::RunInput {
        id,
        kind: kind.into(),
        text: text.into(),
        created_at: None,
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
    let shutdown = CancellationToken::new();
    let (fake, stopper) = (s.fake.clone(), shutdown.clone());
    tokio::spawn(async move {
        fake.until("the runner to wait for input", |calls| {
            calls.contains(&Call::WaitForInput)
        })
        .await;
        stopper.cancel();
    });
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
