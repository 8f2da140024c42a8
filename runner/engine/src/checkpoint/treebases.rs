//! Which packed tree each new loose git tree can be stored as a delta of.
//!
//! A commit writes one loose tree per directory on each changed path, each
//! kilobytes of 20-byte ids that no compressor shrinks, although only an
//! entry or two differ from the same directory's tree in the parent commit.
//! Before the files are read, this walks the first-parent history of each
//! repository's HEAD while its root trees are loose, pairs every loose tree
//! with the tree at the same path one commit earlier, and follows those
//! pairs back to a tree that only a pack holds: the base. The reader then
//! stores the loose tree as a delta against that base
//! ([`crate::gitobj::tree_delta`]); restore reads the base from the restored
//! packs and rebuilds the identical file.
//!
//! Only a base held by a pack is used: it is in the same checkpoint, and it
//! cannot be a delta itself.
//!
//! Repositories with alternates (objects that may live outside the
//! workspace) and SHA-256 repositories are left alone, and so is anything
//! this walk cannot read: those trees are stored as the files they are.
//!
//! The walk reads commits and trees through libgit2, tens of milliseconds
//! per checkpoint once a few commits are loose, so it is cut short by what
//! an earlier checkpoint stored: a loose tree the memo or the cache knows
//! keeps the base it was stored against, as long as every pack of the
//! repository is as it was then (none gone, none new). The walk then stops
//! at the first commit whose root tree is known, and a new tree whose
//! earlier version is known takes that version's base. Nothing is walked
//! when every loose object is known.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

use git2::{Oid, Repository};

use super::memo::Memo;
use crate::cache::FingerprintCache;
use crate::gitobj::{self, GitStored, TreeCache};
use crate::scan::{NodeKind, Scan, join_rel};

/// How far back the first-parent history is followed for a base.
const MAX_COMMITS: usize = 32;

/// What an earlier checkpoint stored a loose object as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    /// Not known as it is now: read by this checkpoint.
    No,
    /// Stored as it is (or as the blob it holds).
    Plain,
    /// Stored as a delta against this packed tree.
    Delta([u8; 20]),
}

/// A loose object of a repository.
#[derive(Debug)]
struct LooseObject {
    rel: Vec<u8>,
    known: Known,
}

/// The loose objects of one repository, by id.
type Loose = HashMap<Oid, LooseObject>;

/// A packed tree a loose tree is stored against.
#[derive(Debug, Clone)]
pub struct Base {
    pub id: [u8; 20],
    /// Its content; empty when the loose tree is known as it is (then only
    /// the id is compared).
    pub content: Arc<[u8]>,
}

/// Loose tree file (path relative to the root) → its base.
#[derive(Debug, Default)]
pub struct TreeBases {
    by_path: HashMap<Vec<u8>, Base>,
}

impl TreeBases {
    pub fn get(&self, rel: &[u8]) -> Option<&Base> {
        self.by_path.get(rel)
    }

    /// Finds the bases of the loose trees in `scan`. What an earlier
    /// checkpoint stored (`memo` for the listings it remembers, else the
    /// cache) is kept while every pack is as it was then; only newer
    /// commits are walked, and contents are loaded only for their trees.
    pub fn find(
        scan: &Scan,
        cache: &FingerprintCache,
        memo: Option<&Memo>,
        trees: &TreeCache,
    ) -> Self {
        let mut bases = Self::default();
        for (objects, loose) in loose_objects(scan, cache, memo) {
            let packs_unchanged = packs_unchanged(scan, &objects, cache, memo);
            let known_bases = loose.values().filter_map(|object| match object.known {
                Known::Delta(id) => Some((
                    object.rel.clone(),
                    Base {
                        id,
                        content: Arc::default(),
                    },
                )),
                _ => None,
            });
            let all_known = loose.values().all(|object| object.known != Known::No);
            if packs_unchanged && all_known {
                bases.by_path.extend(known_bases);
                continue;
            }
            let objects_dir = scan.root.join(OsStr::from_bytes(&objects));
            if objects_dir.join("info/alternates").exists() {
                continue;
            }
            let Some(git_dir) = objects_dir.parent() else {
                continue;
            };
            match bases_in(git_dir, &loose, packs_unchanged, trees) {
                Ok(found) => {
                    if packs_unchanged {
                        bases.by_path.extend(known_bases);
                    }
                    bases.by_path.extend(found);
                }
                Err(e) => {
                    tracing::debug!(repository = %git_dir.display(), error = %e, "no tree deltas for this repository");
                }
            }
        }
        bases
    }
}

/// Per objects directory (relative path): its loose objects.
fn loose_objects(
    scan: &Scan,
    cache: &FingerprintCache,
    memo: Option<&Memo>,
) -> HashMap<Vec<u8>, Loose> {
    let mut found: HashMap<Vec<u8>, Loose> = HashMap::new();
    for dir in &scan.dirs {
        let Some(slash) = dir.path.iter().rposition(|b| *b == b'/') else {
            continue;
        };
        let objects = &dir.path[..slash];
        if !objects.ends_with(b"/objects") && objects != b"objects" {
            continue;
        }
        let remembered = memo.and_then(|memo| memo.get(dir));
        for (n, node) in dir.nodes.iter().enumerate() {
            let NodeKind::File(fingerprint) = &node.kind else {
                continue;
            };
            let rel = join_rel(&dir.path, &node.name);
            let Some(oid) = gitobj::loose_object_id(&rel).and_then(|id| Oid::from_bytes(&id).ok())
            else {
                continue;
            };
            let stored = match remembered {
                Some(outcome) => outcome.files[n].as_ref().map(|file| file.git),
                None => cache.lookup(&rel, fingerprint).map(|known| known.git),
            };
            let known = match stored {
                None => Known::No,
                Some(Some(GitStored::TreeDelta { base, .. })) => Known::Delta(base),
                Some(_) => Known::Plain,
            };
            found
                .entry(objects.to_vec())
                .or_default()
                .insert(oid, LooseObject { rel, known });
        }
    }
    found
}

/// Whether every pack of `objects` is as it was when the loose objects
/// known to an earlier checkpoint were stored: then each base they name is
/// still in the pack it was found in.
fn packs_unchanged(
    scan: &Scan,
    objects: &[u8],
    cache: &FingerprintCache,
    memo: Option<&Memo>,
) -> bool {
    let pack_dir = join_rel(objects, b"pack");
    let Some(listed) = scan.listing(&pack_dir) else {
        return cache.files_in(&pack_dir).next().is_none();
    };
    if memo.is_some_and(|memo| memo.get(listed).is_some()) {
        return true;
    }
    let mut packs_seen = 0;
    for node in &listed.nodes {
        if let NodeKind::File(fingerprint) = &node.kind {
            if cache
                .lookup(&join_rel(&pack_dir, &node.name), fingerprint)
                .is_none()
            {
                return false;
            }
            packs_seen += 1;
        }
    }
    // A pack the cache knows that is gone may have held a base.
    cache.files_in(&pack_dir).count() == packs_seen
}

/// The bases of the loose trees of the repository at `git_dir` that no
/// earlier checkpoint stored. With `trust_known`, only the commits newer
/// than what an earlier checkpoint stored are walked, and a tree's base is
/// the one its known earlier version was stored against.
fn bases_in(
    git_dir: &std::path::Path,
    loose: &Loose,
    trust_known: bool,
    trees: &TreeCache,
) -> Result<HashMap<Vec<u8>, Base>, git2::Error> {
    let known = |oid: &Oid| match loose.get(oid) {
        Some(object) if trust_known => object.known,
        _ => Known::No,
    };
    crate::git::init();
    let repo = Repository::open_bare(git_dir)?;
    let odb = repo.odb()?;
    let mut previous: HashMap<Oid, Oid> = HashMap::new();
    let mut commit = repo.head()?.peel_to_commit()?;
    for _ in 0..MAX_COMMITS {
        if !loose.contains_key(&commit.tree_id()) || known(&commit.tree_id()) != Known::No {
            break;
        }
        let Ok(parent) = commit.parent(0) else {
            break;
        };
        let pair = Pair {
            odb: &odb,
            trees,
            loose,
            known: &known,
        };
        pair.trees(commit.tree_id(), parent.tree_id(), &mut previous)?;
        commit = parent;
    }
    let mut bases = HashMap::new();
    for (&tree, &earlier) in &previous {
        // Back along the same path to a version only a pack holds, or to
        // one stored before.
        let mut base = earlier;
        let mut steps = 0;
        while loose.contains_key(&base) && known(&base) == Known::No && steps < MAX_COMMITS {
            let Some(&older) = previous.get(&base) else {
                break;
            };
            base = older;
            steps += 1;
        }
        let base = match known(&base) {
            Known::Delta(id) => Oid::from_bytes(&id)?,
            Known::Plain => continue,
            Known::No if loose.contains_key(&base) => continue,
            Known::No => base,
        };
        let object = &loose[&tree];
        let id: [u8; 20] = base.as_bytes().try_into().expect("a SHA-1 id");
        let content = if object.known == Known::Delta(id) {
            Arc::default()
        } else {
            match trees.read(&odb, base) {
                Ok(content) => content,
                Err(_) => continue,
            }
        };
        bases.insert(object.rel.clone(), Base { id, content });
    }
    Ok(bases)
}

/// Pairs loose trees with their versions one commit earlier.
struct Pair<'a> {
    odb: &'a git2::Odb<'a>,
    trees: &'a TreeCache,
    loose: &'a Loose,
    known: &'a dyn Fn(&Oid) -> Known,
}

impl Pair<'_> {
    /// Records `new` (a loose tree no earlier checkpoint stored) as the
    /// next version of `old`, and so on for the subtrees they share by name.
    fn trees(
        &self,
        new: Oid,
        old: Oid,
        previous: &mut HashMap<Oid, Oid>,
    ) -> Result<(), git2::Error> {
        if new == old
            || !self.loose.contains_key(&new)
            || (self.known)(&new) != Known::No
            || previous.contains_key(&new)
        {
            return Ok(());
        }
        previous.insert(new, old);
        let (new_tree, old_tree) = (
            self.trees.read(self.odb, new)?,
            self.trees.read(self.odb, old)?,
        );
        let (new_entries, old_entries) = (
            gitobj::parse_tree(&new_tree)?,
            gitobj::parse_tree(&old_tree)?,
        );
        let mut old_subtrees = old_entries.iter().filter(|e| e.is_tree()).peekable();
        for new in new_entries.iter().filter(|e| e.is_tree()) {
            let before = |old: &&gitobj::TreeEntry<'_>| old.git_order(new).is_lt();
            while old_subtrees.next_if(before).is_some() {}
            if let Some(old) = old_subtrees.next_if(|old| old.name == new.name) {
                self.trees(Oid::from_bytes(new.id)?, Oid::from_bytes(old.id)?, previous)?;
            }
        }
        Ok(())
    }
}
