//! Harvesting async write-protect state of another process with `PAGEMAP_SCAN`.

use std::fs::File;
use std::os::fd::AsRawFd;

use super::{DirtyLog, DirtyLogError, HarvestStats};
use crate::ram::PAGE_SIZE;

/// `PAGEMAP_SCAN = _IOWR('f', 16, struct pm_scan_arg)` (96-byte argument).
const PAGEMAP_SCAN: u64 = 0xC060_6610;
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
const PAGE_IS_WRITTEN: u64 = 1 << 1;

#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// Dirty log of a QEMU whose guest RAM was registered by `libtandem_preload.so`.
pub struct UffdWpLog {
    pagemap: File,
    start: u64,
    len: u64,
    regions: Vec<PageRegion>,
}

impl UffdWpLog {
    /// Harvests from process `pid`, whose guest RAM is mapped at `start..start+len` (as the
    /// preloaded library reported).
    pub fn new(pid: u32, start: u64, len: u64) -> Result<Self, DirtyLogError> {
        let path = format!("/proc/{pid}/pagemap");
        let pagemap = File::open(&path).map_err(|e| DirtyLogError::Open(path, e))?;
        Ok(UffdWpLog {
            pagemap,
            start,
            len,
            regions: vec![PageRegion::default(); 4096],
        })
    }

    fn scan(&mut self, from: u64, to: u64, rearm: bool) -> Result<(i64, u64), DirtyLogError> {
        let mut arg = PmScanArg {
            size: std::mem::size_of::<PmScanArg>() as u64,
            flags: if rearm {
                PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC
            } else {
                PM_SCAN_CHECK_WPASYNC
            },
            start: from,
            end: to,
            vec: self.regions.as_mut_ptr() as u64,
            vec_len: self.regions.len() as u64,
            category_mask: PAGE_IS_WRITTEN,
            return_mask: PAGE_IS_WRITTEN,
            ..Default::default()
        };
        // SAFETY: `arg` is a valid pm_scan_arg whose `vec` points to `vec_len` writable
        // page_region entries owned by `self.regions`, alive for the duration of the call.
        let r = unsafe { libc::ioctl(self.pagemap.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
        if r < 0 {
            return Err(DirtyLogError::Scan(std::io::Error::last_os_error()));
        }
        Ok((r as i64, arg.walk_end))
    }
}

impl DirtyLog for UffdWpLog {
    fn name(&self) -> &'static str {
        "uffd-wp"
    }

    fn harvest(&mut self, out: &mut Vec<u64>) -> Result<HarvestStats, DirtyLogError> {
        let end = self.start + self.len;
        let mut from = self.start;
        let mut stats = HarvestStats::default();
        while from < end {
            let (n, walk_end) = self.scan(from, end, true)?;
            for r in &self.regions[..n as usize] {
                let first = (r.start - self.start) / PAGE_SIZE as u64;
                let last = (r.end - self.start) / PAGE_SIZE as u64;
                out.extend(first..last);
                stats.pages += last - first;
            }
            stats.ranges += n as u64;
            if walk_end <= from {
                break;
            }
            from = walk_end;
        }
        Ok(stats)
    }

    fn count(&mut self) -> Option<Result<u64, DirtyLogError>> {
        let end = self.start + self.len;
        let mut from = self.start;
        let mut pages = 0;
        while from < end {
            let (n, walk_end) = match self.scan(from, end, false) {
                Ok(r) => r,
                Err(e) => return Some(Err(e)),
            };
            for r in &self.regions[..n as usize] {
                pages += (r.end - r.start) / PAGE_SIZE as u64;
            }
            if walk_end <= from {
                break;
            }
            from = walk_end;
        }
        Some(Ok(pages))
    }
}

/// Checks that this kernel has `PAGEMAP_SCAN` and async write-protect, on tandem's own memory.
pub fn probe_pagemap_scan() -> Result<(), String> {
    let len = 8 * PAGE_SIZE;
    // SAFETY: fresh private anonymous mapping, unmapped before returning.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err("mmap failed".into());
    }
    let result = (|| {
        let (fd, _) = tandem_preload::register(p as u64, len as u64)
            .map_err(|e| format!("userfaultfd async write-protect unavailable: {e}"))?;
        let _close = CloseOnDrop(fd);
        // SAFETY: p points to `len` writable bytes; async WP resolves the fault in the kernel.
        unsafe { *(p as *mut u8).add(3 * PAGE_SIZE) = 1 };
        let mut log =
            UffdWpLog::new(std::process::id(), p as u64, len as u64).map_err(|e| e.to_string())?;
        let mut pages = Vec::new();
        log.harvest(&mut pages).map_err(|e| {
            format!(
                "{e}: {}",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            )
        })?;
        if pages != [3] {
            return Err(format!(
                "PAGEMAP_SCAN reported pages {pages:?}, expected [3]"
            ));
        }
        let mut again = Vec::new();
        log.harvest(&mut again).map_err(|e| e.to_string())?;
        if !again.is_empty() {
            return Err(format!("PAGEMAP_SCAN did not re-protect: {again:?}"));
        }
        Ok(())
    })();
    // SAFETY: unmapping our own mapping.
    unsafe { libc::munmap(p, len) };
    result
}

struct CloseOnDrop(i32);
impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        // SAFETY: closing an fd we own exactly once.
        unsafe { libc::close(self.0) };
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pm_scan_arg_is_96_bytes() {
        assert_eq!(std::mem::size_of::<super::PmScanArg>(), 96);
        assert_eq!(std::mem::size_of::<super::PageRegion>(), 24);
    }

    #[test]
    fn probe_on_own_memory() {
        // On kernels without async WP this reports why; here (6.18) it must work.
        if let Err(e) = super::probe_pagemap_scan() {
            let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
            let major_minor: Vec<u32> = release
                .trim()
                .split(['.', '-'])
                .take(2)
                .filter_map(|s| s.parse().ok())
                .collect();
            assert!(
                major_minor < vec![6, 7],
                "kernel {release} should support it: {e}"
            );
        }
    }
}
