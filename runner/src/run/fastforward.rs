//! Bringing each checkout up to date before the harness starts.
//!
//! A shared workspace may sit for a while between stations, and meanwhile
//! people push to the branch (a fix on the pull request). For every git
//! checkout under the root whose branch has an upstream, the runner fetches
//! the upstream's remote and, if the branch is only behind, fast-forwards it
//! (`git merge --ff-only`), keeping uncommitted work that is not in the way.
//! It never merges, rebases or discards anything: a branch that diverged,
//! uncommitted changes the update would overwrite, or a failed fetch leave
//! the checkout as it is, and the prepare step says why. Nothing here fails
//! a run.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::listed;
use cairn_engine::git::command::{GitOutput, git, short};
use cairn_utils::text::plural;

/// How long a fetch may take.
pub const FETCH_LIMIT: Duration = Duration::from_secs(120);
/// How long a local git command may take.
pub const LOCAL_LIMIT: Duration = Duration::from_secs(60);
/// How deep under the root checkouts are looked for.
const MAX_DEPTH: usize = 3;

/// A git checkout in the workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkout {
    /// Relative to the root, `/`-separated; "." for the root itself.
    pub name: String,
    pub dir: PathBuf,
}

/// The git checkouts under `root` (the root itself, or directories up to
/// [`MAX_DEPTH`] levels down that hold a `.git`), in name order. Hidden
/// directories (`.cairn` among them) and symlinks are not entered, nor are
/// checkouts (their nested repositories are theirs).
pub fn find_checkouts(root: &Path) -> Vec<Checkout> {
    let mut found = Vec::new();
    let mut level = vec![(String::new(), root.to_path_buf())];
    for depth in 0..=MAX_DEPTH {
        let mut next = Vec::new();
        for (name, dir) in level {
            if fs::symlink_metadata(dir.join(".git")).is_ok() {
                found.push(Checkout {
                    name: if name.is_empty() { ".".into() } else { name },
                    dir,
                });
                continue;
            }
            if depth == MAX_DEPTH {
                continue;
            }
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.filter_map(Result::ok) {
                let file_name = entry.file_name();
                let Some(child) = file_name.to_str() else {
                    continue;
                };
                if child.starts_with('.') || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                let child_name = if name.is_empty() {
                    child.to_owned()
                } else {
                    format!("{name}/{child}")
                };
                next.push((child_name, entry.path()));
            }
        }
        level = next;
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    found
}

/// What the fast-forward step did with one checkout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FastForward {
    /// HEAD is detached or the branch tracks nothing: not touched.
    NoUpstream,
    /// Nothing was pushed since; `ahead` local commits are not pushed.
    UpToDate {
        branch: String,
        upstream: String,
        ahead: u32,
    },
    FastForwarded {
        branch: String,
        commits: u32,
        from: String,
        to: String,
    },
    /// Both sides have commits the other lacks.
    Diverged {
        branch: String,
        upstream: String,
        local: u32,
        remote: u32,
    },
    /// Uncommitted changes to these paths would be overwritten.
    InTheWay {
        paths: Vec<String>,
    },
    FetchFailed {
        remote: String,
        error: String,
    },
    /// Something else stopped it (git's words).
    LeftAsIs {
        reason: String,
    },
}

impl FastForward {
    /// The prepare step's line for checkout `name`; `None` when there was
    /// nothing to do.
    pub fn describe(&self, name: &str) -> Option<String> {
        Some(match self {
            Self::NoUpstream => return None,
            Self::UpToDate { ahead: 0, .. } => format!("{name}: up to date"),
            Self::UpToDate {
                branch,
                upstream,
                ahead,
            } => format!(
                "{name}: up to date with {upstream} ({branch} has {} not pushed)",
                plural(u64::from(*ahead), "commit", "commits")
            ),
            Self::FastForwarded {
                branch,
                commits,
                from,
                to,
            } => format!(
                "{name}: fast-forwarded {branch} {} ({}..{})",
                plural(u64::from(*commits), "commit", "commits"),
                short(from),
                short(to)
            ),
            Self::Diverged {
                branch,
                upstream,
                local,
                remote,
            } => format!(
                "{name}: left as it is: {branch} has diverged from {upstream} ({local} local, {remote} remote commits)"
            ),
            Self::InTheWay { paths } => format!(
                "{name}: left as it is: uncommitted changes to {} would be overwritten",
                listed(paths)
            ),
            Self::FetchFailed { remote, error } => {
                format!("{name}: cannot fetch {remote}: {error}")
            }
            Self::LeftAsIs { reason } => format!("{name}: left as it is: {reason}"),
        })
    }
}

/// A git step; one that did not run to its end is the reason to leave the
/// checkout alone.
async fn git_step(dir: &Path, args: &[&str], limit: Duration) -> Result<GitOutput, FastForward> {
    git(dir, args, limit)
        .await
        .map_err(|e| FastForward::LeftAsIs {
            reason: e.to_string(),
        })
}

/// A git step that must succeed: git's own account of a failure is the
/// reason to leave the checkout alone.
async fn git_ok(dir: &Path, args: &[&str], limit: Duration) -> Result<GitOutput, FastForward> {
    let out = git_step(dir, args, limit).await?;
    if out.success() {
        Ok(out)
    } else {
        Err(FastForward::LeftAsIs {
            reason: out.message(),
        })
    }
}

/// Fetches the upstream of the checkout in `dir` and fast-forwards its
/// branch when it is only behind and no uncommitted change is in the way.
pub async fn fast_forward(dir: &Path) -> FastForward {
    match try_fast_forward(dir).await {
        Ok(done) | Err(done) => done,
    }
}

async fn try_fast_forward(dir: &Path) -> Result<FastForward, FastForward> {
    let branch = git_step(dir, &["symbolic-ref", "-q", "--short", "HEAD"], LOCAL_LIMIT).await?;
    if !branch.success() {
        return Ok(FastForward::NoUpstream);
    }
    let branch = branch.text().to_owned();
    let upstream = git_step(
        dir,
        &["rev-parse", "--abbrev-ref", "--symbolic-full-name", "@{u}"],
        LOCAL_LIMIT,
    )
    .await?;
    if !upstream.success() {
        return Ok(FastForward::NoUpstream);
    }
    let upstream = upstream.text().to_owned();
    let key = format!("branch.{branch}.remote");
    let remote = git_step(dir, &["config", "--get", &key], LOCAL_LIMIT).await?;
    let remote = remote.text().to_owned();
    if !remote.is_empty() && remote != "." {
        let fetched = git(dir, &["fetch", "--quiet", "--", &remote], FETCH_LIMIT)
            .await
            .map_err(|e| FastForward::FetchFailed {
                remote: remote.clone(),
                error: e.to_string(),
            })?;
        if !fetched.success() {
            return Ok(FastForward::FetchFailed {
                remote,
                error: fetched.message(),
            });
        }
    }
    let counts = git_ok(
        dir,
        &["rev-list", "--left-right", "--count", "HEAD...@{u}"],
        LOCAL_LIMIT,
    )
    .await?;
    let (ahead, behind) = parse_counts(counts.text()).ok_or_else(|| FastForward::LeftAsIs {
        reason: format!("git rev-list answered {:?}", counts.text()),
    })?;
    if behind == 0 {
        return Ok(FastForward::UpToDate {
            branch,
            upstream,
            ahead,
        });
    }
    if ahead > 0 {
        return Ok(FastForward::Diverged {
            branch,
            upstream,
            local: ahead,
            remote: behind,
        });
    }
    let in_the_way = uncommitted_in_the_way(dir).await?;
    if !in_the_way.is_empty() {
        return Ok(FastForward::InTheWay { paths: in_the_way });
    }
    let from = git_step(dir, &["rev-parse", "HEAD"], LOCAL_LIMIT).await?;
    let from = from.text().to_owned();
    let merged = git_step(dir, &["merge", "--ff-only", "--quiet", "@{u}"], LOCAL_LIMIT).await?;
    if !merged.success() {
        let paths = overwritten_paths(&merged.stderr);
        return Ok(if paths.is_empty() {
            FastForward::LeftAsIs {
                reason: merged.message(),
            }
        } else {
            FastForward::InTheWay { paths }
        });
    }
    let to = git_step(dir, &["rev-parse", "HEAD"], LOCAL_LIMIT).await?;
    Ok(FastForward::FastForwarded {
        branch,
        commits: behind,
        from,
        to: to.text().to_owned(),
    })
}

/// `A\tB` of `git rev-list --left-right --count`.
fn parse_counts(text: &str) -> Option<(u32, u32)> {
    let mut numbers = text.split_whitespace().map(str::parse::<u32>);
    match (numbers.next(), numbers.next(), numbers.next()) {
        (Some(Ok(ahead)), Some(Ok(behind)), None) => Some((ahead, behind)),
        _ => None,
    }
}

/// Paths with uncommitted changes (staged, unstaged or untracked) that the
/// update from HEAD to the upstream would touch.
async fn uncommitted_in_the_way(dir: &Path) -> Result<Vec<String>, FastForward> {
    let status = git_ok(
        dir,
        &["status", "--porcelain=v1", "-z", "--untracked-files=all"],
        LOCAL_LIMIT,
    )
    .await?;
    let dirty = dirty_paths(&status.stdout);
    if dirty.is_empty() {
        return Ok(Vec::new());
    }
    let changed = git_ok(
        dir,
        &["diff", "--name-only", "-z", "--no-renames", "HEAD", "@{u}"],
        LOCAL_LIMIT,
    )
    .await?;
    let incoming: BTreeSet<&str> = changed
        .stdout
        .split('\0')
        .filter(|p| !p.is_empty())
        .collect();
    Ok(dirty
        .into_iter()
        .filter(|path| {
            incoming.contains(path.as_str())
                // An untracked file where the update puts a directory.
                || incoming.iter().any(|i| i.strip_prefix(path.as_str()).is_some_and(|r| r.starts_with('/')))
        })
        .collect())
}

/// The paths of `git status --porcelain=v1 -z` (both sides of a rename).
fn dirty_paths(porcelain: &str) -> BTreeSet<String> {
    let mut paths = BTreeSet::new();
    let mut entries = porcelain.split('\0').filter(|e| !e.is_empty());
    while let Some(entry) = entries.next() {
        let Some((code, path)) = entry.split_at_checked(3) else {
            continue;
        };
        paths.insert(path.to_owned());
        if code.starts_with(['R', 'C'])
            && let Some(original) = entries.next()
        {
            paths.insert(original.to_owned());
        }
    }
    paths
}

/// The tab-indented paths git lists when a merge would overwrite local changes.
fn overwritten_paths(stderr: &str) -> Vec<String> {
    if !stderr.contains("would be overwritten") {
        return Vec::new();
    }
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix('\t'))
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect()
}

/// Fast-forwards every checkout (of [`find_checkouts`]) except those named
/// in `skip` (just cloned: nothing can be newer); returns a line per checkout
/// that had an upstream.
pub async fn fast_forward_all(checkouts: &[Checkout], skip: &BTreeSet<String>) -> Vec<String> {
    let mut lines = Vec::new();
    for checkout in checkouts {
        if skip.contains(&checkout.name) {
            continue;
        }
        let done = fast_forward(&checkout.dir).await;
        match done.describe(&checkout.name) {
            Some(line) => {
                tracing::info!(checkout = %checkout.name, "{line}");
                lines.push(line);
            }
            None => {
                tracing::debug!(checkout = %checkout.name, "no upstream to fast-forward from")
            }
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_engine::git::testing::git as sh_git;

    fn commit(dir: &Path, file: &str, content: &str) -> String {
        cairn_engine::git::testing::commit(dir, file, content, &format!("change {file}"))
    }

    /// A bare remote with one commit, the workspace's clone `app`, and a
    /// person's clone to push from.
    struct Remote {
        _tmp: tempfile::TempDir,
        root: PathBuf,
        app: PathBuf,
        person: PathBuf,
    }

    impl Remote {
        fn new() -> Self {
            let tmp = tempfile::tempdir().unwrap();
            let base = tmp.path().to_path_buf();
            let origin = base.join("origin.git");
            fs::create_dir(&origin).unwrap();
            sh_git(&origin, &["init", "-q", "--bare"]);
            let seed = base.join("seed");
            sh_git(&base, &["clone", "-q", origin.to_str().unwrap(), "seed"]);
            commit(&seed, "x.rs", "fn x() {}\n");
            commit(&seed, "y.rs", "fn y() {}\n");
            sh_git(&seed, &["push", "-q", "origin", "main"]);
            let root = base.join("workspace");
            fs::create_dir(&root).unwrap();
            sh_git(&root, &["clone", "-q", origin.to_str().unwrap(), "app"]);
            sh_git(&base, &["clone", "-q", origin.to_str().unwrap(), "person"]);
            Self {
                app: root.join("app"),
                person: base.join("person"),
                root,
                _tmp: tmp,
            }
        }

        fn push(&self, file: &str, content: &str) -> String {
            let head = commit(&self.person, file, content);
            sh_git(&self.person, &["push", "-q", "origin", "main"]);
            head
        }

        fn head(&self) -> String {
            sh_git(&self.app, &["rev-parse", "HEAD"])
        }
    }

    #[tokio::test]
    async fn a_branch_that_is_only_behind_is_fast_forwarded() {
        let r = Remote::new();
        let from = r.head();
        r.push("z.rs", "fn z() {}\n");
        let to = r.push("x.rs", "fn x() { 1 }\n");
        // Uncommitted work that is not in the way stays.
        fs::write(r.app.join("y.rs"), "fn y() { local }\n").unwrap();
        fs::write(r.app.join("notes.txt"), "mine\n").unwrap();

        let done = fast_forward(&r.app).await;
        assert_eq!(
            done,
            FastForward::FastForwarded {
                branch: "main".into(),
                commits: 2,
                from: from.clone(),
                to: to.clone(),
            }
        );
        assert_eq!(r.head(), to);
        assert_eq!(
            done.describe("app").unwrap(),
            format!(
                "app: fast-forwarded main 2 commits ({}..{})",
                &from[..7],
                &to[..7]
            )
        );
        assert_eq!(
            fs::read_to_string(r.app.join("y.rs")).unwrap(),
            "fn y() { local }\n"
        );
        assert_eq!(
            fs::read_to_string(r.app.join("x.rs")).unwrap(),
            "fn x() { 1 }\n"
        );
        assert!(r.app.join("notes.txt").exists());

        let again = fast_forward(&r.app).await;
        assert_eq!(again.describe("app").unwrap(), "app: up to date");
    }

    #[tokio::test]
    async fn a_diverged_branch_is_left_with_the_reason() {
        let r = Remote::new();
        commit(&r.app, "local.rs", "fn local() {}\n");
        commit(&r.app, "local2.rs", "fn local2() {}\n");
        let before = r.head();
        r.push("z.rs", "fn z() {}\n");

        let done = fast_forward(&r.app).await;
        assert_eq!(r.head(), before, "nothing moved");
        assert_eq!(
            done.describe("app").unwrap(),
            "app: left as it is: main has diverged from origin/main (2 local, 1 remote commits)"
        );
    }

    #[tokio::test]
    async fn uncommitted_changes_in_the_way_leave_the_checkout_as_it_is() {
        let r = Remote::new();
        let before = r.head();
        r.push("x.rs", "fn x() { theirs }\n");
        fs::write(r.app.join("x.rs"), "fn x() { mine }\n").unwrap();

        let done = fast_forward(&r.app).await;
        assert_eq!(r.head(), before);
        assert_eq!(
            done.describe("app").unwrap(),
            "app: left as it is: uncommitted changes to x.rs would be overwritten"
        );
        assert_eq!(
            fs::read_to_string(r.app.join("x.rs")).unwrap(),
            "fn x() { mine }\n"
        );

        // An untracked file where the update brings one is in the way too.
        let r = Remote::new();
        r.push("new.rs", "fn theirs() {}\n");
        fs::write(r.app.join("new.rs"), "fn mine() {}\n").unwrap();
        assert_eq!(
            fast_forward(&r.app).await,
            FastForward::InTheWay {
                paths: vec!["new.rs".into()]
            }
        );
    }

    #[tokio::test]
    async fn checkouts_without_an_upstream_are_skipped_and_fetch_errors_reported() {
        let r = Remote::new();
        let lonely = r.root.join("lonely");
        fs::create_dir(&lonely).unwrap();
        sh_git(&lonely, &["init", "-q"]);
        commit(&lonely, "a", "a\n");
        assert_eq!(fast_forward(&lonely).await, FastForward::NoUpstream);
        assert_eq!(FastForward::NoUpstream.describe("lonely"), None);
        sh_git(&lonely, &["checkout", "-q", "--detach"]);
        assert_eq!(fast_forward(&lonely).await, FastForward::NoUpstream);

        sh_git(
            &r.app,
            &["remote", "set-url", "origin", "/nonexistent/origin.git"],
        );
        let done = fast_forward(&r.app).await;
        let line = done.describe("app").unwrap();
        assert!(
            line.starts_with("app: cannot fetch origin: ")
                && line.contains("/nonexistent/origin.git"),
            "{line}"
        );

        // Every checkout is found, hidden directories are not entered, and
        // only those with an upstream say something.
        fs::create_dir_all(r.root.join(".cairn/state/x")).unwrap();
        sh_git(&r.root.join(".cairn/state/x"), &["init", "-q"]);
        let names: Vec<String> = find_checkouts(&r.root)
            .into_iter()
            .map(|c| c.name)
            .collect();
        assert_eq!(names, ["app", "lonely"]);
        let lines = fast_forward_all(
            &find_checkouts(&r.root),
            &BTreeSet::from(["app".to_owned()]),
        )
        .await;
        assert!(lines.is_empty(), "{lines:?}");
    }

    #[test]
    fn porcelain_status_and_merge_refusals_are_read() {
        let status = " M src/a.rs\0?? new.txt\0R  b.rs\0old_b.rs\0";
        assert_eq!(
            dirty_paths(status).into_iter().collect::<Vec<_>>(),
            ["b.rs", "new.txt", "old_b.rs", "src/a.rs"]
        );
        let refusal = "error: Your local changes to the following files would be overwritten by merge:\n\
                       \tsrc/x.rs\n\tsrc/y.rs\nPlease commit your changes or stash them before you merge.\nAborting\n";
        assert_eq!(overwritten_paths(refusal), ["src/x.rs", "src/y.rs"]);
        assert!(overwritten_paths("fatal: something else\n").is_empty());
        assert_eq!(parse_counts("2\t1"), Some((2, 1)));
        assert_eq!(parse_counts("x"), None);
    }

    #[test]
    fn lines_count_and_list_in_words() {
        let ahead = FastForward::UpToDate {
            branch: "main".into(),
            upstream: "origin/main".into(),
            ahead: 1,
        };
        assert_eq!(
            ahead.describe("app").unwrap(),
            "app: up to date with origin/main (main has 1 commit not pushed)"
        );
        let paths = (1..=7).map(|i| format!("f{i}")).collect();
        assert_eq!(
            FastForward::InTheWay { paths }.describe("app").unwrap(),
            "app: left as it is: uncommitted changes to f1, f2, f3, f4, f5 and 2 more would be overwritten"
        );
    }
}
