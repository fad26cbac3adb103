//! The primary's watchdog: if the daemon's main loop stops making progress (a QMP call to a
//! QEMU that hangs or was SIGSTOPped, a stuck disk), it kills QEMU, so that the primary fails
//! the way a crash does — the link closes and the backup takes over — instead of holding the
//! guest hostage while its heartbeats look healthy.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone)]
pub struct Watchdog {
    start: Instant,
    last_ms: Arc<AtomicU64>,
    fired: Arc<AtomicBool>,
    /// The guest is no longer this watchdog's (the node changed role): its thread ends.
    done: Arc<AtomicBool>,
    /// The daemon's progress for systemd's watchdog, moved along with this one.
    service: crate::service::Beat,
}

impl Watchdog {
    /// Watches `qemu_pid`; kills it when no [`Watchdog::beat`] came for `limit`.
    /// Every beat also moves `service` (systemd's watchdog).
    pub fn start(
        qemu_pid: u32,
        limit: Duration,
        service: crate::service::Beat,
        status: crate::Status,
    ) -> Watchdog {
        let w = Watchdog {
            start: Instant::now(),
            last_ms: Arc::new(AtomicU64::new(0)),
            fired: Arc::new(AtomicBool::new(false)),
            done: Arc::new(AtomicBool::new(false)),
            service,
        };
        let me = w.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(50));
            if me.done.load(Ordering::SeqCst) {
                return;
            }
            let idle = me.idle();
            if idle > limit {
                status.warn(format!(
                    "watchdog: the main loop made no progress for {} ms (QEMU not answering?); killing QEMU (pid {qemu_pid}) so that the backup takes over",
                    idle.as_millis()
                ));
                me.fired.store(true, Ordering::SeqCst);
                // SAFETY: kill(2) of the QEMU process this daemon started.
                unsafe { libc::kill(qemu_pid as i32, libc::SIGKILL) };
                return;
            }
        });
        w.beat();
        w
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Time since the main loop last made progress.
    pub fn idle(&self) -> Duration {
        Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.last_ms.load(Ordering::SeqCst)),
        )
    }

    /// The main loop is about to do something that may take up to `d` (re-mirroring a disk):
    /// it counts as progress until then.
    pub fn allow(&self, d: Duration) {
        let until = self.now_ms().saturating_add(d.as_millis() as u64);
        self.last_ms.store(until, Ordering::SeqCst);
        self.service.allow(d);
    }

    /// The main loop made progress.
    pub fn beat(&self) {
        self.last_ms.store(self.now_ms(), Ordering::SeqCst);
        self.service.beat();
    }

    /// Stops watching (the daemon let go of this QEMU).
    pub fn stop(&self) {
        self.done.store(true, Ordering::SeqCst);
    }

    /// Whether the watchdog killed QEMU.
    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::SeqCst)
    }
}
