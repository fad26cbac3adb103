//! Guest RAM as a shared file (`memory-backend-file,share=on`) mapped into tandem.
//!
//! QEMU and tandem map the same file, so tandem reads the guest's memory without copying it
//! through QEMU. Reads are consistent only while the guest is stopped; every accessor that hands
//! out guest bytes says so in its contract.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use memmap2::{MmapOptions, MmapRaw};

pub use tandem_types::PAGE_SIZE;

/// Errors mapping guest RAM.
#[derive(Debug, thiserror::Error)]
pub enum RamError {
    /// The RAM file could not be created, sized or mapped.
    #[error("cannot map guest RAM file {path}")]
    Map {
        /// File path.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file system holding the RAM file has no room for it.
    #[error("no room for {bytes} bytes of guest RAM in {path}: free space there (e.g. a bigger tmpfs) or use a smaller guest")]
    NoSpace {
        /// File path.
        path: String,
        /// Guest RAM size.
        bytes: u64,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Size is zero or not a multiple of the page size.
    #[error("guest RAM size {0} is not a positive multiple of {PAGE_SIZE}")]
    BadSize(u64),
}

/// A shared mapping of the whole guest RAM file.
pub struct GuestRam {
    map: MmapRaw,
    path: PathBuf,
    len: usize,
}

impl GuestRam {
    /// Creates the RAM file at `path` with `len` bytes, mode 0600, and maps it shared. A file
    /// already there (left by an earlier run) is replaced: the new one is created exclusively
    /// (`O_EXCL`, no symbolic link followed), so guest memory never lands in a file someone
    /// else created or can read.
    pub fn create(path: &Path, len: u64) -> Result<Self, RamError> {
        if len == 0 || !len.is_multiple_of(PAGE_SIZE as u64) {
            return Err(RamError::BadSize(len));
        }
        let map_err = |source| RamError::Map {
            path: path.display().to_string(),
            source,
        };
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(map_err(e)),
            _ => {}
        }
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(map_err)?;
        f.set_len(len).map_err(map_err)?;
        // Allocate every page now: a file system that fills up later must fail here, with a
        // clear error, and not turn a write through the mapping into SIGBUS.
        match rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, len) {
            Ok(()) => {}
            Err(e) if e == rustix::io::Errno::OPNOTSUPP => {}
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(RamError::NoSpace {
                    path: path.display().to_string(),
                    bytes: len,
                    source: e.into(),
                });
            }
        }
        Self::map_file(&f, path, len)
    }

    /// Maps an existing RAM file at `path`.
    pub fn open(path: &Path) -> Result<Self, RamError> {
        let map_err = |source| RamError::Map {
            path: path.display().to_string(),
            source,
        };
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(map_err)?;
        let len = f.metadata().map_err(map_err)?.len();
        if len == 0 || !len.is_multiple_of(PAGE_SIZE as u64) {
            return Err(RamError::BadSize(len));
        }
        Self::map_file(&f, path, len)
    }

    fn map_file(f: &std::fs::File, path: &Path, len: u64) -> Result<Self, RamError> {
        // Populate now: faulting pages in during the first checkpoint pause would cost tens of
        // milliseconds of guest downtime.
        let map = MmapOptions::new()
            .len(len as usize)
            .populate()
            .map_raw(f)
            .map_err(|source| RamError::Map {
                path: path.display().to_string(),
                source,
            })?;
        Ok(GuestRam {
            map,
            path: path.to_path_buf(),
            len: len as usize,
        })
    }

    /// Bytes of guest RAM.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the mapping is empty (never: sizes are checked).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of guest pages.
    pub fn pages(&self) -> usize {
        self.len / PAGE_SIZE
    }

    /// Path of the RAM file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole guest RAM as a byte slice.
    ///
    /// # Safety
    /// The guest (and every other writer of the file) must be stopped for as long as the slice
    /// lives; otherwise its contents change underneath it.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes and lives as long as `self`; the caller guarantees
        // that nothing writes it while the slice exists.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.len) }
    }

    /// The whole guest RAM as a mutable byte slice (used to load an image before a restore).
    ///
    /// # Safety
    /// No QEMU may be running on this file, and no other slice of it may be alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: as for `as_slice`, plus exclusivity guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr(), self.len) }
    }

    /// Copies page `pfn` into `dst` (one page long). Consistent only while the guest is stopped.
    pub fn copy_page(&self, pfn: u64, dst: &mut [u8]) {
        assert!(
            dst.len() == PAGE_SIZE && (pfn as usize) < self.pages(),
            "page out of range"
        );
        // SAFETY: pfn is in range (checked), so the source lies inside the mapping; dst is a
        // distinct, exclusively borrowed buffer of one page. Concurrent writes by a running
        // guest can only make the copy stale, never out of bounds.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(pfn as usize * PAGE_SIZE),
                dst.as_mut_ptr(),
                PAGE_SIZE,
            )
        }
    }
}

/// A guest RAM file used as a backup's mirror, written only by tandem until failover.
pub struct MirrorFile(GuestRam);

impl MirrorFile {
    /// Creates a zeroed mirror of `len` bytes at `path` (e.g. in `/dev/shm`).
    ///
    /// # Safety
    /// While the returned value is used, nothing else may write the file: a standby QEMU may
    /// map it (it neither runs vCPUs nor touches RAM before its incoming migration), but
    /// [`crate::Vm::resume`] must only be called once the mirror is no longer written.
    pub unsafe fn create(path: &Path, len: u64) -> Result<Self, RamError> {
        GuestRam::create(path, len).map(MirrorFile)
    }

    /// The underlying mapping.
    pub fn ram(&self) -> &GuestRam {
        &self.0
    }
}

impl AsRef<[u8]> for MirrorFile {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `create`'s contract: tandem is the only writer of the file.
        unsafe { self.0.as_slice() }
    }
}

impl AsMut<[u8]> for MirrorFile {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `create`'s contract, and `&mut self` makes this the only live slice.
        unsafe { self.0.as_mut_slice() }
    }
}
