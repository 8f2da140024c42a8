//! Git metadata of the repositories in a workspace, recorded with each checkpoint.
//!
//! For every repository the walk finds, this reads (locally, never touching
//! the network) the branch, HEAD, upstream, how far ahead and behind the
//! upstream it is, the counts of staged, unstaged and untracked paths, and
//! the stash count. It only reads: the index is not refreshed or written,
//! no lock file is taken, nothing in the repository changes.
//!
//! `git status --porcelain=v2 --no-optional-locks` reads it when a `git`
//! binary is there: it stats the tracked files on several threads, about
//! three times faster than libgit2's status on a repository of 80k files,
//! and the status runs while the agent waits for its checkpoint. libgit2
//! reads it otherwise, to the same counts.
//!
//! [`Inspector`] does this on its own thread while the walk is still going
//! (in a resident runner, right after it), so the metadata costs no wall
//! time in a checkpoint. A resident runner keeps each reading
//! ([`StatusMemory`]) and reads next time only what changed since
//! ([`narrow`]), working it out itself from the walk and the parsed index
//! where it can ([`derive`]) and asking git otherwise: the status of a
//! large repository then costs what changed, not what is tracked.

pub mod command;
pub mod derive;
pub mod index;
pub mod narrow;

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread;

use cairn_proto::pb;
use git2::{ErrorCode, Repository, Status, StatusOptions};
use serde::Serialize;

use self::index::IndexEntries;
use self::narrow::{Records, RepoStatus};
use crate::gitobj;
use crate::scan::{RepoFound, Scan, display_rel};

/// The state of one repository.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RepoState {
    /// Relative to the workspace root ("" for the root itself).
    pub path: String,
    /// Empty when HEAD is detached.
    pub branch: String,
    /// Commit id of HEAD; empty before the first commit.
    pub head: String,
    /// e.g. `origin/main`; empty when the branch tracks nothing.
    pub upstream: String,
    pub ahead: u32,
    pub behind: u32,
    /// Paths whose index entry differs from HEAD.
    pub staged: u32,
    /// Tracked paths whose working copy differs from the index.
    pub unstaged: u32,
    /// Untracked files (not ignored), counted one by one.
    pub untracked: u32,
    pub stashes: u32,
    pub detached: bool,
}

impl From<RepoState> for pb::GitRepoState {
    fn from(s: RepoState) -> Self {
        Self {
            path: s.path,
            branch: s.branch,
            head: s.head,
            upstream: s.upstream,
            ahead: s.ahead,
            behind: s.behind,
            staged: s.staged,
            unstaged: s.unstaged,
            untracked: s.untracked,
            stashes: s.stashes,
            detached: s.detached,
        }
    }
}

/// Why a repository's metadata could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read git repository {path}: {message}")]
pub struct GitError {
    pub path: String,
    pub message: String,
}

pub use crate::libgit2::init;

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Reads the state of the repository whose working directory is `dir`:
/// with the git command line, else with libgit2.
pub fn inspect(dir: &Path, rel: &str) -> Result<RepoState, GitError> {
    match status_with_cli(dir, rel, &[]) {
        Some(read) => read.map(|(state, _)| state),
        None => inspect_with_libgit2(dir, rel),
    }
}

/// Reads the state of a resident runner's repository, and what the next
/// reading needs: for only what changed since `since` when it is given
/// (see [`narrow`]).
fn inspect_following(
    found: &RepoFound,
    rel: &str,
    since: Option<&Since>,
    trees: &gitobj::TreeCache,
) -> Result<(RepoState, Option<Arc<RepoStatus>>), GitError> {
    let dir = &found.dir;
    let started = std::time::Instant::now();
    let ms = || started.elapsed().as_millis() as u64;
    let reading = match since {
        Some(since) => narrow::plan(
            &since.previous,
            &since.old,
            &since.new,
            &found.rel,
            dir,
            trees,
        ),
        None => narrow::Reading::Full {
            why: "the first reading",
        },
    };
    tracing::trace!(repository = rel, elapsed_ms = ms(), "git status planned");
    match reading {
        narrow::Reading::Unchanged => {
            let previous = &since
                .expect("only a reading with a previous one is unchanged")
                .previous;
            Ok((previous.state.clone(), Some(previous.clone())))
        }
        narrow::Reading::Full { why } => {
            tracing::debug!(
                repository = rel,
                why,
                elapsed_ms = ms(),
                "git status read in full"
            );
            // Read before git runs: whatever changes in between is in the
            // status too, and differs again from these next time.
            let head = narrow::read_head(dir).ok();
            let index = IndexEntries::read(&dir.join(".git/index"))
                .ok()
                .map(Arc::new);
            match status_with_cli(dir, rel, &[]) {
                Some(read) => {
                    let (state, records) = read?;
                    let remembered = head.map(|head| {
                        Arc::new(RepoStatus {
                            state: state.clone(),
                            records,
                            head,
                            index,
                            narrowed: 0,
                            read_by: narrow::ReadBy::FullGit,
                        })
                    });
                    Ok((state, remembered))
                }
                None => Ok((inspect_with_libgit2(dir, rel)?, None)),
            }
        }
        narrow::Reading::Narrow {
            pathspecs,
            dirs,
            paths,
            head,
            index,
            refs_changed,
            rules_changed,
        } => {
            let since = since.expect("only a reading with a previous one is narrowed");
            let covered = derive::Covered {
                dirs: &dirs,
                paths: &paths,
                head,
                index: index.as_deref(),
                refs_changed,
                rules_changed,
                old: &since.old,
            };
            let derived = match since.derive {
                true => derive::derive(
                    dir,
                    &found.rel,
                    &since.new,
                    &since.previous,
                    &covered,
                    trees,
                ),
                false => Err(derive::LeftToGit("only git reads it")),
            };
            let (mut state, fresh, read_by) = match derived {
                Ok((state, fresh)) => {
                    tracing::debug!(
                        repository = rel,
                        dirs = dirs.len(),
                        paths = paths.len(),
                        elapsed_ms = ms(),
                        "git status worked out for what changed"
                    );
                    (state, fresh, narrow::ReadBy::Derived)
                }
                Err(derive::LeftToGit(why)) => {
                    tracing::debug!(
                        repository = rel,
                        why,
                        pathspecs = pathspecs.len(),
                        elapsed_ms = ms(),
                        "git status read for what changed"
                    );
                    match status_with_cli(dir, rel, &pathspecs) {
                        Some(read) => {
                            let (state, fresh) = read?;
                            tracing::debug!(repository = rel, elapsed_ms = ms(), "git status read");
                            (state, fresh, narrow::ReadBy::NarrowedGit)
                        }
                        None => return Ok((inspect_with_libgit2(dir, rel)?, None)),
                    }
                }
            };
            let records = narrow::merge(&since.previous.records, &dirs, &paths, fresh);
            count_records(&mut state, &records);
            Ok((
                state.clone(),
                Some(Arc::new(RepoStatus {
                    state,
                    records,
                    head,
                    index,
                    narrowed: since.previous.narrowed + 1,
                    read_by,
                })),
            ))
        }
    }
}

/// Reads the state with `git status`, for `pathspecs` only when there are
/// any; None when git cannot be started.
fn status_with_cli(
    dir: &Path,
    rel: &str,
    pathspecs: &[OsString],
) -> Option<Result<(RepoState, Records), GitError>> {
    let mut command = crate::git::command::command(dir);
    command.args([
        // A monitor daemon would be started in the sandbox for one read.
        "-c",
        "core.fsmonitor=false",
        "--no-optional-locks",
        "status",
        "--porcelain=v2",
        "-z",
        "--branch",
        "--show-stash",
        "--untracked-files=all",
        "--no-renames",
        "--ignore-submodules=none",
    ]);
    if !pathspecs.is_empty() {
        command.arg("--").args(pathspecs);
    }
    let output = command.output().ok()?;
    if !output.status.success() {
        return Some(Err(GitError {
            path: display_rel(rel.as_bytes()),
            message: crate::git::command::GitOutput::from(output).message(),
        }));
    }
    Some(Ok(parse_status(rel, &output.stdout)))
}

/// The state `git status --porcelain=v2 -z --branch --show-stash` printed,
/// and the records it listed.
fn parse_status(rel: &str, printed: &[u8]) -> (RepoState, Records) {
    let mut state = RepoState {
        path: rel.to_owned(),
        ..RepoState::default()
    };
    let mut records = Records::new();
    let mut upstream = String::new();
    for record in printed.split(|b| *b == 0).filter(|r| !r.is_empty()) {
        let (kind, rest) = match record.iter().position(|b| *b == b' ') {
            Some(space) => (&record[..space], &record[space + 1..]),
            None => (record, &b""[..]),
        };
        // (fields before the path, after the kind)
        let path_after = match kind {
            b"#" => {
                read_header(&mut state, &mut upstream, &String::from_utf8_lossy(record));
                continue;
            }
            b"1" => 7,
            b"u" => 9,
            b"?" => 0,
            // Renames are not asked for; ignored files neither.
            _ => continue,
        };
        let mut fields = rest.splitn(path_after + 1, |b| *b == b' ');
        let xy = if path_after > 0 {
            fields.next().unwrap_or(b"..")
        } else {
            b".."
        };
        let Some(path) = fields.nth(path_after.saturating_sub(1)) else {
            continue;
        };
        let kinds = match kind {
            b"?" => narrow::UNTRACKED,
            b"u" => narrow::UNSTAGED,
            _ => {
                let bit = |changed: bool, bit: u8| if changed { bit } else { 0 };
                bit(xy.first().is_some_and(|x| *x != b'.'), narrow::STAGED)
                    | bit(xy.get(1).is_some_and(|y| *y != b'.'), narrow::UNSTAGED)
            }
        };
        // A path staged for deletion and on disk again is listed twice.
        *records.entry(path.to_vec()).or_default() |= kinds;
    }
    count_records(&mut state, &records);
    (state, records)
}

/// One `# …` header line of `git status --porcelain=v2 --branch --show-stash`.
fn read_header(state: &mut RepoState, upstream: &mut String, record: &str) {
    let mut words = record.split(' ').skip(1);
    match (words.next(), words.next()) {
        (Some("branch.oid"), Some(oid)) if oid != "(initial)" => {
            state.head = oid.to_owned();
        }
        (Some("branch.head"), Some("(detached)")) => state.detached = true,
        (Some("branch.head"), Some(_)) => {
            state.branch = record["# branch.head ".len()..].to_owned();
        }
        (Some("branch.upstream"), Some(_)) => {
            *upstream = record["# branch.upstream ".len()..].to_owned();
        }
        // Printed only when the upstream exists: one that is gone
        // counts as none, as libgit2 has it.
        (Some("branch.ab"), Some(ahead)) => {
            let number = |word: Option<&str>, sign: char| {
                word.and_then(|w| w.strip_prefix(sign))
                    .and_then(|n| n.parse::<u32>().ok())
                    .unwrap_or(0)
            };
            state.ahead = number(Some(ahead), '+');
            state.behind = number(words.next(), '-');
            state.upstream = std::mem::take(upstream);
        }
        (Some("stash"), Some(n)) => state.stashes = n.parse().unwrap_or(0),
        _ => {}
    }
}

/// The counts of `state` from `records`.
fn count_records(state: &mut RepoState, records: &Records) {
    let with = |bit: u8| count(records.values().filter(|kinds| *kinds & bit != 0).count());
    state.staged = with(narrow::STAGED);
    state.unstaged = with(narrow::UNSTAGED);
    state.untracked = with(narrow::UNTRACKED);
}

/// Reads the state with libgit2.
fn inspect_with_libgit2(dir: &Path, rel: &str) -> Result<RepoState, GitError> {
    init();
    let fail = |e: git2::Error| GitError {
        path: display_rel(rel.as_bytes()),
        message: e.message().to_owned(),
    };
    let mut repo = Repository::open(dir).map_err(fail)?;
    let mut state = RepoState {
        path: rel.to_owned(),
        ..RepoState::default()
    };

    read_refs(&mut repo, &mut state).map_err(fail)?;

    let mut options = StatusOptions::new();
    options
        .include_untracked(true)
        .recurse_untracked_dirs(true)
        .include_ignored(false)
        .exclude_submodules(false);
    {
        let statuses = repo.statuses(Some(&mut options)).map_err(fail)?;
        let staged_bits = Status::INDEX_NEW
            | Status::INDEX_MODIFIED
            | Status::INDEX_DELETED
            | Status::INDEX_RENAMED
            | Status::INDEX_TYPECHANGE;
        let unstaged_bits = Status::WT_MODIFIED
            | Status::WT_DELETED
            | Status::WT_RENAMED
            | Status::WT_TYPECHANGE
            | Status::CONFLICTED;
        let (mut staged, mut unstaged, mut untracked) = (0usize, 0usize, 0usize);
        for entry in statuses.iter() {
            let status = entry.status();
            staged += usize::from(status.intersects(staged_bits));
            unstaged += usize::from(status.intersects(unstaged_bits));
            untracked += usize::from(status.contains(Status::WT_NEW));
        }
        state.staged = count(staged);
        state.unstaged = count(unstaged);
        state.untracked = count(untracked);
    }

    Ok(state)
}

/// The branch, HEAD, upstream, ahead and behind counts and stash count of
/// `repo`, into `state`: what `git status --branch --show-stash` heads its
/// listing with.
pub(crate) fn read_refs(repo: &mut Repository, state: &mut RepoState) -> Result<(), git2::Error> {
    state.detached = repo.head_detached()?;
    match repo.head() {
        Ok(head) => {
            let local = head.target();
            if let Some(oid) = local {
                state.head = oid.to_string();
            }
            if head.is_branch() {
                state.branch = head.shorthand().unwrap_or_default().to_owned();
                let branch = git2::Branch::wrap(head);
                match branch.upstream() {
                    Ok(upstream) => {
                        state.upstream = upstream
                            .name()
                            .ok()
                            .flatten()
                            .unwrap_or_default()
                            .to_owned();
                        if let (Some(local), Some(remote)) = (local, upstream.get().target()) {
                            let (ahead, behind) = repo.graph_ahead_behind(local, remote)?;
                            state.ahead = count(ahead);
                            state.behind = count(behind);
                        }
                    }
                    Err(e) if e.code() == ErrorCode::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
        // Before the first commit HEAD names a branch that does not exist yet.
        Err(e) if e.code() == ErrorCode::UnbornBranch => {
            if let Ok(head) = repo.find_reference("HEAD")
                && let Some(target) = head.symbolic_target()
            {
                state.branch = target
                    .strip_prefix("refs/heads/")
                    .unwrap_or(target)
                    .to_owned();
            }
        }
        Err(e) => return Err(e),
    }

    let mut stashes = 0usize;
    match repo.stash_foreach(|_, _, _| {
        stashes += 1;
        true
    }) {
        Ok(()) => {}
        Err(e) if e.code() == ErrorCode::NotFound => {}
        Err(e) => return Err(e),
    }
    state.stashes = count(stashes);
    Ok(())
}

/// A resident runner's last reading of each repository, and the walk it
/// followed: what the next reading narrows itself to (see [`narrow`]).
#[derive(Debug, Clone)]
pub struct StatusMemory {
    pub walk: Arc<Scan>,
    /// By the repository's path relative to the root.
    pub repos: HashMap<Vec<u8>, Arc<RepoStatus>>,
}

/// What a reading narrows itself against.
#[derive(Debug)]
struct Since {
    previous: Arc<RepoStatus>,
    old: Arc<Scan>,
    new: Arc<Scan>,
    /// Whether a narrowed reading may be worked out without git
    /// ([`derive`]); the tests also read through git alone.
    derive: bool,
}

#[derive(Debug)]
struct Job {
    found: RepoFound,
    /// Whether the reading is kept for the next one (a resident runner).
    remember: bool,
    since: Option<Since>,
}

/// What the inspector read.
#[derive(Debug, Default)]
pub struct Inspected {
    /// Sorted by path.
    pub repos: Vec<RepoState>,
    /// One per repository that could not be read.
    pub warnings: Vec<String>,
    /// What the next reading of each repository narrows itself against;
    /// only for repositories queued with [`Inspector::submit_following`].
    pub statuses: HashMap<Vec<u8>, Arc<RepoStatus>>,
}

/// Reads repositories on a background thread as the walk reports them.
#[derive(Debug)]
pub struct Inspector {
    sender: mpsc::Sender<Job>,
    thread: thread::JoinHandle<Inspected>,
    trees: Arc<gitobj::TreeCache>,
}

impl Inspector {
    pub fn start() -> Self {
        let (sender, receiver) = mpsc::channel::<Job>();
        let trees = Arc::new(gitobj::TreeCache::default());
        let shared = trees.clone();
        let thread = thread::Builder::new()
            .name("cairn-git".into())
            .spawn(move || {
                let mut inspected = Inspected::default();
                for job in receiver {
                    let rel = String::from_utf8_lossy(&job.found.rel).into_owned();
                    let read = if job.remember {
                        inspect_following(&job.found, &rel, job.since.as_ref(), &shared)
                    } else {
                        inspect(&job.found.dir, &rel).map(|state| (state, None))
                    };
                    match read {
                        Ok((state, remembered)) => {
                            inspected.repos.push(state);
                            if let Some(status) = remembered {
                                inspected.statuses.insert(job.found.rel, status);
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "git metadata unavailable");
                            inspected.warnings.push(e.to_string());
                        }
                    }
                }
                inspected.repos.sort_by(|a, b| a.path.cmp(&b.path));
                inspected
            })
            .expect("spawning a thread only fails when the process is out of resources");
        Self {
            sender,
            thread,
            trees,
        }
    }

    /// The git trees its readings read, for the checkpoint's other readers.
    pub fn trees(&self) -> Arc<gitobj::TreeCache> {
        self.trees.clone()
    }

    /// Queues a repository (called from the walk's threads).
    pub fn submit(&self, found: RepoFound) {
        self.send(Job {
            found,
            remember: false,
            since: None,
        });
    }

    /// Queues a repository of a resident runner that has no earlier reading
    /// to narrow from: read in full, and remembered for the next reading.
    pub fn submit_remembered(&self, found: RepoFound) {
        self.send(Job {
            found,
            remember: true,
            since: None,
        });
    }

    /// Queues a repository of a resident runner's walk `walk`, read for only
    /// what changed since `memory` read it, and remembered for the next
    /// reading.
    pub fn submit_following(
        &self,
        found: RepoFound,
        memory: Option<&StatusMemory>,
        walk: &Arc<Scan>,
    ) {
        let since = memory.and_then(|memory| {
            Some(Since {
                previous: memory.repos.get(&found.rel)?.clone(),
                old: memory.walk.clone(),
                new: walk.clone(),
                derive: true,
            })
        });
        self.send(Job {
            found,
            remember: true,
            since,
        });
    }

    fn send(&self, job: Job) {
        // The receiver lives until `finish`, which consumes `self`.
        let _ = self.sender.send(job);
    }

    /// Waits for every queued repository.
    pub fn finish(self) -> Inspected {
        drop(self.sender);
        self.thread.join().unwrap_or_else(|_| Inspected {
            warnings: vec!["git metadata is missing: the reading thread panicked".to_owned()],
            ..Inspected::default()
        })
    }
}

/// Git for tests (this crate's, and with the `testing` feature other
/// crates'): a fixed identity, `main` as the first branch, and a panic (with
/// git's words) when a command fails.
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use std::fs;
    use std::path::Path;
    #[cfg(test)]
    use std::path::PathBuf;
    use std::process::Command;
    #[cfg(test)]
    use std::sync::Arc;

    #[cfg(test)]
    use super::narrow::{Reading, Records, RepoStatus, plan};
    #[cfg(test)]
    use super::{Since, inspect_following, status_with_cli};
    #[cfg(test)]
    use crate::scan::{RepoFound, Scan, ScanOptions};

    /// Runs `git ARGS` in `dir`; returns its stdout, trimmed.
    pub fn git(dir: &Path, args: &[&str]) -> String {
        let out = Command::new("git")
            .args([
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@example.com",
                "-c",
                "init.defaultBranch=main",
            ])
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }

    /// Writes `content` to `file` in the repository `dir` and commits it
    /// with `message`; returns the new HEAD.
    pub fn commit(dir: &Path, file: &str, content: &str, message: &str) -> String {
        fs::write(dir.join(file), content).unwrap();
        git(dir, &["add", file]);
        git(dir, &["commit", "-qm", message]);
        git(dir, &["rev-parse", "HEAD"])
    }

    /// A workspace with one repository, read by a resident runner: each
    /// [`Workspace::read`] walks it again, reads the status against the
    /// last reading and checks it against a full `git status`.
    #[cfg(test)]
    #[derive(Debug)]
    pub struct Workspace {
        pub root: PathBuf,
        pub repo: PathBuf,
        found: RepoFound,
        walk: Arc<Scan>,
        pub status: Arc<RepoStatus>,
        /// Whether narrowed readings may be worked out without git.
        pub derive: bool,
    }

    #[cfg(test)]
    impl Workspace {
        pub fn scan(root: &Path) -> Arc<Scan> {
            let opts = ScanOptions {
                root: root.to_path_buf(),
                skip_ignored: false,
                excludes: Vec::new(),
                exclude_paths: Vec::new(),
            };
            Arc::new(crate::scan::scan(&opts, &|_| {}).unwrap())
        }

        /// A workspace whose repository is at `repo/`, read once in full.
        pub fn new(root: &Path) -> Self {
            let repo = root.join("repo");
            fs::create_dir_all(&repo).unwrap();
            git(&repo, &["init", "-q"]);
            let found = RepoFound {
                dir: repo.clone(),
                rel: b"repo".to_vec(),
            };
            let walk = Self::scan(root);
            let (_, status) =
                inspect_following(&found, "repo", None, &crate::gitobj::TreeCache::default())
                    .unwrap();
            Self {
                root: root.to_path_buf(),
                repo,
                found,
                walk,
                status: status.expect("a reading through git is remembered"),
                derive: true,
            }
        }

        pub fn write(&self, path: &str, content: &str) {
            let path = self.repo.join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, content).unwrap();
        }

        pub fn git(&self, args: &[&str]) -> String {
            git(&self.repo, args)
        }

        /// What the next reading asks git.
        pub fn plan(&self) -> Reading {
            self.plan_for(&Self::scan(&self.root))
        }

        fn plan_for(&self, new: &Scan) -> Reading {
            let trees = crate::gitobj::TreeCache::default();
            plan(&self.status, &self.walk, new, b"repo", &self.repo, &trees)
        }

        /// Reads the status against the last reading, checks it against a
        /// full one, and keeps it; returns the directories it was narrowed
        /// to (None for a full reading).
        pub fn read(&mut self) -> Option<Vec<String>> {
            let new = Self::scan(&self.root);
            let narrowed = match self.plan_for(&new) {
                Reading::Narrow { dirs, .. } => {
                    let mut dirs: Vec<String> = dirs
                        .iter()
                        .map(|d| String::from_utf8_lossy(d).into_owned())
                        .collect();
                    dirs.sort();
                    Some(dirs)
                }
                Reading::Full { .. } => None,
                Reading::Unchanged => Some(Vec::new()),
            };
            let since = Since {
                previous: self.status.clone(),
                old: self.walk.clone(),
                new: new.clone(),
                derive: self.derive,
            };
            let trees = crate::gitobj::TreeCache::default();
            let (state, status) =
                inspect_following(&self.found, "repo", Some(&since), &trees).unwrap();
            let status = status.unwrap();
            let (full_state, full_records) =
                status_with_cli(&self.repo, "repo", &[]).unwrap().unwrap();
            let shown = |records: &Records| {
                records
                    .iter()
                    .map(|(p, k)| format!("{} {k}", String::from_utf8_lossy(p)))
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                shown(&status.records),
                shown(&full_records),
                "narrowed to {narrowed:?}"
            );
            assert_eq!(state, full_state);
            self.walk = new;
            self.status = status;
            narrowed
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::testing::git;
    use super::*;

    fn commit(dir: &Path, file: &str, content: &str) {
        super::testing::commit(dir, file, content, file);
    }

    #[test]
    fn a_working_repository_reports_branch_upstream_and_every_count() {
        let tmp = tempfile::tempdir().unwrap();
        let origin = tmp.path().join("origin.git");
        fs::create_dir(&origin).unwrap();
        git(&origin, &["init", "-q", "--bare"]);
        let work = tmp.path().join("work");
        let other = tmp.path().join("other");
        git(
            tmp.path(),
            &["clone", "-q", origin.to_str().unwrap(), "work"],
        );
        commit(&work, "a.txt", "a\n");
        git(&work, &["push", "-q", "origin", "main"]);
        git(
            tmp.path(),
            &["clone", "-q", origin.to_str().unwrap(), "other"],
        );
        // Two commits the work clone has not pushed, one it has not fetched.
        commit(&other, "o.txt", "o\n");
        git(&other, &["push", "-q", "origin", "main"]);
        commit(&work, "b.txt", "b\n");
        commit(&work, "c.txt", "c\n");
        git(&work, &["fetch", "-q"]);
        // A stash, then: one staged, one unstaged, two untracked, one ignored.
        fs::write(work.join("a.txt"), "stashed\n").unwrap();
        git(&work, &["stash", "-q"]);
        fs::write(work.join("b.txt"), "staged\n").unwrap();
        git(&work, &["add", "b.txt"]);
        fs::write(work.join("c.txt"), "unstaged\n").unwrap();
        fs::create_dir(work.join("new")).unwrap();
        fs::write(work.join("new/u1"), "u\n").unwrap();
        fs::write(work.join("new/u2"), "u\n").unwrap();
        fs::write(work.join(".git/info/exclude"), "*.log\n").unwrap();
        fs::write(work.join("build.log"), "ignored\n").unwrap();
        let index_before = fs::read(work.join(".git/index")).unwrap();
        let index_mtime = fs::metadata(work.join(".git/index"))
            .unwrap()
            .modified()
            .unwrap();

        let state = inspect(&work, "work").unwrap();
        assert_eq!(
            inspect_with_libgit2(&work, "work").unwrap(),
            state,
            "git and libgit2 read the same state"
        );
        let head = git(&work, &["rev-parse", "HEAD"]);
        assert_eq!(
            state,
            RepoState {
                path: "work".into(),
                branch: "main".into(),
                head,
                upstream: "origin/main".into(),
                ahead: 2,
                behind: 1,
                staged: 1,
                unstaged: 1,
                untracked: 2,
                stashes: 1,
                detached: false,
            }
        );
        assert_eq!(
            fs::read(work.join(".git/index")).unwrap(),
            index_before,
            "the index must not be rewritten"
        );
        assert_eq!(
            fs::metadata(work.join(".git/index"))
                .unwrap()
                .modified()
                .unwrap(),
            index_mtime
        );
        assert!(!work.join(".git/index.lock").exists());
    }

    #[test]
    fn git_status_output_is_counted_like_libgit2() {
        let printed = b"# branch.oid 0123456789abcdef0123456789abcdef01234567\0\
# branch.head feature/x\0# branch.upstream origin/gone\0\
1 M. N... 100644 100644 100644 aaaa bbbb staged.rs\0\
1 .M N... 100644 100644 100644 aaaa aaaa unstaged.rs\0\
1 MM N... 100644 100644 100644 aaaa bbbb both.rs\0\
u UU N... 100644 100644 100644 100644 aaaa bbbb cccc conflict.rs\0\
? new file with spaces\0? other\0";
        let (state, records) = parse_status("repo", printed);
        let listed: Vec<(&str, u8)> = records
            .iter()
            .map(|(path, kinds)| (std::str::from_utf8(path).unwrap(), *kinds))
            .collect();
        use narrow::{STAGED, UNSTAGED, UNTRACKED};
        assert_eq!(
            listed,
            [
                ("both.rs", STAGED | UNSTAGED),
                ("conflict.rs", UNSTAGED),
                ("new file with spaces", UNTRACKED),
                ("other", UNTRACKED),
                ("staged.rs", STAGED),
                ("unstaged.rs", UNSTAGED),
            ]
        );
        assert_eq!(
            state,
            RepoState {
                path: "repo".into(),
                branch: "feature/x".into(),
                head: "0123456789abcdef0123456789abcdef01234567".into(),
                // Configured but gone: no `branch.ab` line, so none.
                upstream: String::new(),
                staged: 2,
                unstaged: 3,
                untracked: 2,
                ..RepoState::default()
            }
        );
        let (tracking, _) = parse_status(
            "",
            b"# branch.oid (initial)\0# branch.head (detached)\0# stash 3\0",
        );
        assert!(tracking.detached && tracking.head.is_empty() && tracking.branch.is_empty());
        assert_eq!(tracking.stashes, 3);
    }

    #[test]
    fn a_detached_head_has_no_branch() {
        let tmp = tempfile::tempdir().unwrap();
        git(tmp.path(), &["init", "-q"]);
        commit(tmp.path(), "a", "1");
        commit(tmp.path(), "b", "2");
        git(tmp.path(), &["checkout", "-q", "--detach", "HEAD~1"]);
        let state = inspect(tmp.path(), "").unwrap();
        assert_eq!(inspect_with_libgit2(tmp.path(), "").unwrap(), state);
        assert!(state.detached);
        assert_eq!(state.branch, "");
        assert_eq!(state.upstream, "");
        assert_eq!(state.head, git(tmp.path(), &["rev-parse", "HEAD"]));
    }

    #[test]
    fn a_repository_without_commits_names_its_unborn_branch() {
        let tmp = tempfile::tempdir().unwrap();
        git(tmp.path(), &["init", "-q"]);
        fs::write(tmp.path().join("x"), "x").unwrap();
        let state = inspect(tmp.path(), "").unwrap();
        assert_eq!(inspect_with_libgit2(tmp.path(), "").unwrap(), state);
        assert_eq!(
            (state.branch.as_str(), state.head.as_str(), state.untracked),
            ("main", "", 1)
        );
    }

    #[test]
    fn an_unreadable_repository_becomes_a_warning() {
        let tmp = tempfile::tempdir().unwrap();
        let broken = tmp.path().join("broken");
        fs::create_dir_all(broken.join(".git")).unwrap();
        let inspector = Inspector::start();
        inspector.submit(RepoFound {
            dir: broken,
            rel: b"broken".to_vec(),
        });
        let Inspected {
            repos, warnings, ..
        } = inspector.finish();
        assert!(repos.is_empty());
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].starts_with("cannot read git repository broken:"),
            "{warnings:?}"
        );
    }
}
