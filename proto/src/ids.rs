//! Newtype ids.
//!
//! Generated ids are a kind prefix plus 26 characters of lower-case Crockford
//! base32 of a UUIDv7, so they sort by creation time and say what they name:
//! `ws-01jh…` (workspace), `ck-…` (checkpoint), `run-…`, `host-…`, `tok-…`.
//! Content ids ([`BlobId`], [`PackId`]) are digests, not generated.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ValidationError;

const CROCKFORD: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";
const ENCODED_LEN: usize = 26;

fn encode_uuid(uuid: uuid::Uuid) -> String {
    let value = uuid.as_u128();
    (0..ENCODED_LEN)
        .map(|i| {
            let shift = 5 * (ENCODED_LEN - 1 - i);
            CROCKFORD[((value >> shift) & 0x1f) as usize] as char
        })
        .collect()
}

fn valid_encoded(s: &str) -> bool {
    s.len() == ENCODED_LEN
        && s.bytes().all(|b| CROCKFORD.contains(&b))
        // 26 * 5 = 130 bits; the first character carries only 3 of the 128.
        && s.as_bytes()[0] <= b'7'
}

macro_rules! prefixed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal, $field:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// The prefix every id of this kind starts with.
            pub const PREFIX: &'static str = $prefix;

            /// A new, time-ordered id.
            pub fn generate() -> Self {
                Self(format!("{}{}", $prefix, encode_uuid(uuid::Uuid::now_v7())))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// Whether `s` has the shape of this kind of id (used to tell ids from names).
            pub fn looks_like(s: &str) -> bool {
                s.strip_prefix($prefix).is_some_and(valid_encoded)
            }
        }

        impl FromStr for $name {
            type Err = ValidationError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                if Self::looks_like(s) {
                    Ok(Self(s.to_owned()))
                } else if s.is_empty() {
                    Err(ValidationError::new($field, "is empty"))
                } else {
                    Err(ValidationError::new(
                        $field,
                        format!("{s:?} is not a valid id (expected {}<26 base32 characters>)", $prefix),
                    ))
                }
            }
        }

        impl TryFrom<String> for $name {
            type Error = ValidationError;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                s.parse()
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

prefixed_id!(
    /// A workspace: the durable unit that holds checkpoints.
    WorkspaceId, "ws-", "workspace_id"
);
prefixed_id!(
    /// An immutable checkpoint of a workspace.
    CheckpointId, "ck-", "checkpoint_id"
);
prefixed_id!(
    /// A run: one request for agent work on a workspace.
    RunId, "run-", "run_id"
);
prefixed_id!(
    /// A host that runs sandboxes.
    HostId, "host-", "host_id"
);
prefixed_id!(
    /// One checkpoint commit as the runner meant it: the same id sent again
    /// (a retry after a call was cut off) gets the checkpoint it made, not
    /// a second one.
    CommitRequestId, "cr-", "request_id"
);
prefixed_id!(
    /// A bearer token's public name: listed and revoked by it, never the
    /// token's text (which the coordinator does not keep).
    TokenId, "tok-", "token_id"
);

/// A tenant: the scope of names, tokens and hosts. (Deduplication and keys
/// are scoped to a workspace and its lineage.)
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TenantId(String);

impl TenantId {
    pub const DEFAULT: &'static str = "default";

    pub fn default_tenant() -> Self {
        Self(Self::DEFAULT.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for TenantId {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if ok {
            Ok(Self(s.to_owned()))
        } else {
            Err(ValidationError::new(
                "tenant",
                format!("{s:?} is not a tenant name (1-64 of a-z, 0-9, '-')"),
            ))
        }
    }
}

impl TryFrom<String> for TenantId {
    type Error = ValidationError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<TenantId> for String {
    fn from(id: TenantId) -> String {
        id.0
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The fencing number of a workspace's attempts. A commit or report carrying
/// an older generation than the workspace's current one is refused.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default, Serialize, Deserialize,
)]
pub struct Generation(pub u64);

impl Generation {
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// Keyed id of a blob: HMAC-SHA256 of its plaintext under the tenant's id key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobId(pub [u8; 32]);

impl BlobId {
    pub const LEN: usize = 32;

    pub fn from_slice(bytes: &[u8]) -> Result<Self, ValidationError> {
        let array: [u8; 32] = bytes.try_into().map_err(|_| {
            ValidationError::new("blob_id", format!("is {} bytes, expected 32", bytes.len()))
        })?;
        Ok(Self(array))
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }
}

impl fmt::Debug for BlobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex()[..16])
    }
}

impl fmt::Display for BlobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A pack: lower-case hex SHA-256 of its bytes, which is also its object key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PackId(String);

impl PackId {
    pub fn from_digest(digest: &[u8; 32]) -> Self {
        let mut s = String::with_capacity(64);
        for b in digest {
            s.push_str(&format!("{b:02x}"));
        }
        Self(s)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The raw 32-byte SHA-256 digest.
    pub fn digest(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (i, chunk) in self.0.as_bytes().chunks(2).enumerate() {
            let hex = std::str::from_utf8(chunk).expect("validated ascii hex");
            out[i] = u8::from_str_radix(hex, 16).expect("validated hex");
        }
        out
    }
}

impl FromStr for PackId {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() == 64
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            Ok(Self(s.to_owned()))
        } else {
            Err(ValidationError::new(
                "pack_id",
                format!("{s:?} is not a pack id (64 lower-case hex digits)"),
            ))
        }
    }
}

impl TryFrom<String> for PackId {
    type Error = ValidationError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<PackId> for String {
    fn from(id: PackId) -> String {
        id.0
    }
}

impl fmt::Display for PackId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for PackId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0[..12])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_parse_back_and_sort_by_time() {
        let a = WorkspaceId::generate();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = WorkspaceId::generate();
        assert!(a < b, "{a} should sort before {b}");
        assert_eq!(a.as_str().parse::<WorkspaceId>().unwrap(), a);
        assert!(a.as_str().starts_with("ws-"));
    }

    #[test]
    fn ids_of_the_wrong_kind_are_refused_with_the_field_name() {
        let ck = CheckpointId::generate();
        let err = ck.as_str().parse::<WorkspaceId>().unwrap_err();
        assert_eq!(err.field, "workspace_id");
        assert!(!WorkspaceId::looks_like("my-workspace"));
        assert!("ws-".parse::<WorkspaceId>().is_err());
    }

    #[test]
    fn pack_ids_round_trip_their_digest() {
        let digest = [0xabu8; 32];
        let id = PackId::from_digest(&digest);
        assert_eq!(id.digest(), digest);
        assert!("ABCD".parse::<PackId>().is_err());
    }
}
