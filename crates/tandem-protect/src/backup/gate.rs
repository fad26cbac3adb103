//! The backup's front door. Every connection to the listen port is vetted on its own thread
//! before the daemon sees it: the TLS handshake (with `--tls-*`), then the first frame, which
//! must be a hello for this backup's VM, each within a deadline. Only vetted connections reach
//! the link; a hostile client — random bytes, a replay, a frame for another VM, a slow-loris
//! connection — is dropped there, logged once per address and reason, and cannot delay the
//! real primary (which is vetted in parallel) or touch the mirror.

use std::collections::HashSet;
use std::io::Read;
use std::net::{IpAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_replication::{Frame, Kind};

use crate::conn::Conn;
use crate::Status;

/// How long a new connection has for its handshake and hello.
pub const VET_WITHIN: Duration = Duration::from_secs(5);

/// Connections being vetted at once; more are closed at once.
const MAX_VETTING: usize = 16;

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
    let busy = Arc::new(AtomicUsize::new(0));
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
                if busy.fetch_add(1, Ordering::SeqCst) >= MAX_VETTING {
                    busy.fetch_sub(1, Ordering::SeqCst);
                    once(
                        &said,
                        &status,
                        ip,
                        "too many connections being vetted: closed at once",
                    );
                    continue;
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
                            Ok(v) => send(&tx, v),
                            Err(why) => once(&said, &status, ip, &why),
                        }
                        busy.fetch_sub(1, Ordering::SeqCst);
                    });
            }
        });
    rx
}

fn send(tx: &SyncSender<Vetted>, v: Vetted) {
    // The daemon takes connections one at a time; a full queue drops the oldest caller's
    // chance, not the daemon's (the primary reconnects).
    let _ = tx.try_send(v);
}

/// Logs `why` for `ip` the first time only (reasons carry no per-connection details).
fn once(said: &Mutex<HashSet<(IpAddr, String)>>, status: &Status, ip: IpAddr, why: &str) {
    let key = why.to_string();
    let first = said
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((ip, key));
    if first {
        status.warn(format!(
            "refused a connection from {ip}: {why} (logged once per address and reason; the mirror is untouched)"
        ));
    }
}

fn vet(tcp: std::net::TcpStream, gate: &Gate) -> Result<Vetted, String> {
    let deadline = Instant::now() + VET_WITHIN;
    let mut conn = match &gate.tls {
        Some(c) => crate::tls::accept(tcp, c, VET_WITHIN).map_err(|e| match e {
            // Without the peer's port: the same failure is the same reason.
            crate::tls::TlsError::Handshake { why, .. } => format!("TLS handshake failed: {why}"),
            e => e.to_string(),
        })?,
        None => Conn::plain(tcp).map_err(|e| e.to_string())?,
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
        Ok(None) => return Err("closed before its hello".into()),
        Err(e) => return Err(format!("not a replication hello: {}", crate::chain(&e))),
    };
    let hello = check(f, gate)?;
    conn.set_read_timeout(None).map_err(|e| e.to_string())?;
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

fn check(f: Frame, gate: &Gate) -> Result<Frame, String> {
    if f.kind != Kind::Hello {
        return Err(format!("first frame is {:?}, not a hello", f.kind));
    }
    if f.vm_id != gate.vm_id {
        return Err(format!(
            "hello for VM {}: this backup protects VM {} (--vm-id)",
            f.vm_id, gate.vm_id
        ));
    }
    Ok(f)
}
