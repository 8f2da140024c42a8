//! `cairn.v1.WorkspaceService`: create, show, list and fork workspaces; chat
//! messages; the handoff notes runs left.

use cairn_proto::domain::{WorkspaceRef, to_timestamp, validate_name};
use cairn_proto::ids::{CheckpointId, WorkspaceId};
use cairn_proto::pb;
use cairn_proto::pb::workspace_service_server::WorkspaceService;
use cairn_proto::runs::{from_proto_duration, validate_station};
use tonic::{Request, Response, Status};

use super::{
    ServiceError, Shared, decode_page_token, encode_page_token, ensure_active, handoff_note_to_pb,
    page_size, workspace_to_pb,
};
use crate::auth::principal;
use crate::db::{Message, MessageState, RetentionChange, Workspace};
use crate::retention::Policy;
use crate::tokens::{Action, Principal};
use cairn_proto::stations::DEFAULT_STATION;

const PAGE_KIND: &str = "workspaces";

/// Most workspaces one ForkWorkspace call makes.
pub const MAX_FORK_COUNT: u32 = 64;

/// Implements WorkspaceService over the shared state.
#[derive(Debug, Clone)]
pub struct WorkspaceApi {
    shared: Shared,
}

impl WorkspaceApi {
    pub fn new(shared: Shared) -> Self {
        Self { shared }
    }

    fn policy(&self) -> &Policy {
        &self.shared.collector.config().policy
    }

    /// The workspace `reference` names, which the caller may manage.
    async fn managed(
        &self,
        principal: &Principal,
        reference: &str,
    ) -> Result<Workspace, ServiceError> {
        self.shared
            .authorized_workspace(principal, reference, |id| Action::ManageWorkspace(id))
            .await
    }

    /// `id` as it is now, for an answer.
    async fn reread(
        &self,
        principal: &Principal,
        id: &WorkspaceId,
    ) -> Result<pb::Workspace, Status> {
        let workspace = self
            .shared
            .workspace_by_ref(principal, &WorkspaceRef::Id(id.clone()))
            .await?;
        Ok(workspace_to_pb(&workspace, self.policy()))
    }
}

/// A requested workspace name: empty means unnamed; a name must not look
/// like a workspace id, or lookups by it would be read as an id.
pub(super) fn requested_name(name: &str) -> Result<Option<&str>, ServiceError> {
    let name = name.trim();
    if name.is_empty() {
        return Ok(None);
    }
    validate_name(name)?;
    if WorkspaceId::looks_like(name) {
        return Err(ServiceError::InvalidArgument(format!(
            "invalid name: {name:?} looks like a workspace id"
        )));
    }
    Ok(Some(name))
}

/// The names of `count` forks: `<prefix>-1` … `<prefix>-<count>`, the prefix
/// being `requested` or else `<source name>-fork`; all unnamed when neither
/// gives a prefix.
pub(super) fn fork_names(
    requested: &str,
    source_name: Option<&str>,
    count: u32,
) -> Result<Vec<Option<String>>, ServiceError> {
    if count == 0 || count > MAX_FORK_COUNT {
        return Err(ServiceError::InvalidArgument(format!(
            "count must be 1 to {MAX_FORK_COUNT}, not {count}"
        )));
    }
    let requested = requested.trim();
    let prefix = if requested.is_empty() {
        source_name.map(|name| format!("{name}-fork"))
    } else {
        Some(requested.to_owned())
    };
    (1..=count)
        .map(|i| match &prefix {
            Some(prefix) => requested_name(&format!("{prefix}-{i}")).map(|n| n.map(str::to_owned)),
            None => Ok(None),
        })
        .collect()
}

/// Largest chat message accepted, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// A validated `SendMessageRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMessage {
    /// Workspace id or name, not looked up yet.
    pub workspace: String,
    pub station: String,
    pub text: String,
}

impl TryFrom<pb::SendMessageRequest> for NewMessage {
    type Error = ServiceError;

    fn try_from(req: pb::SendMessageRequest) -> Result<Self, ServiceError> {
        let workspace = req.workspace.trim();
        if workspace.is_empty() {
            return Err(ServiceError::InvalidArgument(
                "workspace is required".into(),
            ));
        }
        if req.text.trim().is_empty() {
            return Err(ServiceError::InvalidArgument(
                "text is empty; a message needs words".into(),
            ));
        }
        if req.text.len() > MAX_MESSAGE_BYTES {
            return Err(ServiceError::InvalidArgument(format!(
                "text has {} bytes; the limit is {MAX_MESSAGE_BYTES}",
                req.text.len()
            )));
        }
        let station = match req.station.trim() {
            "" => DEFAULT_STATION.to_owned(),
            station => {
                validate_station(station)?;
                station.to_owned()
            }
        };
        Ok(Self {
            workspace: workspace.to_owned(),
            station,
            text: req.text,
        })
    }
}

pub(super) fn message_to_pb(m: &Message) -> pb::Message {
    let (state, run_id) = match &m.state {
        MessageState::Pending => (pb::MessageState::Pending, String::new()),
        MessageState::Delivered(run) => (pb::MessageState::Delivered, run.to_string()),
        MessageState::Heard(run) => (pb::MessageState::Heard, run.to_string()),
    };
    pb::Message {
        id: m.id,
        workspace_id: m.workspace_id.to_string(),
        station: m.station.clone(),
        text: m.text.clone(),
        created_at: Some(to_timestamp(m.created_at)),
        state: state as i32,
        run_id,
        given_back: m.given_back,
    }
}

/// Longest retention a workspace may set (keep-last and finished expiry).
const MAX_KEEP_LAST: u32 = 10_000;
const MAX_FINISHED_EXPIRY: std::time::Duration =
    std::time::Duration::from_secs(10 * 365 * 24 * 3600);

/// A SetRetention request, validated.
fn retention_change(req: &pb::SetRetentionRequest) -> Result<RetentionChange, ServiceError> {
    let keep_last = match req.keep_last {
        None => None,
        Some(0) => Some(None),
        Some(n) if n > MAX_KEEP_LAST => {
            return Err(ServiceError::over_limit(
                "retention.keep_last",
                u64::from(MAX_KEEP_LAST),
                u64::from(n),
                format!("keep_last {n} is more than a workspace may keep"),
            ));
        }
        Some(n) => Some(Some(n)),
    };
    let finished_expiry = match &req.finished_expiry {
        None => None,
        Some(d) => {
            let d = from_proto_duration(d, "finished_expiry")?;
            if d > MAX_FINISHED_EXPIRY {
                return Err(ServiceError::InvalidArgument(format!(
                    "finished_expiry {} is longer than ten years",
                    humantime::format_duration(d)
                )));
            }
            Some((!d.is_zero()).then_some(d))
        }
    };
    Ok(RetentionChange {
        keep_last,
        finished_expiry,
    })
}

#[tonic::async_trait]
impl WorkspaceService for WorkspaceApi {
    async fn finish_workspace(
        &self,
        request: Request<pb::FinishWorkspaceRequest>,
    ) -> Result<Response<pb::Workspace>, Status> {
        let principal = principal(&request)?.clone();
        let workspace = self
            .managed(&principal, &request.get_ref().workspace)
            .await?;
        let now = self.shared.collector.clock().now();
        self.shared
            .db
            .finish_workspace(&principal.tenant, &workspace.id, now)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(workspace = %workspace.id, "workspace finished");
        Ok(Response::new(self.reread(&principal, &workspace.id).await?))
    }

    async fn delete_workspace(
        &self,
        request: Request<pb::DeleteWorkspaceRequest>,
    ) -> Result<Response<pb::Workspace>, Status> {
        let principal = principal(&request)?.clone();
        let workspace = self
            .managed(&principal, &request.get_ref().workspace)
            .await?;
        let now = self.shared.collector.clock().now();
        let deleted = self
            .shared
            .db
            .delete_workspace(&principal.tenant, &workspace.id, now)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(workspace = %workspace.id, checkpoints = deleted.checkpoints, packs_condemned = deleted.condemned.packs, "workspace deleted");
        Ok(Response::new(self.reread(&principal, &workspace.id).await?))
    }

    async fn set_retention(
        &self,
        request: Request<pb::SetRetentionRequest>,
    ) -> Result<Response<pb::Workspace>, Status> {
        let principal = principal(&request)?.clone();
        let change = retention_change(request.get_ref())?;
        let workspace = self
            .managed(&principal, &request.get_ref().workspace)
            .await?;
        self.shared
            .db
            .set_retention(&principal.tenant, &workspace.id, change)
            .await
            .map_err(ServiceError::from)?;
        Ok(Response::new(self.reread(&principal, &workspace.id).await?))
    }

    async fn send_message(
        &self,
        request: Request<pb::SendMessageRequest>,
    ) -> Result<Response<pb::SendMessageResponse>, Status> {
        let principal = principal(&request)?.clone();
        let new = NewMessage::try_from(request.into_inner())?;
        let workspace = self
            .shared
            .authorized_workspace(&principal, &new.workspace, |id| Action::ReadWorkspace(id))
            .await?;
        principal
            .authorize(Action::CreateRun)
            .map_err(ServiceError::Denied)?;
        ensure_active(&workspace)?;
        let message = self
            .shared
            .db
            .send_message(&principal.tenant, &workspace.id, &new.station, &new.text)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(
            workspace = %workspace.id,
            station = %message.station,
            message = message.id,
            state = ?message.state,
            "message sent"
        );
        self.shared.scheduler.wake();
        Ok(Response::new(pb::SendMessageResponse {
            message: Some(message_to_pb(&message)),
        }))
    }

    async fn list_messages(
        &self,
        request: Request<pb::ListMessagesRequest>,
    ) -> Result<Response<pb::ListMessagesResponse>, Status> {
        let principal = principal(&request)?.clone();
        let workspace = self
            .shared
            .authorized_workspace(&principal, &request.get_ref().workspace, |id| {
                Action::ReadWorkspace(id)
            })
            .await?;
        let messages = self
            .shared
            .db
            .list_messages(&workspace.id)
            .await
            .map_err(ServiceError::from)?;
        Ok(Response::new(pb::ListMessagesResponse {
            messages: messages.iter().map(message_to_pb).collect(),
        }))
    }

    async fn list_handoff_notes(
        &self,
        request: Request<pb::ListHandoffNotesRequest>,
    ) -> Result<Response<pb::ListHandoffNotesResponse>, Status> {
        let principal = principal(&request)?.clone();
        let workspace = self
            .shared
            .authorized_workspace(&principal, &request.get_ref().workspace, |id| {
                Action::ReadWorkspace(id)
            })
            .await?;
        let notes = self
            .shared
            .db
            .list_handoff_notes(&workspace.id)
            .await
            .map_err(ServiceError::from)?;
        Ok(Response::new(pb::ListHandoffNotesResponse {
            notes: notes.iter().map(handoff_note_to_pb).collect(),
        }))
    }

    async fn fork_workspace(
        &self,
        request: Request<pb::ForkWorkspaceRequest>,
    ) -> Result<Response<pb::ForkWorkspaceResponse>, Status> {
        let principal = principal(&request)?.clone();
        principal
            .authorize(Action::CreateWorkspace)
            .map_err(ServiceError::Denied)?;
        let req = request.into_inner();
        // Cheap checks first: a bad request touches nothing.
        if req.count == 0 || req.count > MAX_FORK_COUNT {
            return Err(ServiceError::InvalidArgument(format!(
                "count must be 1 to {MAX_FORK_COUNT}, not {}",
                req.count
            ))
            .into());
        }
        let checkpoint = match req.checkpoint_id.trim() {
            "" => None,
            id => Some(id.parse::<CheckpointId>().map_err(ServiceError::from)?),
        };
        let source = self
            .shared
            .authorized_workspace(&principal, &req.workspace, |id| Action::ReadWorkspace(id))
            .await?;
        ensure_active(&source)?;
        let names = fork_names(&req.name_prefix, source.name.as_deref(), req.count)?;
        let forked = self
            .shared
            .db
            .fork_workspace(&principal.tenant, &source.id, checkpoint.as_ref(), &names)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(
            source = %source.id,
            checkpoint = %forked.checkpoint,
            count = forked.workspaces.len(),
            tenant = %principal.tenant,
            "workspace forked"
        );
        Ok(Response::new(pb::ForkWorkspaceResponse {
            workspaces: forked
                .workspaces
                .iter()
                .map(|w| workspace_to_pb(w, self.policy()))
                .collect(),
            checkpoint_id: forked.checkpoint.to_string(),
        }))
    }

    async fn create_workspace(
        &self,
        request: Request<pb::CreateWorkspaceRequest>,
    ) -> Result<Response<pb::Workspace>, Status> {
        let principal = principal(&request)?.clone();
        principal
            .authorize(Action::CreateWorkspace)
            .map_err(ServiceError::Denied)?;
        let name = requested_name(&request.get_ref().name)?;
        let workspace = self
            .shared
            .db
            .create_workspace(&principal.tenant, name)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(workspace = %workspace.id, name = name.unwrap_or(""), tenant = %principal.tenant, "workspace created");
        Ok(Response::new(workspace_to_pb(&workspace, self.policy())))
    }

    async fn get_workspace(
        &self,
        request: Request<pb::GetWorkspaceRequest>,
    ) -> Result<Response<pb::Workspace>, Status> {
        let principal = principal(&request)?.clone();
        let workspace = self
            .shared
            .authorized_workspace(&principal, &request.get_ref().workspace, |id| {
                Action::ReadWorkspace(id)
            })
            .await?;
        let storage = self
            .shared
            .db
            .workspace_storage(&workspace.id)
            .await
            .map_err(ServiceError::from)?;
        let mut answer = workspace_to_pb(&workspace, self.policy());
        answer.storage = Some(pb::WorkspaceStorage {
            referenced_bytes: storage.referenced.bytes,
            referenced_packs: storage.referenced.packs,
            unique_bytes: storage.unique_bytes,
            shared_bytes: storage.shared_bytes,
        });
        Ok(Response::new(answer))
    }

    async fn list_workspaces(
        &self,
        request: Request<pb::ListWorkspacesRequest>,
    ) -> Result<Response<pb::ListWorkspacesResponse>, Status> {
        let principal = principal(&request)?.clone();
        principal
            .authorize(Action::ListWorkspaces)
            .map_err(ServiceError::Denied)?;
        let req = request.into_inner();
        let after = match decode_page_token(&req.page_token, PAGE_KIND)? {
            Some(position) => Some(position.parse::<WorkspaceId>().map_err(|_| {
                ServiceError::InvalidArgument("page_token is not a token this list returned".into())
            })?),
            None => None,
        };
        let limit = page_size(req.page_size);
        let mut workspaces = self
            .shared
            .db
            .list_workspaces(&principal.tenant, after.as_ref(), limit + 1)
            .await
            .map_err(ServiceError::from)?;
        let next_page_token = if workspaces.len() > limit as usize {
            workspaces.truncate(limit as usize);
            let last = workspaces.last().expect("a full page is not empty");
            encode_page_token(PAGE_KIND, last.id.as_str())
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListWorkspacesResponse {
            workspaces: workspaces
                .iter()
                .map(|w| workspace_to_pb(w, self.policy()))
                .collect(),
            next_page_token,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_validated_on_receipt() {
        let req = |workspace: &str, text: &str, station: &str| pb::SendMessageRequest {
            workspace: workspace.into(),
            text: text.into(),
            station: station.into(),
        };
        let ok = NewMessage::try_from(req("ws", "hello", "")).unwrap();
        assert_eq!(ok.station, DEFAULT_STATION);
        assert_eq!(ok.text, "hello");
        assert!(NewMessage::try_from(req("", "hello", "")).is_err());
        assert!(NewMessage::try_from(req("ws", "  ", "")).is_err());
        let big = "x".repeat(MAX_MESSAGE_BYTES + 1);
        assert!(NewMessage::try_from(req("ws", &big, "")).is_err());
        assert!(NewMessage::try_from(req("ws", "hi", "../x")).is_err());
    }

    #[test]
    fn names_are_optional_validated_and_never_id_shaped() {
        assert_eq!(requested_name("  ").unwrap(), None);
        assert_eq!(requested_name("fix-login").unwrap(), Some("fix-login"));
        assert!(requested_name("../x").is_err());
        let id = WorkspaceId::generate();
        assert!(requested_name(id.as_str()).is_err());
    }

    #[test]
    fn fork_names_number_a_prefix() {
        let names = |requested, source, count| {
            fork_names(requested, source, count).map(|names| {
                names
                    .into_iter()
                    .map(|n| n.unwrap_or_else(|| "-".into()))
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(
            names("", Some("task"), 2).unwrap(),
            ["task-fork-1", "task-fork-2"]
        );
        assert_eq!(names("try", Some("task"), 1).unwrap(), ["try-1"]);
        assert_eq!(names("", None, 2).unwrap(), ["-", "-"]);
        assert!(names("", Some("task"), 0).is_err());
        assert!(names("", Some("task"), MAX_FORK_COUNT + 1).is_err());
        assert!(names("../x", None, 1).is_err());
    }
}
