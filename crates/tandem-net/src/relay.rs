//! The relay between QEMU's NIC backend and the outside (a tap device).
//!
//! The guest side is either QEMU's `-netdev stream` socket, which frames each Ethernet frame
//! as a 4-byte big-endian length followed by the frame ([`Relay::listen`]), or a tap that QEMU
//! opens with virtio-net headers (`vnet_hdr=on`, what libvirt gives a virtio NIC, so that a
//! guest adopted from such a QEMU keeps its offloads): the relay reads and writes that tap's
//! frames through a packet socket with `PACKET_VNET_HDR`, each with its 10-byte header, and
//! the outside tap is opened with `IFF_VNET_HDR` so the headers pass through untouched
//! ([`Relay::attach_tap`]). The outside is any descriptor with datagram semantics: a tap (one
//! read or write per frame) or, in tests, a unix datagram socket.
//!
//! Policies:
//! - [`Policy::Hold`] (primary): frames from the guest are queued; [`Relay::seal`] closes the
//!   queue of the epoch being checkpointed and [`Relay::release`] writes every sealed queue up
//!   to an acknowledged epoch to the outside. Frames to the guest pass at once. The queues are
//!   bounded ([`Relay::set_hold_limit`], default [`DEFAULT_HOLD_LIMIT`]): a guest frame that
//!   would take the held bytes past the limit is dropped, as on a congested wire (the guest's
//!   TCP resends it), and counted in [`RelayStats::overflow_frames`].
//! - [`Policy::Standby`] (backup before failover): nothing passes either way; the standby QEMU
//!   may connect, its guest is not running.
//! - [`Policy::Pass`] (after failover, or unprotected): both ways at once.
//!
//! Held frames leave the relay only through [`Relay::release`] (sealed epochs up to an
//! acknowledged one) or an explicit switch to [`Policy::Pass`]; [`Relay::discard_held`] and
//! dropping the relay throw them away without writing them.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

mod threads;

use threads::{accept_loop, outside_loop, packet_loop, packet_socket};

/// What the relay lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Hold guest output until its epoch is acknowledged.
    Hold,
    /// Pass nothing (standby).
    Standby,
    /// Pass everything at once.
    Pass,
}

/// A check consulted right before any guest frame leaves: while it returns false, released
/// epochs stay held and frames passing in [`Policy::Pass`] are dropped (fencing: no output
/// once this node learned that etcd's ownership record names another).
pub type Gate = Arc<dyn Fn() -> bool + Send + Sync>;

/// Relay errors.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The unix socket could not be created.
    #[error("cannot listen on {0}")]
    Listen(PathBuf, #[source] std::io::Error),
    /// Writing a released frame to the outside failed.
    #[error("writing a guest frame to the outside")]
    Outside(#[source] std::io::Error),
    /// The packet socket on the guest's tap could not be set up.
    #[error("packet socket on tap {0}")]
    Packet(String, #[source] std::io::Error),
}

/// Default bound of the held guest output: 64 MiB.
pub const DEFAULT_HOLD_LIMIT: u64 = 64 << 20;

/// Counters, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Guest frames held now (unsealed and sealed).
    pub held_frames: u64,
    /// Their bytes.
    pub held_bytes: u64,
    /// Guest frames released to the outside so far.
    pub released_frames: u64,
    /// Frames delivered to the guest so far.
    pub inbound_frames: u64,
    /// Frames dropped: on standby, refused by the outside, or held and then discarded
    /// ([`Relay::discard_held`]).
    pub dropped_frames: u64,
    /// Guest frames dropped on arrival because the held bytes would exceed the hold limit.
    pub overflow_frames: u64,
}

#[derive(Default)]
struct Queues {
    open: Vec<Vec<u8>>,
    sealed: VecDeque<(u64, Vec<Vec<u8>>)>,
    held_bytes: u64,
}

struct Shared {
    policy: Mutex<Policy>,
    queues: Mutex<Queues>,
    guest: Mutex<Option<GuestConn>>,
    outside: File,
    stop: AtomicBool,
    released: AtomicU64,
    inbound: AtomicU64,
    dropped: AtomicU64,
    overflow: AtomicU64,
    hold_limit: AtomicU64,
    gate: Mutex<Option<Gate>>,
    gated: AtomicU64,
}

impl Shared {
    fn open(&self) -> bool {
        let g = lock(&self.gate).clone();
        self.open_with(g.as_ref())
    }

    /// Whether `gate` (fetched once for a batch of frames) lets a frame out now.
    fn open_with(&self, gate: Option<&Gate>) -> bool {
        let open = gate.is_none_or(|g| g());
        if !open {
            self.gated.fetch_add(1, Ordering::Relaxed);
        }
        open
    }
}

/// Where frames to the guest go.
enum GuestConn {
    /// QEMU's stream netdev: length-prefixed frames.
    Stream(UnixStream),
    /// A packet socket on the tap QEMU reads: one frame (with its virtio-net header) per send.
    Packet(Arc<OwnedFd>),
}

impl GuestConn {
    /// Sends `frame`, which `buf` holds at `buf[4..]` (the first four bytes are free for the
    /// stream's length prefix).
    fn send(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            GuestConn::Stream(st) => {
                let n = (buf.len() - 4) as u32;
                buf[..4].copy_from_slice(&n.to_be_bytes());
                st.write_all(buf)
            }
            GuestConn::Packet(fd) => {
                let frame = &buf[4..];
                // SAFETY: `frame` is valid for reads of its length; `fd` is an open socket.
                let r = unsafe {
                    libc::send(
                        fd.as_raw_fd(),
                        frame.as_ptr().cast(),
                        frame.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                if r < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            }
        }
    }

    fn shutdown(&self) {
        if let GuestConn::Stream(st) = self {
            let _ = st.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running relay. Dropping it stops its threads (and removes its guest tap).
pub struct Relay {
    shared: Arc<Shared>,
    /// The stream socket QEMU connects to (none for a tap guest side).
    path: PathBuf,
    /// The tap QEMU opens (none for a stream guest side).
    tap: Option<String>,
}

impl Relay {
    /// Listens on `socket` for QEMU's stream netdev and relays to and from `outside` (a tap).
    /// Start it before QEMU: QEMU connects once, at start-up.
    pub fn listen(socket: &Path, outside: OwnedFd, policy: Policy) -> Result<Relay, RelayError> {
        let _ = std::fs::remove_file(socket);
        let listener =
            UnixListener::bind(socket).map_err(|e| RelayError::Listen(socket.into(), e))?;
        let shared = Self::shared(outside, policy, None);
        let s = shared.clone();
        std::thread::spawn(move || accept_loop(listener, s));
        let s = shared.clone();
        std::thread::spawn(move || outside_loop(s));
        Ok(Relay {
            shared,
            path: socket.into(),
            tap: None,
        })
    }

    /// Relays between the tap `guest_tap` of this process's namespace, which QEMU opens with
    /// `vnet_hdr=on` ([`crate::guest_tap`]), and `outside`, a tap opened with `IFF_VNET_HDR`
    /// ([`crate::open_tap_with`]): every frame carries its virtio-net header both ways. The
    /// relay owns the guest tap: dropping it removes the tap.
    pub fn attach_tap(
        guest_tap: &str,
        outside: OwnedFd,
        policy: Policy,
    ) -> Result<Relay, RelayError> {
        let fd = Arc::new(
            packet_socket(guest_tap).map_err(|e| RelayError::Packet(guest_tap.into(), e))?,
        );
        let shared = Self::shared(outside, policy, Some(GuestConn::Packet(fd.clone())));
        let s = shared.clone();
        std::thread::spawn(move || packet_loop(fd, s));
        let s = shared.clone();
        std::thread::spawn(move || outside_loop(s));
        Ok(Relay {
            shared,
            path: PathBuf::new(),
            tap: Some(guest_tap.into()),
        })
    }

    fn shared(outside: OwnedFd, policy: Policy, guest: Option<GuestConn>) -> Arc<Shared> {
        Arc::new(Shared {
            policy: Mutex::new(policy),
            queues: Mutex::default(),
            guest: Mutex::new(guest),
            outside: File::from(outside),
            stop: AtomicBool::new(false),
            released: AtomicU64::new(0),
            inbound: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            overflow: AtomicU64::new(0),
            hold_limit: AtomicU64::new(DEFAULT_HOLD_LIMIT),
            gate: Mutex::new(None),
            gated: AtomicU64::new(0),
        })
    }

    /// The socket QEMU connects to (empty for a tap guest side).
    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// Closes the current queue of guest frames as belonging to `epoch`. Call it while the guest
    /// is stopped for that epoch's checkpoint: everything read so far was produced before it.
    pub fn seal(&self, epoch: u64) {
        let mut q = lock(&self.shared.queues);
        let frames = std::mem::take(&mut q.open);
        if !frames.is_empty() {
            q.sealed.push_back((epoch, frames));
        }
    }

    /// Writes every frame sealed with an epoch `<= epoch` to the outside, in order; returns
    /// how many were written (a frame the outside refuses is counted as dropped).
    pub fn release(&self, epoch: u64) -> Result<u64, RelayError> {
        self.release_while(epoch, &|| true).map(|(n, _)| n)
    }

    /// Like [`Relay::release`], but `allowed` is consulted (with the gate) right before each
    /// frame is written: once it returns false, this frame and the rest stay held, in order.
    /// The primary's session passes its acknowledgement's deadline here. Returns the frames
    /// written and whether every frame up to `epoch` left (false: some stay held).
    pub fn release_while(
        &self,
        epoch: u64,
        allowed: &dyn Fn() -> bool,
    ) -> Result<(u64, bool), RelayError> {
        let mut n = 0;
        let mut complete = true;
        let mut q = lock(&self.shared.queues);
        // Fetched under the queue lock: once `set_gate` returns, no release runs with the
        // gate it replaced.
        let gate = lock(&self.shared.gate).clone();
        'epochs: while q.sealed.front().is_some_and(|(e, _)| *e <= epoch) {
            let Some((e, frames)) = q.sealed.pop_front() else {
                break;
            };
            let mut frames = frames.into_iter();
            while let Some(f) = frames.next() {
                if !self.shared.open_with(gate.as_ref()) || !allowed() {
                    // The gate closed: this frame and the rest stay held, in order.
                    let mut rest = vec![f];
                    rest.extend(frames);
                    q.sealed.push_front((e, rest));
                    complete = false;
                    break 'epochs;
                }
                q.held_bytes -= f.len() as u64;
                // A frame the tap refuses is lost like on a congested wire (TCP resends);
                // it must not stop the release of the frames after it.
                match write_outside(&self.shared, &f) {
                    Ok(()) => n += 1,
                    Err(e) => {
                        tracing::warn!("relay: {e}: {:?}", std::error::Error::source(&e));
                        self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        self.shared.released.fetch_add(n, Ordering::Relaxed);
        Ok((n, complete))
    }

    /// Switches policy. Switching to [`Policy::Pass`] releases everything still held, sealed
    /// or not (use it when the guest runs unprotected, or after failover on the backup); it is
    /// the only way frames of unacknowledged epochs leave the relay.
    pub fn set_policy(&self, policy: Policy) -> Result<(), RelayError> {
        // Hold the policy lock while releasing: a guest frame arriving meanwhile waits, so it
        // cannot overtake the held ones.
        let mut p = lock(&self.shared.policy);
        *p = policy;
        if policy == Policy::Pass {
            self.seal(u64::MAX);
            self.release(u64::MAX)?;
            // What the gate kept back now would only wait behind frames that pass: in Pass
            // a closed gate drops frames, so these go the same way (TCP resends).
            let kept = take_all(&self.shared);
            self.shared.dropped.fetch_add(kept, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Installs the gate consulted before any guest frame leaves (`None`: always open). It
    /// waits for a release in progress: when it returns, every later frame sees the new gate.
    pub fn set_gate(&self, gate: Option<Gate>) {
        let _q = lock(&self.shared.queues);
        *lock(&self.shared.gate) = gate;
    }

    /// Waits until no release is in progress (a release that starts later sees whatever its
    /// caller's `allowed` says by then).
    pub fn quiesce(&self) {
        drop(lock(&self.shared.queues));
    }

    /// How many times a frame found the gate closed.
    pub fn gated(&self) -> u64 {
        self.shared.gated.load(Ordering::Relaxed)
    }

    /// Bounds the held guest output to `bytes` (sealed and open queues together). A guest frame
    /// that would take the held bytes past it is dropped and counted in
    /// [`RelayStats::overflow_frames`]. Frames already held stay held.
    pub fn set_hold_limit(&self, bytes: u64) {
        self.shared.hold_limit.store(bytes, Ordering::Relaxed);
    }

    /// The current hold limit in bytes.
    pub fn hold_limit(&self) -> u64 {
        self.shared.hold_limit.load(Ordering::Relaxed)
    }

    /// Throws away every held frame, sealed and open, without writing any of them, and
    /// counts them as dropped; returns how many. For a primary that learns another copy of
    /// the guest took over (it is fenced): its held output must never reach the outside.
    /// Frames arriving later are held as usual; switch to [`Policy::Standby`] to drop them too.
    pub fn discard_held(&self) -> u64 {
        let n = take_all(&self.shared);
        self.shared.dropped.fetch_add(n, Ordering::Relaxed);
        n
    }

    /// Whether QEMU is connected.
    pub fn guest_connected(&self) -> bool {
        lock(&self.shared.guest).is_some()
    }

    /// Guest frames held since the last seal (they wait for the next checkpoint).
    pub fn unsealed_frames(&self) -> u64 {
        lock(&self.shared.queues).open.len() as u64
    }

    /// Current counters.
    pub fn stats(&self) -> RelayStats {
        let q = lock(&self.shared.queues);
        RelayStats {
            held_frames: (q.open.len() + q.sealed.iter().map(|s| s.1.len()).sum::<usize>()) as u64,
            held_bytes: q.held_bytes,
            released_frames: self.shared.released.load(Ordering::Relaxed),
            inbound_frames: self.shared.inbound.load(Ordering::Relaxed),
            dropped_frames: self.shared.dropped.load(Ordering::Relaxed),
            overflow_frames: self.shared.overflow.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Relay {
    /// Stops the relay. Held frames are freed, never written out: their epochs were not
    /// acknowledged.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        take_all(&self.shared);
        if let Some(g) = lock(&self.shared.guest).take() {
            g.shutdown();
        }
        if let Some(t) = &self.tap {
            crate::remove_tap(t);
        }
        if !self.path.as_os_str().is_empty() {
            // Wake the acceptor so it sees `stop`.
            let _ = UnixStream::connect(&self.path);
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Empties the hold queues without writing anything; returns how many frames they held.
fn take_all(s: &Shared) -> u64 {
    let mut q = lock(&s.queues);
    let n = q.open.len() + q.sealed.iter().map(|e| e.1.len()).sum::<usize>();
    *q = Queues::default();
    n as u64
}

fn write_outside(s: &Shared, frame: &[u8]) -> Result<(), RelayError> {
    // One write per frame: a tap takes exactly one Ethernet frame per write.
    (&s.outside).write(frame).map_err(RelayError::Outside)?;
    Ok(())
}
