//! Harness for cairn's end-to-end tests: start the real binaries and drive
//! them the way a user or a sandbox would.
//!
//! Every test starts its own [`Coordinator`] (ephemeral ports, a private data
//! dir) and runs `cairn-runner` / `cairnctl` through a [`Client`] with a
//! private cache dir and home, so tests run in parallel under cargo-nextest
//! without sharing a port or a directory.
//!
//! - [`binary`]: the built binaries next to the test executable.
//! - [`Coordinator`]: a `cairn-coordinator serve` process, killed on drop;
//!   gRPC helpers for what the tests set up directly.
//! - [`Client`] and [`Outcome`]: commands run to completion (with a timeout),
//!   their exit status and output, JSON parsed from `--output json`.
//! - [`TreeSnapshot`]: what a directory holds, taken with `lstat` (symlinks
//!   are never followed), compared with readable differences.
//! - [`git()`]: the real `git` CLI with a fixed identity and no user config.
//! - Store helpers: list, classify and damage the pack files of the embedded
//!   blob store.
//! - [`fleet`]: runs on hosts (issue 3) — a coordinator with short host
//!   leases, real `cairn-host` processes with local sandboxes, a recorded
//!   demo agent, crashes and process lookups.
//! - [`tls`]: certificates (a CA, the coordinator's, hosts') for TLS tests.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fmt;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use cairn_proto::pb;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tempfile::TempDir;

pub mod fleet;
pub mod tls;

/// How long any one command may run before the harness kills it.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(240);

/// How long a coordinator may take to write its endpoints and token.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// The path of a binary built by `cargo build --workspace --bins` (same
/// profile as the tests).
pub fn binary(name: &str) -> PathBuf {
    cairn_utils::testing::sibling_binary(name)
}

/// Runs a future to completion on a private runtime (tests are synchronous).
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime always builds")
        .block_on(future)
}

/// The port of a coordinator URL (`http://127.0.0.1:PORT`).
pub fn port_of(url: &str) -> u16 {
    url.trim_end_matches('/')
        .rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in {url}"))
}

/// A temporary directory with a recognisable name.
pub fn tempdir(label: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("cairn-e2e-{label}-"))
        .tempdir()
        .expect("temporary directories can be created")
}

// ---------------------------------------------------------------------------
// The coordinator

/// A running `cairn-coordinator serve` on ephemeral ports; killed on drop.
pub struct Coordinator {
    home: TempDir,
    /// The data dir whose test database it uses (its own, unless it is a
    /// replica of another coordinator).
    database_of: Option<PathBuf>,
    extra_args: Vec<String>,
    /// Environment variables its process gets (e.g. CAIRN_FAILPOINTS).
    extra_env: Vec<(String, String)>,
    child: Option<Child>,
    /// `--listen` and `--blob-listen`: ephemeral ports until a restart
    /// in place pins the ones the first start got.
    listen: [String; 2],
    grpc_url: String,
    blob_url: String,
    admin_token: String,
    /// The CA its TLS certificate chains to (`None`: plain HTTP).
    ca: Option<PathBuf>,
}

impl fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Coordinator")
            .field("data_dir", &self.data_dir())
            .field("grpc_url", &self.grpc_url)
            .field("blob_url", &self.blob_url)
            .finish_non_exhaustive()
    }
}

/// `--database URL --database-schema NAME` when `CAIRN_TEST_DATABASE` names
/// a PostgreSQL database ([`cairn_utils::testing::test_database`]); nothing
/// (the SQLite file in the data dir) otherwise.
fn test_database_args(data_dir: &Path) -> Vec<String> {
    match cairn_utils::testing::test_database(data_dir) {
        Some((url, schema)) => vec!["--database".into(), url, "--database-schema".into(), schema],
        None => Vec::new(),
    }
}

impl Coordinator {
    /// Starts a coordinator with default settings.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a coordinator with extra `serve` flags (e.g. `--url-ttl 1s`).
    pub fn start_with(extra_args: &[&str]) -> Self {
        Self::start_with_env(extra_args, &[])
    }

    /// Starts a coordinator serving TLS with `files`' certificate (and
    /// requiring host certificates when `mtls`), plus extra `serve` flags.
    /// Its clients trust `files.ca`.
    pub fn start_tls(files: &tls::TlsFiles, mtls: bool, extra_args: &[&str]) -> Self {
        let mut args = files.serve_args(mtls);
        args.extend(extra_args.iter().map(|s| s.to_string()));
        let mut coordinator = Self {
            home: tempdir("coordinator"),
            database_of: None,
            extra_args: args,
            extra_env: Vec::new(),
            child: None,
            listen: ["127.0.0.1:0".into(), "127.0.0.1:0".into()],
            grpc_url: String::new(),
            blob_url: String::new(),
            admin_token: String::new(),
            ca: Some(files.ca.clone()),
        };
        coordinator.spawn();
        coordinator
    }

    /// The CA bundle its clients trust (`CAIRN_CA`), when it serves TLS.
    pub fn ca(&self) -> Option<&Path> {
        self.ca.as_deref()
    }

    /// The TLS settings a client of this coordinator uses.
    pub fn client_tls(&self) -> cairn_engine::tls::ClientTls {
        match &self.ca {
            Some(ca) => cairn_engine::tls::ClientTls::trusting(&cairn_proto::tls::PemSource::File(
                ca.clone(),
            ))
            .expect("the test CA loads"),
            None => cairn_engine::tls::ClientTls::default(),
        }
    }

    /// The coordinator's `--data-dir`.
    pub fn data_dir(&self) -> PathBuf {
        self.home.path().join("data")
    }

    /// Where the embedded blob store keeps its objects.
    pub fn blobs_dir(&self) -> PathBuf {
        self.data_dir().join("blobs")
    }

    /// The gRPC address, e.g. `http://127.0.0.1:41234`.
    pub fn grpc_url(&self) -> &str {
        &self.grpc_url
    }

    /// The blob endpoint's base URL.
    pub fn blob_url(&self) -> &str {
        &self.blob_url
    }

    /// The admin token the coordinator wrote at first start.
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    fn log_path(&self) -> PathBuf {
        self.home.path().join("coordinator.log")
    }

    /// The last lines the coordinator printed, for failure messages.
    pub fn log_tail(&self) -> String {
        let log = fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    fn spawn(&mut self) {
        let data = self.data_dir();
        let endpoints_path = data.join("endpoints.json");
        // A restart must not read the previous process's ports.
        let _ = fs::remove_file(&endpoints_path);
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("the coordinator log can be opened");
        let child = Command::new(binary("cairn-coordinator"))
            .arg("serve")
            .arg("--data-dir")
            .arg(&data)
            .args([
                "--listen",
                &self.listen[0],
                "--blob-listen",
                &self.listen[1],
            ])
            .args(test_database_args(
                self.database_of.as_deref().unwrap_or(&data),
            ))
            .args(&self.extra_args)
            .env_remove("CAIRN_FAILPOINTS")
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle clones"))
            .stderr(log)
            .spawn()
            .expect("cairn-coordinator starts");
        self.child = Some(child);

        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            let child = self.child.as_mut().expect("just spawned");
            if let Some(status) = child.try_wait().expect("child status can be read") {
                panic!(
                    "cairn-coordinator exited ({status}) before it was ready; its output:\n{}",
                    self.log_tail()
                );
            }
            if let Some((grpc, blob, token)) = read_endpoints(&data) {
                self.grpc_url = grpc;
                self.blob_url = blob;
                self.admin_token = token;
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "cairn-coordinator wrote no endpoints.json and admin.token within {STARTUP_TIMEOUT:?}; its output:\n{}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A second coordinator on `first`'s database (PostgreSQL: replicas
    /// need `CAIRN_TEST_DATABASE`) with a data dir of its own, extra
    /// `serve` flags and environment variables.
    pub fn start_replica_of(first: &Self, extra_args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawned("replica", Some(first.data_dir()), extra_args, env)
    }

    /// Kills the process (SIGKILL, a crash) and leaves it dead.
    pub fn kill(&mut self) {
        self.stop();
    }

    /// Kills the process (SIGKILL, a crash) and starts it again on the same data dir.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Kills the process (SIGKILL) and starts it again on the same data dir
    /// and the same ports, so clients that were talking to it (their calls
    /// cut off) find it again where it was.
    pub fn restart_in_place(&mut self) {
        let address = |url: &str| {
            url.trim_start_matches("http://")
                .trim_start_matches("https://")
                .to_owned()
        };
        self.listen = [address(&self.grpc_url), address(&self.blob_url)];
        self.restart();
    }

    /// Starts a coordinator with extra `serve` flags and environment
    /// variables (e.g. `CAIRN_FAILPOINTS`).
    pub fn start_with_env(extra_args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawned("coordinator", None, extra_args, env)
    }

    /// Starts a coordinator (plain HTTP, ephemeral ports) in a fresh data
    /// dir named after `label`, on the test database of `database_of`'s
    /// data dir (its own when `None`).
    fn spawned(
        label: &str,
        database_of: Option<PathBuf>,
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut coordinator = Self {
            home: tempdir(label),
            database_of,
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            extra_env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            child: None,
            listen: ["127.0.0.1:0".into(), "127.0.0.1:0".into()],
            grpc_url: String::new(),
            blob_url: String::new(),
            admin_token: String::new(),
            ca: None,
        };
        coordinator.spawn();
        coordinator
    }

    /// Waits (bounded) for the process to exit by itself; its status.
    pub fn wait_for_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut().expect("the coordinator was started");
        loop {
            if let Some(status) = child.try_wait().expect("child status can be read") {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the coordinator did not exit within {within:?}; its output:\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts it again on the same data dir, with no extra environment.
    pub fn restart_without_env(&mut self) {
        self.extra_env.clear();
        self.restart();
    }

    /// Like [`restart`](Self::restart), with other extra `serve` flags.
    pub fn restart_with(&mut self, extra_args: &[&str]) {
        self.extra_args = extra_args.iter().map(|s| s.to_string()).collect();
        self.restart();
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A client with the admin token and a fresh, private runner cache.
    pub fn client(&self) -> Client {
        self.client_with_token(Some(&self.admin_token.clone()))
    }

    /// A client presenting `token` (or none).
    pub fn client_with_token(&self, token: Option<&str>) -> Client {
        Client {
            grpc_url: self.grpc_url.clone(),
            token: token.map(str::to_owned),
            home: tempdir("client"),
            ca: self.ca.clone(),
        }
    }

    /// gRPC clients authenticated with `token`.
    pub async fn connect(&self, token: Option<&str>) -> cairn_engine::client::CoordinatorClient {
        cairn_engine::client::CoordinatorClient::connect_with(
            &self.grpc_url,
            token,
            &self.client_tls(),
        )
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", self.grpc_url))
    }

    /// gRPC clients with the admin token.
    pub async fn admin(&self) -> cairn_engine::client::CoordinatorClient {
        self.connect(Some(&self.admin_token)).await
    }

    /// Creates a workspace called `name` and returns its id.
    pub fn create_workspace(&self, name: &str) -> String {
        block_on(async {
            let mut admin = self.admin().await;
            admin
                .workspaces
                .create_workspace(pb::CreateWorkspaceRequest {
                    name: name.to_owned(),
                })
                .await
                .unwrap_or_else(|s| panic!("CreateWorkspace {name:?} failed: {s}"))
                .into_inner()
                .id
        })
    }

    /// The committed checkpoints of a workspace, newest first.
    pub fn list_checkpoints(&self, workspace: &str) -> Vec<pb::Checkpoint> {
        block_on(async {
            let mut admin = self.admin().await;
            admin
                .checkpoints
                .list_checkpoints(pb::ListCheckpointsRequest {
                    workspace: workspace.to_owned(),
                    page_size: 1000,
                    page_token: String::new(),
                })
                .await
                .unwrap_or_else(|s| panic!("ListCheckpoints {workspace} failed: {s}"))
                .into_inner()
                .checkpoints
        })
    }
}

fn read_endpoints(data: &Path) -> Option<(String, String, String)> {
    let endpoints: Value =
        serde_json::from_str(&fs::read_to_string(data.join("endpoints.json")).ok()?).ok()?;
    let grpc = endpoints.get("grpc")?.as_str()?.to_owned();
    let blob = endpoints.get("blob")?.as_str()?.to_owned();
    let token = fs::read_to_string(data.join("admin.token"))
        .ok()?
        .trim()
        .to_owned();
    (!token.is_empty()).then_some((grpc, blob, token))
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!(
                "--- cairn-coordinator output ({}) ---\n{}",
                self.data_dir().display(),
                self.log_tail()
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Running the CLIs

/// Runs `cairn-runner` and `cairnctl` against one coordinator with a private
/// cache dir (a fresh client is a fresh machine as far as caches go).
pub struct Client {
    grpc_url: String,
    token: Option<String>,
    home: TempDir,
    /// `CAIRN_CA` for a coordinator serving TLS.
    ca: Option<PathBuf>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("grpc_url", &self.grpc_url)
            .field("home", &self.home.path())
            .finish()
    }
}

impl Client {
    /// The runner cache dir this client uses.
    pub fn cache_dir(&self) -> PathBuf {
        self.home.path().join("cache")
    }

    fn command(&self, bin: &str) -> Command {
        let mut cmd = Command::new(binary(bin));
        cmd.env("CAIRN_COORDINATOR", &self.grpc_url)
            .env("CAIRN_CACHE_DIR", self.cache_dir())
            .env("HOME", self.home.path())
            .env_remove("CAIRN_FAILPOINTS")
            .env_remove("CAIRN_WORKSPACE")
            .env_remove("CAIRN_LOG_FORMAT");
        match &self.token {
            Some(token) => cmd.env("CAIRN_TOKEN", token),
            None => cmd.env_remove("CAIRN_TOKEN"),
        };
        match &self.ca {
            Some(ca) => cmd.env("CAIRN_CA", ca),
            None => cmd.env_remove("CAIRN_CA"),
        };
        cmd
    }

    /// `cairn-runner` with this client's environment.
    pub fn runner(&self) -> Command {
        self.command("cairn-runner")
    }

    /// `cairnctl` with this client's environment.
    pub fn ctl(&self) -> Command {
        self.command("cairnctl")
    }

    /// `cairn-runner checkpoint --root ROOT --workspace WS --output json`; must succeed.
    pub fn checkpoint(&self, root: &Path, workspace: &str) -> Value {
        run(self
            .runner()
            .arg("checkpoint")
            .arg("--root")
            .arg(root)
            .args(["--workspace", workspace, "--output", "json"]))
        .assert_success()
        .json()
    }

    /// `cairn-runner restore --root ROOT --workspace WS --output json`; must succeed.
    pub fn restore(&self, root: &Path, workspace: &str) -> Value {
        run(self.runner().arg("restore").arg("--root").arg(root).args([
            "--workspace",
            workspace,
            "--output",
            "json",
        ]))
        .assert_success()
        .json()
    }

    /// `cairn-runner restore` with extra arguments, whatever the outcome.
    pub fn try_restore(&self, root: &Path, workspace: &str, extra: &[&str]) -> Outcome {
        run(self
            .runner()
            .arg("restore")
            .arg("--root")
            .arg(root)
            .args(["--workspace", workspace])
            .args(extra))
    }

    /// `cairnctl --output json ARGS…`; must succeed.
    pub fn ctl_json(&self, args: &[&str]) -> Value {
        run(self.ctl().args(["--output", "json"]).args(args))
            .assert_success()
            .json()
    }
}

/// The signed PUT URL of one data pack holding `bytes`, from PrepareUploads.
pub async fn put_url(
    api: &mut cairn_engine::client::CoordinatorClient,
    workspace: &str,
    bytes: &[u8],
) -> pb::SignedUrl {
    let mut urls = api
        .checkpoints
        .prepare_uploads(pb::PrepareUploadsRequest {
            workspace: workspace.to_owned(),
            packs: vec![pb::PackUpload {
                pack_id: sha256_hex(bytes),
                size: bytes.len() as u64,
                kind: pb::PackKind::Data as i32,
            }],
        })
        .await
        .expect("PrepareUploads")
        .into_inner()
        .urls;
    assert_eq!(urls.len(), 1, "one URL per pack asked for");
    urls.remove(0)
}

/// A finished command.
#[derive(Debug)]
pub struct Outcome {
    pub command: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` exited with {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.command, self.status, self.stdout, self.stderr
        )
    }
}

impl Outcome {
    /// Panics unless the command exited 0.
    #[track_caller]
    pub fn assert_success(self) -> Self {
        assert!(self.status.success(), "expected success: {self}");
        self
    }

    /// Panics unless the command exited with `code`.
    #[track_caller]
    pub fn assert_exit(self, code: i32) -> Self {
        assert_eq!(
            self.status.code(),
            Some(code),
            "expected exit code {code}: {self}"
        );
        self
    }

    /// stdout parsed as one JSON value.
    #[track_caller]
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not one JSON value ({e}): {self}"))
    }

    /// stdout and stderr together, for looking for a message wherever it went.
    pub fn all_output(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }
}

/// Runs `cmd` to completion with stdin closed, capturing its output; kills
/// it after [`COMMAND_TIMEOUT`].
pub fn run(cmd: &mut Command) -> Outcome {
    let command = describe(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start `{command}`: {e}"));
    let stdout = drain(child.stdout.take().expect("piped"));
    let stderr = drain(child.stderr.take().expect("piped"));
    let deadline = Instant::now() + COMMAND_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("child status can be read") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "`{command}` still ran after {COMMAND_TIMEOUT:?}; killed. stderr so far:\n{}",
                stderr.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Outcome {
        command,
        status,
        stdout: stdout.join().expect("reader thread"),
        stderr: stderr.join().expect("reader thread"),
    }
}

fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// Program and arguments (never the environment: it holds tokens).
pub fn describe(cmd: &Command) -> String {
    let mut parts = vec![cmd.get_program().to_string_lossy().into_owned()];
    parts.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    parts.join(" ")
}

// ---------------------------------------------------------------------------
// Trees on disk

/// What one path holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeKind {
    File { size: u64, sha256: [u8; 32] },
    Dir,
    Symlink { target: PathBuf },
    Other(String),
}

/// One path of a [`TreeSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub kind: NodeKind,
    /// Permission bits (`st_mode & 0o7777`); not compared for symlinks.
    pub mode: u32,
    /// (seconds, nanoseconds) of a regular file's mtime.
    pub mtime: Option<(i64, i64)>,
}

/// Everything under a directory (the directory itself excluded), by relative path.
#[derive(Debug, Clone)]
pub struct TreeSnapshot {
    pub root: PathBuf,
    pub nodes: BTreeMap<PathBuf, Node>,
}

impl TreeSnapshot {
    /// Walks `root` with `lstat`, hashing every regular file.
    pub fn take(root: &Path) -> Self {
        let mut nodes = BTreeMap::new();
        walk(root, Path::new(""), &mut nodes);
        Self {
            root: root.to_owned(),
            nodes,
        }
    }

    pub fn files(&self) -> usize {
        self.nodes
            .values()
            .filter(|n| matches!(n.kind, NodeKind::File { .. }))
            .count()
    }

    /// Readable differences between `self` (expected) and `other` (actual).
    pub fn differences(&self, other: &Self, compare_mtimes: bool) -> Vec<String> {
        let mut out = Vec::new();
        let paths: BTreeSet<&PathBuf> = self.nodes.keys().chain(other.nodes.keys()).collect();
        for path in paths {
            let shown = path.display();
            match (self.nodes.get(path), other.nodes.get(path)) {
                (Some(_), None) => {
                    out.push(format!("{shown}: missing from {}", other.root.display()))
                }
                (None, Some(_)) => out.push(format!(
                    "{shown}: not expected, but in {}",
                    other.root.display()
                )),
                (Some(a), Some(b)) => {
                    match (&a.kind, &b.kind) {
                        (
                            NodeKind::File {
                                size: sa,
                                sha256: ha,
                            },
                            NodeKind::File {
                                size: sb,
                                sha256: hb,
                            },
                        ) => {
                            if sa != sb {
                                out.push(format!("{shown}: size {sa} expected, found {sb}"));
                            } else if ha != hb {
                                out.push(format!("{shown}: content differs (same size {sa})"));
                            }
                            if compare_mtimes && a.mtime != b.mtime {
                                out.push(format!(
                                    "{shown}: mtime {:?} expected, found {:?}",
                                    a.mtime, b.mtime
                                ));
                            }
                        }
                        (NodeKind::Symlink { target: ta }, NodeKind::Symlink { target: tb })
                            if ta != tb =>
                        {
                            out.push(format!(
                                "{shown}: symlink to {} expected, found one to {}",
                                ta.display(),
                                tb.display()
                            ));
                        }
                        (ka, kb) if ka != kb => {
                            out.push(format!(
                                "{shown}: {} expected, found {}",
                                kind_word(ka),
                                kind_word(kb)
                            ));
                            continue;
                        }
                        _ => {}
                    }
                    let symlinks = matches!(a.kind, NodeKind::Symlink { .. })
                        || matches!(b.kind, NodeKind::Symlink { .. });
                    if !symlinks && a.mode != b.mode {
                        out.push(format!(
                            "{shown}: mode {:04o} expected, found {:04o}",
                            a.mode, b.mode
                        ));
                    }
                }
                (None, None) => unreachable!("path comes from one of the maps"),
            }
        }
        out
    }

    /// Panics, listing the first differences, unless `actual` holds the same tree.
    #[track_caller]
    pub fn assert_matches(&self, actual: &Path, compare_mtimes: bool) {
        let other = TreeSnapshot::take(actual);
        let diffs = self.differences(&other, compare_mtimes);
        if !diffs.is_empty() {
            let shown: Vec<&String> = diffs.iter().take(25).collect();
            panic!(
                "{} differs from {} in {} place(s):\n  {}",
                actual.display(),
                self.root.display(),
                diffs.len(),
                shown
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join("\n  ")
            );
        }
    }
}

/// Panics with readable differences unless `a` and `b` hold the same tree.
#[track_caller]
pub fn assert_trees_equal(expected: &Path, actual: &Path) {
    TreeSnapshot::take(expected).assert_matches(actual, false);
}

fn kind_word(kind: &NodeKind) -> String {
    match kind {
        NodeKind::File { .. } => "a file".into(),
        NodeKind::Dir => "a directory".into(),
        NodeKind::Symlink { .. } => "a symlink".into(),
        NodeKind::Other(what) => format!("a {what}"),
    }
}

fn walk(root: &Path, rel: &Path, nodes: &mut BTreeMap<PathBuf, Node>) {
    let dir = root.join(rel);
    let mut entries: Vec<_> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.expect("directory entries can be read").file_name())
        .collect();
    entries.sort();
    for name in entries {
        let rel_path = rel.join(&name);
        let path = root.join(&rel_path);
        let meta = fs::symlink_metadata(&path)
            .unwrap_or_else(|e| panic!("cannot lstat {}: {e}", path.display()));
        let file_type = meta.file_type();
        let mode = meta.mode() & 0o7777;
        let node = if file_type.is_symlink() {
            let target = fs::read_link(&path).expect("symlinks can be read");
            Node {
                kind: NodeKind::Symlink { target },
                mode,
                mtime: None,
            }
        } else if file_type.is_dir() {
            Node {
                kind: NodeKind::Dir,
                mode,
                mtime: None,
            }
        } else if file_type.is_file() {
            Node {
                kind: NodeKind::File {
                    size: meta.len(),
                    sha256: sha256_file(&path),
                },
                mode,
                mtime: Some((meta.mtime(), meta.mtime_nsec())),
            }
        } else {
            Node {
                kind: NodeKind::Other(format!("{file_type:?}")),
                mode,
                mtime: None,
            }
        };
        let is_dir = node.kind == NodeKind::Dir;
        nodes.insert(rel_path.clone(), node);
        if is_dir {
            walk(root, &rel_path, nodes);
        }
    }
}

fn sha256_file(path: &Path) -> [u8; 32] {
    let mut file =
        fs::File::open(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).expect("file reads");
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    hasher.finalize().into()
}

/// Names in a directory, sorted (empty when it does not exist).
pub fn dir_names(dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .map(|e| {
            e.expect("entries read")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

/// Writes `contents` to `path`, creating parent directories.
pub fn write(path: &Path, contents: impl AsRef<[u8]>) {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).expect("parents can be created");
    }
    fs::write(path, contents).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

/// Appends `contents` to an existing file.
pub fn append(path: &Path, contents: impl AsRef<[u8]>) {
    let mut file = fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    file.write_all(contents.as_ref()).expect("append works");
}

/// Writes `len` incompressible bytes (xorshift, so it is fast and repeatable per `seed`).
pub fn write_pseudo_random(path: &Path, len: usize, seed: u64) {
    let mut state = seed | 1;
    let mut buf = Vec::with_capacity(len + 8);
    while buf.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        buf.extend_from_slice(&state.to_le_bytes());
    }
    buf.truncate(len);
    write(path, buf);
}

pub fn set_mode(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("modes can be set");
}

/// Creates a symlink at `link` (and its parent directories).
pub fn symlink(target: impl AsRef<Path>, link: &Path) {
    if let Some(parent) = link.parent() {
        fs::create_dir_all(parent).expect("parents can be created");
    }
    std::os::unix::fs::symlink(target, link)
        .unwrap_or_else(|e| panic!("cannot create symlink {}: {e}", link.display()));
}

// ---------------------------------------------------------------------------
// git

/// `git` in `dir`, with a fixed identity and no system or user configuration.
pub fn git_command(dir: &Path) -> Command {
    let mut cmd = Command::new("git");
    cmd.current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_AUTHOR_NAME", "Dev")
        .env("GIT_AUTHOR_EMAIL", "dev@example.com")
        .env("GIT_COMMITTER_NAME", "Dev")
        .env("GIT_COMMITTER_EMAIL", "dev@example.com")
        .env("GIT_TERMINAL_PROMPT", "0");
    cmd
}

/// Runs git in `dir` and returns its stdout; panics when git fails.
#[track_caller]
pub fn git<S: AsRef<OsStr>>(dir: &Path, args: &[S]) -> String {
    run(git_command(dir).args(args)).assert_success().stdout
}

// ---------------------------------------------------------------------------
// The shared benchmark workspace generator

/// `../shared/bench` of the repository (where make_workspace.py lives).
pub fn shared_bench_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("..")
        .join("shared")
        .join("bench")
}

/// `python3 make_workspace.py ROOT ARGS…`.
pub fn make_workspace(root: &Path, args: &[&str]) {
    let script = shared_bench_dir().join("make_workspace.py");
    assert!(
        script.is_file(),
        "{} is missing (the shared bench kit)",
        script.display()
    );
    run(Command::new("python3")
        .arg(&script)
        .arg(root)
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null"))
    .assert_success();
}

/// One simulated agent turn on a workspace made by [`make_workspace`].
pub fn agent_turn(root: &Path, turn: u32) {
    make_workspace(root, &["--turn", &turn.to_string()]);
}

// ---------------------------------------------------------------------------
// The embedded blob store

/// Every file under `dir`, recursively (empty when it does not exist).
pub fn all_files(dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return out;
    };
    for entry in entries {
        let entry = entry.expect("entries read");
        if entry.file_type().expect("types read").is_dir() {
            out.extend(all_files(&entry.path()));
        } else {
            out.insert(entry.path());
        }
    }
    out
}

/// Every pack object in the store (`<blobs>/packs/<tenant>/<xx>/<id>`).
pub fn pack_files(blobs_dir: &Path) -> BTreeSet<PathBuf> {
    all_files(&blobs_dir.join("packs"))
}

/// The kind byte of a pack file's header: [`META`](PACK_META) or [`DATA`](PACK_DATA).
pub fn pack_kind(path: &Path) -> u8 {
    let mut header = [0u8; 16];
    fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .unwrap_or_else(|e| panic!("cannot read the header of {}: {e}", path.display()));
    assert_eq!(
        &header[..8],
        b"CAIRNPK\0",
        "{} is not a pack",
        path.display()
    );
    header[9]
}

pub const PACK_META: u8 = 1;
pub const PACK_DATA: u8 = 2;

/// Inverts every bit of the byte at `offset`.
pub fn flip_byte(path: &Path, offset: u64) {
    let mut file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    let mut byte = [0u8; 1];
    file.seek(SeekFrom::Start(offset)).expect("seek");
    file.read_exact(&mut byte).expect("read one byte");
    byte[0] ^= 0xff;
    file.seek(SeekFrom::Start(offset)).expect("seek");
    file.write_all(&byte).expect("write one byte");
    file.sync_all().expect("sync");
}

/// Lower-case hex SHA-256 (a pack's id).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// A string field of a JSON object, with a message naming what is missing.
#[track_caller]
pub fn json_str<'a>(value: &'a Value, field: &str) -> &'a str {
    value
        .get(field)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string field {field:?} in {value}"))
}

/// An unsigned integer field of a JSON object (nested with `a.b`).
#[track_caller]
pub fn json_u64(value: &Value, field: &str) -> u64 {
    let mut current = value;
    for part in field.split('.') {
        current = current
            .get(part)
            .unwrap_or_else(|| panic!("no field {field:?} in {value}"));
    }
    current
        .as_u64()
        .unwrap_or_else(|| panic!("field {field:?} is not an unsigned integer in {value}"))
}

/// A small workspace: nested text files, an executable, a symlink, an empty
/// dir and a 1 MiB incompressible file (content depends on `seed`).
pub fn populate_small_workspace(root: &Path, seed: u64) {
    write(
        &root.join("README.md"),
        format!("# small workspace {seed}\n"),
    );
    write(
        &root.join("src/main.rs"),
        format!("fn main() {{ println!(\"{seed}\"); }}\n"),
    );
    write(
        &root.join("src/lib/util.rs"),
        "pub fn util() -> u8 { 7 }\n".repeat(50),
    );
    write(&root.join("bin/tool.sh"), "#!/bin/sh\necho tool\n");
    set_mode(&root.join("bin/tool.sh"), 0o755);
    symlink("src/main.rs", &root.join("main-link"));
    fs::create_dir_all(root.join("empty/inner")).expect("dirs can be created");
    write_pseudo_random(&root.join("data/blob.bin"), 1 << 20, seed);
}

/// Every `"id"` string starting with `prefix` in a JSON document, in document
/// order (cairnctl's JSON wraps lists differently per command).
pub fn ids_with_prefix(value: &Value, prefix: &str) -> Vec<String> {
    fn visit(value: &Value, prefix: &str, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(id)) = map.get("id")
                    && id.starts_with(prefix)
                {
                    out.push(id.clone());
                }
                for (key, v) in map {
                    // A checkpoint's workspace or a workspace's latest checkpoint
                    // is another object, not another entry of the list.
                    if key != "latest_checkpoint" {
                        visit(v, prefix, out);
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| visit(v, prefix, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    visit(value, prefix, &mut out);
    out
}

/// Waits until files written so far are older than the runner's racy-timestamp
/// guard (2 s): only then may its fingerprint cache trust them, as it would
/// trust a workspace an agent has been working in for a while.
pub fn let_timestamps_settle() {
    std::thread::sleep(Duration::from_millis(3100));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The comparator is what every fidelity assertion rests on: it must see
    /// each kind of difference a restore could get wrong.
    #[test]
    fn tree_snapshots_report_every_kind_of_difference() {
        let dir = tempdir("harness");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        for root in [&a, &b] {
            write(&root.join("same.txt"), "same");
            write(&root.join("content.txt"), "aaaa");
            write(&root.join("mode.sh"), "#!/bin/sh\n");
            symlink("same.txt", &root.join("link"));
            fs::create_dir_all(root.join("kind")).unwrap();
        }
        assert!(
            TreeSnapshot::take(&a)
                .differences(&TreeSnapshot::take(&b), false)
                .is_empty()
        );

        write(&b.join("content.txt"), "bbbb");
        set_mode(&b.join("mode.sh"), 0o755);
        fs::remove_file(b.join("link")).unwrap();
        symlink("elsewhere", &b.join("link"));
        fs::remove_dir(b.join("kind")).unwrap();
        write(&b.join("kind"), "");
        write(&b.join("extra"), "");
        write(&a.join("only-in-a"), "");
        let diffs = TreeSnapshot::take(&a).differences(&TreeSnapshot::take(&b), false);
        for expected in [
            "content.txt: content differs",
            "mode.sh: mode",
            "link: symlink to same.txt",
            "kind: a directory expected",
            "extra: not expected",
            "only-in-a: missing",
        ] {
            assert!(
                diffs.iter().any(|d| d.starts_with(expected)),
                "{expected:?} not in {diffs:#?}"
            );
        }
        assert_eq!(diffs.len(), 6, "{diffs:#?}");

        let file = b.join("same.txt");
        let old = fs::File::options().write(true).open(&file).unwrap();
        old.set_modified(std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000))
            .unwrap();
        let with_mtimes = TreeSnapshot::take(&a).differences(&TreeSnapshot::take(&b), true);
        assert!(
            with_mtimes.iter().any(|d| d.starts_with("same.txt: mtime")),
            "{with_mtimes:#?}"
        );
    }

    #[test]
    fn ids_are_found_wherever_cairnctl_puts_them() {
        let doc: Value = serde_json::json!({
            "checkpoints": [
                {"id": "ck-2", "workspace_id": "ws-1", "parent_checkpoint_id": "ck-1"},
                {"id": "ck-1", "workspace_id": "ws-1"}
            ]
        });
        assert_eq!(ids_with_prefix(&doc, "ck-"), vec!["ck-2", "ck-1"]);
        let workspace = serde_json::json!({"id": "ws-1", "latest_checkpoint": {"id": "ck-2"}});
        assert_eq!(ids_with_prefix(&workspace, "ck-"), Vec::<String>::new());
    }
}
