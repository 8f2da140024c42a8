//! Signed URLs of the embedded blob store.
//!
//! A URL grants one method on one object until it expires:
//!
//! ```text
//! GET/HEAD  <blob base>/o/<object key>?exp=<unix secs>&sig=<base64url>
//! PUT       <blob base>/o/<object key>?exp=<unix secs>&sig=<base64url>&size=<bytes>&sha256=<hex>
//!
//! sig = HMAC-SHA256(url-signing key,
//!         "cairn-url-v1\n" METHOD "\n" key "\n" exp "\n" size "\n" sha256)
//! ```
//!
//! GET and HEAD share one signature (method `GET`, empty size and sha256), so
//! a PUT URL is useless for reading and a GET URL useless for writing. The
//! key is 32 random bytes kept in the data dir; only the coordinator (which
//! signs) and its embedded blob server (which verifies) hold it. Verification
//! is constant-time (`ring::hmac::verify`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;

use crate::store::ObjectKey;

/// Length of the URL-signing key in bytes.
pub const SIGNING_KEY_LEN: usize = 32;

const DOMAIN: &str = "cairn-url-v1";

/// What a signed URL allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// Read the object (GET, and HEAD for its size).
    Get,
    /// Write exactly these bytes to the object.
    Put { size: u64, sha256: [u8; 32] },
}

impl Grant {
    fn method(&self) -> &'static str {
        match self {
            Self::Get => "GET",
            Self::Put { .. } => "PUT",
        }
    }
}

/// Why a signed URL does not allow a request. Every case is a 403 to the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the URL carries no {0} parameter")]
    Missing(&'static str),
    #[error("the URL's {0} parameter is malformed")]
    Malformed(&'static str),
    #[error("the signature does not match the method, object and parameters")]
    Mismatch,
    #[error("the signed URL expired")]
    Expired,
}

/// The signing parameters of a URL's query string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SignedQuery {
    exp: Option<String>,
    sig: Option<String>,
    size: Option<String>,
    sha256: Option<String>,
}

impl SignedQuery {
    /// Parses `exp=…&sig=…[&size=…&sha256=…]`. Values are URL-safe by
    /// construction, so no percent-decoding is needed; a repeated parameter
    /// is malformed rather than resolved either way.
    pub fn parse(query: &str) -> Result<Self, SignatureError> {
        let mut parsed = Self::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let (slot, field) = match name {
                "exp" => (&mut parsed.exp, "exp"),
                "sig" => (&mut parsed.sig, "sig"),
                "size" => (&mut parsed.size, "size"),
                "sha256" => (&mut parsed.sha256, "sha256"),
                _ => continue,
            };
            if slot.replace(value.to_owned()).is_some() {
                return Err(SignatureError::Malformed(field));
            }
        }
        Ok(parsed)
    }
}

/// Signs and verifies blob URLs with the coordinator's URL-signing key.
#[derive(Clone)]
pub struct UrlSigner {
    key: hmac::Key,
}

impl std::fmt::Debug for UrlSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UrlSigner").finish_non_exhaustive()
    }
}

impl UrlSigner {
    pub fn new(secret: &[u8; SIGNING_KEY_LEN]) -> Self {
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
        }
    }

    fn message(key: &ObjectKey, grant: &Grant, expires: u64) -> Vec<u8> {
        let (size, sha256) = match grant {
            Grant::Get => (String::new(), String::new()),
            Grant::Put { size, sha256 } => (size.to_string(), hex::encode(sha256)),
        };
        format!(
            "{DOMAIN}\n{}\n{}\n{expires}\n{size}\n{sha256}",
            grant.method(),
            key.as_str()
        )
        .into_bytes()
    }

    /// The query string (without `?`) granting `grant` on `key` until `expires`
    /// (Unix seconds).
    pub fn sign_query(&self, key: &ObjectKey, grant: &Grant, expires: u64) -> String {
        let tag = hmac::sign(&self.key, &Self::message(key, grant, expires));
        let sig = URL_SAFE_NO_PAD.encode(tag.as_ref());
        match grant {
            Grant::Get => format!("exp={expires}&sig={sig}"),
            Grant::Put { size, sha256 } => {
                format!(
                    "exp={expires}&sig={sig}&size={size}&sha256={}",
                    hex::encode(sha256)
                )
            }
        }
    }

    /// Checks that `query` grants a read (`put == false`) or a write of `key`
    /// at time `now` (Unix seconds), and returns the grant.
    pub fn verify(
        &self,
        key: &ObjectKey,
        put: bool,
        query: &SignedQuery,
        now: u64,
    ) -> Result<Grant, SignatureError> {
        let exp = query.exp.as_deref().ok_or(SignatureError::Missing("exp"))?;
        let expires: u64 = exp.parse().map_err(|_| SignatureError::Malformed("exp"))?;
        let sig = query.sig.as_deref().ok_or(SignatureError::Missing("sig"))?;
        let sig = URL_SAFE_NO_PAD
            .decode(sig)
            .map_err(|_| SignatureError::Malformed("sig"))?;
        let grant = if put {
            let size = query
                .size
                .as_deref()
                .ok_or(SignatureError::Missing("size"))?;
            let size = size
                .parse()
                .map_err(|_| SignatureError::Malformed("size"))?;
            let digest = query
                .sha256
                .as_deref()
                .ok_or(SignatureError::Missing("sha256"))?;
            let mut sha256 = [0u8; 32];
            hex::decode_to_slice(digest, &mut sha256)
                .map_err(|_| SignatureError::Malformed("sha256"))?;
            Grant::Put { size, sha256 }
        } else {
            Grant::Get
        };
        hmac::verify(&self.key, &Self::message(key, &grant, expires), &sig)
            .map_err(|_| SignatureError::Mismatch)?;
        // Checked after the signature so that only genuine URLs learn they
        // expired. `exp` is the first second the URL is no longer valid.
        if now >= expires {
            return Err(SignatureError::Expired);
        }
        Ok(grant)
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// The expiry (Unix seconds) of a URL signed now for `ttl`, rounded up so a
/// URL lives at least `ttl` and less than a second longer.
pub fn expiry_after(ttl: Duration) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (now + ttl).as_secs() + u64::from((now + ttl).subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> ObjectKey {
        ObjectKey::new(s).unwrap()
    }

    fn signer(byte: u8) -> UrlSigner {
        UrlSigner::new(&[byte; 32])
    }

    fn query(q: &str) -> SignedQuery {
        SignedQuery::parse(q).unwrap()
    }

    #[test]
    fn a_get_url_verifies_for_its_key_until_it_expires() {
        let s = signer(1);
        let q = query(&s.sign_query(&key("packs/a/b"), &Grant::Get, 1000));
        assert_eq!(s.verify(&key("packs/a/b"), false, &q, 999), Ok(Grant::Get));
        assert_eq!(
            s.verify(&key("packs/a/b"), false, &q, 1000),
            Err(SignatureError::Expired)
        );
        assert_eq!(
            s.verify(&key("packs/a/c"), false, &q, 10),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            signer(2).verify(&key("packs/a/b"), false, &q, 10),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn a_put_url_binds_size_and_digest_and_is_no_get_url() {
        let s = signer(1);
        let grant = Grant::Put {
            size: 42,
            sha256: [7; 32],
        };
        let signed = s.sign_query(&key("k"), &grant, 1000);
        assert_eq!(s.verify(&key("k"), true, &query(&signed), 5), Ok(grant));
        assert_eq!(
            s.verify(&key("k"), false, &query(&signed), 5),
            Err(SignatureError::Mismatch)
        );
        let bigger = signed.replace("size=42", "size=43");
        assert_eq!(
            s.verify(&key("k"), true, &query(&bigger), 5),
            Err(SignatureError::Mismatch)
        );
        let get = s.sign_query(&key("k"), &Grant::Get, 1000);
        assert_eq!(
            s.verify(&key("k"), true, &query(&get), 5),
            Err(SignatureError::Missing("size"))
        );
    }

    #[test]
    fn a_later_expiry_does_not_verify() {
        let s = signer(1);
        let signed = s.sign_query(&key("k"), &Grant::Get, 1000);
        let extended = signed.replace("exp=1000", "exp=9999");
        assert_eq!(
            s.verify(&key("k"), false, &query(&extended), 5),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn malformed_queries_name_the_parameter() {
        let s = signer(1);
        assert_eq!(
            s.verify(&key("k"), false, &query("sig=abc"), 5),
            Err(SignatureError::Missing("exp"))
        );
        assert_eq!(
            s.verify(&key("k"), false, &query("exp=x&sig=abc"), 5),
            Err(SignatureError::Malformed("exp"))
        );
        assert_eq!(
            s.verify(&key("k"), false, &query("exp=1&sig=***"), 0),
            Err(SignatureError::Malformed("sig"))
        );
        assert_eq!(
            SignedQuery::parse("exp=1&exp=2"),
            Err(SignatureError::Malformed("exp"))
        );
    }

    #[test]
    fn expiry_is_never_shorter_than_the_ttl() {
        let before = unix_now();
        assert!(expiry_after(Duration::from_secs(60)) >= before + 60);
    }
}
