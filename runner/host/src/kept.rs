//! Workspaces the host keeps after their sandbox ended, for the next sandbox
//! of the same workspace on this host.
//!
//! ```text
//! sandbox of ws-A ends ─► its runner left DIR/sandboxes/<id>/cache/ws-A.fpcache?
//!                         (it restored or checkpointed ws-A)   no ─► removed as before
//!                         yes, no mount below, tree ≤ bound
//!    rename workspace/, cache/ ─► DIR/kept/.staging-<id>/ + kept.json
//!    rename ─► DIR/kept/ws-A/      (an older tree of ws-A moved aside)
//!    ── the sandbox is reported gone: the run goes on ──
//!    settle: the tree measured (too large: deleted), the older one
//!    deleted, oldest trees evicted until the total is within
//!    --kept-workspaces-size
//!
//! every heartbeat lists the workspaces in DIR/kept; the coordinator's
//! scheduler sends a queued run of one of them here while a slot is free
//!
//! next sandbox of ws-A ─► rename DIR/kept/ws-A/{workspace,cache}
//!                         onto its fresh, empty workspace/ and cache/
//!    the runner restores the newest checkpoint onto that tree: a file its
//!    fingerprint cache vouches for (same inode, size, mtime and ctime as
//!    when the runner hashed it) or that reads back as the checkpoint's is
//!    kept; everything else is written, and what the checkpoint lacks removed
//! ```
//!
//! Writing tens of thousands of files is most of a restore into an empty
//! directory, and the pack cache cannot save it; a kept tree can, with two
//! renames on the same file system. Keeping is renames too; measuring the
//! tree (a stat of every file) and deleting what the bounds exclude come
//! after the sandbox is reported gone ([`KeptWorkspaces::settle`]), so that
//! a suspend or a run's end does not wait for them. Keeping moves bytes
//! that were on the disk already: until the tree is settled the bound may
//! be exceeded by it, never by new data. The restore still checks every file
//! against the checkpoint, so a tree that changed after its last checkpoint
//! (a crash, a destroy mid-turn) comes back as the checkpoint, not as it was
//! left.
//!
//! A kept tree is plaintext, like the sandbox's workspace was; it stays under
//! the data directory (mode 0700), is handed only to a sandbox of the same
//! workspace, and is deleted when older than the age bound or evicted by the
//! size bound. Renames cannot cross file systems, so the kept trees live in
//! the data directory, next to the sandboxes.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cairn_proto::ids::WorkspaceId;
use serde::{Deserialize, Serialize};

use super::layout::{self, SandboxPaths};

/// The default bound of the kept trees' total disk use.
pub const DEFAULT_KEPT_SIZE: u64 = 10 << 30;
/// The default age after which a kept tree is deleted unused.
pub const DEFAULT_KEPT_FOR: Duration = Duration::from_secs(24 * 3600);

const RECORD: &str = "kept.json";
const STAGING_PREFIX: &str = ".staging-";

/// How much the host keeps, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptConfig {
    /// Bound of the kept trees' total disk use; a tree larger than this is
    /// never kept.
    pub max_bytes: u64,
    /// A tree not taken within this long is deleted.
    pub max_age: Duration,
}

impl Default for KeptConfig {
    fn default() -> Self {
        Self {
            max_bytes: DEFAULT_KEPT_SIZE,
            max_age: DEFAULT_KEPT_FOR,
        }
    }
}

/// Why a tree could not be kept or taken.
#[derive(Debug, thiserror::Error)]
pub enum KeptError {
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(transparent)]
    Layout(#[from] layout::LayoutError),
}

fn io_error<'p>(action: &'static str, path: &'p Path) -> impl FnOnce(io::Error) -> KeptError + 'p {
    move |source| KeptError::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

/// What became of an ended sandbox's tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keeping {
    /// Kept, to be settled ([`KeptWorkspaces::settle`]) once the sandbox
    /// was reported gone.
    Kept(KeptTree),
    /// Not kept, and why (the sandbox directory is removed as usual).
    Passed(String),
}

/// A tree just kept, not yet measured nor held to the bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptTree {
    workspace: WorkspaceId,
    kept_at_ns: u64,
    /// The older tree of the workspace it replaced, moved aside.
    replaced: Option<PathBuf>,
}

/// A kept tree a new sandbox took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    /// Its disk use; `None` when it was taken before it was settled.
    pub bytes: Option<u64>,
}

/// What settling a kept tree came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Within the bounds; its disk use.
    Kept { bytes: u64 },
    /// Deleted, and why.
    Deleted(String),
    /// A new sandbox of the workspace took it (or a newer tree replaced
    /// it) before it was settled.
    Gone,
}

/// A kept tree's record, written last into its directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct KeptRecord {
    workspace_id: WorkspaceId,
    /// Disk use of the tree (allocated blocks); `None` until it is settled.
    bytes: Option<u64>,
    /// Nanoseconds since the epoch when it was kept.
    kept_at_ns: u64,
}

/// The kept trees of one host (`DIR/kept`).
#[derive(Debug)]
pub struct KeptWorkspaces {
    dir: PathBuf,
    config: KeptConfig,
    /// Keeping, taking and evicting are renames and removals of whole
    /// directories; one at a time keeps the total and the records in step.
    lock: Mutex<()>,
}

impl KeptWorkspaces {
    /// Opens (creating, mode 0700) `dir`, clearing what an interrupted keep
    /// left, measuring trees a restart left unsettled, and deleting what is
    /// past the bounds.
    pub fn open(dir: PathBuf, config: KeptConfig) -> Result<Self, KeptError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(io_error("cannot create", &dir))?;
        let kept = Self {
            dir,
            config,
            lock: Mutex::new(()),
        };
        let _one_at_a_time = kept.lock.lock().unwrap_or_else(|e| e.into_inner());
        kept.evict_locked(None, true);
        drop(_one_at_a_time);
        Ok(kept)
    }

    #[cfg(test)]
    fn dir(&self) -> &Path {
        &self.dir
    }

    fn entry_dir(&self, workspace: &WorkspaceId) -> PathBuf {
        self.dir.join(workspace.as_str())
    }

    /// Keeps the tree of an ended sandbox of `workspace`, moving its
    /// `workspace/` and `cache/` out of `sandbox`: renames only. The caller
    /// removes what is left of the sandbox directory either way, and
    /// settles a kept tree once the sandbox is reported gone.
    pub fn keep(
        &self,
        workspace: &WorkspaceId,
        sandbox_id: &str,
        sandbox: &SandboxPaths,
    ) -> Result<Keeping, KeptError> {
        // Only a tree the runner restored or checkpointed: it left its
        // fingerprint cache, and the workspace has a checkpoint to restore
        // onto the tree.
        let fingerprints =
            cairn_engine::cache::FingerprintCache::path_for(&sandbox.cache, workspace);
        if !fingerprints.is_file() {
            return Ok(Keeping::Passed(
                "its runner restored and checkpointed nothing".to_owned(),
            ));
        }
        if let Some(mount) = layout::mount_below(&sandbox.dir) {
            return Ok(Keeping::Passed(format!(
                "{} is mounted inside it",
                mount.display()
            )));
        }
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let staging = self.dir.join(format!("{STAGING_PREFIX}{sandbox_id}"));
        let record = KeptRecord {
            workspace_id: workspace.clone(),
            bytes: None,
            kept_at_ns: unix_now_ns(),
        };
        if let Err(e) = self.stage(&staging, sandbox, &record) {
            // Half a staged tree is no use to anyone, and it is plaintext.
            if let Err(e) = layout::remove_tree(&staging) {
                tracing::warn!(error = %e, "cannot remove a half-kept tree");
            }
            return Err(e);
        }
        let entry = self.entry_dir(workspace);
        // An older tree of the same workspace gives way to the newer one:
        // moved aside now, deleted when the new one is settled (or by the
        // next look at the kept trees, as a staging leftover).
        let replaced = match fs::symlink_metadata(&entry) {
            Ok(_) => {
                let aside = self
                    .dir
                    .join(format!("{STAGING_PREFIX}replaced-{sandbox_id}"));
                layout::remove_tree(&aside)?;
                fs::rename(&entry, &aside).map_err(io_error("cannot move aside", &entry))?;
                Some(aside)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_error("cannot inspect", &entry)(e)),
        };
        fs::rename(&staging, &entry).map_err(io_error("cannot rename", &staging))?;
        Ok(Keeping::Kept(KeptTree {
            workspace: workspace.clone(),
            kept_at_ns: record.kept_at_ns,
            replaced,
        }))
    }

    /// Measures a tree just kept and holds it to the bounds: deletes the
    /// tree it replaced, the tree itself if it is larger than the size
    /// bound, else the oldest others until the total is within it.
    pub fn settle(&self, tree: KeptTree) -> Result<Settled, KeptError> {
        // A failure leaves it to the next look at the kept trees, which
        // deletes staging leftovers; this tree is settled all the same.
        if let Some(replaced) = &tree.replaced
            && let Err(e) = layout::remove_tree(replaced)
        {
            tracing::warn!(error = %e, "cannot delete the kept tree a newer one replaced");
        }
        let entry = self.entry_dir(&tree.workspace);
        // Without the lock: a stat of every file. A sandbox that takes the
        // tree meanwhile makes the walk fail or the record go.
        let measured = disk_use(&entry);
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut record = match read_record(&entry) {
            Ok(Some(record)) if record.kept_at_ns == tree.kept_at_ns => record,
            _ => return Ok(Settled::Gone),
        };
        let bytes = measured?;
        if bytes > self.config.max_bytes {
            layout::remove_tree(&entry)?;
            return Ok(Settled::Deleted(format!(
                "it uses {}, more than the bound of {}",
                cairn_proto::size::human_bytes(bytes),
                cairn_proto::size::human_bytes(self.config.max_bytes)
            )));
        }
        record.bytes = Some(bytes);
        write_record(&entry, &record)?;
        self.evict_locked(Some(&tree.workspace), false);
        Ok(Settled::Kept { bytes })
    }

    /// Moves the sandbox's tree and cache into `staging`, record last.
    fn stage(
        &self,
        staging: &Path,
        sandbox: &SandboxPaths,
        record: &KeptRecord,
    ) -> Result<(), KeptError> {
        layout::remove_tree(staging)?;
        fs::DirBuilder::new()
            .mode(0o700)
            .create(staging)
            .map_err(io_error("cannot create", staging))?;
        for (from, name) in [(&sandbox.workspace, "workspace"), (&sandbox.cache, "cache")] {
            let to = staging.join(name);
            fs::rename(from, &to).map_err(io_error("cannot move into the kept trees", from))?;
        }
        write_record(staging, record)
    }

    /// Moves the kept tree of `workspace`, if there is one, onto the fresh
    /// and empty `workspace/` and `cache/` of `sandbox`.
    pub fn take(
        &self,
        workspace: &WorkspaceId,
        sandbox: &SandboxPaths,
    ) -> Result<Option<Taken>, KeptError> {
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let entry = self.entry_dir(workspace);
        let record = match read_record(&entry) {
            Ok(Some(record)) => record,
            Ok(None) => return Ok(None),
            Err(reason) => {
                tracing::warn!(entry = %entry.display(), %reason, "dropping an unreadable kept tree");
                layout::remove_tree(&entry)?;
                return Ok(None);
            }
        };
        if record.workspace_id != *workspace || self.expired(&record) {
            layout::remove_tree(&entry)?;
            return Ok(None);
        }
        for (name, to) in [("workspace", &sandbox.workspace), ("cache", &sandbox.cache)] {
            let from = entry.join(name);
            // rename(2) replaces an empty directory.
            if let Err(e) = fs::rename(&from, to) {
                // What did not move is of no use to a later sandbox either.
                if let Err(e) = layout::remove_tree(&entry) {
                    tracing::warn!(error = %e, "cannot remove a half-taken kept tree");
                }
                return Err(io_error("cannot take the kept tree", &from)(e));
            }
        }
        layout::remove_tree(&entry)?;
        Ok(Some(Taken {
            bytes: record.bytes,
        }))
    }

    /// The workspaces a tree is kept for, for the coordinator to send their
    /// runs here. A listing error lists nothing (and is logged).
    pub fn workspaces(&self) -> Vec<WorkspaceId> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot list the kept trees");
                return Vec::new();
            }
        };
        entries
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
            .collect()
    }

    /// Deletes trees past the age bound, then the oldest until the total is
    /// within the size bound. Failures are logged: they leave a tree behind,
    /// which the next prune tries again.
    pub fn prune(&self) {
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.evict_locked(None, false);
    }

    /// `measure_unsettled`: trees kept but never settled (a restart came
    /// between) are measured first; otherwise one that is being settled
    /// counts as nothing until it is.
    fn evict_locked(&self, newest: Option<&WorkspaceId>, measure_unsettled: bool) {
        let mut entries = match self.entries() {
            Ok(entries) => entries,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the kept trees");
                return;
            }
        };
        // Oldest first; the tree just kept goes last, whatever its clock says.
        entries.sort_by_key(|(_, record)| {
            (
                newest.is_some_and(|w| *w == record.workspace_id),
                record.kept_at_ns,
            )
        });
        if measure_unsettled {
            for (path, record) in &mut entries {
                if record.bytes.is_some() {
                    continue;
                }
                match disk_use(path) {
                    Ok(bytes) => {
                        record.bytes = Some(bytes);
                        if let Err(e) = write_record(path, record) {
                            tracing::warn!(error = %e, "cannot record a kept tree's size");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot measure a kept tree"),
                }
            }
        }
        let mut total: u64 = entries.iter().filter_map(|(_, r)| r.bytes).sum();
        for (path, record) in entries {
            let expired = self.expired(&record);
            if !expired && total <= self.config.max_bytes {
                continue;
            }
            match layout::remove_tree(&path) {
                Ok(()) => {
                    total -= record.bytes.unwrap_or(0);
                    tracing::info!(
                        workspace = %record.workspace_id,
                        reason = if expired { "older than the age bound" } else { "over the size bound" },
                        "deleted a kept workspace tree"
                    );
                }
                Err(e) => tracing::warn!(error = %e, "cannot delete a kept workspace tree"),
            }
        }
    }

    /// Every kept tree with its record. Called with the lock held, so a
    /// staging directory is what a keep interrupted by a crash left; it is
    /// deleted, as is an entry without a readable record (not a kept tree).
    fn entries(&self) -> Result<Vec<(PathBuf, KeptRecord)>, KeptError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_error("cannot list", &self.dir))? {
            let entry = entry.map_err(io_error("cannot list", &self.dir))?;
            let path = entry.path();
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(STAGING_PREFIX)
            {
                layout::remove_tree(&path)?;
                continue;
            }
            match read_record(&path) {
                Ok(Some(record)) => out.push((path, record)),
                Ok(None) | Err(_) => {
                    tracing::warn!(entry = %path.display(), "deleting what is not a kept tree");
                    layout::remove_tree(&path)?;
                }
            }
        }
        Ok(out)
    }

    fn expired(&self, record: &KeptRecord) -> bool {
        let age = Duration::from_nanos(unix_now_ns().saturating_sub(record.kept_at_ns));
        age > self.config.max_age
    }
}

/// Writes `record` into the tree at `entry`, whole or not at all.
fn write_record(entry: &Path, record: &KeptRecord) -> Result<(), KeptError> {
    let path = entry.join(RECORD);
    let partial = entry.join(format!("{RECORD}.partial"));
    fs::write(
        &partial,
        serde_json::to_vec(record).expect("a record always serialises"),
    )
    .map_err(io_error("cannot write", &partial))?;
    fs::rename(&partial, &path).map_err(io_error("cannot write", &path))
}

fn read_record(entry: &Path) -> Result<Option<KeptRecord>, String> {
    let path = entry.join(RECORD);
    match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound && !entry.exists() => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

fn unix_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The blocks allocated below `dir`, never following a symlink.
fn disk_use(dir: &Path) -> Result<u64, KeptError> {
    let mut total = 0u64;
    let mut pending = vec![dir.to_owned()];
    while let Some(dir) = pending.pop() {
        let meta = fs::symlink_metadata(&dir).map_err(io_error("cannot inspect", &dir))?;
        total += meta.blocks() * 512;
        for entry in fs::read_dir(&dir).map_err(io_error("cannot list", &dir))? {
            let entry = entry.map_err(io_error("cannot list", &dir))?;
            let path = entry.path();
            let meta = fs::symlink_metadata(&path).map_err(io_error("cannot inspect", &path))?;
            if meta.is_dir() {
                pending.push(path);
            } else {
                total += meta.blocks() * 512;
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Host {
        _tmp: tempfile::TempDir,
        layout: layout::Layout,
        kept: KeptWorkspaces,
    }

    fn host(config: KeptConfig) -> Host {
        let tmp = tempfile::tempdir().unwrap();
        let layout = layout::Layout::open(tmp.path()).unwrap();
        let kept = KeptWorkspaces::open(tmp.path().join("kept"), config).unwrap();
        Host {
            _tmp: tmp,
            layout,
            kept,
        }
    }

    /// A sandbox of `workspace` whose runner left a fingerprint cache (when
    /// `checkpointed`) and `files` in its workspace.
    fn ended_sandbox(
        host: &Host,
        id: &str,
        workspace: &WorkspaceId,
        checkpointed: bool,
        files: &[(&str, &str)],
    ) -> SandboxPaths {
        let paths = host.layout.create_sandbox_dirs(id).unwrap();
        for (name, text) in files {
            let path = paths.workspace.join(name);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
        if checkpointed {
            fs::write(
                cairn_engine::cache::FingerprintCache::path_for(&paths.cache, workspace),
                "x",
            )
            .unwrap();
        }
        paths
    }

    /// Keeps the tree of `paths` and settles it, as a sandbox's end does.
    fn keep_settled(
        kept: &KeptWorkspaces,
        workspace: &WorkspaceId,
        sandbox_id: &str,
        paths: &SandboxPaths,
    ) -> Settled {
        match kept.keep(workspace, sandbox_id, paths).unwrap() {
            Keeping::Kept(tree) => kept.settle(tree).unwrap(),
            Keeping::Passed(reason) => panic!("not kept: {reason}"),
        }
    }

    fn read(dir: &Path, name: &str) -> Option<String> {
        fs::read_to_string(dir.join(name)).ok()
    }

    #[test]
    fn the_next_sandbox_of_the_workspace_takes_the_tree_another_one_gets_nothing() {
        let host = host(KeptConfig::default());
        let (a, b) = (WorkspaceId::generate(), WorkspaceId::generate());
        let ended = ended_sandbox(&host, "sbx-1", &a, true, &[("src/main.rs", "fn main() {}")]);
        let Settled::Kept { bytes } = keep_settled(&host.kept, &a, "sbx-1", &ended) else {
            panic!("not kept")
        };
        assert!(bytes > 0);
        assert!(
            !ended.workspace.exists() && !ended.cache.exists(),
            "moved, not copied"
        );

        let other = host.layout.create_sandbox_dirs("sbx-2").unwrap();
        assert_eq!(
            host.kept.take(&b, &other).unwrap(),
            None,
            "another workspace's"
        );
        assert_eq!(fs::read_dir(&other.workspace).unwrap().count(), 0);

        let newer = ended_sandbox(
            &host,
            "sbx-5",
            &a,
            true,
            &[("src/main.rs", "fn main() { 2 }")],
        );
        // Kept before it is settled: the heartbeat lists it, and the older
        // tree is gone from the listing at once.
        let Keeping::Kept(tree) = host.kept.keep(&a, "sbx-5", &newer).unwrap() else {
            panic!("not kept")
        };
        assert_eq!(host.kept.workspaces(), vec![a.clone()]);
        let Settled::Kept { bytes } = host.kept.settle(tree).unwrap() else {
            panic!("not kept")
        };
        assert_eq!(
            host.kept.workspaces(),
            vec![a.clone()],
            "what the heartbeat lists"
        );
        let next = host.layout.create_sandbox_dirs("sbx-3").unwrap();
        assert_eq!(
            host.kept.take(&a, &next).unwrap(),
            Some(Taken { bytes: Some(bytes) })
        );
        assert!(host.kept.workspaces().is_empty());
        assert_eq!(
            read(&next.workspace, "src/main.rs").as_deref(),
            Some("fn main() { 2 }"),
            "the newer tree replaced the older one"
        );
        assert!(cairn_engine::cache::FingerprintCache::path_for(&next.cache, &a).is_file());
        let again = host.layout.create_sandbox_dirs("sbx-4").unwrap();
        assert_eq!(host.kept.take(&a, &again).unwrap(), None, "taken once");
    }

    #[test]
    fn a_tree_that_cannot_be_taken_whole_is_dropped_with_the_cause() {
        let host = host(KeptConfig::default());
        let ws = WorkspaceId::generate();
        let ended = ended_sandbox(&host, "sbx-1", &ws, true, &[("f", "x")]);
        keep_settled(&host.kept, &ws, "sbx-1", &ended);
        let next = host.layout.create_sandbox_dirs("sbx-2").unwrap();
        // The cache cannot replace a directory that is not empty.
        fs::write(next.cache.join("in-the-way"), "x").unwrap();
        let err = host.kept.take(&ws, &next).unwrap_err();
        assert!(
            err.to_string().contains("cannot take the kept tree"),
            "{err}"
        );
        assert_eq!(host.kept.take(&ws, &next).unwrap(), None, "dropped");
        assert!(host.kept.workspaces().is_empty());
    }

    #[test]
    fn a_tree_the_runner_never_restored_or_checkpointed_is_not_kept() {
        let host = host(KeptConfig::default());
        let ws = WorkspaceId::generate();
        let ended = ended_sandbox(&host, "sbx-1", &ws, false, &[("f", "x")]);
        assert!(matches!(
            host.kept.keep(&ws, "sbx-1", &ended).unwrap(),
            Keeping::Passed(reason) if reason.contains("nothing")
        ));
        assert!(
            ended.workspace.join("f").exists(),
            "left for the usual removal"
        );
        let next = host.layout.create_sandbox_dirs("sbx-2").unwrap();
        assert_eq!(host.kept.take(&ws, &next).unwrap(), None);
    }

    #[test]
    fn the_size_bound_evicts_the_oldest_tree_and_refuses_a_tree_larger_than_itself() {
        let big = "x".repeat(64 << 10);
        let probe = host(KeptConfig::default());
        let ws = WorkspaceId::generate();
        let one = ended_sandbox(&probe, "sbx-p", &ws, true, &[("big", &big)]);
        let Settled::Kept { bytes: one_tree } = keep_settled(&probe.kept, &ws, "sbx-p", &one)
        else {
            panic!("not kept")
        };

        // Room for two trees of this size, not three.
        let host = host(KeptConfig {
            max_bytes: one_tree * 2 + one_tree / 2,
            ..KeptConfig::default()
        });
        let ids: Vec<WorkspaceId> = (0..3).map(|_| WorkspaceId::generate()).collect();
        let first = ended_sandbox(&host, "sbx-1", &ids[0], true, &[("big", &big)]);
        keep_settled(&host.kept, &ids[0], "sbx-1", &first);
        let second = ended_sandbox(&host, "sbx-3", &ids[1], true, &[("big", &big)]);
        keep_settled(&host.kept, &ids[1], "sbx-3", &second);
        let third = ended_sandbox(&host, "sbx-4", &ids[2], true, &[("big", &big)]);
        keep_settled(&host.kept, &ids[2], "sbx-4", &third);

        let taken: Vec<bool> = ids
            .iter()
            .enumerate()
            .map(|(i, ws)| {
                let next = host
                    .layout
                    .create_sandbox_dirs(&format!("sbx-n{i}"))
                    .unwrap();
                host.kept.take(ws, &next).unwrap().is_some()
            })
            .collect();
        assert_eq!(
            taken,
            vec![false, true, true],
            "the oldest tree was evicted"
        );

        let small = host.layout.create_sandbox_dirs("sbx-5").unwrap();
        let tiny = KeptConfig {
            max_bytes: 1,
            ..KeptConfig::default()
        };
        let strict = KeptWorkspaces::open(host.kept.dir().join("../kept-strict"), tiny).unwrap();
        fs::write(small.workspace.join("f"), "x").unwrap();
        fs::write(
            cairn_engine::cache::FingerprintCache::path_for(&small.cache, &ids[0]),
            "x",
        )
        .unwrap();
        assert!(matches!(
            keep_settled(&strict, &ids[0], "sbx-5", &small),
            Settled::Deleted(reason) if reason.contains("more than the bound")
        ));
        assert!(strict.workspaces().is_empty());
    }

    #[test]
    fn a_tree_taken_before_it_is_settled_is_left_to_its_taker() {
        let host = host(KeptConfig::default());
        let ws = WorkspaceId::generate();
        let ended = ended_sandbox(&host, "sbx-1", &ws, true, &[("f", "x")]);
        let Keeping::Kept(tree) = host.kept.keep(&ws, "sbx-1", &ended).unwrap() else {
            panic!("not kept")
        };
        let next = host.layout.create_sandbox_dirs("sbx-2").unwrap();
        assert_eq!(
            host.kept.take(&ws, &next).unwrap(),
            Some(Taken { bytes: None }),
            "taken before it was measured"
        );
        assert_eq!(host.kept.settle(tree).unwrap(), Settled::Gone);
        assert_eq!(read(&next.workspace, "f").as_deref(), Some("x"));
    }

    #[test]
    fn a_tree_a_restart_left_unsettled_is_measured_when_the_host_opens_again() {
        let probe = host(KeptConfig::default());
        let big = "x".repeat(64 << 10);
        let ws = WorkspaceId::generate();
        let ended = ended_sandbox(&probe, "sbx-1", &ws, true, &[("big", &big)]);
        // Kept, then the host stopped before settling it.
        let Keeping::Kept(_) = probe.kept.keep(&ws, "sbx-1", &ended).unwrap() else {
            panic!("not kept")
        };
        let reopened = KeptWorkspaces::open(
            probe.kept.dir().to_owned(),
            KeptConfig {
                max_bytes: 1,
                ..KeptConfig::default()
            },
        )
        .unwrap();
        assert!(
            reopened.workspaces().is_empty(),
            "measured, and over the bound"
        );
    }

    #[test]
    fn trees_past_the_age_bound_and_interrupted_keeps_are_deleted() {
        let host = host(KeptConfig::default());
        let ws = WorkspaceId::generate();
        let ended = ended_sandbox(&host, "sbx-1", &ws, true, &[("f", "x")]);
        keep_settled(&host.kept, &ws, "sbx-1", &ended);
        // A keep cut short by a crash, and a tree kept two days ago.
        fs::create_dir_all(host.kept.dir().join(".staging-sbx-9/workspace")).unwrap();
        let record_path = host.kept.dir().join(ws.as_str()).join(RECORD);
        let mut record: KeptRecord =
            serde_json::from_slice(&fs::read(&record_path).unwrap()).unwrap();
        record.kept_at_ns -= 2 * 24 * 3600 * 1_000_000_000;
        fs::write(&record_path, serde_json::to_vec(&record).unwrap()).unwrap();

        let reopened =
            KeptWorkspaces::open(host.kept.dir().to_owned(), KeptConfig::default()).unwrap();
        assert_eq!(fs::read_dir(reopened.dir()).unwrap().count(), 0);
        let next = host.layout.create_sandbox_dirs("sbx-2").unwrap();
        assert_eq!(reopened.take(&ws, &next).unwrap(), None);
    }
}
