//! Process-wide stop requests. The binary installs the handlers
//! ([`install_stop_handler`]); every daemon loop polls [`stopping`].
//!
//! SIGINT and SIGTERM ask for a stop (the primary hands the guest over to the backup);
//! SIGUSR1 asks for a stop that ends protection ([`shutdown_requested`]: the primary shuts
//! its guest down and the backup does not fail over).

use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);
static SHUTDOWN: AtomicBool = AtomicBool::new(false);
static SWITCHOVER: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    if sig == libc::SIGUSR1 {
        SHUTDOWN.store(true, Ordering::SeqCst);
    }
    STOP.store(true, Ordering::SeqCst);
}

/// SIGINT, SIGTERM and SIGUSR1 ask the process to stop ([`stopping`]); SIGUSR1 also sets
/// [`shutdown_requested`].
pub fn install_stop_handler() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1] {
        // SAFETY: the handler only stores to atomics, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// Asks every daemon loop of this process to stop, as SIGTERM does.
pub fn request_stop() {
    STOP.store(true, Ordering::SeqCst);
}

/// Whether a stop was requested.
pub fn stopping() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// The operator asked to end protection and shut the guest down (SIGUSR1), not to hand it
/// over.
pub fn shutdown_requested() -> bool {
    SHUTDOWN.load(Ordering::SeqCst)
}

/// Asks the primary for a planned switchover (`tandem switchover`): hand the guest over to
/// the backup, then serve as its backup.
pub fn request_switchover() {
    SWITCHOVER.store(true, Ordering::SeqCst);
}

/// Whether a switchover was requested and not yet carried out.
pub fn switchover_requested() -> bool {
    SWITCHOVER.load(Ordering::SeqCst)
}

/// The switchover was carried out (or refused): clears the request.
pub fn clear_switchover() {
    SWITCHOVER.store(false, Ordering::SeqCst);
}

/// Whether the primary's epoch loop should end: a stop or a switchover was requested.
pub fn leaving() -> bool {
    stopping() || switchover_requested()
}
