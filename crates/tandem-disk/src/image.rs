//! The disk image behind the NBD server, and the log of each epoch's writes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

/// One write of an epoch: offset and bytes (TRIM is logged as zeros).
pub type Write = (u64, Vec<u8>);

/// A raw image file; writes land at once and are also logged for the current epoch.
pub struct Image {
    file: File,
    size: u64,
    log: Mutex<Vec<Write>>,
    logging: bool,
}

impl Image {
    /// Opens a raw image read-write.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let size = file.metadata()?.len();
        Ok(Image {
            file,
            size,
            log: Mutex::new(Vec::new()),
            logging: true,
        })
    }

    /// Opens a raw image read-write without a write log (a backup's disk after failover).
    pub fn open_unlogged(path: &Path) -> std::io::Result<Self> {
        Ok(Image {
            logging: false,
            ..Self::open(path)?
        })
    }

    /// Export size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    /// Writes and logs.
    pub fn write_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        self.file.write_all_at(data, offset)?;
        if !self.logging {
            return Ok(());
        }
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((offset, data.to_vec()));
        Ok(())
    }

    /// Makes written data durable.
    pub fn flush(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    /// Takes the writes logged since the previous call: the epoch's disk writes. Call it while
    /// the guest is stopped, so the boundary matches the memory checkpoint.
    pub fn take_epoch_writes(&self) -> Vec<Write> {
        std::mem::take(&mut *self.log.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Serialises an epoch's writes: count u32, then per write offset u64, length u32, bytes.
pub fn encode_writes(writes: &[Write]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + writes.iter().map(|w| 12 + w.1.len()).sum::<usize>());
    out.extend_from_slice(&(writes.len() as u32).to_le_bytes());
    for (o, d) in writes {
        out.extend_from_slice(&o.to_le_bytes());
        out.extend_from_slice(&(d.len() as u32).to_le_bytes());
        out.extend_from_slice(d);
    }
    out
}

/// Parses an epoch's writes, checking every write lies inside a disk of `size` bytes.
pub fn decode_writes(b: &[u8], size: u64) -> Option<Vec<(u64, &[u8])>> {
    let n = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
    let mut out = Vec::with_capacity(n.min(1 << 16));
    let mut pos = 4;
    for _ in 0..n {
        let o = u64::from_le_bytes(b.get(pos..pos + 8)?.try_into().ok()?);
        let l = u32::from_le_bytes(b.get(pos + 8..pos + 12)?.try_into().ok()?) as usize;
        let d = b.get(pos + 12..pos + 12 + l)?;
        if o.checked_add(l as u64)? > size {
            return None;
        }
        out.push((o, d));
        pos += 12 + l;
    }
    (pos == b.len()).then_some(out)
}
