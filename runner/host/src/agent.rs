//! The agent loop: register, heartbeat, and act on the answers.
//!
//! One task owns all state (the sandboxes this host knows, keyed by id); the
//! per-sandbox tasks of [`super::sandbox`] report to it over a channel. The
//! loop wakes for a heartbeat every interval, at once when a sandbox changed
//! state or the coordinator has new orders ([`super::orders`]), and for
//! shutdown.
//!
//! Choices where the contract leaves room:
//! - An assignment arriving while all slots are taken (the coordinator counts
//!   them too, so only after a disagreement) is left for a later answer, which
//!   repeats it.
//! - A destroy order for a sandbox this host does not know (say, from before
//!   a data directory was wiped) is answered with a DESTROYED report, so the
//!   order does not repeat forever. An assignment whose destroy order comes in
//!   the same answer is not started and is reported DESTROYED.
//! - `forget` for a sandbox that still runs is ignored with a warning.
//! - Registration refused for good (bad token, bad labels, unknown service)
//!   stops the agent with an error, after destroying what runs.
//! - The token the agent is started with registers the host once (an
//!   enrollment token, or an admin token); the coordinator answers with a
//!   token bound to this host, kept in the data dir (`host-credential.json`)
//!   and used from then on, for registering again after a restart too. A
//!   kept credential the coordinator refuses (revoked) stops the agent: the
//!   enrollment token cannot take over a known host, so the operator removes
//!   the file to enroll the machine as a new host.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use cairn_proto::auth::BearerInterceptor;
use cairn_proto::ids::Generation;
use cairn_proto::pb;
use cairn_proto::pb::host_service_client::HostServiceClient;
use cairn_proto::runs::{HostState, SandboxState, from_proto_duration};
use rand::Rng;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::Code;
use tonic::service::interceptor::InterceptedService;

use super::driver::{Driver, Sandbox, SandboxSpec};
use super::kept::KeptWorkspaces;
use super::layout::{HostCredential, Layout, SandboxRecord, valid_sandbox_id};
use super::metrics::HostMetrics;
use super::orders::OrderWatch;
use super::sandbox::{self, Cleanup, KeepOnEnd, REASON_HOST_SHUTDOWN, UNKNOWN_EXIT_CODE, Update};
use super::{HostConfig, HostError};
use cairn_engine::client::{AuthChannel, CoordinatorChannel};
use cairn_engine::host_reports::{self, ReportReader};

/// How often kept workspace trees are checked against their age bound.
const KEPT_PRUNE_EVERY: Duration = Duration::from_secs(600);

/// Heartbeat interval used until the coordinator names one.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

/// First retry delay after a failed exchange with the coordinator.
const BACKOFF_START: Duration = Duration::from_millis(200);

/// Longest retry delay (further capped at a third of the lease).
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How often a still-unreachable coordinator is logged again.
const UNREACHABLE_LOG_EVERY: Duration = Duration::from_secs(30);

/// Reason recorded for sandboxes a previous agent process left running.
pub const REASON_HOST_RESTARTED: &str = "host_restarted";

/// Reason for destroying everything after the coordinator declared the host lost.
pub const REASON_SUPERSEDED: &str = "superseded";

struct Tracked {
    record: SandboxRecord,
    /// Present while the sandbox runs and no destroy order was passed on.
    destroy: Option<oneshot::Sender<String>>,
}

impl Tracked {
    fn live(&self) -> bool {
        !self.record.state.is_gone()
    }

    fn report(&self) -> pb::SandboxReport {
        let r = &self.record;
        pb::SandboxReport {
            sandbox_id: r.sandbox_id.clone(),
            run_id: r.run_id.clone(),
            attempt: r.attempt,
            state: pb::SandboxState::from(r.state) as i32,
            exit_code: r.exit_code,
            detail: r.detail.clone(),
        }
    }
}

/// Why an exchange with the coordinator failed.
enum ExchangeError {
    /// Try again later (unreachable, overloaded, restarting, …).
    Retry(tonic::Status),
    /// Will not get better by retrying.
    Fatal(tonic::Status),
}

/// The host agent: owns the sandboxes of this host and talks to the coordinator.
pub struct Agent<D: Driver> {
    config: HostConfig,
    driver: Arc<D>,
    layout: Layout,
    kept: Option<Arc<KeptWorkspaces>>,
    kept_pruned: Instant,
    metrics: Arc<HostMetrics>,
    channel: CoordinatorChannel,
    client: HostServiceClient<AuthChannel>,
    /// The client speaks with the host's bound token (kept in the data dir),
    /// not the one the agent was started with.
    bound: bool,
    /// Counts the clients made, so the orders stream follows a new one.
    client_generation: u64,
    /// The orders stream, while registered.
    order_watch: Option<OrderWatch>,
    /// Notified when the coordinator has new orders for this host.
    orders_rung: Arc<tokio::sync::Notify>,
    sandboxes: BTreeMap<String, Tracked>,
    tasks: JoinSet<()>,
    task_sandboxes: HashMap<tokio::task::Id, String>,
    updates_tx: mpsc::UnboundedSender<Update>,
    updates_rx: mpsc::UnboundedReceiver<Update>,
    host_id: Option<String>,
    registered: bool,
    interval: Duration,
    lease: Option<Duration>,
    host_state: Option<HostState>,
    shutting_down: bool,
    fatal: Option<HostError>,
    backoff: Duration,
    unreachable: Option<Unreachable>,
    full_warned: HashSet<String>,
}

impl<D: Driver> std::fmt::Debug for Agent<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("host_id", &self.host_id)
            .field("sandboxes", &self.sandboxes.len())
            .finish_non_exhaustive()
    }
}

struct Unreachable {
    since: Instant,
    failures: u32,
    last_logged: Instant,
}

impl<D: Driver> Agent<D> {
    pub fn new(config: HostConfig, driver: D, layout: Layout) -> Result<Self, HostError> {
        // One coordinator, or several replicas (comma-separated) it fails
        // over between.
        let channel = CoordinatorChannel::lazy(&config.coordinator, &config.tls)
            .map_err(|e| HostError::Config(e.to_string()))?;
        let credential = layout.read_credential()?;
        let (client, host_id, bound) = match credential {
            Some(credential) => {
                tracing::info!(host_id = %credential.host_id, file = %layout.credential_file().display(), "using the token bound to this host");
                (
                    host_client(&channel, &credential.token)?,
                    Some(credential.host_id),
                    true,
                )
            }
            None => (
                host_client(&channel, &config.token)?,
                layout.read_host_id()?,
                false,
            ),
        };
        let kept_dir = layout.root().join("kept");
        let kept = match config.kept {
            Some(bounds) => Some(Arc::new(KeptWorkspaces::open(kept_dir, bounds)?)),
            None => {
                // Keeping was on before: its plaintext trees go.
                super::layout::remove_tree(&kept_dir)?;
                None
            }
        };
        let (updates_tx, updates_rx) = mpsc::unbounded_channel();
        Ok(Self {
            config,
            driver: Arc::new(driver),
            layout,
            kept,
            kept_pruned: Instant::now(),
            metrics: Arc::new(HostMetrics::new()),
            channel,
            client,
            bound,
            client_generation: 0,
            order_watch: None,
            orders_rung: Arc::default(),
            sandboxes: BTreeMap::new(),
            tasks: JoinSet::new(),
            task_sandboxes: HashMap::new(),
            updates_tx,
            updates_rx,
            host_id,
            registered: false,
            interval: DEFAULT_INTERVAL,
            lease: None,
            host_state: None,
            shutting_down: false,
            fatal: None,
            backoff: BACKOFF_START,
            unreachable: None,
            full_warned: HashSet::new(),
        })
    }

    /// What the agent counts, for `/metrics`.
    pub fn metrics(&self) -> Arc<HostMetrics> {
        self.metrics.clone()
    }

    /// Runs until `shutdown` resolves and every sandbox is gone.
    pub async fn run(mut self, shutdown: impl Future<Output = ()> + Send) -> Result<(), HostError> {
        self.recover()?;
        tokio::pin!(shutdown);
        let mut next_exchange = Instant::now();
        loop {
            if self.shutting_down
                && self.tasks.is_empty()
                && !self.sandboxes.values().any(Tracked::live)
            {
                break;
            }
            self.watch_orders();
            tokio::select! {
                () = &mut shutdown, if !self.shutting_down => {
                    tracing::info!("stopping: destroying every sandbox, taking no new assignments");
                    self.begin_shutdown();
                }
                Some(update) = self.updates_rx.recv() => {
                    self.apply(update);
                    next_exchange = Instant::now();
                }
                () = self.orders_rung.notified() => next_exchange = Instant::now(),
                Some(joined) = self.tasks.join_next_with_id() => self.task_finished(joined),
                () = tokio::time::sleep_until(next_exchange) => {
                    next_exchange = Instant::now() + self.exchange().await;
                }
            }
            self.metrics.set_sandboxes(
                self.config.slots,
                self.sandboxes.values().map(|t| t.record.state),
            );
        }
        // Updates sent just before the last task ended.
        while let Ok(update) = self.updates_rx.try_recv() {
            self.apply(update);
        }
        self.final_heartbeat().await;
        match self.fatal.take() {
            Some(error) => Err(error),
            None => {
                tracing::info!("host agent stopped; every sandbox is gone");
                Ok(())
            }
        }
    }

    /// Keeps the orders stream open while the host is registered and takes
    /// assignments; closes it otherwise.
    fn watch_orders(&mut self) {
        let host_id = match &self.host_id {
            Some(id) if self.registered && !self.shutting_down => id,
            _ => {
                self.order_watch = None;
                return;
            }
        };
        if self
            .order_watch
            .as_ref()
            .is_some_and(|watch| watch.is_for(host_id, self.client_generation))
        {
            return;
        }
        self.order_watch = Some(OrderWatch::start(
            self.client.clone(),
            host_id.clone(),
            self.client_generation,
            self.orders_rung.clone(),
        ));
    }

    fn begin_shutdown(&mut self) {
        self.shutting_down = true;
        let ids: Vec<String> = self.sandboxes.keys().cloned().collect();
        for id in ids {
            self.order_destroy(&id, REASON_HOST_SHUTDOWN);
        }
    }

    /// One register-or-heartbeat exchange; returns the delay until the next.
    async fn exchange(&mut self) -> Duration {
        self.prune_kept();
        if !self.registered {
            if self.shutting_down {
                // Nothing to tell a coordinator we are not registered with; wait for the sandboxes.
                return Duration::from_secs(3600);
            }
            let registered = self.register().await;
            self.metrics.exchange(registered.is_ok());
            return match registered {
                Ok(()) => {
                    self.reachable();
                    Duration::ZERO
                }
                Err(ExchangeError::Retry(status)) => self.unreachable(&status),
                Err(ExchangeError::Fatal(status)) => {
                    let address = self.config.coordinator.clone();
                    if self.bound {
                        tracing::error!(file = %self.layout.credential_file().display(), "the token bound to this host was refused (revoked?); remove the file to enroll this machine again as a new host");
                    }
                    tracing::error!(%address, %status, "the coordinator refused to register this host; stopping");
                    self.fatal = Some(HostError::Refused { address, status });
                    self.begin_shutdown();
                    Duration::from_secs(3600)
                }
            };
        }
        let answered = self.heartbeat(self.rpc_timeout()).await;
        self.metrics.exchange(answered.is_ok());
        match answered {
            Ok(answer) => {
                self.reachable();
                self.handle(answer);
                if self.registered {
                    self.interval
                } else {
                    Duration::ZERO
                }
            }
            Err(ExchangeError::Fatal(status)) if status.code() == Code::NotFound => {
                tracing::warn!(%status, "the coordinator does not know this host; registering again");
                self.registered = false;
                Duration::ZERO
            }
            Err(ExchangeError::Retry(status) | ExchangeError::Fatal(status)) => {
                self.unreachable(&status)
            }
        }
    }

    fn rpc_timeout(&self) -> Duration {
        (self.interval * 3).clamp(Duration::from_secs(2), Duration::from_secs(10))
    }

    async fn register(&mut self) -> Result<(), ExchangeError> {
        let request = pb::RegisterHostRequest {
            name: self.config.name.clone(),
            labels: self.config.labels.0.clone().into_iter().collect(),
            slots: self.config.slots,
            driver: self.driver.kind().to_owned(),
            host_id: self.host_id.clone().unwrap_or_default(),
        };
        let mut client = self.client.clone();
        let answer = match tokio::time::timeout(
            Duration::from_secs(10),
            client.register_host(request),
        )
        .await
        {
            Ok(Ok(answer)) => answer.into_inner(),
            Ok(Err(status)) => return Err(classify(status, true)),
            Err(_) => {
                return Err(ExchangeError::Retry(tonic::Status::deadline_exceeded(
                    "RegisterHost timed out",
                )));
            }
        };
        if answer.host_id.is_empty() {
            return Err(ExchangeError::Retry(tonic::Status::internal(
                "RegisterHost answered without a host id",
            )));
        }
        if !answer.host_token.is_empty() {
            self.keep_credential(&answer.host_id, &answer.host_token)?;
        }
        if self.host_id.as_deref() != Some(answer.host_id.as_str()) {
            if let Err(e) = self.layout.write_host_id(&answer.host_id) {
                tracing::error!(error = %e, "cannot persist the host id; a restart will register as a new host");
            }
            self.host_id = Some(answer.host_id.clone());
        }
        self.interval = answer
            .heartbeat_interval
            .and_then(|d| from_proto_duration(&d, "heartbeat_interval").ok())
            .filter(|d| !d.is_zero())
            .unwrap_or(DEFAULT_INTERVAL);
        self.lease = answer
            .lease
            .and_then(|d| from_proto_duration(&d, "lease").ok())
            .filter(|d| !d.is_zero());
        self.registered = true;
        tracing::info!(
            host_id = %answer.host_id,
            name = %self.config.name,
            labels = %self.config.labels,
            slots = self.config.slots,
            driver = self.driver.kind(),
            interval = ?self.interval,
            "registered with the coordinator"
        );
        Ok(())
    }

    /// Keeps the token the coordinator bound to this host, then speaks with
    /// it. Written before it is used: a restart must find the credential the
    /// coordinator knows this host by, or it could not register again.
    fn keep_credential(&mut self, host_id: &str, token: &str) -> Result<(), ExchangeError> {
        let credential = HostCredential {
            host_id: host_id.to_owned(),
            token: token.to_owned(),
        };
        let client = host_client(&self.channel, token).map_err(|e| {
            ExchangeError::Fatal(tonic::Status::internal(format!(
                "the coordinator answered with a host token that cannot be sent: {e}"
            )))
        })?;
        if let Err(e) = self.layout.write_credential(&credential) {
            // Registered, but a restart could not register again: stop now,
            // loudly, rather than later and obscurely.
            return Err(ExchangeError::Fatal(tonic::Status::internal(format!(
                "cannot keep this host's credential: {e}"
            ))));
        }
        self.client = client;
        self.client_generation += 1;
        self.bound = true;
        tracing::info!(%host_id, file = %self.layout.credential_file().display(), "kept the token bound to this host; it is used from now on");
        Ok(())
    }

    async fn heartbeat(
        &mut self,
        timeout: Duration,
    ) -> Result<pb::HeartbeatResponse, ExchangeError> {
        let kept_workspaces: Vec<String> = self
            .kept
            .as_ref()
            .map(|kept| kept.workspaces().iter().map(ToString::to_string).collect())
            .unwrap_or_default();
        self.metrics.set_kept_trees(kept_workspaces.len());
        let request = pb::HeartbeatRequest {
            host_id: self.host_id.clone().unwrap_or_default(),
            sandboxes: self.sandboxes.values().map(Tracked::report).collect(),
            stopping: self.shutting_down,
            kept_workspaces,
        };
        let mut client = self.client.clone();
        match tokio::time::timeout(timeout, client.heartbeat(request)).await {
            Ok(Ok(answer)) => Ok(answer.into_inner()),
            Ok(Err(status)) => Err(classify(status, false)),
            Err(_) => Err(ExchangeError::Retry(tonic::Status::deadline_exceeded(
                "Heartbeat timed out",
            ))),
        }
    }

    /// Acts on a heartbeat answer.
    fn handle(&mut self, answer: pb::HeartbeatResponse) {
        let state = HostState::try_from(answer.state).ok();
        if state != self.host_state {
            if let Some(state) = state {
                tracing::info!(%state, "host state");
            }
            self.host_state = state;
        }
        let lost = state == Some(HostState::Lost);
        if lost {
            tracing::warn!(
                "the coordinator declared this host lost (its attempts were given to other hosts): \
                 destroying every sandbox ({REASON_SUPERSEDED}) and registering again"
            );
            let ids: Vec<String> = self.sandboxes.keys().cloned().collect();
            for id in ids {
                self.order_destroy(&id, REASON_SUPERSEDED);
            }
            self.registered = false;
        }
        let orders: HashMap<&str, &str> = answer
            .destroy
            .iter()
            .map(|o| (o.sandbox_id.as_str(), o.reason.as_str()))
            .collect();
        if !lost {
            for assignment in &answer.assignments {
                self.assign(
                    assignment,
                    orders.get(assignment.sandbox_id.as_str()).copied(),
                );
            }
        }
        for order in &answer.destroy {
            self.order_destroy(&order.sandbox_id, &order.reason);
        }
        for id in &answer.forget {
            self.forget(id);
        }
    }

    fn assign(&mut self, assignment: &pb::Assignment, destroy_reason: Option<&str>) {
        let id = assignment.sandbox_id.as_str();
        if self.sandboxes.contains_key(id) {
            return;
        }
        if self.shutting_down {
            tracing::debug!(sandbox = %id, "not taking an assignment while stopping");
            return;
        }
        let mut record = SandboxRecord {
            sandbox_id: id.to_owned(),
            run_id: assignment.run_id.clone(),
            attempt: assignment.attempt,
            generation: Generation(assignment.generation),
            workspace_id: assignment.workspace_id.clone(),
            image: Some(assignment.image.clone())
                .filter(|i| !i.is_empty())
                .or_else(|| self.config.default_image.clone())
                .unwrap_or_default(),
            driver: self.driver.kind().to_owned(),
            detached: false,
            pid: None,
            pid_start_time: None,
            state: SandboxState::Starting,
            exit_code: 0,
            detail: String::new(),
        };
        if !valid_sandbox_id(id) {
            tracing::error!(sandbox = ?id, "refusing an assignment with an unusable sandbox id");
            record.state = SandboxState::Failed;
            record.detail = format!(
                "sandbox id {id:?} cannot name a directory (letters, digits, '.', '_', '-')"
            );
            // Not written to disk: the id cannot name a record file either.
            self.sandboxes.insert(
                id.to_owned(),
                Tracked {
                    record,
                    destroy: None,
                },
            );
            return;
        }
        if let Some(reason) = destroy_reason {
            record.state = SandboxState::Destroyed;
            record.detail = format!("destroyed ({reason}) before it started");
            self.remember(record);
            return;
        }
        let live = self.sandboxes.values().filter(|t| t.live()).count();
        if live >= self.config.slots as usize {
            if self.full_warned.insert(id.to_owned()) {
                tracing::warn!(sandbox = %id, slots = self.config.slots, "assignment while every slot is taken; waiting");
            }
            return;
        }
        self.full_warned.remove(id);
        self.start(record, &assignment.run_token);
    }

    fn start(&mut self, mut record: SandboxRecord, run_token: &str) {
        let id = record.sandbox_id.clone();
        if let Err(e) = self.layout.write_record(&record) {
            tracing::error!(sandbox = %id, error = %e, "cannot record the sandbox; not starting it");
            record.state = SandboxState::Failed;
            record.detail = format!("the host cannot record the sandbox: {e}");
            self.sandboxes.insert(
                id,
                Tracked {
                    record,
                    destroy: None,
                },
            );
            return;
        }
        let paths = match self.layout.create_sandbox_dirs(&id) {
            Ok(paths) => paths,
            Err(e) => {
                tracing::error!(sandbox = %id, error = %e, "cannot create the sandbox directory");
                record.state = SandboxState::Failed;
                record.detail = format!("cannot create the sandbox directory: {e}");
                self.remember(record);
                return;
            }
        };
        let keep = self.keep_on_end(&record);
        if let Some(keep) = &keep {
            let taken = keep.kept.take(&keep.workspace, &paths);
            self.metrics.kept_take(matches!(taken, Ok(Some(_))));
            match taken {
                Ok(Some(taken)) => tracing::info!(
                    sandbox = %id, workspace = %keep.workspace,
                    size = %taken.bytes.map_or_else(|| "not measured yet".to_owned(), cairn_proto::size::human_bytes),
                    "starting on the workspace tree an earlier sandbox of this workspace left"
                ),
                Ok(None) => {}
                // The restore copes with whatever part arrived: it checks
                // every file it finds against the checkpoint.
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "cannot take the kept workspace tree")
                }
            }
        }
        // After the take: a kept cache directory brings the last sandbox's.
        if let Err(e) = host_reports::create(&paths.cache) {
            tracing::warn!(sandbox = %id, error = %e, "cannot create the runner's reports file; its restores and checkpoints are not in the metrics");
        }
        let coordinator = self
            .config
            .sandbox_coordinator
            .as_deref()
            .unwrap_or(&self.config.coordinator);
        let spec = SandboxSpec {
            sandbox_id: id.clone(),
            run_id: record.run_id.clone(),
            attempt: record.attempt,
            image: record.image.clone(),
            env: sandbox::sandbox_env(
                coordinator,
                run_token,
                &id,
                &paths,
                self.config.pack_cache.as_ref(),
                self.config.tls.ca_pem().as_deref(),
                &self.config.env,
            ),
            log_file: self.layout.log_file(&id),
            paths,
        };
        match self.driver.start(&spec) {
            Ok(started) => {
                if let Some((pid, start_time)) = started.leader() {
                    record.pid = Some(pid);
                    record.pid_start_time = Some(start_time);
                }
                record.detached = started.detached();
                tracing::info!(
                    sandbox = %id, run = %record.run_id, attempt = record.attempt, pid = ?record.pid,
                    log = %spec.log_file.display(), "sandbox started"
                );
                self.metrics.sandbox_started();
                let (destroy_tx, destroy_rx) = oneshot::channel();
                let reports = ReportReader::new();
                self.supervise(&spec, keep, started, destroy_rx, reports);
                self.remember_live(record, destroy_tx);
            }
            Err(e) => {
                tracing::error!(sandbox = %id, error = %e, "cannot start the sandbox");
                if let Err(e) = super::layout::remove_tree(&spec.paths.dir) {
                    tracing::error!(sandbox = %id, error = %e, "cannot remove the sandbox directory");
                }
                record.state = SandboxState::Failed;
                record.detail = e.to_string();
                self.metrics.sandbox_ended(SandboxState::Failed);
                self.remember(record);
            }
        }
    }

    /// Deletes kept trees past their age every [`KEPT_PRUNE_EVERY`], off the
    /// event loop.
    fn prune_kept(&mut self) {
        let Some(kept) = &self.kept else { return };
        if self.kept_pruned.elapsed() < KEPT_PRUNE_EVERY {
            return;
        }
        self.kept_pruned = Instant::now();
        let kept = kept.clone();
        drop(tokio::task::spawn_blocking(move || kept.prune()));
    }

    /// Where the tree of `record`'s sandbox is kept when it ends (`None`:
    /// keeping is off, or the record names no valid workspace).
    fn keep_on_end(&self, record: &SandboxRecord) -> Option<KeepOnEnd> {
        Some(KeepOnEnd {
            kept: self.kept.clone()?,
            workspace: record.workspace_id.parse().ok()?,
        })
    }

    fn supervise(
        &mut self,
        spec: &SandboxSpec,
        keep: Option<KeepOnEnd>,
        started: D::Sandbox,
        destroy_rx: oneshot::Receiver<String>,
        reports: ReportReader,
    ) {
        let handle = self.tasks.spawn(sandbox::supervise(
            spec.sandbox_id.clone(),
            started,
            self.config.grace,
            destroy_rx,
            Cleanup {
                paths: spec.paths.clone(),
                keep,
            },
            sandbox::RunnerOutput {
                log_file: spec.log_file.clone(),
                reports,
                metrics: self.metrics.clone(),
            },
            self.updates_tx.clone(),
        ));
        self.task_sandboxes
            .insert(handle.id(), spec.sandbox_id.clone());
    }

    /// Tracks an ended (or never started) sandbox and persists its record.
    fn remember(&mut self, record: SandboxRecord) {
        self.persist(&record);
        self.sandboxes.insert(
            record.sandbox_id.clone(),
            Tracked {
                record,
                destroy: None,
            },
        );
    }

    fn remember_live(&mut self, record: SandboxRecord, destroy: oneshot::Sender<String>) {
        self.persist(&record);
        self.sandboxes.insert(
            record.sandbox_id.clone(),
            Tracked {
                record,
                destroy: Some(destroy),
            },
        );
    }

    fn persist(&self, record: &SandboxRecord) {
        if let Err(e) = self.layout.write_record(record) {
            tracing::error!(sandbox = %record.sandbox_id, error = %e, "cannot update the sandbox record");
        }
    }

    fn order_destroy(&mut self, id: &str, reason: &str) {
        match self.sandboxes.get_mut(id) {
            Some(tracked) => {
                if let Some(destroy) = tracked.destroy.take() {
                    let _ = destroy.send(reason.to_owned());
                }
            }
            None => {
                if !valid_sandbox_id(id) {
                    tracing::warn!(sandbox = ?id, %reason, "ignoring a destroy order with an unusable sandbox id");
                    return;
                }
                tracing::warn!(sandbox = %id, %reason, "destroy order for a sandbox this host does not know");
                self.remember(SandboxRecord {
                    sandbox_id: id.to_owned(),
                    run_id: String::new(),
                    attempt: 0,
                    generation: Generation::default(),
                    workspace_id: String::new(),
                    image: String::new(),
                    driver: self.driver.kind().to_owned(),
                    detached: false,
                    pid: None,
                    pid_start_time: None,
                    state: SandboxState::Destroyed,
                    exit_code: 0,
                    detail: format!("destroyed ({reason}): this host has no such sandbox"),
                });
            }
        }
    }

    fn forget(&mut self, id: &str) {
        match self.sandboxes.get(id) {
            None => {}
            Some(tracked) if tracked.live() => {
                tracing::warn!(sandbox = %id, "the coordinator asked to forget a sandbox that still runs; keeping it");
            }
            Some(_) => {
                self.sandboxes.remove(id);
                if valid_sandbox_id(id)
                    && let Err(e) = self.layout.remove_record(id)
                {
                    tracing::warn!(sandbox = %id, error = %e, "cannot remove the sandbox record");
                }
                self.layout.prune_logs();
            }
        }
    }

    fn apply(&mut self, update: Update) {
        match update {
            Update::Up { sandbox_id } => {
                if let Some(tracked) = self.sandboxes.get_mut(&sandbox_id)
                    && tracked.record.state == SandboxState::Starting
                {
                    tracked.record.state = SandboxState::Running;
                    let record = tracked.record.clone();
                    self.persist(&record);
                }
            }
            Update::Ended {
                sandbox_id,
                state,
                exit_code,
                detail,
            } => {
                let Some(tracked) = self.sandboxes.get_mut(&sandbox_id) else {
                    return;
                };
                tracked.destroy = None;
                self.metrics.sandbox_ended(state);
                tracked.record.state = state;
                tracked.record.exit_code = exit_code;
                tracked.record.detail = detail;
                let record = tracked.record.clone();
                if state == SandboxState::Exited && exit_code == 0
                    || state == SandboxState::Destroyed
                {
                    tracing::info!(sandbox = %sandbox_id, %state, detail = %record.detail, "sandbox gone");
                } else {
                    tracing::warn!(sandbox = %sandbox_id, %state, detail = %record.detail, "sandbox gone");
                }
                self.persist(&record);
            }
        }
    }

    fn task_finished(&mut self, joined: Result<(tokio::task::Id, ()), tokio::task::JoinError>) {
        let id = match &joined {
            Ok((id, ())) => *id,
            Err(e) => e.id(),
        };
        let sandbox_id = self.task_sandboxes.remove(&id);
        if let (Err(e), Some(sandbox_id)) = (joined, sandbox_id) {
            tracing::error!(sandbox = %sandbox_id, error = %e, "the sandbox's supervising task failed");
            if let Some(tracked) = self.sandboxes.get_mut(&sandbox_id)
                && tracked.live()
            {
                tracked.destroy = None;
                tracked.record.state = SandboxState::Failed;
                tracked.record.exit_code = UNKNOWN_EXIT_CODE;
                tracked.record.detail = format!("the host agent lost track of the sandbox: {e}");
                let record = tracked.record.clone();
                self.persist(&record);
            }
        }
    }

    /// Takes over what a previous process of the agent left: ended sandboxes
    /// are reported again until forgotten; running ones are destroyed.
    fn recover(&mut self) -> Result<(), HostError> {
        let records = self.layout.read_records()?;
        let known: HashSet<String> = records.iter().map(|r| r.sandbox_id.clone()).collect();
        for mut record in records {
            let id = record.sandbox_id.clone();
            let paths = self.layout.sandbox_paths(&id);
            if record.state.is_gone() {
                if let Err(e) = super::layout::remove_tree(&paths.dir) {
                    tracing::warn!(sandbox = %id, error = %e, "cannot remove a leftover sandbox directory");
                }
                self.sandboxes.insert(
                    id,
                    Tracked {
                        record,
                        destroy: None,
                    },
                );
                continue;
            }
            let coordinator = self
                .config
                .sandbox_coordinator
                .as_deref()
                .unwrap_or(&self.config.coordinator);
            let mut env = sandbox::sandbox_env(
                coordinator,
                "",
                &id,
                &paths,
                self.config.pack_cache.as_ref(),
                self.config.tls.ca_pem().as_deref(),
                &self.config.env,
            );
            env.retain(|v| v.name != super::exec::RUN_TOKEN_VAR);
            let spec = SandboxSpec {
                sandbox_id: id.clone(),
                run_id: record.run_id.clone(),
                attempt: record.attempt,
                image: record.image.clone(),
                env,
                log_file: self.layout.log_file(&id),
                paths,
            };
            match self.driver.adopt(&spec, &record) {
                Some(adopted) => {
                    tracing::warn!(sandbox = %id, "a previous host agent process left this sandbox running; destroying it");
                    let (destroy_tx, destroy_rx) = oneshot::channel();
                    let _ = destroy_tx.send(REASON_HOST_RESTARTED.to_owned());
                    let keep = self.keep_on_end(&record);
                    // The earlier process counted what is in the file.
                    let reports = ReportReader::from_end(&spec.paths.cache);
                    self.supervise(&spec, keep, adopted, destroy_rx, reports);
                    self.sandboxes.insert(
                        id,
                        Tracked {
                            record,
                            destroy: None,
                        },
                    );
                }
                None => {
                    if let Err(e) = super::layout::remove_tree(&spec.paths.dir) {
                        tracing::warn!(sandbox = %id, error = %e, "cannot remove a leftover sandbox directory");
                    }
                    tracing::info!(sandbox = %id, "a sandbox of a previous host agent process ended while no agent ran");
                    record.state = SandboxState::Destroyed;
                    record.exit_code = UNKNOWN_EXIT_CODE;
                    record.detail = format!(
                        "destroyed ({REASON_HOST_RESTARTED}): the host agent restarted and the sandbox was \
                         no longer running (exit status unknown)"
                    );
                    self.remember(record);
                }
            }
        }
        for id in self.layout.sandbox_dirs()? {
            if !known.contains(&id) {
                tracing::info!(sandbox = %id, "removing a sandbox directory nothing refers to");
                if let Err(e) = super::layout::remove_tree(&self.layout.sandbox_paths(&id).dir) {
                    tracing::warn!(sandbox = %id, error = %e, "cannot remove a leftover sandbox directory");
                }
            }
        }
        Ok(())
    }

    /// Tells the coordinator how everything ended (best effort, bounded).
    async fn final_heartbeat(&mut self) {
        if !self.registered {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    "could not send the last heartbeat; the coordinator will notice from the lease"
                );
                return;
            }
            match self.heartbeat(left.min(Duration::from_secs(2))).await {
                Ok(_) => return,
                Err(ExchangeError::Retry(_) | ExchangeError::Fatal(_)) => {
                    tokio::time::sleep(Duration::from_millis(200).min(left)).await;
                }
            }
        }
    }

    fn reachable(&mut self) {
        if let Some(u) = self.unreachable.take() {
            tracing::info!(
                failures = u.failures,
                "coordinator reachable again after {}",
                humantime::format_duration(Duration::from_secs(u.since.elapsed().as_secs()))
            );
        }
        self.backoff = BACKOFF_START;
    }

    /// Notes a failed exchange; returns the delay before the next try.
    fn unreachable(&mut self, status: &tonic::Status) -> Duration {
        let now = Instant::now();
        match &mut self.unreachable {
            None => {
                tracing::warn!(address = %self.config.coordinator, %status, "cannot reach the coordinator; retrying (sandboxes keep running)");
                self.unreachable = Some(Unreachable {
                    since: now,
                    failures: 1,
                    last_logged: now,
                });
            }
            Some(u) => {
                u.failures += 1;
                if now.duration_since(u.last_logged) >= UNREACHABLE_LOG_EVERY {
                    u.last_logged = now;
                    tracing::warn!(
                        failures = u.failures, %status,
                        "coordinator still unreachable after {}",
                        humantime::format_duration(Duration::from_secs(now.duration_since(u.since).as_secs()))
                    );
                }
            }
        }
        let cap = self.lease.map_or(BACKOFF_MAX, |lease| {
            (lease / 3).clamp(BACKOFF_START, BACKOFF_MAX)
        });
        let delay = self.backoff.min(cap);
        self.backoff = (self.backoff * 2).min(cap);
        // Jitter keeps many hosts from retrying in lockstep after a coordinator restart.
        delay.mul_f64(rand::rng().random_range(0.8..1.2))
    }
}

/// A HostService client on `channel` that sends `token`.
fn host_client(
    channel: &CoordinatorChannel,
    token: &str,
) -> Result<HostServiceClient<AuthChannel>, HostError> {
    let interceptor =
        BearerInterceptor::new(Some(token)).map_err(|e| HostError::Config(e.to_string()))?;
    Ok(HostServiceClient::new(InterceptedService::new(
        channel.clone(),
        interceptor,
    )))
}

/// Sorts a failed call into retry-later and give-up.
fn classify(status: tonic::Status, registering: bool) -> ExchangeError {
    match status.code() {
        Code::Unauthenticated | Code::PermissionDenied | Code::Unimplemented => {
            ExchangeError::Fatal(status)
        }
        Code::InvalidArgument if registering => ExchangeError::Fatal(status),
        Code::NotFound if !registering => ExchangeError::Fatal(status),
        _ => ExchangeError::Retry(status),
    }
}
