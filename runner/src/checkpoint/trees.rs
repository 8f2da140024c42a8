//! Building the checkpoint's Merkle tree: one tree object per directory.
//!
//! Directories are encoded deepest first, so every subdirectory's id is
//! known when its parent is encoded. A tree's id is the keyed hash of its
//! bytes, so a directory whose entries (names, kinds, modes, times, owners,
//! contents) did not change keeps its id, and so does every directory above
//! an unchanged subtree: an incremental checkpoint re-sends only the trees on
//! the paths to what changed.

use std::collections::{HashMap, HashSet};

use cairn_proto::ids::BlobId;

use super::content::FileContent;
use crate::format::{Entry, EntryKind, TenantKeys, Tree};
use crate::scan::{NodeKind, Scan, join_rel};

/// What the tree holds, entry by entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    pub total_bytes: u64,
}

/// The encoded trees of a checkpoint.
#[derive(Debug)]
pub struct Trees {
    pub root: BlobId,
    /// The tree id of every directory, by path relative to the root.
    pub by_dir: HashMap<Vec<u8>, BlobId>,
    /// The pages of every paged directory (large ones; see format::tree).
    pub pages: Vec<BlobId>,
    /// Trees that `known` did not recognise, each once, with their bytes.
    pub unknown: Vec<(BlobId, Vec<u8>)>,
    pub counts: Counts,
}

/// Encodes every directory of `scan`, with file contents from `files`
/// (indexed like `scan.dirs[d].nodes[n]`; None leaves the file out).
pub fn build(
    scan: &Scan,
    files: &[Vec<Option<FileContent>>],
    keys: &TenantKeys,
    known: &dyn Fn(&BlobId) -> bool,
) -> Trees {
    let mut by_dir: HashMap<Vec<u8>, BlobId> = HashMap::with_capacity(scan.dirs.len());
    let mut pages = Vec::new();
    let mut unknown = Vec::new();
    let mut sent = HashSet::new();
    let mut counts = Counts::default();
    // Sorted by path bytes, a directory comes before everything below it;
    // walking backwards meets children first.
    for (d, dir) in scan.dirs.iter().enumerate().rev() {
        let mut entries = Vec::with_capacity(dir.nodes.len());
        for (n, node) in dir.nodes.iter().enumerate() {
            let kind = match &node.kind {
                NodeKind::File(_) => match &files[d][n] {
                    Some(file) => {
                        counts.files += 1;
                        counts.total_bytes += file.size;
                        entries.push(Entry {
                            name: node.name.clone(),
                            kind: match file.git {
                                Some(stored) => EntryKind::Git {
                                    size: file.size,
                                    stored,
                                    chunks: file.chunks.to_vec(),
                                },
                                None => EntryKind::File {
                                    size: file.size,
                                    chunks: file.chunks.to_vec(),
                                },
                            },
                            mode: file.meta.mode,
                            mtime_sec: file.meta.mtime_sec,
                            mtime_nsec: file.meta.mtime_nsec,
                            uid: file.meta.uid,
                            gid: file.meta.gid,
                        });
                        continue;
                    }
                    None => continue,
                },
                // A directory without a listing vanished during the walk.
                NodeKind::Dir => match by_dir.get(&join_rel(&dir.path, &node.name)) {
                    Some(tree) => {
                        counts.directories += 1;
                        EntryKind::Dir { tree: *tree }
                    }
                    None => continue,
                },
                NodeKind::Symlink(target) => {
                    counts.symlinks += 1;
                    EntryKind::Symlink {
                        target: target.clone(),
                    }
                }
            };
            entries.push(Entry {
                name: node.name.clone(),
                kind,
                mode: node.meta.mode,
                mtime_sec: node.meta.mtime_sec,
                mtime_nsec: node.meta.mtime_nsec,
                uid: node.meta.uid,
                gid: node.meta.gid,
            });
        }
        let encoded = Tree { entries }.encode_paged(&|bytes| keys.blob_id(bytes));
        for (page, bytes) in encoded.pages {
            pages.push(page);
            if !known(&page) && sent.insert(page) {
                unknown.push((page, bytes));
            }
        }
        let id = keys.blob_id(&encoded.root);
        if !known(&id) && sent.insert(id) {
            unknown.push((id, encoded.root));
        }
        by_dir.insert(dir.path.clone(), id);
    }
    let root = *by_dir.get(&b""[..]).expect("a scan always lists its root");
    Trees {
        root,
        by_dir,
        pages,
        unknown,
        counts,
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::symlink;

    use super::*;
    use crate::format::{ChunkRef, TreeObject};
    use crate::scan::{ScanOptions, scan};

    fn keys() -> TenantKeys {
        TenantKeys::derive("k", &[3; 32]).unwrap()
    }

    /// Scans `root` and gives every file one chunk of its content.
    fn trees_of(root: &std::path::Path, known: &dyn Fn(&BlobId) -> bool) -> Trees {
        let opts = ScanOptions {
            root: root.to_path_buf(),
            skip_ignored: false,
            excludes: vec![],
            exclude_paths: vec![],
        };
        let scan = scan(&opts, &|_| {}).unwrap();
        let keys = keys();
        let files: Vec<Vec<Option<FileContent>>> = scan
            .dirs
            .iter()
            .map(|dir| {
                dir.nodes
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
                    .collect()
            })
            .collect();
        build(&scan, &files, &keys, known)
    }

    fn decode(trees: &Trees, id: &BlobId) -> Tree {
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
