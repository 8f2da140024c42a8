//! The fleet phase: simulated hosts heartbeat while runs are created, and
//! each run's assignment is timed from its CreateRun to the heartbeat
//! answer that hands it to a host.
//!
//! A simulated host registers with the admin token (the answer binds a
//! token to it, which it uses from then on, as `cairn-host` does), beats
//! at the interval the answer gives, starting at an offset spread
//! uniformly over one interval, and keeps every sandbox it was assigned as
//! running: each beat reports them all (level-triggered). It obeys destroy
//! orders (the sandbox is reported destroyed until forgotten) but never
//! finishes a run, so the runs must fit the fleet's slots.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use cairn_proto::pb;
use cairn_proto::pb::host_service_client::HostServiceClient;
use cairn_proto::pb::run_service_client::RunServiceClient;
use futures::StreamExt as _;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterOptions, ReplicaReport};
use crate::stats::{Errors, Latency, rate};
use crate::{AuthChannel, LoadError, auth_channel, bounded, bounded_duration, with_retries};

/// Registrations in flight at once.
const REGISTER_CONCURRENCY: usize = 32;
/// How many heartbeat intervals the phase goes on after the last run
/// reached a host, to catch a run assigned a second time.
const SETTLE_INTERVALS: u32 = 2;

/// What the fleet phase does.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    pub cluster: ClusterOptions,
    pub hosts: usize,
    pub slots: u32,
    pub runs: usize,
    /// `--heartbeat-interval` of the coordinators.
    pub heartbeat_interval: Duration,
    /// `--host-lease` of the coordinators.
    pub lease: Duration,
    /// CreateRun calls in flight at once.
    pub create_concurrency: usize,
    /// Whether each host keeps a WatchOrders stream open and heartbeats as
    /// soon as it hears of new orders, as `cairn-host` does.
    pub watch_orders: bool,
    /// The phase stops here, reporting what it had.
    pub duration_limit: Duration,
}

impl FleetOptions {
    fn validate(&self) -> Result<(), LoadError> {
        self.cluster.validate()?;
        bounded("--hosts", self.hosts as u64, 1, crate::MAX_HOSTS)?;
        bounded("--slots", u64::from(self.slots), 1, crate::MAX_SLOTS)?;
        bounded("--runs", self.runs as u64, 1, crate::MAX_RUNS)?;
        bounded(
            "--create-concurrency",
            self.create_concurrency as u64,
            1,
            crate::MAX_CONCURRENCY,
        )?;
        bounded_duration("--duration-limit", self.duration_limit)?;
        bounded_duration("--heartbeat-interval", self.heartbeat_interval)?;
        bounded_duration("--lease", self.lease)?;
        if self.heartbeat_interval >= self.lease {
            return Err(LoadError::Invalid(format!(
                "--heartbeat-interval ({:?}) must be shorter than --lease ({:?})",
                self.heartbeat_interval, self.lease
            )));
        }
        let capacity = self.hosts as u64 * u64::from(self.slots);
        if self.runs as u64 > capacity {
            return Err(LoadError::Invalid(format!(
                "--runs {} is more than the fleet's {capacity} slots (--hosts × --slots): \
                 simulated sandboxes never finish, so the rest would stay queued",
                self.runs
            )));
        }
        Ok(())
    }
}

/// What the fleet phase measured.
#[derive(Debug, Clone, Serialize)]
pub struct FleetReport {
    pub replicas: usize,
    /// The PostgreSQL schema the coordinators used, if any.
    pub database_schema: Option<crate::cluster::SchemaReport>,
    pub hosts: u64,
    pub hosts_registered: u64,
    pub slots_per_host: u32,
    /// The heartbeat interval and lease the coordinator answered with.
    pub heartbeat_interval_ms: u64,
    pub lease_ms: u64,
    /// RegisterHost calls (retried on UNAVAILABLE, counted once).
    pub register: Latency,
    pub runs_requested: u64,
    pub runs_created: u64,
    /// CreateRun calls that failed, by gRPC code.
    pub create_errors: Errors,
    /// CreateRun call latency.
    pub create: Latency,
    /// Created runs whose assignment reached a host.
    pub runs_assigned: u64,
    /// Runs handed to more than one sandbox (should be 0).
    pub runs_assigned_more_than_once: u64,
    /// Created runs no assignment reached before the phase ended.
    pub runs_unassigned: u64,
    /// Runs assigned per second, from the first CreateRun sent to the last
    /// first assignment received.
    pub assignments_per_second: f64,
    /// From a run's CreateRun sent to its assignment received by a host.
    pub create_to_assign: Latency,
    /// Heartbeat call latency (answered calls), over the whole phase.
    pub heartbeats: Latency,
    pub heartbeat_errors: Errors,
    /// Whether hosts watched for orders (`--no-watch-orders` says not).
    pub watch_orders: bool,
    /// Order notices the hosts heard, each answered by a heartbeat at once.
    pub order_notices: u64,
    /// WatchOrders streams that failed to open or broke, by gRPC code
    /// (reopened at the next heartbeat).
    pub watch_errors: Errors,
    /// Destroy orders received (none expected: no run ends).
    pub destroy_orders: u64,
    /// Heartbeat answers that said the host was lost (none expected).
    pub lost_answers: u64,
    /// Beats after which a host held more sandboxes than its slots.
    pub over_capacity: u64,
    /// Whether the duration limit cut the phase short.
    pub timed_out: bool,
    /// Wall time from the first host's registration to the hosts' stop.
    pub seconds: f64,
    /// CPU time the harness itself used (it shares the machine with the
    /// coordinators it measures).
    pub harness_cpu_seconds: Option<f64>,
    pub coordinators: Vec<ReplicaReport>,
}

/// Starts the coordinators, runs the fleet phase, stops them.
pub async fn fleet(options: FleetOptions) -> Result<FleetReport, LoadError> {
    options.validate()?;
    let serve_args = vec![
        "--heartbeat-interval".to_owned(),
        humantime::format_duration(options.heartbeat_interval).to_string(),
        "--host-lease".to_owned(),
        humantime::format_duration(options.lease).to_string(),
    ];
    let cluster = Cluster::start(&options.cluster, &serve_args).await?;
    let measured = run(&cluster, &options).await;
    let harness_cpu_seconds = crate::cluster::cpu_seconds("self");
    let (coordinators, schema) = cluster.stop().await;
    let mut report = measured?;
    report.harness_cpu_seconds = harness_cpu_seconds;
    report.database_schema = schema;
    report.coordinators = coordinators;
    Ok(report)
}

/// A run's assignment as a host received it.
#[derive(Debug)]
struct Received {
    run_id: String,
    sandbox_id: String,
    at: Instant,
}

/// The assignments hosts received: when each run first reached a host,
/// and every sandbox each run was given.
#[derive(Debug, Default)]
struct Seen {
    first: HashMap<String, Instant>,
    sandboxes: HashMap<String, HashSet<String>>,
}

impl Seen {
    fn note(&mut self, event: Received) {
        self.sandboxes
            .entry(event.run_id.clone())
            .or_default()
            .insert(event.sandbox_id);
        self.first.entry(event.run_id).or_insert(event.at);
    }
}

/// A simulated host after registration.
struct SimHost {
    id: String,
    slots: u32,
    client: HostServiceClient<AuthChannel>,
    /// Sandbox id → what the next beat reports of it.
    sandboxes: BTreeMap<String, pb::SandboxReport>,
}

/// What one host saw while it beat.
#[derive(Debug, Default)]
struct HostTally {
    latencies: Vec<Duration>,
    errors: Errors,
    notices: u64,
    watch_errors: Errors,
    destroy_orders: u64,
    lost_answers: u64,
    over_capacity: u64,
}

async fn run(cluster: &Cluster, options: &FleetOptions) -> Result<FleetReport, LoadError> {
    let started = Instant::now();
    let deadline = started + options.duration_limit;
    let mut report = FleetReport {
        replicas: cluster.replicas.len(),
        database_schema: None,
        hosts: options.hosts as u64,
        hosts_registered: 0,
        slots_per_host: options.slots,
        heartbeat_interval_ms: 0,
        lease_ms: 0,
        register: Latency::default(),
        runs_requested: options.runs as u64,
        runs_created: 0,
        create_errors: Errors::default(),
        create: Latency::default(),
        runs_assigned: 0,
        runs_assigned_more_than_once: 0,
        runs_unassigned: 0,
        assignments_per_second: 0.0,
        create_to_assign: Latency::default(),
        heartbeats: Latency::default(),
        heartbeat_errors: Errors::default(),
        watch_orders: options.watch_orders,
        order_notices: 0,
        watch_errors: Errors::default(),
        destroy_orders: 0,
        lost_answers: 0,
        over_capacity: 0,
        timed_out: false,
        seconds: 0.0,
        harness_cpu_seconds: None,
        coordinators: Vec::new(),
    };

    // Registration, spread over the replicas round-robin.
    let registering = futures::stream::iter(0..options.hosts)
        .map(|index| register(cluster, options, index))
        .buffer_unordered(REGISTER_CONCURRENCY)
        .collect::<Vec<_>>();
    let registered = match tokio::time::timeout_at(deadline, registering).await {
        Ok(registered) => registered,
        Err(_) => {
            report.timed_out = true;
            report.seconds = started.elapsed().as_secs_f64();
            return Ok(report);
        }
    };
    let mut hosts = Vec::with_capacity(options.hosts);
    let mut register_latencies = Vec::with_capacity(options.hosts);
    let mut interval = options.heartbeat_interval;
    for outcome in registered {
        let (host, took, answer) = outcome?;
        register_latencies.push(took);
        hosts.push(host);
        interval = crate::proto_duration(answer.heartbeat_interval).unwrap_or(interval);
        report.lease_ms = crate::proto_duration(answer.lease)
            .unwrap_or(options.lease)
            .as_millis() as u64;
    }
    report.heartbeat_interval_ms = interval.as_millis() as u64;
    report.hosts_registered = hosts.len() as u64;
    report.register = Latency::of(register_latencies);

    // Heartbeats, the first ones spread uniformly over one interval.
    let stop = CancellationToken::new();
    let (received, mut assignments) = mpsc::unbounded_channel::<Received>();
    let beats_from = Instant::now();
    let count = hosts.len() as u32;
    let beating: Vec<_> = hosts
        .into_iter()
        .enumerate()
        .map(|(i, host)| {
            let first = beats_from + interval.mul_f64(f64::from(i as u32) / f64::from(count));
            let watch = options.watch_orders;
            tokio::spawn(beat(
                host,
                first,
                interval,
                watch,
                stop.clone(),
                received.clone(),
            ))
        })
        .collect();
    drop(received);

    // Every host has started beating before the first run is created.
    let all_beating = beats_from + interval;
    let mut seen = Seen::default();
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(all_beating.min(deadline)) => break,
            Some(event) = assignments.recv() => seen.note(event),
        }
    }

    // Runs, created while the hosts beat.
    let mut creating = Some(tokio::spawn(create_runs(
        cluster_clients(cluster)?,
        options.runs,
        options.create_concurrency,
        deadline,
    )));
    let mut created: Option<Created> = None;
    // Created runs no host has received yet, once every creation answered.
    let mut waiting_for: Option<HashSet<String>> = None;
    // Once every created run reached a host: how long to go on beating.
    let mut settle_until: Option<Instant> = None;
    loop {
        if settle_until.is_none() && waiting_for.as_ref().is_some_and(HashSet::is_empty) {
            settle_until = Some((Instant::now() + interval * SETTLE_INTERVALS).min(deadline));
        }
        tokio::select! {
            () = tokio::time::sleep_until(settle_until.unwrap_or(deadline)) => {
                report.timed_out = settle_until.is_none();
                break;
            }
            joined = async { creating.as_mut().expect("guarded").await }, if creating.is_some() => {
                creating = None;
                let done = joined
                    .map_err(|e| LoadError::Setup(format!("creating runs failed: {e}")))?;
                waiting_for = Some(
                    done.runs
                        .iter()
                        .filter(|(id, _)| !seen.first.contains_key(id))
                        .map(|(id, _)| id.clone())
                        .collect(),
                );
                created = Some(done);
            }
            Some(event) = assignments.recv() => {
                if let Some(waiting) = waiting_for.as_mut() {
                    waiting.remove(&event.run_id);
                }
                seen.note(event);
            }
        }
    }

    stop.cancel();
    let mut heartbeat_latencies = Vec::new();
    for host in beating {
        let tally = host
            .await
            .map_err(|e| LoadError::Setup(format!("a simulated host panicked: {e}")))?;
        heartbeat_latencies.extend(tally.latencies);
        report.heartbeat_errors.merge(tally.errors);
        report.order_notices += tally.notices;
        report.watch_errors.merge(tally.watch_errors);
        report.destroy_orders += tally.destroy_orders;
        report.lost_answers += tally.lost_answers;
        report.over_capacity += tally.over_capacity;
    }
    while let Ok(event) = assignments.try_recv() {
        seen.note(event);
    }
    report.seconds = started.elapsed().as_secs_f64();
    report.heartbeats = Latency::of(heartbeat_latencies);

    // The creations end by the deadline (each call is bounded by it).
    let created = match (created, creating) {
        (Some(created), _) => created,
        (None, Some(task)) => task
            .await
            .map_err(|e| LoadError::Setup(format!("creating runs failed: {e}")))?,
        (None, None) => Created::default(),
    };
    report.runs_created = created.runs.len() as u64;
    report.create = Latency::of(created.latencies);
    report.create_errors = created.errors;
    let mut to_assign = Vec::with_capacity(created.runs.len());
    let mut last_assigned: Option<Instant> = None;
    for (run, sent) in &created.runs {
        if let Some(at) = seen.first.get(run) {
            to_assign.push(at.saturating_duration_since(*sent));
            last_assigned = Some(last_assigned.map_or(*at, |last| last.max(*at)));
        }
    }
    report.runs_assigned = to_assign.len() as u64;
    report.runs_unassigned = report.runs_created - report.runs_assigned;
    report.runs_assigned_more_than_once = seen
        .sandboxes
        .values()
        .filter(|sandboxes| sandboxes.len() > 1)
        .count() as u64;
    report.create_to_assign = Latency::of(to_assign);
    if let (Some(first), Some(last)) = (created.first_sent, last_assigned) {
        report.assignments_per_second =
            rate(report.runs_assigned, last.saturating_duration_since(first));
    }
    Ok(report)
}

/// Registers host `index` on replica `index % replicas` with the admin
/// token, then connects it with the token the answer bound to it.
async fn register(
    cluster: &Cluster,
    options: &FleetOptions,
    index: usize,
) -> Result<(SimHost, Duration, pb::RegisterHostResponse), LoadError> {
    let replicas = cluster.replicas.len();
    let replica = &cluster.replicas[index % replicas];
    let channel = replica.channel(index / replicas);
    let mut admin = HostServiceClient::new(auth_channel(channel.clone(), &replica.admin_token)?);
    let name = format!("load-host-{index}");
    let started = Instant::now();
    let answer = with_retries(&format!("registering {name}"), || {
        let mut admin = admin.clone();
        let request = pb::RegisterHostRequest {
            name: name.clone(),
            labels: HashMap::new(),
            slots: options.slots,
            driver: "local".into(),
            host_id: String::new(),
        };
        async move {
            admin
                .register_host(request)
                .await
                .map(tonic::Response::into_inner)
        }
    })
    .await?;
    let took = started.elapsed();
    let token = if answer.host_token.is_empty() {
        // Only a host's own bound token is answered with none.
        replica.admin_token.clone()
    } else {
        answer.host_token.clone()
    };
    admin = HostServiceClient::new(auth_channel(channel, &token)?);
    Ok((
        SimHost {
            id: answer.host_id.clone(),
            slots: options.slots,
            client: admin,
            sandboxes: BTreeMap::new(),
        },
        took,
        answer,
    ))
}

/// One host's heartbeats from `first` on, until `stop`: each an interval
/// after the last one answered, or at once when the host hears of new
/// orders (with `watch`, as `cairn-host` does: the stream opens with the
/// first beat, and again at the next beat after it breaks).
async fn beat(
    mut host: SimHost,
    first: Instant,
    interval: Duration,
    watch: bool,
    stop: CancellationToken,
    received: mpsc::UnboundedSender<Received>,
) -> HostTally {
    let mut tally = HostTally::default();
    let mut next = first;
    let mut orders: Option<tonic::Streaming<pb::OrdersNotice>> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return tally,
            () = tokio::time::sleep_until(next) => {}
            notice = async { orders.as_mut().expect("guarded").message().await }, if orders.is_some() => {
                match notice {
                    Ok(Some(_)) => tally.notices += 1,
                    Ok(None) => orders = None,
                    Err(status) => {
                        tally.watch_errors.record(&status);
                        orders = None;
                    }
                }
                // A broken stream waits for the next beat to reopen.
                if orders.is_none() {
                    continue;
                }
            }
        }
        if watch && orders.is_none() {
            let request = pb::WatchOrdersRequest {
                host_id: host.id.clone(),
            };
            let opened = tokio::select! {
                () = stop.cancelled() => return tally,
                opened = host.client.watch_orders(request) => opened,
            };
            match opened {
                Ok(stream) => orders = Some(stream.into_inner()),
                Err(status) => tally.watch_errors.record(&status),
            }
        }
        let request = pb::HeartbeatRequest {
            host_id: host.id.clone(),
            sandboxes: host.sandboxes.values().cloned().collect(),
            stopping: false,
            kept_workspaces: Vec::new(),
        };
        let sent = Instant::now();
        let answered = tokio::select! {
            () = stop.cancelled() => return tally,
            answered = host.client.heartbeat(request) => answered,
        };
        next = Instant::now() + interval;
        let answer = match answered {
            Ok(answer) => {
                tally.latencies.push(sent.elapsed());
                answer.into_inner()
            }
            Err(status) => {
                tally.errors.record(&status);
                continue;
            }
        };
        let at = Instant::now();
        for assignment in answer.assignments {
            if host.sandboxes.contains_key(&assignment.sandbox_id) {
                // Repeated until our report shows it: level-triggered.
                continue;
            }
            host.sandboxes.insert(
                assignment.sandbox_id.clone(),
                pb::SandboxReport {
                    sandbox_id: assignment.sandbox_id.clone(),
                    run_id: assignment.run_id.clone(),
                    attempt: assignment.attempt,
                    state: pb::SandboxState::Running as i32,
                    exit_code: 0,
                    detail: String::new(),
                },
            );
            let _ = received.send(Received {
                run_id: assignment.run_id,
                sandbox_id: assignment.sandbox_id,
                at,
            });
        }
        for order in answer.destroy {
            if let Some(sandbox) = host.sandboxes.get_mut(&order.sandbox_id)
                && sandbox.state == pb::SandboxState::Running as i32
            {
                tally.destroy_orders += 1;
                sandbox.state = pb::SandboxState::Destroyed as i32;
                sandbox.exit_code = -libc::SIGTERM;
            }
        }
        for gone in answer.forget {
            host.sandboxes.remove(&gone);
        }
        if answer.state == pb::HostState::Lost as i32 {
            tally.lost_answers += 1;
        }
        if host.sandboxes.len() > host.slots as usize {
            tally.over_capacity += 1;
        }
    }
}

/// RunService clients with the admin token: one per channel of every
/// replica, used round-robin.
fn cluster_clients(cluster: &Cluster) -> Result<Vec<RunServiceClient<AuthChannel>>, LoadError> {
    let mut clients = Vec::new();
    for replica in &cluster.replicas {
        for channel in &replica.channels {
            clients.push(RunServiceClient::new(auth_channel(
                channel.clone(),
                &replica.admin_token,
            )?));
        }
    }
    Ok(clients)
}

/// The runs created, each with when its CreateRun was sent.
#[derive(Debug, Default)]
struct Created {
    runs: Vec<(String, Instant)>,
    first_sent: Option<Instant>,
    latencies: Vec<Duration>,
    errors: Errors,
}

/// Creates `count` runs, `concurrency` calls at a time, each on a new
/// workspace with the `command` harness, until `deadline`.
async fn create_runs(
    clients: Vec<RunServiceClient<AuthChannel>>,
    count: usize,
    concurrency: usize,
    deadline: Instant,
) -> Created {
    let clients = Arc::new(clients);
    let first_sent = Instant::now();
    let mut calls = futures::stream::iter(0..count)
        .map(|k| {
            let mut client = clients[k % clients.len()].clone();
            async move {
                let sent = Instant::now();
                let answered =
                    tokio::time::timeout_at(deadline, client.create_run(run_request())).await;
                (sent, sent.elapsed(), answered)
            }
        })
        .buffer_unordered(concurrency);
    let mut created = Created {
        first_sent: Some(first_sent),
        ..Created::default()
    };
    while let Some((sent, took, answered)) = calls.next().await {
        match answered {
            Ok(Ok(run)) => {
                created.latencies.push(took);
                created.runs.push((run.into_inner().id, sent));
            }
            Ok(Err(status)) => created.errors.record(&status),
            Err(_) => created
                .errors
                .record_kind("HarnessDeadline", "cut off at the duration limit"),
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    created
}

fn run_request() -> pb::CreateRunRequest {
    pb::CreateRunRequest {
        target: Some(pb::create_run_request::Target::NewWorkspace(
            pb::NewWorkspace::default(),
        )),
        harness: Some(pb::HarnessSpec {
            name: "command".into(),
            config: [("start".to_owned(), "true".to_owned())].into(),
        }),
        prompt: "cairn-load".into(),
        ..Default::default()
    }
}
