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
//!
//! The certificate and key are read again when their files change
//! ([`ReloadingCertificate::reload_if_changed`], polled by the
//! coordinator), so a renewed certificate (cert-manager, certbot) is served
//! without a restart; new files that do not load leave the old certificate
//! in place. The client CA is read once.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use cairn_proto::tls::{self, PemSource, TlsError};
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
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
    certificate: Arc<ReloadingCertificate>,
}

/// The server certificate both listeners present, read again from its files
/// when they change.
#[derive(Debug)]
pub struct ReloadingCertificate {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<CertifiedKey>>,
    /// The files' modification times when `current` was read.
    read_at: Mutex<Option<(SystemTime, SystemTime)>>,
}

impl ReloadingCertificate {
    fn load(cert: &Path, key: &Path, provider: Arc<CryptoProvider>) -> Result<Self, TlsError> {
        let stamps = modified(cert, key);
        let current = certified_key(cert, key, &provider)?;
        Ok(Self {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            provider,
            current: RwLock::new(Arc::new(current)),
            read_at: Mutex::new(stamps),
        })
    }

    /// Reads the files again if either changed since they were last read;
    /// `Ok(true)` when a new certificate is served from now on. On an error
    /// the old one stays, and the files are tried again once they change.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let stamps = modified(&self.cert, &self.key);
        {
            let mut read_at = self.read_at.lock().expect("not poisoned");
            if stamps.is_none() || *read_at == stamps {
                return Ok(false);
            }
            *read_at = stamps;
        }
        let fresh = certified_key(&self.cert, &self.key, &self.provider)?;
        *self.current.write().expect("not poisoned") = Arc::new(fresh);
        Ok(true)
    }

    /// The end-entity certificate served now (DER).
    pub fn serving(&self) -> Vec<u8> {
        let current = self.current.read().expect("not poisoned");
        current.cert.first().map(|c| c.to_vec()).unwrap_or_default()
    }
}

impl ResolvesServerCert for ReloadingCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().expect("not poisoned").clone())
    }
}

/// Both files' modification times, when both can be read.
fn modified(cert: &Path, key: &Path) -> Option<(SystemTime, SystemTime)> {
    let time = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    Some((time(cert)?, time(key)?))
}

/// The chain and key in these files, checked to belong together.
fn certified_key(
    cert: &Path,
    key: &Path,
    provider: &CryptoProvider,
) -> Result<CertifiedKey, TlsError> {
    let chain = tls::certificates(&PemSource::File(cert.to_path_buf()), "server certificate")?;
    let key = tls::private_key(&PemSource::File(key.to_path_buf()), "server key")?;
    CertifiedKey::from_der(chain.der, key, provider).map_err(|e| TlsError::Rejected {
        what: "server certificate and key (--tls-cert, --tls-key)",
        error: e.to_string(),
    })
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
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certificate = Arc::new(ReloadingCertificate::load(
            &files.cert,
            &files.key,
            provider.clone(),
        )?);
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
        let mut grpc = grpc_builder.with_cert_resolver(certificate.clone());
        grpc.alpn_protocols = vec![b"h2".to_vec()];
        let mut blob = builder
            .with_no_client_auth()
            .with_cert_resolver(certificate.clone());
        // Uploads and downloads are one request each: HTTP/1.1, as without TLS.
        blob.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            grpc: TlsAcceptor::from(Arc::new(grpc)),
            blob: TlsAcceptor::from(Arc::new(blob)),
            hosts_need_certificates: files.client_ca.is_some(),
            certificate,
        })
    }

    /// The certificate both listeners serve, for reloading.
    pub fn certificate(&self) -> &Arc<ReloadingCertificate> {
        &self.certificate
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
