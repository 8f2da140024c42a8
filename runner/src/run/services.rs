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
use cairn_utils::process::signal_group;

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
    /// None: started is as good as it gets.
    health: Option<Health>,
}

#[derive(Debug, Clone)]
struct Health {
    probe: Probe,
    timeout: Duration,
    interval: Duration,
}

#[derive(Debug, Clone)]
enum Probe {
    /// Exits 0 once the service is healthy.
    Command(Vec<String>),
    /// Accepts connections on 127.0.0.1 once the service is healthy.
    Tcp(u16),
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
                None => None,
                Some(h) => Some(Health {
                    probe: match (h.command, h.tcp) {
                        (Some(command), None) => Probe::Command(
                            words(&command).map_err(|e| invalid(format!("health.command: {e}")))?,
                        ),
                        (None, Some(port)) => Probe::Tcp(port),
                        _ => {
                            return Err(invalid(
                                "health needs exactly one of `command` and `tcp`".into(),
                            ));
                        }
                    },
                    timeout: duration(h.timeout.as_deref(), DEFAULT_TIMEOUT)
                        .map_err(|e| invalid(format!("health.timeout: {e}")))?,
                    interval: duration(h.interval.as_deref(), DEFAULT_INTERVAL)
                        .map_err(|e| invalid(format!("health.interval: {e}")))?,
                }),
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
    running: Vec<Running>,
}

#[derive(Debug)]
struct Running {
    name: String,
    /// Its own process group (its pid, kept: a reaped child has no id).
    pgid: i32,
    child: tokio::process::Child,
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
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(true);
        for name in crate::harness::process::HIDDEN_ENV {
            command.env_remove(name);
        }
        let child = match command.spawn() {
            Ok(child) => child,
            Err(e) => return unhealthy(format!("cannot start {:?}: {e}", service.argv[0])),
        };
        // A child not yet waited for always has an id; never signal group 0 (ours).
        let Some(pgid) = child.id().map(|pid| pid as i32) else {
            return unhealthy("it ended as it started".into());
        };
        self.running.push(Running {
            name: name.clone(),
            pgid,
            child,
        });
        let child = &mut self.running.last_mut().expect("just pushed").child;
        let Some(health) = &service.health else {
            return Started::Running { name };
        };
        let began = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return unhealthy(format!("it exited ({status}) before it was healthy"));
            }
            let healthy = match &health.probe {
                Probe::Command(argv) => tokio::process::Command::new(&argv[0])
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
                Probe::Tcp(port) => tokio::net::TcpStream::connect(("127.0.0.1", *port))
                    .await
                    .is_ok(),
            };
            if healthy {
                return Started::Healthy {
                    name,
                    after: began.elapsed(),
                };
            }
            if began.elapsed() >= health.timeout {
                return unhealthy(format!(
                    "its health check did not pass within {}",
                    humantime::format_duration(health.timeout)
                ));
            }
            tokio::time::sleep(health.interval).await;
        }
    }

    /// Stops every service: SIGTERM to its process group, SIGKILL after a grace.
    pub async fn stop(mut self) {
        for service in &self.running {
            signal_group(service.pgid, libc::SIGTERM);
        }
        let deadline = tokio::time::Instant::now() + STOP_GRACE;
        for service in &mut self.running {
            if tokio::time::timeout_at(deadline, service.child.wait())
                .await
                .is_err()
            {
                tracing::warn!(service = %service.name, "the service did not stop on SIGTERM; killing it");
            }
            // The group may hold children that outlive the service's own process.
            signal_group(service.pgid, libc::SIGKILL);
            let _ = service.child.wait().await;
        }
    }
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

        let pids: Vec<i32> = services.running.iter().map(|r| r.pgid).collect();
        services.stop().await;
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "the web service is stopped"
        );
        for pid in pids {
            let alive = cairn_utils::process::read_stat(pid).is_some_and(|s| !s.is_zombie());
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
