//! Workspace records.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use cairn_proto::domain::{WorkspaceRef, WorkspaceState};
use cairn_proto::ids::{CheckpointId, Generation, TenantId, WorkspaceId};
use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};

use crate::retention::Overrides;

use super::checkpoints::{checkpoint_in, copy_checkpoint_in, newest_checkpoint_in};
use super::sql::SqlBuilder;
use super::{
    DbError, FIRST_KEY_ID, MetadataStore, Workspace, from_millis, millis, parse_column,
    query_error, random_secret, unsigned,
};

/// What a fork made: the new workspaces (in the order their names were
/// given) and the checkpoint they start from.
#[derive(Debug, Clone)]
pub struct Forked {
    pub workspaces: Vec<Workspace>,
    pub checkpoint: CheckpointId,
}

/// Generation of a new workspace. Zero stays free to mean "the current one"
/// in requests.
pub(super) const FIRST_GENERATION: Generation = Generation(1);

const WORKSPACE_COLUMNS: &str =
    "w.id, w.tenant, w.name, w.state, w.generation, w.created_at, w.updated_at,
     w.finished_at, w.keep_last, w.finished_retention_ms,
     (SELECT COUNT(*) FROM checkpoints c WHERE c.workspace_id = w.id) AS checkpoint_count";

fn workspace_from_row(row: &AnyRow) -> Result<Workspace, DbError> {
    let read = |source| DbError::Query {
        op: "read workspace",
        source,
    };
    let id: String = row.try_get("id").map_err(read)?;
    let tenant: String = row.try_get("tenant").map_err(read)?;
    let state: String = row.try_get("state").map_err(read)?;
    let generation: i64 = row.try_get("generation").map_err(read)?;
    let count: i64 = row.try_get("checkpoint_count").map_err(read)?;
    let finished_at: Option<i64> = row.try_get("finished_at").map_err(read)?;
    let keep_last: Option<i64> = row.try_get("keep_last").map_err(read)?;
    let finished_retention: Option<i64> = row.try_get("finished_retention_ms").map_err(read)?;
    Ok(Workspace {
        id: parse_column(&id, "workspace id")?,
        tenant: parse_column(&tenant, "tenant")?,
        name: row.try_get("name").map_err(read)?,
        state: parse_column::<WorkspaceState>(&state, "workspace state")?,
        generation: Generation(unsigned(generation, "generation")?),
        created_at: from_millis(row.try_get("created_at").map_err(read)?),
        updated_at: from_millis(row.try_get("updated_at").map_err(read)?),
        checkpoint_count: unsigned(count, "checkpoint count")?,
        latest_checkpoint: None,
        finished_at: finished_at.map(from_millis),
        retention: Overrides {
            keep_last: keep_last.map(|n| unsigned(n, "keep_last")).transpose()?,
            finished_expiry: finished_retention
                .map(|ms| unsigned::<u64>(ms, "finished retention").map(Duration::from_millis))
                .transpose()?,
        },
    })
}

/// Checks that `id` is an active workspace of `tenant` (`op` names the query).
pub(super) async fn ensure_active_workspace(
    conn: &mut AnyConnection,
    tenant: &TenantId,
    id: &WorkspaceId,
    op: &'static str,
) -> Result<(), DbError> {
    let state: Option<String> =
        sqlx::query_scalar("SELECT state FROM workspaces WHERE id = $1 AND tenant = $2")
            .bind(id.as_str())
            .bind(tenant.as_str())
            .fetch_optional(conn)
            .await
            .map_err(query_error(op))?;
    let state = state.ok_or_else(|| DbError::WorkspaceNotFound(id.to_string()))?;
    let state: WorkspaceState = parse_column(&state, "workspace state")?;
    if state != WorkspaceState::Active {
        return Err(DbError::WorkspaceNotActive {
            id: id.clone(),
            state,
        });
    }
    Ok(())
}

/// Whose keys a new workspace seals its checkpoints with.
#[derive(Debug, Clone)]
pub(super) enum KeyLineage {
    /// A lineage of its own, rooted at the new workspace, with a fresh key.
    New,
    /// The lineage of the workspace it was forked from (`None`: the
    /// tenant's keys, for workspaces made before lineages existed).
    Inherit(Option<String>),
}

/// Inserts an active workspace at the first generation, with the key
/// lineage `lineage`; a name already used in the tenant is refused (`op`
/// names the query).
#[allow(clippy::too_many_arguments)]
pub(super) async fn insert_workspace(
    conn: &mut AnyConnection,
    id: &WorkspaceId,
    tenant: &TenantId,
    name: Option<&str>,
    lineage: KeyLineage,
    last_sequence: i64,
    now: i64,
    op: &'static str,
) -> Result<(), DbError> {
    let lineage = match lineage {
        KeyLineage::New => Some(id.to_string()),
        KeyLineage::Inherit(lineage) => lineage,
    };
    let result = sqlx::query(
        "INSERT INTO workspaces (id, tenant, name, state, generation, last_sequence, created_at,
                                 updated_at, lineage)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $8)",
    )
    .bind(id.as_str())
    .bind(tenant.as_str())
    .bind(name)
    .bind(WorkspaceState::Active.as_str())
    .bind(FIRST_GENERATION.0 as i64)
    .bind(last_sequence)
    .bind(now)
    .bind(lineage.as_deref())
    .execute(&mut *conn)
    .await;
    match result {
        Ok(_) => {}
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
            return Err(DbError::NameTaken(name.unwrap_or_default().to_owned()));
        }
        Err(source) => return Err(DbError::Query { op, source }),
    }
    if lineage.as_deref() == Some(id.as_str()) {
        sqlx::query(
            "INSERT INTO lineage_keys (lineage, key_id, secret, created_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(id.as_str())
        .bind(FIRST_KEY_ID)
        .bind(random_secret())
        .bind(now)
        .execute(&mut *conn)
        .await
        .map_err(query_error("insert lineage key"))?;
    }
    Ok(())
}

/// Inserts new workspaces, each the start of its own key lineage, in two
/// statements (what [`insert_workspace`] does for one). A name already
/// taken fails the whole statement.
pub(super) async fn insert_new_workspaces(
    conn: &mut AnyConnection,
    workspaces: &[(&WorkspaceId, &TenantId, Option<&str>)],
    now: i64,
) -> Result<(), DbError> {
    if workspaces.is_empty() {
        return Ok(());
    }
    let mut query = SqlBuilder::new(
        "INSERT INTO workspaces (id, tenant, name, state, generation, last_sequence, created_at,
                                 updated_at, lineage)",
    );
    query.push_values(workspaces, |mut row, (id, tenant, name)| {
        row.push_bind(id.as_str())
            .push_bind(tenant.as_str())
            .push_bind(*name)
            .push_bind(WorkspaceState::Active.as_str())
            .push_bind(FIRST_GENERATION.0 as i64)
            .push_bind(0_i64)
            .push_bind(now)
            .push_bind(now)
            .push_bind(id.as_str());
    });
    query
        .build()
        .execute(&mut *conn)
        .await
        .map_err(query_error("insert workspaces"))?;
    let mut query =
        SqlBuilder::new("INSERT INTO lineage_keys (lineage, key_id, secret, created_at)");
    query.push_values(workspaces, |mut row, (id, _, _)| {
        row.push_bind(id.as_str())
            .push_bind(FIRST_KEY_ID)
            .push_bind(random_secret())
            .push_bind(now);
    });
    query
        .build()
        .execute(conn)
        .await
        .map_err(query_error("insert lineage keys"))?;
    Ok(())
}

/// The key lineage of workspace `id` of `tenant` (`None`: the tenant's
/// keys).
pub(super) async fn lineage_of(
    conn: &mut AnyConnection,
    tenant: &TenantId,
    id: &WorkspaceId,
) -> Result<Option<String>, DbError> {
    let row: Option<(Option<String>,)> =
        sqlx::query_as("SELECT lineage FROM workspaces WHERE id = $1 AND tenant = $2")
            .bind(id.as_str())
            .bind(tenant.as_str())
            .fetch_optional(conn)
            .await
            .map_err(query_error("workspace lineage"))?;
    row.map(|(lineage,)| lineage)
        .ok_or_else(|| DbError::WorkspaceNotFound(id.to_string()))
}

impl MetadataStore {
    /// Creates an active workspace; a name already used in the tenant is refused.
    pub async fn create_workspace(
        &self,
        tenant: &TenantId,
        name: Option<&str>,
    ) -> Result<Workspace, DbError> {
        let id = WorkspaceId::generate();
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let op = "insert workspace";
        insert_workspace(tx.conn(), &id, tenant, name, KeyLineage::New, 0, now, op).await?;
        self.commit(tx).await?;
        // Re-read so the record carries exactly what was stored (times are
        // kept at millisecond precision).
        self.workspace(tenant, &WorkspaceRef::Id(id.clone()))
            .await?
            .ok_or_else(|| {
                DbError::Corrupt(format!(
                    "workspace {id} vanished right after it was created"
                ))
            })
    }

    /// A workspace of `tenant` by id or name, with its newest checkpoint.
    pub async fn workspace(
        &self,
        tenant: &TenantId,
        reference: &WorkspaceRef,
    ) -> Result<Option<Workspace>, DbError> {
        let (condition, value) = match reference {
            WorkspaceRef::Id(id) => ("w.id", id.as_str()),
            WorkspaceRef::Name(name) => ("w.name", name.as_str()),
        };
        let sql = format!(
            "SELECT {WORKSPACE_COLUMNS} FROM workspaces w WHERE w.tenant = $1 AND {condition} = $2"
        );
        let row = sqlx::query(&sql)
            .bind(tenant.as_str())
            .bind(value)
            .fetch_optional(&self.pool)
            .await
            .map_err(query_error("workspace"))?;
        let Some(row) = row else { return Ok(None) };
        let mut workspace = workspace_from_row(&row)?;
        let mut latest = self
            .latest_checkpoints(std::slice::from_ref(&workspace.id))
            .await?;
        workspace.latest_checkpoint = latest.remove(&workspace.id);
        Ok(Some(workspace))
    }

    /// Workspaces of `tenant` ordered by id (creation time), after `after`.
    pub async fn list_workspaces(
        &self,
        tenant: &TenantId,
        after: Option<&WorkspaceId>,
        limit: u32,
    ) -> Result<Vec<Workspace>, DbError> {
        let sql = format!(
            "SELECT {WORKSPACE_COLUMNS} FROM workspaces w
             WHERE w.tenant = $1 AND w.id > $2 ORDER BY w.id LIMIT $3"
        );
        let rows = sqlx::query(&sql)
            .bind(tenant.as_str())
            .bind(after.map_or("", |id| id.as_str()))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(query_error("list workspaces"))?;
        let mut workspaces = rows
            .iter()
            .map(workspace_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let ids: Vec<WorkspaceId> = workspaces.iter().map(|w| w.id.clone()).collect();
        let mut latest: HashMap<_, _> = self.latest_checkpoints(&ids).await?;
        for workspace in &mut workspaces {
            workspace.latest_checkpoint = latest.remove(&workspace.id);
        }
        Ok(workspaces)
    }

    /// Makes one new active workspace of `tenant` per entry of `names`, each
    /// starting from a copy of `checkpoint` of `source` (its newest when
    /// `None`), and each with the source's station sessions marked fork
    /// pending. All in one transaction: a fork is all or nothing.
    pub async fn fork_workspace(
        &self,
        tenant: &TenantId,
        source: &WorkspaceId,
        checkpoint: Option<&CheckpointId>,
        names: &[Option<String>],
    ) -> Result<Forked, DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        ensure_active_workspace(tx.conn(), tenant, source, "fork source").await?;
        let from = match checkpoint {
            Some(id) => checkpoint_in(&mut tx, source, id).await?.ok_or_else(|| {
                DbError::NotFound(format!(
                    "checkpoint {id} is not a checkpoint of workspace {source}"
                ))
            })?,
            None => newest_checkpoint_in(&mut tx, source)
                .await?
                .ok_or_else(|| {
                    DbError::Precondition(format!(
                        "workspace {source} has no checkpoint to fork from"
                    ))
                })?,
        };
        // Forks share their source's keys: they deduplicate against the
        // checkpoint they start from (and only that of the source's data).
        let lineage = lineage_of(tx.conn(), tenant, source).await?;
        let mut ids = Vec::with_capacity(names.len());
        for name in names {
            let id = WorkspaceId::generate();
            let op = "insert forked workspace";
            let inherit = KeyLineage::Inherit(lineage.clone());
            insert_workspace(tx.conn(), &id, tenant, name.as_deref(), inherit, 1, now, op).await?;
            copy_checkpoint_in(&mut tx, tenant, &from, &id, FIRST_GENERATION, now).await?;
            // The source's conversations come along, to be forked (never
            // continued: the source and each fork would write to one).
            sqlx::query(
                "INSERT INTO workspace_sessions (workspace_id, station, harness, session_id, run_id,
                                                 updated_at, fork_pending)
                 SELECT $1, station, harness, session_id, run_id, $2, 1
                 FROM workspace_sessions WHERE workspace_id = $3",
            )
            .bind(id.as_str())
            .bind(now)
            .bind(source.as_str())
            .execute(tx.conn())
            .await
            .map_err(query_error("copy station sessions"))?;
            super::stations::copy_notes_for_fork(&mut tx, source, &id, &from).await?;
            ids.push(id);
        }
        self.commit(tx).await?;
        let mut workspaces = Vec::with_capacity(ids.len());
        for id in ids {
            let workspace = self
                .workspace(tenant, &WorkspaceRef::Id(id.clone()))
                .await?
                .ok_or_else(|| {
                    DbError::Corrupt(format!(
                        "workspace {id} vanished right after a fork made it"
                    ))
                })?;
            workspaces.push(workspace);
        }
        Ok(Forked {
            workspaces,
            checkpoint: from.id,
        })
    }
}
