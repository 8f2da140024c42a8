//! TLS on the coordinator's two listeners (rustls, ring).
//!
//! `serve --tls-cert --tls-key` puts gRPC and the blob server behind the
//! same certificate. `--tls-client-ca` adds mutual TLS for hosts: the gRPC
//! listener asks every client for a certificate and accepts a connection
//! without one (runners and `cairnctl` hold bearer tokens, not
//! certificates), and the auth layer then refuses host calls over such a
//! connection ([`crate::auth`]). The blob server never asks: signed URLs
//! are its credentials.
//!
//! Handshakes run in the per-connection task, under the same deadlines as a
//! request's headers, so a peer that stalls its handshake holds one slot
//! under the connection cap and nothing else.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use cairn_proto::tls::{self, PemSource, TlsError};
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use tokio_rustls::TlsAcceptor;

/// Where the coordinator's certificate, key and (for mutual TLS) the CA of
/// host certificates are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, leaf first (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA bundle host certificates must chain to; `None`: no mutual TLS.
    pub client_ca: Option<PathBuf>,
}

/// Ready-to-use TLS settings of both listeners.
#[derive(Clone)]
pub struct ServerTls {
    grpc: TlsAcceptor,
    blob: TlsAcceptor,
    hosts_need_certificates: bool,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("hosts_need_certificates", &self.hosts_need_certificates)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads and checks the files: the key must match the certificate, and
    /// the client CA bundle must hold a usable CA certificate.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        let chain = tls::certificates(&PemSource::File(files.cert.clone()), "server certificate")?;
        let key = tls::private_key(&PemSource::File(files.key.clone()), "server key")?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let rejected = |what: &'static str| {
            move |e: rustls::Error| TlsError::Rejected {
                what,
                error: e.to_string(),
            }
        };
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(rejected("TLS configuration"))?;
        let grpc_builder = match &files.client_ca {
            Some(path) => {
                let what = "client CA (--tls-client-ca)";
                let roots = tls::root_store(
                    &tls::certificates(&PemSource::File(path.clone()), what)?,
                    what,
                )?;
                let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider)
                    // Runners and cairnctl come without a certificate; the
                    // auth layer decides which calls need one.
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| TlsError::Rejected {
                        what,
                        error: e.to_string(),
                    })?;
                builder.clone().with_client_cert_verifier(verifier)
            }
            None => builder.clone().with_no_client_auth(),
        };
        let mut grpc = grpc_builder
            .with_single_cert(chain.der.clone(), key.clone_key())
            .map_err(rejected(
                "server certificate and key (--tls-cert, --tls-key)",
            ))?;
        grpc.alpn_protocols = vec![b"h2".to_vec()];
        let mut blob = builder
            .with_no_client_auth()
            .with_single_cert(chain.der, key)
            .map_err(rejected(
                "server certificate and key (--tls-cert, --tls-key)",
            ))?;
        // Uploads and downloads are one request each: HTTP/1.1, as without TLS.
        blob.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            grpc: TlsAcceptor::from(Arc::new(grpc)),
            blob: TlsAcceptor::from(Arc::new(blob)),
            hosts_need_certificates: files.client_ca.is_some(),
        })
    }

    pub fn grpc_acceptor(&self) -> &TlsAcceptor {
        &self.grpc
    }

    pub fn blob_acceptor(&self) -> &TlsAcceptor {
        &self.blob
    }

    /// Whether host calls must come over a connection that presented a
    /// certificate of the client CA.
    pub fn hosts_need_certificates(&self) -> bool {
        self.hosts_need_certificates
    }
}

/// Who is at the other end of a gRPC connection, as the services see it
/// (tonic puts it in every request's extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub addr: Option<SocketAddr>,
    /// The connection is TLS and its client presented a certificate that
    /// chains to the client CA (rustls refuses any other certificate).
    pub verified_client_certificate: bool,
}

/// Whether a failed handshake is the client's certificate being refused
/// (not a reset, a timeout or a client that does not speak TLS).
pub fn is_certificate_refusal(error: &std::io::Error) -> bool {
    error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|e| {
            matches!(
                e,
                rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
            )
        })
}
