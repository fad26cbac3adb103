//! A consolidated mirror as the backup's page keeper (tandem-replication's `PageKeeper`): cold
//! pages move into the host's pool on an NRU clock, and every page an epoch reads or overwrites
//! comes back first.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tandem_replication::PageKeeper;

use crate::{Pool, Replica, Usage, PAGE};

/// The mirror's cold pages kept in a pool shared with the host's other replicas.
pub struct Consolidated {
    replica: Replica,
    pool: Arc<Mutex<Pool>>,
    /// Time for the NRU clock's hand to go once round the mirror.
    revolution: Duration,
    last_scan: Instant,
    /// Pages not yet scanned, carried over between epochs.
    owed: f64,
}

/// The pool's operations index only entries they created and do not panic on any input; were
/// one to, the host's other replicas would rather go on with the pool than all stop.
fn lock(p: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

impl Consolidated {
    /// Consolidates a mirror of `mirror_bytes` into `pool` (shared with the host's other
    /// replicas): an NRU clock goes once round the mirror per `revolution`, moving pages no
    /// epoch wrote or read since its last pass out of the mirror (seed 001). The mirror must
    /// be a mapping whose released pages read as zeros (a shared tmpfs file or anonymous
    /// memory); the backup's mirror shows consolidated pages as zeros until materialised.
    pub fn new(mirror_bytes: usize, pool: Arc<Mutex<Pool>>, revolution: Duration) -> Self {
        Consolidated {
            replica: Replica::new((mirror_bytes / PAGE) as u64),
            pool,
            revolution,
            last_scan: Instant::now(),
            owed: 0.0,
        }
    }

    /// Where the mirror's pages are and what they cost.
    pub fn usage(&self) -> Usage {
        self.replica.usage(&lock(&self.pool))
    }

    /// The replica's map and the pool (for a lazy restore at failover, which installs the
    /// consolidated pages into the standby itself).
    pub fn into_parts(self) -> (Replica, Arc<Mutex<Pool>>) {
        (self.replica, self.pool)
    }
}

impl PageKeeper for Consolidated {
    fn reset(&mut self, mirror: &mut [u8]) -> bool {
        // Forget the old copy's pool pages and give its memory back: zeros, for free.
        self.replica.forget(&mut lock(&self.pool));
        let len = mirror.len();
        crate::release(mirror, 0, len);
        true
    }

    fn overwrite(&mut self, mirror: &mut [u8], first: u64, n: u64) -> std::io::Result<()> {
        self.replica
            .overwrite(&mut lock(&self.pool), mirror, first, n)
    }

    fn keeps_pages_elsewhere(&self) -> bool {
        true
    }

    fn restore(&mut self, mirror: &mut [u8], pfns: Option<&[u64]>) -> std::io::Result<()> {
        let mut pool = lock(&self.pool);
        match pfns {
            Some(pfns) => self.replica.restore(&mut pool, mirror, pfns).map(|_| ()),
            // A record that may read and write anywhere: the whole mirror, holes included.
            None => self
                .replica
                .populate_all(mirror)
                .and_then(|()| self.replica.restore_all(&mut pool, mirror).map(|_| ())),
        }
    }

    fn written(&mut self, pfns: &[u64]) {
        self.replica.written(pfns);
    }

    /// Advances the NRU clock by the share of a revolution that passed since its last step
    /// (at most a quarter second's worth, so that a long pause in the stream does not turn
    /// into one long scan).
    fn tick(&mut self, mirror: &mut [u8]) {
        let now = Instant::now();
        let dt = now.duration_since(self.last_scan).as_secs_f64().min(0.25);
        self.last_scan = now;
        let pages = self.replica.pages();
        self.owed += pages as f64 * dt / self.revolution.as_secs_f64().max(1e-9);
        self.owed = self.owed.min(pages as f64);
        let n = self.owed as u64;
        if n > 0 {
            self.owed -= n as f64;
            self.replica.scan(&mut lock(&self.pool), mirror, n);
        }
    }

    fn materialise(&mut self, mirror: &mut [u8]) -> std::io::Result<u64> {
        self.replica.restore_all(&mut lock(&self.pool), mirror)
    }
}
