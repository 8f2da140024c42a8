//! What the scheduler reads and writes: queued runs, host capacity,
//! assignments (a new attempt, generation and run token), why a run stays
//! queued, lost hosts and expired holds.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use cairn_proto::ids::{Generation, HostId, RunId, TenantId, WorkspaceId};
use cairn_proto::runs::{AttemptState, HostState, Labels, RunState};
use prost::Message;
use sqlx::Row;

use super::checkpoints::fetch_all_in;
use super::hosts::lose_host;
use super::run_records::{
    Attempt, EventDraft, RUN_COLUMNS, Run, add_event, attach_attempts, event_reason, load_run,
    run_from_row,
};
use super::runs::transition;
use super::{
    DbError, MetadataStore, WriteTx, from_millis, millis, parse_column, query_error, unsigned,
};
use crate::runlife::Event;
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
        let mut assigned = Vec::with_capacity(assignments.len());
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
            if assign_in(
                &mut tx,
                &mut run,
                &assignment.host,
                &assignment.token_hash,
                now,
            )
            .await?
            {
                host.used += 1;
                assigned.push(run);
            }
        }
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
            // Re-checked under the write lock: a heartbeat may have come in.
            let still_stale: Option<i64> = sqlx::query_scalar(
                "SELECT 1 FROM hosts WHERE id = $1 AND lost_at IS NULL AND last_heartbeat_at < $2",
            )
            .bind(id.as_str())
            .bind(deadline)
            .fetch_optional(tx.conn())
            .await
            .map_err(query_error("stale host"))?;
            if still_stale.is_none() {
                continue;
            }
            lose_host(&mut tx, &id, lease, now).await?;
            self.commit(tx).await?;
            lost.push(id);
        }
        Ok(lost)
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
        let why = format!("workspace {} is no longer active", run.workspace_id);
        transition(
            tx,
            run,
            Event::WorkspaceInactive,
            why.clone(),
            EventDraft::new(event_reason::WORKSPACE_INACTIVE, why),
            now,
        )
        .await?;
        return Ok(false);
    };
    let number = run.attempt_count + 1;
    let run_id = &run.id;
    let sandbox_id = format!("sbx-{run_id}-a{number}");
    sqlx::query(
        "INSERT INTO attempts (run_id, number, generation, host_id, sandbox_id, state, started_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(run_id.as_str())
    .bind(i64::from(number))
    .bind(generation)
    .bind(host_id.as_str())
    .bind(&sandbox_id)
    .bind(AttemptState::Assigned.as_str())
    .bind(now)
    .execute(tx.conn())
    .await
    .map_err(query_error("insert attempt"))?;
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
    // What a reload would read back: the new attempt, as inserted above.
    let attempt = Attempt {
        number,
        generation: Generation(unsigned(generation, "generation")?),
        host_id: host_id.clone(),
        sandbox_id: sandbox_id.clone(),
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
    };
    run.attempt_count = number;
    run.attempts.push(attempt.clone());
    let detail = format!(
        "attempt {number} on host {host_id} (sandbox {sandbox_id}, generation {})",
        attempt.generation
    );
    transition(
        tx,
        run,
        Event::Assigned,
        format!("assigned to host {host_id}"),
        EventDraft::new(event_reason::ASSIGNED, detail).of(&attempt),
        now,
    )
    .await?;
    Ok(true)
}
