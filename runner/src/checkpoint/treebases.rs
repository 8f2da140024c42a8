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
//! per checkpoint once a few commits are loose. It is skipped for a
//! repository whose loose objects and pack files are all as the cache knows
//! them (and none of the packs it knows is gone): no new loose tree needs a
//! base, and every cached base is still in the pack it was found in.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use git2::{ObjectType, Oid, Repository};

use crate::cache::{Cache, Fingerprint};
use crate::gitobj::{self, GitStored};
use crate::scan::{NodeKind, Scan, join_rel};

/// How far back the first-parent history is followed for a base.
const MAX_COMMITS: usize = 32;

/// The loose objects of one repository: id → (path, fingerprint).
type Loose = HashMap<Oid, (Vec<u8>, Fingerprint)>;

/// A packed tree a loose tree is stored against.
#[derive(Debug, Clone)]
pub struct Base {
    pub id: [u8; 20],
    /// Its content; empty when the loose tree is known to the cache (then
    /// only the id is compared).
    pub content: Vec<u8>,
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

    /// Finds the bases of the loose trees in `scan`. Contents are loaded
    /// only for the files the cache does not know as they are.
    pub fn find(scan: &Scan, cache: &Cache) -> Self {
        let mut bases = Self::default();
        for (objects, loose) in loose_objects(scan) {
            if let Some(cached) = cached_bases(scan, &objects, &loose, cache) {
                bases.by_path.extend(cached);
                continue;
            }
            let objects_dir = scan.root.join(OsStr::from_bytes(&objects));
            if objects_dir.join("info/alternates").exists() {
                continue;
            }
            let Some(git_dir) = objects_dir.parent() else {
                continue;
            };
            match bases_in(git_dir, &loose, cache) {
                Ok(found) => bases.by_path.extend(found),
                Err(e) => {
                    tracing::debug!(repository = %git_dir.display(), error = %e, "no tree deltas for this repository");
                }
            }
        }
        bases
    }
}

/// Per objects directory (relative path): the loose objects it holds, by
/// id, with their fingerprints.
fn loose_objects(scan: &Scan) -> HashMap<Vec<u8>, Loose> {
    let mut found: HashMap<Vec<u8>, Loose> = HashMap::new();
    for dir in &scan.dirs {
        let Some(slash) = dir.path.iter().rposition(|b| *b == b'/') else {
            continue;
        };
        let objects = &dir.path[..slash];
        if !objects.ends_with(b"/objects") && objects != b"objects" {
            continue;
        }
        for node in &dir.nodes {
            let NodeKind::File(fingerprint) = &node.kind else {
                continue;
            };
            let rel = join_rel(&dir.path, &node.name);
            if let Some(id) = gitobj::loose_object_id(&rel)
                && let Ok(oid) = Oid::from_bytes(&id)
            {
                found
                    .entry(objects.to_vec())
                    .or_default()
                    .insert(oid, (rel, *fingerprint));
            }
        }
    }
    found
}

/// The bases the cache holds for the loose trees of `objects`, when nothing
/// that could change them changed (see the module doc); None: walk.
fn cached_bases(
    scan: &Scan,
    objects: &[u8],
    loose: &Loose,
    cache: &Cache,
) -> Option<HashMap<Vec<u8>, Base>> {
    let mut bases = HashMap::new();
    for (rel, fingerprint) in loose.values() {
        let known = cache.lookup(rel, fingerprint)?;
        if let Some(GitStored::TreeDelta { base, .. }) = known.git {
            bases.insert(
                rel.clone(),
                Base {
                    id: base,
                    content: Vec::new(),
                },
            );
        }
    }
    let pack_dir = join_rel(objects, b"pack");
    let listed = scan
        .dirs
        .binary_search_by(|d| d.path[..].cmp(&pack_dir[..]))
        .ok()
        .map(|at| &scan.dirs[at]);
    let mut packs_seen = 0;
    for node in listed.map(|d| &d.nodes[..]).unwrap_or_default() {
        if let NodeKind::File(fingerprint) = &node.kind {
            cache.lookup(&join_rel(&pack_dir, &node.name), fingerprint)?;
            packs_seen += 1;
        }
    }
    // A pack the cache knows that is gone may have held a base.
    (cache.files_in(&pack_dir).count() == packs_seen).then_some(bases)
}

fn bases_in(
    git_dir: &std::path::Path,
    loose: &Loose,
    cache: &Cache,
) -> Result<HashMap<Vec<u8>, Base>, git2::Error> {
    let repo = Repository::open_bare(git_dir)?;
    let mut previous: HashMap<Oid, Oid> = HashMap::new();
    let mut commit = repo.head()?.peel_to_commit()?;
    for _ in 0..MAX_COMMITS {
        if !loose.contains_key(&commit.tree_id()) {
            break;
        }
        let Ok(parent) = commit.parent(0) else {
            break;
        };
        pair_trees(
            &repo,
            commit.tree_id(),
            parent.tree_id(),
            loose,
            &mut previous,
        )?;
        commit = parent;
    }
    let odb = repo.odb()?;
    let mut bases = HashMap::new();
    for (&tree, &earlier) in &previous {
        // Back along the same path to a version only a pack holds.
        let mut base = earlier;
        let mut steps = 0;
        while loose.contains_key(&base) && steps < MAX_COMMITS {
            let Some(&older) = previous.get(&base) else {
                break;
            };
            base = older;
            steps += 1;
        }
        if loose.contains_key(&base) {
            continue;
        }
        let (rel, fingerprint) = &loose[&tree];
        let id: [u8; 20] = base.as_bytes().try_into().expect("a SHA-1 id");
        let known = cache.lookup(rel, fingerprint).is_some_and(
            |known| matches!(known.git, Some(GitStored::TreeDelta { base, .. }) if base == id),
        );
        let content = if known {
            Vec::new()
        } else {
            let object = odb.read(base)?;
            if object.kind() != ObjectType::Tree {
                continue;
            }
            object.data().to_vec()
        };
        bases.insert(rel.clone(), Base { id, content });
    }
    Ok(bases)
}

/// Records `new` (a loose tree) as the next version of `old`, and so on
/// for the subtrees they share by name.
fn pair_trees(
    repo: &Repository,
    new: Oid,
    old: Oid,
    loose: &Loose,
    previous: &mut HashMap<Oid, Oid>,
) -> Result<(), git2::Error> {
    if new == old || !loose.contains_key(&new) || previous.contains_key(&new) {
        return Ok(());
    }
    previous.insert(new, old);
    let (new_tree, old_tree) = (repo.find_tree(new)?, repo.find_tree(old)?);
    let old_subtrees: HashMap<Vec<u8>, Oid> = old_tree
        .iter()
        .filter(|e| e.kind() == Some(ObjectType::Tree))
        .map(|e| (e.name_bytes().to_vec(), e.id()))
        .collect();
    let pairs: Vec<(Oid, Oid)> = new_tree
        .iter()
        .filter(|e| e.kind() == Some(ObjectType::Tree))
        .filter_map(|e| Some((e.id(), *old_subtrees.get(e.name_bytes())?)))
        .collect();
    for (new, old) in pairs {
        pair_trees(repo, new, old, loose, previous)?;
    }
    Ok(())
}
