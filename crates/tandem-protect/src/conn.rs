//! A replication connection: plain TCP, or TLS (docs/REPLICATION.md, "Link security").
//!
//! With TLS the daemons' threads do not share a rustls connection: a pump thread owns it and
//! the TCP socket, and moves plaintext to and from one end of a unix socket pair; the daemon
//! reads and writes the other end exactly as it would a TCP socket (blocking, with timeouts,
//! cloneable for a reader and a writer thread). TCP's own options (`TCP_USER_TIMEOUT`,
//! keepalive) stay on the TCP socket, so a dead peer is still noticed: the pump's TLS write
//! fails and it closes the daemon's end.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// One end of the replication link.
pub struct Conn {
    io: Io,
    tcp: TcpStream,
    /// With TLS: the peer's end-entity certificate (already verified against the CA).
    peer_cert: Option<rustls::pki_types::CertificateDer<'static>>,
}

enum Io {
    Plain(TcpStream),
    Tls(UnixStream),
}

impl Conn {
    /// A plain TCP connection.
    pub fn plain(tcp: TcpStream) -> std::io::Result<Conn> {
        Ok(Conn {
            io: Io::Plain(tcp.try_clone()?),
            tcp,
            peer_cert: None,
        })
    }

    /// A TLS connection whose handshake completed: starts the pump.
    pub fn tls(tcp: TcpStream, tls: rustls::Connection) -> std::io::Result<Conn> {
        let peer_cert = tls
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.clone().into_owned());
        let (mine, pumps) = UnixStream::pair()?;
        let t = tcp.try_clone()?;
        std::thread::Builder::new()
            .name("tls-pump".into())
            .spawn(move || {
                if let Err(e) = pump(tls, &t, &pumps) {
                    tracing::debug!("tls pump: {e}");
                }
                let _ = t.shutdown(Shutdown::Both);
                let _ = pumps.shutdown(Shutdown::Both);
            })?;
        Ok(Conn {
            io: Io::Tls(mine),
            tcp,
            peer_cert,
        })
    }

    /// Whether the peer's certificate may serve VM `vm_id` (`vm-ID.tandem.invalid` or
    /// `*.tandem.invalid` among its names). A plain connection has none: false.
    pub fn peer_valid_for_vm(&self, vm_id: u64) -> bool {
        self.peer_cert
            .as_ref()
            .is_some_and(|c| crate::tls::valid_for_vm(c, vm_id))
    }

    /// Another handle on the same connection (one thread reads, another writes).
    pub fn try_clone(&self) -> std::io::Result<Conn> {
        Ok(Conn {
            io: match &self.io {
                Io::Plain(s) => Io::Plain(s.try_clone()?),
                Io::Tls(s) => Io::Tls(s.try_clone()?),
            },
            tcp: self.tcp.try_clone()?,
            peer_cert: self.peer_cert.clone(),
        })
    }

    /// The TCP socket underneath (for its options).
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }

    /// Bounds blocking reads.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match &self.io {
            Io::Plain(s) => s.set_read_timeout(t),
            Io::Tls(s) => s.set_read_timeout(t),
        }
    }

    /// Bounds blocking writes.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.tcp.set_write_timeout(t)?;
        match &self.io {
            Io::Plain(s) => s.set_write_timeout(t),
            Io::Tls(s) => s.set_write_timeout(t),
        }
    }

    /// Closes the connection both ways (unblocks every thread using it). What was written
    /// before still reaches the peer: TCP sends it before its FIN; with TLS the pump forwards
    /// it, then sends close_notify and closes TCP.
    pub fn shutdown(&self) {
        match &self.io {
            Io::Plain(_) => {
                let _ = self.tcp.shutdown(Shutdown::Both);
            }
            Io::Tls(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    /// Closes the sending direction only (the peer reads EOF; replies still arrive).
    pub fn shutdown_write(&self) {
        match &self.io {
            Io::Plain(s) => {
                let _ = s.shutdown(Shutdown::Write);
            }
            Io::Tls(s) => {
                let _ = s.shutdown(Shutdown::Write);
            }
        }
    }

    /// Whether the link is encrypted.
    pub fn is_tls(&self) -> bool {
        matches!(self.io, Io::Tls(_))
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &mut self.io {
            Io::Plain(s) => s.read(buf),
            Io::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &mut self.io {
            Io::Plain(s) => s.write(buf),
            Io::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.io {
            Io::Plain(s) => s.flush(),
            Io::Tls(s) => s.flush(),
        }
    }
}

/// Plaintext waiting for the daemon beyond this stops reading TLS (backpressure).
const PENDING_LIMIT: usize = 4 << 20;

/// How long the pump waits for the peer's close after the daemon closed its end.
const LINGER: Duration = Duration::from_secs(5);

fn would_block(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock
}

/// Moves bytes between the TLS connection on `tcp` and the daemon's unix socket until
/// either side closes or fails.
fn pump(mut tls: rustls::Connection, tcp: &TcpStream, local: &UnixStream) -> std::io::Result<()> {
    tcp.set_nonblocking(true)?;
    local.set_nonblocking(true)?;
    let (mut tcp_r, mut tcp_w, mut loc) = (tcp, tcp, local);
    let mut to_local: Vec<u8> = Vec::new();
    let mut off = 0;
    let mut buf = vec![0u8; 1 << 16];
    let (mut tcp_eof, mut local_eof) = (false, false);
    let (mut tcp_shut, mut local_shut) = (false, false);
    let mut local_eof_at = std::time::Instant::now();
    // Application data that arrived with the last handshake messages is already decrypted.
    loop {
        match tls.reader().read(&mut buf) {
            Ok(0) => {
                tcp_eof = true;
                break;
            }
            Ok(n) => to_local.extend_from_slice(&buf[..n]),
            Err(_) => break,
        }
    }
    loop {
        // Flush what is pending in both directions.
        while off < to_local.len() {
            match loc.write(&to_local[off..]) {
                Ok(n) => off += n,
                Err(e) if would_block(&e) => break,
                Err(_) => {
                    // The daemon closed its end: what the peer sends is dropped, but what
                    // the daemon wrote before (a last `fenced` or `bye`) still goes out.
                    off = to_local.len();
                    if !local_eof {
                        local_eof = true;
                        local_eof_at = std::time::Instant::now();
                        tls.send_close_notify();
                    }
                }
            }
        }
        if off == to_local.len() {
            to_local.clear();
            off = 0;
        }
        while tls.wants_write() {
            match tls.write_tls(&mut tcp_w) {
                Ok(_) => {}
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(e),
            }
        }
        if tcp_eof && to_local.is_empty() && !local_shut {
            let _ = local.shutdown(Shutdown::Write);
            local_shut = true;
        }
        if local_eof && !tls.wants_write() && !tcp_shut {
            let _ = tcp.shutdown(Shutdown::Write);
            tcp_shut = true;
        }
        let drained = to_local.is_empty() && !tls.wants_write();
        // Done when both sides closed and everything went out; or the daemon closed and the
        // peer neither reads nor closes within the linger time.
        if local_eof && ((drained && tcp_eof) || local_eof_at.elapsed() > LINGER) {
            return Ok(());
        }
        let tcp_events = (if !tcp_eof && to_local.len() < PENDING_LIMIT {
            libc::POLLIN
        } else {
            0
        }) | (if tls.wants_write() { libc::POLLOUT } else { 0 });
        let local_events = (if !local_eof && !tls.wants_write() {
            libc::POLLIN
        } else {
            0
        }) | (if to_local.is_empty() {
            0
        } else {
            libc::POLLOUT
        });
        // A descriptor with nothing to wait for is left out (-1): its HUP would spin the loop.
        let fd = |f: i32, ev: i16| if ev == 0 { -1 } else { f };
        let mut fds = [
            libc::pollfd {
                fd: fd(tcp.as_raw_fd(), tcp_events),
                events: tcp_events,
                revents: 0,
            },
            libc::pollfd {
                fd: fd(local.as_raw_fd(), local_events),
                events: local_events,
                revents: 0,
            },
        ];
        // SAFETY: `fds` holds two valid pollfds for descriptors this thread keeps open.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, 200) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let ready = |i: usize| fds[i].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
        if ready(0) && !tcp_eof {
            match tls.read_tls(&mut tcp_r) {
                Ok(0) => tcp_eof = true,
                Ok(_) => {
                    let st = tls.process_new_packets().map_err(|e| {
                        // Tell the peer why before closing.
                        let _ = tls.write_tls(&mut tcp_w);
                        std::io::Error::other(e)
                    })?;
                    let _ = st;
                    loop {
                        match tls.reader().read(&mut buf) {
                            Ok(0) => {
                                tcp_eof = true;
                                break;
                            }
                            Ok(n) => to_local.extend_from_slice(&buf[..n]),
                            Err(e) if would_block(&e) => break,
                            Err(e) => return Err(e),
                        }
                    }
                }
                Err(e) if would_block(&e) => {}
                Err(e) => return Err(e),
            }
        }
        if ready(1) && !local_eof && !tls.wants_write() {
            match loc.read(&mut buf) {
                Ok(0) => {
                    local_eof = true;
                    local_eof_at = std::time::Instant::now();
                    tls.send_close_notify();
                }
                Ok(n) => tls.writer().write_all(&buf[..n])?,
                Err(e) if would_block(&e) => {}
                Err(e) => return Err(e),
            }
        }
    }
}
