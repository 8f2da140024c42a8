//! Where `--store` puts the objects, and how to reach them.
//!
//! [`StoreLocation`] is the parsed `--store` URL (`s3://bucket/prefix`,
//! `gs://bucket/prefix`, `azure://container/prefix`);
//! [`RemoteStore`] adds what the provider's usual environment variables say
//! (endpoint, region, credentials). Both refuse what they cannot use at
//! start-up, naming the flag's part or the variable at fault, so a
//! coordinator never starts against a store it would fail to reach later.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use url::Url;

use super::ObjectStore;
use super::azure::{AzureConfig, AzureStore};
use super::gcs::{GcsConfig, GcsStore};
use super::s3::{S3Config, S3Store};

/// A remote object store named by `--store`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// `s3://BUCKET[/PREFIX]`: AWS S3 or any S3-compatible server.
    S3 {
        bucket: String,
        /// `/`-separated segments without leading or trailing `/`; may be
        /// empty (the bucket's root).
        prefix: String,
    },
    /// `gs://BUCKET[/PREFIX]`: Google Cloud Storage.
    Gcs { bucket: String, prefix: String },
    /// `azure://CONTAINER[/PREFIX]`: a container of the storage account
    /// `AZURE_STORAGE_ACCOUNT_NAME` names.
    Azure { container: String, prefix: String },
}

/// Why `--store` or the environment that goes with it cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreConfigError {
    #[error("--store {location:?}: {reason}")]
    BadLocation {
        location: String,
        reason: &'static str,
    },
    #[error(
        "--store {location:?}: unknown scheme {scheme:?} (expected s3://bucket/prefix, gs://bucket/prefix or azure://container/prefix)"
    )]
    UnknownScheme { location: String, scheme: String },
    #[error("--url-ttl {ttl}: {store} signs URLs that live {bounds}")]
    UrlTtl {
        store: &'static str,
        ttl: String,
        bounds: &'static str,
    },
    #[error("{var} is not set: {why}")]
    MissingVar {
        var: &'static str,
        why: &'static str,
    },
    #[error("{var}={value:?}: {reason}")]
    BadVar {
        var: &'static str,
        value: String,
        reason: String,
    },
}

impl FromStr for StoreLocation {
    type Err = StoreConfigError;

    fn from_str(location: &str) -> Result<Self, Self::Err> {
        let bad = |reason| StoreConfigError::BadLocation {
            location: location.to_owned(),
            reason,
        };
        let Some((scheme, rest)) = location.split_once("://") else {
            return Err(bad("expected a URL such as s3://bucket/prefix"));
        };
        match scheme {
            "s3" | "gs" | "azure" => {}
            _ => {
                return Err(StoreConfigError::UnknownScheme {
                    location: location.to_owned(),
                    scheme: scheme.to_owned(),
                });
            }
        }
        // Nothing of a URL but a bucket and a path: a query, a port or
        // credentials here would be silently ignored otherwise.
        if rest.contains(['?', '#']) {
            return Err(bad(
                "has a query or fragment; only s3://bucket/prefix is accepted",
            ));
        }
        if rest.contains('@') {
            return Err(bad(
                "has user information; credentials come from the provider's variables",
            ));
        }
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let problem = match scheme {
            "s3" => bucket_problem(bucket),
            "gs" => gcs_bucket_problem(bucket),
            _ => container_problem(bucket),
        };
        if let Some(reason) = problem {
            return Err(bad(reason));
        }
        let prefix = prefix.trim_end_matches('/');
        if !prefix.is_empty() {
            if prefix.split('/').any(str::is_empty) {
                return Err(bad("the prefix has an empty path segment"));
            }
            if prefix.split('/').any(|s| s == "." || s == "..") {
                return Err(bad("the prefix has a '.' or '..' segment"));
            }
            if !prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'/' | b'_' | b'.' | b'-'))
            {
                return Err(bad("the prefix has characters outside [A-Za-z0-9/_.-]"));
            }
            if prefix.len() > 512 {
                return Err(bad("the prefix is longer than 512 bytes"));
            }
        }
        let (bucket, prefix) = (bucket.to_owned(), prefix.to_owned());
        Ok(match scheme {
            "s3" => Self::S3 { bucket, prefix },
            "gs" => Self::Gcs { bucket, prefix },
            _ => Self::Azure {
                container: bucket,
                prefix,
            },
        })
    }
}

/// What is wrong with a Cloud Storage bucket name (without dots: dotted
/// names are domain-verified and may be longer), or `None`.
fn gcs_bucket_problem(bucket: &str) -> Option<&'static str> {
    if bucket.is_empty() {
        return Some("names no bucket");
    }
    if !(3..=63).contains(&bucket.len()) {
        return Some("the bucket name must be 3 to 63 characters long");
    }
    if !bucket
        .bytes()
        .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.'))
    {
        return Some("the bucket name has characters outside [a-z0-9_.-]");
    }
    let edge_ok = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_alphanumeric());
    if !edge_ok(bucket.bytes().next()) || !edge_ok(bucket.bytes().last()) {
        return Some("the bucket name must start and end with a letter or digit");
    }
    if bucket.starts_with("goog") || bucket.contains("google") {
        return Some("the bucket name cannot start with \"goog\" or contain \"google\"");
    }
    None
}

/// What is wrong with an Azure container name, or `None`.
fn container_problem(container: &str) -> Option<&'static str> {
    if container.is_empty() {
        return Some("names no container");
    }
    if !(3..=63).contains(&container.len()) {
        return Some("the container name must be 3 to 63 characters long");
    }
    if !container
        .bytes()
        .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-'))
    {
        return Some("the container name has characters outside [a-z0-9-]");
    }
    if container.starts_with('-') || container.ends_with('-') || container.contains("--") {
        return Some(
            "the container name must start and end with a letter or digit and have no '--'",
        );
    }
    None
}

/// A boolean variable: `true`/`1` or `false`/`0` (any case), unset is `default`.
pub(super) fn flag(
    var: &impl Fn(&str) -> Option<String>,
    name: &'static str,
    default: bool,
) -> Result<bool, StoreConfigError> {
    match var(name) {
        None => Ok(default),
        Some(value) => match value.trim().to_ascii_lowercase().as_str() {
            "true" | "1" => Ok(true),
            "false" | "0" => Ok(false),
            _ => Err(StoreConfigError::BadVar {
                var: name,
                value,
                reason: "expected true or false".into(),
            }),
        },
    }
}

/// An endpoint variable's URL: `https://`, or `http://` when the
/// `allow_var` flag allowed it; a host, and nothing a URL could smuggle in
/// besides (query, fragment, user information).
pub(super) fn endpoint_url(
    var: &'static str,
    value: &str,
    allow_http: bool,
    allow_var: &'static str,
) -> Result<Url, StoreConfigError> {
    let bad = |reason: String| StoreConfigError::BadVar {
        var,
        value: value.to_owned(),
        reason,
    };
    let url = Url::parse(value).map_err(|e| bad(format!("not a URL: {e}")))?;
    match url.scheme() {
        "https" => {}
        "http" if allow_http => {}
        "http" => {
            return Err(bad(format!(
                "an http:// endpoint carries signed URLs in the clear; set {allow_var}=true to allow it (test servers)"
            )));
        }
        _ => return Err(bad("expected an http:// or https:// URL".into())),
    }
    if url.host_str().is_none() {
        return Err(bad("names no host".into()));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("has a query or fragment".into()));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad(
            "has user information; credentials come from their own variables".into(),
        ));
    }
    Ok(url)
}

/// What is wrong with an S3 bucket name (AWS's general purpose bucket
/// rules), or `None`.
fn bucket_problem(bucket: &str) -> Option<&'static str> {
    if bucket.is_empty() {
        return Some("names no bucket");
    }
    if !(3..=63).contains(&bucket.len()) {
        return Some("the bucket name must be 3 to 63 characters long");
    }
    if !bucket
        .bytes()
        .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'-'))
    {
        return Some("the bucket name has characters outside [a-z0-9.-]");
    }
    let edge_ok = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_alphanumeric());
    if !edge_ok(bucket.bytes().next()) || !edge_ok(bucket.bytes().last()) {
        return Some("the bucket name must start and end with a letter or digit");
    }
    if bucket.contains("..") {
        return Some("the bucket name has two adjacent dots");
    }
    None
}

impl fmt::Display for StoreLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            Self::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
            Self::Gcs { bucket, prefix } if prefix.is_empty() => write!(f, "gs://{bucket}"),
            Self::Gcs { bucket, prefix } => write!(f, "gs://{bucket}/{prefix}"),
            Self::Azure { container, prefix } if prefix.is_empty() => {
                write!(f, "azure://{container}")
            }
            Self::Azure { container, prefix } => write!(f, "azure://{container}/{prefix}"),
        }
    }
}

/// A remote store, ready to open: its location and what the environment
/// said about reaching it. Its `Debug` shows no secret.
#[derive(Debug, Clone)]
pub enum RemoteStore {
    S3(S3Config),
    Gcs(GcsConfig),
    Azure(AzureConfig),
}

impl RemoteStore {
    /// `location` with endpoint, region and credentials from this
    /// process's environment.
    pub fn from_env(location: &StoreLocation) -> Result<Self, StoreConfigError> {
        Self::from_vars(location, |name| std::env::var(name).ok())
    }

    /// `location` with the variables `var` answers (tests pass their own
    /// rather than change the process's environment).
    pub fn from_vars(
        location: &StoreLocation,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, StoreConfigError> {
        match location {
            StoreLocation::S3 { bucket, prefix } => {
                S3Config::from_vars(bucket, prefix, var).map(Self::S3)
            }
            StoreLocation::Gcs { bucket, prefix } => {
                GcsConfig::from_vars(bucket, prefix, var).map(Self::Gcs)
            }
            StoreLocation::Azure { container, prefix } => {
                AzureConfig::from_vars(container, prefix, var).map(Self::Azure)
            }
        }
    }

    /// Refuses a URL lifetime the provider does not sign, so the start
    /// fails rather than every upload.
    pub fn check_url_ttl(&self, ttl: std::time::Duration) -> Result<(), StoreConfigError> {
        use super::http::V4_URL_TTL;
        let (store, bounds, ok) = match self {
            Self::S3(_) => ("S3", "from 1 second to 7 days", V4_URL_TTL.contains(&ttl)),
            Self::Gcs(_) => (
                "Cloud Storage",
                "from 1 second to 7 days",
                V4_URL_TTL.contains(&ttl),
            ),
            Self::Azure(_) => (
                "Azure",
                "at least a second",
                ttl >= std::time::Duration::from_secs(1),
            ),
        };
        if ok {
            return Ok(());
        }
        Err(StoreConfigError::UrlTtl {
            store,
            ttl: humantime::format_duration(ttl).to_string(),
            bounds,
        })
    }

    /// The store the coordinator uses.
    pub fn open(&self) -> Result<Arc<dyn ObjectStore>, StoreConfigError> {
        match self {
            Self::S3(config) => Ok(Arc::new(S3Store::new(config.clone())?)),
            Self::Gcs(config) => Ok(Arc::new(GcsStore::new(config.clone())?)),
            Self::Azure(config) => Ok(Arc::new(AzureStore::new(config.clone())?)),
        }
    }
}

impl fmt::Display for RemoteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::S3(config) => config.fmt(f),
            Self::Gcs(config) => config.fmt(f),
            Self::Azure(config) => config.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s3(bucket: &str, prefix: &str) -> StoreLocation {
        StoreLocation::S3 {
            bucket: bucket.into(),
            prefix: prefix.into(),
        }
    }

    #[test]
    fn s3_urls_name_a_bucket_and_an_optional_prefix() {
        assert_eq!(
            "s3://cairn-packs".parse::<StoreLocation>().unwrap(),
            s3("cairn-packs", "")
        );
        assert_eq!(
            "s3://cairn-packs/".parse::<StoreLocation>().unwrap(),
            s3("cairn-packs", "")
        );
        assert_eq!(
            "s3://my.bucket-1/team/A_b.c/"
                .parse::<StoreLocation>()
                .unwrap(),
            s3("my.bucket-1", "team/A_b.c")
        );
        assert_eq!(s3("b12", "x/y").to_string(), "s3://b12/x/y");
        assert_eq!(s3("b12", "").to_string(), "s3://b12");
        let azure = "azure://packs-1/team".parse::<StoreLocation>().unwrap();
        assert_eq!(
            azure,
            StoreLocation::Azure {
                container: "packs-1".into(),
                prefix: "team".into()
            }
        );
        assert_eq!(azure.to_string(), "azure://packs-1/team");
        let gcs = "gs://my_packs/team/".parse::<StoreLocation>().unwrap();
        assert_eq!(
            gcs,
            StoreLocation::Gcs {
                bucket: "my_packs".into(),
                prefix: "team".into()
            }
        );
        assert_eq!(gcs.to_string(), "gs://my_packs/team");
    }

    #[test]
    fn bad_store_urls_are_refused_with_the_reason() {
        let refused = [
            ("bucket/prefix", "expected a URL such as s3://bucket/prefix"),
            ("s3://", "names no bucket"),
            ("s3:///prefix", "names no bucket"),
            ("s3://ab", "the bucket name must be 3 to 63 characters long"),
            (
                "s3://Bucket",
                "the bucket name has characters outside [a-z0-9.-]",
            ),
            (
                "s3://bucket:9000/p",
                "the bucket name has characters outside [a-z0-9.-]",
            ),
            (
                "s3://-bucket",
                "the bucket name must start and end with a letter or digit",
            ),
            ("s3://a..b", "the bucket name has two adjacent dots"),
            ("s3://bucket/a//b", "the prefix has an empty path segment"),
            ("s3://bucket/a/../b", "the prefix has a '.' or '..' segment"),
            (
                "s3://bucket/a b",
                "the prefix has characters outside [A-Za-z0-9/_.-]",
            ),
            (
                "s3://bucket/p?region=x",
                "has a query or fragment; only s3://bucket/prefix is accepted",
            ),
            (
                "s3://key:secret@bucket/p",
                "has user information; credentials come from the provider's variables",
            ),
            (
                "gs://google-packs",
                "the bucket name cannot start with \"goog\" or contain \"google\"",
            ),
            (
                "azure://my.container",
                "the container name has characters outside [a-z0-9-]",
            ),
            (
                "azure://a--b",
                "the container name must start and end with a letter or digit and have no '--'",
            ),
        ];
        for (url, reason) in refused {
            match url.parse::<StoreLocation>() {
                Err(StoreConfigError::BadLocation { reason: got, .. }) => {
                    assert_eq!(got, reason, "{url}")
                }
                other => panic!("{url} was not refused as it should be: {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_schemes_are_refused_naming_the_known_ones() {
        let err = "file:///tmp/x".parse::<StoreLocation>().unwrap_err();
        assert!(
            matches!(err, StoreConfigError::UnknownScheme { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("gs://bucket/prefix"), "{err}");
        // Other spellings of Azure URLs name more than a container.
        assert!(
            "abfss://container@account.dfs.core.windows.net/p"
                .parse::<StoreLocation>()
                .is_err()
        );
    }
}
