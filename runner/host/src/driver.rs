//! What a sandbox driver does: start a sandbox for an assignment, report
//! when it is up and when it ends, and destroy it.
//!
//! The host agent owns everything around a driver (directories, records,
//! reports to the coordinator); a driver only turns a [`SandboxSpec`] into
//! running processes and ends them. Two drivers exist: [`super::local`]
//! (a mount namespace per sandbox) and [`super::exec`] (operator-supplied
//! commands: docker, podman, kubectl, bwrap, …).

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::layout::{SandboxPaths, SandboxRecord};
use super::template::RenderError;

/// How a process ended: `Some(n)` exit status n, `Some(-n)` killed by signal n,
/// `None` unknown (a process this host agent did not start).
pub type ExitCode = Option<i32>;

/// One variable of a sandbox's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvVar {
    pub name: String,
    pub value: String,
    /// Means the same inside a container as on the host (not a host path), so
    /// the exec driver's `{env_args}` passes it on.
    pub portable: bool,
}

/// Everything a driver needs to start (or take back) one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub sandbox_id: String,
    pub run_id: String,
    pub attempt: u32,
    /// The image to use (the run's, else the host's default; may be empty).
    pub image: String,
    pub paths: SandboxPaths,
    /// The runner's environment: CAIRN_COORDINATOR, CAIRN_RUN_TOKEN,
    /// CAIRN_CACHE_DIR, HOME, CAIRN_SANDBOX_ID and the host's `--env` extras.
    pub env: Vec<EnvVar>,
    /// Where the sandbox's processes write stdout and stderr.
    pub log_file: PathBuf,
}

impl SandboxSpec {
    pub fn env_value(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|v| v.name == name)
            .map(|v| v.value.as_str())
    }
}

/// Something that happened to a sandbox on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SandboxEvent {
    /// The sandbox is up (its runner runs).
    Up,
    /// The sandbox's process ended by itself.
    Ended(ExitCode),
    /// The sandbox could not be brought up.
    Failed(String),
}

/// How a destroyed sandbox ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destroyed {
    pub exit_code: ExitCode,
    /// For people: what it took ("exited with status 0 after SIGTERM", …).
    pub detail: String,
}

/// Why a sandbox could not be started.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("cannot open the sandbox log {}: {source}", path.display())]
    Log { path: PathBuf, source: io::Error },
    #[error("cannot start {program}: {source}")]
    Spawn { program: String, source: io::Error },
    #[error(transparent)]
    Render(#[from] RenderError),
}

/// A way of running sandboxes on this machine.
pub trait Driver: Send + Sync + 'static {
    type Sandbox: Sandbox;

    /// "local" or "exec", as registered with the coordinator.
    fn kind(&self) -> &'static str;

    /// Starts the sandbox's processes and returns at once; the sandbox reports
    /// [`SandboxEvent::Up`] when it is running.
    fn start(&self, spec: &SandboxSpec) -> Result<Self::Sandbox, DriverError>;

    /// Takes back a sandbox an earlier process of the host agent started (it
    /// is then destroyed). `None` when nothing of it can be found or reached.
    fn adopt(&self, spec: &SandboxSpec, record: &SandboxRecord) -> Option<Self::Sandbox>;
}

/// A sandbox a driver started.
pub trait Sandbox: Send + 'static {
    /// Pid and start time of the sandbox's session leader on this machine, if
    /// it has one (recorded so a restarted agent can find it).
    fn leader(&self) -> Option<(i32, u64)>;

    /// Whether the sandbox runs apart from any process of ours (an exec
    /// create command that returned).
    fn detached(&self) -> bool;

    /// The next thing that happens to the sandbox on its own. Cancel-safe.
    fn next_event(&mut self) -> impl Future<Output = SandboxEvent> + Send;

    /// SIGTERM (or the destroy command), up to `grace` to end, then SIGKILL;
    /// returns when nothing of the sandbox runs any more.
    fn destroy(&mut self, grace: Duration) -> impl Future<Output = Destroyed> + Send;

    /// Cleans up after a sandbox that ended by itself (stray processes,
    /// a detached container's leftovers).
    fn release(&mut self) -> impl Future<Output = ()> + Send;
}

/// Opens (appending) the sandbox's log file twice, for stdout and stderr.
pub fn open_log(path: &Path) -> Result<(std::fs::File, std::fs::File), DriverError> {
    let open = || -> io::Result<(std::fs::File, std::fs::File)> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)?;
        let second = file.try_clone()?;
        Ok((file, second))
    };
    open().map_err(|source| DriverError::Log {
        path: path.to_owned(),
        source,
    })
}

/// The last `lines` non-empty lines of a sandbox log (for error details).
pub fn log_tail(path: &Path, lines: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    const MAX_TAIL_BYTES: u64 = 8192;
    let read = || -> io::Result<String> {
        let mut file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(MAX_TAIL_BYTES)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    let text = read().unwrap_or_default();
    let tail: Vec<&str> = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .collect();
    tail[tail.len().saturating_sub(lines)..].join("\n")
}
