//! The control socket of a resident runner: how `cairn-runner checkpoint`
//! asks a `cairn-runner watch`, or the `cairn-runner run` of its sandbox,
//! to cut a checkpoint with the change tracker and the fingerprint cache it
//! keeps in memory, instead of walking and reading the workspace itself.
//!
//! A Unix socket (mode 0600) next to the fingerprint cache, at a path
//! derived from the root and the cache directory, so the command finds it
//! without being told. One JSON line each way:
//!
//! ```text
//! → {"workspace": "<id or name>", "reason": "manual", "if_changed": false}
//! ← {"report": <the JSON of `cairn-runner checkpoint --output json`>, "summary": "<text>"}
//! ← {"unchanged": {"unchanged_since": "<checkpoint id>", "duration_ms": 3}}   (if_changed only)
//! ← {"error": "<why the checkpoint failed>"}
//! ```

use std::future::Future;
use std::io;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use cairn_proto::domain::CheckpointReason;
use cairn_proto::ids::CheckpointId;

use cairn_engine::checkpoint::CheckpointReport;

/// Longest request line accepted on the control socket.
const MAX_REQUEST: u64 = 4096;

/// The control socket a resident runner of `root` (canonical) with
/// `cache_dir` uses unless told otherwise, so `cairn-runner checkpoint`
/// finds it.
pub fn default_socket(cache_dir: &Path, root: &Path) -> PathBuf {
    let digest = Sha256::digest(root.as_os_str().as_encoded_bytes());
    cache_dir.join(format!("watch-{}.sock", &hex::encode(digest)[..16]))
}

/// A checkpoint asked for on the socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub workspace: String,
    pub reason: String,
    /// Cut only if the workspace differs from its newest checkpoint.
    #[serde(default)]
    pub if_changed: bool,
}

impl Request {
    /// The reason asked for, when the request is for `workspace`, the one
    /// `runner` (a watcher, a run) checkpoints; else the refusal to send.
    pub fn reason_for(&self, workspace: &str, runner: &str) -> Result<CheckpointReason, Response> {
        if self.workspace != workspace {
            return Err(Response::failed(format!(
                "this {runner} checkpoints workspace {workspace}, not {}",
                self.workspace
            )));
        }
        self.reason
            .parse()
            .map_err(|e: cairn_proto::ValidationError| Response::failed(e.to_string()))
    }
}

/// What an `--if-changed` checkpoint of an unchanged workspace answers
/// (also the JSON output of `cairn-runner checkpoint` then).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unchanged {
    /// The newest checkpoint, which still holds the workspace as it is.
    pub unchanged_since: CheckpointId,
    pub duration_ms: u64,
}

impl Unchanged {
    pub fn summary(&self) -> String {
        format!(
            "unchanged since checkpoint {}: nothing committed ({} ms)",
            self.unchanged_since, self.duration_ms
        )
    }
}

/// The answer to a [`Request`].
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Response {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unchanged: Option<Unchanged>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    pub fn failed(error: impl Into<String>) -> Self {
        Self {
            error: Some(error.into()),
            ..Self::default()
        }
    }

    pub fn committed(report: &CheckpointReport) -> Self {
        Self {
            summary: Some(crate::report::checkpoint_summary(report)),
            report: serde_json::to_value(report).ok(),
            ..Self::default()
        }
    }

    pub fn unchanged(unchanged: Unchanged) -> Self {
        Self {
            unchanged: Some(unchanged),
            ..Self::default()
        }
    }
}

/// Binds the control socket (mode 0600), replacing a stale one; refuses
/// when another runner answers there.
pub fn bind(socket: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the directory of {}", socket.display()))?;
    }
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        anyhow::bail!(
            "another runner already listens at {}; stop it first",
            socket.display()
        );
    }
    match std::fs::remove_file(socket) {
        Ok(()) => tracing::info!(socket = %socket.display(), "removed a stale control socket"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", socket.display())),
    }
    let listener =
        UnixListener::bind(socket).with_context(|| format!("listening at {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} private", socket.display()))?;
    Ok(listener)
}

/// Reads one request from `stream`, answers it with `answer`, and closes.
pub async fn serve_connection<F, Fut>(stream: UnixStream, answer: F) -> io::Result<()>
where
    F: FnOnce(Result<Request, String>) -> Fut,
    Fut: Future<Output = Response>,
{
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    tokio::io::AsyncReadExt::take(BufReader::new(read), MAX_REQUEST)
        .read_line(&mut line)
        .await?;
    let request = serde_json::from_str(line.trim()).map_err(|e| format!("unreadable request: {e}"));
    let response = answer(request).await;
    let mut bytes = serde_json::to_vec(&response).map_err(io::Error::other)?;
    bytes.push(b'\n');
    write.write_all(&bytes).await?;
    write.shutdown().await
}

/// Sends `request` to the runner at `socket` and returns its answer;
/// `Ok(None)` when nobody answers there (no listener, or no socket file).
pub async fn ask(socket: &Path, request: &Request) -> anyhow::Result<Option<Response>> {
    let stream = match UnixStream::connect(socket).await {
        Ok(stream) => stream,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e).with_context(|| format!("connecting to {}", socket.display())),
    };
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_vec(request)?;
    line.push(b'\n');
    write.write_all(&line).await?;
    let mut line = String::new();
    BufReader::new(read).read_line(&mut line).await?;
    let response = serde_json::from_str(line.trim()).with_context(|| {
        format!(
            "the runner at {} gave an unreadable answer",
            socket.display()
        )
    })?;
    Ok(Some(response))
}
