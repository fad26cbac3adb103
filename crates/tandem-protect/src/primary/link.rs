//! The primary's replication link: connecting (and reconnecting) to the backup with bounded
//! failure detection, and the sender thread that ships epochs in order and heartbeats that
//! carry the epoch loop's progress.

use std::io::{BufWriter, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_replication::{Acks, Frame};

use crate::metrics::{EpochMetrics, Registry};
use crate::Status;

/// Socket options that bound how long a dead or partitioned backup can go unnoticed:
/// `TCP_USER_TIMEOUT` (unacknowledged data), keepalive probes (an idle link) and no Nagle.
pub fn tune(s: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    use rustix::net::sockopt;
    s.set_nodelay(true)?;
    sockopt::set_tcp_user_timeout(s, timeout.as_millis().clamp(1, u32::MAX as u128) as u32)?;
    sockopt::set_socket_keepalive(s, true)?;
    let idle = (timeout / 3).max(Duration::from_secs(1));
    sockopt::set_tcp_keepidle(s, idle)?;
    sockopt::set_tcp_keepintvl(s, idle)?;
    sockopt::set_tcp_keepcnt(s, 3)?;
    // A write that cannot make progress for this long fails instead of blocking forever.
    s.set_write_timeout(Some(timeout))?;
    Ok(())
}

/// The backup could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The address does not resolve.
    #[error("resolving the backup address {0}")]
    Resolve(String, #[source] std::io::Error),
    /// It resolves to nothing.
    #[error("{0} resolves to no address")]
    NoAddress(String),
    /// Every address refused or timed out.
    #[error("connecting to the backup at {0}")]
    Connect(String, #[source] std::io::Error),
}

/// One connection attempt to `addr` within `timeout`.
pub fn connect_once(addr: &str, timeout: Duration) -> Result<TcpStream, ConnectError> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| ConnectError::Resolve(addr.into(), e))?
        .collect();
    let mut last = None;
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(
        || ConnectError::NoAddress(addr.into()),
        |e| ConnectError::Connect(addr.into(), e),
    ))
}

/// What the sender sends.
pub enum Out {
    /// An epoch and its metrics.
    Epoch(Frame, Box<EpochMetrics>),
    /// A part of the next epoch (committed by its epoch frame).
    Part(Frame),
    /// A control frame (bye, handover).
    Control(Frame),
}

/// Smallest epoch (dirty pages) that updates the shipping rate.
pub const RATE_MIN_PAGES: u64 = 32;

/// State shared by the session's threads.
pub struct Shared {
    pub acks: Mutex<Acks>,
    /// The link broke, or the backup misbehaved: end the session.
    pub lost: AtomicBool,
    pub lost_why: Mutex<Option<String>>,
    /// The backup runs the guest: stop this copy.
    pub fenced: AtomicBool,
    /// The epoch the backup resumed the guest from, when fenced.
    pub fenced_at: AtomicU64,
    /// Epochs the epoch loop has completed (heartbeats carry it).
    pub progress: AtomicU64,
    /// Metrics of the epochs sent and not yet acknowledged (written out at their ack).
    pub pending: Mutex<std::collections::VecDeque<EpochMetrics>>,
    /// Dirty pages shipped per second end to end (encode to acknowledgement), a moving
    /// average over acknowledged epochs; 0 before the first. The adaptive schedule's stop
    /// threshold derives from it (seed 002's bandwidth_approx).
    pub ship_rate: AtomicU64,
    /// The zstd level the next epochs are encoded at (moved by each acknowledgement).
    pub level: std::sync::atomic::AtomicI32,
    /// When the last byte of each epoch's frame not yet acknowledged was handed to the link,
    /// oldest first: the backup received all of epoch N no earlier, so it takes over no
    /// earlier than that plus its promise (the deadline of N's release).
    pub last_byte: Mutex<std::collections::VecDeque<(u64, Instant)>>,
    /// The session is ending: no release may start any more (the link closes once every
    /// release in progress is done, so the backup sees the close only after them).
    pub closing: AtomicBool,
    /// Newest epoch whose output was released.
    pub released: AtomicU64,
    /// The session the backup says it took over when it fenced this primary.
    pub fenced_session: Mutex<Option<u64>>,
    /// Why the backup refused the session, if it did.
    pub refused: Mutex<Option<String>>,
    /// Since when an acknowledgement's output has waited because it came after the backup's
    /// promise ran out (`None`: nothing waits).
    pub deferred_since: Mutex<Option<Instant>>,
    /// Heartbeat period now (µs): the configured one, shortened to a quarter of the backup's
    /// promise so that a backup with a short timeout never finds the link silent (shared by
    /// the daemon's sessions: the next session starts with what the last promise asked).
    pub heartbeat_us: Arc<AtomicU64>,
}

impl Shared {
    pub fn new(acks: Acks, progress: u64) -> Self {
        Shared {
            acks: Mutex::new(acks),
            lost: AtomicBool::new(false),
            lost_why: Mutex::new(None),
            fenced: AtomicBool::new(false),
            fenced_at: AtomicU64::new(0),
            progress: AtomicU64::new(progress),
            pending: Mutex::default(),
            ship_rate: AtomicU64::new(0),
            level: std::sync::atomic::AtomicI32::new(1),
            last_byte: Mutex::default(),
            closing: AtomicBool::new(false),
            released: AtomicU64::new(progress),
            fenced_session: Mutex::new(None),
            refused: Mutex::new(None),
            deferred_since: Mutex::new(None),
            heartbeat_us: Arc::new(AtomicU64::new(100_000)),
        }
    }

    /// Shares the daemon's heartbeat period.
    pub fn with_heartbeat(mut self, heartbeat_us: Arc<AtomicU64>) -> Self {
        self.heartbeat_us = heartbeat_us;
        self
    }

    /// When the last byte of epoch `seq` was handed to the link (`None`: not recorded yet);
    /// forgets the epochs before it.
    pub fn last_byte_of(&self, seq: u64) -> Option<Instant> {
        let mut q = self.last_byte.lock().unwrap_or_else(|e| e.into_inner());
        while q.front().is_some_and(|(s, _)| *s < seq) {
            q.pop_front();
        }
        q.front().filter(|(s, _)| *s == seq).map(|(_, t)| *t)
    }

    /// The heartbeat period now.
    pub fn heartbeat(&self) -> Duration {
        Duration::from_micros(self.heartbeat_us.load(Ordering::Relaxed).max(1_000))
    }

    /// Folds one acknowledged epoch into the shipping rate: `pages` dirty pages took `us`
    /// from the start of their encoding to their acknowledgement. Epochs of fewer than
    /// [`RATE_MIN_PAGES`] pages are skipped: their time is the link's round trip, not a rate.
    pub fn observe_ship(&self, pages: u64, us: u64) {
        if pages < RATE_MIN_PAGES || us == 0 {
            return;
        }
        let sample = pages.saturating_mul(1_000_000) / us;
        let old = self.ship_rate.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            (old * 3 + sample) / 4
        };
        self.ship_rate.store(new.max(1), Ordering::Relaxed);
    }

    /// Moves the level after an epoch encoded at `level` in `encode_us` and acknowledged
    /// `wait_us` after it was sent.
    pub fn observe_level(&self, level: i32, encode_us: u64, wait_us: u64) {
        let next = tandem_codec::level::next(level, encode_us, wait_us);
        self.level.store(next, Ordering::Relaxed);
    }

    /// The shipping rate in pages per second, once measured.
    pub fn ship_rate(&self) -> Option<u64> {
        Some(self.ship_rate.load(Ordering::Relaxed)).filter(|&r| r > 0)
    }

    pub fn acks(&self) -> std::sync::MutexGuard<'_, Acks> {
        self.acks.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn pending(&self) -> std::sync::MutexGuard<'_, std::collections::VecDeque<EpochMetrics>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the link lost (the first reason is kept).
    pub fn lose(&self, why: String) {
        let mut w = self.lost_why.lock().unwrap_or_else(|e| e.into_inner());
        if w.is_none() {
            *w = Some(why);
        }
        self.lost.store(true, Ordering::SeqCst);
    }

    pub fn why(&self) -> String {
        self.lost_why
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_else(|| "the link was lost".into())
    }

    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

/// The sender's settings.
pub struct SenderOpts {
    pub vm_id: u64,
    /// Fault injection for tests: after sending half of this epoch's frame, stall forever.
    pub stall_epoch: Option<u64>,
}

pub fn send(w: &mut impl Write, f: &Frame) -> std::io::Result<()> {
    f.write_to(w)?;
    w.flush()
}

/// Sends `f` and returns when its last byte was handed to the link: the frame goes out but
/// for its last byte, then the time is taken, then the last byte goes. The peer receives the
/// whole frame no earlier than that time, whatever the buffers in between do.
pub fn send_marked(w: &mut impl Write, f: &Frame) -> std::io::Result<Instant> {
    let h = f.header()?;
    let last = match f.payload.split_last() {
        Some((last, most)) => {
            w.write_all(&h)?;
            w.write_all(most)?;
            *last
        }
        None => {
            w.write_all(&h[..h.len() - 1])?;
            h[h.len() - 1]
        }
    };
    w.flush()?;
    let t = Instant::now();
    w.write_all(&[last])?;
    w.flush()?;
    Ok(t)
}

/// Ships frames from `rx` in order; sends a heartbeat with the loop's progress whenever
/// nothing else was sent for `heartbeat`. Ends when `rx` closes or a write fails (then the
/// session is marked lost). Never sends `bye` by itself: only an `Out::Control` does.
pub fn spawn_sender(
    stream: crate::conn::Conn,
    rx: Receiver<Out>,
    shared: Arc<Shared>,
    registry: Registry,
    o: SenderOpts,
    status: Status,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut w = BufWriter::with_capacity(1 << 20, stream);
        // Time spent sending the parts of the next epoch: part of its transfer.
        let mut parts_us = 0;
        loop {
            let r = match rx.recv_timeout(shared.heartbeat()) {
                Ok(Out::Epoch(f, mut m)) => {
                    let t = Instant::now();
                    shared.acks().sent(f.seq, t);
                    if o.stall_epoch == Some(f.seq) {
                        crate::faults::stall(&mut w, &f, &status);
                    }
                    let r = send_marked(&mut w, &f).map(|last| {
                        shared
                            .last_byte
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push_back((f.seq, last));
                    });
                    m.transfer_us = t.elapsed().as_micros() as u64 + std::mem::take(&mut parts_us);
                    if let Some(p) = shared.pending().iter_mut().find(|p| p.epoch == f.seq) {
                        p.transfer_us = m.transfer_us;
                    }
                    registry.sent(&m);
                    r
                }
                Ok(Out::Part(f)) => {
                    let t = Instant::now();
                    let r = send(&mut w, &f);
                    parts_us += t.elapsed().as_micros() as u64;
                    r
                }
                Ok(Out::Control(f)) => send(&mut w, &f),
                Err(RecvTimeoutError::Timeout) => {
                    let p = shared.progress.load(Ordering::SeqCst);
                    send(
                        &mut w,
                        &tandem_replication::wire::heartbeat_frame(o.vm_id, p),
                    )
                }
                Err(RecvTimeoutError::Disconnected) => return,
            };
            if let Err(e) = r {
                shared.lose(format!("writing to the backup: {e}"));
                return;
            }
            if shared.is_lost() {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipping_rate_averages_epochs_and_ignores_tiny_ones() {
        let s = Shared::new(Acks::new(1, 0), 0);
        assert_eq!(s.ship_rate(), None);
        s.observe_ship(10, 1_000); // below RATE_MIN_PAGES: a round trip, not a rate
        s.observe_ship(1_000, 0);
        assert_eq!(s.ship_rate(), None);
        s.observe_ship(1_000, 10_000); // 100 000 pages/s
        assert_eq!(s.ship_rate(), Some(100_000));
        s.observe_ship(1_000, 50_000); // 20 000 pages/s: ¾ old + ¼ new
        assert_eq!(s.ship_rate(), Some(80_000));
    }
}
