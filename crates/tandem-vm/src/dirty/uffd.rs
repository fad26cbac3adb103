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
    /// The second half's buffer when a harvest is split over two threads.
    regions2: Vec<PageRegion>,
    pages2: Vec<u64>,
}

/// Guests of at least this much RAM are harvested by two threads, one half each: the walk of
/// the page tables grows with RAM (3.7 ms for 4 GiB on one core, against 0.3 ms for 256 MiB),
/// and the guest is stopped, so its cores are free.
const SPLIT_BYTES: u64 = 1 << 30;

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
            regions2: Vec::new(),
            pages2: Vec::new(),
        })
    }

    fn scan(&mut self, from: u64, to: u64, rearm: bool) -> Result<(i64, u64), DirtyLogError> {
        scan(&self.pagemap, &mut self.regions, from, to, rearm)
    }
}

/// One `PAGEMAP_SCAN` of `from..to` in `pagemap` into `regions`: the regions filled and where
/// the walk ended.
fn scan(
    pagemap: &File,
    regions: &mut [PageRegion],
    from: u64,
    to: u64,
    rearm: bool,
) -> Result<(i64, u64), DirtyLogError> {
    let mut arg = PmScanArg {
        size: std::mem::size_of::<PmScanArg>() as u64,
        flags: if rearm {
            PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC
        } else {
            PM_SCAN_CHECK_WPASYNC
        },
        start: from,
        end: to,
        vec: regions.as_mut_ptr() as u64,
        vec_len: regions.len() as u64,
        category_mask: PAGE_IS_WRITTEN,
        return_mask: PAGE_IS_WRITTEN,
        ..Default::default()
    };
    // SAFETY: `arg` is a valid pm_scan_arg whose `vec` points to `vec_len` writable
    // page_region entries borrowed from `regions`, alive for the duration of the call.
    let r = unsafe { libc::ioctl(pagemap.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
    if r < 0 {
        return Err(DirtyLogError::Scan(std::io::Error::last_os_error()));
    }
    Ok((r as i64, arg.walk_end))
}

/// Harvests (re-arming) `from..to` of guest RAM mapped at `base`: appends the written pages'
/// frame numbers to `out`, ascending.
fn harvest_range(
    pagemap: &File,
    regions: &mut [PageRegion],
    base: u64,
    (mut from, end): (u64, u64),
    out: &mut Vec<u64>,
) -> Result<HarvestStats, DirtyLogError> {
    let mut stats = HarvestStats::default();
    while from < end {
        let (n, walk_end) = scan(pagemap, regions, from, end, true)?;
        for r in &regions[..n as usize] {
            let first = (r.start - base) / PAGE_SIZE as u64;
            let last = (r.end - base) / PAGE_SIZE as u64;
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

impl DirtyLog for UffdWpLog {
    fn name(&self) -> &'static str {
        "uffd-wp"
    }

    fn harvest(&mut self, out: &mut Vec<u64>) -> Result<HarvestStats, DirtyLogError> {
        let (base, end) = (self.start, self.start + self.len);
        if self.len < SPLIT_BYTES {
            return harvest_range(&self.pagemap, &mut self.regions, base, (base, end), out);
        }
        // Two halves at a page boundary, the second on a scoped thread; its pages follow the
        // first half's, so `out` stays ascending.
        let mid = base + (self.len / 2) / PAGE_SIZE as u64 * PAGE_SIZE as u64;
        if self.regions2.is_empty() {
            self.regions2 = vec![PageRegion::default(); self.regions.len()];
        }
        let UffdWpLog {
            pagemap,
            regions,
            regions2,
            pages2,
            ..
        } = self;
        pages2.clear();
        let pagemap = &*pagemap;
        let (a, b) = std::thread::scope(|s| {
            let second =
                s.spawn(|| harvest_range(pagemap, &mut regions2[..], base, (mid, end), pages2));
            let first = harvest_range(pagemap, &mut regions[..], base, (base, mid), out);
            (first, second.join())
        });
        let b = b.map_err(|_| {
            DirtyLogError::Scan(std::io::Error::other("the harvest thread panicked"))
        })?;
        let (a, b) = (a?, b?);
        out.extend_from_slice(pages2);
        Ok(HarvestStats {
            pages: a.pages + b.pages,
            ranges: a.ranges + b.ranges,
        })
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
    let p = anon_map(len);
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

/// A fresh private anonymous mapping of `len` bytes (untouched pages take no memory), or
/// `MAP_FAILED`; the caller unmaps it.
fn anon_map(len: usize) -> *mut libc::c_void {
    // SAFETY: a new mapping chosen by the kernel; nothing else refers to it.
    unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    }
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
    fn a_large_region_is_harvested_in_two_halves_in_order() {
        use super::{DirtyLog, UffdWpLog, PAGE_SIZE, SPLIT_BYTES};
        if super::probe_pagemap_scan().is_err() {
            return; // An old kernel: probe_on_own_memory says why.
        }
        let len = (SPLIT_BYTES + (1 << 20)) as usize;
        let p = super::anon_map(len);
        assert_ne!(p, libc::MAP_FAILED);
        let (fd, _) = tandem_preload::register(p as u64, len as u64).unwrap();
        let pages = (len / PAGE_SIZE) as u64;
        let touched = [0, 5, pages / 2 - 1, pages / 2, pages / 2 + 7, pages - 1];
        let touch = |pfn: u64| {
            // SAFETY: within the mapping; async WP resolves the fault in the kernel.
            unsafe { *(p as *mut u8).add(pfn as usize * PAGE_SIZE) = 1 };
        };
        for &pfn in &touched {
            touch(pfn);
        }
        let mut log = UffdWpLog::new(std::process::id(), p as u64, len as u64).unwrap();
        let mut out = Vec::new();
        let stats = log.harvest(&mut out).unwrap();
        assert_eq!(out, touched);
        assert_eq!(stats.pages, touched.len() as u64);
        // Re-armed in both halves: only new writes come back.
        touch(3);
        touch(pages - 2);
        out.clear();
        log.harvest(&mut out).unwrap();
        assert_eq!(out, [3, pages - 2]);
        // SAFETY: closing the userfaultfd and unmapping our own mapping.
        unsafe {
            libc::close(fd);
            libc::munmap(p, len);
        }
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
