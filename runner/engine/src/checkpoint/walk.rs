//! The first stage of a checkpoint: BeginCheckpoint, and the walk of the
//! workspace beside it or after it ([`Recall::walk_beside_begin`]); the
//! repositories the walk finds are read on a thread of their own
//! ([`git::Inspector`]) while the later stages go on, and their readings
//! collected at the end ([`Repos::finish`]).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::recall::{Recall, RepoReading};
use super::remote::Session;
use super::upload::Spool;
use super::{CheckpointError, CheckpointOptions};
use crate::client::CoordinatorClient;
use crate::git::{self, Inspected};
use crate::gitobj::TreeCache;
use crate::scan::{RepoFound, Scan};
use crate::task::blocking;

/// What the walk starts from.
pub(crate) struct Walking<'a> {
    pub coordinator: &'a CoordinatorClient,
    pub opts: &'a CheckpointOptions,
    /// The root, resolved.
    pub root: &'a Path,
    /// The cache directory, canonical (left out of the walk).
    pub cache_dir: &'a Path,
    /// Whether the checkpoint may be settled from the walk alone.
    pub only_if_changed: bool,
    pub started: Instant,
}

/// The checkpoint begun and the workspace walked.
pub(crate) struct Walked {
    pub session: Session,
    /// Where this checkpoint's packs wait for their upload.
    pub spool: Spool,
    pub walk: Arc<Scan>,
    pub repos: Repos,
}

/// The reading of the repositories the walk found.
pub(crate) struct Repos {
    inspector: git::Inspector,
    reading: RepoReading,
    /// Repositories held until the end of the walk ([`RepoReading::AfterWalk`]).
    held: Vec<RepoFound>,
}

/// Begins the checkpoint and walks the workspace.
pub(crate) async fn walk(
    recall: &impl Recall,
    walking: Walking<'_>,
) -> Result<Walked, CheckpointError> {
    let Walking {
        coordinator,
        opts,
        root,
        cache_dir,
        only_if_changed,
        started,
    } = walking;
    let ms = || started.elapsed().as_millis() as u64;
    let scan_options = opts.scan_options(root, cache_dir);
    let reading = recall.repo_reading(only_if_changed);
    let scanning = {
        let recall = recall.clone();
        blocking(move || {
            let inspector = git::Inspector::start();
            let held = Mutex::new(Vec::new());
            let on_repo = |found| match reading {
                RepoReading::AfterWalk => held.lock().expect("held repos lock").push(found),
                RepoReading::AtOnceRemembered => inspector.submit_remembered(found),
                RepoReading::AtOnce => inspector.submit(found),
            };
            let scanned = recall.walk(&scan_options, &on_repo);
            let held = held.into_inner().expect("held repos lock");
            (scanned, inspector, held)
        })
    };
    let begin = Session::begin(coordinator, &opts.workspace, opts.generation);
    // (`scanning` starts when first polled.)
    let (session, (scanned, inspector, held)) = if recall.walk_beside_begin() {
        let (session, scanning) = tokio::join!(begin, scanning);
        (session?, scanning)
    } else {
        let session = begin.await?;
        (session, scanning.await)
    };
    let spool = Spool::create(cache_dir).map_err(|source| CheckpointError::CacheDir {
        path: opts.cache_dir.clone(),
        source,
    })?;
    tracing::debug!(elapsed_ms = ms(), "checkpoint begun");
    let (walk, scan_kind) = scanned?;
    tracing::debug!(
        files = walk.file_count(),
        directories = walk.dirs.len(),
        walk = ?scan_kind,
        elapsed_ms = ms(),
        "workspace scanned"
    );
    Ok(Walked {
        session,
        spool,
        walk,
        repos: Repos {
            inspector,
            reading,
            held,
        },
    })
}

impl Repos {
    /// Hands the repositories held until the end of the walk to the
    /// reader, each to be read for what changed since its last reading.
    pub async fn follow(mut self, recall: &impl Recall, walk: &Arc<Scan>) -> Self {
        if self.reading == RepoReading::AfterWalk {
            let memory = recall.repo_statuses().await;
            let memory = memory.filter(|memory| memory.walk.root == walk.root);
            for found in std::mem::take(&mut self.held) {
                self.inspector
                    .submit_following(found, memory.as_ref(), walk);
            }
        }
        self
    }

    /// The git trees the readings read, for the content stage.
    pub fn trees(&self) -> Arc<TreeCache> {
        self.inspector.trees()
    }

    /// Waits for every reading, and keeps them for the next checkpoint's.
    pub async fn finish(
        self,
        recall: &impl Recall,
        walk: &Arc<Scan>,
        started: Instant,
    ) -> Inspected {
        let inspector = self.inspector;
        let mut inspected = blocking(move || inspector.finish()).await;
        tracing::debug!(
            repos = inspected.repos.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "git state read"
        );
        recall.remember_statuses(git::StatusMemory {
            walk: walk.clone(),
            repos: std::mem::take(&mut inspected.statuses),
        });
        inspected
    }
}
