//! Hosts: registration, heartbeats (sandbox reports in, orders out), cordon
//! and drain.
//!
//! Heartbeats are level-triggered. A host reports every sandbox it has, so a
//! sandbox it reported before and leaves out now is gone. The answer is
//! computed from the database every time: every assignment whose sandbox the
//! host has not reported, every destroy order not carried out, `forget` for
//! every reported sandbox that is gone. A lost answer is repeated by the next
//! heartbeat, and a repeated report changes nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::LazyLock;
use std::time::SystemTime;

use cairn_proto::ids::{Generation, HostId, RunId, TenantId, WorkspaceId};
use cairn_proto::runs::{AttemptState, HostState, Labels, SandboxState};
use futures::future::BoxFuture;
use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};

use super::checkpoints::fetch_all_in;
use super::group_commit::{Locking, WriteRequest, fail_all};
use super::run_records::{
    ATTEMPT_COLUMNS, Attempt, EventDraft, Run, attempt_from_row, event_reason, load_run,
};
use super::runs::{EndCause, end_attempt, sandbox_gone, transition};
use super::sql::SqlBuilder;
use super::tokens::{NewTokenRow, TokenInfo, insert_token};
use super::{Backend, TxLock};
use super::{
    DbError, MetadataStore, WriteTx, from_millis, millis, parse_column, query_error, unsigned,
};
use crate::runlife::Event;
use crate::tokens::Scope;

pub use crate::runlife::destroy_reason;

/// How often leases renewed in memory are written: a tenth of the lease,
/// at most a second, so a replica's renewals reach the leader's lost-host
/// check long before the lease runs out.
pub fn heartbeat_flush_interval(lease: std::time::Duration) -> std::time::Duration {
    (lease / 10).clamp(
        std::time::Duration::from_millis(10),
        std::time::Duration::from_secs(1),
    )
}

/// A registered host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    pub id: HostId,
    pub tenant: TenantId,
    pub name: String,
    pub labels: Labels,
    pub slots: u32,
    pub driver: String,
    /// Ready, cordoned or draining: what the operator set.
    pub admin_state: HostState,
    pub lost_at: Option<SystemTime>,
    /// When the host agent said it is shutting down.
    pub stopping_at: Option<SystemTime>,
    pub registered_at: SystemTime,
    pub last_heartbeat_at: SystemTime,
    /// Sandboxes on the host not yet reported gone.
    pub used_slots: u32,
    /// Runs with such a sandbox.
    pub run_ids: Vec<RunId>,
    /// Workspaces whose tree the host keeps (its last heartbeat's list).
    pub kept_workspaces: Vec<WorkspaceId>,
}

impl Host {
    /// What the scheduler and the host see: lost, then stopping, win over
    /// the operator's state.
    pub fn state(&self) -> HostState {
        host_state(
            self.admin_state,
            self.lost_at.is_some(),
            self.stopping_at.is_some(),
        )
    }
}

/// The state a host is shown in: lost, else stopping, else what an admin
/// set.
pub(super) fn host_state(admin: HostState, lost: bool, stopping: bool) -> HostState {
    if lost {
        HostState::Lost
    } else if stopping {
        HostState::Stopping
    } else {
        admin
    }
}

/// What a host says about itself when it registers.
#[derive(Debug, Clone)]
pub struct HostRegistration {
    /// Its old id, when it registers again.
    pub host_id: Option<HostId>,
    pub name: String,
    pub labels: Labels,
    pub slots: u32,
    pub driver: String,
}

/// A host token to bind to the host a registration names.
#[derive(Debug, Clone)]
pub struct BoundToken<'a> {
    pub hash: &'a [u8; 32],
    /// Who asked for it, for the token's description ("enrolled with tok-…").
    /// The token does not expire (an enrollment token's short life would
    /// otherwise end its host's); an operator revokes it.
    pub issued_by: String,
}

/// What a registration came to.
#[derive(Debug, Clone)]
pub enum Registered {
    /// Registered, with the bound token recorded for it if one was asked.
    Host {
        host: Host,
        token: Option<TokenInfo>,
    },
    /// Only a new host could be registered, and this one is known.
    Exists(HostId),
}

/// One sandbox in a heartbeat.
#[derive(Debug, Clone)]
pub struct ReportedSandbox {
    pub sandbox_id: String,
    pub state: SandboxState,
    pub exit_code: i32,
    pub detail: String,
}

/// A sandbox the host should start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssignmentRecord {
    pub sandbox_id: String,
    pub run_id: RunId,
    pub attempt: u32,
    pub generation: Generation,
    pub workspace_id: WorkspaceId,
    pub image: String,
}

/// The answer to a heartbeat.
#[derive(Debug, Clone, Default)]
pub struct HeartbeatAnswer {
    pub state: Option<HostState>,
    pub assignments: Vec<AssignmentRecord>,
    /// Sandbox id → why it must go.
    pub destroy: BTreeMap<String, String>,
    pub forget: Vec<String>,
}

const HOST_COLUMNS: &str = "id, tenant, name, labels, slots, driver, admin_state, lost_at,
     registered_at, last_heartbeat_at, stopping_at, kept_workspaces";

/// A host's stored `kept_workspaces` (a JSON array of workspace ids).
pub(super) fn parse_kept_workspaces(stored: &str, host: &str) -> Result<Vec<WorkspaceId>, DbError> {
    let ids: Vec<String> = serde_json::from_str(stored)
        .map_err(|e| DbError::Corrupt(format!("stored kept workspaces of host {host}: {e}")))?;
    ids.iter()
        .map(|w| parse_column(w, "kept workspace id"))
        .collect()
}

fn host_from_row(row: &AnyRow) -> Result<Host, DbError> {
    let read = |source| DbError::Query {
        op: "read host",
        source,
    };
    let id: String = row.try_get("id").map_err(read)?;
    let tenant: String = row.try_get("tenant").map_err(read)?;
    let labels: String = row.try_get("labels").map_err(read)?;
    let admin_state: String = row.try_get("admin_state").map_err(read)?;
    let lost_at: Option<i64> = row.try_get("lost_at").map_err(read)?;
    let stopping_at: Option<i64> = row.try_get("stopping_at").map_err(read)?;
    let kept: String = row.try_get("kept_workspaces").map_err(read)?;
    Ok(Host {
        kept_workspaces: parse_kept_workspaces(&kept, &id)?,
        labels: Labels(
            serde_json::from_str(&labels)
                .map_err(|e| DbError::Corrupt(format!("stored labels of host {id}: {e}")))?,
        ),
        id: parse_column(&id, "host id")?,
        tenant: parse_column(&tenant, "tenant")?,
        name: row.try_get("name").map_err(read)?,
        slots: unsigned(row.try_get("slots").map_err(read)?, "slots")?,
        driver: row.try_get("driver").map_err(read)?,
        admin_state: parse_column::<HostState>(&admin_state, "host state")?,
        lost_at: lost_at.map(from_millis),
        stopping_at: stopping_at.map(from_millis),
        registered_at: from_millis(row.try_get("registered_at").map_err(read)?),
        last_heartbeat_at: from_millis(row.try_get("last_heartbeat_at").map_err(read)?),
        used_slots: 0,
        run_ids: Vec::new(),
    })
}

/// Fills in each host's sandboxes not yet gone.
async fn attach_usage(conn: &mut AnyConnection, hosts: &mut [Host]) -> Result<(), DbError> {
    for host in hosts {
        let runs: Vec<String> = sqlx::query_scalar(
            "SELECT run_id FROM attempts WHERE host_id = $1 AND sandbox_gone_at IS NULL ORDER BY run_id",
        )
        .bind(host.id.as_str())
        .fetch_all(&mut *conn)
        .await
        .map_err(query_error("host usage"))?;
        host.used_slots = u32::try_from(runs.len()).unwrap_or(u32::MAX);
        host.run_ids = runs
            .iter()
            .map(|r| parse_column(r, "run id"))
            .collect::<Result<_, _>>()?;
        host.run_ids.dedup();
    }
    Ok(())
}

async fn load_host(conn: &mut AnyConnection, id: &HostId) -> Result<Option<Host>, DbError> {
    let Some(host) = load_host_without_usage(conn, id).await? else {
        return Ok(None);
    };
    let mut hosts = [host];
    attach_usage(conn, &mut hosts).await?;
    let [host] = hosts;
    Ok(Some(host))
}

/// A host with its usage left empty, for a heartbeat, which never needs it.
async fn load_host_without_usage(
    conn: &mut AnyConnection,
    id: &HostId,
) -> Result<Option<Host>, DbError> {
    let row = sqlx::query(&format!("SELECT {HOST_COLUMNS} FROM hosts WHERE id = $1"))
        .bind(id.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(query_error("host"))?;
    row.as_ref().map(host_from_row).transpose()
}

/// A host of `tenant` by id, or by name when the name is unambiguous (among
/// hosts that are not lost, if several share it).
async fn find_host(
    conn: &mut AnyConnection,
    tenant: &TenantId,
    reference: &str,
) -> Result<Host, DbError> {
    let missing = || DbError::NotFound(format!("host {reference} does not exist"));
    if HostId::looks_like(reference) {
        let id: HostId = reference.parse().map_err(|_| missing())?;
        return load_host(conn, &id)
            .await?
            .filter(|h| &h.tenant == tenant)
            .ok_or_else(missing);
    }
    let rows = sqlx::query(&format!(
        "SELECT {HOST_COLUMNS} FROM hosts WHERE tenant = $1 AND name = $2 ORDER BY id"
    ))
    .bind(tenant.as_str())
    .bind(reference)
    .fetch_all(&mut *conn)
    .await
    .map_err(query_error("host by name"))?;
    let mut hosts = rows
        .iter()
        .map(host_from_row)
        .collect::<Result<Vec<_>, _>>()?;
    if hosts.len() > 1 {
        hosts.retain(|h| h.lost_at.is_none());
    }
    match hosts.len() {
        0 => Err(missing()),
        1 => {
            attach_usage(conn, &mut hosts).await?;
            Ok(hosts.remove(0))
        }
        _ => Err(DbError::Precondition(format!(
            "hosts {} are all named {reference}; name one by id",
            hosts
                .iter()
                .map(|h| h.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Attempts on a host whose sandboxes are not gone: (run, attempt number).
async fn attempts_on_host(
    conn: &mut AnyConnection,
    host: &HostId,
) -> Result<Vec<(RunId, u32)>, DbError> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT run_id, number FROM attempts WHERE host_id = $1 AND sandbox_gone_at IS NULL
         ORDER BY run_id, number",
    )
    .bind(host.as_str())
    .fetch_all(conn)
    .await
    .map_err(query_error("attempts on host"))?;
    rows.iter()
        .map(|(run, number)| Ok((parse_column(run, "run id")?, unsigned(*number, "attempt")?)))
        .collect()
}

/// The run of an attempt found on a host.
async fn run_of_attempt(conn: &mut AnyConnection, run_id: &RunId) -> Result<Run, DbError> {
    load_run(conn, run_id)
        .await?
        .ok_or_else(|| DbError::Corrupt(format!("attempt of missing run {run_id}")))
}

/// Why every sandbox on a host is ordered destroyed.
#[derive(Clone, Copy)]
enum HostRelease {
    /// The operator drains it (the run's state reason says so too).
    Draining,
    /// The host agent is shutting down.
    Stopping,
}

/// Orders destroyed every sandbox on `host` not already ended or ordered,
/// recording why on each run.
async fn release_host_sandboxes(
    tx: &mut WriteTx,
    host: &Host,
    release: HostRelease,
    now: i64,
) -> Result<(), DbError> {
    let (doing, word, event) = match release {
        HostRelease::Draining => ("is draining", event_reason::DRAINING, Event::HostDraining),
        HostRelease::Stopping => (
            "is shutting down",
            event_reason::HOST_STOPPING,
            Event::HostStopping,
        ),
    };
    for (run_id, number) in attempts_on_host(tx.conn(), &host.id).await? {
        let mut run = run_of_attempt(tx.conn(), &run_id).await?;
        let Some(attempt) = run.attempt(number).cloned() else {
            continue;
        };
        if attempt.is_ended() || attempt.destroy_reason.is_some() {
            continue;
        }
        let reason = format!(
            "host {} {doing}; releasing sandbox {}",
            host.id, attempt.sandbox_id
        );
        // The run stays as it is until its sandbox is gone; only a drain
        // says so in its state reason.
        let state_reason = match release {
            HostRelease::Draining => reason.clone(),
            HostRelease::Stopping => String::new(),
        };
        let draft = EventDraft::new(word, reason).of(&attempt);
        transition(tx, &mut run, event, state_reason, draft, now).await?;
    }
    Ok(())
}

impl MetadataStore {
    /// Registers a host, or registers it again under its old id (it is no
    /// longer lost; its operator state stays). With `rights.new_only` (an
    /// enrollment token) a host the coordinator knows is not touched and
    /// [`Registered::Exists`] is answered; with `bound_token`, a host token
    /// bound to the registered host is recorded in the same transaction, so
    /// a host is never registered without the credential its caller was
    /// promised.
    pub async fn register_host(
        &self,
        tenant: &TenantId,
        registration: HostRegistration,
        new_only: bool,
        bound_token: Option<BoundToken<'_>>,
    ) -> Result<Registered, DbError> {
        let now = millis(SystemTime::now());
        let labels = serde_json::to_string(&registration.labels.0)
            .map_err(|e| DbError::Corrupt(format!("labels do not encode: {e}")))?;
        let mut tx = self.begin_write().await?;
        let existing = match &registration.host_id {
            Some(id) => load_host(tx.conn(), id).await?,
            None => None,
        };
        let id = match existing {
            // Said the same for a host of another tenant: an enrollment
            // token learns nothing about other tenants' hosts.
            Some(host) if new_only => return Ok(Registered::Exists(host.id)),
            Some(host) if &host.tenant != tenant => {
                return Err(DbError::Precondition(format!(
                    "host id {} belongs to another tenant",
                    host.id
                )));
            }
            Some(host) => {
                // Its sandboxes are not touched: the host reports what it
                // still has in its next heartbeat, and what it leaves out is
                // gone then. A runner stopping on its own keeps the time to
                // commit its last checkpoint at its generation.
                sqlx::query(
                    "UPDATE hosts SET name = $1, labels = $2, slots = $3, driver = $4, lost_at = NULL,
                         stopping_at = NULL, registered_at = $5, last_heartbeat_at = $5 WHERE id = $6",
                )
                .bind(&registration.name)
                .bind(&labels)
                .bind(i64::from(registration.slots))
                .bind(&registration.driver)
                .bind(now)
                .bind(host.id.as_str())
                .execute(tx.conn())
                .await
                .map_err(query_error("update host"))?;
                host.id
            }
            None => {
                let id = registration
                    .host_id
                    .clone()
                    .unwrap_or_else(HostId::generate);
                sqlx::query(&format!(
                    "INSERT INTO hosts ({HOST_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, NULL, $8, $8, NULL, '[]')"
                ))
                .bind(id.as_str())
                .bind(tenant.as_str())
                .bind(&registration.name)
                .bind(&labels)
                .bind(i64::from(registration.slots))
                .bind(&registration.driver)
                .bind(HostState::Ready.as_str())
                .bind(now)
                .execute(tx.conn())
                .await
                .map_err(query_error("insert host"))?;
                id
            }
        };
        let host = load_host(tx.conn(), &id)
            .await?
            .ok_or_else(|| DbError::Corrupt(format!("host {id} vanished while registering")))?;
        let token = match bound_token {
            Some(token) => {
                let description =
                    format!("bound to host {id} ({}); {}", host.name, token.issued_by);
                let row = NewTokenRow {
                    hash: token.hash,
                    tenant,
                    scope: Scope::Host,
                    description: &description,
                    expires_at: None,
                    host: Some(&id),
                };
                Some(insert_token(tx.conn(), &row).await?)
            }
            None => None,
        };
        self.commit(tx).await?;
        Ok(Registered::Host { host, token })
    }

    /// Records a heartbeat and its sandbox reports; returns what the host
    /// must do.
    ///
    /// Most heartbeats change nothing but the host's lease: they are
    /// answered from reads alone and the lease is renewed in memory
    /// ([`MetadataStore::flush_heartbeats`] persists it in one batch). One
    /// that reports a new sandbox state or kept trees is answered the same
    /// way, and what it reports is written after the answer, shared with
    /// other reports. Only a heartbeat that ends something (a sandbox gone,
    /// a host stopping) takes a write transaction before it is answered, and
    /// its lease too waits in memory, so the write rate follows the work,
    /// not the fleet size.
    pub async fn heartbeat(
        &self,
        tenant: &TenantId,
        host_id: &HostId,
        reports: &[ReportedSandbox],
        stopping: bool,
        kept: &[WorkspaceId],
    ) -> Result<HeartbeatAnswer, DbError> {
        let now = millis(SystemTime::now());
        let heartbeat = Heartbeat {
            tenant: tenant.clone(),
            host_id: host_id.clone(),
            reports: reports.to_vec(),
            stopping,
            kept: kept.to_vec(),
            now,
        };
        // Heartbeats that arrive together are read together, and those
        // that write while another is being written share the next
        // transaction (see [`super::group_commit`]).
        match self.heartbeat_reads.submit(self, heartbeat).await? {
            ReadAnswer::Answered(answer) => {
                self.renew_lease(host_id, now);
                Ok(answer)
            }
            ReadAnswer::MustWrite(heartbeat) => {
                // After the reports this host was answered on: written
                // later, they would overwrite what this one writes.
                self.unwritten_reports.written(Some(host_id)).await;
                let answer = self.heartbeat_writes.submit(self, heartbeat).await?;
                // A heartbeat that writes leaves its lease to the flush
                // too: lease renewals are written in one place.
                self.renew_lease(host_id, now);
                Ok(answer)
            }
        }
    }

    /// Writes after their answers the reports heartbeats read together
    /// planned (see [`read_heartbeats`]), sharing transactions with others
    /// deferred meanwhile. A failed write is logged and dropped: the hosts
    /// report the same again at their next heartbeat, which plans it again.
    fn defer_reports(&self, planned: PlannedWrites) {
        let hosts = planned.hosts.clone();
        let store = self.clone();
        tokio::spawn(async move {
            if let Err(e) = store.report_writes.submit(&store, planned).await {
                tracing::warn!(error = %e, hosts = hosts.len(), "could not record the sandbox states and kept trees of heartbeats already answered; their hosts report them again");
            }
            store.unwritten_reports.remove(&hosts);
        });
    }

    /// Waits until every report deferred so far is written (or dropped):
    /// a coordinator that shuts down writes them before it closes the
    /// database.
    pub async fn write_deferred_reports(&self) {
        self.unwritten_reports.written(None).await;
    }

    /// Renews `host`'s lease in memory until the next flush.
    fn renew_lease(&self, host: &HostId, now: i64) {
        let mut renewed = self.renewed_leases.lock().expect("lease map lock");
        let at = renewed.entry(host.clone()).or_insert(now);
        *at = (*at).max(now);
    }

    /// Persists the leases renewed in memory since the last flush, in one
    /// transaction, and returns how many. A failed flush keeps them for the
    /// next one. The scheduler flushes before it declares a host lost, and
    /// the coordinator every [`heartbeat_flush_interval`], so another
    /// replica sees a renewal at most that late.
    pub async fn flush_heartbeats(&self) -> Result<usize, DbError> {
        let renewed = std::mem::take(&mut *self.renewed_leases.lock().expect("lease map lock"));
        if renewed.is_empty() {
            return Ok(0);
        }
        let result = async {
            let renewed: Vec<(&HostId, i64)> = renewed.iter().map(|(h, at)| (h, *at)).collect();
            // In this replica's host-rows turn, which heartbeat batches
            // updating these rows take too (see `TxLock::HostRows`); the
            // scheduler marks a host lost by re-reading its lease.
            let mut tx = self.begin_batch(TxLock::HostRows).await?;
            // One statement a chunk; a renewal never moves a lease back (a
            // host that moved to another replica may have renewed since).
            for chunk in renewed.chunks(super::ROWS_PER_STATEMENT) {
                let mut query =
                    SqlBuilder::new("UPDATE hosts SET last_heartbeat_at = v.column2 FROM (");
                query.push_values(chunk, |mut row, (host, at)| {
                    row.push_bind(host.as_str()).push_bind(*at);
                });
                query.push(
                    ") AS v WHERE hosts.id = v.column1 AND hosts.last_heartbeat_at < v.column2",
                );
                query
                    .build()
                    .execute(tx.conn())
                    .await
                    .map_err(query_error("renew host leases"))?;
            }
            self.commit(tx).await
        }
        .await;
        if let Err(e) = result {
            for (host, at) in renewed {
                self.renew_lease(&host, at);
            }
            return Err(e);
        }
        Ok(renewed.len())
    }

    /// Hosts of `tenant`, oldest registration first.
    pub async fn list_hosts(&self, tenant: &TenantId) -> Result<Vec<Host>, DbError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(query_error("list hosts"))?;
        let rows = sqlx::query(&format!(
            "SELECT {HOST_COLUMNS} FROM hosts WHERE tenant = $1 ORDER BY id"
        ))
        .bind(tenant.as_str())
        .fetch_all(&mut *conn)
        .await
        .map_err(query_error("list hosts"))?;
        let mut hosts = rows
            .iter()
            .map(host_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        attach_usage(&mut conn, &mut hosts).await?;
        Ok(hosts)
    }

    /// A host of `tenant` by id or name.
    pub async fn host(&self, tenant: &TenantId, reference: &str) -> Result<Host, DbError> {
        let mut conn = self.pool.acquire().await.map_err(query_error("host"))?;
        find_host(&mut conn, tenant, reference).await
    }

    /// Sets the operator's state of a host: ready (uncordon) or cordoned.
    pub async fn set_host_admin_state(
        &self,
        tenant: &TenantId,
        reference: &str,
        state: HostState,
    ) -> Result<Host, DbError> {
        if !matches!(state, HostState::Ready | HostState::Cordoned) {
            return Err(DbError::Invalid(format!(
                "a host cannot be set {state} directly"
            )));
        }
        let mut tx = self.begin_write().await?;
        let host = find_host(tx.conn(), tenant, reference).await?;
        sqlx::query("UPDATE hosts SET admin_state = $1 WHERE id = $2")
            .bind(state.as_str())
            .bind(host.id.as_str())
            .execute(tx.conn())
            .await
            .map_err(query_error("set host state"))?;
        let host = load_host(tx.conn(), &host.id)
            .await?
            .ok_or_else(|| DbError::Corrupt("a host vanished while it was changed".into()))?;
        self.commit(tx).await?;
        Ok(host)
    }

    /// Cordons a host and orders every sandbox on it destroyed: running runs
    /// are queued again when their sandbox is gone, waiting ones suspended.
    pub async fn drain_host(&self, tenant: &TenantId, reference: &str) -> Result<Host, DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.begin_write().await?;
        let host = find_host(tx.conn(), tenant, reference).await?;
        sqlx::query("UPDATE hosts SET admin_state = $1 WHERE id = $2")
            .bind(HostState::Draining.as_str())
            .bind(host.id.as_str())
            .execute(tx.conn())
            .await
            .map_err(query_error("drain host"))?;
        release_host_sandboxes(&mut tx, &host, HostRelease::Draining, now).await?;
        let host = load_host(tx.conn(), &host.id)
            .await?
            .ok_or_else(|| DbError::Corrupt("a host vanished while it was drained".into()))?;
        self.commit(tx).await?;
        Ok(host)
    }
}

/// The reports heartbeats were answered on and that are not written yet
/// (see [`MetadataStore::defer_reports`]), by host. Until they are, this
/// replica reads a host's attempts and kept trees with them laid over what
/// the database says ([`Self::lay_over`]): a heartbeat that follows at once
/// sees what the one before it reported (a sandbox it started, which it
/// may leave out next if it lost track of it, is not taken for one it has
/// yet to start).
#[derive(Debug, Default)]
pub(super) struct UnwrittenReports {
    hosts: std::sync::Mutex<HashMap<HostId, Unwritten>>,
    written: tokio::sync::Notify,
}

/// One host's reports not written yet.
#[derive(Debug, Clone, Default)]
struct Unwritten {
    /// Writes of them under way: the entry goes when the last one ends.
    writes: usize,
    /// The latest state reported of each sandbox.
    sandbox_states: HashMap<String, SandboxState>,
    /// The latest kept trees reported, if they changed.
    kept: Option<Vec<WorkspaceId>>,
}

impl UnwrittenReports {
    /// Notes what a heartbeat of `host` reported and will be written.
    fn add(
        &self,
        host: &HostId,
        sandbox_states: &[(String, SandboxState)],
        kept: Option<&[WorkspaceId]>,
    ) {
        let mut unwritten = self.hosts.lock().expect("unwritten reports lock");
        let entry = unwritten.entry(host.clone()).or_default();
        entry.writes += 1;
        entry.sandbox_states.extend(sandbox_states.iter().cloned());
        if let Some(kept) = kept {
            entry.kept = Some(kept.to_vec());
        }
    }

    /// Notes that the writes of one heartbeat of each of `hosts` ended
    /// (written or not: a report not written comes again).
    fn remove(&self, hosts: &[HostId]) {
        {
            let mut unwritten = self.hosts.lock().expect("unwritten reports lock");
            for host in hosts {
                if let Some(entry) = unwritten.get_mut(host) {
                    entry.writes -= 1;
                    if entry.writes == 0 {
                        unwritten.remove(host);
                    }
                }
            }
        }
        self.written.notify_waiters();
    }

    /// What `hosts` reported and is not written yet. Taken before their
    /// rows are read: a write that ends in between is then either in what
    /// was read or in this.
    fn of(&self, hosts: &[&HostId]) -> HashMap<HostId, Unwritten> {
        let unwritten = self.hosts.lock().expect("unwritten reports lock");
        hosts
            .iter()
            .filter_map(|host| Some(((*host).clone(), unwritten.get(*host)?.clone())))
            .collect()
    }

    /// Waits until no report of `host` (of any host, if `None`) is left to
    /// write.
    async fn written(&self, host: Option<&HostId>) {
        loop {
            let notified = self.written.notified();
            tokio::pin!(notified);
            // Registered before looking, so a write that ends in between
            // still wakes this.
            notified.as_mut().enable();
            let pending = {
                let unwritten = self.hosts.lock().expect("unwritten reports lock");
                match host {
                    Some(host) => unwritten.contains_key(host),
                    None => !unwritten.is_empty(),
                }
            };
            if !pending {
                return;
            }
            notified.await;
        }
    }
}

/// Where a heartbeat runs.
enum Session<'a> {
    /// On what a batch of heartbeats read together: it answers only if
    /// nothing needs writing.
    Read(&'a Preloaded),
    /// On what a batch of heartbeats read together in a write transaction:
    /// it answers if all it writes is a lease, kept trees and sandbox
    /// states, which it plans for the batch to write at once.
    Plan(&'a Preloaded, &'a mut PlannedWrites),
    /// In a write transaction, on its own.
    Write(&'a mut WriteTx),
}

impl Session<'_> {
    /// The transaction to write in; `None` on a read or plan session, whose
    /// heartbeat must then run again in a write transaction of its own.
    fn writer(&mut self) -> Option<&mut WriteTx> {
        match self {
            Self::Read(_) | Self::Plan(..) => None,
            Self::Write(tx) => Some(tx),
        }
    }
}

/// The writes of heartbeats planned together, written in a few statements.
#[derive(Default)]
pub(crate) struct PlannedWrites {
    /// Host, kept workspaces (as stored), where they changed.
    kept: Vec<(HostId, String)>,
    /// Sandbox, state reported.
    sandbox_states: Vec<(String, SandboxState)>,
    /// The hosts whose heartbeats planned these writes, when they are
    /// written after the answer: until then a heartbeat of theirs that
    /// writes waits (see [`UnwrittenReports`]).
    hosts: Vec<HostId>,
}

impl PlannedWrites {
    fn is_empty(&self) -> bool {
        self.kept.is_empty() && self.sandbox_states.is_empty()
    }

    /// A host's reported kept trees, planned as its heartbeat would.
    #[cfg(test)]
    pub(super) fn kept(host: &HostId, kept: &[WorkspaceId]) -> Self {
        Self {
            kept: vec![(host.clone(), kept_json(kept))],
            ..Self::default()
        }
    }

    /// One sandbox's reported state, planned as a heartbeat of its host would.
    #[cfg(test)]
    pub(super) fn sandbox_state(sandbox: &str, state: SandboxState) -> Self {
        Self {
            sandbox_states: vec![(sandbox.to_owned(), state)],
            ..Self::default()
        }
    }

    fn extend(&mut self, other: Self) {
        self.kept.extend(other.kept);
        self.sandbox_states.extend(other.sandbox_states);
        self.hosts.extend(other.hosts);
    }

    /// Writes the planned rows, a statement per [`super::ROWS_PER_STATEMENT`]
    /// (each row joined to its values, not matched against a `CASE` of all
    /// of them: that costs rows × values). A host or sandbox planned twice
    /// (reports of several heartbeats, written together after their
    /// answers) gets its later plan.
    async fn write(&self, tx: &mut WriteTx) -> Result<(), DbError> {
        if !self.kept.is_empty() {
            tx.take_host_rows_turn().await;
        }
        let kept = last_per_key(&self.kept, |(host, _)| host);
        for chunk in kept.chunks(super::ROWS_PER_STATEMENT) {
            let mut query = SqlBuilder::new("UPDATE hosts SET kept_workspaces = v.column2 FROM (");
            query.push_values(chunk, |mut row, (host, kept)| {
                row.push_bind(host.as_str()).push_bind(kept.as_str());
            });
            query.push(") AS v WHERE hosts.id = v.column1");
            query
                .build()
                .execute(tx.conn())
                .await
                .map_err(query_error("record heartbeats"))?;
        }
        // A sandbox recorded gone since it was planned keeps the state it
        // went with: a report written after its answer may land after a
        // later one that ended the attempt.
        let sandbox_states = last_per_key(&self.sandbox_states, |(sandbox, _)| sandbox);
        for chunk in sandbox_states.chunks(super::ROWS_PER_STATEMENT) {
            let mut query = SqlBuilder::new("UPDATE attempts SET sandbox_state = v.column2 FROM (");
            query.push_values(chunk, |mut row, (sandbox, state)| {
                row.push_bind(sandbox.as_str()).push_bind(state.as_str());
            });
            query.push(
                ") AS v WHERE attempts.sandbox_id = v.column1 AND attempts.sandbox_gone_at IS NULL",
            );
            query
                .build()
                .execute(tx.conn())
                .await
                .map_err(query_error("record sandbox states"))?;
        }
        Ok(())
    }
}

/// The last of `items` for each key, in the order those last ones come:
/// an `UPDATE … FROM` joined to two rows for one key writes either.
fn last_per_key<T, K: Eq + std::hash::Hash>(items: &[T], key: impl Fn(&T) -> &K) -> Vec<&T> {
    let mut seen = std::collections::HashSet::with_capacity(items.len());
    let mut last: Vec<&T> = items
        .iter()
        .rev()
        .filter(|item| seen.insert(key(item)))
        .collect();
    last.reverse();
    last
}

/// The stored form of a host's kept workspaces.
fn kept_json(kept: &[WorkspaceId]) -> String {
    let kept: Vec<&str> = kept.iter().map(WorkspaceId::as_str).collect();
    serde_json::to_string(&kept).expect("strings always serialise")
}

/// A heartbeat's contents, as the host sent them.
pub(crate) struct Heartbeat {
    pub(super) tenant: TenantId,
    pub(super) host_id: HostId,
    pub(super) reports: Vec<ReportedSandbox>,
    pub(super) stopping: bool,
    pub(super) kept: Vec<WorkspaceId>,
    /// When it arrived, in milliseconds since the epoch.
    pub(super) now: i64,
}

/// What reading a heartbeat came to.
pub(crate) enum ReadAnswer {
    Answered(HeartbeatAnswer),
    /// It changes something: it must run again in a write transaction.
    MustWrite(Heartbeat),
}

impl WriteRequest for Heartbeat {
    type Answer = HeartbeatAnswer;

    /// What a plan writes (kept trees, sandbox states) is what no lock
    /// holder decides on unchecked: a sandbox taken as gone before it was
    /// reported gets a destroy order at its next report. Its leases are
    /// renewed in memory, as a heartbeat's that only reads, and flushed
    /// with those (a host is marked lost by a statement that re-reads its
    /// lease). Heartbeats written one by one change runs, and take the
    /// write lock.
    fn locking(_batch: &[Self]) -> Locking {
        Locking::OneByOne
    }

    fn writes_all_at_once(_batch: &[Self]) -> bool {
        true
    }

    /// Answers each heartbeat of a batch whose writes can be planned, and
    /// writes what they planned in a few statements; leaves the others
    /// (a host stopping, a sandbox gone, a second heartbeat of one host)
    /// to be written one by one.
    fn write_all<'a>(
        batch: &'a [Self],
        tx: &'a mut WriteTx,
    ) -> BoxFuture<'a, Result<Vec<Option<HeartbeatAnswer>>, DbError>> {
        Box::pin(async move {
            let backend = tx.backend;
            let preloaded = Preloaded::read(tx.conn(), backend, batch).await?;
            let mut planned = PlannedWrites::default();
            let mut hosts = std::collections::HashSet::new();
            let mut answers = Vec::with_capacity(batch.len());
            for heartbeat in batch {
                if !hosts.insert(&heartbeat.host_id) {
                    answers.push(None);
                    continue;
                }
                let mut own = PlannedWrites::default();
                // A heartbeat refused here is refused again on its own, with
                // its own answer.
                let answer = heartbeat
                    .apply(Session::Plan(&preloaded, &mut own))
                    .await
                    .ok()
                    .flatten();
                if answer.is_some() {
                    planned.extend(own);
                }
                answers.push(answer);
            }
            planned.write(tx).await?;
            Ok(answers)
        })
    }

    fn write(self, tx: &mut WriteTx) -> BoxFuture<'_, Result<HeartbeatAnswer, DbError>> {
        Box::pin(async move {
            self.apply(Session::Write(tx))
                .await?
                .ok_or_else(|| DbError::Corrupt("a write heartbeat asked for a write".into()))
        })
    }
}

/// The [`BatchFn`](super::group_commit::BatchFn) of heartbeats read
/// together: what they all need, read in a few statements, then each one's
/// answer, or its turn to write.
///
/// A heartbeat whose writes can be planned (sandbox states, kept trees) is
/// answered here too, and what it planned is written after the answer
/// ([`MetadataStore::defer_reports`]): the answer does not depend on those
/// writes, and a report lost with them comes again in the host's next
/// heartbeat, which plans it again. So the reports that follow an
/// assignment wave wait for no commit and no second queue.
pub(crate) fn read_heartbeats(
    store: MetadataStore,
    batch: Vec<Heartbeat>,
) -> BoxFuture<'static, Vec<Result<ReadAnswer, DbError>>> {
    Box::pin(async move {
        let read = async {
            let mut conn = store
                .pool
                .acquire()
                .await
                .map_err(query_error("heartbeat"))?;
            Preloaded::read(&mut conn, store.backend, &batch).await
        };
        let hosts: Vec<&HostId> = batch.iter().map(|h| &h.host_id).collect();
        let unwritten = store.unwritten_reports.of(&hosts);
        let mut preloaded = match read.await {
            Ok(preloaded) => preloaded,
            Err(e) => return fail_all(batch.len(), &e),
        };
        preloaded.lay_over(unwritten);
        let mut planned = PlannedWrites::default();
        let mut planned_hosts = std::collections::HashSet::new();
        let mut answers = Vec::with_capacity(batch.len());
        for heartbeat in batch {
            // A host is planned once a batch: its second heartbeat reads
            // what its first has yet to write, and so must write alone.
            let plan = planned_hosts.insert(heartbeat.host_id.clone());
            let mut own = PlannedWrites::default();
            let session = if plan {
                Session::Plan(&preloaded, &mut own)
            } else {
                Session::Read(&preloaded)
            };
            answers.push(match heartbeat.apply(session).await {
                Ok(Some(answer)) => {
                    if !own.is_empty() {
                        let kept = (!own.kept.is_empty()).then_some(&heartbeat.kept[..]);
                        store
                            .unwritten_reports
                            .add(&heartbeat.host_id, &own.sandbox_states, kept);
                        own.hosts.push(heartbeat.host_id);
                        planned.extend(own);
                    }
                    Ok(ReadAnswer::Answered(answer))
                }
                Ok(None) => Ok(ReadAnswer::MustWrite(heartbeat)),
                Err(e) => Err(e),
            });
        }
        if !planned.is_empty() {
            store.defer_reports(planned);
        }
        answers
    })
}

/// The [`BatchFn`](super::group_commit::BatchFn) of reports heartbeats were
/// answered on: all of a batch in one transaction that holds no write lock
/// (see [`Heartbeat::locking`]).
pub(crate) fn write_reports(
    store: MetadataStore,
    batch: Vec<PlannedWrites>,
) -> BoxFuture<'static, Vec<Result<(), DbError>>> {
    Box::pin(async move {
        let count = batch.len();
        let mut all = PlannedWrites::default();
        for planned in batch {
            all.extend(planned);
        }
        let written = async {
            let mut tx = store.begin_batch(TxLock::Nothing).await?;
            all.write(&mut tx).await?;
            store.commit(tx).await
        };
        match written.await {
            Ok(()) => (0..count).map(|_| Ok(())).collect(),
            Err(e) => fail_all(count, &e),
        }
    })
}

/// What a batch of heartbeats needs to be answered without a write: their
/// hosts (without usage, which a heartbeat does not need), and the attempts
/// they concern with their runs' workspace and image.
struct Preloaded {
    hosts: HashMap<HostId, Host>,
    known: KnownAttempts,
}

impl Preloaded {
    /// Lays what hosts reported and is not written yet over what was read
    /// of them; a sandbox recorded gone since keeps the state it went with.
    fn lay_over(&mut self, unwritten: HashMap<HostId, Unwritten>) {
        for (host, reported) in unwritten {
            for (sandbox, state) in reported.sandbox_states {
                if let Some((_, attempt)) = self.known.by_sandbox.get_mut(&sandbox)
                    && attempt.host_id == host
                    && attempt.sandbox_gone_at.is_none()
                {
                    attempt.sandbox_state = Some(state);
                }
            }
            if let (Some(kept), Some(row)) = (reported.kept, self.hosts.get_mut(&host)) {
                row.kept_workspaces = kept;
            }
        }
    }

    async fn read(
        conn: &mut AnyConnection,
        backend: Backend,
        batch: &[Heartbeat],
    ) -> Result<Self, DbError> {
        let ids: Vec<&HostId> = batch.iter().map(|h| &h.host_id).collect();
        // The hosts and the attempts on them in one statement: a row per
        // attempt, or one for a host without any.
        static JOINED: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {}, {} FROM hosts h
                 LEFT JOIN attempts a ON a.host_id = h.id AND a.sandbox_gone_at IS NULL
                 LEFT JOIN runs r ON r.id = a.run_id WHERE h.id IN",
                qualified("h", HOST_COLUMNS),
                *ATTEMPT_WITH_RUN_COLUMNS,
            )
        });
        // PostgreSQL, host by host through `attempts_by_host`: given the
        // join, its planner may scan every live attempt of the fleet and
        // hash them all with their runs, as it does while its statistics
        // lag behind a burst of new runs (36 ms for 64 hosts of 1,000 with
        // 10 attempts each, against 2.7 ms host by host). `OFFSET 0` keeps
        // it from flattening the subquery back into that join.
        static HOST_BY_HOST: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {}, x.* FROM hosts h
                 LEFT JOIN LATERAL (
                     SELECT {} FROM attempts a JOIN runs r ON r.id = a.run_id
                     WHERE a.host_id = h.id AND a.sandbox_gone_at IS NULL OFFSET 0
                 ) x ON TRUE
                 WHERE h.id IN",
                qualified("h", HOST_COLUMNS),
                *ATTEMPT_WITH_RUN_COLUMNS,
            )
        });
        let select = match backend {
            Backend::Sqlite => &*JOINED,
            Backend::Postgres => &*HOST_BY_HOST,
        };
        let rows = fetch_all_in(conn, select, &ids, |id| id.as_str(), "hosts").await?;
        let mut hosts: HashMap<HostId, Host> = HashMap::with_capacity(ids.len());
        let mut known = KnownAttempts::default();
        for row in &rows {
            let read = |source| DbError::Query {
                op: "read host",
                source,
            };
            let id: String = row.try_get("id").map_err(read)?;
            if !hosts.contains_key(&parse_column::<HostId>(&id, "host id")?) {
                let host = host_from_row(row)?;
                hosts.insert(host.id.clone(), host);
            }
            let run: Option<String> = row.try_get("run_id").map_err(read)?;
            if run.is_some() {
                known.keep(row)?;
            }
        }
        let reports: Vec<&ReportedSandbox> = batch.iter().flat_map(|h| &h.reports).collect();
        known.read_reported(conn, &reports).await?;
        Ok(Self { hosts, known })
    }
}

impl Heartbeat {
    /// The answer, after recording what changed; `None` when `session` is
    /// a read session and something must be written.
    async fn apply(&self, mut session: Session<'_>) -> Result<Option<HeartbeatAnswer>, DbError> {
        let Self {
            tenant,
            host_id,
            reports,
            stopping,
            kept,
            now,
        } = self;
        let (stopping, now) = (*stopping, *now);
        let host = match &mut session {
            Session::Read(preloaded) | Session::Plan(preloaded, _) => {
                preloaded.hosts.get(host_id).cloned()
            }
            Session::Write(tx) => load_host_without_usage(tx.conn(), host_id).await?,
        };
        let mut host = host.filter(|h| &h.tenant == tenant).ok_or_else(|| {
            DbError::NotFound(format!("host {host_id} is not registered; register again"))
        })?;
        let lost = host.lost_at.is_some();
        if stopping && !lost && host.stopping_at.is_none() {
            let Some(tx) = session.writer() else {
                return Ok(None);
            };
            stop_host(tx, &host, now).await?;
            host.stopping_at = Some(from_millis(now));
        }
        match &mut session {
            // Every heartbeat's lease is renewed in memory once it is
            // answered (see `MetadataStore::heartbeat`).
            Session::Write(tx) if &host.kept_workspaces != kept => {
                sqlx::query("UPDATE hosts SET kept_workspaces = $1 WHERE id = $2")
                    .bind(kept_json(kept))
                    .bind(host_id.as_str())
                    .execute(tx.conn())
                    .await
                    .map_err(query_error("record kept trees"))?;
            }
            Session::Write(_) => {}
            Session::Plan(_, planned) if &host.kept_workspaces != kept => {
                planned.kept.push((host_id.clone(), kept_json(kept)));
            }
            Session::Plan(..) => {}
            Session::Read(_) if &host.kept_workspaces != kept => return Ok(None),
            Session::Read(_) => {}
        }

        let mut answer = HeartbeatAnswer {
            state: Some(host.state()),
            ..Default::default()
        };
        // The attempts this heartbeat concerns, read once in a few
        // statements whatever the number of sandboxes (for a whole batch
        // when reading). A run this heartbeat changes is read afresh before
        // each later use, as the change may have moved its other attempts
        // too.
        let read_here;
        let known = match &mut session {
            Session::Read(preloaded) | Session::Plan(preloaded, _) => &preloaded.known,
            Session::Write(tx) => {
                let reports: Vec<&ReportedSandbox> = reports.iter().collect();
                read_here = KnownAttempts::read(tx.conn(), &[host_id], &reports).await?;
                &read_here
            }
        };
        let mut changed: std::collections::BTreeSet<RunId> = Default::default();
        let mut reported = std::collections::BTreeSet::new();
        for report in reports {
            reported.insert(report.sandbox_id.clone());
            let found = known
                .by_sandbox
                .get(&report.sandbox_id)
                .filter(|(_, attempt)| &attempt.host_id == host_id);
            let Some((run_id, attempt)) = found else {
                if report.state.is_gone() {
                    answer.forget.push(report.sandbox_id.clone());
                } else {
                    answer
                        .destroy
                        .insert(report.sandbox_id.clone(), destroy_reason::UNKNOWN.into());
                }
                continue;
            };
            let number = attempt.number;
            let attempt = current_attempt(&mut session, &changed, run_id, attempt).await?;
            if report.state.is_gone() {
                if attempt.sandbox_gone_at.is_none() {
                    let Some(tx) = session.writer() else {
                        return Ok(None);
                    };
                    let mut run = run_of_attempt(tx.conn(), run_id).await?;
                    sandbox_gone(
                        tx,
                        &mut run,
                        number,
                        report.state,
                        report.exit_code,
                        &report.detail,
                        now,
                    )
                    .await?;
                    changed.insert(run_id.clone());
                }
                answer.forget.push(report.sandbox_id.clone());
                continue;
            }
            if attempt.sandbox_gone_at.is_none() && attempt.sandbox_state != Some(report.state) {
                match &mut session {
                    Session::Write(tx) => {
                        sqlx::query(
                            "UPDATE attempts SET sandbox_state = $1
                             WHERE run_id = $2 AND number = $3",
                        )
                        .bind(report.state.as_str())
                        .bind(run_id.as_str())
                        .bind(i64::from(number))
                        .execute(tx.conn())
                        .await
                        .map_err(query_error("record sandbox state"))?;
                    }
                    Session::Plan(_, planned) => planned
                        .sandbox_states
                        .push((attempt.sandbox_id.clone(), report.state)),
                    Session::Read(_) => return Ok(None),
                }
            }
            let unwanted = lost
                || attempt.is_ended()
                || attempt.sandbox_gone_at.is_some()
                || attempt.destroy_reason.is_some();
            if unwanted {
                let reason = match (&attempt.destroy_reason, lost) {
                    (Some(reason), false) => reason.clone(),
                    _ => destroy_reason::SUPERSEDED.to_owned(),
                };
                answer.destroy.insert(report.sandbox_id.clone(), reason);
            }
        }

        // Sandboxes the host did not mention this time.
        let mut to_start = Vec::new();
        for (run_id, attempt) in known.on_host(host_id) {
            if reported.contains(&attempt.sandbox_id) {
                continue;
            }
            let number = attempt.number;
            let attempt = current_attempt(&mut session, &changed, run_id, attempt).await?;
            if attempt.sandbox_gone_at.is_some() {
                continue;
            }
            let reported_before = attempt.sandbox_state.is_some();
            if !lost && (reported_before || attempt.is_ended()) {
                // Reported before and left out now, or never started and no
                // longer wanted: the host does not have it.
                let Some(tx) = session.writer() else {
                    return Ok(None);
                };
                let mut run = run_of_attempt(tx.conn(), run_id).await?;
                sandbox_gone(
                    tx,
                    &mut run,
                    number,
                    SandboxState::Failed,
                    0,
                    "the host stopped reporting it",
                    now,
                )
                .await?;
                changed.insert(run_id.clone());
                continue;
            }
            if lost {
                if reported_before {
                    answer.destroy.insert(
                        attempt.sandbox_id.clone(),
                        destroy_reason::SUPERSEDED.into(),
                    );
                }
                continue;
            }
            let wanted = !attempt.is_ended() && attempt.destroy_reason.is_none();
            // Not reported yet and not claimed by a runner: the host has yet to start it.
            let unstarted =
                attempt.sandbox_state.is_none() && attempt.state == AttemptState::Assigned;
            if wanted && unstarted {
                to_start.push((run_id.clone(), attempt));
            }
        }
        // A run's workspace and image never change: as read with its attempts.
        answer.assignments = assignment_records(&known.runs, to_start)?;
        Ok(Some(answer))
    }
}

/// `attempt` as read at the heartbeat's start, or afresh if the heartbeat
/// changed its run since (which only a write session does).
async fn current_attempt(
    session: &mut Session<'_>,
    changed: &std::collections::BTreeSet<RunId>,
    run_id: &RunId,
    attempt: &Attempt,
) -> Result<Attempt, DbError> {
    if !changed.contains(run_id) {
        return Ok(attempt.clone());
    }
    let Some(tx) = session.writer() else {
        return Err(DbError::Corrupt(format!(
            "run {run_id} changed during a heartbeat that only reads"
        )));
    };
    let run = run_of_attempt(tx.conn(), run_id).await?;
    run.attempt(attempt.number)
        .cloned()
        .ok_or_else(|| DbError::Corrupt(format!("run {run_id} lost attempt {}", attempt.number)))
}

/// The attempts heartbeats concern: those on their hosts whose sandbox is
/// not gone, and those of the sandboxes they report, by sandbox; with the
/// workspace and image of their runs, read in the same statements, for
/// those a host has yet to start.
#[derive(Default)]
struct KnownAttempts {
    by_sandbox: HashMap<String, (RunId, Attempt)>,
    runs: HashMap<RunId, (WorkspaceId, String)>,
}

/// The columns [`KnownAttempts::keep`] reads: the attempt's (`a`) and its
/// run's (`r`) workspace and image.
static ATTEMPT_WITH_RUN_COLUMNS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{}, r.workspace_id AS run_workspace_id, r.image AS run_image",
        qualified("a", ATTEMPT_COLUMNS)
    )
});

/// `columns` (comma-separated), each prefixed with `table.`.
fn qualified(table: &str, columns: &str) -> String {
    let columns: Vec<String> = columns
        .split(',')
        .map(|column| format!("{table}.{}", column.trim()))
        .collect();
    columns.join(", ")
}

impl KnownAttempts {
    async fn read(
        conn: &mut AnyConnection,
        hosts: &[&HostId],
        reports: &[&ReportedSandbox],
    ) -> Result<Self, DbError> {
        let mut known = Self::default();
        static SELECT: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {} FROM attempts a JOIN runs r ON r.id = a.run_id
                 WHERE a.sandbox_gone_at IS NULL AND a.host_id IN",
                *ATTEMPT_WITH_RUN_COLUMNS
            )
        });
        for row in &fetch_all_in(conn, &SELECT, hosts, |id| id.as_str(), "attempts on host").await?
        {
            known.keep(row)?;
        }
        known.read_reported(conn, reports).await?;
        Ok(known)
    }

    /// Adds the attempts of `reports` not known yet.
    async fn read_reported(
        &mut self,
        conn: &mut AnyConnection,
        reports: &[&ReportedSandbox],
    ) -> Result<(), DbError> {
        let elsewhere: Vec<&str> = reports
            .iter()
            .map(|r| r.sandbox_id.as_str())
            .filter(|id| !self.by_sandbox.contains_key(*id))
            .collect();
        static SELECT: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {} FROM attempts a JOIN runs r ON r.id = a.run_id WHERE a.sandbox_id IN",
                *ATTEMPT_WITH_RUN_COLUMNS
            )
        });
        for row in &fetch_all_in(conn, &SELECT, &elsewhere, |id| *id, "reported sandboxes").await? {
            self.keep(row)?;
        }
        Ok(())
    }

    /// Adds an attempt read with [`ATTEMPT_WITH_RUN_COLUMNS`].
    fn keep(&mut self, row: &AnyRow) -> Result<(), DbError> {
        let (run, attempt) = attempt_from_row(row)?;
        let read = |source| DbError::Query {
            op: "read attempt's run",
            source,
        };
        let workspace: String = row.try_get("run_workspace_id").map_err(read)?;
        let image: String = row.try_get("run_image").map_err(read)?;
        self.runs.insert(
            run.clone(),
            (parse_column(&workspace, "workspace id")?, image),
        );
        self.by_sandbox
            .insert(attempt.sandbox_id.clone(), (run, attempt));
        Ok(())
    }

    /// The attempts on `host` whose sandbox was not gone, by run and number.
    fn on_host(&self, host: &HostId) -> Vec<(&RunId, &Attempt)> {
        let mut on_host: Vec<(&RunId, &Attempt)> = self
            .by_sandbox
            .values()
            .filter(|(_, a)| &a.host_id == host && a.sandbox_gone_at.is_none())
            .map(|(run, a)| (run, a))
            .collect();
        on_host.sort_by_key(|(run, a)| (*run, a.number));
        on_host
    }
}

/// What a host is told to start for each of `attempts`, with its run's
/// workspace and image from `runs`.
fn assignment_records(
    runs: &HashMap<RunId, (WorkspaceId, String)>,
    attempts: Vec<(RunId, Attempt)>,
) -> Result<Vec<AssignmentRecord>, DbError> {
    attempts
        .into_iter()
        .map(|(run_id, attempt)| {
            let (workspace_id, image) = runs
                .get(&run_id)
                .cloned()
                .ok_or_else(|| DbError::Corrupt(format!("attempt of missing run {run_id}")))?;
            Ok(AssignmentRecord {
                sandbox_id: attempt.sandbox_id,
                run_id,
                attempt: attempt.number,
                generation: attempt.generation,
                workspace_id,
                image,
            })
        })
        .collect()
}

/// The host agent is shutting down: no new assignments, and every attempt on
/// it ends when its sandbox is gone (queued again, or suspended if waiting).
async fn stop_host(tx: &mut WriteTx, host: &Host, now: i64) -> Result<(), DbError> {
    sqlx::query("UPDATE hosts SET stopping_at = $1 WHERE id = $2")
        .bind(now)
        .bind(host.id.as_str())
        .execute(tx.conn())
        .await
        .map_err(query_error("mark host stopping"))?;
    release_host_sandboxes(tx, host, HostRelease::Stopping, now).await
}

/// Used by the scheduler: marks `host` lost and ends its attempts if its
/// lease still ran out before `deadline` as it is marked; returns whether
/// it did.
pub(super) async fn lose_host(
    tx: &mut WriteTx,
    host: &HostId,
    lease: std::time::Duration,
    deadline: i64,
    now: i64,
) -> Result<bool, DbError> {
    // Decided by the statement that marks: on PostgreSQL an UPDATE re-reads
    // the row once it holds it, so a lease renewed by then keeps the host,
    // whatever lock the renewal took.
    let marked = sqlx::query(
        "UPDATE hosts SET lost_at = $1 WHERE id = $2 AND lost_at IS NULL AND last_heartbeat_at < $3",
    )
    .bind(now)
    .bind(host.as_str())
    .bind(deadline)
    .execute(tx.conn())
    .await
    .map_err(query_error("mark host lost"))?;
    if marked.rows_affected() == 0 {
        return Ok(false);
    }
    for (run_id, number) in attempts_on_host(tx.conn(), host).await? {
        let mut run = run_of_attempt(tx.conn(), &run_id).await?;
        end_attempt(tx, &mut run, number, EndCause::HostLost { lease }, now).await?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::{HostId, UnwrittenReports, last_per_key};

    #[tokio::test]
    async fn a_host_waits_for_its_own_unwritten_reports_and_no_others() {
        let unwritten = std::sync::Arc::new(UnwrittenReports::default());
        let (a, b) = (HostId::generate(), HostId::generate());
        unwritten.add(&a, &[], None);
        unwritten.add(&a, &[], None);
        unwritten.written(Some(&b)).await;
        let waiting = tokio::spawn({
            let (unwritten, a) = (unwritten.clone(), a.clone());
            async move { unwritten.written(Some(&a)).await }
        });
        let all = tokio::spawn({
            let unwritten = unwritten.clone();
            async move { unwritten.written(None).await }
        });
        unwritten.remove(std::slice::from_ref(&a));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            !waiting.is_finished() && !all.is_finished(),
            "one of host a's two writes is still under way"
        );
        unwritten.remove(std::slice::from_ref(&a));
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("host a's reports are all written")
            .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), all)
            .await
            .expect("nothing is left to write")
            .unwrap();
    }

    #[test]
    fn a_key_planned_twice_keeps_its_later_plan_in_the_order_of_those_plans() {
        let planned = [("a", 1), ("b", 2), ("a", 3), ("c", 4), ("b", 5)];
        let kept: Vec<_> = last_per_key(&planned, |(key, _)| key)
            .into_iter()
            .copied()
            .collect();
        assert_eq!(kept, [("a", 3), ("c", 4), ("b", 5)]);
    }
}
