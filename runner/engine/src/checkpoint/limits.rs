//! Per-checkpoint size limits: a single file larger than `max_file_bytes`
//! is left out, and when the files together exceed `max_total_bytes` the
//! largest ones are left out until the rest fits. Every file left out is a
//! warning on the checkpoint (and in the runner's output), never a silent
//! gap.
//!
//! What makes the work resumable is never left out, whatever its size, and
//! does not count towards the total: the files inside a `.git` directory (a
//! repository missing a pack is broken, and its commits are the work) and
//! the harnesses' conversations under `.cairn/state/`. Counting them would
//! let a large history push every working-tree file, uncommitted edits
//! included, out of the checkpoint.
//!
//! Which files go is decided from the walk alone (sizes and paths), so the
//! same workspace always loses the same files, and a file the fingerprint
//! cache knows is never read just to be dropped.

use std::sync::Arc;

use cairn_proto::size::human_bytes;

use crate::scan::{NodeKind, Scan, ScannedDir, join_rel};

use cairn_proto::runs::CheckpointLimits;

/// One regular file of the walk (its path is only made when it is named).
struct Candidate {
    dir: usize,
    node: usize,
    size: u64,
    kept_whatever_its_size: bool,
}

impl Candidate {
    fn path(&self, scan: &Scan) -> Vec<u8> {
        let dir = &scan.dirs[self.dir];
        join_rel(&dir.path, &dir.nodes[self.node].name)
    }
}

/// `scan` without the files the limits leave out, and one warning per file
/// left out (or kept above a limit). The same walk, shared, when nothing is
/// left out; otherwise only the listings that lost a file are copied.
pub fn apply(scan: Arc<Scan>, limits: &CheckpointLimits) -> (Arc<Scan>, Vec<String>) {
    if limits.is_unlimited() {
        return (scan, Vec::new());
    }
    let mut candidates = Vec::new();
    for (d, dir) in scan.dirs.iter().enumerate() {
        let dir_is_protected = is_protected_dir(&dir.path);
        for (n, node) in dir.nodes.iter().enumerate() {
            if let NodeKind::File(fingerprint) = &node.kind {
                candidates.push(Candidate {
                    dir: d,
                    node: n,
                    size: fingerprint.size,
                    kept_whatever_its_size: dir_is_protected
                        || is_protected_entry(&dir.path, &node.name),
                });
            }
        }
    }
    let mut warnings = Vec::new();
    let mut left_out: Vec<(usize, usize)> = Vec::new();
    let mut kept: Vec<&Candidate> = Vec::new();
    for candidate in &candidates {
        match limits.max_file_bytes {
            Some(max) if candidate.size > max && candidate.kept_whatever_its_size => {
                warnings.push(format!(
                    "kept {} ({}) although it is larger than the per-file limit of {}: \
                     repository and conversation files are never left out",
                    display(&candidate.path(&scan)),
                    human_bytes(candidate.size),
                    human_bytes(max)
                ));
                kept.push(candidate);
            }
            Some(max) if candidate.size > max => {
                warnings.push(format!(
                    "left out {} ({}): larger than the per-file limit of {}",
                    display(&candidate.path(&scan)),
                    human_bytes(candidate.size),
                    human_bytes(max)
                ));
                left_out.push((candidate.dir, candidate.node));
            }
            _ => kept.push(candidate),
        }
    }
    if let Some(max) = limits.max_total_bytes {
        let mut droppable: Vec<&Candidate> = kept
            .iter()
            .copied()
            .filter(|c| !c.kept_whatever_its_size)
            .collect();
        let mut total: u64 = droppable.iter().map(|c| c.size).sum();
        if total > max {
            droppable.sort_by_cached_key(|c| (std::cmp::Reverse(c.size), c.path(&scan)));
            for candidate in droppable {
                if total <= max {
                    break;
                }
                total -= candidate.size;
                warnings.push(format!(
                    "left out {} ({}): the checkpoint would exceed its limit of {} \
                     (the largest files are left out first)",
                    display(&candidate.path(&scan)),
                    human_bytes(candidate.size),
                    human_bytes(max)
                ));
                left_out.push((candidate.dir, candidate.node));
            }
        }
    }
    if left_out.is_empty() {
        return (scan, warnings);
    }
    left_out.sort_unstable();
    let dirs = scan
        .dirs
        .iter()
        .enumerate()
        .map(|(d, dir)| {
            let start = left_out.partition_point(|(ld, _)| *ld < d);
            let gone: Vec<usize> = left_out[start..]
                .iter()
                .take_while(|(ld, _)| *ld == d)
                .map(|(_, n)| *n)
                .collect();
            if gone.is_empty() {
                return dir.clone();
            }
            Arc::new(ScannedDir {
                path: dir.path.clone(),
                nodes: dir
                    .nodes
                    .iter()
                    .enumerate()
                    .filter(|(n, _)| gone.binary_search(n).is_err())
                    .map(|(_, node)| node.clone())
                    .collect(),
            })
        })
        .collect();
    let limited = Scan {
        root: scan.root.clone(),
        started: scan.started,
        dirs,
        warnings: scan.warnings.clone(),
    };
    (Arc::new(limited), warnings)
}

/// `name` in the unprotected directory `dir` is itself a `.git` (a
/// worktree's or submodule's pointer) or `.cairn/state`.
fn is_protected_entry(dir: &[u8], name: &[u8]) -> bool {
    name == b".git" || (dir == b".cairn" && name == b"state")
}

/// Inside a repository's `.git` directory, or under `.cairn/state/`.
fn is_protected_dir(rel: &[u8]) -> bool {
    rel.split(|b| *b == b'/').any(|part| part == b".git")
        || rel == b".cairn/state"
        || rel.starts_with(b".cairn/state/")
}

fn display(rel: &[u8]) -> String {
    String::from_utf8_lossy(rel).into_owned()
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::scan::{self, ScanOptions};

    fn walk(root: &std::path::Path) -> Arc<Scan> {
        let opts = ScanOptions {
            root: fs::canonicalize(root).unwrap(),
            skip_ignored: false,
            excludes: vec![],
            exclude_paths: vec![],
        };
        Arc::new(scan::scan(&opts, &|_| {}).unwrap())
    }

    fn files(scan: &Scan) -> Vec<String> {
        scan.dirs
            .iter()
            .flat_map(|d| {
                d.nodes
                    .iter()
                    .filter(|n| matches!(n.kind, NodeKind::File(_)))
                    .map(|n| display(&join_rel(&d.path, &n.name)))
            })
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    fn workspace() -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        for (path, size) in [
            ("small.txt", 10),
            ("src/main.rs", 2_000),
            ("data/big.bin", 50_000),
            ("data/bigger.bin", 80_000),
            ("repo/.git/objects/pack/p.pack", 120_000),
            (".cairn/state/claude/t.jsonl", 90_000),
        ] {
            let path = root.join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, vec![b'x'; size]).unwrap();
        }
        tmp
    }

    #[test]
    fn no_limits_share_the_walk_and_say_nothing() {
        let tmp = workspace();
        let scan = walk(tmp.path());
        let (limited, warnings) = apply(scan.clone(), &CheckpointLimits::default());
        assert!(Arc::ptr_eq(&scan, &limited));
        assert!(warnings.is_empty());
    }

    #[test]
    fn a_file_above_the_per_file_limit_is_left_out_and_named() {
        let tmp = workspace();
        let limits = CheckpointLimits {
            max_file_bytes: Some(60_000),
            max_total_bytes: None,
        };
        let (limited, warnings) = apply(walk(tmp.path()), &limits);
        let kept = files(&limited);
        assert!(!kept.contains(&"data/bigger.bin".to_owned()), "{kept:?}");
        assert!(kept.contains(&"data/big.bin".to_owned()));
        assert!(kept.contains(&"repo/.git/objects/pack/p.pack".to_owned()));
        assert!(kept.contains(&".cairn/state/claude/t.jsonl".to_owned()));
        assert_eq!(
            warnings
                .iter()
                .filter(|w| w.starts_with("left out"))
                .count(),
            1
        );
        assert!(
            warnings.contains(
                &"left out data/bigger.bin (78.1 KiB): larger than the per-file limit of 58.6 KiB"
                    .to_owned()
            ),
            "{warnings:?}"
        );
        assert!(
            warnings
                .iter()
                .any(|w| w.starts_with("kept repo/.git/objects/pack/p.pack (117.2 KiB)")),
            "{warnings:?}"
        );
    }

    #[test]
    fn above_the_total_the_largest_ordinary_files_go_first() {
        let tmp = workspace();
        // Ordinary files come to 132,010 bytes; the repository's and the
        // conversation's 210,000 do not count.
        let limits = CheckpointLimits {
            max_file_bytes: None,
            max_total_bytes: Some(60_000),
        };
        let (limited, warnings) = apply(walk(tmp.path()), &limits);
        let kept = files(&limited);
        assert!(!kept.contains(&"data/bigger.bin".to_owned()), "{kept:?}");
        assert!(
            kept.contains(&"data/big.bin".to_owned()),
            "one file was enough"
        );
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("the checkpoint would exceed its limit"));

        let limits = CheckpointLimits {
            max_file_bytes: None,
            max_total_bytes: Some(2_010),
        };
        let (limited, warnings) = apply(walk(tmp.path()), &limits);
        assert_eq!(
            files(&limited),
            [
                ".cairn/state/claude/t.jsonl",
                "repo/.git/objects/pack/p.pack",
                "small.txt",
                "src/main.rs"
            ],
            "the largest go first, and only as many as needed"
        );
        assert_eq!(warnings.len(), 2, "{warnings:?}");
    }
}
