//! Runs on hosts: a coordinator with short host leases, real `cairn-host`
//! processes running `cairn-runner run` in local sandboxes, and a recorded
//! demo agent — everything the issue-3 end-to-end tests drive.
//!
//! - [`Fleet`]: one coordinator (lease and heartbeat from [`FleetTiming`]),
//!   its hosts, gRPC helpers for runs and hosts (create, wait for a state,
//!   events, answer, cancel, cordon, drain), and failure output that shows
//!   the run, its events and every host's and sandbox's log.
//! - [`Host`]: a `cairn-host` process (`--driver local`, or exec with
//!   [`ExecDriver`]) with a private data
//!   dir; [`Host::crash`] SIGKILLs it together with its sandboxes' processes
//!   (stopped first, so nothing gets to react), [`Host::stop`] is a clean
//!   SIGTERM.
//! - The recorded agent: the harness binary runs are given is a small
//!   script that writes down, for every turn, the arguments the runner
//!   started the agent with, the sandbox it ran in and a copy of
//!   `/workspace` as the agent found it, then becomes `cairn-demo-agent`
//!   ([`AgentTurn`]). So a test sees what the agent saw on the host it ran
//!   on, after a restore, without reaching into a live sandbox.
//! - Processes: sandbox processes are found by their `CAIRN_SANDBOX_ID` in
//!   `/proc/<pid>/environ`; signals go through `/usr/bin/kill`.
//!
//! The local driver needs root or unprivileged user namespaces;
//! [`require_local_sandboxes`] fails a test with a message saying so rather
//! than letting it skip.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use cairn_engine::client::AuthChannel;
use cairn_proto::pb;
use cairn_proto::pb::admin_service_client::AdminServiceClient;
use cairn_proto::pb::run_service_client::RunServiceClient;
use cairn_proto::runs::{HostState, RunState, to_proto_duration};
use serde_json::Value;
use tempfile::TempDir;

use crate::tls::TlsFiles;
use crate::{Coordinator, binary, dir_names, tempdir};

/// How long a test waits for a run, host or process to get where it should.
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(90);

/// How often waits look again.
const POLL: Duration = Duration::from_millis(100);

/// The coordinator's host lease and heartbeat interval.
#[derive(Debug, Clone, Copy)]
pub struct FleetTiming {
    pub host_lease: Duration,
    pub heartbeat_interval: Duration,
}

impl Default for FleetTiming {
    /// A lost host is noticed within seconds: lease 3 s, heartbeat 300 ms.
    fn default() -> Self {
        Self {
            host_lease: Duration::from_secs(3),
            heartbeat_interval: Duration::from_millis(300),
        }
    }
}

/// How a [`Host`] is started.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// `--labels`, e.g. `pool=cpu,zone=b` (empty: none).
    pub labels: String,
    pub slots: u32,
    /// `--grace`: SIGTERM to SIGKILL when a sandbox is destroyed.
    pub grace: Duration,
    /// The host's token (default: the admin token).
    pub token: Option<String>,
    /// `--tls-client-cert` and `--tls-client-key` (mutual TLS).
    pub client_certificate: Option<(PathBuf, PathBuf)>,
    /// More `--env NAME=VALUE` for every sandbox (a provider's address).
    pub env: Vec<(String, String)>,
    /// `--metrics-listen`.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// `--driver exec` with these commands (default: `--driver local`).
    pub exec: Option<ExecDriver>,
    /// The `--coordinator` addresses this host is given (default: the
    /// fleet's), e.g. one replica only.
    pub coordinator: Option<String>,
}

/// `cairn-host --driver exec`: the templates, `--default-image`, and
/// variables for the host agent's own environment, which its commands
/// inherit (a container engine's configuration).
#[derive(Debug, Clone, Default)]
pub struct ExecDriver {
    pub create: String,
    pub wait: Option<String>,
    pub destroy: Option<String>,
    pub default_image: Option<String>,
    pub host_env: Vec<(String, String)>,
}

impl Default for HostOptions {
    fn default() -> Self {
        Self {
            labels: String::new(),
            slots: 1,
            grace: Duration::from_secs(20),
            token: None,
            client_certificate: None,
            env: Vec::new(),
            metrics_listen: None,
            exec: None,
            coordinator: None,
        }
    }
}

/// Panics with what to do unless this process can run local-driver
/// sandboxes (root, or unprivileged user namespaces with a `/workspace`
/// mount point). Called by [`Fleet::start`]; never skips silently.
pub fn require_local_sandboxes() {
    if effective_uid() == Some(0) {
        return;
    }
    let userns = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !userns {
        panic!(
            "the end-to-end tests of runs need cairn-host's local driver, which needs root or \
             unprivileged user namespaces: this process is uid {:?} and `unshare --user \
             --map-root-user --mount true` failed. Run the tests as root (CI does), or enable user \
             namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0) \
             and create an empty /workspace",
            effective_uid()
        );
    }
    if !Path::new("/workspace").is_dir() {
        panic!(
            "without root the local driver needs an existing /workspace mount point (an empty \
             directory; only root can create it): run `sudo mkdir /workspace` or run the tests as \
             root"
        );
    }
}

fn effective_uid() -> Option<u32> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

// ---------------------------------------------------------------------------
// The fleet

/// A coordinator, its hosts and gRPC clients for runs and hosts.
pub struct Fleet {
    // Hosts go first: they must be gone before the coordinator is.
    hosts: Vec<Host>,
    pub coordinator: Coordinator,
    /// A second coordinator on the same database, when the fleet has one.
    pub replica: Option<Coordinator>,
    /// What hosts and the fleet's clients are given: the coordinator's
    /// address, or both replicas' separated by a comma.
    addresses: String,
    dir: TempDir,
    runtime: tokio::runtime::Runtime,
    runs: RunServiceClient<AuthChannel>,
    admin: AdminServiceClient<AuthChannel>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("coordinator", &self.coordinator)
            .field(
                "hosts",
                &self.hosts.iter().map(|h| &h.name).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Fleet {
    /// A coordinator with the default [`FleetTiming`] and no hosts yet.
    pub fn start() -> Self {
        Self::start_with(FleetTiming::default())
    }

    pub fn start_with(timing: FleetTiming) -> Self {
        Self::start_with_args(timing, &[])
    }

    /// With more `cairn-coordinator serve` flags (`--metrics-listen ADDR`).
    pub fn start_with_args(timing: FleetTiming, extra_args: &[&str]) -> Self {
        require_local_sandboxes();
        let lease = format!("{}ms", timing.host_lease.as_millis());
        let heartbeat = format!("{}ms", timing.heartbeat_interval.as_millis());
        let mut args = vec!["--host-lease", &lease, "--heartbeat-interval", &heartbeat];
        args.extend_from_slice(extra_args);
        Self::around(Coordinator::start_with(&args))
    }

    /// A coordinator with the default [`FleetTiming`] serving TLS (mutual
    /// TLS for hosts when `mtls`); hosts and clients trust `files.ca`.
    pub fn start_tls(files: &TlsFiles, mtls: bool) -> Self {
        require_local_sandboxes();
        let timing = FleetTiming::default();
        let lease = format!("{}ms", timing.host_lease.as_millis());
        let heartbeat = format!("{}ms", timing.heartbeat_interval.as_millis());
        Self::around(Coordinator::start_tls(
            files,
            mtls,
            &["--host-lease", &lease, "--heartbeat-interval", &heartbeat],
        ))
    }

    fn around(coordinator: Coordinator) -> Self {
        let addresses = coordinator.grpc_url().to_owned();
        Self::around_addresses(coordinator, None, addresses)
    }

    /// Two coordinators on one database (started by the caller with the
    /// [`FleetTiming`] flags): hosts, their sandboxes and the fleet's
    /// clients are given both addresses, `first`'s first.
    pub fn around_replicas(first: Coordinator, second: Coordinator) -> Self {
        require_local_sandboxes();
        let addresses = format!("{},{}", first.grpc_url(), second.grpc_url());
        Self::around_addresses(first, Some(second), addresses)
    }

    fn around_addresses(
        coordinator: Coordinator,
        replica: Option<Coordinator>,
        addresses: String,
    ) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime always builds");
        let channel = runtime.block_on(async {
            cairn_engine::client::CoordinatorClient::connect_with(
                &addresses,
                Some(coordinator.admin_token()),
                &coordinator.client_tls(),
            )
            .await
            .expect("the fleet's coordinator answers")
            .auth_channel()
        });
        let fleet = Self {
            hosts: Vec::new(),
            runs: RunServiceClient::new(channel.clone()),
            admin: AdminServiceClient::new(channel),
            dir: tempdir("fleet"),
            runtime,
            coordinator,
            replica,
            addresses,
        };
        fleet.write_recorded_agent();
        fleet
    }

    /// Starts `cairn-host --name NAME --driver local …` (or `exec`, see
    /// [`HostOptions::exec`]) and waits until the
    /// coordinator lists it as ready.
    pub fn start_host(&mut self, name: &str, options: HostOptions) -> &Host {
        assert!(
            self.hosts.iter().all(|h| h.name != name),
            "a host called {name} is already running"
        );
        let mut host = Host {
            name: name.to_owned(),
            id: String::new(),
            home: tempdir(&format!("host-{name}")),
            child: None,
            coordinator: options
                .coordinator
                .clone()
                .unwrap_or_else(|| self.addresses.clone()),
            options,
            admin_token: self.coordinator.admin_token().to_owned(),
            ca: self.coordinator.ca().map(Path::to_path_buf),
        };
        host.spawn();
        host.id = host.wait_for_id();
        let id = host.id.clone();
        self.hosts.push(host);
        self.wait_for_host(name, "ready", |h| {
            state_of_host(h) == Some(HostState::Ready)
        });
        self.hosts.iter().find(|h| h.id == id).expect("just pushed")
    }

    /// Starts the stopped host `name` again on its data dir (the token it
    /// was started with, unless the data dir holds the one bound to it) and
    /// waits until it registered again.
    pub fn restart_host(&mut self, name: &str) {
        let before = self.host_info(name).registered_at;
        let host = self.host_mut(name);
        assert!(
            host.child.is_none(),
            "host {name} still runs; stop it first"
        );
        host.spawn();
        self.wait_for_host(name, "registered again", |h| {
            h.registered_at != before && state_of_host(h) == Some(HostState::Ready)
        });
    }

    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host called {name} was started"))
    }

    pub fn host_mut(&mut self, name: &str) -> &mut Host {
        self.hosts
            .iter_mut()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host called {name} was started"))
    }

    /// The host (started by this fleet) with coordinator id `id`.
    pub fn host_by_id(&self, id: &str) -> &Host {
        self.hosts.iter().find(|h| h.id == id).unwrap_or_else(|| {
            panic!(
                "{id} is none of this fleet's hosts; {}",
                self.hosts_summary()
            )
        })
    }

    /// Runs `future` (a gRPC call) on the fleet's runtime.
    pub fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    // -- the recorded agent -------------------------------------------------

    fn turns_dir(&self) -> PathBuf {
        self.dir.path().join("agent-turns")
    }

    /// The harness binary runs get (`binary=` of the claude harness): records
    /// each turn, then execs `cairn-demo-agent`.
    pub fn agent_binary(&self) -> PathBuf {
        self.dir.path().join("recorded-agent")
    }

    fn write_recorded_agent(&self) {
        let turns = self.turns_dir();
        fs::create_dir_all(&turns).expect("the turns dir can be created");
        let agent = binary("cairn-demo-agent");
        let script = format!(
            r#"#!/bin/sh
# Writes down how the runner started the agent and what /workspace held, then
# becomes cairn-demo-agent (written by the cairn-e2e harness).
turn='{turns}'/"$(date +%s%N)-$$"
mkdir -p "$turn.partial/workspace"
printf '%s\0' "$@" > "$turn.partial/argv"
printf '%s' "${{CAIRN_SANDBOX_ID:-}}" > "$turn.partial/sandbox"
pwd -P > "$turn.partial/cwd"
cp -a /workspace/. "$turn.partial/workspace/" 2> "$turn.partial/copy-errors"
mv "$turn.partial" "$turn"
exec '{agent}' "$@"
"#,
            turns = turns.display(),
            agent = agent.display()
        );
        crate::write(&self.agent_binary(), script);
        crate::set_mode(&self.agent_binary(), 0o755);
    }

    /// Every turn the recorded agent was started for, oldest first.
    pub fn agent_turns(&self) -> Vec<AgentTurn> {
        dir_names(&self.turns_dir())
            .into_iter()
            .filter(|name| !name.ends_with(".partial"))
            .map(|name| AgentTurn::read(&self.turns_dir().join(name)))
            .collect()
    }

    /// The turns that ran in sandbox `sandbox_id`, oldest first.
    pub fn agent_turns_in(&self, sandbox_id: &str) -> Vec<AgentTurn> {
        self.agent_turns()
            .into_iter()
            .filter(|t| t.sandbox == sandbox_id)
            .collect()
    }

    /// Waits for the first turn in `sandbox_id` (the agent has started there).
    pub fn wait_for_agent_turn(&self, sandbox_id: &str) -> AgentTurn {
        self.wait_for(&format!("the agent to start in {sandbox_id}"), || {
            self.agent_turns_in(sandbox_id).into_iter().next()
        })
    }

    // -- runs ---------------------------------------------------------------

    /// A run on a new workspace called `workspace`, harness `claude` played
    /// by the recorded demo agent, hold 5 minutes.
    pub fn run_request(&self, workspace: &str, prompt: &str) -> pb::CreateRunRequest {
        pb::CreateRunRequest {
            target: Some(pb::create_run_request::Target::NewWorkspace(
                pb::NewWorkspace {
                    name: workspace.to_owned(),
                },
            )),
            harness: Some(pb::HarnessSpec {
                name: "claude".into(),
                config: [(
                    "binary".to_owned(),
                    self.agent_binary().display().to_string(),
                )]
                .into(),
            }),
            prompt: prompt.to_owned(),
            hold: Some(to_proto_duration(Duration::from_secs(300))),
            ..Default::default()
        }
    }

    pub fn create_run(&self, request: pb::CreateRunRequest) -> pb::Run {
        let mut runs = self.runs.clone();
        self.block_on(runs.create_run(request))
            .unwrap_or_else(|s| panic!("CreateRun failed: {s}"))
            .into_inner()
    }

    pub fn get_run(&self, run_id: &str) -> pb::Run {
        self.try_get_run(run_id)
            .unwrap_or_else(|s| panic!("GetRun {run_id} failed: {s}"))
    }

    /// GetRun, whatever the answer (a call to a replica that just died
    /// fails, and moves the fleet's clients to the other).
    pub fn try_get_run(&self, run_id: &str) -> Result<pb::Run, tonic::Status> {
        let mut runs = self.runs.clone();
        self.block_on(runs.get_run(pb::GetRunRequest {
            run_id: run_id.to_owned(),
        }))
        .map(tonic::Response::into_inner)
    }

    /// The run's events so far, oldest first.
    pub fn events(&self, run_id: &str) -> Vec<pb::RunEvent> {
        let mut runs = self.runs.clone();
        self.block_on(async {
            let mut stream = runs
                .watch_run_events(pb::WatchRunEventsRequest {
                    run_id: run_id.to_owned(),
                    after_sequence: 0,
                    follow: false,
                })
                .await
                .unwrap_or_else(|s| panic!("WatchRunEvents {run_id} failed: {s}"))
                .into_inner();
            let mut events = Vec::new();
            while let Some(event) = stream
                .message()
                .await
                .unwrap_or_else(|s| panic!("WatchRunEvents {run_id} broke off: {s}"))
            {
                events.push(event);
            }
            events
        })
    }

    pub fn answer(&self, run_id: &str, text: &str) -> Result<pb::Run, tonic::Status> {
        let mut runs = self.runs.clone();
        self.block_on(runs.answer_run(pb::AnswerRunRequest {
            run_id: run_id.to_owned(),
            text: text.to_owned(),
        }))
        .map(tonic::Response::into_inner)
    }

    /// SuspendRun: checkpoint and release the sandbox (mid-turn too).
    pub fn suspend(&self, run_id: &str) -> pb::Run {
        let mut runs = self.runs.clone();
        self.block_on(runs.suspend_run(pb::SuspendRunRequest {
            run_id: run_id.to_owned(),
            reason: "suspended by the test".into(),
        }))
        .unwrap_or_else(|s| panic!("SuspendRun {run_id} failed: {s}"))
        .into_inner()
    }

    pub fn cancel(&self, run_id: &str) -> pb::Run {
        let mut runs = self.runs.clone();
        self.block_on(runs.cancel_run(pb::CancelRunRequest {
            run_id: run_id.to_owned(),
            reason: "the test is done with it".into(),
        }))
        .unwrap_or_else(|s| panic!("CancelRun {run_id} failed: {s}"))
        .into_inner()
    }

    /// Polls the run until `done` holds; panics after [`WAIT_TIMEOUT`] with
    /// the run, its events and the logs.
    #[track_caller]
    pub fn wait_for_run(
        &self,
        run_id: &str,
        what: &str,
        done: impl Fn(&pb::Run) -> bool,
    ) -> pb::Run {
        let deadline = Instant::now() + WAIT_TIMEOUT;
        loop {
            let run = self.get_run(run_id);
            if done(&run) {
                return run;
            }
            if Instant::now() > deadline {
                panic!(
                    "run {run_id}: {what} did not happen within {WAIT_TIMEOUT:?}\n{}",
                    self.diagnose(run_id)
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// Waits until the run is in `state`; a terminal state other than the
    /// one awaited fails at once.
    #[track_caller]
    pub fn wait_for_state(&self, run_id: &str, state: RunState) -> pb::Run {
        let run = self.wait_for_run(run_id, &format!("state {state}"), |run| {
            let now = state_of(run);
            now == Some(state) || now.is_some_and(RunState::is_terminal)
        });
        if state_of(&run) != Some(state) {
            panic!(
                "run {run_id} ended {} while {state} was awaited\n{}",
                state_name(&run),
                self.diagnose(run_id)
            );
        }
        run
    }

    /// Waits for an event matching `wanted`.
    #[track_caller]
    pub fn wait_for_event(
        &self,
        run_id: &str,
        what: &str,
        wanted: impl Fn(&pb::RunEvent) -> bool,
    ) -> pb::RunEvent {
        self.wait_for(&format!("run {run_id}: {what}"), || {
            self.events(run_id).into_iter().find(|e| wanted(e))
        })
    }

    /// Polls `probe` until it returns something; panics with the fleet's
    /// state after [`WAIT_TIMEOUT`].
    #[track_caller]
    pub fn wait_for<T>(&self, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + WAIT_TIMEOUT;
        loop {
            if let Some(found) = probe() {
                return found;
            }
            if Instant::now() > deadline {
                panic!(
                    "{what}: not within {WAIT_TIMEOUT:?}\n{}",
                    self.hosts_summary()
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// The run, its events and the hosts, for a failure message.
    pub fn diagnose(&self, run_id: &str) -> String {
        let mut out = String::new();
        let run = self.get_run(run_id);
        let _ = writeln!(out, "run: {}", describe_run(&run));
        let _ = writeln!(out, "events:");
        for event in self.events(run_id) {
            let _ = writeln!(out, "  {}", describe_event(&event));
        }
        out.push_str(&self.hosts_summary());
        out
    }

    fn hosts_summary(&self) -> String {
        let mut out = String::from("hosts:\n");
        for host in self.list_hosts() {
            let _ = writeln!(
                out,
                "  {} {} state={} slots={}/{} runs={:?}",
                host.id,
                host.name,
                state_of_host(&host).map_or("?".into(), |s| s.to_string()),
                host.used_slots,
                host.slots,
                host.run_ids
            );
        }
        out
    }

    // -- hosts --------------------------------------------------------------

    pub fn list_hosts(&self) -> Vec<pb::Host> {
        let mut admin = self.admin.clone();
        self.block_on(admin.list_hosts(pb::ListHostsRequest {}))
            .unwrap_or_else(|s| panic!("ListHosts failed: {s}"))
            .into_inner()
            .hosts
    }

    /// The coordinator's view of host `name`.
    pub fn host_info(&self, name: &str) -> pb::Host {
        let id = &self.host(name).id;
        self.list_hosts()
            .into_iter()
            .find(|h| &h.id == id)
            .unwrap_or_else(|| panic!("ListHosts lacks host {name} ({id})"))
    }

    #[track_caller]
    pub fn wait_for_host(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&pb::Host) -> bool,
    ) -> pb::Host {
        let id = self.host(name).id.clone();
        self.wait_for(&format!("host {name} ({id}) {what}"), || {
            self.list_hosts()
                .into_iter()
                .find(|h| h.id == id)
                .filter(|h| done(h))
        })
    }

    pub fn cordon(&self, name: &str) -> pb::Host {
        let mut admin = self.admin.clone();
        self.block_on(admin.cordon_host(pb::HostRequest { host: name.into() }))
            .unwrap_or_else(|s| panic!("CordonHost {name} failed: {s}"))
            .into_inner()
    }

    pub fn uncordon(&self, name: &str) -> pb::Host {
        let mut admin = self.admin.clone();
        self.block_on(admin.uncordon_host(pb::HostRequest { host: name.into() }))
            .unwrap_or_else(|s| panic!("UncordonHost {name} failed: {s}"))
            .into_inner()
    }

    pub fn drain(&self, name: &str) -> pb::Host {
        let mut admin = self.admin.clone();
        self.block_on(admin.drain_host(pb::HostRequest { host: name.into() }))
            .unwrap_or_else(|s| panic!("DrainHost {name} failed: {s}"))
            .into_inner()
    }

    /// A new token of `scope` ("client" or "host").
    pub fn create_token(&self, scope: &str) -> String {
        let mut admin = self.admin.clone();
        self.block_on(admin.create_token(pb::CreateTokenRequest {
            scope: scope.into(),
            description: "cairn-e2e".into(),
            ..Default::default()
        }))
        .unwrap_or_else(|s| panic!("CreateToken {scope} failed: {s}"))
        .into_inner()
        .token
    }

    /// The admin, client and host tokens, as `tokens list` shows them.
    pub fn tokens(&self) -> Vec<pb::TokenInfo> {
        let mut admin = self.admin.clone();
        self.block_on(admin.list_tokens(pb::ListTokensRequest {}))
            .unwrap_or_else(|s| panic!("ListTokens failed: {s}"))
            .into_inner()
            .tokens
    }

    pub fn revoke_token(&self, id: &str) -> pb::TokenInfo {
        let mut admin = self.admin.clone();
        self.block_on(admin.revoke_token(pb::RevokeTokenRequest { id: id.into() }))
            .unwrap_or_else(|s| panic!("RevokeToken {id} failed: {s}"))
            .into_inner()
    }

    /// The workspace's committed checkpoints, newest first.
    pub fn checkpoints(&self, workspace: &str) -> Vec<pb::Checkpoint> {
        self.coordinator.list_checkpoints(workspace)
    }

    /// `cairnctl checkout WORKSPACE DIR --checkpoint CHECKPOINT` into a new
    /// temporary directory; returns it (kept alive) and the checkout's path.
    #[track_caller]
    pub fn checkout(&self, workspace: &str, checkpoint: &str) -> (TempDir, PathBuf) {
        let tmp = tempdir("checkout");
        let dir = tmp.path().join("checkout");
        crate::run(
            self.coordinator
                .client()
                .ctl()
                .arg("checkout")
                .arg(workspace)
                .arg(&dir)
                .args(["--checkpoint", checkpoint]),
        )
        .assert_success();
        (tmp, dir)
    }

    /// Waits until no process of sandbox `sandbox_id` is left and its
    /// directory on `host` is gone.
    #[track_caller]
    pub fn wait_for_sandbox_gone(&self, host: &str, sandbox_id: &str) {
        let dir = self.host(host).sandbox_dir(sandbox_id);
        self.wait_for(
            &format!("sandbox {sandbox_id} on {host} to be gone"),
            || (!dir.exists() && sandbox_processes(sandbox_id).is_empty()).then_some(()),
        );
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for host in &self.hosts {
                eprintln!("{}", host.logs());
            }
        }
        // Hosts before the coordinator (fields drop in order, but say it).
        self.hosts.clear();
    }
}

/// `request` aimed at the existing workspace `workspace` (id or name).
pub fn on_workspace(mut request: pb::CreateRunRequest, workspace: &str) -> pb::CreateRunRequest {
    request.target = Some(pb::create_run_request::Target::Workspace(
        workspace.to_owned(),
    ));
    request
}

/// The run's state, if it is a known one.
pub fn state_of(run: &pb::Run) -> Option<RunState> {
    RunState::try_from(run.state).ok()
}

pub fn state_name(run: &pb::Run) -> String {
    state_of(run).map_or_else(|| format!("state {}", run.state), |s| s.to_string())
}

pub fn state_of_host(host: &pb::Host) -> Option<HostState> {
    HostState::try_from(host.state).ok()
}

pub fn event_state(event: &pb::RunEvent) -> Option<RunState> {
    RunState::try_from(event.state).ok()
}

/// One line about a run, for failure messages.
pub fn describe_run(run: &pb::Run) -> String {
    let mut out = format!(
        "{} {} reason={:?} question={:?} summary={:?} session={:?} last_checkpoint={}",
        run.id,
        state_name(run),
        run.state_reason,
        run.question,
        run.summary,
        run.harness_session_id,
        run.last_checkpoint_id
    );
    for a in &run.attempts {
        let _ = write!(
            out,
            "\n    attempt {} gen {} host {} sandbox {} state {:?} end {:?} prepare {:?} restored {:?}",
            a.number,
            a.generation,
            a.host_id,
            a.sandbox_id,
            cairn_proto::runs::AttemptState::try_from(a.state).ok(),
            a.end_reason,
            a.prepare,
            a.restored_checkpoint_id
        );
    }
    out
}

/// One line about an event, for failure messages.
pub fn describe_event(e: &pb::RunEvent) -> String {
    format!(
        "#{} {} {:<16} host={} attempt={} gen={} checkpoint={} {}",
        e.sequence,
        event_state(e).map_or("?".into(), |s| s.to_string()),
        e.reason,
        e.host_id,
        e.attempt,
        e.generation,
        e.checkpoint_id,
        e.detail
    )
}

// ---------------------------------------------------------------------------
// Hosts

/// A `cairn-host` process; killed (with its sandboxes) on drop.
pub struct Host {
    pub name: String,
    /// The id the coordinator gave it.
    pub id: String,
    home: TempDir,
    child: Option<Child>,
    options: HostOptions,
    coordinator: String,
    admin_token: String,
    /// `CAIRN_CA` when the coordinator serves TLS.
    ca: Option<PathBuf>,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("name", &self.name)
            .field("id", &self.id)
            .field("data_dir", &self.data_dir())
            .finish_non_exhaustive()
    }
}

impl Host {
    /// The host's `--data-dir`.
    pub fn data_dir(&self) -> PathBuf {
        self.home.path().join("data")
    }

    /// `DIR/sandboxes/<id>` (the sandbox's workspace is `workspace/` in it).
    pub fn sandbox_dir(&self, sandbox_id: &str) -> PathBuf {
        self.data_dir().join("sandboxes").join(sandbox_id)
    }

    /// The sandbox directories that exist now.
    pub fn sandbox_ids(&self) -> Vec<String> {
        dir_names(&self.data_dir().join("sandboxes"))
    }

    fn log_path(&self) -> PathBuf {
        self.home.path().join("cairn-host.log")
    }

    /// The host agent's output and every sandbox log, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = format!(
            "--- cairn-host {} ({}) ---\n{}",
            self.name,
            self.data_dir().display(),
            tail(&self.log_path(), 80)
        );
        let logs = self.data_dir().join("logs");
        for name in dir_names(&logs) {
            let _ = write!(
                out,
                "\n--- sandbox log {name} on {} ---\n{}",
                self.name,
                tail(&logs.join(&name), 80)
            );
        }
        out
    }

    /// The pid of the `cairn-host` process (while it runs).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the host runs").id()
    }

    fn spawn(&mut self) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("the host log can be opened");
        let bin_dir = binary("cairn-host")
            .parent()
            .expect("binaries are in a directory")
            .to_path_buf();
        let path = match std::env::var("PATH") {
            Ok(path) if !path.is_empty() => format!("{}:{path}", bin_dir.display()),
            _ => bin_dir.display().to_string(),
        };
        // A test process that dies must not leave hosts (and their sandboxes)
        // behind: setpriv arms the parent-death signal, then execs cairn-host.
        let mut command = if Path::new("/usr/bin/setpriv").is_file() {
            let mut c = Command::new("/usr/bin/setpriv");
            c.args(["--pdeathsig", "KILL", "--"])
                .arg(binary("cairn-host"));
            c
        } else {
            Command::new(binary("cairn-host"))
        };
        command
            .arg("--coordinator")
            .arg(&self.coordinator)
            .arg("--data-dir")
            .arg(self.data_dir())
            .args(["--name", &self.name])
            .args(["--slots", &self.options.slots.to_string()])
            .args(["--grace", &format!("{}ms", self.options.grace.as_millis())])
            .env(
                "CAIRN_TOKEN",
                self.options.token.as_deref().unwrap_or(&self.admin_token),
            )
            .env_remove("CAIRN_COORDINATOR")
            .env_remove("CAIRN_FAILPOINTS")
            .env_remove("CAIRN_LOG_FORMAT")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle clones"))
            .stderr(log);
        if !self.options.labels.is_empty() {
            command.args(["--labels", &self.options.labels]);
        }
        match &self.ca {
            Some(ca) => command.env("CAIRN_CA", ca),
            None => command.env_remove("CAIRN_CA"),
        };
        for (name, value) in &self.options.env {
            command.arg("--env").arg(format!("{name}={value}"));
        }
        match &self.options.exec {
            // The runner finds the recorded agent's binaries on the host.
            None => {
                command
                    .args(["--driver", "local", "--env"])
                    .arg(format!("PATH={path}"));
            }
            // Containers keep their image's PATH ({env_args} passes every
            // --env into them).
            Some(exec) => {
                command
                    .args(["--driver", "exec"])
                    .arg("--exec-create")
                    .arg(&exec.create);
                if let Some(wait) = &exec.wait {
                    command.arg("--exec-wait").arg(wait);
                }
                if let Some(destroy) = &exec.destroy {
                    command.arg("--exec-destroy").arg(destroy);
                }
                if let Some(image) = &exec.default_image {
                    command.arg("--default-image").arg(image);
                }
                command.envs(exec.host_env.iter().map(|(k, v)| (k, v)));
            }
        }
        if let Some(address) = self.options.metrics_listen {
            command.arg("--metrics-listen").arg(address.to_string());
        }
        if let Some((cert, key)) = &self.options.client_certificate {
            command
                .arg("--tls-client-cert")
                .arg(cert)
                .arg("--tls-client-key")
                .arg(key);
        }
        self.child = Some(command.spawn().expect("cairn-host starts"));
    }

    /// Waits for `DIR/host-id` (written once the coordinator registered the host).
    fn wait_for_id(&mut self) -> String {
        let deadline = Instant::now() + WAIT_TIMEOUT;
        let file = self.data_dir().join("host-id");
        loop {
            let child = self.child.as_mut().expect("just spawned");
            if let Some(status) = child.try_wait().expect("child status can be read") {
                panic!(
                    "cairn-host {} exited ({status}) before it registered:\n{}",
                    self.name,
                    self.logs()
                );
            }
            if let Ok(id) = fs::read_to_string(&file)
                && id.trim().starts_with("host-")
            {
                return id.trim().to_owned();
            }
            if Instant::now() > deadline {
                panic!(
                    "cairn-host {} wrote no {} within {WAIT_TIMEOUT:?}:\n{}",
                    self.name,
                    file.display(),
                    self.logs()
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// The pid the host recorded for the sandbox's runner (the session leader).
    pub fn runner_pid(&self, sandbox_id: &str) -> Option<u32> {
        let record = self
            .data_dir()
            .join("records")
            .join(format!("{sandbox_id}.json"));
        let record: Value = serde_json::from_str(&fs::read_to_string(record).ok()?).ok()?;
        record.get("pid")?.as_u64().map(|p| p as u32)
    }

    /// A machine crash: the host agent and every process of its sandboxes are
    /// stopped (SIGSTOP, so none can react — no SIGTERM handler, no last
    /// checkpoint, no parent-death signal handling), then SIGKILLed. The data
    /// dir stays as the crash left it.
    pub fn crash(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let host = child.id();
        signal(&[host], "STOP");
        let mut doomed: BTreeSet<u32> = BTreeSet::from([host]);
        // Stop until nothing new appears: a process may fork while we look.
        loop {
            let mut found: BTreeSet<u32> = descendants(host).into_iter().collect();
            for sandbox in self.sandbox_ids() {
                found.extend(sandbox_processes(&sandbox));
            }
            let new: Vec<u32> = found.difference(&doomed).copied().collect();
            if new.is_empty() {
                break;
            }
            signal(&new, "STOP");
            doomed.extend(new);
        }
        let all: Vec<u32> = doomed.iter().copied().collect();
        signal(&all, "KILL");
        let _ = child.wait();
        for pid in all {
            wait_until_gone(pid);
        }
    }

    /// SIGTERM and wait: the agent destroys its sandboxes and exits.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        signal(&[child.id()], "TERM");
        let deadline = Instant::now() + WAIT_TIMEOUT;
        loop {
            if let Some(status) = child.try_wait().expect("child status can be read") {
                return Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!(
                    "cairn-host {} still ran {WAIT_TIMEOUT:?} after SIGTERM:\n{}",
                    self.name,
                    self.logs()
                );
            }
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.crash();
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---------------------------------------------------------------------------
// The recorded agent

/// One start of the agent, as the recording script saw it.
#[derive(Debug, Clone)]
pub struct AgentTurn {
    /// The arguments after the program name.
    pub argv: Vec<String>,
    /// `CAIRN_SANDBOX_ID` of the sandbox it ran in.
    pub sandbox: String,
    /// Its working directory (realpath).
    pub cwd: String,
    /// A copy of `/workspace` taken before the agent started.
    pub workspace: PathBuf,
}

impl AgentTurn {
    fn read(dir: &Path) -> Self {
        let argv = fs::read(dir.join("argv")).unwrap_or_default();
        let argv = argv
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let errors = fs::read_to_string(dir.join("copy-errors")).unwrap_or_default();
        assert!(
            errors.trim().is_empty(),
            "the recording agent could not copy /workspace: {errors}"
        );
        Self {
            argv,
            sandbox: fs::read_to_string(dir.join("sandbox")).unwrap_or_default(),
            cwd: fs::read_to_string(dir.join("cwd"))
                .unwrap_or_default()
                .trim()
                .to_owned(),
            workspace: dir.join("workspace"),
        }
    }

    /// The value after `flag`, e.g. `--resume`.
    pub fn flag(&self, flag: &str) -> Option<&str> {
        let at = self.argv.iter().position(|a| a == flag)?;
        self.argv.get(at + 1).map(String::as_str)
    }

    /// The message (the last argument).
    pub fn message(&self) -> &str {
        self.argv.last().map_or("", String::as_str)
    }
}

// ---------------------------------------------------------------------------
// Processes

/// Sends `SIG` (a name: TERM, KILL, STOP…) to each pid that still exists.
pub fn signal(pids: &[u32], sig: &str) {
    if pids.is_empty() {
        return;
    }
    // Errors are for pids that exited meanwhile, which is what we wanted.
    let _ = Command::new("/usr/bin/kill")
        .arg("-s")
        .arg(sig)
        .args(pids.iter().map(u32::to_string))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Whether `pid` exists and is not a zombie.
pub fn is_alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

fn wait_until_gone(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while is_alive(pid) {
        assert!(
            Instant::now() < deadline,
            "process {pid} still lives 30 s after SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn all_pids() -> Vec<u32> {
    fs::read_dir("/proc")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Every living descendant of `pid`.
pub fn descendants(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = all_pids()
        .into_iter()
        .filter_map(|p| Some((p, parent_of(p)?)))
        .collect();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    found.remove(0);
    found.retain(|p| is_alive(*p));
    found
}

/// The environment of a process (empty when it is gone or unreadable).
pub fn process_env(pid: u32) -> Vec<(String, String)> {
    let Ok(environ) = fs::read(format!("/proc/{pid}/environ")) else {
        return Vec::new();
    };
    environ
        .split(|b| *b == 0)
        .filter_map(|entry| {
            let entry = String::from_utf8_lossy(entry);
            let (k, v) = entry.split_once('=')?;
            Some((k.to_owned(), v.to_owned()))
        })
        .collect()
}

/// Living processes whose environment says they belong to `sandbox_id`.
pub fn sandbox_processes(sandbox_id: &str) -> Vec<u32> {
    let me = std::process::id();
    all_pids()
        .into_iter()
        .filter(|&pid| pid != me && is_alive(pid))
        .filter(|&pid| {
            process_env(pid)
                .iter()
                .any(|(k, v)| k == "CAIRN_SANDBOX_ID" && v == sandbox_id)
        })
        .collect()
}

/// The command line of a process, arguments joined by spaces.
pub fn process_cmdline(pid: u32) -> String {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| {
            c.split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// The run token a sandbox's runner holds (`CAIRN_RUN_TOKEN` in its environment).
pub fn run_token_of(sandbox_id: &str) -> Option<String> {
    sandbox_processes(sandbox_id).into_iter().find_map(|pid| {
        process_env(pid)
            .into_iter()
            .find(|(k, v)| k == "CAIRN_RUN_TOKEN" && !v.is_empty())
            .map(|(_, v)| v)
    })
}

/// The reason a checkpoint was cut.
pub fn checkpoint_reason(checkpoint: &pb::Checkpoint) -> pb::CheckpointReason {
    pb::CheckpointReason::try_from(checkpoint.reason).unwrap_or(pb::CheckpointReason::Unspecified)
}

/// A word no earlier message could have contained, for `recall` checks.
pub fn codeword(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is after 1970")
        .subsec_nanos();
    format!("{prefix}{}x{nanos}", std::process::id())
}

/// `git status --porcelain` lines of a work tree (ignoring cairn's own state dir).
pub fn git_status(dir: &Path) -> Vec<String> {
    crate::git(dir, &["status", "--porcelain", "--untracked-files=all"])
        .lines()
        .filter(|l| !l.contains(".cairn/"))
        .map(str::to_owned)
        .collect()
}
