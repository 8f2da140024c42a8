//! What runners report about their attempts: claim, progress, the harness
//! session, waiting for a person, inputs, the outcome.
//!
//! Every call names its attempt (from the run token). Only the run's current
//! attempt, before it ended, is heard; others are refused with
//! [`DbError::Precondition`]. Reports of an attempt whose sandbox is being
//! destroyed, or whose run ended, are recorded but no longer move the run.

use std::time::{Duration, SystemTime};

use cairn_proto::ids::{CheckpointId, RunId};
use cairn_proto::refusal::NotCurrent;
use cairn_proto::runs::{AttemptPhase, AttemptState, Outcome, RunState};

use super::run_records::{
    Attempt, EventDraft, Run, RunInput, add_event, event_reason, load_run, pending_inputs,
};
use super::runs::{
    OutcomeReport, ProgressReport, SessionRecord, StartedAttempt, decide, mark_attempt_ended,
    persist, set_attempt_state, transition,
};
use super::stations::{NOTES_PER_ATTEMPT, laid_files, record_note, workspace_notes};
use super::{DbError, MetadataStore, WriteTx, from_millis, millis, query_error, signed};
use crate::runlife::{self, Event};
use sqlx::AnyConnection;

/// The attempt a runner speaks for, if it is the run's current one and has
/// not ended.
fn runner_attempt(run: &Run, number: u32) -> Result<Attempt, DbError> {
    if number != run.attempt_count {
        return Err(DbError::AttemptNotCurrent {
            run: run.id.clone(),
            attempt: number,
            why: NotCurrent::Superseded,
            detail: format!(
                "attempt {number} of run {} was superseded by attempt {}",
                run.id, run.attempt_count
            ),
        });
    }
    let attempt = run
        .current_attempt()
        .ok_or_else(|| DbError::Corrupt(format!("run {} has no attempt {number}", run.id)))?;
    if attempt.is_ended() {
        return Err(DbError::AttemptNotCurrent {
            run: run.id.clone(),
            attempt: number,
            why: if run.state == RunState::Cancelled {
                NotCurrent::Cancelled
            } else {
                NotCurrent::Ended
            },
            detail: format!(
                "attempt {number} of run {} has ended ({})",
                run.id, attempt.end_reason
            ),
        });
    }
    Ok(attempt.clone())
}

/// The run and the attempt a runner speaks for (see [`runner_attempt`]).
async fn load_runner_attempt(
    conn: &mut AnyConnection,
    run_id: &RunId,
    number: u32,
) -> Result<(Run, Attempt), DbError> {
    let run = load_run(conn, run_id)
        .await?
        .ok_or_else(|| DbError::NotFound(format!("run {run_id} does not exist")))?;
    let attempt = runner_attempt(&run, number)?;
    Ok((run, attempt))
}

/// Whether the run's state may still follow its runner's reports: not once
/// it is terminal or its sandbox is being destroyed.
fn follows_runner(run: &Run, attempt: &Attempt) -> bool {
    !run.state.is_terminal() && attempt.destroy_reason.is_none()
}

/// Marks the inputs the runner says its harness heard; unknown ids are refused.
async fn consume_inputs(
    tx: &mut WriteTx,
    run: &Run,
    attempt: u32,
    ids: &[u64],
    now: i64,
) -> Result<(), DbError> {
    for id in ids {
        let known: Option<i64> =
            sqlx::query_scalar("SELECT id FROM run_inputs WHERE run_id = $1 AND id = $2")
                .bind(run.id.as_str())
                .bind(signed(*id, "input id")?)
                .fetch_optional(tx.conn())
                .await
                .map_err(query_error("find input"))?;
        if known.is_none() {
            return Err(DbError::Invalid(format!(
                "run {} has no input {id}",
                run.id
            )));
        }
        sqlx::query(
            "UPDATE run_inputs SET consumed_at = $1, consumed_by = $2
             WHERE run_id = $3 AND id = $4 AND consumed_at IS NULL",
        )
        .bind(now)
        .bind(i64::from(attempt))
        .bind(run.id.as_str())
        .bind(signed(*id, "input id")?)
        .execute(tx.conn())
        .await
        .map_err(query_error("consume input"))?;
    }
    Ok(())
}

/// Checks that `checkpoint` is a checkpoint of the run's workspace.
/// Checks that `checkpoint` is one of `run`'s workspace; returns when it
/// was taken.
async fn check_checkpoint(
    tx: &mut WriteTx,
    run: &Run,
    checkpoint: &CheckpointId,
) -> Result<SystemTime, DbError> {
    let found: Option<(String, i64)> =
        sqlx::query_as("SELECT workspace_id, created_at FROM checkpoints WHERE id = $1")
            .bind(checkpoint.as_str())
            .fetch_optional(tx.conn())
            .await
            .map_err(query_error("find checkpoint"))?;
    match found {
        Some((workspace, taken)) if workspace == run.workspace_id.as_str() => {
            Ok(from_millis(taken))
        }
        _ => Err(DbError::Invalid(format!(
            "checkpoint {checkpoint} is not a checkpoint of workspace {}",
            run.workspace_id
        ))),
    }
}

/// What attempt `number`'s restore could not bring back of the attempt
/// before, in words ([`runlife::unsaved_window`]).
fn work_lost(
    run: &Run,
    number: u32,
    restored_taken_at: Option<SystemTime>,
    restored: &str,
) -> Option<String> {
    let previous = run.attempt(number.checked_sub(1)?)?;
    let window = runlife::unsaved_window(
        previous.outcome,
        previous.started_at,
        previous.ended_at,
        restored_taken_at,
    )?;
    let window = humantime::format_duration(Duration::from_secs(window.as_secs().max(1)));
    let since = if restored.is_empty() {
        "after it started, and no checkpoint was there to restore".to_owned()
    } else {
        format!("after checkpoint {restored}, which this attempt restored,")
    };
    Some(format!(
        "attempt {} ended ({}) {window} {since} without a last checkpoint: what it did in that time is lost",
        previous.number, previous.end_reason
    ))
}

async fn set_last_checkpoint(
    tx: &mut WriteTx,
    run: &mut Run,
    checkpoint: &CheckpointId,
) -> Result<(), DbError> {
    check_checkpoint(tx, run, checkpoint).await?;
    sqlx::query("UPDATE runs SET last_checkpoint_id = $1 WHERE id = $2")
        .bind(checkpoint.as_str())
        .bind(run.id.as_str())
        .execute(tx.conn())
        .await
        .map_err(query_error("record last checkpoint"))?;
    run.last_checkpoint_id = checkpoint.to_string();
    Ok(())
}

impl MetadataStore {
    /// The runner of attempt `number` claims it: the run starts, and the
    /// runner learns what to do.
    pub async fn claim_attempt(
        &self,
        run_id: &RunId,
        number: u32,
    ) -> Result<StartedAttempt, DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let (mut run, attempt) = load_runner_attempt(tx.conn(), run_id, number).await?;
        if attempt.state == AttemptState::Assigned {
            set_attempt_state(&mut tx, &mut run, number, AttemptState::Starting).await?;
            let event = EventDraft::new(
                event_reason::CLAIMED,
                format!("runner started in sandbox {}", attempt.sandbox_id),
            )
            .of(&attempt);
            if follows_runner(&run, &attempt) {
                transition(
                    &mut tx,
                    &mut run,
                    Event::Claimed,
                    format!("starting on host {}", attempt.host_id),
                    event,
                    now,
                )
                .await?;
            } else {
                add_event(&mut tx, &run, event, now).await?;
            }
        }
        let inputs = pending_inputs(tx.conn(), run_id).await?;
        let session: Option<(String, String, i64)> = sqlx::query_as(
            "SELECT harness, session_id, fork_pending FROM workspace_sessions
             WHERE workspace_id = $1 AND station = $2",
        )
        .bind(run.workspace_id.as_str())
        .bind(&run.station)
        .fetch_optional(tx.conn())
        .await
        .map_err(query_error("station session"))?;
        // A conversation is resumed only by the harness that holds it; one
        // of another harness is named.
        let (resume_session_id, fork_session, station_session_harness) = match session {
            Some((harness, id, fork_pending)) if harness == run.harness.name => {
                (id, fork_pending != 0, String::new())
            }
            Some((harness, _, _)) => (String::new(), false, harness),
            None => Default::default(),
        };
        let notes = workspace_notes(tx.conn(), &run.workspace_id, Some(NOTES_PER_ATTEMPT)).await?;
        let lay = laid_files(tx.conn(), run_id).await?;
        let prompt_delivered: i64 = sqlx::query_scalar(
            "SELECT CASE WHEN EXISTS (SELECT 1 FROM run_events WHERE run_id = $1 AND reason = $2)
                    THEN 1 ELSE 0 END",
        )
        .bind(run_id.as_str())
        .bind(event_reason::HARNESS_STARTED)
        .fetch_one(tx.conn())
        .await
        .map_err(query_error("find an earlier harness start"))?;
        let prompt_delivered = prompt_delivered != 0;
        self.commit(tx).await?;
        let attempt = run
            .current_attempt()
            .cloned()
            .ok_or_else(|| DbError::Corrupt(format!("run {run_id} lost its attempt")))?;
        Ok(StartedAttempt {
            run,
            attempt,
            inputs,
            resume_session_id,
            fork_session,
            prompt_delivered,
            notes,
            lay,
            station_session_harness,
        })
    }

    /// Records a runner's phase: restore and prepare steps, the harness
    /// running, checkpoints.
    pub async fn report_progress(
        &self,
        run_id: &RunId,
        number: u32,
        report: ProgressReport,
    ) -> Result<(), DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let (mut run, attempt) = load_runner_attempt(tx.conn(), run_id, number).await?;
        let checkpoint = report
            .checkpoint
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        match report.phase {
            AttemptPhase::Restoring | AttemptPhase::Preparing => {
                let restored_taken_at = match &report.checkpoint {
                    Some(id) => Some(check_checkpoint(&mut tx, &run, id).await?),
                    None => None,
                };
                let step = if report.detail.is_empty() {
                    match &report.checkpoint {
                        Some(id) => format!("restored {id}"),
                        None => report.phase.to_string(),
                    }
                } else {
                    report.detail.clone()
                };
                let prepare = if attempt.prepare.is_empty() {
                    step.clone()
                } else {
                    format!("{}; {step}", attempt.prepare)
                };
                let restored = if report.phase == AttemptPhase::Restoring {
                    checkpoint.clone()
                } else {
                    attempt.restored_checkpoint_id.clone()
                };
                sqlx::query(
                    "UPDATE attempts SET prepare = $1, restored_checkpoint_id = $2 WHERE run_id = $3 AND number = $4",
                )
                .bind(&prepare)
                .bind(&restored)
                .bind(run_id.as_str())
                .bind(i64::from(number))
                .execute(tx.conn())
                .await
                .map_err(query_error("record prepare step"))?;
                let word = if report.phase == AttemptPhase::Restoring {
                    event_reason::RESTORED
                } else {
                    event_reason::PREPARED
                };
                add_event(
                    &mut tx,
                    &run,
                    EventDraft::new(word, step)
                        .of(&attempt)
                        .checkpoint(&checkpoint),
                    now,
                )
                .await?;
                if report.phase == AttemptPhase::Restoring
                    && let Some(lost) = work_lost(&run, number, restored_taken_at, &checkpoint)
                {
                    tracing::warn!(run = %run.id, attempt = number, detail = %lost, "a restore could not bring back an attempt's last work");
                    let draft = EventDraft::new(event_reason::WORK_LOST, lost)
                        .of(&attempt)
                        .checkpoint(&checkpoint);
                    add_event(&mut tx, &run, draft, now).await?;
                }
            }
            AttemptPhase::Running => {
                if attempt.state != AttemptState::Running {
                    set_attempt_state(&mut tx, &mut run, number, AttemptState::Running).await?;
                }
                if follows_runner(&run, &attempt) {
                    let decided = decide(&run, Event::HarnessRunning)?;
                    if decided.enters() {
                        let word = if run.state == RunState::Waiting {
                            event_reason::RUNNING
                        } else {
                            event_reason::HARNESS_STARTED
                        };
                        let reason = format!("running on host {}", attempt.host_id);
                        let draft = EventDraft::new(word, report.detail.clone()).of(&attempt);
                        persist(&mut tx, &mut run, decided, reason, draft, now).await?;
                    } else if !report.detail.is_empty() {
                        // A turn after the first: whoever follows the run must
                        // see what it continues, and above all a conversation
                        // that was lost and replaced by a briefed one.
                        let draft =
                            EventDraft::new(event_reason::TURN, report.detail.clone()).of(&attempt);
                        persist(&mut tx, &mut run, decided, String::new(), draft, now).await?;
                    }
                }
            }
            AttemptPhase::Checkpointed => {
                let id = report.checkpoint.as_ref().ok_or_else(|| {
                    DbError::Invalid("a CHECKPOINTED report names no checkpoint_id".into())
                })?;
                set_last_checkpoint(&mut tx, &mut run, id).await?;
                // What was unsaved is in the checkpoint now; the runner's
                // next count starts from it.
                if attempt.unsaved.is_some_and(|u| u.files > 0 || u.bytes > 0) {
                    sqlx::query(
                        "UPDATE attempts SET unsaved_files = 0, unsaved_bytes = 0, unsaved_complete = 1,
                                unsaved_at = $1 WHERE run_id = $2 AND number = $3",
                    )
                    .bind(now)
                    .bind(run_id.as_str())
                    .bind(i64::from(number))
                    .execute(tx.conn())
                    .await
                    .map_err(query_error("clear unsaved work"))?;
                }
                add_event(
                    &mut tx,
                    &run,
                    EventDraft::new(event_reason::CHECKPOINT, report.detail.clone())
                        .of(&attempt)
                        .checkpoint(&checkpoint),
                    now,
                )
                .await?;
            }
        }
        self.commit(tx).await
    }

    /// Records what attempt `number`'s workspace holds that no checkpoint
    /// has yet, as its runner counted it.
    pub async fn report_unsaved(
        &self,
        run_id: &RunId,
        number: u32,
        files: u64,
        bytes: u64,
        complete: bool,
    ) -> Result<(), DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let (run, attempt) = load_runner_attempt(tx.conn(), run_id, number).await?;
        if !follows_runner(&run, &attempt) {
            // Its sandbox is going: what it held is the destroy checkpoint's.
            return self.commit(tx).await;
        }
        sqlx::query(
            "UPDATE attempts SET unsaved_files = $1, unsaved_bytes = $2, unsaved_complete = $3,
                    unsaved_at = $4 WHERE run_id = $5 AND number = $6",
        )
        .bind(signed(files, "unsaved files")?)
        .bind(signed(bytes, "unsaved bytes")?)
        .bind(i64::from(complete))
        .bind(now)
        .bind(run_id.as_str())
        .bind(i64::from(number))
        .execute(tx.conn())
        .await
        .map_err(query_error("record unsaved work"))?;
        self.commit(tx).await
    }

    /// Records the harness conversation of the run's station, for the next
    /// attempt (and the next run at this station) to resume. A fork pending
    /// on the station is done: the reported conversation is the fork's own.
    pub async fn report_harness_session(
        &self,
        run_id: &RunId,
        number: u32,
        session: SessionRecord,
    ) -> Result<(), DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let (mut run, attempt) = load_runner_attempt(tx.conn(), run_id, number).await?;
        sqlx::query(
            "INSERT INTO workspace_sessions (workspace_id, station, harness, session_id, run_id, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (workspace_id, station) DO UPDATE SET harness = excluded.harness,
                 session_id = excluded.session_id, run_id = excluded.run_id, updated_at = excluded.updated_at,
                 fork_pending = 0",
        )
        .bind(run.workspace_id.as_str())
        .bind(&run.station)
        .bind(&session.harness)
        .bind(&session.session_id)
        .bind(run_id.as_str())
        .bind(now)
        .execute(tx.conn())
        .await
        .map_err(query_error("record station session"))?;
        if run.harness_session_id != session.session_id {
            sqlx::query("UPDATE runs SET harness_session_id = $1 WHERE id = $2")
                .bind(&session.session_id)
                .bind(run_id.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("record run session"))?;
            run.harness_session_id = session.session_id.clone();
            add_event(
                &mut tx,
                &run,
                EventDraft::new(
                    event_reason::HARNESS_SESSION,
                    format!("{} session {}", session.harness, session.session_id),
                )
                .of(&attempt),
                now,
            )
            .await?;
        }
        self.commit(tx).await
    }

    /// The agent asked a person: the run waits, its sandbox held until the
    /// returned time. A run whose sandbox is already being destroyed (or
    /// that ended) does not wait; the hold it gets is now.
    pub async fn report_waiting(
        &self,
        run_id: &RunId,
        number: u32,
        question: &str,
        checkpoint: Option<&CheckpointId>,
        consumed: &[u64],
    ) -> Result<SystemTime, DbError> {
        let now_time = SystemTime::now();
        let now = millis(now_time);
        let mut tx = self.begin_write().await?;
        let (mut run, attempt) = load_runner_attempt(tx.conn(), run_id, number).await?;
        consume_inputs(&mut tx, &run, number, consumed, now).await?;
        if let Some(id) = checkpoint {
            set_last_checkpoint(&mut tx, &mut run, id).await?;
        }
        let hold_until = if follows_runner(&run, &attempt) {
            let until = now_time + run.hold;
            set_attempt_state(&mut tx, &mut run, number, AttemptState::Waiting).await?;
            sqlx::query("UPDATE runs SET question = $1, hold_until = $2 WHERE id = $3")
                .bind(question)
                .bind(millis(until))
                .bind(run_id.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("record question"))?;
            run.question = question.to_owned();
            run.hold_until = Some(from_millis(millis(until)));
            let reason = format!(
                "waiting for an answer; sandbox held for {}",
                humantime::format_duration(run.hold)
            );
            transition(
                &mut tx,
                &mut run,
                Event::QuestionAsked,
                reason,
                EventDraft::new(event_reason::WAITING, question)
                    .of(&attempt)
                    .checkpoint(&checkpoint.map(ToString::to_string).unwrap_or_default()),
                now,
            )
            .await?;
            from_millis(millis(until))
        } else {
            from_millis(now)
        };
        self.commit(tx).await?;
        Ok(hold_until)
    }

    /// Inputs of the run no harness has heard yet, for the runner of attempt
    /// `number` (refused once the attempt is superseded or ended).
    pub async fn inputs_for_runner(
        &self,
        run_id: &RunId,
        number: u32,
    ) -> Result<Vec<RunInput>, DbError> {
        let mut conn = self.pool.acquire().await.map_err(query_error("inputs"))?;
        load_runner_attempt(&mut conn, run_id, number).await?;
        pending_inputs(&mut conn, run_id).await
    }

    /// The runner's account of how its attempt's work ended. Succeeded and
    /// failed end the run (unless it already ended); interrupted waits for
    /// the sandbox to be reported gone.
    pub async fn report_outcome(
        &self,
        run_id: &RunId,
        number: u32,
        report: &OutcomeReport,
    ) -> Result<(), DbError> {
        let OutcomeReport {
            outcome,
            summary,
            error,
            checkpoint,
            consumed,
            handoff,
        } = report;
        let (outcome, summary, error) = (*outcome, summary.as_str(), error.as_str());
        let checkpoint = checkpoint.as_ref();
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let (mut run, attempt) = load_runner_attempt(tx.conn(), run_id, number).await?;
        consume_inputs(&mut tx, &run, number, consumed, now).await?;
        if let Some(id) = checkpoint {
            set_last_checkpoint(&mut tx, &mut run, id).await?;
        }
        sqlx::query("UPDATE attempts SET outcome = $1 WHERE run_id = $2 AND number = $3")
            .bind(outcome.as_str())
            .bind(run_id.as_str())
            .bind(i64::from(number))
            .execute(tx.conn())
            .await
            .map_err(query_error("record outcome"))?;
        if let Some(a) = run.attempt_mut(number) {
            a.outcome = Some(outcome);
        }
        if let Some(handoff) = handoff {
            let checkpoint = checkpoint
                .map(ToString::to_string)
                .unwrap_or_else(|| run.last_checkpoint_id.clone());
            record_note(&mut tx, &run, number, outcome, &checkpoint, handoff, now).await?;
        }
        if !summary.is_empty() {
            sqlx::query("UPDATE runs SET summary = $1 WHERE id = $2")
                .bind(summary)
                .bind(run_id.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("record summary"))?;
            run.summary = summary.to_owned();
        }
        let checkpoint_text = checkpoint.map(ToString::to_string).unwrap_or_default();
        match outcome {
            Outcome::Interrupted => {
                add_event(
                    &mut tx,
                    &run,
                    EventDraft::new(
                        event_reason::INTERRUPTED,
                        "the runner stopped on a destroy order",
                    )
                    .of(&attempt)
                    .checkpoint(&checkpoint_text),
                    now,
                )
                .await?;
            }
            Outcome::Succeeded | Outcome::Failed => {
                let succeeded = outcome == Outcome::Succeeded;
                let (end_reason, word, why) = if succeeded {
                    (
                        "succeeded".to_owned(),
                        event_reason::SUCCEEDED,
                        if summary.is_empty() {
                            "the agent finished".to_owned()
                        } else {
                            summary.to_owned()
                        },
                    )
                } else {
                    let error = if error.is_empty() {
                        "no error given"
                    } else {
                        error
                    };
                    (
                        format!("failed: {error}"),
                        event_reason::FAILED,
                        error.to_owned(),
                    )
                };
                mark_attempt_ended(&mut tx, &mut run, number, &end_reason, now).await?;
                let draft = EventDraft::new(word, why.clone())
                    .of(&attempt)
                    .checkpoint(&checkpoint_text);
                if run.state.is_terminal() {
                    add_event(&mut tx, &run, draft, now).await?;
                } else {
                    let event = Event::Finished { succeeded };
                    transition(&mut tx, &mut run, event, why, draft, now).await?;
                }
            }
        }
        self.commit(tx).await
    }
}
