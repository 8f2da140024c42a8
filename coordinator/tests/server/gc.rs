//! Retention, deletion and garbage collection against a real server: what
//! goes and when, what stays, and commits racing a sweep (forced with
//! async failpoints, both orders).

use std::time::Duration;

use cairn_coordinator::clock::Clock;
use cairn_coordinator::gc::{FAILPOINT_AFTER_MARK, FAILPOINT_BEFORE_STORE_DELETES};
use cairn_coordinator::grpc::FAILPOINT_COMMIT_BEFORE_TRANSACTION;
use cairn_engine::client::CoordinatorClient;
use cairn_engine::format::FinishedPack;
use cairn_proto::domain::PackKind;
use cairn_proto::pb;
use cairn_proto::pb::admin_service_client::AdminServiceClient;
use cairn_proto::refusal::Refusal;
use cairn_utils::failpoint;

use super::harness::*;

const DAY: Duration = Duration::from_secs(24 * 3600);
/// Past the default grace (2h).
const PAST_GRACE: Duration = Duration::from_secs(3 * 3600);

/// A server whose clock the test moves and whose collector runs only when
/// asked.
async fn server(clock: &Clock) -> TestServer {
    let dir = data_dir();
    let clock = clock.clone();
    let mut server = TestServer::start_with(dir.path(), move |config| {
        config.clock = clock;
        config.gc.interval = None;
    })
    .await;
    server.own_dir(dir);
    server
}

async fn gc(client: &CoordinatorClient, dry_run: bool) -> pb::GcReport {
    AdminServiceClient::new(client.auth_channel())
        .collect_garbage(pb::CollectGarbageRequest { dry_run })
        .await
        .unwrap()
        .into_inner()
}

async fn keep_last(client: &mut CoordinatorClient, workspace: &str, n: u32) {
    client
        .workspaces
        .set_retention(pb::SetRetentionRequest {
            workspace: workspace.into(),
            keep_last: Some(n),
            finished_expiry: None,
        })
        .await
        .unwrap();
}

/// A checkpoint of `contents` whose packs are returned (uploaded, committed).
async fn checkpoint_with_packs(
    client: &mut CoordinatorClient,
    workspace: &str,
    contents: &[u8],
) -> (pb::Checkpoint, FinishedPack<Vec<u8>>, FinishedPack<Vec<u8>>) {
    let begin = begin(client, workspace).await;
    let keys = keys_of(&begin);
    let meta = build_pack(&keys, PackKind::Meta, &[&[b"tree of ", contents].concat()]);
    let data = build_pack(&keys, PackKind::Data, &[contents]);
    upload(client, workspace, &[&meta, &data]).await;
    let both = [&meta, &data];
    let made = commit(client, commit_request(&begin, &meta, &both, &both)).await;
    (made, meta, data)
}

fn refusal(status: &tonic::Status) -> Refusal {
    Refusal::of(status).unwrap_or_else(|| panic!("no typed refusal in {status:?}"))
}

fn object_exists(server: &TestServer, pack: &FinishedPack<Vec<u8>>) -> bool {
    server
        .object_file(&format!(
            "packs/default/{}/{}",
            &pack.id.as_str()[..2],
            pack.id
        ))
        .is_file()
}

/// A workspace with keep-last 1 and two checkpoints: the first's packs are
/// referenced by nothing once retention ran, condemned, and past the grace.
/// Returns the workspace id and the first checkpoint's packs.
async fn condemned_past_grace(
    server: &TestServer,
    clock: &Clock,
) -> (String, FinishedPack<Vec<u8>>, FinishedPack<Vec<u8>>) {
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await.id;
    keep_last(&mut client, &ws, 1).await;
    let (_, meta, data) = checkpoint_with_packs(&mut client, &ws, b"first state").await;
    checkpoint_with_packs(&mut client, &ws, b"second state").await;
    let report = gc(&client, false).await;
    assert_eq!(report.checkpoints_deleted, 1);
    assert_eq!(report.packs_condemned, 2, "{report:?}");
    assert_eq!(
        report.packs_swept, 0,
        "condemned now, swept after the grace"
    );
    assert!(object_exists(server, &data));
    clock.advance(PAST_GRACE);
    (ws, meta, data)
}

#[tokio::test]
async fn retention_keeps_the_last_n_and_gc_frees_the_rest_after_the_grace() {
    let clock = Clock::system();
    let server = server(&clock).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "churn").await.id;
    keep_last(&mut client, &ws, 3).await;
    let mut made = Vec::new();
    for turn in 0..20u32 {
        let contents = format!("state after turn {turn}").repeat(50);
        made.push(checkpoint_with_packs(&mut client, &ws, contents.as_bytes()).await);
    }
    // An older one pinned stays as well.
    let pinned = &made[4].0;
    client
        .checkpoints
        .pin_checkpoint(pb::PinCheckpointRequest {
            checkpoint_id: pinned.id.clone(),
            reason: "replay".into(),
            until: None,
        })
        .await
        .unwrap();
    let listed = list_checkpoints(&mut client, &ws).await;
    let doomed = listed
        .iter()
        .filter(|c| c.retention.as_ref().unwrap().kept_by.is_empty())
        .count();
    assert_eq!(doomed, 16, "20 - last 3 - 1 pinned");

    let dry = gc(&client, true).await;
    assert!(dry.dry_run);
    assert_eq!(dry.checkpoints_deleted, 16);
    assert_eq!(dry.packs_condemned, 32);
    assert_eq!(
        list_checkpoints(&mut client, &ws).await.len(),
        20,
        "a dry run changes nothing"
    );

    let report = gc(&client, false).await;
    assert_eq!(report.checkpoints_deleted, 16);
    assert_eq!(report.packs_condemned, 32);
    let left: Vec<u64> = list_checkpoints(&mut client, &ws)
        .await
        .iter()
        .map(|c| c.sequence)
        .collect();
    assert_eq!(left, [20, 19, 18, 5]);
    // Nothing is freed before the grace: URLs handed out may still be used.
    assert!(
        made.iter()
            .all(|(_, m, d)| object_exists(&server, m) && object_exists(&server, d))
    );

    clock.advance(PAST_GRACE);
    let report = gc(&client, false).await;
    assert_eq!(report.packs_swept, 32);
    assert!(report.bytes_swept > 0);
    for (index, (checkpoint, meta, data)) in made.iter().enumerate() {
        let kept = [4, 17, 18, 19].contains(&index);
        assert_eq!(object_exists(&server, meta), kept, "{}", checkpoint.id);
        assert_eq!(object_exists(&server, data), kept, "{}", checkpoint.id);
    }
    // What is kept still has its manifest: every pack signed and fetchable.
    let http = reqwest::Client::new();
    for id in [&made[4].0.id, &made[19].0.id] {
        let manifest = manifest(&mut client, &ws, id).await;
        assert_eq!(manifest.packs.len(), 2);
        for pack in &manifest.packs {
            let got = http.get(&pack.url).send().await.unwrap();
            assert_eq!(got.status(), 200);
        }
    }
    let storage = AdminServiceClient::new(client.auth_channel())
        .get_storage(pb::GetStorageRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(storage.packs, 8, "the live set: 4 checkpoints × 2 packs");
    assert_eq!(storage.checkpoints, 4);
}

#[tokio::test]
async fn the_newest_checkpoint_is_never_deleted() {
    let clock = Clock::system();
    let server = server(&clock).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await.id;
    keep_last(&mut client, &ws, 1).await;
    let (newest, meta, data) = checkpoint_with_packs(&mut client, &ws, b"only").await;
    clock.advance(365 * DAY);
    gc(&client, false).await;
    clock.advance(PAST_GRACE);
    let report = gc(&client, false).await;
    assert_eq!(report.checkpoints_deleted, 0);
    assert_eq!(report.packs_swept, 0);
    let listed = list_checkpoints(&mut client, &ws).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, newest.id);
    let kept_by = &listed[0].retention.as_ref().unwrap().kept_by;
    assert!(matches!(
        kept_by[0].reason,
        Some(pb::keep_reason::Reason::Newest(_))
    ));
    assert!(object_exists(&server, &meta) && object_exists(&server, &data));
}

#[tokio::test]
async fn a_commit_deduplicating_against_a_pack_being_swept_is_told_to_upload_it_again() {
    let clock = Clock::system();
    let server = server(&clock).await;
    let (ws, meta, data) = condemned_past_grace(&server, &clock).await;
    let mut client = server.client().await;

    // The sweep has removed the pack's records and not yet its object.
    failpoint::pause(FAILPOINT_BEFORE_STORE_DELETES);
    let sweeping = tokio::spawn({
        let client = client.clone();
        async move { gc(&client, false).await }
    });
    failpoint::reached(FAILPOINT_BEFORE_STORE_DELETES).await;
    assert!(object_exists(&server, &data), "the object is still there");

    // A runner that learnt earlier that its blob is in `data` references it.
    let begun = begin(&mut client, &ws).await;
    let keys = keys_of(&begun);
    let root = build_pack(&keys, PackKind::Meta, &[b"tree of the third state"]);
    upload(&mut client, &ws, &[&root]).await;
    let refused = commit_err(
        &mut client,
        commit_request(&begun, &root, &[&root], &[&root, &data]),
    )
    .await;
    assert_eq!(
        refusal(&refused),
        Refusal::PacksMissing {
            packs: vec![data.id.clone()]
        },
        "{refused:?}"
    );
    // Uploading it again while its deletion is under way is refused too:
    // the sweep is about to delete that very object.
    upload(&mut client, &ws, &[&data]).await;
    let refused = commit_err(
        &mut client,
        commit_request(&begun, &root, &[&root, &data], &[&root, &data]),
    )
    .await;
    assert_eq!(
        refusal(&refused),
        Refusal::PacksMissing {
            packs: vec![data.id.clone()]
        }
    );

    failpoint::release(FAILPOINT_BEFORE_STORE_DELETES);
    let report = sweeping.await.unwrap();
    assert_eq!(report.packs_swept, 2);
    assert!(!object_exists(&server, &data) && !object_exists(&server, &meta));

    // Told to upload again, the runner does, and the commit goes through.
    // (Its root pack too: with the clock moved past the grace, an upload
    // that waited this long counts as abandoned.)
    upload(&mut client, &ws, &[&root, &data]).await;
    let made = commit(
        &mut client,
        commit_request(&begun, &root, &[&root, &data], &[&root, &data]),
    )
    .await;
    let manifest = manifest(&mut client, &ws, &made.id).await;
    let http = reqwest::Client::new();
    for pack in &manifest.packs {
        assert_eq!(http.get(&pack.url).send().await.unwrap().status(), 200);
    }
}

#[tokio::test]
async fn a_commit_that_lands_before_the_sweep_keeps_the_pack_alive() {
    let clock = Clock::system();
    let server = server(&clock).await;
    let (ws, _meta, data) = condemned_past_grace(&server, &clock).await;
    let mut client = server.client().await;

    // The cycle has marked (the pack is still condemned) and not swept.
    failpoint::pause(FAILPOINT_AFTER_MARK);
    let sweeping = tokio::spawn({
        let client = client.clone();
        async move { gc(&client, false).await }
    });
    failpoint::reached(FAILPOINT_AFTER_MARK).await;

    let begun = begin(&mut client, &ws).await;
    let keys = keys_of(&begun);
    let root = build_pack(&keys, PackKind::Meta, &[b"tree that reuses the first data"]);
    upload(&mut client, &ws, &[&root]).await;
    let made = commit(
        &mut client,
        commit_request(&begun, &root, &[&root], &[&root, &data]),
    )
    .await;

    failpoint::release(FAILPOINT_AFTER_MARK);
    let report = sweeping.await.unwrap();
    assert_eq!(
        report.packs_swept, 1,
        "only the first meta pack: {report:?}"
    );
    assert!(object_exists(&server, &data), "referenced again: kept");
    let manifest = manifest(&mut client, &ws, &made.id).await;
    let http = reqwest::Client::new();
    for pack in &manifest.packs {
        assert_eq!(http.get(&pack.url).send().await.unwrap().status(), 200);
    }
    // Later cycles keep it too.
    clock.advance(PAST_GRACE);
    assert_eq!(gc(&client, false).await.packs_swept, 0);
    assert!(object_exists(&server, &data));
}

#[tokio::test]
async fn a_commit_held_between_its_store_check_and_its_transaction_loses_to_the_sweep() {
    let clock = Clock::system();
    let server = server(&clock).await;
    let (ws, _meta, data) = condemned_past_grace(&server, &clock).await;
    let mut client = server.client().await;

    let begun = begin(&mut client, &ws).await;
    let keys = keys_of(&begun);
    let root = build_pack(&keys, PackKind::Meta, &[b"tree of a slow commit"]);
    upload(&mut client, &ws, &[&root]).await;
    // The commit found `data` in the store and in its workspace's scope…
    failpoint::pause(FAILPOINT_COMMIT_BEFORE_TRANSACTION);
    let committing = tokio::spawn({
        let mut client = client.clone();
        let request = commit_request(&begun, &root, &[&root], &[&root, &data]);
        async move { client.checkpoints.commit_checkpoint(request).await }
    });
    failpoint::reached(FAILPOINT_COMMIT_BEFORE_TRANSACTION).await;
    // …then a whole cycle deletes it…
    let report = gc(&client, false).await;
    assert_eq!(report.packs_swept, 2);
    assert!(!object_exists(&server, &data));
    // …and the commit's transaction finds it gone: refused, nothing recorded.
    failpoint::release(FAILPOINT_COMMIT_BEFORE_TRANSACTION);
    let refused = committing.await.unwrap().unwrap_err();
    assert_eq!(
        refusal(&refused),
        Refusal::PacksMissing {
            packs: vec![data.id.clone()]
        }
    );
    assert_eq!(list_checkpoints(&mut client, &ws).await.len(), 1);
}

#[tokio::test]
async fn uploads_never_committed_go_after_the_grace_and_not_before() {
    let clock = Clock::system();
    let server = server(&clock).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await.id;
    let begun = begin(&mut client, &ws).await;
    let keys = keys_of(&begun);
    let abandoned = build_pack(
        &keys,
        PackKind::Data,
        &[b"a checkpoint that never committed"],
    );
    upload(&mut client, &ws, &[&abandoned]).await;

    let report = gc(&client, false).await;
    assert_eq!(
        report.orphans_swept, 0,
        "young uploads may still be committed"
    );
    assert!(object_exists(&server, &abandoned));

    clock.advance(PAST_GRACE);
    let dry = gc(&client, true).await;
    assert_eq!(dry.orphans_swept, 1);
    assert!(object_exists(&server, &abandoned));
    let report = gc(&client, false).await;
    assert_eq!(report.orphans_swept, 1);
    assert_eq!(report.orphan_bytes_swept, abandoned.size);
    assert!(!object_exists(&server, &abandoned));
}

#[tokio::test]
async fn a_finished_workspace_refuses_runs_and_expires_after_its_retention() {
    let clock = Clock::system();
    let server = server(&clock).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "done").await.id;
    let (_, meta, data) = checkpoint_with_packs(&mut client, &ws, b"final state").await;

    // A run that has not ended holds it open.
    let mut runs =
        cairn_proto::pb::run_service_client::RunServiceClient::new(client.auth_channel());
    let run = runs
        .create_run(pb::CreateRunRequest {
            target: Some(pb::create_run_request::Target::Workspace(ws.clone())),
            prompt: "one more thing".into(),
            harness: Some(pb::HarnessSpec {
                name: "claude".into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let held = client
        .workspaces
        .finish_workspace(pb::FinishWorkspaceRequest {
            workspace: ws.clone(),
        })
        .await
        .unwrap_err();
    let Refusal::WorkspaceHasRuns { runs: holding, .. } = refusal(&held) else {
        panic!("{held:?}");
    };
    assert_eq!(
        holding.iter().map(|r| r.to_string()).collect::<Vec<_>>(),
        std::slice::from_ref(&run.id)
    );
    runs.cancel_run(pb::CancelRunRequest {
        run_id: run.id.clone(),
        reason: "done".into(),
    })
    .await
    .unwrap();

    let finished = client
        .workspaces
        .finish_workspace(pb::FinishWorkspaceRequest {
            workspace: ws.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(finished.state(), pb::WorkspaceState::Finished);
    let expires = cairn_proto::domain::from_timestamp(finished.expires_at.as_ref().unwrap());
    let finished_at = cairn_proto::domain::from_timestamp(finished.finished_at.as_ref().unwrap());
    assert_eq!(expires.duration_since(finished_at).unwrap(), 7 * DAY);

    // New runs are refused with the typed reason.
    let refused = runs
        .create_run(pb::CreateRunRequest {
            target: Some(pb::create_run_request::Target::Workspace(ws.clone())),
            prompt: "again".into(),
            harness: Some(pb::HarnessSpec {
                name: "claude".into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(refusal(&refused), Refusal::WorkspaceNotActive { state, .. } if state == cairn_proto::domain::WorkspaceState::Finished),
        "{refused:?}"
    );

    clock.advance(6 * DAY);
    assert_eq!(gc(&client, false).await.workspaces_expired, 0);
    assert_eq!(list_checkpoints(&mut client, &ws).await.len(), 1);
    clock.advance(DAY + Duration::from_secs(60));
    let report = gc(&client, false).await;
    assert_eq!(report.workspaces_expired, 1);
    assert_eq!(report.checkpoints_deleted, 1);
    let gone = get_workspace(&mut client, &ws).await;
    assert_eq!(gone.state(), pb::WorkspaceState::Deleted);
    assert_eq!(gone.checkpoint_count, 0);
    clock.advance(PAST_GRACE);
    assert_eq!(gc(&client, false).await.packs_swept, 2);
    assert!(!object_exists(&server, &meta) && !object_exists(&server, &data));
}

#[tokio::test]
async fn deleting_a_workspace_goes_at_once_and_its_forks_keep_what_they_share() {
    let clock = Clock::system();
    let server = server(&clock).await;
    let mut client = server.client().await;
    let source = create_workspace(&mut client, "source").await.id;
    let (_, shared_meta, shared_data) =
        checkpoint_with_packs(&mut client, &source, b"the state forks start from").await;
    let forks = client
        .workspaces
        .fork_workspace(pb::ForkWorkspaceRequest {
            workspace: source.clone(),
            count: 3,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .workspaces;
    assert_eq!(forks.len(), 3);
    // The source moves on alone.
    let (_, own_meta, own_data) =
        checkpoint_with_packs(&mut client, &source, b"only the source has this").await;

    let before = get_workspace(&mut client, &source).await.storage.unwrap();
    assert_eq!(before.unique_bytes, own_meta.size + own_data.size);
    assert_eq!(before.shared_bytes, shared_meta.size + shared_data.size);

    let deleted = client
        .workspaces
        .delete_workspace(pb::DeleteWorkspaceRequest {
            workspace: source.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(deleted.state(), pb::WorkspaceState::Deleted);
    assert!(list_checkpoints(&mut client, &source).await.is_empty());
    // Its name is free again.
    create_workspace(&mut client, "source").await;
    // Nothing more can be written to it.
    let refused = client
        .checkpoints
        .begin_checkpoint(pb::BeginCheckpointRequest {
            workspace: source.clone(),
            generation: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );

    clock.advance(PAST_GRACE);
    let report = gc(&client, false).await;
    assert_eq!(report.packs_swept, 2, "only what the source alone had");
    assert!(!object_exists(&server, &own_meta) && !object_exists(&server, &own_data));
    assert!(object_exists(&server, &shared_meta) && object_exists(&server, &shared_data));
    let http = reqwest::Client::new();
    for fork in &forks {
        let storage = get_workspace(&mut client, &fork.id).await.storage.unwrap();
        assert_eq!(storage.referenced_packs, 2);
        let manifest = manifest(&mut client, &fork.id, "").await;
        assert_eq!(manifest.packs.len(), 2);
        for pack in &manifest.packs {
            assert_eq!(http.get(&pack.url).send().await.unwrap().status(), 200);
        }
    }
}

#[tokio::test]
async fn the_grace_must_outlive_every_signed_url() {
    let dir = data_dir();
    let mut config = cairn_coordinator::ServerConfig::new(dir.path());
    config.gc.grace = config.limits.url_ttl;
    let refused = cairn_coordinator::Coordinator::open(config)
        .await
        .unwrap_err();
    assert!(
        matches!(refused, cairn_coordinator::ServeError::GraceTooShort { .. }),
        "{refused}"
    );
    assert!(refused.to_string().contains("longer than signed URLs live"));
}

#[tokio::test]
async fn compaction_moves_only_the_walked_checkpoints_and_takes_no_stray_blob() {
    let clock = Clock::system();
    let server = server(&clock).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await.id;
    let begun = begin(&mut client, &ws).await;
    let keys = keys_of(&begun);
    let root = build_pack(&keys, PackKind::Meta, &[b"tree"]);
    let old = build_pack(&keys, PackKind::Data, &[b"live", b"dead"]);
    upload(&mut client, &ws, &[&root, &old]).await;
    let walked = commit(
        &mut client,
        commit_request(&begun, &root, &[&root, &old], &[&root, &old]),
    )
    .await;
    // Committed after the compactor walked: it keeps the old pack.
    let begun = begin(&mut client, &ws).await;
    let later = commit(
        &mut client,
        commit_request(&begun, &root, &[], &[&root, &old]),
    )
    .await;

    let compaction = |new: &FinishedPack<Vec<u8>>| pb::CompactPacksRequest {
        workspace: ws.clone(),
        new_packs: vec![new_pack(new)],
        replacements: vec![pb::PackReplacement {
            old_pack_id: old.id.to_string(),
            new_pack_ids: vec![new.id.to_string()],
        }],
        checkpoint_ids: vec![walked.id.clone()],
    };
    let stray = build_pack(&keys, PackKind::Data, &[b"live", b"smuggled"]);
    upload(&mut client, &ws, &[&stray]).await;
    let refused = client
        .checkpoints
        .compact_packs(compaction(&stray))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("none of the packs it replaces"));

    let compacted = build_pack(&keys, PackKind::Data, &[b"live"]);
    upload(&mut client, &ws, &[&compacted]).await;
    let answer = client
        .checkpoints
        .compact_packs(compaction(&compacted))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.checkpoints_updated, 1);
    let packs_of = |manifest: pb::RestoreManifest| {
        let mut ids: Vec<String> = manifest.candidates[0].packs.clone();
        ids.sort();
        ids
    };
    let mut expected_walked = vec![root.id.to_string(), compacted.id.to_string()];
    expected_walked.sort();
    assert_eq!(
        packs_of(manifest(&mut client, &ws, &walked.id).await),
        expected_walked
    );
    let mut expected_later = vec![root.id.to_string(), old.id.to_string()];
    expected_later.sort();
    assert_eq!(
        packs_of(manifest(&mut client, &ws, &later.id).await),
        expected_later
    );

    // New commits no longer reference the replaced pack: told it is
    // missing, they find its live blob in the new one.
    let begun = begin(&mut client, &ws).await;
    let refused = commit_err(
        &mut client,
        commit_request(&begun, &root, &[], &[&root, &old]),
    )
    .await;
    assert_eq!(
        refusal(&refused),
        Refusal::PacksMissing {
            packs: vec![old.id.clone()]
        }
    );
    let found = client
        .checkpoints
        .find_missing_blobs(pb::FindMissingBlobsRequest {
            workspace: ws.clone(),
            blob_ids: vec![compacted.blob_ids[0].as_bytes().to_vec()],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(found.packs, [compacted.id.to_string()], "{found:?}");
    assert_eq!(found.locations, [1]);

    // The later checkpoint keeps the old pack alive through any collection.
    gc(&client, false).await;
    clock.advance(PAST_GRACE);
    gc(&client, false).await;
    assert!(object_exists(&server, &old) && object_exists(&server, &compacted));
}
