//! Cutting a checkpoint.
//!
//! ```text
//!  BeginCheckpoint ─► tenant keys, generation, parent          (remote)
//!  walk the root in parallel ──────► git metadata, own thread   (scan, git)
//!  per file: fingerprint cached? reuse chunks : read, cut, hash (content)
//!     └─ new chunks, ~16 MiB batches ─► FindMissingBlobs
//!          └─ missing ones sealed in parallel ─► DATA packs ─► upload, 4 at a time (upload)
//!  one tree per directory, deepest first ─► FindMissingBlobs    (trees)
//!     └─ missing trees sealed ─► META packs ─► upload
//!  all uploads done ─► failpoint checkpoint-before-commit ─► CommitCheckpoint
//!  committed ─► the fingerprint cache learns stable files and blob → pack
//! ```
//!
//! Memory stays bounded by the batch size, not the workspace: chunks the
//! cache or this checkpoint already know are dropped as soon as they are
//! hashed, a batch is sealed only after the store said which of its blobs it
//! lacks, and packs are written to spool files and streamed from there.
//!
//! A commit refused because a referenced pack is gone (the cache remembered
//! a pack that was collected, or the store lost it) is cut again with the
//! cache's blob map forgotten, which re-reads and re-asks about everything;
//! blobs the store still places in a pack the refusal named are sent again.
//! Further redos happen only while each refusal names a pack not seen before.
//!
//! [`checkpoint_if_changed`] cuts a checkpoint only when the workspace
//! differs from a known one (the runner's periodic checkpoints): the root
//! tree id is a keyed digest of the whole tree, so equal ids mean equal
//! content. Nothing new is uploaded for an unchanged workspace (every blob
//! is already in the store), and the commit is skipped.

mod content;
mod dir;
mod learn;
pub mod limits;
mod memo;
mod recall;
mod remote;
mod resident;
mod treebases;
mod trees;
mod upload;

use std::collections::{BTreeSet, HashSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use cairn_proto::domain::{CheckpointReason, PackKind};
use cairn_proto::ids::{BlobId, CommitRequestId, PackId, WorkspaceId};
use cairn_proto::pb;
use cairn_proto::refusal::Refusal;

use rayon::prelude::*;
use serde::Serialize;
use tonic::Code;

use self::content::{Cancelled, Content};
use self::dir::DirTree;
use self::learn::Learned;
use self::memo::Memo;
use self::recall::{Known, OneShot, Recall, RepoReading};
use self::remote::Session;
use self::treebases::TreeBases;
use self::upload::{Packer, Spool, SpooledPack, Uploader};
use crate::cache::{Cache, FastMap};
use crate::client::{ConnectError, CoordinatorClient};
use crate::failpoint::{self, FailpointError};
use crate::format::{FORMAT_VERSION, seal};
use crate::git::{self, RepoState};
use crate::scan::{self, Scan, ScanError, ScanOptions};
use crate::task::blocking;

pub use self::limits::Limits;
pub use self::resident::Resident;
use crate::transfer::TransferError;

/// At most this many warnings are recorded on a checkpoint; the rest are counted.
const MAX_WARNINGS: usize = 100;

/// What to checkpoint and where to send it.
#[derive(Debug, Clone)]
pub struct CheckpointOptions {
    /// Coordinator gRPC address, e.g. `http://127.0.0.1:7400`.
    pub coordinator: String,
    pub token: Option<String>,
    /// Workspace id or name.
    pub workspace: String,
    pub root: PathBuf,
    pub reason: CheckpointReason,
    /// Where the fingerprint cache and the spool live.
    pub cache_dir: PathBuf,
    /// Leave out what git ignores.
    pub skip_ignored: bool,
    /// Gitignore-style patterns relative to the root.
    pub excludes: Vec<String>,
    /// The attempt's generation; 0 checkpoints at the workspace's current one.
    pub generation: u64,
    /// The harness session the checkpoint belongs to, if any.
    pub harness: Option<pb::HarnessSession>,
    /// What one checkpoint may hold; files above are left out, with warnings.
    pub limits: Limits,
    /// What a resident runner keeps between checkpoints (None: every
    /// checkpoint walks the whole workspace and loads the cache from disk).
    pub resident: Option<Arc<Resident>>,
}

impl CheckpointOptions {
    /// The walk of `root` (resolved) that these options ask for, leaving
    /// out the cache directory `cache_dir` (canonical) if it lies inside.
    pub fn scan_options(&self, root: &Path, cache_dir: &Path) -> ScanOptions {
        ScanOptions {
            root: root.to_path_buf(),
            skip_ignored: self.skip_ignored,
            excludes: self.excludes.clone(),
            exclude_paths: vec![cache_dir.to_path_buf()],
        }
    }
}

/// Sizes and counts of one checkpoint (the `stats` of the JSON output).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    /// Logical size of all file contents.
    pub total_bytes: u64,
    /// Files whose contents were read (not known from the fingerprint cache).
    pub files_read: u64,
    pub bytes_read: u64,
    /// Blobs the store did not have, and their plaintext bytes.
    pub new_blobs: u64,
    pub new_bytes: u64,
    /// Sealed pack bytes uploaded.
    pub uploaded_bytes: u64,
    pub packs_uploaded: u32,
    pub duration_ms: u64,
    /// The part of `duration_ms` spent waiting for uploads to finish (all
    /// upload slots busy, or the last packs still on their way).
    pub upload_wait_ms: u64,
    /// When the walk began ([`pb::CheckpointStats::scan_started_at`]).
    #[serde(skip)]
    pub scan_started: Option<std::time::SystemTime>,
}

impl From<&Stats> for pb::CheckpointStats {
    fn from(s: &Stats) -> Self {
        Self {
            files: s.files,
            directories: s.directories,
            symlinks: s.symlinks,
            total_bytes: s.total_bytes,
            files_read: s.files_read,
            bytes_read: s.bytes_read,
            new_blobs: s.new_blobs,
            new_bytes: s.new_bytes,
            uploaded_bytes: s.uploaded_bytes,
            packs_uploaded: s.packs_uploaded,
            duration_ms: s.duration_ms,
            scan_started_at: s.scan_started.map(cairn_proto::domain::to_timestamp),
        }
    }
}

/// A committed checkpoint (the JSON output of `cairn-runner checkpoint`).
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointReport {
    pub checkpoint_id: String,
    pub workspace_id: String,
    pub sequence: u64,
    pub reason: CheckpointReason,
    pub stats: Stats,
    pub warnings: Vec<String>,
    pub repos: Vec<RepoState>,
    /// Keyed id of the root tree (not part of the JSON output).
    #[serde(skip)]
    pub root_tree: BlobId,
}

/// A committed checkpoint that a later one is compared with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Baseline {
    pub checkpoint_id: String,
    pub root_tree: BlobId,
}

/// Why a checkpoint was not committed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Scan(#[from] ScanError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("workspace {0} not found")]
    WorkspaceNotFound(String),
    #[error("{call} failed: {} ({:?})", .status.message(), .status.code())]
    Rpc {
        call: &'static str,
        status: tonic::Status,
    },
    #[error("the coordinator's answer to {call} is unusable: {reason}")]
    BadResponse { call: &'static str, reason: String },
    #[error("cache directory {path}: {source}")]
    CacheDir { path: PathBuf, source: io::Error },
    #[error("spool file {path}: {source}")]
    Spool { path: PathBuf, source: io::Error },
    #[error("uploading pack {pack}: {source}")]
    Upload { pack: PackId, source: TransferError },
    #[error("blob {0} of this checkpoint is in no known pack")]
    UnlocatedBlob(BlobId),
    #[error(transparent)]
    Failpoint(#[from] FailpointError),
    #[error("{0}")]
    Task(String),
}

impl CheckpointError {
    /// Whether running the same checkpoint again later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Connect(ConnectError::Unreachable { .. }) => true,
            Self::Rpc { status, .. } => {
                matches!(
                    status.code(),
                    Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted
                ) || remote::cut_off(status)
            }
            Self::Upload { source, .. } => {
                source.is_retryable() || matches!(source, TransferError::Forbidden { .. })
            }
            _ => false,
        }
    }

    /// The coordinator's typed reason for refusing a call, if it gave one.
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            Self::Rpc { status, .. } => Refusal::of(status),
            _ => None,
        }
    }

    /// The coordinator refused the commit because a referenced pack is not
    /// in the store (the cache named a pack that has been collected).
    pub fn is_missing_pack(&self) -> bool {
        matches!(
            self,
            Self::Rpc {
                call: "CommitCheckpoint",
                ..
            }
        ) && matches!(self.refusal(), Some(Refusal::PacksMissing { .. }))
    }

    /// The packs a missing-pack refusal names.
    pub fn named_packs(&self) -> Vec<PackId> {
        match self.refusal() {
            Some(Refusal::PacksMissing { packs }) => packs,
            _ => Vec::new(),
        }
    }

    /// The coordinator fenced this writer: a newer attempt owns the
    /// workspace, this attempt is no longer current, or the workspace was
    /// finished or deleted under it.
    pub fn is_fenced(&self) -> bool {
        matches!(
            self.refusal(),
            Some(
                Refusal::StaleGeneration { .. }
                    | Refusal::AttemptNotCurrent { .. }
                    | Refusal::WorkspaceNotActive { .. }
            )
        )
    }
}

/// Redos after a commit refused for a lost pack (each must name a new pack).
const MAX_REDOS: u32 = 3;

/// Cuts a checkpoint of `opts.root` and commits it.
pub async fn checkpoint(opts: CheckpointOptions) -> Result<CheckpointReport, CheckpointError> {
    let report = cut(opts, None).await?;
    Ok(report.expect("without a baseline every checkpoint is committed"))
}

/// Cuts a checkpoint of `opts.root` and commits it, unless the workspace's
/// newest checkpoint is still `baseline` and the content has not changed
/// since (then `None`).
pub async fn checkpoint_if_changed(
    opts: CheckpointOptions,
    baseline: &Baseline,
) -> Result<Option<CheckpointReport>, CheckpointError> {
    cut(opts, Some(baseline)).await
}

async fn cut(
    opts: CheckpointOptions,
    baseline: Option<&Baseline>,
) -> Result<Option<CheckpointReport>, CheckpointError> {
    match opts.resident.clone() {
        Some(resident) => cut_with(&resident, &opts, baseline).await,
        None => cut_with(&OneShot, &opts, baseline).await,
    }
}

/// Cuts the checkpoint with what `recall` remembers, again while the
/// commit is refused for a pack that is gone (see the module doc).
async fn cut_with(
    recall: &impl Recall,
    opts: &CheckpointOptions,
    baseline: Option<&Baseline>,
) -> Result<Option<CheckpointReport>, CheckpointError> {
    let started = Instant::now();
    let root = scan::resolve_root(&opts.root)?;
    scan::exclude_matcher(&root, &opts.excludes)?;
    let coordinator = recall
        .coordinator(&opts.coordinator, opts.token.as_deref())
        .await?;
    let mut lost: HashSet<PackId> = HashSet::new();
    let mut redos = 0;
    loop {
        match run(
            recall,
            &coordinator,
            opts,
            &root,
            baseline,
            redos > 0,
            &lost,
            started,
        )
        .await
        {
            Err(e) if e.is_missing_pack() && redos < MAX_REDOS => {
                let named = e.named_packs();
                if redos > 0 && named.iter().all(|p| lost.contains(p)) {
                    return Err(e);
                }
                tracing::warn!(error = %e, "a pack this checkpoint relied on is gone; checkpointing again without it");
                lost.extend(named);
                redos += 1;
            }
            other => return other,
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn run(
    recall: &impl Recall,
    coordinator: &CoordinatorClient,
    opts: &CheckpointOptions,
    root: &Path,
    baseline: Option<&Baseline>,
    forget_blobs: bool,
    lost: &HashSet<PackId>,
    started: Instant,
) -> Result<Option<CheckpointReport>, CheckpointError> {
    let cache_dir_error = |source| CheckpointError::CacheDir {
        path: opts.cache_dir.clone(),
        source,
    };
    fs::create_dir_all(&opts.cache_dir).map_err(cache_dir_error)?;
    let cache_dir = fs::canonicalize(&opts.cache_dir).map_err(cache_dir_error)?;
    let ms = || started.elapsed().as_millis() as u64;

    let scan_options = opts.scan_options(root, &cache_dir);
    let repo_reading = recall.repo_reading(baseline.is_some());
    let scanning = {
        let recall = recall.clone();
        blocking(move || {
            let inspector = git::Inspector::start();
            let held_repos = std::sync::Mutex::new(Vec::new());
            let on_repo = |found| match repo_reading {
                RepoReading::AfterWalk => held_repos.lock().expect("held repos lock").push(found),
                RepoReading::AtOnceRemembered => inspector.submit_remembered(found),
                RepoReading::AtOnce => inspector.submit(found),
            };
            let scanned = recall.walk(&scan_options, &on_repo);
            let held_repos = held_repos.into_inner().expect("held repos lock");
            (scanned, inspector, held_repos)
        })
    };
    let begin = Session::begin(coordinator, &opts.workspace, opts.generation);
    let (session, (scanned, inspector, held_repos)) = if recall.walk_beside_begin() {
        let (session, scanning) = tokio::join!(begin, scanning);
        (session?, scanning)
    } else {
        let session = begin.await?;
        (session, scanning.await)
    };
    let spool = Spool::create(&cache_dir).map_err(cache_dir_error)?;
    tracing::debug!(elapsed_ms = ms(), "checkpoint begun");
    let (walked, scan_kind) = scanned?;
    tracing::debug!(
        files = walked.file_count(),
        directories = walked.dirs.len(),
        walk = ?scan_kind,
        elapsed_ms = ms(),
        "workspace scanned"
    );
    if let Some(baseline) = baseline
        && baseline.checkpoint_id == session.parent
        && recall.cut_from(baseline, &walked)
    {
        // The very walk the newest checkpoint was cut from: nothing to read.
        tracing::debug!(parent = %session.parent, elapsed_ms = ms(), "no change since the last checkpoint; nothing committed");
        return Ok(None);
    }
    if repo_reading == RepoReading::AfterWalk {
        let status_memory = recall.repo_statuses().await;
        let status_memory = status_memory.filter(|memory| memory.walk.root == walked.root);
        for found in held_repos {
            inspector.submit_following(found, status_memory.as_ref(), &walked);
        }
    }

    let Known { mut cache, memo } = recall
        .known(&cache_dir, &session.workspace_id, session.keys.key_id())
        .await;
    if forget_blobs {
        // Which of the remembered blobs sat in a lost pack is not known.
        cache.forget_blobs();
    }
    tracing::debug!(
        files = cache.file_count(),
        blobs = cache.blob_count(),
        elapsed_ms = ms(),
        "fingerprint cache loaded"
    );
    let cache = Arc::new(cache);
    let keys = session.keys.clone();
    let (scan, limit_warnings) = limits::apply(walked.clone(), &opts.limits);
    // After a refused commit a remembered pack may be gone: start afresh.
    let memo = memo.filter(|_| !forget_blobs);

    let mut store = Store::new(&session, &spool, lost);

    // File contents: the reader sends batches of new chunks while this task stores them.
    let (batches, mut incoming) = tokio::sync::mpsc::channel(1);
    let reader = {
        let (scan, cache, keys, memo) = (scan.clone(), cache.clone(), keys.clone(), memo.clone());
        let git_trees = inspector.trees();
        tokio::task::spawn_blocking(move || {
            std::thread::scope(|s| {
                let finding = s.spawn(|| {
                    let bases = TreeBases::find(&scan, &cache, memo.as_deref(), &git_trees);
                    let elapsed_ms = started.elapsed().as_millis() as u64;
                    tracing::debug!(elapsed_ms, "git tree bases found");
                    bases
                });
                // Without bases (the thread panicked) loose trees are
                // stored as the files they are.
                let bases = || finding.join().unwrap_or_default();
                content::read_all(&scan, &cache, bases, &keys, memo.as_deref(), batches)
            })
        })
    };
    let mut stored = Ok(());
    while let Some(batch) = incoming.recv().await {
        if let Err(e) = store.store(PackKind::Data, batch.blobs).await {
            stored = Err(e);
            break;
        }
    }
    // Closing the channel stops the reader if storing failed.
    drop(incoming);
    let read = reader
        .await
        .map_err(|e| CheckpointError::Task(format!("the file reader failed: {e}")));
    stored?;
    let content =
        read?.map_err(|Cancelled| CheckpointError::Task("the file reader stopped early".into()))?;
    store.finish_pack(PackKind::Data).await?;
    tracing::debug!(
        files_read = content.files_read,
        bytes_read = content.bytes_read,
        elapsed_ms = ms(),
        "contents stored"
    );

    // Trees, then what is left to upload.
    let (mut trees, content) = {
        let (scan, cache, keys, memo) = (scan.clone(), cache.clone(), keys.clone(), memo.clone());
        blocking(move || {
            let remembered = remembered_trees(&scan, &content, memo.as_deref());
            let known = |id: &BlobId| cache.knows_blob(id);
            let trees = trees::build(&scan, &content.files, &keys, &known, &remembered);
            drop(remembered);
            (trees, content)
        })
        .await
    };
    tracing::debug!(dirs_reused = trees.reused, elapsed_ms = ms(), "trees built");
    store
        .store(PackKind::Meta, std::mem::take(&mut trees.unknown))
        .await?;
    store.finish_pack(PackKind::Meta).await?;
    let Store {
        uploader,
        located,
        mut stats,
        ..
    } = store;
    let (new_packs, upload_wait) = uploader.finish().await?;
    stats.upload_wait_ms = upload_wait.as_millis() as u64;
    tracing::debug!(
        packs = new_packs.len(),
        elapsed_ms = ms(),
        "trees stored, uploads finished"
    );
    let placed = place(&scan, &content, &trees, &located, &cache, memo.as_deref())?;
    let inspected = blocking(move || inspector.finish()).await;
    tracing::debug!(
        repos = inspected.repos.len(),
        elapsed_ms = ms(),
        "git state read"
    );
    recall.remember_statuses(git::StatusMemory {
        walk: walked.clone(),
        repos: inspected.statuses,
    });
    let (repos, git_warnings) = (inspected.repos, inspected.warnings);
    let learned = Learned {
        walk: walked,
        root: trees.root,
        cache,
        scan,
        content,
        trees: std::mem::take(&mut trees.dirs),
        packs: placed.per_dir,
        located,
        workspace: session.workspace_id.clone(),
        key_id: keys.key_id().to_owned(),
        memo,
    };

    if let Some(baseline) = baseline
        && baseline.checkpoint_id == session.parent
        && baseline.root_tree == trees.root
    {
        tracing::debug!(parent = %session.parent, elapsed_ms = ms(), "workspace unchanged; nothing committed");
        recall.unchanged(baseline.clone(), learned).await;
        return Ok(None);
    }

    failpoint::hit("checkpoint-before-commit")?;

    stats.files = trees.counts.files;
    stats.directories = trees.counts.directories;
    stats.symlinks = trees.counts.symlinks;
    stats.total_bytes = trees.counts.total_bytes;
    stats.files_read = learned.content.files_read;
    stats.bytes_read = learned.content.bytes_read;
    stats.duration_ms = started.elapsed().as_millis() as u64;
    stats.scan_started = Some(learned.scan.started);
    let warnings = capped_warnings(
        learned
            .scan
            .warnings
            .iter()
            .chain(&limit_warnings)
            .chain(&learned.content.warnings)
            .chain(&git_warnings)
            .cloned()
            .collect(),
    );
    let request = pb::CommitCheckpointRequest {
        workspace: session.workspace_id.to_string(),
        generation: session.generation,
        parent_checkpoint_id: session.parent.clone(),
        reason: pb::CheckpointReason::from(opts.reason) as i32,
        format_version: FORMAT_VERSION,
        root_tree: trees.root.as_bytes().to_vec(),
        new_packs,
        referenced_packs: placed.referenced.iter().map(|p| p.to_string()).collect(),
        stats: Some(pb::CheckpointStats::from(&stats)),
        repos: repos.iter().cloned().map(pb::GitRepoState::from).collect(),
        warnings: warnings.clone(),
        harness: opts.harness.clone(),
        key_id: keys.key_id().to_owned(),
        // One name for this commit, however often it is sent: a retry
        // after a cut-off call gets the checkpoint the first one made.
        request_id: CommitRequestId::generate().to_string(),
    };
    let committing = async {
        tracing::debug!(elapsed_ms = ms(), "committing");
        remote::commit(&session.client, request).await
    };
    let committed = recall.commit(committing, learned).await?;
    tracing::debug!(checkpoint = %committed.id, sequence = committed.sequence, elapsed_ms = ms(), "checkpoint committed");
    drop(spool);
    Ok(Some(CheckpointReport {
        checkpoint_id: committed.id,
        workspace_id: session.workspace_id.to_string(),
        sequence: committed.sequence,
        reason: opts.reason,
        stats,
        warnings,
        repos,
        root_tree: trees.root,
    }))
}

/// Per directory, the tree `memo` remembers for it if its files were taken
/// from the memo.
fn remembered_trees<'m>(
    scan: &Scan,
    content: &Content,
    memo: Option<&'m Memo>,
) -> Vec<Option<&'m DirTree>> {
    let Some(memo) = memo else {
        return Vec::new();
    };
    scan.dirs
        .iter()
        .zip(&content.from_memo)
        .map(|(dir, &from_memo)| {
            memo.get(dir)
                .filter(|_| from_memo)
                .map(|outcome| &outcome.tree)
        })
        .collect()
}

/// Where a checkpoint's blobs are.
struct Placed {
    /// Per directory: the packs holding its file chunks, tree and pages.
    per_dir: Vec<Arc<[PackId]>>,
    /// All of them, for the commit.
    referenced: BTreeSet<PackId>,
}

/// Finds the pack of every blob the checkpoint reaches: found or written by
/// this checkpoint, else known to the cache. A directory whose files were
/// taken from `memo`, and whose tree is the one remembered, keeps the packs
/// remembered with it.
fn place(
    scan: &Scan,
    content: &Content,
    trees: &trees::Trees,
    located: &FastMap<BlobId, PackId>,
    cache: &Cache,
    memo: Option<&Memo>,
) -> Result<Placed, CheckpointError> {
    let mut per_dir = Vec::with_capacity(scan.dirs.len());
    let mut referenced = crate::cache::FastSet::default();
    let dirs = scan.dirs.iter().zip(&content.files).zip(&content.from_memo);
    for (d, (((dir, files), &from_memo), tree)) in dirs.zip(&trees.dirs).enumerate() {
        let remembered = memo
            .and_then(|memo| memo.get(dir))
            .filter(|outcome| from_memo && outcome.tree == *tree);
        let packs = match remembered {
            Some(outcome) => outcome.packs.clone(),
            None => {
                let taken = content.from_earlier[d].as_ref();
                let read = files.iter().enumerate().filter_map(|(n, file)| {
                    let taken = taken.is_some_and(|taken| taken.nodes[n]);
                    file.as_ref().filter(|_| !taken)
                });
                let locate = |id: &BlobId| located.get(id).or_else(|| cache.blob_pack(id));
                let earlier = taken.map_or_else(Vec::new, |taken| taken.packs.to_vec());
                memo::packs_of(earlier, read, tree, locate)
                    .map_err(CheckpointError::UnlocatedBlob)?
                    .into()
            }
        };
        // Neighbouring directories mostly sit in the same packs: one
        // comparison with the last list instead of a lookup per pack.
        let same_as_last = per_dir
            .last()
            .is_some_and(|last: &Arc<[PackId]>| last[..] == packs[..]);
        if !same_as_last {
            for pack in packs.iter() {
                if !referenced.contains(pack) {
                    referenced.insert(pack.clone());
                }
            }
        }
        per_dir.push(packs);
    }
    Ok(Placed {
        per_dir,
        referenced: referenced.into_iter().collect(),
    })
}

fn capped_warnings(mut warnings: Vec<String>) -> Vec<String> {
    if warnings.len() > MAX_WARNINGS {
        let more = warnings.len() - (MAX_WARNINGS - 1);
        warnings.truncate(MAX_WARNINGS - 1);
        warnings.push(format!("… and {more} more warnings"));
    }
    warnings
}

/// Stores new blobs: asks which the store lacks, seals and packs those, and
/// uploads every pack as it fills.
struct Store<'a> {
    session: &'a Session,
    /// Packs known to be gone: blobs the store places there are sent again.
    lost: &'a HashSet<PackId>,
    uploader: Uploader,
    /// One packer per kind; lent to a blocking task while it seals a batch.
    data: Option<Packer>,
    meta: Option<Packer>,
    /// Blobs of this checkpoint found in the store or written to a new pack.
    located: FastMap<BlobId, PackId>,
    stats: Stats,
}

impl<'a> Store<'a> {
    fn new(session: &'a Session, spool: &Spool, lost: &'a HashSet<PackId>) -> Self {
        Self {
            session,
            lost,
            uploader: Uploader::new(session),
            data: Some(Packer::new(PackKind::Data, session.keys.clone(), spool)),
            meta: Some(Packer::new(PackKind::Meta, session.keys.clone(), spool)),
            located: FastMap::default(),
            stats: Stats::default(),
        }
    }

    fn packer(&mut self, kind: PackKind) -> &mut Option<Packer> {
        match kind {
            PackKind::Data => &mut self.data,
            PackKind::Meta => &mut self.meta,
        }
    }

    async fn store(
        &mut self,
        kind: PackKind,
        blobs: Vec<(BlobId, Vec<u8>)>,
    ) -> Result<(), CheckpointError> {
        if blobs.is_empty() {
            return Ok(());
        }
        let ids: Vec<BlobId> = blobs.iter().map(|(id, _)| *id).collect();
        let present = self.session.find_missing(&ids).await?;
        let mut missing = Vec::new();
        for ((id, data), pack) in blobs.into_iter().zip(present) {
            match pack {
                Some(pack) if !self.lost.contains(&pack) => {
                    self.located.insert(id, pack);
                }
                _ => missing.push((id, data)),
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        self.stats.new_blobs += missing.len() as u64;
        self.stats.new_bytes += missing
            .iter()
            .map(|(_, data)| data.len() as u64)
            .sum::<u64>();
        let keys = self.session.keys.clone();
        let mut packer = self
            .packer(kind)
            .take()
            .expect("a failed batch ends the checkpoint, so the packer is back");
        let (packer, finished) = blocking(move || -> Result<_, CheckpointError> {
            let sealed: Vec<(BlobId, Vec<u8>, u32)> = missing
                .into_par_iter()
                .map(|(id, data)| {
                    // seal() reserves exactly what the sealed blob needs.
                    let mut out = Vec::new();
                    seal(&keys, &id, &data, &mut out);
                    (id, out, data.len() as u32)
                })
                .collect();
            let mut finished = Vec::new();
            for (id, bytes, plain_len) in sealed {
                finished.extend(packer.add(id, &bytes, plain_len)?);
            }
            Ok((packer, finished))
        })
        .await?;
        *self.packer(kind) = Some(packer);
        for pack in finished {
            self.upload(pack).await?;
        }
        Ok(())
    }

    /// Finishes and uploads the last pack of `kind`, if it holds anything.
    async fn finish_pack(&mut self, kind: PackKind) -> Result<(), CheckpointError> {
        let Some(mut packer) = self.packer(kind).take() else {
            return Ok(());
        };
        if let Some(pack) = packer.finish()? {
            self.upload(pack).await?;
        }
        Ok(())
    }

    async fn upload(&mut self, pack: SpooledPack) -> Result<(), CheckpointError> {
        for id in &pack.blob_ids {
            self.located.insert(*id, pack.id.clone());
        }
        self.stats.uploaded_bytes += pack.record.size;
        self.stats.packs_uploaded += 1;
        self.uploader.upload(pack).await
    }
}

/// The newest checkpoint of a workspace: what a later one is compared
/// with, and whose fingerprint cache a resident runner can load early.
#[derive(Debug, Clone)]
pub struct Newest {
    pub baseline: Baseline,
    pub workspace_id: WorkspaceId,
    pub key_id: String,
}

/// The workspace's newest checkpoint (None: it has none).
pub async fn newest_checkpoint(
    options: &CheckpointOptions,
) -> Result<Option<Newest>, CheckpointError> {
    let coordinator =
        CoordinatorClient::connect_retrying(&options.coordinator, options.token.as_deref()).await?;
    let listed = coordinator
        .checkpoints
        .clone()
        .list_checkpoints(pb::ListCheckpointsRequest {
            workspace: options.workspace.clone(),
            page_size: 1,
            page_token: String::new(),
        })
        .await
        .map_err(|status| match status.code() {
            Code::NotFound => CheckpointError::WorkspaceNotFound(options.workspace.clone()),
            _ => CheckpointError::Rpc {
                call: "ListCheckpoints",
                status,
            },
        })?
        .into_inner();
    let Some(newest) = listed.checkpoints.into_iter().next() else {
        return Ok(None);
    };
    let bad = |what: &str, e: &dyn std::fmt::Display| CheckpointError::BadResponse {
        call: "ListCheckpoints",
        reason: format!("checkpoint {} has a malformed {what}: {e}", newest.id),
    };
    let root_tree = BlobId::from_slice(&newest.root_tree).map_err(|e| bad("root tree", &e))?;
    let workspace_id = newest
        .workspace_id
        .parse()
        .map_err(|e| bad("workspace id", &e))?;
    Ok(Some(Newest {
        baseline: Baseline {
            checkpoint_id: newest.id,
            root_tree,
        },
        workspace_id,
        key_id: newest.key_id,
    }))
}

/// Readies a resident runner (`opts.resident`) for its first checkpoint
/// of `workspace`, whose newest checkpoint is under tenant key `key_id`:
/// loads the fingerprint cache and works out what that checkpoint holds per
/// listing (see [`Resident::preload`]), in the background. When the
/// coordinator cannot say which tenant key hashes the trees, only the cache
/// is loaded.
pub async fn prime(
    opts: &CheckpointOptions,
    workspace: WorkspaceId,
    key_id: String,
    cache_dir: PathBuf,
) {
    let Some(resident) = &opts.resident else {
        return;
    };
    let session =
        match CoordinatorClient::connect_retrying(&opts.coordinator, opts.token.as_deref()).await {
            Ok(coordinator) => Session::begin(&coordinator, &opts.workspace, opts.generation)
                .await
                .ok(),
            Err(_) => None,
        };
    let memo_from = match (session, scan::resolve_root(&opts.root)) {
        (Some(session), Ok(root))
            if session.workspace_id == workspace && session.keys.key_id() == key_id =>
        {
            Some((session.keys, opts.scan_options(&root, &cache_dir)))
        }
        _ => None,
    };
    resident
        .preload(cache_dir, workspace, key_id, memo_from)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_many_warnings_are_summed_up() {
        let warnings = capped_warnings((0..250).map(|i| format!("w{i}")).collect());
        assert_eq!(warnings.len(), MAX_WARNINGS);
        assert_eq!(warnings.last().unwrap(), "… and 151 more warnings");
    }

    #[test]
    fn a_commit_refused_for_a_missing_pack_is_told_apart_by_its_refusal() {
        let pack: PackId = "0123abcd".repeat(8).parse().unwrap();
        let missing = CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: Refusal::PacksMissing {
                packs: vec![pack.clone()],
            }
            .into_status("reworded at will"),
        };
        assert!(missing.is_missing_pack() && !missing.is_fenced());
        assert_eq!(missing.named_packs(), std::slice::from_ref(&pack));
        let worded = CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: tonic::Status::failed_precondition(format!(
                "pack {pack} is not in the store (never uploaded, or lost)"
            )),
        };
        assert!(
            !worded.is_missing_pack() && worded.named_packs().is_empty() && !worded.is_fenced(),
            "the message is never read"
        );
        let stale = CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: Refusal::StaleGeneration {
                given: cairn_proto::ids::Generation(2),
                current: cairn_proto::ids::Generation(3),
            }
            .into_status("pack pack pack"),
        };
        assert!(!stale.is_missing_pack() && stale.is_fenced());
        let unavailable = CheckpointError::Rpc {
            call: "FindMissingBlobs",
            status: tonic::Status::unavailable("down"),
        };
        assert!(unavailable.is_retryable() && !stale.is_retryable());
    }

    #[test]
    fn a_call_cut_off_in_the_transport_is_retried_and_a_sent_unknown_is_not() {
        let broken = std::io::Error::new(io::ErrorKind::ConnectionReset, "connection reset");
        let cut = CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: tonic::Status::from_error(Box::new(broken)),
        };
        assert!(cut.is_retryable(), "a reset connection is retried");
        let sent = CheckpointError::Rpc {
            call: "CommitCheckpoint",
            status: tonic::Status::unknown("the coordinator said so"),
        };
        assert!(
            !sent.is_retryable(),
            "a status the coordinator sent is final"
        );
    }
}
