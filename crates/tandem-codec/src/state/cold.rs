//! The store's compressed tier: pages pushed out of the main list, each kept as its own small
//! zstd frame, oldest first out, within a byte budget. A guest that rewrites a cycle of more
//! pages than the raw store holds (a ring buffer, a scan over a large array) finds most of the
//! cycle here instead of sending it without a delta. A page that does not compress is kept as
//! it is, so the tier never holds fewer pages than raw slots of the same bytes would.
//!
//! Before an epoch is encoded, the held pages among its dirty ones are *staged*: decompressed
//! into a buffer the encoder reads like the main list, however many there are (moving them
//! into the main list would push out each other when an epoch writes more pages than it
//! holds). Writing a page's new version unstages it; once the epoch is encoded, a staged page
//! it left unchanged goes back into the tier and the buffer is released.

use std::collections::VecDeque;

use super::FxMap;
use crate::format::PAGE;
use crate::prefix::Compressor;

/// zstd level of the tier's frames: fast (~3 µs per page on this project's test machine) and,
/// on the held-out `memtouch` trace, within 5 % of level 1's ratio.
const LEVEL: i32 = -1;

/// Bookkeeping charged against the budget per page held: the map's slot, the order's slot
/// and the allocator's header of the frame.
const ENTRY: usize = 64;

/// One held page.
struct Blob {
    /// A zstd frame of the page, or the page itself when that is not shorter.
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
    zc: Compressor,
    buf: Vec<u8>,
    /// Pages put while false are dropped, not compressed.
    pub(super) active: bool,
    /// Staged pages: page number → index of the page in `staged_data`.
    staged: FxMap<u64, u32>,
    staged_data: Vec<u8>,
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
            zc: Compressor::default(),
            buf: Vec::new(),
            active: true,
            staged: FxMap::default(),
            staged_data: Vec::new(),
        }
    }

    /// Keeps `content` as the version of `pfn`, pushing out the oldest pages over budget.
    pub(super) fn put(&mut self, pfn: u64, content: &[u8]) {
        self.remove(pfn);
        if !self.active || self.budget < PAGE + ENTRY {
            return;
        }
        let data: Box<[u8]> = match self.zc.compress(&[], content, LEVEL, &mut self.buf) {
            Ok(()) if self.buf.len() < content.len() => self.buf.as_slice().into(),
            _ => content.into(),
        };
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

    /// Drops the version of `pfn`, if held or staged; returns its frame if it was held.
    pub(super) fn remove(&mut self, pfn: u64) -> Option<Box<[u8]>> {
        self.staged.remove(&pfn);
        let b = self.map.remove(&pfn)?;
        self.charged -= b.data.len() + ENTRY;
        Some(b.data)
    }

    /// Stages the held pages of `pfns` (see the module's comment).
    pub(super) fn stage(&mut self, pfns: &[u64]) {
        self.unstage();
        let n = pfns.iter().filter(|p| self.map.contains_key(p)).count();
        self.staged_data.reserve_exact(n * PAGE);
        for &pfn in pfns {
            let Some(frame) = self.remove(pfn) else {
                continue;
            };
            let i = self.staged.len();
            self.staged_data.resize((i + 1) * PAGE, 0);
            if unpack(&frame, &mut self.staged_data[i * PAGE..]) {
                self.staged.insert(pfn, i as u32);
            } else {
                self.staged_data.truncate(i * PAGE);
            }
        }
    }

    /// Puts the staged pages not written since back into the tier and releases the staging
    /// buffer: it is the epoch's working memory (like the record and its prefix), not state
    /// kept between epochs.
    pub(super) fn unstage(&mut self) {
        let (left, data) = (
            std::mem::take(&mut self.staged),
            std::mem::take(&mut self.staged_data),
        );
        for (&pfn, &i) in &left {
            self.put(pfn, &data[i as usize * PAGE..(i as usize + 1) * PAGE]);
        }
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

    /// Pages the tier holds when full, at the present pages' average size.
    pub(super) fn capacity(&self) -> usize {
        match self.map.len() {
            0 => self.budget / (PAGE + ENTRY),
            n => (self.budget as u128 * n as u128 / self.charged.max(1) as u128) as usize,
        }
    }

    /// Memory held.
    pub(super) fn bytes(&self) -> usize {
        self.map.values().map(|b| b.data.len() + 16).sum::<usize>()
            + self.map.capacity() * 32
            + self.order.capacity() * 16
            + self.buf.capacity()
            + self.staged.capacity() * 16
            + self.staged_data.capacity()
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
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
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
        // A newer version put while off still replaces (drops) the held one.
        c.put(1, &page(3, true));
        assert!(!c.holds(1));
    }

    #[test]
    fn staged_pages_are_read_until_written_and_go_back_if_not() {
        let mut c = Cold::new(100 * (PAGE + ENTRY));
        for p in 0..10 {
            c.put(p, &page(p, true));
        }
        c.stage(&[1, 2, 3, 50]);
        assert_eq!(c.staged(2).unwrap(), page(2, true));
        assert!(c.staged(50).is_none() && c.staged(4).is_none());
        assert!(!c.holds(2), "a staged page is out of the tier");
        // Page 2 is written: its staged version is gone; 1 and 3 are not written.
        c.put(2, &page(20, true));
        assert!(c.staged(2).is_none());
        c.unstage();
        assert!(c.staged(1).is_none() && c.staged_data.capacity() == 0);
        c.stage(&[4]);
        assert!(c.staged(1).is_none() && c.staged(4).is_some());
        let mut dst = vec![0; PAGE];
        for (p, v) in [(1, 1), (2, 20), (3, 3)] {
            assert!(c.take(p, &mut dst));
            assert_eq!(dst, page(v, true));
        }
    }
}
