//! An S3 bucket (AWS or any S3-compatible server) as the object store.
//!
//! Signing is SigV4 query-string signing ([`rusty_s3`], sans-io); the
//! coordinator's own requests (HEAD, DELETE, ListObjectsV2) go out through
//! the same kind of URL, signed for a minute, on a `reqwest` client. The
//! bytes of checkpoints never pass here: runners PUT and GET them through
//! the URLs [`ObjectStore::presign_put`] and [`ObjectStore::presign_get`]
//! hand out.
//!
//! What an upload URL binds (`docs/object-stores.md`): method, bucket and
//! key, expiry, `content-length` (a signed header: a body of another size
//! fails the signature) and `x-amz-checksum-sha256` (a signed header, and S3
//! refuses a body that does not hash to it with `BadDigest`). The runner
//! sends that header from [`PresignedUrl::headers`]. Not the holder: S3 cannot
//! ask the coordinator whether an attempt is still current, so a URL works
//! until it expires.

use std::fmt;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use jiff::Timestamp;
use rusty_s3::actions::ListObjectsV2;
use rusty_s3::{Bucket, Credentials, S3Action as _, UrlStyle};
use url::Url;

use super::http::{check_v4_ttl, client, delete, failure, head, list_all, network};
use super::location::{StoreConfigError, endpoint_url, flag};
use super::{
    ObjectKey, ObjectMeta, ObjectStore, ObjectStoreError, PresignedUrl, StoreFuture, StoreOp,
};
use crate::tokens::RunBinding;

/// How long the URLs of the coordinator's own requests live: they are sent
/// at once, so only clock skew between the coordinator and S3 matters.
const REQUEST_TTL: Duration = Duration::from_secs(60);

/// Keys per ListObjectsV2 page (S3's own maximum).
pub const LIST_PAGE_SIZE: usize = 1000;

/// The header that binds an upload's SHA-256 (base64 of the digest).
pub const CHECKSUM_HEADER: &str = "x-amz-checksum-sha256";

/// Where the bucket is and how to sign for it. `Debug` and `Display` show
/// the access key id at most, never the secret or the session token.
#[derive(Clone)]
pub struct S3Config {
    pub bucket: String,
    /// Empty, or `/`-separated segments with no trailing `/`.
    pub prefix: String,
    /// `https://s3.REGION.amazonaws.com`, or `AWS_ENDPOINT_URL`.
    pub endpoint: Url,
    pub url_style: UrlStyle,
    pub region: String,
    pub credentials: Credentials,
    /// Keys asked for per ListObjectsV2 page (tests lower it to make the
    /// listing page).
    pub list_page_size: usize,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint.as_str())
            .field("url_style", &self.url_style)
            .field("region", &self.region)
            .field("credentials", &self.credentials)
            .field("list_page_size", &self.list_page_size)
            .finish()
    }
}

impl fmt::Display for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s3://{}", self.bucket)?;
        if !self.prefix.is_empty() {
            write!(f, "/{}", self.prefix)?;
        }
        write!(f, " at {} (region {})", self.endpoint, self.region)
    }
}

impl S3Config {
    /// The bucket's configuration from the AWS variables `var` answers:
    /// `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (an S3-compatible server;
    /// `http://` only with `AWS_ALLOW_HTTP=true`), `AWS_REGION` or
    /// `AWS_DEFAULT_REGION` (required for AWS itself, `us-east-1` for an
    /// endpoint), `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    /// `AWS_SESSION_TOKEN`, and `AWS_VIRTUAL_HOSTED_STYLE_REQUEST` (bucket
    /// in the host name: the default for AWS, path style for an endpoint).
    /// Blank variables count as unset.
    pub fn from_vars(
        bucket: &str,
        prefix: &str,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, StoreConfigError> {
        let var = |name: &str| var(name).filter(|value| !value.trim().is_empty());
        let endpoint_var = if var("AWS_ENDPOINT_URL_S3").is_some() {
            "AWS_ENDPOINT_URL_S3"
        } else {
            "AWS_ENDPOINT_URL"
        };
        let custom_endpoint = var(endpoint_var);
        let region = match (var("AWS_REGION"), var("AWS_DEFAULT_REGION")) {
            (Some(region), _) => Some(("AWS_REGION", region)),
            (None, Some(region)) => Some(("AWS_DEFAULT_REGION", region)),
            (None, None) => None,
        };
        let region = match (region, &custom_endpoint) {
            (Some((name, region)), _) => {
                let valid = !region.is_empty()
                    && region.len() <= 64
                    && region
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
                if !valid {
                    return Err(StoreConfigError::BadVar {
                        var: name,
                        value: region,
                        reason: "a region is lowercase letters, digits and '-'".into(),
                    });
                }
                region
            }
            // S3-compatible servers mostly ignore the region but sign with
            // one; this is the one they expect when none is configured.
            (None, Some(_)) => "us-east-1".to_owned(),
            (None, None) => {
                return Err(StoreConfigError::MissingVar {
                    var: "AWS_REGION",
                    why: "AWS S3 signatures name the bucket's region (or set AWS_ENDPOINT_URL for an S3-compatible server)",
                });
            }
        };
        let allow_http = flag(&var, "AWS_ALLOW_HTTP", false)?;
        let endpoint = match &custom_endpoint {
            Some(value) => endpoint_url(endpoint_var, value, allow_http, "AWS_ALLOW_HTTP")?,
            None => Url::parse(&format!("https://s3.{region}.amazonaws.com"))
                .expect("a checked region makes a valid host"),
        };
        // AWS wants the bucket in the host name, except where a dotted name
        // would not match its certificate; S3-compatible servers reached by
        // address mostly take path style only.
        let virtual_default = custom_endpoint.is_none() && !bucket.contains('.');
        let url_style = if flag(&var, "AWS_VIRTUAL_HOSTED_STYLE_REQUEST", virtual_default)? {
            UrlStyle::VirtualHost
        } else {
            UrlStyle::Path
        };
        const CREDENTIALS: &str = "the coordinator signs the store's URLs with an access key (instance profiles, SSO and credential files are not read)";
        let key = var("AWS_ACCESS_KEY_ID").ok_or(StoreConfigError::MissingVar {
            var: "AWS_ACCESS_KEY_ID",
            why: CREDENTIALS,
        })?;
        let secret = var("AWS_SECRET_ACCESS_KEY").ok_or(StoreConfigError::MissingVar {
            var: "AWS_SECRET_ACCESS_KEY",
            why: CREDENTIALS,
        })?;
        let credentials = match var("AWS_SESSION_TOKEN") {
            Some(token) => Credentials::new_with_token(key, secret, token),
            None => Credentials::new(key, secret),
        };
        Ok(Self {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
            endpoint,
            url_style,
            region,
            credentials,
            list_page_size: LIST_PAGE_SIZE,
        })
    }
}

/// Objects in an S3 bucket under a prefix.
#[derive(Debug, Clone)]
pub struct S3Store {
    bucket: Bucket,
    credentials: Credentials,
    /// Empty, or the location's prefix with a trailing `/`.
    prefix: String,
    list_page_size: usize,
    http: reqwest::Client,
}

impl S3Store {
    pub fn new(config: S3Config) -> Result<Self, StoreConfigError> {
        let bucket = Bucket::new(
            config.endpoint.clone(),
            config.url_style,
            config.bucket.clone(),
            config.region.clone(),
        )
        .map_err(|e| StoreConfigError::BadLocation {
            location: config.to_string(),
            reason: match e {
                rusty_s3::BucketError::UnsupportedScheme => "the endpoint is not http:// or https://",
                rusty_s3::BucketError::MissingHost => "the endpoint names no host",
                rusty_s3::BucketError::ParseError(_) => {
                    "the bucket cannot be addressed at this endpoint in this URL style (a virtual-hosted bucket needs a host name, not an address)"
                }
            },
        })?;
        let http = client(&config.to_string(), reqwest::header::HeaderMap::new())?;
        let prefix = if config.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", config.prefix.trim_end_matches('/'))
        };
        Ok(Self {
            bucket,
            credentials: config.credentials,
            prefix,
            list_page_size: config.list_page_size.clamp(1, LIST_PAGE_SIZE),
            http,
        })
    }

    /// The bucket's name for `key`.
    fn object_name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// An upload URL for `key` signed at `now`, and the headers it needs.
    fn sign_put(
        &self,
        key: &ObjectKey,
        size: u64,
        sha256: [u8; 32],
        ttl: Duration,
        now: &Timestamp,
    ) -> (Url, Vec<(String, String)>) {
        let name = self.object_name(key.as_str());
        let checksum = base64::engine::general_purpose::STANDARD.encode(sha256);
        let mut action = self.bucket.put_object(Some(&self.credentials), &name);
        // Signed headers: the request must carry exactly these values. The
        // runner always sends Content-Length; the checksum goes with the URL.
        action
            .headers_mut()
            .insert("content-length", size.to_string());
        action
            .headers_mut()
            .insert(CHECKSUM_HEADER, checksum.clone());
        let url = action.sign_with_time(ttl, now);
        (url, vec![(CHECKSUM_HEADER.to_owned(), checksum)])
    }

    fn sign_get(&self, key: &ObjectKey, ttl: Duration, now: &Timestamp) -> Url {
        let name = self.object_name(key.as_str());
        self.bucket
            .get_object(Some(&self.credentials), &name)
            .sign_with_time(ttl, now)
    }

    fn presigned(
        url: Url,
        method: &'static str,
        now: &Timestamp,
        ttl: Duration,
        headers: Vec<(String, String)>,
    ) -> PresignedUrl {
        PresignedUrl {
            url: url.into(),
            method,
            // Signing counts whole seconds.
            expires_at: SystemTime::from(*now) + Duration::from_secs(ttl.as_secs()),
            headers,
        }
    }

    /// One ListObjectsV2 page: the objects on it and the token of the next.
    async fn list_page(
        &self,
        full_prefix: &str,
        token: Option<&str>,
    ) -> Result<(Vec<ObjectMeta>, Option<String>), ObjectStoreError> {
        let op = StoreOp::List;
        let url = {
            let mut action = self.bucket.list_objects_v2(Some(&self.credentials));
            action.with_prefix(full_prefix);
            action.with_max_keys(self.list_page_size);
            if let Some(token) = token {
                action.with_continuation_token(token);
            }
            action.sign(REQUEST_TTL)
        };
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
        let malformed = |reason: String| ObjectStoreError::Refused {
            op,
            key: full_prefix.to_owned(),
            reason,
        };
        let page = ListObjectsV2::parse_response(&body)
            .map_err(|e| malformed(format!("a ListObjectsV2 answer that does not parse: {e}")))?;
        let mut objects = Vec::with_capacity(page.contents.len());
        for object in page.contents {
            // Anything outside the prefix, or not shaped as a key of ours,
            // was not written through this store.
            let Some(key) = object.key.strip_prefix(&self.prefix) else {
                continue;
            };
            let Ok(key) = ObjectKey::new(key) else {
                continue;
            };
            let size = object
                .size
                .ok_or_else(|| malformed(format!("the listing gives {key} no size")))?;
            let modified = object
                .last_modified
                .as_deref()
                .ok_or_else(|| malformed(format!("the listing gives {key} no modified time")))?
                .parse::<Timestamp>()
                .map_err(|e| {
                    malformed(format!("the modified time of {key} does not parse: {e}"))
                })?;
            objects.push(ObjectMeta {
                key,
                size,
                modified: SystemTime::from(modified),
            });
        }
        Ok((objects, page.next_continuation_token))
    }
}

impl ObjectStore for S3Store {
    fn stat<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, Option<u64>> {
        Box::pin(async move {
            let name = self.object_name(key.as_str());
            let url = self
                .bucket
                .head_object(Some(&self.credentials), &name)
                .sign(REQUEST_TTL);
            head(&self.http, url, key).await
        })
    }

    fn delete<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let name = self.object_name(key.as_str());
            let url = self
                .bucket
                .delete_object(Some(&self.credentials), &name)
                .sign(REQUEST_TTL);
            delete(&self.http, url, key).await
        })
    }

    fn list<'a>(&'a self, prefix: &'a str) -> StoreFuture<'a, Vec<ObjectMeta>> {
        Box::pin(async move {
            let full_prefix = self.object_name(prefix);
            list_all(&full_prefix, |token| {
                let full_prefix = &full_prefix;
                async move { self.list_page(full_prefix, token.as_deref()).await }
            })
            .await
        })
    }

    fn presign_put<'a>(
        &'a self,
        key: &'a ObjectKey,
        size: u64,
        sha256: [u8; 32],
        ttl: Duration,
        // S3 cannot ask whether an attempt is current: the TTL bounds the URL.
        _holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        Box::pin(async move {
            check_v4_ttl("S3", StoreOp::PresignPut, key, ttl)?;
            let now = Timestamp::now();
            let (url, headers) = self.sign_put(key, size, sha256, ttl, &now);
            Ok(Self::presigned(url, "PUT", &now, ttl, headers))
        })
    }

    fn presign_get<'a>(
        &'a self,
        key: &'a ObjectKey,
        ttl: Duration,
        _holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        Box::pin(async move {
            check_v4_ttl("S3", StoreOp::PresignGet, key, ttl)?;
            let now = Timestamp::now();
            let url = self.sign_get(key, ttl, &now);
            Ok(Self::presigned(url, "GET", &now, ttl, Vec::new()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    const KEYS: [(&str, &str); 2] = [
        ("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE"),
        (
            "AWS_SECRET_ACCESS_KEY",
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        ),
    ];

    fn aws_example_store(prefix: &str) -> S3Store {
        let mut env = KEYS.to_vec();
        env.push(("AWS_REGION", "us-east-1"));
        let mut config = S3Config::from_vars("examplebucket", prefix, vars(&env)).unwrap();
        // The documented example uses the global endpoint.
        config.endpoint = "https://s3.amazonaws.com".parse().unwrap();
        S3Store::new(config).unwrap()
    }

    #[test]
    fn a_get_url_matches_the_aws_documented_presigned_example() {
        // "Authenticating Requests: Using Query Parameters (AWS Signature
        // Version 4)", Amazon S3 API Reference: GET examplebucket/test.txt,
        // Fri, 24 May 2013 00:00:00 GMT, 86400 seconds.
        let store = aws_example_store("");
        let now = Timestamp::from_second(1_369_353_600).unwrap();
        let url = store.sign_get(
            &ObjectKey::new("test.txt").unwrap(),
            Duration::from_secs(86400),
            &now,
        );
        assert_eq!(
            url.as_str(),
            "https://examplebucket.s3.amazonaws.com/test.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host&X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404"
        );
    }

    #[test]
    fn an_upload_url_signs_its_size_and_checksum_under_the_prefix() {
        let store = aws_example_store("team/a");
        let now = Timestamp::from_second(1_369_353_600).unwrap();
        let key = ObjectKey::new("packs/default/ab/ab12").unwrap();
        let (url, headers) = store.sign_put(&key, 1234, [7; 32], Duration::from_secs(60), &now);
        assert!(
            url.as_str().starts_with(
                "https://examplebucket.s3.amazonaws.com/team/a/packs/default/ab/ab12?"
            ),
            "{url}"
        );
        let query: HashMap<_, _> = url.query_pairs().into_owned().collect();
        assert_eq!(
            query["X-Amz-SignedHeaders"],
            "content-length;host;x-amz-checksum-sha256"
        );
        assert_eq!(query["X-Amz-Expires"], "60");
        let checksum = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
        assert_eq!(headers, vec![(CHECKSUM_HEADER.to_owned(), checksum)]);
        // Another size or digest is another signature.
        let (other_size, _) = store.sign_put(&key, 1235, [7; 32], Duration::from_secs(60), &now);
        let (other_sum, _) = store.sign_put(&key, 1234, [8; 32], Duration::from_secs(60), &now);
        let signature = |u: &Url| {
            u.query_pairs()
                .find(|(k, _)| k == "X-Amz-Signature")
                .unwrap()
                .1
                .into_owned()
        };
        assert_ne!(signature(&url), signature(&other_size));
        assert_ne!(signature(&url), signature(&other_sum));
    }

    #[test]
    fn the_environment_gives_endpoint_style_region_and_credentials() {
        let mut env = KEYS.to_vec();
        env.push(("AWS_REGION", "eu-west-3"));
        let aws = S3Config::from_vars("bucket", "p", vars(&env)).unwrap();
        assert_eq!(aws.endpoint.as_str(), "https://s3.eu-west-3.amazonaws.com/");
        assert!(matches!(aws.url_style, UrlStyle::VirtualHost));
        assert_eq!(aws.credentials.token(), None);

        let dotted = S3Config::from_vars("my.bucket", "", vars(&env)).unwrap();
        assert!(
            matches!(dotted.url_style, UrlStyle::Path),
            "dots break the certificate"
        );

        let mut env = KEYS.to_vec();
        env.extend([
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:9000"),
            ("AWS_ALLOW_HTTP", "true"),
            ("AWS_SESSION_TOKEN", "tok"),
        ]);
        let local = S3Config::from_vars("bucket", "", vars(&env)).unwrap();
        assert_eq!(local.endpoint.as_str(), "http://127.0.0.1:9000/");
        assert_eq!(local.region, "us-east-1");
        assert!(matches!(local.url_style, UrlStyle::Path));
        assert_eq!(local.credentials.token(), Some("tok"));
        let shown = format!("{local:?} {local}");
        assert!(
            !shown.contains("wJalr") && !shown.contains("tok\""),
            "{shown}"
        );
    }

    #[test]
    fn missing_or_unusable_variables_are_named() {
        let missing = |env: &[(&str, &str)]| match S3Config::from_vars("bucket", "", vars(env)) {
            Err(StoreConfigError::MissingVar { var, .. }) => var,
            other => panic!("expected a missing variable: {other:?}"),
        };
        assert_eq!(missing(&KEYS), "AWS_REGION");
        assert_eq!(missing(&[("AWS_REGION", "us-east-1")]), "AWS_ACCESS_KEY_ID");
        assert_eq!(
            missing(&[
                ("AWS_REGION", "us-east-1"),
                KEYS[0],
                ("AWS_SECRET_ACCESS_KEY", " ")
            ]),
            "AWS_SECRET_ACCESS_KEY"
        );
        let bad = |env: &[(&str, &str)]| {
            let mut all = KEYS.to_vec();
            all.extend_from_slice(env);
            match S3Config::from_vars("bucket", "", vars(&all)) {
                Err(StoreConfigError::BadVar { var, .. }) => var,
                other => panic!("expected a bad variable: {other:?}"),
            }
        };
        assert_eq!(
            bad(&[("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")]),
            "AWS_ENDPOINT_URL"
        );
        assert_eq!(bad(&[("AWS_ENDPOINT_URL", "ftp://x")]), "AWS_ENDPOINT_URL");
        assert_eq!(
            bad(&[("AWS_ENDPOINT_URL", "https://k:s@x")]),
            "AWS_ENDPOINT_URL"
        );
        assert_eq!(
            bad(&[
                ("AWS_ENDPOINT_URL_S3", "nonsense"),
                ("AWS_ENDPOINT_URL", "https://x")
            ]),
            "AWS_ENDPOINT_URL_S3"
        );
        assert_eq!(bad(&[("AWS_REGION", "EU West")]), "AWS_REGION");
        assert_eq!(
            bad(&[("AWS_REGION", "us-east-1"), ("AWS_ALLOW_HTTP", "maybe")]),
            "AWS_ALLOW_HTTP"
        );
    }

    #[tokio::test]
    async fn urls_outside_sigv4_s_lifetimes_are_refused() {
        let store = aws_example_store("");
        let key = ObjectKey::new("packs/a").unwrap();
        for ttl in [
            Duration::from_millis(500),
            Duration::from_secs(8 * 24 * 3600),
        ] {
            let err = store.presign_get(&key, ttl, None).await.unwrap_err();
            assert!(matches!(err, ObjectStoreError::Refused { .. }), "{err}");
            assert!(!err.is_retryable());
        }
        let put = store
            .presign_put(&key, 3, [0; 32], Duration::from_secs(3600), None)
            .await
            .unwrap();
        assert_eq!(put.method, "PUT");
        let left = put.expires_at.duration_since(SystemTime::now()).unwrap();
        assert!(left > Duration::from_secs(3590), "{left:?}");
    }
}
