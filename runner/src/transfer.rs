//! Moving pack bytes to and from the object store through signed URLs.
//!
//! Every request is retried with exponential backoff and jitter when the
//! failure is transient (connection errors, timeouts, 5xx, 429). A 403 is not
//! retried here: the URL expired or was refused, and only the coordinator can
//! hand out a new one. URLs are never printed whole (their query is a
//! credential); errors show the path only.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use rand::Rng;
use reqwest::StatusCode;

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
    #[error("could not reach the store at {url}: {source}")]
    Network { url: String, source: reqwest::Error },
    #[error("the store sent {got} bytes for {url}, expected {expected}")]
    ShortRead {
        url: String,
        got: u64,
        expected: u64,
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
            Self::Forbidden { .. } | Self::NotFound { .. } | Self::Io { .. } => false,
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

/// An HTTP client for signed URLs.
#[derive(Debug, Clone)]
pub struct BlobTransfer {
    http: reqwest::Client,
    retry: RetryPolicy,
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
    pub fn new(retry: RetryPolicy) -> Self {
        install_crypto_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(32)
            .build()
            .expect("a client with default TLS settings always builds");
        Self { http, retry }
    }

    async fn with_retry<T, F, Fut>(&self, url: &str, mut op: F) -> Result<T, TransferError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, TransferError>>,
    {
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
        move |source| TransferError::Network {
            url: redact(url),
            source,
        }
    }

    /// Uploads `bytes` with PUT.
    pub async fn put(&self, url: &str, bytes: Bytes) -> Result<(), TransferError> {
        self.with_retry(url, || {
            let bytes = bytes.clone();
            async move {
                let response = self
                    .http
                    .put(url)
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

    /// Uploads a file with PUT, streaming it from disk.
    pub async fn put_file(&self, url: &str, path: &Path) -> Result<(), TransferError> {
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
                .header(reqwest::header::CONTENT_LENGTH, size)
                .body(body)
                .send()
                .await
                .map_err(Self::network(url))?;
            Self::check(url, response).await.map(drop)
        })
        .await
    }

    /// Downloads a whole object.
    pub async fn get(&self, url: &str) -> Result<Bytes, TransferError> {
        self.with_retry(url, || async move {
            let response = self
                .http
                .get(url)
                .send()
                .await
                .map_err(Self::network(url))?;
            let response = Self::check(url, response).await?;
            response.bytes().await.map_err(Self::network(url))
        })
        .await
    }

    /// Downloads `len` bytes starting at `offset`.
    pub async fn get_range(
        &self,
        url: &str,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, TransferError> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        self.with_retry(url, || async move {
            let response = self
                .http
                .get(url)
                .header(
                    reqwest::header::RANGE,
                    format!("bytes={}-{}", offset, offset + len - 1),
                )
                .send()
                .await
                .map_err(Self::network(url))?;
            let response = Self::check(url, response).await?;
            let bytes = response.bytes().await.map_err(Self::network(url))?;
            if bytes.len() as u64 != len {
                return Err(TransferError::ShortRead {
                    url: redact(url),
                    got: bytes.len() as u64,
                    expected: len,
                });
            }
            Ok(bytes)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
