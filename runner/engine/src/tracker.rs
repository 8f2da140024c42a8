//! Change tracking: which directories changed since the last walk, so an
//! incremental checkpoint lists only those instead of the whole workspace.
//!
//! A [`ChangeTracker`] watches the root with inotify (through `notify`) and
//! keeps the set of *dirty* directories: the parent of every path an event
//! names (its entry there changed) and the path itself (if it is a
//! directory, its listing changed). [`ChangeTracker::scan`] then hands the
//! dirty set and the previous walk to [`scan::rescan`], which lists those
//! directories again, and every new one.
//!
//! An event that only writes to an entry or changes its attributes
//! (IN_MODIFY, IN_ATTRIB) leaves the names in its directory as they were:
//! that entry is stat'ed again in the previous listing, and the directory
//! is listed again only if the entry is no longer what it was (gone, of
//! another kind, or never listed). A directory listed again also has its
//! own entry in its parent's listing stat'ed again: a new or removed entry
//! moves the directory's mtime, and no event says so. So a partial walk
//! equals a full walk of the same tree.
//!
//! It falls back to a full walk, and says why in the log, when:
//! - there is no previous walk yet (the first checkpoint of a process);
//! - the kernel dropped events (queue overflow) or the watcher reported an
//!   error (e.g. the inotify watch limit was reached);
//! - git's ignore rules are in force (`skip_ignored`, see [`scan::rescan`]);
//! - the last full walk is older than the full-scan interval, a guard
//!   against events that never came.
//!
//! The watcher starts before the first walk, so a change made while that
//! walk runs is still in the next dirty set. Taking the set and walking are
//! not atomic; a change in between is seen by this walk and named again in
//! the next set, which costs one listing, never a miss.
//!
//! Events reach the dirty set through notify's own thread, a little after
//! the write that caused them: a checkpoint asked for the moment an agent's
//! turn ends could take the set before the turn's last events are in it.
//! So before taking it, the tracker syncs, as watchman does: it creates and
//! removes a cookie file in the root (`.cairn-sync-*`, which walks never
//! list) and waits until the watcher reports it. The kernel queues events in
//! order, so every change made before the cookie is in the set by then. A
//! cookie that is not reported in time makes the walk a full one.

use std::collections::HashSet;
use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use notify::event::ModifyKind;
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};

use crate::scan::{
    self, NodeKind, RepoFound, SYNC_COOKIE_PREFIX, Scan, ScanError, ScanOptions, Touched,
    is_sync_cookie,
};

/// Full walks at least this often, whatever the events say.
pub const DEFAULT_FULL_SCAN_INTERVAL: Duration = Duration::from_secs(30 * 60);

/// How long a sync waits for its cookie to be reported.
const SYNC_TIMEOUT: Duration = Duration::from_secs(2);

/// Why change tracking could not start.
#[derive(Debug, thiserror::Error)]
pub enum TrackerError {
    #[error(transparent)]
    Root(#[from] ScanError),
    #[error("cannot watch {root} for changes: {source}")]
    Watch {
        root: PathBuf,
        source: notify::Error,
    },
}

/// How a walk was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanKind {
    /// Every directory was listed, for this reason.
    Full { reason: String },
    /// Only these many changed directories were listed.
    Partial { dirty: usize },
}

#[derive(Debug, Default)]
struct Pending {
    /// Directories whose entries may have changed: listed again.
    dirty: HashSet<Vec<u8>>,
    /// Per directory, entries whose content or attributes changed, not the
    /// directory's entries: only those are stat'ed again.
    touched: Touched,
    /// Events were lost; the next walk must be full. Says why.
    lost: Option<String>,
    /// Sync cookies the watcher has reported.
    cookies: HashSet<OsString>,
}

/// The dirty set, and a condition signalled when a cookie is reported.
type Shared = (Mutex<Pending>, Condvar);

/// How a sync before a walk went.
enum Synced {
    Yes,
    /// The cookie could not be made (a read-only root, say): nothing can
    /// change there through this process either, so the events stand.
    CannotWrite(std::io::Error),
    TimedOut,
}

/// Watches a workspace and makes walks that list only what changed.
pub struct ChangeTracker {
    root: PathBuf,
    pending: Arc<Shared>,
    previous: Mutex<Option<(Arc<Scan>, Instant)>>,
    /// Held for a whole walk: two walks at once would each take part of
    /// the changes and build on the same previous walk.
    walking: Mutex<()>,
    full_scan_interval: Duration,
    // Dropping the watcher stops the events.
    _watcher: RecommendedWatcher,
}

impl std::fmt::Debug for ChangeTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangeTracker")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl ChangeTracker {
    /// Starts watching `root` and everything below it.
    pub fn start(root: &Path, full_scan_interval: Duration) -> Result<Self, TrackerError> {
        let root = scan::resolve_root(root)?;
        let pending: Arc<Shared> = Arc::default();
        let handler = {
            let pending = pending.clone();
            let root = root.clone();
            move |event: notify::Result<notify::Event>| {
                let (lock, cookie_seen) = &*pending;
                let mut pending = lock.lock().expect("pending lock");
                match event {
                    Ok(event) if event.need_rescan() => {
                        pending.lost = Some("the kernel dropped change events".into());
                    }
                    Ok(event) => {
                        if matches!(event.kind, EventKind::Access(_)) {
                            return;
                        }
                        // A write or an attribute change leaves the names in
                        // a directory as they are.
                        let in_place = matches!(
                            event.kind,
                            EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Metadata(_))
                        );
                        for path in &event.paths {
                            if let Some(cookie) = sync_cookie(&root, path) {
                                pending.cookies.insert(cookie.to_owned());
                                cookie_seen.notify_all();
                                continue;
                            }
                            if in_place {
                                touch(&mut pending, &root, path);
                            } else {
                                mark(&mut pending.dirty, &root, path);
                            }
                        }
                    }
                    Err(e) => {
                        pending.lost = Some(format!("the change watcher failed: {e}"));
                    }
                }
            }
        };
        let watch_error = |source| TrackerError::Watch {
            root: root.clone(),
            source,
        };
        let config = notify::Config::default().with_follow_symlinks(false);
        let mut watcher = RecommendedWatcher::new(handler, config).map_err(watch_error)?;
        watcher
            .watch(&root, RecursiveMode::Recursive)
            .map_err(watch_error)?;
        Ok(Self {
            root,
            pending,
            previous: Mutex::new(None),
            walking: Mutex::new(()),
            full_scan_interval,
            _watcher: watcher,
        })
    }

    /// Walks the workspace, listing only what changed when it can. The walk
    /// is kept (shared, not copied) as the base of the next one.
    pub fn scan(
        &self,
        opts: &ScanOptions,
        on_repo: &(dyn Fn(RepoFound) + Sync),
    ) -> Result<(Arc<Scan>, ScanKind), ScanError> {
        let _walking = self.walking.lock().expect("walking lock");
        let unsynced = match self.sync() {
            Synced::Yes => None,
            Synced::CannotWrite(e) => {
                tracing::debug!(error = %e, root = %self.root.display(), "cannot write a sync cookie; walking on the events seen so far");
                None
            }
            Synced::TimedOut => Some(format!(
                "the change watcher did not report a sync within {SYNC_TIMEOUT:?}"
            )),
        };
        let Pending {
            mut dirty,
            mut touched,
            lost,
            ..
        } = std::mem::take(&mut *self.pending.0.lock().expect("pending lock"));
        // The walk leaves excluded paths out, so what happens there (the
        // runner's own cache written after a commit, when it lies inside
        // the root) changes nothing the walk would find.
        let excluded = excluded_below(&self.root, &opts.exclude_paths);
        if !excluded.is_empty() {
            dirty.retain(|dir| !is_at_or_below_any(dir, &excluded));
            touched.retain(|dir, names| {
                if is_at_or_below_any(dir, &excluded) {
                    return false;
                }
                names.retain(|name| !is_at_or_below_any(&scan::join_rel(dir, name), &excluded));
                !names.is_empty()
            });
        }
        let lost = lost.or(unsynced);
        let previous = self.previous.lock().expect("previous lock").clone();
        let full_reason = match &previous {
            None => Some("first walk".to_owned()),
            Some(_) if opts.skip_ignored => Some("git's ignore rules are in force".to_owned()),
            Some(_) if lost.is_some() => lost,
            Some((scan, _)) if scan.root != self.root => Some("another root".to_owned()),
            Some((_, at)) if at.elapsed() >= self.full_scan_interval => {
                Some("the periodic full walk is due".to_owned())
            }
            Some(_) => None,
        };
        let (scan, kind, full_at) = match (full_reason, previous) {
            (None, Some((previous, _))) if dirty.is_empty() && touched.is_empty() => {
                // Nothing changed: the same walk again, shared, not rebuilt.
                scan::announce_repos(&previous, on_repo);
                return Ok((previous, ScanKind::Partial { dirty: 0 }));
            }
            (None, Some((previous, full_at))) => {
                let scan = scan::rescan(opts, &previous, &dirty, &touched, on_repo)?;
                let kind = ScanKind::Partial {
                    dirty: dirty.len() + touched.len(),
                };
                (scan, kind, full_at)
            }
            (reason, _) => {
                let reason = reason.unwrap_or_default();
                tracing::info!(root = %self.root.display(), %reason, "walking the whole workspace");
                let scan = scan::scan(opts, on_repo)?;
                (scan, ScanKind::Full { reason }, Instant::now())
            }
        };
        let scan = Arc::new(scan);
        *self.previous.lock().expect("previous lock") = Some((scan.clone(), full_at));
        Ok((scan, kind))
    }

    /// What the workspace holds that the last walk did not, as the events
    /// since then tell it, without taking them (the next walk still lists
    /// them): the files new, changed or removed, and the bytes of those
    /// that exist. Stops counting after `at_most` entries (then the figures
    /// are a floor). `None` when it cannot tell: no walk yet, events were
    /// lost, or a walk is under way (it is about to take the changes).
    pub fn unsaved(&self, opts: &ScanOptions, at_most: usize) -> Option<Unsaved> {
        let patterns = scan::exclude_matcher(&self.root, &opts.excludes).ok()?;
        // Held while syncing: a walk's own sync must not lose its cookie.
        let Ok(_walking) = self.walking.try_lock() else {
            return None;
        };
        // Changes made up to now are in the pending sets once it returns
        // (else the count is a little behind; it is an estimate).
        let _ = self.sync();
        let (previous, _) = self.previous.lock().expect("previous lock").clone()?;
        let (dirty, touched) = {
            let pending = self.pending.0.lock().expect("pending lock");
            if pending.lost.is_some() {
                return None;
            }
            (pending.dirty.clone(), pending.touched.clone())
        };
        let excluded = excluded_below(&self.root, &opts.exclude_paths);
        let mut count = UnsavedCount {
            root: &self.root,
            previous: &previous,
            excluded: &excluded,
            patterns: patterns.as_ref(),
            dirty: &dirty,
            left: at_most,
            unsaved: Unsaved {
                complete: true,
                ..Unsaved::default()
            },
        };
        for (dir, names) in &touched {
            if dirty.contains(dir) {
                // Listed again below, these names with it.
                continue;
            }
            let listing = previous.listing(dir);
            for name in names {
                let rel = scan::join_rel(dir, name);
                let before = listing.and_then(|l| l.node(name));
                if count.entry(&rel, before).is_none() {
                    return Some(count.unsaved);
                }
            }
        }
        let mut dirs: Vec<&Vec<u8>> = dirty.iter().collect();
        dirs.sort();
        for dir in dirs {
            if !count.dir(dir) {
                break;
            }
        }
        Some(count.unsaved)
    }

    /// Makes a cookie in the root and waits until the watcher reports it:
    /// every event queued before it has then been handled.
    fn sync(&self) -> Synced {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = OsString::from(format!(
            "{SYNC_COOKIE_PREFIX}{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let path = self.root.join(&name);
        if let Err(e) = std::fs::File::create(&path) {
            return Synced::CannotWrite(e);
        }
        let _ = std::fs::remove_file(&path);
        let (lock, cookie_seen) = &*self.pending;
        let pending = lock.lock().expect("pending lock");
        let (mut pending, waited) = cookie_seen
            .wait_timeout_while(pending, SYNC_TIMEOUT, |p| !p.cookies.contains(&name))
            .expect("pending lock");
        // Its removal may be reported later; later cookies have other names.
        pending.cookies.clear();
        if waited.timed_out() {
            Synced::TimedOut
        } else {
            Synced::Yes
        }
    }
}

/// What a workspace holds that no walk (so no checkpoint) has yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unsaved {
    /// Files (and symlinks) new, changed or removed.
    pub files: u64,
    /// The bytes of those that exist now.
    pub bytes: u64,
    /// Every change was counted (else the figures are a floor).
    pub complete: bool,
}

/// The state of one [`ChangeTracker::unsaved`] count.
struct UnsavedCount<'a> {
    root: &'a Path,
    previous: &'a Scan,
    excluded: &'a [&'a Path],
    /// The `--exclude` patterns, if any.
    patterns: Option<&'a ignore::gitignore::Gitignore>,
    dirty: &'a HashSet<Vec<u8>>,
    /// Entries still to look at before the count stops.
    left: usize,
    unsaved: Unsaved,
}

impl UnsavedCount<'_> {
    /// Whether no walk lists `rel`: an excluded path, or matched (it or a
    /// directory above it) by an `--exclude` pattern.
    fn is_excluded(&self, rel: &[u8], is_dir: bool) -> bool {
        is_at_or_below_any(rel, self.excluded)
            || self.patterns.is_some_and(|patterns| {
                patterns
                    .matched_path_or_any_parents(
                        Path::new(std::ffi::OsStr::from_bytes(rel)),
                        is_dir,
                    )
                    .is_ignore()
            })
    }

    /// Counts the entry at `rel` if it is not what the walk found
    /// (`before`). Returns whether it is a directory now (counted through
    /// its own listing), or `None` once the bound is reached.
    fn entry(&mut self, rel: &[u8], before: Option<&scan::Node>) -> Option<bool> {
        if self.left == 0 {
            self.unsaved.complete = false;
            return None;
        }
        self.left -= 1;
        if self.is_excluded(rel, false) {
            return Some(false);
        }
        let path = self.root.join(std::ffi::OsStr::from_bytes(rel));
        let meta = std::fs::symlink_metadata(&path);
        let is_dir = meta.as_ref().is_ok_and(std::fs::Metadata::is_dir);
        match meta {
            Ok(meta) if meta.is_file() => {
                let now = crate::cache::Fingerprint::of(&meta);
                if !matches!(before, Some(scan::Node { kind: NodeKind::File(was), .. }) if *was == now)
                {
                    self.unsaved.files += 1;
                    self.unsaved.bytes += meta.len();
                }
            }
            Ok(meta) if meta.file_type().is_symlink() => {
                let target = std::fs::read_link(&path).ok();
                let same = matches!(
                    (before, &target),
                    (Some(scan::Node { kind: NodeKind::Symlink(was), .. }), Some(now))
                        if was[..] == *now.as_os_str().as_bytes()
                );
                if !same {
                    self.unsaved.files += 1;
                }
            }
            // A directory is counted through its own listing.
            Ok(_) => {}
            // Gone: a file the walk had is removed.
            Err(_) => {
                if matches!(
                    before,
                    Some(scan::Node {
                        kind: NodeKind::File(_) | NodeKind::Symlink(_),
                        ..
                    })
                ) {
                    self.unsaved.files += 1;
                }
            }
        }
        Some(is_dir)
    }

    /// Counts what changed in the directory at `rel` against its listing
    /// in the walk, and everything in new directories below it. Returns
    /// false once the bound is reached.
    fn dir(&mut self, rel: &[u8]) -> bool {
        if !rel.is_empty() && self.is_excluded(rel, true) {
            return true;
        }
        let listing = self.previous.listing(rel).cloned();
        let path = self.root.join(std::ffi::OsStr::from_bytes(rel));
        let mut names: Vec<Vec<u8>> = match std::fs::read_dir(&path) {
            Ok(entries) => entries
                .filter_map(|e| Some(e.ok()?.file_name().as_bytes().to_vec()))
                .filter(|name| !(rel.is_empty() && scan::is_sync_cookie(name)))
                .collect(),
            // Removed: its parent's listing counts what the walk had in it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
            Err(_) => Vec::new(),
        };
        names.sort();
        for name in &names {
            let child = scan::join_rel(rel, name);
            let before = listing.as_ref().and_then(|l| l.node(name));
            let Some(is_dir) = self.entry(&child, before) else {
                return false;
            };
            // A new directory the events do not list again: its entries
            // are all new.
            if is_dir
                && !self.dirty.contains(&child)
                && self.previous.listing(&child).is_none()
                && !self.dir(&child)
            {
                return false;
            }
        }
        if let Some(listing) = &listing {
            for node in &listing.nodes {
                if names
                    .binary_search_by(|n| n[..].cmp(&node.name[..]))
                    .is_ok()
                {
                    continue;
                }
                if matches!(node.kind, NodeKind::Dir) {
                    // Removed with everything the walk found in it.
                    let gone = scan::join_rel(rel, &node.name);
                    self.unsaved.files += self
                        .previous
                        .subtree(&gone)
                        .flat_map(|d| &d.nodes)
                        .filter(|n| !matches!(n.kind, NodeKind::Dir))
                        .count() as u64;
                } else {
                    self.unsaved.files += 1;
                }
            }
        }
        true
    }
}

/// `paths` that lie below `root`, relative to it.
fn excluded_below<'p>(root: &Path, paths: &'p [PathBuf]) -> Vec<&'p Path> {
    paths
        .iter()
        .filter_map(|path| path.strip_prefix(root).ok())
        .filter(|rel| !rel.as_os_str().is_empty())
        .collect()
}

/// Whether the relative path `rel` is one of `excluded` or inside one.
fn is_at_or_below_any(rel: &[u8], excluded: &[&Path]) -> bool {
    let rel = Path::new(std::ffi::OsStr::from_bytes(rel));
    excluded.iter().any(|ex| rel.starts_with(ex))
}

/// The cookie's name if `path` is a sync cookie in `root`.
fn sync_cookie<'p>(root: &Path, path: &'p Path) -> Option<&'p std::ffi::OsStr> {
    let name = path.file_name()?;
    (path.parent() == Some(root) && is_sync_cookie(name.as_bytes())).then_some(name)
}

/// Marks an entry whose content or attributes an event at `path` changed:
/// its parent's listing keeps its names, and only it is stat'ed again.
fn touch(pending: &mut Pending, root: &Path, path: &Path) {
    let Ok(rel) = path.strip_prefix(root) else {
        return;
    };
    if !scan::note_touched(&mut pending.touched, rel.as_os_str().as_bytes()) {
        mark(&mut pending.dirty, root, path);
    }
}

/// Marks what an event at `path` may have changed: the listing of its
/// parent (the entry itself) and its own listing (if it is a directory).
fn mark(dirty: &mut HashSet<Vec<u8>>, root: &Path, path: &Path) {
    let Ok(rel) = path.strip_prefix(root) else {
        return;
    };
    let rel = rel.as_os_str().as_bytes();
    let parent = scan::parent_rel(rel);
    if !dirty.contains(parent) {
        dirty.insert(parent.to_vec());
    }
    if !rel.is_empty() && !dirty.contains(rel) {
        dirty.insert(rel.to_vec());
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::time::Duration;

    use super::*;
    use crate::scan::{NodeKind, ScanOptions};

    fn options(root: &Path) -> ScanOptions {
        ScanOptions {
            root: root.to_path_buf(),
            skip_ignored: false,
            excludes: vec![],
            exclude_paths: vec![],
        }
    }

    /// Waits until the watcher has seen something (inotify delivers events
    /// asynchronously, through notify's own thread).
    fn settle(tracker: &ChangeTracker) {
        for _ in 0..200 {
            let pending = tracker.pending.0.lock().unwrap();
            if !pending.dirty.is_empty() || !pending.touched.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    fn listing(scan: &Scan) -> Vec<(String, String)> {
        scan.dirs
            .iter()
            .flat_map(|d| {
                d.nodes.iter().map(move |n| {
                    let kind = match &n.kind {
                        NodeKind::File(fp) => format!("file {}", fp.size),
                        NodeKind::Dir => "dir".into(),
                        NodeKind::Symlink(t) => format!("link {}", String::from_utf8_lossy(t)),
                    };
                    (
                        String::from_utf8_lossy(&scan::join_rel(&d.path, &n.name)).into_owned(),
                        kind,
                    )
                })
            })
            .collect()
    }

    /// The runner's cache may lie inside the root; it is left out of the
    /// walk, and writing it must not make the next walk a new one (an
    /// unchanged workspace would then be compared file by file).
    #[test]
    fn changes_inside_an_excluded_directory_hand_back_the_same_walk() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        let cache = root.join(".cairn/cache");
        fs::create_dir_all(cache.join("spool")).unwrap();
        fs::write(cache.join("entries"), "0").unwrap();
        fs::write(root.join("kept"), "0").unwrap();
        let tracker = ChangeTracker::start(&root, DEFAULT_FULL_SCAN_INTERVAL).unwrap();
        let opts = ScanOptions {
            exclude_paths: vec![cache.clone()],
            ..options(&root)
        };
        let (first, _) = tracker.scan(&opts, &|_| {}).unwrap();

        fs::write(cache.join("entries.tmp"), "1").unwrap();
        fs::rename(cache.join("entries.tmp"), cache.join("entries")).unwrap();
        fs::write(cache.join("spool/pack"), "2").unwrap();
        fs::remove_dir_all(cache.join("spool")).unwrap();
        settle(&tracker);
        let (second, kind) = tracker.scan(&opts, &|_| {}).unwrap();
        assert_eq!(kind, ScanKind::Partial { dirty: 0 });
        assert!(Arc::ptr_eq(&first, &second), "the same walk, shared");

        // A change beside the cache is still seen.
        fs::write(root.join(".cairn/beside"), "3").unwrap();
        settle(&tracker);
        let (third, _) = tracker.scan(&opts, &|_| {}).unwrap();
        assert!(!Arc::ptr_eq(&second, &third));
        let paths: Vec<String> = listing(&third).into_iter().map(|(p, _)| p).collect();
        assert!(paths.contains(&".cairn/beside".to_owned()), "{paths:?}");
        assert!(
            !paths.iter().any(|p| p.starts_with(".cairn/cache")),
            "{paths:?}"
        );
    }

    #[test]
    fn partial_walks_see_every_kind_of_change_and_equal_a_full_walk() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        for d in ["a/deep/er", "b", "c/gone/below", "untouched/x/y"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        for f in [
            "a/deep/er/f.rs",
            "b/g.rs",
            "c/gone/below/h",
            "untouched/x/y/z",
            "top",
        ] {
            fs::write(root.join(f), "0").unwrap();
        }
        let tracker = ChangeTracker::start(root, DEFAULT_FULL_SCAN_INTERVAL).unwrap();
        let opts = options(root);
        let (first, kind) = tracker.scan(&opts, &|_| {}).unwrap();
        assert_eq!(
            kind,
            ScanKind::Full {
                reason: "first walk".into()
            }
        );

        fs::write(root.join("a/deep/er/f.rs"), "longer content").unwrap();
        fs::write(root.join("b/new.rs"), "new").unwrap();
        fs::remove_dir_all(root.join("c/gone")).unwrap();
        fs::create_dir_all(root.join("n/e/w")).unwrap();
        fs::write(root.join("n/e/w/file"), "deep new").unwrap();
        std::os::unix::fs::symlink("top", root.join("link")).unwrap();
        fs::rename(root.join("b/g.rs"), root.join("a/g.rs")).unwrap();
        settle(&tracker);

        let (second, kind) = tracker.scan(&opts, &|_| {}).unwrap();
        let ScanKind::Partial { dirty } = kind else {
            panic!("expected a partial walk, got {kind:?}")
        };
        assert!(dirty < 20, "{dirty} dirty directories");
        let full = scan::scan(&opts, &|_| {}).unwrap();
        assert_eq!(listing(&second), listing(&full));
        assert_ne!(listing(&first), listing(&full));
        let paths: Vec<String> = listing(&second).into_iter().map(|(p, _)| p).collect();
        for expected in [
            "a/g.rs",
            "b/new.rs",
            "n/e/w/file",
            "link",
            "untouched/x/y/z",
        ] {
            assert!(
                paths.contains(&expected.to_owned()),
                "{expected} in {paths:?}"
            );
        }
        assert!(!paths.iter().any(|p| p.starts_with("c/gone")), "{paths:?}");

        // Nothing changed: the walk is the previous one, listing nothing.
        let (third, kind) = tracker.scan(&opts, &|_| {}).unwrap();
        assert_eq!(kind, ScanKind::Partial { dirty: 0 });
        assert_eq!(listing(&third), listing(&full));
    }

    #[test]
    fn a_write_in_place_restats_only_that_entry_and_equals_a_full_walk() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir_all(root.join("big/sub")).unwrap();
        fs::create_dir_all(root.join("other")).unwrap();
        for i in 0..50 {
            fs::write(root.join(format!("big/f{i:02}")), format!("file {i:02}")).unwrap();
        }
        fs::write(root.join("other/x"), "x").unwrap();
        let tracker = ChangeTracker::start(root, DEFAULT_FULL_SCAN_INTERVAL).unwrap();
        let opts = options(root);
        let (first, _) = tracker.scan(&opts, &|_| {}).unwrap();

        // Same length: only the times and the ctime tell.
        fs::write(root.join("big/f07"), "FILE 07").unwrap();
        let mode = |mode| fs::Permissions::from_mode(mode);
        fs::set_permissions(root.join("big/f08"), mode(0o600)).unwrap();
        fs::set_permissions(root.join("big/sub"), mode(0o700)).unwrap();
        settle(&tracker);
        {
            let pending = tracker.pending.0.lock().unwrap();
            assert!(pending.dirty.is_empty(), "{:?}", pending.dirty);
            let names: HashSet<&[u8]> = pending.touched[&b"big"[..]]
                .iter()
                .map(Vec::as_slice)
                .collect();
            assert_eq!(names, HashSet::from([&b"f07"[..], b"f08", b"sub"]));
        }
        let (second, kind) = tracker.scan(&opts, &|_| {}).unwrap();
        assert!(matches!(kind, ScanKind::Partial { .. }), "{kind:?}");
        let full = scan::scan(&opts, &|_| {}).unwrap();
        assert_eq!(second.dirs, full.dirs, "a partial walk equals a full walk");
        assert_ne!(first.dirs, full.dirs);
        let other = |scan: &Scan| {
            scan.dirs
                .iter()
                .find(|dir| dir.path == b"other")
                .unwrap()
                .clone()
        };
        assert!(Arc::ptr_eq(&other(&first), &other(&second)));

        // A name that is not what it was listed as: the directory is listed again.
        fs::remove_file(root.join("big/f09")).unwrap();
        fs::create_dir(root.join("big/f09")).unwrap();
        tracker.pending.0.lock().unwrap().touched =
            Touched::from([(b"big".to_vec(), HashSet::from([b"f09".to_vec()]))]);
        tracker.pending.0.lock().unwrap().dirty.clear();
        let (third, _) = tracker.scan(&opts, &|_| {}).unwrap();
        let full = scan::scan(&opts, &|_| {}).unwrap();
        let big = |scan: &Scan| {
            scan.dirs
                .iter()
                .find(|dir| dir.path == b"big")
                .map(|dir| (**dir).clone())
        };
        assert_eq!(big(&third), big(&full));
        assert!(third.dirs.iter().any(|dir| dir.path == b"big/f09"));
    }

    #[test]
    fn repositories_are_announced_by_partial_walks_too() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir_all(root.join("app/.git/objects")).unwrap();
        fs::create_dir_all(root.join("lib/.git")).unwrap();
        fs::write(root.join("app/src.rs"), "x").unwrap();
        let tracker = ChangeTracker::start(root, DEFAULT_FULL_SCAN_INTERVAL).unwrap();
        let opts = options(root);
        tracker.scan(&opts, &|_| {}).unwrap();
        fs::write(root.join("app/src.rs"), "changed").unwrap();
        settle(&tracker);
        let found = Mutex::new(Vec::new());
        let (_, kind) = tracker
            .scan(&opts, &|repo| found.lock().unwrap().push(repo.rel))
            .unwrap();
        assert!(matches!(kind, ScanKind::Partial { .. }), "{kind:?}");
        let mut found = found.into_inner().unwrap();
        found.sort();
        assert_eq!(found, [b"app".to_vec(), b"lib".to_vec()]);
    }

    #[test]
    fn lost_events_ignore_rules_and_the_interval_force_a_full_walk() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::write(root.join("f"), "x").unwrap();
        let tracker = ChangeTracker::start(root, Duration::from_secs(3600)).unwrap();
        let opts = options(root);
        tracker.scan(&opts, &|_| {}).unwrap();
        tracker.pending.0.lock().unwrap().lost = Some("the kernel dropped change events".into());
        let (_, kind) = tracker.scan(&opts, &|_| {}).unwrap();
        assert_eq!(
            kind,
            ScanKind::Full {
                reason: "the kernel dropped change events".into()
            }
        );
        let ignoring = ScanOptions {
            skip_ignored: true,
            ..options(root)
        };
        let (_, kind) = tracker.scan(&ignoring, &|_| {}).unwrap();
        assert!(matches!(kind, ScanKind::Full { .. }), "{kind:?}");

        let eager = ChangeTracker::start(root, Duration::ZERO).unwrap();
        eager.scan(&opts, &|_| {}).unwrap();
        let (_, kind) = eager.scan(&opts, &|_| {}).unwrap();
        assert_eq!(
            kind,
            ScanKind::Full {
                reason: "the periodic full walk is due".into()
            }
        );
    }

    #[test]
    fn a_walk_right_after_a_write_sees_it_and_an_idle_walk_is_the_same_walk() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        for d in 0..20 {
            fs::create_dir_all(root.join(format!("d{d}"))).unwrap();
            fs::write(root.join(format!("d{d}/f")), "0").unwrap();
        }
        let tracker = ChangeTracker::start(root, DEFAULT_FULL_SCAN_INTERVAL).unwrap();
        let opts = options(root);
        let (mut previous, _) = tracker.scan(&opts, &|_| {}).unwrap();
        // No waiting for the watcher: the sync before each walk does it.
        for round in 1..=30usize {
            let dir = format!("d{}", round % 20);
            fs::write(root.join(&dir).join("f"), "x".repeat(round)).unwrap();
            let (scan, kind) = tracker.scan(&opts, &|_| {}).unwrap();
            assert!(matches!(kind, ScanKind::Partial { .. }), "{kind:?}");
            let size = listing(&scan)
                .into_iter()
                .find(|(path, _)| *path == format!("{dir}/f"))
                .unwrap()
                .1;
            assert_eq!(size, format!("file {round}"), "round {round}");
            assert!(
                listing(&scan)
                    .iter()
                    .all(|(path, _)| !path.starts_with(".cairn-sync-")),
                "cookies are never listed"
            );
            previous = scan;
        }
        let (idle, kind) = tracker.scan(&opts, &|_| {}).unwrap();
        assert_eq!(kind, ScanKind::Partial { dirty: 0 });
        assert!(
            Arc::ptr_eq(&idle, &previous),
            "nothing changed: the same walk"
        );
        assert!(
            fs::read_dir(root)
                .unwrap()
                .all(|e| !is_sync_cookie(e.unwrap().file_name().as_bytes())),
            "no cookie is left behind"
        );
    }

    #[test]
    fn marking_names_the_parent_and_the_path() {
        let mut dirty = HashSet::new();
        let root = Path::new("/w");
        mark(&mut dirty, root, Path::new("/w/a/b/c.rs"));
        mark(&mut dirty, root, Path::new("/w/top"));
        mark(&mut dirty, root, Path::new("/elsewhere/x"));
        let mut got: Vec<_> = dirty.into_iter().collect();
        got.sort();
        assert_eq!(
            got,
            [
                b"".to_vec(),
                b"a/b".to_vec(),
                b"a/b/c.rs".to_vec(),
                b"top".to_vec()
            ]
        );
    }

    #[test]
    fn what_no_walk_has_yet_is_counted_without_taking_it_from_the_next_walk() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        fs::create_dir_all(root.join("src/old")).unwrap();
        fs::write(root.join("src/kept.rs"), "same").unwrap();
        fs::write(root.join("src/edited.rs"), "before").unwrap();
        fs::write(root.join("src/removed.rs"), "gone soon").unwrap();
        fs::write(root.join("src/old/a"), "1").unwrap();
        fs::write(root.join("src/old/b"), "2").unwrap();
        fs::create_dir_all(root.join(".cairn/cache")).unwrap();
        let tracker = ChangeTracker::start(&root, DEFAULT_FULL_SCAN_INTERVAL).unwrap();
        let opts = ScanOptions {
            exclude_paths: vec![root.join(".cairn/cache")],
            excludes: vec!["*.log".into()],
            ..options(&root)
        };
        assert_eq!(tracker.unsaved(&opts, 1000), None, "no walk yet");
        tracker.scan(&opts, &|_| {}).unwrap();
        assert_eq!(
            tracker.unsaved(&opts, 1000),
            Some(Unsaved {
                files: 0,
                bytes: 0,
                complete: true
            })
        );

        fs::write(root.join("src/edited.rs"), "after, longer").unwrap(); // 13 bytes
        fs::remove_file(root.join("src/removed.rs")).unwrap();
        fs::remove_dir_all(root.join("src/old")).unwrap(); // 2 files
        fs::create_dir_all(root.join("src/new/deeper")).unwrap();
        fs::write(root.join("src/new/deeper/x.rs"), "12345").unwrap(); // 5 bytes
        fs::write(root.join("top.txt"), "abc").unwrap(); // 3 bytes
        fs::write(root.join(".cairn/cache/entries"), "not the workspace's").unwrap();
        fs::write(root.join("src/build.log"), "excluded by a pattern").unwrap();
        let unsaved = tracker.unsaved(&opts, 1000).unwrap();
        assert_eq!(
            unsaved,
            Unsaved {
                files: 1 + 1 + 2 + 1 + 1,
                bytes: 13 + 5 + 3,
                complete: true
            }
        );
        // A bound stops the count, which says so.
        let bounded = tracker.unsaved(&opts, 2).unwrap();
        assert!(
            !bounded.complete && bounded.files <= unsaved.files,
            "{bounded:?}"
        );

        // Counting took nothing: the next walk sees every change.
        let (walk, kind) = tracker.scan(&opts, &|_| {}).unwrap();
        assert!(matches!(kind, ScanKind::Partial { .. }), "{kind:?}");
        let listed = listing(&walk);
        assert!(
            listed.contains(&("src/new/deeper/x.rs".into(), "file 5".into())),
            "{listed:?}"
        );
        assert!(!listed.iter().any(|(path, _)| path.starts_with("src/old")));
        assert_eq!(
            tracker.unsaved(&opts, 1000).map(|u| (u.files, u.bytes)),
            Some((0, 0)),
            "the walk took the changes"
        );
    }
}
