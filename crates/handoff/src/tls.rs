//! Credentials for the links between kvfence processes: TLS 1.3 with mutual,
//! role-bound certificates (rustls).
//!
//! A cluster has one certificate authority. Every process holds a
//! certificate for its [`Role`], issued by that CA and naming the role as a
//! DNS subject name (`kvfence-router`, `kvfence-prefill`, `kvfence-decode`).
//! Each end of a link checks the other's chain against the cluster CA *and*
//! its role: a client dials a server by the role it expects (rustls checks the
//! server's name), and a server accepts a client only if its certificate
//! names a role allowed on that listener ([`peer_role`]). So a prefill
//! worker's certificate cannot act as a router, and a certificate from
//! another CA opens nothing.
//!
//! TLS gives each link confidentiality (KV is prompt content in another form)
//! and integrity (a flipped byte fails the record's AEAD tag and ends the
//! link); the hand-off's own checks — epoch, generation, coverage, digest —
//! still guard the pages, whatever the transport.
//!
//! [`ClusterCa::generate`] and [`ClusterCa::write_dir`] are what
//! `kvfence cluster init` runs; [`Credentials::load`] reads such a
//! directory (or a Kubernetes TLS Secret, whose `tls.crt` / `tls.key` /
//! `ca.crt` names are accepted too); [`ClusterCa::credentials`] makes
//! in-memory credentials for links that live inside one process.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::error::HandoffError;

/// What a process is in the cluster; its certificate names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The HTTP front: dials decode workers.
    Router,
    /// Prefill worker: accepted by nothing, dialled by decode workers.
    Prefill,
    /// Decode worker: dials prefill workers, accepts routers.
    Decode,
}

impl Role {
    /// Every role, in the order `cluster init` writes them.
    pub const ALL: [Role; 3] = [Role::Router, Role::Prefill, Role::Decode];

    /// The role's short name (file names, logs).
    pub fn name(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The DNS subject name a certificate of this role carries.
    pub fn subject_name(self) -> &'static str {
        match self {
            Role::Router => "kvfence-router",
            Role::Prefill => "kvfence-prefill",
            Role::Decode => "kvfence-decode",
        }
    }

    /// The name a client asks rustls to verify when it dials this role.
    pub fn server_name(self) -> ServerName<'static> {
        ServerName::try_from(self.subject_name()).expect("role subject names are valid DNS names")
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn tls_error(context: &str, error: impl std::fmt::Display) -> HandoffError {
    HandoffError::Tls(format!("{context}: {error}"))
}

/// The cluster's certificate authority, able to issue role certificates.
pub struct ClusterCa {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterCa")
    }
}

/// Certificates are valid from a day ago (clock skew between hosts) for ten years.
fn validity(params: &mut CertificateParams) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(3650);
}

/// A role certificate and its private key, PEM-encoded.
#[derive(Clone)]
pub struct RoleCert {
    /// The role.
    pub role: Role,
    /// Certificate (PEM).
    pub cert_pem: String,
    /// Private key (PEM, PKCS#8).
    pub key_pem: String,
}

impl std::fmt::Debug for RoleCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("RoleCert")
            .field("role", &self.role)
            .finish()
    }
}

impl ClusterCa {
    /// A fresh CA with a new ECDSA P-256 key.
    pub fn generate() -> Result<ClusterCa, HandoffError> {
        let key = KeyPair::generate().map_err(|e| tls_error("generating the CA key", e))?;
        let mut params = CertificateParams::new(Vec::<String>::new())
            .map_err(|e| tls_error("CA parameters", e))?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params
            .distinguished_name
            .push(DnType::CommonName, "kvfence cluster CA");
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        validity(&mut params);
        let cert = params
            .self_signed(&key)
            .map_err(|e| tls_error("signing the CA certificate", e))?;
        Ok(ClusterCa {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate (PEM): every process trusts exactly this.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues a certificate for `role`: its subject name, a new key, and
    /// both TLS usages (a decode worker is a server to routers and a client
    /// of prefill workers).
    pub fn issue(&self, role: Role) -> Result<RoleCert, HandoffError> {
        let key = KeyPair::generate().map_err(|e| tls_error("generating a role key", e))?;
        let mut params = CertificateParams::new(vec![role.subject_name().to_string()])
            .map_err(|e| tls_error("role certificate parameters", e))?;
        params
            .distinguished_name
            .push(DnType::CommonName, role.subject_name());
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        validity(&mut params);
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| tls_error("signing a role certificate", e))?;
        Ok(RoleCert {
            role,
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// In-memory credentials for `role`, for links inside one process.
    pub fn credentials(&self, role: Role) -> Result<Credentials, HandoffError> {
        let cert = self.issue(role)?;
        Credentials::from_pem(
            role,
            self.cert_pem.as_bytes(),
            cert.cert_pem.as_bytes(),
            cert.key_pem.as_bytes(),
        )
    }

    /// Writes `ca.crt` and, for every role, `ROLE.crt` and `ROLE.key`
    /// (mode 0600) into `dir`, creating it. Refuses to overwrite anything.
    /// The CA's own key is not written: nothing needs it after this.
    pub fn write_dir(&self, dir: &Path) -> Result<Vec<PathBuf>, HandoffError> {
        let io = |path: &Path, e: std::io::Error| HandoffError::Credentials {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let mut files = vec![(dir.join("ca.crt"), self.cert_pem.clone(), false)];
        for role in Role::ALL {
            let cert = self.issue(role)?;
            files.push((dir.join(format!("{role}.crt")), cert.cert_pem, false));
            files.push((dir.join(format!("{role}.key")), cert.key_pem, true));
        }
        if let Some((path, _, _)) = files.iter().find(|(path, _, _)| path.exists()) {
            return Err(HandoffError::Credentials {
                path: path.display().to_string(),
                reason: "already exists; refusing to overwrite cluster credentials".into(),
            });
        }
        for (path, contents, secret) in &files {
            write_file(path, contents.as_bytes(), *secret).map_err(|e| io(path, e))?;
        }
        Ok(files.into_iter().map(|(path, _, _)| path).collect())
    }
}

/// The certificate and key file names `role` is read from in `dir`:
/// `ROLE.crt` and `ROLE.key` as `kvfence cluster init` writes them, else a
/// Kubernetes TLS Secret's `tls.crt` and `tls.key`.
fn file_names(dir: &Path, role: Role) -> (String, String) {
    if dir.join(format!("{role}.crt")).exists() {
        (format!("{role}.crt"), format!("{role}.key"))
    } else {
        ("tls.crt".to_string(), "tls.key".to_string())
    }
}

fn write_file(path: &Path, contents: &[u8], secret: bool) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    options.open(path)?.write_all(contents)
}

/// One process's TLS identity: its role, and rustls configurations that
/// trust only the cluster CA, speak only TLS 1.3, and present the role's
/// certificate on both sides of a link.
#[derive(Clone)]
pub struct Credentials {
    role: Role,
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("role", &self.role)
            .finish()
    }
}

impl Credentials {
    /// Reads `role`'s credentials from `dir`: `ca.crt`, and `ROLE.crt` /
    /// `ROLE.key` (as `kvfence cluster init` writes them) or else `tls.crt` /
    /// `tls.key` (a Kubernetes TLS Secret mounted as a directory).
    pub fn load(dir: &Path, role: Role) -> Result<Credentials, HandoffError> {
        let read = |name: &str| -> Result<Vec<u8>, HandoffError> {
            let path = dir.join(name);
            std::fs::read(&path).map_err(|e| HandoffError::Credentials {
                path: path.display().to_string(),
                reason: format!("{e} (create the directory with `kvfence cluster init --out DIR`)"),
            })
        };
        let (cert, key) = file_names(dir, role);
        Credentials::from_pem(role, &read("ca.crt")?, &read(&cert)?, &read(&key)?).map_err(
            |error| HandoffError::Credentials {
                path: dir.display().to_string(),
                reason: error.to_string(),
            },
        )
    }

    /// The permission bits of the private key [`Credentials::load`] reads
    /// from `dir` for `role`, when they give every other user of the
    /// machine some access to it (any of `0o007`); `None` when they do not,
    /// or when the file cannot be read (loading says why). Such a key still
    /// loads — a Kubernetes Secret volume mounts files `0644` unless told
    /// otherwise — but the process should say so.
    pub fn key_open_to_others(dir: &Path, role: Role) -> Option<u32> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.join(file_names(dir, role).1))
                .ok()?
                .permissions()
                .mode()
                & 0o777;
            (mode & 0o007 != 0).then_some(mode)
        }
        #[cfg(not(unix))]
        {
            let _ = (dir, role);
            None
        }
    }

    /// Credentials from PEM text: the CA certificate, this role's certificate
    /// chain and its private key.
    pub fn from_pem(
        role: Role,
        ca_pem: &[u8],
        cert_pem: &[u8],
        key_pem: &[u8],
    ) -> Result<Credentials, HandoffError> {
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca_pem) {
            let ca = ca.map_err(|e| tls_error("reading the CA certificate", e))?;
            roots
                .add(ca)
                .map_err(|e| tls_error("the CA certificate", e))?;
        }
        if roots.is_empty() {
            return Err(HandoffError::Tls("no CA certificate found".into()));
        }
        let chain = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tls_error("reading the certificate", e))?;
        let Some(leaf) = chain.first() else {
            return Err(HandoffError::Tls("no certificate found".into()));
        };
        // Our own certificate must carry the role we run as: a mislabelled
        // file is an operator's mistake best caught at start-up.
        check_role(leaf, role).map_err(|_| {
            HandoffError::Tls(format!(
                "the certificate does not name the {role} role ({})",
                role.subject_name()
            ))
        })?;
        let key = PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|e| tls_error("reading the private key", e))?;
        let roots = Arc::new(roots);
        // aws-lc-rs (rustls's default provider) rather than ring: its
        // AES-GCM uses 512-bit vectors where the CPU has them, and sealing
        // and opening KV was a third of the link thread's time with ring's
        // (docs/performance.md, "Over TCP").
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
                .build()
                .map_err(|e| tls_error("client verifier", e))?;
        let server = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_error("server configuration", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| tls_error("the certificate and key", e))?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_error("client configuration", e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| tls_error("the certificate and key", e))?;
        Ok(Credentials {
            role,
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }

    /// The role these credentials act as.
    pub fn role(&self) -> Role {
        self.role
    }

    /// For accepting links: requires a client certificate from the cluster
    /// CA; check its role with [`peer_role`] once the handshake is done.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.server)
    }

    /// For dialling: verifies the server against the cluster CA and the
    /// role dialled ([`Role::server_name`]), and presents this role's certificate.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        Arc::clone(&self.client)
    }
}

fn check_role(cert: &CertificateDer<'_>, role: Role) -> Result<(), webpki::Error> {
    webpki::EndEntityCert::try_from(cert)?.verify_is_valid_for_subject_name(&role.server_name())
}

/// The role of an authenticated client, if it is one of `allowed`. The
/// chain was already verified against the cluster CA during the handshake;
/// this checks the name it carries.
pub fn peer_role(
    certificates: Option<&[CertificateDer<'_>]>,
    allowed: &[Role],
) -> Result<Role, HandoffError> {
    let leaf = certificates
        .and_then(<[_]>::first)
        .ok_or(HandoffError::AuthFailed {
            reason: "the peer presented no certificate".into(),
        })?;
    allowed
        .iter()
        .copied()
        .find(|role| check_role(leaf, *role).is_ok())
        .ok_or_else(|| {
            let names: Vec<&str> = allowed.iter().map(|r| r.name()).collect();
            HandoffError::AuthFailed {
                reason: format!(
                    "the peer's certificate names none of the roles this listener accepts ({})",
                    names.join(", ")
                ),
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_name_their_role_and_no_other() {
        let ca = ClusterCa::generate().unwrap();
        for role in Role::ALL {
            let cert = ca.issue(role).unwrap();
            let der = CertificateDer::from_pem_slice(cert.cert_pem.as_bytes()).unwrap();
            for other in Role::ALL {
                assert_eq!(
                    peer_role(Some(std::slice::from_ref(&der)), &[other]).is_ok(),
                    other == role,
                    "{role} certificate checked as {other}"
                );
            }
        }
    }

    #[test]
    fn credentials_refuse_a_certificate_of_another_role() {
        let ca = ClusterCa::generate().unwrap();
        let prefill = ca.issue(Role::Prefill).unwrap();
        let error = Credentials::from_pem(
            Role::Router,
            ca.cert_pem().as_bytes(),
            prefill.cert_pem.as_bytes(),
            prefill.key_pem.as_bytes(),
        )
        .unwrap_err();
        assert!(error.to_string().contains("router"), "{error}");
    }

    #[test]
    fn a_written_directory_loads_for_every_role_and_is_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::generate().unwrap();
        let files = ca.write_dir(dir.path()).unwrap();
        assert_eq!(files.len(), 7);
        for role in Role::ALL {
            assert_eq!(Credentials::load(dir.path(), role).unwrap().role(), role);
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("decode.key"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(
                mode & 0o077,
                0,
                "private keys are readable by their owner only"
            );
        }
        let again = ClusterCa::generate().unwrap().write_dir(dir.path());
        assert!(matches!(again, Err(HandoffError::Credentials { .. })));
        assert!(
            !dir.path().join("ca.key").exists(),
            "the CA key is never written"
        );
    }

    #[test]
    fn a_kubernetes_tls_secret_layout_loads_too() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::generate().unwrap();
        let decode = ca.issue(Role::Decode).unwrap();
        std::fs::write(dir.path().join("ca.crt"), ca.cert_pem()).unwrap();
        std::fs::write(dir.path().join("tls.crt"), &decode.cert_pem).unwrap();
        std::fs::write(dir.path().join("tls.key"), &decode.key_pem).unwrap();
        assert!(Credentials::load(dir.path(), Role::Decode).is_ok());
        // The same Secret cannot be used to run as another role.
        assert!(Credentials::load(dir.path(), Role::Router).is_err());
    }

    #[cfg(unix)]
    #[test]
    fn a_key_other_users_can_read_is_told_and_an_owner_or_group_one_is_not() {
        use std::os::unix::fs::PermissionsExt;
        let chmod = |path: &std::path::Path, mode: u32| {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        ClusterCa::generate()
            .unwrap()
            .write_dir(dir.path())
            .unwrap();
        let key = dir.path().join("prefill.key");
        assert_eq!(
            Credentials::key_open_to_others(dir.path(), Role::Prefill),
            None
        );
        // A Kubernetes Secret with `defaultMode: 0400` under an `fsGroup`.
        chmod(&key, 0o440);
        assert_eq!(
            Credentials::key_open_to_others(dir.path(), Role::Prefill),
            None
        );
        // A Secret volume's default.
        chmod(&key, 0o644);
        assert_eq!(
            Credentials::key_open_to_others(dir.path(), Role::Prefill),
            Some(0o644)
        );
        assert!(
            Credentials::load(dir.path(), Role::Prefill).is_ok(),
            "such a key still loads"
        );
        // The Secret layout's key is the one checked there.
        let secret = tempfile::tempdir().unwrap();
        std::fs::write(secret.path().join("tls.crt"), b"").unwrap();
        std::fs::write(secret.path().join("tls.key"), b"").unwrap();
        chmod(&secret.path().join("tls.key"), 0o604);
        assert_eq!(
            Credentials::key_open_to_others(secret.path(), Role::Decode),
            Some(0o604)
        );
        assert_eq!(
            Credentials::key_open_to_others(dir.path().join("absent").as_path(), Role::Decode),
            None,
            "a key that is not there is for loading to report"
        );
    }

    #[test]
    fn missing_files_say_how_to_make_them() {
        let dir = tempfile::tempdir().unwrap();
        let error = Credentials::load(dir.path(), Role::Decode).unwrap_err();
        assert!(
            error.to_string().contains("kvfence cluster init"),
            "{error}"
        );
    }
}
