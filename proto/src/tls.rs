//! TLS material of cairn's servers and clients: PEM certificates, private
//! keys and CA bundles, read from a file or given inline, with errors that
//! name what was being read and from where.
//!
//! Inline PEM exists for one reason: a sandbox started by `cairn-host` may
//! not see the host's files, so the host hands it the CA it trusts as the
//! value of `CAIRN_CA` itself.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// PEM files larger than this are refused (a CA bundle is a few hundred KiB).
const MAX_PEM_BYTES: u64 = 4 << 20;

/// Why TLS material could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("could not read the {what} from {source_name}: {error}")]
    Read {
        what: &'static str,
        source_name: String,
        error: std::io::Error,
    },
    #[error("the {what} in {source_name} is larger than {MAX_PEM_BYTES} bytes: not a PEM file")]
    TooLarge {
        what: &'static str,
        source_name: String,
    },
    #[error("the {what} in {source_name} is not valid PEM: {error}")]
    BadPem {
        what: &'static str,
        source_name: String,
        error: String,
    },
    #[error(
        "{source_name} holds no certificate for the {what} (expected a -----BEGIN CERTIFICATE----- block)"
    )]
    NoCertificate {
        what: &'static str,
        source_name: String,
    },
    #[error(
        "{source_name} holds no private key for the {what} (expected a PKCS#8, PKCS#1 or SEC1 PEM block)"
    )]
    NoKey {
        what: &'static str,
        source_name: String,
    },
    #[error("the {what} is not usable: {error}")]
    Rejected { what: &'static str, error: String },
}

/// Where PEM text comes from: a file, or the text itself.
#[derive(Clone, PartialEq, Eq)]
pub enum PemSource {
    File(PathBuf),
    Inline(String),
}

impl PemSource {
    /// A value that starts with `-----BEGIN` is PEM text; anything else is a
    /// path.
    pub fn parse(value: &str) -> Self {
        if value.trim_start().starts_with("-----BEGIN") {
            Self::Inline(value.to_owned())
        } else {
            Self::File(PathBuf::from(value))
        }
    }

    /// The PEM bytes (at most [`MAX_PEM_BYTES`]).
    pub fn read(&self, what: &'static str) -> Result<Vec<u8>, TlsError> {
        match self {
            Self::Inline(text) => Ok(text.clone().into_bytes()),
            Self::File(path) => {
                let read_error = |error| TlsError::Read {
                    what,
                    source_name: self.to_string(),
                    error,
                };
                let len = std::fs::metadata(path).map_err(read_error)?.len();
                if len > MAX_PEM_BYTES {
                    return Err(TlsError::TooLarge {
                        what,
                        source_name: self.to_string(),
                    });
                }
                std::fs::read(path).map_err(read_error)
            }
        }
    }
}

impl fmt::Display for PemSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => write!(f, "{}", path.display()),
            Self::Inline(_) => f.write_str("the inline PEM text"),
        }
    }
}

impl fmt::Debug for PemSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PemSource({self})")
    }
}

/// Certificates as PEM text and parsed, for APIs that want either.
#[derive(Clone)]
pub struct Certificates {
    pub pem: Vec<u8>,
    pub der: Vec<CertificateDer<'static>>,
}

impl fmt::Debug for Certificates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Certificates({} certificate(s))", self.der.len())
    }
}

/// Every certificate in `source` (at least one).
pub fn certificates(source: &PemSource, what: &'static str) -> Result<Certificates, TlsError> {
    let pem = source.read(what)?;
    let der = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, pem::Error>>()
        .map_err(|e| TlsError::BadPem {
            what,
            source_name: source.to_string(),
            error: e.to_string(),
        })?;
    if der.is_empty() {
        return Err(TlsError::NoCertificate {
            what,
            source_name: source.to_string(),
        });
    }
    Ok(Certificates { pem, der })
}

/// The first private key in `source`.
pub fn private_key(
    source: &PemSource,
    what: &'static str,
) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = source.read(what)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        pem::Error::NoItemsFound => TlsError::NoKey {
            what,
            source_name: source.to_string(),
        },
        other => TlsError::BadPem {
            what,
            source_name: source.to_string(),
            error: other.to_string(),
        },
    })
}

/// A root store holding every certificate of a CA bundle; refuses a bundle
/// none of whose certificates can be a trust anchor.
pub fn root_store(
    certificates: &Certificates,
    what: &'static str,
) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    let (_, ignored) = roots.add_parsable_certificates(certificates.der.iter().cloned());
    if roots.is_empty() {
        return Err(TlsError::Rejected {
            what,
            error: format!("none of its {ignored} certificate(s) is a usable CA certificate"),
        });
    }
    Ok(Arc::new(roots))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_pem_text_only_when_it_starts_like_pem() {
        assert_eq!(
            PemSource::parse("/etc/cairn/ca.pem"),
            PemSource::File("/etc/cairn/ca.pem".into())
        );
        assert!(matches!(
            PemSource::parse("\n-----BEGIN CERTIFICATE-----\nabc"),
            PemSource::Inline(_)
        ));
    }

    #[test]
    fn errors_name_what_was_read_and_where() {
        let missing = PemSource::File("/nonexistent/ca.pem".into());
        let e = certificates(&missing, "CA bundle (CAIRN_CA)").unwrap_err();
        assert!(matches!(e, TlsError::Read { .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
        assert!(e.to_string().contains("CAIRN_CA"), "{e}");

        let not_pem = PemSource::Inline("-----BEGIN CERTIFICATE-----\n!!!\n".into());
        let e = certificates(&not_pem, "CA bundle").unwrap_err();
        assert!(matches!(e, TlsError::BadPem { .. }), "{e}");

        let only_key = PemSource::Inline(
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n".into(),
        );
        assert!(matches!(
            certificates(&only_key, "server certificate"),
            Err(TlsError::NoCertificate { .. })
        ));
        let only_cert = PemSource::Inline(
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into(),
        );
        assert!(matches!(
            private_key(&only_cert, "server key"),
            Err(TlsError::NoKey { .. })
        ));
    }

    #[test]
    fn a_bundle_of_garbage_certificates_is_no_root_store() {
        let garbage = Certificates {
            pem: Vec::new(),
            der: vec![CertificateDer::from(vec![1u8, 2, 3])],
        };
        let e = root_store(&garbage, "client CA").unwrap_err();
        assert!(e.to_string().contains("none of its 1 certificate"), "{e}");
    }
}
