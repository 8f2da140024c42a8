//! `cairn.v1.AdminService`: hosts (list, cordon, uncordon, drain), client
//! and host tokens (create, list, revoke), garbage collection and storage,
//! for admin tokens only.

use std::time::{Duration, SystemTime};

use cairn_proto::domain::to_timestamp;
use cairn_proto::ids::TokenId;
use cairn_proto::pb;
use cairn_proto::pb::admin_service_server::AdminService;
use cairn_proto::runs::{HostState, from_proto_duration, to_proto_duration};
use tonic::{Request, Response, Status};

use super::{ServiceError, Shared, host_to_pb};
use crate::auth::principal;
use crate::db::{NewTokenRow, TokenInfo, expiry_after};
use crate::gc::GcError;
use crate::tokens::{self, Action, Principal, Scope};

/// Longest token description kept.
const MAX_DESCRIPTION_BYTES: usize = 500;

/// Implements AdminService over the shared state.
#[derive(Debug, Clone)]
pub struct AdminApi {
    shared: Shared,
}

impl AdminApi {
    pub fn new(shared: Shared) -> Self {
        Self { shared }
    }
}

fn admin<T>(request: &Request<T>) -> Result<Principal, Status> {
    let principal = principal(request)?.clone();
    principal
        .authorize(Action::Administer)
        .map_err(ServiceError::Denied)?;
    Ok(principal)
}

fn host_reference(request: &pb::HostRequest) -> Result<&str, ServiceError> {
    match request.host.trim() {
        "" => Err(ServiceError::InvalidArgument(
            "host is empty: name a host by id or name".into(),
        )),
        host => Ok(host),
    }
}

fn tally_bytes(t: crate::db::PackTally) -> (u64, u64) {
    (t.packs, t.bytes)
}

#[tonic::async_trait]
impl AdminService for AdminApi {
    async fn collect_garbage(
        &self,
        request: Request<pb::CollectGarbageRequest>,
    ) -> Result<Response<pb::GcReport>, Status> {
        let principal = admin(&request)?;
        let dry_run = request.get_ref().dry_run;
        let report = self
            .shared
            .collector
            .cycle(Some(&principal.tenant), dry_run)
            .await
            .map_err(|e| match e {
                GcError::Db(e) => ServiceError::Db(e),
                GcError::Store(e) => ServiceError::Store(e),
                GcError::Failpoint(e) => ServiceError::FailedPrecondition(e.to_string()),
            })?;
        tracing::info!(tenant = %principal.tenant, dry_run, checkpoints_deleted = report.checkpoints_deleted, packs_swept = report.swept.packs, orphans_swept = report.orphans_swept.packs, "garbage collection asked for");
        let (packs_condemned, bytes_condemned) = tally_bytes(report.condemned);
        let (packs_swept, bytes_swept) = tally_bytes(report.swept);
        let (orphans_swept, orphan_bytes_swept) = tally_bytes(report.orphans_swept);
        let (packs_awaiting_grace, bytes_awaiting_grace) = tally_bytes(report.awaiting_grace);
        Ok(Response::new(pb::GcReport {
            dry_run: report.dry_run,
            checkpoints_deleted: report.checkpoints_deleted,
            workspaces_expired: report.workspaces_expired,
            packs_condemned,
            bytes_condemned,
            packs_swept,
            bytes_swept,
            orphans_swept,
            orphan_bytes_swept,
            packs_awaiting_grace,
            bytes_awaiting_grace,
            grace: Some(to_proto_duration(report.grace)),
            took: Some(to_proto_duration(report.took)),
        }))
    }

    async fn get_storage(
        &self,
        request: Request<pb::GetStorageRequest>,
    ) -> Result<Response<pb::TenantStorage>, Status> {
        let principal = admin(&request)?;
        let storage = self
            .shared
            .db
            .tenant_storage(&principal.tenant)
            .await
            .map_err(ServiceError::from)?;
        Ok(Response::new(pb::TenantStorage {
            tenant: principal.tenant.to_string(),
            packs: storage.stored.packs,
            stored_bytes: storage.stored.bytes,
            condemned_packs: storage.condemned.packs,
            condemned_bytes: storage.condemned.bytes,
            workspaces: storage.workspaces,
            checkpoints: storage.checkpoints,
        }))
    }

    async fn list_hosts(
        &self,
        request: Request<pb::ListHostsRequest>,
    ) -> Result<Response<pb::ListHostsResponse>, Status> {
        let principal = admin(&request)?;
        let hosts = self
            .shared
            .db
            .list_hosts(&principal.tenant)
            .await
            .map_err(ServiceError::from)?;
        Ok(Response::new(pb::ListHostsResponse {
            hosts: hosts.iter().map(host_to_pb).collect(),
        }))
    }

    async fn cordon_host(
        &self,
        request: Request<pb::HostRequest>,
    ) -> Result<Response<pb::Host>, Status> {
        let principal = admin(&request)?;
        let reference = host_reference(request.get_ref())?;
        let host = self
            .shared
            .db
            .set_host_admin_state(&principal.tenant, reference, HostState::Cordoned)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(host = %host.id, "host cordoned");
        Ok(Response::new(host_to_pb(&host)))
    }

    async fn uncordon_host(
        &self,
        request: Request<pb::HostRequest>,
    ) -> Result<Response<pb::Host>, Status> {
        let principal = admin(&request)?;
        let reference = host_reference(request.get_ref())?;
        let host = self
            .shared
            .db
            .set_host_admin_state(&principal.tenant, reference, HostState::Ready)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(host = %host.id, "host uncordoned");
        self.shared.scheduler.wake();
        Ok(Response::new(host_to_pb(&host)))
    }

    async fn drain_host(
        &self,
        request: Request<pb::HostRequest>,
    ) -> Result<Response<pb::Host>, Status> {
        let principal = admin(&request)?;
        let reference = host_reference(request.get_ref())?;
        let host = self
            .shared
            .db
            .drain_host(&principal.tenant, reference)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(host = %host.id, sandboxes = host.used_slots, "host draining");
        self.shared.scheduler.wake();
        Ok(Response::new(host_to_pb(&host)))
    }

    async fn create_token(
        &self,
        request: Request<pb::CreateTokenRequest>,
    ) -> Result<Response<pb::CreateTokenResponse>, Status> {
        let principal = admin(&request)?;
        let req = request.into_inner();
        let scope = match req.scope.as_str() {
            "client" => Scope::Client,
            "host" => Scope::Host,
            other => {
                return Err(ServiceError::InvalidArgument(format!(
                    "scope {other:?} cannot be created: use \"client\" or \"host\" (admin tokens come from the data dir, run tokens from assignments)"
                ))
                .into());
            }
        };
        if req.description.len() > MAX_DESCRIPTION_BYTES {
            return Err(ServiceError::InvalidArgument(format!(
                "description has {} bytes; the limit is {MAX_DESCRIPTION_BYTES}",
                req.description.len()
            ))
            .into());
        }
        let description = match req.description.trim() {
            "" => format!(
                "{scope} token created {}",
                humantime::format_rfc3339_seconds(SystemTime::now())
            ),
            text => text.to_owned(),
        };
        let expires_at = match req.expires_in.as_ref() {
            None => None,
            Some(d) => match from_proto_duration(d, "expires_in").map_err(ServiceError::from)? {
                Duration::ZERO => None,
                ttl => Some(expiry_after(ttl).map_err(ServiceError::from)?),
            },
        };
        let token = tokens::generate(scope);
        let created = self
            .shared
            .db
            .create_token(&NewTokenRow {
                hash: &token.hash,
                tenant: &principal.tenant,
                scope,
                description: &description,
                expires_at,
                host: None,
            })
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(%scope, id = %created.id, %description, "token created");
        Ok(Response::new(pb::CreateTokenResponse {
            token: token.text,
            scope: scope.as_str().to_owned(),
            id: created.id.to_string(),
            expires_at: created.expires_at.map(to_timestamp),
        }))
    }

    async fn list_tokens(
        &self,
        request: Request<pb::ListTokensRequest>,
    ) -> Result<Response<pb::ListTokensResponse>, Status> {
        let principal = admin(&request)?;
        let tokens = self
            .shared
            .db
            .list_tokens(&principal.tenant)
            .await
            .map_err(ServiceError::from)?;
        Ok(Response::new(pb::ListTokensResponse {
            tokens: tokens.iter().map(token_to_pb).collect(),
        }))
    }

    async fn revoke_token(
        &self,
        request: Request<pb::RevokeTokenRequest>,
    ) -> Result<Response<pb::TokenInfo>, Status> {
        let principal = admin(&request)?;
        let id: TokenId = request
            .get_ref()
            .id
            .trim()
            .parse()
            .map_err(ServiceError::from)?;
        if principal.token.as_ref() == Some(&id) {
            return Err(ServiceError::FailedPrecondition(format!(
                "token {id} is the admin token this call is made with; revoking it would lock \
                 the operator out (the admin token comes from the data dir's admin.token)"
            ))
            .into());
        }
        let revoked = self
            .shared
            .db
            .revoke_token(&principal.tenant, &id)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(%id, scope = %revoked.scope, "token revoked");
        Ok(Response::new(token_to_pb(&revoked)))
    }
}

fn token_to_pb(token: &TokenInfo) -> pb::TokenInfo {
    pb::TokenInfo {
        id: token.id.to_string(),
        scope: token.scope.as_str().to_owned(),
        description: token.description.clone(),
        created_at: Some(to_timestamp(token.created_at)),
        expires_at: token.expires_at.map(to_timestamp),
        revoked_at: token.revoked_at.map(to_timestamp),
        host_id: token
            .host
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default(),
    }
}
