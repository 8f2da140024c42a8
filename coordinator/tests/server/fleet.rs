//! Hosts and runners played by the test: tonic clients of HostService and
//! RunnerService that do what cairn-host and `cairn-runner run` do, one
//! explicit step at a time, so each test decides when a heartbeat goes out
//! and when a sandbox is gone.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use cairn_proto::pb;
use cairn_proto::pb::admin_service_client::AdminServiceClient;
use cairn_proto::pb::host_service_client::HostServiceClient;
use cairn_proto::pb::run_service_client::RunServiceClient;
use cairn_proto::pb::runner_service_client::RunnerServiceClient;
use cairn_runner::client::{AuthChannel, Coordinator};
use tokio_stream::StreamExt;

use crate::harness::TestServer;

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

/// Clients of the run and admin services with one token.
pub struct Clients {
    pub runs: RunServiceClient<AuthChannel>,
    pub admin: AdminServiceClient<AuthChannel>,
}

impl Clients {
    pub async fn connect(server: &TestServer, token: &str) -> Self {
        let channel = server.client_with(Some(token)).await.auth_channel();
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

    pub async fn get(&mut self, run: &str) -> pb::Run {
        self.runs
            .get_run(pb::GetRunRequest { run_id: run.into() })
            .await
            .unwrap()
            .into_inner()
    }

    /// The run's whole history so far.
    pub async fn events(&mut self, run: &str) -> Vec<pb::RunEvent> {
        let mut stream = self
            .runs
            .watch_run_events(pb::WatchRunEventsRequest {
                run_id: run.into(),
                after_sequence: 0,
                follow: false,
            })
            .await
            .unwrap()
            .into_inner();
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
        let channel = server.client_with(Some(token)).await.auth_channel();
        let mut host = Self {
            id: String::new(),
            name: name.into(),
            client: HostServiceClient::new(channel),
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
        };
        host.register_again().await;
        host
    }

    /// Talks to `server` from now on (a coordinator restarted on new ports).
    pub async fn reconnect(&mut self, server: &TestServer, token: &str) {
        let channel = server.client_with(Some(token)).await.auth_channel();
        self.client = HostServiceClient::new(channel);
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
        response
    }

    /// One heartbeat: reports every sandbox, starts new assignments (as
    /// running sandboxes), forgets what the coordinator says to forget.
    pub async fn beat(&mut self) -> pb::HeartbeatResponse {
        let response = self
            .client
            .heartbeat(pb::HeartbeatRequest {
                host_id: self.id.clone(),
                sandboxes: self.sandboxes.values().cloned().collect(),
                stopping: self.stopping,
            })
            .await
            .unwrap()
            .into_inner();
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

    /// The destroy orders of the last answer, sandbox id → reason.
    pub fn destroy_orders(&self) -> BTreeMap<String, String> {
        self.last
            .destroy
            .iter()
            .map(|d| (d.sandbox_id.clone(), d.reason.clone()))
            .collect()
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
    pub coordinator: Coordinator,
}

impl FakeRunner {
    pub async fn connect(server: &TestServer, assignment: &pb::Assignment) -> Self {
        let coordinator = server.client_with(Some(&assignment.run_token)).await;
        Self {
            runner: RunnerServiceClient::new(coordinator.auth_channel()),
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
