//! Hostile clients on the backup's listen port while a real primary replicates to it: random
//! bytes, a replay of bytes captured from the real primary's session, a
//! valid-looking hello for another VM, and slow-loris connections — each sent twice. They
//! change nothing (the primary keeps being acknowledged, no failover), each kind is logged
//! once, and the real primary connects while the slow-loris connections are open.
//! Once with mutual TLS (`tandem keys`, `--tls-dir`), once on a plain link.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{free_port, spawn, wait_event};
use tandem_replication::{Frame, Hello, Kind};

/// A TCP proxy to `to` that records the first 64 KiB its clients send.
struct Proxy {
    addr: String,
    recorded: Arc<Mutex<Vec<u8>>>,
}

impl Proxy {
    fn start(to: String) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let recorded = Arc::new(Mutex::new(Vec::new()));
        let rec = recorded.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(c) = c else { continue };
                let Ok(s) = TcpStream::connect(&to) else {
                    continue;
                };
                let (mut c2, mut s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
                let rec = rec.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16384];
                    let mut c = c;
                    let mut s = s;
                    while let Ok(n) = c.read(&mut buf) {
                        if n == 0 || s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        let mut r = rec.lock().unwrap();
                        if r.len() < 65536 {
                            r.extend_from_slice(&buf[..n]);
                        }
                    }
                    let _ = s.shutdown(Shutdown::Both);
                });
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut s2, &mut c2);
                    let _ = c2.shutdown(Shutdown::Both);
                });
            }
        });
        Proxy { addr, recorded }
    }
}

/// Waits until the primary reports an acknowledged epoch of at least `n`.
fn acked_at_least(prx: &Receiver<String>, n: u64) -> u64 {
    let e = wait_event(prx, "acked", Duration::from_secs(120), |v| {
        v["epoch"].as_u64() >= Some(n)
    });
    e["epoch"].as_u64().unwrap()
}

fn hostile(tls: bool) {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let keys = dir.path().join("keys");
    let mut tls_args: Vec<String> = Vec::new();
    if tls {
        let st = std::process::Command::new(tandem_harness::product_exe().unwrap())
            .args([
                "keys",
                "--dir",
                keys.to_str().unwrap(),
                "--san",
                "127.0.0.1",
            ])
            .status()
            .unwrap();
        assert!(st.success());
        tls_args = vec!["--tls-dir".into(), keys.display().to_string()];
    }
    let listen = format!("127.0.0.1:{}", free_port());
    let bdir = dir.path().join("b");
    let vm = common::lab_vm("idle", 64);
    let mut bargs: Vec<&str> = vec!["backup", "--listen", &listen, "--dir"];
    bargs.push(bdir.to_str().unwrap());
    bargs.extend(["--vm-config", &vm, "--vm-id", "7", "--timeout-ms", "3000"]);
    bargs.push("--json-events");
    bargs.extend(tls_args.iter().map(String::as_str));
    let (mut backup, brx) = spawn(&bargs);
    wait_event(&brx, "listening", Duration::from_secs(60), |_| true);
    // Slow lorises: connections that hold on and never finish a handshake or hello; they are
    // open before the real primary comes and while it connects, and stay silent until the
    // backup cuts them (after `VET_WITHIN`, 5 s), however fast the rest of the test runs.
    let lorises: Vec<_> = (0..2)
        .map(|_| {
            let to = listen.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(&to).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let t = Instant::now();
                let mut b = [0u8; 64];
                let r = s.read(&mut b);
                let cut = match &r {
                    Ok(0) => true,
                    Ok(_) => false,
                    Err(e) => !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ),
                };
                (cut, t.elapsed(), format!("{r:?}"))
            })
        })
        .collect();
    let mut random = vec![0u8; 4096];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in &mut random {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let other_vm = {
        let hello = Hello {
            mem_bytes: 256 << 20,
            page_size: 4096,
            disk_bytes: 0,
            start_epoch: 0,
            session: 1,
            fencing: tandem_replication::Fencing::None,
        };
        let f = Frame {
            kind: Kind::Hello,
            vm_id: 8,
            seq: 0,
            payload: hello.encode(),
        };
        let mut v = Vec::new();
        f.write_to(&mut v).unwrap();
        v
    };
    let attack = |what: &str, bytes: &[u8]| {
        let mut s = TcpStream::connect(&listen).unwrap();
        let _ = s.write_all(bytes);
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut sink = Vec::new();
        // The backup closes the connection; nothing meaningful comes back.
        let _ = s.read_to_end(&mut sink);
        assert!(sink.len() < 4096, "{what}: {} bytes back", sink.len());
    };
    attack("random", &random);
    attack("other-vm", &other_vm);
    // The real primary connects while the lorises hold their connections.
    let proxy = Proxy::start(listen.clone());
    let mut pargs: Vec<&str> = vec!["primary", "--backup", &proxy.addr];
    pargs.extend(["--vm-config", &vm, "--vm-id", "7", "--json-events"]);
    pargs.extend(tls_args.iter().map(String::as_str));
    if tls {
        pargs.extend(["--tls-server-name", "127.0.0.1"]);
    }
    let (mut primary, prx) = spawn(&pargs);
    let before = acked_at_least(&prx, 5);
    let captured = proxy.recorded.lock().unwrap().clone();
    assert!(captured.len() > 1000, "captured {} bytes", captured.len());
    // While it replicates: everything again, and a replay of its own session's first bytes.
    attack("random", &random);
    attack("other-vm", &other_vm);
    if tls {
        // On a plain link a replayed hello of this VM is a new session (docs/REPLICATION.md):
        // only TLS (or the session check of --etcd) turns a replay away.
        attack("replay", &captured);
        attack("replay", &captured);
    }
    let after = acked_at_least(&prx, before + 10);
    assert!(after > before);
    for l in lorises {
        let (cut, held, r) = l.join().unwrap();
        assert!(cut, "a slow loris was not cut: {r} after {held:?}");
        assert!(
            held >= Duration::from_secs(4),
            "a slow loris was cut after only {held:?}"
        );
    }
    // Everything the backup said: each refusal once, no failover.
    // SAFETY: SIGUSR1 ends protection on purpose (bye), then the backup is stopped.
    unsafe { libc::kill(primary.id() as i32, libc::SIGUSR1) };
    primary.wait().unwrap();
    // SAFETY: SIGTERM to our own child.
    unsafe { libc::kill(backup.id() as i32, libc::SIGTERM) };
    let st = backup.wait().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let lines: Vec<String> = brx.try_iter().collect();
    assert!(st.success(), "backup exited with {st}: {lines:#?}");
    assert!(
        !lines.iter().any(|l| common::is_event(l, "failed_over")),
        "{lines:#?}"
    );
    let refusals: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("refused a connection"))
        .collect();
    let mut unique = refusals.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        refusals.len(),
        unique.len(),
        "logged more than once: {refusals:#?}"
    );
    // random bytes, another VM's hello (and a replay) twice each, two lorises: at most one
    // line per kind.
    assert!(!refusals.is_empty() && refusals.len() <= 4, "{refusals:#?}");
    assert!(
        refusals.iter().any(|l| l.contains(if tls {
            "not completed within"
        } else {
            "no complete hello within"
        })),
        "the slow loris was cut: {refusals:#?}"
    );
    if !tls {
        assert!(
            refusals
                .iter()
                .any(|l| l.contains("hello for another VM: VM 8")),
            "{refusals:#?}"
        );
    }
}

#[test]
fn hostile_clients_change_nothing_on_a_mutual_tls_link() {
    hostile(true);
}

#[test]
fn hostile_clients_change_nothing_on_a_plain_link() {
    hostile(false);
}
