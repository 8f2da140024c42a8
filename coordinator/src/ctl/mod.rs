//! `cairnctl`, the admin command line: workspaces, checkpoints, checkout and
//! verification, talking to the coordinator over gRPC with a bearer token.
//!
//! Tables for people, `--output json` for scripts (one JSON document on
//! stdout). Errors go to stderr as `error: <cause>`, with gRPC codes spelled
//! out, and exit 1. The module is compiled into the `cairnctl` binary only
//! (through `#[path]`), so it depends on nothing in the coordinator library.
//!
//! - [`output`]: tables, JSON shapes and human units.
//! - [`workspace`]: `workspace create|list|show`.
//! - [`checkpoints`]: `checkpoints WS`.
//! - [`checkout`]: `checkout WS DEST`, the restore engine with a progress bar.
//! - [`verify`]: `verify WS [--read-data]`.

mod checkout;
mod checkpoints;
mod output;
mod verify;
mod workspace;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use cairn_proto::pb;
use cairn_runner::client::Coordinator;
use clap::{Parser, Subcommand, ValueEnum};

/// cairn's admin CLI: inspect workspaces and checkpoints, materialise any
/// checkpoint into a directory, and verify what the store holds.
#[derive(Debug, Parser)]
#[command(name = "cairnctl", version)]
pub struct Cli {
    /// Coordinator gRPC address.
    #[arg(
        long,
        global = true,
        env = "CAIRN_COORDINATOR",
        default_value = "http://127.0.0.1:7400"
    )]
    pub coordinator: String,

    /// Bearer token (the admin token is in the coordinator's DIR/admin.token).
    #[arg(long, global = true, env = "CAIRN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// Tables for people or JSON for scripts.
    #[arg(long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,

    /// Log format on stderr (`RUST_LOG` filters; default `warn`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "CAIRN_LOG_FORMAT")]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create, list and show workspaces.
    #[command(subcommand)]
    Workspace(WorkspaceCommand),
    /// List a workspace's checkpoints, newest first.
    Checkpoints {
        /// Workspace id or name.
        workspace: String,
    },
    /// Restore a checkpoint (the newest restorable one by default) into a directory.
    Checkout {
        /// Workspace id or name.
        workspace: String,
        /// Directory to write into; created if missing. Entries the checkpoint
        /// does not have are removed from it.
        dest: PathBuf,
        /// Restore exactly this checkpoint (no fallback to older ones).
        #[arg(long)]
        checkpoint: Option<String>,
    },
    /// Check that every pack each checkpoint references is in the store.
    Verify {
        /// Workspace id or name.
        workspace: String,
        /// Also download every pack: check its digest, decrypt and verify
        /// every blob, and walk the trees to find every blob they reference.
        #[arg(long)]
        read_data: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum WorkspaceCommand {
    /// Create a workspace.
    Create {
        /// A unique name (letters, digits, '-', '_', '.').
        #[arg(long)]
        name: Option<String>,
    },
    /// List workspaces.
    List,
    /// Show one workspace: generation, checkpoint count, latest checkpoint.
    Show {
        /// Workspace id or name.
        workspace: String,
    },
}

/// Sets up tracing on stderr (`RUST_LOG` filters; default `warn`).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Runs a parsed command line to completion and prints any error.
pub fn run_to_exit(cli: Cli) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs one command. `Ok(FAILURE)` means the command ran and found problems.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let coordinator = Coordinator::connect(&cli.coordinator, cli.token.as_deref()).await?;
    let output = cli.output;
    match cli.command {
        Command::Workspace(WorkspaceCommand::Create { name }) => {
            workspace::create(&coordinator, name, output).await
        }
        Command::Workspace(WorkspaceCommand::List) => workspace::list(&coordinator, output).await,
        Command::Workspace(WorkspaceCommand::Show { workspace }) => {
            workspace::show(&coordinator, &workspace, output).await
        }
        Command::Checkpoints { workspace } => {
            checkpoints::list(&coordinator, &workspace, output).await
        }
        Command::Checkout {
            workspace,
            dest,
            checkpoint,
        } => {
            checkout::run(
                &coordinator,
                &workspace,
                dest,
                checkpoint.as_deref(),
                output,
            )
            .await
        }
        Command::Verify {
            workspace,
            read_data,
        } => verify::run(&coordinator, &workspace, read_data, output).await,
    }
}

/// A refused RPC as an error naming what was attempted and the status in words.
fn rpc_error(what: &'static str) -> impl FnOnce(tonic::Status) -> anyhow::Error {
    move |status| {
        anyhow::anyhow!(
            "{what}: {}",
            cairn_runner::restore::describe_status(&status)
        )
    }
}

/// Every checkpoint of a workspace, newest first, across pages.
async fn all_checkpoints(
    coordinator: &Coordinator,
    workspace: &str,
) -> anyhow::Result<Vec<pb::Checkpoint>> {
    let mut client = coordinator.checkpoints.clone();
    let mut checkpoints = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_checkpoints(pb::ListCheckpointsRequest {
                workspace: workspace.to_owned(),
                page_size: 500,
                page_token: page_token.clone(),
            })
            .await
            .map_err(rpc_error("listing checkpoints"))?
            .into_inner();
        checkpoints.extend(page.checkpoints);
        if page.next_page_token.is_empty() || page.next_page_token == page_token {
            return Ok(checkpoints);
        }
        page_token = page.next_page_token;
    }
}

fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    emit(&serde_json::to_string_pretty(value).context("encoding JSON")?)
}

/// Writes one block of output to stdout. A closed pipe (`cairnctl … | head`)
/// is not an error: the reader has what it wanted.
fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{text}").and_then(|()| stdout.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_flags_go_before_or_after_the_command() {
        let cli =
            Cli::try_parse_from(["cairnctl", "--output", "json", "checkpoints", "demo"]).unwrap();
        assert_eq!(cli.output, Output::Json);
        let cli = Cli::try_parse_from(["cairnctl", "verify", "ws", "--read-data", "--token", "t"])
            .unwrap();
        assert!(matches!(
            cli.command,
            Command::Verify {
                read_data: true,
                ..
            }
        ));
        assert_eq!(cli.token.as_deref(), Some("t"));
        assert!(
            Cli::try_parse_from(["cairnctl", "checkout", "ws"]).is_err(),
            "DEST is required"
        );
    }

    #[test]
    fn refused_calls_say_what_failed_and_why() {
        let err = rpc_error("showing the workspace")(tonic::Status::not_found(
            "workspace \"x\" not found",
        ));
        assert_eq!(
            err.to_string(),
            "showing the workspace: workspace \"x\" not found"
        );
        let err =
            rpc_error("listing workspaces")(tonic::Status::permission_denied("unknown token"));
        assert_eq!(
            err.to_string(),
            "listing workspaces: permission denied: unknown token"
        );
    }
}
