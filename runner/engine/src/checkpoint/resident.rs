//! What a resident runner (`cairn-runner watch`, `cairn-runner run`) keeps
//! between its checkpoints, so that each one costs what changed:
//! - the change tracker, so a walk lists only the directories that changed;
//! - the fingerprint cache, in memory: a checkpoint neither loads it first
//!   (~50k entries take a tenth of a second to decode) nor waits for it to
//!   be written after the commit. It is still written after every
//!   checkpoint, in the background and at a lower CPU priority
//!   ([`in_background`]), so a restarted runner starts warm;
//! - the walk its last checkpoint was cut from: while the tracker has seen
//!   no change since, a "only if changed" checkpoint is settled without
//!   reading or hashing anything;
//! - what that checkpoint found per directory listing ([`Memo`]), so the
//!   next one takes it for every listing the tracker hands back unchanged;
//! - what the last `git status` of each repository listed, and the walk it
//!   followed, so the next one asks git about only what changed since
//!   ([`crate::git::narrow`]);
//! - the connection to the coordinator, so a checkpoint does not wait for a
//!   TCP and HTTP/2 handshake first.
//!
//! A checkpoint's stages reach all of it through [`Recall`], which a
//! [`Resident`] implements (and [`OneShot`] for a runner that keeps nothing).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cairn_proto::ids::WorkspaceId;
use tokio::task::JoinHandle;

use super::learn::Learned;
use super::memo::Memo;
use super::recall::{Known, OneShot, Recall, RepoReading};
use super::remote::Committed;
use super::{Baseline, CheckpointError};
use crate::cache::FingerprintCache;
use crate::client::{ConnectError, CoordinatorClient};
use crate::format::TenantKeys;
use crate::git::StatusMemory;
use crate::scan::{RepoFound, Scan, ScanError, ScanOptions};
use crate::tracker::{ChangeTracker, ScanKind};

/// A resident runner's state across checkpoints.
#[derive(Debug)]
pub struct Resident {
    tracker: Option<ChangeTracker>,
    /// The fingerprint cache between checkpoints.
    cache: tokio::sync::Mutex<CacheSlot>,
    /// The last checkpoint committed (or found unchanged) and its walk.
    last_cut: Mutex<Option<(Baseline, Arc<Scan>)>>,
    /// What that checkpoint found per listing (or, before the first one,
    /// what the cache tells of the newest checkpoint).
    memo: Mutex<Option<Arc<Memo>>>,
    /// The last reading of each repository's status.
    status: Mutex<Option<StatusMemory>>,
    /// Whether [`Resident::read_repos_after`] was started (once is enough).
    status_read_started: std::sync::atomic::AtomicBool,
    /// That reading while it goes on: a checkpoint that comes before it
    /// ends waits for it and narrows its own reading from it, instead of
    /// reading every repository in full beside it.
    status_reading: Mutex<Option<JoinHandle<()>>>,
    /// The last checkpoint's connection, with the address and token it was
    /// made for.
    coordinator: tokio::sync::Mutex<Option<OpenConnection>>,
}

#[derive(Debug)]
struct OpenConnection {
    address: String,
    token: Option<String>,
    coordinator: CoordinatorClient,
}

#[derive(Debug, Default)]
enum CacheSlot {
    #[default]
    Nothing,
    Ready(FingerprintCache),
    /// Being written or loaded; the task hands the cache back (None if it
    /// could not).
    Busy(JoinHandle<Option<FingerprintCache>>),
}

impl Resident {
    /// `tracker`: None when change tracking could not start (every walk is
    /// then a full one, but the cache is still kept).
    pub fn new(tracker: Option<ChangeTracker>) -> Self {
        Self {
            tracker,
            cache: tokio::sync::Mutex::new(CacheSlot::Nothing),
            last_cut: Mutex::new(None),
            memo: Mutex::new(None),
            status: Mutex::new(None),
            status_read_started: std::sync::atomic::AtomicBool::new(false),
            status_reading: Mutex::new(None),
            coordinator: tokio::sync::Mutex::new(None),
        }
    }

    /// Remembers that `baseline` holds the workspace as `walk` saw it, and
    /// forgets what the checkpoint before found until
    /// [`Resident::remember_memo`] tells what this one did: a listing
    /// unchanged since both must not be taken from the older one.
    fn remember_cut(&self, baseline: Baseline, walk: Arc<Scan>) {
        *self.last_cut.lock().expect("last-cut lock") = Some((baseline, walk));
        *self.memo.lock().expect("memo lock") = None;
    }

    /// Whether the memo and the cache already hold what `learned` teaches:
    /// it was cut from the very walk the last checkpoint was (the tracker
    /// saw nothing change since), read no file and found no blob anywhere
    /// new, and the memo it was cut with is the last checkpoint's.
    fn holds_already(&self, learned: &Learned) -> bool {
        let same_walk = self
            .last_cut
            .lock()
            .expect("last-cut lock")
            .as_ref()
            .is_some_and(|(_, walk)| Arc::ptr_eq(walk, &learned.walk));
        let memo_current = match (&learned.memo, &*self.memo.lock().expect("memo lock")) {
            (Some(used), Some(held)) => Arc::ptr_eq(used, held),
            _ => false,
        };
        same_walk && memo_current && learned.content.files_read == 0 && learned.located.is_empty()
    }

    /// Remembers what the last checkpoint found per listing.
    fn remember_memo(&self, memo: Memo) {
        *self.memo.lock().expect("memo lock") = Some(Arc::new(memo));
    }

    /// What the last checkpoint of `workspace` (tenant key `key_id`) found
    /// per listing.
    fn memo(&self, workspace: &WorkspaceId, key_id: &str) -> Option<Arc<Memo>> {
        let memo = self.memo.lock().expect("memo lock");
        memo.clone().filter(|memo| memo.is_of(workspace, key_id))
    }

    /// The last reading of each repository's status, and the walk it followed.
    pub fn status_memory(&self) -> Option<StatusMemory> {
        self.status.lock().expect("status lock").clone()
    }

    pub fn has_status_memory(&self) -> bool {
        self.status.lock().expect("status lock").is_some()
    }

    /// Whether the background reading of [`Resident::read_repos_after`]
    /// is still going on.
    pub fn status_reading_in_flight(&self) -> bool {
        let reading = self.status_reading.lock().expect("status reading lock");
        reading.as_ref().is_some_and(|task| !task.is_finished())
    }

    /// Waits until the background reading of [`Resident::read_repos_after`]
    /// has ended (and been remembered), if one is going on.
    pub async fn await_status_reading(&self) {
        self.await_status_reading_for(None).await;
    }

    /// Like [`Resident::await_status_reading`], for at most `limit`; false
    /// when the reading still goes on then (a checkpoint still waits for it).
    pub async fn await_status_reading_for(&self, limit: Option<std::time::Duration>) -> bool {
        let reading = self
            .status_reading
            .lock()
            .expect("status reading lock")
            .take();
        let Some(mut task) = reading else {
            return true;
        };
        let ended = match limit {
            Some(limit) => match tokio::time::timeout(limit, &mut task).await {
                Ok(ended) => ended,
                Err(_) => {
                    *self.status_reading.lock().expect("status reading lock") = Some(task);
                    return false;
                }
            },
            None => task.await,
        };
        if let Err(e) = ended {
            tracing::warn!(error = %e, "reading the repositories' status in the background failed");
        }
        true
    }

    /// Reads the status of every repository of `walk` in the background and
    /// remembers it, unless a checkpoint has read them by then: the next
    /// checkpoint's status is then read for only what changed since. Only
    /// the first call reads.
    pub fn read_repos_after(self: &Arc<Self>, walk: Arc<Scan>) {
        use std::sync::atomic::Ordering;
        if self.status_read_started.swap(true, Ordering::SeqCst) || self.has_status_memory() {
            return;
        }
        let resident = self.clone();
        let reading = tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let inspector = crate::git::Inspector::start();
            crate::scan::announce_repos(&walk, &|found| {
                inspector.submit_following(found, None, &walk);
            });
            let inspected = inspector.finish();
            tracing::debug!(
                repos = inspected.statuses.len(),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "the repositories' status read in the background"
            );
            let mut status = resident.status.lock().expect("status lock");
            if status.is_none() {
                *status = Some(StatusMemory {
                    walk,
                    repos: inspected.statuses,
                });
            }
        });
        *self.status_reading.lock().expect("status reading lock") = Some(reading);
    }

    pub fn tracker(&self) -> Option<&ChangeTracker> {
        self.tracker.as_ref()
    }

    /// The cache of `workspace` under `cache_dir` for tenant key `key_id`:
    /// the one kept from the last checkpoint if it is that one, else loaded
    /// from disk. Until [`Resident::keep`] or [`Resident::put_back`], no other
    /// checkpoint gets it.
    async fn take_cache(
        &self,
        cache_dir: &Path,
        workspace: &WorkspaceId,
        key_id: &str,
    ) -> FingerprintCache {
        let held = std::mem::take(&mut *self.cache.lock().await).settle().await;
        match held {
            Some(cache)
                if cache.path() == FingerprintCache::path_for(cache_dir, workspace)
                    && cache.key_id() == key_id =>
            {
                cache
            }
            _ => FingerprintCache::load(cache_dir, workspace, key_id),
        }
    }

    /// Gives back a cache taken by a checkpoint that did not commit, unless
    /// something still holds it (then the next checkpoint loads it).
    async fn put_back(&self, cache: Arc<FingerprintCache>) {
        if let Ok(cache) = Arc::try_unwrap(cache) {
            *self.cache.lock().await = CacheSlot::Ready(cache);
        }
    }

    /// Keeps the cache a checkpoint is writing, for the next one.
    async fn keep(&self, saving: JoinHandle<Option<FingerprintCache>>) {
        *self.cache.lock().await = CacheSlot::Busy(saving);
    }

    /// Starts loading the cache of `workspace` (tenant key `key_id`) in the
    /// background, so that the first checkpoint finds it in memory. With
    /// `keys` and a `walk`, it then works out from a walk and the cache alone
    /// what the workspace's newest checkpoint held per listing
    /// ([`Memo::prime`]), so that the first checkpoint, too, costs what
    /// changed. The first checkpoint waits for both, as for the cache.
    pub async fn preload(
        self: &Arc<Self>,
        cache_dir: PathBuf,
        workspace: WorkspaceId,
        key_id: String,
        memo_from: Option<(Arc<TenantKeys>, ScanOptions)>,
    ) {
        let mut slot = self.cache.lock().await;
        if !matches!(*slot, CacheSlot::Nothing) {
            return;
        }
        let resident = self.clone();
        *slot = CacheSlot::Busy(tokio::task::spawn_blocking(move || {
            let cache = FingerprintCache::load(&cache_dir, &workspace, &key_id);
            if let (Some((keys, walk)), Some(tracker)) = (memo_from, resident.tracker()) {
                match tracker.scan(&walk, &|_| {}) {
                    Ok((scan, _)) => {
                        // A run's runner starts here, after its restore.
                        resident.read_repos_after(scan.clone());
                        resident.prime(workspace, &scan, &cache, &keys);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot walk the workspace to prime the runner")
                    }
                }
            }
            Some(cache)
        }));
    }

    /// Waits until a cache being loaded (and the memo being primed with
    /// it) is in memory, or one being written is on disk (as before the
    /// runner exits).
    pub async fn settle(&self) {
        let mut slot = self.cache.lock().await;
        if let Some(cache) = std::mem::take(&mut *slot).settle().await {
            *slot = CacheSlot::Ready(cache);
        }
    }

    /// Keeps what `cache` tells of the newest checkpoint, unless a
    /// checkpoint got there first (it knows better).
    fn prime(
        &self,
        workspace: WorkspaceId,
        scan: &Arc<Scan>,
        cache: &FingerprintCache,
        keys: &TenantKeys,
    ) {
        let started = std::time::Instant::now();
        let memo = Memo::prime(workspace, scan, cache, keys);
        tracing::debug!(
            dirs = scan.dirs.len(),
            known = memo.listings(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "what the newest checkpoint holds worked out from the cache"
        );
        let mut held = self.memo.lock().expect("memo lock");
        if held.is_none() {
            *held = Some(Arc::new(memo));
        }
    }
}

/// A resident runner remembers what its checkpoints worked out (see the
/// module doc).
impl Recall for Arc<Resident> {
    /// The one the last checkpoint used if it was made for both, else a new
    /// one, kept for the next. A connection that broke is made again
    /// by its channel on the next call.
    async fn coordinator(
        &self,
        address: &str,
        token: Option<&str>,
    ) -> Result<CoordinatorClient, ConnectError> {
        let mut open = self.coordinator.lock().await;
        if let Some(open) = open.as_ref()
            && open.address == address
            && open.token.as_deref() == token
        {
            return Ok(open.coordinator.clone());
        }
        let coordinator = CoordinatorClient::connect(address, token).await?;
        *open = Some(OpenConnection {
            address: address.to_owned(),
            token: token.map(str::to_owned),
            coordinator: coordinator.clone(),
        });
        Ok(coordinator)
    }

    /// The tracker lists only what changed.
    fn walk_beside_begin(&self) -> bool {
        true
    }

    /// Each repository is read for what changed since its last reading,
    /// when there is one or one is on its way, and when the checkpoint may
    /// be settled from the walk; otherwise in full beside the walk, and
    /// remembered for the next checkpoint. A reading that began when the
    /// runner started is waited for, after the walk, rather than done
    /// again beside it.
    fn repo_reading(&self, only_if_changed: bool) -> RepoReading {
        if self.has_status_memory() || self.status_reading_in_flight() || only_if_changed {
            RepoReading::AfterWalk
        } else {
            RepoReading::AtOnceRemembered
        }
    }

    fn walk(
        &self,
        options: &ScanOptions,
        on_repo: &(dyn Fn(RepoFound) + Sync),
    ) -> Result<(Arc<Scan>, ScanKind), ScanError> {
        match self.tracker() {
            Some(tracker) => tracker.scan(options, on_repo),
            None => OneShot.walk(options, on_repo),
        }
    }

    /// The tracker handed back the very walk `baseline` was cut from.
    fn cut_from(&self, baseline: &Baseline, walk: &Arc<Scan>) -> bool {
        let last = self.last_cut.lock().expect("last-cut lock");
        last.as_ref()
            .is_some_and(|(cut, was)| cut == baseline && Arc::ptr_eq(was, walk))
    }

    async fn repo_statuses(&self) -> Option<StatusMemory> {
        self.await_status_reading().await;
        self.status_memory()
    }

    fn remember_statuses(&self, memory: StatusMemory) {
        *self.status.lock().expect("status lock") = Some(memory);
    }

    /// The cache kept from the last checkpoint if it is this one (else
    /// loaded from disk), once written; then the memo, which the last
    /// checkpoint's writing of the cache remembers first.
    async fn known(&self, cache_dir: &Path, workspace: &WorkspaceId, key_id: &str) -> Known {
        let cache = self.take_cache(cache_dir, workspace, key_id).await;
        let memo = self.memo(workspace, key_id);
        Known { cache, memo }
    }

    /// Remembers that `baseline` holds the workspace as this walk saw it,
    /// and what was found per listing; keeps the cache.
    async fn unchanged(&self, baseline: Baseline, learned: Learned) {
        let memo = learned.memo();
        self.remember_cut(baseline, learned.walk.clone());
        self.remember_memo(memo);
        self.put_back(learned.cache).await;
    }

    /// Answers first and writes the cache afterwards, in the background: on
    /// two cores, writing ~50k entries while the coordinator commits slows
    /// the commit the agent waits for.
    async fn commit(
        &self,
        committing: impl Future<Output = Result<Committed, CheckpointError>> + Send,
        learned: Learned,
    ) -> Result<Committed, CheckpointError> {
        let committed = match committing.await {
            Ok(committed) => committed,
            Err(e) => {
                // Unchanged, it still places blobs only in committed packs.
                self.put_back(learned.cache).await;
                return Err(e);
            }
        };
        let baseline = Baseline {
            checkpoint_id: committed.id.clone(),
            root_tree: learned.root,
        };
        if self.holds_already(&learned) {
            // An unchanged workspace's pause, end or destroy checkpoint: the
            // memo and the cache the last checkpoint left hold all this one
            // would, so nothing is worked out or written again (a runner
            // that ends next waits for no cache to be written).
            *self.last_cut.lock().expect("last-cut lock") = Some((baseline, learned.walk.clone()));
            self.put_back(learned.cache).await;
            return Ok(committed);
        }
        // What this checkpoint found is worked out for the next one after
        // the answer, with the cache, which the next checkpoint waits for
        // first.
        self.remember_cut(baseline, learned.walk.clone());
        let resident = self.clone();
        let saving = in_background(move || {
            resident.remember_memo(learned.memo());
            learned.save_cache()
        });
        self.keep(saving).await;
        Ok(committed)
    }
}

/// How much lower than the runner's the priority of background work is
/// (a nice value: at 10 it gets about a tenth of a busy core).
const BACKGROUND_NICENESS: libc::c_int = 10;

/// Runs `work` on a thread of its own at a lower CPU priority: work done
/// after an answer, which nothing waits for yet, then gives way on a busy
/// machine to what is waited for (the next request, the agent, the
/// coordinator) instead of sharing a core with it evenly. A thread of its
/// own because a pooled one could not be given its priority back without
/// privileges.
pub fn in_background<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    tokio::task::spawn_blocking(move || {
        std::thread::Builder::new()
            .name("cairn-background".into())
            .spawn(move || {
                lower_this_threads_priority();
                work()
            })
            .expect("a thread for background work")
            .join()
            // A panic in `work` reaches whoever awaits the handle.
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

fn lower_this_threads_priority() {
    // SAFETY: neither call touches memory; on Linux a thread id given to
    // setpriority names that one thread.
    let rc = unsafe {
        let current = libc::getpriority(libc::PRIO_PROCESS, 0);
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::gettid() as libc::id_t,
            current.saturating_add(BACKGROUND_NICENESS),
        )
    };
    if rc != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "background work runs at the runner's own priority");
    }
}

impl CacheSlot {
    /// The cache, once any write of it has finished.
    async fn settle(self) -> Option<FingerprintCache> {
        match self {
            Self::Nothing => None,
            Self::Ready(cache) => Some(cache),
            Self::Busy(task) => task.await.unwrap_or_else(|e| {
                tracing::warn!(error = %e, "writing or loading the fingerprint cache failed");
                None
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::git::testing::git;

    fn this_threads_niceness() -> libc::c_int {
        // SAFETY: no memory is touched; a thread id names that thread.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }

    /// The cache written after a checkpoint gives way to what is waited
    /// for; the threads that cut checkpoints keep the runner's priority.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn background_work_runs_at_a_lower_priority_and_leaves_the_rest_alone() {
        // SAFETY: no memory is touched.
        let runner = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let background = in_background(this_threads_niceness).await.unwrap();
        assert_eq!(background, (runner + BACKGROUND_NICENESS).min(19));
        let pooled = tokio::task::spawn_blocking(this_threads_niceness)
            .await
            .unwrap();
        assert_eq!(
            pooled, runner,
            "the blocking pool keeps the runner's priority"
        );
        assert_eq!(this_threads_niceness(), runner);

        let failed = in_background(|| panic!("while writing")).await;
        assert!(
            failed.unwrap_err().is_panic(),
            "a panic reaches the awaiting task"
        );
    }

    /// A bounded wait for the background status reading gives up without
    /// losing it: a checkpoint still finds it going on, and waits for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bounded_wait_for_the_status_reading_leaves_it_for_the_checkpoint() {
        let resident = Resident::new(None);
        assert!(!resident.status_reading_in_flight());
        assert!(
            resident
                .await_status_reading_for(Some(Duration::from_millis(1)))
                .await,
            "nothing to wait for"
        );
        let (release, released) = std::sync::mpsc::channel::<()>();
        *resident.status_reading.lock().unwrap() = Some(tokio::task::spawn_blocking(move || {
            let _ = released.recv();
        }));
        assert!(
            !resident
                .await_status_reading_for(Some(Duration::from_millis(20)))
                .await
        );
        assert!(
            resident.status_reading_in_flight(),
            "kept for the checkpoint"
        );
        release.send(()).unwrap();
        resident.await_status_reading().await;
        assert!(!resident.status_reading_in_flight());
    }

    /// A run's runner is made resident after its restore, not by a first
    /// walk of its own: preloading the cache starts the status reading
    /// that narrows the first checkpoint's, once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn preloading_reads_the_repositories_status_once_for_the_first_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(tmp.path()).unwrap().join("ws");
        let repo = root.join("app");
        std::fs::create_dir_all(&repo).unwrap();
        git(&repo, &["init", "-q"]);
        std::fs::write(repo.join("a.txt"), "a").unwrap();
        let cache_dir = tmp.path().join("cache");
        let tracker = ChangeTracker::start(&root, Duration::from_secs(3600)).unwrap();
        let resident = Arc::new(Resident::new(Some(tracker)));
        assert!(!resident.has_status_memory());

        let keys = Arc::new(TenantKeys::derive("k", &[7; 32]).unwrap());
        let walk = ScanOptions {
            root: root.clone(),
            skip_ignored: false,
            excludes: Vec::new(),
            exclude_paths: vec![cache_dir.clone()],
        };
        let workspace = WorkspaceId::generate();
        resident
            .preload(cache_dir, workspace, "k".into(), Some((keys, walk)))
            .await;
        resident.settle().await;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !resident.has_status_memory() {
            assert!(std::time::Instant::now() < deadline, "no status was read");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let memory = resident.status_memory().unwrap();
        let app = &memory.repos[&b"app"[..]];
        assert_eq!(app.state.untracked, 1, "a.txt");
        assert!(
            resident
                .status_read_started
                .load(std::sync::atomic::Ordering::SeqCst)
        );
    }
}
