//! Metadata: tenants and their keys, tokens, workspaces, packs, blobs and
//! checkpoints; hosts, runs, attempts, their events and inputs; handoff
//! notes and the files runs lay for their stations, in SQLite
//! (`DIR/cairn.db`, the embedded default) or PostgreSQL ([`DatabaseLocation`]).
//!
//! [`MetadataStore`] has one method per operation the services need and
//! returns domain records. One set of queries serves both databases through
//! sqlx's `Any` driver, so the SQL is the portable subset: numbered `$n`
//! parameters, `ON CONFLICT`, `RETURNING`, BIGINT milliseconds for times,
//! integers (never booleans) for flags and tests, sums cast to BIGINT. Each
//! database has its own migrations (`coordinator/migrations/{sqlite,postgres}`),
//! applied at open; they describe the same schema.
//!
//! SQLite runs in WAL mode with foreign keys on, full sync and a busy
//! timeout. PostgreSQL runs at READ COMMITTED; the write locks below give it
//! the ordering SQLite's single writer gives for free.
//!
//! Invariants kept here:
//! - A checkpoint, its pack and blob records, and the workspace's sequence
//!   counter are written in one transaction: a commit is all or nothing.
//! - The workspace row is updated first in that transaction, which takes the
//!   write lock before anything is read, so concurrent commits of a workspace
//!   serialize and get consecutive sequence numbers.
//! - A blob's pack is recorded once; later packs holding the same blob do not
//!   replace it (first writer wins) unless the recorded pack was found lost.
//! - Run and host changes run in write transactions ([`WriteTx`]) that take
//!   the write lock first (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: an
//!   exclusive transaction-level advisory lock keyed by the schema), so reads
//!   inside see the state they change and no two of them interleave.
//! - On PostgreSQL, two kinds of batch write beside that lock ([`TxLock`]),
//!   as no holder decides on what they write without re-checking it in the
//!   statement that acts: runs created on new workspaces (rows under new
//!   ids), and heartbeats' planned writes (sandbox states, kept trees; the
//!   leases wait in memory for the flush, and a host is marked lost by a
//!   statement that re-reads its lease). Within a replica, transactions
//!   that update many host rows take turns, so they cannot deadlock.
//! - A checkpoint commit takes the same advisory lock shared on PostgreSQL:
//!   commits of different workspaces run side by side (the workspace row
//!   orders those of one workspace), and none runs beside a write
//!   transaction (garbage collection, retention, compaction), which is what
//!   keeps a commit from referencing a pack a sweep is deleting.
//!   Every run state change writes a run event in the same transaction, and
//!   after the commit the run's id is published to [`MetadataStore::subscribe_runs`].

mod bells;
mod checkpoints;
mod compaction;
mod gc;
mod group_commit;
mod hosts;
mod location;
mod messages;
mod replicas;
mod retention;
mod run_records;
mod runner;
mod runs;
mod scheduling;
mod sql;
mod stations;
mod tally;
mod token_cache;
mod tokens;
mod workspaces;

pub use bells::OrderBells;
pub use checkpoints::{CommitPacks, CommitPreflight};
pub use compaction::Compacted;
pub use gc::{PackDeletion, PackTally, TenantStorage, WorkspaceStorage};
pub use hosts::{
    AssignmentRecord, BoundToken, HeartbeatAnswer, Host, HostRegistration, Registered,
    ReportedSandbox, destroy_reason, heartbeat_flush_interval,
};
pub use location::DatabaseLocation;
pub use messages::{MESSAGE_INPUT, Message, MessageState};
pub use retention::{Deleted, RetainedWorkspace, RetentionChange, RetentionFacts};
pub use run_records::{Attempt, Run, RunEvent, RunInput, UnsavedWork, event_reason};
pub use runs::{
    NewRun, NewRunTarget, OutcomeReport, ProgressReport, RunFilter, SessionRecord, StartedAttempt,
};
pub use scheduling::{Assignment, HostCapacity, QueuedRun};
pub use stations::{HandoffNote, NOTES_PER_ATTEMPT};
pub use tally::{ActiveRun, StoredPacks, Tally};
pub use token_cache::TOKEN_CACHE_TTL;
pub use tokens::{NewTokenRow, TokenInfo, expiry_after};
pub use workspaces::Forked;

use std::collections::{BTreeSet, HashMap};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cairn_proto::domain::{CheckpointReason, NewPack, PackKind, WorkspaceState};
use cairn_proto::ids::{
    BlobId, CheckpointId, CommitRequestId, Generation, HostId, PackId, RunId, TenantId, TokenId,
    WorkspaceId,
};
use cairn_proto::pb;
use cairn_proto::refusal::NotCurrent;
use ring::rand::{SecureRandom, SystemRandom};
use sqlx::any::AnyPoolOptions;
use sqlx::{Any, Connection, Executor, Row, Transaction};
use sqlx::{AnyConnection, AnyPool};

use sql::SqlBuilder;
use tokio::sync::{OwnedMutexGuard, OwnedSemaphorePermit, Semaphore, broadcast};

/// Key id of a tenant's first key.
pub const FIRST_KEY_ID: &str = "k1";

/// Rows per multi-row statement (stays far below SQLite's bound-variable limit).
const ROWS_PER_STATEMENT: usize = 300;

/// Why a metadata operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("could not open the metadata database {location}: {source}")]
    Open {
        location: DatabaseLocation,
        source: sqlx::Error,
    },
    #[error("{0}")]
    BadLocation(String),
    #[error("could not apply the metadata schema migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("metadata query failed ({op}): {source}")]
    Query {
        op: &'static str,
        source: sqlx::Error,
    },
    #[error("metadata is inconsistent: {0}")]
    Corrupt(String),
    #[error("a workspace named {0:?} already exists")]
    NameTaken(String),
    #[error("workspace {0} does not exist")]
    WorkspaceNotFound(String),
    #[error("workspace {id} is {state}, not active")]
    WorkspaceNotActive {
        id: WorkspaceId,
        state: WorkspaceState,
    },
    #[error("{}", generation_message(*given, *current))]
    GenerationMismatch {
        given: Generation,
        current: Generation,
    },
    /// A runner spoke for an attempt that is no longer the run's current,
    /// live one.
    #[error("{detail}")]
    AttemptNotCurrent {
        run: RunId,
        attempt: u32,
        why: NotCurrent,
        detail: String,
    },
    /// A commit declared as new a pack recorded for another workspace.
    #[error(
        "pack {pack} is recorded for another workspace; workspace {workspace} references only its own packs"
    )]
    ForeignPack {
        pack: PackId,
        workspace: WorkspaceId,
    },
    /// Packs a commit references are gone from the records or being
    /// deleted from the store (garbage collection): upload them again.
    #[error("{}", packs_missing_message(packs))]
    PacksMissing { packs: Vec<PackId> },
    /// Finishing or deleting a workspace waits for its runs to end.
    #[error("{}", cairn_proto::refusal::Refusal::WorkspaceHasRuns { workspace: workspace.clone(), runs: runs.clone() })]
    WorkspaceHasRuns {
        workspace: WorkspaceId,
        runs: Vec<RunId>,
    },
    #[error("tenant {0} has no current key")]
    NoTenantKey(TenantId),
    /// A run, host or other record the request names does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request does not fit the record's state (a run that is not
    /// waiting, an attempt that was superseded, …).
    #[error("{0}")]
    Precondition(String),
    /// The request names something that does not fit it (an input the run
    /// does not have, a checkpoint of another workspace).
    #[error("{0}")]
    Invalid(String),
    /// A run was to change in a way its life ([`crate::runlife`]) does not
    /// allow. Callers are checked before, so this is a bug of the
    /// coordinator, never the caller's doing (an INTERNAL status).
    #[error("run {run}: {illegal}")]
    IllegalTransition {
        run: RunId,
        illegal: crate::runlife::IllegalTransition,
    },
    /// The transaction this request shared with others (group commit)
    /// failed as a whole, not on this request: `message` says why.
    #[error("{message}")]
    Batch { retryable: bool, message: String },
}

fn packs_missing_message(packs: &[PackId]) -> String {
    let ids: Vec<&str> = packs.iter().map(PackId::as_str).collect();
    format!(
        "packs {} were deleted by garbage collection (or are being deleted), or replaced by compaction; cut the checkpoint again",
        ids.join(", ")
    )
}

pub(crate) fn generation_message(given: Generation, current: Generation) -> String {
    let relation = if given < current { "older" } else { "newer" };
    format!("generation {given} is {relation} than the workspace's {current}")
}

impl DbError {
    /// Whether trying again may succeed (the database was busy or unreachable).
    pub fn is_retryable(&self) -> bool {
        let source = match self {
            Self::Open { source, .. } | Self::Query { source, .. } => source,
            Self::Batch { retryable, .. } => return *retryable,
            _ => return false,
        };
        match source {
            sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) => true,
            sqlx::Error::Database(e) => e.code().is_some_and(|code| {
                // SQLite: BUSY (5) and LOCKED (6), extended codes included;
                // PostgreSQL: serialization failure and deadlock.
                let sqlite_busy = code.parse::<i32>().is_ok_and(|c| matches!(c & 0xff, 5 | 6));
                sqlite_busy || code == "40001" || code == "40P01"
            }),
            _ => false,
        }
    }
}

fn query_error(op: &'static str) -> impl FnOnce(sqlx::Error) -> DbError {
    move |source| DbError::Query { op, source }
}

/// A checkpoint key: the secret runners derive blob ids and seals from. It
/// belongs to a workspace lineage (or, for workspaces made before
/// lineages, to the tenant).
#[derive(Clone, PartialEq, Eq)]
pub struct TenantKey {
    pub key_id: String,
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for TenantKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantKey")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// A workspace with its checkpoint summary.
#[derive(Debug, Clone)]
pub struct Workspace {
    pub id: WorkspaceId,
    pub tenant: TenantId,
    pub name: Option<String>,
    pub state: WorkspaceState,
    pub generation: Generation,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
    pub checkpoint_count: u64,
    pub latest_checkpoint: Option<Checkpoint>,
    /// When it was finished (finished workspaces only).
    pub finished_at: Option<SystemTime>,
    /// Its own retention settings.
    pub retention: crate::retention::Overrides,
}

/// A committed checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub id: CheckpointId,
    pub workspace_id: WorkspaceId,
    pub sequence: u64,
    pub parent: Option<CheckpointId>,
    pub reason: CheckpointReason,
    pub generation: Generation,
    pub created_at: SystemTime,
    pub format_version: u32,
    pub root_tree: BlobId,
    pub key_id: String,
    pub stats: pb::CheckpointStats,
    pub repos: Vec<pb::GitRepoState>,
    pub warnings: Vec<String>,
    pub harness: Option<pb::HarnessSession>,
    pub pack_count: u32,
    pub stored_bytes: u64,
}

/// A pack recorded in the metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pack {
    pub id: PackId,
    pub kind: PackKind,
    pub size: u64,
    pub index_offset: u64,
    pub index_length: u32,
}

/// What a commit records (already validated and checked against the store).
#[derive(Debug, Clone)]
pub struct NewCheckpoint {
    pub workspace_id: WorkspaceId,
    pub generation: Generation,
    pub parent: Option<CheckpointId>,
    pub reason: CheckpointReason,
    pub format_version: u32,
    pub root_tree: BlobId,
    pub key_id: String,
    pub stats: pb::CheckpointStats,
    pub repos: Vec<pb::GitRepoState>,
    pub warnings: Vec<String>,
    pub harness: Option<pb::HarnessSession>,
    pub new_packs: Vec<NewPack>,
    /// Every pack the checkpoint needs, without duplicates.
    pub referenced_packs: Vec<PackId>,
    /// Sum of the sizes of the referenced packs.
    pub stored_bytes: u64,
    /// The runner's name for this commit: a second commit of the same
    /// workspace with it gets the first one's checkpoint.
    pub request_id: Option<CommitRequestId>,
}

/// Runs whose events changed are announced on this channel; a slow receiver
/// that lags re-reads the database, so the capacity only bounds memory.
const RUN_CHANGES_CAPACITY: usize = 1024;

/// The database engine behind a [`MetadataStore`], where they differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Sqlite,
    Postgres,
}

/// The key of the PostgreSQL advisory lock that write transactions take
/// exclusively and checkpoint commits shared, for the tables in `schema`.
///
/// Advisory locks belong to the database, not to a schema: one constant key
/// would make deployments in separate schemas of one database (and tests
/// side by side) wait for each other's writes. The key is a digest of the
/// schema's name as PostgreSQL resolves it (`current_schema()`), so
/// replicas that name it differently (`public`, or nothing) still share
/// it.
fn write_lock_key(schema: &str) -> i64 {
    let digest = ring::digest::digest(
        &ring::digest::SHA256,
        format!("cairn write lock\0{schema}").as_bytes(),
    );
    let mut key = [0u8; 8];
    key.copy_from_slice(&digest.as_ref()[..8]);
    i64::from_be_bytes(key)
}

/// Connections a PostgreSQL pool keeps (SQLite's one writer gains nothing
/// from more than its 8).
const POSTGRES_CONNECTIONS: u32 = 16;
const SQLITE_CONNECTIONS: u32 = 8;

/// Checkpoint commits holding a PostgreSQL connection at once, on one
/// replica: half the pool. Commits queued behind another replica's write
/// transaction wait for the write lock holding their connection, and the
/// other half stays for reads and the one writer (`write_gate`). More
/// would not commit faster: each is a few round trips on a busy database.
const POSTGRES_COMMITS_AT_ONCE: usize = POSTGRES_CONNECTIONS as usize / 2;

/// Heartbeat batches read at once on PostgreSQL, and the most heartbeats
/// each reads: a burst of heartbeats is served by several connections side
/// by side rather than one batch after another, leaving most of the pool to
/// everything else. Smaller batches spread a burst over those connections
/// (and PostgreSQL's processes): with 64, one batch took most of a burst
/// and its heartbeats waited for all of it.
const HEARTBEAT_READ_DRAINERS: usize = 4;
const HEARTBEAT_READ_BATCH: usize = 16;

/// A PostgreSQL connection idle longer is pinged before it is used.
const POSTGRES_PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// The metadata database.
#[derive(Debug, Clone)]
pub struct MetadataStore {
    pool: AnyPool,
    backend: Backend,
    /// On PostgreSQL, the key of the write lock ([`write_lock_key`]).
    write_lock: i64,
    run_changes: broadcast::Sender<RunId>,
    /// The bells of hosts watching for orders on this replica.
    order_bells: Arc<OrderBells>,
    /// Host leases renewed by heartbeats that changed nothing else, and
    /// when: written in batches by [`MetadataStore::flush_heartbeats`].
    renewed_leases: Arc<std::sync::Mutex<HashMap<HostId, i64>>>,
    /// On PostgreSQL, the channel committed run changes (and token
    /// revocations) are announced on to every replica (`NOTIFY`), and the
    /// URL to listen with.
    run_channel: Option<RunChannel>,
    /// Tokens authenticated recently (see [`token_cache`]).
    token_cache: Arc<token_cache::TokenCache>,
    /// Taken before the database's write lock: this process's writers
    /// wait their turn here, in order, holding no connection. On SQLite
    /// that replaces its busy handler, which sleeps up to 100 ms between
    /// tries and lets newcomers overtake. On PostgreSQL it keeps writers
    /// queued behind another replica's write from holding every
    /// connection of the pool while they wait: reads (heartbeats among
    /// them) would wait for one.
    write_gate: Arc<tokio::sync::Mutex<()>>,
    /// On PostgreSQL, where commits run side by side, the most that hold
    /// a connection at once (see [`POSTGRES_COMMITS_AT_ONCE`]); SQLite's
    /// commits take the write gate instead.
    commit_turns: Arc<Semaphore>,
    /// On PostgreSQL, the turn [`TxLock::HostRows`] takes.
    host_rows: Arc<tokio::sync::Mutex<()>>,
    /// CreateRun requests, created in shared transactions under load.
    run_creations: group_commit::GroupCommit<runs::RunCreation, Run>,
    /// Heartbeats that must write, in shared transactions under load.
    heartbeat_reads: group_commit::GroupCommit<hosts::Heartbeat, hosts::ReadAnswer>,
    heartbeat_writes: group_commit::GroupCommit<hosts::Heartbeat, HeartbeatAnswer>,
    /// Sandbox states and kept trees of heartbeats already answered
    /// (see [`hosts::read_heartbeats`]), in shared transactions, and the
    /// hosts whose reports are still to be written.
    report_writes: group_commit::GroupCommit<hosts::PlannedWrites, ()>,
    unwritten_reports: Arc<hosts::UnwrittenReports>,
    /// On SQLite, checkpoint commits, made in shared transactions under
    /// load (PostgreSQL runs them side by side).
    checkpoint_commits:
        Option<group_commit::GroupCommit<checkpoints::CheckpointCommit, Checkpoint>>,
}

/// Where a PostgreSQL database announces run changes to all replicas.
#[derive(Debug, Clone)]
struct RunChannel {
    url: String,
    /// `cairn_runs_`, then the schema's digest (that of [`write_lock_key`]):
    /// notifications are per database, and each schema holds another
    /// coordinator's metadata.
    name: String,
    /// This replica's mark on what it announces: it hears its own
    /// announcements too, and has acted on them already at its commit (a
    /// second ring would make each host it gave orders to heartbeat twice).
    origin: String,
}

impl RunChannel {
    /// Sends `payload` to every replica's listener when `conn`'s
    /// transaction commits, marked with this replica's origin.
    async fn announce(&self, conn: &mut AnyConnection, payload: &str) -> Result<(), sqlx::Error> {
        // pg_notify returns void, which the Any driver cannot read.
        sqlx::query("SELECT COUNT(*) FROM (SELECT pg_notify($1, $2)) AS sent")
            .bind(&self.name)
            .bind(format!("{}{ORIGIN_END}{payload}", self.origin))
            .execute(conn)
            .await
            .map(drop)
    }

    /// The payload of an announcement another replica made; `None` for
    /// one of this replica's own. An announcement without an origin (from
    /// a replica older than origins) counts as another's.
    fn made_elsewhere<'a>(&self, announced: &'a str) -> Option<&'a str> {
        match announced.split_once(ORIGIN_END) {
            Some((origin, _)) if origin == self.origin => None,
            Some((_, payload)) => Some(payload),
            None => Some(announced),
        }
    }
}

/// What ends the origin that starts every announcement (ids never hold it).
const ORIGIN_END: char = ' ';

/// What starts a notification that a token was revoked (run ids never do).
const REVOKED_TOKEN_PREFIX: &str = "revoked-token:";

/// What starts a notification that hosts were given orders (their ids
/// follow, separated by commas; run ids never start so).
const HOST_ORDERS_PREFIX: &str = "host-orders:";

/// Most run ids one notification carries (PostgreSQL's payload limit is
/// 8000 bytes; an id is 30 characters and a comma).
const RUNS_PER_NOTIFICATION: usize = 200;

/// What a write transaction holds from its start, on PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TxLock {
    /// The write lock: no other write transaction or checkpoint commit
    /// runs beside it.
    Write,
    /// This replica's turn to update many host rows at once, without the
    /// write lock (the lease flush). Two transactions that each update many
    /// of the same rows, in an order neither controls, can deadlock; taking
    /// turns keeps this replica's apart. (Another replica's meet this
    /// replica's only for a host that moved between them; PostgreSQL
    /// detects such a deadlock and the loser is written again.)
    HostRows,
    /// The host-rows turn, then the write lock (never the other way
    /// round): for heartbeats written one by one, which update host rows
    /// among others.
    HostRowsThenWrite,
    /// Nothing at first: for rows no lock holder decides on without
    /// re-checking them in the statement that acts, or rows under ids made
    /// for this transaction. It takes the host-rows turn before it updates
    /// host rows ([`WriteTx::take_host_rows_turn`]).
    Nothing,
}

/// A write transaction that took the database's write lock at its start, and
/// the runs it changed (announced after the commit).
pub(crate) struct WriteTx {
    tx: Transaction<'static, Any>,
    backend: Backend,
    changed_runs: BTreeSet<RunId>,
    /// Hosts given new orders (rung after the commit).
    ordered_hosts: BTreeSet<HostId>,
    /// Released after `tx` ends (fields drop in order).
    gate: Option<OwnedMutexGuard<()>>,
    /// The host-rows turn this transaction may still take (see
    /// [`TxLock::Nothing`]), and the turn once taken.
    host_rows: Option<Arc<tokio::sync::Mutex<()>>>,
    host_rows_turn: Option<OwnedMutexGuard<()>>,
}

/// A checkpoint commit's transaction (see [`MetadataStore::begin_commit`]).
pub(crate) struct CommitTx {
    tx: Transaction<'static, Any>,
    /// Released after `tx` ends (fields drop in order).
    _turn: CommitTurn,
}

/// A commit's place among this process's writers.
enum CommitTurn {
    /// SQLite: the write gate, as every writer.
    Gate { _held: OwnedMutexGuard<()> },
    /// PostgreSQL: one of [`POSTGRES_COMMITS_AT_ONCE`].
    Permit { _held: OwnedSemaphorePermit },
}

impl CommitTx {
    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        self.tx.commit().await
    }
}

impl std::ops::Deref for CommitTx {
    type Target = AnyConnection;

    fn deref(&self) -> &AnyConnection {
        &self.tx
    }
}

impl std::ops::DerefMut for CommitTx {
    fn deref_mut(&mut self) -> &mut AnyConnection {
        &mut self.tx
    }
}

impl WriteTx {
    fn conn(&mut self) -> &mut AnyConnection {
        &mut self.tx
    }

    fn touch(&mut self, run: &RunId) {
        self.changed_runs.insert(run.clone());
    }

    /// Notes that `host` was given an order (an assignment, a destroy
    /// order): its agent hears of it once the transaction commits.
    fn ring(&mut self, host: &HostId) {
        self.ordered_hosts.insert(host.clone());
    }

    /// Undoes everything written in the transaction, announcing nothing,
    /// then lets the next writer in.
    async fn rollback(self) -> Result<(), DbError> {
        let Self {
            tx,
            gate,
            host_rows_turn,
            ..
        } = self;
        let rolled_back = tx.rollback().await.map_err(query_error("roll back"));
        drop((gate, host_rows_turn));
        rolled_back
    }

    /// Waits for this replica's host-rows turn, if this transaction began
    /// without it and without the write lock (see [`TxLock::Nothing`]),
    /// before updating several host rows. Call it before the first
    /// statement that locks a row.
    async fn take_host_rows_turn(&mut self) {
        if let Some(turn) = self.host_rows.take() {
            self.host_rows_turn = Some(turn.lock_owned().await);
        }
    }
}

fn millis(t: SystemTime) -> i64 {
    i64::try_from(t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()).unwrap_or(i64::MAX)
}

fn from_millis(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// A stored integer that must fit the domain type.
fn unsigned<T: TryFrom<i64>>(value: i64, what: &str) -> Result<T, DbError> {
    T::try_from(value).map_err(|_| DbError::Corrupt(format!("{what} {value} is out of range")))
}

/// A domain integer to store (sizes and counters stay far below i64::MAX).
fn signed(value: u64, what: &str) -> Result<i64, DbError> {
    i64::try_from(value)
        .map_err(|_| DbError::Corrupt(format!("{what} {value} does not fit the database")))
}

fn parse_column<T: FromStr>(value: &str, what: &str) -> Result<T, DbError> {
    value
        .parse()
        .map_err(|_| DbError::Corrupt(format!("stored {what} {value:?} is not valid")))
}

fn random_secret() -> Vec<u8> {
    let mut secret = vec![0u8; 32];
    SystemRandom::new()
        .fill(&mut secret)
        .expect("the system random generator works");
    secret
}

impl MetadataStore {
    /// Opens (creating if needed) the database at `location` and migrates it.
    pub async fn open(location: &DatabaseLocation) -> Result<Self, DbError> {
        sqlx::any::install_default_drivers();
        let opened = |source| DbError::Open {
            location: location.clone(),
            source,
        };
        let (pool, backend, run_channel, write_lock) = match location {
            DatabaseLocation::Sqlite(_) => {
                let pool = AnyPoolOptions::new()
                    .max_connections(SQLITE_CONNECTIONS)
                    // A file cannot hang up: pinging a connection before
                    // each use would only cost a hop to its thread.
                    .test_before_acquire(false)
                    .after_connect(|conn, _| {
                        Box::pin(async move {
                            // A committed checkpoint must survive a power loss.
                            conn.execute(
                                "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;
                                 PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 10000;",
                            )
                            .await
                            .map(drop)
                        })
                    })
                    .connect(&location.sqlx_url())
                    .await
                    .map_err(opened)?;
                sqlx::migrate!("./migrations/sqlite").run(&pool).await?;
                (pool, Backend::Sqlite, None, 0)
            }
            DatabaseLocation::Postgres { url, schema } => {
                prepare_postgres(url, schema.as_deref())
                    .await
                    .map_err(opened)?;
                let pool = AnyPoolOptions::new()
                    .max_connections(POSTGRES_CONNECTIONS)
                    // A connection in steady use answers its queries; one
                    // idle a while may have been dropped by the server or
                    // a proxy: only that one is pinged before use.
                    .test_before_acquire(false)
                    .before_acquire(|conn, meta| {
                        Box::pin(async move {
                            if meta.idle_for > POSTGRES_PING_AFTER_IDLE {
                                conn.ping().await?;
                            }
                            Ok(true)
                        })
                    })
                    .connect(&location.sqlx_url())
                    .await
                    .map_err(opened)?;
                sqlx::migrate!("./migrations/postgres").run(&pool).await?;
                let current_schema: Option<String> =
                    sqlx::query_scalar("SELECT CAST(current_schema() AS TEXT)")
                        .fetch_one(&pool)
                        .await
                        .map_err(query_error("find the current schema"))?;
                let current_schema = current_schema.ok_or_else(|| {
                    DbError::Corrupt("the connection's search_path names no schema".into())
                })?;
                let write_lock = write_lock_key(&current_schema);
                let channel = RunChannel {
                    url: url.clone(),
                    // From the schema as resolved, as the lock's key is:
                    // replicas that name it differently hear each other,
                    // and a name of any length fits PostgreSQL's 63 bytes.
                    name: format!("cairn_runs_{:016x}", write_lock.cast_unsigned()),
                    origin: format!("{:016x}", rand::random::<u64>()),
                };
                (pool, Backend::Postgres, Some(channel), write_lock)
            }
        };
        let (run_changes, _) = broadcast::channel(RUN_CHANGES_CAPACITY);
        let store = Self {
            pool,
            backend,
            write_lock,
            run_changes,
            order_bells: Arc::default(),
            renewed_leases: Arc::default(),
            write_gate: Arc::default(),
            commit_turns: Arc::new(Semaphore::new(POSTGRES_COMMITS_AT_ONCE)),
            host_rows: Arc::default(),
            run_creations: group_commit::GroupCommit::new(group_commit::write_batch),
            heartbeat_reads: {
                let (drainers, max_batch) = match backend {
                    // Every statement hops to a connection's thread: fewer,
                    // larger batches serve a burst sooner.
                    Backend::Sqlite => (1, group_commit::MAX_BATCH),
                    Backend::Postgres => (HEARTBEAT_READ_DRAINERS, HEARTBEAT_READ_BATCH),
                };
                group_commit::GroupCommit::reads(hosts::read_heartbeats, drainers, max_batch)
            },
            heartbeat_writes: group_commit::GroupCommit::new(group_commit::write_batch),
            report_writes: group_commit::GroupCommit::new(hosts::write_reports),
            unwritten_reports: Arc::default(),
            checkpoint_commits: (backend == Backend::Sqlite)
                .then(|| group_commit::GroupCommit::new(checkpoints::commit_checkpoint_batch)),
            // On PostgreSQL, trusted once this replica hears revocations.
            token_cache: Arc::new(token_cache::TokenCache::new(run_channel.is_none())),
            run_channel,
        };
        store.assign_token_ids().await?;
        Ok(store)
    }

    /// Ids of runs as their events are committed. Subscribe before reading
    /// what you wait on, so nothing committed in between is missed.
    pub fn subscribe_runs(&self) -> broadcast::Receiver<RunId> {
        self.run_changes.subscribe()
    }

    /// Starts a write transaction holding the write lock from its first
    /// statement: no other write transaction or checkpoint commit runs
    /// beside it.
    pub(crate) async fn begin_write(&self) -> Result<WriteTx, DbError> {
        let gate = Some(self.write_turn().await);
        let tx = match self.backend {
            Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await,
            Backend::Postgres => self.begin_locked("pg_advisory_xact_lock").await,
        }
        .map_err(query_error("begin"))?;
        Ok(WriteTx {
            tx,
            backend: self.backend,
            changed_runs: BTreeSet::new(),
            ordered_hosts: BTreeSet::new(),
            gate,
            host_rows: None,
            host_rows_turn: None,
        })
    }

    /// What `lock` comes to here: on SQLite, where one writes at a time,
    /// every kind is the write lock.
    pub(crate) fn effective(&self, lock: TxLock) -> TxLock {
        match self.backend {
            Backend::Sqlite => TxLock::Write,
            Backend::Postgres => lock,
        }
    }

    /// Starts a batch's write transaction holding `lock` (see
    /// [`TxLock`]); on SQLite, where one writes at a time, every kind is
    /// [`Self::begin_write`].
    pub(crate) async fn begin_batch(&self, lock: TxLock) -> Result<WriteTx, DbError> {
        let lock = self.effective(lock);
        if lock == TxLock::Write {
            return self.begin_write().await;
        }
        let turn = match lock {
            TxLock::HostRows | TxLock::HostRowsThenWrite => {
                Some(Arc::clone(&self.host_rows).lock_owned().await)
            }
            TxLock::Write | TxLock::Nothing => None,
        };
        if lock == TxLock::HostRowsThenWrite {
            let mut tx = self.begin_write().await?;
            tx.host_rows_turn = turn;
            return Ok(tx);
        }
        let tx = self.pool.begin().await.map_err(query_error("begin"))?;
        Ok(WriteTx {
            tx,
            backend: self.backend,
            changed_runs: BTreeSet::new(),
            ordered_hosts: BTreeSet::new(),
            gate: None,
            host_rows: (lock == TxLock::Nothing).then(|| Arc::clone(&self.host_rows)),
            host_rows_turn: turn,
        })
    }

    /// Starts a checkpoint commit's transaction: beside other commits (its
    /// first statement, the workspace row's update, orders the commits of
    /// one workspace), never beside a write transaction.
    pub(crate) async fn begin_commit(&self) -> Result<CommitTx, DbError> {
        let turn = match self.backend {
            Backend::Sqlite => CommitTurn::Gate {
                _held: self.write_turn().await,
            },
            Backend::Postgres => CommitTurn::Permit {
                _held: Arc::clone(&self.commit_turns)
                    .acquire_owned()
                    .await
                    .expect("the commit turns are never closed"),
            },
        };
        let tx = match self.backend {
            // The first statement (an UPDATE) takes SQLite's one write lock.
            Backend::Sqlite => self.pool.begin().await,
            Backend::Postgres => self.begin_locked("pg_advisory_xact_lock_shared").await,
        }
        .map_err(query_error("begin commit"))?;
        Ok(CommitTx { tx, _turn: turn })
    }

    /// Waits for this process's turn to write (see `write_gate`).
    async fn write_turn(&self) -> OwnedMutexGuard<()> {
        Arc::clone(&self.write_gate).lock_owned().await
    }

    async fn begin_locked(
        &self,
        lock: &'static str,
    ) -> Result<Transaction<'static, Any>, sqlx::Error> {
        // BEGIN and the lock in one round trip (a simple query may hold
        // several statements); the lock function returns void, which the
        // Any driver cannot read, so nothing is read back.
        self.pool
            .begin_with(format!("BEGIN; SELECT {lock}({})", self.write_lock))
            .await
    }

    /// Commits `tx` and announces the runs it changed and the hosts it gave
    /// orders to: to this replica's watchers at once, and on PostgreSQL to
    /// every replica's with the commit (a `NOTIFY` is delivered when its
    /// transaction commits).
    pub(crate) async fn commit(&self, tx: WriteTx) -> Result<(), DbError> {
        let WriteTx {
            mut tx,
            backend: _,
            changed_runs,
            ordered_hosts,
            gate,
            host_rows_turn,
            ..
        } = tx;
        if let Some(channel) = &self.run_channel {
            let ids: Vec<&str> = changed_runs.iter().map(RunId::as_str).collect();
            for chunk in ids.chunks(RUNS_PER_NOTIFICATION) {
                channel
                    .announce(&mut tx, &chunk.join(","))
                    .await
                    .map_err(query_error("announce run changes"))?;
            }
            let hosts: Vec<&str> = ordered_hosts.iter().map(HostId::as_str).collect();
            for chunk in hosts.chunks(RUNS_PER_NOTIFICATION) {
                channel
                    .announce(&mut tx, &format!("{HOST_ORDERS_PREFIX}{}", chunk.join(",")))
                    .await
                    .map_err(query_error("announce host orders"))?;
            }
        }
        tx.commit().await.map_err(query_error("commit"))?;
        drop((gate, host_rows_turn));
        for run in changed_runs {
            // No receiver is fine: nobody is watching.
            let _ = self.run_changes.send(run);
        }
        for host in &ordered_hosts {
            self.order_bells.ring(host);
        }
        Ok(())
    }

    /// The bells of the hosts watching this replica for orders.
    pub fn order_bells(&self) -> &Arc<OrderBells> {
        &self.order_bells
    }

    /// Relays the run changes other replicas announce to this replica's
    /// watchers until `stop`; nothing to do on SQLite, where one
    /// coordinator holds the database. A lost connection is opened again,
    /// and the runs with events since it was lost are announced then, since
    /// the announcements made meanwhile are gone.
    pub async fn relay_run_changes(&self, stop: impl std::future::Future<Output = ()>) {
        let Some(channel) = self.run_channel.clone() else {
            return;
        };
        tokio::pin!(stop);
        let mut backoff = Duration::from_millis(100);
        let mut lost_at = None;
        loop {
            let listening = self.relay_from(&channel, &mut lost_at);
            tokio::select! {
                () = &mut stop => return,
                result = listening => {
                    let Err(e) = result;
                    self.token_cache.trust(false);
                    tracing::warn!(error = %e, "lost the run-change announcements of other coordinators; listening again");
                    // A second before, for clocks of replicas that differ a little.
                    lost_at.get_or_insert(millis(SystemTime::now()) - 1000);
                }
            }
            tokio::select! {
                () = &mut stop => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Listens on `channel` and relays what it hears until the connection
    /// fails; first announces the runs with events since `lost_at`, when
    /// an earlier connection was lost then.
    async fn relay_from(
        &self,
        channel: &RunChannel,
        lost_at: &mut Option<i64>,
    ) -> Result<std::convert::Infallible, sqlx::Error> {
        let mut listener = sqlx::postgres::PgListener::connect(&channel.url).await?;
        listener.listen(&channel.name).await?;
        // From now on this replica hears every revocation (until the
        // connection fails, which distrusts the cache again).
        self.token_cache.trust(true);
        if let Some(since) = *lost_at {
            let missed: Vec<String> =
                sqlx::query_scalar("SELECT DISTINCT run_id FROM run_events WHERE at >= $1")
                    .bind(since)
                    .fetch_all(&self.pool)
                    .await?;
            for run in missed.iter().filter_map(|id| id.parse::<RunId>().ok()) {
                let _ = self.run_changes.send(run);
            }
            // Which hosts were given orders meanwhile is not recorded: each
            // watching host heartbeats once and learns its own.
            self.order_bells.ring_all();
            *lost_at = None;
        }
        loop {
            let notification = listener.recv().await?;
            // This replica acted on its own at commit.
            let Some(payload) = channel.made_elsewhere(notification.payload()) else {
                continue;
            };
            if let Some(id) = payload.strip_prefix(REVOKED_TOKEN_PREFIX) {
                match id.parse::<TokenId>() {
                    Ok(id) => self.token_cache.forget(&id),
                    Err(_) => {
                        tracing::warn!(payload = %id, "a revocation names no token; forgetting every token");
                        self.token_cache.forget_all();
                    }
                }
                continue;
            }
            if let Some(ids) = payload.strip_prefix(HOST_ORDERS_PREFIX) {
                for id in ids.split(',') {
                    match id.parse::<HostId>() {
                        Ok(host) => self.order_bells.ring(&host),
                        Err(_) => {
                            tracing::warn!(payload = %id, "a host-orders announcement names no host; ringing every bell");
                            self.order_bells.ring_all();
                        }
                    }
                }
                continue;
            }
            for id in payload.split(',') {
                match id.parse::<RunId>() {
                    // No receiver is fine: nobody is watching.
                    Ok(run) => drop(self.run_changes.send(run)),
                    Err(_) => {
                        tracing::warn!(payload = %id, "a run-change announcement names no run; ignored")
                    }
                }
            }
        }
    }

    /// Closes every connection (checkpoints the WAL).
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Creates `tenant` with a first random key unless it exists. Returns
    /// whether it was created.
    pub async fn ensure_tenant(&self, tenant: &TenantId) -> Result<bool, DbError> {
        let now = millis(SystemTime::now());
        let mut tx = self.pool.begin().await.map_err(query_error("begin"))?;
        let inserted = sqlx::query(
            "INSERT INTO tenants (id, current_key_id, created_at) VALUES ($1, $2, $3)
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(tenant.as_str())
        .bind(FIRST_KEY_ID)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(query_error("insert tenant"))?
        .rows_affected();
        if inserted == 0 {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO tenant_keys (tenant, key_id, secret, created_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(tenant.as_str())
        .bind(FIRST_KEY_ID)
        .bind(random_secret())
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(query_error("insert tenant key"))?;
        tx.commit().await.map_err(query_error("commit tenant"))?;
        Ok(true)
    }

    /// The key new checkpoints of `workspace` are sealed with: its
    /// lineage's newest, or the tenant's current key for a workspace made
    /// before lineages.
    pub async fn current_key(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
    ) -> Result<TenantKey, DbError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(query_error("current key"))?;
        let lineage = workspaces::lineage_of(&mut conn, tenant, workspace).await?;
        let row = match &lineage {
            Some(lineage) => sqlx::query(
                "SELECT key_id, secret FROM lineage_keys WHERE lineage = $1
                 ORDER BY created_at DESC, key_id DESC LIMIT 1",
            )
            .bind(lineage.as_str())
            .fetch_optional(&mut *conn)
            .await
            .map_err(query_error("current key"))?,
            None => sqlx::query(
                "SELECT k.key_id, k.secret FROM tenants t
                 JOIN tenant_keys k ON k.tenant = t.id AND k.key_id = t.current_key_id
                 WHERE t.id = $1",
            )
            .bind(tenant.as_str())
            .fetch_optional(&mut *conn)
            .await
            .map_err(query_error("current key"))?,
        };
        let row = row.ok_or_else(|| match lineage {
            Some(lineage) => DbError::Corrupt(format!("key lineage {lineage} has no key")),
            None => DbError::NoTenantKey(tenant.clone()),
        })?;
        Ok(TenantKey {
            key_id: row.try_get("key_id").map_err(query_error("current key"))?,
            secret: row.try_get("secret").map_err(query_error("current key"))?,
        })
    }

    /// The keys of `workspace`'s lineage (or, for a workspace made before
    /// lineages, of the tenant) among `key_ids`; unknown ids are left out.
    pub async fn keys(
        &self,
        tenant: &TenantId,
        workspace: &WorkspaceId,
        key_ids: &[String],
    ) -> Result<Vec<TenantKey>, DbError> {
        let mut conn = self.pool.acquire().await.map_err(query_error("keys"))?;
        let lineage = workspaces::lineage_of(&mut conn, tenant, workspace).await?;
        let mut keys = Vec::new();
        for chunk in key_ids.chunks(ROWS_PER_STATEMENT) {
            let mut query = match &lineage {
                Some(lineage) => {
                    let mut query =
                        SqlBuilder::new("SELECT key_id, secret FROM lineage_keys WHERE lineage = ");
                    query.push_bind(lineage.as_str());
                    query
                }
                None => {
                    let mut query =
                        SqlBuilder::new("SELECT key_id, secret FROM tenant_keys WHERE tenant = ");
                    query.push_bind(tenant.as_str());
                    query
                }
            };
            query.push(" AND key_id IN (");
            let mut list = query.separated(", ");
            for id in chunk {
                list.push_bind(id.as_str());
            }
            query.push(") ORDER BY key_id");
            let rows = query
                .build()
                .fetch_all(&mut *conn)
                .await
                .map_err(query_error("keys"))?;
            for row in rows {
                keys.push(TenantKey {
                    key_id: row.try_get("key_id").map_err(query_error("keys"))?,
                    secret: row.try_get("secret").map_err(query_error("keys"))?,
                });
            }
        }
        Ok(keys)
    }
}

/// Connects once, so a database that cannot be reached fails the start with
/// the reason (a pool only says it timed out), and creates `schema` unless it
/// exists (replicas starting together may race to create it: the loser finds
/// it there).
async fn prepare_postgres(url: &str, schema: Option<&str>) -> Result<(), sqlx::Error> {
    let mut conn = AnyConnection::connect(url).await?;
    let created = match schema {
        Some(schema) => conn
            .execute(format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"").as_str())
            .await
            .map(drop),
        None => Ok(()),
    };
    let _ = conn.close().await;
    match created {
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("23505" | "42P06")) => {
            Ok(())
        }
        other => other,
    }
}

#[cfg(test)]
pub(crate) mod tests;
