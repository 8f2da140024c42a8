//! The records of runs (runs, attempts, events, inputs), how they are read,
//! and the lowest-level writes on them: appending an event, adding an input.
//!
//! Below runs, messages, stations and workspaces: imports none of them (nor
//! [`crate::runlife`]); run state changes are in [`super::runs`].

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use super::sql::SqlBuilder;
use cairn_proto::ids::{Generation, HostId, RunId, TenantId, WorkspaceId};
use cairn_proto::pb;
use cairn_proto::runs::{AttemptState, CheckpointLimits, Labels, Outcome, RunState, SandboxState};
use prost::Message;
use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};

use super::checkpoints::push_in_list;
use super::{DbError, WriteTx, from_millis, parse_column, query_error, signed, unsigned};

/// Short machine words of run events (`RunEvent.reason`).
pub mod event_reason {
    pub const CREATED: &str = "created";
    pub const PLACEMENT: &str = "placement";
    pub const ASSIGNED: &str = "assigned";
    pub const CLAIMED: &str = "claimed";
    pub const RESTORED: &str = "restored";
    /// A restore could not bring back the end of the attempt before: it
    /// ended without a last checkpoint (host lost, runner died).
    pub const WORK_LOST: &str = "work_lost";
    pub const PREPARED: &str = "prepared";
    pub const HARNESS_STARTED: &str = "harness_started";
    pub const RUNNING: &str = "running";
    /// A later turn of a running harness: the conversation it continues,
    /// or that the one to continue was lost and a briefed one started.
    pub const TURN: &str = "turn";
    pub const CHECKPOINT: &str = "checkpoint";
    pub const HARNESS_SESSION: &str = "harness_session";
    pub const WAITING: &str = "waiting";
    pub const ANSWERED: &str = "answered";
    pub const HOLD_EXPIRED: &str = "hold_expired";
    pub const SUSPEND_REQUESTED: &str = "suspend_requested";
    pub const SUSPENDED: &str = "suspended";
    pub const DRAINING: &str = "draining";
    pub const HOST_STOPPING: &str = "host_stopping";
    pub const SANDBOX_RELEASED: &str = "sandbox_released";
    pub const HOST_LOST: &str = "host_lost";
    pub const RUNNER_EXITED: &str = "runner_exited";
    pub const SANDBOX_FAILED: &str = "sandbox_failed";
    pub const INTERRUPTED: &str = "interrupted";
    pub const SUCCEEDED: &str = "succeeded";
    pub const FAILED: &str = "failed";
    pub const CANCELLED: &str = "cancelled";
    pub const WORKSPACE_INACTIVE: &str = "workspace_inactive";
    pub const MESSAGE: &str = "message";
    pub const MESSAGE_GIVEN_BACK: &str = "message_given_back";
}

/// One attempt of a run: a sandbox on a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub number: u32,
    pub generation: Generation,
    pub host_id: HostId,
    pub sandbox_id: String,
    pub state: AttemptState,
    pub started_at: SystemTime,
    pub ended_at: Option<SystemTime>,
    pub end_reason: String,
    pub prepare: String,
    pub restored_checkpoint_id: String,
    pub outcome: Option<Outcome>,
    pub destroy_reason: Option<String>,
    pub sandbox_state: Option<SandboxState>,
    pub exit_code: Option<i32>,
    pub sandbox_gone_at: Option<SystemTime>,
    /// What its workspace holds that no checkpoint has yet, as its runner
    /// last reported (`None`: never reported).
    pub unsaved: Option<UnsavedWork>,
}

/// A runner's count of what its workspace holds that no checkpoint has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnsavedWork {
    pub files: u64,
    pub bytes: u64,
    /// False: the count stopped at its bound; the figures are a floor.
    pub complete: bool,
    pub reported_at: SystemTime,
}

impl Attempt {
    pub fn is_ended(&self) -> bool {
        self.state == AttemptState::Ended
    }
}

/// A run with its attempts (oldest first).
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub id: RunId,
    pub tenant: TenantId,
    pub workspace_id: WorkspaceId,
    pub station: String,
    pub harness: pb::HarnessSpec,
    pub prompt: String,
    pub labels: Labels,
    pub repos: Vec<pb::RepoSpec>,
    pub image: String,
    pub hold: Duration,
    pub checkpoint_interval: Duration,
    /// The run's own limits on each checkpoint (the runner keeps the
    /// stricter of these and its own).
    pub checkpoint_limits: CheckpointLimits,
    pub max_attempts: u32,
    pub state: RunState,
    pub state_reason: String,
    pub question: String,
    pub summary: String,
    pub harness_session_id: String,
    pub last_checkpoint_id: String,
    pub hold_until: Option<SystemTime>,
    pub attempt_count: u32,
    pub failed_attempts: u32,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
    pub attempts: Vec<Attempt>,
    /// The paths the run lays (their contents are read only at a claim).
    pub laid_paths: Vec<String>,
}

impl Run {
    /// The newest attempt, if the run was ever assigned.
    pub fn current_attempt(&self) -> Option<&Attempt> {
        self.attempts
            .iter()
            .find(|a| a.number == self.attempt_count)
    }

    /// The newest attempt unless it ended.
    pub fn active_attempt(&self) -> Option<&Attempt> {
        self.current_attempt().filter(|a| !a.is_ended())
    }

    /// Attempt `number`, if the run has it.
    pub fn attempt(&self, number: u32) -> Option<&Attempt> {
        self.attempts.iter().find(|a| a.number == number)
    }

    pub(super) fn attempt_mut(&mut self, number: u32) -> Option<&mut Attempt> {
        self.attempts.iter_mut().find(|a| a.number == number)
    }
}

/// One entry of a run's history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunEvent {
    pub run_id: RunId,
    pub sequence: u64,
    pub at: SystemTime,
    pub state: RunState,
    pub reason: String,
    pub host_id: String,
    pub attempt: u32,
    pub generation: u64,
    pub checkpoint_id: String,
    pub detail: String,
}

/// A message for the run's harness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInput {
    pub id: u64,
    pub kind: String,
    pub text: String,
    pub created_at: SystemTime,
}

pub(super) const RUN_COLUMNS: &str =
    "id, tenant, workspace_id, station, prompt, spec, image, hold_ms,
     checkpoint_interval_ms, max_attempts, state, state_reason, question, summary,
     harness_session_id, last_checkpoint_id, hold_until, attempt_count, failed_attempts,
     created_at, updated_at";

pub(super) const ATTEMPT_COLUMNS: &str =
    "run_id, number, generation, host_id, sandbox_id, state, started_at,
     ended_at, end_reason, prepare, restored_checkpoint_id, outcome, destroy_reason,
     sandbox_state, exit_code, sandbox_gone_at, unsaved_files, unsaved_bytes,
     unsaved_complete, unsaved_at";

pub(super) const EVENT_COLUMNS: &str =
    "run_id, sequence, at, state, reason, host_id, attempt, generation, checkpoint_id, detail";

fn millis_duration(ms: i64, what: &str) -> Result<Duration, DbError> {
    Ok(Duration::from_millis(unsigned(ms, what)?))
}

pub(super) fn run_from_row(row: &AnyRow) -> Result<Run, DbError> {
    let read = |source| DbError::Query {
        op: "read run",
        source,
    };
    let id: String = row.try_get("id").map_err(read)?;
    let tenant: String = row.try_get("tenant").map_err(read)?;
    let workspace: String = row.try_get("workspace_id").map_err(read)?;
    let spec: Vec<u8> = row.try_get("spec").map_err(read)?;
    let spec = pb::Run::decode(spec.as_slice())
        .map_err(|e| DbError::Corrupt(format!("stored spec of run {id}: {e}")))?;
    let state: String = row.try_get("state").map_err(read)?;
    let hold_until: Option<i64> = row.try_get("hold_until").map_err(read)?;
    Ok(Run {
        id: parse_column(&id, "run id")?,
        tenant: parse_column(&tenant, "tenant")?,
        workspace_id: parse_column(&workspace, "workspace id")?,
        station: row.try_get("station").map_err(read)?,
        harness: spec.harness.unwrap_or_default(),
        prompt: row.try_get("prompt").map_err(read)?,
        labels: Labels(spec.labels.into_iter().collect()),
        repos: spec.repos,
        image: row.try_get("image").map_err(read)?,
        hold: millis_duration(row.try_get("hold_ms").map_err(read)?, "hold")?,
        checkpoint_interval: millis_duration(
            row.try_get("checkpoint_interval_ms").map_err(read)?,
            "checkpoint interval",
        )?,
        checkpoint_limits: spec.checkpoint_limits.map(Into::into).unwrap_or_default(),
        max_attempts: unsigned(row.try_get("max_attempts").map_err(read)?, "max attempts")?,
        state: parse_column::<RunState>(&state, "run state")?,
        state_reason: row.try_get("state_reason").map_err(read)?,
        question: row.try_get("question").map_err(read)?,
        summary: row.try_get("summary").map_err(read)?,
        harness_session_id: row.try_get("harness_session_id").map_err(read)?,
        last_checkpoint_id: row.try_get("last_checkpoint_id").map_err(read)?,
        hold_until: hold_until.map(from_millis),
        attempt_count: unsigned(row.try_get("attempt_count").map_err(read)?, "attempt count")?,
        failed_attempts: unsigned(
            row.try_get("failed_attempts").map_err(read)?,
            "failed attempts",
        )?,
        created_at: from_millis(row.try_get("created_at").map_err(read)?),
        updated_at: from_millis(row.try_get("updated_at").map_err(read)?),
        attempts: Vec::new(),
        laid_paths: spec.laid_paths,
    })
}

pub(super) fn attempt_from_row(row: &AnyRow) -> Result<(RunId, Attempt), DbError> {
    let read = |source| DbError::Query {
        op: "read attempt",
        source,
    };
    let run: String = row.try_get("run_id").map_err(read)?;
    let host: String = row.try_get("host_id").map_err(read)?;
    let state: String = row.try_get("state").map_err(read)?;
    let outcome: Option<String> = row.try_get("outcome").map_err(read)?;
    let sandbox_state: Option<String> = row.try_get("sandbox_state").map_err(read)?;
    let exit_code: Option<i64> = row.try_get("exit_code").map_err(read)?;
    let ended_at: Option<i64> = row.try_get("ended_at").map_err(read)?;
    let gone_at: Option<i64> = row.try_get("sandbox_gone_at").map_err(read)?;
    let attempt = Attempt {
        number: unsigned(row.try_get("number").map_err(read)?, "attempt number")?,
        generation: Generation(unsigned(
            row.try_get("generation").map_err(read)?,
            "generation",
        )?),
        host_id: parse_column(&host, "host id")?,
        sandbox_id: row.try_get("sandbox_id").map_err(read)?,
        state: parse_column::<AttemptState>(&state, "attempt state")?,
        started_at: from_millis(row.try_get("started_at").map_err(read)?),
        ended_at: ended_at.map(from_millis),
        end_reason: row.try_get("end_reason").map_err(read)?,
        prepare: row.try_get("prepare").map_err(read)?,
        restored_checkpoint_id: row.try_get("restored_checkpoint_id").map_err(read)?,
        outcome: outcome
            .map(|o| parse_column::<Outcome>(&o, "outcome"))
            .transpose()?,
        destroy_reason: row.try_get("destroy_reason").map_err(read)?,
        sandbox_state: sandbox_state
            .map(|s| parse_column::<SandboxState>(&s, "sandbox state"))
            .transpose()?,
        exit_code: exit_code
            .map(|c| i32::try_from(c).map_err(|_| DbError::Corrupt(format!("exit code {c}"))))
            .transpose()?,
        sandbox_gone_at: gone_at.map(from_millis),
        unsaved: unsaved_from_row(row)?,
    };
    Ok((parse_column(&run, "run id")?, attempt))
}

fn unsaved_from_row(row: &AnyRow) -> Result<Option<UnsavedWork>, DbError> {
    let read = |source| DbError::Query {
        op: "read attempt",
        source,
    };
    let at: Option<i64> = row.try_get("unsaved_at").map_err(read)?;
    let Some(at) = at else {
        return Ok(None);
    };
    let files: Option<i64> = row.try_get("unsaved_files").map_err(read)?;
    let bytes: Option<i64> = row.try_get("unsaved_bytes").map_err(read)?;
    let complete: Option<i64> = row.try_get("unsaved_complete").map_err(read)?;
    Ok(Some(UnsavedWork {
        files: unsigned(files.unwrap_or(0), "unsaved files")?,
        bytes: unsigned(bytes.unwrap_or(0), "unsaved bytes")?,
        complete: complete.unwrap_or(0) != 0,
        reported_at: from_millis(at),
    }))
}

pub(super) fn event_from_row(row: &AnyRow) -> Result<RunEvent, DbError> {
    let read = |source| DbError::Query {
        op: "read run event",
        source,
    };
    let run: String = row.try_get("run_id").map_err(read)?;
    let state: String = row.try_get("state").map_err(read)?;
    Ok(RunEvent {
        run_id: parse_column(&run, "run id")?,
        sequence: unsigned(row.try_get("sequence").map_err(read)?, "event sequence")?,
        at: from_millis(row.try_get("at").map_err(read)?),
        state: parse_column::<RunState>(&state, "run state")?,
        reason: row.try_get("reason").map_err(read)?,
        host_id: row.try_get("host_id").map_err(read)?,
        attempt: unsigned(row.try_get("attempt").map_err(read)?, "attempt")?,
        generation: unsigned(row.try_get("generation").map_err(read)?, "generation")?,
        checkpoint_id: row.try_get("checkpoint_id").map_err(read)?,
        detail: row.try_get("detail").map_err(read)?,
    })
}

fn input_from_row(row: &AnyRow) -> Result<RunInput, DbError> {
    let read = |source| DbError::Query {
        op: "read run input",
        source,
    };
    Ok(RunInput {
        id: unsigned(row.try_get("id").map_err(read)?, "input id")?,
        kind: row.try_get("kind").map_err(read)?,
        text: row.try_get("text").map_err(read)?,
        created_at: from_millis(row.try_get("created_at").map_err(read)?),
    })
}

/// Fills in the attempts of `runs`.
pub(super) async fn attach_attempts(
    conn: &mut AnyConnection,
    runs: &mut [Run],
) -> Result<(), DbError> {
    if runs.is_empty() {
        return Ok(());
    }
    let ids: Vec<RunId> = runs.iter().map(|r| r.id.clone()).collect();
    let mut by_run: HashMap<RunId, Vec<Attempt>> = HashMap::new();
    for chunk in ids.chunks(super::ROWS_PER_STATEMENT) {
        let mut query = SqlBuilder::new(format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE run_id IN"
        ));
        push_in_list(&mut query, chunk, RunId::as_str);
        query.push(" ORDER BY run_id, number");
        let rows = query
            .build()
            .fetch_all(&mut *conn)
            .await
            .map_err(query_error("attempts"))?;
        for row in &rows {
            let (run, attempt) = attempt_from_row(row)?;
            by_run.entry(run).or_default().push(attempt);
        }
    }
    for run in runs {
        run.attempts = by_run.remove(&run.id).unwrap_or_default();
    }
    Ok(())
}

/// A run (of any tenant) with its attempts.
pub(super) async fn load_run(conn: &mut AnyConnection, id: &RunId) -> Result<Option<Run>, DbError> {
    let row = sqlx::query(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = $1"))
        .bind(id.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(query_error("run"))?;
    let Some(row) = row else { return Ok(None) };
    let mut runs = [run_from_row(&row)?];
    attach_attempts(conn, &mut runs).await?;
    let [run] = runs;
    Ok(Some(run))
}

/// A run of `tenant`, or NotFound.
pub(super) async fn load_tenant_run(
    conn: &mut AnyConnection,
    tenant: &TenantId,
    id: &RunId,
) -> Result<Run, DbError> {
    load_run(conn, id)
        .await?
        .filter(|r| &r.tenant == tenant)
        .ok_or_else(|| DbError::NotFound(format!("run {id} does not exist")))
}

/// What an event records besides the run's state.
#[derive(Debug, Default)]
pub(super) struct EventDraft {
    pub reason: &'static str,
    pub detail: String,
    pub host_id: String,
    pub attempt: u32,
    pub generation: u64,
    pub checkpoint_id: String,
}

impl EventDraft {
    pub fn new(reason: &'static str, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
            ..Default::default()
        }
    }

    /// Names the attempt (its host, number and generation).
    pub fn of(mut self, attempt: &Attempt) -> Self {
        self.host_id = attempt.host_id.to_string();
        self.attempt = attempt.number;
        self.generation = attempt.generation.0;
        self
    }

    pub fn checkpoint(mut self, id: &str) -> Self {
        self.checkpoint_id = id.to_owned();
        self
    }
}

/// Appends an event to the run's history with the run's current state.
pub(super) async fn add_event(
    tx: &mut WriteTx,
    run: &Run,
    event: EventDraft,
    now: i64,
) -> Result<(), DbError> {
    let sequence: i64 = sqlx::query_scalar(
        "UPDATE runs SET last_event_sequence = last_event_sequence + 1, updated_at = $1
         WHERE id = $2 RETURNING last_event_sequence",
    )
    .bind(now)
    .bind(run.id.as_str())
    .fetch_one(tx.conn())
    .await
    .map_err(query_error("advance event sequence"))?;
    insert_event(tx, run, sequence, event, now).await
}

/// Inserts events of several runs in one statement a chunk: each `(run,
/// sequence, event)` is the run's event number `sequence`, which the run's
/// `last_event_sequence` already counts.
pub(super) async fn insert_events(
    tx: &mut WriteTx,
    events: &[(&Run, i64, EventDraft)],
    now: i64,
) -> Result<(), DbError> {
    for chunk in events.chunks(super::ROWS_PER_STATEMENT) {
        let mut query = SqlBuilder::new(
            "INSERT INTO run_events (run_id, sequence, at, state, reason, host_id, attempt,
                                     generation, checkpoint_id, detail)",
        );
        let mut generations = Vec::with_capacity(chunk.len());
        for (_, _, event) in chunk {
            generations.push(signed(event.generation, "generation")?);
        }
        query.push_values(
            chunk.iter().zip(generations),
            |mut row, ((run, sequence, event), generation)| {
                row.push_bind(run.id.as_str())
                    .push_bind(*sequence)
                    .push_bind(now)
                    .push_bind(run.state.as_str())
                    .push_bind(event.reason)
                    .push_bind(event.host_id.as_str())
                    .push_bind(i64::from(event.attempt))
                    .push_bind(generation)
                    .push_bind(event.checkpoint_id.as_str())
                    .push_bind(event.detail.as_str());
            },
        );
        query
            .build()
            .execute(tx.conn())
            .await
            .map_err(query_error("insert run events"))?;
        for (run, _, _) in chunk {
            tx.touch(&run.id);
        }
    }
    Ok(())
}

/// The sequence of a run's first event: a new run is written with it.
pub(super) const FIRST_EVENT_SEQUENCE: i64 = 1;

/// Inserts `run`'s event number `sequence`, which the run's
/// `last_event_sequence` already counts.
pub(super) async fn insert_event(
    tx: &mut WriteTx,
    run: &Run,
    sequence: i64,
    event: EventDraft,
    now: i64,
) -> Result<(), DbError> {
    sqlx::query(
        "INSERT INTO run_events (run_id, sequence, at, state, reason, host_id, attempt, generation,
                                 checkpoint_id, detail)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(run.id.as_str())
    .bind(sequence)
    .bind(now)
    .bind(run.state.as_str())
    .bind(event.reason)
    .bind(&event.host_id)
    .bind(i64::from(event.attempt))
    .bind(signed(event.generation, "generation")?)
    .bind(&event.checkpoint_id)
    .bind(&event.detail)
    .execute(tx.conn())
    .await
    .map_err(query_error("insert run event"))?;
    tx.touch(&run.id);
    Ok(())
}

/// Adds input `text` of `kind` to the run; returns its id.
pub(super) async fn add_input(
    tx: &mut WriteTx,
    run: &RunId,
    kind: &str,
    text: &str,
    now: i64,
) -> Result<i64, DbError> {
    let id: i64 =
        sqlx::query_scalar("SELECT COALESCE(MAX(id), 0) + 1 FROM run_inputs WHERE run_id = $1")
            .bind(run.as_str())
            .fetch_one(tx.conn())
            .await
            .map_err(query_error("next input id"))?;
    sqlx::query(
        "INSERT INTO run_inputs (run_id, id, kind, text, created_at) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(run.as_str())
    .bind(id)
    .bind(kind)
    .bind(text)
    .bind(now)
    .execute(tx.conn())
    .await
    .map_err(query_error("insert input"))?;
    Ok(id)
}

pub(super) async fn pending_inputs(
    conn: &mut AnyConnection,
    run: &RunId,
) -> Result<Vec<RunInput>, DbError> {
    let rows = sqlx::query(
        "SELECT id, kind, text, created_at FROM run_inputs
         WHERE run_id = $1 AND consumed_at IS NULL ORDER BY id",
    )
    .bind(run.as_str())
    .fetch_all(conn)
    .await
    .map_err(query_error("pending inputs"))?;
    rows.iter().map(input_from_row).collect()
}
