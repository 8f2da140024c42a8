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
//! A URL handed to a run token also names the token's attempt, inside the
//! signature, and is honoured only while that attempt is current (the blob
//! server asks the metadata), so a URL does not outlive its attempt's right
//! to the workspace:
//!
//! ```text
//! …&run=<run id>&attempt=<n>
//!
//! sig = HMAC-SHA256(url-signing key,
//!         "cairn-url-v1-attempt\n" METHOD "\n" key "\n" exp "\n" size "\n" sha256
//!         "\n" run "\n" attempt)
//! ```
//!
//! (Another domain string, so a URL cannot drop its attempt and still verify.)
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
use crate::tokens::RunBinding;

/// Length of the URL-signing key in bytes.
pub const SIGNING_KEY_LEN: usize = 32;

const DOMAIN: &str = "cairn-url-v1";
/// The domain of URLs bound to an attempt.
const ATTEMPT_DOMAIN: &str = "cairn-url-v1-attempt";

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
    run: Option<String>,
    attempt: Option<String>,
}

impl SignedQuery {
    /// Parses `exp=…&sig=…[&size=…&sha256=…][&run=…&attempt=…]`. Values are URL-safe by
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
                "run" => (&mut parsed.run, "run"),
                "attempt" => (&mut parsed.attempt, "attempt"),
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

    fn message(
        key: &ObjectKey,
        grant: &Grant,
        expires: u64,
        holder: Option<&RunBinding>,
    ) -> Vec<u8> {
        let (size, sha256) = match grant {
            Grant::Get => (String::new(), String::new()),
            Grant::Put { size, sha256 } => (size.to_string(), hex::encode(sha256)),
        };
        let method = grant.method();
        let key = key.as_str();
        match holder {
            None => format!("{DOMAIN}\n{method}\n{key}\n{expires}\n{size}\n{sha256}"),
            Some(RunBinding { run, attempt }) => format!(
                "{ATTEMPT_DOMAIN}\n{method}\n{key}\n{expires}\n{size}\n{sha256}\n{run}\n{attempt}"
            ),
        }
        .into_bytes()
    }

    /// The query string (without `?`) granting `grant` on `key` until `expires`
    /// (Unix seconds), to `holder`'s attempt only when one is given.
    pub fn sign_query(
        &self,
        key: &ObjectKey,
        grant: &Grant,
        expires: u64,
        holder: Option<&RunBinding>,
    ) -> String {
        let tag = hmac::sign(&self.key, &Self::message(key, grant, expires, holder));
        let sig = URL_SAFE_NO_PAD.encode(tag.as_ref());
        let mut query = match grant {
            Grant::Get => format!("exp={expires}&sig={sig}"),
            Grant::Put { size, sha256 } => {
                format!(
                    "exp={expires}&sig={sig}&size={size}&sha256={}",
                    hex::encode(sha256)
                )
            }
        };
        if let Some(RunBinding { run, attempt }) = holder {
            query.push_str(&format!("&run={run}&attempt={attempt}"));
        }
        query
    }

    /// Checks that `query` grants a read (`put == false`) or a write of `key`
    /// at time `now` (Unix seconds); returns the grant and the attempt it
    /// was signed for, if any (whether that attempt is current is the
    /// caller's to ask).
    pub fn verify(
        &self,
        key: &ObjectKey,
        put: bool,
        query: &SignedQuery,
        now: u64,
    ) -> Result<(Grant, Option<RunBinding>), SignatureError> {
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
        let holder = match (query.run.as_deref(), query.attempt.as_deref()) {
            (None, None) => None,
            (Some(run), Some(attempt)) => Some(RunBinding {
                run: run.parse().map_err(|_| SignatureError::Malformed("run"))?,
                attempt: attempt
                    .parse()
                    .map_err(|_| SignatureError::Malformed("attempt"))?,
            }),
            (None, Some(_)) => return Err(SignatureError::Missing("run")),
            (Some(_), None) => return Err(SignatureError::Missing("attempt")),
        };
        hmac::verify(
            &self.key,
            &Self::message(key, &grant, expires, holder.as_ref()),
            &sig,
        )
        .map_err(|_| SignatureError::Mismatch)?;
        // Checked after the signature so that only genuine URLs learn they
        // expired. `exp` is the first second the URL is no longer valid.
        if now >= expires {
            return Err(SignatureError::Expired);
        }
        Ok((grant, holder))
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
        let q = query(&s.sign_query(&key("packs/a/b"), &Grant::Get, 1000, None));
        assert_eq!(
            s.verify(&key("packs/a/b"), false, &q, 999),
            Ok((Grant::Get, None))
        );
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
        let signed = s.sign_query(&key("k"), &grant, 1000, None);
        assert_eq!(
            s.verify(&key("k"), true, &query(&signed), 5),
            Ok((grant, None))
        );
        assert_eq!(
            s.verify(&key("k"), false, &query(&signed), 5),
            Err(SignatureError::Mismatch)
        );
        let bigger = signed.replace("size=42", "size=43");
        assert_eq!(
            s.verify(&key("k"), true, &query(&bigger), 5),
            Err(SignatureError::Mismatch)
        );
        let get = s.sign_query(&key("k"), &Grant::Get, 1000, None);
        assert_eq!(
            s.verify(&key("k"), true, &query(&get), 5),
            Err(SignatureError::Missing("size"))
        );
    }

    #[test]
    fn a_later_expiry_does_not_verify() {
        let s = signer(1);
        let signed = s.sign_query(&key("k"), &Grant::Get, 1000, None);
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
    fn a_url_signed_for_an_attempt_names_it_and_cannot_drop_or_change_it() {
        let s = signer(1);
        let run: cairn_proto::ids::RunId = cairn_proto::ids::RunId::generate();
        let holder = RunBinding {
            run: run.clone(),
            attempt: 2,
        };
        let signed = s.sign_query(&key("k"), &Grant::Get, 1000, Some(&holder));
        assert!(signed.contains(&format!("run={run}&attempt=2")), "{signed}");
        assert_eq!(
            s.verify(&key("k"), false, &query(&signed), 5),
            Ok((Grant::Get, Some(holder.clone())))
        );
        let dropped = signed.replace(&format!("&run={run}&attempt=2"), "");
        assert_eq!(
            s.verify(&key("k"), false, &query(&dropped), 5),
            Err(SignatureError::Mismatch),
            "without its attempt the URL does not verify"
        );
        let other_attempt = signed.replace("attempt=2", "attempt=3");
        assert_eq!(
            s.verify(&key("k"), false, &query(&other_attempt), 5),
            Err(SignatureError::Mismatch)
        );
        let half = signed.replace("&attempt=2", "");
        assert_eq!(
            s.verify(&key("k"), false, &query(&half), 5),
            Err(SignatureError::Missing("attempt"))
        );
        let unbound = s.sign_query(&key("k"), &Grant::Get, 1000, None);
        let grafted = format!("{unbound}&run={run}&attempt=2");
        assert_eq!(
            s.verify(&key("k"), false, &query(&grafted), 5),
            Err(SignatureError::Mismatch),
            "an attempt added to an unbound URL does not verify"
        );
    }

    #[test]
    fn expiry_is_never_shorter_than_the_ttl() {
        let before = unix_now();
        assert!(expiry_after(Duration::from_secs(60)) >= before + 60);
    }
}
