//! The Prometheus endpoint: a small HTTP/1.0 responder for `GET /metrics`, at most
//! [`MAX_CLIENTS`] scrapes at once, each with [`CLIENT_TIMEOUT`] to ask and to take its answer.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Registry;

/// At most this many scrapes are served at once; more connections get a 503 and are closed.
pub const MAX_CLIENTS: usize = 8;

/// Time a client has to send its request, and again to take the answer.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest request head read.
const MAX_REQUEST: usize = 8192;

/// Serves `GET /metrics` on `addr` from a background thread; returns the bound address.
pub fn serve(addr: &str, reg: Registry) -> std::io::Result<SocketAddr> {
    let l = TcpListener::bind(addr)?;
    let bound = l.local_addr()?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || accept_loop(l, reg))?;
    Ok(bound)
}

/// Frees a client slot when its thread ends (or could not start).
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(l: TcpListener, reg: Registry) {
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let c = match l.accept() {
            Ok((c, _)) => c,
            Err(e) => {
                // E.g. out of descriptors: do not spin.
                tracing::debug!("metrics: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
            let _slot = Slot(active.clone());
            refuse(c);
            continue;
        }
        let slot = Slot(active.clone());
        let reg = reg.clone();
        let spawned = std::thread::Builder::new()
            .name("metrics-client".into())
            .spawn(move || {
                let _slot = slot;
                handle(c, &reg);
            });
        if let Err(e) = spawned {
            tracing::debug!("metrics: cannot start a client thread: {e}");
        }
    }
}

/// Answers 503 without waiting for anything and closes.
fn refuse(c: TcpStream) {
    let _ = c.set_nonblocking(true);
    let _ = (&c).write(
        b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    );
    let _ = c.shutdown(std::net::Shutdown::Both);
}

/// Reads the request head within the deadline; `None` when the client sent nothing usable.
fn read_head(c: &mut TcpStream, deadline: Instant) -> Option<Vec<u8>> {
    let mut req = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        c.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .ok()?;
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => req.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return None,
        }
        if req.windows(4).any(|w| w == b"\r\n\r\n")
            || req.windows(2).any(|w| w == b"\n\n")
            || req.len() >= MAX_REQUEST
        {
            break;
        }
    }
    (!req.is_empty()).then_some(req)
}

/// Writes `data` within the deadline.
fn write_within(c: &mut TcpStream, mut data: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !data.is_empty() {
        let left = deadline
            .checked_duration_since(Instant::now())
            .ok_or(std::io::ErrorKind::TimedOut)?;
        c.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
        match c.write(data) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn handle(mut c: TcpStream, reg: &Registry) {
    let Some(req) = read_head(&mut c, Instant::now() + CLIENT_TIMEOUT) else {
        return;
    };
    let line = req.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (words.next().unwrap_or_default(), words.next());
    let path = path.map(|p| p.split(|&b| b == b'?').next().unwrap_or_default());
    let (status, body) = match (method, path) {
        (b"GET", Some(b"/metrics")) => ("200 OK", reg.render()),
        (b"GET", Some(_)) => ("404 Not Found", "try /metrics\n".to_string()),
        _ => ("400 Bad Request", "GET /metrics\n".to_string()),
    };
    let resp = format!(
        "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if write_within(&mut c, resp.as_bytes(), Instant::now() + CLIENT_TIMEOUT).is_ok() {
        let _ = c.shutdown(std::net::Shutdown::Write);
    }
}
