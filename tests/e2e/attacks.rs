//! Attacks (issue 28) on the real coordinator binary, with raw gRPC and
//! each token scope: a run token trying to reach another workspace of its
//! tenant, a host token acting as another host, a signed URL of one pack
//! bent to another, a run token after its run was cancelled, and expired
//! and revoked tokens. Every one is refused with the right code and typed
//! reason, and the victim's checkpoint still restores exactly.
//!
//! The run token is got the way a hostile host gets one: by enrolling,
//! heartbeating and taking the assignment it is handed.

use std::time::{Duration, Instant};

use cairn_e2e::{
    Coordinator, assert_trees_equal, block_on, json_str, populate_small_workspace, tempdir,
};
use cairn_engine::client::CoordinatorClient as Api;
use cairn_proto::pb;
use cairn_proto::pb::host_service_client::HostServiceClient;
use cairn_proto::refusal::{NotCurrent, Refusal, TokenRefusal};
use tonic::Code;

async fn api(coordinator: &Coordinator, token: &str) -> Api {
    Api::connect(coordinator.grpc_url(), Some(token))
        .await
        .expect("the coordinator answers")
}

fn hosts(api: &Api) -> HostServiceClient<cairn_engine::client::AuthChannel> {
    HostServiceClient::new(api.auth_channel())
}

async fn register(
    api: &Api,
    name: &str,
    host_id: &str,
) -> Result<pb::RegisterHostResponse, tonic::Status> {
    hosts(api)
        .register_host(pb::RegisterHostRequest {
            name: name.into(),
            slots: 1,
            driver: "local".into(),
            host_id: host_id.into(),
            ..Default::default()
        })
        .await
        .map(tonic::Response::into_inner)
}

async fn heartbeat(
    api: &Api,
    host_id: &str,
    sandboxes: Vec<pb::SandboxReport>,
) -> Result<pb::HeartbeatResponse, tonic::Status> {
    hosts(api)
        .heartbeat(pb::HeartbeatRequest {
            host_id: host_id.into(),
            sandboxes,
            ..Default::default()
        })
        .await
        .map(tonic::Response::into_inner)
}

#[test]
fn every_attack_of_a_sandbox_or_host_is_refused_and_damages_nothing() {
    let tmp = tempdir("attacks");
    let coordinator = Coordinator::start_with(&["--heartbeat-interval", "200ms"]);
    let admin = coordinator.client();

    // The victim: a workspace with a real checkpoint.
    let victim_root = tmp.path().join("victim");
    populate_small_workspace(&victim_root, 11);
    let victim = coordinator.create_workspace("victim");
    admin.checkpoint(&victim_root, &victim);

    // The attacker: a hostile host that gets a run of another workspace.
    let enrollment = json_str(
        &admin.ctl_json(&["tokens", "create", "--scope", "host"]),
        "token",
    )
    .to_owned();
    let run = admin.ctl_json(&[
        "runs",
        "create",
        "--new-workspace",
        "--name",
        "attacker",
        "--harness",
        "claude",
        "--prompt",
        "innocent",
    ]);
    let run_id = json_str(&run, "id").to_owned();

    block_on(async {
        let admin_api = api(&coordinator, coordinator.admin_token()).await;
        let enrolled = api(&coordinator, &enrollment).await;
        let registered = register(&enrolled, "hostile", "").await.unwrap();
        let host_id = registered.host_id.clone();
        let bound = api(&coordinator, &registered.host_token).await;

        // A host token acts only as its host.
        let other = register(&admin_api, "other", "").await.unwrap();
        let status = heartbeat(&bound, &other.host_id, vec![]).await.unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{status}");
        assert!(
            matches!(Refusal::of(&status), Some(Refusal::WrongHost { .. })),
            "{status}"
        );
        let status = register(&bound, "other-again", &other.host_id)
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{status}");
        let status = register(&enrolled, "taken-over", &host_id)
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            Code::PermissionDenied,
            "an enrollment token: {status}"
        );

        // The assignment hands the hostile host a run token.
        let deadline = Instant::now() + Duration::from_secs(20);
        let assignment = loop {
            let beat = heartbeat(&bound, &host_id, vec![]).await.unwrap();
            if let Some(a) = beat.assignments.into_iter().find(|a| a.run_id == run_id) {
                break a;
            }
            assert!(Instant::now() < deadline, "the run was never assigned");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let run_token = api(&coordinator, &assignment.run_token).await;
        let own_workspace = assignment.workspace_id.clone();

        // The victim's keys, packs and URLs, as only its own tokens get them.
        let victim_manifest = admin_api
            .checkpoints
            .clone()
            .get_restore_manifest(pb::GetRestoreManifestRequest {
                workspace: victim.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let victim_key = victim_manifest.keys[0].secret.clone();
        let victim_packs: Vec<String> = victim_manifest
            .packs
            .iter()
            .map(|p| p.pack_id.clone())
            .collect();

        // A run token reaches no other workspace.
        let mut checkpoints = run_token.checkpoints.clone();
        {
            let workspace = &victim;
            let status = checkpoints
                .begin_checkpoint(pb::BeginCheckpointRequest {
                    workspace: workspace.to_string(),
                    generation: 0,
                })
                .await
                .unwrap_err();
            assert_eq!(status.code(), Code::PermissionDenied, "{status}");
            let status = checkpoints
                .get_restore_manifest(pb::GetRestoreManifestRequest {
                    workspace: workspace.to_string(),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(status.code(), Code::PermissionDenied, "{status}");
        }

        // Its own workspace's key is not the victim's, and the victim's
        // blob ids (the strongest attacker knows them) are not found.
        let begun = checkpoints
            .begin_checkpoint(pb::BeginCheckpointRequest {
                workspace: own_workspace.clone(),
                generation: 0,
            })
            .await
            .unwrap()
            .into_inner();
        assert_ne!(begun.key.as_ref().unwrap().secret, victim_key);
        let victim_keys = cairn_engine::format::TenantKeys::derive("k1", &victim_key).unwrap();
        let guessed = victim_keys.blob_id(b"# small workspace 11\n");
        let found = checkpoints
            .find_missing_blobs(pb::FindMissingBlobsRequest {
                workspace: own_workspace.clone(),
                blob_ids: vec![guessed.as_bytes().to_vec()],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            found.locations,
            [0],
            "another workspace's blob is not found"
        );
        let in_victim = admin_api
            .checkpoints
            .clone()
            .find_missing_blobs(pb::FindMissingBlobsRequest {
                workspace: victim.clone(),
                blob_ids: vec![guessed.as_bytes().to_vec()],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            in_victim.locations,
            [1],
            "the guess is right: the victim holds it"
        );

        // Committing a checkpoint that references the victim's packs.
        let status = checkpoints
            .commit_checkpoint(pb::CommitCheckpointRequest {
                workspace: own_workspace.clone(),
                generation: begun.generation,
                reason: pb::CheckpointReason::Manual as i32,
                format_version: cairn_engine::format::FORMAT_VERSION,
                root_tree: guessed.as_bytes().to_vec(),
                referenced_packs: victim_packs.clone(),
                stats: Some(pb::CheckpointStats::default()),
                key_id: begun.key.as_ref().unwrap().key_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition, "{status}");
        assert!(
            matches!(Refusal::of(&status), Some(Refusal::PacksMissing { .. })),
            "{status}"
        );

        // A signed URL of one pack bent to another is refused.
        cairn_engine::transfer::install_crypto_provider();
        let http = reqwest::Client::new();
        let url = &victim_manifest.packs[0].url;
        let ok = http.get(url).send().await.unwrap();
        assert_eq!(ok.status(), 200);
        assert!(victim_packs.len() >= 2, "{victim_packs:?}");
        let bent = url.replace(&victim_packs[0], &victim_packs[1]);
        let refused = http.get(&bent).send().await.unwrap();
        assert_eq!(
            refused.status(),
            403,
            "a URL opens only the object it was signed for"
        );

        // Cancelled, and its sandbox reported gone: the run token is dead.
        pb::run_service_client::RunServiceClient::new(admin_api.auth_channel())
            .cancel_run(pb::CancelRunRequest {
                run_id: run_id.clone(),
                reason: "attack over".into(),
            })
            .await
            .unwrap();
        heartbeat(
            &bound,
            &host_id,
            vec![pb::SandboxReport {
                sandbox_id: assignment.sandbox_id.clone(),
                run_id: run_id.clone(),
                attempt: assignment.attempt,
                state: pb::SandboxState::Destroyed as i32,
                ..Default::default()
            }],
        )
        .await
        .unwrap();
        let status = checkpoints
            .begin_checkpoint(pb::BeginCheckpointRequest {
                workspace: own_workspace.clone(),
                generation: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{status}");
        assert!(
            matches!(
                Refusal::of(&status),
                Some(Refusal::AttemptNotCurrent {
                    why: NotCurrent::Cancelled,
                    ..
                })
            ),
            "{status}"
        );
    });

    // Expired and revoked tokens are refused at once, saying which.
    let short = admin.ctl_json(&[
        "tokens",
        "create",
        "--scope",
        "client",
        "--expires-in",
        "1s",
    ]);
    let revoked = admin.ctl_json(&["tokens", "create", "--scope", "client"]);
    admin.ctl_json(&["tokens", "revoke", json_str(&revoked, "id")]);
    std::thread::sleep(Duration::from_millis(1100));
    block_on(async {
        for (token, why) in [
            (json_str(&short, "token"), TokenRefusal::Expired),
            (json_str(&revoked, "token"), TokenRefusal::Revoked),
        ] {
            let client = api(&coordinator, token).await;
            let status = client
                .workspaces
                .clone()
                .list_workspaces(pb::ListWorkspacesRequest::default())
                .await
                .unwrap_err();
            assert_eq!(status.code(), Code::PermissionDenied, "{status}");
            assert_eq!(Refusal::of(&status), Some(Refusal::Token(why)), "{status}");
        }
    });

    // Nothing of the victim's was damaged: its checkpoint restores exactly.
    let restored = tmp.path().join("restored");
    coordinator.client().restore(&restored, &victim);
    assert_trees_equal(&victim_root, &restored);
}
