//! The backup's front door. Every connection to the listen port is vetted on its own thread
//! before the daemon sees it: the TLS handshake (with `--tls-*`), then the first frame, which
//! must be a hello for this backup's VM, each within a deadline. Only vetted connections reach
//! the link; a hostile client — random bytes, a replay, a frame for another VM, a slow-loris
//! connection — is dropped there, logged once per address and reason (a fixed category), and
//! cannot touch the mirror. The real primary is vetted in parallel: an address holds at most 4
//! of the 32 vetting slots, each for at most 5 s, and when all 32 are taken a new connection
//! evicts the oldest one being vetted — so silent connections from many addresses cannot keep
//! the primary out (it completes its hello within a round trip or a TLS handshake, long before
//! it would be the oldest). With TLS the peer's certificate must be valid for the VM
//! (`vm-ID.tandem.invalid`, or `*.tandem.invalid` for any VM).

use std::collections::HashSet;
use std::io::Read;
use std::net::{IpAddr, TcpListener, TcpStream};
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
pub struct Admission {
    /// This backup's VM.
    pub vm_id: u64,
    /// Mutual TLS, if configured.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// A connection being vetted.
struct Slot {
    id: u64,
    ip: IpAddr,
    /// A handle to close it when it is evicted.
    tcp: TcpStream,
}

/// The connections being vetted, oldest first.
#[derive(Default)]
struct Slots {
    slots: Vec<Slot>,
    next: u64,
}

impl Slots {
    /// Takes a slot for a new connection from `ip` (`None`: its address has too many): when
    /// all are taken, the oldest connection being vetted is closed to make room.
    fn take(&mut self, ip: IpAddr, tcp: &TcpStream) -> Option<(u64, Option<IpAddr>)> {
        if self.slots.iter().filter(|s| s.ip == ip).count() >= MAX_PER_ADDRESS {
            return None;
        }
        let evicted = (self.slots.len() >= MAX_VETTING).then(|| {
            let old = self.slots.remove(0);
            let _ = old.tcp.shutdown(std::net::Shutdown::Both);
            old.ip
        });
        let id = self.next;
        self.next += 1;
        self.slots.push(Slot {
            id,
            ip,
            tcp: tcp.try_clone().ok()?,
        });
        Some((id, evicted))
    }

    fn done(&mut self, id: u64) {
        self.slots.retain(|s| s.id != id);
    }
}

/// Starts accepting on `listener`; vetted connections arrive on the returned channel.
pub fn start(listener: TcpListener, gate: Admission, status: Status) -> Receiver<Vetted> {
    let (tx, rx) = sync_channel(4);
    let gate = Arc::new(gate);
    let said = Arc::new(Mutex::new(HashSet::new()));
    let busy = Arc::new(Mutex::new(Slots::default()));
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
                let taken = busy
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take(ip, &tcp);
                let Some((id, evicted)) = taken else {
                    once(
                        &said,
                        &status,
                        ip,
                        "too many connections from this address being vetted",
                        "closed at once",
                    );
                    continue;
                };
                if let Some(old) = evicted {
                    once(
                        &said,
                        &status,
                        old,
                        "evicted: all vetting slots taken and this was the oldest",
                        "closed",
                    );
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
                        busy.lock().unwrap_or_else(|e| e.into_inner()).done(id);
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

fn vet(tcp: std::net::TcpStream, gate: &Admission) -> Result<Vetted, (&'static str, String)> {
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
    if gate.tls.is_some() && !conn.peer_valid_for_vm(gate.vm_id) {
        return Err((
            "certificate not valid for this VM",
            format!(
                "the primary's certificate names no {} (nor *.tandem.invalid): a certificate of the CA may serve only the VMs it names",
                crate::tls::vm_name(gate.vm_id)
            ),
        ));
    }
    conn.set_read_timeout(None)
        .map_err(|e| ("socket error", e.to_string()))?;
    Ok(Vetted { conn, hello })
}

/// A hello frame is a 32-byte header and a payload of at most 53 bytes.
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

fn check(f: Frame, gate: &Admission) -> Result<Frame, (&'static str, String)> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{SocketAddr, TcpStream};

    fn hello(vm: u64) -> Vec<u8> {
        let f = Frame {
            kind: Kind::Hello,
            vm_id: vm,
            seq: 0,
            payload: tandem_replication::hello_payload(1 << 20, 0),
        };
        let mut b = Vec::new();
        f.write_to(&mut b).unwrap();
        b
    }

    fn from(ip: [u8; 4], to: SocketAddr) -> TcpStream {
        let s = rustix::net::socket(
            rustix::net::AddressFamily::INET,
            rustix::net::SocketType::STREAM,
            None,
        )
        .unwrap();
        rustix::net::bind(&s, &SocketAddr::from((ip, 0))).unwrap();
        rustix::net::connect(&s, &to).unwrap();
        TcpStream::from(s)
    }

    #[test]
    fn silent_connections_from_many_addresses_do_not_keep_the_primary_out() {
        // Finding 8: 8 addresses × 4 silent connections filled all 32 slots, and the real
        // primary was closed at once for 5 s after each attempt.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = l.local_addr().unwrap();
        let rx = start(
            l,
            Admission {
                vm_id: 7,
                tls: None,
            },
            Status::new("test", |_| {}),
        );
        let mut silent = Vec::new();
        for a in 2..=9u8 {
            for _ in 0..MAX_PER_ADDRESS {
                silent.push(from([127, 0, 0, a], to));
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let mut primary = from([127, 0, 0, 10], to);
        primary.write_all(&hello(7)).unwrap();
        let v = rx
            .recv_timeout(Duration::from_secs(2))
            .expect("the primary is vetted although every slot was taken");
        assert_eq!(v.hello.vm_id, 7);
        assert!(t.elapsed() < Duration::from_secs(2));
        // One address still cannot take more than its share.
        let mut more = Vec::new();
        for _ in 0..MAX_PER_ADDRESS + 2 {
            more.push(from([127, 0, 0, 11], to));
        }
        std::thread::sleep(Duration::from_millis(300));
        let n = busy_of(&more);
        assert!(n <= MAX_PER_ADDRESS, "{n} connections of one address held");
    }

    /// How many of `conns` are still open (the gate closed the others).
    fn busy_of(conns: &[TcpStream]) -> usize {
        conns
            .iter()
            .filter(|c| {
                c.set_nonblocking(true).unwrap();
                let mut b = [0u8; 1];
                matches!(std::io::Read::read(&mut &**c, &mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            })
            .count()
    }
}
