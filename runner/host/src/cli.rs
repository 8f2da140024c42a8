//! The `cairn-host` command line: flags, logging, signals, then [`super::run`].

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use cairn_proto::runs::Labels;
use clap::{Parser, ValueEnum};

use super::{DriverConfig, ExecTemplates, HostConfig, parse_env_var};
use cairn_engine::tls::ClientTls;
use cairn_proto::tls::PemSource;
use cairn_utils::logging::LogFormat;

/// cairn's host agent: registers this machine's labels and slots with the
/// coordinator, runs a sandbox with `cairn-runner run` inside for every
/// attempt it is assigned, and destroys sandboxes with SIGTERM, a grace
/// period and SIGKILL. SIGTERM/SIGINT destroy every sandbox and exit 0.
#[derive(Debug, Parser)]
#[command(name = "cairn-host", version)]
pub struct HostArgs {
    /// Coordinator gRPC address, e.g. http://127.0.0.1:7400; several
    /// replicas' separated by commas (the agent and its sandboxes fail over
    /// between them).
    #[arg(long, env = "CAIRN_COORDINATOR")]
    pub coordinator: String,

    /// Host-scope (or admin) token.
    #[arg(long, env = "CAIRN_TOKEN", hide_env_values = true)]
    pub token: String,

    /// Where the agent keeps its host id, sandbox directories, records and logs.
    #[arg(long, value_name = "DIR")]
    pub data_dir: PathBuf,

    /// Placement labels, k=v,k2=v2 (a run is placed only where all its labels match).
    #[arg(long, default_value = "")]
    pub labels: Labels,

    /// How many sandboxes may run at once.
    #[arg(long, default_value_t = 1)]
    pub slots: u32,

    /// Name shown in `cairnctl hosts list` (default: the hostname).
    #[arg(long)]
    pub name: Option<String>,

    /// How sandboxes are made: `local` (a mount namespace per sandbox with its
    /// directory at /workspace) or `exec` (your commands, see --exec-create).
    #[arg(long, value_enum, default_value_t = DriverKind::Local)]
    pub driver: DriverKind,

    /// The cairn-runner binary (default: cairn-runner next to cairn-host, else
    /// on PATH). For exec templates this is what {runner} stands for.
    #[arg(long, value_name = "PATH")]
    pub runner_bin: Option<PathBuf>,

    /// Time a destroyed sandbox gets between SIGTERM and SIGKILL (to checkpoint).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub grace: Duration,

    /// exec driver: command that starts a sandbox. Split like shell words;
    /// placeholders {sandbox_id} {sandbox_dir} {workspace_dir} {home_dir}
    /// {cache_dir} {pack_cache} {image} {runner} {run_id} {attempt} {grace_secs}
    /// {env_args}; e.g. 'bwrap --dev-bind / / --bind {workspace_dir} /workspace
    /// {runner} run'. Without --exec-destroy this command is
    /// the sandbox (destroy = SIGTERM/grace/SIGKILL to it).
    #[arg(long, value_name = "TEMPLATE")]
    pub exec_create: Option<String>,

    /// exec driver: command that destroys a sandbox (e.g. 'docker stop --time
    /// {grace_secs} cairn-{sandbox_id}'). With it, --exec-create must return once
    /// the sandbox is up, and --exec-wait is required.
    #[arg(long, value_name = "TEMPLATE")]
    pub exec_destroy: Option<String>,

    /// exec driver: command that returns when a detached sandbox ended, printing
    /// its exit status last (e.g. 'docker wait cairn-{sandbox_id}').
    #[arg(long, value_name = "TEMPLATE")]
    pub exec_wait: Option<String>,

    /// Image for runs that name none ({image} in exec templates).
    #[arg(long, value_name = "IMAGE")]
    pub default_image: Option<String>,

    /// Extra environment for every sandbox, e.g. PATH with the harness binaries (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE", value_parser = parse_env_var)]
    pub env: Vec<(String, String)>,

    /// Coordinator address the sandboxes use, when it differs from the host's
    /// (containers reach it e.g. through host.docker.internal).
    #[arg(long, value_name = "URL")]
    pub sandbox_coordinator: Option<String>,

    /// The pack cache shared by every sandbox of this host (passed to each
    /// runner as CAIRN_PACK_CACHE; {pack_cache} in exec templates): a second
    /// restore of a workspace, or of another one of the same tenant holding
    /// the same repository, downloads almost nothing. Default: DATA_DIR/pack-cache.
    #[arg(long, value_name = "DIR")]
    pub pack_cache: Option<PathBuf>,

    /// Bound of the pack cache (least recently used pieces are evicted), e.g.
    /// 10GiB, 512MiB; 0 turns the cache off.
    #[arg(long, value_name = "SIZE", default_value = "10GiB", value_parser = cairn_proto::size::parse_size)]
    pub pack_cache_size: u64,

    /// Bound of the disk used by workspace trees kept after their sandbox
    /// ended (DATA_DIR/kept): the next sandbox of the same workspace on this
    /// host starts on the kept tree, and its restore writes only what differs
    /// from the checkpoint. Oldest trees are evicted first; 0 turns keeping off.
    #[arg(long, value_name = "SIZE", default_value = "10GiB", value_parser = cairn_proto::size::parse_size)]
    pub kept_workspaces_size: u64,

    /// A kept tree no sandbox took within this long is deleted.
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = humantime::parse_duration)]
    pub kept_workspaces_for: Duration,

    /// Client certificate (PEM chain) presented to a coordinator that
    /// requires mutual TLS of hosts (`serve --tls-client-ca`). The CA the
    /// host trusts, and hands to its sandboxes, comes from CAIRN_CA.
    #[arg(
        long,
        value_name = "PEM",
        env = "CAIRN_TLS_CLIENT_CERT",
        requires = "tls_client_key"
    )]
    pub tls_client_cert: Option<PathBuf>,

    /// The private key of --tls-client-cert (PEM).
    #[arg(
        long,
        value_name = "PEM",
        env = "CAIRN_TLS_CLIENT_KEY",
        requires = "tls_client_cert"
    )]
    pub tls_client_key: Option<PathBuf>,

    /// Serve Prometheus metrics at http://ADDR/metrics (sandboxes, kept
    /// trees, restore and checkpoint durations, pack cache use); off
    /// unless given.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,

    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "CAIRN_LOG_FORMAT")]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DriverKind {
    Local,
    Exec,
}

impl HostArgs {
    /// Turns the flags into a [`HostConfig`], refusing flags that do not fit the driver.
    pub fn into_config(self) -> anyhow::Result<HostConfig> {
        let exec_flags =
            self.exec_create.is_some() || self.exec_destroy.is_some() || self.exec_wait.is_some();
        let driver = match self.driver {
            DriverKind::Local if exec_flags => {
                anyhow::bail!("--exec-create/--exec-destroy/--exec-wait need --driver exec")
            }
            DriverKind::Local => DriverConfig::Local,
            DriverKind::Exec => DriverConfig::Exec(ExecTemplates {
                create: self
                    .exec_create
                    .context("--driver exec needs --exec-create TEMPLATE")?,
                destroy: self.exec_destroy,
                wait: self.exec_wait,
            }),
        };
        let pack_cache = if self.pack_cache_size > 0 {
            let dir = self
                .pack_cache
                .unwrap_or_else(|| self.data_dir.join("pack-cache"));
            // Runners start elsewhere (the local driver's in /workspace).
            let dir = if dir.is_absolute() {
                dir
            } else {
                std::env::current_dir()
                    .context("cannot resolve --pack-cache")?
                    .join(dir)
            };
            Some(cairn_engine::restore::PackCacheConfig {
                dir,
                max_bytes: self.pack_cache_size,
            })
        } else {
            None
        };
        let mut tls = ClientTls::from_env()?;
        if let (Some(cert), Some(key)) = (self.tls_client_cert, self.tls_client_key) {
            tls = tls.with_identity(&PemSource::File(cert), &PemSource::File(key))?;
        }
        let name = match self.name {
            Some(name) => name,
            None => hostname().context("cannot read the hostname; pass --name")?,
        };
        Ok(HostConfig {
            coordinator: self.coordinator,
            token: self.token,
            data_dir: self.data_dir,
            name,
            labels: self.labels,
            slots: self.slots,
            driver,
            runner_bin: self.runner_bin.unwrap_or_else(default_runner_bin),
            grace: self.grace,
            env: self.env,
            sandbox_coordinator: self.sandbox_coordinator,
            default_image: self.default_image,
            pack_cache,
            tls,
            kept: (self.kept_workspaces_size > 0).then_some(crate::KeptConfig {
                max_bytes: self.kept_workspaces_size,
                max_age: self.kept_workspaces_for,
            }),
        })
    }
}

/// `cairn-runner` next to this executable, else whatever PATH finds.
fn default_runner_bin() -> PathBuf {
    let sibling = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("cairn-runner")));
    match sibling {
        Some(path) if path.is_file() => path,
        _ => find_on_path("cairn-runner").unwrap_or_else(|| PathBuf::from("cairn-runner")),
    }
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

fn hostname() -> std::io::Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..len]).into_owned())
}

/// Resolves on SIGTERM or SIGINT.
async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received"),
                _ = int.recv() => tracing::info!("SIGINT received"),
            }
        }
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM/SIGINT; stop with SIGKILL only");
            std::future::pending::<()>().await
        }
    }
}

/// Entry point of the `cairn-host` binary.
pub fn main() -> ExitCode {
    let args = HostArgs::parse();
    cairn_utils::logging::init(args.log_format, "info");
    let metrics_listen = args.metrics_listen;
    let config = match args.into_config() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: {}", cairn_utils::text::one_line(e.as_ref()));
            return ExitCode::FAILURE;
        }
    };
    cairn_utils::program::run(async move {
        let metrics_listener = match metrics_listen {
            Some(address) => Some(
                tokio::net::TcpListener::bind(address)
                    .await
                    .map_err(|source| super::HostError::MetricsListener { address, source })?,
            ),
            None => None,
        };
        super::run(config, metrics_listener, stop_signal())
            .await
            .map(|()| ExitCode::SUCCESS)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<HostArgs, clap::Error> {
        let base = [
            "cairn-host",
            "--coordinator",
            "http://127.0.0.1:1",
            "--token",
            "t",
            "--data-dir",
            "/tmp/d",
        ];
        HostArgs::try_parse_from(base.iter().chain(args))
    }

    #[test]
    fn flags_fit_the_driver() {
        let config = parse(&[
            "--labels",
            "gpu=a100,zone=eu",
            "--slots",
            "3",
            "--name",
            "n",
            "--grace",
            "5s",
        ])
        .unwrap()
        .into_config()
        .unwrap();
        assert_eq!(config.labels.to_string(), "gpu=a100,zone=eu");
        assert_eq!((config.slots, config.grace), (3, Duration::from_secs(5)));
        assert!(matches!(config.driver, DriverConfig::Local));
        let cache = config.pack_cache.expect("the pack cache is on by default");
        assert_eq!(cache.dir, PathBuf::from("/tmp/d/pack-cache"));
        assert_eq!(cache.max_bytes, 10 << 30);
        assert_eq!(
            config.kept,
            Some(crate::KeptConfig {
                max_bytes: 10 << 30,
                max_age: Duration::from_secs(24 * 3600)
            }),
            "keeping is on by default"
        );
        let kept = parse(&[
            "--kept-workspaces-size",
            "2GiB",
            "--kept-workspaces-for",
            "3d",
        ])
        .unwrap()
        .into_config()
        .unwrap()
        .kept
        .unwrap();
        assert_eq!(
            (kept.max_bytes, kept.max_age),
            (2 << 30, Duration::from_secs(3 * 24 * 3600))
        );
        let off = parse(&["--kept-workspaces-size", "0"])
            .unwrap()
            .into_config()
            .unwrap();
        assert_eq!(off.kept, None);
        let config = parse(&[
            "--pack-cache",
            "/var/cache/packs",
            "--pack-cache-size",
            "2GiB",
        ])
        .unwrap()
        .into_config()
        .unwrap();
        assert_eq!(
            config.pack_cache,
            Some(cairn_engine::restore::PackCacheConfig {
                dir: "/var/cache/packs".into(),
                max_bytes: 2 << 30
            })
        );
        let off = parse(&["--pack-cache-size", "0"])
            .unwrap()
            .into_config()
            .unwrap();
        assert_eq!(off.pack_cache, None);
        assert!(parse(&["--pack-cache-size", "lots"]).is_err());

        let err = parse(&["--exec-create", "x"])
            .unwrap()
            .into_config()
            .unwrap_err();
        assert!(err.to_string().contains("need --driver exec"), "{err}");
        let err = parse(&["--driver", "exec"])
            .unwrap()
            .into_config()
            .unwrap_err();
        assert!(err.to_string().contains("needs --exec-create"), "{err}");
        assert!(parse(&["--labels", "novalue"]).is_err());
        assert!(parse(&["--env", "BAD"]).is_err());
    }
}
