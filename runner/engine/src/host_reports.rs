//! What a runner tells the host it runs under about its restores and
//! checkpoints, for the host's metrics: one JSON line per event, appended
//! to [`FILE_NAME`] in the sandbox's cache directory (`CAIRN_CACHE_DIR`,
//! a host directory in every driver).
//!
//! The host creates the file empty when it starts a sandbox; a runner only
//! appends to a file that exists, so a runner not under a host (or under a
//! host that does not read reports) writes nothing. The host reads what is
//! new every few seconds and once more when the sandbox ends.
//!
//! The file is written from inside the sandbox, so the reader trusts
//! nothing about it: it opens it without following a symlink and without
//! blocking, reads only a regular file with one link, at most
//! [`READ_AT_MOST`] bytes a call, refuses lines longer than
//! [`MAX_LINE`] and any line that is not exactly a [`HostReport`], and
//! starts over when the file shrank. A hostile runner can thus only make
//! its own host's figures wrong, never make the host read anything else.

use std::fs::{File, OpenOptions};
use std::io::{self, Read as _, Seek as _, SeekFrom, Write as _};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The reports file's name in the cache directory.
pub const FILE_NAME: &str = "host-reports.jsonl";

/// The longest line a reader accepts.
pub const MAX_LINE: usize = 4096;

/// The most a reader reads in one call; the rest waits for the next.
pub const READ_AT_MOST: u64 = 64 * 1024;

/// One event a runner reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum HostReport {
    /// A restore that succeeded.
    Restore {
        duration_ms: u64,
        /// Pack bytes received from the object store.
        bytes_downloaded: u64,
        /// Pack bytes taken from the host's pack cache instead.
        bytes_from_cache: u64,
        /// File content written (files already right on disk are not).
        bytes_written: u64,
    },
    /// A checkpoint that was committed.
    Checkpoint {
        duration_ms: u64,
        /// Pack bytes uploaded to the object store.
        bytes_uploaded: u64,
    },
}

/// Creates an empty reports file in `cache_dir`, replacing any (a kept
/// cache directory brings the last sandbox's).
pub fn create(cache_dir: &Path) -> io::Result<()> {
    let path = cache_dir.join(FILE_NAME);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o666)
        .open(&path)?;
    // The runner may run as another user (a container's root, say); the
    // umask must not keep it from appending.
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666))
}

/// Appends `report` to the reports file in `cache_dir`, if it exists.
/// Returns whether it was written.
pub fn append(cache_dir: &Path, report: &HostReport) -> io::Result<bool> {
    let file = OpenOptions::new()
        .append(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(cache_dir.join(FILE_NAME));
    let mut file = match file {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let mut line = serde_json::to_vec(report).map_err(io::Error::other)?;
    line.push(b'\n');
    // One write of a short line with O_APPEND: lines never interleave.
    file.write_all(&line)?;
    Ok(true)
}

/// What one [`ReportReader::read_new`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NewReports {
    pub reports: Vec<HostReport>,
    /// Lines (or files) that were not reports.
    pub rejected: u64,
}

/// Reads a reports file as it grows.
#[derive(Debug, Default)]
pub struct ReportReader {
    /// Bytes of the file consumed so far.
    offset: u64,
    /// The start of a line whose end has not been written yet.
    partial: Vec<u8>,
    /// The file was refused once; it is not counted again.
    refused: bool,
}

impl ReportReader {
    /// Reads the file from its start.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads only what is appended from now on (a sandbox an earlier host
    /// process started, whose reports that process counted).
    pub fn from_end(cache_dir: &Path) -> Self {
        let offset = std::fs::symlink_metadata(cache_dir.join(FILE_NAME))
            .ok()
            .filter(std::fs::Metadata::is_file)
            .map_or(0, |meta| meta.len());
        Self {
            offset,
            ..Self::default()
        }
    }

    /// Reads the complete lines appended to the reports file in
    /// `cache_dir` since the last call. A missing file has nothing new.
    pub fn read_new(&mut self, cache_dir: &Path) -> NewReports {
        let mut new = NewReports::default();
        let chunk = match self.read_chunk(&cache_dir.join(FILE_NAME)) {
            Ok(chunk) => {
                self.refused = false;
                chunk
            }
            Err(e) => {
                if e.kind() != io::ErrorKind::NotFound && !self.refused {
                    tracing::debug!(error = %e, dir = %cache_dir.display(), "refused a sandbox's reports file");
                    self.refused = true;
                    new.rejected += 1;
                }
                return new;
            }
        };
        let mut rest = chunk.as_slice();
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            let (line, tail) = rest.split_at(end);
            rest = &tail[1..];
            if self.partial.len() + line.len() > MAX_LINE {
                self.partial.clear();
                new.rejected += 1;
                continue;
            }
            self.partial.extend_from_slice(line);
            match serde_json::from_slice::<HostReport>(&self.partial) {
                Ok(report) => new.reports.push(report),
                Err(_) => new.rejected += 1,
            }
            self.partial.clear();
        }
        if self.partial.len() + rest.len() > MAX_LINE {
            // Too long already: its end is skipped as part of the next line.
            self.partial.clear();
            new.rejected += 1;
        } else {
            self.partial.extend_from_slice(rest);
        }
        new
    }

    fn read_chunk(&mut self, path: &Path) -> io::Result<Vec<u8>> {
        let mut file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)?;
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(io::Error::other("not a regular file"));
        }
        if meta.nlink() != 1 {
            return Err(io::Error::other("a file with other names (a hard link)"));
        }
        if meta.len() < self.offset {
            // Replaced or truncated: read it from the start.
            self.offset = 0;
            self.partial.clear();
        }
        read_from(&mut file, self.offset, READ_AT_MOST).inspect(|chunk| {
            self.offset += chunk.len() as u64;
        })
    }
}

fn read_from(file: &mut File, offset: u64, at_most: u64) -> io::Result<Vec<u8>> {
    file.seek(SeekFrom::Start(offset))?;
    let mut chunk = Vec::new();
    file.take(at_most).read_to_end(&mut chunk)?;
    Ok(chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn restore(ms: u64) -> HostReport {
        HostReport::Restore {
            duration_ms: ms,
            bytes_downloaded: 10,
            bytes_from_cache: 20,
            bytes_written: 30,
        }
    }

    fn raw_append(dir: &Path, bytes: &[u8]) {
        let mut file = OpenOptions::new()
            .append(true)
            .open(dir.join(FILE_NAME))
            .unwrap();
        file.write_all(bytes).unwrap();
    }

    #[test]
    fn a_runner_appends_only_to_a_file_its_host_created() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!append(dir.path(), &restore(1)).unwrap());
        assert!(!dir.path().join(FILE_NAME).exists());
        create(dir.path()).unwrap();
        assert!(append(dir.path(), &restore(1)).unwrap());
        let checkpoint = HostReport::Checkpoint {
            duration_ms: 7,
            bytes_uploaded: 1234,
        };
        assert!(append(dir.path(), &checkpoint).unwrap());
        let mut reader = ReportReader::new();
        assert_eq!(
            reader.read_new(dir.path()),
            NewReports {
                reports: vec![restore(1), checkpoint],
                rejected: 0
            }
        );
        // Nothing new: nothing read twice.
        assert_eq!(reader.read_new(dir.path()), NewReports::default());
        // A reader from the end sees only what comes next.
        let mut late = ReportReader::from_end(dir.path());
        append(dir.path(), &restore(4)).unwrap();
        assert_eq!(late.read_new(dir.path()).reports, vec![restore(4)]);
        assert_eq!(reader.read_new(dir.path()).reports, vec![restore(4)]);
        // A new sandbox starts on the kept cache directory: a fresh file.
        append(dir.path(), &restore(2)).unwrap();
        create(dir.path()).unwrap();
        append(dir.path(), &restore(3)).unwrap();
        assert_eq!(reader.read_new(dir.path()).reports, vec![restore(3)]);
    }

    #[test]
    fn a_line_is_read_once_it_is_complete() {
        let dir = tempfile::tempdir().unwrap();
        create(dir.path()).unwrap();
        let line = serde_json::to_vec(&restore(5)).unwrap();
        let (head, tail) = line.split_at(10);
        raw_append(dir.path(), head);
        let mut reader = ReportReader::new();
        assert_eq!(reader.read_new(dir.path()), NewReports::default());
        raw_append(dir.path(), tail);
        raw_append(dir.path(), b"\n");
        assert_eq!(reader.read_new(dir.path()).reports, vec![restore(5)]);
    }

    #[test]
    fn what_is_not_a_report_is_counted_and_skipped() {
        let dir = tempfile::tempdir().unwrap();
        create(dir.path()).unwrap();
        raw_append(dir.path(), b"not json\n");
        raw_append(dir.path(), br#"{"kind":"restore","duration_ms":1}"#);
        raw_append(dir.path(), b"\n");
        raw_append(
            dir.path(),
            br#"{"kind":"checkpoint","duration_ms":1,"bytes_uploaded":2,"extra":3}"#,
        );
        raw_append(dir.path(), b"\n");
        raw_append(dir.path(), &vec![b'x'; MAX_LINE + 10]);
        raw_append(dir.path(), b"\n");
        append(dir.path(), &restore(9)).unwrap();
        let mut reader = ReportReader::new();
        assert_eq!(
            reader.read_new(dir.path()),
            NewReports {
                reports: vec![restore(9)],
                rejected: 4
            }
        );
    }

    #[test]
    fn a_reader_reads_a_bounded_amount_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        create(dir.path()).unwrap();
        let line_len = serde_json::to_vec(&restore(100)).unwrap().len() as u64 + 1;
        let lines = READ_AT_MOST / line_len + 10;
        for _ in 0..lines {
            append(dir.path(), &restore(100)).unwrap();
        }
        let mut reader = ReportReader::new();
        let first = reader.read_new(dir.path());
        assert!((first.reports.len() as u64) < lines);
        assert_eq!(first.rejected, 0);
        let second = reader.read_new(dir.path());
        assert_eq!(first.reports.len() + second.reports.len(), lines as usize);
        assert_eq!(second.rejected, 0);
    }

    #[test]
    fn a_symlink_a_hard_link_or_a_fifo_is_refused_once_and_never_read() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(
            &secret,
            format!("{}\n", serde_json::to_string(&restore(1)).unwrap()),
        )
        .unwrap();
        let cache = dir.path().join("cache");
        std::fs::create_dir(&cache).unwrap();
        let reports = cache.join(FILE_NAME);
        let mut reader = ReportReader::new();

        std::os::unix::fs::symlink(&secret, &reports).unwrap();
        assert_eq!(reader.read_new(&cache).rejected, 1);
        assert_eq!(reader.read_new(&cache), NewReports::default());
        std::fs::remove_file(&reports).unwrap();

        std::fs::hard_link(&secret, &reports).unwrap();
        let mut reader = ReportReader::new();
        assert_eq!(
            reader.read_new(&cache),
            NewReports {
                reports: vec![],
                rejected: 1
            }
        );
        std::fs::remove_file(&reports).unwrap();

        rustix::fs::mknodat(
            rustix::fs::CWD,
            &reports,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let mut reader = ReportReader::new();
        // Does not block on the FIFO.
        assert_eq!(reader.read_new(&cache).rejected, 1);
    }
}
