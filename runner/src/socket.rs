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
use std::os::fd::AsRawFd as _;
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

/// The longest path a Unix socket address holds: Linux's `sun_path` is 108
/// bytes, its terminating NUL included.
const MAX_SOCKET_PATH: usize = 107;

/// A path that names a socket and fits a socket address: the socket's own,
/// or, for a longer one, its name under `/proc/self/fd/N`, N a handle on
/// its directory held as long as this is. (The default path lies under the
/// host's data directory; one a little deeper than usual would otherwise
/// leave the runner without a control socket.)
struct Reachable {
    path: PathBuf,
    _dir: Option<std::fs::File>,
}

impl Reachable {
    fn new(socket: &Path) -> io::Result<Self> {
        let too_long = socket.as_os_str().len() > MAX_SOCKET_PATH;
        let Some((dir, name)) = too_long
            .then(|| socket.parent().zip(socket.file_name()))
            .flatten()
        else {
            return Ok(Self {
                path: socket.to_owned(),
                _dir: None,
            });
        };
        let dir = std::fs::File::open(dir)?;
        Ok(Self {
            path: Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name),
            _dir: Some(dir),
        })
    }
}

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
    let reachable = Reachable::new(socket)
        .with_context(|| format!("opening the directory of {}", socket.display()))?;
    if std::os::unix::net::UnixStream::connect(&reachable.path).is_ok() {
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
    let listener = UnixListener::bind(&reachable.path)
        .with_context(|| format!("listening at {}", socket.display()))?;
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
    let connected = match Reachable::new(socket) {
        Ok(reachable) => UnixStream::connect(&reachable.path).await,
        Err(e) => Err(e),
    };
    let stream = match connected {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_socket_deeper_than_an_address_holds_is_bound_and_answers() {
        let tmp = tempfile::tempdir().unwrap();
        let deep = tmp.path().join("d".repeat(60)).join("e".repeat(60));
        let socket = deep.join("watch-0123456789abcdef.sock");
        assert!(socket.as_os_str().len() > MAX_SOCKET_PATH);
        let listener = bind(&socket).unwrap();
        assert!(socket.exists(), "the socket is made where it was asked for");
        let taken = bind(&socket).unwrap_err();
        assert!(
            format!("{taken:#}").contains("another runner already listens"),
            "{taken:#}"
        );
        let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // The probe that found this listener is the first to accept.
        drop(listener.accept().await.unwrap());
        let served = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            serve_connection(stream, |request| async move {
                Response::failed(format!("heard {}", request.unwrap().workspace))
            })
            .await
            .unwrap();
        });
        let request = Request {
            workspace: "deep".into(),
            reason: "manual".into(),
            if_changed: false,
        };
        let answer = ask(&socket, &request)
            .await
            .unwrap()
            .expect("someone answers");
        assert_eq!(answer.error.as_deref(), Some("heard deep"));
        served.await.unwrap();
        // Its listener is gone: the next runner replaces the stale socket.
        bind(&socket).expect("a stale socket is replaced");
    }

    #[tokio::test]
    async fn nobody_answers_at_a_deep_path_with_no_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let socket = tmp.path().join("x".repeat(120)).join("watch.sock");
        let request = Request {
            workspace: "w".into(),
            reason: "manual".into(),
            if_changed: false,
        };
        assert!(ask(&socket, &request).await.unwrap().is_none());
    }
}
