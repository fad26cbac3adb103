//! One replica's page map: which mirror pages are plain (in the mirror file) and which live
//! consolidated in the pool; the NRU clock that moves cold pages out; restore on demand.

use std::collections::HashMap;

use crate::pool::{Id, Pool, Stored};
use crate::release::release;
use crate::PAGE;

/// A patch is kept when it takes at most this many bytes (a quarter page); otherwise the
/// page goes to the pool on its own.
pub const PATCH_MAX: usize = PAGE / 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// In the mirror file.
    Plain,
    /// All zero: a hole in the mirror file, which reads as zeros.
    Zero,
    /// A pool entry (shared with other pages, or compressed, or both).
    Pooled(Id),
    /// A patch against a pool entry, in `patches`.
    Patched,
}

struct Patch {
    base: Id,
    /// LZ4 of the XOR of the page with its base.
    delta: Box<[u8]>,
}

impl Patch {
    /// Writes the patched page: its base, XOR the delta.
    fn apply(&self, pool: &Pool, page: &mut [u8]) {
        pool.read(self.base, page);
        let mut x = [0u8; PAGE];
        let n = lz4_flex::block::decompress_into(&self.delta, &mut x).unwrap_or(0);
        debug_assert_eq!(n, PAGE, "a patch decompressed to {n} bytes");
        for (d, x) in page.iter_mut().zip(x.iter()) {
            *d ^= x;
        }
    }
}

/// Where one replica's pages are and what they cost (pages, and bytes of pool data charged to
/// this replica: a shared entry's bytes are split among its references).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// Guest pages.
    pub pages: u64,
    /// Pages plain in the mirror file.
    pub plain: u64,
    /// Zero pages (holes; cost nothing).
    pub zero: u64,
    /// Pages stored as a pool entry that something else references too.
    pub shared: u64,
    /// Pages stored as a patch against a reference entry.
    pub patched: u64,
    /// Pages stored as a pool entry of their own, compressed.
    pub compressed: u64,
    /// Pages stored as a pool entry of their own that did not compress.
    pub pooled_raw: u64,
    /// Bytes charged for shared pages.
    pub shared_bytes: f64,
    /// Bytes of patches, plus their share of their reference entries.
    pub patch_bytes: f64,
    /// Bytes of compressed entries.
    pub compressed_bytes: u64,
}

impl Usage {
    /// Memory this replica costs: plain pages, its own pool entries, its share of shared
    /// ones, its patches (the page map itself not counted: 8 bytes per page).
    pub fn resident(&self) -> f64 {
        ((self.plain + self.pooled_raw) * PAGE as u64 + self.compressed_bytes) as f64
            + self.shared_bytes
            + self.patch_bytes
    }
}

/// What one clock pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Scan {
    /// Pages looked at.
    pub visited: u64,
    /// Plain pages passed over because they were used since the last pass.
    pub recent: u64,
    /// Pages that became holes (zero).
    pub zeroed: u64,
    /// Pages that joined an existing pool entry.
    pub shared: u64,
    /// Pages stored as patches.
    pub patched: u64,
    /// Pages stored as new pool entries.
    pub stored: u64,
}

/// One replica's page map and clock.
pub struct Replica {
    slots: Vec<Slot>,
    patches: HashMap<u64, Patch>,
    /// The NRU "referenced" bits: set when a page is written or read by an epoch.
    used: Vec<u64>,
    hand: u64,
    scratch: Box<[u8; PAGE]>,
}

impl Replica {
    /// A replica of `pages` guest pages, all plain in its mirror.
    pub fn new(pages: u64) -> Self {
        Replica {
            slots: vec![Slot::Plain; pages as usize],
            patches: HashMap::new(),
            used: vec![0; (pages as usize).div_ceil(64)],
            hand: 0,
            scratch: Box::new([0; PAGE]),
        }
    }

    /// Guest pages.
    pub fn pages(&self) -> u64 {
        self.slots.len() as u64
    }

    /// Bytes of bookkeeping: the page map, the used bits, the patch table (with an allocator
    /// header per patch).
    pub fn meta_bytes(&self) -> u64 {
        (self.slots.capacity() * std::mem::size_of::<Slot>() + self.used.capacity() * 8) as u64
            + (self.patches.capacity() * (8 + std::mem::size_of::<Patch>() + 1)) as u64
            + self.patches.len() as u64 * 16
    }

    /// Pages not plain (consolidated or zero holes).
    pub fn consolidated(&self) -> u64 {
        self.slots.iter().filter(|s| **s != Slot::Plain).count() as u64
    }

    fn mark(&mut self, pfn: u64) {
        self.used[(pfn / 64) as usize] |= 1 << (pfn % 64);
    }

    fn take_mark(&mut self, pfn: u64) -> bool {
        let w = &mut self.used[(pfn / 64) as usize];
        let bit = 1u64 << (pfn % 64);
        let was = *w & bit != 0;
        *w &= !bit;
        was
    }

    /// Puts every listed page back into `mirror` as plain (and marks it used), so that an
    /// epoch may read and write it. Their memory is allocated first ([`crate::populate`]):
    /// on a full tmpfs this is an error, no page changes content, and every page still in
    /// the store is still a hole in the mirror. `pfns` must be sorted and below
    /// [`Replica::pages`].
    pub fn restore(
        &mut self,
        pool: &mut Pool,
        mirror: &mut [u8],
        pfns: &[u64],
    ) -> std::io::Result<u64> {
        let mut n = 0;
        for (first, count) in runs(pfns) {
            self.populate_or_undo(mirror, first, count)?;
            for pfn in first..first + count {
                self.mark(pfn);
                n += self.restore_one(pool, mirror, pfn) as u64;
            }
        }
        Ok(n)
    }

    /// Allocates pages `first..first + count` of `mirror`; if that fails, gives back what it
    /// allocated for pages still in the store (they must stay holes: a lazy restore installs
    /// them only where the mirror has none).
    fn populate_or_undo(&self, mirror: &mut [u8], first: u64, count: u64) -> std::io::Result<()> {
        let r = crate::populate(mirror, first as usize * PAGE, count as usize * PAGE);
        if r.is_err() {
            for pfn in (first..first + count).filter(|&p| self.is_consolidated(p)) {
                release(mirror, pfn as usize * PAGE, PAGE);
            }
        }
        r
    }

    /// Allocates every page of the mirror (holes included) before a record that may write
    /// anywhere; on failure, pages still in the store stay holes.
    pub fn populate_all(&self, mirror: &mut [u8]) -> std::io::Result<()> {
        self.populate_or_undo(mirror, 0, self.pages())
    }

    /// A base chunk overwrites pages `first..first + count` whole: their consolidated content
    /// is dropped (not restored) and their memory allocated, so the chunk can be written.
    pub fn overwrite(
        &mut self,
        pool: &mut Pool,
        mirror: &mut [u8],
        first: u64,
        count: u64,
    ) -> std::io::Result<()> {
        self.populate_or_undo(mirror, first, count)?;
        for pfn in first..first + count {
            match std::mem::replace(&mut self.slots[pfn as usize], Slot::Plain) {
                Slot::Pooled(id) => pool.release(id),
                Slot::Patched => {
                    if let Some(p) = self.patches.remove(&pfn) {
                        pool.release(p.base);
                    }
                }
                Slot::Plain | Slot::Zero => {}
            }
        }
        Ok(())
    }

    /// Restores every consolidated page (failover by materialisation), decompressing on
    /// all cores. Returns the pages written. On a full tmpfs: an error, and nothing changed.
    pub fn restore_all(&mut self, pool: &mut Pool, mirror: &mut [u8]) -> std::io::Result<u64> {
        use rayon::prelude::*;
        let held: Vec<u64> = (0..self.pages())
            .filter(|&p| self.is_consolidated(p))
            .collect();
        let held_runs = runs(&held);
        for (k, &(first, count)) in held_runs.iter().enumerate() {
            if let Err(e) = crate::populate(mirror, first as usize * PAGE, count as usize * PAGE) {
                // Every page of these runs is in the store: back to holes.
                for &(f, c) in &held_runs[..=k] {
                    release(mirror, f as usize * PAGE, c as usize * PAGE);
                }
                return Err(e);
            }
        }
        let (shared, patches) = (&*pool, &self.patches);
        mirror
            .par_chunks_mut(PAGE)
            .zip(self.slots.par_iter())
            .enumerate()
            .for_each(|(pfn, (page, slot))| match *slot {
                Slot::Plain | Slot::Zero => {}
                Slot::Pooled(id) => shared.read(id, page),
                Slot::Patched => patches[&(pfn as u64)].apply(shared, page),
            });
        let mut n = 0;
        for s in &mut self.slots {
            match std::mem::replace(s, Slot::Plain) {
                Slot::Pooled(id) => {
                    pool.release(id);
                    n += 1;
                }
                Slot::Patched => n += 1,
                Slot::Plain | Slot::Zero => {}
            }
        }
        for (_, p) in self.patches.drain() {
            pool.release(p.base);
        }
        Ok(n)
    }

    fn restore_one(&mut self, pool: &mut Pool, mirror: &mut [u8], pfn: u64) -> bool {
        let page = &mut mirror[pfn as usize * PAGE..(pfn as usize + 1) * PAGE];
        self.take(pool, pfn, page)
    }

    /// Takes page `pfn` out of the consolidated store: writes its content into `out` and
    /// returns true, or returns false (leaving `out` alone) when the mirror itself holds it,
    /// plain or as a hole that reads as zeros. The page is plain from then on.
    pub fn take(&mut self, pool: &mut Pool, pfn: u64, out: &mut [u8]) -> bool {
        match std::mem::replace(&mut self.slots[pfn as usize], Slot::Plain) {
            Slot::Plain | Slot::Zero => false,
            Slot::Pooled(id) => {
                pool.read(id, out);
                pool.release(id);
                true
            }
            Slot::Patched => {
                let p = self
                    .patches
                    .remove(&pfn)
                    .expect("a patched slot has its patch");
                p.apply(pool, out);
                pool.release(p.base);
                true
            }
        }
    }

    /// Whether page `pfn` is in the consolidated store (not in the mirror).
    pub fn is_consolidated(&self, pfn: u64) -> bool {
        matches!(self.slots[pfn as usize], Slot::Pooled(_) | Slot::Patched)
    }

    /// Records that an epoch wrote `pfns` (they were restored first, see [`Replica::restore`]).
    pub fn written(&mut self, pfns: &[u64]) {
        for &p in pfns {
            self.mark(p);
        }
    }

    /// Advances the clock over up to `budget` pages: a plain page used since the hand last
    /// passed is spared (its bit cleared); one that was not is consolidated and its memory in
    /// the mirror released: zero → hole; equal to a pool entry → shared; close to a similar
    /// entry → patch; else a new (compressed) pool entry.
    pub fn scan(&mut self, pool: &mut Pool, mirror: &mut [u8], budget: u64) -> Scan {
        let mut s = Scan::default();
        let pages = self.pages();
        let mut run: Option<(u64, u64)> = None; // pages to release: first, count
        for _ in 0..budget.min(pages) {
            let pfn = self.hand;
            self.hand = (self.hand + 1) % pages;
            s.visited += 1;
            if self.slots[pfn as usize] != Slot::Plain {
                continue;
            }
            if self.take_mark(pfn) {
                s.recent += 1;
                continue;
            }
            // Reading a hole of a tmpfs file takes a page: on a full one, skip it this time.
            if crate::release::populate_read(mirror, pfn as usize * PAGE, PAGE).is_err() {
                continue;
            }
            self.consolidate(pool, mirror, pfn, &mut s);
            run = match run {
                Some((first, n)) if first + n == pfn => Some((first, n + 1)),
                Some((first, n)) => {
                    self.release_run(pool, mirror, first, n);
                    Some((pfn, 1))
                }
                None => Some((pfn, 1)),
            };
        }
        if let Some((first, n)) = run {
            self.release_run(pool, mirror, first, n);
        }
        s
    }

    /// Releases the mirror's memory behind pages just consolidated. Where that cannot punch a
    /// hole (a mirror outside tmpfs), they go back to the mirror as plain pages: a page in
    /// the store must be a hole in the mirror.
    fn release_run(&mut self, pool: &mut Pool, mirror: &mut [u8], first: u64, n: u64) {
        if release(mirror, first as usize * PAGE, n as usize * PAGE) {
            return;
        }
        for pfn in first..first + n {
            self.restore_one(pool, mirror, pfn);
            self.slots[pfn as usize] = Slot::Plain;
        }
    }

    fn consolidate(&mut self, pool: &mut Pool, mirror: &[u8], pfn: u64, s: &mut Scan) {
        let page = &mirror[pfn as usize * PAGE..(pfn as usize + 1) * PAGE];
        if page == [0u8; PAGE] {
            self.slots[pfn as usize] = Slot::Zero;
            s.zeroed += 1;
            return;
        }
        if let Some(id) = pool.share(page, &mut self.scratch) {
            self.slots[pfn as usize] = Slot::Pooled(id);
            s.shared += 1;
            return;
        }
        if let Some(base) = pool.similar(page) {
            pool.read(base, &mut self.scratch[..]);
            for (x, b) in self.scratch.iter_mut().zip(page) {
                *x ^= b;
            }
            let delta = lz4_flex::block::compress(&self.scratch[..]);
            if delta.len() <= PATCH_MAX {
                pool.retain(base);
                self.patches.insert(
                    pfn,
                    Patch {
                        base,
                        delta: delta.into_boxed_slice(),
                    },
                );
                self.slots[pfn as usize] = Slot::Patched;
                s.patched += 1;
                return;
            }
        }
        let (id, how) = pool.insert(page, &mut self.scratch);
        self.slots[pfn as usize] = Slot::Pooled(id);
        match how {
            Stored::Shared => s.shared += 1,
            Stored::New => s.stored += 1,
        }
    }

    /// Where this replica's pages are and what they cost.
    pub fn usage(&self, pool: &Pool) -> Usage {
        let mut u = Usage {
            pages: self.pages(),
            ..Usage::default()
        };
        for (pfn, s) in self.slots.iter().enumerate() {
            match *s {
                Slot::Plain => u.plain += 1,
                Slot::Zero => u.zero += 1,
                Slot::Pooled(id) if pool.refs(id) > 1 => {
                    u.shared += 1;
                    u.shared_bytes += pool.stored_len(id) as f64 / pool.refs(id) as f64;
                }
                Slot::Pooled(id) if pool.compressed(id) => {
                    u.compressed += 1;
                    u.compressed_bytes += pool.stored_len(id) as u64;
                }
                Slot::Pooled(_) => u.pooled_raw += 1,
                Slot::Patched => {
                    let p = &self.patches[&(pfn as u64)];
                    u.patched += 1;
                    u.patch_bytes += p.delta.len() as f64
                        + pool.stored_len(p.base) as f64 / pool.refs(p.base) as f64;
                }
            }
        }
        u
    }

    /// Drops every pool reference this replica holds (the replica is being removed). The
    /// mirror's consolidated pages are lost: call [`Replica::restore_all`] first to keep them.
    pub fn forget(&mut self, pool: &mut Pool) {
        for s in &mut self.slots {
            if let Slot::Pooled(id) = std::mem::replace(s, Slot::Plain) {
                pool.release(id);
            }
        }
        for (_, p) in self.patches.drain() {
            pool.release(p.base);
        }
    }
}

/// Runs of consecutive page numbers in sorted `pfns`: (first, count).
fn runs(pfns: &[u64]) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = Vec::new();
    for &p in pfns {
        match v.last_mut() {
            Some((f, c)) if *f + *c == p => *c += 1,
            _ => v.push((p, 1)),
        }
    }
    v
}
