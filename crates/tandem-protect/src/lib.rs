//! tandem's daemons as a library: [`primary::spawn`] protects a VM by replicating it epoch by
//! epoch to a backup, [`backup::spawn`] applies those epochs and fails over onto a standby
//! QEMU, [`node::spawn`] runs a node that changes role at switchovers and failovers,
//! [`checkpoint::save`] takes incremental checkpoints into a store. Each takes a plain config struct. A spawned daemon runs in its own
//! thread until its [`DaemonHandle`] asks it to stop, and says what it does as [`Event`]s on
//! the handle; the blocking forms (`run`, `save`, ...) take a [`Status`] that carries the same
//! events and the [`Stop`] requests. Nothing is process-wide: one process can run many
//! daemons (the `tandem backup-host` command does). The `tandem` binary parses flags into
//! these structs, forwards its signals to the handle and prints the events.
//!
//! `duration` limits exist for benchmarks only.

#![warn(missing_docs)]

pub mod backup;
pub mod checkpoint;
pub mod conn;
pub mod control;
mod events;
pub mod faults;
mod frontend;
mod handle;
pub mod libvirt;
mod metrics;
pub mod node;
pub mod primary;
pub mod restorer;
mod service;
pub mod site;
mod status;
mod stop;
pub mod tls;
pub mod vmfile;
pub mod vmspec;
pub mod watcher;

pub use events::Event;
pub use handle::{DaemonHandle, EVENT_BACKLOG};
pub use status::{Line, Status};
pub use stop::Stop;
pub use vmspec::{boot, VmSpec};

/// Wall-clock time in Unix milliseconds (for reports compared across processes).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Echoes from the guest's serial console what its kernel says about its clocks and stalls
/// (a clock that jumped after a resume, timers that do not fire: `guest kernel: ...` warnings)
/// and what it says when it breaks (a panic, an oops, the OOM killer), and the lines that
/// contain one of the description's `echo` strings (`guest: ...`). The thread ends with the
/// VM's QEMU (`pid`).
pub(crate) fn echo_guest_console(
    serial: std::path::PathBuf,
    pid: u32,
    echo: Vec<String>,
    status: Status,
) {
    std::thread::spawn(move || {
        let mut console = tandem_vm::console::Console::new(&serial);
        let mut done = 0;
        let alive = std::path::PathBuf::from(format!("/proc/{pid}"));
        loop {
            std::thread::sleep(std::time::Duration::from_millis(250));
            if !alive.exists() {
                return;
            }
            let Ok(text) = console.poll() else { continue };
            let complete = text.rfind('\n').map_or(0, |i| i + 1);
            for line in text[done.min(complete)..complete].lines() {
                if echo.iter().any(|e| line.contains(e.as_str())) {
                    status.info(format!("guest: {}", line.trim()));
                } else if [
                    "clocksource",
                    "timekeeping",
                    "rcu: INFO",
                    "soft lockup",
                    "hung_task",
                    "Kernel panic",
                    "BUG:",
                    "Oops",
                    "general protection fault",
                    "Out of memory",
                    "segfault",
                ]
                .iter()
                .any(|k| line.contains(k))
                {
                    // What the guest kernel says about its clocks and stalls matters after a
                    // resume (a clock that jumped, timers that do not fire), and so does a
                    // guest that breaks.
                    status.warn(format!("guest kernel: {}", line.trim()));
                }
            }
            done = complete;
        }
    });
}

/// An error with its sources, `a: b: c` (for status lines about errors the daemon survives).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s = format!("{s}: {c}");
        src = c.source();
    }
    s
}
