//! The daemons' memory during a round: a thread samples the anonymous resident memory
//! (`RssAnon`) of the primary's and the backup's tandem processes every 20 ms from their start
//! on, initial sync and first epoch included, and keeps the highest. QEMU and the mirror's
//! tmpfs file are other processes' or shared memory, not in it.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Default)]
struct Shared {
    pids: [AtomicU32; 2],
    peaks_kib: [AtomicU64; 2],
    stop: AtomicBool,
}

/// Samples the primary (slot 0) and the backup (slot 1) until dropped.
pub struct MemSampler {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Slot of the primary's daemon.
pub const PRIMARY: usize = 0;
/// Slot of the backup's daemon.
pub const BACKUP: usize = 1;

impl MemSampler {
    pub fn start() -> Self {
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let thread = std::thread::spawn(move || {
            while !s.stop.load(Ordering::Relaxed) {
                for (pid, peak) in s.pids.iter().zip(&s.peaks_kib) {
                    let pid = pid.load(Ordering::Relaxed);
                    if let Some(k) = (pid != 0).then(|| status_kib(pid, "RssAnon:")).flatten() {
                        peak.fetch_max(k, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        MemSampler {
            shared,
            thread: Some(thread),
        }
    }

    /// Samples `pid` in `slot` from now on (a daemon started again replaces the old one).
    pub fn watch(&self, slot: usize, pid: u32) {
        self.shared.pids[slot].store(pid, Ordering::Relaxed);
    }

    /// The highest samples so far, MiB: primary, backup.
    pub fn peaks_mib(&self) -> [f64; 2] {
        [0, 1].map(|i| self.shared.peaks_kib[i].load(Ordering::Relaxed) as f64 / 1024.0)
    }
}

impl Drop for MemSampler {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A KiB figure of /proc/PID/status (`key` with its colon, e.g. `RssAnon:`).
pub(crate) fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
