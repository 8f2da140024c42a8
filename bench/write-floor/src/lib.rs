//! The write floor under a restore: how long this machine's filesystem takes
//! to create a given tree when nothing else is done, for `bench/run.py`.
//!
//! A restore into an empty directory downloads, decrypts, decompresses and
//! verifies every blob, and creates every directory and file. On a small
//! machine the creating alone (inode allocation, directory insertion, page
//! cache) can be most of the wall time. [`Tree::write`] does only that, with
//! the system calls a restore makes per file (create exclusively with the
//! mode, write, set the mtime, close) on several threads, so the benchmark
//! can show how far a restore is from what the filesystem allows.
//!
//! [`Tree::load`] reads the whole tree into memory first, untimed.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

/// Files a writer thread takes at a time: neighbours share a directory.
const FILES_PER_TAKE: usize = 16;

/// What an entry gets besides its content.
#[derive(Debug)]
struct Entry {
    rel: PathBuf,
    mode: u32,
    mtime: SystemTime,
}

/// A tree held in memory.
#[derive(Debug, Default)]
pub struct Tree {
    /// Parents before their children.
    dirs: Vec<Entry>,
    files: Vec<(Entry, Vec<u8>)>,
    symlinks: Vec<(Entry, PathBuf)>,
}

impl Tree {
    /// Reads every directory, regular file and symlink below `root`
    /// (without following symlinks). Other kinds of entry are refused.
    pub fn load(root: &Path) -> io::Result<Tree> {
        let mut tree = Tree::default();
        for item in walkdir::WalkDir::new(root).min_depth(1) {
            let item = item.map_err(io::Error::other)?;
            let meta = item.metadata().map_err(io::Error::other)?;
            let entry = Entry {
                rel: item
                    .path()
                    .strip_prefix(root)
                    .expect("walkdir yields paths below its root")
                    .to_owned(),
                mode: meta.permissions().mode() & 0o7777,
                mtime: meta.modified()?,
            };
            let kind = item.file_type();
            if kind.is_dir() {
                tree.dirs.push(entry);
            } else if kind.is_file() {
                let content = fs::read(item.path())?;
                tree.files.push((entry, content));
            } else if kind.is_symlink() {
                let target = fs::read_link(item.path())?;
                tree.symlinks.push((entry, target));
            } else {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} is neither a directory, a file nor a symlink",
                        item.path().display()
                    ),
                ));
            }
        }
        Ok(tree)
    }

    /// Regular files in the tree.
    pub fn files(&self) -> usize {
        self.files.len()
    }

    /// Bytes of all regular files.
    pub fn bytes(&self) -> u64 {
        self.files
            .iter()
            .map(|(_, content)| content.len() as u64)
            .sum()
    }

    /// Creates the tree at `target`, which must not exist, with `threads`
    /// writers for the files, and returns how long that took: directories
    /// first (owner-writable until the end), then the files, the symlinks,
    /// and the directories' modes and mtimes last, deepest first.
    pub fn write(&self, target: &Path, threads: usize) -> io::Result<Duration> {
        let started = Instant::now();
        fs::create_dir(target)?;
        let mut builder = fs::DirBuilder::new();
        builder.mode(0o700);
        for dir in &self.dirs {
            builder.create(target.join(&dir.rel))?;
        }
        let next = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            let writers: Vec<_> = (0..threads.max(1))
                .map(|_| scope.spawn(|| self.write_files(target, &next)))
                .collect();
            writers
                .into_iter()
                .try_for_each(|writer| writer.join().expect("a writer thread panicked"))
        })?;
        for (link, link_target) in &self.symlinks {
            std::os::unix::fs::symlink(link_target, target.join(&link.rel))?;
        }
        for dir in self.dirs.iter().rev() {
            // One descriptor for both, opened while the owner can still read.
            let opened = File::open(target.join(&dir.rel))?;
            opened.set_modified(dir.mtime)?;
            opened.set_permissions(fs::Permissions::from_mode(dir.mode))?;
        }
        Ok(started.elapsed())
    }

    /// One writer: takes files in runs of [`FILES_PER_TAKE`] until none are left.
    fn write_files(&self, target: &Path, next: &AtomicUsize) -> io::Result<()> {
        loop {
            let first = next.fetch_add(FILES_PER_TAKE, Ordering::Relaxed);
            if first >= self.files.len() {
                return Ok(());
            }
            let end = (first + FILES_PER_TAKE).min(self.files.len());
            for (entry, content) in &self.files[first..end] {
                // The permission bits go in at creation, as a restore does;
                // a umask may take some away.
                let mut file = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(entry.mode & 0o777)
                    .open(target.join(&entry.rel))?;
                file.write_all(content)?;
                file.set_modified(entry.mtime)?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn the_copy_has_the_trees_entries_contents_and_mtimes() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("source");
        fs::create_dir_all(source.join("src/deep")).unwrap();
        fs::write(source.join("README"), b"hello").unwrap();
        for i in 0..40 {
            fs::write(
                source.join(format!("src/deep/f{i}")),
                vec![i as u8; i * 100],
            )
            .unwrap();
        }
        fs::write(source.join("src/run.sh"), b"#!/bin/sh\n").unwrap();
        fs::set_permissions(source.join("src/run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink("src/run.sh", source.join("run")).unwrap();
        let old = SystemTime::UNIX_EPOCH + Duration::from_secs(1_600_000_000);
        File::open(source.join("README"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        File::open(source.join("src"))
            .unwrap()
            .set_modified(old)
            .unwrap();

        let tree = Tree::load(&source).unwrap();
        assert_eq!(tree.files(), 42);
        assert_eq!(tree.bytes(), 5 + 10 + (0..40).map(|i| i * 100).sum::<u64>());
        let copy = dir.path().join("copy");
        tree.write(&copy, 3).unwrap();

        for (entry, _) in &tree.files {
            assert_eq!(
                fs::read(copy.join(&entry.rel)).unwrap(),
                fs::read(source.join(&entry.rel)).unwrap()
            );
        }
        let readme = fs::metadata(copy.join("README")).unwrap();
        assert_eq!(readme.modified().unwrap(), old);
        assert_eq!(
            fs::metadata(copy.join("src")).unwrap().modified().unwrap(),
            old
        );
        assert_eq!(
            fs::metadata(copy.join("src/run.sh")).unwrap().mode() & 0o100,
            0o100
        );
        assert_eq!(
            fs::read_link(copy.join("run")).unwrap(),
            Path::new("src/run.sh")
        );
        assert!(
            tree.write(&copy, 1).is_err(),
            "an existing target is refused, not written over"
        );
    }
}
