//! `cairn.v1.RunService`: create, read, list, watch, answer, suspend and
//! cancel runs (client and admin tokens; a run token may read its own run).

use std::collections::BTreeSet;
use std::pin::Pin;
use std::time::Duration;

use cairn_proto::domain::{to_timestamp, validate_name};
use cairn_proto::ids::{RunId, WorkspaceId};
use cairn_proto::pb;
use cairn_proto::pb::run_service_server::RunService;
use cairn_proto::runs::{Labels, RunState, from_proto_duration, validate_station};
use cairn_proto::stations::{DEFAULT_STATION, LaidFiles};
use futures::Stream;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::workspaces::requested_name;
use super::{
    ServiceError, Shared, decode_page_token, encode_page_token, ensure_active, page_size,
    run_event_to_pb, run_to_pb,
};
use crate::auth::principal;
use crate::db::{NewRun, NewRunTarget, Run, RunFilter};
use crate::tokens::{Action, Principal};

const PAGE_KIND: &str = "runs";

/// How long a waiting sandbox is held when the run says nothing.
pub const DEFAULT_HOLD: Duration = Duration::from_secs(5 * 60);
/// Longest hold accepted.
pub const MAX_HOLD: Duration = Duration::from_secs(7 * 24 * 3600);
/// Infrastructure failures a run survives when it says nothing.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
pub const MAX_MAX_ATTEMPTS: u32 = 100;
/// Periodic checkpoints when the run says nothing.
pub const DEFAULT_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(10 * 60);
const MIN_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);
/// Events sent per database read while streaming.
const EVENT_BATCH: u32 = 500;
/// Largest prompt or answer accepted.
const MAX_TEXT_BYTES: usize = 1 << 20;

/// Implements RunService over the shared state.
#[derive(Debug, Clone)]
pub struct RunApi {
    shared: Shared,
}

impl RunApi {
    pub fn new(shared: Shared) -> Self {
        Self { shared }
    }
}

fn invalid(message: impl Into<String>) -> ServiceError {
    ServiceError::InvalidArgument(message.into())
}

fn parse_run_id(text: &str) -> Result<RunId, ServiceError> {
    Ok(text.parse::<RunId>()?)
}

fn check_text(field: &str, text: &str) -> Result<(), ServiceError> {
    if text.trim().is_empty() {
        return Err(invalid(format!("{field} is empty")));
    }
    if text.len() > MAX_TEXT_BYTES {
        return Err(invalid(format!(
            "{field} has {} bytes; the limit is {MAX_TEXT_BYTES}",
            text.len()
        )));
    }
    Ok(())
}

fn validate_harness(harness: Option<pb::HarnessSpec>) -> Result<pb::HarnessSpec, ServiceError> {
    let harness = harness.ok_or_else(|| invalid("harness is missing (e.g. name \"claude\")"))?;
    let name_ok = !harness.name.is_empty()
        && harness.name.len() <= 64
        && harness
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'));
    if !name_ok {
        return Err(invalid(format!(
            "harness.name {:?} is not an adapter name (e.g. claude, command)",
            harness.name
        )));
    }
    let Some(settings) = cairn_proto::runs::harness_settings(&harness.name) else {
        let known: Vec<&str> = cairn_proto::runs::HARNESS_ADAPTERS
            .iter()
            .map(|(name, _)| *name)
            .collect();
        return Err(invalid(format!(
            "harness.name {:?} is not a harness adapter (there are: {})",
            harness.name,
            known.join(", ")
        )));
    };
    if let Some(key) = harness
        .config
        .keys()
        .find(|k| !settings.contains(&k.as_str()))
    {
        return Err(invalid(format!(
            "harness.config key {key:?} is not a setting of the {} adapter (it has: {})",
            harness.name,
            settings.join(", ")
        )));
    }
    Ok(harness)
}

fn validate_repos(repos: &[pb::RepoSpec]) -> Result<(), ServiceError> {
    let mut names = BTreeSet::new();
    for repo in repos {
        validate_name(&repo.name).map_err(|e| invalid(format!("repos: {}", e.reason)))?;
        if repo.url.trim().is_empty() {
            return Err(invalid(format!("repos: {} has no url", repo.name)));
        }
        if !names.insert(repo.name.as_str()) {
            return Err(invalid(format!("repos: {} is listed twice", repo.name)));
        }
    }
    Ok(())
}

fn optional_duration(
    value: Option<&prost_types::Duration>,
    field: &'static str,
    default: Duration,
) -> Result<Duration, ServiceError> {
    match value {
        None => Ok(default),
        Some(d) => Ok(from_proto_duration(d, field)?),
    }
}

impl RunApi {
    /// `runs` as sent, each with when its workspace was last checkpointed.
    async fn with_recovery_points(&self, runs: &[Run]) -> Result<Vec<pb::Run>, ServiceError> {
        let workspaces: BTreeSet<&WorkspaceId> = runs.iter().map(|run| &run.workspace_id).collect();
        let workspaces: Vec<&WorkspaceId> = workspaces.into_iter().collect();
        let newest = self.shared.db.newest_checkpoints(&workspaces).await?;
        Ok(runs
            .iter()
            .map(|run| pb::Run {
                workspace_checkpointed_at: newest.get(&run.workspace_id).copied().map(to_timestamp),
                ..run_to_pb(run)
            })
            .collect())
    }

    async fn create(
        &self,
        principal: &Principal,
        req: pb::CreateRunRequest,
    ) -> Result<crate::db::Run, ServiceError> {
        principal
            .authorize(Action::CreateRun)
            .map_err(ServiceError::Denied)?;
        let target = match req.target {
            Some(pb::create_run_request::Target::Workspace(reference)) => {
                let workspace = self
                    .shared
                    .authorized_workspace(principal, &reference, |id| Action::WriteCheckpoints(id))
                    .await?;
                ensure_active(&workspace)?;
                NewRunTarget::Workspace(workspace.id)
            }
            Some(pb::create_run_request::Target::NewWorkspace(new)) => {
                principal
                    .authorize(Action::CreateWorkspace)
                    .map_err(ServiceError::Denied)?;
                NewRunTarget::NewWorkspace(requested_name(&new.name)?.map(str::to_owned))
            }
            None => {
                return Err(invalid(
                    "target is missing: name a workspace or ask for a new one",
                ));
            }
        };
        let station = match req.station.trim() {
            "" => DEFAULT_STATION.to_owned(),
            station => {
                validate_station(station)?;
                station.to_owned()
            }
        };
        let harness = validate_harness(req.harness)?;
        check_text("prompt", &req.prompt)?;
        let labels = Labels::from_map(req.labels)?;
        let hold = optional_duration(req.hold.as_ref(), "hold", DEFAULT_HOLD)?;
        if hold > MAX_HOLD {
            return Err(invalid(format!(
                "hold {} is longer than the limit of {}",
                humantime::format_duration(hold),
                humantime::format_duration(MAX_HOLD)
            )));
        }
        let max_attempts = match req.max_attempts {
            0 => DEFAULT_MAX_ATTEMPTS,
            n if n > MAX_MAX_ATTEMPTS => {
                return Err(invalid(format!(
                    "max_attempts {n} is above the limit of {MAX_MAX_ATTEMPTS}"
                )));
            }
            n => n,
        };
        let checkpoint_interval = optional_duration(
            req.checkpoint_interval.as_ref(),
            "checkpoint_interval",
            DEFAULT_CHECKPOINT_INTERVAL,
        )?;
        if checkpoint_interval < MIN_CHECKPOINT_INTERVAL {
            return Err(invalid("checkpoint_interval must be at least 1s"));
        }
        validate_repos(&req.repos)?;
        let lay = LaidFiles::try_from(req.lay)?;
        if req.image.len() > 1024 || req.image.contains(char::is_whitespace) {
            return Err(invalid(format!(
                "image {:?} is not an image name",
                req.image
            )));
        }
        let run = self
            .shared
            .db
            .create_run(
                &principal.tenant,
                NewRun {
                    target,
                    station,
                    harness,
                    prompt: req.prompt,
                    labels,
                    hold,
                    max_attempts,
                    repos: req.repos,
                    image: req.image,
                    checkpoint_interval,
                    checkpoint_limits: req.checkpoint_limits.map(Into::into).unwrap_or_default(),
                    lay,
                },
            )
            .await?;
        tracing::info!(run = %run.id, workspace = %run.workspace_id, station = %run.station, harness = %run.harness.name, "run created");
        self.shared.scheduler.wake();
        Ok(run)
    }

    /// The run `id` of the caller's tenant, after the scope check.
    async fn readable_run(
        &self,
        principal: &Principal,
        id: &RunId,
    ) -> Result<crate::db::Run, ServiceError> {
        principal
            .authorize(Action::ReadRun(id))
            .map_err(ServiceError::Denied)?;
        self.shared
            .db
            .run(&principal.tenant, id)
            .await?
            .ok_or_else(|| ServiceError::NotFound(format!("run {id} does not exist")))
    }
}

/// Sends the run's events after `after` to `sink`; with `follow`, keeps
/// sending new ones until the run has ended and its last sandbox is gone,
/// the client goes away, or the server shuts down.
async fn stream_events(
    shared: Shared,
    principal: Principal,
    run: RunId,
    mut after: u64,
    follow: bool,
    sink: mpsc::Sender<Result<pb::RunEvent, Status>>,
) {
    // Subscribed before the first read, so no commit falls in between.
    let mut changes = shared.db.subscribe_runs();
    loop {
        // Read before the events: everything committed up to this state is
        // in the read that follows.
        let finished = match shared.db.run(&principal.tenant, &run).await {
            Ok(Some(r)) => r.state.is_terminal() && r.active_attempt().is_none(),
            Ok(None) => true,
            Err(e) => {
                let _ = sink.send(Err(ServiceError::from(e).into())).await;
                return;
            }
        };
        loop {
            let events = match shared.db.run_events(&run, after, EVENT_BATCH).await {
                Ok(events) => events,
                Err(e) => {
                    let _ = sink.send(Err(ServiceError::from(e).into())).await;
                    return;
                }
            };
            let full = events.len() == EVENT_BATCH as usize;
            for event in &events {
                after = event.sequence;
                if sink.send(Ok(run_event_to_pb(event))).await.is_err() {
                    return;
                }
            }
            if !full {
                break;
            }
        }
        if !follow || finished {
            return;
        }
        loop {
            tokio::select! {
                change = changes.recv() => match change {
                    Ok(id) if id == run => break,
                    Ok(_) => continue,
                    Err(broadcast::error::RecvError::Lagged(_)) => break,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                () = sink.closed() => return,
                () = shared.shutdown.cancelled() => {
                    let _ = sink
                        .send(Err(Status::unavailable("the coordinator is shutting down; watch again")))
                        .await;
                    return;
                }
            }
        }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::RunEvent, Status>> + Send>>;

#[tonic::async_trait]
impl RunService for RunApi {
    async fn create_run(
        &self,
        request: Request<pb::CreateRunRequest>,
    ) -> Result<Response<pb::Run>, Status> {
        let principal = principal(&request)?.clone();
        let run = self.create(&principal, request.into_inner()).await?;
        Ok(Response::new(run_to_pb(&run)))
    }

    async fn get_run(
        &self,
        request: Request<pb::GetRunRequest>,
    ) -> Result<Response<pb::Run>, Status> {
        let principal = principal(&request)?.clone();
        let id = parse_run_id(&request.get_ref().run_id)?;
        let run = self.readable_run(&principal, &id).await?;
        let mut shown = self
            .with_recovery_points(std::slice::from_ref(&run))
            .await?;
        Ok(Response::new(shown.remove(0)))
    }

    async fn list_runs(
        &self,
        request: Request<pb::ListRunsRequest>,
    ) -> Result<Response<pb::ListRunsResponse>, Status> {
        let principal = principal(&request)?.clone();
        principal
            .authorize(Action::ListRuns)
            .map_err(ServiceError::Denied)?;
        let req = request.into_inner();
        let mut filter = RunFilter::default();
        if !req.workspace.is_empty() {
            let workspace = self.shared.workspace(&principal, &req.workspace).await?;
            filter.workspace = Some(workspace.id);
        }
        if req.state != pb::RunState::Unspecified as i32 {
            filter.state = Some(RunState::try_from(req.state).map_err(ServiceError::from)?);
        }
        let before = match decode_page_token(&req.page_token, PAGE_KIND)? {
            Some(position) => Some(
                position
                    .parse::<RunId>()
                    .map_err(|_| invalid("page_token is not a token this list returned"))?,
            ),
            None => None,
        };
        let limit = page_size(req.page_size);
        let mut runs = self
            .shared
            .db
            .list_runs(&principal.tenant, &filter, before.as_ref(), limit + 1)
            .await
            .map_err(ServiceError::from)?;
        let next_page_token = if runs.len() > limit as usize {
            runs.truncate(limit as usize);
            let last = runs.last().expect("a full page is not empty");
            encode_page_token(PAGE_KIND, last.id.as_str())
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListRunsResponse {
            runs: self.with_recovery_points(&runs).await?,
            next_page_token,
        }))
    }

    type WatchRunEventsStream = EventStream;

    async fn watch_run_events(
        &self,
        request: Request<pb::WatchRunEventsRequest>,
    ) -> Result<Response<Self::WatchRunEventsStream>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let id = parse_run_id(&req.run_id)?;
        self.readable_run(&principal, &id).await?;
        let (sink, events) = mpsc::channel(64);
        tokio::spawn(stream_events(
            self.shared.clone(),
            principal,
            id,
            req.after_sequence,
            req.follow,
            sink,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(events))))
    }

    async fn answer_run(
        &self,
        request: Request<pb::AnswerRunRequest>,
    ) -> Result<Response<pb::Run>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let id = parse_run_id(&req.run_id)?;
        principal
            .authorize(Action::DriveRun(&id))
            .map_err(ServiceError::Denied)?;
        check_text("text", &req.text)?;
        let run = self
            .shared
            .db
            .answer_run(&principal.tenant, &id, &req.text)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(run = %id, state = %run.state, "run answered");
        self.shared.scheduler.wake();
        Ok(Response::new(run_to_pb(&run)))
    }

    async fn suspend_run(
        &self,
        request: Request<pb::SuspendRunRequest>,
    ) -> Result<Response<pb::Run>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let id = parse_run_id(&req.run_id)?;
        principal
            .authorize(Action::DriveRun(&id))
            .map_err(ServiceError::Denied)?;
        let run = self
            .shared
            .db
            .suspend_run(&principal.tenant, &id, req.reason.trim())
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(run = %id, state = %run.state, "run suspended on request");
        self.shared.scheduler.wake();
        Ok(Response::new(run_to_pb(&run)))
    }

    async fn cancel_run(
        &self,
        request: Request<pb::CancelRunRequest>,
    ) -> Result<Response<pb::Run>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let id = parse_run_id(&req.run_id)?;
        principal
            .authorize(Action::DriveRun(&id))
            .map_err(ServiceError::Denied)?;
        let run = self
            .shared
            .db
            .cancel_run(&principal.tenant, &id, req.reason.trim())
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(run = %id, "run cancelled");
        self.shared.scheduler.wake();
        Ok(Response::new(run_to_pb(&run)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn harness_names_and_repos_are_checked_by_name() {
        assert!(validate_harness(None).is_err());
        let bad = pb::HarnessSpec {
            name: "../x".into(),
            ..Default::default()
        };
        let err = validate_harness(Some(bad)).unwrap_err().to_string();
        assert!(err.contains("harness.name"), "{err}");
        let ok = pb::HarnessSpec {
            name: "claude".into(),
            ..Default::default()
        };
        assert_eq!(validate_harness(Some(ok.clone())).unwrap(), ok);
        let unknown = pb::HarnessSpec {
            name: "nonesuch".into(),
            ..Default::default()
        };
        let err = validate_harness(Some(unknown)).unwrap_err().to_string();
        let known: Vec<&str> = cairn_proto::runs::HARNESS_ADAPTERS
            .iter()
            .map(|(name, _)| *name)
            .collect();
        assert!(
            err.contains(&format!("(there are: {})", known.join(", ")))
                && err.contains("claude, codex"),
            "{err}"
        );
        let typo = pb::HarnessSpec {
            name: "claude".into(),
            config: [("binray".to_owned(), "/bin/claude".to_owned())].into(),
        };
        let err = validate_harness(Some(typo)).unwrap_err().to_string();
        assert!(
            err.contains(
                "\"binray\" is not a setting of the claude adapter (it has: binary, model"
            ),
            "{err}"
        );

        let repo = |name: &str, url: &str| pb::RepoSpec {
            name: name.into(),
            url: url.into(),
            branch: String::new(),
        };
        assert!(validate_repos(&[repo("app", "https://x/app.git")]).is_ok());
        let twice = validate_repos(&[repo("app", "u"), repo("app", "v")])
            .unwrap_err()
            .to_string();
        assert!(twice.contains("twice"), "{twice}");
        assert!(validate_repos(&[repo("app", " ")]).is_err());
        assert!(validate_repos(&[repo("../app", "u")]).is_err());
    }
}
