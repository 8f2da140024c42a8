//! Tokens: every service — cairn's own and reflection — refuses a request
//! without a token (UNAUTHENTICATED) or with an unknown one
//! (PERMISSION_DENIED); health answers either way; the admin token opens all
//! of them. The CLIs say so clearly and exit 1. A host enrolled with a host
//! token keeps the token bound to it and registers again with it after a
//! restart.

use std::os::unix::fs::PermissionsExt;

use cairn_e2e::fleet::{Fleet, HostOptions};
use cairn_e2e::{Coordinator, block_on, populate_small_workspace, run, tempdir};
use cairn_engine::client::CoordinatorClient as Api;
use cairn_proto::pb;
use cairn_proto::runs::RunState;
use tonic::{Code, Status};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

/// The one call answered without a valid token (a load balancer's probe).
const HEALTH: &str = "grpc.health.v1.Health/Check";

const WRONG_TOKEN: &str = "cairn_admin_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";

async fn health(api: &Api, service: &str) -> Result<i32, Status> {
    let response = HealthClient::new(api.auth_channel())
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await?;
    Ok(response.into_inner().status)
}

async fn reflected_services(api: &Api) -> Result<Vec<String>, Status> {
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = ServerReflectionClient::new(api.auth_channel())
        .server_reflection_info(tokio_stream::iter(vec![request]))
        .await?
        .into_inner();
    let response = stream
        .message()
        .await?
        .ok_or_else(|| Status::unknown("reflection sent no response"))?;
    match response.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            Ok(list.service.into_iter().map(|s| s.name).collect())
        }
        other => Err(Status::unknown(format!(
            "unexpected reflection response {other:?}"
        ))),
    }
}

/// One call of every service; `name` is the workspace CreateWorkspace would make.
async fn call_every_service(
    api: &mut Api,
    workspace: &str,
    name: &str,
) -> Vec<(&'static str, Result<(), Status>)> {
    let ws = || workspace.to_owned();
    vec![
        (
            "cairn.v1.WorkspaceService/ListWorkspaces",
            api.workspaces
                .list_workspaces(pb::ListWorkspacesRequest::default())
                .await
                .map(drop),
        ),
        (
            "cairn.v1.WorkspaceService/GetWorkspace",
            api.workspaces
                .get_workspace(pb::GetWorkspaceRequest { workspace: ws() })
                .await
                .map(drop),
        ),
        (
            "cairn.v1.WorkspaceService/CreateWorkspace",
            api.workspaces
                .create_workspace(pb::CreateWorkspaceRequest {
                    name: name.to_owned(),
                })
                .await
                .map(drop),
        ),
        (
            "cairn.v1.CheckpointService/BeginCheckpoint",
            api.checkpoints
                .begin_checkpoint(pb::BeginCheckpointRequest {
                    workspace: ws(),
                    generation: 0,
                })
                .await
                .map(drop),
        ),
        (
            "cairn.v1.CheckpointService/ListCheckpoints",
            api.checkpoints
                .list_checkpoints(pb::ListCheckpointsRequest {
                    workspace: ws(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "cairn.v1.CheckpointService/GetRestoreManifest",
            api.checkpoints
                .get_restore_manifest(pb::GetRestoreManifestRequest {
                    workspace: ws(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (HEALTH, health(api, "").await.map(drop)),
        (
            "grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            reflected_services(api).await.map(drop),
        ),
    ]
}

#[test]
fn every_service_refuses_missing_and_wrong_tokens_and_admits_the_admin() {
    let tmp = tempdir("tokens");
    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("tokens");
    let root = tmp.path().join("workspace");
    populate_small_workspace(&root, 4);
    coordinator.client().checkpoint(&root, &workspace);

    block_on(async {
        let mut anonymous = coordinator.connect(None).await;
        for (rpc, result) in
            call_every_service(&mut anonymous, &workspace, "made-without-token").await
        {
            if rpc == HEALTH {
                result.unwrap_or_else(|s| panic!("health answers without a token: {s:?}"));
                continue;
            }
            let status = result.expect_err(rpc);
            assert_eq!(
                status.code(),
                Code::Unauthenticated,
                "{rpc} without a token: {status:?}"
            );
        }
        let mut stranger = coordinator.connect(Some(WRONG_TOKEN)).await;
        for (rpc, result) in
            call_every_service(&mut stranger, &workspace, "made-with-wrong-token").await
        {
            if rpc == HEALTH {
                result.unwrap_or_else(|s| panic!("health ignores the token: {s:?}"));
                continue;
            }
            let status = result.expect_err(rpc);
            assert_eq!(
                status.code(),
                Code::PermissionDenied,
                "{rpc} with an unknown token: {status:?}"
            );
        }

        let mut admin = coordinator.admin().await;
        for (rpc, result) in call_every_service(&mut admin, &workspace, "made-by-admin").await {
            result.unwrap_or_else(|s| panic!("{rpc} with the admin token: {s:?}"));
        }
        assert_eq!(
            health(&admin, "").await.unwrap(),
            ServingStatus::Serving as i32
        );
        assert_eq!(
            health(&admin, "cairn.v1.CheckpointService").await.unwrap(),
            ServingStatus::Serving as i32
        );
        let services = reflected_services(&admin).await.unwrap();
        for service in ["cairn.v1.WorkspaceService", "cairn.v1.CheckpointService"] {
            assert!(
                services.iter().any(|s| s == service),
                "reflection does not list {service}: {services:?}"
            );
        }

        // The refused CreateWorkspace calls made nothing.
        let names: Vec<String> = admin
            .workspaces
            .list_workspaces(pb::ListWorkspacesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .workspaces
            .into_iter()
            .map(|w| w.name)
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(
            names.contains(&"tokens".to_owned()) && names.contains(&"made-by-admin".to_owned()),
            "{names:?}"
        );
    });
}

#[test]
fn the_clis_refuse_to_work_with_a_wrong_or_missing_token_and_say_why() {
    let tmp = tempdir("tokens-cli");
    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("tokens-cli");
    let root = tmp.path().join("workspace");
    populate_small_workspace(&root, 5);

    let wrong = coordinator.client_with_token(Some(WRONG_TOKEN));
    let missing = coordinator.client_with_token(None);
    for (client, words) in [
        (&wrong, ["permission", "denied"]),
        (&missing, ["unauthenticated", "token"]),
    ] {
        let listed = run(client.ctl().args(["workspace", "list"])).assert_exit(1);
        let stderr = listed.stderr.to_lowercase();
        assert!(stderr.contains("error:"), "{listed}");
        assert!(
            words.iter().any(|w| stderr.contains(w)),
            "cairnctl does not say the token was refused: {listed}"
        );
        assert!(
            !listed.stderr.contains(WRONG_TOKEN),
            "cairnctl printed the token: {listed}"
        );

        let checkpoint = run(client
            .runner()
            .arg("checkpoint")
            .arg("--root")
            .arg(&root)
            .args(["--workspace", &workspace]))
        .assert_exit(1);
        assert!(checkpoint.stderr.contains("error:"), "{checkpoint}");
        let restore = client
            .try_restore(&tmp.path().join("restored"), &workspace, &[])
            .assert_exit(1);
        assert!(restore.stderr.contains("error:"), "{restore}");
    }
    assert!(
        coordinator.list_checkpoints(&workspace).is_empty(),
        "a refused runner committed a checkpoint"
    );
}

#[test]
fn a_restarted_host_registers_again_with_the_token_bound_to_it() {
    let mut fleet = Fleet::start();
    let enrollment = fleet.create_token("host");
    fleet.start_host(
        "a",
        HostOptions {
            token: Some(enrollment.clone()),
            ..HostOptions::default()
        },
    );
    let host_id = fleet.host("a").id.clone();

    // The answer to the first registration is kept, private, in the data dir.
    let file = fleet.host("a").data_dir().join("host-credential.json");
    let kept: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(kept["host_id"], host_id.as_str());
    let bound = kept["token"].as_str().unwrap().to_owned();
    assert!(bound.starts_with("cairn_host_") && bound != enrollment);
    let mode = std::fs::metadata(&file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{}", file.display());
    let tokens = fleet.tokens();
    assert!(
        tokens
            .iter()
            .any(|t| t.scope == "host" && t.host_id == host_id),
        "the bound token is listed with its host: {tokens:?}"
    );

    let before =
        fleet.create_run(fleet.run_request("before", "commit before.txt before the restart"));
    let done = fleet.wait_for_state(&before.id, RunState::Succeeded);
    assert_eq!(done.attempts[0].host_id, host_id);

    // Stopped, its enrollment token revoked: only the kept credential can
    // register the host again.
    fleet.host_mut("a").stop();
    let enrollment_id = tokens
        .iter()
        .find(|t| t.scope == "host" && t.host_id.is_empty())
        .map(|t| t.id.clone())
        .expect("the enrollment token is listed");
    fleet.revoke_token(&enrollment_id);
    fleet.restart_host("a");
    assert_eq!(
        fleet.host_info("a").id,
        host_id,
        "the same host, not a new one"
    );

    let after = fleet.create_run(fleet.run_request("after", "commit after.txt after the restart"));
    let done = fleet.wait_for_state(&after.id, RunState::Succeeded);
    assert_eq!(done.attempts[0].host_id, host_id, "it keeps working");
    assert_eq!(fleet.list_hosts().len(), 1, "no second host was registered");
}
