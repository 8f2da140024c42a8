//! An Azure Blob Storage container (or Azurite) as the object store.
//!
//! URLs carry service SAS tokens signed with the storage account's key
//! (HMAC-SHA256 over the string-to-sign of SAS version [`SAS_VERSION`]);
//! the coordinator's own requests (Get Blob Properties, Delete Blob, List
//! Blobs paged by marker) go out through the same kind of URL, signed for a
//! minute. The bytes of checkpoints never pass here.
//!
//! What an upload URL binds (`docs/object-stores.md`): the blob, the
//! permissions (create and write for an upload, read for a download) and
//! the expiry. A SAS signs no header, so neither the size nor the SHA-256:
//! the commit checks the size it finds, and restores authenticate every
//! blob. The runner sends `x-ms-blob-type: BlockBlob` from
//! [`PresignedUrl::headers`]. Not the holder: the TTL bounds the URL.

use std::fmt;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use jiff::Timestamp;
use ring::hmac;
use url::Url;

use super::http::{child, client, delete, failure, head, list_all, network, text};
use super::location::StoreConfigError;
use super::{
    ObjectKey, ObjectMeta, ObjectStore, ObjectStoreError, PresignedUrl, StoreFuture, StoreOp,
};
use crate::tokens::RunBinding;

/// The SAS version signed (and so the string-to-sign's layout).
pub const SAS_VERSION: &str = "2022-11-02";

/// How long the URLs of the coordinator's own requests live.
const REQUEST_TTL: Duration = Duration::from_secs(60);

/// Blobs per List Blobs page (Azure's own maximum).
pub const LIST_PAGE_SIZE: usize = 5000;

/// The header every Put Blob needs.
pub const BLOB_TYPE_HEADER: &str = "x-ms-blob-type";

/// The storage account's key, decoded. `Debug` shows nothing of it.
#[derive(Clone)]
pub struct AccountKey(Vec<u8>);

impl AccountKey {
    pub fn from_base64(encoded: &str) -> Option<Self> {
        let key = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .ok()?;
        (!key.is_empty()).then_some(Self(key))
    }
}

impl fmt::Debug for AccountKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AccountKey(…)")
    }
}

/// Where the container is and how to sign for it.
#[derive(Debug, Clone)]
pub struct AzureConfig {
    pub account: String,
    pub key: AccountKey,
    pub container: String,
    /// Empty, or `/`-separated segments with no trailing `/`.
    pub prefix: String,
    /// The blob service: `https://ACCOUNT.blob.core.windows.net`, or
    /// `AZURE_STORAGE_ENDPOINT` (Azurite: `http://127.0.0.1:10000/ACCOUNT`).
    pub endpoint: Url,
    /// Blobs asked for per List Blobs page (tests lower it).
    pub list_page_size: usize,
}

impl fmt::Display for AzureConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "azure://{}", self.container)?;
        if !self.prefix.is_empty() {
            write!(f, "/{}", self.prefix)?;
        }
        write!(f, " at {} (account {})", self.endpoint, self.account)
    }
}

impl AzureConfig {
    /// The container's configuration from the variables `var` answers:
    /// `AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY` (base64),
    /// `AZURE_STORAGE_ENDPOINT` (the blob service; `http://` only with
    /// `AZURE_ALLOW_HTTP=true`). Blank variables count as unset.
    pub fn from_vars(
        container: &str,
        prefix: &str,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, StoreConfigError> {
        let var = |name: &str| var(name).filter(|value| !value.trim().is_empty());
        const ACCOUNT: &str = "the coordinator signs SAS URLs with the storage account's key (Entra ID and managed identities are not read)";
        let account = var("AZURE_STORAGE_ACCOUNT_NAME").ok_or(StoreConfigError::MissingVar {
            var: "AZURE_STORAGE_ACCOUNT_NAME",
            why: ACCOUNT,
        })?;
        let valid_account = (3..=24).contains(&account.len())
            && account
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        if !valid_account {
            return Err(StoreConfigError::BadVar {
                var: "AZURE_STORAGE_ACCOUNT_NAME",
                value: account,
                reason: "an account name is 3 to 24 lowercase letters and digits".into(),
            });
        }
        let key = var("AZURE_STORAGE_ACCOUNT_KEY").ok_or(StoreConfigError::MissingVar {
            var: "AZURE_STORAGE_ACCOUNT_KEY",
            why: ACCOUNT,
        })?;
        let key = AccountKey::from_base64(&key).ok_or_else(|| StoreConfigError::BadVar {
            var: "AZURE_STORAGE_ACCOUNT_KEY",
            // Never echo a secret, even a malformed one.
            value: "…".into(),
            reason: "not base64 (the key as the portal shows it)".into(),
        })?;
        let allow_http = super::location::flag(&var, "AZURE_ALLOW_HTTP", false)?;
        let endpoint = match var("AZURE_STORAGE_ENDPOINT") {
            Some(value) => super::location::endpoint_url(
                "AZURE_STORAGE_ENDPOINT",
                &value,
                allow_http,
                "AZURE_ALLOW_HTTP",
            )?,
            None => Url::parse(&format!("https://{account}.blob.core.windows.net"))
                .expect("a checked account name makes a valid host"),
        };
        Ok(Self {
            account,
            key,
            container: container.to_owned(),
            prefix: prefix.to_owned(),
            endpoint,
            list_page_size: LIST_PAGE_SIZE,
        })
    }
}

/// A SAS grant: what the signature covers besides the resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sas {
    /// `sr=b`: one blob, with these permissions.
    Blob(&'static str),
    /// `sr=c`, `sp=l`: listing the container.
    List,
}

/// Blobs in an Azure container under a prefix.
#[derive(Debug, Clone)]
pub struct AzureStore {
    account: String,
    key: hmac::Key,
    container: String,
    /// Empty, or the location's prefix with a trailing `/`.
    prefix: String,
    /// The endpoint's path with a trailing `/` (Azurite puts the account
    /// there).
    endpoint: Url,
    list_page_size: usize,
    http: reqwest::Client,
}

impl AzureStore {
    pub fn new(config: AzureConfig) -> Result<Self, StoreConfigError> {
        // Every request the coordinator sends itself speaks this version.
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            "x-ms-version",
            reqwest::header::HeaderValue::from_static(SAS_VERSION),
        );
        let http = client(&config.to_string(), headers)?;
        let mut endpoint = config.endpoint.clone();
        if !endpoint.path().ends_with('/') {
            let path = format!("{}/", endpoint.path());
            endpoint.set_path(&path);
        }
        let prefix = if config.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", config.prefix.trim_end_matches('/'))
        };
        Ok(Self {
            account: config.account,
            key: hmac::Key::new(hmac::HMAC_SHA256, &config.key.0),
            container: config.container,
            prefix,
            endpoint,
            list_page_size: config.list_page_size.clamp(1, LIST_PAGE_SIZE),
            http,
        })
    }

    fn blob_name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The SAS string-to-sign of [`SAS_VERSION`] ("Create a service SAS":
    /// permissions, start, expiry, canonicalized resource, identifier, IP,
    /// protocol, version, resource, snapshot time, encryption scope, and
    /// the five response-header overrides), with only what cairn sets.
    fn string_to_sign(
        &self,
        blob: Option<&str>,
        permissions: &str,
        expiry: &str,
        resource: &str,
    ) -> String {
        let mut canonical = format!("/blob/{}/{}", self.account, self.container);
        if let Some(blob) = blob {
            canonical.push('/');
            canonical.push_str(blob);
        }
        [
            permissions,
            "",
            expiry,
            &canonical,
            "",
            "",
            "",
            SAS_VERSION,
            resource,
            "",
            "",
            "",
            "",
            "",
            "",
            "",
        ]
        .join("\n")
    }

    /// The URL of `blob` (or of the container), with a SAS for `grant`
    /// expiring at `expiry`, and `query` (unsigned parameters of the
    /// operation itself) before it.
    fn sign(
        &self,
        blob: Option<&str>,
        grant: Sas,
        expiry: &Timestamp,
        query: &[(&str, &str)],
    ) -> Url {
        let mut url = self.endpoint.clone();
        let path = match blob {
            Some(blob) => format!("{}{}/{blob}", url.path(), self.container),
            None => format!("{}{}", url.path(), self.container),
        };
        url.set_path(&path);
        let expiry = expiry.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
        let (permissions, resource) = match grant {
            Sas::Blob(permissions) => (permissions, "b"),
            Sas::List => ("l", "c"),
        };
        let to_sign = self.string_to_sign(blob, permissions, &expiry, resource);
        let signature = base64::engine::general_purpose::STANDARD
            .encode(hmac::sign(&self.key, to_sign.as_bytes()).as_ref());
        {
            let mut pairs = url.query_pairs_mut();
            for (name, value) in query {
                pairs.append_pair(name, value);
            }
            pairs
                .append_pair("sv", SAS_VERSION)
                .append_pair("se", &expiry)
                .append_pair("sr", resource)
                .append_pair("sp", permissions)
                .append_pair("sig", &signature);
        }
        url
    }

    fn presigned(
        url: Url,
        method: &'static str,
        expiry: &Timestamp,
        headers: Vec<(String, String)>,
    ) -> PresignedUrl {
        PresignedUrl {
            url: url.into(),
            method,
            expires_at: SystemTime::from(*expiry),
            headers,
        }
    }

    /// Signing counts whole seconds, so the expiry is rounded down; below a
    /// second nothing would be left.
    fn expiry(op: StoreOp, key: &ObjectKey, ttl: Duration) -> Result<Timestamp, ObjectStoreError> {
        let whole = Duration::from_secs(ttl.as_secs());
        if whole.is_zero() {
            return Err(ObjectStoreError::Refused {
                op,
                key: key.to_string(),
                reason: "SAS URLs must live at least a second (--url-ttl)".into(),
            });
        }
        let now =
            Timestamp::from_second(Timestamp::now().as_second()).expect("now is a valid time");
        now.checked_add(whole)
            .map_err(|e| ObjectStoreError::Refused {
                op,
                key: key.to_string(),
                reason: format!(
                    "an expiry {} from now: {e}",
                    humantime::format_duration(whole)
                ),
            })
    }

    fn request_expiry() -> Timestamp {
        Timestamp::now()
            .checked_add(REQUEST_TTL)
            .expect("a minute from now is a valid time")
    }

    /// One List Blobs page: the blobs on it and the marker of the next.
    async fn list_page(
        &self,
        full_prefix: &str,
        marker: Option<&str>,
    ) -> Result<(Vec<ObjectMeta>, Option<String>), ObjectStoreError> {
        let op = StoreOp::List;
        let page_size = self.list_page_size.to_string();
        let mut query = vec![
            ("restype", "container"),
            ("comp", "list"),
            ("prefix", full_prefix),
            ("maxresults", page_size.as_str()),
        ];
        if let Some(marker) = marker {
            query.push(("marker", marker));
        }
        let url = self.sign(None, Sas::List, &Self::request_expiry(), &query);
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
        let document = roxmltree::Document::parse(&body)
            .map_err(|e| malformed(format!("a List Blobs answer that does not parse: {e}")))?;
        let root = document.root_element();
        let mut objects = Vec::new();
        if let Some(blobs) = child(root, "Blobs") {
            for blob in blobs
                .children()
                .filter(|c| c.is_element() && c.tag_name().name() == "Blob")
            {
                let name = text(child(blob, "Name"));
                let Some(key) = name.strip_prefix(&self.prefix) else {
                    continue;
                };
                let Ok(key) = ObjectKey::new(key) else {
                    continue;
                };
                let properties = child(blob, "Properties");
                let size = text(properties.and_then(|p| child(p, "Content-Length")))
                    .parse::<u64>()
                    .map_err(|_| malformed(format!("the listing gives {key} no size")))?;
                let modified = text(properties.and_then(|p| child(p, "Last-Modified")));
                let modified = httpdate::parse_http_date(&modified).map_err(|_| {
                    malformed(format!(
                        "the modified time of {key} does not parse: {modified:?}"
                    ))
                })?;
                objects.push(ObjectMeta {
                    key,
                    size,
                    modified,
                });
            }
        }
        let next = text(child(root, "NextMarker"));
        Ok((objects, (!next.is_empty()).then_some(next)))
    }
}

impl ObjectStore for AzureStore {
    fn stat<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, Option<u64>> {
        Box::pin(async move {
            let blob = self.blob_name(key.as_str());
            let url = self.sign(Some(&blob), Sas::Blob("r"), &Self::request_expiry(), &[]);
            head(&self.http, url, key).await
        })
    }

    fn delete<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let blob = self.blob_name(key.as_str());
            let url = self.sign(Some(&blob), Sas::Blob("d"), &Self::request_expiry(), &[]);
            delete(&self.http, url, key).await
        })
    }

    fn list<'a>(&'a self, prefix: &'a str) -> StoreFuture<'a, Vec<ObjectMeta>> {
        Box::pin(async move {
            let full_prefix = self.blob_name(prefix);
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
        _size: u64,
        _sha256: [u8; 32],
        ttl: Duration,
        // A SAS binds neither size, digest nor holder: see the module doc.
        _holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        Box::pin(async move {
            let expiry = Self::expiry(StoreOp::PresignPut, key, ttl)?;
            let blob = self.blob_name(key.as_str());
            let url = self.sign(Some(&blob), Sas::Blob("cw"), &expiry, &[]);
            let headers = vec![(BLOB_TYPE_HEADER.to_owned(), "BlockBlob".to_owned())];
            Ok(Self::presigned(url, "PUT", &expiry, headers))
        })
    }

    fn presign_get<'a>(
        &'a self,
        key: &'a ObjectKey,
        ttl: Duration,
        _holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        Box::pin(async move {
            let expiry = Self::expiry(StoreOp::PresignGet, key, ttl)?;
            let blob = self.blob_name(key.as_str());
            let url = self.sign(Some(&blob), Sas::Blob("r"), &expiry, &[]);
            Ok(Self::presigned(url, "GET", &expiry, Vec::new()))
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

    const ACCOUNT: [(&str, &str); 2] = [
        ("AZURE_STORAGE_ACCOUNT_NAME", "myaccount"),
        // base64 of "a key of the account's"
        (
            "AZURE_STORAGE_ACCOUNT_KEY",
            "YSBrZXkgb2YgdGhlIGFjY291bnQncw==",
        ),
    ];

    fn store(prefix: &str) -> AzureStore {
        AzureStore::new(AzureConfig::from_vars("sascontainer", prefix, vars(&ACCOUNT)).unwrap())
            .unwrap()
    }

    #[test]
    fn the_string_to_sign_follows_the_service_sas_layout_of_its_version() {
        // "Create a service SAS", version 2020-12-06 and later: sixteen
        // fields, the canonicalized resource /blob/ACCOUNT/CONTAINER/BLOB.
        let store = store("");
        let to_sign = store.string_to_sign(Some("sasblob.txt"), "r", "2019-04-30T02:23:26Z", "b");
        assert_eq!(
            to_sign,
            "r\n\n2019-04-30T02:23:26Z\n/blob/myaccount/sascontainer/sasblob.txt\n\n\n\n2022-11-02\nb\n\n\n\n\n\n\n"
        );
        assert_eq!(to_sign.split('\n').count(), 16);
        let container = store.string_to_sign(None, "l", "2019-04-30T02:23:26Z", "c");
        assert!(
            container.contains("\n/blob/myaccount/sascontainer\n"),
            "{container:?}"
        );
    }

    #[test]
    fn a_sas_url_names_its_blob_permissions_and_expiry_and_signs_them() {
        let store = store("team/a");
        let expiry = Timestamp::from_second(1_556_590_406).unwrap();
        let blob = store.blob_name("packs/default/ab/ab12");
        let url = store.sign(Some(&blob), Sas::Blob("cw"), &expiry, &[]);
        assert!(
            url.as_str().starts_with(
                "https://myaccount.blob.core.windows.net/sascontainer/team/a/packs/default/ab/ab12?"
            ),
            "{url}"
        );
        let query: HashMap<_, _> = url.query_pairs().into_owned().collect();
        assert_eq!(query["sv"], SAS_VERSION);
        assert_eq!(query["se"], "2019-04-30T02:13:26Z");
        assert_eq!(query["sr"], "b");
        assert_eq!(query["sp"], "cw");
        let expected = hmac::sign(
            &hmac::Key::new(hmac::HMAC_SHA256, b"a key of the account's"),
            store
                .string_to_sign(Some(&blob), "cw", "2019-04-30T02:13:26Z", "b")
                .as_bytes(),
        );
        assert_eq!(
            query["sig"],
            base64::engine::general_purpose::STANDARD.encode(expected.as_ref())
        );
        // Read and write are different grants, so different signatures.
        let read = store.sign(Some(&blob), Sas::Blob("r"), &expiry, &[]);
        let sig = |u: &Url| {
            u.query_pairs()
                .find(|(k, _)| k == "sig")
                .unwrap()
                .1
                .into_owned()
        };
        assert_ne!(sig(&url), sig(&read));
    }

    #[test]
    fn missing_or_unusable_variables_are_named_and_the_key_never_shown() {
        let err = AzureConfig::from_vars("c12", "", vars(&[])).unwrap_err();
        assert!(
            matches!(
                err,
                StoreConfigError::MissingVar {
                    var: "AZURE_STORAGE_ACCOUNT_NAME",
                    ..
                }
            ),
            "{err}"
        );
        let err = AzureConfig::from_vars("c12", "", vars(&ACCOUNT[..1])).unwrap_err();
        assert!(
            matches!(
                err,
                StoreConfigError::MissingVar {
                    var: "AZURE_STORAGE_ACCOUNT_KEY",
                    ..
                }
            ),
            "{err}"
        );
        let err = AzureConfig::from_vars(
            "c12",
            "",
            vars(&[
                ACCOUNT[0],
                ("AZURE_STORAGE_ACCOUNT_KEY", "not base64 secret!"),
            ]),
        )
        .unwrap_err();
        assert!(!err.to_string().contains("secret"), "{err}");
        let mut env = ACCOUNT.to_vec();
        env.push(("AZURE_STORAGE_ENDPOINT", "http://127.0.0.1:10000/myaccount"));
        let err = AzureConfig::from_vars("c12", "", vars(&env)).unwrap_err();
        assert!(err.to_string().contains("AZURE_ALLOW_HTTP=true"), "{err}");
        env.push(("AZURE_ALLOW_HTTP", "true"));
        let config = AzureConfig::from_vars("c12", "", vars(&env)).unwrap();
        assert_eq!(config.endpoint.as_str(), "http://127.0.0.1:10000/myaccount");
        assert!(!format!("{config:?}").contains("YSBr"), "{config:?}");
        let err = AzureConfig::from_vars(
            "c12",
            "",
            vars(&[("AZURE_STORAGE_ACCOUNT_NAME", "My-Account"), ACCOUNT[1]]),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                StoreConfigError::BadVar {
                    var: "AZURE_STORAGE_ACCOUNT_NAME",
                    ..
                }
            ),
            "{err}"
        );
    }
}
