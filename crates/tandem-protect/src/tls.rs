//! Mutual TLS on the replication link (rustls, ring): the backup accepts only primaries whose
//! certificate chains to the configured CA, the primary accepts only a backup whose
//! certificate chains to it and names the address it dialled. Both must name the VM too:
//! `vm-ID.tandem.invalid` (or `*.tandem.invalid` for every VM) among the certificate's DNS
//! names, so that a certificate of the CA serves only the VMs it was issued for. `tandem keys`
//! makes a lab CA and the two certificates; operators pass their own PKI's files instead.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::conn::Conn;

/// The PEM files of one side.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// CA certificate(s) the peer's certificate must chain to.
    pub ca: PathBuf,
    /// This side's certificate chain.
    pub cert: PathBuf,
    /// This side's private key.
    pub key: PathBuf,
}

impl TlsFiles {
    /// `ca.pem`, `<role>.pem` and `<role>.key` in `dir` (as `tandem keys` writes them).
    pub fn in_dir(dir: &Path, role: &str) -> TlsFiles {
        TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{role}.pem")),
            key: dir.join(format!("{role}.key")),
        }
    }
}

/// TLS set-up or a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("reading {0}: {1}")]
    Pem(PathBuf, String),
    /// rustls refused the configuration.
    #[error("TLS configuration")]
    Config(#[from] rustls::Error),
    /// The CA could not be used to verify peers.
    #[error("the CA in {0} cannot verify peers: {1}")]
    Verifier(PathBuf, String),
    /// The peer's name is not a DNS name or IP address.
    #[error("{0:?} is not a DNS name or an IP address for TLS (use --tls-server-name)")]
    ServerName(String),
    /// The handshake failed or timed out.
    #[error("TLS handshake with {peer}: {why}")]
    Handshake {
        /// The peer.
        peer: String,
        /// What went wrong.
        why: String,
    },
    /// Key generation failed.
    #[error("generating keys: {0}")]
    Keys(String),
    /// A file could not be written.
    #[error("writing {0}")]
    Write(PathBuf, #[source] std::io::Error),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(p: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let v: Vec<_> = CertificateDer::pem_file_iter(p)
        .map_err(|e| TlsError::Pem(p.into(), e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Pem(p.into(), e.to_string()))?;
    if v.is_empty() {
        return Err(TlsError::Pem(p.into(), "no certificate in it".into()));
    }
    Ok(v)
}

fn key(p: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(p).map_err(|e| TlsError::Pem(p.into(), e.to_string()))
}

fn roots(p: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut r = RootCertStore::empty();
    for c in certs(p)? {
        r.add(c)
            .map_err(|e| TlsError::Verifier(p.into(), e.to_string()))?;
    }
    Ok(Arc::new(r))
}

/// The backup's configuration: client certificates required, chained to the CA.
pub fn server_config(f: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(&f.ca)?, provider())
            .build()
            .map_err(|e| TlsError::Verifier(f.ca.clone(), e.to_string()))?;
    let c = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(&f.cert)?, key(&f.key)?)?;
    Ok(Arc::new(c))
}

/// The primary's configuration: the backup's certificate chained to the CA, this side's
/// certificate presented.
pub fn client_config(f: &TlsFiles) -> Result<Arc<ClientConfig>, TlsError> {
    let c = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(&f.ca)?)
        .with_client_auth_cert(certs(&f.cert)?, key(&f.key)?)?;
    Ok(Arc::new(c))
}

/// The DNS name a certificate carries to serve VM `vm_id` on the replication link.
pub fn vm_name(vm_id: u64) -> String {
    format!("vm-{vm_id}.tandem.invalid")
}

/// The DNS name a certificate carries to serve every VM.
pub const ANY_VM: &str = "*.tandem.invalid";

/// Whether `cert` names VM `vm_id` ([`vm_name`], or [`ANY_VM`]).
pub fn valid_for_vm(cert: &CertificateDer<'_>, vm_id: u64) -> bool {
    let Ok(parsed) = rustls::server::ParsedCertificate::try_from(cert) else {
        return false;
    };
    let Ok(name) = ServerName::try_from(vm_name(vm_id)) else {
        return false;
    };
    rustls::client::verify_server_name(&parsed, &name).is_ok()
}

/// The name the primary expects in the backup's certificate: `name`, or the host part of
/// `addr` (`host:port`).
pub fn server_name(addr: &str, name: Option<&str>) -> Result<ServerName<'static>, TlsError> {
    let host = name.map(str::to_string).unwrap_or_else(|| {
        let h = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        h.trim_start_matches('[').trim_end_matches(']').to_string()
    });
    ServerName::try_from(host.clone()).map_err(|_| TlsError::ServerName(host))
}

fn handshake(
    tcp: TcpStream,
    mut tls: rustls::Connection,
    within: Duration,
) -> Result<Conn, TlsError> {
    let peer = tcp
        .peer_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    let fail = |why: String| TlsError::Handshake {
        peer: peer.clone(),
        why,
    };
    let deadline = Instant::now() + within;
    let timed_out = || fail(format!("not completed within {within:?}"));
    let mut s = &tcp;
    // Driven by hand so that every read is bounded by what is left of the deadline: a peer
    // that trickles bytes cannot stretch the handshake.
    while tls.is_handshaking() {
        while tls.wants_write() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timed_out());
            }
            tcp.set_write_timeout(Some(left))
                .map_err(|e| fail(e.to_string()))?;
            tls.write_tls(&mut s).map_err(|e| match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => timed_out(),
                _ => fail(e.to_string()),
            })?;
        }
        if !tls.is_handshaking() {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        tcp.set_read_timeout(Some(left))
            .map_err(|e| fail(e.to_string()))?;
        match tls.read_tls(&mut s) {
            Ok(0) => return Err(fail("the peer closed the connection".into())),
            Ok(_) => {
                if let Err(e) = tls.process_new_packets() {
                    // Tell the peer why (an alert), then fail.
                    let _ = tls.write_tls(&mut s);
                    return Err(fail(e.to_string()));
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(timed_out())
            }
            Err(e) => return Err(fail(e.to_string())),
        }
    }
    // The last handshake messages (the client's Finished) go out before the pump starts.
    while tls.wants_write() {
        tls.write_tls(&mut s).map_err(|e| fail(e.to_string()))?;
    }
    let _ = tcp.set_read_timeout(None);
    let _ = tcp.set_write_timeout(None);
    Conn::tls(tcp, tls).map_err(|e| fail(e.to_string()))
}

/// The backup's side of a handshake on an accepted connection, bounded by `within`.
pub fn accept(tcp: TcpStream, c: &Arc<ServerConfig>, within: Duration) -> Result<Conn, TlsError> {
    let tls = rustls::ServerConnection::new(c.clone())?;
    handshake(tcp, tls.into(), within)
}

/// The primary's side of a handshake, bounded by `within`.
pub fn connect(
    tcp: TcpStream,
    c: &Arc<ClientConfig>,
    name: ServerName<'static>,
    within: Duration,
) -> Result<Conn, TlsError> {
    let tls = rustls::ClientConnection::new(c.clone(), name)?;
    handshake(tcp, tls.into(), within)
}

/// Writes a lab CA (`ca.pem`; its key is not kept) and certificates for `primary` and
/// `backup` valid for `sans` (DNS names or IP addresses) and for the VMs `vms` (`None`: every
/// VM) into `dir`.
pub fn generate(
    dir: &Path,
    sans: &[String],
    vms: Option<&[u64]>,
) -> Result<Vec<PathBuf>, TlsError> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    };
    let k = |e: rcgen::Error| TlsError::Keys(e.to_string());
    std::fs::create_dir_all(dir).map_err(|e| TlsError::Write(dir.into(), e))?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(k)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "tandem lab CA");
    let ca_key = KeyPair::generate().map_err(k)?;
    let ca_cert = ca.self_signed(&ca_key).map_err(k)?;
    let mut out = Vec::new();
    let mut write = |name: &str, text: String, mode: u32| -> Result<(), TlsError> {
        use std::os::unix::fs::OpenOptionsExt;
        let p = dir.join(name);
        let _ = std::fs::remove_file(&p);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&p)
            .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()))
            .map_err(|e| TlsError::Write(p.clone(), e))?;
        out.push(p);
        Ok(())
    };
    write("ca.pem", ca_cert.pem(), 0o644)?;
    let mut names = sans.to_vec();
    match vms {
        None => names.push(ANY_VM.to_string()),
        Some(ids) => names.extend(ids.iter().map(|&id| vm_name(id))),
    }
    for role in ["primary", "backup"] {
        let mut p = CertificateParams::new(names.clone()).map_err(k)?;
        p.distinguished_name
            .push(DnType::CommonName, format!("tandem {role}"));
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(k)?;
        let cert = p.signed_by(&key, &ca_cert, &ca_key).map_err(k)?;
        write(&format!("{role}.pem"), cert.pem(), 0o644)?;
        write(&format!("{role}.key"), key.serialize_pem(), 0o600)?;
    }
    Ok(out)
}
