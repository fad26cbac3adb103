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
pub mod disk_copy;
mod events;
pub mod faults;
mod frontend;
mod handle;
pub mod libvirt;
mod metrics;
pub mod node;
pub mod primary;
mod progress;
pub mod report;
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

/// The guest's console file is rotated past this size (to `NAME.1`, one old file kept).
pub const CONSOLE_ROTATE_BYTES: u64 = 16 << 20;

/// Echoes from the guest's serial console what its kernel says about its clocks and stalls
/// (a clock that jumped after a resume, timers that do not fire: `guest kernel: ...` warnings)
/// and what it says when it breaks (a panic, an oops, the OOM killer), and the lines that
/// contain one of the description's `echo` strings (`guest: ...`). It also rotates the console
/// file past [`CONSOLE_ROTATE_BYTES`] (QEMU appends to it). The thread ends with the VM
/// (`vm`'s [`tandem_vm::Vm::lifetime`]); its memory is bounded by the console reader's.
pub(crate) fn echo_guest_console(vm: &tandem_vm::Vm, status: Status) {
    let serial = vm.serial_path();
    let life = vm.lifetime();
    let echo = vm.config().echo.clone();
    let st = status.clone();
    let spawned = std::thread::Builder::new()
        .name("console".into())
        .spawn(move || {
            let mut console = tandem_vm::console::Console::new(&serial);
            let mut done = 0; // position of the first line not yet looked at
            loop {
                std::thread::sleep(std::time::Duration::from_millis(250));
                if life.upgrade().is_none() {
                    return;
                }
                rotate(&serial);
                if console.poll().is_err() {
                    continue;
                }
                let (start, text) = (console.start(), console.text());
                let complete = text.rfind('\n').map_or(0, |i| i + 1);
                let from = done.max(start) - start;
                for line in text.get(from.min(complete)..complete).unwrap_or("").lines() {
                    echo_line(line, &echo, &st);
                }
                done = start + complete;
            }
        });
    if let Err(e) = spawned {
        status.warn(format!("guest console not followed: {e}"));
    }
}

fn echo_line(line: &str, echo: &[String], status: &Status) {
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
        // What the guest kernel says about its clocks and stalls matters after a resume (a
        // clock that jumped, timers that do not fire), and so does a guest that breaks.
        status.warn(format!("guest kernel: {}", line.trim()));
    }
}

/// Copies a console file grown past [`CONSOLE_ROTATE_BYTES`] to `NAME.1` and truncates it
/// (QEMU opens it with O_APPEND: its next line lands at the new start).
fn rotate(path: &std::path::Path) {
    let big = std::fs::metadata(path).is_ok_and(|m| m.len() > CONSOLE_ROTATE_BYTES);
    if !big {
        return;
    }
    let mut old = path.as_os_str().to_owned();
    old.push(".1");
    if std::fs::copy(path, &old).is_ok() {
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .and_then(|f| f.set_len(0));
    }
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

#[cfg(test)]
mod console_tests {
    #[test]
    fn a_console_file_past_the_bound_is_rotated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("guest-console.log");
        std::fs::write(&path, b"small\n").unwrap();
        super::rotate(&path);
        assert_eq!(std::fs::read(&path).unwrap(), b"small\n");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(super::CONSOLE_ROTATE_BYTES + 1).unwrap();
        super::rotate(&path);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        let old = dir.path().join("guest-console.log.1");
        assert_eq!(
            std::fs::metadata(old).unwrap().len(),
            super::CONSOLE_ROTATE_BYTES + 1
        );
    }
}
