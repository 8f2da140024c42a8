//! A sandbox's process tree on this machine: started in a session of its own,
//! ended with SIGTERM, a grace period and SIGKILL.
//!
//! Every sandbox process is started with `setsid()`, so it leads a new session
//! and a process group with its own pid. The runner puts the harness in a
//! process group of its own (so it can signal it apart), but that group stays
//! in the runner's session; the session is therefore what "everything in the
//! sandbox" means here. Destroy sends SIGTERM to the leader's process group
//! (the contract: the runner forwards it and checkpoints), waits up to the
//! grace period for every process of the session to end, then SIGKILLs the
//! group and whatever is left in the session. When the leader ends by itself,
//! processes it left behind in its session are killed at once. Either way
//! nothing of the sandbox runs when its directory is removed.
//!
//! The child also gets `PR_SET_PDEATHSIG(SIGTERM)`: if the host agent dies,
//! its runners are told to checkpoint and stop rather than run on unseen.
//! The kernel sends that signal when the *thread* that forked the child exits,
//! so sandboxes are spawned only from async tasks, which run on the runtime's
//! worker threads (alive as long as the agent), never from `spawn_blocking`.

use std::io;
use std::time::Duration;

use tokio::process::Child;

use cairn_utils::process::{read_stat, session_members, signal_group};

use cairn_utils::process::{describe_exit, exit_code};

use super::driver::{Destroyed, ExitCode, Sandbox, SandboxEvent};
use super::layout::SandboxRecord;

/// How long to wait for a process to vanish after SIGKILL before giving up.
const KILL_WAIT: Duration = Duration::from_secs(30);

/// How often an adopted process (not our child) is checked for exit.
const ADOPTED_POLL: Duration = Duration::from_millis(100);

/// How a terminated sandbox ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terminated {
    /// The session leader's exit status.
    pub exit_code: ExitCode,
    /// The leader outlived the grace period and was SIGKILLed.
    pub leader_killed: bool,
    /// The leader ended in time, but processes it left in its session did
    /// not, and were SIGKILLed.
    pub stragglers_killed: bool,
    /// The leader had already ended before SIGTERM was sent.
    pub already_gone: bool,
}

impl Terminated {
    pub fn describe(&self, grace: Duration) -> String {
        let grace = humantime::format_duration(grace);
        if self.already_gone {
            format!("{} before it was signalled", describe_exit(self.exit_code))
        } else if self.leader_killed {
            format!("killed with SIGKILL after the {grace} grace period")
        } else if self.stragglers_killed {
            format!(
                "{} after SIGTERM; processes it left were killed with SIGKILL after the {grace} grace period",
                describe_exit(self.exit_code)
            )
        } else {
            format!("{} after SIGTERM", describe_exit(self.exit_code))
        }
    }
}

/// The work every sandbox process does between fork and exec: lead a new
/// session and die with the host agent. Only async-signal-safe calls.
///
/// `parent` is the host agent's pid, read before the fork: if the agent is
/// already gone, the child must not start (the death signal would never come).
pub fn child_prelude(parent: libc::pid_t) -> io::Result<()> {
    // SAFETY: both run only in the forked child, before exec.
    unsafe {
        new_session()?;
        arm_parent_death_signal(parent)
    }
}

/// `setsid()`: the child leads a new session and process group.
///
/// # Safety
/// Call only in a freshly forked child (async-signal-safe context).
pub unsafe fn new_session() -> io::Result<()> {
    // SAFETY: setsid takes no pointers.
    if unsafe { libc::setsid() } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets `PR_SET_PDEATHSIG(SIGTERM)` and checks the parent is still `parent`.
///
/// # Safety
/// Call only in a freshly forked child (async-signal-safe context).
pub unsafe fn arm_parent_death_signal(parent: libc::pid_t) -> io::Result<()> {
    // SAFETY: prctl/getppid take no pointers.
    unsafe {
        if libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGTERM as libc::c_ulong,
            0,
            0,
            0,
        ) < 0
        {
            return Err(io::Error::last_os_error());
        }
        if libc::getppid() != parent {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
    }
    Ok(())
}

/// One sandbox process that leads its own session and process group.
#[derive(Debug)]
pub struct SessionLeader {
    pid: i32,
    start_time: u64,
    /// `None` for a process adopted from an earlier host agent process.
    child: Option<Child>,
    ended: Option<ExitCode>,
}

impl SessionLeader {
    /// Wraps a child spawned with [`child_prelude`].
    pub fn from_child(child: Child) -> io::Result<Self> {
        let pid = child.id().ok_or_else(|| {
            io::Error::other("the sandbox process ended before it could be tracked")
        })? as i32;
        // The child cannot be reaped before we wait for it, so its stat is there.
        let start_time = read_stat(pid).map(|s| s.start_time).unwrap_or(0);
        Ok(Self {
            pid,
            start_time,
            child: Some(child),
            ended: None,
        })
    }

    /// Takes over a process an earlier host agent process started, if it still
    /// runs (same pid and same start time, so a reused pid is not mistaken).
    pub fn adopt(pid: i32, start_time: u64) -> Option<Self> {
        let stat = read_stat(pid)?;
        (stat.start_time == start_time && stat.session == pid && stat.state != 'Z').then_some(
            Self {
                pid,
                start_time,
                child: None,
                ended: None,
            },
        )
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Start time of the process in clock ticks since boot (from /proc).
    pub fn start_time(&self) -> u64 {
        self.start_time
    }

    /// Resolves when the leader has ended. Cancel-safe.
    pub async fn wait(&mut self) -> ExitCode {
        if let Some(code) = self.ended {
            return code;
        }
        let code = match &mut self.child {
            Some(child) => match child.wait().await {
                Ok(status) => Some(exit_code(status)),
                Err(e) => {
                    tracing::warn!(pid = self.pid, error = %e, "cannot wait for the sandbox process");
                    None
                }
            },
            None => loop {
                match read_stat(self.pid) {
                    Some(stat) if stat.start_time == self.start_time && stat.state != 'Z' => {
                        tokio::time::sleep(ADOPTED_POLL).await
                    }
                    _ => break None,
                }
            },
        };
        self.ended = Some(code);
        code
    }

    /// SIGTERM to the process group, then up to `grace` for the leader and
    /// every other process of its session to end, then SIGKILL to whatever is
    /// left. Returns once nothing of the session runs.
    ///
    /// Waiting for the whole session, not only the leader, matters when the
    /// leader is a wrapper (bwrap dies of SIGTERM at once while the runner it
    /// started is still checkpointing) and when the runner's harness, in a
    /// process group of its own, is still shutting down.
    pub async fn terminate(&mut self, grace: Duration) -> Terminated {
        if let Some(code) = self.ended {
            self.kill_session().await;
            return Terminated {
                exit_code: code,
                leader_killed: false,
                stragglers_killed: false,
                already_gone: true,
            };
        }
        signal_group(self.pid, libc::SIGTERM);
        let deadline = tokio::time::Instant::now() + grace;
        let leader_ended = tokio::time::timeout_at(deadline, self.wait()).await.ok();
        let (exit_code, leader_killed, stragglers_killed) = match leader_ended {
            Some(code) => (code, false, !self.session_drained(deadline).await),
            None => {
                signal_group(self.pid, libc::SIGKILL);
                kill_session_members(self.pid);
                match tokio::time::timeout(KILL_WAIT, self.wait()).await {
                    Ok(code) => (code, true, false),
                    Err(_) => {
                        tracing::error!(
                            pid = self.pid,
                            "sandbox process survived SIGKILL for {KILL_WAIT:?}"
                        );
                        (None, true, false)
                    }
                }
            }
        };
        // An adopted process's status is unknown; the signal that ended it is the best account.
        let exit_code = exit_code.or(Some(if leader_killed {
            -libc::SIGKILL
        } else {
            -libc::SIGTERM
        }));
        self.kill_session().await;
        Terminated {
            exit_code,
            leader_killed,
            stragglers_killed,
            already_gone: false,
        }
    }

    /// Waits until no process of the session is left, or `deadline`.
    async fn session_drained(&self, deadline: tokio::time::Instant) -> bool {
        loop {
            if session_members(self.pid).is_empty() {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILLs whatever the leader left behind in its session and waits
    /// (bounded) until it is gone.
    pub async fn kill_session(&self) {
        let deadline = tokio::time::Instant::now() + KILL_WAIT;
        loop {
            // The process group is part of the session, so the session covers it.
            if kill_session_members(self.pid) == 0 {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::error!(
                    session = self.pid,
                    "processes of the sandbox survived SIGKILL"
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A sandbox that is one session of processes on this machine (the local
/// driver's runner, or an exec create command that stays in the foreground).
#[derive(Debug)]
pub struct ProcessSandbox {
    leader: SessionLeader,
    reported_up: bool,
}

impl ProcessSandbox {
    /// A freshly started sandbox: it is up as soon as its process runs.
    pub fn new(leader: SessionLeader) -> Self {
        Self {
            leader,
            reported_up: false,
        }
    }

    /// The recorded session leader of an earlier agent process, if it still runs.
    pub fn adopt(record: &SandboxRecord) -> Option<Self> {
        let leader = SessionLeader::adopt(record.pid?, record.pid_start_time?)?;
        Some(Self {
            leader,
            reported_up: true,
        })
    }
}

impl Sandbox for ProcessSandbox {
    fn leader(&self) -> Option<(i32, u64)> {
        Some((self.leader.pid(), self.leader.start_time()))
    }

    fn detached(&self) -> bool {
        false
    }

    async fn next_event(&mut self) -> SandboxEvent {
        if !self.reported_up {
            self.reported_up = true;
            return SandboxEvent::Up;
        }
        SandboxEvent::Ended(self.leader.wait().await)
    }

    async fn destroy(&mut self, grace: Duration) -> Destroyed {
        let terminated = self.leader.terminate(grace).await;
        Destroyed {
            exit_code: terminated.exit_code,
            detail: terminated.describe(grace),
        }
    }

    async fn release(&mut self) {
        self.leader.kill_session().await;
    }
}

/// SIGKILLs every live process of session `sid`; returns how many it found.
fn kill_session_members(sid: i32) -> usize {
    let mut found = 0;
    for pid in session_members(sid) {
        found += 1;
        // SAFETY: kill takes no pointers.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    found
}
