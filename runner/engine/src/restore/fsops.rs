//! Filesystem operations of the restore writer that never follow a symlink.
//!
//! The writer works on paths below the restore root whose every directory
//! component it has checked (lstat) or created itself, top-down, before it
//! touches anything inside. What remains is the last component, which may be
//! anything the previous occupant of the root left there: files are opened
//! with `O_NOFOLLOW` (and created with `O_EXCL`, so a symlink or a hard link
//! planted at the path is never written through), and metadata is set on
//! open descriptors, or with the `l*`/`AT_SYMLINK_NOFOLLOW` calls for
//! symlinks.

use std::ffi::CString;
use std::fs::{self, File, FileTimes, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::cache::Fingerprint;

/// The metadata a restored entry gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct EntryMeta {
    pub mode: u32,
    pub mtime_sec: i64,
    pub mtime_nsec: u32,
    pub uid: u32,
    pub gid: u32,
}

impl EntryMeta {
    pub fn mtime(&self) -> SystemTime {
        let nanos = Duration::from_nanos(u64::from(self.mtime_nsec.min(999_999_999)));
        if self.mtime_sec >= 0 {
            UNIX_EPOCH + Duration::from_secs(self.mtime_sec as u64) + nanos
        } else {
            UNIX_EPOCH - Duration::from_secs(self.mtime_sec.unsigned_abs()) + nanos
        }
    }

    /// Whether an entry on disk already carries this metadata.
    pub fn matches(&self, stat: &DiskStat, set_owner: bool) -> bool {
        stat.fingerprint.mode & 0o7777 == self.mode & 0o7777
            && self.mtime_matches(stat)
            && (!set_owner || (stat.uid == self.uid && stat.gid == self.gid))
    }

    /// Whether an entry on disk has this mtime, to the nanosecond.
    pub fn mtime_matches(&self, stat: &DiskStat) -> bool {
        let fp = &stat.fingerprint;
        (fp.mtime_sec, fp.mtime_nsec) == (self.mtime_sec, i64::from(self.mtime_nsec))
    }
}

/// What kind of entry sits on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DiskKind {
    File,
    Dir,
    /// A symlink, fifo, socket or device.
    Other,
}

/// The parts of an entry's `stat` a restore looks at, from
/// [`fs::Metadata`] or from a `statat` relative to an open directory (which
/// spares the kernel the walk of the whole path).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DiskStat {
    pub kind: DiskKind,
    pub nlink: u64,
    pub uid: u32,
    pub gid: u32,
    pub fingerprint: Fingerprint,
}

impl From<&fs::Metadata> for DiskStat {
    fn from(meta: &fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        let file_type = meta.file_type();
        Self {
            kind: if file_type.is_file() {
                DiskKind::File
            } else if file_type.is_dir() {
                DiskKind::Dir
            } else {
                DiskKind::Other
            },
            nlink: meta.nlink(),
            uid: meta.uid(),
            gid: meta.gid(),
            fingerprint: Fingerprint::of(meta),
        }
    }
}

impl From<&rustix::fs::Stat> for DiskStat {
    // The field types differ between targets.
    #[allow(clippy::unnecessary_cast)]
    fn from(stat: &rustix::fs::Stat) -> Self {
        let kind = match rustix::fs::FileType::from_raw_mode(stat.st_mode as _) {
            rustix::fs::FileType::RegularFile => DiskKind::File,
            rustix::fs::FileType::Directory => DiskKind::Dir,
            _ => DiskKind::Other,
        };
        Self {
            kind,
            nlink: stat.st_nlink as u64,
            uid: stat.st_uid as u32,
            gid: stat.st_gid as u32,
            fingerprint: Fingerprint {
                dev: stat.st_dev as u64,
                ino: stat.st_ino as u64,
                size: stat.st_size as u64,
                mtime_sec: stat.st_mtime as i64,
                mtime_nsec: stat.st_mtime_nsec as i64,
                ctime_sec: stat.st_ctime as i64,
                ctime_nsec: stat.st_ctime_nsec as i64,
                mode: stat.st_mode as u32,
            },
        }
    }
}

/// The `stat` of `name` in the open directory `dir`, not following a symlink.
pub(crate) fn stat_in(dir: impl std::os::fd::AsFd, name: &std::ffi::CStr) -> io::Result<DiskStat> {
    let stat = rustix::fs::statat(dir, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)?;
    Ok(DiskStat::from(&stat))
}

/// Whether this process may give files away (restore uid/gid).
pub(crate) fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Creates a new regular file for writing, with the permission bits of
/// `meta` (less the umask) and always the owner's read and write, which
/// later writes through a second descriptor need. Fails if anything is at
/// `path`.
pub(crate) fn create_new(path: &Path, meta: &EntryMeta) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode((meta.mode & 0o777) | 0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Opens an existing regular file that the writer created, for writing.
pub(crate) fn open_for_write(path: &Path) -> io::Result<File> {
    // Readable too: a git object written as its content is read back to be
    // deflated in place.
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Opens a file for reading without following a symlink and without
/// blocking on a fifo that might have replaced it.
pub(crate) fn open_for_read(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
}

/// Opens a directory (not a symlink to one) to set its metadata.
pub(crate) fn open_dir(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(path)
}

/// Sets owner (when `set_owner`), mode and mtime on an open file or directory.
/// The owner goes first because chown clears setuid/setgid bits.
pub(crate) fn apply_meta(file: &File, meta: &EntryMeta, set_owner: bool) -> io::Result<()> {
    if set_owner {
        std::os::unix::fs::fchown(file, Some(meta.uid), Some(meta.gid))?;
    }
    file.set_permissions(fs::Permissions::from_mode(meta.mode & 0o7777))?;
    file.set_times(FileTimes::new().set_modified(meta.mtime()))
}

/// Removes whatever is at `path` without following it: a directory with all
/// its content, anything else by unlinking the entry itself.
pub(crate) fn remove_entry(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// Sets the mtime of a symlink itself (std has no stable call for this).
pub(crate) fn set_symlink_mtime(path: &Path, meta: &EntryMeta) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: timespec is plain old data; all-zero is a valid value.
    let mut times: [libc::timespec; 2] = unsafe { std::mem::zeroed() };
    times[0].tv_nsec = libc::UTIME_OMIT;
    times[1].tv_sec = meta.mtime_sec as libc::time_t;
    times[1].tv_nsec = i64::from(meta.mtime_nsec.min(999_999_999)) as _;
    // SAFETY: `c` is a NUL-terminated path and `times` holds the two
    // timespecs utimensat reads; neither outlives this call.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// What this user may still take on the filesystem holding `path` (or its
/// nearest existing ancestor): bytes and inodes (`f_bavail`, `f_favail`).
/// What `statvfs` says this user may still take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpaceFree {
    pub bytes: u64,
    /// `None` where the filesystem has no inode limit (it reports none).
    pub inodes: Option<u64>,
    pub block_size: u64,
}

pub(crate) fn free_space(path: &Path) -> io::Result<SpaceFree> {
    let mut probe = path;
    while fs::symlink_metadata(probe).is_err() {
        match probe.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => probe = parent,
            _ => {
                probe = Path::new(".");
                break;
            }
        }
    }
    let c = c_path(probe)?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is NUL-terminated and `stat` is a writable statvfs buffer.
    let rc = unsafe { libc::statvfs(c.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled the buffer.
    let stat = unsafe { stat.assume_init() };
    // The field types are 32 bits wide on some targets.
    #[allow(clippy::unnecessary_cast)]
    let (bavail, frsize, files, favail) = (
        stat.f_bavail as u64,
        stat.f_frsize as u64,
        stat.f_files as u64,
        stat.f_favail as u64,
    );
    Ok(SpaceFree {
        bytes: bavail.saturating_mul(frsize),
        // A filesystem without an inode table (btrfs, a tmpfs without
        // nr_inodes) reports no inodes at all.
        inodes: (files > 0).then_some(favail),
        block_size: frsize.max(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn files_are_never_created_or_opened_through_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        fs::write(&outside, b"keep").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        let meta = EntryMeta {
            mode: 0o644,
            ..EntryMeta::default()
        };
        assert!(create_new(&link, &meta).is_err());
        assert!(open_for_write(&link).is_err());
        assert!(open_for_read(&link).is_err());
        assert_eq!(fs::read(&outside).unwrap(), b"keep");
        remove_entry(&link).unwrap();
        assert!(outside.exists(), "removing a link leaves its target alone");
    }

    #[test]
    fn symlink_mtimes_are_set_on_the_link_itself() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        fs::write(&target, b"x").unwrap();
        let before = fs::metadata(&target).unwrap().mtime();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("target", &link).unwrap();
        let meta = EntryMeta {
            mode: 0o777,
            mtime_sec: 1_000_000,
            mtime_nsec: 5,
            uid: 0,
            gid: 0,
        };
        set_symlink_mtime(&link, &meta).unwrap();
        let got = fs::symlink_metadata(&link).unwrap();
        assert_eq!((got.mtime(), got.mtime_nsec()), (1_000_000, 5));
        assert_eq!(fs::metadata(&target).unwrap().mtime(), before);
    }

    #[test]
    fn a_stat_relative_to_a_directory_gives_the_fingerprint_a_checkpoint_scan_computes() {
        // The survey records reused files with this fingerprint, and the
        // next checkpoint compares it with `Fingerprint::of`: any field that
        // differs would make it read the whole restored tree again.
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("file"), b"content").unwrap();
        fs::create_dir(dir.path().join("dir")).unwrap();
        std::os::unix::fs::symlink("file", dir.path().join("link")).unwrap();
        let handle = open_dir(dir.path()).unwrap();
        for (name, kind) in [
            (c"file", DiskKind::File),
            (c"dir", DiskKind::Dir),
            (c"link", DiskKind::Other),
        ] {
            let path = dir.path().join(name.to_str().unwrap());
            let meta = fs::symlink_metadata(&path).unwrap();
            let stat = stat_in(&handle, name).unwrap();
            assert_eq!(stat.kind, kind, "{path:?}");
            assert_eq!(stat.fingerprint, Fingerprint::of(&meta), "{path:?}");
            assert_eq!(
                (stat.nlink, stat.uid, stat.gid),
                (meta.nlink(), meta.uid(), meta.gid())
            );
        }
        assert_eq!(
            stat_in(&handle, c"missing").unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn negative_mtimes_convert_to_times_before_the_epoch() {
        let meta = EntryMeta {
            mode: 0,
            mtime_sec: -2,
            mtime_nsec: 500_000_000,
            uid: 0,
            gid: 0,
        };
        assert_eq!(
            UNIX_EPOCH.duration_since(meta.mtime()).unwrap(),
            Duration::from_millis(1500)
        );
    }
}
