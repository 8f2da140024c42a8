//! The coordinators under load: `cairn-coordinator serve` processes started
//! here on loopback, each with a data directory of its own (its log is
//! `DATA_DIR/coordinator.log`), and a small pool of gRPC channels to each.
//!
//! Every process is started in a process group of its own, so a Ctrl-C in
//! the terminal reaches only the harness; the harness then stops them
//! (SIGTERM, a bounded wait, SIGKILL), on success, on error, and when its
//! future is dropped.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::LoadError;
use crate::stats::Served;

/// How long a coordinator may take to bind, write its endpoints and serve.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a coordinator may take to exit after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// How many warning and error lines of each log the report quotes.
const LOG_LINES_QUOTED: usize = 5;

/// Where the coordinators come from and how they are started.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// The `cairn-coordinator` binary.
    pub coordinator_bin: PathBuf,
    /// `--database` for every replica (None: SQLite in each data dir).
    pub database: Option<String>,
    /// `--database-schema`. None with a `postgres://` database: a fresh
    /// schema per invocation, so runs and hosts of an earlier invocation do
    /// not take part.
    pub database_schema: Option<String>,
    /// Coordinator processes on the one database (more than one needs
    /// `database`).
    pub replicas: usize,
    /// gRPC channels (HTTP/2 connections) the harness opens to each replica.
    pub channels_per_replica: usize,
    /// Keep the data directories (and logs) after the run.
    pub keep_data: bool,
}

impl ClusterOptions {
    /// `coordinator_bin` with defaults: one replica on SQLite, 8 channels.
    pub fn new(coordinator_bin: impl Into<PathBuf>) -> Self {
        Self {
            coordinator_bin: coordinator_bin.into(),
            database: None,
            database_schema: None,
            replicas: 1,
            channels_per_replica: 8,
            keep_data: false,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), LoadError> {
        crate::bounded("--replicas", self.replicas as u64, 1, crate::MAX_REPLICAS)?;
        crate::bounded(
            "--channels",
            self.channels_per_replica as u64,
            1,
            crate::MAX_CHANNELS,
        )?;
        if self.replicas > 1 && self.database.is_none() {
            return Err(LoadError::Invalid(
                "--replicas above 1 needs --database (a database the replicas share)".into(),
            ));
        }
        if !self.coordinator_bin.is_file() {
            return Err(LoadError::Invalid(format!(
                "{} is not a file (build it: cargo build -p cairn-coordinator, or pass --coordinator-bin)",
                self.coordinator_bin.display()
            )));
        }
        Ok(())
    }
}

/// What became of one coordinator process, for the report.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaReport {
    pub grpc_url: String,
    /// Kept data directory (with `coordinator.log`); None when removed.
    pub data_dir: Option<PathBuf>,
    /// Whether it was still serving when the harness stopped it.
    pub alive_at_end: bool,
    /// How it exited (`exited with status 0`, `was killed by signal 9`).
    pub exit: String,
    /// CPU time (user and system) the process had used when it was
    /// stopped, start-up included.
    pub cpu_seconds: Option<f64>,
    pub log_warnings: u64,
    pub log_errors: u64,
    /// The first warning and error lines of its log.
    pub log_excerpt: Vec<String>,
    /// Heartbeats and commits as the coordinator timed them, from its
    /// `/metrics` just before it was stopped: without the harness's share
    /// of the machine and the connection (None: none answered).
    pub served_heartbeats: Option<Served>,
    pub served_commits: Option<Served>,
    /// Why `/metrics` could not be read, when it could not.
    pub metrics_error: Option<String>,
}

/// The PostgreSQL schema a run used, and what became of it.
#[derive(Debug, Clone, Serialize)]
pub struct SchemaReport {
    pub name: String,
    /// Whether the harness dropped it at the end (only a schema it made,
    /// and not with `--keep-data`).
    pub dropped: bool,
    /// Why it is still there, when it is.
    pub left_because: Option<String>,
}

/// One running coordinator.
#[derive(Debug)]
pub(crate) struct Replica {
    pub grpc_url: String,
    /// Its `/metrics` (the harness serves them on an ephemeral port).
    pub metrics_url: Option<String>,
    pub admin_token: String,
    pub channels: Vec<Channel>,
    child: Option<Child>,
    dir: Option<tempfile::TempDir>,
    data_dir: PathBuf,
}

impl Replica {
    fn log_path(&self) -> PathBuf {
        self.data_dir.join("coordinator.log")
    }

    /// The channel for the `k`-th client of this replica (round-robin).
    pub fn channel(&self, k: usize) -> Channel {
        self.channels[k % self.channels.len()].clone()
    }
}

/// The coordinators of one harness run.
#[derive(Debug)]
pub(crate) struct Cluster {
    pub replicas: Vec<Replica>,
    keep_data: bool,
    /// The `--database-schema` the replicas were given, if any.
    schema: Option<String>,
    /// The database, and whether the harness made the schema (and so
    /// drops it at the end).
    database: Option<String>,
    own_schema: bool,
}

impl Cluster {
    /// Starts `options.replicas` coordinators one after the other (the
    /// first creates the schema), each with `serve_args` as well, and
    /// connects to each.
    pub async fn start(options: &ClusterOptions, serve_args: &[String]) -> Result<Self, LoadError> {
        options.validate()?;
        // Uploads and scrapes go through reqwest with rustls (plain HTTP
        // here, but its clients are built with a provider).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let schema = match (&options.database, &options.database_schema) {
            (Some(_), Some(schema)) => Some(schema.clone()),
            (Some(url), None)
                if url.starts_with("postgres://") || url.starts_with("postgresql://") =>
            {
                let secs = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or_default();
                Some(format!("cairn_load_{secs}_{}", std::process::id()))
            }
            _ => None,
        };
        let mut cluster = Self {
            replicas: Vec::with_capacity(options.replicas),
            keep_data: options.keep_data,
            own_schema: schema.is_some() && options.database_schema.is_none(),
            schema,
            database: options.database.clone(),
        };
        for index in 0..options.replicas {
            let replica = cluster.spawn(options, serve_args, index)?;
            cluster.replicas.push(replica);
            let replica = cluster.replicas.last_mut().expect("just pushed");
            wait_until_serving(replica, options.channels_per_replica).await?;
        }
        Ok(cluster)
    }

    fn spawn(
        &self,
        options: &ClusterOptions,
        serve_args: &[String],
        index: usize,
    ) -> Result<Replica, LoadError> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("cairn-load-{index}-"))
            .tempdir()
            .map_err(|e| LoadError::Io("creating a data directory".into(), e))?;
        let data_dir = dir.path().to_owned();
        let log_path = data_dir.join("coordinator.log");
        let log = File::create(&log_path)
            .map_err(|e| LoadError::Io(format!("creating {}", log_path.display()), e))?;
        let log_err = log
            .try_clone()
            .map_err(|e| LoadError::Io(format!("opening {}", log_path.display()), e))?;
        let mut command = Command::new(&options.coordinator_bin);
        command
            .arg("serve")
            .arg("--data-dir")
            .arg(&data_dir)
            .args(["--listen", "127.0.0.1:0", "--blob-listen", "127.0.0.1:0"])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .args(serve_args)
            // Only what the harness says: no database, data dir or
            // failpoints from the caller's environment.
            .env_remove("CAIRN_DATABASE")
            .env_remove("CAIRN_DATA_DIR")
            .env_remove("CAIRN_FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0);
        if let Some(database) = &options.database {
            command.arg("--database").arg(database);
        }
        if let Some(schema) = &self.schema {
            command.arg("--database-schema").arg(schema);
        }
        let child = command.spawn().map_err(|e| {
            LoadError::Io(format!("starting {}", options.coordinator_bin.display()), e)
        })?;
        Ok(Replica {
            grpc_url: String::new(),
            metrics_url: None,
            admin_token: String::new(),
            channels: Vec::new(),
            child: Some(child),
            dir: Some(dir),
            data_dir,
        })
    }

    /// Stops every coordinator (SIGTERM, then SIGKILL after a bounded
    /// wait) and says how each ended; removes the data directories and
    /// drops the schema the harness made unless they are kept.
    pub async fn stop(mut self) -> (Vec<ReplicaReport>, Option<SchemaReport>) {
        let mut reports = Vec::with_capacity(self.replicas.len());
        for replica in &mut self.replicas {
            replica.channels.clear();
            let scraped = match &replica.metrics_url {
                Some(url) => scrape(url).await,
                None => Err("the coordinator wrote no metrics URL".into()),
            };
            let (served_heartbeats, served_commits, metrics_error) = match scraped {
                Ok(text) => (
                    Served::of(&text, "cairn_heartbeat_duration_seconds"),
                    Served::of(&text, "cairn_checkpoint_commit_duration_seconds"),
                    None,
                ),
                Err(why) => (None, None, Some(why)),
            };
            let (alive_at_end, cpu_seconds, exit) = match replica.child.take() {
                Some(mut child) => {
                    let alive = matches!(child.try_wait(), Ok(None));
                    let cpu = alive
                        .then(|| cpu_seconds(&child.id().to_string()))
                        .flatten();
                    let status = terminate(&mut child).await;
                    (alive, cpu, status)
                }
                None => (false, None, "not started".into()),
            };
            let (log_warnings, log_errors, log_excerpt) = scan_log(&replica.log_path());
            let data_dir = if self.keep_data {
                replica.dir.take().map(tempfile::TempDir::keep)
            } else {
                None
            };
            reports.push(ReplicaReport {
                grpc_url: replica.grpc_url.clone(),
                data_dir,
                alive_at_end,
                exit,
                cpu_seconds,
                log_warnings,
                log_errors,
                log_excerpt,
                served_heartbeats,
                served_commits,
                metrics_error,
            });
        }
        let schema = match self.schema.take() {
            Some(name) => Some(self.drop_schema(name).await),
            None => None,
        };
        (reports, schema)
    }

    async fn drop_schema(&self, name: String) -> SchemaReport {
        let left = |why: String| SchemaReport {
            name: name.clone(),
            dropped: false,
            left_because: Some(why),
        };
        if !self.own_schema {
            return left("given with --database-schema".into());
        }
        if self.keep_data {
            return left("--keep-data".into());
        }
        let Some(url) = &self.database else {
            return left("no database".into());
        };
        match drop_postgres_schema(url, &name).await {
            Ok(()) => SchemaReport {
                name,
                dropped: true,
                left_because: None,
            },
            Err(e) => left(format!("dropping it failed: {e}")),
        }
    }
}

/// Drops schema `name` (one the harness named: letters, digits and `_`)
/// and everything in it.
async fn drop_postgres_schema(url: &str, name: &str) -> Result<(), sqlx::Error> {
    use sqlx::Connection as _;
    debug_assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    let mut conn = sqlx::postgres::PgConnection::connect(url).await?;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
        .execute(&mut conn)
        .await?;
    conn.close().await
}

impl Drop for Replica {
    fn drop(&mut self) {
        // Only when the harness did not stop it: an error or a dropped future.
        if let Some(mut child) = self.child.take() {
            signal(&child, libc::SIGTERM);
            let deadline = Instant::now() + STOP_TIMEOUT;
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if matches!(child.try_wait(), Ok(None)) {
                signal(&child, libc::SIGKILL);
                let _ = child.wait();
            }
        }
    }
}

/// Sends `sig` to the coordinator's process group (its own: see `spawn`).
fn signal(child: &Child, sig: libc::c_int) {
    if let Ok(pid) = i32::try_from(child.id()) {
        cairn_utils::process::signal_group(pid, sig);
    }
}

/// How long a scrape of `/metrics` may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

/// The text of a replica's `/metrics`.
async fn scrape(url: &str) -> Result<String, String> {
    let client = reqwest::Client::builder()
        .timeout(SCRAPE_TIMEOUT)
        .build()
        .map_err(|e| format!("building an HTTP client: {e}"))?;
    let response = client
        .get(url)
        .send()
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    let status = response.status();
    if !status.is_success() {
        return Err(format!("GET {url}: {status}"));
    }
    response
        .text()
        .await
        .map_err(|e| format!("reading {url}: {e}"))
}

/// SIGTERM, a bounded wait, SIGKILL; how it exited.
async fn terminate(child: &mut Child) -> String {
    if matches!(child.try_wait(), Ok(None)) {
        signal(child, libc::SIGTERM);
    }
    let deadline = Instant::now() + STOP_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return cairn_utils::process::describe_status(status),
            Ok(None) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(None) => {
                signal(child, libc::SIGKILL);
                return match child.wait() {
                    Ok(status) => format!(
                        "did not stop within {STOP_TIMEOUT:?} of SIGTERM; {}",
                        cairn_utils::process::describe_status(status)
                    ),
                    Err(e) => format!("could not be waited for: {e}"),
                };
            }
            Err(e) => return format!("could not be waited for: {e}"),
        }
    }
}

/// Waits for the replica's endpoints and admin token, connects its
/// channels and waits for its health check to answer.
async fn wait_until_serving(replica: &mut Replica, channels: usize) -> Result<(), LoadError> {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    let endpoints_path = replica.data_dir.join("endpoints.json");
    let token_path = replica.data_dir.join("admin.token");
    let not_ready = |replica: &Replica, why: String| LoadError::Startup {
        why,
        log_tail: log_tail(&replica.log_path()),
    };
    loop {
        if let Some(child) = replica.child.as_mut()
            && let Ok(Some(status)) = child.try_wait()
        {
            replica.child = None;
            return Err(not_ready(
                replica,
                format!(
                    "cairn-coordinator {} before it was ready",
                    cairn_utils::process::describe_status(status)
                ),
            ));
        }
        if let (Ok(endpoints), Ok(token)) = (
            std::fs::read_to_string(&endpoints_path),
            std::fs::read_to_string(&token_path),
        ) && let Ok(json) = serde_json::from_str::<serde_json::Value>(&endpoints)
            && let Some(grpc) = json.get("grpc").and_then(|v| v.as_str())
        {
            replica.grpc_url = grpc.to_owned();
            replica.metrics_url = json
                .get("metrics")
                .and_then(|v| v.as_str())
                .map(str::to_owned);
            replica.admin_token = token.trim().to_owned();
            break;
        }
        if Instant::now() > deadline {
            return Err(not_ready(
                replica,
                format!("no endpoints.json and admin.token within {STARTUP_TIMEOUT:?}"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let endpoint = Endpoint::from_shared(replica.grpc_url.clone())
        .map_err(|e| not_ready(replica, format!("bad gRPC URL {}: {e}", replica.grpc_url)))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        .http2_keep_alive_interval(Duration::from_secs(30));
    while replica.channels.len() < channels {
        match endpoint.connect().await {
            Ok(channel) => replica.channels.push(channel),
            Err(e) if Instant::now() > deadline => {
                return Err(not_ready(
                    replica,
                    format!("cannot connect to {}: {e}", replica.grpc_url),
                ));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let mut health = HealthClient::new(replica.channel(0));
    loop {
        let asked = health
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await;
        match asked {
            Ok(_) => return Ok(()),
            Err(status) if Instant::now() > deadline => {
                return Err(not_ready(
                    replica,
                    format!("its health check did not answer: {status}"),
                ));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// CPU time (user and system) process `pid` (or `self`) has used, from
/// `/proc/PID/stat`.
pub(crate) fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state is
    // field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf takes no pointers.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (ticks > 0).then(|| (utime + stime) as f64 / ticks as f64)
}

/// The level word of a tracing text line (`2025-…Z  WARN target: …`).
fn level(line: &str) -> Option<&str> {
    line.split_whitespace()
        .nth(1)
        .filter(|w| matches!(*w, "WARN" | "ERROR"))
}

/// Warning and error lines of a log: counts and the first few.
fn scan_log(path: &Path) -> (u64, u64, Vec<String>) {
    let Ok(file) = File::open(path) else {
        return (0, 0, Vec::new());
    };
    let (mut warnings, mut errors, mut excerpt) = (0, 0, Vec::new());
    for line in BufReader::new(file).lines().map_while(Result::ok) {
        match level(&line) {
            Some("WARN") => warnings += 1,
            Some(_) => errors += 1,
            None => continue,
        }
        if excerpt.len() < LOG_LINES_QUOTED {
            excerpt.push(line.chars().take(400).collect());
        }
    }
    (warnings, errors, excerpt)
}

/// The last lines of a log, for errors.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_warning_and_error_lines_have_a_level() {
        let at = "2025-01-01T00:00:00.000000Z";
        assert_eq!(level(&format!("{at}  WARN cairn: slow")), Some("WARN"));
        assert_eq!(level(&format!("{at} ERROR cairn: broke")), Some("ERROR"));
        assert_eq!(level(&format!("{at}  INFO cairn: WARN in text")), None);
        assert_eq!(level("admin token written to /x"), None);
    }

    #[test]
    fn this_process_has_used_some_cpu() {
        let spent = cpu_seconds("self").expect("/proc/self/stat reads");
        assert!(spent >= 0.0);
    }
}
