//! Running as a systemd service (`Type=notify`, units in dist/systemd): READY=1 once the
//! daemon serves, STATUS= with the `tandem status` line every second, and WATCHDOG=1 pings
//! while the daemon's main loop makes progress — a hung daemon stops pinging and systemd
//! kills it after `WatchdogSec` (the backup then takes over; a hung primary releases nothing its
//! backup did not acknowledge, see docs/FENCING.md). Outside systemd (no `NOTIFY_SOCKET`) all of this does nothing.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sd_notify::NotifyState;

use crate::metrics::Registry;

/// Progress of a daemon's main loop, for the watchdog pings.
#[derive(Clone)]
pub struct Beat {
    start: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Default for Beat {
    fn default() -> Self {
        Beat {
            start: Instant::now(),
            last_ms: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl Beat {
    /// The main loop made progress.
    pub fn beat(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// The main loop is about to do something that may take up to `d`: progress until then.
    pub fn allow(&self, d: Duration) {
        let until = (self.start.elapsed() + d).as_millis() as u64;
        self.last_ms.store(until, Ordering::Relaxed);
    }

    /// Time since the last [`Beat::beat`].
    pub fn idle(&self) -> Duration {
        let now = self.start.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// The daemon's link to systemd.
pub struct Service {
    enabled: bool,
    stop: Arc<AtomicBool>,
}

impl Service {
    /// Starts the STATUS and WATCHDOG thread when run under systemd; `idle` says how long
    /// the main loop has made no progress.
    pub fn start(registry: Registry, idle: impl Fn() -> Duration + Send + 'static) -> Service {
        let enabled = std::env::var_os("NOTIFY_SOCKET").is_some();
        let stop = Arc::new(AtomicBool::new(false));
        if enabled {
            let mut usec = 0;
            let watchdog =
                sd_notify::watchdog_enabled(false, &mut usec).then(|| Duration::from_micros(usec));
            let s = stop.clone();
            let _ = std::thread::Builder::new()
                .name("sd-notify".into())
                .spawn(move || notify_loop(registry, idle, watchdog, s));
        }
        Service { enabled, stop }
    }

    /// The daemon serves: READY=1.
    pub fn ready(&self) {
        if self.enabled {
            let _ = sd_notify::notify(false, &[NotifyState::Ready]);
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if self.enabled {
            let _ = sd_notify::notify(false, &[NotifyState::Stopping]);
        }
    }
}

fn notify_loop(
    registry: Registry,
    idle: impl Fn() -> Duration,
    watchdog: Option<Duration>,
    stop: Arc<AtomicBool>,
) {
    // Ping at half the watchdog period, but only while the main loop moved within it.
    let period = watchdog.map_or(Duration::from_secs(1), |w| {
        (w / 2).min(Duration::from_secs(1))
    });
    let mut last_status = Instant::now() - Duration::from_secs(2);
    let mut said = false;
    while !stop.load(Ordering::SeqCst) {
        if let Some(w) = watchdog {
            if idle() < w / 2 {
                let _ = sd_notify::notify(false, &[NotifyState::Watchdog]);
                said = false;
            } else if !std::mem::replace(&mut said, true) {
                tracing::warn!(
                    "main loop idle for {:?}: no watchdog ping (systemd restarts the daemon after WatchdogSec)",
                    idle()
                );
            }
        }
        if last_status.elapsed() >= Duration::from_secs(1) {
            last_status = Instant::now();
            let line = crate::control::describe(&registry.status());
            let _ = sd_notify::notify(false, &[NotifyState::Status(&line)]);
        }
        std::thread::sleep(period);
    }
}
