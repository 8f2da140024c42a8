//! The runner's calls to the coordinator's RunnerService, with retries.
//!
//! Every call carries the attempt's run token. A coordinator that is
//! restarting or briefly unreachable is retried with backoff; a refusal
//! saying this attempt is no longer the run's current one (or that the token
//! no longer counts) is final: the runner stops.

use std::future::Future;
use std::time::Duration;

use cairn_proto::ids::CheckpointId;
use cairn_proto::pb;
use cairn_proto::pb::runner_service_client::RunnerServiceClient;
use cairn_proto::refusal::Refusal;
use tonic::Code;

use cairn_engine::client::{AuthChannel, MAX_MESSAGE_BYTES};
use cairn_engine::restore::describe_status;
use cairn_engine::tracker::Unsaved;

const ATTEMPTS: u32 = 8;
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Added to a long poll's own timeout for the request deadline.
const POLL_SLACK: Duration = Duration::from_secs(15);
/// How long an unsaved-work report may take; the next count tries again.
const UNSAVED_TIMEOUT: Duration = Duration::from_secs(5);
/// Texts sent (details, questions, summaries, errors) are cut to this many
/// bytes: the coordinator refuses reports that are far larger, and a
/// harness may say a lot.
pub const MAX_TEXT: usize = 32 << 10;

/// `text`, cut at a character boundary to at most [`MAX_TEXT`] bytes.
pub fn clip(text: String) -> String {
    clip_to(text, MAX_TEXT)
}

/// `text`, cut at a character boundary to at most `max` bytes, the cut
/// marked.
pub fn clip_to(mut text: String, max: usize) -> String {
    const MARK: &str = " … (cut)";
    if text.len() > max {
        let mut end = max - MARK.len();
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str(MARK);
    }
    text
}

/// A RunnerService call the coordinator refused or could not answer.
#[derive(Debug, thiserror::Error)]
#[error("{call}: {}", describe_status(.status))]
pub struct ControlError {
    pub call: &'static str,
    pub status: tonic::Status,
}

impl ControlError {
    /// This attempt may not act for the run any more (superseded by a newer
    /// attempt, ended, or its token expired or was revoked), as the
    /// coordinator's typed refusal says.
    pub fn is_superseded(&self) -> bool {
        matches!(
            Refusal::of(&self.status),
            Some(
                Refusal::AttemptNotCurrent { .. }
                    | Refusal::StaleGeneration { .. }
                    | Refusal::Token(_)
            )
        )
    }
}

fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted
    )
}

/// The runner's side of RunnerService.
#[derive(Debug, Clone)]
pub struct Control {
    client: RunnerServiceClient<AuthChannel>,
}

impl Control {
    /// Uses `channel`, which carries the run token. An attempt's spec may
    /// be large (the files it lays, the workspace's handoff notes).
    pub fn new(channel: AuthChannel) -> Self {
        Self {
            client: RunnerServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        }
    }

    async fn call<T, F, Fut>(&self, name: &'static str, mut rpc: F) -> Result<T, ControlError>
    where
        F: FnMut(RunnerServiceClient<AuthChannel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut backoff = FIRST_BACKOFF;
        let mut attempt = 1;
        loop {
            match rpc(self.client.clone()).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) if retryable(status.code()) && attempt < ATTEMPTS => {
                    tracing::info!(call = name, code = ?status.code(), message = status.message(), ?backoff, "coordinator unavailable; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    attempt += 1;
                }
                Err(status) => return Err(ControlError { call: name, status }),
            }
        }
    }

    pub async fn claim(&self) -> Result<pb::AttemptSpec, ControlError> {
        self.call("ClaimAttempt", |mut c| async move {
            c.claim_attempt(pb::ClaimAttemptRequest {}).await
        })
        .await
    }

    pub async fn progress(
        &self,
        phase: pb::AttemptPhase,
        detail: impl Into<String>,
        checkpoint: Option<&CheckpointId>,
    ) -> Result<(), ControlError> {
        let request = pb::ReportProgressRequest {
            phase: phase as i32,
            detail: clip(detail.into()),
            checkpoint_id: checkpoint.map(ToString::to_string).unwrap_or_default(),
        };
        self.call("ReportProgress", |mut c| {
            let request = request.clone();
            async move { c.report_progress(request).await }
        })
        .await
        .map(drop)
    }

    /// Reports the work no checkpoint has yet: once, within a few seconds
    /// (the next count reports again if this one is lost).
    pub async fn unsaved(&self, unsaved: Unsaved) -> Result<(), ControlError> {
        let mut request = tonic::Request::new(pb::ReportUnsavedRequest {
            files: unsaved.files,
            bytes: unsaved.bytes,
            complete: unsaved.complete,
        });
        request.set_timeout(UNSAVED_TIMEOUT);
        self.client
            .clone()
            .report_unsaved(request)
            .await
            .map(drop)
            .map_err(|status| ControlError {
                call: "ReportUnsaved",
                status,
            })
    }

    pub async fn session(&self, harness: &str, session_id: &str) -> Result<(), ControlError> {
        let request = pb::ReportHarnessSessionRequest {
            harness: harness.to_owned(),
            session_id: session_id.to_owned(),
        };
        self.call("ReportHarnessSession", |mut c| {
            let request = request.clone();
            async move { c.report_harness_session(request).await }
        })
        .await
        .map(drop)
    }

    pub async fn waiting(
        &self,
        question: &str,
        checkpoint: Option<&CheckpointId>,
        consumed_inputs: Vec<u64>,
    ) -> Result<pb::ReportWaitingResponse, ControlError> {
        let request = pb::ReportWaitingRequest {
            question: clip(question.to_owned()),
            checkpoint_id: checkpoint.map(ToString::to_string).unwrap_or_default(),
            consumed_inputs,
        };
        self.call("ReportWaiting", |mut c| {
            let request = request.clone();
            async move { c.report_waiting(request).await }
        })
        .await
    }

    /// Long-polls for answers for up to `timeout` (empty when none came).
    pub async fn wait_for_input(
        &self,
        timeout: Duration,
    ) -> Result<Vec<pb::RunInput>, ControlError> {
        let response = self
            .call("WaitForInput", |mut c| async move {
                let mut request = tonic::Request::new(pb::WaitForInputRequest {
                    timeout: Some(cairn_proto::runs::to_proto_duration(timeout)),
                });
                request.set_timeout(timeout + POLL_SLACK);
                c.wait_for_input(request).await
            })
            .await?;
        Ok(response.inputs)
    }

    pub async fn outcome(&self, mut request: pb::ReportOutcomeRequest) -> Result<(), ControlError> {
        request.summary = clip(std::mem::take(&mut request.summary));
        request.error = clip(std::mem::take(&mut request.error));
        self.call("ReportOutcome", |mut c| {
            let request = request.clone();
            async move { c.report_outcome(request).await }
        })
        .await
        .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_texts_are_cut_at_a_character_boundary() {
        assert_eq!(clip("short".into()), "short");
        let long = "é".repeat(MAX_TEXT);
        let cut = clip(long);
        assert!(
            cut.len() <= MAX_TEXT && cut.ends_with(" … (cut)"),
            "{}",
            cut.len()
        );
        assert!(cut.starts_with("éé"));
    }

    #[test]
    fn superseded_attempts_are_told_apart() {
        let run = cairn_proto::ids::RunId::generate();
        let refused = ControlError {
            call: "ReportProgress",
            status: Refusal::AttemptNotCurrent {
                run: run.clone(),
                attempt: 1,
                why: cairn_proto::refusal::NotCurrent::Superseded,
            }
            .into_status(format!(
                "attempt 1 of run {run} was superseded by attempt 2"
            )),
        };
        assert!(refused.is_superseded());
        assert_eq!(
            refused.to_string(),
            format!(
                "ReportProgress: permission denied: attempt 1 of run {run} was superseded by attempt 2"
            )
        );
        let worded = ControlError {
            call: "ReportProgress",
            status: tonic::Status::failed_precondition("attempt 1 was superseded"),
        };
        assert!(
            !worded.is_superseded(),
            "without a typed reason a refusal is a failure, whatever it says"
        );
        let down = ControlError {
            call: "ReportProgress",
            status: tonic::Status::unavailable("restarting"),
        };
        assert!(!down.is_superseded() && retryable(down.status.code()));
    }
}
