//! The store's compressed tier: pages pushed out of the main list, each kept as its own small
//! zstd frame, oldest first out, within a byte budget. A guest that rewrites a cycle of more
//! pages than the raw store holds (a ring buffer, a scan over a large array) finds most of the
//! cycle here instead of sending it without a delta. A page that does not compress is kept as
//! it is, so the tier never holds fewer pages than raw slots of the same bytes would.
//!
//! Per epoch:
//! - Before it is encoded, the held pages among its dirty ones are *staged*: decompressed
//!   (on the encoder's threads) into a buffer the encoder reads like the main list, however
//!   many there are. Moving them into the main list would make them push each other out when
//!   an epoch writes more pages than it holds.
//! - While the store takes the epoch's new versions, the pages the main list pushes out are
//!   *deferred*: copied aside, to be compressed together.
//! - Writing a page's new version drops any version held, staged or deferred.
//! - Once the epoch is encoded, the store *settles*: the deferred pages are compressed (on
//!   the encoder's threads) and taken in, in the order they were pushed out; the staged pages
//!   the epoch left unchanged go back in as the frames they were (not compressed again); both
//!   buffers, the epoch's working memory like the record and its prefix, are emptied for the
//!   next epoch.
//!
//! What is held does not depend on the number of threads.
//!
//! The tier costs a compression per page it takes in, which pays only for pages that come
//! back from it after more pages than the store would hold without it (all of its bytes raw):
//! a page back sooner would have been held anyway. The store counts both (halved every
//! [`WINDOW`] pages taken in). While fewer than one in [`PAYS`] pages taken in comes back so,
//! the tier takes in only a fixed sample of page numbers (one in [`SAMPLE`]): compile's and
//! pgbench's pages pushed out of the main list come back soon or not at all, and the sample
//! keeps watching for a cycle, like memtouch's, whose pages do.

use std::cell::RefCell;
use std::collections::VecDeque;

use super::FxMap;
use crate::format::PAGE;
use crate::prefix::Compressor;

/// zstd level of the tier's frames. On this project's test machine a page takes 9–14 µs to
/// compress and 2–6 µs to decompress (memtouch's to compile's); LZ4 takes about half as long
/// but keeps 1.1–2× the bytes, and on a page of integers (a counter per word) it keeps most
/// of the page, where zstd's entropy coding shrinks it (docs/CODEC.md, "zstd, not LZ4").
const LEVEL: i32 = -1;

/// Bookkeeping charged against the budget per page held: the map's slot, the order's slot
/// and the allocator's header of the frame.
const ENTRY: usize = 64;

/// The tier takes in every page while at least one in `PAYS` of those taken in comes back.
const PAYS: u64 = 4;
/// ... else one page number in `SAMPLE`.
const SAMPLE: u64 = 8;
/// Pages taken in after which both counts are halved.
const WINDOW: u64 = 1 << 14;

/// Fewest pages per thread when a batch is handed to the encoder's threads.
const PER_THREAD: usize = 32;

thread_local! {
    /// One compression context and output buffer per thread, reused by every page it
    /// compresses. Not the thread's context for records (`prefix::compress_frame`): zstd
    /// shrinks a context used for many frames much smaller than its tables, and the next
    /// record's frame (a table of up to 2 MiB) would allocate them again.
    static ZC: RefCell<(Compressor, Vec<u8>)> = RefCell::new(Default::default());
}

/// `content` as the tier keeps it: a zstd frame, or the page itself when that is not shorter.
fn pack(content: &[u8]) -> Box<[u8]> {
    ZC.with(|cell| {
        let (zc, buf) = &mut *cell.borrow_mut();
        match zc.compress(&[], content, LEVEL, buf) {
            Ok(()) if buf.len() < content.len() => buf.as_slice().into(),
            _ => content.into(),
        }
    })
}

/// One held page.
struct Blob {
    /// What [`pack`] made of it.
    data: Box<[u8]>,
    /// Its place in [`Cold::order`].
    seq: u32,
}

/// Compressed previous versions, least recently pushed out first.
pub(super) struct Cold {
    map: FxMap<u64, Blob>,
    /// Page numbers in the order they came in; entries whose `seq` no longer matches the
    /// map's were taken out since and are skipped.
    order: VecDeque<(u64, u32)>,
    seq: u32,
    /// Bytes charged: frames plus [`ENTRY`] per page.
    charged: usize,
    budget: usize,
    /// Pages pushed out while false are dropped, not compressed (the store's main list then
    /// has the tier's bytes: switch.rs).
    pub(super) active: bool,
    /// Staged pages: page number → index of the page in `staged_data`.
    staged: FxMap<u64, u32>,
    staged_data: Vec<u8>,
    /// Per staged page, its frame: a page the epoch leaves unchanged goes back as it was,
    /// not compressed again.
    staged_frames: Vec<Option<Box<[u8]>>>,
    /// Pages of the epoch being encoded: at most as many can be deferred, which the
    /// deferral buffer is sized for once instead of growing page by page.
    epoch_pages: usize,
    /// Deferred pages: page number → index of its latest copy in `deferred_data` (an entry
    /// of `deferred_pfns` whose page maps elsewhere, or nowhere, was superseded).
    deferred: FxMap<u64, u32>,
    deferred_pfns: Vec<u64>,
    deferred_data: Vec<u8>,
    /// Pages taken in, and staged back, lately (see the module's comment).
    taken: u64,
    back: u64,
}

impl Cold {
    /// A tier of at most `budget` bytes.
    pub(super) fn new(budget: usize) -> Self {
        Cold {
            map: FxMap::default(),
            order: VecDeque::new(),
            seq: 0,
            charged: 0,
            budget,
            active: true,
            staged: FxMap::default(),
            staged_data: Vec::new(),
            staged_frames: Vec::new(),
            epoch_pages: 0,
            deferred: FxMap::default(),
            deferred_pfns: Vec::new(),
            deferred_data: Vec::new(),
            taken: 0,
            back: 0,
        }
    }

    /// Whether the tier takes in `pfn` if pushed out now: always while pages come back from
    /// it, else if the page is in the sample.
    fn wants(&self, pfn: u64) -> bool {
        self.back * PAYS >= self.taken.max(1) || super::rank(pfn) * SAMPLE < 1024
    }

    /// The tier's bytes.
    pub(super) fn budget(&self) -> usize {
        self.budget
    }

    /// Records that a page staged from the tier came back after more pages than the store
    /// would hold without it (see the module's comment).
    pub(super) fn came_back(&mut self) {
        self.back += 1;
    }

    /// Whether pages put now are kept at all.
    fn takes(&self) -> bool {
        self.active && self.budget >= PAGE + ENTRY
    }

    /// Takes in `data` (made by [`pack`]) as the version of `pfn`, pushing out the oldest
    /// pages over budget.
    fn insert(&mut self, pfn: u64, data: Box<[u8]>) {
        self.remove(pfn);
        self.seq = self.seq.wrapping_add(1);
        self.charged += data.len() + ENTRY;
        self.map.insert(
            pfn,
            Blob {
                data,
                seq: self.seq,
            },
        );
        self.order.push_back((pfn, self.seq));
        while self.charged > self.budget {
            let Some((p, s)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&p).is_some_and(|b| b.seq == s) {
                self.remove(p);
            }
        }
        if self.order.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.order
                .retain(|(p, s)| map.get(p).is_some_and(|b| b.seq == *s));
        }
    }

    /// Keeps `content` as the version of `pfn` now (compressed on this thread).
    #[cfg(test)]
    pub(super) fn put(&mut self, pfn: u64, content: &[u8]) {
        self.remove(pfn);
        if self.takes() {
            self.insert(pfn, pack(content));
        }
    }

    /// Keeps `content` as the version of `pfn` once the store settles.
    pub(super) fn defer(&mut self, pfn: u64, content: &[u8]) {
        self.remove(pfn);
        if !self.takes() || !self.wants(pfn) {
            return;
        }
        let i = self.deferred_pfns.len();
        self.deferred_pfns.push(pfn);
        if self.deferred_data.capacity() == self.deferred_data.len() {
            self.deferred_data
                .reserve((self.epoch_pages.max(i + 1) - i) * PAGE);
        }
        self.deferred_data.extend_from_slice(content);
        self.deferred.insert(pfn, i as u32);
    }

    /// Drops every page held and deferred (staged ones go at the next settle).
    pub(super) fn clear(&mut self) {
        self.map = FxMap::default();
        self.order = VecDeque::new();
        self.charged = 0;
        self.deferred.clear();
        self.deferred_pfns.clear();
        self.deferred_data = Vec::new();
    }

    /// Drops the version of `pfn` held, staged or deferred; returns its frame if it was held.
    pub(super) fn remove(&mut self, pfn: u64) -> Option<Box<[u8]>> {
        self.staged.remove(&pfn);
        self.deferred.remove(&pfn);
        let b = self.map.remove(&pfn)?;
        self.charged -= b.data.len() + ENTRY;
        Some(b.data)
    }

    /// Stages the held pages of `pfns` (see the module's comment).
    pub(super) fn stage(&mut self, pfns: &[u64], pool: Option<&rayon::ThreadPool>) {
        self.settle(pool);
        let frames: Vec<(u64, Box<[u8]>)> = pfns
            .iter()
            .filter_map(|&p| self.remove(p).map(|f| (p, f)))
            .collect();
        let mut data = std::mem::take(&mut self.staged_data);
        data.clear();
        data.resize(frames.len() * PAGE, 0);
        let ok = crate::record::par_chunks_map(pool, PER_THREAD, &mut data, PAGE, |i, d| {
            unpack(&frames[i].1, d)
        });
        self.staged_frames.clear();
        for (i, ((pfn, frame), ok)) in frames.into_iter().zip(ok).enumerate() {
            if ok {
                self.staged.insert(pfn, i as u32);
            }
            self.staged_frames.push(Some(frame));
        }
        self.staged_data = data;
        self.epoch_pages = pfns.len();
    }

    /// Ends the epoch (see the module's comment).
    pub(super) fn settle(&mut self, pool: Option<&rayon::ThreadPool>) {
        let (mut pfns, mut data) = (
            std::mem::take(&mut self.deferred_pfns),
            std::mem::take(&mut self.deferred_data),
        );
        let live: Vec<usize> = (0..pfns.len())
            .filter(|&i| self.deferred.get(&pfns[i]) == Some(&(i as u32)))
            .collect();
        self.deferred.clear();
        let packed = crate::record::par_map(pool, PER_THREAD, live.len(), |k| {
            let i = live[k];
            pack(&data[i * PAGE..(i + 1) * PAGE])
        });
        for (&i, frame) in live.iter().zip(packed) {
            self.insert(pfns[i], frame);
        }
        self.taken += live.len() as u64;
        if self.taken > WINDOW {
            (self.taken, self.back) = (self.taken / 2, self.back / 2);
        }
        crate::record::keep(&mut data, pfns.len().max(self.epoch_pages) * PAGE);
        pfns.clear();
        (self.deferred_pfns, self.deferred_data) = (pfns, data);
        let mut left: Vec<(u64, u32)> = self.staged.drain().collect();
        let mut staged = std::mem::take(&mut self.staged_data);
        if self.takes() {
            left.sort_unstable();
            for (pfn, i) in left {
                if let Some(frame) = self.staged_frames[i as usize].take() {
                    self.insert(pfn, frame);
                }
            }
        }
        self.staged_frames.clear();
        let used = staged.len();
        crate::record::keep(&mut staged, used);
        self.staged_data = staged;
    }

    /// The staged version of `pfn`.
    pub(super) fn staged(&self, pfn: u64) -> Option<&[u8]> {
        let i = *self.staged.get(&pfn)? as usize;
        Some(&self.staged_data[i * PAGE..(i + 1) * PAGE])
    }

    /// Takes the version of `pfn` out of the tier into `dst`.
    #[cfg(test)]
    fn take(&mut self, pfn: u64, dst: &mut [u8]) -> bool {
        self.remove(pfn).is_some_and(|f| unpack(&f, dst))
    }

    /// Whether a version of `pfn` is held.
    #[cfg(test)]
    fn holds(&self, pfn: u64) -> bool {
        self.map.contains_key(&pfn)
    }

    /// Pages the tier holds when full, at the present pages' average size; switched off (it
    /// takes no page in), the pages it holds.
    pub(super) fn capacity(&self) -> usize {
        if !self.takes() {
            return self.map.len();
        }
        match self.map.len() {
            0 => self.budget / (PAGE + ENTRY),
            n => (self.budget as u128 * n as u128 / self.charged.max(1) as u128) as usize,
        }
    }

    /// Working memory of the epoch: the staging and deferral buffers, copies of pages of the
    /// epoch like the encoder's prefix and record buffers (each is kept for the next epoch,
    /// and released after an epoch far smaller than the largest).
    pub(super) fn work_bytes(&self) -> usize {
        self.staged_data.capacity()
            + self
                .staged_frames
                .iter()
                .flatten()
                .map(|f| f.len())
                .sum::<usize>()
            + self.staged_frames.capacity() * 16
            + self.deferred_data.capacity()
            + self.deferred_pfns.capacity() * 8
            + (self.staged.capacity() + self.deferred.capacity()) * 16
    }

    /// Memory held as state: the frames and their bookkeeping (not the working memory,
    /// [`Cold::work_bytes`]).
    pub(super) fn bytes(&self) -> usize {
        self.map.values().map(|b| b.data.len() + 16).sum::<usize>()
            + self.map.capacity() * 32
            + self.order.capacity() * 16
    }
}

/// Decodes a held `frame` into `dst` (one page); false if it does not decode to a whole page,
/// which a frame made here cannot do (the page is then simply not held).
fn unpack(frame: &[u8], dst: &mut [u8]) -> bool {
    if frame.len() == PAGE {
        dst.copy_from_slice(frame);
        return true;
    }
    crate::prefix::decompress(frame, &[], dst) == Ok(PAGE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(seed: u64, compressible: bool) -> Vec<u8> {
        let mut x = seed | 1;
        (0..PAGE)
            .map(|i| {
                x = crate::xorshift64(x);
                if compressible {
                    (i / 64) as u8 ^ seed as u8
                } else {
                    x as u8
                }
            })
            .collect()
    }

    #[test]
    fn pages_come_back_exactly_and_the_oldest_leave_first() {
        let mut c = Cold::new(10 * (PAGE + ENTRY));
        let mut dst = vec![0; PAGE];
        // Incompressible pages are kept as they are: exactly 10 fit.
        for p in 0..12 {
            c.put(p, &page(p, false));
        }
        assert!(!c.holds(0) && !c.holds(1) && c.holds(2));
        assert_eq!(c.capacity(), 10);
        assert!(c.take(5, &mut dst));
        assert_eq!(dst, page(5, false));
        assert!(!c.take(5, &mut dst), "taken out");
        // Compressible pages take far less: many more fit, and decode exactly.
        for p in 100..200 {
            c.put(p, &page(p, true));
        }
        assert!(c.holds(199) && c.capacity() > 40);
        assert!(c.take(150, &mut dst));
        assert_eq!(dst, page(150, true));
        // A newer version replaces the held one.
        c.put(199, &page(7, true));
        assert!(c.take(199, &mut dst));
        assert_eq!(dst, page(7, true));
        assert!(c.charged <= c.budget);
        // The order of stale entries is compacted.
        for r in 0..100 {
            c.put(300, &page(r, true));
        }
        assert!(c.order.len() <= 2 * c.map.len() + 1024);
    }

    #[test]
    fn a_tier_too_small_or_switched_off_holds_nothing_new() {
        let mut c = Cold::new(PAGE);
        c.put(1, &page(1, true));
        assert!(!c.holds(1));
        assert_eq!(c.bytes(), 0);
        let mut c = Cold::new(100 * PAGE);
        c.put(1, &page(1, true));
        c.active = false;
        c.put(2, &page(2, true));
        assert!(c.holds(1) && !c.holds(2));
        // Off, it counts only what it holds (the store admits by it).
        assert_eq!(c.capacity(), 1);
        // A newer version put while off still replaces (drops) the held one.
        c.put(1, &page(3, true));
        assert!(!c.holds(1));
        assert_eq!(c.capacity(), 0);
    }

    #[test]
    fn staged_pages_are_read_until_written_and_go_back_if_not() {
        let mut c = Cold::new(100 * (PAGE + ENTRY));
        for p in 0..10 {
            c.put(p, &page(p, true));
        }
        let frame_1 = c.map[&1].data.clone();
        c.stage(&[1, 2, 3, 50], None);
        assert_eq!(c.staged(2).unwrap(), page(2, true));
        assert!(c.staged(50).is_none() && c.staged(4).is_none());
        assert!(!c.holds(2), "a staged page is out of the tier");
        // Page 2 is written: its staged version is gone; 1 and 3 are not written.
        c.put(2, &page(20, true));
        assert!(c.staged(2).is_none());
        c.settle(None);
        assert!(c.staged(1).is_none() && c.staged_data.is_empty());
        assert_eq!(
            c.map[&1].data, frame_1,
            "an unchanged page goes back as its frame"
        );
        assert!(c.staged_frames.is_empty());
        c.stage(&[4], None);
        assert!(c.staged(1).is_none() && c.staged(4).is_some());
        let mut dst = vec![0; PAGE];
        for (p, v) in [(1, 1), (2, 20), (3, 3)] {
            assert!(c.take(p, &mut dst));
            assert_eq!(dst, page(v, true));
        }
    }
}
