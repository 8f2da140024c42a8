//! TLS for cairn's clients: which CA they trust and, for hosts, the client
//! certificate they present.
//!
//! Every client (`cairn-runner`, `cairn-host`, `cairnctl`) reads `CAIRN_CA`:
//! a PEM bundle, as a path or as the PEM text itself. When it is set, its
//! certificates are the only roots trusted, for gRPC and for signed URLs
//! alike (append the system bundle to it to trust public CAs too); when it
//! is unset, the public web roots are. `http://` addresses never use TLS.
//! `cairn-host` hands the bundle to its sandboxes as PEM text in `CAIRN_CA`,
//! since a sandbox may not see the host's files.

use cairn_proto::tls::{self, Certificates, PemSource, TlsError};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// The variable naming the CA bundle clients trust.
pub const CA_VAR: &str = "CAIRN_CA";

/// What a client trusts and presents over TLS.
#[derive(Clone, Default)]
pub struct ClientTls {
    ca: Option<Certificates>,
    identity: Option<ClientIdentity>,
}

#[derive(Clone)]
struct ClientIdentity {
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca", &self.ca)
            .field("identity", &self.identity.is_some())
            .finish()
    }
}

impl ClientTls {
    /// Trusts the bundle in `CAIRN_CA`, if set (else the public web roots).
    pub fn from_env() -> Result<Self, TlsError> {
        match std::env::var(CA_VAR) {
            Ok(value) if !value.trim().is_empty() => Self::trusting(&PemSource::parse(&value)),
            _ => Ok(Self::default()),
        }
    }

    /// Trusts only the certificates in `bundle`.
    pub fn trusting(bundle: &PemSource) -> Result<Self, TlsError> {
        let what = "CA bundle (CAIRN_CA)";
        let ca = tls::certificates(bundle, what)?;
        // Checked here so a bad bundle fails with its name, not at the
        // first handshake.
        tls::root_store(&ca, what)?;
        Ok(Self {
            ca: Some(ca),
            identity: None,
        })
    }

    /// Also presents `cert` (a PEM chain, leaf first) with its `key` to
    /// servers that ask for a client certificate (mutual TLS).
    pub fn with_identity(self, cert: &PemSource, key: &PemSource) -> Result<Self, TlsError> {
        let chain = tls::certificates(cert, "client certificate")?;
        let private = tls::private_key(key, "client key")?;
        // The key must be of a kind rustls can sign with.
        rustls::crypto::ring::sign::any_supported_type(&private).map_err(|e| {
            TlsError::Rejected {
                what: "client key",
                error: e.to_string(),
            }
        })?;
        Ok(Self {
            identity: Some(ClientIdentity {
                cert: chain.pem,
                key: key.read("client key")?,
            }),
            ..self
        })
    }

    /// The trusted bundle as PEM text, to hand to a sandbox as `CAIRN_CA`.
    pub fn ca_pem(&self) -> Option<String> {
        self.ca
            .as_ref()
            .map(|ca| String::from_utf8_lossy(&ca.pem).into_owned())
    }

    /// `endpoint` (at `address`) with TLS when `address` is `https://`.
    pub fn configure(
        &self,
        endpoint: Endpoint,
        address: &str,
    ) -> Result<Endpoint, tonic::transport::Error> {
        if !address.starts_with("https://") {
            return Ok(endpoint);
        }
        let mut config = ClientTlsConfig::new();
        config = match &self.ca {
            Some(ca) => config.ca_certificate(Certificate::from_pem(&ca.pem)),
            None => config.with_webpki_roots(),
        };
        if let Some(identity) = &self.identity {
            config = config.identity(Identity::from_pem(&identity.cert, &identity.key));
        }
        endpoint.tls_config(config)
    }

    /// `builder` trusting this bundle (only it) for `https://` URLs.
    pub fn configure_http(&self, builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
        match &self.ca {
            None => builder,
            Some(ca) => {
                ca.der
                    .iter()
                    .fold(builder.tls_built_in_root_certs(false), |builder, der| {
                        match reqwest::Certificate::from_der(der) {
                            Ok(certificate) => builder.add_root_certificate(certificate),
                            // Parsed once already; reqwest accepts any DER.
                            Err(_) => builder,
                        }
                    })
            }
        }
    }
}

/// `error` and each of its causes, joined: tonic and reqwest say what went
/// wrong (a certificate, a refused connection) only in their sources.
pub fn describe_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut messages = vec![error.to_string()];
    let mut source = error.source();
    while let Some(cause) = source {
        messages.push(cause.to_string());
        source = cause.source();
    }
    // Wrappers often repeat their cause ("transport error: X" over "X"):
    // a message the next one already contains, or that contains the next
    // one and says nothing more, is dropped.
    let mut kept: Vec<String> = Vec::new();
    for message in messages {
        if kept.iter().any(|k| k.contains(message.as_str())) {
            continue;
        }
        kept.retain(|k| !message.contains(k.as_str()));
        kept.push(message);
    }
    kept.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_address_gets_no_tls_and_errors_name_their_cause() {
        let tls = ClientTls::default();
        let endpoint = Endpoint::from_static("http://127.0.0.1:7400");
        assert!(tls.configure(endpoint, "http://127.0.0.1:7400").is_ok());
        assert!(tls.ca_pem().is_none());

        let e = ClientTls::trusting(&PemSource::File("/nonexistent/ca.pem".into())).unwrap_err();
        assert!(e.to_string().contains("CAIRN_CA"), "{e}");
    }

    #[test]
    fn a_chain_of_errors_reads_as_one_line() {
        let inner = std::io::Error::other("invalid peer certificate: UnknownIssuer");
        let outer = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, inner);
        // io::Error displays its inner error and has it as its source too.
        assert_eq!(
            describe_chain(&outer),
            "invalid peer certificate: UnknownIssuer"
        );

        #[derive(Debug)]
        struct Wrapper(&'static str, Option<Box<Wrapper>>);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|w| w as _)
            }
        }
        // tonic's shape: a bare wrapper, a cause that repeats it, the root.
        let tonic_like = Wrapper(
            "transport error",
            Some(Box::new(Wrapper(
                "transport error: invalid peer certificate: UnknownIssuer",
                Some(Box::new(Wrapper(
                    "invalid peer certificate: UnknownIssuer",
                    None,
                ))),
            ))),
        );
        assert_eq!(
            describe_chain(&tonic_like),
            "transport error: invalid peer certificate: UnknownIssuer"
        );
        let distinct = Wrapper(
            "error sending request",
            Some(Box::new(Wrapper("connection refused", None))),
        );
        assert_eq!(
            describe_chain(&distinct),
            "error sending request: connection refused"
        );
    }
}
