//! Garbage collection's records: which packs no checkpoint references
//! (condemned), the deletions in progress (`pack_deletions`), and the bytes
//! each tenant and workspace stores.
//!
//! What may delete a pack, and when:
//! - Only a sweep, only a pack condemned at least a grace period ago (longer
//!   than any signed URL lives) and referenced by no checkpoint when the
//!   sweep's transaction re-checks it; or an object in the store that no
//!   pack record names (an upload never committed), older than the grace.
//! - The sweep removes the pack's records and writes its deletion in one
//!   transaction, deletes the object after, and only then forgets the
//!   deletion. A commit naming a pack whose records are gone or whose
//!   deletion is pending is refused as missing (upload again); a commit
//!   that came first references the pack, so the sweep's re-check keeps it.
//! - A sweep cut short leaves its deletions written; the next one finishes
//!   them before anything else.

use std::collections::HashSet;
use std::time::SystemTime;

use super::sql::SqlBuilder;
use cairn_proto::ids::{PackId, TenantId, WorkspaceId};
use sqlx::Row;

use super::checkpoints::push_in_list;
use super::{
    DbError, MetadataStore, ROWS_PER_STATEMENT, WriteTx, millis, parse_column, query_error, signed,
    unsigned,
};

/// A pack whose object a sweep deletes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PackDeletion {
    pub tenant: TenantId,
    pub pack: PackId,
    pub size: u64,
}

/// Packs and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PackTally {
    pub packs: u64,
    pub bytes: u64,
}

impl PackTally {
    pub fn add(&mut self, size: u64) {
        self.packs += 1;
        self.bytes = self.bytes.saturating_add(size);
    }

    pub fn absorb(&mut self, other: PackTally) {
        self.packs += other.packs;
        self.bytes = self.bytes.saturating_add(other.bytes);
    }
}

/// What one tenant stores.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantStorage {
    pub stored: PackTally,
    pub condemned: PackTally,
    pub workspaces: u64,
    pub checkpoints: u64,
}

/// What one workspace's checkpoints reference.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkspaceStorage {
    pub referenced: PackTally,
    /// Bytes no other workspace's checkpoint references.
    pub unique_bytes: u64,
    /// Bytes other workspaces' checkpoints reference too.
    pub shared_bytes: u64,
}

fn tally(row: &sqlx::any::AnyRow, op: &'static str) -> Result<PackTally, DbError> {
    let read = |source| DbError::Query { op, source };
    Ok(PackTally {
        packs: unsigned(row.try_get("packs").map_err(read)?, "pack count")?,
        bytes: unsigned(row.try_get("bytes").map_err(read)?, "pack bytes")?,
    })
}

const UNREFERENCED: &str = "NOT EXISTS (SELECT 1 FROM checkpoint_packs cp
                             WHERE cp.tenant = p.tenant AND cp.pack_id = p.id)";

/// Condemns at `now` the packs (of `tenant`, or of all) no checkpoint
/// references, and absolves condemned ones referenced again. Returns what
/// was newly condemned.
pub(super) async fn condemn_unreferenced_in(
    tx: &mut WriteTx,
    tenant: Option<&TenantId>,
    now: SystemTime,
) -> Result<PackTally, DbError> {
    let scope = tenant.map(TenantId::as_str);
    let newly = sqlx::query(&format!(
        "SELECT COUNT(*) AS packs, CAST(COALESCE(SUM(size), 0) AS BIGINT) AS bytes FROM packs p
         WHERE p.condemned_at IS NULL AND ($1 IS NULL OR p.tenant = $1) AND {UNREFERENCED}"
    ))
    .bind(scope)
    .fetch_one(tx.conn())
    .await
    .map_err(query_error("count unreferenced packs"))?;
    let newly = tally(&newly, "count unreferenced packs")?;
    sqlx::query(
        "UPDATE packs SET condemned_at = $1
         WHERE condemned_at IS NULL AND ($2 IS NULL OR tenant = $2)
           AND NOT EXISTS (SELECT 1 FROM checkpoint_packs cp
                           WHERE cp.tenant = packs.tenant AND cp.pack_id = packs.id)",
    )
    .bind(millis(now))
    .bind(scope)
    .execute(tx.conn())
    .await
    .map_err(query_error("condemn packs"))?;
    sqlx::query(
        "UPDATE packs SET condemned_at = NULL
         WHERE condemned_at IS NOT NULL AND ($1 IS NULL OR tenant = $1)
           AND EXISTS (SELECT 1 FROM checkpoint_packs cp
                       WHERE cp.tenant = packs.tenant AND cp.pack_id = packs.id)",
    )
    .bind(scope)
    .execute(tx.conn())
    .await
    .map_err(query_error("absolve packs"))?;
    Ok(newly)
}

/// Which of `packs` (of `tenant`) a commit may not reference, inside the
/// commit's transaction: those without a record (swept, or never recorded),
/// those whose deletion is under way, and (`superseded_too`) those
/// compaction replaced.
pub(super) async fn unusable_packs_in(
    tx: &mut sqlx::AnyConnection,
    tenant: &TenantId,
    packs: &[PackId],
    superseded_too: bool,
) -> Result<Vec<PackId>, DbError> {
    Ok(recheck_packs_in(tx, tenant, packs, superseded_too)
        .await?
        .unusable)
}

/// What [`recheck_packs_in`] found.
#[derive(Debug, Default)]
pub(super) struct Rechecked {
    /// See [`unusable_packs_in`].
    pub unusable: Vec<PackId>,
    /// Usable packs a collection condemned (a reference absolves them).
    pub condemned: Vec<PackId>,
}

/// [`unusable_packs_in`], and which of the usable ones are condemned, in
/// the same reads.
pub(super) async fn recheck_packs_in(
    tx: &mut sqlx::AnyConnection,
    tenant: &TenantId,
    packs: &[PackId],
    superseded_too: bool,
) -> Result<Rechecked, DbError> {
    let mut usable = HashSet::new();
    let mut condemned = Vec::new();
    for chunk in packs.chunks(ROWS_PER_STATEMENT) {
        let mut query = SqlBuilder::new(
            "SELECT p.id, CAST(CASE WHEN p.condemned_at IS NULL THEN 0 ELSE 1 END AS BIGINT) AS condemned
             FROM packs p WHERE p.tenant = ",
        );
        query.push_bind(tenant.as_str());
        if superseded_too {
            query.push(" AND p.superseded_at IS NULL");
        }
        query.push(
            " AND NOT EXISTS (SELECT 1 FROM pack_deletions d
              WHERE d.tenant = p.tenant AND d.pack_id = p.id) AND p.id IN",
        );
        push_in_list(&mut query, chunk, PackId::as_str);
        let rows = query
            .build()
            .fetch_all(&mut *tx)
            .await
            .map_err(query_error("recheck referenced packs"))?;
        for row in rows {
            let read = |source| DbError::Query {
                op: "recheck referenced packs",
                source,
            };
            let id: String = row.try_get("id").map_err(read)?;
            let is_condemned: i64 = row.try_get("condemned").map_err(read)?;
            if is_condemned != 0 {
                condemned.push(parse_column(&id, "pack id")?);
            }
            usable.insert(id);
        }
    }
    Ok(Rechecked {
        unusable: packs
            .iter()
            .filter(|p| !usable.contains(p.as_str()))
            .cloned()
            .collect(),
        condemned,
    })
}

/// Whether any of `packs` of `tenant` has a deletion under way (a commit
/// may not record such a pack as new: its object is about to go).
pub(super) async fn deletions_pending_in(
    tx: &mut sqlx::AnyConnection,
    tenant: &TenantId,
    packs: &[&PackId],
) -> Result<Vec<PackId>, DbError> {
    let mut pending = Vec::new();
    for chunk in packs.chunks(ROWS_PER_STATEMENT) {
        let mut query = SqlBuilder::new("SELECT pack_id FROM pack_deletions WHERE tenant = ");
        query.push_bind(tenant.as_str()).push(" AND pack_id IN");
        push_in_list(&mut query, chunk, |p: &&PackId| p.as_str());
        let rows: Vec<String> = query
            .build_query_scalar()
            .fetch_all(&mut *tx)
            .await
            .map_err(query_error("pending pack deletions"))?;
        for id in rows {
            pending.push(parse_column(&id, "pack id")?);
        }
    }
    Ok(pending)
}

fn deletion_from_row(row: &sqlx::any::AnyRow) -> Result<PackDeletion, DbError> {
    let read = |source| DbError::Query {
        op: "read pack deletion",
        source,
    };
    let tenant: String = row.try_get("tenant").map_err(read)?;
    let pack: String = row.try_get("pack_id").map_err(read)?;
    Ok(PackDeletion {
        tenant: parse_column(&tenant, "tenant")?,
        pack: parse_column(&pack, "pack id")?,
        size: unsigned(row.try_get("size").map_err(read)?, "pack size")?,
    })
}

impl MetadataStore {
    /// Condemns unreferenced packs and absolves referenced ones (see
    /// [`condemn_unreferenced_in`]).
    pub async fn condemn_unreferenced(
        &self,
        tenant: Option<&TenantId>,
        now: SystemTime,
    ) -> Result<PackTally, DbError> {
        let mut tx = self.begin_write().await?;
        let newly = condemn_unreferenced_in(&mut tx, tenant, now).await?;
        self.commit(tx).await?;
        Ok(newly)
    }

    /// Condemned packs that are still unreferenced: those condemned at or
    /// before `cutoff` (sweepable) and those after it (awaiting the grace).
    pub async fn condemned_packs(
        &self,
        tenant: Option<&TenantId>,
        cutoff: SystemTime,
    ) -> Result<(PackTally, PackTally), DbError> {
        let row = sqlx::query(&format!(
            "SELECT
               COUNT(CASE WHEN p.condemned_at <= $1 THEN 1 END) AS due,
               CAST(COALESCE(SUM(CASE WHEN p.condemned_at <= $1 THEN p.size END), 0) AS BIGINT) AS due_bytes,
               COUNT(CASE WHEN p.condemned_at > $1 THEN 1 END) AS waiting,
               CAST(COALESCE(SUM(CASE WHEN p.condemned_at > $1 THEN p.size END), 0) AS BIGINT) AS waiting_bytes
             FROM packs p
             WHERE p.condemned_at IS NOT NULL AND ($2 IS NULL OR p.tenant = $2) AND {UNREFERENCED}"
        ))
        .bind(millis(cutoff))
        .bind(tenant.map(TenantId::as_str))
        .fetch_one(&self.pool)
        .await
        .map_err(query_error("condemned packs"))?;
        let read = |source| DbError::Query {
            op: "read condemned packs",
            source,
        };
        let get = |name: &str| -> Result<u64, DbError> {
            unsigned(row.try_get::<i64, _>(name).map_err(read)?, name)
        };
        Ok((
            PackTally {
                packs: get("due")?,
                bytes: get("due_bytes")?,
            },
            PackTally {
                packs: get("waiting")?,
                bytes: get("waiting_bytes")?,
            },
        ))
    }

    /// Starts deleting up to `limit` packs (of `tenant`, or of all)
    /// condemned at or before `cutoff` and still referenced by no
    /// checkpoint: in one transaction their records go (no commit can
    /// deduplicate against them from now on) and their deletions are
    /// written. The caller deletes the objects, then
    /// [`MetadataStore::finish_pack_deletions`].
    pub async fn begin_pack_deletions(
        &self,
        tenant: Option<&TenantId>,
        cutoff: SystemTime,
        limit: u32,
        now: SystemTime,
    ) -> Result<Vec<PackDeletion>, DbError> {
        let mut tx = self.begin_write().await?;
        let rows = sqlx::query(&format!(
            "SELECT p.tenant, p.id AS pack_id, p.size FROM packs p
             WHERE p.condemned_at IS NOT NULL AND p.condemned_at <= $1
               AND ($2 IS NULL OR p.tenant = $2) AND {UNREFERENCED}
             ORDER BY p.condemned_at, p.id LIMIT $3"
        ))
        .bind(millis(cutoff))
        .bind(tenant.map(TenantId::as_str))
        .bind(i64::from(limit))
        .fetch_all(tx.conn())
        .await
        .map_err(query_error("sweepable packs"))?;
        let deletions = rows
            .iter()
            .map(deletion_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        for deletion in &deletions {
            for (table, column) in [
                ("blobs", "pack_id"),
                ("workspace_packs", "pack_id"),
                ("packs", "id"),
            ] {
                sqlx::query(&format!(
                    "DELETE FROM {table} WHERE tenant = $1 AND {column} = $2"
                ))
                .bind(deletion.tenant.as_str())
                .bind(deletion.pack.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("delete pack records"))?;
            }
            record_deletion(&mut tx, deletion, now).await?;
        }
        self.commit(tx).await?;
        Ok(deletions)
    }

    /// Starts deleting objects the store holds that no pack record names
    /// (uploads no checkpoint committed), among `candidates`: those still
    /// without a record get their deletion written, in one transaction, and
    /// are returned. A commit recording one of them as new from now on is
    /// refused as missing.
    pub async fn begin_orphan_deletions(
        &self,
        candidates: &[PackDeletion],
        now: SystemTime,
    ) -> Result<Vec<PackDeletion>, DbError> {
        let mut tx = self.begin_write().await?;
        let mut started = Vec::new();
        for candidate in candidates {
            let recorded: Option<i64> = sqlx::query_scalar(
                "SELECT 1 FROM packs WHERE tenant = $1 AND id = $2
                 UNION ALL SELECT 1 FROM pack_deletions WHERE tenant = $1 AND pack_id = $2",
            )
            .bind(candidate.tenant.as_str())
            .bind(candidate.pack.as_str())
            .fetch_optional(tx.conn())
            .await
            .map_err(query_error("orphan check"))?;
            if recorded.is_none() {
                record_deletion(&mut tx, candidate, now).await?;
                started.push(candidate.clone());
            }
        }
        self.commit(tx).await?;
        Ok(started)
    }

    /// Every deletion written and not finished (of `tenant`, or of all): a
    /// sweep that was cut short, or one under way.
    pub async fn pending_pack_deletions(
        &self,
        tenant: Option<&TenantId>,
    ) -> Result<Vec<PackDeletion>, DbError> {
        let rows = sqlx::query(
            "SELECT tenant, pack_id, size FROM pack_deletions
             WHERE ($1 IS NULL OR tenant = $1) ORDER BY started_at, pack_id",
        )
        .bind(tenant.map(TenantId::as_str))
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("pending pack deletions"))?;
        rows.iter().map(deletion_from_row).collect()
    }

    /// Forgets deletions whose objects are gone from the store.
    pub async fn finish_pack_deletions(&self, done: &[PackDeletion]) -> Result<(), DbError> {
        let mut tx = self.begin_write().await?;
        for deletion in done {
            sqlx::query("DELETE FROM pack_deletions WHERE tenant = $1 AND pack_id = $2")
                .bind(deletion.tenant.as_str())
                .bind(deletion.pack.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("finish pack deletion"))?;
        }
        self.commit(tx).await
    }

    /// Packs (of `tenant`, or of all) not condemned yet that deleting
    /// `doomed` checkpoints would leave unreferenced, with those no
    /// checkpoint references now: what a mark after them would condemn.
    /// Reads only (a temporary table on one connection).
    pub async fn packs_freed_by(
        &self,
        tenant: Option<&TenantId>,
        doomed: &[cairn_proto::ids::CheckpointId],
    ) -> Result<PackTally, DbError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(query_error("packs freed"))?;
        sqlx::query("CREATE TEMP TABLE IF NOT EXISTS gc_doomed (id TEXT PRIMARY KEY)")
            .execute(&mut *conn)
            .await
            .map_err(query_error("packs freed"))?;
        sqlx::query("DELETE FROM gc_doomed")
            .execute(&mut *conn)
            .await
            .map_err(query_error("packs freed"))?;
        for chunk in doomed.chunks(ROWS_PER_STATEMENT) {
            let mut query = SqlBuilder::new("INSERT INTO gc_doomed (id) ");
            query.push_values(chunk, |mut row, id| {
                row.push_bind(id.as_str());
            });
            query.push(" ON CONFLICT (id) DO NOTHING");
            query
                .build()
                .execute(&mut *conn)
                .await
                .map_err(query_error("packs freed"))?;
        }
        let row = sqlx::query(
            "SELECT COUNT(*) AS packs, CAST(COALESCE(SUM(p.size), 0) AS BIGINT) AS bytes FROM packs p
             WHERE p.condemned_at IS NULL AND ($1 IS NULL OR p.tenant = $1)
               AND NOT EXISTS (SELECT 1 FROM checkpoint_packs cp
                               WHERE cp.tenant = p.tenant AND cp.pack_id = p.id
                                 AND cp.checkpoint_id NOT IN (SELECT id FROM gc_doomed))",
        )
        .bind(tenant.map(TenantId::as_str))
        .fetch_one(&mut *conn)
        .await
        .map_err(query_error("packs freed"))?;
        let freed = tally(&row, "packs freed")?;
        sqlx::query("DELETE FROM gc_doomed")
            .execute(&mut *conn)
            .await
            .map_err(query_error("packs freed"))?;
        Ok(freed)
    }

    /// Which of `packs` (of `tenant`) have a record.
    pub async fn recorded_packs(
        &self,
        tenant: &TenantId,
        packs: &[PackId],
    ) -> Result<HashSet<PackId>, DbError> {
        let mut recorded = HashSet::new();
        for chunk in packs.chunks(ROWS_PER_STATEMENT) {
            let mut query = SqlBuilder::new("SELECT id FROM packs WHERE tenant = ");
            query.push_bind(tenant.as_str()).push(" AND id IN");
            push_in_list(&mut query, chunk, PackId::as_str);
            let rows: Vec<String> = query
                .build_query_scalar()
                .fetch_all(&self.pool)
                .await
                .map_err(query_error("recorded packs"))?;
            for id in rows {
                recorded.insert(parse_column(&id, "pack id")?);
            }
        }
        Ok(recorded)
    }

    /// Every tenant with a record (for a collection over all of them).
    pub async fn tenants(&self) -> Result<Vec<TenantId>, DbError> {
        let rows: Vec<String> = sqlx::query_scalar("SELECT id FROM tenants ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .map_err(query_error("tenants"))?;
        rows.iter().map(|t| parse_column(t, "tenant")).collect()
    }

    /// What `tenant` stores.
    pub async fn tenant_storage(&self, tenant: &TenantId) -> Result<TenantStorage, DbError> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS packs, CAST(COALESCE(SUM(size), 0) AS BIGINT) AS bytes,
                    COUNT(condemned_at) AS condemned,
                    CAST(COALESCE(SUM(CASE WHEN condemned_at IS NOT NULL THEN size END), 0) AS BIGINT) AS condemned_bytes
             FROM packs WHERE tenant = $1",
        )
        .bind(tenant.as_str())
        .fetch_one(&self.pool)
        .await
        .map_err(query_error("tenant storage"))?;
        let read = |source| DbError::Query {
            op: "read tenant storage",
            source,
        };
        let condemned = PackTally {
            packs: unsigned(row.try_get("condemned").map_err(read)?, "condemned packs")?,
            bytes: unsigned(
                row.try_get("condemned_bytes").map_err(read)?,
                "condemned bytes",
            )?,
        };
        let stored = tally(&row, "tenant storage")?;
        let counts = sqlx::query(
            "SELECT (SELECT COUNT(*) FROM workspaces WHERE tenant = $1 AND state <> 'deleted') AS workspaces,
                    (SELECT COUNT(*) FROM checkpoints c JOIN workspaces w ON w.id = c.workspace_id
                     WHERE w.tenant = $1) AS checkpoints",
        )
        .bind(tenant.as_str())
        .fetch_one(&self.pool)
        .await
        .map_err(query_error("tenant counts"))?;
        Ok(TenantStorage {
            stored,
            condemned,
            workspaces: unsigned(counts.try_get("workspaces").map_err(read)?, "workspaces")?,
            checkpoints: unsigned(counts.try_get("checkpoints").map_err(read)?, "checkpoints")?,
        })
    }

    /// What `workspace`'s checkpoints reference, and how much of it other
    /// workspaces' checkpoints reference too (forks share packs).
    pub async fn workspace_storage(
        &self,
        workspace: &WorkspaceId,
    ) -> Result<WorkspaceStorage, DbError> {
        let rows = sqlx::query(
            "SELECT p.size,
                    CASE WHEN EXISTS (SELECT 1 FROM checkpoint_packs other
                                      JOIN checkpoints oc ON oc.id = other.checkpoint_id
                                      WHERE other.tenant = p.tenant AND other.pack_id = p.id
                                        AND oc.workspace_id <> $1)
                         THEN 1 ELSE 0 END AS shared
             FROM packs p
             WHERE EXISTS (SELECT 1 FROM checkpoint_packs cp
                           JOIN checkpoints c ON c.id = cp.checkpoint_id
                           WHERE cp.tenant = p.tenant AND cp.pack_id = p.id
                             AND c.workspace_id = $1)",
        )
        .bind(workspace.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("workspace storage"))?;
        let read = |source| DbError::Query {
            op: "read workspace storage",
            source,
        };
        let mut storage = WorkspaceStorage::default();
        for row in &rows {
            let size: u64 = unsigned(row.try_get("size").map_err(read)?, "pack size")?;
            let shared = row.try_get::<i64, _>("shared").map_err(read)? != 0;
            storage.referenced.add(size);
            if shared {
                storage.shared_bytes += size;
            } else {
                storage.unique_bytes += size;
            }
        }
        Ok(storage)
    }
}

async fn record_deletion(
    tx: &mut WriteTx,
    deletion: &PackDeletion,
    now: SystemTime,
) -> Result<(), DbError> {
    sqlx::query(
        "INSERT INTO pack_deletions (tenant, pack_id, size, started_at) VALUES ($1, $2, $3, $4)
         ON CONFLICT (tenant, pack_id) DO NOTHING",
    )
    .bind(deletion.tenant.as_str())
    .bind(deletion.pack.as_str())
    .bind(signed(deletion.size, "pack size")?)
    .bind(millis(now))
    .execute(tx.conn())
    .await
    .map_err(query_error("record pack deletion"))?;
    Ok(())
}
