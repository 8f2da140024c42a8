//! The coordinator's data directory and its first-start set-up.
//!
//! ```text
//! DIR/                  mode 0700
//!   cairn.db            metadata (SQLite, WAL: also cairn.db-wal, cairn.db-shm)
//!   url-signing.key     32 random bytes, mode 0600: signs blob URLs
//!   run-token.key       32 random bytes, mode 0600: seeds the run-token key
//!                       (the database keeps the one all replicas use)
//!   admin.token         the admin bearer token, one line, mode 0600
//!   endpoints.json      {"grpc": URL, "blob": URL, "metrics": URL if served},
//!                       written after binding
//!   coordinator.lock    locked while a coordinator serves from DIR
//!   blobs/              the embedded object store (blobs/.tmp: uploads in flight)
//! ```
//!
//! Secret files are written to a temporary name with mode 0600, synced, and
//! renamed into place, so a crash never leaves a half-written key.

use std::io::{ErrorKind, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use ring::rand::{SecureRandom, SystemRandom};

use crate::signing::SIGNING_KEY_LEN;
use crate::tokens::{self, RUN_TOKEN_KEY_LEN, Scope};

/// Why the data directory could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error(
        "{dir}: another coordinator serves from this data directory (it holds {lock}); give each coordinator a data directory of its own"
    )]
    InUse { dir: PathBuf, lock: PathBuf },
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> DataDirError + '_ {
    move |source| DataDirError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Paths inside a data directory.
#[derive(Debug, Clone)]
pub struct DataDir {
    root: PathBuf,
}

impl DataDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn database(&self) -> PathBuf {
        self.root.join("cairn.db")
    }

    pub fn blobs(&self) -> PathBuf {
        self.root.join("blobs")
    }

    pub fn signing_key(&self) -> PathBuf {
        self.root.join("url-signing.key")
    }

    pub fn run_token_key(&self) -> PathBuf {
        self.root.join("run-token.key")
    }

    pub fn admin_token(&self) -> PathBuf {
        self.root.join("admin.token")
    }

    pub fn endpoints(&self) -> PathBuf {
        self.root.join("endpoints.json")
    }

    /// Locks the directory for this process: one coordinator serves from a
    /// data directory (its blobs, endpoints and SQLite file are its own).
    /// The lock lasts as long as the returned file is open.
    pub fn lock(&self) -> Result<std::fs::File, DataDirError> {
        let path = self.root.join("coordinator.lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_at(&path))?;
        match file.try_lock() {
            Ok(()) => Ok(file),
            Err(std::fs::TryLockError::WouldBlock) => Err(DataDirError::InUse {
                dir: self.root.clone(),
                lock: path,
            }),
            Err(std::fs::TryLockError::Error(e)) => Err(io_at(&path)(e)),
        }
    }

    /// Creates the directory (mode 0700) unless it exists.
    pub fn create(&self) -> Result<(), DataDirError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.root)
            .map_err(io_at(&self.root))
    }

    /// The URL-signing key, created at first start.
    pub fn load_or_create_signing_key(&self) -> Result<[u8; SIGNING_KEY_LEN], DataDirError> {
        load_or_create_key(&self.signing_key(), "a URL-signing key")
    }

    /// The key run tokens are derived from, created at first start. Keeping
    /// it across restarts keeps the tokens of running attempts valid.
    pub fn load_or_create_run_token_key(&self) -> Result<[u8; RUN_TOKEN_KEY_LEN], DataDirError> {
        load_or_create_key(&self.run_token_key(), "a run-token key")
    }

    /// The admin token, and whether it was created now.
    pub fn load_or_create_admin_token(&self) -> Result<(String, bool), DataDirError> {
        let path = self.admin_token();
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let token = text.trim();
                if !token.starts_with("cairn_admin_") || token.contains(char::is_whitespace) {
                    return Err(DataDirError::Invalid {
                        path,
                        reason: "does not hold an admin token (cairn_admin_…)".into(),
                    });
                }
                Ok((token.to_owned(), false))
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let token = tokens::generate(Scope::Admin).text;
                write_secret(&path, format!("{token}\n").as_bytes())?;
                Ok((token, true))
            }
            Err(e) => Err(io_at(&path)(e)),
        }
    }

    /// Writes `endpoints.json` atomically; `metrics` when they are served.
    pub fn write_endpoints(
        &self,
        grpc: &str,
        blob: &str,
        metrics: Option<&str>,
    ) -> Result<(), DataDirError> {
        let path = self.endpoints();
        let mut json = serde_json::json!({ "grpc": grpc, "blob": blob });
        if let Some(metrics) = metrics {
            json["metrics"] = metrics.into();
        }
        write_atomically(&path, format!("{json}\n").as_bytes(), 0o644)
    }

    /// Removes `endpoints.json` (a stale one would point at a dead server).
    pub fn remove_endpoints(&self) -> Result<(), DataDirError> {
        let path = self.endpoints();
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(io_at(&path)(e)),
            _ => Ok(()),
        }
    }
}

/// Reads the random key of `N` bytes at `path`, creating it if missing.
fn load_or_create_key<const N: usize>(path: &Path, what: &str) -> Result<[u8; N], DataDirError> {
    match std::fs::read(path) {
        Ok(bytes) => bytes
            .as_slice()
            .try_into()
            .map_err(|_| DataDirError::Invalid {
                path: path.to_owned(),
                reason: format!("holds {} bytes; {what} is {N}", bytes.len()),
            }),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let mut key = [0u8; N];
            SystemRandom::new()
                .fill(&mut key)
                .expect("the system random generator works");
            write_secret(path, &key)?;
            Ok(key)
        }
        Err(e) => Err(io_at(path)(e)),
    }
}

fn write_secret(path: &Path, contents: &[u8]) -> Result<(), DataDirError> {
    write_atomically(path, contents, 0o600)
}

/// Writes `contents` to a temporary sibling with `mode`, syncs it and
/// renames it to `path`, then syncs the directory.
fn write_atomically(path: &Path, contents: &[u8], mode: u32) -> Result<(), DataDirError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let temp = dir.join(format!(".{name}.{:016x}.tmp", rand::random::<u64>()));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&temp)?;
        file.write_all(contents)?;
        file.sync_all()?;
        std::fs::rename(&temp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result.map_err(io_at(path))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn first_start_creates_private_secrets_and_later_starts_reuse_them() {
        let parent = tempfile::tempdir().unwrap();
        let dir = DataDir::new(parent.path().join("data"));
        dir.create().unwrap();
        assert_eq!(mode(dir.root()), 0o700);

        let key = dir.load_or_create_signing_key().unwrap();
        assert_eq!(mode(&dir.signing_key()), 0o600);
        assert_eq!(dir.load_or_create_signing_key().unwrap(), key);
        let run_key = dir.load_or_create_run_token_key().unwrap();
        assert_eq!(mode(&dir.run_token_key()), 0o600);
        assert_eq!(dir.load_or_create_run_token_key().unwrap(), run_key);
        assert_ne!(run_key, key);

        let (token, created) = dir.load_or_create_admin_token().unwrap();
        assert!(created);
        assert_eq!(mode(&dir.admin_token()), 0o600);
        assert_eq!(
            std::fs::read_to_string(dir.admin_token()).unwrap(),
            format!("{token}\n")
        );
        assert_eq!(dir.load_or_create_admin_token().unwrap(), (token, false));
    }

    #[test]
    fn a_damaged_key_file_is_refused_by_name() {
        let parent = tempfile::tempdir().unwrap();
        let dir = DataDir::new(parent.path());
        std::fs::write(dir.signing_key(), b"short").unwrap();
        let err = dir.load_or_create_signing_key().unwrap_err().to_string();
        assert!(
            err.contains("url-signing.key") && err.contains("5 bytes"),
            "{err}"
        );
    }

    #[test]
    fn a_second_coordinator_cannot_lock_a_data_directory_in_use() {
        let parent = tempfile::tempdir().unwrap();
        let dir = DataDir::new(parent.path());
        let held = dir.lock().unwrap();
        let err = dir.lock().unwrap_err();
        assert!(matches!(err, DataDirError::InUse { .. }), "{err}");
        assert!(
            err.to_string().contains("another coordinator serves"),
            "{err}"
        );
        drop(held);
        dir.lock().expect("free again once the first lets go");
    }

    #[test]
    fn endpoints_are_written_as_json_and_removed() {
        let parent = tempfile::tempdir().unwrap();
        let dir = DataDir::new(parent.path());
        let read = || -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(dir.endpoints()).unwrap()).unwrap()
        };
        dir.write_endpoints("http://127.0.0.1:1", "http://127.0.0.1:2", None)
            .unwrap();
        let json = read();
        assert_eq!(json["grpc"], "http://127.0.0.1:1");
        assert_eq!(json["blob"], "http://127.0.0.1:2");
        assert!(json.get("metrics").is_none(), "{json}");
        dir.write_endpoints(
            "http://127.0.0.1:1",
            "http://127.0.0.1:2",
            Some("http://127.0.0.1:3/metrics"),
        )
        .unwrap();
        assert_eq!(read()["metrics"], "http://127.0.0.1:3/metrics");
        dir.remove_endpoints().unwrap();
        assert!(!dir.endpoints().exists());
        dir.remove_endpoints().unwrap();
    }
}
