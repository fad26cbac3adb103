//! Dirty logging: which guest pages were written since the previous harvest.
//!
//! Two implementations of [`DirtyLog`]:
//! - [`UffdWpLog`]: userfaultfd async write-protect, registered inside QEMU by the preloaded
//!   library and harvested from outside with `PAGEMAP_SCAN` (Linux ≥ 6.7). Cost scales with the
//!   number of written pages.
//! - [`HashLog`]: xxh3 of every page on all cores, compared with the previous epoch's hashes.
//!   Works on any kernel; costs one full read of guest RAM per harvest.
//!
//! and [`ReplayLog`], which returns recorded harvests (tests). A [`crate::Vm`] takes any of
//! them ([`crate::Vm::set_dirty_log`]).

mod hash;
mod recorded;
mod uffd;

pub use hash::HashLog;
pub use recorded::ReplayLog;
pub use uffd::{probe_pagemap_scan, UffdWpLog};

/// Errors of a dirty-log harvest.
#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    /// Opening `/proc/<pid>/pagemap` failed.
    #[error("cannot open {0}")]
    Open(String, #[source] std::io::Error),
    /// The `PAGEMAP_SCAN` ioctl failed.
    #[error("PAGEMAP_SCAN failed (kernel older than 6.7, or the range is not registered for async write-protect)")]
    Scan(#[source] std::io::Error),
}

/// Outcome of one harvest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HarvestStats {
    /// Pages reported written.
    pub pages: u64,
    /// Contiguous ranges the kernel returned (uffd) or 0 (hash).
    pub ranges: u64,
}

/// A source of "pages written since the last harvest".
pub trait DirtyLog: Send {
    /// Short name for reports (`uffd-wp`, `hash`).
    fn name(&self) -> &'static str;
    /// Appends the page numbers written since the previous harvest to `out`, sorted ascending,
    /// and re-arms tracking. Call it only while the guest is stopped.
    fn harvest(&mut self, out: &mut Vec<u64>) -> Result<HarvestStats, DirtyLogError>;

    /// Pages written since the last harvest, counted while the guest runs and without
    /// re-arming; `None` if this log cannot count cheaply (the hash log).
    fn count(&mut self) -> Option<Result<u64, DirtyLogError>> {
        None
    }
}
