//! Where the backup daemon keeps its mirror's pages: all in the mirror file (`--plain-mirror`
//! in the lab, the default without `--consolidate`) or consolidated into the host's pool
//! (tandem-consolidate), chosen at start.

use tandem_consolidate::{Consolidated, Pool, Replica, Usage};
use tandem_replication::{PageKeeper, Plain};

/// The backup daemon's page keeper.
pub enum Keeper {
    /// Every page in the mirror file.
    Plain(Plain),
    /// Cold pages in the host's pool.
    Consolidated(Box<Consolidated>),
}

impl Keeper {
    /// Where the pages are and what they cost (`None`: a plain mirror).
    pub fn usage(&self) -> Option<Usage> {
        match self {
            Keeper::Plain(_) => None,
            Keeper::Consolidated(c) => Some(c.usage()),
        }
    }

    /// Whether the mirror is consolidated.
    pub fn is_consolidated(&self) -> bool {
        matches!(self, Keeper::Consolidated(_))
    }

    /// Takes the consolidation out (a lazy restore at failover installs the consolidated
    /// pages into the standby itself): the mirror holds only the plain pages from then on.
    pub fn take_consolidated(
        &mut self,
    ) -> Option<(Replica, std::sync::Arc<std::sync::Mutex<Pool>>)> {
        match std::mem::replace(self, Keeper::Plain(Plain)) {
            Keeper::Consolidated(c) => Some(c.into_parts()),
            plain => {
                *self = plain;
                None
            }
        }
    }

    fn inner(&mut self) -> &mut dyn PageKeeper {
        match self {
            Keeper::Plain(p) => p,
            Keeper::Consolidated(c) => c.as_mut(),
        }
    }
}

impl PageKeeper for Keeper {
    fn reset(&mut self, mirror: &mut [u8]) -> bool {
        self.inner().reset(mirror)
    }
    fn overwrite(&mut self, mirror: &mut [u8], first: u64, n: u64) -> std::io::Result<()> {
        self.inner().overwrite(mirror, first, n)
    }
    fn keeps_pages_elsewhere(&self) -> bool {
        self.is_consolidated()
    }
    fn restore(&mut self, mirror: &mut [u8], pfns: Option<&[u64]>) -> std::io::Result<()> {
        self.inner().restore(mirror, pfns)
    }
    fn written(&mut self, pfns: &[u64]) {
        self.inner().written(pfns)
    }
    fn tick(&mut self, mirror: &mut [u8]) {
        self.inner().tick(mirror)
    }
    fn materialise(&mut self, mirror: &mut [u8]) -> std::io::Result<u64> {
        self.inner().materialise(mirror)
    }
}
