//! Compaction's record: new packs in, the walked checkpoints' references
//! moved from each old pack to its new ones, in one transaction.
//!
//! The new packs are recorded before any reference to an old one goes, so
//! a crash leaves either the old state or the new one; the old packs are
//! then released the usual way (condemned when nothing references them,
//! swept after the grace).

use std::collections::HashSet;

use super::sql::SqlBuilder;
use cairn_proto::domain::NewPack;
use cairn_proto::ids::{BlobId, CheckpointId, PackId, TenantId, WorkspaceId};
use sqlx::Row;

use super::checkpoints::{push_in_list, record_pack_in};
use super::gc::{deletions_pending_in, unusable_packs_in};
use super::{DbError, MetadataStore, ROWS_PER_STATEMENT, millis, parse_column, query_error};

/// What a compaction changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Compacted {
    pub checkpoints_updated: u64,
    pub packs_replaced: u64,
}

impl MetadataStore {
    /// The blob ids recorded for `packs` of `tenant`.
    pub async fn blobs_of_packs(
        &self,
        tenant: &TenantId,
        packs: &[PackId],
    ) -> Result<HashSet<(PackId, BlobId)>, DbError> {
        let mut found = HashSet::new();
        for chunk in packs.chunks(ROWS_PER_STATEMENT) {
            let mut query = SqlBuilder::new("SELECT pack_id, blob_id FROM blobs WHERE tenant = ");
            query.push_bind(tenant.as_str()).push(" AND pack_id IN");
            push_in_list(&mut query, chunk, PackId::as_str);
            let rows = query
                .build()
                .fetch_all(&self.pool)
                .await
                .map_err(query_error("blobs of packs"))?;
            for row in rows {
                let read = |source| DbError::Query {
                    op: "read blob of pack",
                    source,
                };
                let pack: String = row.try_get("pack_id").map_err(read)?;
                let blob: Vec<u8> = row.try_get("blob_id").map_err(read)?;
                found.insert((
                    parse_column(&pack, "pack id")?,
                    BlobId::from_slice(&blob)
                        .map_err(|e| DbError::Corrupt(format!("stored blob id: {e}")))?,
                ));
            }
        }
        Ok(found)
    }

    /// Records `new_packs` for `workspace` and moves the references of
    /// `checkpoints` (those of the workspace that still exist) from each
    /// old pack of `replacements` to its new packs. Refused, with nothing
    /// written, when an old pack's records are gone or any pack's deletion
    /// is under way (`PacksMissing`), or a new pack is another workspace's.
    pub async fn compact_packs(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
        new_packs: &[NewPack],
        replacements: &[(PackId, Vec<PackId>)],
        checkpoints: &[CheckpointId],
        now: std::time::SystemTime,
    ) -> Result<Compacted, DbError> {
        let now_ms = millis(now);
        let mut tx = self.begin_write().await?;
        let olds: Vec<PackId> = replacements.iter().map(|(old, _)| old.clone()).collect();
        let news: Vec<&PackId> = new_packs.iter().map(|p| &p.pack_id).collect();
        let mut pending = deletions_pending_in(tx.conn(), tenant, &news).await?;
        pending.extend(unusable_packs_in(tx.conn(), tenant, &olds, false).await?);
        if !pending.is_empty() {
            return Err(DbError::PacksMissing { packs: pending });
        }
        for pack in &news {
            let foreign: Option<i64> = sqlx::query_scalar(
                "SELECT 1 FROM packs p WHERE p.tenant = $1 AND p.id = $2
                 AND NOT EXISTS (SELECT 1 FROM workspace_packs wp
                                 WHERE wp.workspace_id = $3 AND wp.pack_id = p.id)",
            )
            .bind(tenant.as_str())
            .bind(pack.as_str())
            .bind(workspace.as_str())
            .fetch_optional(tx.conn())
            .await
            .map_err(query_error("check compacted pack"))?;
            if foreign.is_some() {
                return Err(DbError::ForeignPack {
                    pack: (*pack).clone(),
                    workspace: workspace.clone(),
                });
            }
        }
        for pack in new_packs {
            record_pack_in(tx.conn(), tenant, pack, now_ms).await?;
            sqlx::query(
                "INSERT INTO workspace_packs (workspace_id, tenant, pack_id) VALUES ($1, $2, $3)
                 ON CONFLICT (workspace_id, pack_id) DO NOTHING",
            )
            .bind(workspace.as_str())
            .bind(tenant.as_str())
            .bind(pack.pack_id.as_str())
            .execute(tx.conn())
            .await
            .map_err(query_error("insert compacted pack scope"))?;
        }

        let mut updated = HashSet::new();
        let mut replaced = HashSet::new();
        for checkpoint in checkpoints {
            for (old, news) in replacements {
                let moved = sqlx::query(
                    "DELETE FROM checkpoint_packs WHERE checkpoint_id = $1 AND tenant = $2
                     AND pack_id = $3
                     AND checkpoint_id IN (SELECT id FROM checkpoints WHERE workspace_id = $4)",
                )
                .bind(checkpoint.as_str())
                .bind(tenant.as_str())
                .bind(old.as_str())
                .bind(workspace.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("move checkpoint pack"))?
                .rows_affected();
                if moved == 0 {
                    continue;
                }
                updated.insert(checkpoint.clone());
                replaced.insert(old.clone());
                for new in news {
                    sqlx::query(
                        "INSERT INTO checkpoint_packs (checkpoint_id, tenant, pack_id)
                         VALUES ($1, $2, $3) ON CONFLICT (checkpoint_id, pack_id) DO NOTHING",
                    )
                    .bind(checkpoint.as_str())
                    .bind(tenant.as_str())
                    .bind(new.as_str())
                    .execute(tx.conn())
                    .await
                    .map_err(query_error("move checkpoint pack"))?;
                }
            }
        }
        // New commits stop deduplicating against what was replaced.
        for old in &replaced {
            sqlx::query("UPDATE packs SET superseded_at = $1 WHERE tenant = $2 AND id = $3")
                .bind(now_ms)
                .bind(tenant.as_str())
                .bind(old.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("supersede pack"))?;
        }
        for checkpoint in &updated {
            sqlx::query(
                "UPDATE checkpoints SET
                   pack_count = (SELECT COUNT(*) FROM checkpoint_packs WHERE checkpoint_id = $1),
                   stored_bytes = (SELECT CAST(COALESCE(SUM(p.size), 0) AS BIGINT) FROM checkpoint_packs cp
                                   JOIN packs p ON p.tenant = cp.tenant AND p.id = cp.pack_id
                                   WHERE cp.checkpoint_id = $1)
                 WHERE id = $1",
            )
            .bind(checkpoint.as_str())
            .execute(tx.conn())
            .await
            .map_err(query_error("recount checkpoint packs"))?;
        }
        self.commit(tx).await?;
        Ok(Compacted {
            checkpoints_updated: updated.len() as u64,
            packs_replaced: replaced.len() as u64,
        })
    }
}
