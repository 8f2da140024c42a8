//! The gRPC server: `cairn.v1` services, grpc.health.v1 and reflection,
//! behind the bearer-token layer.
//!
//! - WorkspaceService, CheckpointService: the checkpoint engine.
//! - RunService (client and admin tokens), HostService (host and admin),
//!   RunnerService (an attempt's run token), AdminService (admin).
//!
//! Service errors are a [`ServiceError`]; the one `From<ServiceError> for
//! Status` decides every status code and logs internal failures with their
//! cause where they are turned into a status. Scope checks go through the
//! caller's [`Principal`]. Long calls (WatchRunEvents, WaitForInput) end when
//! the server shuts down, so a graceful stop never waits on them.

mod admin;
mod checkpoints;
mod hosts;
mod runner;
mod runs;
mod workspaces;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use cairn_proto::ValidationError;
use cairn_proto::domain::{WorkspaceRef, WorkspaceState, to_timestamp};
use cairn_proto::ids::WorkspaceId;
use cairn_proto::pb;
use cairn_proto::pb::admin_service_server::AdminServiceServer;
use cairn_proto::pb::checkpoint_service_server::CheckpointServiceServer;
use cairn_proto::pb::host_service_server::HostServiceServer;
use cairn_proto::pb::run_service_server::RunServiceServer;
use cairn_proto::pb::runner_service_server::RunnerServiceServer;
use cairn_proto::pb::workspace_service_server::WorkspaceServiceServer;
use cairn_proto::refusal::Refusal;
use cairn_proto::runs::to_proto_duration;
use tokio::net::TcpListener;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::auth::AuthLayer;
use crate::db::{
    Attempt, Checkpoint, DbError, HandoffNote, Host, MetadataStore, Run, RunEvent, Workspace,
};
use crate::gc::Collector;
use crate::retention::{self, KeepReason, Policy, Verdict};
use crate::scheduler::SchedulerHandle;
use crate::store::{ObjectStore, ObjectStoreError};
use crate::tls::{Peer, ServerTls};
use crate::tokens::{Action, Principal, RunTokenKey};

pub use admin::AdminApi;
pub use checkpoints::{CheckpointApi, FAILPOINT_COMMIT_BEFORE_TRANSACTION};
pub use hosts::HostApi;
pub use runner::RunnerApi;
pub use runs::RunApi;
pub use workspaces::WorkspaceApi;

/// Largest gRPC message either way (commits of big workspaces list many blob
/// ids: a million new blobs is about 40 MiB). Each concurrent call may hold
/// one, so this bounds what a connection can make the server buffer.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// How the gRPC listener treats connections: one abusive client must not
/// stall the others, and dead peers are dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Connections open at once; past it new ones wait in the kernel's
    /// backlog, holding no file handle.
    pub max_connections: usize,
    /// A connection that sends nothing this long after it was accepted is
    /// closed before it reaches the HTTP/2 server (a flood of silent
    /// connections would otherwise hold every slot).
    pub handshake_timeout: Duration,
    /// Calls served at once on one connection; more wait their turn.
    pub concurrency_per_connection: usize,
    /// HTTP/2 streams a client may open at once on one connection.
    pub max_concurrent_streams: u32,
    /// HTTP/2 PING interval; a peer that does not answer within
    /// `keepalive_timeout` is dropped.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            handshake_timeout: Duration::from_secs(10),
            // Long calls (WatchRunEvents, WaitForInput) hold a slot each.
            concurrency_per_connection: 256,
            max_concurrent_streams: 256,
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
        }
    }
}

/// Page size when a list request names none.
const DEFAULT_PAGE_SIZE: u32 = 100;
/// Largest page a list request gets.
const MAX_PAGE_SIZE: u32 = 1000;

/// Limits and lifetimes the services apply (per request and per commit).
#[derive(Debug, Clone)]
pub struct ServiceLimits {
    /// Lifetime of signed URLs.
    pub url_ttl: Duration,
    /// Blob ids one FindMissingBlobs call may carry.
    pub max_find_batch: u32,
    /// Largest pack accepted, in bytes.
    pub max_pack_size: u64,
    /// Packs one PrepareUploads or CommitCheckpoint call may name as new.
    pub max_packs_per_call: usize,
    /// Store lookups a commit runs at once.
    pub stat_concurrency: usize,
    /// Blob ids one commit may declare in its new packs: recording them
    /// holds the metadata's write lock, so one huge commit would stall
    /// every other workspace's checkpoints.
    pub max_commit_blobs: u64,
    /// Packs one commit may reference (new and old).
    pub max_commit_referenced_packs: usize,
    /// Encoded bytes of a commit's git states, warnings and harness session.
    pub max_commit_details_bytes: usize,
}

impl Default for ServiceLimits {
    fn default() -> Self {
        Self {
            url_ttl: Duration::from_secs(3600),
            max_find_batch: 20_000,
            max_pack_size: 1 << 30,
            max_packs_per_call: 10_000,
            stat_concurrency: 16,
            max_commit_blobs: 1_000_000,
            max_commit_referenced_packs: 50_000,
            max_commit_details_bytes: 4 << 20,
        }
    }
}

/// How often hosts heartbeat and how long until a silent host is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostTiming {
    pub heartbeat_interval: Duration,
    pub lease: Duration,
}

impl Default for HostTiming {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(1),
            lease: Duration::from_secs(10),
        }
    }
}

/// What every service works with.
#[derive(Clone)]
pub struct Shared {
    pub db: Arc<MetadataStore>,
    pub store: Arc<dyn ObjectStore>,
    pub limits: ServiceLimits,
    pub host_timing: HostTiming,
    /// Derives each attempt's run token.
    pub run_tokens: RunTokenKey,
    /// Wakes the scheduler after a change it should act on.
    pub scheduler: SchedulerHandle,
    /// Cancelled when the server shuts down: long calls end then.
    pub shutdown: CancellationToken,
    /// Retention and garbage collection (with the clock they go by).
    pub collector: Collector,
    /// What the services count for `/metrics`.
    pub metrics: Arc<crate::metrics::Metrics>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Why a request failed, before it becomes a [`Status`].
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Denied(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// A refusal the caller decides on: sent with its code and the typed
    /// reason in the status details.
    #[error("{message}")]
    Refused { refusal: Refusal, message: String },
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Store(#[from] ObjectStoreError),
}

impl ServiceError {
    /// A request over one of the coordinator's limits: INVALID_ARGUMENT
    /// naming the limit, with [`Refusal::LimitExceeded`] for callers.
    fn over_limit(limit: &str, max: u64, actual: u64, what: impl fmt::Display) -> Self {
        Self::Refused {
            refusal: Refusal::LimitExceeded {
                limit: limit.to_owned(),
                max,
                actual,
            },
            message: format!("{what}; the limit ({limit}) is {max}"),
        }
    }
}

impl From<ServiceError> for Status {
    fn from(err: ServiceError) -> Self {
        match err {
            ServiceError::Invalid(e) => Status::invalid_argument(e.to_string()),
            ServiceError::InvalidArgument(m) => Status::invalid_argument(m),
            ServiceError::Denied(m) => Status::permission_denied(m),
            ServiceError::NotFound(m) => Status::not_found(m),
            ServiceError::FailedPrecondition(m) => Status::failed_precondition(m),
            ServiceError::Refused { refusal, message } => refusal.into_status(message),
            ServiceError::Db(e) => match e {
                DbError::GenerationMismatch { given, current } => {
                    Refusal::StaleGeneration { given, current }.into_status(e.to_string())
                }
                DbError::WorkspaceNotActive { ref id, state } => Refusal::WorkspaceNotActive {
                    workspace: id.clone(),
                    state,
                }
                .into_status(e.to_string()),
                DbError::AttemptNotCurrent {
                    run,
                    attempt,
                    why,
                    detail,
                } => Refusal::AttemptNotCurrent { run, attempt, why }.into_status(detail),
                DbError::PacksMissing { ref packs } => Refusal::PacksMissing {
                    packs: packs.clone(),
                }
                .into_status(e.to_string()),
                DbError::WorkspaceHasRuns {
                    ref workspace,
                    ref runs,
                } => Refusal::WorkspaceHasRuns {
                    workspace: workspace.clone(),
                    runs: runs.clone(),
                }
                .into_status(e.to_string()),
                DbError::NameTaken(_) => Status::already_exists(e.to_string()),
                DbError::WorkspaceNotFound(_) | DbError::NotFound(_) => {
                    Status::not_found(e.to_string())
                }
                DbError::Invalid(_) => Status::invalid_argument(e.to_string()),
                DbError::ForeignPack { .. } => Status::permission_denied(e.to_string()),
                DbError::Precondition(_) => Status::failed_precondition(e.to_string()),
                e if e.is_retryable() => {
                    tracing::warn!(error = %e, "metadata database busy");
                    Status::unavailable(format!(
                        "the coordinator's database is busy, try again: {e}"
                    ))
                }
                e => {
                    tracing::error!(error = %e, "metadata operation failed");
                    Status::internal(format!("internal error in the coordinator's metadata: {e}"))
                }
            },
            ServiceError::Store(e) if e.is_retryable() => {
                tracing::warn!(error = %e, "object store unavailable");
                Status::unavailable(e.to_string())
            }
            ServiceError::Store(e) => {
                tracing::error!(error = %e, "object store operation failed");
                Status::internal(e.to_string())
            }
        }
    }
}

impl Shared {
    /// Looks a workspace of the caller's tenant up by id or name.
    async fn workspace(
        &self,
        principal: &Principal,
        reference: &str,
    ) -> Result<Workspace, ServiceError> {
        let parsed: WorkspaceRef = reference.parse()?;
        self.workspace_by_ref(principal, &parsed).await
    }

    /// Looks a workspace up like [`Shared::workspace`], then checks that the
    /// caller may do `action` with it.
    async fn authorized_workspace(
        &self,
        principal: &Principal,
        reference: &str,
        action: for<'a> fn(&'a WorkspaceId) -> Action<'a>,
    ) -> Result<Workspace, ServiceError> {
        let workspace = self.workspace(principal, reference).await?;
        principal
            .authorize(action(&workspace.id))
            .map_err(ServiceError::Denied)?;
        Ok(workspace)
    }

    pub(super) async fn workspace_by_ref(
        &self,
        principal: &Principal,
        reference: &WorkspaceRef,
    ) -> Result<Workspace, ServiceError> {
        self.db
            .workspace(&principal.tenant, reference)
            .await?
            .ok_or_else(|| ServiceError::NotFound(format!("workspace {reference} does not exist")))
    }
}

fn ensure_active(workspace: &Workspace) -> Result<(), ServiceError> {
    if workspace.state == WorkspaceState::Active {
        Ok(())
    } else {
        Err(ServiceError::Db(DbError::WorkspaceNotActive {
            id: workspace.id.clone(),
            state: workspace.state,
        }))
    }
}

/// The page size to use for a request's `page_size`.
fn page_size(requested: u32) -> u32 {
    match requested {
        0 => DEFAULT_PAGE_SIZE,
        n => n.min(MAX_PAGE_SIZE),
    }
}

/// An opaque page token: `kind` tells lists apart so a token of one list is
/// refused by another.
fn encode_page_token(kind: &str, position: &str) -> String {
    URL_SAFE_NO_PAD.encode(format!("{kind}:{position}"))
}

/// The position in a page token of `kind` (`None` for an empty token).
fn decode_page_token(token: &str, kind: &str) -> Result<Option<String>, ServiceError> {
    if token.is_empty() {
        return Ok(None);
    }
    let invalid =
        || ServiceError::InvalidArgument("page_token is not a token this list returned".into());
    let bytes = URL_SAFE_NO_PAD.decode(token).map_err(|_| invalid())?;
    let text = String::from_utf8(bytes).map_err(|_| invalid())?;
    let position = text
        .strip_prefix(kind)
        .and_then(|rest| rest.strip_prefix(':'))
        .ok_or_else(invalid)?;
    Ok(Some(position.to_owned()))
}

fn checkpoint_to_pb(c: &Checkpoint) -> pb::Checkpoint {
    pb::Checkpoint {
        id: c.id.to_string(),
        workspace_id: c.workspace_id.to_string(),
        sequence: c.sequence,
        parent_checkpoint_id: c
            .parent
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default(),
        reason: pb::CheckpointReason::from(c.reason) as i32,
        generation: c.generation.0,
        created_at: Some(to_timestamp(c.created_at)),
        format_version: c.format_version,
        root_tree: c.root_tree.as_bytes().to_vec(),
        stats: Some(c.stats),
        repos: c.repos.clone(),
        warnings: c.warnings.clone(),
        harness: c.harness.clone(),
        pack_count: c.pack_count,
        stored_bytes: c.stored_bytes,
        key_id: c.key_id.clone(),
        retention: None,
    }
}

fn keep_reason_to_pb(reason: &KeepReason) -> pb::KeepReason {
    use pb::keep_reason::{Newest, Pinned, Reason, Recent, RunStart};
    let reason = match reason {
        KeepReason::Newest => Reason::Newest(Newest {}),
        KeepReason::Recent { rank, of } => Reason::Recent(Recent {
            rank: *rank,
            of: *of,
        }),
        KeepReason::Pinned { reason, until } => Reason::Pinned(Pinned {
            reason: reason.clone(),
            until: until.map(to_timestamp),
        }),
        KeepReason::RunStart { run, until } => Reason::RunStart(RunStart {
            run_id: run.to_string(),
            until: Some(to_timestamp(*until)),
        }),
    };
    pb::KeepReason {
        reason: Some(reason),
    }
}

fn verdict_to_pb(verdict: &Verdict) -> pb::CheckpointRetention {
    pb::CheckpointRetention {
        kept_by: verdict.kept_by.iter().map(keep_reason_to_pb).collect(),
        kept_until: verdict.kept_until.map(to_timestamp),
    }
}

/// The retention that applies to `w`: the server's `defaults` under its own.
fn retention_to_pb(w: &Workspace, defaults: &Policy) -> pb::Retention {
    let policy = defaults.with_overrides(&w.retention);
    pb::Retention {
        keep_last: policy.keep_last,
        finished_expiry: Some(to_proto_duration(policy.finished_expiry)),
        own_keep_last: w.retention.keep_last.is_some(),
        own_finished_expiry: w.retention.finished_expiry.is_some(),
    }
}

fn workspace_to_pb(w: &Workspace, defaults: &Policy) -> pb::Workspace {
    let policy = defaults.with_overrides(&w.retention);
    pb::Workspace {
        id: w.id.to_string(),
        name: w.name.clone().unwrap_or_default(),
        tenant: w.tenant.to_string(),
        state: pb::WorkspaceState::from(w.state) as i32,
        created_at: Some(to_timestamp(w.created_at)),
        updated_at: Some(to_timestamp(w.updated_at)),
        generation: w.generation.0,
        checkpoint_count: u32::try_from(w.checkpoint_count).unwrap_or(u32::MAX),
        latest_checkpoint: w.latest_checkpoint.as_ref().map(checkpoint_to_pb),
        finished_at: w.finished_at.map(to_timestamp),
        expires_at: retention::expires_at(&policy, w.state, w.finished_at).map(to_timestamp),
        retention: Some(retention_to_pb(w, defaults)),
        storage: None,
    }
}

fn attempt_to_pb(a: &Attempt) -> pb::Attempt {
    pb::Attempt {
        number: a.number,
        generation: a.generation.0,
        host_id: a.host_id.to_string(),
        sandbox_id: a.sandbox_id.clone(),
        state: pb::AttemptState::from(a.state) as i32,
        started_at: Some(to_timestamp(a.started_at)),
        ended_at: a.ended_at.map(to_timestamp),
        end_reason: a.end_reason.clone(),
        prepare: a.prepare.clone(),
        restored_checkpoint_id: a.restored_checkpoint_id.clone(),
        unsaved: a.unsaved.map(|u| pb::UnsavedWork {
            files: u.files,
            bytes: u.bytes,
            complete: u.complete,
            reported_at: Some(to_timestamp(u.reported_at)),
        }),
    }
}

fn run_to_pb(r: &Run) -> pb::Run {
    pb::Run {
        id: r.id.to_string(),
        workspace_id: r.workspace_id.to_string(),
        station: r.station.clone(),
        harness: Some(r.harness.clone()),
        prompt: r.prompt.clone(),
        labels: r.labels.0.clone().into_iter().collect(),
        hold: Some(to_proto_duration(r.hold)),
        max_attempts: r.max_attempts,
        state: pb::RunState::from(r.state) as i32,
        state_reason: r.state_reason.clone(),
        created_at: Some(to_timestamp(r.created_at)),
        updated_at: Some(to_timestamp(r.updated_at)),
        attempts: r.attempts.iter().map(attempt_to_pb).collect(),
        question: r.question.clone(),
        summary: r.summary.clone(),
        harness_session_id: r.harness_session_id.clone(),
        last_checkpoint_id: r.last_checkpoint_id.clone(),
        repos: r.repos.clone(),
        image: r.image.clone(),
        checkpoint_interval: Some(to_proto_duration(r.checkpoint_interval)),
        checkpoint_limits: Some(r.checkpoint_limits.into()),
        hold_until: r.hold_until.map(to_timestamp),
        laid_paths: r.laid_paths.clone(),
        workspace_checkpointed_at: None,
    }
}

fn handoff_note_to_pb(n: &HandoffNote) -> pb::HandoffNote {
    pb::HandoffNote {
        workspace_id: n.workspace_id.to_string(),
        run_id: n.run_id.to_string(),
        station: n.station.clone(),
        attempt: n.attempt,
        harness: n.harness.clone(),
        outcome: n.outcome.as_str().to_owned(),
        checkpoint_id: n.checkpoint_id.clone(),
        created_at: Some(to_timestamp(n.created_at)),
        text: Some(n.text.clone().into()),
    }
}

fn run_event_to_pb(e: &RunEvent) -> pb::RunEvent {
    pb::RunEvent {
        sequence: e.sequence,
        run_id: e.run_id.to_string(),
        at: Some(to_timestamp(e.at)),
        state: pb::RunState::from(e.state) as i32,
        reason: e.reason.clone(),
        host_id: e.host_id.clone(),
        attempt: e.attempt,
        generation: e.generation,
        checkpoint_id: e.checkpoint_id.clone(),
        detail: e.detail.clone(),
    }
}

fn host_to_pb(h: &Host) -> pb::Host {
    pb::Host {
        id: h.id.to_string(),
        name: h.name.clone(),
        labels: h.labels.0.clone().into_iter().collect(),
        slots: h.slots,
        used_slots: h.used_slots,
        state: pb::HostState::from(h.state()) as i32,
        driver: h.driver.clone(),
        registered_at: Some(to_timestamp(h.registered_at)),
        last_heartbeat_at: Some(to_timestamp(h.last_heartbeat_at)),
        run_ids: h.run_ids.iter().map(ToString::to_string).collect(),
        kept_workspaces: h.kept_workspaces.iter().map(ToString::to_string).collect(),
    }
}

/// Why the gRPC server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    #[error("could not build the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves every gRPC service on `listener` (over TLS when `tls` is given)
/// until `shutdown` completes, then drains the open calls.
pub async fn serve(
    shared: Shared,
    listener: TcpListener,
    limits: ServerLimits,
    tls: Option<ServerTls>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), GrpcError> {
    let auth = AuthLayer::new(
        shared.db.clone(),
        tls.as_ref().is_some_and(ServerTls::hosts_need_certificates),
    );
    let workspaces = WorkspaceServiceServer::new(WorkspaceApi::new(shared.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let checkpoints = CheckpointServiceServer::new(CheckpointApi::new(shared.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    // A run request carries the files it lays, an attempt's spec those and
    // the workspace's handoff notes.
    let runs = RunServiceServer::new(RunApi::new(shared.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let hosts = HostServiceServer::new(HostApi::new(shared.clone()));
    let runner = RunnerServiceServer::new(RunnerApi::new(shared.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let admin = AdminServiceServer::new(AdminApi::new(shared));

    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<WorkspaceServiceServer<WorkspaceApi>>()
        .await;
    health_reporter
        .set_serving::<CheckpointServiceServer<CheckpointApi>>()
        .await;
    health_reporter
        .set_serving::<RunServiceServer<RunApi>>()
        .await;
    health_reporter
        .set_serving::<HostServiceServer<HostApi>>()
        .await;
    health_reporter
        .set_serving::<RunnerServiceServer<RunnerApi>>()
        .await;
    health_reporter
        .set_serving::<AdminServiceServer<AdminApi>>()
        .await;

    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(cairn_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;

    tonic::transport::Server::builder()
        .concurrency_limit_per_connection(limits.concurrency_per_connection.max(1))
        .max_concurrent_streams(limits.max_concurrent_streams.max(1))
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        // A peer whose machine vanished answers no PING either, but TCP
        // keepalive also covers a connection between calls.
        .tcp_keepalive(Some(limits.keepalive_interval))
        // Streams reset at once by the client (rapid reset) are bounded.
        .http2_max_pending_accept_reset_streams(Some(64))
        .layer(auth)
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(workspaces)
        .add_service(checkpoints)
        .add_service(runs)
        .add_service(hosts)
        .add_service(runner)
        .add_service(admin)
        .serve_with_incoming_shutdown(incoming(listener, limits, tls), shutdown)
        .await?;
    Ok(())
}

/// The gRPC listener's connections: at most `limits.max_connections` open,
/// each handed to the server only once it sent its first bytes (with TLS:
/// once its handshake is done), within `limits.handshake_timeout`.
fn incoming(
    listener: TcpListener,
    limits: ServerLimits,
    tls: Option<ServerTls>,
) -> impl tokio_stream::Stream<Item = Result<GrpcConn, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    tokio::spawn(async move {
        loop {
            // The permit comes before accept: past the cap, connections wait
            // in the kernel's backlog.
            let permit = tokio::select! {
                permit = permits.clone().acquire_owned() => permit.expect("never closed"),
                () = tx.closed() => return,
            };
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = tx.closed() => return,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file handles, or a connection reset before
                    // accept: wait a moment instead of spinning.
                    tracing::warn!(error = %e, "gRPC accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            // A reply's HEADERS, DATA and trailers go out as separate small
            // writes; with Nagle's algorithm each one after the first waits
            // for the client's delayed ACK (40 ms).
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY on a gRPC connection");
            }
            let tx = tx.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let addr = stream.peer_addr().ok();
                let opened = async {
                    match &tls {
                        None => {
                            stream.readable().await?;
                            Ok((Either::Left(stream), false))
                        }
                        Some(tls) => {
                            let stream = tls.grpc_acceptor().accept(stream).await?;
                            let verified = stream
                                .get_ref()
                                .1
                                .peer_certificates()
                                .is_some_and(|chain| !chain.is_empty());
                            Ok::<_, std::io::Error>((Either::Right(stream), verified))
                        }
                    }
                };
                match tokio::time::timeout(limits.handshake_timeout, opened).await {
                    Ok(Ok((stream, verified_client_certificate))) => {
                        let peer = Peer {
                            addr,
                            verified_client_certificate,
                        };
                        let _ = tx
                            .send(Ok(GrpcConn {
                                stream,
                                peer,
                                _permit: permit,
                            }))
                            .await;
                    }
                    Ok(Err(e)) if crate::tls::is_certificate_refusal(&e) => {
                        // An operator wants to hear of a host with a wrong
                        // certificate: the host itself sees only a closed pipe.
                        tracing::warn!(peer = ?addr, error = %e, "TLS client certificate refused")
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(peer = ?addr, error = %e, "gRPC connection failed before its first request (TLS handshake or reset)")
                    }
                    Err(_) => {
                        tracing::debug!(peer = ?addr, "gRPC connection closed: no request (or TLS handshake) within the handshake timeout")
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A gRPC connection (plain or TLS) holding its slot under the connection cap.
struct GrpcConn {
    stream: Either<tokio::net::TcpStream, tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
    peer: Peer,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl tonic::transport::server::Connected for GrpcConn {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.peer
    }
}

impl tokio::io::AsyncRead for GrpcConn {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for GrpcConn {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_tokens_round_trip_and_are_bound_to_their_list() {
        let token = encode_page_token("w", "ws-123");
        assert_eq!(
            decode_page_token(&token, "w").unwrap().as_deref(),
            Some("ws-123")
        );
        assert!(decode_page_token(&token, "c").is_err());
        assert!(decode_page_token("not base64!", "w").is_err());
        assert_eq!(decode_page_token("", "w").unwrap(), None);
    }

    #[test]
    fn page_sizes_default_and_cap() {
        assert_eq!(page_size(0), DEFAULT_PAGE_SIZE);
        assert_eq!(page_size(7), 7);
        assert_eq!(page_size(1_000_000), MAX_PAGE_SIZE);
    }

    #[test]
    fn domain_errors_map_to_precise_codes() {
        let code = |e: ServiceError| Status::from(e).code();
        assert_eq!(
            code(DbError::NameTaken("x".into()).into()),
            tonic::Code::AlreadyExists
        );
        let stale = DbError::GenerationMismatch {
            given: cairn_proto::ids::Generation(1),
            current: cairn_proto::ids::Generation(2),
        };
        let status = Status::from(ServiceError::from(stale));
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert_eq!(
            status.message(),
            "generation g1 is older than the workspace's g2"
        );
        assert_eq!(
            Refusal::of(&status),
            Some(Refusal::StaleGeneration {
                given: cairn_proto::ids::Generation(1),
                current: cairn_proto::ids::Generation(2),
            }),
            "the caller decides on the typed reason"
        );
        let down = ObjectStoreError::Unavailable {
            op: crate::store::StoreOp::Stat,
            key: "k".into(),
            reason: "down".into(),
        };
        assert_eq!(code(down.into()), tonic::Code::Unavailable);
        assert_eq!(
            code(ValidationError::new("name", "bad").into()),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            code(DbError::Corrupt("x".into()).into()),
            tonic::Code::Internal
        );
    }
}
