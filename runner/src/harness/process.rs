//! One turn of a harness as a child process.
//!
//! The process runs in its own process group, so the runner can signal the
//! harness and everything it started without signalling itself, and dies
//! with the runner (parent-death signal) so it never outlives a runner that
//! was killed. Its stdout is read line by line into the adapter's
//! [`Harness::observe`]; its stderr is passed through to the runner's stderr
//! line by line (and read by the adapter too: Claude Code reports a missing
//! conversation there). The session id is announced as a [`TurnEvent`] the
//! moment it is seen, not at the end of the turn.

use std::collections::VecDeque;
use std::io::Write as _;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{Harness, HarnessCommand, HarnessError, Observed, Stream};

/// Variables of the runner that the harness and the workspace's services must not see.
pub(crate) const HIDDEN_ENV: &[&str] = &["CAIRN_RUN_TOKEN", "CAIRN_TOKEN"];
/// Lines of stderr kept to explain a failed turn.
const STDERR_TAIL: usize = 20;
/// After the harness exits, how long its output may stay open (held by
/// children it left behind) before the rest of its process group is killed.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Something a running turn said that the runner acts on at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnEvent {
    /// The conversation's session id (sent again only when it changes).
    Session(String),
    /// The harness is stuck waiting for something nobody will do
    /// ([`Observed::stuck`]); sent once.
    Stuck(String),
}

/// How a turn's process ended.
#[derive(Debug)]
pub struct TurnExit {
    pub status: ExitStatus,
    pub observed: Observed,
    /// The last lines of stderr.
    pub stderr_tail: Vec<String>,
    /// The last non-empty line of stdout.
    pub last_stdout: Option<String>,
}

impl TurnExit {
    /// Why the turn failed, in the harness's own words when it gave any.
    pub fn failure(&self) -> String {
        if let Some(error) = &self.observed.error {
            return error.clone();
        }
        let status = cairn_utils::process::describe_status(self.status);
        match self.stderr_tail.iter().rev().find(|l| !l.trim().is_empty()) {
            Some(line) => format!("the harness {status}: {}", line.trim()),
            None => format!("the harness {status}"),
        }
    }
}

/// A harness turn in progress.
#[derive(Debug)]
pub struct RunningTurn {
    pgid: i32,
    done: JoinHandle<TurnExit>,
}

/// Starts one turn; the receiver gets its [`TurnEvent`]s as they happen.
pub fn spawn_turn(
    harness: Arc<dyn Harness>,
    command: HarnessCommand,
) -> Result<(RunningTurn, mpsc::UnboundedReceiver<TurnEvent>), HarnessError> {
    let mut cmd = tokio::process::Command::new(&command.program);
    cmd.args(&command.args)
        .current_dir(&command.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(false);
    for name in HIDDEN_ENV {
        cmd.env_remove(name);
    }
    for (key, value) in &command.env {
        cmd.env(key, value);
    }
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|source| HarnessError::Spawn {
        program: command.program.clone(),
        source,
    })?;
    let pgid = child.id().expect("a child that was just spawned has a pid") as i32;
    tracing::debug!(program = %command.program, pgid, cwd = %command.cwd.display(), "harness turn started");

    let (events, receiver) = mpsc::unbounded_channel();
    let shared = Arc::new(Mutex::new(Reading::default()));
    if let Some(session) = &command.session_at_start {
        let mut reading = shared.lock().expect("not poisoned");
        reading.observed.session_id = Some(session.clone());
        reading.announced = Some(session.clone());
        let _ = events.send(TurnEvent::Session(session.clone()));
    }
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let out_reader = tokio::spawn(read_lines(
        stdout,
        Stream::Stdout,
        harness.clone(),
        shared.clone(),
        events.clone(),
    ));
    let err_reader = tokio::spawn(read_lines(
        stderr,
        Stream::Stderr,
        harness,
        shared.clone(),
        events,
    ));
    let done = tokio::spawn(async move {
        let status = match child.wait().await {
            Ok(status) => status,
            Err(e) => {
                tracing::error!(error = %e, "cannot wait for the harness process");
                kill_group(pgid, libc::SIGKILL);
                child
                    .wait()
                    .await
                    .unwrap_or_else(|_| exit_status_from_signal(libc::SIGKILL))
            }
        };
        let readers = async {
            let _ = out_reader.await;
            let _ = err_reader.await;
        };
        tokio::pin!(readers);
        if tokio::time::timeout(DRAIN_GRACE, &mut readers)
            .await
            .is_err()
        {
            tracing::info!(
                pgid,
                "the harness left processes holding its output open; killing them"
            );
            kill_group(pgid, libc::SIGKILL);
            readers.await;
        }
        let reading = std::mem::take(&mut *shared.lock().expect("not poisoned"));
        TurnExit {
            status,
            observed: reading.observed,
            stderr_tail: reading.stderr_tail.into(),
            last_stdout: reading.last_stdout,
        }
    });
    Ok((RunningTurn { pgid, done }, receiver))
}

impl RunningTurn {
    /// The process group of the turn.
    pub fn pgid(&self) -> i32 {
        self.pgid
    }

    /// Waits for the turn to end. Cancel-safe: may be called again.
    pub async fn finished(&mut self) -> TurnExit {
        match (&mut self.done).await {
            Ok(exit) => exit,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }

    /// Sends SIGTERM to the turn's process group, waits up to `grace`, then
    /// SIGKILLs what is left, and returns how the turn ended.
    pub async fn stop(mut self, grace: Duration) -> TurnExit {
        kill_group(self.pgid, libc::SIGTERM);
        match tokio::time::timeout(grace, self.finished()).await {
            Ok(exit) => exit,
            Err(_) => {
                tracing::warn!(
                    pgid = self.pgid,
                    ?grace,
                    "the harness did not stop on SIGTERM; killing it"
                );
                kill_group(self.pgid, libc::SIGKILL);
                self.finished().await
            }
        }
    }
}

fn kill_group(pgid: i32, signal: i32) {
    // SAFETY: killpg has no memory-safety preconditions.
    let rc = unsafe { libc::killpg(pgid, signal) };
    if rc == -1 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ESRCH) {
            tracing::warn!(pgid, signal, error = %e, "cannot signal the harness's process group");
        }
    }
}

fn exit_status_from_signal(signal: i32) -> ExitStatus {
    use std::os::unix::process::ExitStatusExt as _;
    ExitStatus::from_raw(signal)
}

#[derive(Debug, Default)]
struct Reading {
    observed: Observed,
    announced: Option<String>,
    stuck_announced: bool,
    stderr_tail: VecDeque<String>,
    last_stdout: Option<String>,
}

async fn read_lines(
    stream: impl AsyncRead + Unpin,
    which: Stream,
    harness: Arc<dyn Harness>,
    shared: Arc<Mutex<Reading>>,
    events: mpsc::UnboundedSender<TurnEvent>,
) {
    let mut reader = BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(stream = ?which, error = %e, "cannot read the harness's output");
                return;
            }
        }
        if which == Stream::Stderr {
            let mut err = std::io::stderr().lock();
            let _ = err.write_all(&buf);
            if !buf.ends_with(b"\n") {
                let _ = err.write_all(b"\n");
            }
        }
        let line = String::from_utf8_lossy(&buf);
        let line = line.trim_end_matches(['\n', '\r']);
        let mut reading = shared.lock().expect("not poisoned");
        harness.observe(which, line, &mut reading.observed);
        match which {
            Stream::Stderr => {
                if reading.stderr_tail.len() == STDERR_TAIL {
                    reading.stderr_tail.pop_front();
                }
                reading.stderr_tail.push_back(line.to_owned());
            }
            Stream::Stdout => {
                if !line.trim().is_empty() {
                    reading.last_stdout = Some(line.to_owned());
                }
            }
        }
        if let Some(session) = reading.observed.session_id.clone()
            && reading.announced.as_ref() != Some(&session)
        {
            reading.announced = Some(session.clone());
            let _ = events.send(TurnEvent::Session(session));
        }
        if let Some(why) = reading.observed.stuck.clone()
            && !reading.stuck_announced
        {
            reading.stuck_announced = true;
            let _ = events.send(TurnEvent::Stuck(why));
        }
    }
}
