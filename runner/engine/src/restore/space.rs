//! Whether a restore fits, and what an interrupted one leaves behind.
//!
//! A filesystem runs out of blocks or of inodes, and many small files need
//! far more of both than their bytes say: the check counts files rounded up
//! to whole blocks, a block per new directory, and an inode per new entry,
//! against what `statvfs` says this user may still take. It is made before
//! the first write.
//!
//! A restore that fails after it began writing (a disk that fills anyway,
//! another writer, a quota) never leaves a tree that passes for the
//! workspace. Into a root that held nothing, what it wrote is removed.
//! Otherwise (files of an earlier tree were already replaced) it leaves
//! [`INCOMPLETE_MARKER`] in the root, which `run` refuses to start on and
//! the next restore takes as "nothing here is vouched for": it reads every
//! file there and removes the marker only once it completed.
//!
//! Running out of space (ENOSPC or EDQUOT, before or while writing) ends the
//! restore: it does not fall back to an older checkpoint, which would go
//! onto the same full disk.

use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::apply::{Existing, FileState, Survey};
use super::fsops::SpaceFree;
use super::plan::{Plan, PlanKind};

/// Written into the root before a restore changes anything, removed when it
/// completed: its presence means the tree is not a restored checkpoint.
pub const INCOMPLETE_MARKER: &str = ".cairn-restore-incomplete";

/// A symlink target longer than this takes a block of its own (ext4 keeps
/// shorter ones in the inode).
const INLINE_SYMLINK: usize = 60;

/// What a restore takes from the filesystem.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpaceNeeded {
    /// Whole blocks, in bytes.
    pub bytes: u64,
    pub inodes: u64,
}

/// What the restore of `plan` over what `survey` found takes, in blocks of
/// `block_size` bytes, plus the marker file. Files it replaces give their
/// blocks back; stale entries it removes are not counted (a margin).
pub(crate) fn space_needed(plan: &Plan, survey: &Survey, block_size: u64) -> SpaceNeeded {
    let block_size = block_size.max(1);
    let blocks = |bytes: u64| bytes.div_ceil(block_size).saturating_mul(block_size);
    // The marker: one inode and its one block.
    let mut needed = block_size;
    let mut freed = 0u64;
    let mut inodes = 1u64;
    for (entry, state) in plan.entries.iter().zip(&survey.files) {
        match (&entry.kind, state) {
            (PlanKind::File { size, .. }, Some(FileState::Write { existing })) => {
                needed = needed.saturating_add(blocks(*size));
                match existing {
                    Existing::Other { bytes } => freed = freed.saturating_add(blocks(*bytes)),
                    Existing::Nothing | Existing::Dir => inodes += 1,
                }
            }
            (PlanKind::Symlink { target }, _) => {
                inodes += 1;
                if target.len() > INLINE_SYMLINK {
                    needed = needed.saturating_add(block_size);
                }
            }
            _ => {}
        }
    }
    let new_dirs = plan.directories.saturating_sub(survey.dirs_present);
    inodes = inodes.saturating_add(new_dirs);
    needed = needed.saturating_add(new_dirs.saturating_mul(block_size));
    SpaceNeeded {
        bytes: needed.saturating_sub(freed),
        inodes,
    }
}

/// Whether `needed` fits in `free`.
pub(crate) fn fits(needed: SpaceNeeded, free: SpaceFree) -> bool {
    needed.bytes <= free.bytes && free.inodes.is_none_or(|inodes| needed.inodes <= inodes)
}

/// Whether `e` says the filesystem (or the user's quota) is full.
pub(crate) fn is_out_of_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// Relative paths under the root a sweep leaves alone: `protected` names
/// the runner's cache dir and its ancestors. The deepest ones are kept
/// whole; an ancestor is walked into (only its other entries go).
struct Keep<'a> {
    protected: &'a [Vec<u8>],
}

impl Keep<'_> {
    fn is_marker(rel: &[u8]) -> bool {
        rel == INCOMPLETE_MARKER.as_bytes()
    }

    /// `Some(true)`: keep whole; `Some(false)`: walk into; `None`: not kept.
    fn kept(&self, rel: &[u8]) -> Option<bool> {
        if Self::is_marker(rel) {
            return Some(true);
        }
        if !self.protected.iter().any(|p| p == rel) {
            return None;
        }
        let ancestor = self
            .protected
            .iter()
            .any(|p| p.len() > rel.len() && p.starts_with(rel) && p[rel.len()] == b'/');
        Some(!ancestor)
    }
}

/// Whether `root` holds nothing but the protected paths and the marker.
pub(crate) fn holds_nothing(root: &Path, protected: &[Vec<u8>]) -> io::Result<bool> {
    let mut found = false;
    walk(root, &[], &Keep { protected }, &mut |_| {
        found = true;
        Ok(())
    })?;
    Ok(!found)
}

/// Removes everything in `root` but the protected paths and the marker.
pub(crate) fn clear(root: &Path, protected: &[Vec<u8>]) -> io::Result<()> {
    walk(root, &[], &Keep { protected }, &mut |path| {
        let meta = fs::symlink_metadata(path)?;
        // remove_dir_all does not follow symlinks.
        if meta.is_dir() {
            fs::remove_dir_all(path)
        } else {
            fs::remove_file(path)
        }
    })
}

/// Calls `found` for each entry under `dir` (relative path `rel`) that is
/// not kept, walking into kept ancestors only.
fn walk(
    dir: &Path,
    rel: &[u8],
    keep: &Keep<'_>,
    found: &mut dyn FnMut(&Path) -> io::Result<()>,
) -> io::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let child_rel = if rel.is_empty() {
            name.as_bytes().to_vec()
        } else {
            [rel, b"/", name.as_bytes()].concat()
        };
        match keep.kept(&child_rel) {
            Some(true) => {}
            Some(false) if entry.file_type()?.is_dir() => {
                walk(&entry.path(), &child_rel, keep, found)?;
            }
            _ => found(&entry.path())?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::restore::plan::PlanEntry;

    fn entry(path: &str, kind: PlanKind) -> PlanEntry {
        PlanEntry {
            path: path.as_bytes().to_vec(),
            name_start: 0,
            parent: None,
            kind,
            meta: crate::restore::fsops::EntryMeta::default(),
        }
    }

    fn file(size: u64) -> PlanKind {
        PlanKind::File {
            size,
            chunks: Vec::new(),
            git: None,
        }
    }

    fn plan(entries: Vec<PlanEntry>, directories: u64) -> Plan {
        Plan {
            root_children: 0..entries.len(),
            files: 0,
            directories,
            symlinks: 0,
            total_bytes: 0,
            entries,
        }
    }

    fn survey(states: Vec<Option<FileState>>, dirs_present: u64) -> Survey {
        Survey {
            root_exists: true,
            files: states,
            stale: Vec::new(),
            dirs_present,
        }
    }

    fn write(existing: Existing) -> Option<FileState> {
        Some(FileState::Write { existing })
    }

    #[test]
    fn small_files_count_whole_blocks_and_an_inode_each() {
        let plan = plan(
            vec![
                entry("a", file(1)),
                entry("b", file(4097)),
                entry("c", file(0)),
            ],
            3,
        );
        let survey = survey(
            vec![
                write(Existing::Nothing),
                write(Existing::Nothing),
                write(Existing::Nothing),
            ],
            1,
        );
        let needed = space_needed(&plan, &survey, 4096);
        // 1 + 2 + 0 blocks of files, two new directories, the marker.
        assert_eq!(needed.bytes, (3 + 2 + 1) * 4096);
        // Three files, two directories, the marker.
        assert_eq!(needed.inodes, 6);
    }

    #[test]
    fn replaced_files_give_their_blocks_back_and_reused_ones_cost_nothing() {
        let plan = plan(vec![entry("a", file(8192)), entry("b", file(100))], 0);
        let reused = Some(FileState::Reuse {
            meta_ok: true,
            fingerprint: crate::cache::Fingerprint {
                dev: 1,
                ino: 2,
                size: 100,
                mtime_sec: 0,
                mtime_nsec: 0,
                ctime_sec: 0,
                ctime_nsec: 0,
                mode: 0o644,
            },
        });
        let survey = survey(vec![write(Existing::Other { bytes: 5000 }), reused], 0);
        let needed = space_needed(&plan, &survey, 4096);
        // 2 blocks written, 2 freed, the marker's.
        assert_eq!(needed.bytes, 4096);
        assert_eq!(needed.inodes, 1);
    }

    #[test]
    fn long_symlinks_take_a_block() {
        let long = vec![b'x'; 100];
        let plan = plan(
            vec![
                entry(
                    "s",
                    PlanKind::Symlink {
                        target: b"t".to_vec(),
                    },
                ),
                entry("l", PlanKind::Symlink { target: long }),
            ],
            0,
        );
        let needed = space_needed(&plan, &survey(vec![None, None], 0), 4096);
        assert_eq!(
            needed,
            SpaceNeeded {
                bytes: 2 * 4096,
                inodes: 3
            }
        );
    }

    #[test]
    fn blocks_and_inodes_must_both_fit() {
        let needed = SpaceNeeded {
            bytes: 100,
            inodes: 10,
        };
        let free = |bytes, inodes| SpaceFree {
            bytes,
            inodes,
            block_size: 4096,
        };
        assert!(fits(needed, free(100, Some(10))));
        assert!(!fits(needed, free(99, Some(10))));
        assert!(!fits(needed, free(100, Some(9))));
        assert!(fits(needed, free(100, None)), "no inode limit");
    }

    #[test]
    fn clearing_keeps_the_cache_dir_whole_and_removes_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join(".cache/cairn/x")).unwrap();
        fs::write(root.join(".cache/cairn/x/cache"), b"c").unwrap();
        fs::write(root.join(INCOMPLETE_MARKER), b"").unwrap();
        let protected = vec![b".cache".to_vec(), b".cache/cairn".to_vec()];
        assert!(holds_nothing(root, &protected).unwrap());
        fs::create_dir_all(root.join("src/deep")).unwrap();
        fs::write(root.join("src/deep/f"), b"f").unwrap();
        fs::write(root.join(".cache/other"), b"o").unwrap();
        std::os::unix::fs::symlink("/", root.join("link")).unwrap();
        assert!(!holds_nothing(root, &protected).unwrap());
        clear(root, &protected).unwrap();
        assert!(holds_nothing(root, &protected).unwrap());
        assert!(root.join(".cache/cairn/x/cache").exists());
        assert!(root.join(INCOMPLETE_MARKER).exists());
        assert!(!root.join(".cache/other").exists());
        assert!(!root.join("src").exists());
        assert!(fs::symlink_metadata(root.join("link")).is_err());
    }
}
