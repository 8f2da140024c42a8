//! The checkpoint protocol's calls to the coordinator, with retries.
//!
//! Every call is retried with exponential backoff while the coordinator is
//! unavailable (restarting, overloaded, refusing connections) and when a
//! call was cut off before its answer (the coordinator died mid-call):
//! every call of the protocol is safe to send again (the commit names
//! itself with a request id, so a retried commit makes one checkpoint).
//! Any other refusal is final and reported with the call's name and the
//! coordinator's message.

use std::future::Future;
use std::time::Duration;

use cairn_proto::ids::{BlobId, CheckpointId, Generation, PackId, WorkspaceId};
use cairn_proto::pb;
use tonic::Code;

use super::CheckpointError;
use crate::client::{AuthChannel, CoordinatorClient};
use crate::format::TenantKeys;

type CheckpointClient = pb::checkpoint_service_client::CheckpointServiceClient<AuthChannel>;

const ATTEMPTS: u32 = 6;
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Used when the coordinator does not say how many ids one call may carry.
const DEFAULT_FIND_BATCH: usize = 4096;

fn retryable(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted
    ) || cut_off(status)
}

/// The call failed in this process's transport (the connection broke
/// before an answer came), not with a status the coordinator sent: only
/// such a status carries an error source.
pub(crate) fn cut_off(status: &tonic::Status) -> bool {
    use std::error::Error as _;
    status.source().is_some()
        && matches!(
            status.code(),
            Code::Unknown | Code::Internal | Code::Cancelled | Code::Unavailable
        )
}

/// Runs one RPC, again and again while the coordinator is unavailable.
pub(super) async fn call<T, F, Fut>(name: &'static str, mut rpc: F) -> Result<T, CheckpointError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let mut backoff = FIRST_BACKOFF;
    let mut attempt = 1;
    loop {
        match rpc().await {
            Ok(response) => return Ok(response.into_inner()),
            Err(status) if retryable(&status) && attempt < ATTEMPTS => {
                tracing::info!(call = name, code = ?status.code(), message = status.message(), ?backoff, "coordinator unavailable; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                attempt += 1;
            }
            Err(status) => return Err(CheckpointError::Rpc { call: name, status }),
        }
    }
}

/// One checkpoint's standing with the coordinator (from BeginCheckpoint).
pub(super) struct Session {
    pub client: CheckpointClient,
    pub workspace_id: WorkspaceId,
    pub keys: std::sync::Arc<TenantKeys>,
    pub generation: Generation,
    /// The workspace's newest checkpoint, which this one follows (None: the first).
    pub parent: Option<CheckpointId>,
    pub find_batch: usize,
}

/// A checkpoint the coordinator recorded.
#[derive(Debug, Clone)]
pub(crate) struct Committed {
    pub id: CheckpointId,
    pub sequence: u64,
}

impl Session {
    pub async fn begin(
        coordinator: &CoordinatorClient,
        workspace: &str,
        generation: Option<Generation>,
    ) -> Result<Self, CheckpointError> {
        let client = coordinator.checkpoints.clone();
        let request = pb::BeginCheckpointRequest {
            workspace: workspace.to_owned(),
            // 0 asks for the workspace's current generation.
            generation: generation.map_or(0, |g| g.0),
        };
        let begun = call("BeginCheckpoint", || {
            let mut client = client.clone();
            let request = request.clone();
            async move { client.begin_checkpoint(request).await }
        })
        .await
        .map_err(|e| match e {
            CheckpointError::Rpc { status, .. } if status.code() == Code::NotFound => {
                CheckpointError::WorkspaceNotFound(workspace.to_owned())
            }
            other => other,
        })?;
        let bad = |reason: String| CheckpointError::BadResponse {
            call: "BeginCheckpoint",
            reason,
        };
        let workspace_id: WorkspaceId = begun
            .workspace_id
            .parse()
            .map_err(|e| bad(format!("{e}")))?;
        let key = begun.key.ok_or_else(|| bad("no tenant key".into()))?;
        if key.key_id.is_empty() {
            return Err(bad("the tenant key has no id".into()));
        }
        let keys = TenantKeys::derive(key.key_id, &key.secret).map_err(|e| bad(e.to_string()))?;
        let parent = match begun.parent_checkpoint_id.as_str() {
            "" => None,
            id => Some(id.parse().map_err(|e| bad(format!("parent: {e}")))?),
        };
        let find_batch = match begun.max_find_batch {
            0 => DEFAULT_FIND_BATCH,
            n => n as usize,
        };
        Ok(Self {
            client,
            workspace_id,
            keys: std::sync::Arc::new(keys),
            generation: Generation(begun.generation),
            parent,
            find_batch,
        })
    }

    /// For each id, the pack that already holds it (None: missing).
    pub async fn find_missing(
        &self,
        ids: &[BlobId],
    ) -> Result<Vec<Option<PackId>>, CheckpointError> {
        let mut found = Vec::with_capacity(ids.len());
        for slice in ids.chunks(self.find_batch) {
            let request = pb::FindMissingBlobsRequest {
                workspace: self.workspace_id.to_string(),
                blob_ids: slice.iter().map(|id| id.as_bytes().to_vec()).collect(),
            };
            let answer = call("FindMissingBlobs", || {
                let mut client = self.client.clone();
                let request = request.clone();
                async move { client.find_missing_blobs(request).await }
            })
            .await?;
            let bad = |reason: String| CheckpointError::BadResponse {
                call: "FindMissingBlobs",
                reason,
            };
            if answer.locations.len() != slice.len() {
                return Err(bad(format!(
                    "{} locations for {} blob ids",
                    answer.locations.len(),
                    slice.len()
                )));
            }
            let packs = answer
                .packs
                .iter()
                .map(|p| p.parse::<PackId>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(e.to_string()))?;
            for location in answer.locations {
                let pack = match location as usize {
                    0 => None,
                    k => Some(
                        packs
                            .get(k - 1)
                            .cloned()
                            .ok_or_else(|| bad(format!("location {k} names no pack")))?,
                    ),
                };
                found.push(pack);
            }
        }
        Ok(found)
    }
}

/// A signed upload URL for one pack.
pub(super) async fn prepare_upload(
    client: &CheckpointClient,
    workspace: &WorkspaceId,
    upload: pb::PackUpload,
) -> Result<pb::SignedUrl, CheckpointError> {
    let pack_id = upload.pack_id.clone();
    let request = pb::PrepareUploadsRequest {
        workspace: workspace.to_string(),
        packs: vec![upload],
    };
    let answer = call("PrepareUploads", || {
        let mut client = client.clone();
        let request = request.clone();
        async move { client.prepare_uploads(request).await }
    })
    .await?;
    answer
        .urls
        .into_iter()
        .find(|u| u.pack_id == pack_id)
        .ok_or_else(|| CheckpointError::BadResponse {
            call: "PrepareUploads",
            reason: format!("no URL for pack {pack_id}"),
        })
}

/// Records the checkpoint.
pub(super) async fn commit(
    client: &CheckpointClient,
    request: pb::CommitCheckpointRequest,
) -> Result<Committed, CheckpointError> {
    let committed = call("CommitCheckpoint", || {
        let mut client = client.clone();
        let request = request.clone();
        async move { client.commit_checkpoint(request).await }
    })
    .await?;
    let id = committed
        .id
        .parse()
        .map_err(|e| CheckpointError::BadResponse {
            call: "CommitCheckpoint",
            reason: format!("{e}"),
        })?;
    Ok(Committed {
        id,
        sequence: committed.sequence,
    })
}
