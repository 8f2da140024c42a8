//! A repository's status read again for only what changed since the last
//! reading, in a resident runner.
//!
//! `git status` costs O(tracked files) whatever changed: it reads the whole
//! index, stats every tracked file and lists every directory for untracked
//! files (about 150 ms of CPU on a repository of 80k files, on the cores the
//! checkpoint itself needs). A resident runner keeps what the last reading
//! listed ([`RepoStatus`]) and the walk it followed, and the next reading
//! covers only the following, worked out without git where
//! [`super::derive`] can, else asked of git with pathspecs:
//!
//! - the directories whose listing differs between the two walks (added,
//!   removed, or any entry changed), each as `D/*` (its files), and the
//!   nested repositories in them, each as itself (git lists one as `D/S/`,
//!   which `D/*` does not match); a directory
//!   whose `.gitignore` or `.gitattributes` changed counts with everything
//!   below it;
//! - when anything in the `.git` directory changed: the paths whose index
//!   entry changed ([`IndexEntries::changed_paths`]) and whose entry in
//!   HEAD's tree changed (a commit, a reset), each as itself.
//!
//! Outside those, nothing a path's status depends on changed (its working
//! file, its index entry, its entry in HEAD, the ignore rules above it), so
//! its record from the last reading stands. The rest is read in full: the
//! first reading, a changed `.git/config` or `.git/info`, a work tree whose
//! `.git` is a file, submodules (their status follows work trees this does
//! not map), an index this cannot parse (a split index, say), more than
//! [`MAX_PATHSPECS`] changes, and the reading after [`MAX_NARROWED`]
//! narrowed ones in a row, which also catches what no walk sees (a global
//! excludes file).
//!
//! Whatever changes between the walk and the status is read by git and
//! also differs in the next walk, so it is read again then: the records are
//! never older than the walk they are kept with. The index and HEAD are
//! read before git runs, for the same reason.
//!
//! A resident runner reads every repository in full once, in the
//! background, when it starts. A checkpoint asked for before that reading
//! ends waits for it and narrows its own reading from it: two full readings
//! side by side would double the first checkpoint's cost. A resident
//! runner's full readings are always remembered, so only its very first
//! reading is full for want of an earlier one.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::Path;
use std::sync::Arc;

use git2::{Oid, Repository};

use super::RepoState;
use super::index::IndexEntries;
use crate::gitobj;
use crate::scan::{Node, NodeKind, Scan, ScannedDir, is_at_or_below};

/// Above this many directories and paths, one full reading is cheaper
/// than git matching each path against every pathspec.
pub const MAX_PATHSPECS: usize = 512;

/// Narrowed readings in a row before a full one.
pub const MAX_NARROWED: u32 = 64;

/// A record's kinds, as bits.
pub const STAGED: u8 = 1;
pub const UNSTAGED: u8 = 2;
pub const UNTRACKED: u8 = 4;

/// What `git status` listed for one repository: every path that is not
/// clean (relative to the work tree, as git prints it; an untracked nested
/// repository ends in `/`) with its kinds.
pub type Records = BTreeMap<Vec<u8>, u8>;

/// What a reading of one repository leaves for the next one.
#[derive(Debug, Clone)]
pub struct RepoStatus {
    /// What the reading reported.
    pub state: RepoState,
    pub records: Records,
    /// HEAD when it was read, before git ran; None before the first commit.
    pub head: Option<Oid>,
    /// The index as it was read, before git ran; None when it could not
    /// be parsed (then a change in `.git` means a full reading).
    pub index: Option<Arc<IndexEntries>>,
    /// Narrowed readings since the last full one.
    pub narrowed: u32,
    /// How this reading was made.
    pub read_by: ReadBy,
}

/// How a reading was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadBy {
    /// `git status` of the whole work tree.
    FullGit,
    /// `git status` of what changed.
    NarrowedGit,
    /// Worked out without git ([`super::derive`]).
    Derived,
}

/// What to ask git.
#[derive(Debug)]
pub enum Reading {
    /// Nothing in the work tree or in `.git` changed: the last reading stands.
    Unchanged,
    Full {
        why: &'static str,
    },
    Narrow {
        /// Magic pathspecs for `git status -- …`.
        pathspecs: Vec<OsString>,
        /// Directories (relative to the work tree) whose records are replaced.
        dirs: HashSet<Vec<u8>>,
        /// Paths whose records are replaced.
        paths: HashSet<Vec<u8>>,
        head: Option<Oid>,
        index: Option<Arc<IndexEntries>>,
        /// Whether anything in `.git` besides objects changed.
        refs_changed: bool,
        /// Whether an ignore or attributes file changed.
        rules_changed: bool,
    },
}

/// Works out what to ask git about the repository at `rel` (`dir` on
/// disk), which `previous` read after the walk `old`; `new` is this walk.
pub fn plan(
    previous: &RepoStatus,
    old: &Scan,
    new: &Scan,
    rel: &[u8],
    dir: &Path,
    trees: &gitobj::TreeCache,
) -> Reading {
    if previous.narrowed >= MAX_NARROWED {
        return Reading::Full {
            why: "the periodic full reading",
        };
    }
    let Some(root) = listing(new, rel) else {
        return Reading::Full {
            why: "the work tree is not in the walk",
        };
    };
    if !has_dir(root, b".git") {
        return Reading::Full {
            why: "its .git is not a directory",
        };
    }
    if root.node(b".gitmodules").is_some() {
        return Reading::Full {
            why: "it has submodules",
        };
    }
    let git_dir = join(rel, b".git");
    let Changes {
        dirs,
        nested,
        git_changed,
        rules_changed,
    } = changes(old, new, rel, &git_dir);

    let (mut head, mut index) = (previous.head, previous.index.clone());
    let mut paths = HashSet::new();
    if git_changed {
        let config_or_info_changed = node(listing(old, &git_dir), b"config")
            != node(listing(new, &git_dir), b"config")
            || listing(old, &join(&git_dir, b"info")) != listing(new, &join(&git_dir, b"info"));
        if config_or_info_changed {
            return Reading::Full {
                why: ".git/config or .git/info changed",
            };
        }
        let Some(old_index) = &previous.index else {
            return Reading::Full {
                why: "the last index could not be parsed",
            };
        };
        // Git replaces the index by a rename: the same file is the same index.
        let index_changed =
            node(listing(old, &git_dir), b"index") != node(listing(new, &git_dir), b"index");
        if index_changed {
            let new_index = match IndexEntries::read(&dir.join(".git/index")) {
                Ok(entries) => Arc::new(entries),
                Err(e) => {
                    tracing::debug!(repository = %dir.display(), error = %e, "reading git status in full");
                    return Reading::Full {
                        why: "the index cannot be parsed",
                    };
                }
            };
            paths.extend(old_index.changed_paths(&new_index));
            index = Some(new_index);
        }
        super::init();
        let repo = Repository::open(dir);
        head = match repo.as_ref().map(head_of) {
            Ok(Ok(now)) => now,
            _ => {
                return Reading::Full {
                    why: "HEAD cannot be read",
                };
            }
        };
        if head != previous.head {
            let repo = repo.expect("HEAD was read from it");
            match (previous.head, head) {
                (Some(before), Some(now)) => match tree_changes(&repo, before, now, trees) {
                    Ok(changed) if changed.len() <= MAX_PATHSPECS => paths.extend(changed),
                    _ => {
                        return Reading::Full {
                            why: "HEAD moved far",
                        };
                    }
                },
                _ => {
                    return Reading::Full {
                        why: "HEAD was born or unborn",
                    };
                }
            }
        }
    }
    if dirs.is_empty() && paths.is_empty() && !git_changed {
        return Reading::Unchanged;
    }
    if dirs.len() + paths.len() > MAX_PATHSPECS {
        return Reading::Full {
            why: "too many changes",
        };
    }
    // Git matches every index entry against every pathspec (~60 ns a
    // pair, ~5 ms a pathspec on 80k files): as few as will do.
    let mut pathspecs = Vec::with_capacity(dirs.len() + nested.len() + paths.len());
    for dir in &dirs {
        let mut files = b":(glob)".to_vec();
        if !dir.is_empty() {
            escape_glob(dir, &mut files);
            files.push(b'/');
        }
        files.push(b'*');
        pathspecs.push(OsString::from_vec(files));
    }
    let literal = |path: &[u8]| {
        let mut literal = b":(literal)".to_vec();
        literal.extend_from_slice(path);
        OsString::from_vec(literal)
    };
    // With the trailing slash: as `D/S`, git leaves it out once other
    // pathspecs are given.
    pathspecs.extend(nested.iter().map(|path| literal(&join(path, b""))));
    pathspecs.extend(
        paths
            .iter()
            .filter(|path| !dirs.contains(parent(path)))
            .map(|path| literal(path)),
    );
    if pathspecs.is_empty() {
        // Only refs changed: the branch lines, and no path, are wanted (git
        // lists nothing in `.git`; no pathspec at all would list everything).
        pathspecs.push(OsString::from(":(literal).git/"));
    }
    Reading::Narrow {
        pathspecs,
        dirs,
        paths,
        head,
        index,
        refs_changed: git_changed,
        rules_changed,
    }
}

/// `previous` with the records of `dirs` and `paths` replaced by `fresh`,
/// which git listed for exactly those.
pub fn merge(
    previous: &Records,
    dirs: &HashSet<Vec<u8>>,
    paths: &HashSet<Vec<u8>>,
    fresh: Records,
) -> Records {
    let mut merged: Records = previous
        .iter()
        .filter(|(path, _)| !paths.contains(*path) && !dirs.contains(parent(path)))
        .map(|(path, kinds)| (path.clone(), *kinds))
        .collect();
    merged.extend(fresh);
    merged
}

/// HEAD's commit; None before the first commit.
pub fn read_head(dir: &Path) -> Result<Option<Oid>, git2::Error> {
    super::init();
    head_of(&Repository::open(dir)?)
}

fn head_of(repo: &Repository) -> Result<Option<Oid>, git2::Error> {
    match repo.refname_to_id("HEAD") {
        Ok(oid) => Ok(Some(oid)),
        Err(e) if e.code() == git2::ErrorCode::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The directory a record is listed in ("" for the work tree's top).
pub(super) fn parent(path: &[u8]) -> &[u8] {
    crate::scan::parent_rel(path.strip_suffix(b"/").unwrap_or(path))
}

fn escape_glob(path: &[u8], out: &mut Vec<u8>) {
    for &b in path {
        if matches!(b, b'*' | b'?' | b'[' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
}

fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    crate::scan::join_rel(dir, name)
}

/// A directory of the work tree at `rel`, as a path relative to the root.
pub(super) fn work_tree_path(rel: &[u8], inside: &[u8]) -> Vec<u8> {
    if inside.is_empty() {
        rel.to_vec()
    } else {
        join(rel, inside)
    }
}

fn listing<'a>(scan: &'a Scan, rel: &[u8]) -> Option<&'a ScannedDir> {
    scan.listing(rel).map(Arc::as_ref)
}

fn node<'a>(dir: Option<&'a ScannedDir>, name: &[u8]) -> Option<&'a Node> {
    dir?.node(name)
}

fn has_dir(dir: &ScannedDir, name: &[u8]) -> bool {
    dir.node(name).is_some_and(|n| n.kind == NodeKind::Dir)
}

/// What differs between two walks below a work tree.
struct Changes {
    /// Changed directories, relative to the work tree (`.git` left out).
    dirs: HashSet<Vec<u8>>,
    /// Repositories directly in a changed directory (git lists each as
    /// `D/S/`, which `D/*` does not match).
    nested: Vec<Vec<u8>>,
    /// Whether anything in `.git` outside `objects` changed.
    git_changed: bool,
    /// Whether a `.gitignore` or `.gitattributes` changed.
    rules_changed: bool,
}

fn changes(old: &Scan, new: &Scan, rel: &[u8], git_dir: &[u8]) -> Changes {
    let objects = join(git_dir, b"objects");
    // A directory as git sees it (relative to the work tree), or None for
    // one git never lists: the repository's or a nested one's `.git`.
    let for_status = |path: &[u8]| -> Option<Vec<u8>> {
        let inside = match rel.is_empty() {
            true => path,
            false => path.get(rel.len() + 1..).unwrap_or_default(),
        };
        let in_a_git_dir = inside.split(|b| *b == b'/').any(|part| part == b".git");
        (!in_a_git_dir).then(|| inside.to_vec())
    };
    let mut dirs = HashSet::new();
    let mut whole = Vec::new();
    let mut git_changed = false;
    let mut changed = |path: &[u8], before: Option<&ScannedDir>, after: Option<&ScannedDir>| {
        if is_at_or_below(path, git_dir) {
            git_changed |= !is_at_or_below(path, &objects);
            return;
        }
        let Some(inside) = for_status(path) else {
            return;
        };
        let rules = [&b".gitignore"[..], b".gitattributes"];
        if rules
            .iter()
            .any(|name| node(before, name) != node(after, name))
        {
            whole.push(inside.clone());
        }
        dirs.insert(inside);
    };
    let (mut olds, mut news) = (old.subtree(rel).peekable(), new.subtree(rel).peekable());
    loop {
        let order = match (olds.peek(), news.peek()) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some(a), Some(b)) => a.path.cmp(&b.path),
        };
        match order {
            Ordering::Less => {
                let gone = olds.next().expect("peeked");
                changed(&gone.path, Some(gone), None);
            }
            Ordering::Greater => {
                let added = news.next().expect("peeked");
                changed(&added.path, None, Some(added));
            }
            Ordering::Equal => {
                let (a, b) = (olds.next().expect("peeked"), news.next().expect("peeked"));
                if !Arc::ptr_eq(a, b) && !same_for_status(a, b) {
                    changed(&a.path, Some(a), Some(b));
                }
            }
        }
    }
    // A changed ignore file changes what is untracked all the way down.
    let rules_changed = !whole.is_empty();
    if rules_changed {
        for dir in old.subtree(rel).chain(new.subtree(rel)) {
            if let Some(inside) = for_status(&dir.path)
                && whole.iter().any(|top| is_at_or_below(&inside, top))
            {
                dirs.insert(inside);
            }
        }
    }
    let mut nested = Vec::new();
    for dir in &dirs {
        let Some(changed) = listing(new, &work_tree_path(rel, dir)) else {
            continue;
        };
        for child in changed.nodes.iter().filter(|n| n.kind == NodeKind::Dir) {
            let child_path = join(&changed.path, &child.name);
            if listing(new, &child_path).is_some_and(|c| has_dir(c, b".git")) {
                nested.push(join(dir, &child.name));
            }
        }
    }
    Changes {
        dirs,
        nested,
        git_changed,
        rules_changed,
    }
}

/// Whether two listings of a directory hold the same for `git status`: the
/// same names and kinds, and the same files. A subdirectory's own times
/// change with what is in it, which its own listing tells.
fn same_for_status(a: &ScannedDir, b: &ScannedDir) -> bool {
    a.nodes.len() == b.nodes.len()
        && a.nodes
            .iter()
            .zip(&b.nodes)
            .all(|(a, b)| match (&a.kind, &b.kind) {
                (NodeKind::Dir, NodeKind::Dir) => a.name == b.name,
                _ => a == b,
            })
}

/// Paths whose entry differs between the trees of two commits. Subtrees
/// with the same id are skipped (libgit2's own tree diff reads them all:
/// ~50 ms on 80k files for a one-file commit).
fn tree_changes(
    repo: &Repository,
    before: Oid,
    now: Oid,
    trees: &gitobj::TreeCache,
) -> Result<Vec<Vec<u8>>, git2::Error> {
    let old_tree = repo.find_commit(before)?.tree_id();
    let new_tree = repo.find_commit(now)?.tree_id();
    let mut paths = Vec::new();
    let odb = repo.odb()?;
    diff_trees(&odb, trees, Some(old_tree), Some(new_tree), &[], &mut paths)?;
    paths.sort_unstable();
    paths.dedup();
    Ok(paths)
}

/// Walks both trees' entries side by side in git's order, borrowed from
/// the raw objects: a commit's trees on a changed path hold thousands of
/// entries of which a few differ.
fn diff_trees(
    odb: &git2::Odb<'_>,
    trees: &gitobj::TreeCache,
    old: Option<Oid>,
    new: Option<Oid>,
    prefix: &[u8],
    paths: &mut Vec<Vec<u8>>,
) -> Result<(), git2::Error> {
    if old == new || paths.len() > MAX_PATHSPECS {
        return Ok(());
    }
    let read = |tree: Option<Oid>| tree.map(|tree| trees.read(odb, tree)).transpose();
    let (old_content, new_content) = (read(old)?, read(new)?);
    let before = old_content.as_deref().map(gitobj::parse_tree).transpose()?;
    let after = new_content.as_deref().map(gitobj::parse_tree).transpose()?;
    let (before, after) = (before.unwrap_or_default(), after.unwrap_or_default());
    let (mut was, mut is) = (before.iter().peekable(), after.iter().peekable());
    loop {
        let (removed, added) = match (was.peek(), is.peek()) {
            (None, None) => break,
            (Some(_), None) => (was.next(), None),
            (None, Some(_)) => (None, is.next()),
            (Some(a), Some(b)) => match a.git_order(b) {
                Ordering::Less => (was.next(), None),
                Ordering::Greater => (None, is.next()),
                Ordering::Equal => (was.next(), is.next()),
            },
        };
        // A changed executable bit is a change too.
        if let (Some(a), Some(b)) = (removed, added)
            && (a.id, a.mode) == (b.id, b.mode)
        {
            continue;
        }
        let name = removed.or(added).expect("one side has the entry").name;
        let path = join(prefix, name);
        let subtree = |entry: Option<&gitobj::TreeEntry<'_>>| {
            entry
                .filter(|e| e.is_tree())
                .map(|e| Oid::from_bytes(e.id))
                .transpose()
        };
        let (old_sub, new_sub) = (subtree(removed)?, subtree(added)?);
        // A file (or link, or submodule) on either side is a changed path.
        if removed.is_some_and(|e| !e.is_tree()) || added.is_some_and(|e| !e.is_tree()) {
            paths.push(path.clone());
        }
        if old_sub.is_some() || new_sub.is_some() {
            diff_trees(odb, trees, old_sub, new_sub, &path, paths)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::super::testing::{Workspace, git};
    use super::*;

    /// The paths a commit changed, as `git diff --name-only` lists them,
    /// through names git orders by a subtree's trailing `/` and a file
    /// that became a directory.
    #[test]
    fn the_paths_a_commit_changed_are_the_ones_git_lists() {
        let tmp = tempfile::tempdir().unwrap();
        let repo = fs::canonicalize(tmp.path()).unwrap();
        git(&repo, &["init", "-q"]);
        let write = |path: &str, content: &str| {
            let path = repo.join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, content).unwrap();
        };
        for path in ["a/x.rs", "a/y.rs", "a-b", "a.c", "a0/z", "f", "same/s.rs"] {
            write(path, path);
        }
        git(&repo, &["add", "-A"]);
        git(&repo, &["commit", "-qm", "one"]);
        fs::remove_file(repo.join("f")).unwrap();
        write("f/inside.rs", "now a directory");
        write("a/x.rs", "changed");
        write("a-b", "changed");
        fs::remove_file(repo.join("a0/z")).unwrap();
        write("a0/w", "new");
        git(&repo, &["add", "-A"]);
        git(&repo, &["commit", "-qm", "two"]);

        super::super::init();
        let opened = Repository::open(&repo).unwrap();
        let head = opened.head().unwrap().peel_to_commit().unwrap();
        let parent = head.parent_id(0).unwrap();
        let trees = gitobj::TreeCache::default();
        let ours = tree_changes(&opened, parent, head.id(), &trees).unwrap();
        let listed = git(
            &repo,
            &["diff", "--name-only", "--no-renames", "HEAD~1", "HEAD"],
        );
        let mut theirs: Vec<Vec<u8>> = listed.lines().map(|l| l.as_bytes().to_vec()).collect();
        theirs.sort_unstable();
        assert_eq!(ours, theirs);
    }

    #[test]
    fn a_narrowed_reading_lists_what_a_full_one_does_through_edits_commits_resets_and_ignores() {
        // Through git alone, and worked out without it where it can be.
        for derive in [false, true] {
            narrowed_readings_list_what_a_full_one_does(derive);
        }
    }

    fn narrowed_readings_list_what_a_full_one_does(derive: bool) {
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        let mut ws = Workspace::new(&root);
        ws.derive = derive;
        for (path, content) in [
            ("src/a.rs", "a"),
            ("src/b/c.rs", "c"),
            ("src-gen/g.rs", "g"),
            ("docs/x.md", "x"),
            ("docs/[weird]*.md", "w"),
            (".gitignore", "*.log\n"),
        ] {
            ws.write(path, content);
        }
        ws.git(&["add", "-A"]);
        ws.git(&["commit", "-qm", "one"]);
        ws.git(&["commit", "-q", "--allow-empty", "-m", "two"]);
        // HEAD was born since the first reading.
        assert_eq!(ws.read(), None);

        ws.write("src/a.rs", "a2");
        ws.write("src/b/new.rs", "n");
        ws.write("src/b/debug.log", "ignored");
        ws.write("docs/[weird]*.md", "w2");
        assert_eq!(
            ws.read(),
            Some(vec!["docs".into(), "src".into(), "src/b".into()])
        );
        assert_eq!(ws.status.records.len(), 3);

        // Only the index changed: the paths whose entries did are read.
        ws.git(&["add", "src/a.rs"]);
        match ws.plan() {
            Reading::Narrow { dirs, paths, .. } => {
                assert!(dirs.is_empty(), "{dirs:?}");
                assert_eq!(paths, HashSet::from([b"src/a.rs".to_vec()]));
            }
            full => panic!("{full:?}"),
        }
        assert_eq!(ws.read(), Some(vec![]));

        ws.git(&["commit", "-qm", "three"]);
        assert_eq!(ws.read(), Some(vec![]));
        ws.git(&["rm", "-q", "--cached", "docs/x.md"]);
        ws.read().unwrap();
        ws.git(&["reset", "-q", "--soft", "HEAD~2"]);
        ws.read().unwrap();

        // A nested repository, a new directory, a removed one.
        git(&root.join("repo/src"), &["init", "-q", "nested"]);
        ws.write("src/nested/inner.txt", "i");
        ws.write("fresh/deep/f.txt", "f");
        fs::remove_dir_all(ws.repo.join("src-gen")).unwrap();
        ws.read().unwrap();

        // An ignore file changes what is untracked below it.
        ws.write("src/.gitignore", "b/\n");
        let dirs = ws.read().unwrap();
        assert!(dirs.contains(&"src/b".to_owned()), "{dirs:?}");
        fs::remove_file(ws.repo.join("src/.gitignore")).unwrap();
        ws.read().unwrap();

        ws.git(&["stash", "-q", "-u"]);
        ws.read().unwrap();
        // Stashing leaves only the nested repository.
        let left: Vec<&[u8]> = ws.status.records.keys().map(Vec::as_slice).collect();
        assert_eq!(left, [&b"src/nested/"[..]]);
        assert_eq!(ws.status.state.stashes, 1);
        // Only a ref changes: no path is read again, the stash count is.
        ws.git(&["stash", "drop", "-q"]);
        assert_eq!(ws.read(), Some(vec![]));
        assert_eq!(ws.status.state.stashes, 0);

        // A conflict: unmerged records.
        ws.git(&["checkout", "-q", "-b", "side"]);
        ws.write("src/a.rs", "side");
        ws.git(&["commit", "-qam", "side"]);
        ws.git(&["checkout", "-q", "-"]);
        ws.write("src/a.rs", "main");
        ws.git(&["commit", "-qam", "main"]);
        let merge = crate::git::command::command(&ws.repo)
            .args([
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@e",
                "merge",
                "-q",
                "side",
            ])
            .output()
            .unwrap();
        assert!(!merge.status.success(), "the merge conflicts");
        ws.read().unwrap();
        assert!(ws.status.records.contains_key(&b"src/a.rs"[..]));

        // Only a mode changes in HEAD: staged again after a soft reset.
        ws.git(&["merge", "--abort"]);
        ws.write("docs/mode.sh", "m");
        ws.git(&["add", "docs/mode.sh"]);
        ws.git(&["commit", "-qm", "mode"]);
        ws.read().unwrap();
        let script = ws.repo.join("docs/mode.sh");
        fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        ws.git(&["commit", "-qam", "executable"]);
        ws.read().unwrap();
        ws.git(&["reset", "-q", "--soft", "HEAD~1"]);
        ws.read().unwrap();
        assert_eq!(ws.status.records.get(&b"docs/mode.sh"[..]), Some(&STAGED));

        // What the walk cannot see the ignore rules of is read in full.
        ws.git(&["config", "core.excludesFile", "/nonexistent"]);
        assert_eq!(ws.read(), None);
    }

    #[test]
    fn every_so_many_readings_one_is_full_and_unchanged_repositories_read_nothing_new() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        let mut ws = Workspace::new(&root);
        ws.write("a.txt", "a");
        ws.git(&["add", "-A"]);
        ws.git(&["commit", "-qm", "one"]);
        assert_eq!(ws.read(), None);
        assert_eq!(ws.read(), Some(vec![]));
        let mut status = (*ws.status).clone();
        status.narrowed = MAX_NARROWED;
        ws.status = Arc::new(status);
        assert_eq!(ws.read(), None);
        assert_eq!(ws.status.narrowed, 0);
    }

    #[test]
    fn a_record_belongs_to_the_directory_it_is_listed_in() {
        assert_eq!(parent(b"a.txt"), b"");
        assert_eq!(parent(b"src/b/c.rs"), b"src/b");
        assert_eq!(parent(b"src/nested/"), b"src");
        let mut escaped = Vec::new();
        escape_glob(b"d/[w]*?\\x", &mut escaped);
        assert_eq!(escaped, b"d/\\[w]\\*\\?\\\\x");
    }
}
