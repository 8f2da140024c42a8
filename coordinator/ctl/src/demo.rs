//! `cairnctl demo`: the whole system on this machine, with nothing to set up
//! and no network.
//!
//! ```text
//!   cairnctl demo ─┬─ embedded coordinator (127.0.0.1:0, temp data dir, lease 3s)
//!                  ├─ cairn-host A ─┐  sandboxes: cairn-runner run ─► cairn-demo-agent
//!                  └─ cairn-host B ─┘  (real processes, --driver local)
//!
//!   run: commit, edit, untracked file, "the codeword is X", ask ─► waiting
//!        ▸ SIGKILL host A and its sandbox ─► lease expires ─► suspended
//!        ▸ answer "recall codeword" ─► queued ─► host B ─► restored
//!        ─► resumed (--resume, same session) ─► succeeded, summary names X
//! ```
//!
//! The demo follows the run's events and acts on them: it starts host B once
//! the run is placed on A (so placement is certain), kills A when the run
//! waits, and answers once it is suspended. Then it checks what the issue
//! promises ([`checks`]) and exits 0 only if all of it holds.
//!
//! Every path — success, failure, timeout, Ctrl-C, SIGTERM — ends in
//! [`Demo::shutdown`]: hosts stopped (their sandboxes with them), leftover
//! sandbox processes killed, the coordinator stopped, the directory removed
//! (unless `--keep`). The coordinator's log and the hosts' logs live in that
//! directory; their tails are printed when something goes wrong.

mod checks;
mod processes;
mod timeline;

use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use cairn_coordinator::{ServeError, ServerConfig, local_url};
use cairn_engine::client::CoordinatorClient;
use cairn_proto::pb;
use cairn_proto::runs::to_proto_duration;
use futures::StreamExt as _;
use rand::seq::IndexedRandom as _;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use self::checks::{Check, Expected};
use self::processes::{Binaries, Driver, HostProcess, HostSpec};
use self::timeline::{Sink, Timeline};
use super::output;
use super::{Output, emit, hosts, print_document, runs};

/// Short enough that losing a host shows within seconds.
const HOST_LEASE: Duration = Duration::from_secs(3);
const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(300);
/// How long the waiting sandbox would be held warm.
const HOLD: Duration = Duration::from_secs(4);
/// Time a destroyed sandbox gets to checkpoint before SIGKILL.
const GRACE: Duration = Duration::from_secs(3);
/// How long a host may take to stop after SIGTERM before it is killed.
const HOST_STOP_PATIENCE: Duration = Duration::from_secs(8);
/// How long a started host may take to show up as ready.
const HOST_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the event stream may run on after the run ended (late events).
const AFTER_END: Duration = Duration::from_secs(5);
/// Lines of each log shown when the demo fails.
const LOG_TAIL: usize = 15;

/// Words the agent is told in its first turn and asked about after resuming;
/// picked at random so it cannot be remembered from anywhere else.
const CODEWORDS: &[&str] = &[
    "KESTREL", "PELICAN", "MARMOT", "NARWHAL", "OSPREY", "QUOKKA", "TAPIR", "WOMBAT", "IBEX",
    "LYNX",
];

/// `cairnctl demo` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Directory with cairn-host, cairn-runner and cairn-demo-agent
    /// (default: the directory this cairnctl is in).
    #[arg(long, value_name = "DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Keep the demo's directory (coordinator data, host data, logs) and say where.
    #[arg(long)]
    pub keep: bool,
    /// Give up (and clean up) after this long.
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

/// The first turn: work that leaves all three kinds of change, a codeword,
/// and a question.
pub fn prompt(codeword: &str) -> String {
    format!(
        "The codeword is {codeword}. Keep it in mind: you will be asked about it later.\n\
         commit notes/plan.md Plan: make agent sandboxes disposable without losing work.\n\
         edit notes/plan.md Draft, not committed yet: resume on any host.\n\
         untracked scratch/ideas.txt An idea git does not know about.\n\
         ask The plan is committed and a draft is started. Shall I carry on?"
    )
}

/// The answer: a question only the first turn can answer.
pub const ANSWER: &str = "Yes, carry on. First remind me: what was the codeword I gave you at the start?\n\
                          recall codeword";

pub async fn run(args: DemoArgs, out: Output) -> anyhow::Result<ExitCode> {
    // Before anything is started, so no signal leaves processes behind.
    let mut stop = StopSignals::install()?;
    let bins = Binaries::find(args.bin_dir.clone())?;
    let dir = DemoDir::create(args.keep)?;
    init_logging(&dir.path().join("cairnctl.log"))?;
    let started = Instant::now();
    let mut demo = Demo::new(bins, dir.path().to_owned(), out);
    let outcome = tokio::select! {
        played = tokio::time::timeout(args.timeout, demo.play()) => match played {
            Ok(result) => result,
            Err(_) => Err(anyhow::anyhow!(
                "the demo did not finish within {}",
                humantime::format_duration(args.timeout)
            )),
        },
        signal = stop.received() => Err(anyhow::anyhow!("interrupted by {signal}; cleaning up")),
    };
    demo.shutdown().await;
    let passed = matches!(&outcome, Ok(checks) if checks.iter().all(|c| c.passed));
    if !passed {
        demo.print_logs(&dir);
    }
    demo.report(&outcome, started.elapsed())?;
    if args.keep {
        eprintln!("the demo's directory is kept: {}", dir.path().display());
    }
    drop(dir);
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// SIGINT and SIGTERM, listened for from the start.
struct StopSignals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> anyhow::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt()).context("cannot listen for Ctrl-C")?,
            terminate: signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?,
        })
    }

    async fn received(&mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "Ctrl-C",
            _ = self.terminate.recv() => "SIGTERM",
        }
    }
}

/// The demo's private directory, removed when dropped (unless kept).
#[derive(Debug)]
struct DemoDir {
    path: PathBuf,
    keep: bool,
}

impl DemoDir {
    fn create(keep: bool) -> anyhow::Result<Self> {
        let suffix: u64 = rand::random();
        let path = std::env::temp_dir().join(format!(
            "cairn-demo-{}-{:08x}",
            std::process::id(),
            suffix as u32
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path, keep })
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DemoDir {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        if let Err(e) = std::fs::remove_dir_all(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("warning: cannot remove {}: {e}", self.path.display());
        }
    }
}

/// The embedded coordinator's log goes to a file: the terminal shows the timeline.
fn init_logging(path: &Path) -> anyhow::Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(file))
        .try_init();
    Ok(())
}

/// The coordinator running inside this process.
struct Embedded {
    url: String,
    admin_token: String,
    stop: CancellationToken,
    task: JoinHandle<Result<(), ServeError>>,
}

impl Embedded {
    async fn start(data_dir: &Path) -> anyhow::Result<Self> {
        let mut config = ServerConfig::new(data_dir);
        config.host_lease = HOST_LEASE;
        config.heartbeat_interval = HEARTBEAT_INTERVAL;
        let coordinator = cairn_coordinator::Coordinator::open(config)
            .await
            .context("starting the embedded coordinator")?;
        let token_file = coordinator.data_dir().admin_token();
        let admin_token = std::fs::read_to_string(&token_file)
            .with_context(|| format!("reading {}", token_file.display()))?
            .trim()
            .to_owned();
        let grpc = TcpListener::bind("127.0.0.1:0")
            .await
            .context("listening for gRPC on 127.0.0.1")?;
        let blob = TcpListener::bind("127.0.0.1:0")
            .await
            .context("listening for blobs on 127.0.0.1")?;
        let url = local_url(
            grpc.local_addr().context("reading the gRPC address")?,
            false,
        );
        let stop = CancellationToken::new();
        let task = tokio::spawn(coordinator.run(grpc, blob, stop.clone().cancelled_owned()));
        Ok(Self {
            url,
            admin_token,
            stop,
            task,
        })
    }

    async fn shutdown(self) {
        self.stop.cancel();
        match tokio::time::timeout(Duration::from_secs(10), self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::error!(error = %e, "the embedded coordinator failed"),
            Ok(Err(e)) => tracing::error!(error = %e, "the embedded coordinator's task failed"),
            Err(_) => tracing::error!("the embedded coordinator did not stop within 10s"),
        }
    }
}

/// What the demo learnt along the way, for the checks and the summary.
#[derive(Debug, Default)]
struct Facts {
    driver: String,
    coordinator: String,
    codeword: String,
    run_id: String,
    workspace_id: String,
    /// The session id the first attempt reported, read when it waited.
    session_id: String,
    question: String,
    final_run: Option<pb::Run>,
    events: Vec<pb::RunEvent>,
}

/// Where the story is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Waiting for the run to be placed on host A.
    Placing,
    /// Host B is starting; the run works on A until it asks.
    Working,
    /// Host A was killed; waiting for the run to be suspended.
    HostKilled,
    /// Answered; waiting for the run to finish on B.
    Answered,
}

struct Demo {
    bins: Binaries,
    dir: PathBuf,
    out: Output,
    timeline: Timeline,
    coordinator: Option<Embedded>,
    /// Host A first, then host B once started.
    hosts: Vec<HostProcess>,
    facts: Facts,
}

impl Demo {
    fn new(bins: Binaries, dir: PathBuf, out: Output) -> Self {
        let sink = match out {
            Output::Table | Output::Wide => Sink::Stdout,
            Output::Json | Output::Yaml => Sink::Stderr,
        };
        Self {
            bins,
            dir,
            out,
            timeline: Timeline::new(SystemTime::now(), sink),
            coordinator: None,
            hosts: Vec::new(),
            facts: Facts::default(),
        }
    }

    /// The whole story; the checks at its end.
    async fn play(&mut self) -> anyhow::Result<Vec<Check>> {
        self.timeline
            .say("cairn demo: a coordinator, two hosts and an agent run, all on this machine\n");
        let scratch = self.dir.join("probe");
        std::fs::create_dir_all(&scratch)
            .with_context(|| format!("creating {}", scratch.display()))?;
        let bins = self.bins.clone();
        let driver = tokio::task::spawn_blocking(move || processes::choose_driver(&bins, &scratch))
            .await
            .context("the driver probe panicked")??;
        self.facts.driver = driver.describe();

        let embedded = Embedded::start(&self.dir.join("coordinator")).await?;
        let (url, token) = (embedded.url.clone(), embedded.admin_token.clone());
        self.coordinator = Some(embedded);
        self.facts.coordinator = url.clone();
        let client = CoordinatorClient::connect(&url, Some(&token)).await?;
        self.timeline.say(&output::key_values(&[
            (
                "  coordinator",
                format!(
                    "{url} (in this process; hosts are lost after {} without a heartbeat)",
                    humantime::format_duration(HOST_LEASE)
                ),
            ),
            ("  sandboxes", self.facts.driver.clone()),
            ("  agent", self.bins.agent.display().to_string()),
        ]));

        self.start_host(&driver, &url, &token, "A")?;
        self.wait_until_ready(&client, 0).await?;
        self.facts.codeword = CODEWORDS
            .choose(&mut rand::rng())
            .copied()
            .unwrap_or("KESTREL")
            .to_owned();
        let run = self.create_run(&client).await?;
        self.timeline.say(&format!(
            "{}\n\n{}\n",
            output::key_values(&[
                (
                    "  run",
                    format!("{} on new workspace {}", run.id, run.workspace_id)
                ),
                (
                    "  harness",
                    format!(
                        "claude, played by cairn-demo-agent; a waiting sandbox is held {}",
                        humantime::format_duration(HOLD)
                    )
                ),
            ]),
            indent("  prompt  ", &run.prompt),
        ));
        self.follow(&client, &driver, &url, &token).await?;

        let final_run = get_run(&client, &self.facts.run_id).await?;
        let (lost, other) = (self.host_id(0), self.host_id(1));
        let checks = checks::check(
            &final_run,
            &self.facts.events,
            &Expected {
                lost_host: (&lost, "A"),
                other_host: (&other, "B"),
                session_id: &self.facts.session_id,
                codeword: &self.facts.codeword,
            },
        );
        self.facts.final_run = Some(final_run);
        Ok(checks)
    }

    fn host_id(&self, index: usize) -> String {
        self.hosts
            .get(index)
            .and_then(|h| h.host_id.clone())
            .unwrap_or_default()
    }

    fn start_host(
        &mut self,
        driver: &Driver,
        url: &str,
        token: &str,
        role: &'static str,
    ) -> anyhow::Result<()> {
        let letter = role.to_lowercase();
        let spec = HostSpec {
            role,
            name: format!("demo-{letter}"),
            labels: format!("demo=yes,host={letter}"),
            data_dir: self.dir.join(format!("host-{letter}")),
            log: self.dir.join(format!("host-{letter}.log")),
        };
        let host = processes::spawn_host(&self.bins, driver, url, token, GRACE, spec)?;
        self.timeline.act(&format!(
            "host {role} started: cairn-host pid {}, name {}, labels {}, 1 slot",
            host.pid, host.spec.name, host.spec.labels
        ));
        self.hosts.push(host);
        Ok(())
    }

    /// Waits until host `index` is listed READY, and learns its id.
    async fn wait_until_ready(
        &mut self,
        client: &CoordinatorClient,
        index: usize,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + HOST_READY_TIMEOUT;
        loop {
            self.check_hosts_alive()?;
            if self.learn_host_ids(client).await? {
                let host = &self.hosts[index];
                if let Some(id) = &host.host_id {
                    self.timeline
                        .act(&format!("host {} registered as {id}", host.spec.role));
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "host {} did not register within {}",
                    self.hosts[index].spec.role,
                    humantime::format_duration(HOST_READY_TIMEOUT)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Reads the host list and names the demo's hosts in the timeline;
    /// whether anything new was learnt.
    async fn learn_host_ids(&mut self, client: &CoordinatorClient) -> anyhow::Result<bool> {
        let listed = hosts::client(client)
            .list_hosts(pb::ListHostsRequest {})
            .await
            .map_err(super::rpc_error("listing hosts"))?
            .into_inner()
            .hosts;
        let mut learnt = false;
        for host in &mut self.hosts {
            if host.host_id.is_some() {
                continue;
            }
            if let Some(listed) = listed
                .iter()
                .find(|h| h.name == host.spec.name && h.state == pb::HostState::Ready as i32)
            {
                host.host_id = Some(listed.id.clone());
                self.timeline.name_host(&listed.id, host.spec.role);
                learnt = true;
            }
        }
        Ok(learnt)
    }

    /// A host that exits on its own ends the demo, with its log.
    fn check_hosts_alive(&mut self) -> anyhow::Result<()> {
        for host in &mut self.hosts {
            if host.killed {
                continue;
            }
            host.note_sandboxes();
            if let Some(status) = host.exited() {
                anyhow::bail!(
                    "host {} (cairn-host pid {}) exited by itself ({status}); its log ends:\n{}",
                    host.spec.role,
                    host.pid,
                    host.log_tail(LOG_TAIL)
                );
            }
        }
        Ok(())
    }

    async fn create_run(&mut self, client: &CoordinatorClient) -> anyhow::Result<pb::Run> {
        let request = pb::CreateRunRequest {
            target: Some(pb::create_run_request::Target::NewWorkspace(
                pb::NewWorkspace {
                    name: "demo".into(),
                },
            )),
            station: String::new(),
            harness: Some(pb::HarnessSpec {
                name: "claude".into(),
                config: [("binary".to_owned(), self.bins.agent.display().to_string())]
                    .into_iter()
                    .collect(),
            }),
            prompt: prompt(&self.facts.codeword),
            labels: [("demo".to_owned(), "yes".to_owned())]
                .into_iter()
                .collect(),
            hold: Some(to_proto_duration(HOLD)),
            max_attempts: 3,
            repos: Vec::new(),
            image: String::new(),
            checkpoint_interval: None,
            checkpoint_limits: None,
            lay: Default::default(),
        };
        let run = runs::client(client)
            .create_run(request)
            .await
            .map_err(super::rpc_error("creating the demo run"))?
            .into_inner();
        self.facts.run_id = run.id.clone();
        self.facts.workspace_id = run.workspace_id.clone();
        Ok(run)
    }

    /// Follows the run's events to its end, acting at each turn of the story.
    async fn follow(
        &mut self,
        client: &CoordinatorClient,
        driver: &Driver,
        url: &str,
        token: &str,
    ) -> anyhow::Result<()> {
        let mut stage = Stage::Placing;
        let mut after_sequence = 0;
        let mut reconnects = 0;
        let mut ended_at: Option<Instant> = None;
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        'watch: loop {
            let mut stream = runs::client(client)
                .watch_run_events(pb::WatchRunEventsRequest {
                    run_id: self.facts.run_id.clone(),
                    after_sequence,
                    follow: true,
                })
                .await
                .map_err(super::rpc_error("watching the run"))?
                .into_inner();
            loop {
                let next = tokio::select! {
                    next = stream.next() => next,
                    _ = tick.tick() => {
                        self.check_hosts_alive()?;
                        if ended_at.is_some_and(|t| t.elapsed() > AFTER_END) {
                            return Ok(());
                        }
                        continue;
                    }
                };
                let event = match next {
                    None => return Ok(()),
                    Some(Ok(event)) => event,
                    Some(Err(status))
                        if status.code() == tonic::Code::Unavailable && reconnects < 3 =>
                    {
                        reconnects += 1;
                        continue 'watch;
                    }
                    Some(Err(status)) => {
                        return Err(super::rpc_error("watching the run")(status));
                    }
                };
                after_sequence = event.sequence;
                self.show_event(client, &event).await?;
                self.facts.events.push(event.clone());
                let state =
                    pb::RunState::try_from(event.state).unwrap_or(pb::RunState::Unspecified);
                if matches!(
                    state,
                    pb::RunState::Succeeded | pb::RunState::Failed | pb::RunState::Cancelled
                ) {
                    ended_at.get_or_insert_with(Instant::now);
                    continue;
                }
                stage = self
                    .advance(client, driver, url, token, stage, &event, state)
                    .await?;
            }
        }
    }

    /// Acts on `event` if it is the one the story waits for.
    #[allow(clippy::too_many_arguments)]
    async fn advance(
        &mut self,
        client: &CoordinatorClient,
        driver: &Driver,
        url: &str,
        token: &str,
        stage: Stage,
        event: &pb::RunEvent,
        state: pb::RunState,
    ) -> anyhow::Result<Stage> {
        match stage {
            Stage::Placing if event.attempt == 1 && !event.host_id.is_empty() => {
                self.start_host(driver, url, token, "B")?;
                Ok(Stage::Working)
            }
            Stage::Working if state == pb::RunState::Waiting => {
                let run = get_run(client, &self.facts.run_id).await?;
                self.facts.session_id = run.harness_session_id.clone();
                self.facts.question = run.question.clone();
                self.timeline.act(&format!(
                    "the agent asks {:?} in conversation {}",
                    run.question,
                    output::or_dash(&run.harness_session_id)
                ));
                let host = &mut self.hosts[0];
                let killed = host.kill_hard().await;
                self.timeline.act(&format!(
                    "host A lost: SIGKILL to cairn-host (pid {}) and {killed} sandbox process{} — nothing gets to checkpoint or report",
                    host.pid,
                    if killed == 1 { "" } else { "es" }
                ));
                Ok(Stage::HostKilled)
            }
            Stage::HostKilled if state == pb::RunState::Suspended => {
                self.timeline.act(&format!(
                    "answering: {:?}",
                    ANSWER.lines().collect::<Vec<_>>().join(" / ")
                ));
                runs::client(client)
                    .answer_run(pb::AnswerRunRequest {
                        run_id: self.facts.run_id.clone(),
                        text: ANSWER.to_owned(),
                    })
                    .await
                    .map_err(super::rpc_error("answering the run"))?;
                Ok(Stage::Answered)
            }
            _ => Ok(stage),
        }
    }

    async fn show_event(
        &mut self,
        client: &CoordinatorClient,
        event: &pb::RunEvent,
    ) -> anyhow::Result<()> {
        if !self.timeline.knows_host(&event.host_id) {
            self.learn_host_ids(client).await?;
        }
        let checkpoint = if event.checkpoint_id.is_empty() {
            None
        } else {
            let mut checkpoints = client.checkpoints.clone();
            match checkpoints
                .get_checkpoint(pb::GetCheckpointRequest {
                    checkpoint_id: event.checkpoint_id.clone(),
                })
                .await
            {
                Ok(c) => Some(c.into_inner()),
                Err(status) => {
                    tracing::warn!(checkpoint = %event.checkpoint_id, %status, "cannot read the checkpoint");
                    None
                }
            }
        };
        self.timeline.event(event, checkpoint.as_ref());
        Ok(())
    }

    /// Stops every host (gently unless already killed), kills what they
    /// left, stops the coordinator.
    async fn shutdown(&mut self) {
        for host in &mut self.hosts {
            host.stop(HOST_STOP_PATIENCE).await;
        }
        if let Some(coordinator) = self.coordinator.take() {
            coordinator.shutdown().await;
        }
    }

    /// The tails of the logs, on stderr, when the demo failed.
    fn print_logs(&self, dir: &DemoDir) {
        let mut logs: Vec<(String, PathBuf)> = self
            .hosts
            .iter()
            .map(|h| (format!("host {}", h.spec.role), h.spec.log.clone()))
            .collect();
        logs.push(("coordinator".into(), dir.path().join("cairnctl.log")));
        for (what, path) in logs {
            let tail = processes::tail(&path, LOG_TAIL);
            if !tail.trim().is_empty() {
                eprintln!(
                    "--- last lines of the {what} log ({}):\n{tail}",
                    path.display()
                );
            }
        }
    }

    fn report(&self, outcome: &anyhow::Result<Vec<Check>>, took: Duration) -> anyhow::Result<()> {
        let checks: &[Check] = outcome.as_ref().map(Vec::as_slice).unwrap_or(&[]);
        let passed = outcome.is_ok() && checks.iter().all(|c| c.passed);
        match self.out {
            Output::Json | Output::Yaml => {
                print_document(self.out, &self.summary_json(outcome, passed, took))
            }
            Output::Table | Output::Wide => {
                let mut text = String::new();
                if !checks.is_empty() {
                    text.push_str("\nchecks\n");
                    for c in checks {
                        let mark = if c.passed { "✓" } else { "✗" };
                        text.push_str(&format!("  {mark} {}\n      {}\n", c.name, c.detail));
                    }
                }
                if let Err(e) = outcome {
                    eprintln!("error: {}", cairn_utils::text::one_line(e.as_ref()));
                }
                let verdict = if passed { "passed" } else { "FAILED" };
                text.push_str(&format!("\ndemo {verdict} in {:.1}s", took.as_secs_f64()));
                emit(&text)
            }
        }
    }

    fn summary_json(
        &self,
        outcome: &anyhow::Result<Vec<Check>>,
        passed: bool,
        took: Duration,
    ) -> Value {
        let checks: Vec<Value> = match outcome {
            Ok(checks) => checks.iter().map(Check::to_json).collect(),
            Err(_) => Vec::new(),
        };
        let hosts: Vec<Value> = self
            .hosts
            .iter()
            .map(|h| {
                json!({
                    "role": h.spec.role,
                    "name": h.spec.name,
                    "id": h.host_id,
                    "pid": h.pid,
                    "labels": h.spec.labels,
                    "killed": h.killed,
                })
            })
            .collect();
        json!({
            "passed": passed,
            "error": outcome.as_ref().err().map(|e| cairn_utils::text::one_line(e.as_ref())),
            "duration_ms": took.as_millis() as u64,
            "coordinator": self.facts.coordinator,
            "driver": self.facts.driver,
            "run_id": self.facts.run_id,
            "workspace_id": self.facts.workspace_id,
            "codeword": self.facts.codeword,
            "question": self.facts.question,
            "session_id": self.facts.session_id,
            "summary": self.facts.final_run.as_ref().map(|r| r.summary.clone()),
            "hosts": hosts,
            "checks": checks,
            "timeline": self.timeline.to_json(),
            "run": self.facts.final_run.as_ref().map(output::run_json),
        })
    }
}

async fn get_run(client: &CoordinatorClient, run_id: &str) -> anyhow::Result<pb::Run> {
    Ok(runs::client(client)
        .get_run(pb::GetRunRequest {
            run_id: run_id.to_owned(),
        })
        .await
        .map_err(super::rpc_error("reading the run"))?
        .into_inner())
}

/// `label` before the first line, the rest indented to match.
fn indent(label: &str, text: &str) -> String {
    let pad = " ".repeat(label.chars().count());
    text.lines()
        .enumerate()
        .map(|(i, line)| {
            if i == 0 {
                format!("{label}{line}")
            } else {
                format!("{pad}{line}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_commits_edits_leaves_a_file_and_asks_after_the_codeword() {
        let prompt = prompt("IBEX");
        let lines: Vec<&str> = prompt.lines().collect();
        assert!(lines[0].contains("codeword is IBEX"), "{prompt}");
        let directives: Vec<&str> = lines[1..]
            .iter()
            .map(|l| l.split_whitespace().next().unwrap())
            .collect();
        assert_eq!(directives, ["commit", "edit", "untracked", "ask"]);
        assert!(!ANSWER.contains("IBEX"));
        assert_eq!(ANSWER.lines().last(), Some("recall codeword"));
    }

    #[test]
    fn the_demo_command_parses_its_flags() {
        use clap::Parser as _;
        let cli = super::super::Cli::try_parse_from([
            "cairnctl",
            "--output",
            "json",
            "demo",
            "--keep",
            "--timeout",
            "90s",
        ])
        .unwrap();
        assert_eq!(cli.output, Output::Json);
        match cli.command {
            super::super::Command::Demo(args) => {
                assert!(args.keep);
                assert_eq!(args.timeout, Duration::from_secs(90));
                assert_eq!(args.bin_dir, None);
            }
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn the_demo_directory_goes_away_unless_kept() {
        let dir = DemoDir::create(false).unwrap();
        let path = dir.path().to_owned();
        std::fs::write(path.join("file"), b"x").unwrap();
        drop(dir);
        assert!(!path.exists());

        let dir = DemoDir::create(true).unwrap();
        let path = dir.path().to_owned();
        drop(dir);
        assert!(path.is_dir());
        std::fs::remove_dir_all(path).unwrap();
    }
}
