//! Workspace records.

use std::collections::HashMap;
use std::time::SystemTime;

use cairn_proto::domain::{WorkspaceRef, WorkspaceState};
use cairn_proto::ids::{Generation, TenantId, WorkspaceId};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use super::{
    DbError, MetadataStore, Workspace, from_millis, millis, parse_column, query_error, unsigned,
};

/// Generation of a new workspace. Zero stays free to mean "the current one"
/// in requests.
pub(super) const FIRST_GENERATION: Generation = Generation(1);

const WORKSPACE_COLUMNS: &str =
    "w.id, w.tenant, w.name, w.state, w.generation, w.created_at, w.updated_at,
     (SELECT COUNT(*) FROM checkpoints c WHERE c.workspace_id = w.id) AS checkpoint_count";

fn workspace_from_row(row: &SqliteRow) -> Result<Workspace, DbError> {
    let read = |source| DbError::Query {
        op: "read workspace",
        source,
    };
    let id: String = row.try_get("id").map_err(read)?;
    let tenant: String = row.try_get("tenant").map_err(read)?;
    let state: String = row.try_get("state").map_err(read)?;
    let generation: i64 = row.try_get("generation").map_err(read)?;
    let count: i64 = row.try_get("checkpoint_count").map_err(read)?;
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
    })
}

impl MetadataStore {
    /// Creates an active workspace; a name already used in the tenant is refused.
    pub async fn create_workspace(
        &self,
        tenant: &TenantId,
        name: Option<&str>,
    ) -> Result<Workspace, DbError> {
        let id = WorkspaceId::generate();
        let now = SystemTime::now();
        let result = sqlx::query(
            "INSERT INTO workspaces (id, tenant, name, state, generation, last_sequence, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, 0, $6, $6)",
        )
        .bind(id.as_str())
        .bind(tenant.as_str())
        .bind(name)
        .bind(WorkspaceState::Active.as_str())
        .bind(FIRST_GENERATION.0 as i64)
        .bind(millis(now))
        .execute(&self.pool)
        .await;
        match result {
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                return Err(DbError::NameTaken(name.unwrap_or_default().to_owned()));
            }
            Err(source) => {
                return Err(DbError::Query {
                    op: "insert workspace",
                    source,
                });
            }
        }
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
}
