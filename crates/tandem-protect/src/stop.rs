//! What a daemon's owner asks of it while it runs: stop, end protection, switch over.
//!
//! One [`Stop`] per daemon, shared by its threads and its owner (a [`DaemonHandle`], the
//! control socket's `switchover` command, the binary's signal handlers). Nothing here is
//! process-wide: a program that runs many daemons stops each on its own.
//!
//! [`DaemonHandle`]: crate::DaemonHandle

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Default, Debug)]
struct Requests {
    stop: AtomicBool,
    shutdown: AtomicBool,
    switchover: AtomicBool,
}

/// The requests to one daemon (cheap to clone: every clone is the same daemon's).
#[derive(Clone, Default, Debug)]
pub struct Stop(Arc<Requests>);

impl Stop {
    /// No request yet.
    pub fn new() -> Self {
        Stop::default()
    }

    /// Stop: the primary hands its guest over to a backup that can take it (or shuts it down
    /// when there is none); the backup and the other daemons stop.
    pub fn request_stop(&self) {
        self.0.stop.store(true, Ordering::SeqCst);
    }

    /// Stop and end protection: the primary shuts its guest down and the backup does not fail
    /// over.
    pub fn request_shutdown(&self) {
        self.0.shutdown.store(true, Ordering::SeqCst);
        self.0.stop.store(true, Ordering::SeqCst);
    }

    /// A planned switchover: the primary hands the guest over to its backup, then serves as
    /// that backup (a node started with a listen address).
    pub fn request_switchover(&self) {
        self.0.switchover.store(true, Ordering::SeqCst);
    }

    /// The switchover was carried out (or refused): clears the request.
    pub fn clear_switchover(&self) {
        self.0.switchover.store(false, Ordering::SeqCst);
    }

    /// Whether a stop was requested.
    pub fn stopping(&self) -> bool {
        self.0.stop.load(Ordering::SeqCst)
    }

    /// Whether the owner asked to end protection and shut the guest down, not to hand it over.
    pub fn shutdown_requested(&self) -> bool {
        self.0.shutdown.load(Ordering::SeqCst)
    }

    /// Whether a switchover was requested and not yet carried out.
    pub fn switchover_requested(&self) -> bool {
        self.0.switchover.load(Ordering::SeqCst)
    }

    /// Whether the primary's epoch loop should end: a stop or a switchover was requested.
    pub fn leaving(&self) -> bool {
        self.stopping() || self.switchover_requested()
    }
}

#[cfg(test)]
mod tests {
    use super::Stop;

    #[test]
    fn each_daemon_has_its_own_requests_and_clones_share_them() {
        let (a, b) = (Stop::new(), Stop::new());
        let a2 = a.clone();
        a2.request_switchover();
        assert!(a.leaving() && !a.stopping() && !b.leaving());
        a.clear_switchover();
        assert!(!a2.switchover_requested());
        b.request_shutdown();
        assert!(b.stopping() && b.shutdown_requested() && !a.stopping());
    }
}
