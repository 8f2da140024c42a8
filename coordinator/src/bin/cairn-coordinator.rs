//! `cairn-coordinator serve`: the control plane in one process, with its
//! metadata and blob store in a data directory.
//!
//! Binds the gRPC and blob listeners, writes `DIR/endpoints.json` once both
//! are bound, and serves until SIGINT or SIGTERM, then drains open requests.
//! Logs go to stderr (`RUST_LOG` filters, `--log-format json` for machines);
//! stdout carries only what a person starting it needs to see.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use cairn_coordinator::datadir::DataDir;
use cairn_coordinator::grpc::Limits;
use cairn_coordinator::{Coordinator, ServerConfig, local_url};
use clap::{Parser, Subcommand, ValueEnum};
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

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

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Directory for metadata, keys, the admin token and blobs (created 0700).
    #[arg(long, value_name = "DIR", env = "CAIRN_DATA_DIR")]
    data_dir: PathBuf,
    /// Address of the gRPC API (port 0 picks a free one; see DIR/endpoints.json).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7400")]
    listen: String,
    /// Address of the embedded blob server that signed URLs point at.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7401")]
    blob_listen: String,
    /// Base URL runners reach the blob server at, when it differs from
    /// http://<blob-listen> (e.g. behind a proxy or on another interface).
    #[arg(long, value_name = "URL")]
    blob_public_url: Option<String>,
    /// Lifetime of signed URLs (e.g. 90s, 15m, 1h).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = humantime::parse_duration)]
    url_ttl: Duration,
    /// Most blob ids one checkpoint commit may declare in its new packs
    /// (recording them holds the metadata's write lock).
    #[arg(long, value_name = "COUNT", default_value_t = Limits::default().max_commit_blobs)]
    max_commit_blobs: u64,
    /// Most packs one checkpoint commit may reference.
    #[arg(long, value_name = "COUNT", default_value_t = Limits::default().max_commit_referenced_packs)]
    max_commit_packs: usize,
    /// A host whose last heartbeat is older than this is lost: its attempts
    /// end and its runs are queued again elsewhere.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    host_lease: Duration,
    /// How often hosts heartbeat (must be shorter than --host-lease).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
    heartbeat_interval: Duration,
    /// Log line format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
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
    config.blob_public_url = args.blob_public_url;
    config.limits = Limits {
        url_ttl: args.url_ttl,
        max_commit_blobs: args.max_commit_blobs,
        max_commit_referenced_packs: args.max_commit_packs,
        ..Limits::default()
    };
    config.host_lease = args.host_lease;
    config.heartbeat_interval = args.heartbeat_interval;
    let coordinator = Coordinator::open(config).await?;
    if coordinator.admin_token_created() {
        println!(
            "admin token written to {}",
            data_dir.admin_token().display()
        );
    }

    let grpc_listener = bind(&args.listen, "gRPC").await?;
    let blob_listener = bind(&args.blob_listen, "the blob server").await?;
    let grpc_url = local_url(grpc_listener.local_addr()?);
    let blob_url = local_url(blob_listener.local_addr()?);
    data_dir.write_endpoints(&grpc_url, &blob_url)?;

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
            init_logging(args.log_format);
            serve(args).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
