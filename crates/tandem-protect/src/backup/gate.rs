//! The backup's front door. Every connection to the listen port is vetted on its own thread
//! before the daemon sees it: the TLS handshake (with `--tls-*`), then the first frame, which
//! must be a hello for this backup's VM, each within a deadline. Only vetted connections reach
//! the link; a hostile client — random bytes, a replay, a frame for another VM, a slow-loris
//! connection — is dropped there, logged once per address and reason (a fixed category), and
//! cannot touch the mirror. The real primary is vetted in parallel: a hostile address holds at
//! most 4 of the 32 vetting slots, each for at most 5 s.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::net::{IpAddr, TcpListener};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_replication::{Frame, Kind};

use crate::conn::Conn;
use crate::Status;

/// How long a new connection has for its handshake and hello.
pub const VET_WITHIN: Duration = Duration::from_secs(5);

/// Connections being vetted at once; more are closed at once.
const MAX_VETTING: usize = 32;

/// Connections from one address being vetted at once.
const MAX_PER_ADDRESS: usize = 4;

/// Distinct (address, reason) pairs remembered for logging once.
const MAX_REMEMBERED: usize = 4096;

/// A vetted connection and the hello it opened with.
pub struct Vetted {
    /// The connection.
    pub conn: Conn,
    /// Its first frame (a hello for this VM).
    pub hello: Frame,
}

/// What the gate lets through.
pub struct Gate {
    /// This backup's VM.
    pub vm_id: u64,
    /// Mutual TLS, if configured.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// Starts accepting on `listener`; vetted connections arrive on the returned channel.
pub fn start(listener: TcpListener, gate: Gate, status: Status) -> Receiver<Vetted> {
    let (tx, rx) = sync_channel(4);
    let gate = Arc::new(gate);
    let said = Arc::new(Mutex::new(HashSet::new()));
    let busy = Arc::new(Mutex::new(HashMap::<IpAddr, usize>::new()));
    let _ = std::thread::Builder::new()
        .name("gate".into())
        .spawn(move || {
            for c in listener.incoming() {
                let Ok(tcp) = c else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                let ip = tcp
                    .peer_addr()
                    .map_or(IpAddr::from([0, 0, 0, 0]), |a| a.ip());
                {
                    let mut b = busy.lock().unwrap_or_else(|e| e.into_inner());
                    let total: usize = b.values().sum();
                    let mine = b.get(&ip).copied().unwrap_or(0);
                    if mine >= MAX_PER_ADDRESS || total >= MAX_VETTING {
                        drop(b);
                        once(
                            &said,
                            &status,
                            ip,
                            "too many connections being vetted",
                            "closed at once",
                        );
                        continue;
                    }
                    b.insert(ip, mine + 1);
                }
                let (gate, said, busy, status, tx) = (
                    gate.clone(),
                    said.clone(),
                    busy.clone(),
                    status.clone(),
                    tx.clone(),
                );
                let _ = std::thread::Builder::new()
                    .name("vet".into())
                    .spawn(move || {
                        match vet(tcp, &gate) {
                            Ok(v) => {
                                if tx.try_send(v).is_err() {
                                    once(
                                        &said,
                                        &status,
                                        ip,
                                        "the daemon has vetted connections waiting",
                                        "this one was closed (the primary reconnects)",
                                    );
                                }
                            }
                            Err((what, detail)) => once(&said, &status, ip, what, &detail),
                        }
                        let mut b = busy.lock().unwrap_or_else(|e| e.into_inner());
                        if let Some(n) = b.get_mut(&ip) {
                            *n -= 1;
                            if *n == 0 {
                                b.remove(&ip);
                            }
                        }
                    });
            }
        });
    rx
}

/// Logs a refusal for `ip` the first time its reason (a fixed category, `what`) is seen; the
/// detail of that first time goes with it.
fn once(
    said: &Mutex<HashSet<(IpAddr, &'static str)>>,
    status: &Status,
    ip: IpAddr,
    what: &'static str,
    detail: &str,
) {
    let first = {
        let mut s = said.lock().unwrap_or_else(|e| e.into_inner());
        s.len() < MAX_REMEMBERED && s.insert((ip, what))
    };
    if first {
        status.warn(format!(
            "refused a connection from {ip}: {what}: {detail} (logged once per address and reason; the mirror is untouched)"
        ));
    }
}

fn vet(tcp: std::net::TcpStream, gate: &Gate) -> Result<Vetted, (&'static str, String)> {
    let deadline = Instant::now() + VET_WITHIN;
    let mut conn = match &gate.tls {
        Some(c) => crate::tls::accept(tcp, c, VET_WITHIN).map_err(|e| match e {
            crate::tls::TlsError::Handshake { why, .. } if why.starts_with("not completed") => {
                ("no complete TLS handshake in time", why)
            }
            crate::tls::TlsError::Handshake { why, .. } => ("TLS handshake failed", why),
            e => ("TLS handshake failed", e.to_string()),
        })?,
        None => Conn::plain(tcp).map_err(|e| ("socket error", e.to_string()))?,
    };
    // Unbuffered, so that nothing after the hello is consumed here; bounded in time and size,
    // so that a trickle or a huge declared length cannot hold the thread.
    let mut r = Bounded {
        conn: &mut conn,
        left: HELLO_MAX,
        deadline,
    };
    let f = match Frame::read_from(&mut r) {
        Ok(Some(f)) => f,
        Ok(None) => return Err(("closed before its hello", String::new())),
        Err(tandem_replication::WireError::Io(e)) if e.kind() == std::io::ErrorKind::TimedOut => {
            return Err(("no complete hello in time", e.to_string()))
        }
        Err(e) => return Err(("not a replication hello", crate::chain(&e))),
    };
    let hello = check(f, gate)?;
    conn.set_read_timeout(None)
        .map_err(|e| ("socket error", e.to_string()))?;
    Ok(Vetted { conn, hello })
}

/// A hello frame is a 32-byte header and a payload of at most 36 bytes.
const HELLO_MAX: usize = 32 + 64;

struct Bounded<'a> {
    conn: &'a mut Conn,
    left: usize,
    deadline: Instant,
}

impl Read for Bounded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let time = self.deadline.saturating_duration_since(Instant::now());
        if time.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no complete hello within {VET_WITHIN:?}"),
            ));
        }
        if self.left == 0 {
            return Err(std::io::Error::other("longer than a hello"));
        }
        self.conn.set_read_timeout(Some(time))?;
        let n = buf.len().min(self.left);
        let got = self.conn.read(&mut buf[..n]).map_err(|e| {
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no complete hello within {VET_WITHIN:?}"),
                )
            } else {
                e
            }
        })?;
        self.left -= got;
        Ok(got)
    }
}

fn check(f: Frame, gate: &Gate) -> Result<Frame, (&'static str, String)> {
    if f.kind != Kind::Hello {
        return Err((
            "not a replication hello",
            format!("first frame is {:?}", f.kind),
        ));
    }
    if f.vm_id != gate.vm_id {
        return Err((
            "hello for another VM",
            format!(
                "VM {}; this backup protects VM {} (--vm-id)",
                f.vm_id, gate.vm_id
            ),
        ));
    }
    Ok(f)
}
