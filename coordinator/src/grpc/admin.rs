//! `cairn.v1.AdminService`: hosts (list, cordon, uncordon, drain) and
//! client and host tokens, for admin tokens only.

use std::time::SystemTime;

use cairn_proto::pb;
use cairn_proto::pb::admin_service_server::AdminService;
use cairn_proto::runs::HostState;
use tonic::{Request, Response, Status};

use super::{ServiceError, Shared, host_to_pb};
use crate::auth::principal;
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

#[tonic::async_trait]
impl AdminService for AdminApi {
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
        let token = tokens::generate(scope);
        self.shared
            .db
            .ensure_token(&token.hash, &principal.tenant, scope, None, &description)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(%scope, %description, "token created");
        Ok(Response::new(pb::CreateTokenResponse {
            token: token.text,
            scope: scope.as_str().to_owned(),
        }))
    }
}
