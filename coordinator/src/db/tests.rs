//! Tests of the metadata store against a real SQLite file.

use std::collections::BTreeMap;

use cairn_proto::domain::{CheckpointReason, NewPack, PackKind, WorkspaceRef, WorkspaceState};
use cairn_proto::ids::{BlobId, Generation, PackId, TenantId};
use cairn_proto::pb;
use cairn_proto::runs::RunState;

use super::*;

/// The database a test's store in `dir` uses: the PostgreSQL one
/// `CAIRN_TEST_DATABASE` names, in a schema of its own, or a SQLite file in
/// `dir`.
pub(super) fn test_location(dir: &std::path::Path) -> DatabaseLocation {
    match cairn_utils::testing::test_database(dir) {
        Some((url, schema)) => url
            .parse::<DatabaseLocation>()
            .and_then(|location| location.in_schema(&schema))
            .expect("CAIRN_TEST_DATABASE is a PostgreSQL URL"),
        None => DatabaseLocation::sqlite(dir.join("cairn.db")),
    }
}

pub(crate) async fn open() -> (tempfile::TempDir, MetadataStore, TenantId) {
    let dir = tempfile::tempdir().unwrap();
    let db = MetadataStore::open(&test_location(dir.path()))
        .await
        .unwrap();
    let tenant = TenantId::default_tenant();
    db.ensure_tenant(&tenant).await.unwrap();
    (dir, db, tenant)
}

/// Whether a test of what only PostgreSQL does is skipped here (the store
/// is SQLite), and why; `scripts/test` runs it again on PostgreSQL.
fn skipped_off_postgres(db: &MetadataStore, why: &str) -> bool {
    let skipped = db.backend != Backend::Postgres;
    if skipped {
        eprintln!(
            "skipped here: {why} (CAIRN_TEST_DATABASE); scripts/test runs this on PostgreSQL"
        );
    }
    skipped
}

fn pack_id(n: u8) -> PackId {
    PackId::from_digest(&[n; 32])
}

fn new_pack(n: u8, blobs: &[u8]) -> NewPack {
    NewPack {
        pack_id: pack_id(n),
        kind: PackKind::Data,
        size: 100 + u64::from(n),
        index_offset: 50,
        index_length: 20,
        blob_ids: blobs.iter().map(|b| BlobId([*b; 32])).collect(),
    }
}

fn commit_of(
    workspace: &Workspace,
    new_packs: Vec<NewPack>,
    referenced: Vec<PackId>,
) -> NewCheckpoint {
    NewCheckpoint {
        workspace_id: workspace.id.clone(),
        generation: workspace.generation,
        parent: None,
        reason: CheckpointReason::Manual,
        format_version: 1,
        root_tree: BlobId([1; 32]),
        key_id: FIRST_KEY_ID.into(),
        stats: pb::CheckpointStats {
            files: 3,
            ..Default::default()
        },
        repos: vec![pb::GitRepoState {
            path: "app".into(),
            branch: "main".into(),
            ..Default::default()
        }],
        warnings: vec!["skipped a fifo".into()],
        harness: None,
        new_packs,
        referenced_packs: referenced,
        stored_bytes: 201,
        request_id: None,
    }
}

#[tokio::test]
async fn each_new_workspace_has_a_key_of_its_own_and_forks_share_it() {
    let (_dir, db, tenant) = open().await;
    assert!(!db.ensure_tenant(&tenant).await.unwrap());
    let a = db.create_workspace(&tenant, None).await.unwrap();
    let b = db.create_workspace(&tenant, None).await.unwrap();
    let key_a = db.current_key(&tenant, &a.id).await.unwrap();
    let key_b = db.current_key(&tenant, &b.id).await.unwrap();
    assert_eq!(key_a.key_id, FIRST_KEY_ID);
    assert_eq!(key_a.secret.len(), 32);
    assert_ne!(key_a.secret, key_b.secret, "no two lineages share a key");
    assert_eq!(
        db.keys(&tenant, &a.id, &["k1".into(), "k9".into()])
            .await
            .unwrap(),
        vec![key_a.clone()]
    );
    db.commit_checkpoint(
        &tenant,
        commit_of(&a, vec![new_pack(1, &[1])], vec![pack_id(1)]),
    )
    .await
    .unwrap();
    let forked = db
        .fork_workspace(&tenant, &a.id, None, &[None])
        .await
        .unwrap();
    let fork = &forked.workspaces[0];
    assert_eq!(db.current_key(&tenant, &fork.id).await.unwrap(), key_a);

    // A workspace made before lineages keeps the tenant's key, and so do
    // its forks: their checkpoints were sealed with it.
    sqlx::query("UPDATE workspaces SET lineage = NULL WHERE id = $1")
        .bind(b.id.as_str())
        .execute(&db.pool)
        .await
        .unwrap();
    let tenant_key = db.current_key(&tenant, &b.id).await.unwrap();
    assert_ne!(tenant_key.secret, key_b.secret);
    assert_eq!(
        db.keys(&tenant, &b.id, &["k1".into()]).await.unwrap(),
        vec![tenant_key]
    );

    // What a commit checks: the key, in the workspace's lineage or (b)
    // among the tenant's keys.
    for ws in [&a, &b, fork] {
        let reference = WorkspaceRef::Id(ws.id.clone());
        let known = db
            .commit_preflight(&tenant, &reference, "k1", None, None)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (
                known.state,
                known.generation,
                known.key_known,
                known.parent_known
            ),
            (WorkspaceState::Active, ws.generation, true, true)
        );
        let unknown = db
            .commit_preflight(&tenant, &reference, "k9", None, None)
            .await
            .unwrap()
            .unwrap();
        assert!(!unknown.key_known);
    }
    let other: TenantId = "other".parse().unwrap();
    assert!(
        db.commit_preflight(&other, &WorkspaceRef::Id(a.id.clone()), "k1", None, None)
            .await
            .unwrap()
            .is_none(),
        "another tenant's workspace is not found"
    );
}

#[tokio::test]
async fn a_commit_preflight_finds_the_parent_and_an_earlier_commit_of_the_request() {
    let (_dir, db, tenant) = open().await;
    let ws = db.create_workspace(&tenant, None).await.unwrap();
    let other = db.create_workspace(&tenant, None).await.unwrap();
    let request = CommitRequestId::generate();
    let mut first = commit_of(&ws, vec![new_pack(1, &[1])], vec![pack_id(1)]);
    first.request_id = Some(request.clone());
    let first = db.commit_checkpoint(&tenant, first).await.unwrap();
    let theirs = db
        .commit_checkpoint(
            &tenant,
            commit_of(&other, vec![new_pack(2, &[2])], vec![pack_id(2)]),
        )
        .await
        .unwrap();

    let preflight = |reference, parent, request| {
        let db = db.clone();
        let tenant = tenant.clone();
        async move {
            db.commit_preflight(&tenant, &reference, FIRST_KEY_ID, parent, request)
                .await
                .unwrap()
                .unwrap()
        }
    };
    let by_id = WorkspaceRef::Id(ws.id.clone());
    let retried = preflight(by_id.clone(), Some(&first.id), Some(&request)).await;
    assert_eq!(retried.earlier, Some(first.id.clone()));
    assert!(retried.parent_known);
    let fresh = CommitRequestId::generate();
    assert_eq!(
        preflight(by_id.clone(), None, Some(&fresh)).await.earlier,
        None
    );
    assert!(
        !preflight(by_id, Some(&theirs.id), None).await.parent_known,
        "another workspace's checkpoint is no parent"
    );
    // Another workspace does not see the request of this one.
    let elsewhere = preflight(WorkspaceRef::Id(other.id.clone()), None, Some(&request)).await;
    assert_eq!(elsewhere.earlier, None);
}

#[tokio::test]
async fn a_committed_request_sent_again_gets_its_checkpoint_whatever_would_refuse_it_now() {
    let (_dir, db, tenant) = open().await;
    let ws = db.create_workspace(&tenant, None).await.unwrap();
    let request = CommitRequestId::generate();
    let mut first = commit_of(&ws, vec![new_pack(1, &[1])], vec![pack_id(1)]);
    first.request_id = Some(request.clone());
    let first = db.commit_checkpoint(&tenant, first).await.unwrap();

    // Sent again with what is refused now (a generation the workspace
    // left, a pack it does not have): the answer is the checkpoint made.
    let mut stale = commit_of(&ws, Vec::new(), vec![pack_id(1)]);
    stale.generation = Generation(0);
    stale.request_id = Some(request.clone());
    let mut missing = commit_of(&ws, Vec::new(), vec![pack_id(1), pack_id(9)]);
    missing.request_id = Some(request.clone());
    let mut again = commit_of(&ws, Vec::new(), vec![pack_id(1)]);
    again.request_id = Some(request);
    for retry in [stale, missing, again] {
        let answer = db.commit_checkpoint(&tenant, retry).await.unwrap();
        assert_eq!(answer.id, first.id);
        assert_eq!(answer.sequence, 1);
    }
    // Without the request, the same commits are refused; nothing was
    // recorded by the retries, sequence counter included.
    let mut stale = commit_of(&ws, Vec::new(), vec![pack_id(1)]);
    stale.generation = Generation(0);
    assert!(matches!(
        db.commit_checkpoint(&tenant, stale).await,
        Err(DbError::GenerationMismatch { .. })
    ));
    let next = db
        .commit_checkpoint(&tenant, commit_of(&ws, Vec::new(), vec![pack_id(1)]))
        .await
        .unwrap();
    assert_eq!(next.sequence, 2);
    assert_eq!(
        db.list_checkpoints(&ws.id, None, 10).await.unwrap().len(),
        2
    );
}

#[tokio::test]
async fn commit_packs_know_the_workspace_packs_and_which_of_them_hold_the_root() {
    let (_dir, db, tenant) = open().await;
    let ws = db.create_workspace(&tenant, None).await.unwrap();
    let other = db.create_workspace(&tenant, None).await.unwrap();
    db.commit_checkpoint(
        &tenant,
        commit_of(
            &ws,
            vec![new_pack(1, &[1, 2]), new_pack(2, &[3])],
            vec![pack_id(1), pack_id(2)],
        ),
    )
    .await
    .unwrap();
    db.commit_checkpoint(
        &tenant,
        commit_of(&other, vec![new_pack(3, &[4])], vec![pack_id(3)]),
    )
    .await
    .unwrap();
    let blob = |n| BlobId([n; 32]);

    let both = db
        .commit_packs(&tenant, &ws.id, &[pack_id(1), pack_id(2)], &blob(2))
        .await
        .unwrap();
    assert_eq!(both.known.len(), 2);
    assert_eq!(both.known[&pack_id(2)].size, 102);
    assert!(both.root_held);
    // The root is in a pack of the workspace's, but not in one referenced.
    let elsewhere = db
        .commit_packs(&tenant, &ws.id, &[pack_id(2)], &blob(1))
        .await
        .unwrap();
    assert!(!elsewhere.root_held);
    // Another workspace's pack is unknown here, root or not.
    let foreign = db
        .commit_packs(&tenant, &ws.id, &[pack_id(3)], &blob(4))
        .await
        .unwrap();
    assert!(foreign.known.is_empty());
    assert!(!foreign.root_held);
    // A lost pack is still known (the commit is refused for it later), but
    // a restore could not read the root there.
    db.mark_packs_lost(&tenant, &[pack_id(1)]).await.unwrap();
    let lost = db
        .commit_packs(&tenant, &ws.id, &[pack_id(1)], &blob(1))
        .await
        .unwrap();
    assert!(lost.known.contains_key(&pack_id(1)));
    assert!(!lost.root_held);
}

#[tokio::test]
async fn a_workspace_sees_only_its_own_packs_and_those_it_was_forked_from() {
    let (_dir, db, tenant) = open().await;
    let a = db.create_workspace(&tenant, None).await.unwrap();
    let b = db.create_workspace(&tenant, None).await.unwrap();
    db.commit_checkpoint(
        &tenant,
        commit_of(&a, vec![new_pack(1, &[1, 2])], vec![pack_id(1)]),
    )
    .await
    .unwrap();
    let blob = |n| BlobId([n; 32]);

    // B learns nothing of A's blobs and cannot reference A's pack.
    assert!(
        db.find_blobs(&tenant, &b.id, &[blob(1)])
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        db.workspace_packs(&tenant, &b.id, &[pack_id(1)])
            .await
            .unwrap()
            .is_empty()
    );
    // Nor claim it as its own by declaring it new.
    match db
        .commit_checkpoint(
            &tenant,
            commit_of(&b, vec![new_pack(1, &[1])], vec![pack_id(1)]),
        )
        .await
    {
        Err(DbError::ForeignPack { pack, workspace }) => {
            assert_eq!((pack, workspace), (pack_id(1), b.id.clone()));
        }
        other => panic!("a foreign pack was claimed: {other:?}"),
    }
    // B's own upload declaring A's blob ids (a poisoning attempt) is B's
    // alone: A keeps finding its blobs in its own pack.
    db.commit_checkpoint(
        &tenant,
        commit_of(&b, vec![new_pack(2, &[1, 2])], vec![pack_id(2)]),
    )
    .await
    .unwrap();
    let of_a = db
        .find_blobs(&tenant, &a.id, &[blob(1), blob(2)])
        .await
        .unwrap();
    assert_eq!(
        of_a.values().collect::<Vec<_>>(),
        [&pack_id(1), &pack_id(1)]
    );
    let of_b = db.find_blobs(&tenant, &b.id, &[blob(1)]).await.unwrap();
    assert_eq!(of_b[&blob(1)], pack_id(2));

    // A fork dedups against the checkpoint it starts from, and only that.
    let forked = db
        .fork_workspace(&tenant, &a.id, None, &[None])
        .await
        .unwrap();
    let fork = &forked.workspaces[0];
    let of_fork = db.find_blobs(&tenant, &fork.id, &[blob(1)]).await.unwrap();
    assert_eq!(of_fork[&blob(1)], pack_id(1));
    let next = db
        .workspace(&tenant, &WorkspaceRef::Id(a.id.clone()))
        .await
        .unwrap()
        .unwrap();
    let mut later = commit_of(&next, vec![new_pack(3, &[3])], vec![pack_id(1), pack_id(3)]);
    later.parent = next.latest_checkpoint.map(|c| c.id);
    db.commit_checkpoint(&tenant, later).await.unwrap();
    assert!(
        db.find_blobs(&tenant, &fork.id, &[blob(3)])
            .await
            .unwrap()
            .is_empty(),
        "what the source uploads after the fork is not the fork's"
    );
}

#[tokio::test]
async fn names_are_unique_per_tenant_and_lookups_work_by_id_or_name() {
    let (_dir, db, tenant) = open().await;
    let named = db
        .create_workspace(&tenant, Some("fix-login"))
        .await
        .unwrap();
    assert_eq!(named.state, WorkspaceState::Active);
    assert_eq!(named.generation, Generation(1));
    db.create_workspace(&tenant, None).await.unwrap();
    db.create_workspace(&tenant, None).await.unwrap();
    match db.create_workspace(&tenant, Some("fix-login")).await {
        Err(DbError::NameTaken(name)) => assert_eq!(name, "fix-login"),
        other => panic!("duplicate name accepted: {other:?}"),
    }
    let by_name = db
        .workspace(&tenant, &WorkspaceRef::Name("fix-login".into()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(by_name.id, named.id);
    let by_id = db
        .workspace(&tenant, &WorkspaceRef::Id(named.id.clone()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(by_id.name.as_deref(), Some("fix-login"));
    let other_tenant: TenantId = "other".parse().unwrap();
    assert!(
        db.workspace(&other_tenant, &WorkspaceRef::Id(named.id))
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn stores_in_separate_schemas_do_not_wait_for_each_others_writes() {
    let (_dir, db, tenant) = open().await;
    if skipped_off_postgres(&db, "the write lock is PostgreSQL's advisory lock") {
        return;
    }
    let (_other_dir, other, _) = open().await;
    assert_ne!(
        db.write_lock, other.write_lock,
        "each schema has its own key"
    );
    // This schema's write lock is held by a transaction that stays open.
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query("BEGIN").execute(&mut *holder).await.unwrap();
    sqlx::query(&format!(
        "SELECT CAST(pg_advisory_xact_lock({}) AS TEXT)",
        db.write_lock
    ))
    .execute(&mut *holder)
    .await
    .unwrap();
    // The other schema's writers go on.
    let wait = Duration::from_secs(10);
    tokio::time::timeout(wait, other.create_workspace(&tenant, None))
        .await
        .expect("a write in another schema waited for this schema's lock")
        .unwrap();
    // This schema's writers wait for it, and go on once it is released.
    let blocked = tokio::spawn({
        let db = db.clone();
        let tenant = tenant.clone();
        async move { db.create_workspace(&tenant, None).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!blocked.is_finished(), "a write went on beside the lock");
    sqlx::query("ROLLBACK").execute(&mut *holder).await.unwrap();
    tokio::time::timeout(wait, blocked)
        .await
        .expect("the write went on once the lock was released")
        .unwrap()
        .unwrap();
}

#[test]
fn the_write_lock_key_is_a_function_of_the_schema_alone() {
    assert_eq!(write_lock_key("cairn_prod"), write_lock_key("cairn_prod"));
    assert_ne!(
        write_lock_key("cairn_prod"),
        write_lock_key("cairn_staging")
    );
    assert_ne!(write_lock_key("public"), write_lock_key(""));
}

#[tokio::test]
async fn writers_and_commits_queued_for_the_write_lock_leave_the_pool_to_readers() {
    let (_dir, db, tenant) = open().await;
    if skipped_off_postgres(&db, "the write lock is PostgreSQL's advisory lock") {
        return;
    }
    let ws = db.create_workspace(&tenant, None).await.unwrap();
    db.commit_checkpoint(
        &tenant,
        commit_of(&ws, vec![new_pack(1, &[1])], vec![pack_id(1)]),
    )
    .await
    .unwrap();
    // Another replica's write transaction holds the lock a while (its
    // connection is one of this pool's, standing in for the other's).
    let mut other = db.pool.acquire().await.unwrap();
    sqlx::query("BEGIN").execute(&mut *other).await.unwrap();
    sqlx::query(&format!(
        "SELECT CAST(pg_advisory_xact_lock({}) AS TEXT)",
        db.write_lock
    ))
    .execute(&mut *other)
    .await
    .unwrap();
    // Far more writers and commits than the pool has connections queue
    // for it.
    let writers: Vec<_> = (0..2 * super::POSTGRES_CONNECTIONS)
        .map(|_| {
            let db = db.clone();
            let tenant = tenant.clone();
            tokio::spawn(async move { db.create_workspace(&tenant, None).await })
        })
        .collect();
    let commits: Vec<_> = (0..2 * super::POSTGRES_CONNECTIONS)
        .map(|_| {
            let db = db.clone();
            let tenant = tenant.clone();
            let commit = commit_of(&ws, vec![], vec![pack_id(1)]);
            tokio::spawn(async move { db.commit_checkpoint(&tenant, commit).await })
        })
        .collect();
    // Until one of them waits on the lock in the database…
    let watch = db.pool.acquire().await.unwrap();
    let mut watch = watch.detach();
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event = 'advisory'",
        )
        .fetch_one(&mut watch)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // …and the others had their chance to take connections too.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Reads (a heartbeat's, a restore's) are still served.
    let read = tokio::time::timeout(
        Duration::from_secs(10),
        db.workspace(&tenant, &WorkspaceRef::Id(ws.id.clone())),
    )
    .await
    .expect("a read waited for a connection behind the queued writers")
    .unwrap();
    assert!(read.is_some());

    sqlx::query("COMMIT").execute(&mut *other).await.unwrap();
    for writer in writers {
        writer.await.unwrap().unwrap();
    }
    let mut sequences = Vec::new();
    for commit in commits {
        sequences.push(commit.await.unwrap().unwrap().sequence);
    }
    sequences.sort_unstable();
    let expected: Vec<u64> = (2..2 + u64::from(2 * super::POSTGRES_CONNECTIONS)).collect();
    assert_eq!(
        sequences, expected,
        "every queued commit went through, in turn"
    );
}

#[tokio::test]
async fn a_commit_absolves_the_condemned_packs_it_references_and_only_those() {
    let (_dir, db, tenant) = open().await;
    let ws = db.create_workspace(&tenant, None).await.unwrap();
    db.commit_checkpoint(
        &tenant,
        commit_of(
            &ws,
            vec![new_pack(1, &[1]), new_pack(2, &[2])],
            vec![pack_id(1), pack_id(2)],
        ),
    )
    .await
    .unwrap();
    // A collection condemned both (as its mark would, had the checkpoint
    // gone) and has not swept yet.
    sqlx::query("UPDATE packs SET condemned_at = 1 WHERE tenant = $1")
        .bind(tenant.as_str())
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(db.tenant_storage(&tenant).await.unwrap().condemned.packs, 2);

    db.commit_checkpoint(&tenant, commit_of(&ws, vec![], vec![pack_id(1)]))
        .await
        .unwrap();
    let condemned = db.tenant_storage(&tenant).await.unwrap().condemned;
    assert_eq!(
        (condemned.packs, condemned.bytes),
        (1, 102),
        "pack 1 is referenced again; pack 2 stays condemned"
    );
}

#[tokio::test]
async fn a_commit_of_more_packs_than_a_statement_holds_rechecks_and_lists_them_all() {
    let (_dir, db, tenant) = open().await;
    let ws = db.create_workspace(&tenant, None).await.unwrap();
    // A commit rechecks, absolves and lists its packs a chunk per
    // statement (PostgreSQL lists the first chunk in the statement that
    // writes the checkpoint): every chunk must count.
    let count = u16::try_from(2 * super::ROWS_PER_STATEMENT + 50).unwrap();
    let id_of = |i: u16| {
        let mut digest = [7u8; 32];
        digest[..2].copy_from_slice(&i.to_be_bytes());
        PackId::from_digest(&digest)
    };
    let ids: Vec<PackId> = (0..count).map(id_of).collect();
    let packs = ids
        .iter()
        .map(|id| NewPack {
            pack_id: id.clone(),
            ..new_pack(1, &[])
        })
        .collect();
    db.commit_checkpoint(&tenant, commit_of(&ws, packs, ids.clone()))
        .await
        .unwrap();

    let first_chunk = id_of(3);
    let beyond = id_of(count - 1);
    sqlx::query("UPDATE packs SET superseded_at = 1 WHERE tenant = $1 AND id IN ($2, $3)")
        .bind(tenant.as_str())
        .bind(first_chunk.as_str())
        .bind(beyond.as_str())
        .execute(&db.pool)
        .await
        .unwrap();
    let refused = db
        .commit_checkpoint(&tenant, commit_of(&ws, vec![], ids.clone()))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, DbError::PacksMissing { packs } if *packs == [first_chunk.clone(), beyond.clone()]),
        "{refused:?}"
    );
    assert_eq!(
        db.list_checkpoints(&ws.id, None, 10).await.unwrap().len(),
        1
    );

    // Usable again, and condemned meanwhile: the next commit takes them
    // all and absolves them all.
    sqlx::query("UPDATE packs SET superseded_at = NULL, condemned_at = 1 WHERE tenant = $1")
        .bind(tenant.as_str())
        .execute(&db.pool)
        .await
        .unwrap();
    let made = db
        .commit_checkpoint(&tenant, commit_of(&ws, vec![], ids.clone()))
        .await
        .unwrap();
    assert_eq!(made.pack_count, u32::from(count));
    let listed = db
        .checkpoint_packs(std::slice::from_ref(&made.id))
        .await
        .unwrap();
    let mut expected = ids.clone();
    expected.sort();
    let mut got = listed[&made.id].clone();
    got.sort();
    assert_eq!(got, expected);
    assert_eq!(db.tenant_storage(&tenant).await.unwrap().condemned.packs, 0);
}

#[tokio::test]
async fn commits_number_checkpoints_and_record_packs_and_blobs() {
    let (_dir, db, tenant) = open().await;
    let ws = db.create_workspace(&tenant, None).await.unwrap();
    let first = db
        .commit_checkpoint(
            &tenant,
            commit_of(&ws, vec![new_pack(1, &[1, 2])], vec![pack_id(1)]),
        )
        .await
        .unwrap();
    assert_eq!(first.sequence, 1);
    // Blob 2 is also in pack 2; the answer names the first pack by id.
    let second = db
        .commit_checkpoint(
            &tenant,
            commit_of(
                &ws,
                vec![new_pack(2, &[2, 3])],
                vec![pack_id(1), pack_id(2)],
            ),
        )
        .await
        .unwrap();
    assert_eq!(second.sequence, 2);

    let found = db
        .find_blobs(
            &tenant,
            &ws.id,
            &[BlobId([2; 32]), BlobId([3; 32]), BlobId([9; 32])],
        )
        .await
        .unwrap();
    assert_eq!(found.get(&BlobId([2; 32])), Some(&pack_id(1)));
    assert_eq!(found.get(&BlobId([3; 32])), Some(&pack_id(2)));
    assert_eq!(found.len(), 2);

    let packs = db
        .checkpoint_packs(std::slice::from_ref(&second.id))
        .await
        .unwrap();
    assert_eq!(packs[&second.id], vec![pack_id(1), pack_id(2)]);
    let records = db
        .workspace_packs(&tenant, &ws.id, &[pack_id(2)])
        .await
        .unwrap();
    assert_eq!(records[&pack_id(2)].size, 102);

    let stored = db.checkpoint(&tenant, &second.id).await.unwrap().unwrap();
    assert_eq!(stored.repos[0].branch, "main");
    assert_eq!(stored.warnings, ["skipped a fifo"]);
    assert_eq!(stored.stats.files, 3);
    assert_eq!(stored.pack_count, 2);

    let ws = db
        .workspace(&tenant, &WorkspaceRef::Id(ws.id))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ws.checkpoint_count, 2);
    assert_eq!(ws.latest_checkpoint.unwrap().id, second.id);
    let newest_first = db.list_checkpoints(&ws.id, None, 10).await.unwrap();
    assert_eq!(
        newest_first.iter().map(|c| c.sequence).collect::<Vec<_>>(),
        [2, 1]
    );
    assert_eq!(
        db.list_checkpoints(&ws.id, Some(2), 10)
            .await
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test]
async fn a_refused_commit_leaves_no_trace() {
    let (_dir, db, tenant) = open().await;
    let ws = db.create_workspace(&tenant, None).await.unwrap();
    let mut stale = commit_of(&ws, vec![new_pack(1, &[1])], vec![pack_id(1)]);
    stale.generation = Generation(0);
    match db.commit_checkpoint(&tenant, stale).await {
        Err(DbError::GenerationMismatch { given, current }) => {
            assert_eq!((given, current), (Generation(0), Generation(1)));
        }
        other => panic!("stale commit accepted: {other:?}"),
    }
    // A referenced pack with no record violates a foreign key: the whole
    // transaction rolls back, sequence counter included.
    let dangling = commit_of(&ws, vec![new_pack(1, &[1])], vec![pack_id(1), pack_id(7)]);
    assert!(db.commit_checkpoint(&tenant, dangling).await.is_err());
    assert!(
        db.workspace_packs(&tenant, &ws.id, &[pack_id(1)])
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        db.find_blobs(&tenant, &ws.id, &[BlobId([1; 32])])
            .await
            .unwrap()
            .is_empty()
    );
    let ok = db
        .commit_checkpoint(
            &tenant,
            commit_of(&ws, vec![new_pack(1, &[1])], vec![pack_id(1)]),
        )
        .await
        .unwrap();
    assert_eq!(ok.sequence, 1);
}

#[tokio::test]
async fn workspaces_list_in_pages_by_id() {
    let (_dir, db, tenant) = open().await;
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(db.create_workspace(&tenant, None).await.unwrap().id);
    }
    let first = db.list_workspaces(&tenant, None, 2).await.unwrap();
    let rest = db
        .list_workspaces(&tenant, Some(&first[1].id), 10)
        .await
        .unwrap();
    let listed: Vec<_> = first.iter().chain(&rest).map(|w| w.id.clone()).collect();
    assert_eq!(listed, ids);
}

/// A run of the command harness on a new workspace.
fn new_run() -> runs::NewRun {
    runs::NewRun {
        target: runs::NewRunTarget::NewWorkspace(None),
        station: "implement".into(),
        harness: pb::HarnessSpec {
            name: "command".into(),
            ..Default::default()
        },
        prompt: "do it".into(),
        labels: Default::default(),
        hold: Duration::from_secs(60),
        max_attempts: 3,
        repos: Vec::new(),
        image: String::new(),
        checkpoint_interval: Duration::ZERO,
        checkpoint_limits: Default::default(),
        lay: Default::default(),
    }
}

#[tokio::test]
async fn an_illegal_transition_is_refused_and_changes_nothing() {
    use crate::runlife::{Event, IllegalTransition};
    use cairn_proto::runs::RunState;

    let (_dir, db, tenant) = open().await;
    let new = new_run();
    let created = db.create_run(&tenant, new).await.unwrap();
    assert_eq!(created.state, RunState::Queued);
    let events = db.run_events(&created.id, 0, 100).await.unwrap().len();

    let mut tx = db.begin_write().await.unwrap();
    let mut run = run_records::load_run(tx.conn(), &created.id)
        .await
        .unwrap()
        .unwrap();
    let draft = run_records::EventDraft::new(run_records::event_reason::CLAIMED, "");
    let err = runs::transition(&mut tx, &mut run, Event::Claimed, "claimed", draft, 0)
        .await
        .unwrap_err();
    let DbError::IllegalTransition { run: id, illegal } = &err else {
        panic!("expected an illegal transition, got {err:?}");
    };
    assert_eq!(id, &created.id);
    assert_eq!(
        illegal,
        &IllegalTransition {
            from: RunState::Queued,
            event: Event::Claimed
        }
    );
    assert_eq!(run.state, RunState::Queued);
    db.commit(tx).await.unwrap();

    let after = db.run(&tenant, &created.id).await.unwrap().unwrap();
    assert_eq!(after.state, RunState::Queued);
    assert_eq!(after.state_reason, created.state_reason);
    assert_eq!(
        db.run_events(&created.id, 0, 100).await.unwrap().len(),
        events
    );
    // A bug of the coordinator, not the caller's doing.
    let status = tonic::Status::from(crate::grpc::ServiceError::from(err));
    assert_eq!(status.code(), tonic::Code::Internal);
}

#[tokio::test]
async fn a_heartbeat_that_changes_nothing_renews_the_lease_in_memory_until_flushed() {
    use cairn_proto::runs::SandboxState;

    let (_dir, db, tenant) = open().await;
    let registration = hosts::HostRegistration {
        host_id: None,
        name: "h".into(),
        labels: Default::default(),
        slots: 1,
        driver: "local".into(),
    };
    let hosts::Registered::Host { host, .. } = db
        .register_host(&tenant, registration, false, None)
        .await
        .unwrap()
    else {
        panic!("a new host registers");
    };
    let stored_heartbeat = || async {
        db.host(&tenant, host.id.as_str())
            .await
            .unwrap()
            .last_heartbeat_at
    };
    let registered = stored_heartbeat().await;
    let created = db.create_run(&tenant, new_run()).await.unwrap();
    let assigned = db
        .assign_runs(&[Assignment {
            run: created.id.clone(),
            attempt_count: 0,
            host: host.id.clone(),
            token_hash: [7; 32],
        }])
        .await
        .unwrap();
    assert_eq!(assigned.len(), 1, "the run is assigned");

    // Nothing changes: the assignment is answered, nothing is written.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let answer = db
        .heartbeat(&tenant, &host.id, &[], false, &[])
        .await
        .unwrap();
    assert_eq!(answer.assignments.len(), 1);
    assert_eq!(stored_heartbeat().await, registered, "no write for a lease");

    // A sandbox report changes something: the state is written right
    // after the answer; the lease still waits in memory for the flush.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let running = [hosts::ReportedSandbox {
        sandbox_id: answer.assignments[0].sandbox_id.clone(),
        state: SandboxState::Running,
        exit_code: 0,
        detail: String::new(),
    }];
    let answer = db
        .heartbeat(&tenant, &host.id, &running, false, &[])
        .await
        .unwrap();
    assert!(
        answer.assignments.is_empty(),
        "a started sandbox is not assigned again"
    );
    db.write_deferred_reports().await;
    let attempt = db.attempt(&created.id, 1).await.unwrap().unwrap();
    assert_eq!(attempt.sandbox_state, Some(SandboxState::Running));
    assert_eq!(stored_heartbeat().await, registered);
    assert_eq!(db.flush_heartbeats().await.unwrap(), 1);
    let reported = stored_heartbeat().await;
    assert!(reported > registered, "the flush writes the lease");

    // The same report again: only the lease, renewed in memory.
    tokio::time::sleep(Duration::from_millis(5)).await;
    db.heartbeat(&tenant, &host.id, &running, false, &[])
        .await
        .unwrap();
    assert_eq!(stored_heartbeat().await, reported);
    assert_eq!(db.flush_heartbeats().await.unwrap(), 1);
    assert!(
        stored_heartbeat().await > reported,
        "the flush writes the lease"
    );
    assert_eq!(
        db.flush_heartbeats().await.unwrap(),
        0,
        "nothing left to write"
    );

    // A changed kept-tree list is written right after the answer too.
    let kept = [created.workspace_id.clone()];
    db.heartbeat(&tenant, &host.id, &running, false, &kept)
        .await
        .unwrap();
    db.write_deferred_reports().await;
    let host = db.host(&tenant, host.id.as_str()).await.unwrap();
    assert_eq!(host.kept_workspaces, kept);
}

#[tokio::test]
async fn a_batch_of_assignments_rechecks_every_run_and_slot_in_its_transaction() {
    let (_dir, db, tenant) = open().await;
    let register = |name: &str| hosts::HostRegistration {
        host_id: None,
        name: name.into(),
        labels: Default::default(),
        slots: 1,
        driver: "local".into(),
    };
    let mut hosts = Vec::new();
    for name in ["a", "b"] {
        let hosts::Registered::Host { host, .. } = db
            .register_host(&tenant, register(name), false, None)
            .await
            .unwrap()
        else {
            panic!("a new host registers");
        };
        hosts.push(host.id);
    }
    let mut runs = Vec::new();
    for _ in 0..4 {
        runs.push(db.create_run(&tenant, new_run()).await.unwrap().id);
    }
    let assignment = |run: usize, attempt_count: u32, host: usize| Assignment {
        run: runs[run].clone(),
        attempt_count,
        host: hosts[host].clone(),
        token_hash: [u8::try_from(run).unwrap(); 32],
    };
    // Run 1 asks host a, which run 0 just filled; run 2 was counted with
    // an attempt it does not have; run 3 takes host b.
    let assigned = db
        .assign_runs(&[
            assignment(0, 0, 0),
            assignment(1, 0, 0),
            assignment(2, 1, 1),
            assignment(3, 0, 1),
        ])
        .await
        .unwrap();
    let placed: Vec<(RunId, HostId)> = assigned
        .iter()
        .map(|run| {
            let attempt = run
                .current_attempt()
                .expect("an assigned run has an attempt");
            assert_eq!(run.state, RunState::Assigned);
            assert_eq!(attempt.number, 1);
            (run.id.clone(), attempt.host_id.clone())
        })
        .collect();
    assert_eq!(
        placed,
        [
            (runs[0].clone(), hosts[0].clone()),
            (runs[3].clone(), hosts[1].clone())
        ]
    );
    for skipped in [&runs[1], &runs[2]] {
        let run = db.run(&tenant, skipped).await.unwrap().unwrap();
        assert_eq!(run.state, RunState::Queued, "{skipped} stays queued");
        assert!(run.attempts.is_empty());
    }
    // What was written reads back the same, and the same batch again
    // assigns nothing: both runs moved on, both hosts are full.
    let stored = db.run(&tenant, &runs[3]).await.unwrap().unwrap();
    assert_eq!(stored.attempts, assigned[1].attempts);
    assert!(
        db.assign_runs(&[assignment(0, 0, 1), assignment(1, 0, 1)])
            .await
            .unwrap()
            .is_empty()
    );

    // Waiting reasons: written once, an event each time one changes.
    let reasons = [
        (runs[1].clone(), "all 2 matching hosts are full".to_owned()),
        (runs[0].clone(), "not queued any more".to_owned()),
    ];
    assert_eq!(db.set_queue_reasons(&reasons).await.unwrap(), [&reasons[0]]);
    assert!(db.set_queue_reasons(&reasons).await.unwrap().is_empty());
    let run = db.run(&tenant, &runs[1]).await.unwrap().unwrap();
    assert_eq!(run.state_reason, "all 2 matching hosts are full");
}

fn named_run(name: &str) -> runs::NewRun {
    runs::NewRun {
        target: runs::NewRunTarget::NewWorkspace(Some(name.to_owned())),
        ..new_run()
    }
}

#[tokio::test]
async fn runs_created_in_one_transaction_are_refused_or_created_each_on_its_own() {
    let (_dir, db, tenant) = open().await;
    let creation = |name: &str| runs::RunCreation {
        tenant: tenant.clone(),
        new: named_run(name),
    };
    // The second is refused by the database itself (a unique name): on
    // PostgreSQL that aborts the transaction unless its savepoint is
    // rolled back.
    let batch = vec![creation("first"), creation("first"), creation("second")];
    let results = group_commit::write_together(&db, batch).await;
    assert_eq!(results.len(), 3);
    let first = results[0].as_ref().expect("the first run is created");
    assert!(
        matches!(&results[1], Err(DbError::NameTaken(name)) if name == "first"),
        "{:?}",
        results[1]
    );
    let second = results[2]
        .as_ref()
        .expect("the run after a refused one is created");

    for (run, name) in [(first, "first"), (second, "second")] {
        let stored = db.run(&tenant, &run.id).await.unwrap().expect("committed");
        assert_eq!(stored.state, RunState::Queued);
        let events = db.run_events(&run.id, 0, 10).await.unwrap();
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].reason, run_records::event_reason::CREATED);
        let workspace = db
            .workspace(&tenant, &WorkspaceRef::Name(name.to_owned()))
            .await
            .unwrap()
            .expect("its workspace is committed");
        assert_eq!(workspace.id, run.workspace_id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creations_each_get_their_own_answer() {
    let (_dir, db, tenant) = open().await;
    let creations = (0..40).map(|i| {
        let (db, tenant) = (db.clone(), tenant.clone());
        // Two of them ask for the same workspace name: one must lose.
        let new = if i < 2 {
            named_run("contested")
        } else {
            new_run()
        };
        tokio::spawn(async move { db.create_run(&tenant, new).await })
    });
    let results: Vec<Result<Run, DbError>> = futures::future::join_all(creations)
        .await
        .into_iter()
        .map(|joined| joined.expect("no creation panics"))
        .collect();
    let refused: Vec<&DbError> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        matches!(refused.as_slice(), [DbError::NameTaken(name)] if name == "contested"),
        "{refused:?}"
    );
    let created: BTreeSet<RunId> = results
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .map(|run| run.id.clone())
        .collect();
    assert_eq!(created.len(), 39);
    for id in &created {
        let run = db.run(&tenant, id).await.unwrap().expect("committed");
        assert_eq!(run.state, RunState::Queued);
        assert_eq!(db.run_events(id, 0, 10).await.unwrap().len(), 1);
    }
}

#[tokio::test]
async fn checkpoints_committed_in_one_transaction_are_refused_or_kept_each_on_its_own() {
    let (_dir, db, tenant) = open().await;
    let ws = db.create_workspace(&tenant, None).await.unwrap();
    let other = db.create_workspace(&tenant, None).await.unwrap();
    let mut first = commit_of(&ws, vec![new_pack(1, &[1])], vec![pack_id(1)]);
    first.request_id = Some(CommitRequestId::generate());
    let mut stale = commit_of(&other, vec![new_pack(2, &[2])], vec![pack_id(2)]);
    stale.generation = Generation(0);
    // Fails on a foreign key after it has written the workspace's
    // sequence and its pack: its savepoint must take both back.
    let dangling = commit_of(&ws, vec![new_pack(3, &[3])], vec![pack_id(3), pack_id(7)]);
    let second = commit_of(&ws, Vec::new(), vec![pack_id(1)]);
    let repeated = first.clone();
    let batch = vec![
        (tenant.clone(), first),
        (tenant.clone(), stale),
        (tenant.clone(), dangling),
        (tenant.clone(), second),
        (tenant.clone(), repeated),
    ];
    let results = db.commit_checkpoints_together(batch).await;
    assert_eq!(results.len(), 5);
    let first = results[0].as_ref().expect("the first commit is kept");
    assert_eq!(first.sequence, 1);
    assert!(
        matches!(results[1], Err(DbError::GenerationMismatch { .. })),
        "{:?}",
        results[1]
    );
    assert!(results[2].is_err(), "{:?}", results[2]);
    let second = results[3]
        .as_ref()
        .expect("a commit after refused ones is kept");
    assert_eq!(
        second.sequence, 2,
        "the refused commit took no sequence number"
    );
    let repeated = results[4].as_ref().expect("a repeated request is answered");
    assert_eq!(repeated.id, first.id);

    // Nothing of the refused commits stayed, and the repeated request
    // took no number either: the next commit is the third.
    assert!(
        db.workspace_packs(&tenant, &ws.id, &[pack_id(3)])
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        db.workspace_packs(&tenant, &other.id, &[pack_id(2)])
            .await
            .unwrap()
            .is_empty()
    );
    let third = db
        .commit_checkpoint(&tenant, commit_of(&ws, Vec::new(), vec![pack_id(1)]))
        .await
        .unwrap();
    assert_eq!(third.sequence, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commits_number_each_workspaces_checkpoints_without_gaps() {
    let (_dir, db, tenant) = open().await;
    let mut workspaces = Vec::new();
    for n in 0..4u8 {
        let ws = db.create_workspace(&tenant, None).await.unwrap();
        db.commit_checkpoint(
            &tenant,
            commit_of(&ws, vec![new_pack(n, &[n])], vec![pack_id(n)]),
        )
        .await
        .unwrap();
        workspaces.push((ws, pack_id(n)));
    }
    let commits = (0..40).map(|i| {
        let (ws, pack) = workspaces[i % 4].clone();
        let (db, tenant) = (db.clone(), tenant.clone());
        tokio::spawn(async move {
            db.commit_checkpoint(&tenant, commit_of(&ws, Vec::new(), vec![pack]))
                .await
                .map(|c| (ws.id.clone(), c.sequence))
        })
    });
    let mut sequences: BTreeMap<WorkspaceId, Vec<u64>> = BTreeMap::new();
    for joined in futures::future::join_all(commits).await {
        let (ws, sequence) = joined
            .expect("no commit panics")
            .expect("every commit is kept");
        sequences.entry(ws).or_default().push(sequence);
    }
    assert_eq!(sequences.len(), 4);
    for (ws, mut numbers) in sequences {
        numbers.sort_unstable();
        assert_eq!(numbers, (2..=11).collect::<Vec<u64>>(), "workspace {ws}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_heartbeats_that_write_each_record_their_own_reports() {
    use cairn_proto::runs::SandboxState;

    let (_dir, db, tenant) = open().await;
    let mut started = Vec::new();
    for n in 0..12 {
        let registration = hosts::HostRegistration {
            host_id: None,
            name: format!("h{n}"),
            labels: Default::default(),
            slots: 1,
            driver: "local".into(),
        };
        let hosts::Registered::Host { host, .. } = db
            .register_host(&tenant, registration, false, None)
            .await
            .unwrap()
        else {
            panic!("a new host registers");
        };
        let run = db.create_run(&tenant, new_run()).await.unwrap();
        let assignment = Assignment {
            run: run.id.clone(),
            attempt_count: 0,
            host: host.id.clone(),
            token_hash: [7; 32],
        };
        assert_eq!(db.assign_runs(&[assignment]).await.unwrap().len(), 1);
        let answer = db
            .heartbeat(&tenant, &host.id, &[], false, &[])
            .await
            .unwrap();
        started.push((host.id, run.id, answer.assignments[0].sandbox_id.clone()));
    }
    // Every host reports at once: half their sandbox running, half their
    // sandbox exited, each a write; each answer and record is its own.
    let beats = started.iter().enumerate().map(|(n, (host, _, sandbox))| {
        let (db, tenant, host) = (db.clone(), tenant.clone(), host.clone());
        let report = hosts::ReportedSandbox {
            sandbox_id: sandbox.clone(),
            state: if n % 2 == 0 {
                SandboxState::Running
            } else {
                SandboxState::Exited
            },
            exit_code: if n % 2 == 0 { 0 } else { 3 },
            detail: String::new(),
        };
        tokio::spawn(async move { db.heartbeat(&tenant, &host, &[report], false, &[]).await })
    });
    for answered in futures::future::join_all(beats).await {
        let answer = answered
            .expect("no heartbeat panics")
            .expect("every heartbeat is answered");
        assert!(
            answer.assignments.is_empty(),
            "a reported sandbox is not assigned again"
        );
    }
    // The running ones are written after their answers.
    db.write_deferred_reports().await;
    for (n, (_, run, _)) in started.iter().enumerate() {
        let attempt = db.attempt(run, 1).await.unwrap().unwrap();
        let expected = if n % 2 == 0 {
            SandboxState::Running
        } else {
            SandboxState::Exited
        };
        assert_eq!(attempt.sandbox_state, Some(expected), "run {n}");
    }
}

#[tokio::test]
async fn runs_on_new_workspaces_are_created_together_as_if_one_by_one() {
    let (_dir, db, tenant) = open().await;
    let mut laying = new_run();
    laying.lay = cairn_proto::stations::LaidFiles::try_from(
        [("notes/brief.md".to_owned(), b"read me".to_vec())]
            .into_iter()
            .collect::<HashMap<_, _>>(),
    )
    .unwrap();
    let batch = vec![
        runs::RunCreation {
            tenant: tenant.clone(),
            new: new_run(),
        },
        runs::RunCreation {
            tenant: tenant.clone(),
            new: named_run("named"),
        },
        runs::RunCreation {
            tenant: tenant.clone(),
            new: laying,
        },
    ];
    let changes = db.subscribe_runs();
    let mut tx = db.begin_write().await.unwrap();
    use group_commit::WriteRequest as _;
    assert!(runs::RunCreation::writes_all_at_once(&batch));
    let created: Vec<Run> = runs::RunCreation::write_all(&batch, &mut tx)
        .await
        .expect("every run is created")
        .into_iter()
        .map(|run| run.expect("no run is left to be created on its own"))
        .collect();
    db.commit(tx).await.unwrap();
    assert_eq!(created.len(), 3);
    assert_eq!(changes.len(), 3, "each new run is announced");

    let named = db
        .workspace(&tenant, &WorkspaceRef::Name("named".into()))
        .await
        .unwrap()
        .expect("the named workspace is committed");
    assert_eq!(named.id, created[1].workspace_id);
    assert_eq!(created[2].laid_paths, ["notes/brief.md"]);
    for run in &created {
        let stored = db.run(&tenant, &run.id).await.unwrap().expect("committed");
        assert_eq!(stored.state, RunState::Queued);
        assert_eq!(stored.workspace_id, run.workspace_id);
        let events = db.run_events(&run.id, 0, 10).await.unwrap();
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].sequence, 1);
        assert_eq!(events[0].reason, run_records::event_reason::CREATED);
        // Each workspace starts a key lineage of its own.
        let key = db.current_key(&tenant, &run.workspace_id).await.unwrap();
        assert_eq!(key.key_id, FIRST_KEY_ID);
    }
    assert_ne!(
        db.current_key(&tenant, &created[0].workspace_id)
            .await
            .unwrap(),
        db.current_key(&tenant, &created[2].workspace_id)
            .await
            .unwrap()
    );
    // The next event follows the first: the run counts it.
    db.cancel_run(&tenant, &created[0].id, "not needed")
        .await
        .unwrap();
    let events = db.run_events(&created[0].id, 0, 10).await.unwrap();
    assert_eq!(
        events.iter().map(|e| e.sequence).collect::<Vec<_>>(),
        (1..=events.len() as u64).collect::<Vec<_>>()
    );
    assert!(events.len() >= 2, "{events:?}");
}

/// Registers a host named `name` with `slots` slots.
async fn register(db: &MetadataStore, tenant: &TenantId, name: &str, slots: u32) -> HostId {
    let registration = hosts::HostRegistration {
        host_id: None,
        name: name.into(),
        labels: Default::default(),
        slots,
        driver: "local".into(),
    };
    match db.register_host(tenant, registration, false, None).await {
        Ok(hosts::Registered::Host { host, .. }) => host.id,
        other => panic!("a new host registers: {other:?}"),
    }
}

/// A host of one slot named `name` and a run on a new workspace assigned to
/// it (its sandbox is `sbx-RUN-a1`).
async fn assigned_run(db: &MetadataStore, tenant: &TenantId, name: &str) -> (HostId, Run) {
    let host = register(db, tenant, name, 1).await;
    let run = db.create_run(tenant, new_run()).await.unwrap();
    let assignment = Assignment {
        run: run.id.clone(),
        attempt_count: 0,
        host: host.clone(),
        token_hash: [0; 32],
    };
    assert_eq!(db.assign_runs(&[assignment]).await.unwrap().len(), 1);
    (host, run)
}

#[tokio::test]
async fn assignments_written_together_read_back_as_if_one_by_one() {
    let (_dir, db, tenant) = open().await;
    let hosts = [
        register(&db, &tenant, "a", 2).await,
        register(&db, &tenant, "b", 2).await,
    ];
    let mut runs = Vec::new();
    for _ in 0..4 {
        runs.push(db.create_run(&tenant, new_run()).await.unwrap());
    }
    // Run 1's workspace is finished behind the scheduler's back.
    sqlx::query("UPDATE workspaces SET state = 'finished' WHERE id = $1")
        .bind(runs[1].workspace_id.as_str())
        .execute(&db.pool)
        .await
        .unwrap();
    let assignment = |run: usize, host: usize| Assignment {
        run: runs[run].id.clone(),
        attempt_count: 0,
        host: hosts[host].clone(),
        token_hash: [u8::try_from(run).unwrap() + 1; 32],
    };
    let changes = db.subscribe_runs();
    let assigned = db
        .assign_runs(&[
            assignment(0, 0),
            assignment(1, 0),
            assignment(2, 1),
            assignment(3, 0),
        ])
        .await
        .unwrap();
    let assigned_ids: Vec<&RunId> = assigned.iter().map(|r| &r.id).collect();
    assert_eq!(assigned_ids, [&runs[0].id, &runs[2].id, &runs[3].id]);
    assert_eq!(changes.len(), 4, "every run the batch moved is announced");

    let failed = db.run(&tenant, &runs[1].id).await.unwrap().unwrap();
    assert_eq!(failed.state, RunState::Failed);
    assert!(failed.attempts.is_empty());
    assert_eq!(
        failed.state_reason,
        format!("workspace {} is no longer active", runs[1].workspace_id)
    );

    // A run assigned alone takes the one-by-one path: the batch must have
    // written the same things.
    let alone = db.create_run(&tenant, new_run()).await.unwrap();
    let alone_assigned = db
        .assign_runs(&[Assignment {
            run: alone.id.clone(),
            attempt_count: 0,
            host: hosts[1].clone(),
            token_hash: [9; 32],
        }])
        .await
        .unwrap();
    assert_eq!(alone_assigned.len(), 1);
    let written = |run: &Run| {
        let attempt = run.current_attempt().expect("an attempt").clone();
        (
            run.state,
            run.state_reason.replace(attempt.host_id.as_str(), "HOST"),
            run.attempt_count,
            attempt.number,
            attempt.state,
            attempt.generation,
            attempt.sandbox_id.replace(run.id.as_str(), "RUN"),
        )
    };
    let expected = written(&db.run(&tenant, &alone.id).await.unwrap().unwrap());
    for (n, run) in assigned.iter().enumerate() {
        let stored = db.run(&tenant, &run.id).await.unwrap().unwrap();
        assert_eq!(
            stored.attempts, run.attempts,
            "run {n} reads back as returned"
        );
        assert_eq!(written(&stored), expected, "run {n}");
        let events = db.run_events(&run.id, 0, 10).await.unwrap();
        let reasons: Vec<(u64, &str, RunState)> = events
            .iter()
            .map(|e| (e.sequence, e.reason.as_str(), e.state))
            .collect();
        assert_eq!(
            reasons,
            [
                (1, "created", RunState::Queued),
                (2, "assigned", RunState::Assigned)
            ]
        );
        let attempt = stored.current_attempt().unwrap();
        assert_eq!(events[1].host_id, attempt.host_id.as_str());
        assert_eq!(
            (events[1].attempt, events[1].generation),
            (1, attempt.generation.0)
        );
        assert_eq!(
            events[1].detail,
            format!(
                "attempt 1 on host {} (sandbox {}, generation {})",
                attempt.host_id, attempt.sandbox_id, attempt.generation
            )
        );
    }
    // Each attempt's run token is recorded, bound to its run and attempt.
    for (n, hash) in [(0, [1; 32]), (2, [3; 32]), (3, [4; 32])] {
        let token = db
            .token(&hash)
            .await
            .unwrap()
            .expect("the run token is stored");
        let binding = token.run.expect("a run token names its run");
        assert_eq!((binding.run, binding.attempt), (runs[n].id.clone(), 1));
    }
    assert!(
        db.token(&[2; 32]).await.unwrap().is_none(),
        "no token for a failed run"
    );
}

/// Four hosts of one slot (a, b, c, d), each with a run on a new workspace
/// assigned: host, run and sandbox id.
struct FourAssigned {
    tenant: TenantId,
    started: Vec<(HostId, Run, String)>,
}

impl FourAssigned {
    async fn new(db: &MetadataStore, tenant: &TenantId) -> Self {
        let mut started = Vec::new();
        for name in ["a", "b", "c", "d"] {
            let (host, run) = assigned_run(db, tenant, name).await;
            let sandbox = format!("sbx-{}-a1", run.id);
            started.push((host, run, sandbox));
        }
        Self {
            tenant: tenant.clone(),
            started,
        }
    }

    /// Host `n`'s sandbox, reported in `state`.
    fn report(&self, n: usize, state: cairn_proto::runs::SandboxState) -> hosts::ReportedSandbox {
        hosts::ReportedSandbox {
            sandbox_id: self.started[n].2.clone(),
            state,
            exit_code: 0,
            detail: String::new(),
        }
    }

    /// A heartbeat of host `n` at `now`.
    fn heartbeat(
        &self,
        n: usize,
        reports: Vec<hosts::ReportedSandbox>,
        kept: Vec<WorkspaceId>,
        now: i64,
    ) -> hosts::Heartbeat {
        hosts::Heartbeat {
            tenant: self.tenant.clone(),
            host_id: self.started[n].0.clone(),
            reports,
            stopping: false,
            kept,
            now,
        }
    }
}

#[tokio::test]
async fn heartbeats_written_together_record_what_each_reports_or_are_left_to_write_alone() {
    use cairn_proto::runs::SandboxState;
    use group_commit::WriteRequest as _;

    let (_dir, db, tenant) = open().await;
    let four = FourAssigned::new(&db, &tenant).await;
    let started = &four.started;
    let report = |n: usize, state: SandboxState| four.report(n, state);
    // Later than registration, so a lease written shows.
    let now = millis(std::time::SystemTime::now()) + 1_000;
    let heartbeat = |n: usize, reports: Vec<hosts::ReportedSandbox>, kept: Vec<WorkspaceId>| {
        four.heartbeat(n, reports, kept, now)
    };
    let host_b = db.host(&tenant, started[1].0.as_str()).await.unwrap();
    let kept = vec![started[2].1.workspace_id.clone()];
    let batch = [
        // Host a: its sandbox runs now.
        heartbeat(0, vec![report(0, SandboxState::Running)], vec![]),
        // Host b: its sandbox exited, which ends an attempt: left alone.
        heartbeat(1, vec![report(1, SandboxState::Exited)], vec![]),
        // Host c: keeps a tree now, sandbox not started yet.
        heartbeat(2, vec![], kept.clone()),
        // Host a again: a second heartbeat of one host is left alone.
        heartbeat(0, vec![report(0, SandboxState::Running)], vec![]),
        // Host d: nothing changes but its lease.
        heartbeat(3, vec![], vec![]),
    ];
    // As the group commit writes them: without the write lock.
    let mut tx = db.begin_batch(TxLock::Nothing).await.unwrap();
    assert!(hosts::Heartbeat::writes_all_at_once(&batch));
    let answers = hosts::Heartbeat::write_all(&batch, &mut tx).await.unwrap();
    db.commit(tx).await.unwrap();

    let answered: Vec<bool> = answers.iter().map(Option::is_some).collect();
    assert_eq!(answered, [true, false, true, false, true]);
    let assignments = |n: usize| answers[n].as_ref().unwrap().assignments.clone();
    assert!(
        assignments(0).is_empty(),
        "a running sandbox is not assigned again"
    );
    for n in [2, 4] {
        let host = if n == 2 { 2 } else { 3 };
        let assigned = assignments(n);
        let sandboxes: Vec<&str> = assigned.iter().map(|a| a.sandbox_id.as_str()).collect();
        assert_eq!(sandboxes, [started[host].2.as_str()], "heartbeat {n}");
    }
    let attempt = |n: usize| {
        let run = started[n].1.id.clone();
        let db = db.clone();
        async move { db.attempt(&run, 1).await.unwrap().unwrap() }
    };
    assert_eq!(attempt(0).await.sandbox_state, Some(SandboxState::Running));
    assert_eq!(
        attempt(1).await.sandbox_state,
        None,
        "left for its own write"
    );
    assert_eq!(attempt(2).await.sandbox_state, None);
    for (n, kept_now) in [(0, vec![]), (2, kept), (3, vec![])] {
        let host = db.host(&tenant, started[n].0.as_str()).await.unwrap();
        assert!(
            host.last_heartbeat_at < from_millis(now),
            "host {n}'s lease waits in memory for the flush"
        );
        assert_eq!(host.kept_workspaces, kept_now, "host {n}'s kept trees");
    }
    let left = db.host(&tenant, started[1].0.as_str()).await.unwrap();
    assert_eq!(left, host_b, "the heartbeat left alone wrote nothing");
}

#[tokio::test]
async fn heartbeats_read_together_are_answered_and_what_they_report_is_written_after() {
    use cairn_proto::runs::SandboxState;

    let (_dir, db, tenant) = open().await;
    let four = FourAssigned::new(&db, &tenant).await;
    let started = &four.started;
    let report = |n: usize, state: SandboxState| four.report(n, state);
    let now = millis(std::time::SystemTime::now());
    let heartbeat = |n: usize, reports: Vec<hosts::ReportedSandbox>, kept: Vec<WorkspaceId>| {
        four.heartbeat(n, reports, kept, now)
    };
    let kept = vec![started[2].1.workspace_id.clone()];
    let batch = vec![
        // Host a: its sandbox runs now (a planned write).
        heartbeat(0, vec![report(0, SandboxState::Running)], vec![]),
        // Host b: its sandbox exited, which ends an attempt: never planned.
        heartbeat(1, vec![report(1, SandboxState::Exited)], vec![]),
        // Host c: keeps a tree now (a planned write of its host row).
        heartbeat(2, vec![], kept.clone()),
        // Host a again: its second heartbeat of a batch writes alone.
        heartbeat(0, vec![report(0, SandboxState::Starting)], vec![]),
        // Host d: nothing to write.
        heartbeat(3, vec![], vec![]),
    ];
    let answers = hosts::read_heartbeats(db.clone(), batch).await;
    let outcome: Vec<&str> = answers
        .iter()
        .map(|answer| match answer {
            Ok(hosts::ReadAnswer::Answered(_)) => "answered",
            Ok(hosts::ReadAnswer::MustWrite(_)) => "must write",
            Err(e) => panic!("a heartbeat is refused: {e}"),
        })
        .collect();
    let attempt = |n: usize| {
        let run = started[n].1.id.clone();
        let db = db.clone();
        async move { db.attempt(&run, 1).await.unwrap().unwrap() }
    };
    let host = |n: usize| {
        let id = started[n].0.clone();
        let (db, tenant) = (db.clone(), tenant.clone());
        async move { db.host(&tenant, id.as_str()).await.unwrap() }
    };
    assert_eq!(
        outcome,
        [
            "answered",
            "must write",
            "answered",
            "must write",
            "answered"
        ]
    );
    // What hosts a and c reported is written after their answers.
    db.write_deferred_reports().await;
    assert_eq!(attempt(0).await.sandbox_state, Some(SandboxState::Running));
    assert_eq!(host(2).await.kept_workspaces, kept);
    assert_eq!(
        attempt(1).await.sandbox_state,
        None,
        "left for its own write"
    );
    let Ok(hosts::ReadAnswer::Answered(answer)) = &answers[4] else {
        unreachable!("checked above");
    };
    let assigned: Vec<&str> = answer
        .assignments
        .iter()
        .map(|a| a.sandbox_id.as_str())
        .collect();
    assert_eq!(
        assigned,
        [started[3].2.as_str()],
        "host d still has its run to start"
    );
}

#[tokio::test]
async fn a_sandbox_reported_and_not_written_yet_is_not_taken_for_one_to_start() {
    use cairn_proto::runs::SandboxState;

    let (_dir, db, tenant) = open().await;
    let four = FourAssigned::new(&db, &tenant).await;
    let (host, run, sandbox) = &four.started[0];
    // Another writer holds the attempt's row: the report waits to be written.
    let mut held = db.begin_write().await.unwrap();
    sqlx::query("UPDATE attempts SET exit_code = exit_code WHERE sandbox_id = $1")
        .bind(sandbox.as_str())
        .execute(held.conn())
        .await
        .unwrap();
    let bound = Duration::from_secs(30);
    let running = [four.report(0, SandboxState::Running)];
    let answer = tokio::time::timeout(bound, db.heartbeat(&tenant, host, &running, false, &[]))
        .await
        .expect("a report is answered before it is written")
        .unwrap();
    assert!(answer.assignments.is_empty());

    // The host lost track of it and leaves it out: it is gone, not a
    // sandbox to start again; that is written after the report before it.
    let forgotten = tokio::spawn({
        let (db, tenant, host) = (db.clone(), tenant.clone(), host.clone());
        async move { db.heartbeat(&tenant, &host, &[], false, &[]).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !forgotten.is_finished(),
        "the sandbox gone waits for the report before it to be written"
    );
    held.rollback().await.unwrap();
    let answer = tokio::time::timeout(bound, forgotten)
        .await
        .expect("written once the row is free")
        .unwrap()
        .unwrap();
    assert!(answer.assignments.is_empty(), "not assigned again");
    let attempt = db.attempt(&run.id, 1).await.unwrap().unwrap();
    assert_eq!(attempt.sandbox_state, Some(SandboxState::Failed));
    assert!(attempt.sandbox_gone_at.is_some());
}

#[tokio::test]
async fn reports_of_one_host_written_together_keep_its_later_kept_trees() {
    let (_dir, db, tenant) = open().await;
    let four = FourAssigned::new(&db, &tenant).await;
    let host = &four.started[0].0;
    let earlier = vec![four.started[1].1.workspace_id.clone()];
    let later = vec![four.started[2].1.workspace_id.clone()];
    // Two heartbeats' reports, deferred and written in one batch.
    let batch = vec![
        hosts::PlannedWrites::kept(host, &earlier),
        hosts::PlannedWrites::kept(host, &later),
    ];
    let written = hosts::write_reports(db.clone(), batch).await;
    assert!(written.iter().all(Result::is_ok));
    let stored = db.host(&tenant, host.as_str()).await.unwrap();
    assert_eq!(stored.kept_workspaces, later);
}

#[tokio::test]
async fn a_report_written_after_its_answer_leaves_a_sandbox_gone_since_as_it_went() {
    use cairn_proto::runs::SandboxState;

    let (_dir, db, tenant) = open().await;
    let four = FourAssigned::new(&db, &tenant).await;
    let now = millis(std::time::SystemTime::now());
    // Host a reports its sandbox running, and its answer goes out; before
    // that report is written, the host's next heartbeat reports it exited.
    let running = hosts::PlannedWrites::sandbox_state(&four.started[0].2, SandboxState::Running);
    let exited = four.heartbeat(0, vec![four.report(0, SandboxState::Exited)], vec![], now);
    let answers = group_commit::write_together(&db, vec![exited]).await;
    assert!(answers[0].is_ok(), "{:?}", answers[0].as_ref().err());
    let written = hosts::write_reports(db.clone(), vec![running]).await;
    assert!(written[0].is_ok());
    let attempt = db.attempt(&four.started[0].1.id, 1).await.unwrap().unwrap();
    assert_eq!(attempt.sandbox_state, Some(SandboxState::Exited));
    assert!(attempt.sandbox_gone_at.is_some());
}

#[tokio::test]
async fn a_heartbeat_batch_answers_each_whether_planned_or_left_to_write_alone() {
    use cairn_proto::runs::SandboxState;

    let (_dir, db, tenant) = open().await;
    let mut started = Vec::new();
    for name in ["a", "b"] {
        started.push(assigned_run(&db, &tenant, name).await);
    }
    let heartbeat = |n: usize, state: SandboxState| hosts::Heartbeat {
        tenant: tenant.clone(),
        host_id: started[n].0.clone(),
        reports: vec![hosts::ReportedSandbox {
            sandbox_id: format!("sbx-{}-a1", started[n].1.id),
            state,
            exit_code: 0,
            detail: String::new(),
        }],
        stopping: false,
        kept: vec![],
        now: millis(std::time::SystemTime::now()),
    };
    // Host a's report is planned (written beside the write lock on
    // PostgreSQL); host b's exit ends an attempt, so it is written on its
    // own afterwards, under the lock: two transactions, each answer kept.
    let batch = vec![
        heartbeat(0, SandboxState::Running),
        heartbeat(1, SandboxState::Exited),
    ];
    let answers = group_commit::write_together(&db, batch).await;
    assert_eq!(answers.len(), 2);
    for (n, answer) in answers.iter().enumerate() {
        let answer = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("heartbeat {n}: {e}"));
        assert!(answer.assignments.is_empty(), "heartbeat {n}");
    }
    let attempt = |n: usize| {
        let run = started[n].1.id.clone();
        let db = db.clone();
        async move { db.attempt(&run, 1).await.unwrap().unwrap() }
    };
    assert_eq!(attempt(0).await.sandbox_state, Some(SandboxState::Running));
    let exited = attempt(1).await;
    assert_eq!(exited.sandbox_state, Some(SandboxState::Exited));
    assert!(exited.is_ended(), "the exit ended the attempt");
}

#[tokio::test]
async fn runs_on_new_workspaces_and_sandbox_reports_are_written_while_the_write_lock_is_held() {
    use cairn_proto::runs::SandboxState;

    let (_dir, db, tenant) = open().await;
    if skipped_off_postgres(&db, "SQLite has one writer") {
        return;
    }
    let (host, assigned) = assigned_run(&db, &tenant, "h").await;

    // A scheduler pass (or any write transaction) holds the lock
    // meanwhile: these must not wait for it. (The bound only keeps a
    // regression from hanging the suite.)
    let held = db.begin_write().await.unwrap();
    let bound = Duration::from_secs(60);
    let created = tokio::time::timeout(bound, db.create_run(&tenant, new_run()))
        .await
        .expect("a run on a new workspace is created beside the write lock")
        .unwrap();
    let running = [hosts::ReportedSandbox {
        sandbox_id: format!("sbx-{}-a1", assigned.id),
        state: SandboxState::Running,
        exit_code: 0,
        detail: String::new(),
    }];
    tokio::time::timeout(bound, db.heartbeat(&tenant, &host, &running, false, &[]))
        .await
        .expect("a sandbox report is answered beside the write lock")
        .unwrap();
    tokio::time::timeout(bound, db.write_deferred_reports())
        .await
        .expect("a sandbox report is written beside the write lock");
    let attempt = db.attempt(&assigned.id, 1).await.unwrap().unwrap();
    assert_eq!(attempt.sandbox_state, Some(SandboxState::Running));
    assert_eq!(
        db.run(&tenant, &created.id).await.unwrap().unwrap().state,
        RunState::Queued
    );
    held.rollback().await.unwrap();
}

/// Two replicas relaying each other's announcements, as their servers do.
struct Relays {
    stop: tokio_util::sync::CancellationToken,
    tasks: [tokio::task::JoinHandle<()>; 2],
}

impl Relays {
    /// Starts both relays and waits until both listen (a replica trusts
    /// its token cache once it hears revocations).
    async fn listening(one: &MetadataStore, other: &MetadataStore) -> Self {
        let stop = tokio_util::sync::CancellationToken::new();
        let tasks = [one, other].map(|store| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move { store.relay_run_changes(stop.cancelled_owned()).await })
        });
        tokio::time::timeout(Duration::from_secs(30), async {
            while !(one.token_cache.trusted() && other.token_cache.trusted()) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("both replicas listen for announcements");
        Self { stop, tasks }
    }

    async fn stop(self) {
        self.stop.cancel();
        for task in self.tasks {
            task.await.unwrap();
        }
    }
}

#[tokio::test]
async fn a_replica_rings_the_hosts_it_ordered_once_and_the_other_replicas_too() {
    let (dir, db, tenant) = open().await;
    if skipped_off_postgres(&db, "SQLite has one coordinator, and no announcements") {
        return;
    }
    let other = MetadataStore::open(&test_location(dir.path()))
        .await
        .unwrap();
    let host = register(&db, &tenant, "h", 1).await;
    let mut here = db.order_bells().listen(&host);
    let mut there = other.order_bells().listen(&host);
    let relays = Relays::listening(&db, &other).await;
    let bound = Duration::from_secs(30);

    let mut tx = db.begin_write().await.unwrap();
    tx.ring(&host);
    db.commit(tx).await.unwrap();
    tokio::time::timeout(bound, there.wait_for(|rung| *rung >= 1))
        .await
        .expect("the other replica hears the announcement")
        .unwrap();
    // This replica heard its own announcement by now too (one listener
    // each, the same notification): it must not ring again.
    let mut tx = other.begin_write().await.unwrap();
    tx.ring(&host);
    other.commit(tx).await.unwrap();
    tokio::time::timeout(bound, here.wait_for(|rung| *rung >= 2))
        .await
        .expect("this replica hears the other's announcement")
        .unwrap();
    // An echo of its own would have come before the other's announcement
    // and rung a third time; give a late one a moment to show.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        *here.borrow(),
        2,
        "rung once at its own commit and once by the other's announcement"
    );
    relays.stop().await;
}

#[tokio::test]
async fn replicas_hear_each_other_however_they_name_a_long_schema() {
    let (dir, db, tenant) = open().await;
    if skipped_off_postgres(&db, "SQLite has one coordinator, and no announcements") {
        return;
    }
    let (url, short) = cairn_utils::testing::test_database(dir.path()).unwrap();
    // As long as a schema's name may be.
    let schema = format!(
        "{short}_{}",
        "x".repeat(location::MAX_SCHEMA_LEN - short.len() - 1)
    );
    let named = url
        .parse::<DatabaseLocation>()
        .unwrap()
        .in_schema(&schema)
        .unwrap();
    let one = MetadataStore::open(&named).await.unwrap();
    // The other names no schema: its URL's search_path finds the same one.
    let by_path: DatabaseLocation = named.sqlx_url().parse().unwrap();
    let other = MetadataStore::open(&by_path).await.unwrap();
    one.ensure_tenant(&tenant).await.unwrap();
    let host = register(&one, &tenant, "h", 1).await;
    let mut here = one.order_bells().listen(&host);
    let mut there = other.order_bells().listen(&host);
    let relays = Relays::listening(&one, &other).await;
    let bound = Duration::from_secs(30);

    let mut tx = one.begin_write().await.unwrap();
    tx.ring(&host);
    one.commit(tx)
        .await
        .expect("an announcement on a long schema's channel");
    tokio::time::timeout(bound, there.wait_for(|rung| *rung >= 1))
        .await
        .expect("the replica that names no schema hears the one that does")
        .unwrap();
    let mut tx = other.begin_write().await.unwrap();
    tx.ring(&host);
    other.commit(tx).await.unwrap();
    tokio::time::timeout(bound, here.wait_for(|rung| *rung >= 2))
        .await
        .expect("the replica that names the schema hears the one that does not")
        .unwrap();
    relays.stop().await;
}

#[tokio::test]
async fn every_text_column_on_postgresql_compares_bytes() {
    let (_dir, db, _tenant) = open().await;
    if skipped_off_postgres(&db, "a PostgreSQL schema's collations") {
        return;
    }
    // A text column added later without COLLATE "C" would compare through
    // strcoll again, and order ids differently from SQLite.
    let linguistic: Vec<String> = sqlx::query_scalar(
        "SELECT c.table_name || '.' || c.column_name
         FROM information_schema.columns c
         JOIN information_schema.tables t
           ON t.table_schema = c.table_schema AND t.table_name = c.table_name
         WHERE c.table_schema = current_schema() AND t.table_type = 'BASE TABLE'
           AND c.data_type = 'text' AND c.table_name NOT LIKE '\\_sqlx%'
           AND c.collation_name IS DISTINCT FROM 'C'
         ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(linguistic.is_empty(), "{linguistic:?}");
}

#[tokio::test]
async fn a_host_is_marked_lost_only_if_its_lease_is_still_stale_when_marked() {
    let (_dir, db, tenant) = open().await;
    let host = register(&db, &tenant, "h", 1).await;
    let renewed = millis(
        db.host(&tenant, host.as_str())
            .await
            .unwrap()
            .last_heartbeat_at,
    );
    let lease = Duration::from_secs(10);
    let now = renewed + 1;

    // The scheduler saw it stale against an older lease; the lease it
    // holds now was renewed since (not before the deadline).
    let mut tx = db.begin_write().await.unwrap();
    assert!(
        !hosts::lose_host(&mut tx, &host, lease, renewed, now)
            .await
            .unwrap()
    );
    db.commit(tx).await.unwrap();
    let kept = db.host(&tenant, host.as_str()).await.unwrap();
    assert_eq!(kept.lost_at, None, "a renewed lease keeps the host");

    let mut tx = db.begin_write().await.unwrap();
    assert!(
        hosts::lose_host(&mut tx, &host, lease, renewed + 1, now)
            .await
            .unwrap()
    );
    db.commit(tx).await.unwrap();
    let lost = db.host(&tenant, host.as_str()).await.unwrap();
    assert_eq!(lost.lost_at, Some(from_millis(now)));
}
