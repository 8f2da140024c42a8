//! Moving pack bytes to and from the object store through signed URLs.
//!
//! Every request is retried with exponential backoff and jitter when the
//! failure is transient (connection errors, timeouts, 5xx, 429). A 403 is not
//! retried here: the URL expired or was refused, and only the coordinator can
//! hand out a new one. `https://` URLs trust the CA in `CAIRN_CA`
//! ([`crate::tls`]). URLs are never printed whole (their query is a
//! credential); errors show the path only.
//!
//! An upload URL may come with headers its signature covers (S3 binds the
//! pack's SHA-256 in `x-amz-checksum-sha256`): the runner sends them as
//! given, whatever the store, after checking that none would change how the
//! request is framed or addressed.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use cairn_proto::tls::TlsError;
use rand::Rng;
use reqwest::StatusCode;

use crate::tls::{ClientTls, describe_chain};

/// Why a transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("the store refused {url} (403): the signed URL expired or does not match the request")]
    Forbidden { url: String },
    #[error("{url} is not in the store (404)")]
    NotFound { url: String },
    #[error("the store answered {status} for {url}: {body}")]
    Status {
        url: String,
        status: StatusCode,
        body: String,
    },
    // Described whole in the message, so not also a `source`.
    #[error("could not reach the store at {url}: {}", describe_chain(cause))]
    Network { url: String, cause: reqwest::Error },
    #[error("cannot fetch {url}: {error}")]
    Tls { url: String, error: Arc<TlsError> },
    #[error("the store sent {got} bytes for {url}, expected {expected}")]
    ShortRead {
        url: String,
        got: u64,
        expected: u64,
    },
    #[error("the upload URL {url} asks for header {name:?}, which {reason}")]
    BadHeader {
        url: String,
        name: String,
        reason: &'static str,
    },
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

impl TransferError {
    /// Whether trying again with the same URL may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Network { .. } | Self::ShortRead { .. } => true,
            Self::Status { status, .. } => {
                status.is_server_error() || *status == StatusCode::TOO_MANY_REQUESTS
            }
            Self::Forbidden { .. }
            | Self::NotFound { .. }
            | Self::BadHeader { .. }
            | Self::Io { .. }
            | Self::Tls { .. } => false,
        }
    }
}

/// How often and how patiently to retry.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub attempts: u32,
    pub first_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 6,
            first_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    fn backoff(&self, attempt: u32) -> Duration {
        let base = self
            .first_backoff
            .saturating_mul(1 << attempt.min(16))
            .min(self.max_backoff);
        // Full jitter keeps parallel uploads from retrying in lockstep.
        let millis = base.as_millis() as u64;
        Duration::from_millis(rand::rng().random_range(millis / 2..=millis.max(1)))
    }
}

/// The URL without its query string (the signature).
pub fn redact(url: &str) -> String {
    match url.split_once('?') {
        Some((path, _)) => format!("{path}?…"),
        None => url.to_owned(),
    }
}

/// Headers the transfer sets itself, or that would change how the body is
/// framed or where the request goes: a URL's headers may not name them.
const RESERVED_HEADERS: [&str; 11] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "expect",
    "proxy-authorization",
    "proxy-connection",
];

/// The headers an upload URL was signed with, checked.
fn signed_headers(
    url: &str,
    headers: &HashMap<String, String>,
) -> Result<reqwest::header::HeaderMap, TransferError> {
    use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
    let mut map = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let bad = |reason| TransferError::BadHeader {
            url: redact(url),
            name: name.clone(),
            reason,
        };
        let parsed = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| bad("is not a valid header name"))?;
        if RESERVED_HEADERS.contains(&parsed.as_str()) {
            return Err(bad("only the transfer itself sets"));
        }
        let value =
            HeaderValue::from_str(value).map_err(|_| bad("has a value that is not valid"))?;
        map.insert(parsed, value);
    }
    Ok(map)
}

/// An HTTP client for signed URLs.
#[derive(Debug, Clone)]
pub struct BlobTransfer {
    http: reqwest::Client,
    retry: RetryPolicy,
    /// Why `CAIRN_CA` could not be used: every transfer fails with it
    /// rather than trusting other roots than the ones asked for.
    tls_error: Option<Arc<TlsError>>,
}

impl Default for BlobTransfer {
    fn default() -> Self {
        Self::new(RetryPolicy::default())
    }
}

/// Installs ring as rustls' crypto provider (once per process).
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl BlobTransfer {
    /// Transfers trusting the CA in `CAIRN_CA` for `https://` URLs.
    pub fn new(retry: RetryPolicy) -> Self {
        match ClientTls::from_env() {
            Ok(tls) => Self::with_tls(retry, &tls),
            Err(e) => Self {
                tls_error: Some(Arc::new(e)),
                ..Self::with_tls(retry, &ClientTls::default())
            },
        }
    }

    /// Transfers with TLS settings of the caller's.
    pub fn with_tls(retry: RetryPolicy, tls: &ClientTls) -> Self {
        install_crypto_provider();
        let builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(32);
        let http = tls
            .configure_http(builder)
            .build()
            .expect("a client with parsed root certificates always builds");
        Self {
            http,
            retry,
            tls_error: None,
        }
    }

    async fn with_retry<T, F, Fut>(&self, url: &str, mut op: F) -> Result<T, TransferError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, TransferError>>,
    {
        if let Some(error) = &self.tls_error {
            return Err(TransferError::Tls {
                url: redact(url),
                error: error.clone(),
            });
        }
        let mut attempt = 0;
        loop {
            match op().await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_retryable() && attempt + 1 < self.retry.attempts => {
                    let wait = self.retry.backoff(attempt);
                    tracing::debug!(url = %redact(url), error = %e, ?wait, "transfer failed; retrying");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn check(
        url: &str,
        response: reqwest::Response,
    ) -> Result<reqwest::Response, TransferError> {
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let url = redact(url);
        match status {
            StatusCode::FORBIDDEN => Err(TransferError::Forbidden { url }),
            StatusCode::NOT_FOUND => Err(TransferError::NotFound { url }),
            _ => {
                let body = response.text().await.unwrap_or_default();
                Err(TransferError::Status {
                    url,
                    status,
                    body: body.chars().take(300).collect(),
                })
            }
        }
    }

    fn network(url: &str) -> impl Fn(reqwest::Error) -> TransferError + '_ {
        move |cause| TransferError::Network {
            url: redact(url),
            cause,
        }
    }

    /// Uploads `bytes` with PUT, sending the `headers` the URL was signed with.
    pub async fn put(
        &self,
        url: &str,
        headers: &HashMap<String, String>,
        bytes: Bytes,
    ) -> Result<(), TransferError> {
        let headers = signed_headers(url, headers)?;
        self.with_retry(url, || {
            let bytes = bytes.clone();
            let headers = headers.clone();
            async move {
                let response = self
                    .http
                    .put(url)
                    .headers(headers)
                    .header(reqwest::header::CONTENT_LENGTH, bytes.len())
                    .body(bytes)
                    .send()
                    .await
                    .map_err(Self::network(url))?;
                Self::check(url, response).await.map(drop)
            }
        })
        .await
    }

    /// Uploads a file with PUT, streaming it from disk, sending the
    /// `headers` the URL was signed with.
    pub async fn put_file(
        &self,
        url: &str,
        headers: &HashMap<String, String>,
        path: &Path,
    ) -> Result<(), TransferError> {
        let headers = signed_headers(url, headers)?;
        let headers = &headers;
        self.with_retry(url, || async move {
            let io = |source| TransferError::Io {
                path: path.display().to_string(),
                source,
            };
            let file = tokio::fs::File::open(path).await.map_err(io)?;
            let size = file.metadata().await.map_err(io)?.len();
            let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(
                file,
                256 << 10,
            ));
            let response = self
                .http
                .put(url)
                .headers(headers.clone())
                .header(reqwest::header::CONTENT_LENGTH, size)
                .body(body)
                .send()
                .await
                .map_err(Self::network(url))?;
            Self::check(url, response).await.map(drop)
        })
        .await
    }

    /// Downloads a whole object into a buffer from `buffers`.
    pub async fn get(&self, url: &str, buffers: &BodyBuffers) -> Result<Bytes, TransferError> {
        self.read_body(url, None, buffers).await
    }

    /// Downloads `len` bytes starting at `offset` into a buffer from `buffers`.
    pub async fn get_range(
        &self,
        url: &str,
        offset: u64,
        len: u64,
        buffers: &BodyBuffers,
    ) -> Result<Bytes, TransferError> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        self.read_body(url, Some((offset, len)), buffers).await
    }

    /// GETs `url` (the `range` of it: offset, length) and reads the body
    /// chunk by chunk into one buffer. Each chunk is copied and dropped at
    /// once, so hyper can reuse its read buffer too; collecting the chunks
    /// first and joining them would fault in a second copy of every body.
    async fn read_body(
        &self,
        url: &str,
        range: Option<(u64, u64)>,
        buffers: &BodyBuffers,
    ) -> Result<Bytes, TransferError> {
        self.with_retry(url, || async move {
            let mut request = self.http.get(url);
            if let Some((offset, len)) = range {
                let range = format!("bytes={}-{}", offset, offset + len - 1);
                request = request.header(reqwest::header::RANGE, range);
            }
            let response = request.send().await.map_err(Self::network(url))?;
            let mut response = Self::check(url, response).await?;
            let expected = range.map(|(_, len)| len);
            let hint = expected.or(response.content_length()).unwrap_or(0);
            let mut body = buffers.take(usize::try_from(hint).unwrap_or(0));
            let short = |got: usize| TransferError::ShortRead {
                url: redact(url),
                got: got as u64,
                expected: expected.unwrap_or_default(),
            };
            while let Some(chunk) = response.chunk().await.map_err(Self::network(url))? {
                body.extend_from_slice(&chunk);
                if expected.is_some_and(|len| body.len() as u64 > len) {
                    return Err(short(body.len()));
                }
            }
            if expected.is_some_and(|len| body.len() as u64 != len) {
                return Err(short(body.len()));
            }
            Ok(buffers.share(body))
        })
        .await
    }
}

/// Download buffers kept for the next download. A restore reads hundreds of
/// MiB in ranges of up to 8 MiB; a fresh allocation per range is faulted in
/// and zeroed page by page by the kernel (a third of a restore's page
/// faults, and slow where a VM's host must back each page again). A body
/// handed out as [`Bytes`] gives its buffer back when its last clone drops.
/// The buffers live as long as their owner (one restore), so an idle runner
/// keeps none.
#[derive(Debug, Clone, Default)]
pub struct BodyBuffers(Arc<Mutex<Vec<Vec<u8>>>>);

/// At most this many buffers wait for reuse (a restore has 8 reads in flight).
const KEPT_BUFFERS: usize = 16;
/// Larger buffers (whole packs) are freed rather than kept.
const KEPT_BUFFER_BYTES: usize = 16 << 20;

impl BodyBuffers {
    /// An empty buffer with room for `len` bytes, reused when one is kept.
    fn take(&self, len: usize) -> Vec<u8> {
        let reused = {
            let mut kept = self.0.lock().expect("body buffer lock");
            match kept.iter().position(|buf| buf.capacity() >= len) {
                Some(fits) => Some(kept.swap_remove(fits)),
                None => kept.pop(),
            }
        };
        let mut buf = reused.unwrap_or_default();
        buf.clear();
        buf.reserve_exact(len);
        buf
    }

    fn keep(&self, buf: Vec<u8>) {
        if buf.capacity() > KEPT_BUFFER_BYTES {
            return;
        }
        let mut kept = self.0.lock().expect("body buffer lock");
        if kept.len() < KEPT_BUFFERS {
            kept.push(buf);
        }
    }

    /// `buf` as [`Bytes`] that return it here when dropped.
    fn share(&self, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Lent {
            buf,
            home: self.clone(),
        })
    }

    /// How many buffers wait for reuse.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.0.lock().expect("body buffer lock").len()
    }
}

/// A body's buffer on loan to [`Bytes`].
struct Lent {
    buf: Vec<u8>,
    home: BodyBuffers,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.home.keep(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_s_headers_are_sent_unless_they_would_reframe_or_redirect_the_request() {
        let url = "http://h/o/x?X-Amz-Signature=secret";
        let headers = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let ok =
            signed_headers(url, &headers(&[("x-amz-checksum-sha256", "q83vEjRWeJA=")])).unwrap();
        assert_eq!(ok["x-amz-checksum-sha256"], "q83vEjRWeJA=");
        for (name, value, reason) in [
            ("content-length", "1", "only the transfer itself sets"),
            ("Host", "elsewhere", "only the transfer itself sets"),
            (
                "transfer-encoding",
                "chunked",
                "only the transfer itself sets",
            ),
            ("bad name", "x", "is not a valid header name"),
            ("x-amz-meta", "line\nbreak", "has a value that is not valid"),
        ] {
            match signed_headers(url, &headers(&[(name, value)])) {
                Err(TransferError::BadHeader {
                    url: shown,
                    reason: got,
                    ..
                }) => {
                    assert_eq!(got, reason, "{name}");
                    assert!(!shown.contains("secret"), "{shown}");
                }
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn urls_lose_their_signature_in_messages() {
        assert_eq!(
            redact("http://h/o/packs/ab?sig=secret&exp=1"),
            "http://h/o/packs/ab?…"
        );
        assert_eq!(redact("http://h/o/x"), "http://h/o/x");
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let p = RetryPolicy::default();
        assert!(p.backoff(0) <= Duration::from_millis(100));
        assert!(p.backoff(20) <= p.max_backoff);
        assert!(p.backoff(3) >= Duration::from_millis(400));
    }

    #[test]
    fn a_body_buffer_is_reused_once_its_bytes_are_dropped() {
        let buffers = BodyBuffers::default();
        let mut first = buffers.take(1 << 20);
        first.extend_from_slice(b"range one");
        let at = first.as_ptr();
        let body = buffers.share(first);
        let clone = body.slice(6..);
        drop(body);
        assert_eq!(buffers.kept(), 0, "a clone still reads the buffer");
        assert_eq!(&clone[..], b"one");
        drop(clone);
        assert_eq!(buffers.kept(), 1);
        let second = buffers.take(4096);
        assert!(second.is_empty());
        assert_eq!(
            second.as_ptr(),
            at,
            "the kept allocation is handed out again"
        );
    }

    #[test]
    fn whole_pack_sized_buffers_are_not_kept() {
        let buffers = BodyBuffers::default();
        drop(buffers.share(buffers.take(KEPT_BUFFER_BYTES + 1)));
        assert_eq!(buffers.kept(), 0);
        for _ in 0..KEPT_BUFFERS + 4 {
            drop(buffers.share(buffers.take(16)));
        }
        let held: Vec<Bytes> = (0..KEPT_BUFFERS + 4)
            .map(|_| buffers.share(buffers.take(16)))
            .collect();
        drop(held);
        assert_eq!(buffers.kept(), KEPT_BUFFERS);
    }
}
