//! Figures for operators: what the metrics read at each scrape (runs and
//! hosts by state, the oldest queued run, each active run's newest
//! checkpoint, what each tenant stores) and the recovery points runs are
//! shown with.

use std::collections::HashMap;
use std::time::SystemTime;

use cairn_proto::ids::{RunId, TenantId, WorkspaceId};
use cairn_proto::runs::{HostState, RunState};
use sqlx::Row;

use super::checkpoints::fetch_all_in;
use super::gc::PackTally;
use super::hosts::host_state;
use super::{DbError, MetadataStore, from_millis, parse_column, query_error, unsigned};

/// The database's figures at one moment, across tenants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Runs by state (states without runs are absent).
    pub runs: HashMap<RunState, u64>,
    /// Hosts by state as they are shown (lost, stopping, else the admin
    /// state).
    pub hosts: HashMap<HostState, u64>,
    /// When the oldest queued run was created.
    pub oldest_queued_since: Option<SystemTime>,
    /// Runs with a sandbox assigned or running, oldest id first.
    pub active: Vec<ActiveRun>,
    /// Per tenant with packs, what its packs hold (tenant order).
    pub stored: Vec<StoredPacks>,
}

/// What one tenant's packs hold in the object store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredPacks {
    pub tenant: TenantId,
    /// Packs a checkpoint references, or that no sweep has condemned yet.
    pub live: PackTally,
    /// Packs condemned and waiting out the grace before they are deleted.
    pub condemned: PackTally,
}

/// A run with a sandbox, and how recent its workspace's newest checkpoint is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveRun {
    pub run: RunId,
    pub workspace: WorkspaceId,
    pub created_at: SystemTime,
    /// `None` if the workspace has no checkpoint yet.
    pub newest_checkpoint_at: Option<SystemTime>,
}

/// The states in which a run has (or is about to have) a sandbox whose work
/// a crash would lose.
const ACTIVE: [RunState; 4] = [
    RunState::Assigned,
    RunState::Starting,
    RunState::Running,
    RunState::Waiting,
];

impl MetadataStore {
    /// Reads the figures the metrics report, in five statements.
    pub async fn tally(&self) -> Result<Tally, DbError> {
        let op = "read figures for metrics";
        let mut conn = self.pool.acquire().await.map_err(query_error(op))?;
        let read = |source| DbError::Query { op, source };
        let mut tally = Tally::default();

        let rows = sqlx::query("SELECT state, COUNT(*) AS n FROM runs GROUP BY state")
            .fetch_all(&mut *conn)
            .await
            .map_err(query_error(op))?;
        for row in &rows {
            let state: String = row.try_get("state").map_err(read)?;
            let count: i64 = row.try_get("n").map_err(read)?;
            tally.runs.insert(
                parse_column(&state, "run state")?,
                unsigned(count, "run count")?,
            );
        }

        let rows = sqlx::query(
            "SELECT admin_state,
                    CAST(CASE WHEN lost_at IS NULL THEN 0 ELSE 1 END AS BIGINT) AS lost,
                    CAST(CASE WHEN stopping_at IS NULL THEN 0 ELSE 1 END AS BIGINT) AS stopping,
                    COUNT(*) AS n
             FROM hosts GROUP BY 1, 2, 3",
        )
        .fetch_all(&mut *conn)
        .await
        .map_err(query_error(op))?;
        for row in &rows {
            let admin: String = row.try_get("admin_state").map_err(read)?;
            let lost: i64 = row.try_get("lost").map_err(read)?;
            let stopping: i64 = row.try_get("stopping").map_err(read)?;
            let count: i64 = row.try_get("n").map_err(read)?;
            let state = host_state(
                parse_column(&admin, "host admin state")?,
                lost != 0,
                stopping != 0,
            );
            *tally.hosts.entry(state).or_default() += unsigned::<u64>(count, "host count")?;
        }

        let oldest: Option<i64> =
            sqlx::query_scalar("SELECT MIN(created_at) FROM runs WHERE state = $1")
                .bind(RunState::Queued.as_str())
                .fetch_one(&mut *conn)
                .await
                .map_err(query_error(op))?;
        tally.oldest_queued_since = oldest.map(from_millis);

        let rows = sqlx::query(
            "SELECT r.id, r.workspace_id, r.created_at,
                    (SELECT MAX(c.created_at) FROM checkpoints c
                     WHERE c.workspace_id = r.workspace_id) AS newest
             FROM runs r WHERE r.state IN ($1, $2, $3, $4) ORDER BY r.id",
        )
        .bind(ACTIVE[0].as_str())
        .bind(ACTIVE[1].as_str())
        .bind(ACTIVE[2].as_str())
        .bind(ACTIVE[3].as_str())
        .fetch_all(&mut *conn)
        .await
        .map_err(query_error(op))?;
        for row in &rows {
            let run: String = row.try_get("id").map_err(read)?;
            let workspace: String = row.try_get("workspace_id").map_err(read)?;
            let created_at: i64 = row.try_get("created_at").map_err(read)?;
            let newest: Option<i64> = row.try_get("newest").map_err(read)?;
            tally.active.push(ActiveRun {
                run: parse_column(&run, "run id")?,
                workspace: parse_column(&workspace, "workspace id")?,
                created_at: from_millis(created_at),
                newest_checkpoint_at: newest.map(from_millis),
            });
        }

        let rows = sqlx::query(
            "SELECT tenant,
                    CAST(CASE WHEN condemned_at IS NULL THEN 0 ELSE 1 END AS BIGINT) AS condemned,
                    COUNT(*) AS packs, CAST(COALESCE(SUM(size), 0) AS BIGINT) AS bytes
             FROM packs GROUP BY 1, 2 ORDER BY 1",
        )
        .fetch_all(&mut *conn)
        .await
        .map_err(query_error(op))?;
        for row in &rows {
            let tenant: String = row.try_get("tenant").map_err(read)?;
            let tenant: TenantId = parse_column(&tenant, "tenant")?;
            let condemned: i64 = row.try_get("condemned").map_err(read)?;
            let packs = PackTally {
                packs: unsigned(row.try_get("packs").map_err(read)?, "pack count")?,
                bytes: unsigned(row.try_get("bytes").map_err(read)?, "pack bytes")?,
            };
            if tally.stored.last().is_none_or(|s| s.tenant != tenant) {
                tally.stored.push(StoredPacks {
                    tenant,
                    live: PackTally::default(),
                    condemned: PackTally::default(),
                });
            }
            let stored = tally.stored.last_mut().expect("pushed above");
            if condemned != 0 {
                stored.condemned.absorb(packs);
            } else {
                stored.live.absorb(packs);
            }
        }
        Ok(tally)
    }
}

impl MetadataStore {
    /// When each of `workspaces` was last checkpointed (absent: never).
    pub async fn newest_checkpoints(
        &self,
        workspaces: &[&WorkspaceId],
    ) -> Result<HashMap<WorkspaceId, SystemTime>, DbError> {
        let op = "read newest checkpoints";
        let mut conn = self.pool.acquire().await.map_err(query_error(op))?;
        let rows = fetch_all_in(
            &mut conn,
            "SELECT w.id, (SELECT MAX(c.created_at) FROM checkpoints c
                           WHERE c.workspace_id = w.id) AS newest
             FROM workspaces w WHERE w.id IN",
            workspaces,
            |id| id.as_str(),
            op,
        )
        .await?;
        let read = |source| DbError::Query { op, source };
        let mut newest = HashMap::with_capacity(rows.len());
        for row in &rows {
            let id: String = row.try_get("id").map_err(read)?;
            let at: Option<i64> = row.try_get("newest").map_err(read)?;
            if let Some(at) = at {
                newest.insert(parse_column(&id, "workspace id")?, from_millis(at));
            }
        }
        Ok(newest)
    }
}
