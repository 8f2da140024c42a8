//! One sandbox's life on this host, from the driver's start to its removal:
//! a task per sandbox waits for the sandbox to come up and to end, or for a
//! destroy order, then keeps its workspace tree for the next sandbox of the
//! same workspace ([`super::kept`]), removes the sandbox directory and
//! reports the end.
//!
//! Every way a sandbox ends goes through here: an order from the coordinator
//! (hold expiry, cancel, suspend, drain, superseded), the host shutting down
//! or restarting (the order's sender goes away or the reason is
//! `host_restarted`), or the runner exiting by itself.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cairn_proto::ids::WorkspaceId;
use cairn_proto::runs::SandboxState;
use tokio::sync::{mpsc, oneshot};

use super::driver::ExitCode;
use super::driver::{EnvVar, Sandbox, SandboxEvent, log_tail};
use super::kept::{Keeping, KeptTree, KeptWorkspaces, Settled};
use super::layout::{SandboxPaths, remove_tree};
use super::metrics::HostMetrics;
use cairn_engine::host_reports::ReportReader;
use cairn_engine::restore::PackCacheConfig;
use cairn_utils::process::describe_exit;

/// Names the host sets in every sandbox; `--env` may not set them.
pub const RESERVED_ENV: &[&str] = &[
    "CAIRN_COORDINATOR",
    "CAIRN_RUN_TOKEN",
    "CAIRN_SANDBOX_ID",
    "CAIRN_CACHE_DIR",
    "CAIRN_PACK_CACHE",
    "CAIRN_PACK_CACHE_SIZE",
    "CAIRN_CA",
    "HOME",
];

/// The destroy reason used when the host agent itself stops.
pub const REASON_HOST_SHUTDOWN: &str = "host_shutdown";

/// How many log lines an exit detail quotes.
const TAIL_LINES: usize = 3;

/// The runner's environment in a sandbox (see [`super::driver::SandboxSpec::env`]).
pub fn sandbox_env(
    coordinator: &str,
    run_token: &str,
    sandbox_id: &str,
    paths: &SandboxPaths,
    pack_cache: Option<&PackCacheConfig>,
    ca_pem: Option<&str>,
    extras: &[(String, String)],
) -> Vec<EnvVar> {
    let var = |name: &str, value: &str, portable| EnvVar {
        name: name.to_owned(),
        value: value.to_owned(),
        portable,
    };
    let mut env = vec![
        var("CAIRN_COORDINATOR", coordinator, true),
        var("CAIRN_RUN_TOKEN", run_token, true),
        var("CAIRN_SANDBOX_ID", sandbox_id, true),
        var("CAIRN_CACHE_DIR", &paths.cache.display().to_string(), false),
        var("HOME", &paths.home.display().to_string(), false),
    ];
    if let Some(cache) = pack_cache {
        // A host path: the local driver's sandboxes see the host's file
        // system apart from /workspace; exec templates mount {pack_cache}.
        env.push(var(
            "CAIRN_PACK_CACHE",
            &cache.dir.display().to_string(),
            false,
        ));
        env.push(var(
            "CAIRN_PACK_CACHE_SIZE",
            &cache.max_bytes.to_string(),
            true,
        ));
    }
    if let Some(pem) = ca_pem {
        // The PEM text itself: a sandbox may not see the host's files.
        env.push(var(cairn_engine::tls::CA_VAR, pem, true));
    }
    env.extend(extras.iter().map(|(k, v)| var(k, v, true)));
    env
}

/// What a sandbox task tells the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    Up {
        sandbox_id: String,
    },
    Ended {
        sandbox_id: String,
        state: SandboxState,
        exit_code: i32,
        detail: String,
    },
}

/// Reported when an exit status cannot be known (the signal that was sent is
/// the best account of what ended the sandbox).
pub const UNKNOWN_EXIT_CODE: i32 = -libc::SIGTERM;

/// Where an ended sandbox's tree may be kept, and as whose.
#[derive(Debug, Clone)]
pub struct KeepOnEnd {
    pub kept: Arc<KeptWorkspaces>,
    pub workspace: WorkspaceId,
}

/// What becomes of a sandbox's directories once it has ended.
#[derive(Debug, Clone)]
pub struct Cleanup {
    pub paths: SandboxPaths,
    /// Keep the workspace tree first, if it qualifies; `None`: just remove.
    pub keep: Option<KeepOnEnd>,
}

impl Cleanup {
    /// Keeps the tree if it can (renames), then removes the sandbox
    /// directory. A tree that is not kept goes with the directory, as
    /// without keeping. Returns a kept tree, to settle once the sandbox is
    /// reported gone ([`settle`]).
    fn run(self, sandbox_id: &str) -> (Result<(), super::layout::LayoutError>, Option<ToSettle>) {
        let mut kept = None;
        if let Some(keep) = &self.keep {
            match keep.kept.keep(&keep.workspace, sandbox_id, &self.paths) {
                Ok(Keeping::Kept(tree)) => kept = Some((keep.kept.clone(), tree)),
                Ok(Keeping::Passed(reason)) => tracing::debug!(
                    sandbox = %sandbox_id, %reason, "the workspace tree is not kept"
                ),
                Err(e) => tracing::warn!(
                    sandbox = %sandbox_id, error = %e, "cannot keep the workspace tree; removing it"
                ),
            }
        }
        (remove_tree(&self.paths.dir), kept)
    }
}

/// A tree just kept, and where: settled after the sandbox is reported gone.
type ToSettle = (Arc<KeptWorkspaces>, KeptTree);

/// Measures a tree kept from `sandbox_id` and holds it to the bounds, off
/// the event loop, after the sandbox was reported gone.
async fn settle(sandbox_id: &str, kept: Arc<KeptWorkspaces>, tree: KeptTree) {
    let settled = tokio::task::spawn_blocking(move || kept.settle(tree))
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    match settled {
        Ok(Settled::Kept { bytes }) => tracing::info!(
            sandbox = %sandbox_id, size = %cairn_proto::size::human_bytes(bytes),
            "kept the workspace tree for the next sandbox of this workspace"
        ),
        Ok(Settled::Deleted(reason)) => tracing::info!(
            sandbox = %sandbox_id, %reason, "deleted the workspace tree kept from the sandbox"
        ),
        Ok(Settled::Gone) => tracing::debug!(
            sandbox = %sandbox_id, "the kept workspace tree was taken before it was measured"
        ),
        Err(e) => tracing::warn!(
            sandbox = %sandbox_id, error = %e, "cannot settle the kept workspace tree"
        ),
    }
}

/// How often a sandbox's reports file is read while it runs.
const READ_REPORTS_EVERY: Duration = Duration::from_secs(2);

/// What a sandbox's runner leaves for the host: its log, whose tail an
/// exit detail quotes, and its reports, read from its cache directory
/// ([`cairn_engine::host_reports`]) into the host's metrics.
#[derive(Debug)]
pub struct RunnerOutput {
    pub log_file: PathBuf,
    pub reports: ReportReader,
    pub metrics: Arc<HostMetrics>,
}

impl RunnerOutput {
    fn read_reports(&mut self, cache_dir: &std::path::Path) {
        let new = self.reports.read_new(cache_dir);
        self.metrics.runner_reports(&new);
    }
}

/// Supervises one started sandbox until it is gone and its directory removed.
///
/// `destroy` carries the destroy reason; if its sender is dropped, the
/// sandbox is destroyed as in a host shutdown.
pub async fn supervise<S: Sandbox>(
    sandbox_id: String,
    mut sandbox: S,
    grace: Duration,
    mut destroy: oneshot::Receiver<String>,
    cleanup: Cleanup,
    mut runner: RunnerOutput,
    updates: mpsc::UnboundedSender<Update>,
) {
    let mut read_reports = tokio::time::interval(READ_REPORTS_EVERY);
    read_reports.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (state, exit_code, mut detail) = loop {
        tokio::select! {
            biased;
            order = &mut destroy => {
                let reason = order.unwrap_or_else(|_| REASON_HOST_SHUTDOWN.to_owned());
                tracing::info!(sandbox = %sandbox_id, %reason, "destroying sandbox");
                let destroyed = sandbox.destroy(grace).await;
                let detail = format!("destroyed ({reason}): {}", destroyed.detail);
                break (SandboxState::Destroyed, destroyed.exit_code, detail);
            }
            event = sandbox.next_event() => match event {
                SandboxEvent::Up => {
                    let _ = updates.send(Update::Up { sandbox_id: sandbox_id.clone() });
                }
                SandboxEvent::Ended(code) => {
                    sandbox.release().await;
                    break (SandboxState::Exited, code, exit_detail(code, &runner.log_file));
                }
                SandboxEvent::Failed(detail) => {
                    sandbox.release().await;
                    break (SandboxState::Failed, None, detail);
                }
            },
            _ = read_reports.tick() => runner.read_reports(&cleanup.paths.cache),
        }
    };
    // What the runner reported last, the destroy checkpoint among it,
    // before the directory is kept or removed.
    runner.read_reports(&cleanup.paths.cache);
    // Walking and moving a workspace of tens of thousands of files is no
    // work for the agent's event loop.
    let id = sandbox_id.clone();
    let (removed, kept) = tokio::task::spawn_blocking(move || cleanup.run(&id))
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    if let Err(e) = removed {
        tracing::error!(sandbox = %sandbox_id, error = %e, "cannot remove the sandbox directory");
        detail.push_str(&format!("; the sandbox directory was not removed: {e}"));
    }
    if exit_code.is_none() && state != SandboxState::Failed {
        detail.push_str(" (exit status unknown)");
    }
    let exit_code = exit_code.unwrap_or(if state == SandboxState::Failed {
        0
    } else {
        UNKNOWN_EXIT_CODE
    });
    let _ = updates.send(Update::Ended {
        sandbox_id: sandbox_id.clone(),
        state,
        exit_code,
        detail,
    });
    // Reported first: a suspend or a run's end waits for no walk of the
    // tree. The agent waits for this task before it exits.
    if let Some((kept, tree)) = kept {
        settle(&sandbox_id, kept, tree).await;
    }
}

fn exit_detail(code: ExitCode, log_file: &std::path::Path) -> String {
    let mut detail = format!("runner {}", describe_exit(code));
    if code != Some(0) {
        let tail = log_tail(log_file, TAIL_LINES);
        if !tail.is_empty() {
            detail.push_str(": ");
            detail.push_str(&tail);
        }
    }
    detail
}
