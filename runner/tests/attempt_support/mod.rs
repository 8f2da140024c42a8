//! Shared pieces of the run state machine's integration tests
//! (run_attempt.rs, harness_adapters.rs): a fake RunnerService served over
//! real gRPC (it honours the proto contract and records every call), a store
//! that snapshots the workspace at every checkpoint and restores snapshots,
//! and a sandbox tying them to a workspace root. Also, for the tests against
//! the real coordinator (run_coordinator.rs, checkpoint_if_changed.rs),
//! starting the `cairn-coordinator` binary.
#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cairn_engine::checkpoint::{Baseline, CheckpointError};
use cairn_engine::client::CoordinatorClient;
use cairn_proto::domain::CheckpointReason;
use cairn_proto::ids::BlobId;
use cairn_proto::pb::runner_service_server::{RunnerService, RunnerServiceServer};
use cairn_proto::pb::{self, AttemptPhase};
use cairn_runner::run::{
    self, CheckpointRequest, Checkpointed, Control, Finished, Restored, RunOptions, StoreTarget,
    WorkspaceStore, WorkspaceStoreError,
};
use futures::future::BoxFuture;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

pub const TOKEN: &str = "run-token-1";
/// How long any wait in the attempt tests may take before the test fails.
pub const LIMIT: Duration = Duration::from_secs(60);

/// One call the runner made.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
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
    Unsaved(pb::ReportUnsavedRequest),
}

#[derive(Default)]
pub struct FakeState {
    pub spec: pb::AttemptSpec,
    pub calls: Vec<Call>,
    /// Answers handed out by WaitForInput, one batch per call, once waiting.
    pub answers: VecDeque<Vec<pb::RunInput>>,
    /// When set, every call after the claim is refused as superseded.
    pub superseded: bool,
}

#[derive(Clone, Default)]
pub struct FakeRunnerService(pub Arc<Mutex<FakeState>>);

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
            // As the coordinator refuses it: typed, the message for people.
            return Err(cairn_proto::refusal::Refusal::AttemptNotCurrent {
                run: cairn_proto::ids::RunId::generate(),
                attempt: 1,
                why: cairn_proto::refusal::NotCurrent::Superseded,
            }
            .into_status("attempt 1 of run run-1 was superseded by attempt 2"));
        }
        Ok(())
    }

    /// Records `call` and acknowledges it (a report with nothing to answer).
    fn ack<T>(&self, request: &Request<T>, call: Call) -> Result<Response<pb::ReportAck>, Status> {
        self.check(request, call)?;
        Ok(Response::new(pb::ReportAck {}))
    }

    pub fn calls(&self) -> Vec<Call> {
        self.0.lock().unwrap().calls.clone()
    }

    pub fn outcome(&self) -> pb::ReportOutcomeRequest {
        self.calls()
            .into_iter()
            .find_map(|c| match c {
                Call::Outcome(o) => Some(o),
                _ => None,
            })
            .expect("an outcome was reported")
    }

    pub fn details(&self, phase: AttemptPhase) -> Vec<String> {
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

    pub fn sessions(&self) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Session { id, .. } => Some(id),
                _ => None,
            })
            .collect()
    }

    /// The progress reports of `phase`, in order.
    pub fn progress(&self, phase: AttemptPhase) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| matches!(c, Call::Progress { phase: p, .. } if *p == phase))
            .collect()
    }

    /// Waits (bounded) until `done` holds for the calls so far.
    pub async fn until(&self, what: &str, done: impl Fn(&[Call]) -> bool) {
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
        let call = Call::Progress {
            phase: AttemptPhase::try_from(r.phase).unwrap(),
            detail: r.detail.clone(),
            checkpoint: r.checkpoint_id.clone(),
        };
        self.ack(&request, call)
    }

    async fn report_harness_session(
        &self,
        request: Request<pb::ReportHarnessSessionRequest>,
    ) -> Result<Response<pb::ReportAck>, Status> {
        let r = request.get_ref();
        let call = Call::Session {
            harness: r.harness.clone(),
            id: r.session_id.clone(),
        };
        self.ack(&request, call)
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
        self.ack(&request, call)
    }

    async fn report_unsaved(
        &self,
        request: Request<pb::ReportUnsavedRequest>,
    ) -> Result<Response<pb::ReportAck>, Status> {
        let call = Call::Unsaved(*request.get_ref());
        self.ack(&request, call)
    }
}

/// Serves the fake on a free local port; returns a Control carrying the run token.
pub async fn serve(fake: &FakeRunnerService) -> Control {
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
    let coordinator = CoordinatorClient::connect(&address, Some(TOKEN))
        .await
        .unwrap();
    Control::new(coordinator.auth_channel())
}

/// A checkpoint the store took: the reason and the workspace's files then.
/// The workspace every attempt of the fake coordinator names.
pub const WORKSPACE_ID: &str = "ws-00000000000000000000000001";

/// The id the store double gives its `n`th checkpoint (from 1).
pub fn checkpoint_id(n: usize) -> String {
    format!("ck-{n:026}")
}

#[derive(Debug, Clone)]
pub struct Snapshot {
    pub id: String,
    pub reason: CheckpointReason,
    pub session: Option<String>,
    pub files: BTreeMap<String, Vec<u8>>,
}

impl Snapshot {
    pub fn text(&self, path: &str) -> Option<String> {
        self.files
            .get(path)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }
}

#[derive(Default)]
pub struct StoreState {
    pub committed: Vec<Snapshot>,
    /// Interval checkpoints skipped because nothing changed.
    pub skipped: usize,
    pub restores: usize,
    pub targets: Vec<StoreTarget>,
    /// Commits are refused as from a stale generation.
    pub fenced: bool,
}

/// Checkpoints by copying every file's content (the root tree id is a
/// digest of them); restores the newest copy into an emptied root.
#[derive(Clone)]
pub struct SnapshotStore {
    pub root: PathBuf,
    pub state: Arc<Mutex<StoreState>>,
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
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            state: Arc::default(),
        }
    }

    pub fn committed(&self) -> Vec<Snapshot> {
        self.state.lock().unwrap().committed.clone()
    }

    pub fn reasons(&self) -> Vec<CheckpointReason> {
        self.committed().iter().map(|s| s.reason).collect()
    }

    /// The generation of every attempt the store was made for, in order.
    pub fn targets_generations(&self) -> Vec<u64> {
        self.state
            .lock()
            .unwrap()
            .targets
            .iter()
            .map(|t| t.generation.0)
            .collect()
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
    fn restore(&self) -> BoxFuture<'_, Result<Restored, WorkspaceStoreError>> {
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
                id: newest.id.parse().unwrap(),
                root_tree: Some(digest(&newest.files)),
                summary: format!("restored checkpoint {}", newest.id),
            })
        })
    }

    fn checkpoint(
        &self,
        request: CheckpointRequest,
    ) -> BoxFuture<'_, Result<Option<Checkpointed>, WorkspaceStoreError>> {
        Box::pin(async move {
            let mut files = BTreeMap::new();
            read_tree(&self.root, &self.root, &mut files);
            files.retain(|path, _| !self.excluded(path));
            let root_tree = digest(&files);
            let mut state = self.state.lock().unwrap();
            if state.fenced {
                return Err(WorkspaceStoreError::Checkpoint(CheckpointError::Rpc {
                    call: "CommitCheckpoint",
                    status: cairn_proto::refusal::Refusal::StaleGeneration {
                        given: cairn_proto::ids::Generation(1),
                        current: cairn_proto::ids::Generation(2),
                    }
                    .into_status("generation 1 is older than the workspace's generation 2"),
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
                && checkpoint_id.as_str() == newest
                && *before == root_tree
            {
                state.skipped += 1;
                return Ok(None);
            }
            let id = checkpoint_id(state.committed.len() + 1);
            state.committed.push(Snapshot {
                id: id.clone(),
                reason: request.reason,
                session: request.harness.map(|h| h.session_id),
                files,
            });
            Ok(Some(Checkpointed {
                id: id.parse().unwrap(),
                root_tree,
                summary: format!("{} checkpoint {id}", request.reason),
                report: serde_json::json!({
                    "checkpoint_id": id,
                    "workspace_id": WORKSPACE_ID,
                    "reason": request.reason.to_string(),
                }),
                repos: Vec::new(),
            }))
        })
    }
}

/// A shutdown token (the host's SIGTERM) that is cancelled once the runner
/// first waits for input.
pub fn stop_once_waiting(fake: &FakeRunnerService) -> CancellationToken {
    let shutdown = CancellationToken::new();
    let fake = fake.clone();
    let stopper = shutdown.clone();
    tokio::spawn(async move {
        fake.until("the runner to wait for input", |calls| {
            calls.contains(&Call::WaitForInput)
        })
        .await;
        stopper.cancel();
    });
    shutdown
}

/// A run's sandbox: a workspace root, the fake coordinator and the store.
pub struct Harnessed {
    _dir: tempfile::TempDir,
    pub root: PathBuf,
    pub credentials: PathBuf,
    pub fake: FakeRunnerService,
    pub store: SnapshotStore,
}

impl Harnessed {
    /// A sandbox whose harness credentials are `credential_file` (holding
    /// `secret`) in `credentials`, a directory relative to a fresh base.
    pub fn new(credentials: &str, credential_file: &str, secret: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let base = fs::canonicalize(dir.path()).unwrap();
        let root = base.join("workspace");
        let credentials = base.join(credentials);
        fs::create_dir_all(&credentials).unwrap();
        fs::write(credentials.join(credential_file), secret).unwrap();
        let store = SnapshotStore::new(&root);
        Self {
            _dir: dir,
            root,
            credentials,
            fake: FakeRunnerService::default(),
            store,
        }
    }

    /// The harness `name` run as `binary`, with this sandbox's credentials.
    pub fn harness(&self, name: &str, binary: &str) -> pb::HarnessSpec {
        pb::HarnessSpec {
            name: name.into(),
            config: [
                ("binary".to_owned(), binary.to_owned()),
                (
                    "credentials_dir".to_owned(),
                    self.credentials.to_string_lossy().into_owned(),
                ),
            ]
            .into(),
        }
    }

    /// The attempt the fake hands out next.
    pub fn attempt(&self, attempt: u32, prompt: &str, harness: pb::HarnessSpec) -> pb::AttemptSpec {
        pb::AttemptSpec {
            run_id: "run-1".into(),
            attempt,
            generation: u64::from(attempt),
            workspace_id: WORKSPACE_ID.into(),
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

    pub fn next(&self, spec: pb::AttemptSpec) {
        let mut state = self.fake.0.lock().unwrap();
        state.spec = spec;
        state.calls.clear();
    }

    pub fn answer(&self, inputs: Vec<pb::RunInput>) {
        self.fake.0.lock().unwrap().answers.push_back(inputs);
    }

    pub fn options(&self) -> RunOptions {
        RunOptions {
            wait_timeout: Duration::from_millis(300),
            control_socket: Some(self.control_socket()),
            // Never dialled: the agent's checkpoint requests go to the socket.
            coordinator: Some("http://127.0.0.1:9".into()),
            ..RunOptions::new(&self.root)
        }
    }

    /// Where the attempt listens for the agent's checkpoint requests.
    pub fn control_socket(&self) -> PathBuf {
        self.root.with_file_name("runner.sock")
    }

    /// Runs one attempt to its end; `shutdown` plays the host's SIGTERM.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<Finished, run::RunError> {
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

pub fn input(id: u64, kind: &str, text: &str) -> pb::RunInput {
    pb::RunInput {
        id,
        kind: kind.into(),
        text: text.into(),
        created_at: None,
    }
}

/// A child process, killed and reaped when dropped.
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `cairn-demo-agent` binary (another package's).
pub fn demo_agent_binary() -> String {
    cairn_utils::testing::sibling_binary("cairn-demo-agent")
        .to_string_lossy()
        .into_owned()
}

/// The `cairn-coordinator` binary (another package's).
pub fn coordinator_binary() -> PathBuf {
    cairn_utils::testing::sibling_binary("cairn-coordinator")
}

/// Starts the coordinator, waiting at most `patience` for it; returns it,
/// its gRPC address and the admin token.
pub fn start_coordinator(
    binary: &Path,
    data: &Path,
    patience: Duration,
) -> (Reaped, String, String) {
    start_coordinator_on(binary, data, "127.0.0.1:0", patience)
}

/// [`start_coordinator`] with its gRPC listener on `listen` (to start one
/// again where it was, on the same data dir, after removing the
/// `endpoints.json` the last one left).
pub fn start_coordinator_on(
    binary: &Path,
    data: &Path,
    listen: &str,
    patience: Duration,
) -> (Reaped, String, String) {
    let server = Reaped(
        Command::new(binary)
            .args(["serve", "--data-dir"])
            .arg(data)
            .args(["--listen", listen, "--blob-listen", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + patience;
    loop {
        let endpoints = fs::read_to_string(data.join("endpoints.json")).ok();
        let token = fs::read_to_string(data.join("admin.token")).ok();
        if let (Some(endpoints), Some(token)) = (endpoints, token) {
            let endpoints: serde_json::Value = serde_json::from_str(&endpoints).unwrap();
            let grpc = endpoints["grpc"].as_str().unwrap().to_owned();
            return (server, grpc, token.trim().to_owned());
        }
        assert!(Instant::now() < deadline, "the coordinator did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
}
