//! Bearer tokens on every gRPC service, and scopes; health without one;
//! expiry and revocation.

use cairn_coordinator::db::MetadataStore;
use cairn_coordinator::tokens::{self, Scope};
use cairn_engine::client::CoordinatorClient;
use cairn_proto::ids::TenantId;
use cairn_proto::pb;
use std::time::Duration;
use tokio_stream::StreamExt;

use cairn_proto::refusal::{Refusal, TokenRefusal};
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

use cairn_proto::pb::host_service_client::HostServiceClient;
use cairn_proto::pb::runner_service_client::RunnerServiceClient;

use crate::fleet::{Clients, FakeHost, run_request};
use crate::harness::*;

/// The status of one call to each service (`Ok` for success).
async fn call_every_service(
    client: &mut CoordinatorClient,
) -> Vec<(&'static str, Result<(), tonic::Status>)> {
    let workspaces = client
        .workspaces
        .list_workspaces(pb::ListWorkspacesRequest::default())
        .await
        .map(drop);
    let checkpoints = client
        .checkpoints
        .get_checkpoint(pb::GetCheckpointRequest {
            checkpoint_id: "ck-00000000000000000000000000".into(),
        })
        .await
        .map(drop);
    let health = HealthClient::new(client.auth_channel())
        .check(HealthCheckRequest {
            service: "cairn.v1.CheckpointService".into(),
        })
        .await
        .map(drop);
    let reflection = list_services(client).await.map(drop);
    vec![
        ("WorkspaceService", workspaces),
        // Authenticated, this call reaches the service and answers NOT_FOUND.
        (
            "CheckpointService",
            checkpoints.or_else(|s| {
                if s.code() == Code::NotFound {
                    Ok(())
                } else {
                    Err(s)
                }
            }),
        ),
        ("grpc.health.v1.Health", health),
        ("grpc.reflection.v1.ServerReflection", reflection),
    ]
}

/// The services reflection lists.
async fn list_services(client: &mut CoordinatorClient) -> Result<Vec<String>, tonic::Status> {
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut reflection = ServerReflectionClient::new(client.auth_channel());
    let mut responses = reflection
        .server_reflection_info(tokio_stream::once(request))
        .await?
        .into_inner();
    let response = responses.next().await.expect("one response")?;
    match response.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            Ok(list.service.into_iter().map(|s| s.name).collect())
        }
        other => panic!("unexpected reflection answer {other:?}"),
    }
}

/// The one service that answers without a valid token.
const HEALTH: &str = "grpc.health.v1.Health";

#[tokio::test]
async fn a_missing_token_is_unauthenticated_on_every_service_but_health() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut anonymous = server.client_with(None).await;
    for (service, result) in call_every_service(&mut anonymous).await {
        if service == HEALTH {
            result.unwrap_or_else(|s| panic!("health answers without a token: {s:?}"));
            continue;
        }
        let status = result.expect_err(service);
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{service}: {}",
            status.message()
        );
    }
    let denied =
        cairn_proto::pb::run_service_client::RunServiceClient::new(anonymous.auth_channel())
            .list_runs(pb::ListRunsRequest::default())
            .await
            .unwrap_err();
    assert_eq!(denied.code(), Code::Unauthenticated);

    // Check and Watch, as a probe (grpc_health_probe, Kubernetes) asks.
    let mut health = HealthClient::new(anonymous.auth_channel());
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    for service in ["", "cairn.v1.CheckpointService", "cairn.v1.RunnerService"] {
        let answer = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap_or_else(|s| panic!("Check {service:?}: {s:?}"))
            .into_inner();
        assert_eq!(answer.status, serving, "{service:?}");
    }
    let mut watch = health
        .watch(HealthCheckRequest {
            service: "cairn.v1.WorkspaceService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(watch.next().await.unwrap().unwrap().status, serving);
}

#[tokio::test]
async fn an_unknown_token_is_permission_denied_on_every_service_but_health() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let forged = tokens::generate(Scope::Admin).text;
    for token in [forged.as_str(), "not-a-token"] {
        let mut stranger = server.client_with(Some(token)).await;
        for (service, result) in call_every_service(&mut stranger).await {
            if service == HEALTH {
                result.unwrap_or_else(|s| panic!("health ignores the token: {s:?}"));
                continue;
            }
            let status = result.expect_err(service);
            assert_eq!(
                status.code(),
                Code::PermissionDenied,
                "{service}: {}",
                status.message()
            );
            assert_eq!(
                Refusal::of(&status),
                None,
                "an unknown token is not valid, with no refusal: {service}"
            );
        }
    }
}

#[tokio::test]
async fn the_admin_token_reaches_every_service() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut admin = server.client().await;
    for (service, result) in call_every_service(&mut admin).await {
        result.unwrap_or_else(|s| panic!("{service}: {s:?}"));
    }
    let services = list_services(&mut admin).await.unwrap();
    let cairn_services = [
        "cairn.v1.WorkspaceService",
        "cairn.v1.CheckpointService",
        "cairn.v1.RunService",
        "cairn.v1.HostService",
        "cairn.v1.RunnerService",
        "cairn.v1.AdminService",
    ];
    for name in cairn_services.iter().chain(&["grpc.health.v1.Health"]) {
        assert!(
            services.iter().any(|s| s == name),
            "{name} missing from {services:?}"
        );
    }
    for service in cairn_services {
        let serving = HealthClient::new(admin.auth_channel())
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            serving.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service}"
        );
    }
}

#[tokio::test]
async fn created_tokens_carry_their_scope_and_nothing_more() {
    let dir = data_dir();
    let server = crate::fleet::start_patient(dir.path()).await;
    let mut admin = Clients::admin(&server).await;
    let create = |scope: &str| pb::CreateTokenRequest {
        scope: scope.into(),
        description: format!("test {scope}"),
        ..Default::default()
    };
    let client_token = admin
        .admin
        .create_token(create("client"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(client_token.scope, "client");
    assert!(client_token.token.starts_with("cairn_client_"));
    let host_token = admin
        .admin
        .create_token(create("host"))
        .await
        .unwrap()
        .into_inner()
        .token;
    assert!(host_token.starts_with("cairn_host_"));
    for scope in ["admin", "run", "root"] {
        let refused = admin.admin.create_token(create(scope)).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{scope}");
    }

    // A host token registers and heartbeats, and does nothing else.
    let mut host = FakeHost::register(&server, &host_token, "h", &[], 1).await;
    let mut as_host = Clients::connect(&server, &host_token).await;
    let denied = as_host.runs.create_run(run_request(&[])).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = as_host
        .runs
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = as_host
        .admin
        .list_hosts(pb::ListHostsRequest {})
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);

    // A client token drives runs but is no host and no admin.
    let mut client = Clients::connect(&server, &client_token.token).await;
    let mine = client.create_run(&[]).await;
    let other = client.create_run(&[]).await;
    let denied = HostServiceClient::new(server.channel(&client_token.token).await)
        .register_host(pb::RegisterHostRequest {
            slots: 1,
            driver: "local".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = client
        .admin
        .create_token(create("client"))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = RunnerServiceClient::new(server.channel(&client_token.token).await)
        .claim_attempt(pb::ClaimAttemptRequest {})
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);

    // A run token reads its own run, and no other.
    let assignment = host.beat_until_assigned(&mine.id).await;
    let mut as_run = Clients::connect(&server, &assignment.run_token).await;
    assert_eq!(as_run.get(&mine.id).await.id, mine.id);
    let denied = as_run
        .runs
        .get_run(pb::GetRunRequest {
            run_id: other.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert!(denied.message().contains(&other.id), "{}", denied.message());
    let denied = as_run
        .runs
        .watch_run_events(pb::WatchRunEventsRequest {
            run_id: other.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = as_run.answer(&mine.id, "me").await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = as_run.runs.create_run(run_request(&[])).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
}

#[tokio::test]
async fn a_run_token_reaches_only_its_own_workspace() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut admin = server.client().await;
    let own = create_workspace(&mut admin, "own").await;
    let other = create_workspace(&mut admin, "other").await;
    checkpoint(&mut admin, &other.id, b"other's work").await;

    // A run token bound to a workspace only (no run), recorded directly.
    let run_token = tokens::generate(Scope::Run);
    let db = MetadataStore::open(&crate::harness::test_location(dir.path()))
        .await
        .unwrap();
    db.ensure_token(
        &run_token.hash,
        &TenantId::default_tenant(),
        Scope::Run,
        Some(&own.id.parse().unwrap()),
        "test run",
    )
    .await
    .unwrap();
    db.close().await;

    let mut run = server.client_with(Some(&run_token.text)).await;
    let committed = checkpoint(&mut run, &own.id, b"own work").await;
    assert_eq!(committed.workspace_id, own.id);
    get_workspace(&mut run, "own").await;

    let denied = run
        .checkpoints
        .get_restore_manifest(pb::GetRestoreManifestRequest {
            workspace: other.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert!(denied.message().contains(&other.id), "{}", denied.message());
    let other_checkpoint = list_checkpoints(&mut admin, &other.id).await.remove(0);
    let denied = run
        .checkpoints
        .get_checkpoint(pb::GetCheckpointRequest {
            checkpoint_id: other_checkpoint.id,
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = run
        .workspaces
        .create_workspace(pb::CreateWorkspaceRequest::default())
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = run
        .workspaces
        .list_workspaces(pb::ListWorkspacesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
}

/// A client token of its own, created through AdminService.
pub(crate) async fn client_token(
    admin: &mut Clients,
    expires_in: Option<Duration>,
) -> pb::CreateTokenResponse {
    admin
        .admin
        .create_token(pb::CreateTokenRequest {
            scope: "client".into(),
            description: "lifecycle".into(),
            expires_in: expires_in.map(crate::fleet::duration),
        })
        .await
        .unwrap()
        .into_inner()
}

pub(crate) async fn list_workspaces(server: &TestServer, token: &str) -> Result<(), tonic::Status> {
    server
        .client_with(Some(token))
        .await
        .workspaces
        .list_workspaces(pb::ListWorkspacesRequest::default())
        .await
        .map(drop)
}

pub(crate) fn token_refusal(status: &tonic::Status) -> Option<TokenRefusal> {
    match Refusal::of(status) {
        Some(Refusal::Token(why)) => Some(why),
        _ => None,
    }
}

#[tokio::test]
async fn an_expired_token_is_refused_as_expired() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut admin = Clients::admin(&server).await;
    let short = client_token(&mut admin, Some(Duration::from_secs(1))).await;
    let long = client_token(&mut admin, Some(Duration::from_secs(3600))).await;
    let expires_at = cairn_proto::domain::from_timestamp(short.expires_at.as_ref().unwrap());
    assert!(expires_at > std::time::SystemTime::now() - Duration::from_secs(1));
    list_workspaces(&server, &short.token).await.unwrap();

    tokio::time::sleep(Duration::from_millis(1100)).await;
    let refused = list_workspaces(&server, &short.token).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert_eq!(
        token_refusal(&refused),
        Some(TokenRefusal::Expired),
        "{refused:?}"
    );
    list_workspaces(&server, &long.token).await.unwrap();

    let listed = admin.tokens().await;
    let short_listed = listed.iter().find(|t| t.id == short.id).unwrap();
    assert_eq!(short_listed.expires_at, short.expires_at);
    assert!(short_listed.revoked_at.is_none());
}

#[tokio::test]
async fn a_revoked_token_is_refused_at_once_and_listed_as_revoked() {
    let dir = data_dir();
    let server = crate::fleet::start_patient(dir.path()).await;
    let mut admin = Clients::admin(&server).await;
    let client = client_token(&mut admin, None).await;
    let other = client_token(&mut admin, None).await;
    assert!(
        client.expires_at.is_none(),
        "no --expires-in: never expires"
    );
    assert!(client.id.starts_with("tok-"), "{}", client.id);
    list_workspaces(&server, &client.token).await.unwrap();

    let revoked = admin
        .admin
        .revoke_token(pb::RevokeTokenRequest {
            id: client.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(revoked.id, client.id);
    assert!(revoked.revoked_at.is_some());
    let refused = list_workspaces(&server, &client.token).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert_eq!(
        token_refusal(&refused),
        Some(TokenRefusal::Revoked),
        "{refused:?}"
    );
    list_workspaces(&server, &other.token).await.unwrap();

    let listed = admin.tokens().await;
    let scopes: Vec<(&str, bool)> = listed
        .iter()
        .map(|t| (t.scope.as_str(), t.revoked_at.is_some()))
        .collect();
    assert!(scopes.contains(&("admin", false)), "{scopes:?}");
    assert_eq!(
        listed
            .iter()
            .find(|t| t.id == client.id)
            .map(|t| t.revoked_at.is_some()),
        Some(true)
    );

    // Unknown ids and the caller's own admin token are refused.
    let unknown = admin
        .admin
        .revoke_token(pb::RevokeTokenRequest {
            id: cairn_proto::ids::TokenId::generate().to_string(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    let admin_id = listed
        .iter()
        .find(|t| t.scope == "admin")
        .unwrap()
        .id
        .clone();
    let own = admin
        .admin
        .revoke_token(pb::RevokeTokenRequest { id: admin_id })
        .await
        .unwrap_err();
    assert_eq!(own.code(), Code::FailedPrecondition, "{own:?}");

    // A client token may neither list nor revoke tokens.
    let mut as_other = Clients::connect(&server, &other.token).await;
    let denied = as_other
        .admin
        .list_tokens(pb::ListTokensRequest {})
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = as_other
        .admin
        .revoke_token(pb::RevokeTokenRequest {
            id: other.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    list_workspaces(&server, &other.token).await.unwrap();
}
