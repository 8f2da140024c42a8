//! Walking the workspace: what a checkpoint holds, as metadata only.
//!
//! The walk lists every directory in parallel (one rayon task per
//! directory) and `lstat`s every entry; no file content is read here and no
//! symlink is followed. It keeps files, directories (empty ones too) and
//! symlinks with their permission bits, mtime, uid and gid. `.git`
//! directories are kept as they are: the index, stashes, reflogs and objects
//! are part of the work. Fifos, sockets and device nodes are skipped with a
//! warning, and so is anything that cannot be read: the checkpoint says what
//! it lacks instead of losing it silently. Entries that vanish during the
//! walk are simply not there.
//!
//! What is left out on purpose:
//! - paths listed in [`ScanOptions::exclude_paths`] (the runner's own cache
//!   when it lies inside the workspace);
//! - paths matching an `--exclude` pattern (gitignore syntax, relative to the
//!   root);
//! - with [`ScanOptions::skip_ignored`], what git ignores in each repository:
//!   its `.gitignore` files and `.git/info/exclude` (the user's global
//!   excludes file is not read, so the result does not depend on who runs
//!   the runner). As in git, a tracked file is never ignored, even under an
//!   ignored directory, and nothing inside `.git` is ever matched.
//!
//! Repositories (directories holding a `.git` directory or file) are
//! announced through a callback as soon as they are found, so their git
//! metadata can be read while the walk goes on.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::{self, Metadata};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use ignore::gitignore::{Gitignore, GitignoreBuilder};

use crate::cache::Fingerprint;

/// How a change tracker's sync cookies in the root are named (see
/// [`crate::tracker`]); a walk never lists them.
pub const SYNC_COOKIE_PREFIX: &str = ".cairn-sync-";

/// Whether a name in the root is a change tracker's sync cookie.
pub fn is_sync_cookie(name: &[u8]) -> bool {
    name.starts_with(SYNC_COOKIE_PREFIX.as_bytes())
}

/// What to walk and what to leave out.
#[derive(Debug, Clone)]
pub struct ScanOptions {
    /// The workspace root (canonical, so it can be compared with `exclude_paths`).
    pub root: PathBuf,
    /// Leave out what git ignores in each repository.
    pub skip_ignored: bool,
    /// Gitignore-style patterns, relative to the root.
    pub excludes: Vec<String>,
    /// Absolute paths left out with everything below them.
    pub exclude_paths: Vec<PathBuf>,
}

/// The metadata a tree entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    /// `st_mode & 0o7777`.
    pub mode: u32,
    pub mtime_sec: i64,
    pub mtime_nsec: u32,
    pub uid: u32,
    pub gid: u32,
}

impl Meta {
    pub fn of(meta: &Metadata) -> Self {
        Self {
            mode: meta.mode() & 0o7777,
            mtime_sec: meta.mtime(),
            mtime_nsec: meta.mtime_nsec().clamp(0, 999_999_999) as u32,
            uid: meta.uid(),
            gid: meta.gid(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeKind {
    /// A regular file, with what identifies its content without reading it.
    File(Fingerprint),
    /// A directory; its entries are in the [`ScannedDir`] of the same path.
    Dir,
    /// A symlink and its target, byte for byte.
    Symlink(Vec<u8>),
}

/// One entry of a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Shared: a listing copied to stat a few of its entries again (a
    /// directory of thousands of files, one of them written) copies
    /// pointers, not every name.
    pub name: Arc<[u8]>,
    pub kind: NodeKind,
    pub meta: Meta,
}

/// One directory's listing, entries sorted by name bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedDir {
    /// Path relative to the root, `/`-separated; empty for the root itself.
    pub path: Vec<u8>,
    pub nodes: Vec<Node>,
}

impl ScannedDir {
    /// The entry called `name`.
    pub fn node(&self, name: &[u8]) -> Option<&Node> {
        let at = self.nodes.binary_search_by(|n| n.name[..].cmp(name)).ok()?;
        Some(&self.nodes[at])
    }
}

/// A repository found during the walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoFound {
    /// Absolute path of the repository's working directory.
    pub dir: PathBuf,
    /// The same, relative to the root (empty for the root itself).
    pub rel: Vec<u8>,
}

/// The result of a walk.
#[derive(Debug)]
pub struct Scan {
    pub root: PathBuf,
    /// When the walk began; files changed after it are not trusted for caching.
    pub started: SystemTime,
    /// Every directory, sorted by path bytes (the root first). Shared: a
    /// partial rescan takes unchanged listings from the walk before it.
    pub dirs: Vec<Arc<ScannedDir>>,
    /// What was skipped or could not be read, one sentence each.
    pub warnings: Vec<String>,
}

impl Scan {
    /// The listing of the directory at `rel`.
    pub fn listing(&self, rel: &[u8]) -> Option<&Arc<ScannedDir>> {
        Some(&self.dirs[self.position(rel)?])
    }

    /// Where the listing of the directory at `rel` is in `dirs`.
    pub fn position(&self, rel: &[u8]) -> Option<usize> {
        self.dirs.binary_search_by(|d| d.path[..].cmp(rel)).ok()
    }

    /// The listings of `rel` and of everything below it, in path order.
    pub fn subtree<'a>(&'a self, rel: &'a [u8]) -> impl Iterator<Item = &'a Arc<ScannedDir>> + 'a {
        let start = self.dirs.partition_point(|d| d.path[..] < *rel);
        // Everything that starts with `rel` is contiguous, but siblings such
        // as "app-config" (b'-' < b'/') sort between "app" and "app/src".
        self.dirs[start..]
            .iter()
            .take_while(move |d| d.path.starts_with(rel))
            .filter(move |d| is_at_or_below(&d.path, rel))
    }

    pub fn file_count(&self) -> usize {
        self.dirs
            .iter()
            .flat_map(|d| &d.nodes)
            .filter(|n| matches!(n.kind, NodeKind::File(_)))
            .count()
    }
}

/// Why a walk could not start. Problems below the root are warnings, not errors.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error("workspace root {0} does not exist")]
    RootMissing(PathBuf),
    #[error("workspace root {0} is not a directory")]
    RootNotDirectory(PathBuf),
    #[error("cannot read workspace root {path}: {source}")]
    Root { path: PathBuf, source: io::Error },
    #[error("invalid --exclude pattern {pattern:?}: {reason}")]
    BadExclude { pattern: String, reason: String },
}

/// Whether the relative path `path` is `dir` or below it ("" is the root).
pub fn is_at_or_below(path: &[u8], dir: &[u8]) -> bool {
    dir.is_empty() || (path.starts_with(dir) && matches!(path.get(dir.len()), None | Some(b'/')))
}

/// A relative path's directory and last name (`None` for the root): the
/// inverse of [`join_rel`].
pub fn split_rel(rel: &[u8]) -> Option<(&[u8], &[u8])> {
    if rel.is_empty() {
        return None;
    }
    Some(match rel.iter().rposition(|b| *b == b'/') {
        Some(slash) => (&rel[..slash], &rel[slash + 1..]),
        None => (&[][..], rel),
    })
}

/// The directory a relative path is in (the root, `""`, for a name at the
/// top and for the root itself).
pub fn parent_rel(rel: &[u8]) -> &[u8] {
    split_rel(rel).map_or(&[][..], |(parent, _)| parent)
}

/// `dir/name` for relative paths (`name` when `dir` is the root).
pub fn join_rel(dir: &[u8], name: &[u8]) -> Vec<u8> {
    if dir.is_empty() {
        return name.to_vec();
    }
    let mut path = Vec::with_capacity(dir.len() + 1 + name.len());
    path.extend_from_slice(dir);
    path.push(b'/');
    path.extend_from_slice(name);
    path
}

/// [`join_rel`] into `path`, reusing its allocation.
pub fn join_rel_into(path: &mut Vec<u8>, dir: &[u8], name: &[u8]) {
    path.clear();
    if !dir.is_empty() {
        path.extend_from_slice(dir);
        path.push(b'/');
    }
    path.extend_from_slice(name);
}

/// A relative path for messages (`.` for the root).
pub fn display_rel(rel: &[u8]) -> String {
    if rel.is_empty() {
        ".".to_owned()
    } else {
        String::from_utf8_lossy(rel).into_owned()
    }
}

fn rel_path(rel: &[u8]) -> &Path {
    Path::new(OsStr::from_bytes(rel))
}

/// Checks that `root` is a directory and returns its canonical path.
pub fn resolve_root(root: &Path) -> Result<PathBuf, ScanError> {
    match fs::metadata(root) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Err(ScanError::RootNotDirectory(root.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(ScanError::RootMissing(root.to_path_buf()));
        }
        Err(source) => {
            return Err(ScanError::Root {
                path: root.to_path_buf(),
                source,
            });
        }
    }
    fs::canonicalize(root).map_err(|source| ScanError::Root {
        path: root.to_path_buf(),
        source,
    })
}

/// Builds the matcher of `--exclude` patterns (None when there are none).
pub fn exclude_matcher(root: &Path, patterns: &[String]) -> Result<Option<Gitignore>, ScanError> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut builder = GitignoreBuilder::new(root);
    for pattern in patterns {
        if pattern.trim().is_empty() {
            return Err(ScanError::BadExclude {
                pattern: pattern.clone(),
                reason: "is empty".into(),
            });
        }
        builder
            .add_line(None, pattern)
            .map_err(|e| ScanError::BadExclude {
                pattern: pattern.clone(),
                reason: e.to_string(),
            })?;
    }
    builder
        .build()
        .map(Some)
        .map_err(|e| ScanError::BadExclude {
            pattern: patterns.join(" "),
            reason: e.to_string(),
        })
}

/// Walks `opts.root`, calling `on_repo` for every repository found.
pub fn scan(opts: &ScanOptions, on_repo: &(dyn Fn(RepoFound) + Sync)) -> Result<Scan, ScanError> {
    walk_root(opts, None, on_repo)
}

/// Walks only what may have changed since `previous`: the directories in
/// `dirty` (relative paths whose listing, or an entry of which, changed) are
/// listed again, with every directory that is new; everything else is taken
/// from `previous` without a system call. `previous` must be a scan of the
/// same root with the same options, and `dirty` must hold every directory
/// changed since it was taken (a change tracker's job); anything else may
/// be named too. Repositories are announced as by [`scan`].
///
/// Refused with `skip_ignored`: what git ignores depends on every
/// `.gitignore` above a directory and on the index, which a listing of the
/// dirty directories alone cannot tell.
pub fn rescan(
    opts: &ScanOptions,
    previous: &Scan,
    dirty: &HashSet<Vec<u8>>,
    touched: &Touched,
    on_repo: &(dyn Fn(RepoFound) + Sync),
) -> Result<Scan, ScanError> {
    assert!(
        !opts.skip_ignored,
        "a partial rescan cannot apply git's ignore rules"
    );
    // Adding or removing an entry of `d` moves `d`'s mtime, which its
    // parent's listing carries (no event says so): that entry of the parent
    // is stat'ed again, as a touched one.
    let mut touched = touched.clone();
    for path in dirty {
        if split_rel(path).is_some_and(|(parent, _)| !dirty.contains(parent)) {
            note_touched(&mut touched, path);
        }
    }
    let mut ancestors = HashSet::new();
    // A directory with touched entries is walked into, not taken whole.
    ancestors.extend(touched.keys().cloned());
    for path in dirty.iter().chain(touched.keys()) {
        let mut rest = &path[..];
        while let Some(slash) = rest.iter().rposition(|b| *b == b'/') {
            rest = &rest[..slash];
            if !ancestors.insert(rest.to_vec()) {
                break;
            }
        }
        if !path.is_empty() {
            ancestors.insert(Vec::new());
        }
    }
    let reuse = Reuse {
        previous,
        dirty,
        touched: &touched,
        ancestors,
        reused_subtrees: Mutex::new(Vec::new()),
    };
    walk_root(opts, Some(&reuse), on_repo)
}

/// Per directory (relative path), the names of entries whose content or
/// attributes changed while its names stayed as they were.
pub type Touched = HashMap<Vec<u8>, HashSet<Vec<u8>>>;

/// Notes that the entry at `rel` changed in place; false for the root,
/// which is no entry of a listing.
pub fn note_touched(touched: &mut Touched, rel: &[u8]) -> bool {
    let Some((parent, name)) = split_rel(rel) else {
        return false;
    };
    touched
        .entry(parent.to_vec())
        .or_default()
        .insert(name.to_vec());
    true
}

/// `previous` with the entries `names` stat'ed again: all that a write or an
/// attribute change, which leaves a directory's names as they are, can
/// change. None when one of them is no longer what it was (gone, another
/// kind, or never listed): then the directory is listed again.
fn restat(abs: &Path, previous: &ScannedDir, names: &HashSet<Vec<u8>>) -> Option<Arc<ScannedDir>> {
    let mut nodes = previous.nodes.clone();
    for name in names {
        let at = nodes
            .binary_search_by(|node| node.name[..].cmp(name))
            .ok()?;
        let meta = fs::symlink_metadata(abs.join(OsStr::from_bytes(name))).ok()?;
        let node = &mut nodes[at];
        match (&node.kind, meta.file_type()) {
            (NodeKind::File(_), kind) if kind.is_file() => {
                node.kind = NodeKind::File(Fingerprint::of(&meta));
            }
            (NodeKind::Dir, kind) if kind.is_dir() => {}
            _ => return None,
        }
        node.meta = Meta::of(&meta);
    }
    Some(Arc::new(ScannedDir {
        path: previous.path.clone(),
        nodes,
    }))
}

/// What a partial rescan may take from the scan before it.
struct Reuse<'a> {
    previous: &'a Scan,
    dirty: &'a HashSet<Vec<u8>>,
    touched: &'a Touched,
    /// Every directory above a dirty path: walked through, not relisted.
    ancestors: HashSet<Vec<u8>>,
    /// Directories taken whole, with everything below them, from `previous`.
    reused_subtrees: Mutex<Vec<Vec<u8>>>,
}

impl Reuse<'_> {
    /// The previous listing of `rel`, if it may be used as it is.
    fn listing(&self, rel: &[u8]) -> Option<&Arc<ScannedDir>> {
        if self.dirty.contains(rel) {
            return None;
        }
        self.previous.listing(rel)
    }

    /// Whether nothing at or below `rel` changed and `previous` has it.
    fn whole_subtree(&self, rel: &[u8]) -> bool {
        !self.ancestors.contains(rel) && self.listing(rel).is_some()
    }
}

fn walk_root(
    opts: &ScanOptions,
    reuse: Option<&Reuse<'_>>,
    on_repo: &(dyn Fn(RepoFound) + Sync),
) -> Result<Scan, ScanError> {
    let root = resolve_root(&opts.root)?;
    let excludes = exclude_matcher(&root, &opts.excludes)?;
    let walk = Walk {
        skip_ignored: opts.skip_ignored,
        exclude_paths: &opts.exclude_paths,
        excludes,
        on_repo,
        reuse,
        dirs: Mutex::new(Vec::new()),
        warnings: Mutex::new(Vec::new()),
    };
    let started = SystemTime::now();
    rayon::scope(|scope| {
        walk.walk_dir(
            scope,
            root.clone(),
            Vec::new(),
            DirContext {
                scope: None,
                in_git_dir: false,
            },
        );
    });
    let mut dirs = walk
        .dirs
        .into_inner()
        .expect("no walker panicked holding the lock");
    if let Some(reuse) = reuse {
        let subtrees = reuse
            .reused_subtrees
            .lock()
            .expect("no walker panicked holding the lock");
        for top in subtrees.iter() {
            for dir in reuse.previous.subtree(top) {
                announce_repo(&root, dir, on_repo);
                dirs.push(dir.clone());
            }
        }
    }
    // Stable sorting finds the runs already in order (every reused subtree
    // is one) and merges them, instead of sorting every directory of a
    // large workspace again after a partial walk.
    dirs.sort_by(|a, b| a.path.cmp(&b.path));
    if dirs.first().is_none_or(|d| !d.path.is_empty()) {
        // The root itself vanished while the walk began.
        return Err(ScanError::RootMissing(opts.root.clone()));
    }
    let mut warnings = walk
        .warnings
        .into_inner()
        .expect("no walker panicked holding the lock");
    warnings.sort();
    Ok(Scan {
        root,
        started,
        dirs,
        warnings,
    })
}

/// Announces every repository of `scan`, as its walk did.
pub fn announce_repos(scan: &Scan, on_repo: &(dyn Fn(RepoFound) + Sync)) {
    for dir in &scan.dirs {
        announce_repo(&scan.root, dir, on_repo);
    }
}

/// Announces `dir` if it is a repository taken from an earlier scan (a
/// directory holding `.git`, not itself inside a `.git` directory).
fn announce_repo(root: &Path, dir: &ScannedDir, on_repo: &(dyn Fn(RepoFound) + Sync)) {
    // Listings are sorted by name: a search, not a pass over every entry
    // of every directory a partial walk takes over.
    let in_git_dir = || dir.path.split(|b| *b == b'/').any(|part| part == b".git");
    if dir.node(b".git").is_some() && !in_git_dir() {
        on_repo(RepoFound {
            dir: root.join(rel_path(&dir.path)),
            rel: dir.path.clone(),
        });
    }
}

struct Walk<'a> {
    skip_ignored: bool,
    exclude_paths: &'a [PathBuf],
    excludes: Option<Gitignore>,
    on_repo: &'a (dyn Fn(RepoFound) + Sync),
    reuse: Option<&'a Reuse<'a>>,
    dirs: Mutex<Vec<Arc<ScannedDir>>>,
    warnings: Mutex<Vec<String>>,
}

/// What a directory inherits from its parent.
#[derive(Clone)]
struct DirContext {
    /// The ignore rules in force (only with `skip_ignored`, outside `.git`).
    scope: Option<Arc<IgnoreScope>>,
    /// Inside a `.git` directory: nothing is matched and no repository is announced.
    in_git_dir: bool,
}

impl<'a> Walk<'a> {
    fn warn(&self, message: String) {
        tracing::debug!(%message, "scan warning");
        self.warnings.lock().expect("warnings lock").push(message);
    }

    fn walk_dir<'s>(&'s self, scope: &rayon::Scope<'s>, abs: PathBuf, rel: Vec<u8>, ctx: DirContext)
    where
        'a: 's,
    {
        let kept = self.reuse.and_then(|reuse| {
            let previous = reuse.listing(&rel)?;
            match reuse.touched.get(&rel) {
                Some(names) => restat(&abs, previous, names),
                None => Some(previous.clone()),
            }
        });
        if let Some(previous) = kept {
            // Its names unchanged, but something in or below it changed.
            if !ctx.in_git_dir && previous.node(b".git").is_some() {
                (self.on_repo)(RepoFound {
                    dir: abs.clone(),
                    rel: rel.clone(),
                });
            }
            for node in &previous.nodes {
                if node.kind == NodeKind::Dir {
                    self.descend(scope, &abs, &rel, &node.name, &ctx, None);
                }
            }
            self.dirs.lock().expect("dirs lock").push(previous);
            return;
        }
        let listing = match fs::read_dir(&abs) {
            Ok(listing) => listing,
            // Gone since its parent was listed: its parent entry is dropped too.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) => {
                self.warn(format!(
                    "cannot list directory {}: {e}; its contents are not in the checkpoint",
                    display_rel(&rel)
                ));
                self.dirs
                    .lock()
                    .expect("dirs lock")
                    .push(Arc::new(ScannedDir {
                        path: rel,
                        nodes: Vec::new(),
                    }));
                return;
            }
        };
        let mut entries = Vec::new();
        for entry in listing {
            match entry {
                Ok(entry) => entries.push(entry),
                Err(e) => self.warn(format!(
                    "cannot list directory {} completely: {e}; some entries are not in the checkpoint",
                    display_rel(&rel)
                )),
            }
        }
        let has_name = |wanted: &[u8]| entries.iter().any(|e| e.file_name().as_bytes() == wanted);
        let is_repo = !ctx.in_git_dir && has_name(b".git");
        if is_repo {
            (self.on_repo)(RepoFound {
                dir: abs.clone(),
                rel: rel.clone(),
            });
        }
        let child_scope = if !self.skip_ignored || ctx.in_git_dir {
            None
        } else {
            let base = if is_repo {
                IgnoreScope::for_repo(&abs).map_err(|reason| {
                    self.warn(format!(
                        "cannot read the git ignore rules of {}: {reason}; nothing in it is left out",
                        display_rel(&rel)
                    ))
                })
                .ok()
                .map(Arc::new)
            } else {
                ctx.scope.clone()
            };
            match base {
                Some(base) if !base.inside_ignored && has_name(b".gitignore") => {
                    Some(Arc::new(base.with_gitignore(&abs)))
                }
                other => other,
            }
        };

        let mut nodes = Vec::with_capacity(entries.len());
        for entry in entries {
            let name = entry.file_name().into_vec();
            if rel.is_empty() && is_sync_cookie(&name) {
                // A change tracker's marker, there for a millisecond.
                continue;
            }
            let child_abs = abs.join(OsStr::from_bytes(&name));
            let child_rel = join_rel(&rel, &name);
            if self.exclude_paths.contains(&child_abs) {
                continue;
            }
            let meta = match entry.metadata() {
                Ok(meta) => meta,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => {
                    self.warn(format!(
                        "cannot stat {}: {e}; it is not in the checkpoint",
                        display_rel(&child_rel)
                    ));
                    continue;
                }
            };
            let file_type = meta.file_type();
            let is_dir = file_type.is_dir();
            if let Some(excludes) = &self.excludes
                && excludes.matched(rel_path(&child_rel), is_dir).is_ignore()
            {
                continue;
            }
            let is_git_dir = name == b".git";
            let mut grandchild_scope = child_scope.clone();
            if let Some(ignore) = &child_scope
                && !is_git_dir
            {
                match ignore.decide(&child_abs, is_dir) {
                    Decision::Keep => {}
                    Decision::Skip => continue,
                    Decision::DescendTracked => {
                        grandchild_scope = Some(Arc::new(ignore.inside_ignored()))
                    }
                }
            }

            let kind = if file_type.is_file() {
                NodeKind::File(Fingerprint::of(&meta))
            } else if is_dir {
                self.descend(scope, &abs, &rel, &name, &ctx, grandchild_scope);
                NodeKind::Dir
            } else if file_type.is_symlink() {
                match fs::read_link(&child_abs) {
                    Ok(target) => NodeKind::Symlink(target.into_os_string().into_vec()),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        self.warn(format!(
                            "cannot read symlink {}: {e}; it is not in the checkpoint",
                            display_rel(&child_rel)
                        ));
                        continue;
                    }
                }
            } else {
                let what = if file_type.is_fifo() {
                    "fifo"
                } else if file_type.is_socket() {
                    "socket"
                } else if file_type.is_char_device() {
                    "character device"
                } else if file_type.is_block_device() {
                    "block device"
                } else {
                    "special file"
                };
                self.warn(format!(
                    "skipped {what} {}: fifos, sockets and device nodes are not checkpointed",
                    display_rel(&child_rel)
                ));
                continue;
            };
            nodes.push(Node {
                name: name.into(),
                kind,
                meta: Meta::of(&meta),
            });
        }
        nodes.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        self.dirs
            .lock()
            .expect("dirs lock")
            .push(Arc::new(ScannedDir { path: rel, nodes }));
    }

    /// Walks the child directory `name` of `rel`, or, in a partial rescan
    /// where nothing below it changed, takes it from the previous scan.
    fn descend<'s>(
        &'s self,
        scope: &rayon::Scope<'s>,
        abs: &Path,
        rel: &[u8],
        name: &[u8],
        ctx: &DirContext,
        ignore_scope: Option<Arc<IgnoreScope>>,
    ) where
        'a: 's,
    {
        let child_rel = join_rel(rel, name);
        if let Some(reuse) = self.reuse
            && reuse.whole_subtree(&child_rel)
        {
            reuse
                .reused_subtrees
                .lock()
                .expect("subtrees lock")
                .push(child_rel);
            return;
        }
        let is_git_dir = name == b".git";
        let ctx = DirContext {
            scope: if is_git_dir { None } else { ignore_scope },
            in_git_dir: ctx.in_git_dir || is_git_dir,
        };
        let child_abs = abs.join(OsStr::from_bytes(name));
        scope.spawn(move |scope| self.walk_dir(scope, child_abs, child_rel, ctx));
    }
}

enum Decision {
    Keep,
    Skip,
    /// An ignored directory holding tracked files: walk it, keeping only those.
    DescendTracked,
}

/// One repository's ignore rules as seen from one directory.
#[derive(Clone)]
struct IgnoreScope {
    repo: Arc<RepoRules>,
    /// `.gitignore` matchers from the repository root down to this directory.
    gitignores: Vec<Arc<Gitignore>>,
    /// Below an ignored directory: everything untracked is ignored.
    inside_ignored: bool,
}

struct RepoRules {
    /// Repository root (absolute) and its `info/exclude` rules.
    root: PathBuf,
    info_exclude: Gitignore,
    /// Repository-relative paths in the index, sorted.
    tracked: Vec<Vec<u8>>,
}

impl IgnoreScope {
    fn for_repo(dir: &Path) -> Result<Self, String> {
        crate::libgit2::init();
        let repo = git2::Repository::open(dir).map_err(|e| e.message().to_owned())?;
        let mut tracked: Vec<Vec<u8>> = match repo.index() {
            Ok(index) => index.iter().map(|entry| entry.path).collect(),
            Err(e) => return Err(format!("cannot read its index: {}", e.message())),
        };
        tracked.sort_unstable();
        tracked.dedup();
        let mut builder = GitignoreBuilder::new(dir);
        let exclude_file = repo.commondir().join("info").join("exclude");
        if exclude_file.is_file()
            && let Some(e) = builder.add(&exclude_file)
        {
            tracing::debug!(file = %exclude_file.display(), error = %e, "parts of an exclude file are unusable");
        }
        let info_exclude = builder.build().map_err(|e| e.to_string())?;
        Ok(Self {
            repo: Arc::new(RepoRules {
                root: dir.to_path_buf(),
                info_exclude,
                tracked,
            }),
            gitignores: Vec::new(),
            inside_ignored: false,
        })
    }

    fn with_gitignore(&self, dir: &Path) -> Self {
        let mut builder = GitignoreBuilder::new(dir);
        let file = dir.join(".gitignore");
        if let Some(e) = builder.add(&file) {
            // Git skips what it cannot parse (or read) in an ignore file; so do we.
            tracing::debug!(file = %file.display(), error = %e, "parts of a .gitignore are unusable");
        }
        let mut next = self.clone();
        match builder.build() {
            Ok(matcher) if !matcher.is_empty() => next.gitignores.push(Arc::new(matcher)),
            Ok(_) => {}
            Err(e) => tracing::debug!(file = %file.display(), error = %e, "unusable .gitignore"),
        }
        next
    }

    fn inside_ignored(&self) -> Self {
        Self {
            inside_ignored: true,
            ..self.clone()
        }
    }

    fn is_ignored(&self, abs: &Path, is_dir: bool) -> bool {
        if self.inside_ignored {
            return true;
        }
        // The deepest .gitignore that has an opinion wins, then info/exclude.
        for matcher in self.gitignores.iter().rev() {
            let m = matcher.matched(abs, is_dir);
            if !m.is_none() {
                return m.is_ignore();
            }
        }
        self.repo.info_exclude.matched(abs, is_dir).is_ignore()
    }

    fn decide(&self, abs: &Path, is_dir: bool) -> Decision {
        if !self.is_ignored(abs, is_dir) {
            return Decision::Keep;
        }
        let Ok(in_repo) = abs.strip_prefix(&self.repo.root) else {
            return Decision::Keep;
        };
        let in_repo = in_repo.as_os_str().as_bytes();
        let tracked = &self.repo.tracked;
        if is_dir {
            let mut prefix = in_repo.to_vec();
            prefix.push(b'/');
            let at = tracked.partition_point(|p| p.as_slice() < prefix.as_slice());
            if tracked.get(at).is_some_and(|p| p.starts_with(&prefix)) {
                Decision::DescendTracked
            } else {
                Decision::Skip
            }
        } else if tracked
            .binary_search_by(|p| p.as_slice().cmp(in_repo))
            .is_ok()
        {
            Decision::Keep
        } else {
            Decision::Skip
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::git::testing::git;
    use std::collections::BTreeMap;
    use std::os::unix::fs::{PermissionsExt, symlink};

    /// Every scanned path with a short description of what it is.
    fn listing(scan: &Scan) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for dir in &scan.dirs {
            for node in &dir.nodes {
                let path = String::from_utf8_lossy(&join_rel(&dir.path, &node.name)).into_owned();
                let what = match &node.kind {
                    NodeKind::File(fp) => format!("file {} {:o}", fp.size, node.meta.mode),
                    NodeKind::Dir => format!("dir {:o}", node.meta.mode),
                    NodeKind::Symlink(t) => format!("link {}", String::from_utf8_lossy(t)),
                };
                out.insert(path, what);
            }
        }
        out
    }

    fn options(root: &Path) -> ScanOptions {
        ScanOptions {
            root: root.to_path_buf(),
            skip_ignored: false,
            excludes: Vec::new(),
            exclude_paths: Vec::new(),
        }
    }

    fn run(opts: &ScanOptions) -> Scan {
        scan(opts, &|_| {}).unwrap()
    }

    #[test]
    fn files_dirs_and_symlinks_are_listed_with_their_modes_and_links_are_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir_all(root.join("src/empty")).unwrap();
        fs::write(root.join("src/main.rs"), b"fn main() {}\n").unwrap();
        fs::write(root.join("run.sh"), b"#!/bin/sh\n").unwrap();
        fs::set_permissions(root.join("run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::write(root.join("secret"), b"x").unwrap();
        fs::set_permissions(root.join("secret"), fs::Permissions::from_mode(0o600)).unwrap();
        fs::write(root.join("empty file"), b"").unwrap();
        symlink("src/main.rs", root.join("relative link")).unwrap();
        symlink("/nowhere/at/all", root.join("dangling")).unwrap();
        // A link to a directory outside must not be walked into.
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("not-mine"), b"x").unwrap();
        symlink(outside.path(), root.join("elsewhere")).unwrap();

        let scan = run(&options(root));
        let got = listing(&scan);
        let outside_target = format!("link {}", outside.path().display());
        let want: BTreeMap<String, String> = [
            ("dangling", "link /nowhere/at/all"),
            ("elsewhere", outside_target.as_str()),
            ("empty file", "file 0 644"),
            ("relative link", "link src/main.rs"),
            ("run.sh", "file 10 755"),
            ("secret", "file 1 600"),
            ("src", "dir 755"),
            ("src/empty", "dir 755"),
            ("src/main.rs", "file 13 644"),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
        .collect();
        assert_eq!(got, want);
        assert!(scan.warnings.is_empty(), "{:?}", scan.warnings);
        let paths: Vec<_> = scan.dirs.iter().map(|d| display_rel(&d.path)).collect();
        assert_eq!(
            paths,
            [".", "src", "src/empty"],
            "empty directories have a listing too"
        );
    }

    #[test]
    fn mtimes_and_owners_are_recorded() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        fs::write(&path, b"x").unwrap();
        let when = SystemTime::UNIX_EPOCH + std::time::Duration::new(1_600_000_000, 123_456_789);
        fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(when)
            .unwrap();
        let scan = run(&options(tmp.path()));
        let node = &scan.dirs[0].nodes[0];
        assert_eq!(
            (node.meta.mtime_sec, node.meta.mtime_nsec),
            (1_600_000_000, 123_456_789)
        );
        let meta = fs::metadata(&path).unwrap();
        assert_eq!((node.meta.uid, node.meta.gid), (meta.uid(), meta.gid()));
    }

    #[test]
    fn names_that_are_not_utf8_survive_byte_for_byte() {
        let tmp = tempfile::tempdir().unwrap();
        let name = OsStr::from_bytes(b"caf\xe9 \xff.txt");
        fs::create_dir(tmp.path().join(OsStr::from_bytes(b"d\xfe"))).unwrap();
        fs::write(
            tmp.path().join(OsStr::from_bytes(b"d\xfe")).join(name),
            b"latin-1",
        )
        .unwrap();
        let scan = run(&options(tmp.path()));
        assert_eq!(scan.dirs[1].path, b"d\xfe");
        assert_eq!(&scan.dirs[1].nodes[0].name[..], b"caf\xe9 \xff.txt");
    }

    #[test]
    fn fifos_and_sockets_are_skipped_with_a_warning() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo =
            std::ffi::CString::new(tmp.path().join("pipe").into_os_string().into_vec()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo has no other preconditions.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        let _socket = std::os::unix::net::UnixListener::bind(tmp.path().join("sock")).unwrap();
        fs::write(tmp.path().join("kept"), b"x").unwrap();
        let scan = run(&options(tmp.path()));
        assert_eq!(listing(&scan).keys().collect::<Vec<_>>(), ["kept"]);
        assert_eq!(scan.warnings.len(), 2, "{:?}", scan.warnings);
        assert!(
            scan.warnings[0].contains("skipped fifo pipe"),
            "{:?}",
            scan.warnings
        );
        assert!(
            scan.warnings[1].contains("skipped socket sock"),
            "{:?}",
            scan.warnings
        );
    }

    #[test]
    fn an_unreadable_directory_is_kept_empty_with_a_warning() {
        let tmp = tempfile::tempdir().unwrap();
        let locked = tmp.path().join("locked");
        fs::create_dir(&locked).unwrap();
        fs::write(locked.join("inside"), b"x").unwrap();
        fs::set_permissions(&locked, fs::Permissions::from_mode(0o000)).unwrap();
        let readable_anyway = fs::read_dir(&locked).is_ok(); // running as root
        let scan = run(&options(tmp.path()));
        fs::set_permissions(&locked, fs::Permissions::from_mode(0o755)).unwrap();
        if readable_anyway {
            assert!(listing(&scan).contains_key("locked/inside"));
            return;
        }
        assert!(listing(&scan).contains_key("locked"));
        assert!(!listing(&scan).contains_key("locked/inside"));
        assert!(
            scan.warnings
                .iter()
                .any(|w| w.contains("cannot list directory locked")),
            "{:?}",
            scan.warnings
        );
    }

    #[test]
    fn exclude_patterns_and_exclude_paths_leave_things_out() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        for dir in ["build", "src/build", "cache", "node/cache", "runner-cache"] {
            fs::create_dir_all(root.join(dir)).unwrap();
        }
        for file in [
            "a.tmp",
            "src/b.tmp",
            "src/keep.rs",
            "build/x",
            "src/build/y",
            "cache/z",
            "node/cache/w",
            "runner-cache/c",
        ] {
            fs::write(root.join(file), b"x").unwrap();
        }
        let mut opts = options(root);
        opts.root = fs::canonicalize(root).unwrap();
        opts.excludes = vec!["*.tmp".into(), "/build".into(), "cache/".into()];
        opts.exclude_paths = vec![opts.root.join("runner-cache")];
        let scan = run(&opts);
        let got: Vec<_> = listing(&scan).into_keys().collect();
        assert_eq!(
            got,
            ["node", "src", "src/build", "src/build/y", "src/keep.rs"]
        );
    }

    #[test]
    fn a_bad_exclude_pattern_is_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let mut opts = options(tmp.path());
        opts.excludes = vec!["[z-a].txt".into()];
        let err = scan(&opts, &|_| {}).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid --exclude pattern \"[z-a].txt\": "),
            "{err}"
        );
    }

    #[test]
    fn a_missing_root_or_a_file_as_root_is_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let err = scan(&options(&tmp.path().join("nope")), &|_| {}).unwrap_err();
        assert!(matches!(err, ScanError::RootMissing(_)), "{err}");
        fs::write(tmp.path().join("file"), b"").unwrap();
        let err = scan(&options(&tmp.path().join("file")), &|_| {}).unwrap_err();
        assert!(err.to_string().ends_with("is not a directory"), "{err}");
    }

    #[test]
    fn skip_ignored_leaves_out_what_git_ignores_and_keeps_git_and_tracked_files() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        let repo = root.join("repo");
        fs::create_dir_all(repo.join("target/debug")).unwrap();
        fs::create_dir_all(repo.join("sub/gen")).unwrap();
        fs::create_dir_all(repo.join("vendor")).unwrap();
        git(&repo, &["init", "-q"]);
        fs::write(repo.join(".gitignore"), "target/\n*.log\nvendor/\n").unwrap();
        fs::write(repo.join("sub/.gitignore"), "gen/\n!keep.log\n").unwrap();
        fs::write(repo.join(".git/info/exclude"), "private.txt\n").unwrap();
        for file in [
            "main.rs",
            "target/debug/app",
            "debug.log",
            "sub/keep.log",
            "sub/gen/out.rs",
            "private.txt",
            "vendor/forced.c",
            "vendor/untracked.c",
        ] {
            fs::write(repo.join(file), b"x").unwrap();
        }
        git(
            &repo,
            &[
                "add",
                ".gitignore",
                "sub/.gitignore",
                "main.rs",
                "sub/keep.log",
            ],
        );
        git(&repo, &["add", "-f", "vendor/forced.c"]);
        git(&repo, &["commit", "-qm", "init"]);
        // Outside any repository nothing is ignored, whatever its name.
        fs::write(root.join("loose.log"), b"x").unwrap();

        let mut opts = options(&root);
        let all = listing(&run(&opts));
        assert!(all.contains_key("repo/target/debug/app") && all.contains_key("repo/private.txt"));

        opts.skip_ignored = true;
        let found = Mutex::new(Vec::new());
        let scan = scan(&opts, &|repo| found.lock().unwrap().push(repo)).unwrap();
        let got = listing(&scan);
        for kept in [
            "loose.log",
            "repo/.gitignore",
            "repo/main.rs",
            "repo/sub/keep.log",
            "repo/vendor",
            "repo/vendor/forced.c",
            "repo/.git/HEAD",
            "repo/.git/index",
            "repo/.git/info/exclude",
        ] {
            assert!(got.contains_key(kept), "{kept} must be kept: {got:#?}");
        }
        for left_out in [
            "repo/target",
            "repo/debug.log",
            "repo/sub/gen",
            "repo/private.txt",
            "repo/vendor/untracked.c",
        ] {
            assert!(
                !got.contains_key(left_out),
                "{left_out} is ignored by git: {got:#?}"
            );
        }
        let found = found.into_inner().unwrap();
        assert_eq!(
            found,
            [RepoFound {
                dir: repo.clone(),
                rel: b"repo".to_vec()
            }]
        );
    }

    #[test]
    fn a_partial_rescan_keeps_the_subdirectories_of_a_directory_whose_name_is_a_prefix_of_a_sibling()
     {
        // "app-config" sorts between "app" and "app/src" ('-' < '/'): the
        // listings below "app" are not next to it in the sorted scan.
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        for dir in ["app/src/deep", "app-config", "app.d", "other"] {
            fs::create_dir_all(root.join(dir)).unwrap();
        }
        for file in [
            "app/src/deep/lib.rs",
            "app/main.rs",
            "app-config/c.toml",
            "app.d/x",
            "other/o",
        ] {
            fs::write(root.join(file), file).unwrap();
        }
        let opts = options(&root);
        let before = run(&opts);
        fs::write(root.join("other/new"), b"n").unwrap();
        let dirty = HashSet::from([b"other".to_vec()]);
        let after = rescan(&opts, &before, &dirty, &Touched::new(), &|_| {}).unwrap();
        assert_eq!(listing(&after), listing(&run(&opts)));
        assert!(listing(&after).contains_key("app/src/deep/lib.rs"));
    }

    #[test]
    fn a_partial_rescan_records_the_new_mtime_of_a_directory_that_gained_an_entry() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        fs::create_dir_all(root.join("app/src")).unwrap();
        fs::write(root.join("app/src/lib.rs"), "lib").unwrap();
        fs::write(root.join("top.txt"), "top").unwrap();
        let opts = options(&root);
        let before = run(&opts);
        let old = filetime(&root.join("app/src"), 1_600_000_000);
        fs::write(root.join("app/src/new.rs"), "new").unwrap();
        fs::remove_file(root.join("top.txt")).unwrap();
        assert_ne!(fs::metadata(root.join("app/src")).unwrap().mtime(), old);
        let dirty = HashSet::from([b"app/src".to_vec(), Vec::new()]);
        let after = rescan(&opts, &before, &dirty, &Touched::new(), &|_| {}).unwrap();
        let full = run(&opts);
        assert_eq!(after.dirs, full.dirs, "a partial walk equals a full walk");
        assert_ne!(before.dirs, full.dirs);
    }

    /// Sets `path`'s mtime to `secs` and returns it.
    fn filetime(path: &Path, secs: i64) -> i64 {
        let time = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs as u64);
        fs::File::open(path).unwrap().set_modified(time).unwrap();
        fs::metadata(path).unwrap().mtime()
    }

    #[test]
    fn a_git_directory_is_never_matched_even_by_a_catch_all_pattern() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        git(&root, &["init", "-q"]);
        fs::write(root.join(".gitignore"), ".*\n").unwrap();
        let mut opts = options(&root);
        opts.skip_ignored = true;
        let got = listing(&run(&opts));
        assert!(got.contains_key(".git/HEAD"), "{got:#?}");
        assert!(!got.contains_key(".gitignore"));
    }
}
