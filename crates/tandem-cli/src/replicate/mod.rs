//! `tandem primary` and `tandem backup`: continuous replication over TCP with output commit
//! (network frames held by tandem's relay, disk writes shipped with their epoch) and failover
//! onto a standby QEMU pre-started on the backup's mirror file.

mod backup;
mod primary;
mod site;

pub use backup::{backup, BackupArgs};
pub use primary::{primary, PrimaryArgs};

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use tandem_replication::Frame;

static STOP: AtomicBool = AtomicBool::new(false);
static SHUTDOWN: AtomicBool = AtomicBool::new(false);
static KILL_IN_PAUSE: AtomicBool = AtomicBool::new(false);

extern "C" fn on_fault_signal(_: libc::c_int) {
    KILL_IN_PAUSE.store(true, Ordering::SeqCst);
}

/// Fault injection for tests (`tandem primary --fault-hooks`): SIGUSR2 makes the primary kill
/// its QEMU inside the next checkpoint pause, while the guest is stopped.
pub(crate) fn install_fault_hooks() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGUSR2,
            on_fault_signal as *const () as libc::sighandler_t,
        )
    };
}

/// Whether a kill inside the pause was requested (and clears the request).
pub(crate) fn take_kill_in_pause() -> bool {
    KILL_IN_PAUSE.swap(false, Ordering::SeqCst)
}

extern "C" fn on_signal(sig: libc::c_int) {
    if sig == libc::SIGUSR1 {
        SHUTDOWN.store(true, Ordering::SeqCst);
    }
    STOP.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM ask the process to stop ([`stopping`]); SIGUSR1 too, and also sets
/// [`shutdown_requested`] (the primary's "end protection and shut the guest down").
pub(crate) fn install_stop_handler() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1] {
        // SAFETY: the handler only stores to atomics, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

pub(crate) fn stopping() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// The operator asked to end protection and shut the guest down (SIGUSR1), not to hand it
/// over.
pub(crate) fn shutdown_requested() -> bool {
    SHUTDOWN.load(Ordering::SeqCst)
}

fn send(w: &mut impl Write, f: &Frame) -> anyhow::Result<()> {
    f.write_to(w).context("writing to the peer")?;
    w.flush().context("writing to the peer")
}

/// Wall-clock time in Unix milliseconds (for reports compared across processes).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Echoes the guest's workload progress lines (`sqlite txns=N`, `compile objs=N`) from its
/// serial console as `guest: ...` lines, for benchmarks and operators.
pub(crate) fn echo_guest_progress(serial: std::path::PathBuf, who: &'static str) {
    std::thread::spawn(move || {
        let mut console = tandem_vm::console::Console::new(&serial);
        let mut done = 0;
        loop {
            std::thread::sleep(std::time::Duration::from_millis(250));
            let Ok(text) = console.poll() else { continue };
            let complete = text.rfind('\n').map_or(0, |i| i + 1);
            for line in text[done.min(complete)..complete].lines() {
                if line.contains(" txns=") || line.contains(" objs=") {
                    println!("{who}: guest: {}", line.trim());
                }
            }
            done = complete;
        }
    });
}
