//! Injected write failures for tests: an append made to fail at one of its steps, as the
//! disk filling up would.

use std::fs::File;
use std::os::unix::fs::FileExt;

/// Where an append can be made to fail in tests (each as the disk filling up: `ENOSPC`;
/// the writes fail after writing half of their bytes, as a torn write would).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteFault {
    /// Writing the record into the segment.
    SegmentWrite,
    /// Syncing the segment.
    SegmentSync,
    /// Writing the index entry.
    IndexWrite,
    /// Syncing the index.
    IndexSync,
}

/// Writes `buf` at `off`, or, if a fault is injected here, half of it and `ENOSPC`.
pub(crate) fn write_at(
    fault: &mut Option<WriteFault>,
    at: WriteFault,
    f: &File,
    buf: &[u8],
    off: u64,
) -> std::io::Result<()> {
    if *fault == Some(at) {
        *fault = None;
        f.write_all_at(&buf[..buf.len() / 2], off)?;
        return Err(enospc());
    }
    f.write_all_at(buf, off)
}

/// Syncs `f`, or fails with `ENOSPC` if a fault is injected here.
pub(crate) fn sync(
    fault: &mut Option<WriteFault>,
    at: WriteFault,
    f: &File,
) -> std::io::Result<()> {
    if *fault == Some(at) {
        *fault = None;
        return Err(enospc());
    }
    f.sync_data()
}

fn enospc() -> std::io::Error {
    std::io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error())
}
