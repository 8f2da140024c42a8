//! A Google Cloud Storage bucket as the object store.
//!
//! URLs are V4 signed URLs (`GOOG4-RSA-SHA256`) signed with a service
//! account's RSA key, on the XML API (`https://storage.googleapis.com/
//! BUCKET/OBJECT`). The coordinator's own requests (HEAD, DELETE, and
//! listing the bucket, paged by marker) go out through the same kind of
//! URL, signed for a minute. The bytes of checkpoints never pass here.
//!
//! What an upload URL binds (`docs/object-stores.md`): method, bucket and
//! object, expiry, and `content-length` (a signed header: a body of
//! another size fails the signature). Not the SHA-256: Cloud Storage checks
//! only MD5 and CRC32C, which the coordinator does not know. Not the
//! holder: the TTL bounds the URL.

use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use jiff::Timestamp;
use ring::rand::SystemRandom;
use ring::signature::{RSA_PKCS1_SHA256, RsaKeyPair};
use sha2::{Digest, Sha256};
use url::Url;

use super::http::{check_v4_ttl, child, client, delete, failure, head, list_all, network, text};
use super::location::StoreConfigError;
use super::{
    ObjectKey, ObjectMeta, ObjectStore, ObjectStoreError, PresignedUrl, StoreFuture, StoreOp,
};
use crate::tokens::RunBinding;

/// Cloud Storage's XML API.
pub const DEFAULT_ENDPOINT: &str = "https://storage.googleapis.com";

const REQUEST_TTL: Duration = Duration::from_secs(60);

/// Keys per listing page (the XML API's maximum).
pub const LIST_PAGE_SIZE: usize = 1000;

/// A service account's signing key and its e-mail (the credential V4
/// signatures name). `Debug` shows the e-mail only.
#[derive(Clone)]
pub struct ServiceAccount {
    pub client_email: String,
    key: std::sync::Arc<RsaKeyPair>,
}

impl fmt::Debug for ServiceAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceAccount")
            .field("client_email", &self.client_email)
            .finish_non_exhaustive()
    }
}

impl ServiceAccount {
    /// A service account key file's JSON (`type`, `client_email`,
    /// `private_key` as PKCS#8 PEM); the reason it cannot be used otherwise.
    pub fn from_json(json: &str) -> Result<Self, String> {
        let value: serde_json::Value =
            serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
        let field = |name: &str| {
            value
                .get(name)
                .and_then(|v| v.as_str())
                .ok_or_else(|| format!("has no {name:?}"))
        };
        let kind = field("type")?;
        if kind != "service_account" {
            return Err(format!(
                "is a {kind:?} credential; signed URLs need a service account key"
            ));
        }
        let client_email = field("client_email")?.to_owned();
        let pem = field("private_key")?;
        let body: String = pem
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with("-----"))
            .collect();
        if !pem.contains("-----BEGIN PRIVATE KEY-----") {
            return Err("has a private_key that is not a PKCS#8 PEM key".into());
        }
        use base64::Engine as _;
        let der = base64::engine::general_purpose::STANDARD
            .decode(body)
            .map_err(|_| "has a private_key whose PEM body is not base64".to_owned())?;
        let key = RsaKeyPair::from_pkcs8(&der)
            .map_err(|e| format!("has a private_key that is not a usable RSA key: {e}"))?;
        Ok(Self {
            client_email,
            key: std::sync::Arc::new(key),
        })
    }
}

/// Where the bucket is and how to sign for it.
#[derive(Debug, Clone)]
pub struct GcsConfig {
    pub bucket: String,
    /// Empty, or `/`-separated segments with no trailing `/`.
    pub prefix: String,
    pub account: ServiceAccount,
    /// [`DEFAULT_ENDPOINT`], or `STORAGE_EMULATOR_HOST`.
    pub endpoint: Url,
    pub list_page_size: usize,
}

impl fmt::Display for GcsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gs://{}", self.bucket)?;
        if !self.prefix.is_empty() {
            write!(f, "/{}", self.prefix)?;
        }
        write!(
            f,
            " at {} (as {})",
            self.endpoint, self.account.client_email
        )
    }
}

impl GcsConfig {
    /// The bucket's configuration from the variables `var` answers:
    /// `GOOGLE_APPLICATION_CREDENTIALS` (the path of a service account key
    /// file, read now) and `STORAGE_EMULATOR_HOST` (another endpoint, as
    /// Google's client libraries take it; `http://` allowed, it is meant
    /// for emulators).
    pub fn from_vars(
        bucket: &str,
        prefix: &str,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, StoreConfigError> {
        let var = |name: &str| var(name).filter(|value| !value.trim().is_empty());
        const VAR: &str = "GOOGLE_APPLICATION_CREDENTIALS";
        let path = var(VAR).ok_or(StoreConfigError::MissingVar {
            var: VAR,
            why: "the coordinator signs Cloud Storage URLs with a service account key file (metadata-server and user credentials are not read)",
        })?;
        let bad = |reason: String| StoreConfigError::BadVar {
            var: VAR,
            value: path.clone(),
            reason,
        };
        let json = std::fs::read_to_string(PathBuf::from(&path))
            .map_err(|e| bad(format!("cannot be read: {e}")))?;
        let account =
            ServiceAccount::from_json(&json).map_err(|reason| bad(format!("the file {reason}")))?;
        let endpoint = match var("STORAGE_EMULATOR_HOST") {
            Some(value) => {
                super::location::endpoint_url("STORAGE_EMULATOR_HOST", &value, true, "")?
            }
            None => Url::parse(DEFAULT_ENDPOINT).expect("a valid URL"),
        };
        Ok(Self {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
            account,
            endpoint,
            list_page_size: LIST_PAGE_SIZE,
        })
    }
}

/// RFC 3986 percent-encoding of everything but unreserved characters (and
/// `/` in paths), as V4 signing canonicalizes.
fn encode(text: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(byte as char)
            }
            b'/' if keep_slash => out.push('/'),
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

/// Objects in a Cloud Storage bucket under a prefix.
#[derive(Debug, Clone)]
pub struct GcsStore {
    bucket: String,
    account: ServiceAccount,
    /// Empty, or the location's prefix with a trailing `/`.
    prefix: String,
    endpoint: Url,
    list_page_size: usize,
    http: reqwest::Client,
    rng: SystemRandom,
}

impl GcsStore {
    pub fn new(config: GcsConfig) -> Result<Self, StoreConfigError> {
        let http = client(&config.to_string(), reqwest::header::HeaderMap::new())?;
        let prefix = if config.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", config.prefix.trim_end_matches('/'))
        };
        Ok(Self {
            bucket: config.bucket,
            account: config.account,
            prefix,
            endpoint: config.endpoint,
            list_page_size: config.list_page_size.clamp(1, LIST_PAGE_SIZE),
            http,
            rng: SystemRandom::new(),
        })
    }

    fn object_name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// A V4 signed URL ("V4 signing process" of Cloud Storage): `object`
    /// of the bucket (or the bucket itself), with `query` (the operation's
    /// own parameters) and `headers` (lowercase names, which the request
    /// must carry as given) signed, as if at `now`.
    fn sign(
        &self,
        method: &str,
        object: Option<&str>,
        query: &[(&str, &str)],
        headers: &[(&str, &str)],
        ttl: Duration,
        now: &Timestamp,
    ) -> Url {
        let mut path = format!("/{}", encode(&self.bucket, false));
        if let Some(object) = object {
            path.push('/');
            path.push_str(&encode(object, true));
        }
        let host = match (self.endpoint.host_str(), self.endpoint.port()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (Some(host), None) => host.to_owned(),
            (None, _) => unreachable!("endpoints are checked to have a host"),
        };
        let mut headers: Vec<(String, String)> = headers
            .iter()
            .map(|(name, value)| {
                // Values trimmed and inner runs of spaces collapsed.
                let value = value.split_whitespace().collect::<Vec<_>>().join(" ");
                (name.to_ascii_lowercase(), value)
            })
            .chain([("host".to_owned(), host)])
            .collect();
        headers.sort();
        let signed_headers = headers
            .iter()
            .map(|(name, _)| name.as_str())
            .collect::<Vec<_>>()
            .join(";");
        let date = now.strftime("%Y%m%d").to_string();
        let datetime = now.strftime("%Y%m%dT%H%M%SZ").to_string();
        let scope = format!("{date}/auto/storage/goog4_request");
        let credential = format!("{}/{scope}", self.account.client_email);
        let expires = ttl.as_secs().to_string();
        let mut params: Vec<(String, String)> = [
            ("X-Goog-Algorithm", "GOOG4-RSA-SHA256"),
            ("X-Goog-Credential", credential.as_str()),
            ("X-Goog-Date", datetime.as_str()),
            ("X-Goog-Expires", expires.as_str()),
            ("X-Goog-SignedHeaders", signed_headers.as_str()),
        ]
        .iter()
        .chain(query)
        .map(|(name, value)| (encode(name, false), encode(value, false)))
        .collect();
        params.sort();
        let canonical_query = params
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect::<Vec<_>>()
            .join("&");
        let canonical_headers: String = headers
            .iter()
            .map(|(name, value)| format!("{name}:{value}\n"))
            .collect();
        let canonical_request = format!(
            "{method}\n{path}\n{canonical_query}\n{canonical_headers}\n{signed_headers}\nUNSIGNED-PAYLOAD"
        );
        let string_to_sign = format!(
            "GOOG4-RSA-SHA256\n{datetime}\n{scope}\n{}",
            hex::encode(Sha256::digest(canonical_request.as_bytes()))
        );
        let mut signature = vec![0; self.account.key.public().modulus_len()];
        self.account
            .key
            .sign(
                &RSA_PKCS1_SHA256,
                &self.rng,
                string_to_sign.as_bytes(),
                &mut signature,
            )
            .expect("an RSA key signs any message with a buffer of its modulus length");
        let mut url = self.endpoint.clone();
        let base = url.path().trim_end_matches('/').to_owned();
        url.set_path(&format!("{base}{path}"));
        url.set_query(Some(&format!(
            "{canonical_query}&X-Goog-Signature={}",
            hex::encode(signature)
        )));
        url
    }

    fn presigned(url: Url, method: &'static str, now: &Timestamp, ttl: Duration) -> PresignedUrl {
        PresignedUrl {
            url: url.into(),
            method,
            expires_at: SystemTime::from(*now) + Duration::from_secs(ttl.as_secs()),
            // Content-Length is signed, and the runner sends it anyway.
            headers: Vec::new(),
        }
    }

    /// One listing page: the objects on it and the marker of the next.
    async fn list_page(
        &self,
        full_prefix: &str,
        marker: Option<&str>,
    ) -> Result<(Vec<ObjectMeta>, Option<String>), ObjectStoreError> {
        let op = StoreOp::List;
        let page_size = self.list_page_size.to_string();
        let mut query = vec![("prefix", full_prefix), ("max-keys", page_size.as_str())];
        if let Some(marker) = marker {
            query.push(("marker", marker));
        }
        let url = self.sign("GET", None, &query, &[], REQUEST_TTL, &Timestamp::now());
        let response = self
            .http
            .get(url)
            .send()
            .await
            .map_err(network(op, full_prefix))?;
        if !response.status().is_success() {
            return Err(failure(op, full_prefix, response).await);
        }
        let body = response.text().await.map_err(network(op, full_prefix))?;
        parse_listing(&body, &self.prefix).map_err(|reason| ObjectStoreError::Refused {
            op,
            key: full_prefix.to_owned(),
            reason,
        })
    }
}

/// An XML API listing (`ListBucketResult`): the objects under `prefix` that
/// are keys of ours, and where the next page starts (`NextMarker`, or the
/// last key when a truncated page names none).
fn parse_listing(body: &str, prefix: &str) -> Result<(Vec<ObjectMeta>, Option<String>), String> {
    let document = roxmltree::Document::parse(body)
        .map_err(|e| format!("a listing that does not parse: {e}"))?;
    let root = document.root_element();
    let mut objects = Vec::new();
    let mut last = None;
    for entry in root
        .children()
        .filter(|c| c.is_element() && c.tag_name().name() == "Contents")
    {
        let name = text(child(entry, "Key"));
        last = Some(name.clone());
        let Some(key) = name.strip_prefix(prefix) else {
            continue;
        };
        let Ok(key) = ObjectKey::new(key) else {
            continue;
        };
        let size = text(child(entry, "Size"))
            .parse::<u64>()
            .map_err(|_| format!("the listing gives {key} no size"))?;
        let modified = text(child(entry, "LastModified"));
        let modified = modified
            .parse::<Timestamp>()
            .map_err(|e| format!("the modified time of {key} does not parse: {e}"))?;
        objects.push(ObjectMeta {
            key,
            size,
            modified: SystemTime::from(modified),
        });
    }
    let truncated = text(child(root, "IsTruncated")) == "true";
    let next = text(child(root, "NextMarker"));
    let next = match (truncated, next.is_empty()) {
        (false, _) => None,
        (true, false) => Some(next),
        (true, true) => Some(last.ok_or("a truncated listing with no object in it")?),
    };
    Ok((objects, next))
}

impl ObjectStore for GcsStore {
    fn stat<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, Option<u64>> {
        Box::pin(async move {
            let name = self.object_name(key.as_str());
            let url = self.sign(
                "HEAD",
                Some(&name),
                &[],
                &[],
                REQUEST_TTL,
                &Timestamp::now(),
            );
            head(&self.http, url, key).await
        })
    }

    fn delete<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let name = self.object_name(key.as_str());
            let url = self.sign(
                "DELETE",
                Some(&name),
                &[],
                &[],
                REQUEST_TTL,
                &Timestamp::now(),
            );
            delete(&self.http, url, key).await
        })
    }

    fn list<'a>(&'a self, prefix: &'a str) -> StoreFuture<'a, Vec<ObjectMeta>> {
        Box::pin(async move {
            let full_prefix = self.object_name(prefix);
            list_all(&full_prefix, |marker| {
                let full_prefix = &full_prefix;
                async move { self.list_page(full_prefix, marker.as_deref()).await }
            })
            .await
        })
    }

    fn presign_put<'a>(
        &'a self,
        key: &'a ObjectKey,
        size: u64,
        // Cloud Storage verifies only MD5 and CRC32C: see the module doc.
        _sha256: [u8; 32],
        ttl: Duration,
        _holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        Box::pin(async move {
            check_v4_ttl("Cloud Storage", StoreOp::PresignPut, key, ttl)?;
            let now = Timestamp::now();
            let name = self.object_name(key.as_str());
            let size = size.to_string();
            let url = self.sign(
                "PUT",
                Some(&name),
                &[],
                &[("content-length", &size)],
                ttl,
                &now,
            );
            Ok(Self::presigned(url, "PUT", &now, ttl))
        })
    }

    fn presign_get<'a>(
        &'a self,
        key: &'a ObjectKey,
        ttl: Duration,
        _holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        Box::pin(async move {
            check_v4_ttl("Cloud Storage", StoreOp::PresignGet, key, ttl)?;
            let now = Timestamp::now();
            let name = self.object_name(key.as_str());
            let url = self.sign("GET", Some(&name), &[], &[], ttl, &now);
            Ok(Self::presigned(url, "GET", &now, ttl))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inactive service account of Google's signing conformance tests
    /// (googleapis/conformance-tests, storage/v1/service-account: "a dummy
    /// service account JSON file that is inactive").
    const CONFORMANCE_KEY: &str = "-----BEGIN PRIVATE KEY-----
MIIEvAIBADANBgkqhkiG9w0BAQEFAASCBKYwggSiAgEAAoIBAQCsPzMirIottfQ2
ryjQmPWocSEeGo7f7Q4/tMQXHlXFzo93AGgU2t+clEj9L5loNhLVq+vk+qmnyDz5
Q04y8jVWyMYzzGNNrGRW/yaYqnqlKZCy1O3bmnNjV7EDbC/jE1ZLBY0U3HaSHfn6
S9ND8MXdgD0/ulRTWwq6vU8/w6i5tYsU7n2LLlQTl1fQ7/emO9nYcCFJezHZVa0H
meWsdHwWsok0skwQYQNIzP3JF9BpR5gJT2gNge6KopDesJeLoLzaX7cUnDn+CAnn
LuLDwwSsIVKyVxhBFsFXPplgpaQRwmGzwEbf/Xpt9qo26w2UMgn30jsOaKlSeAX8
cS6ViF+tAgMBAAECggEACKRuJCP8leEOhQziUx8Nmls8wmYqO4WJJLyk5xUMUC22
SI4CauN1e0V8aQmxnIc0CDkFT7qc9xBmsMoF+yvobbeKrFApvlyzNyM7tEa/exh8
DGD/IzjbZ8VfWhDcUTwn5QE9DCoon9m1sG+MBNlokB3OVOt8LieAAREdEBG43kJu
yQTOkY9BGR2AY1FnAl2VZ/jhNDyrme3tp1sW1BJrawzR7Ujo8DzlVcS2geKA9at7
55ua5GbHz3hfzFgjVXDfnkWzId6aHypUyqHrSn1SqGEbyXTaleKTc6Pgv0PgkJjG
hZazWWdSuf1T5Xbs0OhAK9qraoAzT6cXXvMEvvPt6QKBgQDXcZKqJAOnGEU4b9+v
Odoh+nssdrIOBNMu1m8mYbUVYS1aakc1iDGIIWNM3qAwbG+yNEIi2xi80a2RMw2T
9RyCNB7yqCXXVKLBiwg9FbKMai6Vpk2bWIrzahM9on7AhCax/X2AeOp+UyYhFEy6
UFG4aHb8THscL7b515ukSuKb5QKBgQDMq+9PuaB0eHsrmL6q4vHNi3MLgijGg/zu
AXaPygSYAwYW8KglcuLZPvWrL6OG0+CrfmaWTLsyIZO4Uhdj7MLvX6yK7IMnagvk
L3xjgxSklEHJAwi5wFeJ8ai/1MIuCn8p2re3CbwISKpvf7Sgs/W4196P4vKvTiAz
jcTiSYFIKQKBgCjMpkS4O0TakMlGTmsFnqyOneLmu4NyIHgfPb9cA4n/9DHKLKAT
oaWxBPgatOVWs7RgtyGYsk+XubHkpC6f3X0+15mGhFwJ+CSE6tN+l2iF9zp52vqP
Qwkjzm7+pdhZbmaIpcq9m1K+9lqPWJRz/3XXuqi+5xWIZ7NaxGvRjqaNAoGAdK2b
utZ2y48XoI3uPFsuP+A8kJX+CtWZrlE1NtmS7tnicdd19AtfmTuUL6fz0FwfW4Su
lQZfPT/5B339CaEiq/Xd1kDor+J7rvUHM2+5p+1A54gMRGCLRv92FQ4EON0RC1o9
m2I4SHysdO3XmjmdXmfp4BsgAKJIJzutvtbqlakCgYB+Cb10z37NJJ+WgjDt+yT2
yUNH17EAYgWXryfRgTyi2POHuJitd64Xzuy6oBVs3wVveYFM6PIKXlj8/DahYX5I
R2WIzoCNLL3bEZ+nC6Jofpb4kspoAeRporj29SgesK6QBYWHWX2H645RkRGYGpDo
51gjy9m/hSNqBbH2zmh04A==
-----END PRIVATE KEY-----
";
    const CONFORMANCE_EMAIL: &str = "test-iam-credentials@dummy-project-id.iam.gserviceaccount.com";

    fn key_file() -> String {
        serde_json::json!({
            "type": "service_account",
            "client_email": CONFORMANCE_EMAIL,
            "private_key": CONFORMANCE_KEY,
        })
        .to_string()
    }

    fn store(bucket: &str, prefix: &str) -> GcsStore {
        GcsStore::new(GcsConfig {
            bucket: bucket.into(),
            prefix: prefix.into(),
            account: ServiceAccount::from_json(&key_file()).unwrap(),
            endpoint: Url::parse(DEFAULT_ENDPOINT).unwrap(),
            list_page_size: LIST_PAGE_SIZE,
        })
        .unwrap()
    }

    fn at_conformance_time() -> Timestamp {
        "2019-02-01T09:00:00Z".parse().unwrap()
    }

    /// A case of Google's V4 signing conformance tests
    /// (googleapis/conformance-tests, storage/v1/v4_signatures.json).
    struct Case {
        description: &'static str,
        method: &'static str,
        bucket: &'static str,
        object: Option<&'static str>,
        query: &'static [(&'static str, &'static str)],
        headers: &'static [(&'static str, &'static str)],
        expiration: u64,
        timestamp: &'static str,
        endpoint: &'static str,
        expected: &'static str,
    }

    /// The cases of that file for path-style URLs on an endpoint, each
    /// expected URL whole (signature included), copied as it is there.
    /// Left out besides other URL styles: "Simple GET with non-default
    /// hostname", which signs `host:localhost` for a request to
    /// `localhost:8080`, though the Host header sent carries the port.
    const CONFORMANCE: &[Case] = &[
        Case {
            description: "Simple GET",
            method: "GET",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[],
            headers: &[],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=host&X-Goog-Signature=95e6a13d43a1d1962e667f17397f2b80ac9bdd1669210d5e08e0135df9dff4e56113485dbe429ca2266487b9d1796ebdee2d7cf682a6ef3bb9fbb4c351686fba90d7b621cf1c4eb1fdf126460dd25fa0837dfdde0a9fd98662ce60844c458448fb2b352c203d9969cb74efa4bdb742287744a4f2308afa4af0e0773f55e32e92973619249214b97283b2daa14195244444e33f938138d1e5f561088ce8011f4986dda33a556412594db7c12fc40e1ff3f1bedeb7a42f5bcda0b9567f17f65855f65071fabb88ea12371877f3f77f10e1466fff6ff6973b74a933322ff0949ce357e20abe96c3dd5cfab42c9c83e740a4d32b9e11e146f0eb3404d2e975896f74",
        },
        Case {
            description: "Simple PUT",
            method: "PUT",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[],
            headers: &[],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=host&X-Goog-Signature=8adff1d4285739e31aa68e73767a46bc5511fde377497dbe08481bf5ceb34e29cc9a59921748d8ec3dd4085b7e9b7772a952afedfcdaecb3ae8352275b8b7c867f204e3db85076220a3127a8a9589302fc1181eae13b9b7fe41109ec8cdc93c1e8bac2d7a0cc32a109ca02d06957211326563ab3d3e678a0ba296e298b5fc5e14593c99d444c94724cc4be97015dbff1dca377b508fa0cb7169195de98d0e4ac96c42b918d28c8d92d33e1bd125ce0fb3cd7ad2c45dae65c22628378f6584971b8bf3945b26f2611eb651e9b6a8648970c1ecf386bb71327b082e7296c4e1ee2fc0bdd8983da80af375c817fb1ad491d0bc22c0f51dba0d66e2cffbc90803e47",
        },
        Case {
            description: "POST for resumable uploads",
            method: "POST",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[],
            headers: &[("X-Goog-Resumable", "start")],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=host%3Bx-goog-resumable&X-Goog-Signature=4a6d39b23343cedf4c30782aed4b384001828c79ffa3a080a481ea01a640dea0a0ceb58d67a12cef3b243c3f036bb3799c6ee88e8db3eaf7d0bdd4b70a228d0736e07eaa1ee076aff5c6ce09dff1f1f03a0d8ead0d2893408dd3604fdabff553aa6d7af2da67cdba6790006a70240f96717b98f1a6ccb24f00940749599be7ef72aaa5358db63ddd54b2de9e2d6d6a586eac4fe25f36d86fc6ab150418e9c6fa01b732cded226c6d62fc95b72473a4cc55a8257482583fe66d9ab6ede909eb41516a8690946c3e87b0f2052eb0e97e012a14b2f721c42e6e19b8a1cd5658ea36264f10b9b1ada66b8ed5bf7ed7d1708377ac6e5fe608ae361fb594d2e5b24c54",
        },
        Case {
            description: "Vary expiration and timestamp",
            method: "GET",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[],
            headers: &[],
            expiration: 20,
            timestamp: "2019-03-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190301%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190301T090000Z&X-Goog-Expires=20&X-Goog-SignedHeaders=host&X-Goog-Signature=9669ed5b10664dc594c758296580662912cf4bcc5a4ba0b6bf055bcbf6f34eed7bdad664f534962174a924741a0c273a4f67bc1847cef20192a6beab44223bd9d4fbbd749c407b79997598c30f82ddc269ff47ec09fa3afe74e00616d438df0d96a7d8ad0adacfad1dc3286f864d924fe919fb0dce45d3d975c5afe8e13af2db9cc37ba77835f92f7669b61e94c6d562196c1274529e76cfff1564cc2cad7d5387dc8e12f7a5dfd925685fe92c30b43709eee29fa2f66067472cee5423d1a3a4182fe8cea75c9329d181dc6acad7c393cd04f8bf5bc0515127d8ebd65d80c08e19ad03316053ea60033fd1b1fd85a69c576415da3bf0a3718d9ea6d03e0d66f0",
        },
        Case {
            description: "Vary bucket and object",
            method: "GET",
            bucket: "test-bucket2",
            object: Some("test-object2"),
            query: &[],
            headers: &[],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket2/test-object2?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=host&X-Goog-Signature=36e3d58dfd3ec1d2dd2f24b5ee372a71e811ffaa2162a2b871d26728d0354270bc116face87127532969c4a3967ed05b7309af741e19c7202f3167aa8c2ac420b61417d6451442bb91d7c822cd17be8783f01e05372769c88913561d27e6660dd8259f0081a71f831be6c50283626cbf04494ac10c394b29bb3bce74ab91548f58a37118a452693cf0483d77561fc9cac8f1765d2c724994cca46a83517a10157ee0347a233a2aaeae6e6ab5e204ff8fc5f54f90a3efdb8301d9fff5475d58cd05b181affd657f48203f4fb133c3a3d355b8eefbd10d5a0a5fd70d06e9515460ad74e22334b2cba4b29cae4f6f285cdb92d8f3126d7a1479ca3bdb69c207d860",
        },
        Case {
            description: "Slashes in object name should not be URL encoded",
            method: "GET",
            bucket: "test-bucket",
            object: Some("path/with/slashes/under_score/amper&sand/file.ext"),
            query: &[],
            headers: &[("header/name/with/slash", "should-be-encoded")],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/path/with/slashes/under_score/amper%26sand/file.ext?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=header%2Fname%2Fwith%2Fslash%3Bhost&X-Goog-Signature=2a9a82e84e39f5d2c0d980514db17f8c3dece473c9a5743d54e8453f9811927b1b99ce548c534cababd8fa339183e75b410e12e32a4c72f5ff176e95651fabed0072e59e7e236eb7e26f52c0ce599db1c47ae07af1a98d20872b6fde23432c0a5fcf4fb2dda735169198c80cd5cc51be9904f7e5eef2cc489ff44ac5697c529e4b34ac08709a7d2e425619377212c64561ed8b4d2fcb70a26e4f9236f995ab4658d240ac85c7a353bae6b2d39d5fc0716afa435a1f6e100db5504612b5e610db370623ab4b8eba3c03c98f23dcb4b9ffd518f2212abb2f93649d25385d71603d470cff0b7631adb9d0849d38609dedb3097761c8f47ec0d57777bb063611c05b",
        },
        Case {
            description: "Simple headers",
            method: "GET",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[],
            headers: &[("BAR", "BAR-value"), ("foo", "foo-value")],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=bar%3Bfoo%3Bhost&X-Goog-Signature=68ecd3b008328ed30d91e2fe37444ed7b9b03f28ed4424555b5161980531ef87db1c3a5bc0265aad5640af30f96014c94fb2dba7479c41bfe1c020eb90c0c6d387d4dd09d4a5df8b60ea50eb6b01cdd786a1e37020f5f95eb8f9b6cd3f65a1f8a8a65c9fcb61ea662959efd9cd73b683f8d8804ef4d6d9b2852419b013368842731359d7f9e6d1139032ceca75d5e67cee5fd0192ea2125e5f2955d38d3d50cf116f3a52e6a62de77f6207f5b95aaa1d7d0f8a46de89ea72e7ea30f21286318d7eba0142232b0deb3a1dc9e1e812a981c66b5ffda3c6b01a8a9d113155792309fd53a3acfd054ca7776e8eec28c26480cd1e3c812f67f91d14217f39a606669d",
        },
        Case {
            description: "Headers with colons",
            method: "GET",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[],
            headers: &[("BAR", "2023-02-10T03:"), ("foo", "2023-02-10T02:00:00Z")],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=bar%3Bfoo%3Bhost&X-Goog-Signature=30b831c18b5cdef6dceaa476a395a28d80002ad70b4419af8fd63eaad02c2fbb4b4829b3a4e33e7796a9ce92735498dfc20e0fbc177172f7c8ab6a07736512c7c923ef2f28a2e72d727fd61ca89495c9e62d51b93a2f7061451240c909ed8d05a7bcf616c1ad90fa5cdbc27c4724dec6b29db04129b32402db4ddf7b5b554724481bfdbf41cb24c3c6b9e33bb411c864077d6a19a750a90eb5ad9370d2b171df2813c9a864b40b2ee215ae9790d7916155de863708aa5121bca42e4695def5322f3726f8e1a7ec56da7a1a4f6b959253513a10f7edf6594c02340021b8cc709b0177ec6bb127fc2fb705f508bde045ed94603471c19c1c6af165f559a3c4741b",
        },
        Case {
            description: "Headers should be trimmed",
            method: "GET",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[],
            headers: &[
                ("collapsed", "abc    def"),
                ("leading", "    xyz"),
                ("trailing", "abc    "),
                ("tabs", "\tabc\t\t\t\tdef\t"),
            ],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=collapsed%3Bhost%3Bleading%3Btabs%3Btrailing&X-Goog-Signature=75d77a3ed2d9b74ff7e1e23b2fd7cc714ad4cc32518c65f3a8197827cd87d302623bab990cf2ff3a633bfaae69b6c2d897add78c105aa68411229610421c4239579add4aff6bdbd5067a0fd61c3aa0029d7de0f8ae88fa3458fa70f875e841d6df9598597d9012b9f848c6857e08f2704ca2f332c71738490ffdda2ed928f9340549d7295745725062d28dc1696eab7cb3b88ac4fd445e951423f645d680a60dd8033d65b65f4c10286f59f4258dbb2bcf36a76ffdd40574104cbbf0b76901c24df5854f24c42e9192fcedc386d85704fec6a6bad3a5201e1fb6c491a4c43371b0913420743580daf3504e99204c6ec894b4d70cd27bc60c3fe2850e8bf3ed22",
        },
        Case {
            description: "Header value with multiple inline values",
            method: "GET",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[],
            headers: &[("multiple", " xyz ,  abc, def  , xyz   ")],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=host%3Bmultiple&X-Goog-Signature=5cc113735625341f59c7203f0c2c9febc95ba6af6b9c38814f8e523214712087dc0996e4960d273ae1889f248ac1e58d4d19cb3a69ad7670e9a8ca1b434e878f59339dc7006cf32dfd715337e9f593e0504371839174962a08294586e0c78160a7aa303397888c8350637c6af3b32ac310886cc4590bfda9ca561ee58fb5b8ec56bc606d2ada6e7df31f4276e9dcb96bcaea39dc2cd096f3fad774f9c4b30e317ad43736c05f76831437f44e8726c1e90d3f6c9827dc273f211f32fc85658dfc5d357eb606743a6b00a29e519eef1bebaf9db3e8f4b1f5f9afb648ad06e60bc42fa8b57025056697c874c9ea76f5a73201c9717ea43e54713ff3502ff3fc626b",
        },
        Case {
            description: "Customer-supplied encryption key",
            method: "GET",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[],
            headers: &[
                ("X-Goog-Encryption-Algorithm", "AES256"),
                ("X-Goog-Encryption-Key", "key"),
                ("X-Goog-Encryption-Key-Sha256", "key-hash"),
            ],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=host%3Bx-goog-encryption-algorithm%3Bx-goog-encryption-key%3Bx-goog-encryption-key-sha256&X-Goog-Signature=278a1c5a3bad248637054a047014760353942433955871031ed08f515b54588654ad033e91f046ab202b68673030e117d1b786c325e870238b035ba75b3feed560a17aff9bab6bddebd4a31a52cb68b214e27d3b0bd886502c6b36b164306fe88b5a07c6063592afe746b2a5d205dbe90dd5386b94f0a78f75d9f53ee884e18f476e8fc2eb1dd910ce0b4ae1f5d7b09876ef9bf983f539c028429e14bad3c75dbd4ed1ae37856f6d6f8a1805eaf8b52a0d6fc993902e4c1ee8de477661f7b67c3663000474cb00e178189789b2a3ed6bd21b4ade684fca8108ac4dd106acb17f5954d045775f7aa5a98ebda5d3075e11a8ea49c64c6ad1481e463e8c9f11f704",
        },
        Case {
            description: "List Objects",
            method: "GET",
            bucket: "test-bucket",
            object: None,
            query: &[],
            headers: &[],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=host&X-Goog-Signature=6dbe94f8e52b2b8a9a476b1c857efa474e09944e2b52b925800316e094a7169d8dbe0df9c0ac08dabb22ac7e827470ceccd65f5a3eadba2a4fb9beebfe37f0d9bb1e552b851fa31a25045bdf019e507f5feb44f061551ef1aeb18dcec0e38ba2e2f77d560a46eaace9c56ed9aa642281301a9d848b0eb30749e34bc7f73a3d596240533466ff9b5f289cd0d4c845c7d96b82a35a5abd0c3aff83e4440ee6873e796087f43545544dc8c01afe1d79c726696b6f555371e491980e7ec145cca0803cf562c38f3fa1d724242f5dea25aac91d74ec9ddd739ff65523627763eaef25cd1f95ad985aaf0079b7c74eb5bcb2870a9b137a7b2c8e41fbe838c95872f75b",
        },
        Case {
            description: "Query Parameter Encoding",
            method: "GET",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[("aA0é/=%-_.~", "~ ._-%=/é0Aa")],
            headers: &[],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=host&aA0%C3%A9%2F%3D%25-_.~=~%20._-%25%3D%2F%C3%A90Aa&X-Goog-Signature=0e4f289c28626a32af95d78f5a0d2c75e5f0bef1cfe5035a532a8185e3ad45b1d5e8ad5ae0fb1898420e40a1576479861c6579db7e3b28ef8386160995ac1374be85e780ac3dfcc62538e9b2e2c51555950fb6fd0d7ecc509d3ccd9c02af5a6c6eb930d21a7383792300eb50a093a597c1da2a290ed56b01844251f8271d0d5e61fc3f4273a0c26f80e061c06124d93346ea1c50388e3fe73494c05ac27a54caedc04d1476c276c7602554e4cc1933e41df31ea523f4009e879c92333f98b4313755470d7e400bbbde9f5bef36f40b2a1c4a85edbd62aaa84a516e3df055d5d3f575b9ea0f1c24f057240852d9e618403e1dd2cd0fa7fc16b071b07322172256",
        },
        Case {
            description: "Query Parameter Ordering",
            method: "GET",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[("prefix", "/foo"), ("X-Goog-Meta-Foo", "bar")],
            headers: &[],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-Meta-Foo=bar&X-Goog-SignedHeaders=host&prefix=%2Ffoo&X-Goog-Signature=a07745e1b3d59b85cbe11aa766df72c22468959e7217615dccb7f030234f66b60b37e480f30725ed51f29816362ca8286c619ebb66448ff1d370be2a4a48aacf20d3d2d6200ed17341a5791baf2ee5cd9c2823adacc6264f66c8a54fa887e1bce3c55cf78fb2f6a52618cf09d6f945f63d148052a7b66a75e075ff5065828a806b84bdc49a42399be7483225c720d5e18a6160f79d815f433e7921694fe1d041099851793c2581db0e5ca503cfb566e414f900ceede5f9b22030edd32ab20b6f7f9fb2afba89098b9364e03397c03a94eac3a140c99979b8786844fb4f6c62c1985378939dd1bbaea8e41b9100dda85a27733171cc78d96ee362ea2c3432f4d8",
        },
        Case {
            description: "Header Ordering",
            method: "GET",
            bucket: "test-bucket",
            object: Some("test-object"),
            query: &[],
            headers: &[("X-Goog-Date", "20190201T090000Z")],
            expiration: 10,
            timestamp: "2019-02-01T09:00:00Z",
            endpoint: "https://storage.googleapis.com",
            expected: "https://storage.googleapis.com/test-bucket/test-object?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=test-iam-credentials%40dummy-project-id.iam.gserviceaccount.com%2F20190201%2Fauto%2Fstorage%2Fgoog4_request&X-Goog-Date=20190201T090000Z&X-Goog-Expires=10&X-Goog-SignedHeaders=host%3Bx-goog-date&X-Goog-Signature=55a28435997457f1498291e878fd39c5f321973057d2541886020fdfd212b1467d9eeffdc70951ea952d634cb4193e657ed5b7860c46d37f7d904774680a16e518aa9dff273e8441d6893de615eb592e3113d682ad64a87eb0e0c48df17c30f899e7f940ba230530b30f725ab9ec38789682413752de6a026ae69dd858843100645f3ec986aed618d229f8844d378e0e66e907ede6dff7aac56723f51eb830e8877a56100c86a876173424602abefe6c22b6540a2b36634860b2e89137f297cca8f080bdf3433a9d614c5ab2ec84f65412b45516b30500886a2300f23c3423ae0e91546e3471ee08d06894bddc76203a418d46f35bf0b4574f7b24a693fb046c",
        },
    ];

    #[test]
    fn urls_match_google_s_v4_signing_conformance_cases() {
        for case in CONFORMANCE {
            let store = GcsStore::new(GcsConfig {
                bucket: case.bucket.into(),
                prefix: String::new(),
                account: ServiceAccount::from_json(&key_file()).unwrap(),
                endpoint: Url::parse(case.endpoint).unwrap(),
                list_page_size: LIST_PAGE_SIZE,
            })
            .unwrap();
            let now: Timestamp = case.timestamp.parse().unwrap();
            let url = store.sign(
                case.method,
                case.object,
                case.query,
                case.headers,
                Duration::from_secs(case.expiration),
                &now,
            );
            assert_eq!(url.as_str(), case.expected, "{}", case.description);
        }
    }

    #[test]
    fn an_upload_url_signs_its_size_under_the_prefix() {
        let store = store("cairn-packs", "team/a");
        let now = at_conformance_time();
        let key = "packs/default/ab/ab12";
        let name = store.object_name(key);
        let url = store.sign(
            "PUT",
            Some(&name),
            &[],
            &[("content-length", "1234")],
            Duration::from_secs(60),
            &now,
        );
        assert!(
            url.as_str().starts_with(
                "https://storage.googleapis.com/cairn-packs/team/a/packs/default/ab/ab12?"
            ),
            "{url}"
        );
        let signed: Vec<_> = url
            .query_pairs()
            .filter(|(k, _)| k == "X-Goog-SignedHeaders")
            .map(|(_, v)| v.into_owned())
            .collect();
        assert_eq!(signed, ["content-length;host"]);
        let other = store.sign(
            "PUT",
            Some(&name),
            &[],
            &[("content-length", "1235")],
            Duration::from_secs(60),
            &now,
        );
        assert_ne!(url, other, "another size is another signature");
    }

    #[test]
    fn a_listing_gives_our_keys_with_sizes_times_and_where_the_next_page_starts() {
        // The shape of the XML API's "List objects" response.
        let page = r#"<?xml version='1.0' encoding='UTF-8'?>
<ListBucketResult xmlns="http://doc.s3.amazonaws.com/2006-03-01">
  <Name>cairn-packs</Name>
  <Prefix>team/a/packs/</Prefix>
  <Marker></Marker>
  <NextMarker>team/a/packs/default/cd/cd2</NextMarker>
  <IsTruncated>true</IsTruncated>
  <Contents>
    <Key>team/a/packs/default/ab/ab1</Key>
    <Generation>1360887697105000</Generation>
    <MetaGeneration>1</MetaGeneration>
    <LastModified>2013-02-15T00:21:37.106Z</LastModified>
    <ETag>"d41d8cd98f00b204e9800998ecf8427e"</ETag>
    <Size>3</Size>
  </Contents>
  <Contents>
    <Key>team/a/packs/Not A Key</Key>
    <LastModified>2013-02-15T00:21:37.106Z</LastModified>
    <Size>1</Size>
  </Contents>
  <Contents>
    <Key>team/a/packs/default/cd/cd2</Key>
    <LastModified>2013-02-15T00:21:38Z</LastModified>
    <Size>22</Size>
  </Contents>
</ListBucketResult>"#;
        let (objects, next) = parse_listing(page, "team/a/").unwrap();
        let listed: Vec<_> = objects.iter().map(|o| (o.key.as_str(), o.size)).collect();
        assert_eq!(
            listed,
            [("packs/default/ab/ab1", 3), ("packs/default/cd/cd2", 22)]
        );
        assert_eq!(
            objects[0].modified,
            SystemTime::UNIX_EPOCH + Duration::from_millis(1_360_887_697_106)
        );
        assert_eq!(next.as_deref(), Some("team/a/packs/default/cd/cd2"));
        // The last page; a truncated one without NextMarker goes on after
        // its last key.
        let last = page.replace("<IsTruncated>true", "<IsTruncated>false");
        assert_eq!(parse_listing(&last, "team/a/").unwrap().1, None);
        let unmarked = page.replace("<NextMarker>team/a/packs/default/cd/cd2</NextMarker>", "");
        assert_eq!(
            parse_listing(&unmarked, "team/a/").unwrap().1.as_deref(),
            Some("team/a/packs/default/cd/cd2")
        );
        assert!(
            parse_listing(
                "<ListBucketResult><Contents><Key>team/a/x</Key></Contents></ListBucketResult>",
                "team/a/"
            )
            .is_err()
        );
    }

    #[test]
    fn the_credentials_file_must_be_a_service_account_key() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        };
        let var = |path: Option<String>| {
            move |name: &str| {
                (name == "GOOGLE_APPLICATION_CREDENTIALS")
                    .then(|| path.clone())
                    .flatten()
            }
        };
        let err = GcsConfig::from_vars("b12", "", var(None)).unwrap_err();
        assert!(
            err.to_string()
                .contains("GOOGLE_APPLICATION_CREDENTIALS is not set"),
            "{err}"
        );
        let missing = dir.path().join("absent.json").display().to_string();
        let err = GcsConfig::from_vars("b12", "", var(Some(missing))).unwrap_err();
        assert!(err.to_string().contains("cannot be read"), "{err}");
        let user = write("user.json", r#"{"type": "authorized_user"}"#);
        let err = GcsConfig::from_vars("b12", "", var(Some(user))).unwrap_err();
        assert!(
            err.to_string().contains("need a service account key"),
            "{err}"
        );
        let garbled = key_file().replace(
            "MIIEvAIBADANBgkqhkiG9w0BAQEFAASC",
            "MIIEvAIBADANBgkqhkiG9w0BAQEFAAS!",
        );
        let err =
            GcsConfig::from_vars("b12", "", var(Some(write("bad.json", &garbled)))).unwrap_err();
        assert!(err.to_string().contains("private_key"), "{err}");
        let good =
            GcsConfig::from_vars("b12", "p", var(Some(write("key.json", &key_file())))).unwrap();
        assert_eq!(good.account.client_email, CONFORMANCE_EMAIL);
        assert!(!format!("{good:?}").contains("MIIE"), "{good:?}");
        assert_eq!(
            good.to_string(),
            format!("gs://b12/p at https://storage.googleapis.com/ (as {CONFORMANCE_EMAIL})")
        );
    }
}
