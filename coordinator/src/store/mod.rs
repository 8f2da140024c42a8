//! The object store, as the coordinator sees it.
//!
//! The coordinator never moves checkpoint bytes: it asks the store whether an
//! object is there and how big it is, and it signs URLs through which runners
//! move the bytes themselves. [`ObjectStore`] is that narrow interface, object
//! safe so the server holds an `Arc<dyn ObjectStore>`:
//!
//! - [`LocalStore`]: files under `DIR/blobs`, served by the embedded blob
//!   server ([`crate::blob_http`]) through URLs signed with
//!   [`crate::signing::UrlSigner`].
//! - [`S3Store`]: a bucket of AWS S3 or of any S3-compatible server,
//!   through SigV4 presigned URLs (`--store s3://bucket/prefix`).
//! - [`GcsStore`]: a Google Cloud Storage bucket, through V4 signed URLs
//!   (`--store gs://bucket/prefix`).
//! - [`AzureStore`]: a container of Azure Blob Storage (or Azurite),
//!   through service SAS URLs (`--store azure://container/prefix`).
//! - [`FaultyStore`]: wraps any store and fails or hides what a test arms.
//!
//! [`StoreLocation`] is what `--store` names; [`RemoteStore`] is such a
//! location with its endpoint and credentials, read from the provider's
//! environment variables. `docs/object-stores.md` says what each store's
//! URLs bind.
//!
//! Object keys are validated ([`ObjectKey`]); packs live at
//! `packs/<tenant>/<first two hex digits>/<pack id>` (under the location's
//! prefix in a remote store).

pub mod azure;
mod faulty;
pub mod gcs;
mod http;
pub(crate) mod local;
mod location;
pub mod s3;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::tokens::RunBinding;
use cairn_proto::ids::{PackId, TenantId};

pub use azure::AzureStore;
pub use faulty::{Faults, FaultyStore};
pub use gcs::GcsStore;
pub use local::{LocalStore, TEMP_DIR};
pub use location::{RemoteStore, StoreConfigError, StoreLocation};
pub use s3::S3Store;

/// Longest object key accepted.
pub const MAX_KEY_LEN: usize = 1024;

/// A validated object key: `/`-separated segments of `[a-z0-9_.-]`, none
/// empty, none starting with `.` (so no `..`, and dot-names such as the blob
/// server's `.tmp` are never addressable), not absolute.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey(String);

impl ObjectKey {
    pub fn new(key: impl Into<String>) -> Result<Self, ObjectStoreError> {
        let key = key.into();
        match Self::problem(&key) {
            None => Ok(Self(key)),
            Some(reason) => Err(ObjectStoreError::InvalidKey { key, reason }),
        }
    }

    fn problem(key: &str) -> Option<&'static str> {
        if key.is_empty() {
            return Some("is empty");
        }
        if key.len() > MAX_KEY_LEN {
            return Some("is longer than 1024 bytes");
        }
        if key.starts_with('/') {
            return Some("is absolute");
        }
        if !key
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'/' | b'_' | b'.' | b'-'))
        {
            return Some("has characters outside [a-z0-9/_.-]");
        }
        if key.split('/').any(|segment| segment.is_empty()) {
            return Some("has an empty path segment");
        }
        if key.split('/').any(|segment| segment.starts_with('.')) {
            return Some("has a path segment starting with '.'");
        }
        None
    }

    /// Where a tenant's pack lives.
    pub fn for_pack(tenant: &TenantId, pack: &PackId) -> Self {
        let id = pack.as_str();
        Self(format!("packs/{tenant}/{}/{id}", &id[..2]))
    }

    /// The tenant and pack a pack's key names ([`ObjectKey::for_pack`]
    /// backwards); `None` for any other key.
    pub fn pack(&self) -> Option<(TenantId, PackId)> {
        let mut parts = self.0.split('/');
        let (Some("packs"), Some(tenant), Some(fanout), Some(id), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return None;
        };
        let pack: PackId = id.parse().ok()?;
        (id.get(..2) == Some(fanout)).then_some(())?;
        Some((tenant.parse().ok()?, pack))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// An object found by [`ObjectStore::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub key: ObjectKey,
    pub size: u64,
    /// When it was last written (garbage collection spares uploads younger
    /// than its grace period: they may still be committed).
    pub modified: std::time::SystemTime,
}

/// A URL that lets its bearer do one thing to one object until it expires.
#[derive(Clone, PartialEq, Eq)]
pub struct PresignedUrl {
    pub url: String,
    /// `GET` (which also allows `HEAD`) or `PUT`.
    pub method: &'static str,
    pub expires_at: SystemTime,
    /// Headers an upload must carry as they are, because the signature
    /// covers them (S3's `x-amz-checksum-sha256`); lowercase names, sent
    /// to runners in `SignedUrl.headers`. Not a credential: they only
    /// repeat what the request states. Always empty for downloads, whose
    /// URLs reach runners as bare strings.
    pub headers: Vec<(String, String)>,
}

impl fmt::Debug for PresignedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The query string is a credential.
        let path = self
            .url
            .split_once('?')
            .map_or(self.url.as_str(), |(path, _)| path);
        f.debug_struct("PresignedUrl")
            .field("url", &format_args!("{path}?…"))
            .field("method", &self.method)
            .field("expires_at", &self.expires_at)
            .field("headers", &self.headers)
            .finish()
    }
}

/// An operation of [`ObjectStore`], for errors and fault injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreOp {
    Stat,
    Delete,
    List,
    PresignPut,
    PresignGet,
}

impl fmt::Display for StoreOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Stat => "stat",
            Self::Delete => "delete",
            Self::List => "list",
            Self::PresignPut => "presign PUT",
            Self::PresignGet => "presign GET",
        })
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ObjectStoreError {
    #[error("invalid object key {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },
    #[error("object store: {op} {key}: {source}")]
    Io {
        op: StoreOp,
        key: String,
        #[source]
        source: std::io::Error,
    },
    #[error("object store unavailable: {op} {key}: {reason}")]
    Unavailable {
        op: StoreOp,
        key: String,
        reason: String,
    },
    /// The store answered, and said no in a way trying again will not
    /// change (refused credentials, a missing bucket, a malformed answer, a
    /// URL lifetime it does not sign).
    #[error("object store refused {op} {key}: {reason}")]
    Refused {
        op: StoreOp,
        key: String,
        reason: String,
    },
}

impl ObjectStoreError {
    /// Whether the same operation may succeed if tried again.
    pub fn is_retryable(&self) -> bool {
        use std::io::ErrorKind;
        match self {
            Self::InvalidKey { .. } | Self::Refused { .. } => false,
            Self::Unavailable { .. } => true,
            Self::Io { source, .. } => matches!(
                source.kind(),
                ErrorKind::Interrupted
                    | ErrorKind::TimedOut
                    | ErrorKind::WouldBlock
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::ResourceBusy
                    | ErrorKind::StorageFull
            ),
        }
    }
}

/// A boxed future of a store operation (keeps [`ObjectStore`] object safe).
pub type StoreFuture<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, ObjectStoreError>> + Send + 'a>>;

/// What the coordinator needs from an object store.
pub trait ObjectStore: Send + Sync + 'static {
    /// The object's size, or `None` when it does not exist.
    fn stat<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, Option<u64>>;

    /// Removes the object; removing a missing object succeeds.
    fn delete<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, ()>;

    /// Every object whose key starts with `prefix`, sorted by key.
    fn list<'a>(&'a self, prefix: &'a str) -> StoreFuture<'a, Vec<ObjectMeta>>;

    /// A URL that uploads exactly `size` bytes hashing to `sha256` to `key`
    /// (as far as the store can check them: `docs/object-stores.md` says
    /// what each store binds). With `holder`, the embedded store honours it
    /// only while that attempt is current; a provider's store cannot ask
    /// the coordinator, so it signs without the holder, and the URL's
    /// lifetime (`ttl`) is then all that bounds it.
    fn presign_put<'a>(
        &'a self,
        key: &'a ObjectKey,
        size: u64,
        sha256: [u8; 32],
        ttl: Duration,
        holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl>;

    /// A URL that reads `key` (whole or by byte ranges) and needs no
    /// header; `holder` as for [`ObjectStore::presign_put`].
    fn presign_get<'a>(
        &'a self,
        key: &'a ObjectKey,
        ttl: Duration,
        holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl>;
}

impl<T: ObjectStore + ?Sized> ObjectStore for Arc<T> {
    fn stat<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, Option<u64>> {
        (**self).stat(key)
    }

    fn delete<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, ()> {
        (**self).delete(key)
    }

    fn list<'a>(&'a self, prefix: &'a str) -> StoreFuture<'a, Vec<ObjectMeta>> {
        (**self).list(prefix)
    }

    fn presign_put<'a>(
        &'a self,
        key: &'a ObjectKey,
        size: u64,
        sha256: [u8; 32],
        ttl: Duration,
        holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        (**self).presign_put(key, size, sha256, ttl, holder)
    }

    fn presign_get<'a>(
        &'a self,
        key: &'a ObjectKey,
        ttl: Duration,
        holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        (**self).presign_get(key, ttl, holder)
    }
}

/// Wraps the store the server builds (e.g. in a [`FaultyStore`]).
pub type StoreLayer = Arc<dyn Fn(Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore> + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_outside_the_safe_shape_are_refused_with_the_reason() {
        let refused = [
            ("", "is empty"),
            ("/packs/a", "is absolute"),
            ("packs/../etc", "has a path segment starting with '.'"),
            ("packs/.tmp/x", "has a path segment starting with '.'"),
            ("packs//x", "has an empty path segment"),
            ("packs/x/", "has an empty path segment"),
            ("Packs/x", "has characters outside [a-z0-9/_.-]"),
            ("packs/x y", "has characters outside [a-z0-9/_.-]"),
        ];
        for (key, reason) in refused {
            match ObjectKey::new(key) {
                Err(ObjectStoreError::InvalidKey { reason: got, .. }) => {
                    assert_eq!(got, reason, "{key:?}")
                }
                other => panic!("{key:?} was not refused: {other:?}"),
            }
        }
        assert!(ObjectKey::new("x".repeat(MAX_KEY_LEN + 1)).is_err());
        assert!(ObjectKey::new("packs/default/ab/ab12-x_y.z").is_ok());
    }

    #[test]
    fn a_pack_key_names_its_tenant_and_pack_and_no_other_key_does() {
        let tenant: TenantId = "acme".parse().unwrap();
        let pack = PackId::from_digest(&[0xab; 32]);
        let key = ObjectKey::for_pack(&tenant, &pack);
        assert_eq!(key.pack(), Some((tenant, pack.clone())));
        for other in [
            "keys/acme/k1".to_owned(),
            format!("packs/acme/{}", pack.as_str()),
            format!("packs/acme/cd/{}", pack.as_str()),
            "packs/acme/ab/not-a-pack".to_owned(),
            format!("packs/acme/ab/{}/x", pack.as_str()),
        ] {
            assert_eq!(
                ObjectKey::new(other.clone()).unwrap().pack(),
                None,
                "{other}"
            );
        }
    }

    #[test]
    fn pack_keys_follow_the_store_layout() {
        let pack: PackId = format!("ab{}", "0".repeat(62)).parse().unwrap();
        let key = ObjectKey::for_pack(&TenantId::default_tenant(), &pack);
        assert_eq!(key.as_str(), format!("packs/default/ab/{pack}"));
        assert_eq!(ObjectKey::new(key.as_str()).unwrap(), key);
    }

    #[test]
    fn only_transient_failures_are_retryable() {
        let io = |kind: std::io::ErrorKind| ObjectStoreError::Io {
            op: StoreOp::Stat,
            key: "k".into(),
            source: kind.into(),
        };
        assert!(io(std::io::ErrorKind::TimedOut).is_retryable());
        assert!(!io(std::io::ErrorKind::PermissionDenied).is_retryable());
        assert!(!ObjectKey::new("..").unwrap_err().is_retryable());
        let down = ObjectStoreError::Unavailable {
            op: StoreOp::Stat,
            key: "k".into(),
            reason: "down".into(),
        };
        assert!(down.is_retryable());
    }
}
