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

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

pub(crate) fn install_stop_handler() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

pub(crate) fn stopping() -> bool {
    STOP.load(Ordering::SeqCst)
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
