//! Certificates for the TLS tests, made with rcgen: a CA, the coordinator's
//! certificate (for `localhost` and `127.0.0.1`), a host's client
//! certificate, and a second, unrelated CA with a client certificate of its
//! own (what an impostor would hold).

use std::fs;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// PEM files in a directory.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA that signed the coordinator's and the host's certificates.
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub host_cert: PathBuf,
    pub host_key: PathBuf,
    /// An unrelated CA, and a client certificate it signed.
    pub rogue_ca: PathBuf,
    pub rogue_host_cert: PathBuf,
    pub rogue_host_key: PathBuf,
    /// A server certificate for the same names, signed by that other CA
    /// (what a renewal by another CA looks like).
    pub other_server_cert: PathBuf,
    pub other_server_key: PathBuf,
}

fn new_ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names to check");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("a P-256 key generates"))
        .expect("a CA certificate signs")
}

fn leaf(
    issuer: &CertifiedIssuer<'static, KeyPair>,
    name: &str,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let mut params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .expect("valid names");
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![usage];
    let key = KeyPair::generate().expect("a P-256 key generates");
    let cert = params.signed_by(&key, issuer).expect("a leaf signs");
    (cert.pem(), key.serialize_pem())
}

impl TlsFiles {
    /// Writes a fresh set of certificates into `dir`.
    pub fn generate(dir: &Path) -> Self {
        fs::create_dir_all(dir).expect("the TLS directory can be made");
        let write = |name: &str, pem: &str| {
            let path = dir.join(name);
            fs::write(&path, pem).expect("a PEM file can be written");
            path
        };
        let ca = new_ca("cairn test CA");
        let (server_cert, server_key) = leaf(
            &ca,
            "coordinator",
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (host_cert, host_key) = leaf(&ca, "host-a", &[], ExtendedKeyUsagePurpose::ClientAuth);
        let rogue = new_ca("someone else's CA");
        let (rogue_host_cert, rogue_host_key) =
            leaf(&rogue, "impostor", &[], ExtendedKeyUsagePurpose::ClientAuth);
        let (other_server_cert, other_server_key) = leaf(
            &rogue,
            "coordinator",
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        Self {
            ca: write("ca.pem", &ca.pem()),
            server_cert: write("coordinator.pem", &server_cert),
            server_key: write("coordinator.key", &server_key),
            host_cert: write("host.pem", &host_cert),
            host_key: write("host.key", &host_key),
            rogue_ca: write("rogue-ca.pem", &rogue.pem()),
            rogue_host_cert: write("rogue-host.pem", &rogue_host_cert),
            rogue_host_key: write("rogue-host.key", &rogue_host_key),
            other_server_cert: write("other-coordinator.pem", &other_server_cert),
            other_server_key: write("other-coordinator.key", &other_server_key),
        }
    }

    /// `serve` flags for TLS, with mutual TLS for hosts when `mtls`.
    pub fn serve_args(&self, mtls: bool) -> Vec<String> {
        let mut args = vec![
            "--tls-cert".to_owned(),
            self.server_cert.display().to_string(),
            "--tls-key".to_owned(),
            self.server_key.display().to_string(),
        ];
        if mtls {
            args.push("--tls-client-ca".to_owned());
            args.push(self.ca.display().to_string());
        }
        args
    }
}
