//! Stations: the handoff notes runs leave with their workspace, and the
//! files a run lays for its station.
//!
//! A note is written with the outcome a runner reports (one per run and
//! workspace: a later report of the run replaces it, so an interrupted
//! attempt's note stands until the run's next attempt ends). A runner that
//! claims an attempt gets the workspace's newest [`NOTES_PER_ATTEMPT`] notes,
//! oldest first, to brief a new conversation with. A fork starts with the
//! notes of the work it was forked from: those not written after the
//! checkpoint it was made from.
//!
//! Below runs and workspaces: imports only [`super::run_records`] of the run
//! modules.

use std::collections::BTreeMap;
use std::time::SystemTime;

use cairn_proto::ids::{RunId, WorkspaceId};
use cairn_proto::runs::Outcome;
use cairn_proto::stations::{HandoffText, LaidFiles, NoteField};
use sqlx::any::AnyRow;
use sqlx::{AnyConnection, AnyExecutor, Row};

use super::run_records::Run;
use super::{
    Checkpoint, DbError, MetadataStore, WriteTx, from_millis, millis, parse_column, query_error,
    signed, unsigned,
};

/// How many notes (the newest) an attempt is given.
pub const NOTES_PER_ATTEMPT: u32 = 10;

/// A run's handoff note, as stored with a workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandoffNote {
    pub workspace_id: WorkspaceId,
    pub run_id: RunId,
    pub station: String,
    pub attempt: u32,
    pub harness: String,
    pub outcome: Outcome,
    /// The run's last checkpoint when the note was written (empty: none).
    pub checkpoint_id: String,
    pub created_at: SystemTime,
    pub text: HandoffText,
}

const NOTE_COLUMNS: &str = "workspace_id, run_id, station, attempt, harness, outcome, checkpoint_id, \
                            summary, changed, checked, uncertain, next_action, composed, created_at";

fn note_from_row(row: &AnyRow) -> Result<HandoffNote, DbError> {
    let read = |source| DbError::Query {
        op: "read handoff note",
        source,
    };
    let workspace: String = row.try_get("workspace_id").map_err(read)?;
    let run: String = row.try_get("run_id").map_err(read)?;
    let outcome: String = row.try_get("outcome").map_err(read)?;
    let composed: String = row.try_get("composed").map_err(read)?;
    let composed = composed
        .split(',')
        .filter(|name| !name.is_empty())
        .map(|name| parse_column::<NoteField>(name, "composed note field"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(HandoffNote {
        workspace_id: parse_column(&workspace, "workspace id")?,
        run_id: parse_column(&run, "run id")?,
        station: row.try_get("station").map_err(read)?,
        attempt: unsigned(row.try_get("attempt").map_err(read)?, "attempt")?,
        harness: row.try_get("harness").map_err(read)?,
        outcome: parse_column(&outcome, "outcome")?,
        checkpoint_id: row.try_get("checkpoint_id").map_err(read)?,
        created_at: from_millis(row.try_get("created_at").map_err(read)?),
        text: HandoffText {
            summary: row.try_get("summary").map_err(read)?,
            changed: row.try_get("changed").map_err(read)?,
            checked: row.try_get("checked").map_err(read)?,
            uncertain: row.try_get("uncertain").map_err(read)?,
            next: row.try_get("next_action").map_err(read)?,
            composed,
        },
    })
}

/// Stores the note of attempt `attempt` of `run`, replacing the run's
/// earlier one (the newest note goes last in the workspace's order).
pub(super) async fn record_note(
    tx: &mut WriteTx,
    run: &Run,
    attempt: u32,
    outcome: Outcome,
    checkpoint: &str,
    text: &HandoffText,
    now: i64,
) -> Result<(), DbError> {
    sqlx::query("DELETE FROM handoff_notes WHERE workspace_id = $1 AND run_id = $2")
        .bind(run.workspace_id.as_str())
        .bind(run.id.as_str())
        .execute(tx.conn())
        .await
        .map_err(query_error("replace handoff note"))?;
    let composed: Vec<&str> = text.composed.iter().map(|f| f.as_str()).collect();
    sqlx::query(&format!(
        "INSERT INTO handoff_notes ({NOTE_COLUMNS})
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"
    ))
    .bind(run.workspace_id.as_str())
    .bind(run.id.as_str())
    .bind(&run.station)
    .bind(i64::from(attempt))
    .bind(&run.harness.name)
    .bind(outcome.as_str())
    .bind(checkpoint)
    .bind(&text.summary)
    .bind(&text.changed)
    .bind(&text.checked)
    .bind(&text.uncertain)
    .bind(&text.next)
    .bind(composed.join(","))
    .bind(now)
    .execute(tx.conn())
    .await
    .map_err(query_error("insert handoff note"))?;
    Ok(())
}

/// The notes of `workspace`, oldest first: all of them, or the `newest`.
pub(super) async fn workspace_notes(
    conn: impl AnyExecutor<'_>,
    workspace: &WorkspaceId,
    newest: Option<u32>,
) -> Result<Vec<HandoffNote>, DbError> {
    let rows = sqlx::query(&format!(
        "SELECT {NOTE_COLUMNS} FROM handoff_notes WHERE workspace_id = $1 ORDER BY id DESC LIMIT $2"
    ))
    .bind(workspace.as_str())
    // No limit is every row there can be (SQLite reads a negative limit as
    // none; PostgreSQL refuses one).
    .bind(newest.map_or(i64::MAX, i64::from))
    .fetch_all(conn)
    .await
    .map_err(query_error("handoff notes"))?;
    rows.iter().rev().map(note_from_row).collect()
}

/// Gives the fork `fork` copies of the notes of `source` up to checkpoint
/// `from`: every note except those that describe a later checkpoint of the
/// source (or, naming none, were written after `from` was cut).
pub(super) async fn copy_notes_for_fork(
    tx: &mut WriteTx,
    source: &WorkspaceId,
    fork: &WorkspaceId,
    from: &Checkpoint,
) -> Result<(), DbError> {
    sqlx::query(&format!(
        "INSERT INTO handoff_notes ({NOTE_COLUMNS})
         SELECT $1, n.run_id, n.station, n.attempt, n.harness, n.outcome, n.checkpoint_id, n.summary,
                n.changed, n.checked, n.uncertain, n.next_action, n.composed, n.created_at
         FROM handoff_notes n
         WHERE n.workspace_id = $2
           AND NOT EXISTS (SELECT 1 FROM checkpoints c
                           WHERE c.id = n.checkpoint_id AND c.workspace_id = $2 AND c.sequence > $3)
           AND NOT (n.checkpoint_id = '' AND n.created_at > $4)
         ORDER BY n.id"
    ))
    .bind(fork.as_str())
    .bind(source.as_str())
    .bind(signed(from.sequence, "checkpoint sequence")?)
    .bind(millis(from.created_at))
    .execute(tx.conn())
    .await
    .map_err(query_error("copy handoff notes"))?;
    Ok(())
}

/// Stores the files `run` lays.
pub(super) async fn insert_laid_files(
    tx: &mut WriteTx,
    run: &RunId,
    files: &LaidFiles,
) -> Result<(), DbError> {
    for (path, content) in files.iter() {
        sqlx::query("INSERT INTO run_laid_files (run_id, path, content) VALUES ($1, $2, $3)")
            .bind(run.as_str())
            .bind(path)
            .bind(content.as_slice())
            .execute(tx.conn())
            .await
            .map_err(query_error("insert laid file"))?;
    }
    Ok(())
}

/// The files `run` lays, path → content.
pub(super) async fn laid_files(
    conn: &mut AnyConnection,
    run: &RunId,
) -> Result<BTreeMap<String, Vec<u8>>, DbError> {
    let rows: Vec<(String, Vec<u8>)> =
        sqlx::query_as("SELECT path, content FROM run_laid_files WHERE run_id = $1 ORDER BY path")
            .bind(run.as_str())
            .fetch_all(conn)
            .await
            .map_err(query_error("laid files"))?;
    Ok(rows.into_iter().collect())
}

impl MetadataStore {
    /// The handoff notes of `workspace`, oldest first.
    pub async fn list_handoff_notes(
        &self,
        workspace: &WorkspaceId,
    ) -> Result<Vec<HandoffNote>, DbError> {
        workspace_notes(&self.pool, workspace, None).await
    }
}
