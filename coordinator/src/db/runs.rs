//! Every run state change, and the requests that make them: creating,
//! answering, messaging, suspending and cancelling runs (their records are
//! in [`super::run_records`]; what runners report is in [`super::runner`]).
//! Above run_records, messages, stations and workspaces: none of them
//! imports this module.
//!
//! Where a run goes on each event, and what the end of an attempt makes of
//! it, is decided by [`crate::runlife`]; here it is persisted, so that each
//! change and its event commit together. [`transition`] asks the table and
//! writes its answer (the state, its reason, the hold), the run's event and
//! the effects; an event the table refuses is a
//! [`DbError::IllegalTransition`] and changes nothing.
//!
//! An attempt ends exactly once ([`end_attempt`]); what the run does next
//! depends on why ([`runlife::next_step`]): the destroy order's reason if
//! there was one, else the cause (host lost, runner exited). A run that was
//! waiting for a person is never retried as a failure: it is suspended (or
//! queued again at once when an answer is already pending).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use super::sql::SqlBuilder;
use cairn_proto::ids::{CheckpointId, RunId, TenantId, WorkspaceId};
use cairn_proto::pb;
use cairn_proto::runs::{
    AttemptPhase, AttemptState, CheckpointLimits, Labels, Outcome, RunState, SandboxState,
};
use cairn_proto::stations::{HandoffText, LaidFiles};
use futures::future::BoxFuture;
use prost::Message as _;
use sqlx::AnyConnection;

use super::group_commit::{Locking, WriteRequest};
use super::messages::{Message, deliver, load_message};
use super::run_records::{
    ATTEMPT_COLUMNS, Attempt, EVENT_COLUMNS, EventDraft, FIRST_EVENT_SEQUENCE, RUN_COLUMNS, Run,
    RunEvent, RunInput, add_event, add_input, attach_attempts, attempt_from_row, event_from_row,
    event_reason, insert_event, insert_events, load_run, load_tenant_run, run_from_row,
};
use super::stations::HandoffNote;
use super::workspaces::{
    KeyLineage, ensure_active_workspace, insert_new_workspaces, insert_workspace,
};
use super::{
    DbError, MetadataStore, WriteTx, from_millis, millis, parse_column, query_error, signed,
    unsigned,
};
use crate::runlife::{self, AttemptEnd, Change, Effect, Event, NextStep, Transition};

/// The kind of every input a person sends (`RunInput.kind`).
pub const ANSWER_INPUT: &str = "answer";

/// Where a new run works.
#[derive(Debug, Clone)]
pub enum NewRunTarget {
    Workspace(WorkspaceId),
    /// Create a workspace (optionally named) in the same transaction.
    NewWorkspace(Option<String>),
}

/// A validated run request.
#[derive(Debug, Clone)]
pub struct NewRun {
    pub target: NewRunTarget,
    pub station: String,
    pub harness: pb::HarnessSpec,
    pub prompt: String,
    pub labels: Labels,
    pub hold: Duration,
    pub max_attempts: u32,
    pub repos: Vec<pb::RepoSpec>,
    pub image: String,
    pub checkpoint_interval: Duration,
    pub checkpoint_limits: CheckpointLimits,
    /// Files laid for the run's station before its harness starts.
    pub lay: LaidFiles,
}

/// Filters of a run listing.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    pub workspace: Option<WorkspaceId>,
    pub state: Option<RunState>,
}

/// What a runner gets when it claims its attempt.
#[derive(Debug, Clone)]
pub struct StartedAttempt {
    pub run: Run,
    pub attempt: Attempt,
    /// Inputs no harness has heard yet.
    pub inputs: Vec<RunInput>,
    /// The station's conversation to resume (empty: start a new one).
    pub resume_session_id: String,
    /// `resume_session_id` belongs to the workspace this one was forked
    /// from: fork it rather than continue it.
    pub fork_session: bool,
    /// An earlier attempt of this run started the harness with the prompt.
    pub prompt_delivered: bool,
    /// The workspace's newest handoff notes, oldest first.
    pub notes: Vec<HandoffNote>,
    /// The files to lay, path → content.
    pub lay: BTreeMap<String, Vec<u8>>,
    /// The harness holding the station's conversation when it is not the
    /// run's (that conversation cannot be resumed); empty otherwise.
    pub station_session_harness: String,
}

/// A phase report of a runner.
#[derive(Debug, Clone)]
pub struct ProgressReport {
    pub phase: AttemptPhase,
    pub detail: String,
    pub checkpoint: Option<CheckpointId>,
}

/// How a runner says its attempt's work ended.
#[derive(Debug, Clone)]
pub struct OutcomeReport {
    pub outcome: Outcome,
    pub summary: String,
    pub error: String,
    pub checkpoint: Option<CheckpointId>,
    /// Input ids the harness heard.
    pub consumed: Vec<u64>,
    /// The run's handoff note, if the runner wrote one.
    pub handoff: Option<HandoffText>,
}

/// A harness conversation of a workspace's station.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRecord {
    pub harness: String,
    pub session_id: String,
}

fn encode_spec(new: &NewRun) -> Vec<u8> {
    pb::Run {
        harness: Some(new.harness.clone()),
        labels: new.labels.0.clone().into_iter().collect(),
        repos: new.repos.clone(),
        laid_paths: new.lay.paths(),
        checkpoint_limits: Some(new.checkpoint_limits.into()),
        ..Default::default()
    }
    .encode_to_vec()
}

fn duration_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// What `event` does to `run` ([`runlife::next`]), or why it may not.
pub(super) fn decide(run: &Run, event: Event) -> Result<Transition, DbError> {
    runlife::next(run.state, event).map_err(|illegal| DbError::IllegalTransition {
        run: run.id.clone(),
        illegal,
    })
}

/// Carries `event` out on the run (updating `run` too) as [`runlife`]
/// decides: see [`persist`].
pub(super) async fn transition(
    tx: &mut WriteTx,
    run: &mut Run,
    event: Event,
    state_reason: impl Into<String>,
    draft: EventDraft,
    now: i64,
) -> Result<(), DbError> {
    let decided = decide(run, event)?;
    persist(tx, run, decided, state_reason.into(), draft, now).await
}

/// Writes what was `decided` for the run as it is: a run that enters a state
/// gets it with `state_reason`, and its hold is cleared when the change says
/// so; a run that stays keeps its state, and its reason unless
/// `state_reason` is not empty. Then the event is recorded with the run's
/// state, and the effects are carried out in order.
pub(super) async fn persist(
    tx: &mut WriteTx,
    run: &mut Run,
    decided: Transition,
    state_reason: String,
    draft: EventDraft,
    now: i64,
) -> Result<(), DbError> {
    if decided.from != run.state {
        return Err(DbError::Corrupt(format!(
            "a change decided for a {} run was applied to run {}, which is {}",
            decided.from, run.id, run.state
        )));
    }
    match decided.change {
        Change::Enter(state) => {
            if decided.effects.contains(&Effect::ClearHold) {
                run.hold_until = None;
            }
            sqlx::query(
                "UPDATE runs SET state = $1, state_reason = $2, hold_until = $3, updated_at = $4 WHERE id = $5",
            )
            .bind(state.as_str())
            .bind(&state_reason)
            .bind(run.hold_until.map(millis))
            .bind(now)
            .bind(run.id.as_str())
            .execute(tx.conn())
            .await
            .map_err(query_error("update run state"))?;
            run.state = state;
            run.state_reason = state_reason;
        }
        Change::Stay if state_reason.is_empty() => {}
        Change::Stay => set_state_reason(tx, run, &state_reason).await?,
    }
    add_event(tx, run, draft, now).await?;
    for effect in decided.effects {
        match effect {
            // Written with the state above.
            Effect::ClearHold => {}
            Effect::ClearQuestion => {
                sqlx::query("UPDATE runs SET question = '' WHERE id = $1")
                    .bind(run.id.as_str())
                    .execute(tx.conn())
                    .await
                    .map_err(query_error("clear question"))?;
                run.question.clear();
            }
            Effect::CountFailedAttempt => {
                run.failed_attempts += 1;
                sqlx::query("UPDATE runs SET failed_attempts = $1 WHERE id = $2")
                    .bind(i64::from(run.failed_attempts))
                    .bind(run.id.as_str())
                    .execute(tx.conn())
                    .await
                    .map_err(query_error("count failed attempts"))?;
            }
            Effect::GiveBackMessages => {
                super::messages::give_back_messages(tx, run, now).await?;
            }
            Effect::OrderDestroy(reason) => {
                if let Some(number) = run.active_attempt().map(|a| a.number) {
                    // Boxed: a sandbox that never started is gone at once,
                    // and its attempt's end moves the run again.
                    Box::pin(order_destroy(tx, run, number, reason, now)).await?;
                }
            }
        }
    }
    Ok(())
}

pub(super) async fn set_attempt_state(
    tx: &mut WriteTx,
    run: &mut Run,
    number: u32,
    state: AttemptState,
) -> Result<(), DbError> {
    sqlx::query("UPDATE attempts SET state = $1 WHERE run_id = $2 AND number = $3")
        .bind(state.as_str())
        .bind(run.id.as_str())
        .bind(i64::from(number))
        .execute(tx.conn())
        .await
        .map_err(query_error("update attempt state"))?;
    if let Some(a) = run.attempt_mut(number) {
        a.state = state;
    }
    Ok(())
}

/// How many inputs of the run no harness has heard yet.
async fn pending_input_count(conn: &mut AnyConnection, run: &RunId) -> Result<u64, DbError> {
    let count: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM run_inputs WHERE run_id = $1 AND consumed_at IS NULL",
    )
    .bind(run.as_str())
    .fetch_one(conn)
    .await
    .map_err(query_error("count pending inputs"))?;
    unsigned(count, "pending inputs")
}

/// Why an attempt ends.
#[derive(Debug, Clone)]
pub(super) enum EndCause {
    /// The host reported the sandbox gone (destroyed on an order, or the
    /// runner exited, or the sandbox failed).
    SandboxGone {
        state: SandboxState,
        exit_code: i32,
        detail: String,
    },
    /// The host missed heartbeats for longer than the lease.
    HostLost { lease: Duration },
}

fn describe_exit(code: i32) -> String {
    if code < 0 {
        format!(
            "runner exited with status {code} (killed by signal {})",
            -code
        )
    } else {
        format!("runner exited with status {code}")
    }
}

/// Records attempt `number` of `run` as ended for `end_reason` (the row and `run`).
pub(super) async fn mark_attempt_ended(
    tx: &mut WriteTx,
    run: &mut Run,
    number: u32,
    end_reason: &str,
    now: i64,
) -> Result<(), DbError> {
    sqlx::query(
        "UPDATE attempts SET state = $1, ended_at = $2, end_reason = $3 WHERE run_id = $4 AND number = $5",
    )
    .bind(AttemptState::Ended.as_str())
    .bind(now)
    .bind(end_reason)
    .bind(run.id.as_str())
    .bind(i64::from(number))
    .execute(tx.conn())
    .await
    .map_err(query_error("end attempt"))?;
    if let Some(a) = run.attempt_mut(number) {
        a.state = AttemptState::Ended;
        a.ended_at = Some(from_millis(now));
        a.end_reason = end_reason.to_owned();
    }
    Ok(())
}

/// Ends the run's current attempt (if it is not ended yet) and moves the run
/// on: released, requeued, or failed when infrastructure failures reached
/// max_attempts.
pub(super) async fn end_attempt(
    tx: &mut WriteTx,
    run: &mut Run,
    number: u32,
    cause: EndCause,
    now: i64,
) -> Result<(), DbError> {
    let Some(attempt) = run.attempt(number).cloned() else {
        return Err(DbError::Corrupt(format!(
            "run {} has no attempt {number}",
            run.id
        )));
    };
    if attempt.is_ended() {
        return Ok(());
    }
    let interrupted = attempt.outcome == Some(Outcome::Interrupted);
    let (end_reason, event_word, detail) = match (&cause, &attempt.destroy_reason) {
        (EndCause::SandboxGone { .. }, Some(order)) => (
            order.clone(),
            event_reason::SANDBOX_RELEASED,
            format!("sandbox {} destroyed ({order})", attempt.sandbox_id),
        ),
        (
            EndCause::SandboxGone {
                state: SandboxState::Failed,
                detail,
                ..
            },
            None,
        ) => {
            let text = if detail.is_empty() {
                "sandbox failed".to_owned()
            } else {
                format!("sandbox failed: {detail}")
            };
            (text.clone(), event_reason::SANDBOX_FAILED, text)
        }
        (EndCause::SandboxGone { exit_code, .. }, None) => {
            let text = describe_exit(*exit_code);
            let word = if interrupted {
                "interrupted".to_owned()
            } else {
                text.clone()
            };
            (word, event_reason::RUNNER_EXITED, text)
        }
        (EndCause::HostLost { lease }, _) => (
            "host_lost".to_owned(),
            event_reason::HOST_LOST,
            format!(
                "host {} missed heartbeats for longer than {}",
                attempt.host_id,
                humantime::format_duration(*lease)
            ),
        ),
    };
    mark_attempt_ended(tx, run, number, &end_reason, now).await?;

    let step = runlife::next_step(run.state, attempt.destroy_reason.as_deref(), interrupted);
    let draft = EventDraft::new(event_word, detail.clone()).of(&attempt);
    let end = match step {
        NextStep::Nothing => None,
        NextStep::Release => Some(AttemptEnd::Released {
            input_pending: pending_input_count(tx.conn(), &run.id).await? > 0,
        }),
        NextStep::Requeue { failure } => Some(AttemptEnd::Retried {
            failure,
            failed_attempts: run.failed_attempts,
            max_attempts: run.max_attempts,
        }),
    };
    let moved = match end {
        None => add_event(tx, run, draft, now).await,
        Some(end) => {
            let decided = decide(run, Event::AttemptEnded(end))?;
            let reason = match (end, decided.to()) {
                (AttemptEnd::Released { .. }, RunState::Queued) => {
                    format!("answered; attempt {number} ended ({end_reason}); waiting for a host")
                }
                (AttemptEnd::Released { .. }, _) => {
                    format!("suspended ({end_reason}); an answer resumes the run")
                }
                (AttemptEnd::Retried { .. }, RunState::Failed) => format!(
                    "gave up after {} failed attempts; the last: {detail}",
                    run.failed_attempts + 1
                ),
                (AttemptEnd::Retried { .. }, _) => {
                    format!("attempt {number} ended ({end_reason}); waiting for a host")
                }
            };
            persist(tx, run, decided, reason, draft, now).await
        }
    };
    moved?;
    super::messages::note_unheard_messages(tx, run, number, now).await
}

/// Records that the host reported the attempt's sandbox gone, and ends the
/// attempt if it was still going.
pub(super) async fn sandbox_gone(
    tx: &mut WriteTx,
    run: &mut Run,
    number: u32,
    state: SandboxState,
    exit_code: i32,
    detail: &str,
    now: i64,
) -> Result<(), DbError> {
    sqlx::query(
        "UPDATE attempts SET sandbox_state = $1, exit_code = $2, sandbox_gone_at = COALESCE(sandbox_gone_at, $3)
         WHERE run_id = $4 AND number = $5",
    )
    .bind(state.as_str())
    .bind(i64::from(exit_code))
    .bind(now)
    .bind(run.id.as_str())
    .bind(i64::from(number))
    .execute(tx.conn())
    .await
    .map_err(query_error("record sandbox gone"))?;
    if let Some(a) = run.attempt_mut(number) {
        a.sandbox_state = Some(state);
        a.exit_code = Some(exit_code);
        a.sandbox_gone_at.get_or_insert(from_millis(now));
    }
    let cause = EndCause::SandboxGone {
        state,
        exit_code,
        detail: detail.to_owned(),
    };
    end_attempt(tx, run, number, cause, now).await
}

/// Orders the host to destroy the attempt's sandbox (the first order's reason
/// stays). A sandbox that neither the host reported nor a runner claimed is
/// taken as gone at once: if the host starts it anyway, its next report gets
/// a destroy order.
pub(super) async fn order_destroy(
    tx: &mut WriteTx,
    run: &mut Run,
    number: u32,
    reason: &str,
    now: i64,
) -> Result<(), DbError> {
    sqlx::query(
        "UPDATE attempts SET destroy_reason = COALESCE(destroy_reason, $1) WHERE run_id = $2 AND number = $3",
    )
    .bind(reason)
    .bind(run.id.as_str())
    .bind(i64::from(number))
    .execute(tx.conn())
    .await
    .map_err(query_error("order destroy"))?;
    let Some(attempt) = run.attempt_mut(number) else {
        return Ok(());
    };
    if attempt.destroy_reason.is_none() {
        tx.ring(&attempt.host_id);
    }
    attempt
        .destroy_reason
        .get_or_insert_with(|| reason.to_owned());
    let never_started = attempt.sandbox_state.is_none()
        && attempt.state == AttemptState::Assigned
        && attempt.sandbox_gone_at.is_none();
    if never_started {
        sandbox_gone(
            tx,
            run,
            number,
            SandboxState::Destroyed,
            0,
            "never started",
            now,
        )
        .await?;
    }
    Ok(())
}

/// Records why the run is in its state, without changing the state.
pub(super) async fn set_state_reason(
    tx: &mut WriteTx,
    run: &mut Run,
    reason: &str,
) -> Result<(), DbError> {
    sqlx::query("UPDATE runs SET state_reason = $1 WHERE id = $2")
        .bind(reason)
        .bind(run.id.as_str())
        .execute(tx.conn())
        .await
        .map_err(query_error("update run state reason"))?;
    run.state_reason = reason.to_owned();
    Ok(())
}

/// How the history tells of an input a person sent (an answer, a message).
pub(super) struct InputNews {
    /// The events' reason.
    pub reason: &'static str,
    /// What the input is called: "the {noun} goes to the next attempt".
    pub noun: &'static str,
    /// The state reason of a run queued for it.
    pub queued: &'static str,
    /// The event's detail then.
    pub next_attempt: &'static str,
}

/// Hands a new input of a waiting or suspended run on: the held sandbox of a
/// waiting run gets it at once (or, while it is being released, the next
/// attempt); a run without one is queued for its next attempt. Returns
/// whether the run was waiting or suspended (nothing is done otherwise).
pub(super) async fn hand_on_input(
    tx: &mut WriteTx,
    run: &mut Run,
    news: InputNews,
    now: i64,
) -> Result<bool, DbError> {
    if !matches!(run.state, RunState::Waiting | RunState::Suspended) {
        return Ok(false);
    }
    let attempt = run.active_attempt().cloned();
    let event = Event::InputArrived {
        sandbox_held: attempt.is_some(),
    };
    match attempt {
        Some(attempt) => {
            let detail = if attempt.destroy_reason.is_some() {
                format!(
                    "the held sandbox is being released; the {} goes to the next attempt",
                    news.noun
                )
            } else {
                "delivered to the held sandbox".to_owned()
            };
            let draft = EventDraft::new(news.reason, detail).of(&attempt);
            transition(tx, run, event, "", draft, now).await?;
        }
        None => {
            let draft = EventDraft::new(news.reason, news.next_attempt);
            transition(tx, run, event, news.queued, draft, now).await?;
        }
    }
    Ok(true)
}

impl MetadataStore {
    /// Creates a queued run (and its workspace, when asked). A workspace that
    /// is not active, or that already has a run that has not ended, is
    /// refused: two runs would fence each other's checkpoints off.
    ///
    /// Calls made while a creation is being written share the next
    /// transaction ([`super::group_commit`]); each is refused or created on
    /// its own.
    pub async fn create_run(&self, tenant: &TenantId, new: NewRun) -> Result<Run, DbError> {
        let creation = RunCreation {
            tenant: tenant.clone(),
            new,
        };
        self.run_creations.submit(self, creation).await
    }

    /// One attempt of a run.
    pub async fn attempt(&self, run: &RunId, number: u32) -> Result<Option<Attempt>, DbError> {
        let row = sqlx::query(&format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE run_id = $1 AND number = $2"
        ))
        .bind(run.as_str())
        .bind(i64::from(number))
        .fetch_optional(&self.pool)
        .await
        .map_err(query_error("attempt"))?;
        row.as_ref()
            .map(|row| attempt_from_row(row).map(|(_, attempt)| attempt))
            .transpose()
    }

    /// A run of `tenant` with its attempts.
    pub async fn run(&self, tenant: &TenantId, id: &RunId) -> Result<Option<Run>, DbError> {
        let mut conn = self.pool.acquire().await.map_err(query_error("run"))?;
        Ok(load_run(&mut conn, id)
            .await?
            .filter(|r| &r.tenant == tenant))
    }

    /// Runs of `tenant`, newest first, older than `before`.
    pub async fn list_runs(
        &self,
        tenant: &TenantId,
        filter: &RunFilter,
        before: Option<&RunId>,
        limit: u32,
    ) -> Result<Vec<Run>, DbError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(query_error("list runs"))?;
        let mut query = SqlBuilder::new(format!("SELECT {RUN_COLUMNS} FROM runs WHERE tenant = "));
        query.push_bind(tenant.as_str());
        if let Some(before) = before {
            query.push(" AND id < ").push_bind(before.as_str());
        }
        if let Some(workspace) = &filter.workspace {
            query
                .push(" AND workspace_id = ")
                .push_bind(workspace.as_str());
        }
        if let Some(state) = filter.state {
            query.push(" AND state = ").push_bind(state.as_str());
        }
        query
            .push(" ORDER BY id DESC LIMIT ")
            .push_bind(i64::from(limit));
        let rows = query
            .build()
            .fetch_all(&mut *conn)
            .await
            .map_err(query_error("list runs"))?;
        let mut runs = rows
            .iter()
            .map(run_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        attach_attempts(&mut conn, &mut runs).await?;
        Ok(runs)
    }

    /// Events of a run after `after`, oldest first, at most `limit`.
    pub async fn run_events(
        &self,
        run: &RunId,
        after: u64,
        limit: u32,
    ) -> Result<Vec<RunEvent>, DbError> {
        let rows = sqlx::query(&format!(
            "SELECT {EVENT_COLUMNS} FROM run_events WHERE run_id = $1 AND sequence > $2
             ORDER BY sequence LIMIT $3"
        ))
        .bind(run.as_str())
        .bind(signed(after, "sequence")?)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("run events"))?;
        rows.iter().map(event_from_row).collect()
    }

    /// Stores an answer. A waiting run keeps its sandbox (the held runner
    /// receives it); a suspended run is queued for its next attempt.
    pub async fn answer_run(
        &self,
        tenant: &TenantId,
        id: &RunId,
        text: &str,
    ) -> Result<Run, DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let mut run = load_tenant_run(tx.conn(), tenant, id).await?;
        if !matches!(run.state, RunState::Waiting | RunState::Suspended) {
            return Err(DbError::Precondition(format!(
                "run {id} is {}; only a waiting or suspended run takes an answer",
                run.state
            )));
        }
        add_input(&mut tx, id, ANSWER_INPUT, text, now).await?;
        let news = InputNews {
            reason: event_reason::ANSWERED,
            noun: "answer",
            queued: "answered; waiting for a host",
            next_attempt: "the next attempt resumes the run",
        };
        hand_on_input(&mut tx, &mut run, news, now).await?;
        self.commit(tx).await?;
        Ok(run)
    }

    /// Stores a message to `station` of an active workspace: an input of the
    /// workspace's unfinished run at the station if there is one (a held
    /// sandbox gets it at once, a suspended run is queued, a running one
    /// picks it up at its next turn or attempt), else pending.
    pub async fn send_message(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
        station: &str,
        text: &str,
    ) -> Result<Message, DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        ensure_active_workspace(tx.conn(), tenant, workspace, "find workspace").await?;
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO workspace_messages (workspace_id, station, text, created_at)
             VALUES ($1, $2, $3, $4) RETURNING id",
        )
        .bind(workspace.as_str())
        .bind(station)
        .bind(text)
        .bind(now)
        .fetch_one(tx.conn())
        .await
        .map_err(query_error("insert message"))?;
        let run: Option<String> = sqlx::query_scalar(
            "SELECT id FROM runs WHERE workspace_id = $1 AND station = $2
             AND state NOT IN ('succeeded', 'failed', 'cancelled') ORDER BY id LIMIT 1",
        )
        .bind(workspace.as_str())
        .bind(station)
        .fetch_optional(tx.conn())
        .await
        .map_err(query_error("find unfinished run"))?;
        if let Some(run_id) = run {
            let run_id: RunId = parse_column(&run_id, "run id")?;
            let mut run = load_run(tx.conn(), &run_id)
                .await?
                .ok_or_else(|| DbError::Corrupt(format!("run {run_id} vanished")))?;
            deliver(&mut tx, &run, id, text, now).await?;
            let news = InputNews {
                reason: event_reason::MESSAGE,
                noun: "message",
                queued: "a message arrived; waiting for a host",
                next_attempt: "the next attempt takes it",
            };
            if !hand_on_input(&mut tx, &mut run, news, now).await? {
                let event = EventDraft::new(
                    event_reason::MESSAGE,
                    "the next turn or attempt picks it up",
                );
                add_event(&mut tx, &run, event, now).await?;
            }
        }
        let message = load_message(&mut tx, id).await?;
        self.commit(tx).await?;
        Ok(message)
    }

    /// Releases the run's sandbox so it waits for input: at once for a queued
    /// run, after the host destroyed the sandbox otherwise.
    pub async fn suspend_run(
        &self,
        tenant: &TenantId,
        id: &RunId,
        reason: &str,
    ) -> Result<Run, DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let mut run = load_tenant_run(tx.conn(), tenant, id).await?;
        let why = if reason.is_empty() {
            "suspended on request".to_owned()
        } else {
            format!("suspended on request: {reason}")
        };
        match run.state {
            RunState::Suspended => return Ok(run),
            state if state.is_terminal() => {
                return Err(DbError::Precondition(format!(
                    "run {id} is {state}; it cannot be suspended"
                )));
            }
            RunState::Queued => {
                transition(
                    &mut tx,
                    &mut run,
                    Event::SuspendRequested,
                    why.clone(),
                    EventDraft::new(event_reason::SUSPENDED, why),
                    now,
                )
                .await?;
            }
            _ => {
                let attempt = run.active_attempt().cloned().ok_or_else(|| {
                    DbError::Corrupt(format!("run {id} is {} without an attempt", run.state))
                })?;
                if attempt.destroy_reason.is_none() {
                    // The run stays as it is until its sandbox is gone.
                    let reason = format!("{why}; releasing sandbox {}", attempt.sandbox_id);
                    let draft = EventDraft::new(event_reason::SUSPEND_REQUESTED, reason.clone())
                        .of(&attempt);
                    let event = Event::SuspendRequested;
                    transition(&mut tx, &mut run, event, reason, draft, now).await?;
                }
            }
        }
        self.commit(tx).await?;
        Ok(run)
    }

    /// Cancels the run at once; its sandbox, if any, is destroyed.
    pub async fn cancel_run(
        &self,
        tenant: &TenantId,
        id: &RunId,
        reason: &str,
    ) -> Result<Run, DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let mut run = load_tenant_run(tx.conn(), tenant, id).await?;
        match run.state {
            RunState::Cancelled => return Ok(run),
            state if state.is_terminal() => {
                return Err(DbError::Precondition(format!(
                    "run {id} already {state}; it cannot be cancelled"
                )));
            }
            _ => {}
        }
        let why = if reason.is_empty() {
            "cancelled on request".to_owned()
        } else {
            format!("cancelled: {reason}")
        };
        let mut event = EventDraft::new(event_reason::CANCELLED, why.clone());
        if let Some(attempt) = run.active_attempt() {
            event = event.of(attempt);
        }
        // A live attempt's sandbox is ordered destroyed too.
        transition(&mut tx, &mut run, Event::CancelRequested, why, event, now).await?;
        self.commit(tx).await?;
        Ok(run)
    }
}

/// A CreateRun request: the tenant and what to create.
pub(crate) struct RunCreation {
    pub(crate) tenant: TenantId,
    pub(crate) new: NewRun,
}

/// Why a new run waits.
const WAITING_FOR_THE_SCHEDULER: &str = "waiting for the scheduler";

impl WriteRequest for RunCreation {
    type Answer = Run;

    /// A run on a new workspace inserts its workspace, keys, run, laid
    /// files and event, all under ids made for it, and reads nothing; a
    /// name two take at once is settled by the unique index.
    fn locking(batch: &[Self]) -> Locking {
        if Self::writes_all_at_once(batch) {
            Locking::None
        } else {
            Locking::All
        }
    }

    fn writes_all_at_once(batch: &[Self]) -> bool {
        batch
            .iter()
            .all(|c| matches!(c.new.target, NewRunTarget::NewWorkspace(_)))
    }

    fn write_all<'a>(
        batch: &'a [Self],
        tx: &'a mut WriteTx,
    ) -> BoxFuture<'a, Result<Vec<Option<Run>>, DbError>> {
        Box::pin(async move {
            let runs = create_runs_on_new_workspaces(tx, batch).await?;
            Ok(runs.into_iter().map(Some).collect())
        })
    }

    fn write(self, tx: &mut WriteTx) -> BoxFuture<'_, Result<Run, DbError>> {
        Box::pin(async move {
            let now = millis(SystemTime::now());
            create_run_in(tx, &self.tenant, self.new, now).await
        })
    }
}

/// Creates one run inside `tx` (see [`MetadataStore::create_run`]).
async fn create_run_in(
    tx: &mut WriteTx,
    tenant: &TenantId,
    new: NewRun,
    now: i64,
) -> Result<Run, DbError> {
    let workspace = match &new.target {
        NewRunTarget::Workspace(id) => {
            ensure_active_workspace(tx.conn(), tenant, id, "find workspace").await?;
            let busy: Option<(String, String)> = sqlx::query_as(
                "SELECT id, state FROM runs WHERE workspace_id = $1
                     AND state NOT IN ('succeeded', 'failed', 'cancelled') ORDER BY id LIMIT 1",
            )
            .bind(id.as_str())
            .fetch_optional(tx.conn())
            .await
            .map_err(query_error("find active runs"))?;
            if let Some((run, state)) = busy {
                return Err(DbError::Precondition(format!(
                    "workspace {id} already has run {run} ({state}); cancel it or wait until it ends"
                )));
            }
            id.clone()
        }
        NewRunTarget::NewWorkspace(name) => {
            let id = WorkspaceId::generate();
            let op = "insert workspace";
            let lineage = KeyLineage::New;
            insert_workspace(tx.conn(), &id, tenant, name.as_deref(), lineage, 0, now, op).await?;
            id
        }
    };
    let id = RunId::generate();
    // The run is written with its first event's sequence and read back in
    // the same statement: a new run has no attempts to load.
    let row = sqlx::query(&format!(
        "INSERT INTO runs ({RUN_COLUMNS}, last_event_sequence)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, '', '', '', '', NULL, 0, 0, $13, $13, 1)
         RETURNING {RUN_COLUMNS}"
    ))
    .bind(id.as_str())
    .bind(tenant.as_str())
    .bind(workspace.as_str())
    .bind(&new.station)
    .bind(&new.prompt)
    .bind(encode_spec(&new))
    .bind(&new.image)
    .bind(duration_millis(new.hold))
    .bind(duration_millis(new.checkpoint_interval))
    .bind(i64::from(new.max_attempts))
    .bind(runlife::INITIAL.as_str())
    .bind(WAITING_FOR_THE_SCHEDULER)
    .bind(now)
    .fetch_one(tx.conn())
    .await
    .map_err(query_error("insert run"))?;
    let mut run = run_from_row(&row)?;
    super::stations::insert_laid_files(tx, &id, &new.lay).await?;
    let created = EventDraft::new(event_reason::CREATED, created_detail(&run));
    insert_event(tx, &run, FIRST_EVENT_SEQUENCE, created, now).await?;
    // Messages left for the station wait on an existing workspace only.
    if matches!(new.target, NewRunTarget::Workspace(_)) {
        super::messages::attach_pending_messages(tx, &run, now).await?;
    }
    run.updated_at = from_millis(now);
    Ok(run)
}

/// What a run's `created` event says of it.
fn created_detail(run: &Run) -> String {
    format!(
        "station {}, harness {}{}{}",
        run.station,
        run.harness.name,
        if run.labels.is_empty() {
            String::new()
        } else {
            format!(", labels {}", run.labels)
        },
        match run.laid_paths.len() {
            0 => String::new(),
            1 => format!(", lays {}", run.laid_paths[0]),
            n => format!(", lays {n} files"),
        }
    )
}

/// Creates runs, each on a new workspace, in a few statements whatever
/// their number: the workspaces and their keys, the runs (read back by
/// RETURNING), their laid files, their `created` events. Any failure (a
/// name taken) fails the lot; the caller then creates them one by one.
async fn create_runs_on_new_workspaces(
    tx: &mut WriteTx,
    batch: &[RunCreation],
) -> Result<Vec<Run>, DbError> {
    let now = millis(SystemTime::now());
    let mut ids = Vec::with_capacity(batch.len());
    for creation in batch {
        let NewRunTarget::NewWorkspace(name) = &creation.new.target else {
            return Err(DbError::Invalid("a run on an existing workspace".into()));
        };
        ids.push((WorkspaceId::generate(), RunId::generate(), name.as_deref()));
    }
    let workspaces: Vec<_> = batch
        .iter()
        .zip(&ids)
        .map(|(creation, (workspace, _, name))| (workspace, &creation.tenant, *name))
        .collect();
    insert_new_workspaces(tx.conn(), &workspaces, now).await?;

    let mut query = SqlBuilder::new(format!(
        "INSERT INTO runs ({RUN_COLUMNS}, last_event_sequence)"
    ));
    query.push_values(
        batch.iter().zip(&ids),
        |mut row, (creation, (workspace, run, _))| {
            let new = &creation.new;
            row.push_bind(run.as_str())
                .push_bind(creation.tenant.as_str())
                .push_bind(workspace.as_str())
                .push_bind(new.station.as_str())
                .push_bind(new.prompt.as_str())
                .push_bind(encode_spec(new))
                .push_bind(new.image.as_str())
                .push_bind(duration_millis(new.hold))
                .push_bind(duration_millis(new.checkpoint_interval))
                .push_bind(i64::from(new.max_attempts))
                .push_bind(runlife::INITIAL.as_str())
                .push_bind(WAITING_FOR_THE_SCHEDULER);
            // question, summary, harness_session_id, last_checkpoint_id, then
            // hold_until, attempt_count, failed_attempts: none yet.
            row.push_bind("")
                .push_bind("")
                .push_bind("")
                .push_bind("")
                .push_bind(None::<i64>)
                .push_bind(0_i64)
                .push_bind(0_i64)
                .push_bind(now)
                .push_bind(now)
                .push_bind(FIRST_EVENT_SEQUENCE);
        },
    );
    query.push(format!(" RETURNING {RUN_COLUMNS}"));
    let rows = query
        .build()
        .fetch_all(tx.conn())
        .await
        .map_err(query_error("insert runs"))?;
    let mut by_id = HashMap::with_capacity(rows.len());
    for row in &rows {
        let run = run_from_row(row)?;
        by_id.insert(run.id.clone(), run);
    }
    let mut runs = Vec::with_capacity(batch.len());
    for (creation, (_, id, _)) in batch.iter().zip(&ids) {
        let mut run = by_id
            .remove(id)
            .ok_or_else(|| DbError::Corrupt(format!("run {id} vanished while it was created")))?;
        super::stations::insert_laid_files(tx, id, &creation.new.lay).await?;
        run.updated_at = from_millis(now);
        runs.push(run);
    }

    let events: Vec<_> = runs
        .iter()
        .map(|run| {
            let event = EventDraft::new(event_reason::CREATED, created_detail(run));
            (run, FIRST_EVENT_SEQUENCE, event)
        })
        .collect();
    insert_events(tx, &events, now).await?;
    Ok(runs)
}
