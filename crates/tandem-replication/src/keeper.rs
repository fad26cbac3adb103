//! Where the backup keeps the pages of its mirror. [`Plain`] (the default) keeps every page in
//! the mirror. Another strategy may move pages out of it — tandem-consolidate shares, patches
//! and compresses cold ones with other replicas on the host — as long as every page an epoch
//! reads or overwrites is back in the mirror before the epoch is applied, and everything is
//! back before a standby resumes from it.

/// A page-keeping strategy of the backup's mirror (the mirror is the guest's RAM, whole pages
/// of [`crate::backup`]'s page size).
pub trait PageKeeper {
    /// A new initial copy begins: forget every page kept elsewhere. Returns whether the mirror
    /// now reads as zeros (false: the caller zeroes it).
    fn reset(&mut self, mirror: &mut [u8]) -> bool;
    /// Pages `first..first + n` are about to be overwritten whole (an initial copy's chunk).
    fn overwrite(&mut self, mirror: &mut [u8], first: u64, n: u64) -> std::io::Result<()>;
    /// Whether some pages may be kept outside the mirror (so an epoch's read set must be
    /// computed and [`PageKeeper::restore`] called before it is applied).
    fn keeps_pages_elsewhere(&self) -> bool;
    /// Puts pages `pfns` back into the mirror (`None`: every page) before an epoch reads them.
    /// Changes no content the guest sees.
    fn restore(&mut self, mirror: &mut [u8], pfns: Option<&[u64]>) -> std::io::Result<()>;
    /// An epoch was applied and wrote `pfns`.
    fn written(&mut self, pfns: &[u64]);
    /// Background work after an acknowledgement (e.g. a clock that moves cold pages out).
    fn tick(&mut self, mirror: &mut [u8]);
    /// Every page back into the mirror (before a standby resumes from it); the pages written.
    /// An error before any is written when their memory cannot be had.
    fn materialise(&mut self, mirror: &mut [u8]) -> std::io::Result<u64>;
}

/// Every page stays in the mirror.
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain;

impl PageKeeper for Plain {
    fn reset(&mut self, _mirror: &mut [u8]) -> bool {
        false
    }
    fn overwrite(&mut self, _mirror: &mut [u8], _first: u64, _n: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn keeps_pages_elsewhere(&self) -> bool {
        false
    }
    fn restore(&mut self, _mirror: &mut [u8], _pfns: Option<&[u64]>) -> std::io::Result<()> {
        Ok(())
    }
    fn written(&mut self, _pfns: &[u64]) {}
    fn tick(&mut self, _mirror: &mut [u8]) {}
    fn materialise(&mut self, _mirror: &mut [u8]) -> std::io::Result<u64> {
        Ok(0)
    }
}
