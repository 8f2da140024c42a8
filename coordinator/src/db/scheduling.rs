//! What the scheduler reads and writes: queued runs, host capacity,
//! assignments (a new attempt, generation and run token), why a run stays
//! queued, lost hosts and expired holds.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use cairn_proto::ids::{Generation, HostId, RunId, TenantId, WorkspaceId};
use cairn_proto::runs::{AttemptState, HostState, Labels, RunState};
use prost::Message;
use sqlx::Row;

use super::checkpoints::{fetch_all_in, push_in_list};
use super::hosts::lose_host;
use super::run_records::{
    Attempt, EventDraft, RUN_COLUMNS, Run, add_event, attach_attempts, event_reason, insert_events,
    load_run, run_from_row,
};
use super::runs::{decide, transition};
use super::sql::SqlBuilder;
use super::{
    DbError, MetadataStore, WriteTx, from_millis, millis, parse_column, query_error, signed,
    unsigned,
};
use crate::runlife::{Change, Event};
use crate::tokens::Scope;

/// A run waiting for a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedRun {
    pub id: RunId,
    pub tenant: TenantId,
    pub workspace: WorkspaceId,
    pub labels: Labels,
    pub state_reason: String,
    /// Attempts so far; the next one is this plus one.
    pub attempt_count: u32,
}

/// A host that takes new sandboxes, and how full it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostCapacity {
    pub id: HostId,
    pub tenant: TenantId,
    pub labels: Labels,
    pub slots: u32,
    /// Sandboxes not yet reported gone.
    pub used: u32,
    /// Workspaces whose tree the host keeps (its last heartbeat's list; a
    /// set, as every queued run asks every matching host).
    pub kept: BTreeSet<WorkspaceId>,
}

impl MetadataStore {
    /// Queued runs, oldest first.
    pub async fn queued_runs(&self) -> Result<Vec<QueuedRun>, DbError> {
        let rows = sqlx::query(
            "SELECT id, tenant, workspace_id, spec, state_reason, attempt_count FROM runs
             WHERE state = $1 ORDER BY created_at, id",
        )
        .bind(RunState::Queued.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("queued runs"))?;
        rows.iter()
            .map(|row| {
                let read = |source| DbError::Query {
                    op: "read queued run",
                    source,
                };
                let id: String = row.try_get("id").map_err(read)?;
                let tenant: String = row.try_get("tenant").map_err(read)?;
                let workspace: String = row.try_get("workspace_id").map_err(read)?;
                let spec: Vec<u8> = row.try_get("spec").map_err(read)?;
                let spec = cairn_proto::pb::Run::decode(spec.as_slice())
                    .map_err(|e| DbError::Corrupt(format!("stored spec of run {id}: {e}")))?;
                Ok(QueuedRun {
                    id: parse_column(&id, "run id")?,
                    tenant: parse_column(&tenant, "tenant")?,
                    workspace: parse_column(&workspace, "workspace id")?,
                    labels: Labels(spec.labels.into_iter().collect()),
                    state_reason: row.try_get("state_reason").map_err(read)?,
                    attempt_count: unsigned(
                        row.try_get("attempt_count").map_err(read)?,
                        "attempt count",
                    )?,
                })
            })
            .collect()
    }

    /// Hosts that are ready (not cordoned, draining or lost), with their usage.
    pub async fn ready_hosts(&self) -> Result<Vec<HostCapacity>, DbError> {
        let rows = sqlx::query(
            "SELECT h.id, h.tenant, h.labels, h.slots, h.kept_workspaces,
                    (SELECT COUNT(*) FROM attempts a WHERE a.host_id = h.id AND a.sandbox_gone_at IS NULL) AS used
             FROM hosts h WHERE h.admin_state = $1 AND h.lost_at IS NULL AND h.stopping_at IS NULL ORDER BY h.registered_at, h.id",
        )
        .bind(HostState::Ready.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("ready hosts"))?;
        rows.iter()
            .map(|row| {
                let read = |source| DbError::Query {
                    op: "read host capacity",
                    source,
                };
                let id: String = row.try_get("id").map_err(read)?;
                let tenant: String = row.try_get("tenant").map_err(read)?;
                let labels: String = row.try_get("labels").map_err(read)?;
                let kept: String = row.try_get("kept_workspaces").map_err(read)?;
                Ok(HostCapacity {
                    kept: super::hosts::parse_kept_workspaces(&kept, &id)?
                        .into_iter()
                        .collect(),
                    labels: Labels(serde_json::from_str(&labels).map_err(|e| {
                        DbError::Corrupt(format!("stored labels of host {id}: {e}"))
                    })?),
                    id: parse_column(&id, "host id")?,
                    tenant: parse_column(&tenant, "tenant")?,
                    slots: unsigned(row.try_get("slots").map_err(read)?, "slots")?,
                    used: unsigned(row.try_get("used").map_err(read)?, "used slots")?,
                })
            })
            .collect()
    }

    /// Assigns queued runs to hosts, all in one transaction: each gets
    /// attempt `attempt_count + 1` with its workspace's next generation
    /// (older generations' commits are refused from now on) and its run
    /// token. An assignment whose run or host changed since the scheduler
    /// looked (the run is no longer queued with that attempt count, the
    /// host is no longer ready or has no free slot) is skipped. Returns the
    /// runs assigned.
    pub async fn assign_runs(&self, assignments: &[Assignment]) -> Result<Vec<Run>, DbError> {
        if assignments.is_empty() {
            return Ok(Vec::new());
        }
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let mut runs = load_runs(&mut tx, assignments.iter().map(|a| &a.run)).await?;
        let mut hosts = host_capacities(&mut tx, assignments.iter().map(|a| &a.host)).await?;
        let active = active_workspaces(&mut tx, runs.values().map(|r| &r.workspace_id)).await?;
        let mut chosen = Vec::with_capacity(assignments.len());
        for assignment in assignments {
            let Some(mut run) = runs.remove(&assignment.run) else {
                continue;
            };
            if run.state != RunState::Queued || run.attempt_count != assignment.attempt_count {
                continue;
            }
            let Some(host) = hosts.get_mut(&assignment.host) else {
                continue;
            };
            if host.tenant != run.tenant || !host.ready || host.used >= host.slots {
                continue;
            }
            if !active.contains(&run.workspace_id) {
                fail_on_inactive_workspace(&mut tx, &mut run, now).await?;
                continue;
            }
            host.used += 1;
            chosen.push((run, assignment));
        }
        let assigned = assign_all(&mut tx, chosen, now).await?;
        self.commit(tx).await?;
        Ok(assigned)
    }

    /// Updates why queued runs wait, in one transaction; a changed reason
    /// is recorded as an event. Returns the entries that changed a reason.
    pub async fn set_queue_reasons<'r>(
        &self,
        reasons: &'r [(RunId, String)],
    ) -> Result<Vec<&'r (RunId, String)>, DbError> {
        if reasons.is_empty() {
            return Ok(Vec::new());
        }
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let mut runs = load_runs(&mut tx, reasons.iter().map(|(id, _)| id)).await?;
        let mut changed = Vec::new();
        for entry in reasons {
            let (id, reason) = entry;
            let Some(run) = runs.get_mut(id) else {
                continue;
            };
            if run.state != RunState::Queued || run.state_reason == *reason {
                continue;
            }
            sqlx::query("UPDATE runs SET state_reason = $1 WHERE id = $2")
                .bind(reason)
                .bind(id.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("update queue reason"))?;
            run.state_reason.clone_from(reason);
            add_event(
                &mut tx,
                run,
                EventDraft::new(event_reason::PLACEMENT, reason.as_str()),
                now,
            )
            .await?;
            changed.push(entry);
        }
        self.commit(tx).await?;
        Ok(changed)
    }

    /// Marks lost every host whose last heartbeat (or `alive_since`, if
    /// later) is older than `lease`; their attempts end. Returns the hosts.
    pub async fn mark_lost_hosts(
        &self,
        lease: Duration,
        alive_since: SystemTime,
    ) -> Result<Vec<HostId>, DbError> {
        let now_time = SystemTime::now();
        let deadline = millis(now_time.checked_sub(lease).unwrap_or(std::time::UNIX_EPOCH));
        if millis(alive_since) > deadline {
            return Ok(Vec::new());
        }
        let stale_hosts = || async {
            sqlx::query_scalar::<_, String>(
                "SELECT id FROM hosts WHERE lost_at IS NULL AND last_heartbeat_at < $1 ORDER BY id",
            )
            .bind(deadline)
            .fetch_all(&self.pool)
            .await
            .map_err(query_error("stale hosts"))
        };
        let mut stale = stale_hosts().await?;
        if !stale.is_empty() && self.flush_heartbeats().await? > 0 {
            // A host is never lost for a heartbeat that only waited in
            // this replica's memory: written, then asked again. (Flushed
            // only here, not every pass, so an idle check writes nothing.)
            stale = stale_hosts().await?;
        }
        let mut lost = Vec::new();
        for id in stale {
            let id: HostId = parse_column(&id, "host id")?;
            let now = millis(SystemTime::now());
            let mut tx = self.begin_write().await?;
            // Re-checked as it is marked: a heartbeat may have come in.
            if !lose_host(&mut tx, &id, lease, deadline, now).await? {
                continue;
            }
            self.commit(tx).await?;
            lost.push(id);
        }
        Ok(lost)
    }

    /// When the next hold of a waiting run runs out, if one does.
    pub async fn next_hold_expiry(&self) -> Result<Option<SystemTime>, DbError> {
        let next: Option<i64> = sqlx::query_scalar(
            "SELECT MIN(hold_until) FROM runs WHERE state = $1 AND hold_until > $2",
        )
        .bind(RunState::Waiting.as_str())
        .bind(millis(SystemTime::now()))
        .fetch_one(&self.pool)
        .await
        .map_err(query_error("next hold expiry"))?;
        Ok(next.map(from_millis))
    }

    /// Orders the sandboxes of waiting runs whose hold ran out destroyed.
    /// Returns the runs.
    pub async fn expire_holds(&self) -> Result<Vec<RunId>, DbError> {
        let now = millis(SystemTime::now());
        let due: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM runs WHERE state = $1 AND hold_until IS NOT NULL AND hold_until <= $2 ORDER BY id",
        )
        .bind(RunState::Waiting.as_str())
        .bind(now)
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("expired holds"))?;
        let mut expired = Vec::new();
        for id in due {
            let id: RunId = parse_column(&id, "run id")?;
            let mut tx = self.begin_write().await?;
            let Some(mut run) = load_run(tx.conn(), &id).await? else {
                continue;
            };
            let Some(attempt) = run.active_attempt().cloned() else {
                continue;
            };
            let due = run.hold_until.is_some_and(|until| millis(until) <= now);
            if run.state != RunState::Waiting || !due || attempt.destroy_reason.is_some() {
                continue;
            }
            let detail = format!(
                "held for {}; releasing sandbox {}",
                humantime::format_duration(run.hold),
                attempt.sandbox_id
            );
            // The run stays waiting until its sandbox is gone.
            let draft = EventDraft::new(event_reason::HOLD_EXPIRED, detail).of(&attempt);
            transition(&mut tx, &mut run, Event::HoldExpired, "", draft, now).await?;
            self.commit(tx).await?;
            expired.push(id);
        }
        Ok(expired)
    }
}

/// One run the scheduler places on a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub run: RunId,
    /// The run's attempts when the scheduler looked.
    pub attempt_count: u32,
    pub host: HostId,
    /// The new attempt's run token, hashed.
    pub token_hash: [u8; 32],
}

/// A host's capacity as a transaction sees it.
struct SlotsInTx {
    tenant: TenantId,
    /// Ready, not lost and not stopping.
    ready: bool,
    slots: i64,
    used: i64,
}

/// The runs named, with their attempts, by id.
async fn load_runs<'a>(
    tx: &mut WriteTx,
    ids: impl Iterator<Item = &'a RunId>,
) -> Result<HashMap<RunId, Run>, DbError> {
    let ids: Vec<&RunId> = ids.collect();
    let select = format!("SELECT {RUN_COLUMNS} FROM runs WHERE id IN");
    let rows = fetch_all_in(tx.conn(), &select, &ids, |id| id.as_str(), "runs by id").await?;
    let mut runs = rows
        .iter()
        .map(run_from_row)
        .collect::<Result<Vec<_>, _>>()?;
    attach_attempts(tx.conn(), &mut runs).await?;
    Ok(runs.into_iter().map(|run| (run.id.clone(), run)).collect())
}

/// The capacity of the hosts named, by id (hosts that do not exist are
/// left out).
async fn host_capacities<'a>(
    tx: &mut WriteTx,
    ids: impl Iterator<Item = &'a HostId>,
) -> Result<HashMap<HostId, SlotsInTx>, DbError> {
    let ids: Vec<&HostId> = ids.collect::<BTreeSet<_>>().into_iter().collect();
    let rows = fetch_all_in(
        tx.conn(),
        "SELECT h.id, h.tenant, h.admin_state, COALESCE(h.lost_at, h.stopping_at) AS unavailable_since,
                h.slots,
                (SELECT COUNT(*) FROM attempts a WHERE a.host_id = h.id AND a.sandbox_gone_at IS NULL) AS used
         FROM hosts h WHERE h.id IN",
        &ids,
        |id| id.as_str(),
        "host capacity",
    )
    .await?;
    let mut hosts = HashMap::with_capacity(rows.len());
    for row in &rows {
        let read = |source| DbError::Query {
            op: "read host capacity",
            source,
        };
        let id: String = row.try_get("id").map_err(read)?;
        let tenant: String = row.try_get("tenant").map_err(read)?;
        let admin_state: String = row.try_get("admin_state").map_err(read)?;
        let unavailable_since: Option<i64> = row.try_get("unavailable_since").map_err(read)?;
        hosts.insert(
            parse_column(&id, "host id")?,
            SlotsInTx {
                tenant: parse_column(&tenant, "tenant")?,
                ready: admin_state == HostState::Ready.as_str() && unavailable_since.is_none(),
                slots: row.try_get("slots").map_err(read)?,
                used: row.try_get("used").map_err(read)?,
            },
        );
    }
    Ok(hosts)
}

/// Of the workspaces named, those still active.
async fn active_workspaces<'a>(
    tx: &mut WriteTx,
    ids: impl Iterator<Item = &'a WorkspaceId>,
) -> Result<BTreeSet<WorkspaceId>, DbError> {
    let ids: Vec<&WorkspaceId> = ids.collect::<BTreeSet<_>>().into_iter().collect();
    let select = "SELECT id FROM workspaces WHERE state = 'active' AND id IN";
    let rows = fetch_all_in(
        tx.conn(),
        select,
        &ids,
        |id| id.as_str(),
        "active workspaces",
    )
    .await?;
    rows.iter()
        .map(|row| {
            let id: String = row.try_get("id").map_err(|source| DbError::Query {
                op: "read active workspace",
                source,
            })?;
            parse_column(&id, "workspace id")
        })
        .collect()
}

/// Gives each chosen run, whose workspace is active, its next attempt on
/// its host inside `tx`, in a few statements whatever their number;
/// returns the runs assigned.
async fn assign_all(
    tx: &mut WriteTx,
    chosen: Vec<(Run, &Assignment)>,
    now: i64,
) -> Result<Vec<Run>, DbError> {
    let workspaces: BTreeSet<&WorkspaceId> =
        chosen.iter().map(|(run, _)| &run.workspace_id).collect();
    if chosen.len() < 2 || workspaces.len() < chosen.len() {
        // One run, or runs sharing a workspace (each takes a generation of
        // its own): one by one.
        let mut assigned = Vec::with_capacity(chosen.len());
        for (mut run, assignment) in chosen {
            if assign_in(tx, &mut run, &assignment.host, &assignment.token_hash, now).await? {
                assigned.push(run);
            }
        }
        return Ok(assigned);
    }
    let workspaces: Vec<&WorkspaceId> = workspaces.into_iter().collect();
    let mut generations: HashMap<WorkspaceId, i64> = HashMap::with_capacity(workspaces.len());
    for chunk in workspaces.chunks(super::ROWS_PER_STATEMENT) {
        let mut query =
            SqlBuilder::new("UPDATE workspaces SET generation = generation + 1, updated_at = ");
        query.push_bind(now);
        query.push(" WHERE state = 'active' AND id IN");
        push_in_list(&mut query, chunk, |id| id.as_str());
        query.push(" RETURNING id, generation");
        let rows = query
            .build()
            .fetch_all(tx.conn())
            .await
            .map_err(query_error("advance workspace generations"))?;
        for row in &rows {
            let read = |source| DbError::Query {
                op: "read workspace generation",
                source,
            };
            let id: String = row.try_get("id").map_err(read)?;
            generations.insert(
                parse_column(&id, "workspace id")?,
                row.try_get("generation").map_err(read)?,
            );
        }
    }

    let mut assigned = Vec::with_capacity(chosen.len());
    let mut tokens = Vec::with_capacity(chosen.len());
    for (mut run, assignment) in chosen {
        let Some(&generation) = generations.get(&run.workspace_id) else {
            return Err(DbError::Corrupt(format!(
                "workspace {} stopped being active while run {} was assigned",
                run.workspace_id, run.id
            )));
        };
        let decided = decide(&run, Event::Assigned)?;
        if decided.change != Change::Enter(RunState::Assigned) || !decided.effects.is_empty() {
            return Err(DbError::Corrupt(format!(
                "assigning queued run {} decided {decided:?}",
                run.id
            )));
        }
        let attempt = new_attempt(&run, &assignment.host, generation, now)?;
        run.attempt_count = attempt.number;
        run.attempts.push(attempt);
        run.state = RunState::Assigned;
        run.state_reason = format!("assigned to host {}", assignment.host);
        tokens.push(assignment.token_hash);
        assigned.push(run);
    }
    for (runs, tokens) in assigned
        .chunks_mut(super::ROWS_PER_STATEMENT)
        .zip(tokens.chunks(super::ROWS_PER_STATEMENT))
    {
        record_assignments(tx, runs, tokens, now).await?;
    }
    Ok(assigned)
}

/// Writes assignments decided in memory: each run's new attempt (its last),
/// state and attempt count, its `assigned` event, its run token.
async fn record_assignments(
    tx: &mut WriteTx,
    runs: &mut [Run],
    token_hashes: &[[u8; 32]],
    now: i64,
) -> Result<(), DbError> {
    let attempts: Vec<(&Run, &Attempt)> = runs
        .iter()
        .map(|run| {
            let attempt = run.attempts.last().ok_or_else(|| {
                DbError::Corrupt(format!("run {} was assigned without an attempt", run.id))
            })?;
            Ok((run, attempt))
        })
        .collect::<Result<_, DbError>>()?;
    let mut generations = Vec::with_capacity(attempts.len());
    for (_, attempt) in &attempts {
        generations.push(signed(attempt.generation.0, "generation")?);
    }
    let mut query = SqlBuilder::new(
        "INSERT INTO attempts (run_id, number, generation, host_id, sandbox_id, state, started_at)",
    );
    query.push_values(
        attempts.iter().zip(&generations),
        |mut row, ((run, attempt), generation)| {
            row.push_bind(run.id.as_str())
                .push_bind(i64::from(attempt.number))
                .push_bind(*generation)
                .push_bind(attempt.host_id.as_str())
                .push_bind(attempt.sandbox_id.as_str())
                .push_bind(AttemptState::Assigned.as_str())
                .push_bind(now);
        },
    );
    query
        .build()
        .execute(tx.conn())
        .await
        .map_err(query_error("insert attempts"))?;
    for (_, attempt) in &attempts {
        tx.ring(&attempt.host_id);
    }

    // Each row joined to its values (a CASE per column would cost rows ×
    // values).
    let mut query = SqlBuilder::new("UPDATE runs SET state = ");
    query.push_bind(RunState::Assigned.as_str());
    query.push(", attempt_count = v.column2, state_reason = v.column3, updated_at = ");
    query.push_bind(now);
    query.push(", last_event_sequence = last_event_sequence + 1 FROM (");
    query.push_values(&attempts, |mut row, (run, attempt)| {
        row.push_bind(run.id.as_str())
            .push_bind(i64::from(attempt.number))
            .push_bind(run.state_reason.as_str());
    });
    query.push(") AS v WHERE runs.id = v.column1 RETURNING id, last_event_sequence");
    let rows = query
        .build()
        .fetch_all(tx.conn())
        .await
        .map_err(query_error("record assigned runs"))?;
    let mut sequences: HashMap<String, i64> = HashMap::with_capacity(rows.len());
    for row in &rows {
        let read = |source| DbError::Query {
            op: "read assigned run",
            source,
        };
        sequences.insert(
            row.try_get("id").map_err(read)?,
            row.try_get("last_event_sequence").map_err(read)?,
        );
    }
    let mut events = Vec::with_capacity(attempts.len());
    for (run, attempt) in &attempts {
        let sequence = *sequences.get(run.id.as_str()).ok_or_else(|| {
            DbError::Corrupt(format!("run {} vanished while it was assigned", run.id))
        })?;
        events.push((*run, sequence, assigned_event(attempt)));
    }
    insert_events(tx, &events, now).await?;

    let mut query = SqlBuilder::new(
        "INSERT INTO tokens (token_hash, tenant, scope, workspace_id, description, created_at, run_id, attempt)",
    );
    query.push_values(
        attempts.iter().zip(token_hashes),
        |mut row, ((run, attempt), hash)| {
            row.push_bind(hash.as_slice())
                .push_bind(run.tenant.as_str())
                .push_bind(Scope::Run.as_str())
                .push_bind(run.workspace_id.as_str())
                .push_bind(format!("run {} attempt {}", run.id, attempt.number))
                .push_bind(now)
                .push_bind(run.id.as_str())
                .push_bind(i64::from(attempt.number));
        },
    );
    query.push(" ON CONFLICT (token_hash) DO NOTHING");
    query
        .build()
        .execute(tx.conn())
        .await
        .map_err(query_error("insert run tokens"))?;
    for run in runs.iter_mut() {
        run.updated_at = from_millis(now);
    }
    Ok(())
}

/// A queued run's next attempt on `host` at `generation`, as it is inserted.
fn new_attempt(run: &Run, host: &HostId, generation: i64, now: i64) -> Result<Attempt, DbError> {
    let number = run.attempt_count + 1;
    Ok(Attempt {
        number,
        generation: Generation(unsigned(generation, "generation")?),
        host_id: host.clone(),
        sandbox_id: format!("sbx-{}-a{number}", run.id),
        state: AttemptState::Assigned,
        started_at: from_millis(now),
        ended_at: None,
        end_reason: String::new(),
        prepare: String::new(),
        restored_checkpoint_id: String::new(),
        outcome: None,
        destroy_reason: None,
        sandbox_state: None,
        exit_code: None,
        sandbox_gone_at: None,
        unsaved: None,
    })
}

/// The `assigned` event of `attempt`.
fn assigned_event(attempt: &Attempt) -> EventDraft {
    let detail = format!(
        "attempt {} on host {} (sandbox {}, generation {})",
        attempt.number, attempt.host_id, attempt.sandbox_id, attempt.generation
    );
    EventDraft::new(event_reason::ASSIGNED, detail).of(attempt)
}

/// Fails queued `run`, whose workspace is no longer active.
async fn fail_on_inactive_workspace(
    tx: &mut WriteTx,
    run: &mut Run,
    now: i64,
) -> Result<(), DbError> {
    let why = format!("workspace {} is no longer active", run.workspace_id);
    transition(
        tx,
        run,
        Event::WorkspaceInactive,
        why.clone(),
        EventDraft::new(event_reason::WORKSPACE_INACTIVE, why),
        now,
    )
    .await
}

/// Gives queued `run` its next attempt on `host` inside `tx`. Returns
/// false, having failed the run, when its workspace is no longer active.
async fn assign_in(
    tx: &mut WriteTx,
    run: &mut Run,
    host_id: &HostId,
    token_hash: &[u8; 32],
    now: i64,
) -> Result<bool, DbError> {
    let generation: Option<i64> = sqlx::query_scalar(
        "UPDATE workspaces SET generation = generation + 1, updated_at = $1
         WHERE id = $2 AND state = 'active' RETURNING generation",
    )
    .bind(now)
    .bind(run.workspace_id.as_str())
    .fetch_optional(tx.conn())
    .await
    .map_err(query_error("advance workspace generation"))?;
    let Some(generation) = generation else {
        fail_on_inactive_workspace(tx, run, now).await?;
        return Ok(false);
    };
    let attempt = new_attempt(run, host_id, generation, now)?;
    let number = attempt.number;
    let run_id = &run.id;
    sqlx::query(
        "INSERT INTO attempts (run_id, number, generation, host_id, sandbox_id, state, started_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(run_id.as_str())
    .bind(i64::from(number))
    .bind(generation)
    .bind(host_id.as_str())
    .bind(&attempt.sandbox_id)
    .bind(AttemptState::Assigned.as_str())
    .bind(now)
    .execute(tx.conn())
    .await
    .map_err(query_error("insert attempt"))?;
    tx.ring(host_id);
    sqlx::query("UPDATE runs SET attempt_count = $1 WHERE id = $2")
        .bind(i64::from(number))
        .bind(run_id.as_str())
        .execute(tx.conn())
        .await
        .map_err(query_error("count attempts"))?;
    sqlx::query(
        "INSERT INTO tokens (token_hash, tenant, scope, workspace_id, description, created_at, run_id, attempt)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
         ON CONFLICT (token_hash) DO NOTHING",
    )
    .bind(token_hash.as_slice())
    .bind(run.tenant.as_str())
    .bind(Scope::Run.as_str())
    .bind(run.workspace_id.as_str())
    .bind(format!("run {run_id} attempt {number}"))
    .bind(now)
    .bind(run_id.as_str())
    .bind(i64::from(number))
    .execute(tx.conn())
    .await
    .map_err(query_error("insert run token"))?;
    let event = assigned_event(&attempt);
    run.attempt_count = number;
    run.attempts.push(attempt);
    transition(
        tx,
        run,
        Event::Assigned,
        format!("assigned to host {host_id}"),
        event,
        now,
    )
    .await?;
    Ok(true)
}
