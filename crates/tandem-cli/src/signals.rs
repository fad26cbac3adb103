//! The binary's signals, forwarded to the daemon it runs: SIGINT and SIGTERM ask for a stop
//! (the primary hands the guest over to the backup), SIGUSR1 for a stop that ends protection
//! (the primary shuts its guest down, the backup does not fail over).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tandem_protect::Stop;

static STOP: AtomicBool = AtomicBool::new(false);
static SHUTDOWN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    if sig == libc::SIGUSR1 {
        SHUTDOWN.store(true, Ordering::SeqCst);
    }
    STOP.store(true, Ordering::SeqCst);
}

/// Installs the handlers of SIGINT, SIGTERM and SIGUSR1.
pub fn install() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1] {
        // SAFETY: the handler only stores to atomics, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// Whether a stop signal came.
pub fn stopping() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Installs the handlers and passes each stop signal on to `stop` (a thread that looks every
/// 10 ms, for as long as the process runs).
pub fn forward_to(stop: Stop) {
    install();
    std::thread::spawn(move || loop {
        if SHUTDOWN.load(Ordering::SeqCst) {
            stop.request_shutdown();
            return;
        }
        if STOP.load(Ordering::SeqCst) {
            stop.request_stop();
            // A SIGUSR1 after a SIGTERM still turns the stop into a shutdown.
        }
        std::thread::sleep(Duration::from_millis(10));
    });
}

/// A [`Stop`] that the process's stop signals set.
pub fn stop() -> Stop {
    let s = Stop::new();
    forward_to(s.clone());
    s
}
