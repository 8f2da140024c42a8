//! `cairnctl`, the command line: workspaces, checkpoints, checkout and
//! verification, runs, hosts and tokens, talking to the coordinator over
//! gRPC with a bearer token — and `cairnctl demo`, the whole system on one
//! machine.
//!
//! Tables for people (`-o wide` adds columns), `-o json` or `-o yaml` for
//! scripts (one document on stdout, the same in either language; `runs
//! events --follow` prints one JSON object per line, or one YAML document
//! each). Errors go to stderr as `error: <cause>`, with gRPC codes spelled
//! out, then `hint: <what to do next>` where cairnctl knows it
//! ([`errors`]), and exit 1.
//! `cairnctl checkout` is the engine's restore ([`cairn_engine::restore`])
//! with `cairn-runner restore`'s flags; `cairnctl demo` starts the real
//! binaries.
//!
//! - [`output`]: tables, JSON shapes and human units.
//! - [`workspace`]: `workspace create|list|show|fork|send|messages|notes|
//!   finish|delete|retention`.
//! - [`checkpoints`]: `checkpoints [list] WS`, `checkpoints pin|unpin CID`.
//! - [`gc`]: `gc [--dry-run]` (a spinner while it runs), `storage`,
//!   `compact WS`.
//! - [`checkout`]: `checkout WS DEST`, the restore engine with a progress bar.
//! - [`verify`]: `verify WS [--read-data]`, with a progress bar.
//! - [`progress`]: the bars of checkout, verify and gc, for people only.
//! - [`runs`]: `runs create|list|show|events|answer|suspend|cancel`.
//! - [`watch`]: `runs watch`, the runs table kept current.
//! - [`hosts`]: `hosts list|cordon|uncordon|drain`.
//! - [`tokens`]: `tokens create --scope client|host [--expires-in]`,
//!   `tokens list`, `tokens revoke ID`.
//! - `completions SHELL`: completion scripts for bash, zsh, fish, elvish
//!   and PowerShell (clap_complete), from the same definitions as `--help`.
//! - [`demo`]: `demo`, an embedded coordinator, two hosts and a run that
//!   loses its host and resumes on the other.

mod checkout;
mod checkpoints;
mod demo;
mod errors;
mod gc;
mod hosts;
mod output;
mod progress;
mod runs;
mod tokens;
mod verify;
mod watch;
mod workspace;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use cairn_engine::client::CoordinatorClient;
use cairn_proto::pb;
use cairn_proto::runs::RunState;
use cairn_utils::logging::LogFormat;
use clap::{Parser, Subcommand, ValueEnum};

/// cairn's command line: run agents on workspaces and follow them across
/// hosts, inspect workspaces and checkpoints, materialise any checkpoint into
/// a directory, verify what the store holds, and manage hosts and tokens.
/// `cairnctl demo` shows it all on this machine.
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

    /// Tables for people (wide: more columns) or JSON or YAML for scripts.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,

    /// Log format on stderr (`RUST_LOG` filters; default `warn`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "CAIRN_LOG_FORMAT")]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

/// How results are shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned tables and key/value blocks.
    Table,
    /// Tables with more columns (labels, generations, sandboxes, whole texts).
    Wide,
    /// One JSON document (or one object per line where output streams).
    Json,
    /// The same document as `json`, in YAML.
    Yaml,
}

impl Output {
    /// Whether this is a document for scripts (JSON or YAML) rather than
    /// text for people; progress bars and other decorations stay off then.
    pub fn is_document(self) -> bool {
        matches!(self, Self::Json | Self::Yaml)
    }

    /// Whether tables get their extra columns.
    pub fn is_wide(self) -> bool {
        self == Self::Wide
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create, list and show workspaces.
    #[command(subcommand)]
    Workspace(WorkspaceCommand),
    /// List a workspace's checkpoints, newest first, with why retention
    /// keeps each and until when; pin or unpin one.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Checkpoints {
        /// Workspace id or name (as `checkpoints list WS`).
        #[arg(required = true)]
        workspace: Option<String>,
        #[command(subcommand)]
        command: Option<CheckpointsCommand>,
    },
    /// Run a garbage collection cycle now (admin token): retention, then
    /// the packs no checkpoint references, past the grace period.
    Gc {
        /// Say what it would delete and free; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// What the tenant stores: packs, bytes, what waits to be freed (admin token).
    Storage,
    /// Rewrite a workspace's data packs that are mostly dead into packs of
    /// their live blobs (this machine reads the trees with the workspace's
    /// key); `gc` then frees the old ones.
    Compact {
        /// Workspace id or name.
        workspace: String,
        /// Rewrite packs with less than this share live (0 to 1).
        #[arg(long, default_value_t = 0.5)]
        threshold: f64,
        /// Say what would be rewritten; change nothing.
        #[arg(long)]
        dry_run: bool,
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
        #[command(flatten)]
        pack_cache: cairn_runner::cli::PackCacheArgs,
        #[command(flatten)]
        existing: cairn_runner::cli::ExistingFilesArgs,
        /// Warn on stderr when the restored checkpoint is older than this
        /// (the work after it is not in the tree); 0 never warns.
        #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = humantime::parse_duration)]
        warn_older_than: std::time::Duration,
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
    /// Create runs and follow, answer, suspend or cancel them.
    #[command(subcommand)]
    Runs(RunsCommand),
    /// List hosts; cordon, uncordon or drain one (admin token).
    #[command(subcommand)]
    Hosts(HostsCommand),
    /// Create, list and revoke tokens of clients and hosts (admin token).
    #[command(subcommand)]
    Tokens(TokensCommand),
    /// Run everything locally, no set-up: an embedded coordinator, two hosts,
    /// and a run that works, asks a question, loses its host and resumes on
    /// the other one when answered. Exits 0 only if the resumed agent
    /// remembered its first turn.
    Demo(demo::DemoArgs),
    /// Print a completion script for SHELL on stdout, e.g.
    /// `cairnctl completions bash > /etc/bash_completion.d/cairnctl`, or
    /// `source <(cairnctl completions bash)` in ~/.bashrc.
    Completions {
        /// The shell to complete for.
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Subcommand)]
pub enum RunsCommand {
    /// Ask for agent work on a workspace (queued until a host takes it).
    Create(runs::CreateArgs),
    /// List runs, newest first.
    List {
        #[command(flatten)]
        filter: runs::RunFilter,
    },
    /// Keep the runs table current: redrawn in place on a terminal, one
    /// line (or with -o json, one JSON object) per change otherwise;
    /// Ctrl-C stops.
    Watch(watch::WatchArgs),
    /// Show a run: state and why, question, summary, session, attempts.
    Show {
        /// Run id.
        run: String,
    },
    /// The run's events: time, state, reason, host, attempt/generation,
    /// checkpoint, detail.
    Events {
        /// Run id.
        run: String,
        /// Keep printing new events until the run ends.
        #[arg(long, short)]
        follow: bool,
    },
    /// Answer a run's question: to its held sandbox while it waits, or by
    /// starting the next attempt once it is suspended.
    Answer {
        /// Run id.
        run: String,
        /// The answer.
        text: String,
    },
    /// Checkpoint and release the run's sandbox; an answer resumes it.
    Suspend {
        /// Run id.
        run: String,
        /// Why, for the run's events.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Stop a run for good (its sandbox is destroyed after a checkpoint).
    Cancel {
        /// Run id.
        run: String,
        /// Why, for the run's events.
        #[arg(long, default_value = "")]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum CheckpointsCommand {
    /// List a workspace's checkpoints (what `checkpoints WS` does).
    List {
        /// Workspace id or name.
        workspace: String,
    },
    /// Keep a checkpoint past its workspace's retention.
    Pin {
        /// Checkpoint id (ck-…).
        checkpoint: String,
        /// Until when (RFC 3339, e.g. 2027-01-31T00:00:00Z); without it,
        /// until unpinned.
        #[arg(long, value_parser = humantime::parse_rfc3339_weak)]
        until: Option<std::time::SystemTime>,
        /// Why (a-z, 0-9, '-', '_'); one pin per reason.
        #[arg(long, default_value = "pinned")]
        reason: String,
    },
    /// Remove a pin.
    Unpin {
        /// Checkpoint id (ck-…).
        checkpoint: String,
        /// The pin's reason.
        #[arg(long, default_value = "pinned")]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum HostsCommand {
    /// List hosts: state, slots, labels, last heartbeat, runs.
    List,
    /// Place no new runs on a host.
    Cordon {
        /// Host id or name.
        host: String,
    },
    /// Place runs on a cordoned host again.
    Uncordon {
        /// Host id or name.
        host: String,
    },
    /// Cordon a host and release its sandboxes: running runs resume
    /// elsewhere, waiting ones are suspended.
    Drain {
        /// Host id or name.
        host: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Create a token (printed once). A host token is an enrollment token:
    /// it registers a new host, which then uses the token bound to it.
    Create {
        /// What the token may do.
        #[arg(long, value_enum)]
        scope: tokens::Scope,
        /// A note stored with the token (who or what uses it).
        #[arg(long)]
        description: Option<String>,
        /// Refuse the token after this long (30d, 12h, 90m); without it the
        /// token lives until revoked.
        #[arg(long, value_parser = tokens::parse_expires_in)]
        expires_in: Option<std::time::Duration>,
    },
    /// List admin, client and host tokens: scope, status, expiry, bound host.
    List,
    /// Revoke a token: refused from its next call on.
    Revoke {
        /// The token's id (tok-…), from `tokens list`.
        id: String,
    },
}

pub(crate) fn parse_run_state(text: &str) -> Result<RunState, String> {
    text.parse::<RunState>().map_err(|e| e.reason)
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
    /// Make N workspaces from one checkpoint (no data is copied); their first
    /// runs fork the conversation where the harness can.
    Fork {
        /// Workspace id or name.
        workspace: String,
        /// How many workspaces to make (1 to 64).
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// The checkpoint to fork from (default: the newest).
        #[arg(long)]
        checkpoint: Option<String>,
        /// Name the new workspaces PREFIX-1 … PREFIX-N (default: <name>-fork).
        #[arg(long)]
        name_prefix: Option<String>,
    },
    /// Send a chat message to a workspace station: an input of its
    /// unfinished run there, or pending until the next run there starts.
    Send {
        /// Workspace id or name.
        workspace: String,
        /// The message (up to 64 KiB).
        text: String,
        /// The station (default: "default").
        #[arg(long)]
        station: Option<String>,
    },
    /// List a workspace's messages and where each is: pending, delivered to
    /// a run, or heard by its harness.
    Messages {
        /// Workspace id or name.
        workspace: String,
    },
    /// Show the handoff notes runs left on a workspace, oldest first: run,
    /// station, time, and what changed, was checked, is uncertain, comes next.
    Notes {
        /// Workspace id or name.
        workspace: String,
    },
    /// Finish a workspace: it takes no new runs, checkpoints or forks, and
    /// is deleted once its retention period has passed.
    Finish {
        /// Workspace id or name.
        workspace: String,
    },
    /// Delete a workspace now: its checkpoints go at once, and garbage
    /// collection frees the packs nothing else references.
    Delete {
        /// Workspace id or name.
        workspace: String,
    },
    /// Set a workspace's own retention (without flags: show it).
    Retention {
        /// Workspace id or name.
        workspace: String,
        /// Keep this many of the newest checkpoints (0: the server's default).
        #[arg(long)]
        keep_last: Option<u32>,
        /// Delete it this long after it is finished (e.g. 3days; 0s: the
        /// server's default).
        #[arg(long, value_parser = humantime::parse_duration)]
        finished_expiry: Option<std::time::Duration>,
    },
}

/// Runs a parsed command line to completion and prints any error, with
/// the next step where cairnctl knows one.
pub fn run_to_exit(cli: Cli) -> ExitCode {
    let circumstances = errors::Circumstances {
        coordinator: cli.coordinator.clone(),
        token_given: cli.token.as_deref().is_some_and(|t| !t.trim().is_empty()),
        listing: listing_of(&cli.command),
    };
    cairn_utils::program::run(async move {
        run(cli)
            .await
            .map_err(|e| errors::explain(&e, &circumstances))
    })
}

/// The command that lists what `command` names, for when it is not found.
fn listing_of(command: &Command) -> Option<&'static str> {
    Some(match command {
        Command::Runs(_) => "cairnctl runs list",
        Command::Checkpoints {
            command: Some(CheckpointsCommand::Pin { .. } | CheckpointsCommand::Unpin { .. }),
            ..
        } => "cairnctl checkpoints WS",
        Command::Workspace(_)
        | Command::Checkpoints { .. }
        | Command::Checkout { .. }
        | Command::Verify { .. }
        | Command::Compact { .. } => "cairnctl workspace list",
        Command::Hosts(_) => "cairnctl hosts list",
        Command::Tokens(_) => "cairnctl tokens list",
        _ => return None,
    })
}

/// Runs one command. `Ok(FAILURE)` means the command ran and found problems.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let output = cli.output;
    // The demo brings its own coordinator.
    let command = match cli.command {
        Command::Demo(args) => return demo::run(args, output).await,
        Command::Completions { shell } => return completions(shell),
        command => command,
    };
    let coordinator = CoordinatorClient::connect(&cli.coordinator, cli.token.as_deref()).await?;
    match command {
        Command::Demo(args) => demo::run(args, output).await,
        Command::Completions { shell } => completions(shell),
        Command::Workspace(WorkspaceCommand::Create { name }) => {
            workspace::create(&coordinator, name, output).await
        }
        Command::Workspace(WorkspaceCommand::List) => workspace::list(&coordinator, output).await,
        Command::Workspace(WorkspaceCommand::Show { workspace }) => {
            workspace::show(&coordinator, &workspace, output).await
        }
        Command::Workspace(WorkspaceCommand::Fork {
            workspace,
            count,
            checkpoint,
            name_prefix,
        }) => {
            let request = pb::ForkWorkspaceRequest {
                workspace,
                checkpoint_id: checkpoint.unwrap_or_default(),
                count,
                name_prefix: name_prefix.unwrap_or_default(),
            };
            workspace::fork(&coordinator, request, output).await
        }
        Command::Workspace(WorkspaceCommand::Send {
            workspace,
            text,
            station,
        }) => {
            let request = pb::SendMessageRequest {
                workspace,
                text,
                station: station.unwrap_or_default(),
            };
            workspace::send(&coordinator, request, output).await
        }
        Command::Workspace(WorkspaceCommand::Messages { workspace }) => {
            workspace::messages(&coordinator, &workspace, output).await
        }
        Command::Workspace(WorkspaceCommand::Notes { workspace }) => {
            workspace::notes(&coordinator, &workspace, output).await
        }
        Command::Checkpoints { workspace, command } => match (workspace, command) {
            (_, Some(CheckpointsCommand::List { workspace })) | (Some(workspace), None) => {
                checkpoints::list(&coordinator, &workspace, output).await
            }
            (
                _,
                Some(CheckpointsCommand::Pin {
                    checkpoint,
                    until,
                    reason,
                }),
            ) => checkpoints::pin(&coordinator, &checkpoint, &reason, until, output).await,
            (_, Some(CheckpointsCommand::Unpin { checkpoint, reason })) => {
                checkpoints::unpin(&coordinator, &checkpoint, &reason, output).await
            }
            (None, None) => anyhow::bail!("name a workspace: cairnctl checkpoints WS"),
        },
        Command::Gc { dry_run } => gc::collect(&coordinator, dry_run, output).await,
        Command::Storage => gc::storage(&coordinator, output).await,
        Command::Compact {
            workspace,
            threshold,
            dry_run,
        } => {
            let opts = cairn_engine::compact::CompactOptions {
                workspace,
                threshold,
                dry_run,
            };
            gc::compact(&coordinator, opts, output).await
        }
        Command::Workspace(WorkspaceCommand::Finish { workspace }) => {
            workspace::end(&coordinator, &workspace, workspace::Ending::Finish, output).await
        }
        Command::Workspace(WorkspaceCommand::Delete { workspace }) => {
            workspace::end(&coordinator, &workspace, workspace::Ending::Delete, output).await
        }
        Command::Workspace(WorkspaceCommand::Retention {
            workspace,
            keep_last,
            finished_expiry,
        }) => {
            let request = pb::SetRetentionRequest {
                workspace,
                keep_last,
                finished_expiry: finished_expiry.map(cairn_proto::runs::to_proto_duration),
            };
            workspace::set_retention(&coordinator, request, output).await
        }
        Command::Checkout {
            workspace,
            dest,
            checkpoint,
            pack_cache,
            existing,
            warn_older_than,
        } => {
            let checkout = checkout::Checkout {
                workspace: &workspace,
                dest,
                checkpoint: checkpoint.as_deref(),
                pack_cache: pack_cache.config(),
                verify_existing: existing.verify_existing,
                warn_older_than,
            };
            checkout::run(&coordinator, checkout, output).await
        }
        Command::Verify {
            workspace,
            read_data,
        } => verify::run(&coordinator, &workspace, read_data, output).await,
        Command::Runs(command) => run_runs(&coordinator, command, output).await,
        Command::Hosts(command) => {
            let (action, host) = match command {
                HostsCommand::List => return hosts::list(&coordinator, output).await,
                HostsCommand::Cordon { host } => (hosts::Action::Cordon, host),
                HostsCommand::Uncordon { host } => (hosts::Action::Uncordon, host),
                HostsCommand::Drain { host } => (hosts::Action::Drain, host),
            };
            hosts::act(&coordinator, action, &host, output).await
        }
        Command::Tokens(TokensCommand::Create {
            scope,
            description,
            expires_in,
        }) => tokens::create(&coordinator, scope, description, expires_in, output).await,
        Command::Tokens(TokensCommand::List) => tokens::list(&coordinator, output).await,
        Command::Tokens(TokensCommand::Revoke { id }) => {
            tokens::revoke(&coordinator, &id, output).await
        }
    }
}

async fn run_runs(
    coordinator: &CoordinatorClient,
    command: RunsCommand,
    output: Output,
) -> anyhow::Result<ExitCode> {
    let (action, run, text) = match command {
        RunsCommand::Create(args) => return runs::create(coordinator, args, output).await,
        RunsCommand::List { filter } => return runs::list(coordinator, &filter, output).await,
        RunsCommand::Watch(args) => return watch::run(coordinator, args, output).await,
        RunsCommand::Show { run } => return runs::show(coordinator, &run, output).await,
        RunsCommand::Events { run, follow } => {
            return runs::events(coordinator, &run, follow, output).await;
        }
        RunsCommand::Answer { run, text } => (runs::Action::Answer, run, text),
        RunsCommand::Suspend { run, reason } => (runs::Action::Suspend, run, reason),
        RunsCommand::Cancel { run, reason } => (runs::Action::Cancel, run, reason),
    };
    runs::act(coordinator, action, &run, text, output).await
}

/// Writes the completion script for `shell` to stdout.
fn completions(shell: clap_complete::Shell) -> anyhow::Result<ExitCode> {
    use clap::CommandFactory as _;
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "cairnctl", &mut script);
    emit(String::from_utf8_lossy(&script).trim_end())?;
    Ok(ExitCode::SUCCESS)
}

/// A refused RPC as an error naming what was attempted and the status in
/// words; the status stays inside for [`errors::explain`] to decide on.
fn rpc_error(what: &'static str) -> impl FnOnce(tonic::Status) -> anyhow::Error {
    move |status| errors::RpcError { what, status }.into()
}

/// Every checkpoint of a workspace, newest first, across pages.
async fn all_checkpoints(
    coordinator: &CoordinatorClient,
    workspace: &str,
) -> anyhow::Result<Vec<pb::Checkpoint>> {
    coordinator
        .all_checkpoints(workspace)
        .await
        .map_err(rpc_error("listing checkpoints"))
}

/// Prints `value` as one document: YAML for `-o yaml`, else JSON. Both
/// come from the same value so a script may switch languages freely.
fn print_document(out: Output, value: &serde_json::Value) -> anyhow::Result<()> {
    emit(&document_text(value, out)?)
}

fn document_text(value: &serde_json::Value, out: Output) -> anyhow::Result<String> {
    Ok(match out {
        Output::Yaml => yaml_serde::to_string(value)
            .context("encoding YAML")?
            .trim_end()
            .to_owned(),
        Output::Table | Output::Wide | Output::Json => {
            serde_json::to_string_pretty(value).context("encoding JSON")?
        }
    })
}

/// Prints one item of a stream that never ends in one document: a JSON
/// object per line, or a YAML document per item (`---` before each).
fn print_stream_item(value: &serde_json::Value, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Yaml => emit(&format!("---\n{}", document_text(value, out)?)),
        _ => emit(&serde_json::to_string(value).context("encoding JSON")?),
    }
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
    fn bash_completions_offer_the_subcommands_and_output_formats() {
        let mut script = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut Cli::command(),
            "cairnctl",
            &mut script,
        );
        let script = String::from_utf8(script).unwrap();
        assert!(
            script.contains("complete -F _cairnctl"),
            "not a bash completion script"
        );
        for word in [
            "checkout",
            "verify",
            "runs",
            "watch",
            "completions",
            "yaml",
            "wide",
        ] {
            assert!(script.contains(word), "{word} is not offered");
        }
    }

    #[test]
    fn yaml_is_the_same_document_as_json() {
        let value = serde_json::json!({
            "id": "ws-1",
            "name": "yes",
            "count": 3,
            "ratio": 0.5,
            "none": null,
            "list": [{"id": "ck-1", "text": "line one\nline two"}],
        });
        let yaml = document_text(&value, Output::Yaml).unwrap();
        let back: serde_json::Value = yaml_serde::from_str(&yaml).unwrap();
        assert_eq!(back, value, "{yaml}");
        let json = document_text(&value, Output::Json).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&json).unwrap(),
            value
        );
        let cli = Cli::try_parse_from(["cairnctl", "-o", "wide", "runs", "list"]).unwrap();
        assert!(cli.output.is_wide() && !cli.output.is_document());
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
