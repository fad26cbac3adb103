//! The backup's copy of the guest's data disk, and the all-or-nothing apply of an epoch's
//! disk writes: the bytes each write replaces are read first (an undo log), and a failed write
//! puts every earlier write of the epoch back, so the disk copy stays at the committed epoch.

use std::os::unix::fs::FileExt;

/// The backup's copy of the guest's data disk.
pub trait DiskCopy {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Reads `buf.len()` bytes at `offset` (inside the size; checked by the caller).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()>;
    /// Writes `data` at `offset` (inside the size; checked by the caller).
    fn write_at(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()>;
    /// Makes the whole disk zeros again (a new initial copy starts).
    fn zero(&mut self) -> std::io::Result<()>;
}

impl DiskCopy for Vec<u8> {
    fn size(&self) -> u64 {
        self.len() as u64
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        buf.copy_from_slice(&self[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn zero(&mut self) -> std::io::Result<()> {
        self.fill(0);
        Ok(())
    }
}

/// A disk copy in a raw image file, preallocated so that applying writes never needs space
/// the file system may not have (a full tmpfs fails at start, not in the middle of an epoch).
pub struct FileDisk {
    file: std::fs::File,
    size: u64,
}

impl FileDisk {
    /// Uses `file` (its current length is the disk size) and allocates all of its blocks.
    pub fn new(file: std::fs::File) -> std::io::Result<Self> {
        let size = file.metadata()?.len();
        preallocate(&file, size)?;
        Ok(FileDisk { file, size })
    }
}

/// Allocates every block of `file` up to `len` (fallocate); a file system without fallocate
/// support is accepted as is.
pub fn preallocate(file: &std::fs::File, len: u64) -> std::io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(()),
        Err(e) if e == rustix::io::Errno::OPNOTSUPP => Ok(()),
        Err(e) => Err(e.into()),
    }
}

impl DiskCopy for FileDisk {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.file.write_all_at(data, offset)
    }
    fn zero(&mut self) -> std::io::Result<()> {
        // Punch the whole file: zeros, still of the same size; then allocate it again.
        self.file.set_len(0)?;
        self.file.set_len(self.size)?;
        preallocate(&self.file, self.size)
    }
}

/// Why an epoch's disk writes were not applied.
#[derive(Debug, thiserror::Error)]
pub enum DiskApplyError {
    /// A write failed and every earlier write of the epoch was undone: the copy is unchanged.
    #[error("writing the disk copy failed; the epoch's earlier writes were undone")]
    Undone(#[source] std::io::Error),
    /// A write failed and undoing the earlier ones failed too: the copy is inconsistent.
    #[error("writing the disk copy failed and undoing the epoch's writes failed too ({undo})")]
    Inconsistent {
        /// The failed write.
        #[source]
        write: std::io::Error,
        /// The failed undo.
        undo: std::io::Error,
    },
}

/// Applies `writes` in order, all or nothing (see the module documentation). Every write
/// must lie inside the disk (checked by the caller).
pub fn apply_all(disk: &mut dyn DiskCopy, writes: &[(u64, &[u8])]) -> Result<(), DiskApplyError> {
    let mut undo: Vec<(u64, Vec<u8>)> = Vec::with_capacity(writes.len());
    for &(off, data) in writes {
        let mut old = vec![0u8; data.len()];
        let r = disk
            .read_at(off, &mut old)
            .and_then(|()| disk.write_at(off, data));
        match r {
            Ok(()) => undo.push((off, old)),
            Err(write) => {
                // Undo in reverse order: overlapping writes get their oldest bytes back last.
                for (o, old) in undo.iter().rev() {
                    if let Err(e) = disk.write_at(*o, old) {
                        return Err(DiskApplyError::Inconsistent { write, undo: e });
                    }
                }
                return Err(DiskApplyError::Undone(write));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A disk whose `fail_at`-th write fails.
    struct Flaky {
        d: Vec<u8>,
        writes: usize,
        fail_at: usize,
    }

    impl DiskCopy for Flaky {
        fn size(&self) -> u64 {
            self.d.len() as u64
        }
        fn read_at(&self, o: u64, b: &mut [u8]) -> std::io::Result<()> {
            self.d.read_at(o, b)
        }
        fn write_at(&mut self, o: u64, data: &[u8]) -> std::io::Result<()> {
            self.writes += 1;
            if self.writes == self.fail_at {
                return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
            }
            self.d.write_at(o, data)
        }
        fn zero(&mut self) -> std::io::Result<()> {
            self.d.zero()
        }
    }

    proptest::proptest! {
        #[test]
        fn a_failed_write_leaves_the_disk_as_it_was(
            writes in proptest::collection::vec((0u64..900, proptest::collection::vec(proptest::num::u8::ANY, 1..100)), 1..12),
            fail in 1usize..13,
        ) {
            let before: Vec<u8> = (0..1000).map(|i| (i % 251) as u8).collect();
            let mut d = Flaky { d: before.clone(), writes: 0, fail_at: fail };
            let w: Vec<(u64, &[u8])> = writes
                .iter()
                .map(|(o, v)| (*o, &v[..v.len().min(1000 - *o as usize)]))
                .collect();
            match apply_all(&mut d, &w) {
                Ok(()) => {
                    let mut expect = before.clone();
                    for (o, v) in &w {
                        expect[*o as usize..*o as usize + v.len()].copy_from_slice(v);
                    }
                    proptest::prop_assert!(fail > w.len());
                    proptest::prop_assert_eq!(d.d, expect);
                }
                Err(DiskApplyError::Undone(_)) => proptest::prop_assert_eq!(d.d, before),
                Err(e) => proptest::prop_assert!(false, "{e}"),
            }
        }
    }
}
