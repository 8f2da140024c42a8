//! Hosts and runners played by the test: tonic clients of HostService and
//! RunnerService that do what cairn-host and `cairn-runner run` do, one
//! explicit step at a time, so each test decides when a heartbeat goes out
//! and when a sandbox is gone.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use cairn_engine::client::{AuthChannel, CoordinatorClient};
use cairn_proto::pb;
use cairn_proto::pb::admin_service_client::AdminServiceClient;
use cairn_proto::pb::host_service_client::HostServiceClient;
use cairn_proto::pb::run_service_client::RunServiceClient;
use cairn_proto::pb::runner_service_client::RunnerServiceClient;
use tokio_stream::StreamExt;

use crate::harness::{TestServer, data_dir};

/// Starts a coordinator whose hosts are lost after `lease` of silence.
pub async fn start_with_lease(data_dir: &std::path::Path, lease: Duration) -> TestServer {
    TestServer::start_with(data_dir, |config| {
        config.host_lease = lease;
        config.heartbeat_interval = lease / 4;
    })
    .await
}

/// A coordinator whose hosts are never lost during a test.
pub async fn start_patient(data_dir: &std::path::Path) -> TestServer {
    start_with_lease(data_dir, Duration::from_secs(600)).await
}

/// The start of most fleet tests: a coordinator, its admin clients, and
/// one host (without labels) registered with the admin token.
pub type Fleet = (TestServer, Clients, FakeHost);

/// A fleet whose hosts are never lost, on a fresh data directory (removed
/// with the server).
pub async fn patient_fleet(host: &str, slots: u32) -> Fleet {
    fleet_with_lease(Duration::from_secs(600), host, slots).await
}

/// A fleet whose hosts are lost after `lease` of silence, on a fresh data
/// directory (removed with the server).
pub async fn fleet_with_lease(lease: Duration, host: &str, slots: u32) -> Fleet {
    let dir = data_dir();
    let mut server = start_with_lease(dir.path(), lease).await;
    server.own_dir(dir);
    fleet_on(server, host, slots).await
}

/// The admin clients and a host of a coordinator already started.
pub async fn fleet_on(server: TestServer, host: &str, slots: u32) -> Fleet {
    let clients = Clients::admin(&server).await;
    let host = FakeHost::register(&server, &server.admin_token, host, &[], slots).await;
    (server, clients, host)
}

/// Clients of the run and admin services with one token.
pub struct Clients {
    pub runs: RunServiceClient<AuthChannel>,
    pub admin: AdminServiceClient<AuthChannel>,
}

impl Clients {
    pub async fn connect(server: &TestServer, token: &str) -> Self {
        let channel = server.channel(token).await;
        Self {
            runs: RunServiceClient::new(channel.clone()),
            admin: AdminServiceClient::new(channel),
        }
    }

    pub async fn admin(server: &TestServer) -> Self {
        Self::connect(server, &server.admin_token).await
    }

    /// Creates a run in a new workspace with the demo harness.
    pub async fn create_run(&mut self, labels: &[(&str, &str)]) -> pb::Run {
        self.create(run_request(labels)).await
    }

    pub async fn create(&mut self, request: pb::CreateRunRequest) -> pb::Run {
        self.runs.create_run(request).await.unwrap().into_inner()
    }

    /// Creates a run in a new workspace that may take `max_attempts` attempts.
    pub async fn create_with_max_attempts(&mut self, max_attempts: u32) -> pb::Run {
        self.create(pb::CreateRunRequest {
            max_attempts,
            ..run_request(&[])
        })
        .await
    }

    pub async fn get(&mut self, run: &str) -> pb::Run {
        self.runs
            .get_run(pb::GetRunRequest { run_id: run.into() })
            .await
            .unwrap()
            .into_inner()
    }

    /// The run's events after `after_sequence`; with `follow`, live until it ends.
    pub async fn watch(
        &mut self,
        run: &str,
        after_sequence: u64,
        follow: bool,
    ) -> tonic::Streaming<pb::RunEvent> {
        self.runs
            .watch_run_events(pb::WatchRunEventsRequest {
                run_id: run.into(),
                after_sequence,
                follow,
            })
            .await
            .unwrap()
            .into_inner()
    }

    /// The run's whole history so far.
    pub async fn events(&mut self, run: &str) -> Vec<pb::RunEvent> {
        let mut stream = self.watch(run, 0, false).await;
        let mut events = Vec::new();
        while let Some(event) = stream.next().await {
            events.push(event.unwrap());
        }
        events
    }

    pub async fn answer(&mut self, run: &str, text: &str) -> Result<pb::Run, tonic::Status> {
        self.runs
            .answer_run(pb::AnswerRunRequest {
                run_id: run.into(),
                text: text.into(),
            })
            .await
            .map(tonic::Response::into_inner)
    }

    pub async fn cancel(&mut self, run: &str, reason: &str) -> pb::Run {
        self.runs
            .cancel_run(pb::CancelRunRequest {
                run_id: run.into(),
                reason: reason.into(),
            })
            .await
            .unwrap()
            .into_inner()
    }

    pub async fn hosts(&mut self) -> Vec<pb::Host> {
        self.admin
            .list_hosts(pb::ListHostsRequest {})
            .await
            .unwrap()
            .into_inner()
            .hosts
    }

    /// Waits until host `host` is recorded as keeping `workspace`'s tree.
    pub async fn wait_for_kept(&mut self, host: &str, workspace: &str) {
        let mut deadline =
            Deadline::new(&format!("host {host} to be recorded keeping {workspace}"));
        loop {
            let hosts = self.hosts().await;
            let listed = hosts.iter().find(|h| h.id == host);
            if listed.is_some_and(|h| h.kept_workspaces.iter().any(|w| w == workspace)) {
                return;
            }
            deadline.tick().await;
        }
    }

    pub async fn tokens(&mut self) -> Vec<pb::TokenInfo> {
        self.admin
            .list_tokens(pb::ListTokensRequest {})
            .await
            .unwrap()
            .into_inner()
            .tokens
    }

    pub async fn host_request(&mut self, op: &str, host: &str) -> Result<pb::Host, tonic::Status> {
        let request = pb::HostRequest { host: host.into() };
        let result = match op {
            "cordon" => self.admin.cordon_host(request).await,
            "uncordon" => self.admin.uncordon_host(request).await,
            "drain" => self.admin.drain_host(request).await,
            other => panic!("no host operation {other}"),
        };
        result.map(tonic::Response::into_inner)
    }
}

/// A run request on a new workspace with the demo harness.
pub fn run_request(labels: &[(&str, &str)]) -> pb::CreateRunRequest {
    pb::CreateRunRequest {
        target: Some(pb::create_run_request::Target::NewWorkspace(
            pb::NewWorkspace::default(),
        )),
        harness: Some(pb::HarnessSpec {
            name: "claude".into(),
            config: [("binary".to_owned(), "cairn-demo-agent".to_owned())].into(),
        }),
        prompt: "remember the codeword PELICAN".into(),
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    }
}

/// A run request on the existing `workspace` (id or name) with the demo harness.
pub fn run_on(workspace: &str) -> pb::CreateRunRequest {
    pb::CreateRunRequest {
        target: Some(pb::create_run_request::Target::Workspace(workspace.into())),
        ..run_request(&[])
    }
}

pub fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// A host agent played step by step: it reports its sandboxes on every
/// beat and starts what it is assigned; destroying is a separate step.
pub struct FakeHost {
    pub id: String,
    pub name: String,
    client: HostServiceClient<AuthChannel>,
    labels: BTreeMap<String, String>,
    slots: u32,
    /// Sandbox id → the report the next beat sends.
    pub sandboxes: BTreeMap<String, pb::SandboxReport>,
    /// Sandbox id → its assignment.
    pub assignments: BTreeMap<String, pb::Assignment>,
    /// Sandboxes whose assignment a test was given.
    handed_out: BTreeSet<String>,
    /// The last answer.
    pub last: pb::HeartbeatResponse,
    /// Whether the next beats say the host agent is shutting down.
    pub stopping: bool,
    /// Workspaces the next beats say the host keeps a tree of.
    pub kept: Vec<String>,
    /// The token the coordinator bound to this host, once it answered one.
    pub bound_token: Option<String>,
}

impl FakeHost {
    /// Registers a host named `name` with `labels` and `slots`.
    pub async fn register(
        server: &TestServer,
        token: &str,
        name: &str,
        labels: &[(&str, &str)],
        slots: u32,
    ) -> Self {
        let mut host = Self {
            id: String::new(),
            name: name.into(),
            client: HostServiceClient::new(server.channel(token).await),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            slots,
            sandboxes: BTreeMap::new(),
            assignments: BTreeMap::new(),
            handed_out: BTreeSet::new(),
            last: pb::HeartbeatResponse::default(),
            stopping: false,
            kept: Vec::new(),
            bound_token: None,
        };
        host.register_again().await;
        // As cairn-host does: the bound token is used from now on.
        if let Some(bound) = &host.bound_token {
            host.client = HostServiceClient::new(server.channel(bound).await);
        }
        host
    }

    /// Talks to `server` from now on (a coordinator restarted on new ports).
    pub async fn reconnect(&mut self, server: &TestServer, token: &str) {
        self.client = HostServiceClient::new(server.channel(token).await);
    }

    /// Registers (again, under the same id once it has one), as a restarted
    /// host does; it keeps reporting the sandboxes it knows.
    pub async fn register_again(&mut self) -> pb::RegisterHostResponse {
        let response = self
            .client
            .register_host(pb::RegisterHostRequest {
                name: self.name.clone(),
                labels: self.labels.clone().into_iter().collect(),
                slots: self.slots,
                driver: "local".into(),
                host_id: self.id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        self.id = response.host_id.clone();
        if !response.host_token.is_empty() {
            self.bound_token = Some(response.host_token.clone());
        }
        response
    }

    /// Opens this host's WatchOrders stream.
    pub async fn watch_orders(
        &mut self,
    ) -> Result<tonic::Streaming<pb::OrdersNotice>, tonic::Status> {
        self.client
            .watch_orders(pb::WatchOrdersRequest {
                host_id: self.id.clone(),
            })
            .await
            .map(tonic::Response::into_inner)
    }

    /// One heartbeat as it is, without acting on the answer.
    pub async fn client_heartbeat(&mut self) -> Result<pb::HeartbeatResponse, tonic::Status> {
        self.client
            .heartbeat(pb::HeartbeatRequest {
                host_id: self.id.clone(),
                sandboxes: self.sandboxes.values().cloned().collect(),
                stopping: self.stopping,
                kept_workspaces: self.kept.clone(),
            })
            .await
            .map(tonic::Response::into_inner)
    }

    /// One heartbeat: reports every sandbox, starts new assignments (as
    /// running sandboxes), forgets what the coordinator says to forget.
    pub async fn beat(&mut self) -> pb::HeartbeatResponse {
        let response = self.client_heartbeat().await.unwrap();
        for assignment in &response.assignments {
            self.sandboxes
                .entry(assignment.sandbox_id.clone())
                .or_insert_with(|| pb::SandboxReport {
                    sandbox_id: assignment.sandbox_id.clone(),
                    run_id: assignment.run_id.clone(),
                    attempt: assignment.attempt,
                    state: pb::SandboxState::Running as i32,
                    exit_code: 0,
                    detail: String::new(),
                });
            self.assignments
                .insert(assignment.sandbox_id.clone(), assignment.clone());
        }
        for gone in &response.forget {
            self.sandboxes.remove(gone);
        }
        self.last = response.clone();
        response
    }

    /// Beats until an assignment for `run` that no earlier call returned has
    /// arrived (possibly with an earlier beat); returns it.
    pub async fn beat_until_assigned(&mut self, run: &str) -> pb::Assignment {
        let mut deadline = Deadline::new(&format!("host {} to be assigned run {run}", self.name));
        loop {
            self.beat().await;
            let fresh = self
                .assignments
                .values()
                .find(|a| a.run_id == run && !self.handed_out.contains(&a.sandbox_id))
                .cloned();
            if let Some(assignment) = fresh {
                self.handed_out.insert(assignment.sandbox_id.clone());
                return assignment;
            }
            deadline.tick().await;
        }
    }

    /// Beats until `run` is assigned, beats once more so the sandbox is
    /// reported running, and connects the attempt's runner (not yet claimed).
    pub async fn launch(&mut self, server: &TestServer, run: &str) -> (pb::Assignment, FakeRunner) {
        let assignment = self.beat_until_assigned(run).await;
        self.beat().await;
        let runner = FakeRunner::connect(server, &assignment).await;
        (assignment, runner)
    }

    /// The destroy orders of the last answer, sandbox id → reason.
    pub fn destroy_orders(&self) -> BTreeMap<String, String> {
        self.last
            .destroy
            .iter()
            .map(|d| (d.sandbox_id.clone(), d.reason.clone()))
            .collect()
    }

    /// The last answer's reason to destroy `sandbox`, if it said to.
    pub fn destroy_order(&self, sandbox: &str) -> Option<&str> {
        self.last
            .destroy
            .iter()
            .find(|d| d.sandbox_id == sandbox)
            .map(|d| d.reason.as_str())
    }

    /// Marks a sandbox gone: destroyed on an order, or exited on its own.
    pub fn sandbox_gone(&mut self, sandbox: &str, state: pb::SandboxState, exit_code: i32) {
        let report = self
            .sandboxes
            .get_mut(sandbox)
            .unwrap_or_else(|| panic!("host {} has no sandbox {sandbox}", self.name));
        report.state = state as i32;
        report.exit_code = exit_code;
    }
}

/// The runner of one attempt: its run token's clients.
pub struct FakeRunner {
    pub runner: RunnerServiceClient<AuthChannel>,
    /// Workspace and checkpoint clients with the run token.
    pub coordinator: CoordinatorClient,
}

impl FakeRunner {
    pub async fn connect(server: &TestServer, assignment: &pb::Assignment) -> Self {
        let coordinator = server.client_with(Some(&assignment.run_token)).await;
        Self {
            // As the real runner: an attempt's spec may be large.
            runner: RunnerServiceClient::new(coordinator.auth_channel())
                .max_decoding_message_size(cairn_engine::client::MAX_MESSAGE_BYTES),
            coordinator,
        }
    }

    pub async fn claim(&mut self) -> pb::AttemptSpec {
        self.runner
            .claim_attempt(pb::ClaimAttemptRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    pub async fn progress(
        &mut self,
        phase: pb::AttemptPhase,
        detail: &str,
        checkpoint: &str,
    ) -> Result<(), tonic::Status> {
        self.runner
            .report_progress(pb::ReportProgressRequest {
                phase: phase as i32,
                detail: detail.into(),
                checkpoint_id: checkpoint.into(),
            })
            .await
            .map(drop)
    }

    /// Claims and reports the harness running.
    pub async fn start(&mut self) -> pb::AttemptSpec {
        let spec = self.claim().await;
        self.progress(pb::AttemptPhase::Running, "harness started", "")
            .await
            .unwrap();
        spec
    }

    /// Reports the harness's conversation `session` (of the claude harness).
    pub async fn report_session(&mut self, session: &str) {
        self.runner
            .report_harness_session(pb::ReportHarnessSessionRequest {
                harness: "claude".into(),
                session_id: session.into(),
            })
            .await
            .unwrap();
    }

    pub async fn wait_for_person(&mut self, question: &str) -> pb::ReportWaitingResponse {
        self.runner
            .report_waiting(pb::ReportWaitingRequest {
                question: question.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
    }

    pub async fn outcome(
        &mut self,
        outcome: pb::Outcome,
        consumed: &[u64],
    ) -> Result<(), tonic::Status> {
        self.runner
            .report_outcome(pb::ReportOutcomeRequest {
                outcome: outcome as i32,
                summary: "did the work".into(),
                consumed_inputs: consumed.to_vec(),
                ..Default::default()
            })
            .await
            .map(drop)
    }
}

/// Waits (a minute at most) for the inputs of a runner's attempt.
pub async fn wait_for_input(
    runner: &mut RunnerServiceClient<AuthChannel>,
) -> pb::WaitForInputResponse {
    runner
        .wait_for_input(pb::WaitForInputRequest {
            timeout: Some(duration(Duration::from_secs(60))),
        })
        .await
        .unwrap()
        .into_inner()
}

/// Bounds a polling loop: `tick` sleeps a little, and panics naming what
/// never happened once a generous limit is reached (never a timing assertion:
/// it only stops a broken test from hanging).
pub struct Deadline {
    what: String,
    ticks: u32,
}

/// Polling period, and how many periods make the limit (60 s).
const TICK: Duration = Duration::from_millis(50);
const MAX_TICKS: u32 = 1200;

impl Deadline {
    pub fn new(what: &str) -> Self {
        Self {
            what: what.into(),
            ticks: 0,
        }
    }

    pub async fn tick(&mut self) {
        self.ticks += 1;
        assert!(self.ticks < MAX_TICKS, "gave up waiting for {}", self.what);
        tokio::time::sleep(TICK).await;
    }
}

/// Waits until `run` is in `state` (the hosts are not beating meanwhile).
pub async fn wait_for_state(clients: &mut Clients, run: &str, state: pb::RunState) -> pb::Run {
    let mut deadline = Deadline::new(&format!("run {run} to be {state:?}"));
    loop {
        let current = clients.get(run).await;
        if current.state == state as i32 {
            return current;
        }
        deadline.tick().await;
    }
}

/// The reasons of `events`, in order.
pub fn reasons(events: &[pb::RunEvent]) -> Vec<&str> {
    events.iter().map(|e| e.reason.as_str()).collect()
}
