//! The trees stage ([`store_trees`]): building the checkpoint's Merkle tree,
//! one tree object per directory, and storing the trees the store lacks.
//!
//! Directories are encoded deepest first, so every subdirectory's id is
//! known when its parent is encoded. A tree's id is the keyed hash of its
//! bytes, so a directory whose entries (names, kinds, modes, times, owners,
//! contents) did not change keeps its id, and so does every directory above
//! an unchanged subtree: an incremental checkpoint re-sends only the trees on
//! the paths to what changed.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use cairn_proto::domain::PackKind;
use cairn_proto::ids::BlobId;

use super::CheckpointError;
use super::content::Content;
use super::dir::{Counts, DirFiles, DirTree};
use super::memo::Memo;
use super::upload::Store;
use crate::cache::FingerprintCache;
use crate::format::TenantKeys;
use crate::scan::{NodeKind, Scan, join_rel_into, parent_rel};
use crate::task::blocking;

/// The encoded trees of a checkpoint.
#[derive(Debug)]
pub struct Trees {
    pub root: BlobId,
    /// Per directory, indexed like the scan's.
    pub dirs: Vec<DirTree>,
    /// Trees that `known` did not recognise, each once, with their bytes.
    pub unknown: Vec<(BlobId, Vec<u8>)>,
    pub counts: Counts,
    /// Directories whose remembered tree was taken as it was.
    pub reused: u64,
}

/// What the trees stage builds from.
pub(crate) struct Building {
    /// The walk, as the limits left it.
    pub scan: Arc<Scan>,
    /// What the content stage found.
    pub content: Content,
    pub cache: Arc<FingerprintCache>,
    pub memo: Option<Arc<Memo>>,
    pub keys: Arc<TenantKeys>,
    pub started: Instant,
}

/// The trees stage: encodes every directory's tree on a blocking thread
/// (see [`build`]), taking the memo's where it can, and has `store` store
/// those it lacks in META packs, whose uploads start as they fill. Gives
/// the content back with the trees.
pub(crate) async fn store_trees(
    store: &mut Store<'_>,
    building: Building,
) -> Result<(Trees, Content), CheckpointError> {
    let Building {
        scan,
        content,
        cache,
        memo,
        keys,
        started,
    } = building;
    let (mut trees, content) = blocking(move || {
        let remembered = remembered_trees(&scan, &content, memo.as_deref());
        let known = |id: &BlobId| cache.knows_blob(id);
        let trees = build(&scan, &content.files, &keys, &known, &remembered);
        drop(remembered);
        (trees, content)
    })
    .await;
    let elapsed_ms = || started.elapsed().as_millis() as u64;
    tracing::debug!(
        dirs_reused = trees.reused,
        elapsed_ms = elapsed_ms(),
        "trees built"
    );
    store
        .store(PackKind::Meta, std::mem::take(&mut trees.unknown))
        .await?;
    store.finish_pack(PackKind::Meta).await?;
    Ok((trees, content))
}

/// Per directory, the tree `memo` remembers for it if its files were taken
/// from the memo.
fn remembered_trees<'m>(
    scan: &Scan,
    content: &Content,
    memo: Option<&'m Memo>,
) -> Vec<Option<&'m DirTree>> {
    let Some(memo) = memo else {
        return Vec::new();
    };
    scan.dirs
        .iter()
        .zip(&content.from_memo)
        .map(|(dir, &from_memo)| {
            memo.get(dir)
                .filter(|_| from_memo)
                .map(|outcome| &outcome.tree)
        })
        .collect()
}

/// Encodes every directory of `scan`, with file contents from `files`
/// (indexed like `scan.dirs[d].nodes[n]`; None leaves the file out).
/// `remembered[d]`, when set, is the tree directory `d` had with these very
/// files (the same listing); it is taken as it is if its subdirectories'
/// trees are unchanged.
///
/// Only the directories on the paths to a change are looked at entry by
/// entry: a remembered directory none of whose subdirectories got another
/// tree is taken without listing its subdirectories' trees. (Its listing
/// being the one remembered, it has the same subdirectories, each listed.)
pub fn build(
    scan: &Scan,
    files: &[DirFiles],
    keys: &TenantKeys,
    known: &dyn Fn(&BlobId) -> bool,
    remembered: &[Option<&DirTree>],
) -> Trees {
    // Per directory (as indexed in the scan), its tree, once built; found by
    // a search of the sorted scan, only for the few directories encoded,
    // rather than by hashing the path of every directory.
    let mut by_dir: Vec<Option<BlobId>> = vec![None; scan.dirs.len()];
    // Directories with a subdirectory whose tree is not the remembered one.
    let mut changed_below = vec![false; scan.dirs.len()];
    let mut dirs = Vec::with_capacity(scan.dirs.len());
    let mut unknown = Vec::new();
    let mut sent = HashSet::new();
    let mut counts = Counts::default();
    let mut reused = 0;
    let mut path = Vec::new();
    // Sorted by path bytes, a directory comes before everything below it;
    // walking backwards meets children first.
    for (d, dir) in scan.dirs.iter().enumerate().rev() {
        let remembered = remembered.get(d).copied().flatten();
        let tree = match remembered {
            Some(tree) if !changed_below[d] => tree.clone(),
            _ => {
                let mut subtrees = Vec::new();
                for node in &dir.nodes {
                    if let NodeKind::Dir = node.kind {
                        join_rel_into(&mut path, &dir.path, &node.name);
                        // A directory without a listing vanished during the walk.
                        subtrees.push(scan.position(&path).and_then(|at| by_dir[at]));
                    }
                }
                match remembered {
                    Some(tree) if *tree.subtrees == subtrees[..] => tree.clone(),
                    _ => DirTree::encode(dir, &files[d], subtrees, keys, &mut |id, bytes| {
                        if !known(&id) && sent.insert(id) {
                            unknown.push((id, bytes));
                        }
                    }),
                }
            }
        };
        if remembered.is_some_and(|was| was.id == tree.id) {
            reused += 1;
        } else if !dir.path.is_empty()
            && let Some(parent) = scan.position(parent_rel(&dir.path))
        {
            changed_below[parent] = true;
        }
        counts += tree.counts;
        by_dir[d] = Some(tree.id);
        dirs.push(tree);
    }
    dirs.reverse();
    let root = dirs.first().expect("a scan always lists its root").id;
    Trees {
        root,
        dirs,
        unknown,
        counts,
        reused,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::fs;
    use std::os::unix::fs::symlink;

    use super::*;
    use crate::checkpoint::dir::FileContent;
    use crate::format::{ChunkRef, Tree, TreeObject};
    use crate::scan::{ScanOptions, join_rel, scan};

    fn keys() -> TenantKeys {
        TenantKeys::derive("k", &[3; 32]).unwrap()
    }

    /// A checkpoint's trees, looked up by directory path.
    struct Built {
        root: BlobId,
        by_dir: HashMap<Vec<u8>, BlobId>,
        pages: Vec<BlobId>,
        unknown: Vec<(BlobId, Vec<u8>)>,
        counts: Counts,
    }

    /// Scans `root` and gives every file one chunk of its content.
    fn scanned(root: &std::path::Path) -> (Scan, Vec<DirFiles>) {
        let opts = ScanOptions {
            root: root.to_path_buf(),
            skip_ignored: false,
            excludes: vec![],
            exclude_paths: vec![],
        };
        let scan = scan(&opts, &|_| {}).unwrap();
        let keys = keys();
        let files: Vec<DirFiles> = scan
            .dirs
            .iter()
            .map(|dir| {
                let files = dir
                    .nodes
                    .iter()
                    .map(|node| {
                        let NodeKind::File(_) = node.kind else {
                            return None;
                        };
                        let path = scan
                            .root
                            .join(std::str::from_utf8(&join_rel(&dir.path, &node.name)).unwrap());
                        let data = fs::read(path).unwrap();
                        let chunks = if data.is_empty() {
                            vec![]
                        } else {
                            vec![ChunkRef {
                                id: keys.blob_id(&data),
                                len: data.len() as u32,
                            }]
                        };
                        Some(FileContent {
                            chunks: chunks.into(),
                            size: data.len() as u64,
                            meta: node.meta,
                            cacheable: None,
                            git: None,
                        })
                    })
                    .collect();
                std::sync::Arc::new(files)
            })
            .collect();
        (scan, files)
    }

    fn trees_of(root: &std::path::Path, known: &dyn Fn(&BlobId) -> bool) -> Built {
        let (scan, files) = scanned(root);
        let trees = build(&scan, &files, &keys(), known, &[]);
        Built {
            root: trees.root,
            by_dir: scan
                .dirs
                .iter()
                .zip(&trees.dirs)
                .map(|(dir, tree)| (dir.path.clone(), tree.id))
                .collect(),
            pages: trees.dirs.iter().flat_map(|t| t.pages.clone()).collect(),
            unknown: trees.unknown,
            counts: trees.counts,
        }
    }

    fn decode(trees: &Built, id: &BlobId) -> Tree {
        let bytes = |id: &BlobId| {
            trees
                .unknown
                .iter()
                .find(|(i, _)| i == id)
                .expect("tree was encoded")
                .1
                .clone()
        };
        match TreeObject::decode(&bytes(id)).unwrap() {
            TreeObject::Entries(tree) => tree,
            TreeObject::Pages(pages) => {
                Tree::concat(pages.iter().map(|p| Tree::decode(&bytes(p)).unwrap())).unwrap()
            }
        }
    }

    #[test]
    fn an_unchanged_subtree_keeps_its_id_and_changes_reach_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir_all(root.join("stable/deep")).unwrap();
        fs::create_dir_all(root.join("busy")).unwrap();
        fs::write(root.join("stable/deep/a"), b"a").unwrap();
        fs::write(root.join("busy/b"), b"b").unwrap();
        let before = trees_of(root, &|_| false);

        // Rewriting a file in place changes it and its parent, not the root's mtime.
        fs::write(root.join("busy/b"), b"changed").unwrap();
        let after = trees_of(root, &|_| false);
        assert_eq!(before.by_dir[&b"stable"[..]], after.by_dir[&b"stable"[..]]);
        assert_eq!(
            before.by_dir[&b"stable/deep"[..]],
            after.by_dir[&b"stable/deep"[..]]
        );
        assert_ne!(before.by_dir[&b"busy"[..]], after.by_dir[&b"busy"[..]]);
        assert_ne!(before.root, after.root);

        // Known trees are not offered again.
        let known: HashSet<BlobId> = before.by_dir.values().copied().collect();
        let incremental = trees_of(root, &|id| known.contains(id));
        let offered: HashSet<BlobId> = incremental.unknown.iter().map(|(id, _)| *id).collect();
        assert_eq!(
            offered,
            HashSet::from([after.by_dir[&b"busy"[..]], after.root])
        );
    }

    #[test]
    fn a_remembered_tree_is_taken_only_while_its_subdirectories_are_unchanged() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir_all(root.join("a/b")).unwrap();
        fs::create_dir_all(root.join("c")).unwrap();
        fs::write(root.join("a/b/f"), b"f").unwrap();
        fs::write(root.join("c/g"), b"g").unwrap();
        let build_with = |remembered: &[Option<&DirTree>]| {
            let (scan, files) = scanned(root);
            let paths: Vec<Vec<u8>> = scan.dirs.iter().map(|d| d.path.clone()).collect();
            (paths, build(&scan, &files, &keys(), &|_| false, remembered))
        };
        let (paths, before) = build_with(&[]);
        assert_eq!(paths, [&b""[..], b"a", b"a/b", b"c"]);

        // A page no encoding makes marks the remembered trees that were taken.
        let marker = BlobId([9; 32]);
        let marked: Vec<DirTree> = before
            .dirs
            .iter()
            .map(|tree| DirTree {
                pages: vec![marker],
                ..tree.clone()
            })
            .collect();
        let taken = |trees: &Trees| -> Vec<bool> {
            trees.dirs.iter().map(|t| t.pages == [marker]).collect()
        };
        let all: Vec<Option<&DirTree>> = marked.iter().map(Some).collect();
        let (_, unchanged) = build_with(&all);
        assert_eq!(taken(&unchanged), [true; 4]);
        assert_eq!((unchanged.reused, unchanged.root), (4, before.root));
        assert_eq!(unchanged.counts, before.counts);
        assert!(unchanged.unknown.is_empty(), "nothing was encoded");

        // a/b gets a new subdirectory: a/b is not remembered (its listing
        // changed), so neither a nor the root may be taken; c still is.
        fs::create_dir(root.join("a/b/new")).unwrap();
        let remembered = [
            Some(&marked[0]),
            Some(&marked[1]),
            None,
            None,
            Some(&marked[3]),
        ];
        let (paths, after) = build_with(&remembered);
        assert_eq!(paths, [&b""[..], b"a", b"a/b", b"a/b/new", b"c"]);
        assert_eq!(taken(&after), [false, false, false, false, true]);
        let (_, fresh) = build_with(&[]);
        assert_eq!(after.root, fresh.root);
        assert_eq!(after.dirs[..4], fresh.dirs[..4]);
        assert_eq!(after.counts, fresh.counts);
    }

    #[test]
    fn a_change_in_a_large_directory_re_sends_one_page_of_it() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir(root.join("big")).unwrap();
        for i in 0..400 {
            fs::write(root.join(format!("big/f{i:03}")), format!("{i}")).unwrap();
        }
        let before = trees_of(root, &|_| false);
        assert!(before.pages.len() > 5, "{} pages", before.pages.len());
        let listing = decode(&before, &before.by_dir[&b"big"[..]]);
        assert_eq!(listing.entries.len(), 400);
        listing.validate().unwrap();

        fs::write(root.join("big/f200"), b"changed").unwrap();
        let known: HashSet<BlobId> = before.unknown.iter().map(|(id, _)| *id).collect();
        let after = trees_of(root, &|id| known.contains(id));
        let sent: Vec<usize> = after.unknown.iter().map(|(_, b)| b.len()).collect();
        // The root, the page list of big/, and one page of it.
        assert_eq!(sent.len(), 3, "{sent:?}");
        let listing_bytes: usize = before.unknown.iter().map(|(_, b)| b.len()).sum();
        assert!(
            sent.iter().sum::<usize>() * 4 < listing_bytes,
            "sent {sent:?} of {listing_bytes} bytes"
        );
    }

    #[test]
    fn entries_are_sorted_by_name_bytes_and_counted() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir(root.join("B")).unwrap();
        fs::create_dir(root.join("empty")).unwrap();
        fs::create_dir(root.join("empty2")).unwrap();
        fs::write(root.join("a"), b"12345").unwrap();
        fs::write(root.join("B/x"), b"").unwrap();
        symlink("a", root.join("_link")).unwrap();
        let trees = trees_of(root, &|_| false);
        let tree = decode(&trees, &trees.root);
        tree.validate().unwrap();
        let names: Vec<&[u8]> = tree.entries.iter().map(|e| &e.name[..]).collect();
        assert_eq!(names, [&b"B"[..], b"_link", b"a", b"empty", b"empty2"]);
        assert_eq!(
            trees.counts,
            Counts {
                files: 2,
                directories: 3,
                symlinks: 1,
                total_bytes: 5
            }
        );
        // Two directories with the same listing share one tree object.
        assert_eq!(trees.by_dir[&b"empty"[..]], trees.by_dir[&b"empty2"[..]]);
        assert!(
            decode(&trees, &trees.by_dir[&b"empty"[..]])
                .entries
                .is_empty()
        );
        assert_eq!(
            trees.unknown.len(),
            3,
            "root, B and the empty tree, each once"
        );
    }
}
