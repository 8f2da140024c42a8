//! The demo's processes: finding the binaries it starts, choosing how the
//! hosts make sandboxes, starting `cairn-host`s, and stopping them — gently
//! (SIGTERM, so they destroy their sandboxes) or the hard way (SIGKILL to the
//! agent and every process of its sandboxes at once, as when a machine dies).
//!
//! Each host runs in a process group of its own, so a Ctrl-C in the terminal
//! reaches only `cairnctl`, which then stops the hosts in order. Sandboxes
//! are sessions of their own (the drivers `setsid`), so they are found
//! through `/proc`: the host's descendants and every member of their
//! sessions, remembered with their start times so a recycled pid is never
//! signalled.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use cairn_host::LocalDriver;
use cairn_utils::process::{ProcStat, read_stat, signal_group};
use tokio::process::{Child, Command};
use tokio::signal::unix::SignalKind;

/// SIGKILL is 9 on every Linux architecture (and in POSIX).
const SIGKILL: i32 = 9;

/// The binaries the demo starts, all from one directory.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub dir: PathBuf,
    pub host: PathBuf,
    pub runner: PathBuf,
    pub agent: PathBuf,
}

const HOST_BIN: &str = "cairn-host";
const RUNNER_BIN: &str = "cairn-runner";
const AGENT_BIN: &str = "cairn-demo-agent";

/// Under `cargo run` (cargo sets `CARGO` for the program it runs), builds
/// the runner's binaries into `dir`, the same profile as this cairnctl, so
/// `cargo run --release --bin cairnctl -- demo` needs nothing else. Returns
/// whether it ran a build that left all of them there.
fn build_with_cargo(dir: &Path) -> anyhow::Result<bool> {
    let Some(cargo) = std::env::var_os("CARGO") else {
        return Ok(false);
    };
    let profile = dir.file_name().and_then(|n| n.to_str());
    // This crate is coordinator/ctl in the workspace.
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .context("cairnctl's crate is not two levels below the workspace")?;
    let mut build = std::process::Command::new(cargo);
    build
        .arg("build")
        .arg("--manifest-path")
        .arg(workspace.join("Cargo.toml"))
        // The whole workspace, as `scripts/test` builds it: building one
        // package would unify features differently and rebuild dependencies.
        .args(["--workspace", "--bins"]);
    match profile {
        Some("release") => {
            build.arg("--release");
        }
        Some("debug") => {}
        // Not a cargo profile directory: leave it to the person.
        _ => return Ok(false),
    }
    eprintln!(
        "building cairn-host, cairn-runner and cairn-demo-agent for the demo (cargo build --workspace --bins)"
    );
    build.stdout(Stdio::null());
    let status = build
        .status()
        .context("cannot run cargo to build the demo's binaries")?;
    anyhow::ensure!(
        status.success(),
        "building the demo's binaries failed ({status})"
    );
    Ok([HOST_BIN, RUNNER_BIN, AGENT_BIN]
        .iter()
        .all(|name| dir.join(name).is_file()))
}

impl Binaries {
    /// The binaries in `dir`, by default the directory of this `cairnctl`
    /// (cargo puts every binary of a build there). Missing ones are named,
    /// with the build command that makes them.
    pub fn find(dir: Option<PathBuf>) -> anyhow::Result<Self> {
        let given = dir.is_some();
        let dir = match dir {
            Some(dir) => dir,
            None => std::env::current_exe()
                .context("cannot find where cairnctl is")?
                .parent()
                .context("cairnctl's path has no directory")?
                .to_owned(),
        };
        let missing = |dir: &Path| -> Vec<&'static str> {
            [HOST_BIN, RUNNER_BIN, AGENT_BIN]
                .into_iter()
                .filter(|name| !dir.join(name).is_file())
                .collect()
        };
        // Under cargo, build (or find up to date) the binaries of this same
        // source, so a stale or absent cairn-host is never what the demo runs.
        if !given {
            build_with_cargo(&dir)?;
        }
        let missing = missing(&dir);
        if !missing.is_empty() {
            let build = if dir.file_name().is_some_and(|n| n == "debug") {
                "cargo build --bins"
            } else {
                "cargo build --release --bins"
            };
            anyhow::bail!(
                "{} not found next to cairnctl in {}: build {} with `{build}` (or point --bin-dir at them)",
                missing.join(", "),
                dir.display(),
                if missing.len() == 1 { "it" } else { "them" },
            );
        }
        Ok(Self {
            host: dir.join(HOST_BIN),
            runner: dir.join(RUNNER_BIN),
            agent: dir.join(AGENT_BIN),
            dir,
        })
    }

    /// `PATH` for the sandboxes: the binaries' directory first.
    pub fn sandbox_path(&self) -> String {
        let mut dirs = vec![self.dir.clone()];
        if let Some(path) = std::env::var_os("PATH") {
            dirs.extend(std::env::split_paths(&path));
        }
        std::env::join_paths(dirs)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_else(|_| self.dir.display().to_string())
    }
}

/// How the demo's hosts make sandboxes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Driver {
    /// `--driver local`: a mount namespace per sandbox.
    Local { how: &'static str },
    /// `--driver exec` with a template, when the local driver cannot work here.
    Exec { tool: &'static str, create: String },
}

impl Driver {
    pub fn host_args(&self) -> Vec<String> {
        match self {
            Self::Local { .. } => vec!["--driver".into(), "local".into()],
            Self::Exec { create, .. } => vec![
                "--driver".into(),
                "exec".into(),
                "--exec-create".into(),
                create.clone(),
            ],
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Self::Local { how } => format!("local driver, /workspace {how}"),
            Self::Exec { tool, .. } => {
                format!("exec driver with {tool} (no mount namespaces for the local driver)")
            }
        }
    }
}

/// The bubblewrap template of `cairn-host --driver exec` (see its docs).
const BWRAP_TEMPLATE: &str =
    "{bwrap} --dev-bind / / --bind {workspace_dir} /workspace --chdir /workspace {runner} run";
/// The unshare template, for root where the local driver's probe failed.
const UNSHARE_TEMPLATE: &str = "{unshare} -m sh -c 'mount --bind {workspace_dir} /workspace && cd /workspace && exec {runner} run'";

/// Picks the local driver when this machine can make mount namespaces,
/// else an exec template with bubblewrap or unshare that works here, else
/// says what is needed. `scratch` is a directory the probes may use.
pub fn choose_driver(bins: &Binaries, scratch: &Path) -> anyhow::Result<Driver> {
    let local_error = match LocalDriver::new(&bins.runner, scratch) {
        Ok(driver) => {
            let how = match driver.mode() {
                cairn_host::NamespaceMode::Root => "in a mount namespace (root)",
                cairn_host::NamespaceMode::UserNamespace => "in a user namespace",
            };
            return Ok(Driver::Local { how });
        }
        Err(e) => e.to_string(),
    };
    let marker = scratch.join("cairn-demo-probe");
    std::fs::write(&marker, b"probe").with_context(|| format!("writing {}", marker.display()))?;
    let mut tried = vec![format!("local driver: {local_error}")];
    if let Some(bwrap) = find_on_path("bwrap") {
        let bwrap = bwrap.display().to_string();
        let probe = std::process::Command::new(&bwrap)
            .args(["--dev-bind", "/", "/", "--bind"])
            .arg(scratch)
            .args(["/workspace", "test", "-e", "/workspace/cairn-demo-probe"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        match probe {
            Ok(output) if output.status.success() => {
                return Ok(Driver::Exec {
                    tool: "bubblewrap",
                    create: BWRAP_TEMPLATE.replace("{bwrap}", &bwrap),
                });
            }
            Ok(output) => tried.push(format!(
                "bubblewrap: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )),
            Err(e) => tried.push(format!("bubblewrap: cannot run {bwrap}: {e}")),
        }
    } else {
        tried.push("bubblewrap: bwrap is not on PATH".into());
    }
    if let Some(unshare) = find_on_path("unshare") {
        let unshare = unshare.display().to_string();
        let script = format!(
            "mount --bind '{}' /workspace && test -e /workspace/cairn-demo-probe",
            scratch.display()
        );
        let probe = std::process::Command::new(&unshare)
            .args(["-m", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        match probe {
            Ok(output) if output.status.success() => {
                return Ok(Driver::Exec {
                    tool: "unshare",
                    create: UNSHARE_TEMPLATE.replace("{unshare}", &unshare),
                });
            }
            Ok(output) => tried.push(format!(
                "unshare: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )),
            Err(e) => tried.push(format!("unshare: cannot run {unshare}: {e}")),
        }
    } else {
        tried.push("unshare: not on PATH".into());
    }
    anyhow::bail!(
        "the demo's sandboxes need a private /workspace, and this machine offers none. Run it as \
         root, or enable unprivileged user namespaces, or install bubblewrap. What was tried: {}",
        tried.join("; ")
    )
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// What a `cairn-host` of the demo is started with.
#[derive(Debug, Clone)]
pub struct HostSpec {
    /// "A" or "B".
    pub role: &'static str,
    pub name: String,
    pub labels: String,
    pub data_dir: PathBuf,
    pub log: PathBuf,
}

/// A running `cairn-host`.
#[derive(Debug)]
pub struct HostProcess {
    pub spec: HostSpec,
    pub pid: u32,
    /// Set once the coordinator lists it.
    pub host_id: Option<String>,
    /// Killed on purpose (host lost); not an error when it is gone.
    pub killed: bool,
    child: Child,
    status: Option<ExitStatus>,
    /// Sandbox processes seen so far, to stop any the host leaves behind.
    seen: HashMap<i32, Process>,
}

/// Starts `cairn-host` with `spec`, talking to `coordinator` with `token`.
pub fn spawn_host(
    bins: &Binaries,
    driver: &Driver,
    coordinator: &str,
    token: &str,
    grace: Duration,
    spec: HostSpec,
) -> anyhow::Result<HostProcess> {
    std::fs::create_dir_all(&spec.data_dir)
        .with_context(|| format!("creating {}", spec.data_dir.display()))?;
    let log =
        File::create(&spec.log).with_context(|| format!("creating {}", spec.log.display()))?;
    let log_err = log.try_clone().context("opening the host log twice")?;
    let mut command = Command::new(&bins.host);
    command
        .arg("--coordinator")
        .arg(coordinator)
        .arg("--data-dir")
        .arg(&spec.data_dir)
        .args([
            "--labels",
            &spec.labels,
            "--slots",
            "1",
            "--name",
            &spec.name,
        ])
        .arg("--grace")
        .arg(humantime::format_duration(grace).to_string())
        .arg("--runner-bin")
        .arg(&bins.runner)
        .args(driver.host_args())
        .arg("--env")
        .arg(format!("PATH={}", bins.sandbox_path()))
        // In the environment, not on the command line other users can read.
        .env("CAIRN_TOKEN", token)
        .env_remove("CAIRN_FAILPOINTS")
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .process_group(0)
        .kill_on_drop(true);
    let child = command
        .spawn()
        .with_context(|| format!("cannot start {}", bins.host.display()))?;
    let pid = child.id().context("the host exited at once")?;
    Ok(HostProcess {
        spec,
        pid,
        host_id: None,
        killed: false,
        child,
        status: None,
        seen: HashMap::new(),
    })
}

impl HostProcess {
    /// The exit status, once it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Remembers the host's sandbox processes as they are now.
    pub fn note_sandboxes(&mut self) {
        if self.exited().is_some() {
            return;
        }
        for process in sandbox_processes(self.pid as i32) {
            self.seen.insert(process.pid, process);
        }
    }

    /// Kills the host and its sandboxes at once with SIGKILL, like a machine
    /// that dies: nobody gets to checkpoint or report. Returns how many
    /// sandbox processes were killed.
    pub async fn kill_hard(&mut self) -> usize {
        self.killed = true;
        let sandboxes = sandbox_processes(self.pid as i32);
        // The host goes first: a host that saw its sandbox die would report
        // it (a crash) before it died itself.
        let _ = self.child.start_kill();
        let killed = kill_groups(&sandboxes);
        self.status = self.child.wait().await.ok();
        killed
    }

    /// SIGTERM (the host destroys its sandboxes within the grace period and
    /// exits), SIGKILL if it takes longer than `patience`, then SIGKILL to
    /// any sandbox process still around.
    pub async fn stop(&mut self, patience: Duration) {
        self.note_sandboxes();
        if self.exited().is_none() {
            signal_group(self.pid as i32, SignalKind::terminate().as_raw_value());
            match tokio::time::timeout(patience, self.child.wait()).await {
                Ok(status) => self.status = status.ok(),
                Err(_) => {
                    tracing::warn!(host = %self.spec.name, "the host did not stop in time; killing it");
                    let _ = self.child.start_kill();
                    self.status = self.child.wait().await.ok();
                }
            }
        }
        let leftovers: Vec<Process> = self.seen.drain().map(|(_, p)| p).collect();
        let killed = kill_groups(&leftovers);
        if killed > 0 {
            tracing::warn!(host = %self.spec.name, killed, "killed sandbox processes the host left behind");
        }
    }

    /// The last lines of the host's log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.spec.log, lines)
    }
}

/// The last `lines` lines of a file (empty if unreadable).
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Process {
    pub pid: i32,
    pub stat: ProcStat,
}

fn all_processes() -> Vec<Process> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            Some(Process {
                pid,
                stat: read_stat(pid)?,
            })
        })
        .filter(|p| !p.stat.is_zombie())
        .collect()
}

/// The processes of `host`'s sandboxes: its descendants, and every member
/// of their sessions (a sandbox is a session), not the host itself.
pub fn sandbox_processes(host: i32) -> Vec<Process> {
    select_sandboxes(host, &all_processes())
}

fn select_sandboxes(host: i32, processes: &[Process]) -> Vec<Process> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for p in processes {
        children.entry(p.stat.parent).or_default().push(p.pid);
    }
    let mut descendants = BTreeSet::new();
    let mut stack = vec![host];
    while let Some(pid) = stack.pop() {
        for &child in children.get(&pid).into_iter().flatten() {
            if descendants.insert(child) {
                stack.push(child);
            }
        }
    }
    let host_session = processes
        .iter()
        .find(|p| p.pid == host)
        .map(|p| p.stat.session);
    let sessions: BTreeSet<i32> = processes
        .iter()
        .filter(|p| descendants.contains(&p.pid) && Some(p.stat.session) != host_session)
        .map(|p| p.stat.session)
        .collect();
    processes
        .iter()
        .filter(|p| {
            p.pid != host && (descendants.contains(&p.pid) || sessions.contains(&p.stat.session))
        })
        .copied()
        .collect()
}

/// SIGKILLs the process group of every process that is still the same
/// process (same start time); returns how many of them were still there.
fn kill_groups(processes: &[Process]) -> usize {
    let alive: Vec<Process> = processes
        .iter()
        .filter_map(|p| {
            let current = read_stat(p.pid)?;
            (current.start_time == p.stat.start_time && !current.is_zombie()).then_some(Process {
                pid: p.pid,
                stat: current,
            })
        })
        .collect();
    let groups: BTreeSet<i32> = alive.iter().map(|p| p.stat.group).collect();
    for group in groups {
        signal_group(group, SIGKILL);
    }
    alive.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(pid: i32, parent: i32, session: i32) -> Process {
        Process {
            pid,
            stat: ProcStat {
                state: 'S',
                parent,
                group: pid,
                session,
                start_time: 1,
            },
        }
    }

    #[test]
    fn a_hosts_sandboxes_are_its_descendants_and_their_sessions() {
        let processes = [
            process(1, 0, 1),
            process(100, 1, 50),    // the host, in the demo's session
            process(101, 100, 101), // a sandbox's runner, leading its session
            process(102, 101, 101), // the agent under it
            process(103, 1, 101),   // reparented to init, same session
            process(104, 1, 50),    // an unrelated process in the demo's session
            process(200, 1, 200),   // another host
            process(201, 200, 201),
        ];
        let mut pids: Vec<i32> = select_sandboxes(100, &processes)
            .iter()
            .map(|p| p.pid)
            .collect();
        pids.sort_unstable();
        assert_eq!(pids, [101, 102, 103]);
    }

    #[test]
    fn missing_binaries_are_named_with_the_build_command() {
        let dir = std::env::temp_dir().join(format!("cairn-demo-bins-{}", std::process::id()));
        let debug = dir.join("debug");
        std::fs::create_dir_all(&debug).unwrap();
        std::fs::write(debug.join(HOST_BIN), b"").unwrap();
        let err = Binaries::find(Some(debug.clone())).unwrap_err().to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            err.contains("cairn-runner, cairn-demo-agent not found next to cairnctl"),
            "{err}"
        );
        assert!(err.contains("`cargo build --bins`"), "{err}");
    }
}
