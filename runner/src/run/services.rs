//! Workspace services: the processes a workspace needs while the agent works
//! (a database, a dev server), declared in `/workspace/.cairn/services.toml`:
//!
//! ```toml
//! [[service]]
//! name = "db"
//! command = "postgres -D data -p 5433"   # split like a shell would
//! cwd = "app"                            # relative to the root (default: the root)
//! env = { PGDATA = "data" }
//! health = { tcp = 5433, timeout = "30s" }
//!
//! [[service]]
//! name = "web"
//! command = "npm run dev"
//! health = { command = "curl -fsS http://127.0.0.1:3000/health", interval = "500ms" }
//! ```
//!
//! A checkpoint holds files, never processes, so after every restore (and in
//! a fresh workspace) the runner starts each service in its own process
//! group, waits until its health check passes (a command that exits 0, or a
//! TCP port that accepts on 127.0.0.1), and reports each result in the
//! attempt's prepare step. An unhealthy service does not stop the run: the
//! agent may be the one to fix it. Output goes to `.cairn/logs/<name>.log`,
//! which checkpoints leave out. When the attempt ends the services get
//! SIGTERM, then SIGKILL; if the runner itself is killed, the host ends them
//! with the sandbox's session.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::harness::template;

/// The declaration, relative to the root.
pub const SERVICES_FILE: &str = ".cairn/services.toml";
/// Service logs, relative to the root (left out of checkpoints).
pub const LOG_DIR: &str = ".cairn/logs";

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);
const STOP_GRACE: Duration = Duration::from_secs(5);
const MAX_SERVICES: usize = 32;

/// Why the services file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ServicesError {
    #[error("cannot read {SERVICES_FILE}: {0}")]
    Read(std::io::Error),
    #[error("{SERVICES_FILE} is not valid: {0}")]
    Invalid(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    service: Vec<ServiceSpec>,
}

/// One declared service.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    pub name: String,
    pub command: String,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub health: Option<HealthSpec>,
}

/// How to tell that a service is up.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HealthSpec {
    /// A command that exits 0 once the service is healthy.
    #[serde(default)]
    pub command: Option<String>,
    /// A port on 127.0.0.1 that accepts connections once it is healthy.
    #[serde(default)]
    pub tcp: Option<u16>,
    /// How long to wait before calling it unhealthy (default 60s).
    #[serde(default)]
    pub timeout: Option<String>,
    /// Time between checks (default 250ms).
    #[serde(default)]
    pub interval: Option<String>,
}

/// A service checked and ready to start.
#[derive(Debug, Clone)]
struct Service {
    name: String,
    argv: Vec<String>,
    cwd: PathBuf,
    env: BTreeMap<String, String>,
    health: Health,
}

#[derive(Debug, Clone)]
enum Health {
    /// No check: started is as good as it gets.
    None,
    Command {
        argv: Vec<String>,
        timeout: Duration,
        interval: Duration,
    },
    Tcp {
        port: u16,
        timeout: Duration,
        interval: Duration,
    },
}

/// What became of one service, for the prepare step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Started {
    Healthy { name: String, after: Duration },
    Running { name: String },
    Unhealthy { name: String, reason: String },
}

impl fmt::Display for Started {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Healthy { name, after } => write!(
                f,
                "service {name}: healthy after {:.1}s",
                after.as_secs_f64()
            ),
            Self::Running { name } => write!(f, "service {name}: started (no health check)"),
            Self::Unhealthy { name, reason } => write!(
                f,
                "service {name}: unhealthy: {reason} (log: {LOG_DIR}/{name}.log)"
            ),
        }
    }
}

/// Reads and checks `root/.cairn/services.toml`; an absent file declares none.
fn declared(root: &Path) -> Result<Vec<Service>, ServicesError> {
    let text = match fs::read_to_string(root.join(SERVICES_FILE)) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(ServicesError::Read(e)),
    };
    let file: File = toml::from_str(&text).map_err(|e| ServicesError::Invalid(e.to_string()))?;
    if file.service.len() > MAX_SERVICES {
        return Err(ServicesError::Invalid(format!(
            "{} services; at most {MAX_SERVICES}",
            file.service.len()
        )));
    }
    let mut names = std::collections::BTreeSet::new();
    file.service
        .into_iter()
        .map(|spec| {
            let invalid =
                |what: String| ServicesError::Invalid(format!("service {:?}: {what}", spec.name));
            let name_ok = !spec.name.is_empty()
                && spec.name.len() <= 64
                && spec
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
                && !spec.name.starts_with('.');
            if !name_ok {
                return Err(invalid(
                    "the name must be letters, digits, '-', '_' or '.'".into(),
                ));
            }
            if !names.insert(spec.name.clone()) {
                return Err(invalid("the name is used twice".into()));
            }
            let argv = words(&spec.command).map_err(|e| invalid(format!("command: {e}")))?;
            let cwd = match &spec.cwd {
                None => root.to_path_buf(),
                Some(dir) => {
                    let relative = Path::new(dir);
                    if !relative
                        .components()
                        .all(|c| matches!(c, Component::Normal(_)))
                    {
                        return Err(invalid(format!(
                            "cwd {dir:?} must be a path inside the workspace"
                        )));
                    }
                    root.join(relative)
                }
            };
            let health = match spec.health {
                None => Health::None,
                Some(h) => {
                    let timeout = duration(h.timeout.as_deref(), DEFAULT_TIMEOUT)
                        .map_err(|e| invalid(format!("health.timeout: {e}")))?;
                    let interval = duration(h.interval.as_deref(), DEFAULT_INTERVAL)
                        .map_err(|e| invalid(format!("health.interval: {e}")))?;
                    match (h.command, h.tcp) {
                        (Some(command), None) => Health::Command {
                            argv: words(&command)
                                .map_err(|e| invalid(format!("health.command: {e}")))?,
                            timeout,
                            interval,
                        },
                        (None, Some(port)) => Health::Tcp {
                            port,
                            timeout,
                            interval,
                        },
                        _ => {
                            return Err(invalid(
                                "health needs exactly one of `command` and `tcp`".into(),
                            ));
                        }
                    }
                }
            };
            Ok(Service {
                name: spec.name,
                argv,
                cwd,
                env: spec.env,
                health,
            })
        })
        .collect()
}

fn words(command: &str) -> Result<Vec<String>, String> {
    let argv = template::split(command).map_err(|e| e.to_string())?;
    if argv.is_empty() {
        return Err("it is empty".into());
    }
    Ok(argv)
}

fn duration(text: Option<&str>, default: Duration) -> Result<Duration, String> {
    match text {
        None => Ok(default),
        Some(text) => humantime::parse_duration(text)
            .map_err(|e| format!("{text:?} is not a duration (e.g. 500ms, 30s): {e}")),
    }
}

/// The services of an attempt, running until [`Services::stop`].
#[derive(Debug, Default)]
pub struct Services {
    running: Vec<(String, tokio::process::Child)>,
}

impl Services {
    /// Starts every declared service and waits for its health check.
    /// Returns the services and one line per service (or one line saying
    /// why the file cannot be used).
    pub async fn start(root: &Path) -> (Self, Vec<String>) {
        let mut services = Self::default();
        let declared = match declared(root) {
            Ok(declared) => declared,
            Err(e) => return (services, vec![format!("services not started: {e}")]),
        };
        if declared.is_empty() {
            return (services, Vec::new());
        }
        let logs = root.join(LOG_DIR);
        if let Err(e) = fs::create_dir_all(&logs) {
            return (
                services,
                vec![format!(
                    "services not started: cannot create {LOG_DIR}: {e}"
                )],
            );
        }
        let mut lines = Vec::new();
        for service in declared {
            let started = services.start_one(&service, &logs).await;
            tracing::info!(service = %service.name, "{started}");
            lines.push(started.to_string());
        }
        (services, lines)
    }

    async fn start_one(&mut self, service: &Service, logs: &Path) -> Started {
        let name = service.name.clone();
        let unhealthy = |reason: String| Started::Unhealthy {
            name: name.clone(),
            reason,
        };
        let log = match fs::File::create(logs.join(format!("{}.log", service.name))) {
            Ok(log) => log,
            Err(e) => return unhealthy(format!("cannot create its log: {e}")),
        };
        let stderr = match log.try_clone() {
            Ok(stderr) => stderr,
            Err(e) => return unhealthy(format!("cannot create its log: {e}")),
        };
        let mut command = tokio::process::Command::new(&service.argv[0]);
        command
            .args(&service.argv[1..])
            .current_dir(&service.cwd)
            .envs(&service.env)
            .env_remove("CAIRN_RUN_TOKEN")
            .env_remove("CAIRN_TOKEN")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(true);
        let child = match command.spawn() {
            Ok(child) => child,
            Err(e) => return unhealthy(format!("cannot start {:?}: {e}", service.argv[0])),
        };
        self.running.push((service.name.clone(), child));
        let (_, child) = self.running.last_mut().expect("just pushed");
        let began = Instant::now();
        let (timeout, interval) = match &service.health {
            Health::None => return Started::Running { name },
            Health::Command {
                timeout, interval, ..
            }
            | Health::Tcp {
                timeout, interval, ..
            } => (*timeout, *interval),
        };
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return unhealthy(format!("it exited ({status}) before it was healthy"));
            }
            let healthy = match &service.health {
                Health::None => true,
                Health::Command { argv, .. } => tokio::process::Command::new(&argv[0])
                    .args(&argv[1..])
                    .current_dir(&service.cwd)
                    .envs(&service.env)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .kill_on_drop(true)
                    .status()
                    .await
                    .is_ok_and(|s| s.success()),
                Health::Tcp { port, .. } => tokio::net::TcpStream::connect(("127.0.0.1", *port))
                    .await
                    .is_ok(),
            };
            if healthy {
                return Started::Healthy {
                    name,
                    after: began.elapsed(),
                };
            }
            if began.elapsed() >= timeout {
                return unhealthy(format!(
                    "its health check did not pass within {}",
                    humantime::format_duration(timeout)
                ));
            }
            tokio::time::sleep(interval).await;
        }
    }

    /// Stops every service: SIGTERM to its process group, SIGKILL after a grace.
    pub async fn stop(mut self) {
        for (_, child) in &self.running {
            if let Some(pid) = child.id() {
                signal_group(pid as i32, libc::SIGTERM);
            }
        }
        let deadline = tokio::time::Instant::now() + STOP_GRACE;
        for (name, child) in &mut self.running {
            let pgid = child.id().map(|pid| pid as i32);
            if tokio::time::timeout_at(deadline, child.wait())
                .await
                .is_err()
            {
                tracing::warn!(service = %name, "the service did not stop on SIGTERM; killing it");
            }
            // The group may hold children that outlive the service's own process.
            if let Some(pgid) = pgid {
                signal_group(pgid, libc::SIGKILL);
            }
            let _ = child.wait().await;
        }
    }
}

fn signal_group(pgid: i32, signal: libc::c_int) {
    // SAFETY: killpg takes no pointers; a gone group only returns ESRCH.
    unsafe { libc::killpg(pgid, signal) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace(services_toml: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join(".cairn")).unwrap();
        fs::write(dir.path().join(SERVICES_FILE), services_toml).unwrap();
        dir
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[tokio::test]
    async fn services_start_report_their_health_and_stop() {
        let port = free_port();
        let dir = workspace(&format!(
            r#"
[[service]]
name = "web"
command = "python3 -m http.server {port} --bind 127.0.0.1"
health = {{ tcp = {port}, timeout = "20s", interval = "50ms" }}

[[service]]
name = "marker"
command = "sh -c 'sleep 0.3; echo up > ready; exec sleep 600'"
env = {{ GREETING = "hi" }}
health = {{ command = "test -f ready", interval = "50ms" }}

[[service]]
name = "broken"
command = "sh -c 'echo no database >&2; exit 3'"
health = {{ command = "false", timeout = "5s", interval = "50ms" }}

[[service]]
name = "quiet"
command = "sleep 600"
"#
        ));
        let (services, lines) = Services::start(dir.path()).await;
        assert_eq!(lines.len(), 4, "{lines:?}");
        assert!(
            lines[0].starts_with("service web: healthy after "),
            "{lines:?}"
        );
        assert!(
            lines[1].starts_with("service marker: healthy after "),
            "{lines:?}"
        );
        assert!(
            lines[2].starts_with(
                "service broken: unhealthy: it exited (exit status: 3) before it was healthy"
            ),
            "{lines:?}"
        );
        assert_eq!(lines[3], "service quiet: started (no health check)");
        let log = fs::read_to_string(dir.path().join(LOG_DIR).join("broken.log")).unwrap();
        assert_eq!(log, "no database\n");
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());

        let pids: Vec<u32> = services
            .running
            .iter()
            .filter_map(|(_, c)| c.id())
            .collect();
        services.stop().await;
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "the web service is stopped"
        );
        for pid in pids {
            let alive =
                fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "));
            assert!(!alive, "process {pid} outlived stop()");
        }
    }

    #[tokio::test]
    async fn a_bad_declaration_is_reported_and_nothing_starts() {
        for (toml, expected) in [
            ("[[service]]\nname = \"a\"\n", "missing field `command`"),
            (
                "[[service]]\nname = \"a\"\ncommand = \"x\"\ncwd = \"../etc\"\n",
                "must be a path inside the workspace",
            ),
            (
                "[[service]]\nname = \"a\"\ncommand = \"x\"\n[[service]]\nname = \"a\"\ncommand = \"y\"\n",
                "the name is used twice",
            ),
            (
                "[[service]]\nname = \"a\"\ncommand = \"x\"\nhealth = { tcp = 1, command = \"y\" }\n",
                "exactly one of `command` and `tcp`",
            ),
            (
                "[[service]]\nname = \"a\"\ncommand = \"x\"\nhealth = { tcp = 1, timeout = \"soon\" }\n",
                "health.timeout",
            ),
        ] {
            let dir = workspace(toml);
            let (services, lines) = Services::start(dir.path()).await;
            assert!(services.running.is_empty());
            assert_eq!(lines.len(), 1);
            assert!(
                lines[0].starts_with("services not started: .cairn/services.toml is not valid")
                    && lines[0].contains(expected),
                "{toml}: {lines:?}"
            );
        }
        let none = tempfile::tempdir().unwrap();
        let (services, lines) = Services::start(none.path()).await;
        assert!(services.running.is_empty() && lines.is_empty());
    }
}
