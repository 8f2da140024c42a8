//! The host agent's data directory: its host id, one directory per sandbox,
//! a record per sandbox, and the sandboxes' logs.
//!
//! ```text
//! DIR/host-id                      the id the coordinator gave this host
//! DIR/host-credential.json         that host id and the token bound to it (0600)
//! DIR/sandboxes/<id>/workspace/    bind-mounted at /workspace (local driver)
//! DIR/sandboxes/<id>/home/         HOME of the runner
//! DIR/sandboxes/<id>/cache/        CAIRN_CACHE_DIR (fingerprint cache)
//! DIR/records/<id>.json            what the agent knows about the sandbox
//! DIR/logs/<id>.log                stdout and stderr of the sandbox's processes
//! DIR/kept/<workspace>/            a tree kept from an ended sandbox (see kept.rs)
//! ```
//!
//! A record is written before the sandbox starts and kept, with the sandbox's
//! end, until the coordinator says to forget it. So an agent that restarts
//! finds sandboxes its previous process left running (and stops them) and
//! keeps reporting ended ones the coordinator may not have heard of yet.
//! Logs outlive their sandbox; ones older than [`LOG_RETENTION`] are pruned.
//!
//! The host credential is what the coordinator answered the first
//! registration with: a token that acts only as this host. The agent uses it
//! for every later call, registering again after a restart included, in
//! place of the (enrollment) token it was started with; the host id and the
//! token are written together, in one file, so they never disagree.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use cairn_proto::ids::Generation;
use cairn_proto::runs::SandboxState;
use serde::{Deserialize, Serialize};

/// Sandbox logs older than this are deleted when sandboxes are forgotten.
pub const LOG_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Longest sandbox id accepted (it becomes a directory name).
const MAX_SANDBOX_ID: usize = 128;

/// Paths inside the data directory.
#[derive(Debug, Clone)]
pub struct Layout {
    root: PathBuf,
}

/// The directories of one sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxPaths {
    pub dir: PathBuf,
    pub workspace: PathBuf,
    pub home: PathBuf,
    pub cache: PathBuf,
}

/// The token bound to this host, and the host it is bound to.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCredential {
    pub host_id: String,
    pub token: String,
}

impl std::fmt::Debug for HostCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a secret: never in logs.
        f.debug_struct("HostCredential")
            .field("host_id", &self.host_id)
            .finish_non_exhaustive()
    }
}

/// What the host agent remembers about one sandbox, on disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub sandbox_id: String,
    /// The run and workspace as the assignment named them (empty for a
    /// destroy order of a sandbox this host never knew). The host only
    /// passes them on; where it acts on one (keeping a tree) it parses it.
    pub run_id: String,
    pub attempt: u32,
    pub generation: Generation,
    pub workspace_id: String,
    /// The image the sandbox was started from (after `--default-image`).
    pub image: String,
    /// "local" or "exec".
    pub driver: String,
    /// Started by an exec create command that returned (a detached sandbox).
    pub detached: bool,
    /// Pid and start time (clock ticks since boot) of the session leader.
    pub pid: Option<i32>,
    pub pid_start_time: Option<u64>,
    pub state: SandboxState,
    pub exit_code: i32,
    pub detail: String,
}

/// Why the data directory could not be used.
#[derive(Debug, thiserror::Error)]
#[error("{action} {path}: {source}")]
pub struct LayoutError {
    action: &'static str,
    path: PathBuf,
    source: io::Error,
}

impl LayoutError {
    fn new(action: &'static str, path: &Path, source: io::Error) -> Self {
        Self {
            action,
            path: path.to_owned(),
            source,
        }
    }
}

/// Whether `id` can name a sandbox directory: 1–128 of letters, digits, `.`,
/// `_` and `-`, not starting with `.` or `-`.
pub fn valid_sandbox_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_SANDBOX_ID
        && !id.starts_with(['.', '-'])
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Layout {
    /// Creates the data directory's skeleton (mode 0700) if needed.
    pub fn open(root: &Path) -> Result<Self, LayoutError> {
        let root = if root.is_absolute() {
            root.to_owned()
        } else {
            std::env::current_dir()
                .map_err(|e| LayoutError::new("cannot resolve", root, e))?
                .join(root)
        };
        let layout = Self { root };
        for dir in [
            layout.root.clone(),
            layout.sandboxes_dir(),
            layout.records_dir(),
            layout.logs_dir(),
        ] {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(|e| LayoutError::new("cannot create", &dir, e))?;
        }
        Ok(layout)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn sandboxes_dir(&self) -> PathBuf {
        self.root.join("sandboxes")
    }

    fn records_dir(&self) -> PathBuf {
        self.root.join("records")
    }

    fn logs_dir(&self) -> PathBuf {
        self.root.join("logs")
    }

    fn host_id_file(&self) -> PathBuf {
        self.root.join("host-id")
    }

    /// Where the host credential is kept.
    pub fn credential_file(&self) -> PathBuf {
        self.root.join("host-credential.json")
    }

    /// The directories of sandbox `id` (which must be [`valid_sandbox_id`]).
    pub fn sandbox_paths(&self, id: &str) -> SandboxPaths {
        let dir = self.sandboxes_dir().join(id);
        SandboxPaths {
            workspace: dir.join("workspace"),
            home: dir.join("home"),
            cache: dir.join("cache"),
            dir,
        }
    }

    pub fn log_file(&self, id: &str) -> PathBuf {
        self.logs_dir().join(format!("{id}.log"))
    }

    /// The host id a previous run of the agent was given, if any.
    pub fn read_host_id(&self) -> Result<Option<String>, LayoutError> {
        let path = self.host_id_file();
        match fs::read_to_string(&path) {
            Ok(text) => Ok(Some(text.trim().to_owned()).filter(|id| !id.is_empty())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(LayoutError::new("cannot read", &path, e)),
        }
    }

    pub fn write_host_id(&self, id: &str) -> Result<(), LayoutError> {
        write_atomically(&self.host_id_file(), format!("{id}\n").as_bytes())
    }

    /// The credential a previous registration left, if any. A file that is
    /// there but cannot be read or parsed is an error, never ignored: the
    /// agent would otherwise fall back to its enrollment token, which the
    /// coordinator refuses for a known host.
    pub fn read_credential(&self) -> Result<Option<HostCredential>, LayoutError> {
        let path = self.credential_file();
        let text = match fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(LayoutError::new("cannot read", &path, e)),
        };
        let credential: HostCredential = serde_json::from_slice(&text).map_err(|e| {
            LayoutError::new(
                "cannot parse",
                &path,
                io::Error::new(io::ErrorKind::InvalidData, e),
            )
        })?;
        if credential.host_id.is_empty() || credential.token.is_empty() {
            return Err(LayoutError::new(
                "incomplete host credential in",
                &path,
                io::Error::new(io::ErrorKind::InvalidData, "host_id or token is empty"),
            ));
        }
        Ok(Some(credential))
    }

    /// Keeps the credential (mode 0600, replaced atomically and synced).
    pub fn write_credential(&self, credential: &HostCredential) -> Result<(), LayoutError> {
        let text = serde_json::to_vec(credential).expect("strings always serialise");
        write_atomically(&self.credential_file(), &text)
    }

    /// Creates a fresh, empty directory tree for a sandbox (removing a stale one).
    pub fn create_sandbox_dirs(&self, id: &str) -> Result<SandboxPaths, LayoutError> {
        let paths = self.sandbox_paths(id);
        remove_tree(&paths.dir)?;
        for dir in [&paths.dir, &paths.workspace, &paths.home, &paths.cache] {
            fs::DirBuilder::new()
                .mode(0o755)
                .create(dir)
                .map_err(|e| LayoutError::new("cannot create", dir, e))?;
        }
        Ok(paths)
    }

    /// Ids of sandbox directories present on disk.
    pub fn sandbox_dirs(&self) -> Result<Vec<String>, LayoutError> {
        list_names(&self.sandboxes_dir(), "")
    }

    pub fn write_record(&self, record: &SandboxRecord) -> Result<(), LayoutError> {
        let json = serde_json::to_vec_pretty(record).expect("a record always serialises");
        write_atomically(&self.record_path(&record.sandbox_id), &json)
    }

    pub fn remove_record(&self, id: &str) -> Result<(), LayoutError> {
        let path = self.record_path(id);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Err(LayoutError::new("cannot remove", &path, e))
            }
            _ => Ok(()),
        }
    }

    /// Every readable record; unreadable ones are logged and skipped.
    pub fn read_records(&self) -> Result<Vec<SandboxRecord>, LayoutError> {
        let mut records = Vec::new();
        for id in list_names(&self.records_dir(), ".json")? {
            let path = self.record_path(&id);
            let parsed = fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|bytes| {
                    serde_json::from_slice::<SandboxRecord>(&bytes).map_err(|e| e.to_string())
                });
            match parsed {
                Ok(record) if record.sandbox_id == id => records.push(record),
                Ok(_) => {
                    tracing::warn!(path = %path.display(), "sandbox record names another sandbox; ignored")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable sandbox record; ignored")
                }
            }
        }
        Ok(records)
    }

    fn record_path(&self, id: &str) -> PathBuf {
        self.records_dir().join(format!("{id}.json"))
    }

    /// Deletes sandbox logs older than [`LOG_RETENTION`].
    pub fn prune_logs(&self) {
        let Ok(entries) = fs::read_dir(self.logs_dir()) else {
            return;
        };
        let now = SystemTime::now();
        for entry in entries.flatten() {
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| now.duration_since(t).unwrap_or_default() > LOG_RETENTION);
            if old && let Err(e) = fs::remove_file(entry.path()) {
                tracing::warn!(path = %entry.path().display(), error = %e, "cannot prune an old sandbox log");
            }
        }
    }
}

/// Names in `dir` that end with `suffix` (stripped) and are valid sandbox ids.
fn list_names(dir: &Path, suffix: &str) -> Result<Vec<String>, LayoutError> {
    let entries = fs::read_dir(dir).map_err(|e| LayoutError::new("cannot list", dir, e))?;
    let mut names: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_suffix(suffix)
                .map(str::to_owned)
        })
        .filter(|name| valid_sandbox_id(name))
        .collect();
    names.sort();
    Ok(names)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), LayoutError> {
    let tmp = path.with_extension("tmp");
    let write = || -> io::Result<()> {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&tmp, path)
    };
    write().map_err(|e| LayoutError::new("cannot write", path, e))
}

/// Removes `path` and everything below it without ever following a symlink
/// out of it, and without descending into a file system mounted inside it.
///
/// Read-only directories (a Go module cache, say) are made writable first.
pub fn remove_tree(path: &Path) -> Result<(), LayoutError> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(LayoutError::new("cannot inspect", path, e)),
        Ok(meta) if !meta.is_dir() => {
            return fs::remove_file(path).map_err(|e| LayoutError::new("cannot remove", path, e));
        }
        Ok(_) => {}
    }
    if let Some(mount) = mount_below(path) {
        return Err(LayoutError::new(
            "refusing to remove",
            path,
            io::Error::other(format!(
                "{} is mounted inside it; unmount it first",
                mount.display()
            )),
        ));
    }
    // std's remove_dir_all opens every directory with O_NOFOLLOW and unlinks
    // relative to it, so a symlink (or a swapped-in one) is removed, not followed.
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            make_dirs_writable(path);
            fs::remove_dir_all(path).map_err(|e| LayoutError::new("cannot remove", path, e))
        }
        Err(e) => Err(LayoutError::new("cannot remove", path, e)),
    }
}

/// Gives the owner rwx on every directory below `dir`, never through a symlink.
fn make_dirs_writable(dir: &Path) {
    let opened = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_DIRECTORY)
        .open(dir);
    let Ok(handle) = opened else { return };
    if let Ok(meta) = handle.metadata() {
        let mode = meta.permissions().mode();
        if mode & 0o700 != 0o700 {
            let _ = handle.set_permissions(fs::Permissions::from_mode(mode | 0o700));
        }
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            make_dirs_writable(&entry.path());
        }
    }
}

/// A mount point at or below `path` in this process's mount namespace.
pub(crate) fn mount_below(path: &Path) -> Option<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let base = path.canonicalize().ok()?;
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mount_path(field)))
        .find(|mount| mount.starts_with(&base))
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mount_path(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let code = (bytes[i] == b'\\' && i + 4 <= bytes.len())
            .then(|| std::str::from_utf8(&bytes[i + 1..i + 4]).ok())
            .flatten()
            .and_then(|digits| u8::from_str_radix(digits, 8).ok());
        if let Some(code) = code {
            out.push(code);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn sandbox_ids_cannot_escape_the_sandboxes_dir() {
        for good in ["sbx-run-01abc-a1", "sbx.1_x", "a"] {
            assert!(valid_sandbox_id(good), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            "-rf",
            ".hidden",
            "a b",
            &"x".repeat(129),
        ] {
            assert!(!valid_sandbox_id(bad), "{bad}");
        }
    }

    #[test]
    fn removal_never_follows_symlinks_out_of_the_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("precious"), "keep me").unwrap();
        let tree = tmp.path().join("tree");
        fs::create_dir_all(tree.join("a/b")).unwrap();
        fs::write(tree.join("a/b/file"), "x").unwrap();
        symlink(&outside, tree.join("a/link-to-dir")).unwrap();
        symlink(outside.join("precious"), tree.join("link-to-file")).unwrap();
        // A read-only directory, as Go's module cache leaves them.
        fs::create_dir(tree.join("ro")).unwrap();
        fs::write(tree.join("ro/f"), "x").unwrap();
        fs::set_permissions(tree.join("ro"), fs::Permissions::from_mode(0o555)).unwrap();

        remove_tree(&tree).unwrap();
        assert!(!tree.exists());
        assert_eq!(
            fs::read_to_string(outside.join("precious")).unwrap(),
            "keep me"
        );
        remove_tree(&tree).unwrap();
    }

    #[test]
    fn the_host_credential_is_private_and_survives_a_restart() {
        let tmp = tempfile::tempdir().unwrap();
        let layout = Layout::open(tmp.path()).unwrap();
        assert_eq!(layout.read_credential().unwrap(), None);
        let credential = HostCredential {
            host_id: "host-abc".into(),
            token: "cairn_host_secret".into(),
        };
        layout.write_credential(&credential).unwrap();
        let mode = fs::metadata(layout.credential_file())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!format!("{credential:?}").contains("secret"));
        let again = Layout::open(tmp.path()).unwrap();
        assert_eq!(again.read_credential().unwrap(), Some(credential));

        fs::write(again.credential_file(), b"{\"host_id\": \"\"}").unwrap();
        let damaged = again.read_credential().unwrap_err().to_string();
        assert!(damaged.contains("host-credential.json"), "{damaged}");
    }

    #[test]
    fn records_and_host_id_survive_a_restart() {
        let tmp = tempfile::tempdir().unwrap();
        let layout = Layout::open(tmp.path()).unwrap();
        assert_eq!(layout.read_host_id().unwrap(), None);
        layout.write_host_id("host-abc").unwrap();
        let record = SandboxRecord {
            sandbox_id: "sbx-r-a1".into(),
            run_id: "run-r".into(),
            attempt: 1,
            generation: Generation(7),
            workspace_id: "ws-1".into(),
            image: String::new(),
            driver: "local".into(),
            detached: false,
            pid: Some(42),
            pid_start_time: Some(99),
            state: SandboxState::Running,
            exit_code: 0,
            detail: String::new(),
        };
        layout.write_record(&record).unwrap();
        let paths = layout.create_sandbox_dirs("sbx-r-a1").unwrap();
        assert!(paths.workspace.is_dir() && paths.home.is_dir() && paths.cache.is_dir());

        let again = Layout::open(tmp.path()).unwrap();
        assert_eq!(again.read_host_id().unwrap().as_deref(), Some("host-abc"));
        assert_eq!(again.read_records().unwrap(), vec![record]);
        assert_eq!(again.sandbox_dirs().unwrap(), vec!["sbx-r-a1".to_owned()]);
        again.remove_record("sbx-r-a1").unwrap();
        assert!(again.read_records().unwrap().is_empty());
    }

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape_mount_path(r"/a\040b\134c"), r"/a b\c");
        assert_eq!(unescape_mount_path("/plain"), "/plain");
    }
}
