//! The checkpoint protocol: begin, find, upload, commit, list, restore manifest.

use std::path::Path;

use cairn_coordinator::store::{ObjectKey, StoreOp};
use cairn_engine::client::CoordinatorClient;
use cairn_proto::domain::PackKind;
use cairn_proto::ids::{Generation, PackId, TenantId};
use cairn_proto::pb;
use cairn_proto::refusal::Refusal;
use tonic::Code;

use crate::harness::*;

/// Moves a workspace to its next generation, as a new attempt of a run would.
pub(crate) async fn bump_generation(data_dir: &Path, workspace: &str) {
    sqlx::any::install_default_drivers();
    let location = crate::harness::test_location(data_dir);
    let pool = sqlx::AnyPool::connect(&location.sqlx_url()).await.unwrap();
    sqlx::query("UPDATE workspaces SET generation = generation + 1 WHERE id = $1")
        .bind(workspace)
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
}

async fn find_missing(
    client: &mut CoordinatorClient,
    request: pb::FindMissingBlobsRequest,
) -> Result<pb::FindMissingBlobsResponse, tonic::Status> {
    client
        .checkpoints
        .find_missing_blobs(request)
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test]
async fn the_checkpoint_protocol_round_trips() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "round-trip").await;

    let first_begin = begin(&mut client, "round-trip").await;
    assert_eq!(first_begin.workspace_id, ws.id);
    assert_eq!(first_begin.tenant, "default");
    assert_eq!(first_begin.generation, ws.generation);
    assert_eq!(first_begin.parent_checkpoint_id, "");
    assert!(first_begin.max_find_batch >= 1000);
    let key = first_begin.key.clone().unwrap();
    assert_eq!((key.key_id.as_str(), key.secret.len()), ("k1", 32));

    let keys = keys_of(&first_begin);
    let meta = build_pack(&keys, PackKind::Meta, &[b"root tree v1"]);
    let data = build_pack(&keys, PackKind::Data, &[b"file a", b"file b"]);
    let wanted: Vec<Vec<u8>> = meta
        .blob_ids
        .iter()
        .chain(&data.blob_ids)
        .map(|b| b.as_bytes().to_vec())
        .collect();
    let find = pb::FindMissingBlobsRequest {
        workspace: ws.id.clone(),
        blob_ids: wanted.clone(),
    };
    let missing = find_missing(&mut client, find.clone()).await.unwrap();
    assert_eq!(missing.locations, [0, 0, 0]);

    upload(&mut client, &ws.id, &[&meta, &data]).await;
    let first = commit(
        &mut client,
        commit_request(&first_begin, &meta, &[&meta, &data], &[&meta, &data]),
    )
    .await;
    assert_eq!(first.sequence, 1);
    assert_eq!(first.workspace_id, ws.id);
    assert_eq!(first.pack_count, 2);
    assert_eq!(first.stored_bytes, meta.size + data.size);
    assert_eq!(first.key_id, "k1");

    // Now every blob is known, each with the pack holding it.
    let found = find_missing(&mut client, find).await.unwrap();
    assert_eq!(found.packs, [meta.id.to_string(), data.id.to_string()]);
    assert_eq!(found.locations, [1, 2, 2]);

    // A second checkpoint changes only the tree: one new pack, one reused.
    let second_begin = begin(&mut client, &ws.id).await;
    assert_eq!(second_begin.parent_checkpoint_id, first.id);
    let meta2 = build_pack(&keys, PackKind::Meta, &[b"root tree v2"]);
    upload(&mut client, &ws.id, &[&meta2]).await;
    let second = commit(
        &mut client,
        commit_request(&second_begin, &meta2, &[&meta2], &[&meta2, &data]),
    )
    .await;
    assert_eq!(second.sequence, 2);
    assert_eq!(second.parent_checkpoint_id, first.id);

    let listed = list_checkpoints(&mut client, &ws.id).await;
    assert_eq!(
        listed.iter().map(|c| c.id.clone()).collect::<Vec<_>>(),
        [second.id.clone(), first.id.clone()]
    );
    let shown = client
        .checkpoints
        .get_checkpoint(pb::GetCheckpointRequest {
            checkpoint_id: first.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    // Shown, it also says why retention keeps it: the second newest of
    // the last five.
    let retention = shown
        .retention
        .clone()
        .expect("GetCheckpoint says why it is kept");
    assert_eq!(retention.kept_by.len(), 1);
    assert_eq!(
        pb::Checkpoint {
            retention: None,
            ..shown
        },
        first
    );
    let workspace = get_workspace(&mut client, &ws.id).await;
    assert_eq!(workspace.checkpoint_count, 2);
    assert_eq!(workspace.latest_checkpoint.unwrap().id, second.id);

    let manifest = manifest(&mut client, &ws.id, "").await;
    assert_eq!(manifest.workspace_id, ws.id);
    assert_eq!(manifest.keys, [key]);
    let candidates: Vec<_> = manifest
        .candidates
        .iter()
        .map(|c| c.checkpoint.as_ref().unwrap().id.clone())
        .collect();
    assert_eq!(candidates, [second.id.clone(), first.id.clone()]);
    let mut second_packs = vec![meta2.id.to_string(), data.id.to_string()];
    second_packs.sort();
    assert_eq!(manifest.candidates[0].packs, second_packs);
    let mut all = vec![
        meta.id.to_string(),
        meta2.id.to_string(),
        data.id.to_string(),
    ];
    all.sort();
    assert_eq!(
        manifest
            .packs
            .iter()
            .map(|p| p.pack_id.clone())
            .collect::<Vec<_>>(),
        all
    );
    let data_location = manifest
        .packs
        .iter()
        .find(|p| p.pack_id == data.id.to_string())
        .unwrap();
    assert_eq!(
        (
            data_location.size,
            data_location.index_offset,
            data_location.index_length
        ),
        (data.size, data.index_offset, data.index_length)
    );
    assert_eq!(data_location.kind, pb::PackKind::Data as i32);
    let fetched = reqwest::get(&data_location.url)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(fetched.as_ref(), data.sink.as_slice());
    assert!(manifest.urls_expire_at.is_some());

    // Nothing changed since: a checkpoint of packs the workspace has,
    // rooted in one of them, uploads nothing.
    let third_begin = begin(&mut client, &ws.id).await;
    let unchanged = commit(
        &mut client,
        commit_request(&third_begin, &meta2, &[], &[&meta2, &data]),
    )
    .await;
    assert_eq!(unchanged.sequence, 3);
    assert_eq!(unchanged.root_tree, second.root_tree);
    // Rooted in a pack of the workspace's that it does not reference: a
    // restore of it would not find its tree.
    let status = commit_err(
        &mut client,
        commit_request(&third_begin, &meta, &[], &[&meta2, &data]),
    )
    .await;
    assert_eq!(status.code(), Code::FailedPrecondition, "{status}");
    assert!(status.message().contains("root tree"), "{status}");
}

#[tokio::test]
async fn a_commit_naming_a_pack_that_was_never_uploaded_is_refused_and_leaves_no_trace() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let begin = begin(&mut client, &ws.id).await;
    let keys = keys_of(&begin);
    let meta = build_pack(&keys, PackKind::Meta, &[b"tree"]);
    let data = build_pack(&keys, PackKind::Data, &[b"content"]);
    upload(&mut client, &ws.id, &[&meta]).await;

    let status = commit_err(
        &mut client,
        commit_request(&begin, &meta, &[&meta, &data], &[&meta, &data]),
    )
    .await;
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        Refusal::of(&status),
        Some(Refusal::PacksMissing {
            packs: vec![data.id.clone()]
        })
    );
    assert!(
        status.message().contains(data.id.as_str()),
        "{}",
        status.message()
    );

    assert!(list_checkpoints(&mut client, &ws.id).await.is_empty());
    let find = pb::FindMissingBlobsRequest {
        workspace: ws.id.clone(),
        blob_ids: meta
            .blob_ids
            .iter()
            .map(|b| b.as_bytes().to_vec())
            .collect(),
    };
    let found = find_missing(&mut client, find).await.unwrap();
    assert_eq!(
        found.locations,
        [0],
        "blobs of an uncommitted checkpoint are not recorded"
    );

    // Once the pack is there, the same commit goes through as checkpoint 1.
    upload(&mut client, &ws.id, &[&data]).await;
    let committed = commit(
        &mut client,
        commit_request(&begin, &meta, &[&meta, &data], &[&meta, &data]),
    )
    .await;
    assert_eq!(committed.sequence, 1);
}

#[tokio::test]
async fn a_commit_with_a_stale_generation_is_refused() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let old = begin(&mut client, &ws.id).await;
    let keys = keys_of(&old);
    let meta = build_pack(&keys, PackKind::Meta, &[b"tree"]);
    upload(&mut client, &ws.id, &[&meta]).await;

    bump_generation(dir.path(), &ws.id).await;
    let status = commit_err(&mut client, commit_request(&old, &meta, &[&meta], &[&meta])).await;
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        Refusal::of(&status),
        Some(Refusal::StaleGeneration {
            given: Generation(1),
            current: Generation(2),
        })
    );
    assert_eq!(
        status.message(),
        "generation g1 is older than the workspace's g2"
    );
    assert!(list_checkpoints(&mut client, &ws.id).await.is_empty());

    let status = client
        .checkpoints
        .begin_checkpoint(pb::BeginCheckpointRequest {
            workspace: ws.id.clone(),
            generation: 1,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains("g1") && status.message().contains("g2"),
        "{}",
        status.message()
    );

    // The current generation commits.
    let current = begin(&mut client, &ws.id).await;
    assert_eq!(current.generation, 2);
    let committed = commit(
        &mut client,
        commit_request(&current, &meta, &[&meta], &[&meta]),
    )
    .await;
    assert_eq!(committed.generation, 2);
}

#[tokio::test]
async fn a_store_outage_makes_the_commit_unavailable_and_a_retry_succeeds() {
    let dir = data_dir();
    let (server, faults) = TestServer::start_faulty(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let begin = begin(&mut client, &ws.id).await;
    let keys = keys_of(&begin);
    let meta = build_pack(&keys, PackKind::Meta, &[b"tree"]);
    let data = build_pack(&keys, PackKind::Data, &[b"content"]);
    upload(&mut client, &ws.id, &[&meta, &data]).await;
    let request = commit_request(&begin, &meta, &[&meta, &data], &[&meta, &data]);

    faults.fail_next(StoreOp::Stat, 1);
    let status = commit_err(&mut client, request.clone()).await;
    assert_eq!(status.code(), Code::Unavailable, "{}", status.message());
    assert!(list_checkpoints(&mut client, &ws.id).await.is_empty());
    assert!(faults.calls(StoreOp::Stat) >= 1);

    let committed = commit(&mut client, request).await;
    assert_eq!(committed.sequence, 1);
    assert_eq!(list_checkpoints(&mut client, &ws.id).await.len(), 1);
}

#[tokio::test]
async fn a_pack_missing_from_the_store_cannot_be_referenced_again() {
    let dir = data_dir();
    let (server, faults) = TestServer::start_faulty(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    checkpoint(&mut client, &ws.id, b"first").await;
    let manifest = manifest(&mut client, &ws.id, "").await;
    let data_pack: PackId = manifest
        .packs
        .iter()
        .find(|p| p.kind == pb::PackKind::Data as i32)
        .unwrap()
        .pack_id
        .parse()
        .unwrap();

    // The next checkpoint reuses the data pack, which the store lost.
    faults.hide(&ObjectKey::for_pack(
        &TenantId::default_tenant(),
        &data_pack,
    ));
    let begin = begin(&mut client, &ws.id).await;
    let meta = build_pack(&keys_of(&begin), PackKind::Meta, &[b"tree 2"]);
    upload(&mut client, &ws.id, &[&meta]).await;
    let mut request = commit_request(&begin, &meta, &[&meta], &[&meta]);
    request.referenced_packs.push(data_pack.to_string());
    let status = commit_err(&mut client, request).await;
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        Refusal::of(&status),
        Some(Refusal::PacksMissing {
            packs: vec![data_pack.clone()]
        })
    );
    assert!(
        status.message().contains(data_pack.as_str()),
        "{}",
        status.message()
    );
    assert_eq!(list_checkpoints(&mut client, &ws.id).await.len(), 1);
}

#[tokio::test]
async fn every_missing_pack_is_named_marked_lost_and_its_blobs_uploaded_again() {
    let dir = data_dir();
    let (server, faults) = TestServer::start_faulty(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let begin1 = begin(&mut client, &ws.id).await;
    let keys = keys_of(&begin1);
    let meta = build_pack(&keys, PackKind::Meta, &[b"tree 1"]);
    let data_a = build_pack(&keys, PackKind::Data, &[b"file a"]);
    let data_b = build_pack(&keys, PackKind::Data, &[b"file b"]);
    upload(&mut client, &ws.id, &[&meta, &data_a, &data_b]).await;
    commit(
        &mut client,
        commit_request(
            &begin1,
            &meta,
            &[&meta, &data_a, &data_b],
            &[&meta, &data_a, &data_b],
        ),
    )
    .await;

    // The store loses both data packs; the next commit reuses them.
    let tenant = TenantId::default_tenant();
    faults.hide(&ObjectKey::for_pack(&tenant, &data_a.id));
    faults.hide(&ObjectKey::for_pack(&tenant, &data_b.id));
    let begin2 = begin(&mut client, &ws.id).await;
    let meta2 = build_pack(&keys, PackKind::Meta, &[b"tree 2"]);
    upload(&mut client, &ws.id, &[&meta2]).await;
    let status = commit_err(
        &mut client,
        commit_request(&begin2, &meta2, &[&meta2], &[&meta2, &data_a, &data_b]),
    )
    .await;
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        Refusal::of(&status),
        Some(Refusal::PacksMissing {
            packs: vec![data_a.id.clone(), data_b.id.clone()]
        })
    );
    for pack in [&data_a.id, &data_b.id] {
        assert!(
            status.message().contains(&format!("pack {pack}")),
            "{}",
            status.message()
        );
    }

    // Their blobs now count as missing, so a runner uploads them again.
    let wanted: Vec<Vec<u8>> = data_a
        .blob_ids
        .iter()
        .chain(&data_b.blob_ids)
        .chain(&meta.blob_ids)
        .map(|b| b.as_bytes().to_vec())
        .collect();
    let find = pb::FindMissingBlobsRequest {
        workspace: ws.id.clone(),
        blob_ids: wanted,
    };
    let found = find_missing(&mut client, find.clone()).await.unwrap();
    assert_eq!(found.locations, [0, 0, 1]);
    assert_eq!(found.packs, [meta.id.to_string()]);

    let again = build_pack(&keys, PackKind::Data, &[b"file a", b"file b"]);
    upload(&mut client, &ws.id, &[&again]).await;
    let committed = commit(
        &mut client,
        commit_request(&begin2, &meta2, &[&meta2, &again], &[&meta2, &again]),
    )
    .await;
    assert_eq!(committed.sequence, 2);
    let found = find_missing(&mut client, find).await.unwrap();
    assert_eq!(found.locations, [1, 1, 2]);
    assert_eq!(found.packs, [again.id.to_string(), meta.id.to_string()]);
}

#[tokio::test]
async fn malformed_checkpoint_requests_are_invalid_arguments() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let begin = begin(&mut client, &ws.id).await;

    let too_many = vec![vec![0u8; 32]; begin.max_find_batch as usize + 1];
    let status = find_missing(
        &mut client,
        pb::FindMissingBlobsRequest {
            workspace: ws.id.clone(),
            blob_ids: too_many,
        },
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        Refusal::of(&status),
        Some(Refusal::LimitExceeded {
            limit: "find.blob_ids".into(),
            max: u64::from(begin.max_find_batch),
            actual: u64::from(begin.max_find_batch) + 1,
        })
    );

    let short = vec![vec![0u8; 32], vec![0u8; 31]];
    let status = find_missing(
        &mut client,
        pb::FindMissingBlobsRequest {
            workspace: ws.id.clone(),
            blob_ids: short,
        },
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("blob_ids[1]"),
        "{}",
        status.message()
    );

    let meta = build_pack(&keys_of(&begin), PackKind::Meta, &[b"tree"]);
    upload(&mut client, &ws.id, &[&meta]).await;
    let mut unknown_key = commit_request(&begin, &meta, &[&meta], &[&meta]);
    unknown_key.key_id = "k9".into();
    let status = commit_err(&mut client, unknown_key).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("k9"), "{}", status.message());

    let mut no_reason = commit_request(&begin, &meta, &[&meta], &[&meta]);
    no_reason.reason = 0;
    let status = commit_err(&mut client, no_reason).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("reason"), "{}", status.message());

    let mut foreign_root = commit_request(&begin, &meta, &[&meta], &[&meta]);
    foreign_root.root_tree = vec![9; 32];
    let status = commit_err(&mut client, foreign_root).await;
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains("root tree"),
        "{}",
        status.message()
    );

    assert!(list_checkpoints(&mut client, &ws.id).await.is_empty());
    let status = client
        .checkpoints
        .get_checkpoint(pb::GetCheckpointRequest {
            checkpoint_id: "ck-00000000000000000000000000".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
}

#[tokio::test]
async fn restore_manifests_offer_newest_first_candidates_or_exactly_one() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;

    let empty = manifest(&mut client, &ws.id, "").await;
    assert!(empty.candidates.is_empty() && empty.packs.is_empty());

    let mut ids = Vec::new();
    for i in 0..7u8 {
        ids.push(checkpoint(&mut client, &ws.id, &[i; 100]).await.id);
    }
    let newest = manifest(&mut client, &ws.id, "").await;
    let got: Vec<_> = newest
        .candidates
        .iter()
        .map(|c| c.checkpoint.as_ref().unwrap().id.clone())
        .collect();
    let expected: Vec<_> = ids.iter().rev().take(5).cloned().collect();
    assert_eq!(got, expected, "five newest by default, newest first");
    assert_eq!(newest.packs.len(), 10);

    let two = client
        .checkpoints
        .get_restore_manifest(pb::GetRestoreManifestRequest {
            workspace: ws.id.clone(),
            checkpoint_id: String::new(),
            max_candidates: 2,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(two.candidates.len(), 2);

    let exact = manifest(&mut client, &ws.id, &ids[0]).await;
    assert_eq!(exact.candidates.len(), 1);
    assert_eq!(exact.candidates[0].checkpoint.as_ref().unwrap().id, ids[0]);
    assert_eq!(exact.packs.len(), 2);

    let other = create_workspace(&mut client, "").await;
    let status = client
        .checkpoints
        .get_restore_manifest(pb::GetRestoreManifestRequest {
            workspace: other.id.clone(),
            checkpoint_id: ids[0].clone(),
            max_candidates: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
}

#[tokio::test]
async fn checkpoints_list_newest_first_in_pages() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    for i in 0..5u8 {
        checkpoint(&mut client, &ws.id, &[i]).await;
    }
    let mut sequences = Vec::new();
    let mut page_token = String::new();
    let mut pages = 0;
    loop {
        let page = client
            .checkpoints
            .list_checkpoints(pb::ListCheckpointsRequest {
                workspace: ws.id.clone(),
                page_size: 2,
                page_token,
            })
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        assert!(page.checkpoints.len() <= 2);
        sequences.extend(page.checkpoints.iter().map(|c| c.sequence));
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    assert_eq!(sequences, [5, 4, 3, 2, 1]);
    assert_eq!(pages, 3);
}

/// A commit over any per-commit cap is refused before it costs anything,
/// naming the limit, and a commit within them still goes through.
#[tokio::test]
async fn commits_over_the_per_commit_caps_are_refused_naming_the_limit() {
    let dir = data_dir();
    let server = TestServer::start_with(dir.path(), |config| {
        config.limits.max_commit_blobs = 3;
        config.limits.max_commit_referenced_packs = 2;
        config.limits.max_commit_details_bytes = 64;
    })
    .await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let begin = begin(&mut client, &ws.id).await;
    let keys = keys_of(&begin);
    let meta = build_pack(&keys, PackKind::Meta, &[b"tree"]);
    let data = build_pack(&keys, PackKind::Data, &[b"a", b"b", b"c"]);
    let other = build_pack(&keys, PackKind::Data, &[b"d"]);
    upload(&mut client, &ws.id, &[&meta, &data, &other]).await;
    let refused_limit = |status: &tonic::Status| match Refusal::of(status) {
        Some(Refusal::LimitExceeded { limit, max, actual }) => (limit, max, actual),
        other => panic!("not a limit refusal: {other:?} ({status})"),
    };

    let status = commit_err(
        &mut client,
        commit_request(&begin, &meta, &[&meta, &data], &[&meta, &data]),
    )
    .await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(refused_limit(&status), ("commit.blob_ids".into(), 3, 4));
    assert!(status.message().contains("commit.blob_ids"), "{status}");

    let status = commit_err(
        &mut client,
        commit_request(&begin, &meta, &[&meta, &other], &[&meta, &other, &data]),
    )
    .await;
    assert_eq!(
        refused_limit(&status),
        ("commit.referenced_packs".into(), 2, 3)
    );

    let mut chatty = commit_request(&begin, &meta, &[&meta, &other], &[&meta, &other]);
    chatty.warnings = vec!["w".repeat(65)];
    let status = commit_err(&mut client, chatty).await;
    assert_eq!(
        refused_limit(&status),
        ("commit.details_bytes".into(), 64, 65)
    );
    assert!(list_checkpoints(&mut client, &ws.id).await.is_empty());

    let within = commit_request(&begin, &meta, &[&meta, &other], &[&meta, &other]);
    commit(&mut client, within).await;
    assert_eq!(list_checkpoints(&mut client, &ws.id).await.len(), 1);
}
