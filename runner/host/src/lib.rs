//! The host agent (`cairn-host`): registers a machine's labels and slots with
//! the coordinator, starts a sandbox with `cairn-runner run` inside for every
//! attempt it is assigned, and destroys sandboxes — always with SIGTERM and a
//! grace period first, so the runner can checkpoint.
//!
//! ```text
//!   coordinator ◄── RegisterHost(name, labels, slots, driver, old host id)
//!        │      ◄── Heartbeat(every sandbox: state, exit status)  every interval,
//!        │                                 at once when a sandbox changes, and
//!        │                                 at once on a WatchOrders notice;
//!        │                 also the workspaces whose tree DIR/kept holds
//!        └──► assignments · destroy orders · forget · host state (LOST?)
//!   coordinator ──► WatchOrders: a notice when there are new orders (held open)
//!
//!   assignment ─► DIR/sandboxes/<id>/{workspace,home,cache} ─► driver.start
//!                  (local: mount namespace, workspace at /workspace; exec: templates)
//!                  every runner gets the host's pack cache (CAIRN_PACK_CACHE,
//!                  default DIR/pack-cache), shared by all the host's restores;
//!                  a tree kept from an earlier sandbox of the same workspace
//!                  is moved into workspace/ and cache/ first (kept.rs)
//!   runner exits by itself ──────────────┐
//!   destroy order / host stop ─► SIGTERM ─► grace ─► SIGKILL ─► keep tree? ─► remove dir ─► report
//! ```
//!
//! Heartbeats are level-triggered both ways: the host reports every sandbox it
//! knows until the coordinator says to forget it, and the coordinator repeats
//! assignments and destroy orders until the reports show them carried out. A
//! lost answer is therefore just repeated by the next exchange; the agent
//! keeps no pending queue of its own.
//!
//! The coordinator being unreachable changes nothing locally: sandboxes keep
//! running and heartbeats are retried with backoff (capped well below the
//! lease). If the coordinator answers that this host is LOST (it missed the
//! lease and its attempts went elsewhere), every sandbox is destroyed with
//! reason `superseded` and the host registers again under the same id.
//!
//! SIGTERM/SIGINT stop the agent: no new assignments, every sandbox destroyed
//! in parallel through the same path, one last heartbeat, exit 0.
//!
//! Code map:
//! - [`cli`]: the `cairn-host` command line.
//! - [`agent`]: registration, heartbeats, assignments, orders, restart recovery.
//! - `orders`: the WatchOrders stream that makes the agent heartbeat as
//!   soon as the coordinator has orders for it.
//! - [`sandbox`]: one sandbox's task: wait for it, destroy it, remove it, report.
//! - [`driver`]: the driver traits; [`local`] and [`exec`] implement them.
//! - [`process`]: process sessions: start, SIGTERM/grace/SIGKILL, sweeping.
//! - [`template`]: the exec driver's command templates.
//! - [`layout`]: the data directory (host id, sandbox dirs, records, logs).
//! - [`kept`]: workspace trees kept for the next sandbox of their workspace.
//! - [`metrics`]: Prometheus metrics on `--metrics-listen`: sandboxes, kept
//!   trees, exchanges, and what runners report of their restores and
//!   checkpoints.

pub mod agent;
pub mod cli;
pub mod driver;
pub mod exec;
pub mod kept;
pub mod layout;
pub mod local;
pub mod metrics;
mod orders;
pub mod process;
pub mod sandbox;
pub mod template;

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use cairn_proto::runs::Labels;
use tokio::net::TcpListener;

use cairn_engine::restore::PackCacheConfig;
use cairn_engine::tls::ClientTls;

pub use self::exec::{ExecDriver, ExecDriverError, ExecTemplates};
pub use self::kept::{KeptConfig, KeptWorkspaces};
pub use self::local::{LocalDriver, LocalDriverError, NamespaceMode};

/// The default grace period between SIGTERM and SIGKILL.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(30);

/// Which driver runs the sandboxes.
#[derive(Debug, Clone)]
pub enum DriverConfig {
    Local,
    Exec(ExecTemplates),
}

/// Everything the host agent needs to run.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// The coordinator's gRPC address, e.g. `http://127.0.0.1:7400`.
    pub coordinator: String,
    /// A host-scope (or admin) token.
    pub token: String,
    pub data_dir: PathBuf,
    /// How the host shows in `cairnctl hosts list` (default: the hostname).
    pub name: String,
    pub labels: Labels,
    /// How many sandboxes may run at once.
    pub slots: u32,
    pub driver: DriverConfig,
    /// The `cairn-runner` binary (local driver; `{runner}` in exec templates).
    pub runner_bin: PathBuf,
    /// Time between SIGTERM and SIGKILL when a sandbox is destroyed.
    pub grace: Duration,
    /// Extra variables for every sandbox (`--env K=V`).
    pub env: Vec<(String, String)>,
    /// The coordinator address sandboxes use (default: `coordinator`).
    pub sandbox_coordinator: Option<String>,
    /// The image for runs that name none (exec templates' `{image}`).
    pub default_image: Option<String>,
    /// The pack cache every runner of this host restores through
    /// (`CAIRN_PACK_CACHE`); `None` turns it off.
    pub pack_cache: Option<PackCacheConfig>,
    /// Trees of ended sandboxes kept for the next sandbox of the same
    /// workspace (`DIR/kept`, [`kept`]); `None` turns keeping off.
    pub kept: Option<KeptConfig>,
    /// The CA trusted for an `https://` coordinator (also handed to every
    /// sandbox as `CAIRN_CA`) and the client certificate presented.
    pub tls: ClientTls,
}

/// Why the host agent stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    DataDir(#[from] layout::LayoutError),
    #[error(transparent)]
    Local(#[from] LocalDriverError),
    #[error(transparent)]
    Exec(#[from] ExecDriverError),
    #[error("the kept workspace trees: {0}")]
    Kept(#[from] kept::KeptError),
    #[error("the coordinator at {address} refused this host: {status}")]
    Refused {
        address: String,
        status: tonic::Status,
    },
    #[error("cannot create the pack cache directory {}: {source}", path.display())]
    PackCache {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot listen for metrics scrapes on {address}: {source}")]
    MetricsListener {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
}

impl HostConfig {
    /// Checks what can be checked before anything starts.
    pub fn validate(&self) -> Result<(), HostError> {
        let bad = |msg: String| Err(HostError::Config(msg));
        if self.slots == 0 {
            return bad("--slots must be at least 1".to_owned());
        }
        if let Err(e) = cairn_proto::domain::validate_name(&self.name) {
            return bad(format!("host name: {}", e.reason));
        }
        if self.token.trim().is_empty() {
            return bad("a host token is required (--token or CAIRN_TOKEN)".to_owned());
        }
        for address in std::iter::once(&self.coordinator).chain(&self.sandbox_coordinator) {
            if !(address.starts_with("http://") || address.starts_with("https://")) {
                return bad(format!(
                    "coordinator address {address:?} is not a URL (expected e.g. http://127.0.0.1:7400)"
                ));
            }
        }
        if let (DriverConfig::Local, Some(cache)) = (&self.driver, &self.pack_cache)
            && cache.dir.starts_with(local::MOUNT_POINT)
        {
            return bad(format!(
                "--pack-cache {} lies under {}, which the local driver covers with each \
                 sandbox's own workspace",
                cache.dir.display(),
                local::MOUNT_POINT
            ));
        }
        for (name, _) in &self.env {
            if sandbox::RESERVED_ENV.contains(&name.as_str()) {
                return bad(format!(
                    "--env {name}=… is not allowed: the host sets {name} itself{}",
                    if name == "CAIRN_COORDINATOR" {
                        " (use --sandbox-coordinator)"
                    } else {
                        ""
                    }
                ));
            }
        }
        Ok(())
    }
}

/// Parses one `--env` value: `NAME=value` with a shell-style variable name.
pub fn parse_env_var(text: &str) -> Result<(String, String), String> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not NAME=value"))?;
    let valid = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid {
        return Err(format!(
            "{name:?} is not a variable name (letters, digits and '_', not starting with a digit)"
        ));
    }
    Ok((name.to_owned(), value.to_owned()))
}

/// Runs the host agent until `shutdown` resolves (then destroys every
/// sandbox and returns) or the coordinator refuses the host, serving its
/// [`metrics`] on `metrics_listener` meanwhile, if given.
pub async fn run(
    config: HostConfig,
    metrics_listener: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), HostError> {
    config.validate()?;
    let layout = layout::Layout::open(&config.data_dir)?;
    create_pack_cache(&config)?;
    match &config.driver {
        DriverConfig::Local => {
            let driver = LocalDriver::new(&config.runner_bin, layout.root())?;
            let agent = agent::Agent::new(config, driver, layout)?;
            run_serving_metrics(agent, metrics_listener, shutdown).await
        }
        DriverConfig::Exec(templates) => {
            let runner = config.runner_bin.display().to_string();
            let pack_cache = config.pack_cache.as_ref().map(|c| c.dir.as_path());
            let driver =
                ExecDriver::new(templates, &runner, layout.root(), pack_cache, config.grace)?;
            let agent = agent::Agent::new(config, driver, layout)?;
            run_serving_metrics(agent, metrics_listener, shutdown).await
        }
    }
}

/// Runs `agent`, with its metrics served on `listener` until it stops.
async fn run_serving_metrics<D: driver::Driver>(
    agent: agent::Agent<D>,
    listener: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), HostError> {
    let Some(listener) = listener else {
        return agent.run(shutdown).await;
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(metrics::serve(listener, agent.metrics(), async {
        let _ = stopped.await;
    }));
    let result = agent.run(shutdown).await;
    let _ = stop.send(());
    match serving.await {
        Ok(Ok(())) => {}
        // The sandboxes matter more than the scrapes: the agent goes on
        // without them.
        Ok(Err(e)) => tracing::error!(error = %e, "the metrics server failed"),
        Err(e) => tracing::error!(error = %e, "the metrics server panicked"),
    }
    result
}

/// Like [`run`] with a driver the caller built (tests, embedders).
pub async fn run_with_driver<D: driver::Driver>(
    config: HostConfig,
    driver: D,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), HostError> {
    config.validate()?;
    let layout = layout::Layout::open(&config.data_dir)?;
    create_pack_cache(&config)?;
    agent::Agent::new(config, driver, layout)?
        .run(shutdown)
        .await
}

/// Creates the pack cache directory (mode 0700) before any sandbox starts,
/// so that an exec template can mount it. The runners fill and evict it.
fn create_pack_cache(config: &HostConfig) -> Result<(), HostError> {
    use std::os::unix::fs::DirBuilderExt;
    let Some(cache) = &config.pack_cache else {
        return Ok(());
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&cache.dir)
        .map_err(|source| HostError::PackCache {
            path: cache.dir.clone(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> HostConfig {
        HostConfig {
            coordinator: "http://127.0.0.1:7400".into(),
            token: "cairn_host_x".into(),
            data_dir: "/tmp/x".into(),
            name: "h".into(),
            labels: Labels::default(),
            slots: 1,
            driver: DriverConfig::Local,
            runner_bin: "/bin/true".into(),
            grace: DEFAULT_GRACE,
            env: vec![],
            sandbox_coordinator: None,
            default_image: None,
            pack_cache: None,
            kept: None,
            tls: ClientTls::default(),
        }
    }

    #[test]
    fn env_flags_are_checked() {
        assert_eq!(
            parse_env_var("PATH=/a:/b=c").unwrap(),
            ("PATH".into(), "/a:/b=c".into())
        );
        assert!(
            parse_env_var("NOVALUE")
                .unwrap_err()
                .contains("not NAME=value")
        );
        assert!(
            parse_env_var("1X=2")
                .unwrap_err()
                .contains("not a variable name")
        );
        let mut c = config();
        c.env = vec![("CAIRN_RUN_TOKEN".into(), "x".into())];
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("the host sets CAIRN_RUN_TOKEN itself")
        );
        c.env = vec![("CAIRN_COORDINATOR".into(), "x".into())];
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("--sandbox-coordinator")
        );
    }

    #[test]
    fn config_is_checked() {
        let c = HostConfig {
            slots: 0,
            ..config()
        };
        assert!(c.validate().unwrap_err().to_string().contains("--slots"));
        let c = HostConfig {
            coordinator: "localhost:7400".into(),
            ..config()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("is not a URL")
        );
        assert!(config().validate().is_ok());
    }
}
