//! `cairn-coordinator serve`: the control plane in one process, with its
//! metadata and blob store in a data directory.
//!
//! Binds the gRPC and blob listeners, writes `DIR/endpoints.json` once both
//! are bound, and serves until SIGINT or SIGTERM, then drains open requests.
//! Logs go to stderr (`RUST_LOG` filters, `--log-format json` for machines);
//! stdout carries only what a person starting it needs to see.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use cairn_coordinator::conn_limits::Timeouts;
use cairn_coordinator::datadir::DataDir;
use cairn_coordinator::db::DatabaseLocation;
use cairn_coordinator::gc::GcConfig;
use cairn_coordinator::grpc::{ServerLimits, ServiceLimits};
use cairn_coordinator::retention::Policy;
use cairn_coordinator::store::{RemoteStore, StoreLocation};
use cairn_coordinator::tls::TlsFiles;
use cairn_coordinator::{Coordinator, ServerConfig, local_url};
use clap::{Parser, Subcommand};
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};

/// cairn's coordinator: workspaces, checkpoint metadata, signed URLs, runs and hosts.
#[derive(Debug, Parser)]
#[command(name = "cairn-coordinator", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the coordinator (gRPC API and embedded blob store) until SIGINT/SIGTERM.
    Serve(ServeArgs),
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Directory for metadata, keys, the admin token and blobs (created 0700).
    #[arg(long, value_name = "DIR", env = "CAIRN_DATA_DIR")]
    data_dir: PathBuf,
    /// The metadata database: a postgres:// URL (several coordinators may
    /// share one) or a SQLite file (default: DIR/cairn.db). Give a password
    /// through the environment rather than the command line.
    #[arg(long, value_name = "URL", env = "CAIRN_DATABASE")]
    database: Option<DatabaseLocation>,
    /// PostgreSQL schema for cairn's tables, created when missing (default:
    /// the connection's search path, usually public).
    #[arg(long, value_name = "NAME", requires = "database")]
    database_schema: Option<String>,
    /// Address of the gRPC API (port 0 picks a free one; see DIR/endpoints.json).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7400")]
    listen: String,
    /// Address of the embedded blob server that signed URLs point at.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7401")]
    blob_listen: String,
    /// Serve Prometheus metrics at http://ADDR/metrics (off unless given).
    /// The endpoint has no authentication: bind it where only the scraper
    /// reaches it.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// Base URL runners reach the blob server at, when it differs from
    /// http://<blob-listen> (e.g. behind a proxy or on another interface).
    #[arg(long, value_name = "URL")]
    blob_public_url: Option<String>,
    /// Keep checkpoint packs in this bucket instead of the embedded blob
    /// store: s3://BUCKET[/PREFIX] (AWS, or any S3-compatible server with
    /// AWS_ENDPOINT_URL; AWS_REGION, AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY), gs://BUCKET[/PREFIX]
    /// (GOOGLE_APPLICATION_CREDENTIALS: a service account key file) or
    /// azure://CONTAINER[/PREFIX] (AZURE_STORAGE_ACCOUNT_NAME,
    /// AZURE_STORAGE_ACCOUNT_KEY); see docs/object-stores.md.
    #[arg(long, value_name = "URL")]
    store: Option<StoreLocation>,
    /// Lifetime of signed URLs (e.g. 90s, 15m, 1h).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = humantime::parse_duration)]
    url_ttl: Duration,
    /// Most blob ids one checkpoint commit may declare in its new packs
    /// (recording them holds the metadata's write lock).
    #[arg(long, value_name = "COUNT", default_value_t = ServiceLimits::default().max_commit_blobs)]
    max_commit_blobs: u64,
    /// Most packs one checkpoint commit may reference.
    #[arg(long, value_name = "COUNT", default_value_t = ServiceLimits::default().max_commit_referenced_packs)]
    max_commit_packs: usize,
    /// A host whose last heartbeat is older than this is lost: its attempts
    /// end and its runs are queued again elsewhere.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    host_lease: Duration,
    /// How often hosts heartbeat (must be shorter than --host-lease).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
    heartbeat_interval: Duration,
    /// Blob connections open at once; past it new connections wait in the
    /// listen backlog. Lowered to fit the open-file limit (raised to its hard
    /// limit at start).
    #[arg(long, value_name = "N", default_value_t = cairn_coordinator::DEFAULT_BLOB_MAX_CONNECTIONS)]
    blob_max_connections: usize,
    /// A blob connection must deliver a request's headers this soon after it
    /// was opened (or after the request's first byte).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    blob_header_timeout: Duration,
    /// A kept-alive blob connection is closed after this long between requests.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = humantime::parse_duration)]
    blob_idle_timeout: Duration,
    /// Bytes per second an upload or download must move once
    /// --blob-min-rate-grace has passed; slower connections are cut (0: off).
    #[arg(long, value_name = "BYTES", default_value_t = 16384)]
    blob_min_rate: u64,
    /// How long a blob request may move fewer than --blob-min-rate bytes/s
    /// at its start.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    blob_min_rate_grace: Duration,
    /// gRPC connections open at once; past it new connections wait in the
    /// listen backlog. Lowered to fit the open-file limit.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    grpc_max_connections: usize,
    /// A gRPC connection that sends nothing this long after it was opened is closed.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    grpc_handshake_timeout: Duration,
    /// Calls one gRPC connection may have served at once (more wait).
    #[arg(long, value_name = "N", default_value_t = 256)]
    grpc_concurrency_per_connection: usize,
    /// HTTP/2 streams one gRPC connection may open at once.
    #[arg(long, value_name = "N", default_value_t = 256)]
    grpc_max_streams: u32,
    /// HTTP/2 PING interval; a peer silent for another --grpc-keepalive-timeout is dropped.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    grpc_keepalive_interval: Duration,
    /// How long a gRPC peer has to answer a PING.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    grpc_keepalive_timeout: Duration,
    /// Serve gRPC and the blob server over TLS with this certificate chain
    /// (PEM, leaf first); clients trust its CA through CAIRN_CA.
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS for hosts: host calls must come over a connection that
    /// presented a client certificate chaining to this CA bundle (PEM).
    /// Runners and cairnctl still connect with tokens alone.
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// How often --tls-cert and --tls-key are looked at: changed files (a
    /// renewal) are served from then on, without a restart.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    tls_reload_interval: Duration,
    /// How many of each workspace's newest checkpoints retention keeps
    /// (the newest always is; a workspace may set its own).
    #[arg(long, value_name = "N", default_value_t = Policy::DEFAULT_KEEP_LAST, value_parser = clap::value_parser!(u32).range(1..))]
    keep_last: u32,
    /// How long a finished workspace stays before it is deleted (a
    /// workspace may set its own).
    #[arg(long, value_name = "DURATION", default_value = "7days", value_parser = humantime::parse_duration)]
    finished_retention: Duration,
    /// How long the checkpoint a run started from is kept after the run
    /// started.
    #[arg(long, value_name = "DURATION", default_value = "30days", value_parser = humantime::parse_duration)]
    run_start_hold: Duration,
    /// How long garbage collection waits before deleting a pack no
    /// checkpoint references (or an upload no commit recorded). Must be
    /// longer than --url-ttl: a pack must outlive every URL to it.
    #[arg(long, value_name = "DURATION", default_value = "2h", value_parser = humantime::parse_duration)]
    gc_grace: Duration,
    /// How often garbage collection runs on its own (0: only when
    /// `cairnctl gc` asks).
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = humantime::parse_duration)]
    gc_interval: Duration,
    /// Log line format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    log_format: cairn_utils::logging::LogFormat,
}

async fn bind(address: &str, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(address)
        .await
        .with_context(|| format!("could not listen for {what} on {address}"))
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // Installed before serving so a signal during start-up is not lost.
    let mut interrupt =
        signal(SignalKind::interrupt()).context("could not install a SIGINT handler")?;
    let mut terminate =
        signal(SignalKind::terminate()).context("could not install a SIGTERM handler")?;

    let data_dir = DataDir::new(&args.data_dir);
    // A file left by an earlier run would point readers at a dead server.
    data_dir.remove_endpoints()?;
    let mut config = ServerConfig::new(&args.data_dir);
    config.database = match (args.database, args.database_schema) {
        (Some(location), Some(schema)) => Some(location.in_schema(&schema)?),
        (location, _) => location,
    };
    // Before anything is created: a store that cannot be reached is a
    // mistake in the command line or the environment.
    config.store = args.store.as_ref().map(RemoteStore::from_env).transpose()?;
    config.blob_public_url = args.blob_public_url;
    config.limits = ServiceLimits {
        url_ttl: args.url_ttl,
        max_commit_blobs: args.max_commit_blobs,
        max_commit_referenced_packs: args.max_commit_packs,
        ..ServiceLimits::default()
    };
    config.host_lease = args.host_lease;
    config.heartbeat_interval = args.heartbeat_interval;
    config.blob_max_connections = args.blob_max_connections;
    config.blob_timeouts = Timeouts {
        header_timeout: args.blob_header_timeout,
        idle_timeout: args.blob_idle_timeout,
        min_rate: args.blob_min_rate,
        rate_grace: args.blob_min_rate_grace,
    };
    config.grpc_limits = ServerLimits {
        max_connections: args.grpc_max_connections,
        handshake_timeout: args.grpc_handshake_timeout,
        concurrency_per_connection: args.grpc_concurrency_per_connection,
        max_concurrent_streams: args.grpc_max_streams,
        keepalive_interval: args.grpc_keepalive_interval,
        keepalive_timeout: args.grpc_keepalive_timeout,
    };
    config.tls = match (args.tls_cert, args.tls_key) {
        (Some(cert), Some(key)) => Some(TlsFiles {
            cert,
            key,
            client_ca: args.tls_client_ca,
        }),
        _ => None,
    };
    config.tls_reload_interval = args.tls_reload_interval;
    config.gc = GcConfig {
        policy: Policy {
            keep_last: args.keep_last,
            run_start_hold: args.run_start_hold,
            finished_expiry: args.finished_retention,
        },
        grace: args.gc_grace,
        interval: (!args.gc_interval.is_zero()).then_some(args.gc_interval),
    };
    let mut coordinator = Coordinator::open(config).await?;
    if coordinator.admin_token_created() {
        println!(
            "admin token written to {}",
            data_dir.admin_token().display()
        );
    }

    let grpc_listener = bind(&args.listen, "gRPC").await?;
    let blob_listener = bind(&args.blob_listen, "the blob server").await?;
    let mut metrics_url = None;
    if let Some(address) = &args.metrics_listen {
        let listener = bind(address, "metrics").await?;
        let url = format!("{}/metrics", local_url(listener.local_addr()?, false));
        tracing::info!(metrics = %url, "serving metrics");
        metrics_url = Some(url);
        coordinator = coordinator.with_metrics_listener(listener);
    }
    let grpc_url = local_url(grpc_listener.local_addr()?, coordinator.uses_tls());
    let blob_url = local_url(blob_listener.local_addr()?, coordinator.uses_tls());
    data_dir.write_endpoints(&grpc_url, &blob_url, metrics_url.as_deref())?;

    let shutdown = async move {
        tokio::select! {
            _ = interrupt.recv() => tracing::info!("SIGINT received"),
            _ = terminate.recv() => tracing::info!("SIGTERM received"),
        }
    };
    let result = coordinator
        .run(grpc_listener, blob_listener, shutdown)
        .await;
    data_dir.remove_endpoints()?;
    result?;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => {
            cairn_utils::logging::init(args.log_format, "info");
            serve(args).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", cairn_utils::text::one_line(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}
