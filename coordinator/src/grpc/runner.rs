//! `cairn.v1.RunnerService`: the runner inside a sandbox reports its
//! attempt's life. Every call carries the attempt's run token; a call from an
//! attempt that is not the run's current one (superseded, or ended) is
//! refused with FAILED_PRECONDITION.

use std::time::Duration;

use cairn_proto::domain::to_timestamp;
use cairn_proto::ids::CheckpointId;
use cairn_proto::pb;
use cairn_proto::pb::runner_service_server::RunnerService;
use cairn_proto::runs::{AttemptPhase, Outcome, from_proto_duration, to_proto_duration};
use cairn_proto::stations::HandoffText;
use tokio::sync::broadcast;
use tonic::{Request, Response, Status};

use super::{ServiceError, Shared, handoff_note_to_pb};
use crate::auth::principal;
use crate::db::{OutcomeReport, ProgressReport, RunInput, SessionRecord};
use crate::tokens::RunBinding;

/// WaitForInput's wait when the request names none.
const DEFAULT_INPUT_WAIT: Duration = Duration::from_secs(30);
/// Longest WaitForInput wait.
const MAX_INPUT_WAIT: Duration = Duration::from_secs(60);
/// Longest question, summary or detail accepted.
const MAX_REPORT_BYTES: usize = 64 << 10;

/// Implements RunnerService over the shared state.
#[derive(Debug, Clone)]
pub struct RunnerApi {
    shared: Shared,
}

impl RunnerApi {
    pub fn new(shared: Shared) -> Self {
        Self { shared }
    }
}

/// The attempt the caller's run token speaks for.
fn binding<T>(request: &Request<T>) -> Result<RunBinding, Status> {
    let principal = principal(request)?;
    Ok(principal.attempt().map_err(ServiceError::Denied)?.clone())
}

fn optional_checkpoint(text: &str) -> Result<Option<CheckpointId>, ServiceError> {
    if text.is_empty() {
        Ok(None)
    } else {
        Ok(Some(text.parse()?))
    }
}

fn bounded(field: &str, text: &str) -> Result<(), ServiceError> {
    if text.len() > MAX_REPORT_BYTES {
        return Err(ServiceError::InvalidArgument(format!(
            "{field} has {} bytes; the limit is {MAX_REPORT_BYTES}",
            text.len()
        )));
    }
    Ok(())
}

fn input_to_pb(input: &RunInput) -> pb::RunInput {
    pb::RunInput {
        id: input.id,
        kind: input.kind.clone(),
        text: input.text.clone(),
        created_at: Some(to_timestamp(input.created_at)),
    }
}

impl RunnerApi {
    /// Inputs for the attempt, waiting up to `wait` for one to arrive.
    async fn wait_for_inputs(
        &self,
        binding: &RunBinding,
        wait: Duration,
    ) -> Result<Vec<RunInput>, ServiceError> {
        let db = &self.shared.db;
        let deadline = tokio::time::Instant::now() + wait;
        // Subscribed before each read, so an answer committed in between wakes us.
        let mut changes = db.subscribe_runs();
        loop {
            let inputs = db.inputs_for_runner(&binding.run, binding.attempt).await?;
            if !inputs.is_empty() {
                return Ok(inputs);
            }
            loop {
                tokio::select! {
                    change = changes.recv() => match change {
                        Ok(id) if id == binding.run => break,
                        Ok(_) => continue,
                        Err(broadcast::error::RecvError::Lagged(_)) => break,
                        Err(broadcast::error::RecvError::Closed) => return Ok(Vec::new()),
                    },
                    () = tokio::time::sleep_until(deadline) => return Ok(Vec::new()),
                    () = self.shared.shutdown.cancelled() => return Ok(Vec::new()),
                }
            }
        }
    }
}

#[tonic::async_trait]
impl RunnerService for RunnerApi {
    async fn claim_attempt(
        &self,
        request: Request<pb::ClaimAttemptRequest>,
    ) -> Result<Response<pb::AttemptSpec>, Status> {
        let binding = binding(&request)?;
        let started = self
            .shared
            .db
            .claim_attempt(&binding.run, binding.attempt)
            .await
            .map_err(ServiceError::from)?;
        let run = &started.run;
        tracing::info!(run = %run.id, attempt = binding.attempt, sandbox = %started.attempt.sandbox_id, "attempt claimed");
        Ok(Response::new(pb::AttemptSpec {
            run_id: run.id.to_string(),
            attempt: started.attempt.number,
            generation: started.attempt.generation.0,
            workspace_id: run.workspace_id.to_string(),
            station: run.station.clone(),
            harness: Some(run.harness.clone()),
            prompt: run.prompt.clone(),
            inputs: started.inputs.iter().map(input_to_pb).collect(),
            resume_session_id: started.resume_session_id,
            hold: Some(to_proto_duration(run.hold)),
            checkpoint_interval: Some(to_proto_duration(run.checkpoint_interval)),
            repos: run.repos.clone(),
            question: run.question.clone(),
            prompt_delivered: started.prompt_delivered,
            fork_session: started.fork_session,
            notes: started.notes.iter().map(handoff_note_to_pb).collect(),
            lay: started.lay.into_iter().collect(),
            station_session_harness: started.station_session_harness,
            checkpoint_limits: Some(run.checkpoint_limits.into()),
        }))
    }

    async fn report_progress(
        &self,
        request: Request<pb::ReportProgressRequest>,
    ) -> Result<Response<pb::ReportAck>, Status> {
        let binding = binding(&request)?;
        let req = request.into_inner();
        let phase = AttemptPhase::try_from(req.phase).map_err(ServiceError::from)?;
        bounded("detail", &req.detail)?;
        let report = ProgressReport {
            phase,
            detail: req.detail,
            checkpoint: optional_checkpoint(&req.checkpoint_id)?,
        };
        self.shared
            .db
            .report_progress(&binding.run, binding.attempt, report)
            .await
            .map_err(ServiceError::from)?;
        Ok(Response::new(pb::ReportAck {}))
    }

    async fn report_unsaved(
        &self,
        request: Request<pb::ReportUnsavedRequest>,
    ) -> Result<Response<pb::ReportAck>, Status> {
        let binding = binding(&request)?;
        let req = request.into_inner();
        // Stored as signed 64-bit integers; no workspace holds more.
        if req.files > i64::MAX as u64 || req.bytes > i64::MAX as u64 {
            return Err(ServiceError::InvalidArgument(format!(
                "{} files, {} bytes is not a count of a workspace",
                req.files, req.bytes
            ))
            .into());
        }
        self.shared
            .db
            .report_unsaved(
                &binding.run,
                binding.attempt,
                req.files,
                req.bytes,
                req.complete,
            )
            .await
            .map_err(ServiceError::from)?;
        Ok(Response::new(pb::ReportAck {}))
    }

    async fn report_harness_session(
        &self,
        request: Request<pb::ReportHarnessSessionRequest>,
    ) -> Result<Response<pb::ReportAck>, Status> {
        let binding = binding(&request)?;
        let req = request.into_inner();
        if req.harness.is_empty() || req.session_id.trim().is_empty() {
            return Err(ServiceError::InvalidArgument(
                "a harness session needs both harness and session_id".into(),
            )
            .into());
        }
        if req.session_id.len() > 256 || req.session_id.contains(char::is_whitespace) {
            return Err(ServiceError::InvalidArgument(format!(
                "session_id {:?} is not a session id",
                req.session_id
            ))
            .into());
        }
        self.shared
            .db
            .report_harness_session(
                &binding.run,
                binding.attempt,
                SessionRecord {
                    harness: req.harness,
                    session_id: req.session_id,
                },
            )
            .await
            .map_err(ServiceError::from)?;
        Ok(Response::new(pb::ReportAck {}))
    }

    async fn report_waiting(
        &self,
        request: Request<pb::ReportWaitingRequest>,
    ) -> Result<Response<pb::ReportWaitingResponse>, Status> {
        let binding = binding(&request)?;
        let req = request.into_inner();
        if req.question.trim().is_empty() {
            return Err(
                ServiceError::InvalidArgument("question is empty: ask something".into()).into(),
            );
        }
        bounded("question", &req.question)?;
        let checkpoint = optional_checkpoint(&req.checkpoint_id)?;
        let hold_until = self
            .shared
            .db
            .report_waiting(
                &binding.run,
                binding.attempt,
                &req.question,
                checkpoint.as_ref(),
                &req.consumed_inputs,
            )
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(run = %binding.run, attempt = binding.attempt, "run waits for an answer");
        Ok(Response::new(pb::ReportWaitingResponse {
            hold_until: Some(to_timestamp(hold_until)),
        }))
    }

    async fn wait_for_input(
        &self,
        request: Request<pb::WaitForInputRequest>,
    ) -> Result<Response<pb::WaitForInputResponse>, Status> {
        let binding = binding(&request)?;
        let wait = match request.get_ref().timeout.as_ref() {
            None => DEFAULT_INPUT_WAIT,
            Some(d) => match from_proto_duration(d, "timeout").map_err(ServiceError::from)? {
                Duration::ZERO => DEFAULT_INPUT_WAIT,
                d => d.min(MAX_INPUT_WAIT),
            },
        };
        let inputs = self.wait_for_inputs(&binding, wait).await?;
        Ok(Response::new(pb::WaitForInputResponse {
            inputs: inputs.iter().map(input_to_pb).collect(),
        }))
    }

    async fn report_outcome(
        &self,
        request: Request<pb::ReportOutcomeRequest>,
    ) -> Result<Response<pb::ReportAck>, Status> {
        let binding = binding(&request)?;
        let req = request.into_inner();
        let outcome = Outcome::try_from(req.outcome).map_err(ServiceError::from)?;
        bounded("summary", &req.summary)?;
        bounded("error", &req.error)?;
        let checkpoint = optional_checkpoint(&req.checkpoint_id)?;
        let handoff = req
            .handoff
            .map(HandoffText::try_from)
            .transpose()
            .map_err(ServiceError::from)?;
        self.shared
            .db
            .report_outcome(
                &binding.run,
                binding.attempt,
                &OutcomeReport {
                    outcome,
                    summary: req.summary,
                    error: req.error,
                    checkpoint,
                    consumed: req.consumed_inputs,
                    handoff,
                },
            )
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(run = %binding.run, attempt = binding.attempt, %outcome, "attempt outcome");
        Ok(Response::new(pb::ReportAck {}))
    }
}
