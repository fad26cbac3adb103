//! Device state without RAM: QEMU's migration stream with `x-ignore-shared`, through a pipe
//! passed over QMP (`getfd`), never a shell `exec:` URI.
//!
//! Capture: the guest must be stopped; `migrate fd:NAME` writes every device's state (CPU,
//! chipset, virtio queues, ...) but skips the shared RAM block, ~0.5–1 MB. Afterwards QEMU is in
//! `postmigrate` and `cont` resumes the guest from exactly that state.
//!
//! After a VM's first capture, [`fast`] captures with `xen-save-devices-state` instead (about
//! 2 ms less per pause here), framed into the same stream; `migrate` stays the fallback.
//!
//! Restore: a QEMU started with the same command line plus `-incoming defer -S`, whose RAM file
//! already holds the checkpoint's memory, reads the stream with `migrate-incoming fd:NAME` and
//! ends `paused`; `cont` runs the guest from the checkpoint.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::time::Duration;

use serde_json::json;

use crate::qmp::{Qmp, QmpError};

pub mod fast;

pub use fast::{Capturer, Method};

const FD_NAME: &str = "tandem-devstate";
const PIPE_SIZE: usize = 1 << 20;

/// Errors capturing or restoring device state.
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    /// A QMP step failed.
    #[error("device-state migration")]
    Qmp(#[from] QmpError),
    /// Creating or using the pipe failed.
    #[error("device-state pipe")]
    Pipe(#[from] std::io::Error),
    /// QEMU produced no state at all.
    #[error("QEMU wrote no device state (migration did not start)")]
    Empty,
    /// Reading a fast capture's file to frame it failed.
    #[error("reading the device-state file")]
    File(#[source] std::io::Error),
    /// A fast capture's file no longer held what the pause checked.
    #[error("the device-state file changed after its capture: {0}")]
    Changed(String),
}

fn pipe() -> Result<(std::fs::File, std::fs::File), DeviceStateError> {
    let (r, w) =
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(std::io::Error::from)?;
    // A larger pipe lets QEMU write the whole state without waiting for us; failure is harmless.
    let _ = rustix::pipe::fcntl_setpipe_size(&w, PIPE_SIZE);
    Ok((std::fs::File::from(r), std::fs::File::from(w)))
}

/// Enables the capabilities a RAM-less device-state stream needs. Call once per QEMU.
pub fn prepare(qmp: &mut Qmp) -> Result<(), DeviceStateError> {
    qmp.set_migrate_caps(&[("x-ignore-shared", true)])?;
    Ok(())
}

/// Captures the device state of a stopped guest into `out` (cleared first).
pub fn capture(qmp: &mut Qmp, out: &mut Vec<u8>) -> Result<(), DeviceStateError> {
    out.clear();
    let (mut r, w) = pipe()?;
    qmp.getfd(FD_NAME, w.as_fd())?;
    drop(w);
    qmp.execute("migrate", Some(json!({ "uri": format!("fd:{FD_NAME}") })))?;
    r.read_to_end(out)?;
    qmp.wait_migration(Duration::from_secs(30))?;
    if out.is_empty() {
        return Err(DeviceStateError::Empty);
    }
    Ok(())
}

/// QEMU's own save of the whole VM (RAM included) into `file`, as `virsh save` / `savevm`
/// to a file would do; the guest must be stopped. Returns the bytes written.
pub fn full_save(qmp: &mut Qmp, file: &std::fs::File) -> Result<u64, DeviceStateError> {
    qmp.set_migrate_caps(&[("x-ignore-shared", false)])?;
    let r = (|| {
        qmp.getfd(FD_NAME, file.as_fd())?;
        qmp.execute("migrate", Some(json!({ "uri": format!("fd:{FD_NAME}") })))?;
        qmp.wait_migration(Duration::from_secs(300))?;
        Ok::<_, DeviceStateError>(file.metadata()?.len())
    })();
    qmp.set_migrate_caps(&[("x-ignore-shared", true)])?;
    r
}

/// Feeds `state` to a QEMU started with `-incoming defer -S` and waits until it is paused.
pub fn restore(qmp: &mut Qmp, state: &[u8]) -> Result<(), DeviceStateError> {
    let (r, mut w) = pipe()?;
    qmp.getfd(FD_NAME, r.as_fd())?;
    drop(r);
    qmp.execute(
        "migrate-incoming",
        Some(json!({ "uri": format!("fd:{FD_NAME}") })),
    )?;
    w.write_all(state)?;
    drop(w);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match qmp.status()?.as_str() {
            "inmigrate" | "restore-vm" => {}
            "paused" | "running" => return Ok(()),
            other => {
                return Err(DeviceStateError::Qmp(QmpError::Protocol(format!(
                    "incoming migration ended in state {other}"
                ))))
            }
        }
        if std::time::Instant::now() > deadline {
            return Err(
                QmpError::Timeout(Duration::from_secs(30), "incoming migration".into()).into(),
            );
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}
