//! A workspace reaches only its own data: the attacks of a hostile sandbox
//! on another workspace of the same tenant, through the checkpoint
//! protocol, are refused and leave the other workspace's checkpoints whole.

use cairn_proto::domain::PackKind;
use cairn_proto::pb;
use cairn_proto::refusal::Refusal;
use tonic::Code;

use crate::harness::*;

/// A workspace with one committed checkpoint holding `content`.
struct Victim {
    workspace: pb::Workspace,
    begin: pb::BeginCheckpointResponse,
    data: cairn_engine::format::FinishedPack<Vec<u8>>,
    checkpoint: pb::Checkpoint,
}

async fn victim(client: &mut cairn_engine::client::CoordinatorClient, content: &[u8]) -> Victim {
    let workspace = create_workspace(client, "").await;
    let begin = begin(client, &workspace.id).await;
    let keys = keys_of(&begin);
    let meta = build_pack(&keys, PackKind::Meta, &[b"victim tree"]);
    let data = build_pack(&keys, PackKind::Data, &[content]);
    upload(client, &workspace.id, &[&meta, &data]).await;
    let checkpoint = commit(
        client,
        commit_request(&begin, &meta, &[&meta, &data], &[&meta, &data]),
    )
    .await;
    Victim {
        workspace,
        begin,
        data,
        checkpoint,
    }
}

/// FindMissingBlobs of `ids` on behalf of `workspace`.
async fn find_in(
    client: &mut cairn_engine::client::CoordinatorClient,
    workspace: &str,
    ids: &[cairn_proto::ids::BlobId],
) -> pb::FindMissingBlobsResponse {
    client
        .checkpoints
        .find_missing_blobs(pb::FindMissingBlobsRequest {
            workspace: workspace.to_owned(),
            blob_ids: ids.iter().map(|b| b.as_bytes().to_vec()).collect(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// Attack 1: learn whether another workspace holds a blob, commit a
/// checkpoint of your own that references its pack (as an old pack, or
/// claimed as new), or roots your tree in its blob, to get the pack's URL
/// and key.
#[tokio::test]
async fn another_workspace_is_neither_found_nor_referenced_nor_decryptable() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let victim = victim(&mut client, b"the LICENSE everyone has").await;
    let attacker = create_workspace(&mut client, "").await;
    let own = begin(&mut client, &attacker.id).await;

    // Each workspace seals with a key of its own lineage.
    assert_ne!(
        own.key.as_ref().unwrap().secret,
        victim.begin.key.as_ref().unwrap().secret,
        "another workspace's key is never handed out"
    );

    // The victim's blob ids are unknown to the attacker's workspace.
    let found = find_in(&mut client, &attacker.id, &victim.data.blob_ids).await;
    assert!(found.packs.is_empty(), "{found:?}");
    assert!(found.locations.iter().all(|l| *l == 0));

    let keys = keys_of(&own);
    let meta = build_pack(&keys, PackKind::Meta, &[b"attacker tree"]);
    upload(&mut client, &attacker.id, &[&meta]).await;

    // Referencing the victim's pack as an old one: unknown to this workspace.
    let mut referencing = commit_request(&own, &meta, &[&meta], &[&meta]);
    referencing
        .referenced_packs
        .push(victim.data.id.to_string());
    let status = commit_err(&mut client, referencing).await;
    assert_eq!(status.code(), Code::FailedPrecondition, "{status}");
    assert_eq!(
        Refusal::of(&status),
        Some(Refusal::PacksMissing {
            packs: vec![victim.data.id.clone()]
        })
    );

    // Claiming it as new (it is in the store, at the size the attacker
    // read from a leaked URL): refused, it is recorded for another workspace.
    let claiming = commit_request(&own, &meta, &[&meta, &victim.data], &[&meta, &victim.data]);
    let status = commit_err(&mut client, claiming).await;
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");
    assert!(
        status.message().contains(victim.data.id.as_str()),
        "{status}"
    );

    // Rooting the tree in the victim's blob: in none of the referenced packs.
    let mut rooted = commit_request(&own, &meta, &[&meta], &[&meta]);
    rooted.root_tree = victim.data.blob_ids[0].as_bytes().to_vec();
    let status = commit_err(&mut client, rooted).await;
    assert_eq!(status.code(), Code::FailedPrecondition, "{status}");

    // Nothing of that was recorded; no manifest of the attacker's names the
    // victim's pack, and the victim's checkpoint still restores its own.
    assert!(list_checkpoints(&mut client, &attacker.id).await.is_empty());
    let theirs = manifest(&mut client, &victim.workspace.id, &victim.checkpoint.id).await;
    assert!(
        theirs.candidates[0]
            .packs
            .contains(&victim.data.id.to_string())
    );
    assert!(
        theirs
            .packs
            .iter()
            .any(|p| p.pack_id == victim.data.id.to_string())
    );
}

/// Attack 2: upload a pack that declares the blob ids of common content
/// but holds garbage, hoping other workspaces deduplicate against it.
#[tokio::test]
async fn a_poisoned_pack_reaches_no_other_workspace() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let victim = victim(&mut client, b"fn main() {}").await;
    let attacker = create_workspace(&mut client, "").await;
    let own = begin(&mut client, &attacker.id).await;
    let keys = keys_of(&own);
    let meta = build_pack(&keys, PackKind::Meta, &[b"attacker tree"]);
    // The strongest attacker: it knows the victim's blob ids (it cannot
    // compute them without the victim's key) and declares them.
    let garbage = build_pack(&keys, PackKind::Data, &[b"not what the ids say"]);
    upload(&mut client, &attacker.id, &[&meta, &garbage]).await;
    let mut poisoned = new_pack(&garbage);
    poisoned.blob_ids = victim
        .data
        .blob_ids
        .iter()
        .map(|b| b.as_bytes().to_vec())
        .collect();
    let mut request = commit_request(&own, &meta, &[&meta], &[&meta, &garbage]);
    request.new_packs.push(poisoned);
    commit(&mut client, request).await;

    // The victim's next checkpoint deduplicates against its own pack only.
    let found = find_in(&mut client, &victim.workspace.id, &victim.data.blob_ids).await;
    assert_eq!(found.packs, [victim.data.id.to_string()]);
    assert_eq!(found.locations, [1]);

    // A third workspace holding the same content asks with ids of its own
    // key, which nobody declared: it uploads its own copy.
    let third = create_workspace(&mut client, "").await;
    let third_begin = begin(&mut client, &third.id).await;
    let third_ids = keys_of(&third_begin).blob_id(b"fn main() {}");
    assert_ne!(third_ids, victim.data.blob_ids[0]);
    let found = find_in(&mut client, &third.id, &[third_ids]).await;
    assert_eq!(found.locations, [0]);
}

/// A commit sent again with its request id (its answer was cut off) gets
/// the checkpoint the first made, not a second one.
#[tokio::test]
async fn a_commit_sent_twice_with_one_request_id_makes_one_checkpoint() {
    let dir = data_dir();
    let server = TestServer::start(dir.path()).await;
    let mut client = server.client().await;
    let ws = create_workspace(&mut client, "").await;
    let begun = begin(&mut client, &ws.id).await;
    let keys = keys_of(&begun);
    let meta = build_pack(&keys, PackKind::Meta, &[b"tree"]);
    upload(&mut client, &ws.id, &[&meta]).await;
    let mut request = commit_request(&begun, &meta, &[&meta], &[&meta]);
    request.request_id = cairn_proto::ids::CommitRequestId::generate().to_string();
    let first_request = request.clone();
    let first = commit(&mut client, request.clone()).await;
    let again = commit(&mut client, request.clone()).await;
    assert_eq!(again.id, first.id);
    assert_eq!(list_checkpoints(&mut client, &ws.id).await.len(), 1);

    // Another request id is another checkpoint.
    let mut other = request;
    other.request_id = cairn_proto::ids::CommitRequestId::generate().to_string();
    let second = commit(&mut client, other).await;
    assert_ne!(second.id, first.id);
    assert_eq!(second.sequence, 2);

    // Even once the workspace moved to a newer generation, which would
    // refuse a new commit of the old one.
    crate::checkpoints::bump_generation(dir.path(), &ws.id).await;
    let late = commit(&mut client, first_request.clone()).await;
    assert_eq!(late.id, first.id);
    let status = commit_err(&mut client, {
        let mut fresh = first_request;
        fresh.request_id = cairn_proto::ids::CommitRequestId::generate().to_string();
        fresh
    })
    .await;
    assert_eq!(status.code(), Code::FailedPrecondition, "{status}");

    let mut malformed = commit_request(&begun, &meta, &[&meta], &[&meta]);
    malformed.request_id = "../x".into();
    let status = commit_err(&mut client, malformed).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("request_id"), "{status}");
}
