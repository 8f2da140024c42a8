//! Chat messages to a workspace station.
//!
//! A message goes to the workspace's unfinished run at its station as an
//! input of kind [`MESSAGE_INPUT`]; with no such run it waits as pending and
//! the next run created there takes it. An input is consumed only when the
//! runner reports its harness heard it; a run that ends before that gives
//! its messages back to the workspace (a duplicate beats a loss).
//!
//! Sending one hands it on to its run, a run state change, so
//! [`MetadataStore::send_message`] is in [`super::runs`]. Below runs:
//! imports only [`super::run_records`] of the run modules.

use std::time::SystemTime;

use cairn_proto::ids::{RunId, WorkspaceId};
use sqlx::Row;
use sqlx::any::AnyRow;

use super::run_records::{EventDraft, Run, add_event, add_input, event_reason};
use super::{DbError, MetadataStore, WriteTx, from_millis, parse_column, query_error, unsigned};

/// The kind of the inputs chat messages become (`RunInput.kind`).
pub const MESSAGE_INPUT: &str = "message";

/// Where a message is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageState {
    /// No run has it yet: the next run created at its station takes it.
    Pending,
    /// An input of this run, not heard yet.
    Delivered(RunId),
    /// The harness of this run heard it.
    Heard(RunId),
}

/// A message sent to a workspace station.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub id: u64,
    pub workspace_id: WorkspaceId,
    pub station: String,
    pub text: String,
    pub created_at: SystemTime,
    pub state: MessageState,
    /// How many times a run ended without its harness hearing it.
    pub given_back: u32,
}

const MESSAGE_COLUMNS: &str = "m.id, m.workspace_id, m.station, m.text, m.created_at, m.run_id, \
                               m.given_back, i.consumed_at";

fn message_from_row(row: &AnyRow) -> Result<Message, DbError> {
    let read = |source| DbError::Query {
        op: "read message",
        source,
    };
    let run: Option<String> = row.try_get("run_id").map_err(read)?;
    let consumed: Option<i64> = row.try_get("consumed_at").map_err(read)?;
    let state = match run {
        None => MessageState::Pending,
        Some(run) => {
            let run: RunId = parse_column(&run, "message run id")?;
            if consumed.is_some() {
                MessageState::Heard(run)
            } else {
                MessageState::Delivered(run)
            }
        }
    };
    let workspace: String = row.try_get("workspace_id").map_err(read)?;
    Ok(Message {
        id: unsigned(row.try_get("id").map_err(read)?, "message id")?,
        workspace_id: parse_column(&workspace, "message workspace id")?,
        station: row.try_get("station").map_err(read)?,
        text: row.try_get("text").map_err(read)?,
        created_at: from_millis(row.try_get("created_at").map_err(read)?),
        state,
        given_back: unsigned(row.try_get("given_back").map_err(read)?, "given back")?,
    })
}

pub(super) async fn load_message(tx: &mut WriteTx, id: i64) -> Result<Message, DbError> {
    let row = sqlx::query(&format!(
        "SELECT {MESSAGE_COLUMNS} FROM workspace_messages m
         LEFT JOIN run_inputs i ON i.run_id = m.run_id AND i.id = m.input_id
         WHERE m.id = $1"
    ))
    .bind(id)
    .fetch_one(tx.conn())
    .await
    .map_err(query_error("read message"))?;
    message_from_row(&row)
}

/// Makes message `message` (saying `text`) an input of `run`.
pub(super) async fn deliver(
    tx: &mut WriteTx,
    run: &Run,
    message: i64,
    text: &str,
    now: i64,
) -> Result<(), DbError> {
    let input = add_input(tx, &run.id, MESSAGE_INPUT, text, now).await?;
    sqlx::query("UPDATE workspace_messages SET run_id = $1, input_id = $2 WHERE id = $3")
        .bind(run.id.as_str())
        .bind(input)
        .bind(message)
        .execute(tx.conn())
        .await
        .map_err(query_error("deliver message"))?;
    Ok(())
}

/// Hands the pending messages of the run's workspace station to the new
/// run (its first attempt gets them with the prompt).
pub(super) async fn attach_pending_messages(
    tx: &mut WriteTx,
    run: &Run,
    now: i64,
) -> Result<(), DbError> {
    let pending: Vec<(i64, String)> = sqlx::query_as(
        "SELECT id, text FROM workspace_messages
         WHERE workspace_id = $1 AND station = $2 AND run_id IS NULL ORDER BY id",
    )
    .bind(run.workspace_id.as_str())
    .bind(&run.station)
    .fetch_all(tx.conn())
    .await
    .map_err(query_error("pending messages"))?;
    if pending.is_empty() {
        return Ok(());
    }
    for (id, text) in &pending {
        deliver(tx, run, *id, text, now).await?;
    }
    let detail = format!(
        "{} pending message{} of the workspace",
        pending.len(),
        if pending.len() == 1 { "" } else { "s" }
    );
    add_event(tx, run, EventDraft::new(event_reason::MESSAGE, detail), now).await
}

/// Gives the messages of an ended run that its harness never heard back to
/// the workspace: they go with the next run created at the station.
pub(super) async fn give_back_messages(
    tx: &mut WriteTx,
    run: &Run,
    now: i64,
) -> Result<(), DbError> {
    let given = sqlx::query(
        "UPDATE workspace_messages SET run_id = NULL, input_id = NULL, given_back = given_back + 1
         WHERE run_id = $1 AND input_id IN
             (SELECT id FROM run_inputs WHERE run_id = $1 AND consumed_at IS NULL)",
    )
    .bind(run.id.as_str())
    .execute(tx.conn())
    .await
    .map_err(query_error("give messages back"))?
    .rows_affected();
    if given == 0 {
        return Ok(());
    }
    let detail = format!(
        "{given} unheard message{} given back to the workspace; the next run at station {} takes {}",
        if given == 1 { "" } else { "s" },
        run.station,
        if given == 1 { "it" } else { "them" }
    );
    add_event(
        tx,
        run,
        EventDraft::new(event_reason::MESSAGE_GIVEN_BACK, detail),
        now,
    )
    .await
}

/// Records that an attempt ended with message inputs its harness never
/// heard: they stay pending, so the run's next attempt gets them again.
pub(super) async fn note_unheard_messages(
    tx: &mut WriteTx,
    run: &Run,
    number: u32,
    now: i64,
) -> Result<(), DbError> {
    if run.state.is_terminal() {
        return Ok(());
    }
    let unheard: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM run_inputs WHERE run_id = $1 AND kind = $2 AND consumed_at IS NULL",
    )
    .bind(run.id.as_str())
    .bind(MESSAGE_INPUT)
    .fetch_one(tx.conn())
    .await
    .map_err(query_error("count unheard messages"))?;
    if unheard == 0 {
        return Ok(());
    }
    let mut event = EventDraft::new(
        event_reason::MESSAGE_GIVEN_BACK,
        format!(
            "attempt {number} ended before its harness heard {unheard} message{}; the next attempt gets {}",
            if unheard == 1 { "" } else { "s" },
            if unheard == 1 { "it" } else { "them" }
        ),
    );
    if let Some(attempt) = run.attempt(number) {
        event = event.of(attempt);
    }
    add_event(tx, run, event, now).await
}

impl MetadataStore {
    /// The messages of a workspace, oldest first.
    pub async fn list_messages(&self, workspace: &WorkspaceId) -> Result<Vec<Message>, DbError> {
        let rows = sqlx::query(&format!(
            "SELECT {MESSAGE_COLUMNS} FROM workspace_messages m
             LEFT JOIN run_inputs i ON i.run_id = m.run_id AND i.id = m.input_id
             WHERE m.workspace_id = $1 ORDER BY m.id"
        ))
        .bind(workspace.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("list messages"))?;
        rows.iter().map(message_from_row).collect()
    }
}
