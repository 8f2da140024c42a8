//! A narrowed status worked out by the runner itself, without running git.
//!
//! A narrowed `git status` ([`super::narrow`]) still costs O(tracked files):
//! git reads the whole index and matches every entry against every
//! pathspec (about 150 ms of CPU on 80k files, however little changed). The
//! runner already holds what git would look at: the walk has every file's
//! stat data, and the index is parsed ([`IndexEntries`], stat data
//! included). So for the directories and paths a narrowed reading covers,
//! this lists what `git status --porcelain=v2 --untracked-files=all` would,
//! by git's own rules:
//!
//! - **unstaged**: a tracked file that is gone, or a directory now, or of
//!   another type or executable bit, or whose content differs from its
//!   entry's object. The content is hashed only when the stat data differs
//!   from the entry's (git's `ie_match_stat`: times in whole seconds, as git
//!   compares them, inode, owner, size) or the entry is racily clean (the
//!   file changed in the second the index was written); an entry in conflict
//!   is unmerged, which counts as unstaged.
//! - **staged**: the entry differs from HEAD's (object id or mode, or one
//!   side missing). It depends on the index and HEAD only, so outside the
//!   paths whose entry in either changed, the last reading's bit stands.
//! - **untracked**: a file or link with no entry that no ignore rule
//!   excludes (libgit2 evaluates the rules: `.gitignore` files, the
//!   repository's `info/exclude`, `core.excludesFile`), and a nested
//!   repository, listed once as `D/S/`; nothing inside a nested repository
//!   is listed.
//!
//! Within a covered directory, a path whose file is the same in both walks
//! (and was not changed within two seconds of the older one, so that its
//! stat data would show a change), whose index and HEAD entries did not
//! change and above which no ignore or attributes file changed keeps its
//! last record: only what changed is compared or hashed.
//!
//! The branch lines (HEAD, upstream, ahead and behind, stashes) are read
//! with libgit2 when something in `.git` changed, and kept otherwise.
//!
//! Whatever this cannot decide as git would is left to git
//! ([`LeftToGit`], which says why): an index it could not parse, entries
//! marked assume-valid, skip-worktree or intent-to-add, submodules and
//! `.git` files, a case-insensitive or symlink-less checkout, and a file to
//! hash that a filter, `ident` or an encoding would change on its way into
//! git, or that a line-ending conversion applies to and that holds a CR.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::io::Read as _;
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;

use git2::{Oid, Repository};
use ring::digest;

use super::RepoState;
use super::index::{Entry, IndexEntries};
use super::narrow::{Records, RepoStatus, STAGED, UNSTAGED, UNTRACKED, parent, work_tree_path};
use crate::gitobj::TreeCache;
use crate::scan::{Node, NodeKind, Scan, ScannedDir, join_rel, join_rel_into};

/// Why a reading is left to git.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeftToGit(pub &'static str);

const S_IFMT: u32 = 0o170_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;
const S_IFGITLINK: u32 = 0o160_000;
/// Git's object id of the empty blob.
const EMPTY_BLOB: [u8; 20] = [
    0xe6, 0x9d, 0xe2, 0x9b, 0xb2, 0xd1, 0xd6, 0x43, 0x4b, 0x8b, 0x29, 0xae, 0x77, 0x5a, 0xd8, 0xc2,
    0xe4, 0x8c, 0x53, 0x91,
];

/// What one narrowed reading covers (see [`super::narrow::Reading::Narrow`]).
pub struct Covered<'a> {
    /// Directories, relative to the work tree, whose records are replaced.
    pub dirs: &'a HashSet<Vec<u8>>,
    /// Paths whose index or HEAD entry changed.
    pub paths: &'a HashSet<Vec<u8>>,
    pub head: Option<Oid>,
    pub index: Option<&'a IndexEntries>,
    /// Whether anything in `.git` besides objects changed: the branch lines
    /// are read again.
    pub refs_changed: bool,
    /// Whether an ignore or attributes file changed: what is untracked is
    /// worked out again even where no file changed.
    pub rules_changed: bool,
    /// The walk the last reading followed.
    pub old: &'a Scan,
}

impl std::fmt::Debug for Covered<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Covered")
            .field("dirs", &self.dirs.len())
            .field("paths", &self.paths.len())
            .finish_non_exhaustive()
    }
}

/// The state and the fresh records for what `covered` covers, of the
/// repository whose work tree is `dir` on disk and `rel` in the walk `new`.
pub fn derive(
    dir: &Path,
    rel: &[u8],
    new: &Scan,
    previous: &RepoStatus,
    covered: &Covered<'_>,
    trees: &TreeCache,
) -> Result<(RepoState, Records), LeftToGit> {
    let index = covered
        .index
        .ok_or(LeftToGit("its index could not be parsed"))?;
    super::init();
    let mut repo = Repository::open(dir).map_err(|_| LeftToGit("it cannot be opened"))?;
    let settings = Settings::of(&repo)?;
    let mut state = previous.state.clone();
    if covered.refs_changed {
        state = RepoState {
            path: state.path,
            ..RepoState::default()
        };
        super::read_refs(&mut repo, &mut state)
            .map_err(|_| LeftToGit("its refs cannot be read"))?;
    }
    let head_tree = match covered.head {
        Some(head) => Some(
            repo.find_commit(head)
                .map(|commit| commit.tree_id())
                .map_err(|_| LeftToGit("HEAD's tree cannot be read"))?,
        ),
        None => None,
    };
    let odb = repo
        .odb()
        .map_err(|_| LeftToGit("its objects cannot be read"))?;
    // The changed paths by the directory they are in.
    let mut paths_in: HashMap<&[u8], Vec<&[u8]>> = HashMap::new();
    for path in covered.paths {
        paths_in.entry(parent(path)).or_default().push(path);
    }
    let mut reader = Reader {
        repo: &repo,
        dir,
        rel,
        new,
        previous,
        covered,
        index,
        head_tree,
        odb: &odb,
        trees,
        settings,
        conversions: HashMap::new(),
        ignored_dirs: HashMap::new(),
        records: Records::new(),
    };
    for inside in covered.dirs {
        let changed = paths_in.remove(&inside[..]).unwrap_or_default();
        reader.directory(inside, &changed)?;
    }
    for path in paths_in.into_values().flatten() {
        reader.path(path)?;
    }
    Ok((state, reader.records))
}

/// The repository's settings this depends on.
struct Settings {
    /// `core.filemode`: whether the executable bit counts.
    filemode: bool,
    /// What `core.autocrlf` and the attributes files outside the work tree
    /// (the repository's `info/attributes`, `core.attributesFile` or the
    /// user's, the system's) may do to any file.
    conversion: Conversion,
}

impl Settings {
    fn of(repo: &Repository) -> Result<Self, LeftToGit> {
        let config = repo
            .config()
            .and_then(|mut c| c.snapshot())
            .map_err(|_| LeftToGit("its configuration cannot be read"))?;
        let flag = |name: &str, default: bool| config.get_bool(name).unwrap_or(default);
        if flag("core.ignorecase", false) {
            return Err(LeftToGit("core.ignorecase is set"));
        }
        if !flag("core.symlinks", true) {
            return Err(LeftToGit("core.symlinks is off"));
        }
        let mut conversion = Conversion::None;
        if config
            .get_string("core.autocrlf")
            .is_ok_and(|v| !v.eq_ignore_ascii_case("false"))
        {
            conversion = Conversion::LineEndings;
        }
        let user_file = config.get_path("core.attributesFile").ok().or_else(|| {
            let config_home = std::env::var_os("XDG_CONFIG_HOME")
                .filter(|v| !v.is_empty())
                .map(std::path::PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".config")))?;
            Some(config_home.join("git/attributes"))
        });
        let sources = [
            Some(repo.path().join("info/attributes")),
            user_file,
            Some(std::path::PathBuf::from("/etc/gitattributes")),
        ];
        for source in sources.into_iter().flatten() {
            conversion = conversion.max(Conversion::of_file(&source)?);
        }
        Ok(Self {
            filemode: flag("core.filemode", true),
            conversion,
        })
    }
}

/// What attributes may do to a file's content on its way into git, as far
/// as the attributes files' words tell (a file naming none of these
/// attributes sets none of them; one that does may, for some paths).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Conversion {
    None,
    /// `text`, `eol` or `crlf`: a CR may be dropped.
    LineEndings,
    /// `filter`, `ident` or `working-tree-encoding`: anything may change.
    Rewrites,
}

impl Conversion {
    fn of_text(text: &[u8]) -> Self {
        let names = |words: &[&str]| {
            words
                .iter()
                .any(|w| text.windows(w.len()).any(|at| at == w.as_bytes()))
        };
        if names(&["filter", "ident", "encoding"]) {
            Self::Rewrites
        } else if names(&["text", "eol", "crlf"]) {
            Self::LineEndings
        } else {
            Self::None
        }
    }

    /// Of the attributes file at `path`; none when there is none.
    fn of_file(path: &Path) -> Result<Self, LeftToGit> {
        match std::fs::read(path) {
            Ok(text) => Ok(Self::of_text(&text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::None),
            Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => Ok(Self::None),
            Err(_) => Err(LeftToGit("an attributes file cannot be read")),
        }
    }
}

struct Reader<'a> {
    repo: &'a Repository,
    dir: &'a Path,
    rel: &'a [u8],
    new: &'a Scan,
    previous: &'a RepoStatus,
    covered: &'a Covered<'a>,
    index: &'a IndexEntries,
    head_tree: Option<Oid>,
    odb: &'a git2::Odb<'a>,
    trees: &'a TreeCache,
    settings: Settings,
    /// What the `.gitattributes` files at and above a directory may do,
    /// by directory (relative to the work tree).
    conversions: HashMap<Vec<u8>, Conversion>,
    /// Directories whose ignore rules were asked already.
    ignored_dirs: HashMap<Vec<u8>, bool>,
    records: Records,
}

impl<'a> Reader<'a> {
    /// The records of everything directly in the directory `inside`, where
    /// the index or HEAD entries of `changed` changed.
    ///
    /// Every list this draws on is sorted by name (the index and the old
    /// records by path, which within one directory is the same order), so
    /// the names are merged once and each list is walked alongside: a
    /// directory of a few thousand files costs no allocation per file and
    /// no lookup per file in any of them.
    fn directory(&mut self, inside: &[u8], changed: &[&[u8]]) -> Result<(), LeftToGit> {
        if self.in_nested_repo(inside)? {
            return Ok(());
        }
        let listing = self.listing(inside);
        let nodes: &'a [Node] = listing.map_or(&[], |l| &l.nodes);
        let old_nodes: &'a [Node] = self.old_listing(inside).map_or(&[], |l| &l.nodes);
        let prefix = join_rel(inside, b"");
        let name_of = |path: &'a [u8]| &path[prefix.len()..];
        // What was listed here last time (a deletion staged leaves neither
        // file nor entry, only its record).
        let previous: Vec<(&'a [u8], u8)> = self
            .previous
            .records
            .range(prefix.clone()..)
            .take_while(|(path, _)| path.starts_with(&prefix))
            .filter(|(path, _)| !path.ends_with(b"/") && parent(path) == inside)
            .map(|(path, kinds)| (name_of(path), *kinds))
            .collect();
        let mut changed_names: Vec<&[u8]> =
            changed.iter().map(|path| &path[prefix.len()..]).collect();
        changed_names.sort_unstable();

        // Every name that may have a record: tracked, on disk, listed last
        // time, or changed in the index or HEAD.
        let tracked = self.index.children(inside);
        let mut names: Vec<&[u8]> =
            Vec::with_capacity(tracked.len() + nodes.len() + previous.len() + changed.len());
        names.extend(tracked.iter().map(|&i| name_of(self.index.entry(i).path)));
        for node in nodes {
            match node.kind {
                NodeKind::File(_) | NodeKind::Symlink(_) => names.push(&node.name),
                NodeKind::Dir => {
                    if node.name[..] != b".git"[..] {
                        let path = join_rel(inside, &node.name);
                        if self.nested_repo(&path)? {
                            self.nested(path)?;
                        }
                    }
                }
            }
        }
        names.extend(previous.iter().map(|(name, _)| *name));
        names.extend(changed_names.iter().copied());
        // Sorted runs, one after another: merged in linear passes.
        names.sort();
        names.dedup();

        let (mut now, mut before) = (Along::new(nodes), Along::new(old_nodes));
        let (mut listed, mut changed_here) = (Along::new(&previous), Along::new(&changed_names));
        let mut path = Vec::new();
        for name in names {
            let node = now.find(name, |n| &n.name);
            let old = before.find(name, |n| &n.name);
            let last_record = listed
                .find(name, |(name, _)| *name)
                .map(|(_, kinds)| *kinds);
            let entry_changed = changed_here.find(name, |changed| *changed).is_some();
            join_rel_into(&mut path, inside, name);
            if !entry_changed && self.unchanged_since_last_reading(node, old) {
                if let Some(kinds) = last_record {
                    self.records.insert(path.clone(), kinds);
                }
                continue;
            }
            self.record(&path, node)?;
        }
        Ok(())
    }

    /// Whether nothing a path's record depends on, besides its index and
    /// HEAD entries, changed since the last reading: the same file in both
    /// walks (and not changed too recently for its stat data to tell), the
    /// same ignore rules. Its last record then stands, unhashed.
    fn unchanged_since_last_reading(&self, now: Option<&Node>, before: Option<&Node>) -> bool {
        let stable = match now.map(|n| &n.kind) {
            Some(NodeKind::File(fingerprint)) => fingerprint.is_stable(self.covered.old.started),
            Some(NodeKind::Symlink(_)) => true,
            _ => false,
        };
        stable && now == before && !self.covered.rules_changed
    }

    /// The record of one path whose index or HEAD entry changed, outside
    /// the covered directories.
    fn path(&mut self, path: &[u8]) -> Result<(), LeftToGit> {
        let inside = parent(path);
        if self.in_nested_repo(inside)? {
            return Ok(());
        }
        let node = self.listing(inside).and_then(|l| l.node(file_name(path)));
        if node.is_some_and(|n| n.kind == NodeKind::Dir) && self.nested_repo(path)? {
            return Err(LeftToGit("a path of the index became a nested repository"));
        }
        self.record(path, node)
    }

    /// A nested repository `path` in a covered directory: untracked, as
    /// `path/`, unless ignored.
    fn nested(&mut self, path: Vec<u8>) -> Result<(), LeftToGit> {
        if !self.index.find(&path).is_empty() || self.index.has_below(&path) {
            return Err(LeftToGit(
                "a nested repository is tracked, or holds tracked paths",
            ));
        }
        if self.may_be_untracked(&path)? {
            self.records.insert(join_rel(&path, b""), UNTRACKED);
        }
        Ok(())
    }

    /// The record of `path`, which the walk found as `node`.
    fn record(&mut self, path: &[u8], node: Option<&Node>) -> Result<(), LeftToGit> {
        let entries = self.index.find(path);
        let entry = match entries.len() {
            0 => None,
            1 if self.index.entry(entries.start).stage == 0 => {
                Some(self.index.entry(entries.start))
            }
            // Unmerged: git lists it as such, which counts as unstaged.
            _ => {
                self.records.insert(path.to_vec(), UNSTAGED);
                return Ok(());
            }
        };
        if let Some(entry) = &entry {
            if entry.assume_valid || entry.skip_worktree || entry.intent_to_add {
                return Err(LeftToGit(
                    "an entry is marked assume-valid, skip-worktree or intent-to-add",
                ));
            }
            if entry.mode & S_IFMT == S_IFGITLINK {
                return Err(LeftToGit("a submodule's entry is among what changed"));
            }
        }
        let staged = if self.covered.paths.contains(path) {
            self.staged(path, entry.as_ref())?
        } else {
            self.previous
                .records
                .get(path)
                .is_some_and(|kinds| kinds & STAGED != 0)
        };
        let mut kinds = if staged { STAGED } else { 0 };
        match &entry {
            Some(entry) => {
                if self.unstaged(entry, node)? {
                    kinds |= UNSTAGED;
                }
            }
            None => {
                let on_disk = node.is_some_and(|n| n.kind != NodeKind::Dir);
                if on_disk && self.may_be_untracked(path)? {
                    kinds |= UNTRACKED;
                }
            }
        }
        if kinds != 0 {
            self.records.insert(path.to_vec(), kinds);
        }
        Ok(())
    }

    /// Whether the index entry of `path` (None: it has none) differs from
    /// HEAD's entry for it.
    fn staged(&self, path: &[u8], entry: Option<&Entry<'_>>) -> Result<bool, LeftToGit> {
        let Some(tree) = self.head_tree else {
            return Ok(entry.is_some());
        };
        let in_head = self
            .trees
            .entry_at(self.odb, tree, path)
            .map_err(|_| LeftToGit("HEAD's tree cannot be read"))?;
        Ok(match (entry, in_head) {
            (None, None) => false,
            (Some(entry), Some((id, mode))) => id.as_bytes() != entry.oid || mode != entry.mode,
            _ => true,
        })
    }

    /// Whether a path with no entry is listed as untracked: neither it nor
    /// its directory is ignored.
    fn may_be_untracked(&mut self, path: &[u8]) -> Result<bool, LeftToGit> {
        let inside = parent(path);
        let dir_ignored = match self.ignored_dirs.get(inside) {
            Some(ignored) => *ignored,
            None => {
                let ignored = !inside.is_empty() && self.ignored(inside)?;
                self.ignored_dirs.insert(inside.to_vec(), ignored);
                ignored
            }
        };
        Ok(!dir_ignored && !self.ignored(path)?)
    }

    /// Whether the working file differs from the entry (git's
    /// `ie_match_stat`, then the content when the stat data cannot tell).
    fn unstaged(&mut self, entry: &Entry<'_>, node: Option<&Node>) -> Result<bool, LeftToGit> {
        let is_link = entry.mode & S_IFMT == S_IFLNK;
        match node.map(|n| &n.kind) {
            // Gone, or a directory where the index has a file: deleted.
            None | Some(NodeKind::Dir) => Ok(true),
            Some(NodeKind::Symlink(target)) => {
                Ok(!is_link || blob_id_of(target).as_ref() != entry.oid)
            }
            Some(NodeKind::File(fingerprint)) => {
                if is_link || entry.mode & S_IFMT != S_IFREG {
                    return Ok(true);
                }
                let node = node.expect("matched a node");
                if self.settings.filemode && (entry.mode ^ node.meta.mode) & 0o100 != 0 {
                    return Ok(true);
                }
                // Whole seconds, as git built without USE_NSEC (its
                // default) compares them: a finer comparison would hash
                // files git calls clean without looking, and disagree.
                let stat = &entry.stat;
                let same_stat = stat.mtime_sec == fingerprint.mtime_sec as u32
                    && stat.ctime_sec == fingerprint.ctime_sec as u32
                    && stat.ino == fingerprint.ino as u32
                    && stat.uid == node.meta.uid
                    && stat.gid == node.meta.gid
                    && stat.size == fingerprint.size as u32
                    // Git's "racily smudged" entry: size 0, not empty.
                    && (stat.size != 0 || entry.oid == EMPTY_BLOB);
                // The file may have changed within the second the index
                // was written, its stat data staying the same.
                let racy = self
                    .index
                    .written
                    .is_none_or(|sec| sec <= i64::from(stat.mtime_sec));
                if same_stat && !racy {
                    return Ok(false);
                }
                self.content_differs(entry)
            }
        }
    }

    /// Whether the working file's content, as git would store it, is
    /// another object than the entry's.
    fn content_differs(&mut self, entry: &Entry<'_>) -> Result<bool, LeftToGit> {
        let as_path = Path::new(OsStr::from_bytes(entry.path));
        // Not libgit2's attribute lookup: it reads the whole index first.
        let conversion = self
            .settings
            .conversion
            .max(self.conversion_in(parent(entry.path))?);
        if conversion == Conversion::Rewrites {
            return Err(LeftToGit(
                "a file to compare may have a filter, ident or encoding attribute",
            ));
        }
        let converts_line_endings = conversion == Conversion::LineEndings;
        let file = self.dir.join(as_path);
        let mut file = match std::fs::File::open(&file) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
            Err(_) => return Err(LeftToGit("a file to compare cannot be read")),
        };
        let size = file
            .metadata()
            .map_err(|_| LeftToGit("a file to compare cannot be read"))?
            .len();
        let mut hash = blob_hasher(size);
        let mut buffer = vec![0; 64 << 10];
        let mut read = 0u64;
        loop {
            let n = match file.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return Err(LeftToGit("a file to compare cannot be read")),
            };
            if converts_line_endings && buffer[..n].contains(&b'\r') {
                return Err(LeftToGit(
                    "a file to compare holds a CR and its line endings may be converted",
                ));
            }
            hash.update(&buffer[..n]);
            read += n as u64;
        }
        if read != size {
            // It changed while read: the next walk sees it again.
            return Ok(true);
        }
        Ok(hash.finish().as_ref() != entry.oid)
    }

    /// What the `.gitattributes` files of the directory `inside` and the
    /// directories above it may do.
    fn conversion_in(&mut self, inside: &[u8]) -> Result<Conversion, LeftToGit> {
        if let Some(known) = self.conversions.get(inside) {
            return Ok(*known);
        }
        let above = match inside.is_empty() {
            true => Conversion::None,
            false => self.conversion_in(parent(inside))?,
        };
        let here = match self.listing(inside).and_then(|l| l.node(b".gitattributes")) {
            Some(_) => Conversion::of_file(
                &self
                    .dir
                    .join(OsStr::from_bytes(&join_rel(inside, b".gitattributes"))),
            )?,
            None => Conversion::None,
        };
        let conversion = above.max(here);
        self.conversions.insert(inside.to_vec(), conversion);
        Ok(conversion)
    }

    /// Whether git's ignore rules exclude `path` (relative to the work
    /// tree; a directory's path ends in `/`, or is checked as one on disk).
    fn ignored(&self, path: &[u8]) -> Result<bool, LeftToGit> {
        let trimmed = path.strip_suffix(b"/").unwrap_or(path);
        self.repo
            .is_path_ignored(Path::new(OsStr::from_bytes(trimmed)))
            .map_err(|_| LeftToGit("its ignore rules cannot be read"))
    }

    /// Whether the directory `inside` (relative to the work tree) is a
    /// nested repository or inside one: git lists nothing there.
    fn in_nested_repo(&self, inside: &[u8]) -> Result<bool, LeftToGit> {
        let mut at = inside;
        while !at.is_empty() {
            if self.nested_repo(at)? {
                return Ok(true);
            }
            at = parent(at);
        }
        Ok(false)
    }

    /// Whether the directory `inside` is a repository of its own (a `.git`
    /// directory with `HEAD`, `objects` and `refs`, as git checks).
    fn nested_repo(&self, inside: &[u8]) -> Result<bool, LeftToGit> {
        let Some(listing) = self.listing(inside) else {
            return Ok(false);
        };
        match listing.node(b".git").map(|n| &n.kind) {
            None => Ok(false),
            Some(NodeKind::Dir) => {
                let git_dir = self.listing(&join_rel(inside, b".git"));
                let has = |name: &[u8]| git_dir.is_some_and(|l| l.node(name).is_some());
                Ok(has(b"HEAD") && has(b"objects") && has(b"refs"))
            }
            Some(_) => Err(LeftToGit("a .git file below the work tree")),
        }
    }

    /// The listing of the work tree's directory `inside`.
    fn listing(&self, inside: &[u8]) -> Option<&'a ScannedDir> {
        self.listing_in(self.new, inside)
    }

    /// The same in the walk the last reading followed.
    fn old_listing(&self, inside: &[u8]) -> Option<&'a ScannedDir> {
        self.listing_in(self.covered.old, inside)
    }

    fn listing_in(&self, walk: &'a Scan, inside: &[u8]) -> Option<&'a ScannedDir> {
        walk.listing(&work_tree_path(self.rel, inside))
            .map(AsRef::as_ref)
    }
}

/// A walk along a list sorted by name, asked for names in ascending order.
struct Along<'l, T> {
    items: &'l [T],
}

impl<'l, T> Along<'l, T> {
    fn new(items: &'l [T]) -> Self {
        Self { items }
    }

    /// The item called `name`, passing over those before it (never asked
    /// for again).
    fn find(&mut self, name: &[u8], name_of: impl Fn(&'l T) -> &'l [u8]) -> Option<&'l T> {
        while let Some((first, rest)) = self.items.split_first() {
            match name_of(first).cmp(name) {
                std::cmp::Ordering::Less => self.items = rest,
                std::cmp::Ordering::Equal => return Some(first),
                std::cmp::Ordering::Greater => return None,
            }
        }
        None
    }
}

/// Git's object hash of a blob of `len` bytes, its header hashed.
fn blob_hasher(len: u64) -> digest::Context {
    let mut hash = digest::Context::new(&digest::SHA1_FOR_LEGACY_USE_ONLY);
    hash.update(format!("blob {len}\0").as_bytes());
    hash
}

/// Git's id of a blob holding `content`.
fn blob_id_of(content: &[u8]) -> digest::Digest {
    let mut hash = blob_hasher(content.len() as u64);
    hash.update(content);
    hash.finish()
}

fn file_name(path: &[u8]) -> &[u8] {
    crate::scan::split_rel(path).map_or(path, |(_, name)| name)
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt as _;
    use std::time::{Duration, SystemTime};

    use super::super::narrow::ReadBy;
    use super::super::testing::{Workspace, git};
    use super::*;

    fn set_mtime(path: &Path, when: SystemTime) {
        let file = fs::File::options().write(true).open(path).unwrap();
        file.set_modified(when).unwrap();
    }

    fn long_ago() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_500_000_000)
    }

    fn kinds(ws: &Workspace, path: &str) -> Option<u8> {
        ws.status.records.get(path.as_bytes()).copied()
    }

    /// Reads against the last reading (checked against a full `git status`
    /// by [`Workspace::read`]) and says how it was read.
    fn read(ws: &mut Workspace) -> ReadBy {
        ws.read();
        ws.status.read_by
    }

    #[test]
    fn a_derived_status_lists_what_git_does_through_edits_modes_links_deletions_and_ignores() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        let mut ws = Workspace::new(&root);
        for (path, content) in [
            ("src/a.rs", "a"),
            ("src/b.rs", "b"),
            ("src/c.rs", "c"),
            ("src/same.rs", "aaaa"),
            ("docs/x.md", "x"),
            ("tool.sh", "echo"),
            ("data/d1.txt", "d"),
            (".gitignore", "*.log\n!keep.log\nbuild/\n"),
        ] {
            ws.write(path, content);
            // Older than the index: the stat data decides, not the content.
            set_mtime(&ws.repo.join(path), long_ago());
        }
        std::os::unix::fs::symlink("src/a.rs", ws.repo.join("link")).unwrap();
        ws.git(&["add", "-A"]);
        ws.git(&["commit", "-qm", "one"]);
        assert_eq!(read(&mut ws), ReadBy::FullGit, "HEAD was born");

        ws.write("src/a.rs", "a longer a");
        // Same size, same mtime: only the inode change time tells, in
        // whole seconds.
        let ctime = |path: &str| {
            std::os::unix::fs::MetadataExt::ctime(&fs::metadata(ws.repo.join(path)).unwrap())
        };
        let added = ctime("src/same.rs");
        // Until the change time is a later second by the file system's own
        // clock, which lags the wall clock by up to a tick.
        loop {
            ws.write("src/same.rs", "bbbb");
            set_mtime(&ws.repo.join("src/same.rs"), long_ago());
            if ctime("src/same.rs") > added {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let tool = ws.repo.join("tool.sh");
        fs::set_permissions(&tool, fs::Permissions::from_mode(0o755)).unwrap();
        fs::remove_file(ws.repo.join("link")).unwrap();
        std::os::unix::fs::symlink("src/b.rs", ws.repo.join("link")).unwrap();
        fs::remove_file(ws.repo.join("docs/x.md")).unwrap();
        fs::remove_file(ws.repo.join("data/d1.txt")).unwrap();
        ws.write("data/d1.txt/inner.txt", "now a directory");
        for (path, content) in [
            ("src/new.rs", "n"),
            ("src/debug.log", "ignored"),
            ("src/keep.log", "not ignored"),
            ("build/out/o.txt", "ignored directory"),
            ("build/keep.log", "in an ignored directory"),
        ] {
            ws.write(path, content);
        }
        assert_eq!(read(&mut ws), ReadBy::Derived);
        for (path, expected) in [
            ("src/a.rs", Some(UNSTAGED)),
            ("src/same.rs", Some(UNSTAGED)),
            ("tool.sh", Some(UNSTAGED)),
            ("link", Some(UNSTAGED)),
            ("docs/x.md", Some(UNSTAGED)),
            ("data/d1.txt", Some(UNSTAGED)),
            ("data/d1.txt/inner.txt", Some(UNTRACKED)),
            ("src/new.rs", Some(UNTRACKED)),
            ("src/keep.log", Some(UNTRACKED)),
            ("src/b.rs", None),
            ("src/debug.log", None),
            ("build/out/o.txt", None),
            ("build/keep.log", None),
        ] {
            assert_eq!(kinds(&ws, path), expected, "{path}");
        }

        // Staging; a deletion staged; a path staged for deletion but kept.
        ws.git(&["add", "src/a.rs", "tool.sh"]);
        ws.git(&["rm", "-q", "docs/x.md"]);
        ws.git(&["rm", "-q", "--cached", "src/b.rs"]);
        assert_eq!(read(&mut ws), ReadBy::Derived);
        assert_eq!(kinds(&ws, "src/a.rs"), Some(STAGED));
        assert_eq!(kinds(&ws, "tool.sh"), Some(STAGED));
        assert_eq!(kinds(&ws, "docs/x.md"), Some(STAGED));
        assert_eq!(kinds(&ws, "src/b.rs"), Some(STAGED | UNTRACKED));
        assert_eq!(ws.status.state.staged, 4);

        // Touched, not changed: hashed, and clean. The staged deletion in
        // the same directory stays.
        set_mtime(&ws.repo.join("src/c.rs"), SystemTime::now());
        assert_eq!(read(&mut ws), ReadBy::Derived);
        assert_eq!(kinds(&ws, "src/c.rs"), None);
        assert_eq!(kinds(&ws, "src/b.rs"), Some(STAGED | UNTRACKED));

        ws.git(&["commit", "-qm", "two"]);
        assert_eq!(read(&mut ws), ReadBy::Derived);

        // A nested repository is one untracked record, whatever is in it.
        git(&ws.repo.join("src"), &["init", "-q", "nested"]);
        ws.write("src/nested/inner.txt", "i");
        assert_eq!(read(&mut ws), ReadBy::Derived);
        assert_eq!(kinds(&ws, "src/nested/"), Some(UNTRACKED));
        ws.write("src/nested/deeper/more.txt", "m");
        assert_eq!(read(&mut ws), ReadBy::Derived);
        assert_eq!(kinds(&ws, "src/nested/deeper/more.txt"), None);

        // An ignore rule that changes what is untracked below it.
        ws.write(".gitignore", "*.log\n!keep.log\nbuild/\nsrc/new.rs\n");
        assert_eq!(read(&mut ws), ReadBy::Derived);
        assert_eq!(kinds(&ws, "src/new.rs"), None);

        // An upstream, and a commit ahead of it.
        let origin = root.join("origin.git");
        fs::create_dir(&origin).unwrap();
        git(&origin, &["init", "-q", "--bare"]);
        ws.git(&["remote", "add", "origin", origin.to_str().unwrap()]);
        ws.git(&["push", "-q", "-u", "origin", "main"]);
        assert_eq!(read(&mut ws), ReadBy::FullGit, ".git/config changed");
        assert_eq!(ws.status.state.upstream, "origin/main");
        ws.write("src/c.rs", "c2");
        ws.git(&["commit", "-qam", "three"]);
        assert_eq!(read(&mut ws), ReadBy::Derived);
        assert_eq!((ws.status.state.ahead, ws.status.state.behind), (1, 0));
    }

    #[test]
    fn what_git_would_convert_or_that_is_marked_is_left_to_git() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        let mut ws = Workspace::new(&root);
        ws.write(".gitattributes", "*.txt text\n");
        ws.write("id/.gitattributes", "*.id ident\n");
        ws.write("id/a.id", "$Id$\n");
        ws.write("b.txt", "b\n");
        ws.write("c.rs", "c\n");
        ws.git(&["add", "-A"]);
        ws.git(&["commit", "-qm", "one"]);
        assert_eq!(read(&mut ws), ReadBy::FullGit);

        ws.write("id/a.id", "$Id$\nmore\n");
        assert_eq!(read(&mut ws), ReadBy::NarrowedGit, "ident rewrites it");
        ws.write("b.txt", "b\r\n");
        assert_eq!(read(&mut ws), ReadBy::NarrowedGit, "a CR in a text file");
        ws.write("b.txt", "b2\n");
        assert_eq!(read(&mut ws), ReadBy::Derived, "no CR: nothing converts");

        ws.write("new.rs", "n");
        ws.git(&["add", "-N", "new.rs"]);
        assert_eq!(read(&mut ws), ReadBy::NarrowedGit, "intent to add");
        ws.git(&["add", "new.rs"]);
        assert_eq!(read(&mut ws), ReadBy::Derived);
    }

    #[test]
    fn attributes_files_are_read_for_the_attributes_that_change_content() {
        assert_eq!(
            Conversion::of_text(b"*.png binary\n*.rs diff=rust\n"),
            Conversion::None
        );
        assert_eq!(
            Conversion::of_text(b"* text=auto eol=lf\n"),
            Conversion::LineEndings
        );
        assert_eq!(
            Conversion::of_text(b"*.bin -crlf\n"),
            Conversion::LineEndings
        );
        for rewriting in [
            &b"*.psd filter=lfs diff=lfs merge=lfs -text\n"[..],
            b"*.c ident\n",
            b"*.txt working-tree-encoding=UTF-16\n",
        ] {
            assert_eq!(Conversion::of_text(rewriting), Conversion::Rewrites);
        }
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(
            Conversion::of_file(&tmp.path().join("none")).unwrap(),
            Conversion::None
        );
    }

    #[test]
    fn the_empty_blob_id_is_gits() {
        assert_eq!(blob_id_of(b"").as_ref(), EMPTY_BLOB);
        // `printf hello | git hash-object --stdin`
        assert_eq!(
            Oid::from_bytes(blob_id_of(b"hello").as_ref())
                .unwrap()
                .to_string(),
            "b6fc4c620b67d95f953a5c1c1230aaab5db5a1b0"
        );
    }
}
