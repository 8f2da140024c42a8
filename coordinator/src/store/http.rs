//! What the provider stores share about talking to their servers: errors
//! from failed requests and refusing answers, their HTTP client, HEAD and
//! DELETE through a signed URL, paging through a listing, reading XML
//! listings, and how long a V4 signature may live.

use std::future::Future;
use std::ops::RangeInclusive;
use std::time::Duration;

use reqwest::StatusCode;

use super::{ObjectKey, ObjectMeta, ObjectStoreError, StoreConfigError, StoreOp};

/// Most bytes of an error answer read for its message.
const ERROR_BODY_LIMIT: usize = 4096;

/// A failed request's error: the server was not reached, or the answer was
/// cut (retryable).
pub(super) fn network(
    op: StoreOp,
    key: &str,
) -> impl FnOnce(reqwest::Error) -> ObjectStoreError + '_ {
    move |e| ObjectStoreError::Unavailable {
        op,
        key: key.to_owned(),
        // The URL in reqwest's message carries a signature.
        reason: cairn_utils::text::one_line(&e.without_url()),
    }
}

/// The error an unsuccessful answer means: retryable when the server is
/// overloaded or failing, refused otherwise, with the store's code and
/// message when the body has them (S3 and Azure both answer
/// `<Error><Code>…</Code><Message>…</Message></Error>`).
pub(super) async fn failure(
    op: StoreOp,
    key: &str,
    mut response: reqwest::Response,
) -> ObjectStoreError {
    let status = response.status();
    let mut body = Vec::new();
    while body.len() < ERROR_BODY_LIMIT {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            _ => break,
        }
    }
    let body = String::from_utf8_lossy(&body[..body.len().min(ERROR_BODY_LIMIT)]);
    let element = |name: &str| {
        let open = format!("<{name}>");
        let start = body.find(&open)? + open.len();
        let end = body[start..].find('<')? + start;
        Some(body[start..end].trim().to_owned())
    };
    let mut reason = format!("HTTP {status}");
    if let Some(code) = element("Code") {
        reason.push_str(": ");
        reason.push_str(&code);
    }
    if let Some(message) = element("Message") {
        reason.push_str(": ");
        reason.push_str(&message);
    }
    let key = key.to_owned();
    if status.is_server_error()
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::REQUEST_TIMEOUT
    {
        ObjectStoreError::Unavailable { op, key, reason }
    } else {
        ObjectStoreError::Refused { op, key, reason }
    }
}

/// The HTTP client a store sends its own requests with (`location` names
/// the store in the error): every request carries `default_headers`.
pub(super) fn client(
    location: &str,
    default_headers: reqwest::header::HeaderMap,
) -> Result<reqwest::Client, StoreConfigError> {
    // reqwest's rustls needs a process-wide provider; the coordinator uses
    // ring everywhere else too.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(120))
        .default_headers(default_headers)
        .build()
        .map_err(|_| StoreConfigError::BadLocation {
            location: location.to_owned(),
            reason: "the HTTP client for the store cannot be built",
        })
}

/// How long an S3 or Cloud Storage V4 signature may live.
pub(super) const V4_URL_TTL: RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(7 * 24 * 3600);

/// Refuses to sign a `store` URL for longer (or shorter) than
/// [`V4_URL_TTL`]; the start refuses such a `--url-ttl` already, this keeps
/// a caller with another lifetime from getting a URL the store would refuse.
pub(super) fn check_v4_ttl(
    store: &str,
    op: StoreOp,
    key: &ObjectKey,
    ttl: Duration,
) -> Result<(), ObjectStoreError> {
    if V4_URL_TTL.contains(&ttl) {
        return Ok(());
    }
    Err(ObjectStoreError::Refused {
        op,
        key: key.to_string(),
        reason: format!(
            "{store} signed URLs live from 1 second to 7 days, not {} (--url-ttl)",
            humantime::format_duration(ttl)
        ),
    })
}

/// The size of `key` by a HEAD of its signed `url`: `None` for 404, the
/// `Content-Length` header (not the empty body) for a success, the store's
/// refusal otherwise.
pub(super) async fn head(
    http: &reqwest::Client,
    url: url::Url,
    key: &ObjectKey,
) -> Result<Option<u64>, ObjectStoreError> {
    let op = StoreOp::Stat;
    let response = http
        .head(url)
        .send()
        .await
        .map_err(network(op, key.as_str()))?;
    match response.status() {
        StatusCode::NOT_FOUND => Ok(None),
        status if status.is_success() => response
            .headers()
            .get(reqwest::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map(Some)
            .ok_or_else(|| ObjectStoreError::Refused {
                op,
                key: key.to_string(),
                reason: "HEAD answered without a Content-Length".into(),
            }),
        _ => Err(failure(op, key.as_str(), response).await),
    }
}

/// Deletes `key` through its signed `url`: removing a missing object
/// succeeds (the stores say 2xx or 404 for it).
pub(super) async fn delete(
    http: &reqwest::Client,
    url: url::Url,
    key: &ObjectKey,
) -> Result<(), ObjectStoreError> {
    let response = http
        .delete(url)
        .send()
        .await
        .map_err(network(StoreOp::Delete, key.as_str()))?;
    if response.status().is_success() || response.status() == StatusCode::NOT_FOUND {
        Ok(())
    } else {
        Err(failure(StoreOp::Delete, key.as_str(), response).await)
    }
}

/// Every object of a paged listing under `full_prefix`: `page` fetches
/// the page a marker (or continuation token) starts, and says where the
/// next one starts. Sorted by key, each once.
pub(super) async fn list_all<F, Fut>(
    full_prefix: &str,
    mut page: F,
) -> Result<Vec<ObjectMeta>, ObjectStoreError>
where
    F: FnMut(Option<String>) -> Fut,
    Fut: Future<Output = Result<(Vec<ObjectMeta>, Option<String>), ObjectStoreError>>,
{
    let mut objects = Vec::new();
    let mut marker: Option<String> = None;
    loop {
        let (found, next) = page(marker.clone()).await?;
        objects.extend(found);
        match next {
            // A server handing the same marker back would page forever.
            Some(next) if marker.as_deref() == Some(next.as_str()) => {
                return Err(ObjectStoreError::Refused {
                    op: StoreOp::List,
                    key: full_prefix.to_owned(),
                    reason: "the listing handed the same page marker back".into(),
                });
            }
            Some(next) => marker = Some(next),
            None => break,
        }
    }
    objects.sort_by(|a, b| a.key.cmp(&b.key));
    objects.dedup_by(|a, b| a.key == b.key);
    Ok(objects)
}

/// The first child element of `node` called `name` (namespaces aside:
/// Cloud Storage's listing has one, Azure's none).
pub(super) fn child<'a, 'input>(
    node: roxmltree::Node<'a, 'input>,
    name: &str,
) -> Option<roxmltree::Node<'a, 'input>> {
    node.children()
        .find(|c| c.is_element() && c.tag_name().name() == name)
}

/// The text of `node`, empty when there is none.
pub(super) fn text(node: Option<roxmltree::Node<'_, '_>>) -> String {
    node.and_then(|n| n.text()).unwrap_or_default().to_owned()
}
