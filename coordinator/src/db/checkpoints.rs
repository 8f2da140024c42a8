//! Checkpoint, pack and blob records, and the atomic commit.

use std::collections::HashMap;
use std::time::SystemTime;

use super::sql::SqlBuilder;
use cairn_proto::domain::{CheckpointReason, NewPack, PackKind, WorkspaceRef, WorkspaceState};
use cairn_proto::ids::{
    BlobId, CheckpointId, CommitRequestId, Generation, PackId, TenantId, WorkspaceId,
};
use cairn_proto::pb;
use futures::future::BoxFuture;
use prost::Message;
use sqlx::any::AnyRow;
use sqlx::{Any, AnyConnection, Row};

use super::gc::{deletions_pending_in, recheck_packs_in};
use super::group_commit::{begin_savepoint, end_savepoint, fail_all, fail_batch};
use super::{
    Backend, Checkpoint, DbError, MetadataStore, NewCheckpoint, Pack, ROWS_PER_STATEMENT, WriteTx,
    from_millis, millis, parse_column, query_error, signed, unsigned,
};

/// What a commit checks before its transaction
/// ([`MetadataStore::commit_preflight`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPreflight {
    pub workspace_id: WorkspaceId,
    pub state: WorkspaceState,
    pub generation: Generation,
    /// The checkpoint a commit with the same request id made (its answer
    /// was cut off): the answer to this one.
    pub earlier: Option<CheckpointId>,
    /// Whether the commit's key is one of the workspace's.
    pub key_known: bool,
    /// Whether the commit's parent is a checkpoint of the workspace (true
    /// when it names none).
    pub parent_known: bool,
}

/// The packs a commit references that it did not upload, as the
/// workspace has them ([`MetadataStore::commit_packs`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitPacks {
    /// The referenced packs the workspace may reference, by id; others are
    /// left out, as unknown ids are.
    pub known: HashMap<PackId, Pack>,
    /// Whether one of the known packs holds the commit's root tree (and
    /// is neither lost nor superseded, so a restore could read it there).
    pub root_held: bool,
}

const CHECKPOINT_COLUMNS: &str = "c.id, c.workspace_id, c.sequence, c.parent_id, c.reason, c.generation,
     c.format_version, c.root_tree, c.key_id, c.stats, c.details, c.pack_count, c.stored_bytes, c.created_at";

/// The optional parts of a checkpoint, stored together as one protobuf
/// `cairn.v1.Checkpoint` holding only these fields.
fn encode_details(
    repos: &[pb::GitRepoState],
    warnings: &[String],
    harness: &Option<pb::HarnessSession>,
) -> Vec<u8> {
    pb::Checkpoint {
        repos: repos.to_vec(),
        warnings: warnings.to_vec(),
        harness: harness.clone(),
        ..Default::default()
    }
    .encode_to_vec()
}

fn checkpoint_from_row(row: &AnyRow) -> Result<Checkpoint, DbError> {
    let read = |source| DbError::Query {
        op: "read checkpoint",
        source,
    };
    let id: String = row.try_get("id").map_err(read)?;
    let workspace_id: String = row.try_get("workspace_id").map_err(read)?;
    let parent: Option<String> = row.try_get("parent_id").map_err(read)?;
    let reason: String = row.try_get("reason").map_err(read)?;
    let root_tree: Vec<u8> = row.try_get("root_tree").map_err(read)?;
    let stats: Vec<u8> = row.try_get("stats").map_err(read)?;
    let details: Vec<u8> = row.try_get("details").map_err(read)?;
    let corrupt = |what: &str, e: prost::DecodeError| {
        DbError::Corrupt(format!("stored {what} of checkpoint {id}: {e}"))
    };
    let stats = pb::CheckpointStats::decode(stats.as_slice()).map_err(|e| corrupt("stats", e))?;
    let details = pb::Checkpoint::decode(details.as_slice()).map_err(|e| corrupt("details", e))?;
    Ok(Checkpoint {
        id: parse_column(&id, "checkpoint id")?,
        workspace_id: parse_column(&workspace_id, "workspace id")?,
        sequence: unsigned(row.try_get("sequence").map_err(read)?, "sequence")?,
        parent: parent
            .map(|p| parse_column(&p, "parent checkpoint id"))
            .transpose()?,
        reason: parse_column::<CheckpointReason>(&reason, "reason")?,
        generation: Generation(unsigned(
            row.try_get("generation").map_err(read)?,
            "generation",
        )?),
        created_at: from_millis(row.try_get("created_at").map_err(read)?),
        format_version: unsigned(
            row.try_get("format_version").map_err(read)?,
            "format version",
        )?,
        root_tree: BlobId::from_slice(&root_tree)
            .map_err(|e| DbError::Corrupt(format!("stored root tree of checkpoint {id}: {e}")))?,
        key_id: row.try_get("key_id").map_err(read)?,
        stats,
        repos: details.repos,
        warnings: details.warnings,
        harness: details.harness,
        pack_count: unsigned(row.try_get("pack_count").map_err(read)?, "pack count")?,
        stored_bytes: unsigned(row.try_get("stored_bytes").map_err(read)?, "stored bytes")?,
    })
}

fn pack_from_row(row: &AnyRow) -> Result<Pack, DbError> {
    let read = |source| DbError::Query {
        op: "read pack",
        source,
    };
    let id: String = row.try_get("id").map_err(read)?;
    let kind: String = row.try_get("kind").map_err(read)?;
    Ok(Pack {
        id: parse_column(&id, "pack id")?,
        kind: parse_column::<PackKind>(&kind, "pack kind")?,
        size: unsigned(row.try_get("size").map_err(read)?, "pack size")?,
        index_offset: unsigned(row.try_get("index_offset").map_err(read)?, "index offset")?,
        index_length: unsigned(row.try_get("index_length").map_err(read)?, "index length")?,
    })
}

/// Appends ` (v1, v2, …)`, binding `bind(item)` for each item.
pub(super) fn push_in_list<'a, T, V>(
    query: &mut SqlBuilder<'a>,
    items: &'a [T],
    bind: impl Fn(&'a T) -> V,
) where
    V: 'a + sqlx::Encode<'a, Any> + sqlx::Type<Any>,
{
    query.push(" (");
    let mut list = query.separated(", ");
    for item in items {
        list.push_bind(bind(item));
    }
    query.push(")");
}

/// The rows of `select … IN (items)`, one statement per
/// [`ROWS_PER_STATEMENT`] items (`select` ends just before the list).
pub(super) async fn fetch_all_in<'a, T, V>(
    conn: &mut sqlx::AnyConnection,
    select: &str,
    items: &'a [T],
    bind: impl Fn(&'a T) -> V + Copy,
    op: &'static str,
) -> Result<Vec<sqlx::any::AnyRow>, DbError>
where
    V: 'a + sqlx::Encode<'a, Any> + sqlx::Type<Any>,
{
    let mut rows = Vec::new();
    for chunk in items.chunks(ROWS_PER_STATEMENT) {
        let mut query = SqlBuilder::new(select);
        push_in_list(&mut query, chunk, bind);
        rows.extend(
            query
                .build()
                .fetch_all(&mut *conn)
                .await
                .map_err(query_error(op))?,
        );
    }
    Ok(rows)
}

/// Records a pack that was uploaded and its blobs, inside `tx`. A pack
/// found lost earlier and uploaded again is back, one condemned or
/// superseded is in use again, and its blobs are declared again.
pub(super) async fn record_pack_in(
    tx: &mut sqlx::AnyConnection,
    tenant: &TenantId,
    pack: &NewPack,
    now_ms: i64,
) -> Result<(), DbError> {
    sqlx::query(
        "INSERT INTO packs (tenant, id, kind, size, index_offset, index_length, created_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (tenant, id)
         DO UPDATE SET lost_at = NULL, condemned_at = NULL, superseded_at = NULL",
    )
    .bind(tenant.as_str())
    .bind(pack.pack_id.as_str())
    .bind(pack.kind.as_str())
    .bind(signed(pack.size, "pack size")?)
    .bind(signed(pack.index_offset, "index offset")?)
    .bind(i64::from(pack.index_length))
    .bind(now_ms)
    .execute(&mut *tx)
    .await
    .map_err(query_error("insert pack"))?;
    for chunk in pack.blob_ids.chunks(ROWS_PER_STATEMENT) {
        let mut query = SqlBuilder::new("INSERT INTO blobs (tenant, blob_id, pack_id) ");
        query.push_values(chunk, |mut row, blob| {
            row.push_bind(tenant.as_str())
                .push_bind(blob.as_bytes().as_slice())
                .push_bind(pack.pack_id.as_str());
        });
        query.push(" ON CONFLICT (tenant, blob_id, pack_id) DO NOTHING");
        query
            .build()
            .execute(&mut *tx)
            .await
            .map_err(query_error("insert blobs"))?;
    }
    Ok(())
}

/// A checkpoint of `workspace`, read inside `tx`.
pub(super) async fn checkpoint_in(
    tx: &mut WriteTx,
    workspace: &WorkspaceId,
    id: &CheckpointId,
) -> Result<Option<Checkpoint>, DbError> {
    let sql = format!(
        "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints c WHERE c.workspace_id = $1 AND c.id = $2"
    );
    let row = sqlx::query(&sql)
        .bind(workspace.as_str())
        .bind(id.as_str())
        .fetch_optional(tx.conn())
        .await
        .map_err(query_error("checkpoint"))?;
    row.as_ref().map(checkpoint_from_row).transpose()
}

/// The newest checkpoint of `workspace`, read inside `tx`.
pub(super) async fn newest_checkpoint_in(
    tx: &mut WriteTx,
    workspace: &WorkspaceId,
) -> Result<Option<Checkpoint>, DbError> {
    let sql = format!(
        "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints c WHERE c.workspace_id = $1
         ORDER BY c.sequence DESC LIMIT 1"
    );
    let row = sqlx::query(&sql)
        .bind(workspace.as_str())
        .fetch_optional(tx.conn())
        .await
        .map_err(query_error("newest checkpoint"))?;
    row.as_ref().map(checkpoint_from_row).transpose()
}

/// Records a copy of `source` as checkpoint 1 of the new workspace `into`
/// (generation `generation`, no parent): the same root tree, key, stats,
/// details and pack rows. The fork may use those packs (and no other of the
/// source's), so nothing is copied in the store; the copy restores exactly
/// what the source does.
pub(super) async fn copy_checkpoint_in(
    tx: &mut WriteTx,
    tenant: &TenantId,
    source: &Checkpoint,
    into: &WorkspaceId,
    generation: Generation,
    now_ms: i64,
) -> Result<CheckpointId, DbError> {
    let id = CheckpointId::generate();
    let details = encode_details(&source.repos, &source.warnings, &source.harness);
    sqlx::query(
        "INSERT INTO checkpoints (id, workspace_id, sequence, parent_id, reason, generation, format_version,
                                  root_tree, key_id, stats, details, pack_count, stored_bytes, created_at)
         VALUES ($1, $2, 1, NULL, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
    )
    .bind(id.as_str())
    .bind(into.as_str())
    .bind(source.reason.as_str())
    .bind(signed(generation.0, "generation")?)
    .bind(i64::from(source.format_version))
    .bind(source.root_tree.as_bytes().as_slice())
    .bind(source.key_id.as_str())
    .bind(source.stats.encode_to_vec())
    .bind(details)
    .bind(i64::from(source.pack_count))
    .bind(signed(source.stored_bytes, "stored bytes")?)
    .bind(now_ms)
    .execute(tx.conn())
    .await
    .map_err(query_error("insert forked checkpoint"))?;
    sqlx::query(
        "INSERT INTO checkpoint_packs (checkpoint_id, tenant, pack_id)
         SELECT $1, $2, pack_id FROM checkpoint_packs WHERE checkpoint_id = $3 AND tenant = $2",
    )
    .bind(id.as_str())
    .bind(tenant.as_str())
    .bind(source.id.as_str())
    .execute(tx.conn())
    .await
    .map_err(query_error("copy checkpoint packs"))?;
    sqlx::query(
        "INSERT INTO workspace_packs (workspace_id, tenant, pack_id)
         SELECT $1, $2, pack_id FROM checkpoint_packs WHERE checkpoint_id = $3 AND tenant = $2
         ON CONFLICT (workspace_id, pack_id) DO NOTHING",
    )
    .bind(into.as_str())
    .bind(tenant.as_str())
    .bind(source.id.as_str())
    .execute(tx.conn())
    .await
    .map_err(query_error("copy workspace packs"))?;
    Ok(id)
}

impl MetadataStore {
    /// The newest checkpoint of each of `workspaces` that has one.
    pub async fn latest_checkpoints(
        &self,
        workspaces: &[WorkspaceId],
    ) -> Result<HashMap<WorkspaceId, Checkpoint>, DbError> {
        let mut latest = HashMap::new();
        for chunk in workspaces.chunks(ROWS_PER_STATEMENT) {
            let mut query = SqlBuilder::new(format!(
                "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints c
                 JOIN (SELECT workspace_id, MAX(sequence) AS sequence FROM checkpoints
                       WHERE workspace_id IN"
            ));
            push_in_list(&mut query, chunk, WorkspaceId::as_str);
            query.push(
                " GROUP BY workspace_id) newest
                 ON c.workspace_id = newest.workspace_id AND c.sequence = newest.sequence",
            );
            let rows = query
                .build()
                .fetch_all(&self.pool)
                .await
                .map_err(query_error("latest checkpoints"))?;
            for row in &rows {
                let checkpoint = checkpoint_from_row(row)?;
                latest.insert(checkpoint.workspace_id.clone(), checkpoint);
            }
        }
        Ok(latest)
    }

    /// A checkpoint of one of `tenant`'s workspaces.
    pub async fn checkpoint(
        &self,
        tenant: &TenantId,
        id: &CheckpointId,
    ) -> Result<Option<Checkpoint>, DbError> {
        let sql = format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints c JOIN workspaces w ON w.id = c.workspace_id
             WHERE w.tenant = $1 AND c.id = $2"
        );
        let row = sqlx::query(&sql)
            .bind(tenant.as_str())
            .bind(id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(query_error("checkpoint"))?;
        row.as_ref().map(checkpoint_from_row).transpose()
    }

    /// What a commit to workspace `reference` checks before its
    /// transaction, in one statement: the workspace's standing, the
    /// checkpoint an earlier commit with the same `request` made, whether
    /// `key_id` is a key of the workspace (of its lineage, or of its tenant
    /// for workspaces older than lineages), and whether `parent` is one of
    /// its checkpoints. None: no such workspace in `tenant`.
    pub async fn commit_preflight(
        &self,
        tenant: &TenantId,
        reference: &WorkspaceRef,
        key_id: &str,
        parent: Option<&CheckpointId>,
        request: Option<&CommitRequestId>,
    ) -> Result<Option<CommitPreflight>, DbError> {
        let (condition, value) = match reference {
            WorkspaceRef::Id(id) => ("w.id", id.as_str()),
            WorkspaceRef::Name(name) => ("w.name", name.as_str()),
        };
        let sql = format!(
            "SELECT w.id, w.state, w.generation,
               (SELECT c.id FROM checkpoints c
                 WHERE c.workspace_id = w.id AND c.request_id = $3) AS earlier,
               CASE WHEN w.lineage IS NULL
                 THEN (SELECT COUNT(*) FROM tenant_keys k WHERE k.tenant = w.tenant AND k.key_id = $4)
                 ELSE (SELECT COUNT(*) FROM lineage_keys k WHERE k.lineage = w.lineage AND k.key_id = $4)
               END AS keys,
               (SELECT COUNT(*) FROM checkpoints p WHERE p.workspace_id = w.id AND p.id = $5) AS parents
             FROM workspaces w WHERE w.tenant = $1 AND {condition} = $2"
        );
        let row = sqlx::query(&sql)
            .bind(tenant.as_str())
            .bind(value)
            .bind(request.map(CommitRequestId::as_str))
            .bind(key_id)
            .bind(parent.map(CheckpointId::as_str))
            .fetch_optional(&self.pool)
            .await
            .map_err(query_error("commit preflight"))?;
        let Some(row) = row else { return Ok(None) };
        let read = |source| DbError::Query {
            op: "read commit preflight",
            source,
        };
        let id: String = row.try_get("id").map_err(read)?;
        let state: String = row.try_get("state").map_err(read)?;
        let generation: i64 = row.try_get("generation").map_err(read)?;
        let earlier: Option<String> = row.try_get("earlier").map_err(read)?;
        let keys: i64 = row.try_get("keys").map_err(read)?;
        let parents: i64 = row.try_get("parents").map_err(read)?;
        Ok(Some(CommitPreflight {
            workspace_id: parse_column(&id, "workspace id")?,
            state: parse_column(&state, "workspace state")?,
            generation: Generation(unsigned(generation, "generation")?),
            earlier: earlier
                .map(|id| parse_column(&id, "checkpoint id"))
                .transpose()?,
            key_known: keys > 0,
            parent_known: parent.is_none() || parents > 0,
        }))
    }

    /// Checkpoints of a workspace, newest first, with a sequence below `before`.
    pub async fn list_checkpoints(
        &self,
        workspace: &WorkspaceId,
        before: Option<u64>,
        limit: u32,
    ) -> Result<Vec<Checkpoint>, DbError> {
        let sql = format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints c
             WHERE c.workspace_id = $1 AND c.sequence < $2 ORDER BY c.sequence DESC LIMIT $3"
        );
        let before = before.map_or(Ok(i64::MAX), |b| signed(b, "sequence"))?;
        let rows = sqlx::query(&sql)
            .bind(workspace.as_str())
            .bind(before)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(query_error("list checkpoints"))?;
        rows.iter().map(checkpoint_from_row).collect()
    }

    /// Which of `blobs` `workspace` has, and in which pack: only packs in
    /// the workspace's own scope count (see `workspace_packs`), so another
    /// workspace's uploads are never an answer. Blobs whose pack was found
    /// lost are not had: they must be uploaded again.
    pub async fn find_blobs(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
        blobs: &[BlobId],
    ) -> Result<HashMap<BlobId, PackId>, DbError> {
        let mut found = HashMap::new();
        for chunk in blobs.chunks(ROWS_PER_STATEMENT) {
            let mut query = SqlBuilder::new(
                "SELECT b.blob_id, b.pack_id FROM blobs b
                 JOIN workspace_packs wp ON wp.tenant = b.tenant AND wp.pack_id = b.pack_id
                 JOIN packs p ON p.tenant = b.tenant AND p.id = b.pack_id
                 WHERE p.lost_at IS NULL AND p.superseded_at IS NULL AND wp.workspace_id = ",
            );
            query
                .push_bind(workspace.as_str())
                .push(" AND b.tenant = ")
                .push_bind(tenant.as_str())
                .push(" AND b.blob_id IN");
            push_in_list(&mut query, chunk, |b| b.as_bytes().as_slice());
            query.push(" ORDER BY b.blob_id, b.pack_id");
            let rows = query
                .build()
                .fetch_all(&self.pool)
                .await
                .map_err(query_error("find blobs"))?;
            for row in rows {
                let read = |source| DbError::Query {
                    op: "read blob",
                    source,
                };
                let blob: Vec<u8> = row.try_get("blob_id").map_err(read)?;
                let pack: String = row.try_get("pack_id").map_err(read)?;
                let blob = BlobId::from_slice(&blob)
                    .map_err(|e| DbError::Corrupt(format!("stored blob id: {e}")))?;
                // Any pack of the workspace's that holds it will do; the
                // first by id, so the answer is the same every time.
                found.entry(blob).or_insert(parse_column(&pack, "pack id")?);
            }
        }
        Ok(found)
    }

    /// The recorded packs among `ids` that `workspace` may reference: its
    /// own and those of the checkpoint it was forked from. Others are left
    /// out, as unknown ids are.
    pub async fn workspace_packs(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
        ids: &[PackId],
    ) -> Result<HashMap<PackId, Pack>, DbError> {
        Ok(self.scoped_packs(tenant, workspace, ids, None).await?.known)
    }

    /// What a commit needs to know of the packs it references without
    /// uploading them, in one statement per chunk: which of `ids` the
    /// workspace may reference (see [`Self::workspace_packs`]), and whether
    /// one of those holds `root`.
    pub async fn commit_packs(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
        ids: &[PackId],
        root: &BlobId,
    ) -> Result<CommitPacks, DbError> {
        self.scoped_packs(tenant, workspace, ids, Some(root)).await
    }

    /// [`Self::workspace_packs`], and whether one of them holds `root`.
    async fn scoped_packs(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
        ids: &[PackId],
        root: Option<&BlobId>,
    ) -> Result<CommitPacks, DbError> {
        let mut packs = CommitPacks::default();
        for chunk in ids.chunks(ROWS_PER_STATEMENT) {
            let mut query =
                SqlBuilder::new("SELECT p.id, p.kind, p.size, p.index_offset, p.index_length, ");
            match root {
                Some(root) => query
                    .push(
                        "CAST(CASE WHEN p.lost_at IS NULL AND p.superseded_at IS NULL AND EXISTS (
                           SELECT 1 FROM blobs b
                           WHERE b.tenant = p.tenant AND b.pack_id = p.id AND b.blob_id = ",
                    )
                    .push_bind(root.as_bytes().as_slice())
                    .push(") THEN 1 ELSE 0 END AS BIGINT)"),
                None => query.push("CAST(0 AS BIGINT)"),
            };
            query
                .push(
                    " AS holds_root FROM packs p
                     JOIN workspace_packs wp ON wp.tenant = p.tenant AND wp.pack_id = p.id
                     WHERE wp.workspace_id = ",
                )
                .push_bind(workspace.as_str())
                .push(" AND p.tenant = ")
                .push_bind(tenant.as_str())
                .push(" AND p.id IN");
            push_in_list(&mut query, chunk, PackId::as_str);
            let rows = query
                .build()
                .fetch_all(&self.pool)
                .await
                .map_err(query_error("workspace packs"))?;
            for row in &rows {
                let pack = pack_from_row(row)?;
                let holds_root: i64 =
                    row.try_get("holds_root").map_err(|source| DbError::Query {
                        op: "read workspace packs",
                        source,
                    })?;
                packs.root_held |= holds_root != 0;
                packs.known.insert(pack.id.clone(), pack);
            }
        }
        Ok(packs)
    }

    /// Marks recorded packs of `tenant` as lost from the store: their blobs
    /// stop counting as stored. Returns how many were newly marked.
    pub async fn mark_packs_lost(&self, tenant: &TenantId, ids: &[PackId]) -> Result<u64, DbError> {
        let now = millis(SystemTime::now());
        let mut marked = 0;
        for chunk in ids.chunks(ROWS_PER_STATEMENT) {
            let mut query = SqlBuilder::new("UPDATE packs SET lost_at = ");
            query
                .push_bind(now)
                .push(" WHERE lost_at IS NULL AND tenant = ")
                .push_bind(tenant.as_str())
                .push(" AND id IN");
            push_in_list(&mut query, chunk, PackId::as_str);
            marked += query
                .build()
                .execute(&self.pool)
                .await
                .map_err(query_error("mark packs lost"))?
                .rows_affected();
        }
        Ok(marked)
    }

    /// The packs each of `checkpoints` references, sorted by pack id.
    pub async fn checkpoint_packs(
        &self,
        checkpoints: &[CheckpointId],
    ) -> Result<HashMap<CheckpointId, Vec<PackId>>, DbError> {
        let mut by_checkpoint: HashMap<CheckpointId, Vec<PackId>> = HashMap::new();
        for chunk in checkpoints.chunks(ROWS_PER_STATEMENT) {
            let mut query = SqlBuilder::new(
                "SELECT checkpoint_id, pack_id FROM checkpoint_packs WHERE checkpoint_id IN",
            );
            push_in_list(&mut query, chunk, CheckpointId::as_str);
            query.push(" ORDER BY checkpoint_id, pack_id");
            let rows = query
                .build()
                .fetch_all(&self.pool)
                .await
                .map_err(query_error("checkpoint packs"))?;
            for row in rows {
                let read = |source| DbError::Query {
                    op: "read checkpoint pack",
                    source,
                };
                let checkpoint: String = row.try_get("checkpoint_id").map_err(read)?;
                let pack: String = row.try_get("pack_id").map_err(read)?;
                by_checkpoint
                    .entry(parse_column(&checkpoint, "checkpoint id")?)
                    .or_default()
                    .push(parse_column(&pack, "pack id")?);
            }
        }
        Ok(by_checkpoint)
    }

    /// Records a checkpoint in one transaction: the workspace's sequence
    /// counter, new packs (never one recorded for another workspace), their
    /// blobs, the checkpoint, its pack list and the workspace's scope.
    /// Refuses a workspace that is not active or whose generation differs
    /// from the commit's; nothing is written then.
    ///
    /// On SQLite, commits made while another is being written share the
    /// next transaction ([`super::group_commit`]), each in a savepoint of
    /// its own: one write lock and one log flush for the lot. PostgreSQL
    /// runs commits side by side and groups their flushes itself.
    pub async fn commit_checkpoint(
        &self,
        tenant: &TenantId,
        new: NewCheckpoint,
    ) -> Result<Checkpoint, DbError> {
        match &self.checkpoint_commits {
            Some(commits) => commits.submit(self, (tenant.clone(), new)).await,
            None => {
                let mut results = self
                    .commit_checkpoints_together(vec![(tenant.clone(), new)])
                    .await;
                results.pop().expect("one result per commit")
            }
        }
    }

    /// Commits a batch of checkpoints in one transaction, one result each,
    /// in order.
    pub(super) async fn commit_checkpoints_together(
        &self,
        batch: Vec<CheckpointCommit>,
    ) -> Vec<Result<Checkpoint, DbError>> {
        let total = batch.len();
        let now = SystemTime::now();
        let mut tx = match self.begin_commit().await {
            Ok(tx) => tx,
            Err(e) => return fail_all(total, &e),
        };
        let alone = total == 1;
        let mut recorded = Vec::with_capacity(total);
        for (tenant, new) in batch {
            if !alone && let Err(e) = begin_savepoint(&mut tx).await {
                return fail_batch(recorded, total, &e);
            }
            let outcome = record_checkpoint(&mut tx, self.backend, &tenant, new, now).await;
            let keep = matches!(outcome, Ok(Recorded::New(_)));
            let ended = if alone {
                Ok(())
            } else {
                end_savepoint(&mut tx, keep).await
            };
            recorded.push(outcome.map(|r| (tenant, r)));
            if let Err(e) = ended {
                return fail_batch(recorded, total, &e);
            }
        }
        // Alone, a commit refused or answered with an earlier checkpoint
        // has nothing to keep: its transaction is rolled back. In a batch,
        // its savepoint was.
        let kept = recorded
            .iter()
            .any(|r| matches!(r, Ok((_, Recorded::New(_)))));
        if kept || !alone {
            if let Err(e) = tx.commit().await.map_err(query_error("commit checkpoint")) {
                return fail_batch(recorded, total, &e);
            }
        } else {
            drop(tx);
        }
        let mut results = Vec::with_capacity(total);
        for outcome in recorded {
            results.push(match outcome {
                Ok((_, Recorded::New(checkpoint))) => Ok(checkpoint),
                Ok((tenant, Recorded::Earlier(id))) => {
                    self.checkpoint(&tenant, &id).await.and_then(|found| {
                        found.ok_or_else(|| {
                            DbError::Corrupt(format!("checkpoint {id} vanished while it was read"))
                        })
                    })
                }
                Err(e) => Err(e),
            });
        }
        results
    }
}

/// A checkpoint commit request: the tenant and what to record.
pub(crate) type CheckpointCommit = (TenantId, NewCheckpoint);

/// Commits a batch of checkpoints in one transaction (see
/// [`super::group_commit`]).
pub(crate) fn commit_checkpoint_batch(
    store: MetadataStore,
    batch: Vec<CheckpointCommit>,
) -> BoxFuture<'static, Vec<Result<Checkpoint, DbError>>> {
    Box::pin(async move { store.commit_checkpoints_together(batch).await })
}

/// What [`record_checkpoint`] did.
enum Recorded {
    New(Checkpoint),
    /// The same request was committed before (its answer was cut off):
    /// that checkpoint is the answer, whatever happened since. Nothing was
    /// written that should stay: undo it.
    Earlier(CheckpointId),
}

/// Records one checkpoint inside a commit transaction (see
/// [`MetadataStore::commit_checkpoint`]).
async fn record_checkpoint(
    conn: &mut AnyConnection,
    backend: Backend,
    tenant: &TenantId,
    new: NewCheckpoint,
    now: SystemTime,
) -> Result<Recorded, DbError> {
    let now_ms = millis(now);
    // Writing first takes SQLite's write lock (PostgreSQL: the workspace
    // row's) before anything is read, so commits of one workspace
    // serialize and number their checkpoints in order.
    let advanced = sqlx::query(
        "UPDATE workspaces SET last_sequence = last_sequence + 1, updated_at = $1
             WHERE id = $2 AND tenant = $3
             RETURNING last_sequence, generation, state",
    )
    .bind(now_ms)
    .bind(new.workspace_id.as_str())
    .bind(tenant.as_str())
    .fetch_optional(&mut *conn)
    .await
    .map_err(query_error("advance workspace sequence"))?
    .ok_or_else(|| DbError::WorkspaceNotFound(new.workspace_id.to_string()))?;
    // The same request committed already (its answer was cut off): that
    // checkpoint is the answer, whatever happened since. SQLite looks
    // first. PostgreSQL saves the round trip: the statement that writes
    // the checkpoint looks (it starts after this one waited for the
    // workspace row, so it sees a duplicate committed meanwhile), and a
    // refusal decided before it looks then.
    let looked_up_last = backend == Backend::Postgres;
    if !looked_up_last
        && let Some(made) = earlier_commit(conn, &new.workspace_id, new.request_id.as_ref()).await?
    {
        return Ok(Recorded::Earlier(made));
    }
    let workspace = new.workspace_id.clone();
    let request = new.request_id.clone();
    match record_advanced(conn, backend, tenant, new, &advanced, now_ms).await {
        Err(
            refusal @ (DbError::WorkspaceNotActive { .. }
            | DbError::GenerationMismatch { .. }
            | DbError::ForeignPack { .. }
            | DbError::PacksMissing { .. }),
        ) if looked_up_last => match earlier_commit(conn, &workspace, request.as_ref()).await? {
            Some(made) => Ok(Recorded::Earlier(made)),
            None => Err(refusal),
        },
        outcome => outcome,
    }
}

/// The checkpoint an earlier commit of `request` to `workspace` made.
async fn earlier_commit(
    conn: &mut AnyConnection,
    workspace: &WorkspaceId,
    request: Option<&CommitRequestId>,
) -> Result<Option<CheckpointId>, DbError> {
    let Some(request) = request else {
        return Ok(None);
    };
    let made: Option<String> = sqlx::query_scalar(
        "SELECT id FROM checkpoints WHERE workspace_id = $1 AND request_id = $2",
    )
    .bind(workspace.as_str())
    .bind(request.as_str())
    .fetch_optional(&mut *conn)
    .await
    .map_err(query_error("find commit request"))?;
    made.map(|id| parse_column(&id, "checkpoint id"))
        .transpose()
}

/// The rest of [`record_checkpoint`], once the workspace's sequence was
/// advanced (`row` is what that returned).
async fn record_advanced(
    conn: &mut AnyConnection,
    backend: Backend,
    tenant: &TenantId,
    new: NewCheckpoint,
    row: &AnyRow,
    now_ms: i64,
) -> Result<Recorded, DbError> {
    let read = |source| DbError::Query {
        op: "advance workspace sequence",
        source,
    };
    let sequence: u64 = unsigned(row.try_get("last_sequence").map_err(read)?, "sequence")?;
    let current = Generation(unsigned(
        row.try_get("generation").map_err(read)?,
        "generation",
    )?);
    let state: String = row.try_get("state").map_err(read)?;
    let state: WorkspaceState = parse_column(&state, "workspace state")?;
    if state != WorkspaceState::Active {
        return Err(DbError::WorkspaceNotActive {
            id: new.workspace_id,
            state,
        });
    }
    if new.generation != current {
        return Err(DbError::GenerationMismatch {
            given: new.generation,
            current,
        });
    }

    // A pack recorded for another workspace cannot be claimed as new:
    // that would put it in this workspace's scope (and its URLs in this
    // workspace's manifests) by knowing its id alone.
    let new_ids: Vec<&PackId> = new.new_packs.iter().map(|p| &p.pack_id).collect();
    for chunk in new_ids.chunks(ROWS_PER_STATEMENT) {
        let mut query = SqlBuilder::new("SELECT p.id FROM packs p WHERE p.tenant = ");
        query.push_bind(tenant.as_str()).push(" AND p.id IN");
        push_in_list(&mut query, chunk, |id: &&PackId| id.as_str());
        query
            .push(
                " AND NOT EXISTS (SELECT 1 FROM workspace_packs wp
                      WHERE wp.workspace_id = ",
            )
            .push_bind(new.workspace_id.as_str())
            .push(" AND wp.pack_id = p.id) LIMIT 1");
        let foreign: Option<String> = query
            .build_query_scalar()
            .fetch_optional(&mut *conn)
            .await
            .map_err(query_error("check new packs"))?;
        if let Some(pack) = foreign {
            return Err(DbError::ForeignPack {
                pack: parse_column(&pack, "pack id")?,
                workspace: new.workspace_id,
            });
        }
    }

    // A pack whose object a sweep is deleting cannot be recorded again
    // now: the object may go after this commit. Upload it again later.
    let pending = deletions_pending_in(conn, tenant, &new_ids).await?;
    if !pending.is_empty() {
        return Err(DbError::PacksMissing { packs: pending });
    }

    for pack in &new.new_packs {
        record_pack_in(conn, tenant, pack, now_ms).await?;
    }

    // What was checked before this transaction may have changed: a
    // sweep may have deleted a pack this checkpoint deduplicated
    // against since. Refused then, with the packs to upload again.
    let rechecked = recheck_packs_in(conn, tenant, &new.referenced_packs, true).await?;
    if !rechecked.unusable.is_empty() {
        return Err(DbError::PacksMissing {
            packs: rechecked.unusable,
        });
    }
    // A referenced pack is not garbage: absolve those a collection
    // condemned, so that its sweep leaves them.
    for chunk in rechecked.condemned.chunks(ROWS_PER_STATEMENT) {
        let mut query = SqlBuilder::new(
            "UPDATE packs SET condemned_at = NULL WHERE condemned_at IS NOT NULL AND tenant = ",
        );
        query.push_bind(tenant.as_str()).push(" AND id IN");
        push_in_list(&mut query, chunk, PackId::as_str);
        query
            .build()
            .execute(&mut *conn)
            .await
            .map_err(query_error("absolve referenced packs"))?;
    }

    let id = CheckpointId::generate();
    let stats = new.stats.encode_to_vec();
    let details = encode_details(&new.repos, &new.warnings, &new.harness);
    let pack_count = u32::try_from(new.referenced_packs.len())
        .map_err(|_| DbError::Corrupt("a checkpoint references more than 2^32 packs".into()))?;
    let values = CheckpointValues {
        id: &id,
        new: &new,
        sequence: signed(sequence, "sequence")?,
        generation: signed(current.0, "generation")?,
        stats: &stats,
        details: &details,
        pack_count,
        stored_bytes: signed(new.stored_bytes, "stored bytes")?,
        now_ms,
    };
    let packs_left = match backend {
        Backend::Sqlite => {
            let mut insert = SqlBuilder::new(format!(
                "INSERT INTO checkpoints ({CHECKPOINT_INSERT_COLUMNS}) VALUES ("
            ));
            values.push(&mut insert);
            insert
                .push(")")
                .build()
                .execute(&mut *conn)
                .await
                .map_err(query_error("insert checkpoint"))?;
            &new.referenced_packs[..]
        }
        // One statement writes the checkpoint, its pack list and the
        // workspace's scope (up to a chunk of packs), unless the request
        // was committed before.
        Backend::Postgres => {
            let (first, rest) = new
                .referenced_packs
                .split_at(new.referenced_packs.len().min(ROWS_PER_STATEMENT));
            let mut insert = SqlBuilder::new(
                "WITH earlier AS (SELECT id FROM checkpoints WHERE workspace_id = ",
            );
            insert
                .push_bind(new.workspace_id.as_str())
                .push(" AND request_id = ")
                .push_bind(new.request_id.as_ref().map(CommitRequestId::as_str))
                .push(format!(
                    "), made AS (INSERT INTO checkpoints ({CHECKPOINT_INSERT_COLUMNS}) SELECT "
                ));
            values.push(&mut insert);
            insert.push(" WHERE NOT EXISTS (SELECT 1 FROM earlier) RETURNING id, workspace_id)");
            if !first.is_empty() {
                insert.push(", referenced (pack_id) AS (");
                insert.push_values(first, |mut row, pack| {
                    row.push_bind(pack.as_str());
                });
                insert
                    .push("), listed AS (INSERT INTO checkpoint_packs (checkpoint_id, tenant, pack_id)
                       SELECT made.id, ")
                    .push_bind(tenant.as_str())
                    .push(
                        ", r.pack_id FROM made, referenced r),
                       scoped AS (INSERT INTO workspace_packs (workspace_id, tenant, pack_id)
                       SELECT made.workspace_id, ",
                    )
                    .push_bind(tenant.as_str())
                    .push(
                        ", r.pack_id FROM made, referenced r
                       ON CONFLICT (workspace_id, pack_id) DO NOTHING)",
                    );
            }
            insert.push(" SELECT id FROM earlier");
            let earlier: Option<String> = insert
                .build_query_scalar()
                .fetch_optional(&mut *conn)
                .await
                .map_err(query_error("insert checkpoint"))?;
            if let Some(made) = earlier {
                return Ok(Recorded::Earlier(parse_column(&made, "checkpoint id")?));
            }
            rest
        }
    };
    insert_pack_lists(conn, tenant, &id, &new.workspace_id, packs_left).await?;

    Ok(Recorded::New(Checkpoint {
        id,
        workspace_id: new.workspace_id,
        sequence,
        parent: new.parent,
        reason: new.reason,
        generation: current,
        created_at: from_millis(now_ms),
        format_version: new.format_version,
        root_tree: new.root_tree,
        key_id: new.key_id,
        stats: new.stats,
        repos: new.repos,
        warnings: new.warnings,
        harness: new.harness,
        pack_count,
        stored_bytes: new.stored_bytes,
    }))
}

/// The columns [`CheckpointValues::push`] gives values for, in order.
const CHECKPOINT_INSERT_COLUMNS: &str = "id, workspace_id, sequence, parent_id, reason, generation, \
     format_version, root_tree, key_id, stats, details, pack_count, stored_bytes, created_at, request_id";

/// A new checkpoint's row, as bound parameters.
struct CheckpointValues<'a> {
    id: &'a CheckpointId,
    new: &'a NewCheckpoint,
    sequence: i64,
    generation: i64,
    stats: &'a [u8],
    details: &'a [u8],
    pack_count: u32,
    stored_bytes: i64,
    now_ms: i64,
}

impl<'a> CheckpointValues<'a> {
    /// Appends the values of [`CHECKPOINT_INSERT_COLUMNS`], comma-separated.
    fn push(&self, query: &mut SqlBuilder<'a>) {
        let new = self.new;
        let mut row = query.separated(", ");
        row.push_bind(self.id.as_str())
            .push_bind(new.workspace_id.as_str())
            .push_bind(self.sequence)
            .push_bind(new.parent.as_ref().map(CheckpointId::as_str))
            .push_bind(new.reason.as_str())
            .push_bind(self.generation)
            .push_bind(i64::from(new.format_version))
            .push_bind(new.root_tree.as_bytes().as_slice())
            .push_bind(new.key_id.as_str())
            .push_bind(self.stats)
            .push_bind(self.details)
            .push_bind(i64::from(self.pack_count))
            .push_bind(self.stored_bytes)
            .push_bind(self.now_ms)
            .push_bind(new.request_id.as_ref().map(CommitRequestId::as_str));
    }
}

/// Lists `packs` as checkpoint `id`'s and puts them in `workspace`'s scope:
/// it may dedup against them, reference them again, fetch them.
async fn insert_pack_lists(
    conn: &mut AnyConnection,
    tenant: &TenantId,
    id: &CheckpointId,
    workspace: &WorkspaceId,
    packs: &[PackId],
) -> Result<(), DbError> {
    for chunk in packs.chunks(ROWS_PER_STATEMENT) {
        let mut query =
            SqlBuilder::new("INSERT INTO checkpoint_packs (checkpoint_id, tenant, pack_id) ");
        query.push_values(chunk, |mut row, pack| {
            row.push_bind(id.as_str())
                .push_bind(tenant.as_str())
                .push_bind(pack.as_str());
        });
        query
            .build()
            .execute(&mut *conn)
            .await
            .map_err(query_error("insert checkpoint packs"))?;
    }
    for chunk in packs.chunks(ROWS_PER_STATEMENT) {
        let mut query =
            SqlBuilder::new("INSERT INTO workspace_packs (workspace_id, tenant, pack_id) ");
        query.push_values(chunk, |mut row, pack| {
            row.push_bind(workspace.as_str())
                .push_bind(tenant.as_str())
                .push_bind(pack.as_str());
        });
        query.push(" ON CONFLICT (workspace_id, pack_id) DO NOTHING");
        query
            .build()
            .execute(&mut *conn)
            .await
            .map_err(query_error("insert workspace packs"))?;
    }
    Ok(())
}
