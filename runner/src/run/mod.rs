//! `cairn-runner run`: one attempt of a run, inside its sandbox.
//!
//! ```text
//! ClaimAttempt ─► AttemptSpec (workspace, generation, harness, prompt, inputs, resume id)
//! restore the newest checkpoint ──► RESTORING <checkpoint>
//!   or, when there is none: clone the run's repos / start empty ──► PREPARING
//! station: clear what earlier runs laid and a stale outcome file,
//!   fast-forward each checkout to its upstream, lay this run's files ──► PREPARING
//! turn: harness process (own process group) ──► RUNNING
//!   │  init event ─► ReportHarnessSession; the turn's inputs are now heard
//!   │  every checkpoint_interval ─► checkpoint (interval) if anything changed
//!   ▼  exit ─► outcome file (or the exit status) says how the turn ended
//!   needs_input ─► checkpoint (pause) ─► ReportWaiting ─► WaitForInput …
//!                    answer ─► RUNNING ─► next turn, same conversation (--resume)
//!   done / failed ─► checkpoint (end) ─► ReportOutcome with the handoff note
//!   conversation gone ─► new conversation opened with a handoff briefing
//! SIGTERM / SIGINT at any point after the harness started: SIGTERM to the
//!   harness's group, grace, SIGKILL ─► checkpoint (destroy) ─► INTERRUPTED
//! ```
//!
//! While the harness works, the agent may ask for a checkpoint itself
//! (`cairn-runner checkpoint` in the sandbox): the control socket
//! ([`requests`]) hands the request to the attempt, which cuts it like its
//! own, between its other steps.
//!
//! Every checkpoint is cut with the attempt's generation, so once a newer
//! attempt owns the workspace this one's commits are refused; a refusal
//! like that (or a RunnerService call refused as superseded) stops the
//! harness and ends the runner without another write.
//!
//! The lifecycle checkpoints (pause, end, destroy) are always committed —
//! they are the moments the run's timeline shows; the periodic ones only
//! when the workspace's root tree differs from the last checkpoint's.
//! A harness turn ends either in a question or in the run's end, so the
//! checkpoint after a turn carries that reason (pause or end).

pub mod control;
pub mod fastforward;
pub mod handoff;
pub mod laid;
pub mod messages;
pub mod outcome;
pub mod prepare;
pub mod requests;
pub mod services;
pub mod store;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_proto::domain::CheckpointReason;
use cairn_proto::ids::{CheckpointId, Generation, WorkspaceId};
use cairn_proto::pb::{self, AttemptPhase};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::harness::{
    self, Harness, OUTCOME_ENV, RunningTurn, TurnEvent, TurnExit, TurnRequest, spawn_turn,
};
use crate::socket::{self as control_socket, Response, Unchanged};
use cairn_engine::checkpoint::Baseline;
use cairn_engine::client::{ConnectError, CoordinatorClient};
use cairn_engine::tracker::Unsaved;

pub use control::{Control, ControlError};
pub use outcome::Outcome as OutcomeFile;
pub use store::{
    Arming, CheckpointRequest, Checkpointed, RemoteStore, Restored, StoreTarget, WorkspaceStore,
    WorkspaceStoreError,
};

/// Patterns no checkpoint of a run contains, whatever the harness. Service
/// logs are output, not work (and a running service keeps writing them).
const ALWAYS_EXCLUDED: &[&str] = &["/.cairn/outcome.json", "/.cairn/logs/"];

/// How an attempt is run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The workspace (`/workspace` in a sandbox).
    pub root: PathBuf,
    /// How long the harness gets between SIGTERM and SIGKILL.
    pub stop_grace: Duration,
    /// How long one WaitForInput call waits for an answer.
    pub wait_timeout: Duration,
    /// Where the agent's `cairn-runner checkpoint` reaches this runner
    /// (None: the agent cannot ask for checkpoints).
    pub control_socket: Option<PathBuf>,
    /// The coordinator's address, told to the agent (`CAIRN_COORDINATOR`)
    /// so that `cairn-runner checkpoint` runs there without flags.
    pub coordinator: Option<String>,
}

impl RunOptions {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            stop_grace: Duration::from_secs(5),
            wait_timeout: Duration::from_secs(60),
            control_socket: None,
            coordinator: None,
        }
    }
}

/// How the attempt ended, as reported to the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    Succeeded,
    Failed,
    Interrupted,
}

/// Why the runner could not see its attempt through (exit status 1).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot claim the attempt: {0}")]
    Claim(#[source] ControlError),
    #[error("this attempt no longer owns the run: {0}")]
    Superseded(String),
    #[error(transparent)]
    Control(ControlError),
    #[error("cannot prepare the workspace: {0}")]
    Prepare(#[source] WorkspaceStoreError),
    #[error("cannot create the workspace {}: {source}", .path.display())]
    Workspace {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl From<ControlError> for RunError {
    fn from(e: ControlError) -> Self {
        if e.is_superseded() {
            Self::Superseded(e.to_string())
        } else {
            Self::Control(e)
        }
    }
}

/// Makes the store of an attempt once its workspace and generation are known.
pub type StoreFactory<'a> = dyn Fn(StoreTarget) -> Arc<dyn WorkspaceStore> + Sync + 'a;

/// Claims the attempt the run token names and sees it through.
pub async fn run(
    control: Control,
    stores: &StoreFactory<'_>,
    options: RunOptions,
    shutdown: CancellationToken,
) -> Result<Finished, RunError> {
    let spec = control.claim().await.map_err(RunError::Claim)?;
    tracing::info!(
        run = %spec.run_id,
        attempt = spec.attempt,
        generation = spec.generation,
        workspace = %spec.workspace_id,
        harness = %spec.harness.as_ref().map_or("", |h| h.name.as_str()),
        resume = %spec.resume_session_id,
        "attempt claimed"
    );
    let workspace_id = match spec.workspace_id.parse::<WorkspaceId>() {
        Ok(id) => id,
        Err(e) => {
            tracing::error!(error = %e, "the attempt names no valid workspace");
            control
                .outcome(pb::ReportOutcomeRequest {
                    outcome: pb::Outcome::Failed as i32,
                    error: format!("the attempt names no valid workspace: {e}"),
                    ..Default::default()
                })
                .await?;
            return Ok(Finished::Failed);
        }
    };
    let harness_spec = spec.harness.clone().unwrap_or_default();
    let harness = match harness::from_spec(&harness_spec, &options.root) {
        Ok(harness) => harness,
        Err(e) => {
            tracing::error!(error = %e, "the run's harness cannot be used");
            control
                .outcome(pb::ReportOutcomeRequest {
                    outcome: pb::Outcome::Failed as i32,
                    error: e.to_string(),
                    ..Default::default()
                })
                .await?;
            return Ok(Finished::Failed);
        }
    };
    let mut excludes: Vec<String> = ALWAYS_EXCLUDED.iter().map(|p| p.to_string()).collect();
    excludes.extend(harness.excludes());
    let store = stores(StoreTarget {
        workspace_id,
        generation: Generation(spec.generation),
        excludes,
        limits: spec.checkpoint_limits.map(Into::into).unwrap_or_default(),
    });
    let attempt = Attempt {
        control,
        store,
        harness,
        spec,
        options,
        shutdown,
        session: None,
        reported_session: None,
        heard: BTreeSet::new(),
        baseline: None,
        last_checkpoint: None,
        harness_started: false,
        cloned: BTreeSet::new(),
        start_heads: handoff::Heads::default(),
        agent_handoff: None,
        listening: None,
        requests: None,
        unsaved_reported: None,
        repos_read: None,
    };
    attempt.run().await
}

/// One turn, and what it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Turn {
    request: TurnRequest,
    /// Input ids the message carries; heard once the harness reports its
    /// session, or the turn runs to its own end.
    input_ids: Vec<u64>,
    /// The people's messages in it (for a briefing if the turn cannot run).
    answers: Vec<String>,
}

/// How a turn ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TurnEnd {
    Asked(String),
    Done(String),
    Failed(String),
    /// The conversation to resume does not exist.
    SessionLost(String),
    Interrupted,
}

enum Prepared {
    Ready,
    Interrupted,
    Failed(String),
}

enum Driven {
    Exited(TurnExit),
    Interrupted,
    /// The harness waits for something nobody will do; why.
    Stuck(String),
}

/// What a lifecycle checkpoint came to.
enum Cut {
    Committed(Checkpointed),
    Failed(String),
}

struct Attempt {
    control: Control,
    store: Arc<dyn WorkspaceStore>,
    harness: Arc<dyn Harness>,
    spec: pb::AttemptSpec,
    options: RunOptions,
    shutdown: CancellationToken,
    /// The conversation's id, once the harness reported one.
    session: Option<String>,
    reported_session: Option<String>,
    /// Input ids the harness has heard in this attempt.
    heard: BTreeSet<u64>,
    /// The last checkpoint restored or committed, to compare with.
    baseline: Option<Baseline>,
    last_checkpoint: Option<CheckpointId>,
    harness_started: bool,
    /// Repositories this attempt cloned (nothing to fast-forward).
    cloned: BTreeSet<String>,
    /// Each checkout's HEAD when the harness was about to start.
    start_heads: handoff::Heads,
    /// The handoff the agent wrote in its latest outcome file.
    agent_handoff: Option<handoff::AgentHandoff>,
    /// The control socket, once the workspace is ready.
    listening: Option<requests::Listening>,
    /// Checkpoints the agent asked for through it.
    requests: Option<mpsc::Receiver<requests::Asked>>,
    /// The unsaved work the coordinator has for this attempt: the last
    /// count reported, or nothing since the last commit.
    unsaved_reported: Option<Unsaved>,
    /// The repositories' states as the last lifecycle checkpoint read them,
    /// for the handoff note that follows it (taken by the note).
    repos_read: Option<Vec<cairn_engine::git::RepoState>>,
}

/// How often the runner counts the work no checkpoint has yet, and reports
/// it if it changed.
const UNSAVED_EVERY: Duration = Duration::from_secs(5);

impl Attempt {
    async fn run(mut self) -> Result<Finished, RunError> {
        match self.prepare_workspace().await? {
            Prepared::Ready => {}
            Prepared::Interrupted => return self.finish_interrupted().await,
            Prepared::Failed(error) => return self.finish_unstarted(error).await,
        }
        match self.prepare_station().await? {
            Prepared::Ready => {}
            Prepared::Interrupted => return self.finish_interrupted().await,
            Prepared::Failed(error) => return self.finish_unstarted(error).await,
        }
        if let Err(e) = self.harness.prepare() {
            return self.finish_unstarted(e.to_string()).await;
        }
        self.listen();
        // Processes are never restored: the workspace's services start anew.
        let shutdown = self.shutdown.clone();
        let (services, started) = tokio::select! {
            started = services::Services::start(&self.options.root) => started,
            _ = shutdown.cancelled() => return self.finish_interrupted().await,
        };
        for line in started {
            self.control
                .progress(AttemptPhase::Preparing, line, None)
                .await?;
        }
        let finished = self.converse().await;
        services.stop().await;
        finished
    }

    /// Opens the control socket, if the runner has one; without it the
    /// agent's checkpoint requests find nobody (and say so).
    fn listen(&mut self) {
        let Some(path) = self.options.control_socket.clone() else {
            return;
        };
        match requests::Listening::start(&path) {
            Ok((listening, requests)) => {
                tracing::debug!(socket = %path.display(), "the agent's checkpoint requests are heard here");
                self.listening = Some(listening);
                self.requests = Some(requests);
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "no control socket: the agent cannot ask for checkpoints");
            }
        }
    }

    async fn prepare_workspace(&mut self) -> Result<Prepared, RunError> {
        let (store, shutdown) = (self.store.clone(), self.shutdown.clone());
        let restored = tokio::select! {
            restored = store.restore() => restored,
            _ = shutdown.cancelled() => return Ok(Prepared::Interrupted),
        };
        match restored {
            Ok(Restored::Checkpoint {
                id,
                root_tree,
                summary,
            }) => {
                tracing::info!(checkpoint = %id, %summary, "workspace restored");
                self.baseline = root_tree.map(|root_tree| Baseline {
                    checkpoint_id: id.clone(),
                    root_tree,
                });
                self.last_checkpoint = Some(id.clone());
                self.control
                    .progress(AttemptPhase::Restoring, summary, Some(&id))
                    .await?;
            }
            Ok(Restored::NoCheckpoint) => {
                let root = &self.options.root;
                // No restore ran to clear it: the tree an earlier restore
                // left partial is not a workspace to start on.
                let marker = root.join(cairn_engine::restore::INCOMPLETE_MARKER);
                if std::fs::symlink_metadata(&marker).is_ok() {
                    let error = format!(
                        "the workspace at {} is what a restore that did not complete left (marked by {}), and the workspace has no checkpoint to restore over it",
                        root.display(),
                        marker.display()
                    );
                    tracing::error!("{error}");
                    return Ok(Prepared::Failed(error));
                }
                fs::create_dir_all(root).map_err(|source| RunError::Workspace {
                    path: root.clone(),
                    source,
                })?;
                if self.spec.repos.is_empty() {
                    tracing::info!("the workspace has no checkpoint: starting empty");
                    self.control
                        .progress(
                            AttemptPhase::Preparing,
                            "workspace has no checkpoint: started empty",
                            None,
                        )
                        .await?;
                }
                for repo in self.spec.repos.clone() {
                    let cloned = tokio::select! {
                        cloned = prepare::clone_repo(root, &repo) => cloned,
                        _ = shutdown.cancelled() => return Ok(Prepared::Interrupted),
                    };
                    match cloned {
                        Ok(done) => {
                            tracing::info!(repo = %repo.name, "{}", done.said);
                            if done.fresh {
                                self.cloned.insert(done.name);
                            }
                            self.control
                                .progress(AttemptPhase::Preparing, done.said, None)
                                .await?;
                        }
                        Err(e) => return Ok(Prepared::Failed(e.to_string())),
                    }
                }
            }
            Err(e) if e.is_permanent() => {
                tracing::error!(error = %e, "the workspace cannot be restored");
                return Ok(Prepared::Failed(format!(
                    "cannot restore the workspace: {e}"
                )));
            }
            Err(e) => return Err(RunError::Prepare(e)),
        }
        Ok(Prepared::Ready)
    }

    /// The station's part of the prepare step: clear what earlier runs left
    /// for themselves, bring each checkout up to date with its upstream,
    /// lay this run's files, and note where every checkout stands.
    async fn prepare_station(&mut self) -> Result<Prepared, RunError> {
        let root = self.options.root.clone();
        // Laid once per attempt: the spec's copy is not needed again.
        let files = match laid::received(std::mem::take(&mut self.spec.lay)) {
            Ok(files) => files,
            Err(error) => return Ok(Prepared::Failed(error)),
        };
        let cleared = {
            let root = root.clone();
            tokio::task::spawn_blocking(move || laid::clear_leftovers(&root))
                .await
                .unwrap_or_else(|e| laid::Cleared {
                    unreadable: Some(format!("clearing stopped: {e}")),
                    ..Default::default()
                })
        };
        if let Some(line) = cleared.describe() {
            tracing::info!("{line}");
            self.control
                .progress(AttemptPhase::Preparing, line, None)
                .await?;
        }
        // Laying creates no checkout (no laid path is in a `.git`): one look
        // serves the fast-forward and the HEADs the handoff note starts from.
        let checkouts = fastforward::find_checkouts(&root);
        let shutdown = self.shutdown.clone();
        let lines = tokio::select! {
            lines = fastforward::fast_forward_all(&checkouts, &self.cloned) => lines,
            _ = shutdown.cancelled() => return Ok(Prepared::Interrupted),
        };
        for line in lines {
            self.control
                .progress(AttemptPhase::Preparing, line, None)
                .await?;
        }
        let (station, run_id) = (self.spec.station.clone(), self.spec.run_id.clone());
        let replaceable = cleared.replaceable();
        let laid = tokio::task::spawn_blocking(move || {
            laid::lay(&root, &station, &run_id, &files, &replaceable)
        })
        .await;
        match laid {
            Ok(Ok(Some(line))) => {
                tracing::info!("{line}");
                self.control
                    .progress(AttemptPhase::Preparing, line, None)
                    .await?;
            }
            Ok(Ok(None)) => {}
            Ok(Err(e)) => return Ok(Prepared::Failed(e.to_string())),
            Err(e) => {
                return Ok(Prepared::Failed(format!(
                    "laying the run's files stopped: {e}"
                )));
            }
        }
        self.start_heads = handoff::heads(&checkouts).await;
        Ok(Prepared::Ready)
    }

    async fn converse(&mut self) -> Result<Finished, RunError> {
        let opening = messages::opening_turn(
            &self.spec,
            self.harness.can_resume(),
            self.harness.can_fork(),
        );
        let mut turn = Turn {
            request: opening.request,
            input_ids: opening.input_ids,
            answers: opening.messages,
        };
        let mut question = Some(self.spec.question.clone()).filter(|q| !q.trim().is_empty());
        loop {
            match self.turn(&turn).await? {
                TurnEnd::Interrupted => return self.finish_interrupted().await,
                TurnEnd::Done(summary) => {
                    return self
                        .finish(pb::Outcome::Succeeded, summary, String::new())
                        .await;
                }
                TurnEnd::Failed(error) => {
                    return self.finish(pb::Outcome::Failed, String::new(), error).await;
                }
                TurnEnd::SessionLost(session_id) => {
                    tracing::warn!(session = %session_id, harness = self.harness.name(), "the conversation to resume is gone; starting a new one with a handoff briefing");
                    self.control
                        .progress(
                            AttemptPhase::Running,
                            format!(
                                "{} has no conversation {session_id} any more; started a new conversation with a \
                                 handoff briefing (lossy handoff)",
                                self.harness.name()
                            ),
                            None,
                        )
                        .await?;
                    self.session = None;
                    let why = format!(
                        "{} has no conversation {session_id} any more",
                        self.harness.name()
                    );
                    let message =
                        messages::Briefing::of(&self.spec, question.as_deref(), &turn.answers)
                            .lossy(&why);
                    turn = Turn {
                        request: TurnRequest::Start { message },
                        ..turn
                    };
                }
                TurnEnd::Asked(asked) => {
                    tracing::info!(question = %asked, "the agent asks a person");
                    let checkpoint = match self.checkpoint(CheckpointReason::Pause).await? {
                        Cut::Committed(checkpoint) => Some(checkpoint.id),
                        Cut::Failed(_) => self.last_checkpoint.clone(),
                    };
                    let held = self
                        .control
                        .waiting(&asked, checkpoint.as_ref(), self.heard())
                        .await?;
                    tracing::info!(hold_until = ?held.hold_until, "waiting for an answer");
                    let Some(inputs) = self.wait_for_answers().await? else {
                        return self.finish_interrupted().await;
                    };
                    turn = self.answered(&inputs, &asked);
                    let detail = match &turn.request {
                        TurnRequest::Resume { session_id, .. } => {
                            format!("answered; resuming conversation {session_id}")
                        }
                        TurnRequest::Start { .. } => {
                            "answered; starting a new conversation with a briefing".to_owned()
                        }
                    };
                    self.control
                        .progress(AttemptPhase::Running, detail, None)
                        .await?;
                    question = Some(asked);
                }
            }
        }
    }

    /// The turn that carries a person's answers.
    fn answered(&self, inputs: &[pb::RunInput], question: &str) -> Turn {
        let answers: Vec<String> = inputs.iter().map(|i| i.text.clone()).collect();
        let input_ids = inputs.iter().map(|i| i.id).collect();
        let request = match &self.session {
            Some(session_id) if self.harness.can_resume() => TurnRequest::Resume {
                session_id: session_id.clone(),
                message: answers.join("\n\n"),
                fork: false,
            },
            session => {
                let why = if session.is_some() {
                    "this harness cannot continue a conversation"
                } else {
                    "the harness never reported a conversation id"
                };
                TurnRequest::Start {
                    message: messages::Briefing::of(&self.spec, Some(question), &answers)
                        .lossy(why),
                }
            }
        };
        Turn {
            request,
            input_ids,
            answers,
        }
    }

    async fn wait_for_answers(&mut self) -> Result<Option<Vec<pb::RunInput>>, RunError> {
        let shutdown = self.shutdown.clone();
        loop {
            let mut inputs = tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                inputs = self.control.wait_for_input(self.options.wait_timeout) => inputs?,
            };
            // Inputs the harness already heard are not news, even if the
            // coordinator has not recorded that yet.
            let received = inputs.len();
            inputs.retain(|input| !self.heard.contains(&input.id));
            if !inputs.is_empty() {
                tracing::info!(inputs = inputs.len(), "answer received");
                return Ok(Some(inputs));
            }
            if received > 0 {
                // Do not poll in a tight loop while the coordinator catches up.
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    }

    /// Where a turn runs: a resumed conversation where it started, a new one
    /// where the configuration says, else in the only repository, else the root.
    fn cwd_for(&self, request: &TurnRequest) -> PathBuf {
        let root = &self.options.root;
        let recorded = match request {
            TurnRequest::Resume { session_id, .. } => prepare::session_cwd(root, session_id),
            TurnRequest::Start { .. } => None,
        };
        recorded
            .or_else(|| self.harness.configured_cwd())
            .unwrap_or_else(|| harness::default_cwd(root))
    }

    async fn turn(&mut self, turn: &Turn) -> Result<TurnEnd, RunError> {
        let cwd = self.cwd_for(&turn.request);
        let outcome_path = outcome::path_in(&self.options.root);
        let prepared = fs::create_dir_all(&cwd)
            .map_err(|e| {
                format!(
                    "cannot create the harness's directory {}: {e}",
                    cwd.display()
                )
            })
            .and_then(|()| outcome::clear(&outcome_path).map_err(|e| e.to_string()))
            .and_then(|()| {
                self.harness
                    .command(&turn.request, &cwd)
                    .map_err(|e| e.to_string())
            });
        let mut command = match prepared {
            Ok(command) => command,
            Err(error) => return Ok(TurnEnd::Failed(error)),
        };
        // A harness that would silently open an empty conversation under an
        // unknown id is asked first: the agent must never carry on without
        // its memory and without the briefing.
        if let TurnRequest::Resume { session_id, .. } = &turn.request
            && self.harness.has_conversation(session_id) == Some(false)
        {
            return Ok(TurnEnd::SessionLost(session_id.clone()));
        }
        command.env.push((
            OUTCOME_ENV.to_owned(),
            outcome_path.to_string_lossy().into_owned(),
        ));
        // What `cairn-runner checkpoint` in the sandbox needs to reach us.
        command
            .env
            .push(("CAIRN_WORKSPACE".into(), self.spec.workspace_id.clone()));
        if let Some(listening) = &self.listening {
            command.env.push((
                "CAIRN_CONTROL_SOCKET".into(),
                listening.path().to_string_lossy().into_owned(),
            ));
        }
        if let Some(address) = &self.options.coordinator {
            command
                .env
                .push(("CAIRN_COORDINATOR".into(), address.clone()));
        }
        let (mut running, mut events) = match spawn_turn(self.harness.clone(), command) {
            Ok(started) => started,
            Err(e) => return Ok(TurnEnd::Failed(e.to_string())),
        };
        self.harness_started = true;
        let detail = match &turn.request {
            TurnRequest::Start { .. } => format!(
                "{} started a new conversation in {}",
                self.harness.name(),
                cwd.display()
            ),
            TurnRequest::Resume {
                session_id,
                fork: true,
                ..
            } => format!(
                "{} forked conversation {session_id} in {}",
                self.harness.name(),
                cwd.display()
            ),
            TurnRequest::Resume { session_id, .. } => {
                format!(
                    "{} resumed conversation {session_id} in {}",
                    self.harness.name(),
                    cwd.display()
                )
            }
        };
        tracing::info!(pgid = running.pgid(), "{detail}");
        let driven = match self
            .control
            .progress(AttemptPhase::Running, detail, None)
            .await
        {
            Ok(()) => self.drive(&mut running, &mut events, turn, &cwd).await,
            Err(e) => Err(e.into()),
        };
        let exit = match driven {
            Ok(Driven::Exited(exit)) => exit,
            Ok(Driven::Interrupted) => {
                tracing::info!(grace = ?self.options.stop_grace, "stopping the harness");
                let exit = running.stop(self.options.stop_grace).await;
                tracing::info!(
                    "the harness {}",
                    cairn_utils::process::describe_status(exit.status)
                );
                // A session it announced meanwhile still counts: its inputs were heard.
                while let Ok(event) = events.try_recv() {
                    self.on_event(event, turn, &cwd).await?;
                }
                return Ok(TurnEnd::Interrupted);
            }
            Ok(Driven::Stuck(why)) => {
                tracing::warn!(reason = %why, "the harness is stuck; stopping it");
                running.stop(self.options.stop_grace).await;
                while let Ok(event) = events.try_recv() {
                    self.on_event(event, turn, &cwd).await?;
                }
                return Ok(TurnEnd::Failed(why));
            }
            Err(e) => {
                running.stop(self.options.stop_grace).await;
                return Err(e);
            }
        };
        while let Ok(event) = events.try_recv() {
            self.on_event(event, turn, &cwd).await?;
        }
        tracing::info!(summary = ?exit.observed.summary, "the harness {}", cairn_utils::process::describe_status(exit.status));
        let ended = self.classify(exit, turn);
        if !matches!(ended, TurnEnd::SessionLost(_)) {
            // A turn that ran to its own end read its message, session or not.
            self.heard.extend(&turn.input_ids);
        }
        Ok(ended)
    }

    async fn drive(
        &mut self,
        running: &mut RunningTurn,
        events: &mut mpsc::UnboundedReceiver<TurnEvent>,
        turn: &Turn,
        cwd: &Path,
    ) -> Result<Driven, RunError> {
        // Lent to the loop, which also needs the attempt itself.
        let mut requests = self.requests.take();
        let driven = self
            .drive_with(running, events, &mut requests, turn, cwd)
            .await;
        self.requests = requests;
        driven
    }

    async fn drive_with(
        &mut self,
        running: &mut RunningTurn,
        events: &mut mpsc::UnboundedReceiver<TurnEvent>,
        requests: &mut Option<mpsc::Receiver<requests::Asked>>,
        turn: &Turn,
        cwd: &Path,
    ) -> Result<Driven, RunError> {
        let shutdown = self.shutdown.clone();
        let every = self
            .spec
            .checkpoint_interval
            .as_ref()
            .and_then(|d| cairn_proto::runs::from_proto_duration(d, "checkpoint_interval").ok())
            .filter(|d| !d.is_zero());
        let mut ticker = every.map(|every| {
            let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker
        });
        let mut count_unsaved =
            tokio::time::interval_at(tokio::time::Instant::now() + UNSAVED_EVERY, UNSAVED_EVERY);
        count_unsaved.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(Driven::Interrupted),
                Some(event) = events.recv() => {
                    if let TurnEvent::Stuck(why) = event {
                        return Ok(Driven::Stuck(why));
                    }
                    self.on_event(event, turn, cwd).await?;
                }
                exit = running.finished() => return Ok(Driven::Exited(exit)),
                _ = tick(&mut ticker) => self.interval_checkpoint().await?,
                _ = count_unsaved.tick() => self.report_unsaved().await,
                Some((request, reply)) = next_request(requests) => {
                    self.asked_checkpoint(request, reply).await?;
                }
            }
        }
    }

    /// A checkpoint the agent asked for through the control socket.
    async fn asked_checkpoint(
        &mut self,
        request: control_socket::Request,
        reply: oneshot::Sender<Response>,
    ) -> Result<(), RunError> {
        let started = Instant::now();
        let answer = |response: Response| {
            // The agent may have stopped waiting; nothing is lost then.
            let _ = reply.send(response);
        };
        let reason = match request.reason_for(&self.spec.workspace_id, "run") {
            Ok(reason) => reason,
            Err(refused) => {
                answer(refused);
                return Ok(());
            }
        };
        let checkpoint_request = CheckpointRequest {
            reason,
            harness: self.harness_session(),
            unless_unchanged: request.if_changed.then(|| self.baseline.clone()).flatten(),
        };
        let checkpoint_request_baseline = checkpoint_request.unless_unchanged.clone();
        let (store, shutdown) = (self.store.clone(), self.shutdown.clone());
        let result = tokio::select! {
            result = store.checkpoint(checkpoint_request) => result,
            _ = shutdown.cancelled() => {
                answer(Response::failed("the run is stopping; the checkpoint was given up"));
                return Ok(());
            }
        };
        match result {
            Ok(Some(checkpoint)) => {
                self.committed(&checkpoint).await?;
                answer(Response {
                    report: Some(checkpoint.report.clone()),
                    summary: Some(checkpoint.summary.clone()),
                    ..Response::default()
                });
                Ok(())
            }
            Ok(None) => {
                let baseline = checkpoint_request_baseline
                    .expect("only a checkpoint with a baseline is left uncommitted");
                answer(Response::unchanged(Unchanged {
                    unchanged_since: baseline.checkpoint_id,
                    duration_ms: started.elapsed().as_millis() as u64,
                }));
                Ok(())
            }
            Err(e) if e.is_fenced() => {
                answer(Response::failed(e.to_string()));
                Err(RunError::Superseded(e.to_string()))
            }
            Err(e) => {
                tracing::warn!(%reason, error = %e, "the checkpoint the agent asked for failed");
                answer(Response::failed(cairn_utils::text::one_line(&e)));
                Ok(())
            }
        }
    }

    async fn on_event(
        &mut self,
        event: TurnEvent,
        turn: &Turn,
        cwd: &Path,
    ) -> Result<(), RunError> {
        let TurnEvent::Session(session_id) = event else {
            // Acted on where the turn is driven.
            return Ok(());
        };
        if session_id.len() > 256 || session_id.contains(char::is_whitespace) {
            tracing::warn!(session = %session_id, "the harness reported something that is not a session id; ignoring it");
            return Ok(());
        }
        self.heard.extend(&turn.input_ids);
        self.session = Some(session_id.clone());
        if self.reported_session.as_ref() != Some(&session_id) {
            tracing::info!(session = %session_id, "harness session");
            self.control
                .session(self.harness.name(), &session_id)
                .await?;
            self.reported_session = Some(session_id.clone());
        }
        if let Err(e) =
            prepare::record_session(&self.options.root, self.harness.name(), &session_id, cwd)
        {
            tracing::warn!(error = %e, "cannot record where the conversation runs; a resume elsewhere uses the default directory");
        }
        Ok(())
    }

    fn classify(&mut self, exit: TurnExit, turn: &Turn) -> TurnEnd {
        if let TurnRequest::Resume { session_id, .. } = &turn.request
            && exit.observed.session_lost
        {
            return TurnEnd::SessionLost(session_id.clone());
        }
        let taken =
            outcome::take_with_handoff(&outcome::path_in(&self.options.root)).map(|taken| {
                taken.map(|(outcome, handoff)| {
                    // A turn that wrote no handoff keeps an earlier turn's.
                    if handoff.is_some() {
                        self.agent_handoff = handoff;
                    }
                    outcome
                })
            });
        match taken {
            Ok(Some(OutcomeFile::NeedsInput { question })) => TurnEnd::Asked(question),
            Ok(Some(OutcomeFile::Done { summary })) => TurnEnd::Done(
                summary
                    .or(exit.observed.summary)
                    .or(exit.last_stdout)
                    .unwrap_or_default(),
            ),
            Ok(Some(OutcomeFile::Failed { error })) => TurnEnd::Failed(error),
            Ok(None) if exit.status.success() && exit.observed.error.is_none() => TurnEnd::Done(
                exit.observed
                    .summary
                    .or(exit.last_stdout)
                    .unwrap_or_default(),
            ),
            Ok(None) => TurnEnd::Failed(exit.failure()),
            Err(e) => {
                tracing::error!(error = %e, "the agent's outcome file cannot be used");
                TurnEnd::Failed(e.to_string())
            }
        }
    }

    fn harness_session(&self) -> Option<pb::HarnessSession> {
        self.session.as_ref().map(|session_id| pb::HarnessSession {
            harness: self.harness.name().to_owned(),
            session_id: session_id.clone(),
            station: self.spec.station.clone(),
        })
    }

    fn heard(&self) -> Vec<u64> {
        self.heard.iter().copied().collect()
    }

    async fn committed(&mut self, checkpoint: &Checkpointed) -> Result<(), RunError> {
        tracing::info!(checkpoint = %checkpoint.id, "{}", checkpoint.summary);
        self.baseline = Some(checkpoint.baseline());
        self.last_checkpoint = Some(checkpoint.id.clone());
        self.control
            .progress(
                AttemptPhase::Checkpointed,
                checkpoint.summary.clone(),
                Some(&checkpoint.id),
            )
            .await?;
        // The coordinator set the attempt's unsaved work back to nothing.
        self.unsaved_reported = Some(Unsaved {
            complete: true,
            ..Unsaved::default()
        });
        Ok(())
    }

    /// Counts what the workspace holds that no checkpoint has yet and
    /// reports it when it differs from what the coordinator has. A count
    /// that cannot be made, or a report that fails, waits for the next
    /// tick: it is a figure for people, never worth stopping the run.
    async fn report_unsaved(&mut self) {
        let Some(unsaved) = self.store.unsaved().await else {
            return;
        };
        if self.unsaved_reported == Some(unsaved) {
            return;
        }
        match self.control.unsaved(unsaved).await {
            Ok(()) => self.unsaved_reported = Some(unsaved),
            Err(e) => {
                tracing::debug!(error = %e, "cannot report the unsaved work; the next count tries again")
            }
        }
    }

    /// A lifecycle checkpoint (pause, end, destroy): always committed.
    async fn checkpoint(&mut self, reason: CheckpointReason) -> Result<Cut, RunError> {
        let request = CheckpointRequest {
            reason,
            harness: self.harness_session(),
            unless_unchanged: None,
        };
        self.repos_read = None;
        match self.store.checkpoint(request).await {
            Ok(Some(checkpoint)) => {
                self.committed(&checkpoint).await?;
                self.repos_read = Some(checkpoint.repos.clone());
                Ok(Cut::Committed(checkpoint))
            }
            Ok(None) => Ok(Cut::Failed(format!(
                "the {reason} checkpoint was not committed"
            ))),
            Err(e) if e.is_fenced() => Err(RunError::Superseded(e.to_string())),
            Err(e) => {
                tracing::error!(%reason, error = %e, "checkpoint failed");
                Ok(Cut::Failed(e.to_string()))
            }
        }
    }

    /// A periodic checkpoint while the harness works, only if something
    /// changed; given up (uncommitted) when the runner is told to stop.
    async fn interval_checkpoint(&mut self) -> Result<(), RunError> {
        let request = CheckpointRequest {
            reason: CheckpointReason::Interval,
            harness: self.harness_session(),
            unless_unchanged: self.baseline.clone(),
        };
        let (store, shutdown) = (self.store.clone(), self.shutdown.clone());
        let result = tokio::select! {
            result = store.checkpoint(request) => result,
            _ = shutdown.cancelled() => return Ok(()),
        };
        match result {
            Ok(Some(checkpoint)) => self.committed(&checkpoint).await,
            Ok(None) => {
                tracing::debug!("nothing changed since the last checkpoint");
                Ok(())
            }
            Err(e) if e.is_fenced() => Err(RunError::Superseded(e.to_string())),
            Err(e) => {
                tracing::warn!(error = %e, "periodic checkpoint failed; the next one tries again");
                Ok(())
            }
        }
    }

    async fn finish(
        &mut self,
        outcome: pb::Outcome,
        summary: String,
        mut error: String,
    ) -> Result<Finished, RunError> {
        let mut outcome = outcome;
        if let Cut::Failed(reason) = self.checkpoint(CheckpointReason::End).await? {
            error = match (outcome, error.is_empty()) {
                (pb::Outcome::Succeeded, _) | (_, true) => {
                    format!(
                        "the final checkpoint failed ({reason}); work after checkpoint {} is lost",
                        self.last_checkpoint_or_none()
                    )
                }
                _ => format!("{error}; also, the final checkpoint failed: {reason}"),
            };
            outcome = pb::Outcome::Failed;
        }
        tracing::info!(outcome = ?outcome, %summary, %error, "attempt finished");
        let ending = if outcome == pb::Outcome::Succeeded {
            handoff::Ending::Succeeded {
                summary: summary.clone(),
            }
        } else {
            handoff::Ending::Failed {
                error: error.clone(),
            }
        };
        let note = self.handoff_note(&ending).await;
        self.report_outcome(outcome, summary, error, Some(note))
            .await?;
        Ok(if outcome == pb::Outcome::Succeeded {
            Finished::Succeeded
        } else {
            Finished::Failed
        })
    }

    /// Ends an attempt whose harness never ran: nothing to checkpoint.
    async fn finish_unstarted(&mut self, error: String) -> Result<Finished, RunError> {
        tracing::error!(%error, "the attempt fails before the harness started");
        self.report_outcome(pb::Outcome::Failed, String::new(), error, None)
            .await?;
        Ok(Finished::Failed)
    }

    async fn finish_interrupted(&mut self) -> Result<Finished, RunError> {
        let mut error = String::new();
        if self.harness_started
            && let Cut::Failed(reason) = self.checkpoint(CheckpointReason::Destroy).await?
        {
            error = format!("the destroy checkpoint failed: {reason}");
        }
        tracing::info!(checkpoint = ?self.last_checkpoint, "interrupted");
        let note = if self.harness_started {
            Some(self.handoff_note(&handoff::Ending::Interrupted).await)
        } else {
            None
        };
        self.report_outcome(pb::Outcome::Interrupted, String::new(), error, note)
            .await?;
        Ok(Finished::Interrupted)
    }

    fn last_checkpoint_or_none(&self) -> &str {
        self.last_checkpoint
            .as_ref()
            .map_or("(none)", CheckpointId::as_str)
    }

    /// The run's handoff note: the agent's words where it gave them, the
    /// rest from git (as the checkpoint just committed read it, when there
    /// is one: nothing runs in between) and how the run ended.
    async fn handoff_note(&mut self, ending: &handoff::Ending) -> pb::HandoffText {
        let read = self.repos_read.take();
        let changed =
            handoff::changes(&self.options.root, &self.start_heads, read.as_deref()).await;
        handoff::compose(self.agent_handoff.as_ref(), ending, &changed)
    }

    async fn report_outcome(
        &mut self,
        outcome: pb::Outcome,
        summary: String,
        error: String,
        handoff: Option<pb::HandoffText>,
    ) -> Result<(), RunError> {
        self.control
            .outcome(pb::ReportOutcomeRequest {
                outcome: outcome as i32,
                summary,
                error,
                checkpoint_id: self
                    .last_checkpoint
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
                consumed_inputs: self.heard(),
                handoff,
            })
            .await?;
        Ok(())
    }
}

/// How many paths a line of the prepare step names before it says how many
/// more.
const PATHS_SHOWN: usize = 5;

/// The first [`PATHS_SHOWN`] of `paths`, and how many more: `a, b and 3 more`.
fn listed(paths: &[String]) -> String {
    let mut text = paths[..paths.len().min(PATHS_SHOWN)].join(", ");
    if paths.len() > PATHS_SHOWN {
        text.push_str(&format!(" and {} more", paths.len() - PATHS_SHOWN));
    }
    text
}

/// The next checkpoint the agent asks for; never, without a socket.
async fn next_request(
    requests: &mut Option<mpsc::Receiver<requests::Asked>>,
) -> Option<requests::Asked> {
    match requests {
        Some(requests) => requests.recv().await,
        None => std::future::pending().await,
    }
}

async fn tick(ticker: &mut Option<tokio::time::Interval>) {
    match ticker {
        Some(ticker) => {
            ticker.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Cancels `token` on the first SIGTERM or SIGINT.
pub fn cancel_on_signals(token: CancellationToken) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!("{name} received: stopping the harness, then checkpointing and reporting");
        token.cancel();
    });
    Ok(())
}

/// Connects, retrying a little: the sandbox may start before the network settles.
pub(crate) async fn connect(address: &str, token: &str) -> Result<CoordinatorClient, ConnectError> {
    let mut backoff = Duration::from_millis(250);
    for _ in 0..6 {
        match CoordinatorClient::connect(address, Some(token)).await {
            Err(ConnectError::Unreachable { .. }) => {
                tracing::info!(address, ?backoff, "coordinator unreachable; retrying");
                tokio::time::sleep(backoff).await;
                backoff *= 2;
            }
            other => return other,
        }
    }
    CoordinatorClient::connect(address, Some(token)).await
}
