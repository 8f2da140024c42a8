//! Retention's records: what [`crate::retention`] judges (checkpoints, pins,
//! the runs that started from them, a workspace's own settings), and what
//! carries out its decisions (deleting checkpoints, finishing and deleting
//! workspaces).
//!
//! Every delete re-checks in its transaction what the decision was made
//! from: a checkpoint pinned, restored or made the newest since is not
//! deleted, whatever the caller decided a moment before.

use std::time::{Duration, SystemTime};

use super::sql::SqlBuilder;
use cairn_proto::domain::WorkspaceState;
use cairn_proto::ids::{CheckpointId, RunId, TenantId, WorkspaceId};
use cairn_proto::runs::RunState;
use sqlx::Row;

use super::checkpoints::push_in_list;
use super::gc::{PackTally, condemn_unreferenced_in};
use super::{
    DbError, MetadataStore, ROWS_PER_STATEMENT, WriteTx, from_millis, millis, parse_column,
    query_error, signed, unsigned,
};
use crate::retention::{CheckpointFacts, Overrides, Pin, RunStart};

/// What retention judges one workspace by.
#[derive(Debug, Clone, Default)]
pub struct RetentionFacts {
    pub checkpoints: Vec<CheckpointFacts>,
    pub pins: Vec<Pin>,
    pub run_starts: Vec<RunStart>,
}

/// A workspace as retention sees it.
#[derive(Debug, Clone)]
pub struct RetainedWorkspace {
    pub id: WorkspaceId,
    pub tenant: TenantId,
    pub state: WorkspaceState,
    pub finished_at: Option<SystemTime>,
    pub overrides: Overrides,
}

/// What a delete took away.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Deleted {
    pub checkpoints: u64,
    /// Packs nothing references any more, condemned by the delete.
    pub condemned: PackTally,
}

/// A change to a workspace's own retention settings: `None` leaves a
/// setting as it is, `Some(None)` clears it (back to the server default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetentionChange {
    pub keep_last: Option<Option<u32>>,
    pub finished_expiry: Option<Option<Duration>>,
}

/// Runs of `workspace` that have not ended, oldest first.
async fn unended_runs(tx: &mut WriteTx, workspace: &WorkspaceId) -> Result<Vec<RunId>, DbError> {
    let terminal = [RunState::Succeeded, RunState::Failed, RunState::Cancelled];
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT id FROM runs WHERE workspace_id = $1 AND state NOT IN ($2, $3, $4) ORDER BY id",
    )
    .bind(workspace.as_str())
    .bind(terminal[0].as_str())
    .bind(terminal[1].as_str())
    .bind(terminal[2].as_str())
    .fetch_all(tx.conn())
    .await
    .map_err(query_error("unended runs"))?;
    rows.iter().map(|id| parse_column(id, "run id")).collect()
}

/// The state of `workspace` of `tenant`, read inside `tx`.
async fn state_in(
    tx: &mut WriteTx,
    tenant: &TenantId,
    workspace: &WorkspaceId,
) -> Result<WorkspaceState, DbError> {
    let state: Option<String> =
        sqlx::query_scalar("SELECT state FROM workspaces WHERE id = $1 AND tenant = $2")
            .bind(workspace.as_str())
            .bind(tenant.as_str())
            .fetch_optional(tx.conn())
            .await
            .map_err(query_error("workspace state"))?;
    let state = state.ok_or_else(|| DbError::WorkspaceNotFound(workspace.to_string()))?;
    parse_column(&state, "workspace state")
}

/// Deletes checkpoints `ids` of `workspace` and what hangs off them (their
/// pack lists and pins), inside `tx`.
async fn delete_checkpoint_rows(
    tx: &mut WriteTx,
    workspace: &WorkspaceId,
    ids: &[CheckpointId],
) -> Result<u64, DbError> {
    let mut deleted = 0;
    for chunk in ids.chunks(ROWS_PER_STATEMENT) {
        for table in ["checkpoint_packs", "checkpoint_pins"] {
            let mut query = SqlBuilder::new(format!("DELETE FROM {table} WHERE checkpoint_id IN"));
            push_in_list(&mut query, chunk, CheckpointId::as_str);
            query
                .build()
                .execute(tx.conn())
                .await
                .map_err(query_error("delete checkpoint records"))?;
        }
        let mut query = SqlBuilder::new("DELETE FROM checkpoints WHERE workspace_id = ");
        query.push_bind(workspace.as_str()).push(" AND id IN");
        push_in_list(&mut query, chunk, CheckpointId::as_str);
        deleted += query
            .build()
            .execute(tx.conn())
            .await
            .map_err(query_error("delete checkpoints"))?
            .rows_affected();
    }
    Ok(deleted)
}

impl MetadataStore {
    /// Workspaces retention looks at: active and finished ones, of `tenant`
    /// or of every tenant.
    pub async fn retained_workspaces(
        &self,
        tenant: Option<&TenantId>,
    ) -> Result<Vec<RetainedWorkspace>, DbError> {
        let rows = sqlx::query(
            "SELECT id, tenant, state, finished_at, keep_last, finished_retention_ms
             FROM workspaces WHERE state <> $1 AND ($2 IS NULL OR tenant = $2) ORDER BY id",
        )
        .bind(WorkspaceState::Deleted.as_str())
        .bind(tenant.map(TenantId::as_str))
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("retained workspaces"))?;
        rows.iter()
            .map(|row| {
                let read = |source| DbError::Query {
                    op: "read retained workspace",
                    source,
                };
                let id: String = row.try_get("id").map_err(read)?;
                let tenant: String = row.try_get("tenant").map_err(read)?;
                let state: String = row.try_get("state").map_err(read)?;
                let finished_at: Option<i64> = row.try_get("finished_at").map_err(read)?;
                let keep_last: Option<i64> = row.try_get("keep_last").map_err(read)?;
                let expiry: Option<i64> = row.try_get("finished_retention_ms").map_err(read)?;
                Ok(RetainedWorkspace {
                    id: parse_column(&id, "workspace id")?,
                    tenant: parse_column(&tenant, "tenant")?,
                    state: parse_column(&state, "workspace state")?,
                    finished_at: finished_at.map(from_millis),
                    overrides: Overrides {
                        keep_last: keep_last.map(|n| unsigned(n, "keep_last")).transpose()?,
                        finished_expiry: expiry
                            .map(|ms| unsigned::<u64>(ms, "finished retention"))
                            .transpose()?
                            .map(Duration::from_millis),
                    },
                })
            })
            .collect()
    }

    /// The checkpoints of `workspace`, the pins on them and the attempts
    /// that started from them.
    pub async fn retention_facts(
        &self,
        workspace: &WorkspaceId,
    ) -> Result<RetentionFacts, DbError> {
        let rows = sqlx::query("SELECT id, sequence FROM checkpoints WHERE workspace_id = $1")
            .bind(workspace.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(query_error("retention checkpoints"))?;
        let read = |source| DbError::Query {
            op: "read retention facts",
            source,
        };
        let mut facts = RetentionFacts::default();
        for row in &rows {
            let id: String = row.try_get("id").map_err(read)?;
            facts.checkpoints.push(CheckpointFacts {
                id: parse_column(&id, "checkpoint id")?,
                sequence: unsigned(row.try_get("sequence").map_err(read)?, "sequence")?,
            });
        }
        let rows = sqlx::query(
            "SELECT p.checkpoint_id, p.reason, p.until_at FROM checkpoint_pins p
             JOIN checkpoints c ON c.id = p.checkpoint_id WHERE c.workspace_id = $1
             ORDER BY p.checkpoint_id, p.reason",
        )
        .bind(workspace.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("retention pins"))?;
        for row in &rows {
            let id: String = row.try_get("checkpoint_id").map_err(read)?;
            let until: Option<i64> = row.try_get("until_at").map_err(read)?;
            facts.pins.push(Pin {
                checkpoint: parse_column(&id, "checkpoint id")?,
                reason: row.try_get("reason").map_err(read)?,
                until: until.map(from_millis),
            });
        }
        let rows = sqlx::query(
            "SELECT a.restored_checkpoint_id, a.run_id, a.started_at FROM attempts a
             JOIN runs r ON r.id = a.run_id
             WHERE r.workspace_id = $1 AND a.restored_checkpoint_id <> ''
             ORDER BY a.run_id, a.number",
        )
        .bind(workspace.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("retention run starts"))?;
        for row in &rows {
            let checkpoint: String = row.try_get("restored_checkpoint_id").map_err(read)?;
            let run: String = row.try_get("run_id").map_err(read)?;
            facts.run_starts.push(RunStart {
                checkpoint: parse_column(&checkpoint, "restored checkpoint id")?,
                run: parse_column(&run, "run id")?,
                started_at: from_millis(row.try_get("started_at").map_err(read)?),
            });
        }
        Ok(facts)
    }

    /// Deletes those of `ids` (checkpoints of `workspace`) that are still
    /// not kept at `now`: never the newest, nor one a pin holds, nor one an
    /// attempt started from within `run_start_hold`. Packs no checkpoint
    /// references any more are condemned at `now`.
    pub async fn delete_expired_checkpoints(
        &self,
        workspace: &WorkspaceId,
        ids: &[CheckpointId],
        run_start_hold: Duration,
        now: SystemTime,
    ) -> Result<Deleted, DbError> {
        if ids.is_empty() {
            return Ok(Deleted::default());
        }
        let now_ms = millis(now);
        let hold_from = millis(
            now.checked_sub(run_start_hold)
                .unwrap_or(SystemTime::UNIX_EPOCH),
        );
        let mut tx = self.begin_write().await?;
        let mut doomed = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(ROWS_PER_STATEMENT) {
            let mut query =
                SqlBuilder::new("SELECT c.id FROM checkpoints c WHERE c.workspace_id = ");
            query
                .push_bind(workspace.as_str())
                .push(" AND c.sequence < (SELECT MAX(sequence) FROM checkpoints WHERE workspace_id = ")
                .push_bind(workspace.as_str())
                .push(") AND NOT EXISTS (SELECT 1 FROM checkpoint_pins p WHERE p.checkpoint_id = c.id AND (p.until_at IS NULL OR p.until_at > ")
                .push_bind(now_ms)
                .push(")) AND NOT EXISTS (SELECT 1 FROM attempts a WHERE a.restored_checkpoint_id = c.id AND a.started_at > ")
                .push_bind(hold_from)
                .push(") AND c.id IN");
            push_in_list(&mut query, chunk, CheckpointId::as_str);
            let rows: Vec<String> = query
                .build_query_scalar()
                .fetch_all(tx.conn())
                .await
                .map_err(query_error("recheck expired checkpoints"))?;
            for id in rows {
                doomed.push(parse_column::<CheckpointId>(&id, "checkpoint id")?);
            }
        }
        let checkpoints = delete_checkpoint_rows(&mut tx, workspace, &doomed).await?;
        let condemned = condemn_unreferenced_in(&mut tx, None, now).await?;
        self.commit(tx).await?;
        Ok(Deleted {
            checkpoints,
            condemned,
        })
    }

    /// Pins checkpoint `id` of `tenant` for `reason` until `until` (`None`:
    /// until unpinned); the same reason again replaces the time. Refused
    /// for a checkpoint of a deleted workspace (there is none) or a
    /// finished one (nothing it holds is to be kept past its expiry).
    pub async fn pin_checkpoint(
        &self,
        tenant: &TenantId,
        id: &CheckpointId,
        reason: &str,
        until: Option<SystemTime>,
        now: SystemTime,
    ) -> Result<(), DbError> {
        let mut tx = self.begin_write().await?;
        let workspace: Option<String> = sqlx::query_scalar(
            "SELECT c.workspace_id FROM checkpoints c JOIN workspaces w ON w.id = c.workspace_id
             WHERE c.id = $1 AND w.tenant = $2",
        )
        .bind(id.as_str())
        .bind(tenant.as_str())
        .fetch_optional(tx.conn())
        .await
        .map_err(query_error("pin checkpoint"))?;
        let workspace: WorkspaceId = parse_column(
            &workspace
                .ok_or_else(|| DbError::NotFound(format!("checkpoint {id} does not exist")))?,
            "workspace id",
        )?;
        let state = state_in(&mut tx, tenant, &workspace).await?;
        if state != WorkspaceState::Active {
            return Err(DbError::WorkspaceNotActive {
                id: workspace,
                state,
            });
        }
        sqlx::query(
            "INSERT INTO checkpoint_pins (checkpoint_id, reason, until_at, created_at)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (checkpoint_id, reason) DO UPDATE SET until_at = excluded.until_at",
        )
        .bind(id.as_str())
        .bind(reason)
        .bind(until.map(millis))
        .bind(millis(now))
        .execute(tx.conn())
        .await
        .map_err(query_error("pin checkpoint"))?;
        self.commit(tx).await
    }

    /// Removes the pin `reason` from checkpoint `id`; returns whether there
    /// was one.
    pub async fn unpin_checkpoint(
        &self,
        tenant: &TenantId,
        id: &CheckpointId,
        reason: &str,
    ) -> Result<bool, DbError> {
        let removed = sqlx::query(
            "DELETE FROM checkpoint_pins WHERE checkpoint_id = $1 AND reason = $2
             AND checkpoint_id IN (SELECT c.id FROM checkpoints c
                                   JOIN workspaces w ON w.id = c.workspace_id WHERE w.tenant = $3)",
        )
        .bind(id.as_str())
        .bind(reason)
        .bind(tenant.as_str())
        .execute(&self.pool)
        .await
        .map_err(query_error("unpin checkpoint"))?
        .rows_affected();
        Ok(removed > 0)
    }

    /// Changes `workspace`'s own retention settings as `change` says.
    pub async fn set_retention(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
        change: RetentionChange,
    ) -> Result<(), DbError> {
        let mut tx = self.begin_write().await?;
        let state = state_in(&mut tx, tenant, workspace).await?;
        if state == WorkspaceState::Deleted {
            return Err(DbError::WorkspaceNotActive {
                id: workspace.clone(),
                state,
            });
        }
        if let Some(keep_last) = change.keep_last {
            sqlx::query("UPDATE workspaces SET keep_last = $1 WHERE id = $2")
                .bind(keep_last.map(i64::from))
                .bind(workspace.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("set keep_last"))?;
        }
        if let Some(expiry) = change.finished_expiry {
            let ms = expiry
                .map(|d| {
                    signed(
                        u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
                        "retention",
                    )
                })
                .transpose()?;
            sqlx::query("UPDATE workspaces SET finished_retention_ms = $1 WHERE id = $2")
                .bind(ms)
                .bind(workspace.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("set finished retention"))?;
        }
        self.commit(tx).await
    }

    /// Marks an active workspace finished at `now`. A finished one stays as
    /// it is; a deleted one, or one with runs that have not ended, is
    /// refused.
    pub async fn finish_workspace(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
        now: SystemTime,
    ) -> Result<(), DbError> {
        let mut tx = self.begin_write().await?;
        match state_in(&mut tx, tenant, workspace).await? {
            WorkspaceState::Finished => return Ok(()),
            WorkspaceState::Deleted => {
                return Err(DbError::WorkspaceNotActive {
                    id: workspace.clone(),
                    state: WorkspaceState::Deleted,
                });
            }
            WorkspaceState::Active => {}
        }
        let runs = unended_runs(&mut tx, workspace).await?;
        if !runs.is_empty() {
            return Err(DbError::WorkspaceHasRuns {
                workspace: workspace.clone(),
                runs,
            });
        }
        sqlx::query(
            "UPDATE workspaces SET state = $1, finished_at = $2, updated_at = $2 WHERE id = $3",
        )
        .bind(WorkspaceState::Finished.as_str())
        .bind(millis(now))
        .bind(workspace.as_str())
        .execute(tx.conn())
        .await
        .map_err(query_error("finish workspace"))?;
        self.commit(tx).await
    }

    /// Deletes `workspace` at `now`: its checkpoints, pins, pack scope,
    /// conversations, messages and notes go in one transaction, its name is
    /// freed, and the packs nothing references any more are condemned (the
    /// garbage collector frees them after its grace). The row stays, state
    /// deleted, for the runs and tokens that name it. Refused while a run of
    /// it has not ended.
    pub async fn delete_workspace(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
        now: SystemTime,
    ) -> Result<Deleted, DbError> {
        let mut tx = self.begin_write().await?;
        if state_in(&mut tx, tenant, workspace).await? == WorkspaceState::Deleted {
            return Ok(Deleted::default());
        }
        let runs = unended_runs(&mut tx, workspace).await?;
        if !runs.is_empty() {
            return Err(DbError::WorkspaceHasRuns {
                workspace: workspace.clone(),
                runs,
            });
        }
        let ids: Vec<String> =
            sqlx::query_scalar("SELECT id FROM checkpoints WHERE workspace_id = $1")
                .bind(workspace.as_str())
                .fetch_all(tx.conn())
                .await
                .map_err(query_error("workspace checkpoints"))?;
        let ids = ids
            .iter()
            .map(|id| parse_column::<CheckpointId>(id, "checkpoint id"))
            .collect::<Result<Vec<_>, _>>()?;
        let checkpoints = delete_checkpoint_rows(&mut tx, workspace, &ids).await?;
        for table in [
            "workspace_packs",
            "workspace_sessions",
            "workspace_messages",
            "handoff_notes",
        ] {
            sqlx::query(&format!("DELETE FROM {table} WHERE workspace_id = $1"))
                .bind(workspace.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("delete workspace records"))?;
        }
        sqlx::query("UPDATE workspaces SET state = $1, name = NULL, updated_at = $2 WHERE id = $3")
            .bind(WorkspaceState::Deleted.as_str())
            .bind(millis(now))
            .bind(workspace.as_str())
            .execute(tx.conn())
            .await
            .map_err(query_error("delete workspace"))?;
        let condemned = condemn_unreferenced_in(&mut tx, Some(tenant), now).await?;
        self.commit(tx).await?;
        Ok(Deleted {
            checkpoints,
            condemned,
        })
    }
}
