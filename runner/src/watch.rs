//! `cairn-runner watch`: a resident checkpointer for one workspace.
//!
//! It keeps a [`ChangeTracker`] on the root, so each checkpoint lists only
//! the directories that changed and reads only the files that did, and it
//! cuts checkpoints on two triggers:
//! - every `--interval`, only when something changed since the last one
//!   (an unchanged workspace makes no new checkpoint);
//! - whenever `cairn-runner checkpoint` asks through the control socket,
//!   a Unix socket (mode 0600) next to the fingerprint cache.
//!
//! The protocol on the socket is one JSON line each way:
//!
//! ```text
//! → {"workspace": "<id or name>", "reason": "manual"}
//! ← {"report": <the JSON of `cairn-runner checkpoint --output json`>, "summary": "<text>"}
//! ← {"error": "<why the checkpoint failed>"}
//! ```
//!
//! Checkpoints never overlap: the triggers queue on one lock.

use std::future::Future;
use std::io;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cairn_proto::domain::CheckpointReason;
use cairn_proto::ids::BlobId;
use cairn_proto::pb;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Mutex;

use crate::checkpoint::{self, Baseline, CheckpointOptions, CheckpointReport, Resident};
use crate::cli::{CheckpointArgs, OutputFormat, WatchArgs};
use crate::client::Coordinator;
use crate::scan;
use crate::tracker::ChangeTracker;

/// Longest request line accepted on the control socket.
const MAX_REQUEST: u64 = 4096;

/// The control socket a watcher of `root` (canonical) with `cache_dir` uses
/// unless told otherwise, so `cairn-runner checkpoint` finds it.
pub fn default_socket(cache_dir: &Path, root: &Path) -> PathBuf {
    let digest = Sha256::digest(root.as_os_str().as_encoded_bytes());
    cache_dir.join(format!("watch-{}.sock", &hex::encode(digest)[..16]))
}

#[derive(Debug, Serialize, Deserialize)]
struct Request {
    workspace: String,
    reason: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Response {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    report: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    summary: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// Cuts the watched workspace's checkpoints, one at a time.
#[derive(Debug)]
pub struct Checkpointer {
    /// Everything but the reason, which each trigger sets.
    options: CheckpointOptions,
    /// The last checkpoint this watcher committed: an interval checkpoint
    /// is skipped while it is still the newest and nothing changed.
    baseline: Mutex<Option<Baseline>>,
}

impl Checkpointer {
    /// A checkpointer whose first interval checkpoint is skipped when the
    /// workspace still matches `baseline` (its newest checkpoint).
    pub fn new(options: CheckpointOptions, baseline: Option<Baseline>) -> Self {
        Self {
            options,
            baseline: Mutex::new(baseline),
        }
    }

    /// Cuts a checkpoint; with `only_if_changed`, `None` when nothing changed
    /// since the last one.
    pub async fn checkpoint(
        &self,
        reason: CheckpointReason,
        only_if_changed: bool,
    ) -> Result<Option<CheckpointReport>, checkpoint::CheckpointError> {
        let mut baseline = self.baseline.lock().await;
        let opts = CheckpointOptions {
            reason,
            ..self.options.clone()
        };
        let report = match (only_if_changed, baseline.as_ref()) {
            (true, Some(base)) => checkpoint::checkpoint_if_changed(opts, base).await?,
            _ => Some(checkpoint::checkpoint(opts).await?),
        };
        if let Some(report) = &report {
            *baseline = Some(Baseline {
                checkpoint_id: report.checkpoint_id.clone(),
                root_tree: report.root_tree,
            });
        }
        Ok(report)
    }

    async fn answer(&self, request: &str) -> Response {
        let failed = |error: String| Response {
            report: None,
            summary: None,
            error: Some(error),
        };
        let request: Request = match serde_json::from_str(request) {
            Ok(request) => request,
            Err(e) => return failed(format!("unreadable request: {e}")),
        };
        if request.workspace != self.options.workspace {
            return failed(format!(
                "this watcher checkpoints workspace {}, not {}",
                self.options.workspace, request.workspace
            ));
        }
        let reason = match request.reason.parse::<CheckpointReason>() {
            Ok(reason) => reason,
            Err(e) => return failed(e.to_string()),
        };
        match self.checkpoint(reason, false).await {
            Ok(Some(report)) => Response {
                summary: Some(checkpoint::summary(&report)),
                report: serde_json::to_value(&report).ok(),
                error: None,
            },
            Ok(None) => unreachable!("a requested checkpoint is always cut"),
            Err(e) => {
                tracing::warn!(error = %e, "a requested checkpoint failed");
                failed(checkpoint::one_line(&e))
            }
        }
    }
}

/// Serves checkpoint requests on `listener` and cuts interval checkpoints
/// until `shutdown` completes.
pub async fn serve(
    listener: UnixListener,
    checkpointer: Arc<Checkpointer>,
    interval: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let start = tokio::time::Instant::now() + interval;
    let mut ticker = tokio::time::interval_at(start, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = ticker.tick() => {
                match checkpointer.checkpoint(CheckpointReason::Interval, true).await {
                    Ok(Some(report)) => tracing::info!("{}", checkpoint::summary(&report)),
                    Ok(None) => tracing::debug!("nothing changed; no interval checkpoint"),
                    Err(e) => tracing::warn!(error = %e, "the interval checkpoint failed; trying again at the next one"),
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let checkpointer = checkpointer.clone();
                    tokio::spawn(async move {
                        if let Err(e) = handle(stream, &checkpointer).await {
                            tracing::debug!(error = %e, "a control connection ended early");
                        }
                    });
                }
                Err(e) => tracing::warn!(error = %e, "cannot accept a control connection"),
            },
        }
    }
}

async fn handle(stream: UnixStream, checkpointer: &Checkpointer) -> io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    tokio::io::AsyncReadExt::take(BufReader::new(read), MAX_REQUEST)
        .read_line(&mut line)
        .await?;
    let response = checkpointer.answer(line.trim()).await;
    let mut bytes = serde_json::to_vec(&response).map_err(io::Error::other)?;
    bytes.push(b'\n');
    write.write_all(&bytes).await?;
    write.shutdown().await
}

/// `cairn-runner watch`.
pub async fn cli_main(args: WatchArgs) -> anyhow::Result<()> {
    let root = scan::resolve_root(&args.target.root)?;
    let mut options = CheckpointOptions::from_args(args.target, CheckpointReason::Manual);
    let socket = args
        .socket
        .unwrap_or_else(|| default_socket(&options.cache_dir, &root));
    std::fs::create_dir_all(&options.cache_dir).with_context(|| {
        format!(
            "creating the cache directory {}",
            options.cache_dir.display()
        )
    })?;
    let cache_dir = std::fs::canonicalize(&options.cache_dir).with_context(|| {
        format!(
            "resolving the cache directory {}",
            options.cache_dir.display()
        )
    })?;
    // The first walk, made now, is what the first checkpoint builds on.
    let walk = options.scan_options(&root, &cache_dir);
    let full_scan_interval = args.full_scan_interval;
    let tracker = tokio::task::spawn_blocking(move || -> anyhow::Result<ChangeTracker> {
        let tracker = ChangeTracker::start(&walk.root, full_scan_interval)?;
        tracker.scan(&walk, &|_| {})?;
        Ok(tracker)
    })
    .await
    .context("starting the change tracker")??;
    let resident = Arc::new(Resident::new(Some(tracker)));
    options.resident = Some(resident.clone());
    let baseline = newest_checkpoint(&options).await?;
    let listener = bind(&socket)?;
    let checkpointer = Arc::new(Checkpointer::new(options, baseline));
    tracing::info!(
        root = %root.display(),
        socket = %socket.display(),
        interval = %humantime::format_duration(args.interval),
        "watching; `cairn-runner checkpoint` asks here"
    );
    serve(listener, checkpointer, args.interval, shutdown_signal()).await;
    let _ = std::fs::remove_file(&socket);
    resident.flush().await;
    tracing::info!("watcher stopped");
    Ok(())
}

/// The workspace's newest checkpoint, which the first interval checkpoint
/// is compared with (None: it has none, so the first one is cut).
async fn newest_checkpoint(options: &CheckpointOptions) -> anyhow::Result<Option<Baseline>> {
    let workspace = &options.workspace;
    let coordinator = Coordinator::connect(&options.coordinator, options.token.as_deref()).await?;
    let listed = coordinator
        .checkpoints
        .clone()
        .list_checkpoints(pb::ListCheckpointsRequest {
            workspace: workspace.clone(),
            page_size: 1,
            page_token: String::new(),
        })
        .await
        .map_err(|status| {
            anyhow::anyhow!(
                "listing the checkpoints of {workspace}: {}",
                status.message()
            )
        })?
        .into_inner();
    Ok(listed.checkpoints.into_iter().next().and_then(|newest| {
        Some(Baseline {
            root_tree: BlobId::from_slice(&newest.root_tree).ok()?,
            checkpoint_id: newest.id,
        })
    }))
}

/// Binds the control socket (mode 0600), replacing a stale one; refuses
/// when another watcher answers there.
fn bind(socket: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the directory of {}", socket.display()))?;
    }
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        anyhow::bail!(
            "another watcher already listens at {}; stop it first",
            socket.display()
        );
    }
    match std::fs::remove_file(socket) {
        Ok(()) => tracing::info!(socket = %socket.display(), "removed a stale control socket"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", socket.display())),
    }
    let listener =
        UnixListener::bind(socket).with_context(|| format!("listening at {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} private", socket.display()))?;
    Ok(listener)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// The socket `cairn-runner checkpoint` should ask, if any: the one named
/// by `--socket`, else the default one when a file is there.
pub fn socket_for(args: &CheckpointArgs) -> Option<(PathBuf, bool)> {
    if let Some(socket) = &args.socket {
        return Some((socket.clone(), true));
    }
    let root = scan::resolve_root(&args.target.root).ok()?;
    let socket = default_socket(&args.target.cache_dir(), &root);
    socket.exists().then_some((socket, false))
}

/// Asks the watcher at `socket` for a checkpoint and prints its answer as
/// `cairn-runner checkpoint` would. `Ok(false)`: nobody answered there.
pub async fn ask(socket: &Path, args: &CheckpointArgs) -> anyhow::Result<bool> {
    let stream = match UnixStream::connect(socket).await {
        Ok(stream) => stream,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
            ) =>
        {
            return Ok(false);
        }
        Err(e) => return Err(e).with_context(|| format!("connecting to {}", socket.display())),
    };
    let (read, mut write) = stream.into_split();
    let mut request = serde_json::to_vec(&Request {
        workspace: args.target.workspace.clone(),
        reason: args.reason.clone(),
    })?;
    request.push(b'\n');
    write.write_all(&request).await?;
    let mut line = String::new();
    BufReader::new(read).read_line(&mut line).await?;
    let response: Response = serde_json::from_str(line.trim()).with_context(|| {
        format!(
            "the watcher at {} gave an unreadable answer",
            socket.display()
        )
    })?;
    if let Some(error) = response.error {
        anyhow::bail!("{error}");
    }
    let report = response
        .report
        .with_context(|| format!("the watcher at {} sent no report", socket.display()))?;
    match args.output {
        OutputFormat::Json => println!("{report}"),
        OutputFormat::Text => {
            println!("{}", response.summary.unwrap_or_default());
            for warning in report["warnings"].as_array().into_iter().flatten() {
                eprintln!("warning: {}", warning.as_str().unwrap_or_default());
            }
        }
    }
    Ok(true)
}
