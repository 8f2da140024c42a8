//! `cairn.v1.HostService`: host agents register and heartbeat (host and
//! admin tokens). The heartbeat answer carries every assignment (with its
//! run token, derived again each time) and destroy order still due;
//! `WatchOrders` tells a host the moment it has new ones, so it need not wait
//! for its next heartbeat to hear them (see [`crate::db::OrderBells`]).
//!
//! A host token acts only as the host it is bound to: an enrollment token
//! (bound to none) only registers a new host and gets that host's bound
//! token in the answer; a bound token heartbeats and registers again only
//! as its own host (see [`crate::tokens::Principal::registration`]).

use std::pin::Pin;
use std::time::SystemTime;

use cairn_proto::domain::{to_timestamp, validate_name};
use cairn_proto::ids::{HostId, WorkspaceId};
use cairn_proto::pb;
use cairn_proto::pb::host_service_server::HostService;
use cairn_proto::runs::{HostState, Labels, SandboxState, to_proto_duration};
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::{ServiceError, Shared};
use crate::auth::principal;
use crate::db::{BoundToken, HostRegistration, Registered, ReportedSandbox};
use crate::tokens::{self, Action, Denied, Scope};

/// The notices of a `WatchOrders` stream.
type NoticeStream = Pin<Box<dyn Stream<Item = Result<pb::OrdersNotice, Status>> + Send>>;

/// Most slots one host may offer.
const MAX_SLOTS: u32 = 10_000;

/// Implements HostService over the shared state.
#[derive(Debug, Clone)]
pub struct HostApi {
    shared: Shared,
}

impl HostApi {
    pub fn new(shared: Shared) -> Self {
        Self { shared }
    }

    /// Answers a heartbeat ([`HostService::heartbeat`] times it).
    async fn answer_heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let principal = principal(&request)?.clone();
        principal
            .authorize(Action::ActAsHost)
            .map_err(ServiceError::Denied)?;
        let req = request.into_inner();
        let host_id: HostId = req.host_id.parse().map_err(ServiceError::from)?;
        // Before anything is read or written: the answer carries the host's
        // assignments and their run tokens.
        principal
            .act_as_host(&host_id)
            .map_err(Denied::into_status)?;
        let reports = req
            .sandboxes
            .into_iter()
            .map(reported)
            .collect::<Result<Vec<_>, _>>()?;
        let answer = self
            .shared
            .db
            .heartbeat(
                &principal.tenant,
                &host_id,
                &reports,
                req.stopping,
                &kept_workspaces(req.kept_workspaces)?,
            )
            .await
            .map_err(ServiceError::from)?;
        let state = answer.state.unwrap_or(HostState::Ready);
        if !answer.forget.is_empty() {
            // Slots came free.
            self.shared.scheduler.wake();
        }
        let assignments = answer
            .assignments
            .iter()
            .map(|a| pb::Assignment {
                sandbox_id: a.sandbox_id.clone(),
                run_id: a.run_id.to_string(),
                attempt: a.attempt,
                generation: a.generation.0,
                workspace_id: a.workspace_id.to_string(),
                run_token: self.shared.run_tokens.token(&a.run_id, a.attempt).text,
                image: a.image.clone(),
            })
            .collect();
        Ok(Response::new(pb::HeartbeatResponse {
            lease_expires_at: Some(to_timestamp(
                SystemTime::now() + self.shared.host_timing.lease,
            )),
            state: pb::HostState::from(state) as i32,
            assignments,
            destroy: answer
                .destroy
                .into_iter()
                .map(|(sandbox_id, reason)| pb::DestroyOrder { sandbox_id, reason })
                .collect(),
            forget: answer.forget,
        }))
    }
}

/// The host id a registration asks for (None: a new one).
fn asked_host_id(req: &pb::RegisterHostRequest) -> Result<Option<HostId>, ServiceError> {
    match req.host_id.trim() {
        "" => Ok(None),
        id => Ok(Some(id.parse()?)),
    }
}

/// Checks a registration for `host_id` (the asked id, or a new one).
fn registration(
    req: pb::RegisterHostRequest,
    host_id: HostId,
) -> Result<HostRegistration, ServiceError> {
    let name = match req.name.trim() {
        "" => host_id.to_string(),
        name => {
            validate_name(name)?;
            name.to_owned()
        }
    };
    if req.slots == 0 || req.slots > MAX_SLOTS {
        return Err(ServiceError::InvalidArgument(format!(
            "slots must be 1 to {MAX_SLOTS}, not {}",
            req.slots
        )));
    }
    let driver_ok = !req.driver.is_empty()
        && req.driver.len() <= 32
        && req
            .driver
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if !driver_ok {
        return Err(ServiceError::InvalidArgument(format!(
            "driver {:?} is not a driver name (local, exec)",
            req.driver
        )));
    }
    Ok(HostRegistration {
        host_id: Some(host_id),
        name,
        labels: Labels::from_map(req.labels)?,
        slots: req.slots,
        driver: req.driver,
    })
}

fn reported(report: pb::SandboxReport) -> Result<ReportedSandbox, ServiceError> {
    if report.sandbox_id.is_empty() {
        return Err(ServiceError::InvalidArgument(
            "a sandbox report has no sandbox_id".into(),
        ));
    }
    let state = SandboxState::try_from(report.state).map_err(|e| {
        ServiceError::InvalidArgument(format!("sandbox {}: {e}", report.sandbox_id))
    })?;
    Ok(ReportedSandbox {
        sandbox_id: report.sandbox_id,
        state,
        exit_code: report.exit_code,
        detail: report.detail,
    })
}

#[tonic::async_trait]
impl HostService for HostApi {
    async fn register_host(
        &self,
        request: Request<pb::RegisterHostRequest>,
    ) -> Result<Response<pb::RegisterHostResponse>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let rights = principal
            .registration(asked_host_id(&req)?.as_ref())
            .map_err(Denied::into_status)?;
        let host_id = rights.host_id.clone().unwrap_or_else(HostId::generate);
        let registration = registration(req, host_id)?;
        let bound = rights
            .issue_bound_token
            .then(|| tokens::generate(Scope::Host));
        let issued_by = match (&principal.scope, &principal.token) {
            (Scope::Admin, _) => "registered with an admin token".to_owned(),
            (_, Some(id)) => format!("enrolled with {id}"),
            (_, None) => "enrolled".to_owned(),
        };
        let registered = self
            .shared
            .db
            .register_host(
                &principal.tenant,
                registration,
                rights.new_only,
                bound.as_ref().map(|token| BoundToken {
                    hash: &token.hash,
                    issued_by,
                }),
            )
            .await
            .map_err(ServiceError::from)?;
        let (host, token) = match registered {
            Registered::Host { host, token } => (host, token),
            Registered::Exists(id) => {
                return Err(Status::permission_denied(format!(
                    "host {id} is already registered: an enrollment token registers only a new host; \
                     the host registers again with the token bound to it (kept in its data dir)"
                )));
            }
        };
        tracing::info!(host = %host.id, name = %host.name, labels = %host.labels, slots = host.slots, state = %host.state(), token = ?token.as_ref().map(|t| &t.id), "host registered");
        self.shared.scheduler.wake();
        let timing = self.shared.host_timing;
        Ok(Response::new(pb::RegisterHostResponse {
            host_id: host.id.to_string(),
            heartbeat_interval: Some(to_proto_duration(timing.heartbeat_interval)),
            lease: Some(to_proto_duration(timing.lease)),
            host_token: bound.map(|token| token.text).unwrap_or_default(),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let started = std::time::Instant::now();
        let answered = self.answer_heartbeat(request).await;
        self.shared
            .metrics
            .heartbeat(started.elapsed(), answered.as_ref().map(drop));
        answered
    }

    type WatchOrdersStream = NoticeStream;

    async fn watch_orders(
        &self,
        request: Request<pb::WatchOrdersRequest>,
    ) -> Result<Response<Self::WatchOrdersStream>, Status> {
        let principal = principal(&request)?.clone();
        principal
            .authorize(Action::ActAsHost)
            .map_err(ServiceError::Denied)?;
        let host_id: HostId = request
            .into_inner()
            .host_id
            .parse()
            .map_err(ServiceError::from)?;
        principal
            .act_as_host(&host_id)
            .map_err(Denied::into_status)?;
        // A host that registered, so that nobody holds bells for made-up ids.
        self.shared
            .db
            .host(&principal.tenant, host_id.as_str())
            .await
            .map_err(ServiceError::from)?;
        let (sink, notices) = mpsc::channel(1);
        tokio::spawn(ring_notices(self.shared.clone(), host_id, sink));
        Ok(Response::new(Box::pin(ReceiverStream::new(notices))))
    }
}

/// Sends `host` a notice at once, then one each time its bell rings, until
/// the host hangs up or the server shuts down. Notices carry nothing but a
/// count, so a stream outliving its token's revocation tells nothing: the
/// heartbeat it prompts is checked as any other.
async fn ring_notices(
    shared: super::Shared,
    host: HostId,
    sink: mpsc::Sender<Result<pb::OrdersNotice, Status>>,
) {
    let bells = shared.db.order_bells().clone();
    let mut bell = bells.listen(&host);
    let mut sequence = 0;
    loop {
        sequence += 1;
        // The channel holds one notice: a host that has not read the last
        // one yet will heartbeat anyway, so nothing is queued behind it.
        match sink.try_send(Ok(pb::OrdersNotice { sequence })) {
            Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
            Err(mpsc::error::TrySendError::Closed(_)) => break,
        }
        tokio::select! {
            rung = bell.changed() => if rung.is_err() { break },
            () = sink.closed() => break,
            () = shared.shutdown.cancelled() => {
                let _ = sink
                    .send(Err(Status::unavailable("the coordinator is shutting down; watch again")))
                    .await;
                break;
            }
        }
    }
    drop(bell);
    bells.release(&host);
}

/// Most kept workspaces a heartbeat may list.
const MAX_KEPT_WORKSPACES: usize = 10_000;

/// Checks a heartbeat's `kept_workspaces`: valid workspace ids, not too many.
fn kept_workspaces(ids: Vec<String>) -> Result<Vec<WorkspaceId>, Status> {
    if ids.len() > MAX_KEPT_WORKSPACES {
        return Err(Status::invalid_argument(format!(
            "kept_workspaces lists {} workspaces; at most {MAX_KEPT_WORKSPACES}",
            ids.len()
        )));
    }
    ids.iter()
        .map(|id| {
            id.parse::<WorkspaceId>()
                .map_err(|e| Status::invalid_argument(format!("kept_workspaces: {e}")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_are_checked_and_get_an_id_and_a_name() {
        let request = pb::RegisterHostRequest {
            slots: 2,
            driver: "local".into(),
            ..Default::default()
        };
        assert_eq!(asked_host_id(&request).unwrap(), None);
        let id = HostId::generate();
        let registration = registration(request.clone(), id.clone()).unwrap();
        assert_eq!(registration.host_id.as_ref(), Some(&id));
        assert_eq!(registration.name, id.as_str());

        let no_slots = pb::RegisterHostRequest {
            slots: 0,
            ..request.clone()
        };
        assert!(registration_error(no_slots).contains("slots"));
        let bad_id = pb::RegisterHostRequest {
            host_id: "ws-1".into(),
            ..request.clone()
        };
        assert!(
            asked_host_id(&bad_id)
                .unwrap_err()
                .to_string()
                .contains("host_id")
        );
        let bad_driver = pb::RegisterHostRequest {
            driver: "a b".into(),
            ..request
        };
        assert!(registration_error(bad_driver).contains("driver"));
    }

    fn registration_error(request: pb::RegisterHostRequest) -> String {
        registration(request, HostId::generate())
            .unwrap_err()
            .to_string()
    }
}
