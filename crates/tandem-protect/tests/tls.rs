//! Mutual TLS on loopback sockets: keys from `tls::generate`, a handshake each way, a few MiB
//! through the pump in both directions, EOF; a peer from another CA, a client without a
//! certificate and a silent client are refused within the deadline; a certificate names the
//! VMs it may serve.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use tandem_protect::tls::{self, TlsFiles};

fn pair(dir: &std::path::Path) -> (TlsFiles, TlsFiles) {
    tls::generate(dir, &["127.0.0.1".into(), "localhost".into()], None).unwrap();
    (
        TlsFiles::in_dir(dir, "primary"),
        TlsFiles::in_dir(dir, "backup"),
    )
}

#[test]
fn mutual_tls_carries_data_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let (p, b) = pair(dir.path());
    let server = tls::server_config(&b).unwrap();
    let client = tls::client_config(&p).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let srv = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        let mut c = tls::accept(s, &server, Duration::from_secs(5)).unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        c.write_all(&(got.len() as u64).to_le_bytes()).unwrap();
        c.flush().unwrap();
        got
    });
    let name = tls::server_name(&addr, None).unwrap();
    let tcp = TcpStream::connect(&addr).unwrap();
    let mut c = tls::connect(tcp, &client, name, Duration::from_secs(5)).unwrap();
    assert!(c.is_tls());
    assert!(c.peer_valid_for_vm(1) && c.peer_valid_for_vm(u64::MAX));
    let data: Vec<u8> = (0..(3 << 20)).map(|i| (i * 7 % 251) as u8).collect();
    let mut w = c.try_clone().unwrap();
    w.write_all(&data).unwrap();
    // Half-close: the server reads to EOF, then answers.
    c.shutdown_write();
    let mut n = [0u8; 8];
    c.read_exact(&mut n).unwrap();
    assert_eq!(u64::from_le_bytes(n), data.len() as u64);
    assert_eq!(srv.join().unwrap(), data);
}

#[test]
fn peers_without_a_certificate_of_the_ca_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let (_, b) = pair(dir.path());
    let (stranger, _) = pair(other.path());
    let server = tls::server_config(&b).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let srv = std::thread::spawn(move || {
        let mut errors = Vec::new();
        for _ in 0..4 {
            let (s, _) = l.accept().unwrap();
            let t = Instant::now();
            let e = tls::accept(s, &server, Duration::from_secs(1))
                .err()
                .unwrap();
            assert!(t.elapsed() < Duration::from_secs(3));
            errors.push(e.to_string());
        }
        errors
    });
    // 1: a certificate from another CA.
    let c = tls::client_config(&stranger).unwrap();
    let tcp = TcpStream::connect(&addr).unwrap();
    let name = tls::server_name(&addr, None).unwrap();
    assert!(tls::connect(tcp, &c, name, Duration::from_secs(5)).is_err());
    // 2: random bytes instead of a ClientHello.
    let mut tcp = TcpStream::connect(&addr).unwrap();
    tcp.write_all(b"\x16\x03\x01garbage that is not TLS at all....")
        .unwrap();
    // 3: connects and says nothing (slow loris): cut at the deadline.
    let _silent = TcpStream::connect(&addr).unwrap();
    // 4: a record header that promises a large handshake, then a byte every 200 ms: the
    // deadline holds for the whole handshake, not per read.
    let to = addr.clone();
    let trickle = std::thread::spawn(move || {
        let mut s = TcpStream::connect(&to).unwrap();
        let _ = s.write_all(&[0x16, 0x03, 0x01, 0x40, 0x00]);
        for _ in 0..30 {
            if s.write_all(&[0]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let errors = srv.join().unwrap();
    let _ = trickle.join();
    assert!(
        errors.iter().all(|e| e.contains("TLS handshake")),
        "{errors:?}"
    );
    assert!(errors[2].contains("not completed within"), "{errors:?}");
    assert!(errors[3].contains("not completed within"), "{errors:?}");
}

#[test]
fn missing_or_empty_pem_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let f = TlsFiles::in_dir(dir.path(), "primary");
    let e = tls::client_config(&f).err().unwrap().to_string();
    assert!(e.contains("ca.pem"), "{e}");
    std::fs::write(dir.path().join("ca.pem"), "not pem").unwrap();
    let e = tls::client_config(&f).err().unwrap().to_string();
    assert!(e.contains("ca.pem") && e.contains("no certificate"), "{e}");
}

#[test]
fn a_certificate_serves_only_the_vms_it_names() {
    // Finding 8: with TLS, any certificate of the CA could claim any VM id.
    let dir = tempfile::tempdir().unwrap();
    tls::generate(dir.path(), &["127.0.0.1".into()], Some(&[3, 5])).unwrap();
    let pem = std::fs::read(dir.path().join("primary.pem")).unwrap();
    use rustls::pki_types::pem::PemObject;
    let cert = rustls::pki_types::CertificateDer::from_pem_slice(&pem).unwrap();
    assert!(tls::valid_for_vm(&cert, 3));
    assert!(tls::valid_for_vm(&cert, 5));
    assert!(!tls::valid_for_vm(&cert, 4));
    assert!(!tls::valid_for_vm(&cert, 35));
}
