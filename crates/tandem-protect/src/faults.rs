//! Fault injection for the lab's tests, compiled only with the `fault-hooks` feature.
//!
//! The lab (tandem-harness) builds the `tandem` binary with this feature to kill or stall a
//! primary at moments a test cannot reach from outside: inside the guest's checkpoint pause,
//! between an acknowledgement and its release, in the middle of an epoch's frame, at each step
//! of a handover. Without the feature every hook below is a constant no-op and
//! [`PrimaryConfig`](crate::primary::PrimaryConfig) has no `faults` field, so the default
//! build carries none of it.

use std::io::Write;

use tandem_replication::Frame;

use crate::primary::PrimaryConfig;
use crate::status::Status;

/// A step of a planned handover at which [`Faults::kill_at`] kills the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandoverStep {
    /// The last epoch was sent to the backup.
    HandoverShipped,
    /// Its output was released.
    HandoverReleased,
    /// The handover frame was written.
    HandoverSent,
}

impl HandoverStep {
    /// The step's name, as the `--fault-kill-at` flag spells it.
    pub fn name(self) -> &'static str {
        match self {
            HandoverStep::HandoverShipped => "handover-shipped",
            HandoverStep::HandoverReleased => "handover-released",
            HandoverStep::HandoverSent => "handover-sent",
        }
    }
}

#[cfg(feature = "fault-hooks")]
pub use hooks::{install_signal_hooks, Faults};

#[cfg(feature = "fault-hooks")]
mod hooks {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::HandoverStep;

    pub(super) static KILL_IN_PAUSE: AtomicBool = AtomicBool::new(false);
    pub(super) static STOP_AT_ACK: AtomicBool = AtomicBool::new(false);

    /// The faults a primary injects into itself.
    #[derive(Clone, Debug, Default)]
    pub struct Faults {
        /// Send half of this epoch's frame, then stall until killed.
        pub stall_epoch: Option<u64>,
        /// SIGKILL the process group (the daemon and its QEMU, as a host failure) when a
        /// handover reaches this step.
        pub kill_at: Option<HandoverStep>,
    }

    extern "C" fn on_fault_signal(sig: libc::c_int) {
        if sig == libc::SIGWINCH {
            STOP_AT_ACK.store(true, Ordering::SeqCst);
        } else {
            KILL_IN_PAUSE.store(true, Ordering::SeqCst);
        }
    }

    /// SIGUSR2 makes the primary kill its QEMU inside the next checkpoint pause, while the
    /// guest is stopped; SIGWINCH makes it stop itself (SIGSTOP) right after it reads the next
    /// acknowledgement, before it releases that acknowledgement's output.
    pub fn install_signal_hooks() {
        for sig in [libc::SIGUSR2, libc::SIGWINCH] {
            // SAFETY: the handler only stores to atomics, which is async-signal-safe.
            unsafe { libc::signal(sig, on_fault_signal as *const () as libc::sighandler_t) };
        }
    }
}

/// The epoch whose frame the sender stalls in the middle of.
pub(crate) fn stall_epoch(_cfg: &PrimaryConfig) -> Option<u64> {
    #[cfg(feature = "fault-hooks")]
    return _cfg.faults.stall_epoch;
    #[cfg(not(feature = "fault-hooks"))]
    None
}

/// The compaction step at which the saver aborts.
pub(crate) fn compact_crash(
    _cfg: &crate::checkpoint::SaveConfig,
) -> Option<tandem_store::store::CrashPoint> {
    #[cfg(feature = "fault-hooks")]
    return _cfg.fault_compact;
    #[cfg(not(feature = "fault-hooks"))]
    None
}

/// Kills this process group (the daemon and its QEMU) if the configuration names `step`.
pub(crate) fn kill_point(_cfg: &PrimaryConfig, step: HandoverStep, status: &Status) {
    #[cfg(feature = "fault-hooks")]
    if _cfg.faults.kill_at == Some(step) {
        status.warn(format!(
            "fault injection: killing this host at {}",
            step.name()
        ));
        // SAFETY: kill(2) of this process's own group (a test's host failure).
        unsafe { libc::kill(0, libc::SIGKILL) };
    }
    let _ = (step, status);
}

/// Whether a kill inside the pause was requested (and clears the request).
pub(crate) fn take_kill_in_pause() -> bool {
    #[cfg(feature = "fault-hooks")]
    return hooks::KILL_IN_PAUSE.swap(false, std::sync::atomic::Ordering::SeqCst);
    #[cfg(not(feature = "fault-hooks"))]
    false
}

/// Stops this process (SIGSTOP) if a stop after the next acknowledgement was requested.
pub(crate) fn stop_at_ack(status: &Status) {
    #[cfg(feature = "fault-hooks")]
    if hooks::STOP_AT_ACK.swap(false, std::sync::atomic::Ordering::SeqCst) {
        status.warn(
            "fault injection: stopping this daemon between an acknowledgement and its release",
        );
        // SAFETY: raise(3) with SIGSTOP stops this process until SIGCONT.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
    let _ = status;
}

/// Sends half of `f`, then stalls this thread for good (until the test kills the process).
pub(crate) fn stall(w: &mut impl Write, f: &Frame, status: &Status) -> ! {
    let mut bytes = Vec::new();
    let _ = f.write_to(&mut bytes);
    let _ = w.write_all(&bytes[..bytes.len() / 2]);
    let _ = w.flush();
    status.warn(format!(
        "fault injection: stalled in the middle of epoch {}",
        f.seq
    ));
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
