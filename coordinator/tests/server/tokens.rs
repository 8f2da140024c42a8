//! Bearer tokens on every gRPC service, and scopes.

use cairn_coordinator::db::MetadataStore;
use cairn_coordinator::tokens::{self, Scope};
use cairn_proto::ids::TenantId;
use cairn_proto::pb;
use cairn_runner::client::Coordinator;
use tokio_stream::StreamExt;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

use crate::harness::*;

/// The status of one call to each service (`Ok` for success).
async fn call_every_service(
    client: &mut Coordinator,
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
async fn list_services(client: &mut Coordinator) -> Result<Vec<String>, tonic::Status> {
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

#[tokio::test]
async fn a_missing_token_is_unauthenticated_on_every_service() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut anonymous = server.client_with(None).await;
    for (service, result) in call_every_service(&mut anonymous).await {
        let status = result.expect_err(service);
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{service}: {}",
            status.message()
        );
    }
}

#[tokio::test]
async fn an_unknown_token_is_permission_denied_on_every_service() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let forged = tokens::generate(Scope::Admin).text;
    for token in [forged.as_str(), "not-a-token"] {
        let mut stranger = server.client_with(Some(token)).await;
        for (service, result) in call_every_service(&mut stranger).await {
            let status = result.expect_err(service);
            assert_eq!(
                status.code(),
                Code::PermissionDenied,
                "{service}: {}",
                status.message()
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
    for name in [
        "cairn.v1.WorkspaceService",
        "cairn.v1.CheckpointService",
        "grpc.health.v1.Health",
    ] {
        assert!(
            services.iter().any(|s| s == name),
            "{name} missing from {services:?}"
        );
    }
    let serving = HealthClient::new(admin.auth_channel())
        .check(HealthCheckRequest {
            service: "cairn.v1.WorkspaceService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        serving.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

#[tokio::test]
async fn a_run_token_reaches_only_its_own_workspace() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut admin = server.client().await;
    let own = create_workspace(&mut admin, "own").await;
    let other = create_workspace(&mut admin, "other").await;
    checkpoint(&mut admin, &other.id, b"other's work").await;

    // Run tokens are issued by the run service of a later issue; record one directly.
    let run_token = tokens::generate(Scope::Run);
    let db = MetadataStore::open(&dir.path().join("cairn.db"))
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
    run.workspaces
        .get_workspace(pb::GetWorkspaceRequest {
            workspace: "own".into(),
        })
        .await
        .unwrap();

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
