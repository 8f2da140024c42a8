//! `cairn-runner watch`: a resident checkpointer for one workspace.
//!
//! It keeps a [`ChangeTracker`] on the root, so each checkpoint lists only
//! the directories that changed and reads only the files that did, and it
//! cuts checkpoints on two triggers:
//! - every `--interval`, only when something changed since the last one
//!   (an unchanged workspace makes no new checkpoint);
//! - whenever `cairn-runner checkpoint` asks through the control socket
//!   ([`crate::socket`]).
//!
//! Checkpoints never overlap: the triggers queue on one lock. The socket is
//! bound once the fingerprint cache is loaded, the memo primed and the
//! repositories' status read, so that every checkpoint asked there is cut
//! at resident speed.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cairn_proto::domain::CheckpointReason;
use cairn_proto::ids::CheckpointId;
use tokio::net::UnixListener;
use tokio::sync::Mutex;

use crate::socket::{self, Request, Response, Unchanged};
use cairn_engine::checkpoint::{self, Baseline, CheckpointOptions, CheckpointReport, Resident};
use cairn_engine::scan;
use cairn_engine::tracker::ChangeTracker;

/// How long a starting watcher waits for its first reading of the
/// repositories' status before it listens anyway (a checkpoint asked then
/// waits for the rest of it).
const STATUS_READING_WAIT: Duration = Duration::from_secs(30);

/// Cuts the watched workspace's checkpoints, one at a time.
#[derive(Debug)]
pub struct Checkpointer {
    /// Everything but the reason, which each trigger sets.
    options: CheckpointOptions,
    /// The last checkpoint this watcher committed: an interval checkpoint
    /// is skipped while it is still the newest and nothing changed.
    baseline: Mutex<Option<Baseline>>,
}

/// What one checkpoint request came to.
#[derive(Debug)]
pub enum Cut {
    Committed(CheckpointReport),
    /// Nothing changed since this checkpoint, the newest; none was cut.
    Unchanged(CheckpointId),
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

    /// Cuts a checkpoint; with `only_if_changed`, none when nothing changed
    /// since the last one.
    pub async fn checkpoint(
        &self,
        reason: CheckpointReason,
        only_if_changed: bool,
    ) -> Result<Cut, checkpoint::CheckpointError> {
        let mut baseline = self.baseline.lock().await;
        let opts = CheckpointOptions {
            reason,
            ..self.options.clone()
        };
        let report = match (only_if_changed, baseline.as_ref()) {
            (true, Some(base)) => match checkpoint::checkpoint_if_changed(opts, base).await? {
                Some(report) => report,
                None => return Ok(Cut::Unchanged(base.checkpoint_id.clone())),
            },
            _ => checkpoint::checkpoint(opts).await?,
        };
        *baseline = Some(Baseline {
            checkpoint_id: report.checkpoint_id.clone(),
            root_tree: report.root_tree,
        });
        Ok(Cut::Committed(report))
    }

    async fn answer(&self, request: Result<Request, String>) -> Response {
        let started = Instant::now();
        let request = match request {
            Ok(request) => request,
            Err(e) => return Response::failed(e),
        };
        let reason = match request.reason_for(&self.options.workspace, "watcher") {
            Ok(reason) => reason,
            Err(refused) => return refused,
        };
        match self.checkpoint(reason, request.if_changed).await {
            Ok(Cut::Committed(report)) => Response::committed(&report),
            Ok(Cut::Unchanged(since)) => Response::unchanged(Unchanged {
                unchanged_since: since,
                duration_ms: started.elapsed().as_millis() as u64,
            }),
            Err(e) => {
                tracing::warn!(error = %e, "a requested checkpoint failed");
                Response::failed(cairn_utils::text::one_line(&e))
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
                    Ok(Cut::Committed(report)) => tracing::info!("{}", crate::report::checkpoint_summary(&report)),
                    Ok(Cut::Unchanged(_)) => tracing::debug!("nothing changed; no interval checkpoint"),
                    Err(e) => tracing::warn!(error = %e, "the interval checkpoint failed; trying again at the next one"),
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let checkpointer = checkpointer.clone();
                    tokio::spawn(async move {
                        let answered = socket::serve_connection(stream, |request| async move {
                            checkpointer.answer(request).await
                        });
                        if let Err(e) = answered.await {
                            tracing::debug!(error = %e, "a control connection ended early");
                        }
                    });
                }
                Err(e) => tracing::warn!(error = %e, "cannot accept a control connection"),
            },
        }
    }
}

/// What a watcher watches and how often it checkpoints.
#[derive(Debug, Clone)]
pub struct WatchOptions {
    /// The workspace and where its checkpoints go.
    pub checkpoint: CheckpointOptions,
    /// The control socket (default: derived from the root and the cache).
    pub socket: Option<PathBuf>,
    /// How often to checkpoint when something changed.
    pub interval: Duration,
    /// How often the tracker walks the whole workspace anyway.
    pub full_scan_interval: Duration,
}

/// Watches until SIGTERM or SIGINT: interval checkpoints when something
/// changed, and a checkpoint whenever one is asked for on the socket.
pub async fn watch(watch: WatchOptions) -> anyhow::Result<()> {
    let WatchOptions {
        checkpoint: mut options,
        socket,
        interval,
        full_scan_interval,
    } = watch;
    let root = scan::resolve_root(&options.root)?;
    let socket = socket.unwrap_or_else(|| socket::default_socket(&options.cache_dir, &root));
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
    let (tracker, first_walk) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let tracker = ChangeTracker::start(&walk.root, full_scan_interval)?;
        let (first_walk, _) = tracker.scan(&walk, &|_| {})?;
        Ok((tracker, first_walk))
    })
    .await
    .context("starting the change tracker")??;
    let resident = Arc::new(Resident::new(Some(tracker)));
    // Also while nobody waits: the first checkpoint's git status is then
    // read for only what changed since.
    resident.read_repos_after(first_walk);
    options.resident = Some(resident.clone());
    let newest = checkpoint::newest_checkpoint(&options).await?;
    if let Some(newest) = &newest {
        // Worked out while nobody waits, not by the first checkpoint.
        let (workspace, key_id) = (newest.workspace_id.clone(), newest.key_id.clone());
        checkpoint::prime(&options, workspace, key_id, cache_dir.clone()).await;
        // The socket is bound once the runner answers at resident speed: a
        // checkpoint asked sooner would wait for this anyway (~0.5 s on
        // 200k files), and for the first reading of the repositories'
        // status, which its own narrows from. Until it is there,
        // `cairn-runner checkpoint` finds no resident runner: it cuts the
        // checkpoint itself, or with `--socket` says that none answers.
        resident.settle().await;
        if !resident
            .await_status_reading_for(Some(STATUS_READING_WAIT))
            .await
        {
            tracing::info!(
                waited = %humantime::format_duration(STATUS_READING_WAIT),
                "the repositories' status is still being read; listening meanwhile"
            );
        }
    }
    let baseline = newest.map(|newest| newest.baseline);
    let listener = socket::bind(&socket)?;
    let checkpointer = Arc::new(Checkpointer::new(options, baseline));
    tracing::info!(
        root = %root.display(),
        socket = %socket.display(),
        interval = %humantime::format_duration(interval),
        "watching; `cairn-runner checkpoint` asks here"
    );
    serve(listener, checkpointer, interval, shutdown_signal()).await;
    let _ = std::fs::remove_file(&socket);
    resident.settle().await;
    tracing::info!("watcher stopped");
    Ok(())
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
