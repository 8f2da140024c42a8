//! The embedded blob server: `DIR/blobs` over HTTP, through signed URLs.
//!
//! ```text
//! PUT  /o/{key}?exp&sig&size&sha256   stream to blobs/.tmp, hash, check, fsync, rename
//! GET  /o/{key}?exp&sig               whole object, or one byte range (206 / 416)
//! HEAD /o/{key}?exp&sig               size only (a GET URL)
//! GET  /healthz                       200, no signature
//! ```
//!
//! Any signature problem (missing, tampered, expired, signed for another
//! method or key) is a 403, and so is a URL signed for a run token's attempt
//! that is no longer current (ended, superseded, cancelled: the metadata is
//! asked, and its answer kept for at most [`ATTEMPT_CACHE_TTL`]); a missing
//! object a 404; an upload whose bytes do
//! not match the signed size and digest a 400, with nothing stored. Bodies
//! stream both ways; a pack is never held in memory whole.

use std::collections::HashMap;
use std::io::{ErrorKind, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::io::ReaderStream;

use cairn_proto::refusal::NotCurrent;

use crate::conn_limits::{self, CappedListener, ConnMeter, Timeouts};
use crate::db::MetadataStore;
use crate::signing::{Grant, SignedQuery, UrlSigner, unix_now};
use crate::store::ObjectKey;
use crate::store::local::{TEMP_DIR, object_path};
use crate::tokens::RunBinding;

const STREAM_CHUNK: usize = 256 << 10;

/// How long the answer to "is this attempt current?" is reused. A URL of an
/// attempt that just ended works at most this much longer; every request
/// within it (a restore fetches many packs) costs no metadata query.
pub const ATTEMPT_CACHE_TTL: Duration = Duration::from_secs(1);

/// Answers kept at most; past it, stale ones are dropped before a new one
/// is kept (and all of them if none is stale), so memory stays bounded.
const ATTEMPT_CACHE_ENTRIES: usize = 4096;

/// An attempt's answer and when it was asked.
type Answers = HashMap<RunBinding, (Instant, Result<(), NotCurrent>)>;

/// Whether the attempts URLs were signed for are current, asked of the
/// metadata and remembered briefly.
#[derive(Debug)]
struct AttemptCheck {
    db: Arc<MetadataStore>,
    answers: Mutex<Answers>,
}

impl AttemptCheck {
    async fn current(&self, holder: &RunBinding) -> Result<(), NotCurrent> {
        let now = Instant::now();
        if let Some((at, answer)) = self.lock().get(holder)
            && now.duration_since(*at) < ATTEMPT_CACHE_TTL
        {
            return *answer;
        }
        let answer = self.db.attempt_current(&holder.run, holder.attempt).await;
        let mut answers = self.lock();
        if answers.len() >= ATTEMPT_CACHE_ENTRIES {
            answers.retain(|_, (at, _)| now.duration_since(*at) < ATTEMPT_CACHE_TTL);
            if answers.len() >= ATTEMPT_CACHE_ENTRIES {
                answers.clear();
            }
        }
        answers.insert(holder.clone(), (now, answer));
        answer
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Answers> {
        // The map holds only cached answers: one a panicking holder left is still usable.
        self.answers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What the blob server needs: where objects live, the key to check URLs
/// with, and the metadata to ask whether an attempt is current.
#[derive(Debug)]
pub struct BlobServer {
    root: PathBuf,
    signer: UrlSigner,
    attempts: AttemptCheck,
}

impl BlobServer {
    /// Serves the objects under `root`, creating it and its temp dir.
    pub fn new(
        root: impl Into<PathBuf>,
        signer: UrlSigner,
        db: Arc<MetadataStore>,
    ) -> std::io::Result<Self> {
        let root = root.into();
        std::fs::create_dir_all(root.join(TEMP_DIR))?;
        Ok(Self {
            root,
            signer,
            attempts: AttemptCheck {
                db,
                answers: Mutex::new(HashMap::new()),
            },
        })
    }

    /// The routes of the blob server.
    pub fn router(self) -> Router {
        Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route(
                "/o/{*key}",
                get(get_object).put(put_object).fallback(|| async {
                    refuse(
                        StatusCode::FORBIDDEN,
                        "signed URLs allow only GET, HEAD and PUT".into(),
                    )
                }),
            )
            // Uploads are bounded by their signed size, checked while streaming.
            .layer(DefaultBodyLimit::disable())
            .with_state(Arc::new(self))
    }
}

/// Serves `router` on `listener` (over TLS when `tls` is given) until
/// `shutdown` completes, then drains: at most `max_connections` open at
/// once, each held to `timeouts` ([`crate::conn_limits`]).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    max_connections: usize,
    timeouts: Timeouts,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = CappedListener::new(listener, max_connections, timeouts, tls);
    let app = router
        .layer(axum::middleware::from_fn(conn_limits::track_requests))
        .into_make_service_with_connect_info::<ConnMeter>();
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

fn refuse(status: StatusCode, message: String) -> Response {
    (status, format!("{message}\n")).into_response()
}

fn internal(what: &str, path: &Path, error: std::io::Error) -> Response {
    tracing::error!(path = %path.display(), %error, "blob server could not {what}");
    refuse(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("could not {what}"),
    )
}

/// Checks the URL's signature for `put` (or a read) of `key`, and that the
/// attempt it was signed for, if any, is current.
async fn authorize(
    server: &BlobServer,
    key: &str,
    query: Option<&str>,
    put: bool,
) -> Result<(ObjectKey, Grant), Response> {
    let forbidden = |reason: String| refuse(StatusCode::FORBIDDEN, format!("forbidden: {reason}"));
    // A key the store would never sign cannot carry a valid signature.
    let key = ObjectKey::new(key).map_err(|e| forbidden(e.to_string()))?;
    let query = SignedQuery::parse(query.unwrap_or("")).map_err(|e| forbidden(e.to_string()))?;
    let (grant, holder) = server
        .signer
        .verify(&key, put, &query, unix_now())
        .map_err(|e| forbidden(e.to_string()))?;
    if let Some(holder) = holder
        && let Err(why) = server.attempts.current(&holder).await
    {
        tracing::info!(run = %holder.run, attempt = holder.attempt, why = why.as_str(), %key, "URL of an attempt that is not current refused");
        return Err(forbidden(format!(
            "the URL was signed for attempt {} of run {}, which is {}; a URL works only while its attempt is current",
            holder.attempt,
            holder.run,
            why.as_str()
        )));
    }
    Ok((key, grant))
}

/// A byte range request, resolved against the object's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RangeRequest {
    /// No range, or one this server ignores (several ranges, malformed).
    Whole,
    /// `first..=last`.
    Part {
        first: u64,
        last: u64,
    },
    Unsatisfiable,
}

/// Parses a `Range` header for an object of `size` bytes: `bytes=a-b`,
/// `bytes=a-` or `bytes=-n`. Headers it cannot use are ignored, as HTTP allows.
fn parse_range(header: &str, size: u64) -> RangeRequest {
    let Some(spec) = header.trim().strip_prefix("bytes=") else {
        return RangeRequest::Whole;
    };
    if spec.contains(',') {
        return RangeRequest::Whole;
    }
    let Some((first, last)) = spec.split_once('-') else {
        return RangeRequest::Whole;
    };
    let (first, last) = (first.trim(), last.trim());
    if first.is_empty() {
        let Ok(suffix) = last.parse::<u64>() else {
            return RangeRequest::Whole;
        };
        if suffix == 0 || size == 0 {
            return RangeRequest::Unsatisfiable;
        }
        return RangeRequest::Part {
            first: size - suffix.min(size),
            last: size - 1,
        };
    }
    let Ok(first) = first.parse::<u64>() else {
        return RangeRequest::Whole;
    };
    let last = if last.is_empty() {
        None
    } else {
        match last.parse::<u64>() {
            Ok(last) if last >= first => Some(last),
            _ => return RangeRequest::Whole,
        }
    };
    if first >= size {
        return RangeRequest::Unsatisfiable;
    }
    RangeRequest::Part {
        first,
        last: last.map_or(size - 1, |l| l.min(size - 1)),
    }
}

async fn get_object(
    State(server): State<Arc<BlobServer>>,
    UrlPath(key): UrlPath<String>,
    RawQuery(query): RawQuery,
    method: Method,
    headers: HeaderMap,
) -> Response {
    let (key, _) = match authorize(&server, &key, query.as_deref(), false).await {
        Ok(granted) => granted,
        Err(response) => return response,
    };
    let path = object_path(&server.root, &key);
    let mut file = match tokio::fs::File::open(&path).await {
        Ok(file) => file,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return refuse(
                StatusCode::NOT_FOUND,
                format!("object {key} does not exist"),
            );
        }
        Err(e) => return internal("open the object", &path, e),
    };
    let size = match file.metadata().await {
        Ok(meta) => meta.len(),
        Err(e) => return internal("read the object's size", &path, e),
    };
    let range = headers
        .get(header::RANGE)
        .and_then(|value| value.to_str().ok())
        .map_or(RangeRequest::Whole, |value| parse_range(value, size));
    let (status, first, len, content_range) = match range {
        RangeRequest::Whole => (StatusCode::OK, 0, size, None),
        RangeRequest::Part { first, last } => (
            StatusCode::PARTIAL_CONTENT,
            first,
            last - first + 1,
            Some(format!("bytes {first}-{last}/{size}")),
        ),
        RangeRequest::Unsatisfiable => {
            let mut response = refuse(
                StatusCode::RANGE_NOT_SATISFIABLE,
                format!("the object has {size} bytes"),
            );
            response.headers_mut().insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes */{size}")).expect("ascii header"),
            );
            return response;
        }
    };
    let body = if method == Method::HEAD {
        Body::empty()
    } else {
        if first > 0
            && let Err(e) = file.seek(SeekFrom::Start(first)).await
        {
            return internal("seek in the object", &path, e);
        }
        Body::from_stream(ReaderStream::with_capacity(file.take(len), STREAM_CHUNK))
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    headers.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Some(content_range) = content_range {
        headers.insert(
            header::CONTENT_RANGE,
            HeaderValue::from_str(&content_range).expect("ascii header"),
        );
    }
    response
}

/// An upload in flight: removed on drop unless it was moved into place.
struct TempUpload {
    path: PathBuf,
    kept: bool,
}

impl Drop for TempUpload {
    fn drop(&mut self) {
        if !self.kept
            && let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), error = %e, "could not remove a failed upload");
        }
    }
}

/// Creates the missing directories above `path` (up to `root`) and syncs
/// each parent that gained an entry, so a renamed object survives a crash.
async fn create_parents_durably(root: &Path, path: &Path) -> std::io::Result<()> {
    let mut missing = Vec::new();
    let mut dir = path.parent();
    while let Some(d) = dir {
        if d == root || tokio::fs::try_exists(d).await? {
            break;
        }
        missing.push(d.to_owned());
        dir = d.parent();
    }
    for d in missing.iter().rev() {
        match tokio::fs::create_dir(d).await {
            Ok(()) => sync_dir(d.parent().unwrap_or(root)).await?,
            // A concurrent upload created it first.
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn sync_dir(dir: &Path) -> std::io::Result<()> {
    tokio::fs::File::open(dir).await?.sync_all().await
}

/// At most this much of a refused upload is read before the refusal is sent.
const DRAIN_LIMIT: usize = 1 << 20;

/// Reads what the client is still sending (up to [`DRAIN_LIMIT`], for a few
/// seconds) before answering `refusal`: a connection closed while the
/// client sends is reset, and the client sees a send error instead of the
/// answer that says why.
async fn after_draining(body: Body, refusal: Response) -> Response {
    let drain = axum::body::to_bytes(body, DRAIN_LIMIT);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), drain).await;
    refusal
}

async fn put_object(
    State(server): State<Arc<BlobServer>>,
    UrlPath(key): UrlPath<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (key, grant) = match authorize(&server, &key, query.as_deref(), true).await {
        Ok(granted) => granted,
        Err(refusal) => return after_draining(body, refusal).await,
    };
    let Grant::Put { size, sha256 } = grant else {
        unreachable!("a PUT verification grants a PUT")
    };
    let bad_request = |message: String| {
        tracing::info!(%key, "upload refused: {message}");
        refuse(StatusCode::BAD_REQUEST, message)
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(declared) = declared
        && declared != size
    {
        let refusal = bad_request(format!(
            "Content-Length is {declared}, the URL was signed for {size} bytes"
        ));
        return after_draining(body, refusal).await;
    }

    let mut temp = TempUpload {
        path: server
            .root
            .join(TEMP_DIR)
            .join(format!("{:032x}.part", rand::random::<u128>())),
        kept: false,
    };
    let mut file = match tokio::fs::File::create(&temp.path).await {
        Ok(file) => file,
        Err(e) => return internal("create an upload file", &temp.path, e),
    };
    let mut hasher = Sha256::new();
    let mut received = 0u64;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(e) => return bad_request(format!("the upload was interrupted: {e}")),
        };
        received += chunk.len() as u64;
        if received > size {
            return bad_request(format!(
                "the upload has more than the {size} bytes the URL was signed for"
            ));
        }
        hasher.update(&chunk);
        if let Err(e) = file.write_all(&chunk).await {
            return internal("write an upload", &temp.path, e);
        }
    }
    if received != size {
        return bad_request(format!(
            "the upload has {received} bytes, the URL was signed for {size}"
        ));
    }
    let digest: [u8; 32] = hasher.finalize().into();
    if digest != sha256 {
        return bad_request(format!(
            "the upload's SHA-256 is {}, the URL was signed for {}",
            hex::encode(digest),
            hex::encode(sha256)
        ));
    }
    if let Err(e) = file.sync_all().await {
        return internal("sync an upload", &temp.path, e);
    }
    drop(file);

    let path = object_path(&server.root, &key);
    if let Err(e) = create_parents_durably(&server.root, &path).await {
        return internal("create the object's directory", &path, e);
    }
    // Replacing an existing object is safe: the new bytes are verified
    // against the same signed digest, so an identical upload is a no-op.
    if let Err(e) = tokio::fs::rename(&temp.path, &path).await {
        return internal("move an upload into place", &path, e);
    }
    temp.kept = true;
    if let Err(e) = sync_dir(path.parent().unwrap_or(&server.root)).await {
        return internal("sync the object's directory", &path, e);
    }
    tracing::debug!(%key, size, "object stored");
    StatusCode::OK.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_resolve_against_the_object_size() {
        use RangeRequest::*;
        assert_eq!(parse_range("bytes=0-9", 100), Part { first: 0, last: 9 });
        assert_eq!(
            parse_range("bytes=90-", 100),
            Part {
                first: 90,
                last: 99
            }
        );
        assert_eq!(
            parse_range("bytes=-10", 100),
            Part {
                first: 90,
                last: 99
            }
        );
        assert_eq!(parse_range("bytes=-500", 100), Part { first: 0, last: 99 });
        assert_eq!(
            parse_range("bytes=50-500", 100),
            Part {
                first: 50,
                last: 99
            }
        );
        assert_eq!(parse_range("bytes=100-", 100), Unsatisfiable);
        assert_eq!(parse_range("bytes=-0", 100), Unsatisfiable);
        assert_eq!(parse_range("bytes=0-", 0), Unsatisfiable);
    }

    #[test]
    fn unusable_range_headers_are_ignored() {
        use RangeRequest::*;
        assert_eq!(parse_range("bytes=0-1,5-6", 100), Whole);
        assert_eq!(parse_range("bytes=9-3", 100), Whole);
        assert_eq!(parse_range("items=0-3", 100), Whole);
        assert_eq!(parse_range("bytes=x-3", 100), Whole);
    }
}
