//! The `cairn-runner` command line: flags, logging, then a call into the
//! library; what it prints for people and scripts.

mod ask;
mod checkpoint;
mod restore;
mod run;
mod watch;

use std::path::PathBuf;
use std::process::ExitCode;

use cairn_engine::checkpoint::CheckpointOptions;
use cairn_proto::domain::CheckpointReason;
use cairn_utils::logging::LogFormat;
use clap::{Args, Parser, Subcommand, ValueEnum};

/// cairn's in-sandbox runner: cuts verified, content-addressed checkpoints of
/// the workspace and restores them on any host.
#[derive(Debug, Parser)]
#[command(name = "cairn-runner", version)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "CAIRN_LOG_FORMAT")]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// A summary for people.
    Text,
    /// One JSON object on stdout, for scripts.
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Cut a checkpoint of the workspace and commit it to the coordinator.
    Checkpoint(CheckpointArgs),
    /// Restore the newest restorable checkpoint (or a chosen one) into the workspace.
    Restore(RestoreArgs),
    /// Stay resident: watch the workspace, checkpoint it every --interval
    /// when something changed, and cut a checkpoint whenever
    /// `cairn-runner checkpoint` asks through the control socket (only what
    /// changed is walked and read).
    Watch(WatchArgs),
    /// Run the attempt this sandbox was started for: restore, drive the
    /// harness, checkpoint, report (inside a sandbox, started by cairn-host).
    Run(RunArgs),
    /// End the agent's turn with a question for a person (writes the outcome file).
    Ask(AskArgs),
}

/// Where the coordinator is and how to authenticate.
#[derive(Debug, Clone, Args)]
pub struct CoordinatorArgs {
    /// Coordinator gRPC address, e.g. http://127.0.0.1:7400.
    #[arg(long, env = "CAIRN_COORDINATOR")]
    pub coordinator: String,

    /// Bearer token (admin, client or the attempt's run token).
    #[arg(long, env = "CAIRN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// Which workspace a checkpoint is of, and what it leaves out.
#[derive(Debug, Clone, Args)]
pub struct WorkspaceArgs {
    #[command(flatten)]
    pub coordinator: CoordinatorArgs,

    /// The workspace directory.
    #[arg(long, default_value = "/workspace")]
    pub root: PathBuf,

    /// Workspace id or name.
    #[arg(long, env = "CAIRN_WORKSPACE")]
    pub workspace: String,

    /// Where the fingerprint cache lives (outside the workspace).
    #[arg(long, env = "CAIRN_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,

    /// Leave out files that git ignores (node_modules, build outputs, …). A
    /// watcher then walks the whole workspace at every checkpoint: git's
    /// rules depend on more than what changed.
    #[arg(long)]
    pub skip_ignored: bool,

    /// Leave out paths matching this gitignore-style pattern (repeatable).
    #[arg(long = "exclude", value_name = "PATTERN")]
    pub excludes: Vec<String>,

    #[command(flatten)]
    pub limits: LimitArgs,
}

impl WorkspaceArgs {
    /// The cache directory, defaulted.
    pub fn cache_dir(&self) -> PathBuf {
        self.cache_dir.clone().unwrap_or_else(default_cache_dir)
    }

    pub fn limits(&self) -> cairn_proto::runs::CheckpointLimits {
        self.limits.limits()
    }

    /// The options of `cairn-runner checkpoint` and `watch`: at the
    /// workspace's current generation, outside any run.
    pub fn checkpoint_options(self, reason: CheckpointReason) -> CheckpointOptions {
        let limits = self.limits();
        CheckpointOptions {
            cache_dir: self.cache_dir(),
            coordinator: self.coordinator.coordinator,
            token: self.coordinator.token,
            workspace: self.workspace,
            root: self.root,
            reason,
            skip_ignored: self.skip_ignored,
            excludes: self.excludes,
            generation: None,
            harness: None,
            limits,
            resident: None,
        }
    }
}

/// Limits on what one checkpoint holds. Files inside `.git` directories and
/// the conversations under `.cairn/state` are always kept and not counted.
#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Leave out any file larger than SIZE (e.g. 512MiB, 2GB), with a
    /// warning on the checkpoint naming it. Default: no limit.
    #[arg(long, env = "CAIRN_MAX_FILE_SIZE", value_name = "SIZE", value_parser = cairn_proto::size::parse_size)]
    pub max_file_size: Option<u64>,

    /// Keep at most SIZE of file contents per checkpoint; above it the
    /// largest files are left out until the rest fits, each with a warning
    /// on the checkpoint. Default: no limit.
    #[arg(long, env = "CAIRN_MAX_TOTAL_SIZE", value_name = "SIZE", value_parser = cairn_proto::size::parse_size)]
    pub max_total_size: Option<u64>,
}

impl LimitArgs {
    pub fn limits(&self) -> cairn_proto::runs::CheckpointLimits {
        cairn_proto::runs::CheckpointLimits {
            max_file_bytes: self.max_file_size,
            max_total_bytes: self.max_total_size,
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct CheckpointArgs {
    #[command(flatten)]
    pub target: WorkspaceArgs,

    /// Why the checkpoint is cut: turn, pause, end, destroy, interval or manual.
    #[arg(long, default_value = "manual")]
    pub reason: String,

    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,

    /// Cut the checkpoint only if the workspace differs from its newest
    /// checkpoint; otherwise say which checkpoint still holds it and commit
    /// nothing (exit status 0).
    #[arg(long)]
    pub if_changed: bool,

    /// The control socket of a resident runner of this workspace (`cairn-runner
    /// watch`, or the `cairn-runner run` of this sandbox); when one answers
    /// there, it cuts the checkpoint. Default: the socket a resident runner of
    /// this root and cache directory would use, if it exists.
    #[arg(long, env = "CAIRN_CONTROL_SOCKET")]
    pub socket: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct WatchArgs {
    #[command(flatten)]
    pub target: WorkspaceArgs,

    /// How often to checkpoint (reason interval) when something changed.
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = humantime::parse_duration)]
    pub interval: std::time::Duration,

    /// Walk the whole workspace at least this often, whatever the change
    /// events say (a guard against events that never came).
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = humantime::parse_duration)]
    pub full_scan_interval: std::time::Duration,

    /// Where to listen for `cairn-runner checkpoint` (default: derived from
    /// the root and the cache directory, so that command finds it).
    #[arg(long, env = "CAIRN_CONTROL_SOCKET")]
    pub socket: Option<PathBuf>,
}

/// The host's pack cache, shared by the restores of one machine.
#[derive(Debug, Clone, Args)]
pub struct PackCacheArgs {
    /// Keep downloaded pack bytes in DIR, shared by every restore on this
    /// host (cairn-host passes its own), so a later restore of the same
    /// workspace, or of another one of the same tenant holding the same
    /// repository, reads them from disk. Everything read from it is verified
    /// like bytes from the store. Default: no pack cache.
    #[arg(long, env = "CAIRN_PACK_CACHE", value_name = "DIR")]
    pub pack_cache: Option<PathBuf>,

    /// Bound of the pack cache; the least recently used pieces are evicted
    /// (e.g. 10GiB, 512MiB, 2GB).
    #[arg(
        long,
        env = "CAIRN_PACK_CACHE_SIZE",
        value_name = "SIZE",
        default_value = "10GiB",
        value_parser = cairn_proto::size::parse_size
    )]
    pub pack_cache_size: u64,
}

impl PackCacheArgs {
    /// The cache to use, if any (a size of 0 turns it off).
    pub fn config(&self) -> Option<cairn_engine::restore::PackCacheConfig> {
        let dir = self.pack_cache.clone()?;
        (self.pack_cache_size > 0 && !dir.as_os_str().is_empty()).then_some(
            cairn_engine::restore::PackCacheConfig {
                dir,
                max_bytes: self.pack_cache_size,
            },
        )
    }
}

#[derive(Debug, Clone, Args)]
pub struct RestoreArgs {
    #[command(flatten)]
    pub coordinator: CoordinatorArgs,

    /// The directory to restore into (created if missing).
    #[arg(long, default_value = "/workspace")]
    pub root: PathBuf,

    /// Workspace id or name.
    #[arg(long, env = "CAIRN_WORKSPACE")]
    pub workspace: String,

    /// Restore exactly this checkpoint (no fallback to older ones).
    #[arg(long)]
    pub checkpoint: Option<String>,

    /// Where the fingerprint cache lives (outside the workspace).
    #[arg(long, env = "CAIRN_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,

    #[command(flatten)]
    pub pack_cache: PackCacheArgs,

    #[command(flatten)]
    pub existing: ExistingFilesArgs,

    /// Warn on stderr when the restored checkpoint is older than this (the
    /// work after it is not restored); 0 never warns.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = humantime::parse_duration)]
    pub warn_older_than: std::time::Duration,

    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

/// How a restore decides that a file already in its root can stay.
#[derive(Debug, Clone, Copy, Default, Args)]
pub struct ExistingFilesArgs {
    /// Read every file already in the root to compare its content, unless
    /// the runner's fingerprint cache knows it unchanged (inode and ctime
    /// included). By default a file with the size and mtime the checkpoint
    /// recorded is kept unread when that mtime lies safely before the
    /// checkpoint was taken (an older copy made by `cp -a`, `rsync -a` or
    /// a restore keeps both). Use this when a tool may have set
    /// mtimes back on changed files.
    #[arg(long)]
    pub verify_existing: bool,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Coordinator gRPC address, e.g. http://127.0.0.1:7400.
    #[arg(long, env = "CAIRN_COORDINATOR")]
    pub coordinator: String,

    /// The attempt's run token (the host agent passes it).
    #[arg(long, env = "CAIRN_RUN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// The workspace directory.
    #[arg(long, default_value = "/workspace")]
    pub root: PathBuf,

    /// Where the fingerprint cache lives (outside the workspace).
    #[arg(long, env = "CAIRN_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,

    #[command(flatten)]
    pub pack_cache: PackCacheArgs,

    #[command(flatten)]
    pub limits: LimitArgs,

    /// Where the agent's `cairn-runner checkpoint` asks this runner for a
    /// checkpoint (told to the agent as CAIRN_CONTROL_SOCKET; default:
    /// derived from the root and the cache directory).
    #[arg(long = "socket", env = "CAIRN_CONTROL_SOCKET")]
    pub control_socket: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct AskArgs {
    /// The question for a person (several words are joined with spaces).
    #[arg(required = true, num_args = 1..)]
    pub question: Vec<String>,

    /// The outcome file to write (default: /workspace/.cairn/outcome.json).
    #[arg(long, env = "CAIRN_OUTCOME_FILE")]
    pub outcome_file: Option<PathBuf>,
}

/// The default cache directory: `$HOME/.cache/cairn`, else `/var/cache/cairn`.
pub fn default_cache_dir() -> PathBuf {
    match std::env::var_os("HOME") {
        Some(home) if !home.is_empty() => PathBuf::from(home).join(".cache").join("cairn"),
        _ => PathBuf::from("/var/cache/cairn"),
    }
}

/// Entry point of the `cairn-runner` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    cairn_utils::logging::init(cli.log_format, "info");
    cairn_utils::program::run(async {
        match cli.command {
            Command::Checkpoint(args) => checkpoint::main(args).await,
            Command::Restore(args) => restore::main(args).await,
            Command::Watch(args) => watch::main(args).await,
            Command::Run(args) => run::main(args).await,
            Command::Ask(args) => ask::main(args),
        }
        .map(|()| ExitCode::SUCCESS)
    })
}
