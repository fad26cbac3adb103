//! One writer per store: an exclusive advisory lock (`flock`) on the file `lock` in the store
//! directory, taken by [`crate::Store::create`] and [`crate::Store::open_append`] and held for
//! the life of the writable store (the kernel drops it when the process dies, however it dies).
//! The holder writes its pid into the file so that a refused writer can name it.
//!
//! Readers ([`crate::Store::open`]: list, verify, restore) take no lock: they never modify the
//! store, and the commit order (record durable before its index entry; a new index renamed
//! into place) means a reader sees only committed checkpoints even while a saver appends. A
//! compaction running meanwhile may delete a segment a reader was about to read; the reader
//! then fails with an I/O error naming the file and can simply be run again.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use rustix::fs::{flock, FlockOperation};
use rustix::io::Errno;

use crate::StoreError;

/// Name of the lock file in a store directory.
pub const LOCK_FILE: &str = "lock";

/// Takes the store's writer lock (without waiting) and records this process's pid in it.
pub(crate) fn lock(dir: &Path) -> Result<File, StoreError> {
    let path = dir.join(LOCK_FILE);
    let io = |e: std::io::Error| StoreError::Io(path.display().to_string(), e);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    match flock(&f, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(Errno::WOULDBLOCK) => {
            let pid = std::fs::read_to_string(&path)
                .ok()
                .and_then(|s| s.trim().parse().ok());
            return Err(StoreError::Locked {
                dir: dir.display().to_string(),
                pid,
            });
        }
        Err(e) => return Err(io(e.into())),
    }
    // Best effort: on a full disk the pid may not fit, the lock holds all the same.
    let pid = format!("{}\n", std::process::id());
    if let Err(e) = f
        .set_len(0)
        .and_then(|()| f.write_all_at(pid.as_bytes(), 0))
    {
        tracing::warn!("{}: cannot record the pid: {e}", path.display());
    }
    Ok(f)
}

/// How a refused writer names the holder.
pub(crate) fn holder(pid: &Option<u32>) -> String {
    match pid {
        Some(p) => format!("pid {p}"),
        None => "pid unknown".into(),
    }
}
