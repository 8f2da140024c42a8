//! The run state machine (`cairn_runner::run::run`) against a fake
//! RunnerService served over real gRPC (it honours the proto contract and
//! records every call) and a store that snapshots the workspace at every
//! checkpoint and restores snapshots — with the real demo agent as the
//! harness, through the `claude` adapter (and once through `command`).

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

const DEMO: &str = env!("CARGO_BIN_EXE_cairn-demo-agent");
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

/// A run's sandbox: a workspace root, the fake coordinator and the store.
struct Harnessed {
    _dir: tempfile::TempDir,
    root: PathBuf,
    credentials: PathBuf,
    fake: FakeRunnerService,
    store: SnapshotStore,
}

impl Harnessed {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let base = fs::canonicalize(dir.path()).unwrap();
        let root = base.join("workspace");
        let credentials = base.join("home/.claude");
        fs::create_dir_all(&credentials).unwrap();
        fs::write(
            credentials.join(".credentials.json"),
            "{\"secret\":\"do not checkpoint\"}",
        )
        .unwrap();
        let store = SnapshotStore::new(&root);
        Self {
            _dir: dir,
            root,
            credentials,
            fake: FakeRunnerService::default(),
            store,
        }
    }

    fn claude(&self) -> pb::HarnessSpec {
        pb::HarnessSpec {
            name: "claude".into(),
            config: [
                ("binary".to_owned(), DEMO.to_owned()),
                (
                    "credentials_dir".to_owned(),
                    self.credentials.to_string_lossy().into_owned(),
                ),
            ]
            .into(),
        }
    }

    /// The attempt the fake hands out next.
    fn attempt(&self, attempt: u32, prompt: &str, harness: pb::HarnessSpec) -> pb::AttemptSpec {
        pb::AttemptSpec {
            run_id: "run-1".into(),
            attempt,
            generation: u64::from(attempt),
            workspace_id: "ws-1".into(),
            station: "default".into(),
            harness: Some(harness),
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

    fn options(&self) -> RunOptions {
        RunOptions {
            wait_timeout: Duration::from_millis(300),
            ..RunOptions::new(&self.root)
        }
    }

    /// Runs one attempt to its end.
    async fn run(&self, shutdown: CancellationToken) -> Result<Finished, run::RunError> {
        let control = serve(&self.fake).await;
        let store = self.store.clone();
        let stores = move |target: StoreTarget| -> Arc<dyn WorkspaceStore> {
            store.state.lock().unwrap().targets.push(target);
            Arc::new(store.clone())
        };
        tokio::time::timeout(LIMIT, run::run(control, &stores, self.options(), shutdown))
            .await
            .expect("the attempt ends")
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
                      untracked scratch.txt draft\n\
                      ask Which colour should the button be?";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_asks_waits_and_resumes_the_same_conversation_with_the_answer() {
    let h = Harnessed::new();
    git2::Repository::init(h.root.join("app")).unwrap();
    h.next(h.attempt(1, PROMPT, h.claude()));
    h.answer(vec![input(2, "answer", "Blue.\nrecall codeword")]);

    let finished = h.run(CancellationToken::new()).await.unwrap();
    assert_eq!(finished, Finished::Succeeded);

    let calls = h.fake.calls();
    assert_eq!(calls[0], Call::Claim);
    assert_eq!(
        h.fake.details(AttemptPhase::Preparing),
        ["workspace has no checkpoint: started empty"]
    );
    let sessions = h.fake.sessions();
    assert_eq!(
        sessions.len(),
        1,
        "one conversation, reported once: {calls:#?}"
    );
    let session = &sessions[0];

    // The turn ended in a question: a pause checkpoint holding the work, then waiting.
    let committed = h.store.committed();
    assert_eq!(
        h.store.reasons(),
        [CheckpointReason::Pause, CheckpointReason::End]
    );
    let pause = &committed[0];
    assert_eq!(pause.session.as_ref(), Some(session));
    assert_eq!(
        pause.text("app/notes.md").as_deref(),
        Some("first line\nsecond line\n")
    );
    assert_eq!(pause.text("app/scratch.txt").as_deref(), Some("draft\n"));
    assert!(
        pause
            .files
            .keys()
            .any(|p| p.starts_with(".cairn/state/claude/projects/")
                && p.ends_with(&format!("{session}.jsonl")))
    );
    assert!(
        !pause
            .files
            .contains_key(".cairn/state/claude/.credentials.json"),
        "credentials are never checkpointed"
    );
    assert!(
        h.root
            .join(".cairn/state/claude/.credentials.json")
            .exists(),
        "but they were copied in for the harness"
    );
    assert!(
        !pause.files.contains_key(".cairn/outcome.json"),
        "the outcome file was read and removed"
    );
    let waiting = calls
        .iter()
        .find_map(|c| match c {
            Call::Waiting {
                question,
                checkpoint,
                consumed,
            } => Some((question.clone(), checkpoint.clone(), consumed.clone())),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        waiting,
        (
            "Which colour should the button be?".to_owned(),
            pause.id.clone(),
            vec![1]
        )
    );
    let checkpointed: Vec<&Call> = calls
        .iter()
        .filter(|c| {
            matches!(
                c,
                Call::Progress {
                    phase: AttemptPhase::Checkpointed,
                    ..
                }
            )
        })
        .collect();
    assert!(
        matches!(checkpointed[0], Call::Progress { checkpoint, .. } if *checkpoint == pause.id)
    );

    // The answer went to the same conversation (--resume), which remembered turn one.
    let running = h.fake.details(AttemptPhase::Running);
    assert!(
        running
            .iter()
            .any(|d| *d == format!("answered; resuming conversation {session}")),
        "{running:#?}"
    );
    assert!(
        running
            .iter()
            .any(|d| d.starts_with(&format!("claude resumed conversation {session} in "))),
        "{running:#?}"
    );
    let outcome = h.fake.outcome();
    assert_eq!(outcome.outcome, pb::Outcome::Succeeded as i32);
    assert_eq!(outcome.summary, "the codeword was PELICAN");
    assert_eq!(outcome.checkpoint_id, committed[1].id, "the end checkpoint");
    assert_eq!(outcome.consumed_inputs, [1, 2]);
    assert!(
        matches!(calls.last(), Some(Call::Outcome(_))),
        "the outcome is the last word"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_waiting_cuts_a_destroy_checkpoint_and_reports_interrupted() {
    let h = Harnessed::new();
    h.next(h.attempt(1, PROMPT, h.claude()));
    let shutdown = CancellationToken::new();
    let fake = h.fake.clone();
    let stopper = shutdown.clone();
    tokio::spawn(async move {
        fake.until("the runner to wait for input", |calls| {
            calls.contains(&Call::WaitForInput)
        })
        .await;
        stopper.cancel();
    });

    let finished = h.run(shutdown).await.unwrap();
    assert_eq!(finished, Finished::Interrupted);
    assert_eq!(
        h.store.reasons(),
        [CheckpointReason::Pause, CheckpointReason::Destroy]
    );
    let outcome = h.fake.outcome();
    assert_eq!(outcome.outcome, pb::Outcome::Interrupted as i32);
    assert_eq!(outcome.checkpoint_id, h.store.committed()[1].id);
    assert_eq!(outcome.consumed_inputs, [1], "the prompt was heard");
    assert_eq!(outcome.error, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_turn_stops_the_harness_then_checkpoints() {
    let h = Harnessed::new();
    h.next(h.attempt(
        1,
        "edit work.txt half done\nsleep 120\nedit work.txt never written",
        h.claude(),
    ));
    let shutdown = CancellationToken::new();
    let stopper = shutdown.clone();
    let work = h.root.join("work.txt");
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + LIMIT;
        while !work.exists() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stopper.cancel();
    });

    let finished = h.run(shutdown).await.unwrap();
    assert_eq!(finished, Finished::Interrupted);
    assert_eq!(h.store.reasons(), [CheckpointReason::Destroy]);
    let destroy = &h.store.committed()[0];
    assert_eq!(
        destroy.text("work.txt").as_deref(),
        Some("half done\n"),
        "the agent was stopped mid-sleep"
    );
    assert_eq!(h.fake.outcome().outcome, pb::Outcome::Interrupted as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_run_resumes_after_a_restore_and_recalls_the_first_turn() {
    let h = Harnessed::new();
    git2::Repository::init(h.root.join("app")).unwrap();
    h.next(h.attempt(1, PROMPT, h.claude()));
    let shutdown = CancellationToken::new();
    let fake = h.fake.clone();
    let stopper = shutdown.clone();
    tokio::spawn(async move {
        fake.until("the runner to wait for input", |calls| {
            calls.contains(&Call::WaitForInput)
        })
        .await;
        stopper.cancel();
    });
    assert_eq!(h.run(shutdown).await.unwrap(), Finished::Interrupted);
    let session = h.fake.sessions().pop().unwrap();

    // The sandbox is gone; the next attempt restores the newest checkpoint at the same path.
    fs::remove_dir_all(&h.root).unwrap();
    let mut second = h.attempt(2, PROMPT, h.claude());
    second.inputs = vec![input(2, "answer", "Blue.\nrecall codeword")];
    second.resume_session_id = session.clone();
    second.prompt_delivered = true;
    second.question = "Which colour should the button be?".into();
    h.next(second);

    assert_eq!(
        h.run(CancellationToken::new()).await.unwrap(),
        Finished::Succeeded
    );
    let restoring: Vec<Call> = h
        .fake
        .calls()
        .into_iter()
        .filter(|c| {
            matches!(
                c,
                Call::Progress {
                    phase: AttemptPhase::Restoring,
                    ..
                }
            )
        })
        .collect();
    assert_eq!(
        restoring,
        [Call::Progress {
            phase: AttemptPhase::Restoring,
            detail: "restored checkpoint ck-2".into(),
            checkpoint: "ck-2".into()
        }]
    );
    assert_eq!(h.fake.sessions(), [session], "the same conversation");
    let outcome = h.fake.outcome();
    assert_eq!(outcome.summary, "the codeword was PELICAN");
    assert_eq!(outcome.consumed_inputs, [2]);
    let end = h.store.committed().pop().unwrap();
    assert_eq!(end.reason, CheckpointReason::End);
    assert_eq!(
        end.text("app/notes.md").as_deref(),
        Some("first line\nsecond line\n"),
        "the work came along"
    );
    assert_eq!(h.store.targets_generations(), [1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_conversation_is_replaced_by_a_briefed_one() {
    let h = Harnessed::new();
    let gone = "0f0e0d0c-0b0a-4908-8706-050403020100";
    let mut spec = h.attempt(2, "The codeword is HERON. Build the thing.", h.claude());
    spec.inputs = vec![input(7, "answer", "recall codeword")];
    spec.resume_session_id = gone.into();
    spec.prompt_delivered = true;
    spec.question = "What should I remember?".into();
    h.next(spec);

    assert_eq!(
        h.run(CancellationToken::new()).await.unwrap(),
        Finished::Succeeded
    );
    let running = h.fake.details(AttemptPhase::Running);
    assert!(
        running.contains(&format!(
            "claude has no conversation {gone} any more; started a new conversation with a handoff briefing (lossy handoff)"
        )),
        "{running:#?}"
    );
    let sessions = h.fake.sessions();
    assert_eq!(sessions.len(), 1);
    assert_ne!(sessions[0], gone, "a new conversation");
    let outcome = h.fake.outcome();
    // The briefing carried the task, so even the new conversation knows the codeword.
    assert_eq!(outcome.summary, "the codeword was HERON");
    assert_eq!(outcome.consumed_inputs, [7]);

    let transcript = h
        .store
        .committed()
        .pop()
        .unwrap()
        .files
        .into_iter()
        .find(|(p, _)| p.ends_with(&format!("{}.jsonl", sessions[0])))
        .map(|(_, c)| String::from_utf8(c).unwrap())
        .unwrap();
    let first: serde_json::Value =
        serde_json::from_str(transcript.lines().next().unwrap()).unwrap();
    let briefing = first["message"]["content"].as_str().unwrap();
    assert!(
        briefing.starts_with("lossy handoff: the earlier conversation could not be resumed"),
        "{briefing}"
    );
    assert!(
        briefing.contains("The question you asked:\nWhat should I remember?"),
        "{briefing}"
    );
    assert!(
        briefing.contains("The answer:\nrecall codeword"),
        "{briefing}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_checkpoints_are_cut_only_when_something_changed() {
    let h = Harnessed::new();
    let mut spec = h.attempt(
        1,
        "edit a.txt one\nsleep 3\nedit a.txt two\nsleep 3",
        h.claude(),
    );
    spec.checkpoint_interval = Some(cairn_proto::runs::to_proto_duration(Duration::from_millis(
        250,
    )));
    h.next(spec);

    assert_eq!(
        h.run(CancellationToken::new()).await.unwrap(),
        Finished::Succeeded
    );
    let committed = h.store.committed();
    let intervals: Vec<&Snapshot> = committed
        .iter()
        .filter(|s| s.reason == CheckpointReason::Interval)
        .collect();
    assert!(
        !intervals.is_empty(),
        "six seconds of work span several intervals"
    );
    for pair in committed
        .windows(2)
        .filter(|w| w[1].reason == CheckpointReason::Interval)
    {
        assert_ne!(
            pair[0].files, pair[1].files,
            "an interval checkpoint is cut only after a change"
        );
    }
    assert!(
        h.store.state.lock().unwrap().skipped > 0,
        "unchanged intervals were skipped"
    );
    assert_eq!(committed.last().unwrap().reason, CheckpointReason::End);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_attempt_stops_without_another_write() {
    let h = Harnessed::new();
    h.next(h.attempt(1, "edit a.txt one\nask Anything?", h.claude()));
    h.store.state.lock().unwrap().fenced = true;

    let err = h.run(CancellationToken::new()).await.unwrap_err();
    assert!(matches!(err, run::RunError::Superseded(_)), "{err}");
    assert!(err.to_string().contains("generation 1 is older"), "{err}");
    assert!(h.store.committed().is_empty());
    assert!(
        !h.fake
            .calls()
            .iter()
            .any(|c| matches!(c, Call::Waiting { .. } | Call::Outcome(_))),
        "nothing reported after the refusal"
    );

    let h = Harnessed::new();
    h.next(h.attempt(1, "edit a.txt one", h.claude()));
    h.fake.0.lock().unwrap().superseded = true;
    let err = h.run(CancellationToken::new()).await.unwrap_err();
    assert!(
        err.to_string().contains("was superseded by attempt 2"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_adapter_drives_a_templated_harness_through_a_question() {
    let h = Harnessed::new();
    let state = h
        .root
        .join(".cairn/state/demo")
        .to_string_lossy()
        .into_owned();
    let command = pb::HarnessSpec {
        name: "command".into(),
        config: [
            ("start".to_owned(), format!("env CLAUDE_CONFIG_DIR={state} {DEMO} -p --output-format stream-json --verbose {{message}}")),
            ("resume".to_owned(), format!("env CLAUDE_CONFIG_DIR={state} {DEMO} -p --output-format stream-json --verbose --resume {{session_id}} {{message}}")),
            ("session_regex".to_owned(), r#""session_id":"(?P<id>[0-9a-f-]{36})""#.to_owned()),
        ]
        .into(),
    };
    h.next(h.attempt(1, PROMPT, command));
    h.answer(vec![input(2, "answer", "recall codeword")]);

    assert_eq!(
        h.run(CancellationToken::new()).await.unwrap(),
        Finished::Succeeded
    );
    let sessions = h.fake.sessions();
    assert_eq!(sessions.len(), 1, "the regex found the conversation once");
    assert!(sessions.iter().all(|s| s.len() == 36));
    let summary = h.fake.outcome().summary;
    assert!(
        summary.starts_with(r#"{"duration_api_ms""#),
        "the last line of stdout: {summary}"
    );
    assert!(
        summary.contains(r#""result":"the codeword was PELICAN""#),
        "{summary}"
    );
    assert_eq!(
        h.store.reasons(),
        [CheckpointReason::Pause, CheckpointReason::End]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspace_services_start_before_the_agent_and_stop_after_it() {
    let h = Harnessed::new();
    fs::create_dir_all(h.root.join(".cairn")).unwrap();
    fs::write(
        h.root.join(".cairn/services.toml"),
        r#"
[[service]]
name = "sleeper"
command = "sh -c 'echo $$ > sleeper.pid; exec sleep 600'"
health = { command = "test -s sleeper.pid", interval = "50ms" }
"#,
    )
    .unwrap();
    h.next(h.attempt(1, "edit a.txt one", h.claude()));
    assert_eq!(
        h.run(CancellationToken::new()).await.unwrap(),
        Finished::Succeeded
    );
    let preparing = h.fake.details(AttemptPhase::Preparing);
    assert!(
        preparing
            .iter()
            .any(|d| d.starts_with("service sleeper: healthy after ")),
        "{preparing:#?}"
    );
    let pid: i32 = fs::read_to_string(h.root.join("sleeper.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let alive = fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "));
    assert!(!alive, "the service outlived its attempt");
    let end = h.store.committed().pop().unwrap();
    assert!(end.files.contains_key(".cairn/services.toml"));
    assert!(
        !end.files.keys().any(|p| p.starts_with(".cairn/logs/")),
        "service logs are not checkpointed: {:?}",
        end.files.keys().collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_harness_fails_the_run_with_its_reason() {
    let h = Harnessed::new();
    h.next(h.attempt(
        1,
        "edit a.txt one\nfail the licence server is down",
        h.claude(),
    ));
    assert_eq!(
        h.run(CancellationToken::new()).await.unwrap(),
        Finished::Failed
    );
    let outcome = h.fake.outcome();
    assert_eq!(outcome.outcome, pb::Outcome::Failed as i32);
    assert_eq!(outcome.error, "the licence server is down");
    assert_eq!(
        h.store.reasons(),
        [CheckpointReason::End],
        "the work so far is kept"
    );

    let h = Harnessed::new();
    let mut missing = h.claude();
    missing
        .config
        .insert("binary".into(), "/nonexistent/claude".into());
    h.next(h.attempt(1, "hello", missing));
    assert_eq!(
        h.run(CancellationToken::new()).await.unwrap(),
        Finished::Failed
    );
    assert!(
        h.fake
            .outcome()
            .error
            .starts_with("cannot start \"/nonexistent/claude\": "),
        "{}",
        h.fake.outcome().error
    );

    let h = Harnessed::new();
    h.next(h.attempt(
        1,
        "hello",
        pb::HarnessSpec {
            name: "aider".into(),
            config: Default::default(),
        },
    ));
    assert_eq!(
        h.run(CancellationToken::new()).await.unwrap(),
        Finished::Failed
    );
    assert_eq!(
        h.fake.outcome().error,
        "unknown harness \"aider\" (this runner has: claude, codex, gemini, command)"
    );
    assert_eq!(
        h.store.state.lock().unwrap().restores,
        0,
        "nothing was restored for a run that cannot start"
    );
}

impl SnapshotStore {
    fn targets_generations(&self) -> Vec<u64> {
        self.state
            .lock()
            .unwrap()
            .targets
            .iter()
            .map(|t| t.generation)
            .collect()
    }
}
