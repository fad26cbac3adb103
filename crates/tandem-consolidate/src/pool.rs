//! The content pool shared by every replica on the host: each distinct page content stored
//! once (LZ4-compressed when that saves a quarter or more), found by its full-page hash, and
//! indexed by seed 001's HashSimilarityDetector(2,1) as a reference for patches.

use std::collections::HashMap;

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::PAGE;

/// Offsets of the two 64-byte blocks the similarity detector hashes ("two fixed locations in
/// the page, chosen at random", seed 001).
const SIMILAR_AT: [usize; 2] = [1152, 2944];
/// A page is stored compressed when that takes at most this many bytes.
const COMPRESS_MAX: usize = PAGE * 3 / 4;

/// An entry of the pool.
pub type Id = u32;

struct Entry {
    /// References: replica pages stored as this entry, plus patches based on it. 0 = free.
    refs: u32,
    hash: u128,
    /// LZ4 block, or the page itself when `raw`.
    data: Box<[u8]>,
    raw: bool,
    sim: [u64; 2],
}

/// Shared content store. Not thread-safe by itself: the backup keeps it behind a mutex.
#[derive(Default)]
pub struct Pool {
    entries: Vec<Entry>,
    free: Vec<Id>,
    by_hash: HashMap<u128, Id>,
    similar: HashMap<u64, Id>,
    bytes: u64,
}

/// How [`Pool::insert`] stored a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Already there: one more reference.
    Shared,
    /// A new entry.
    New,
}

fn sim_keys(page: &[u8]) -> [u64; 2] {
    // The slot number goes into the key, so equal blocks at the two offsets do not collide.
    SIMILAR_AT.map(|o| xxh3_64(&page[o..o + 64]) ^ o as u64)
}

impl Pool {
    /// An empty pool.
    pub fn new() -> Self {
        Pool::default()
    }

    /// Bytes of page data held (entries' stored sizes).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes of bookkeeping: the entry table, both indexes (at their capacity, with
    /// hashbrown's control byte) and an allocator header per stored page.
    pub fn meta_bytes(&self) -> u64 {
        let map = |cap: usize, item: usize| (cap * (item + 1)) as u64;
        (self.entries.capacity() * std::mem::size_of::<Entry>()) as u64
            + map(self.by_hash.capacity(), 16 + 4)
            + map(self.similar.capacity(), 8 + 4)
            + (self.free.capacity() * 4) as u64
            + self.len() as u64 * 16
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.entries.len() - self.free.len()
    }

    /// Whether the pool holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stored size of entry `id`.
    pub fn stored_len(&self, id: Id) -> usize {
        self.entries[id as usize].data.len()
    }

    /// References to entry `id`.
    pub fn refs(&self, id: Id) -> u32 {
        self.entries[id as usize].refs
    }

    /// Whether entry `id` is kept compressed.
    pub fn compressed(&self, id: Id) -> bool {
        !self.entries[id as usize].raw
    }

    /// Finds an entry equal to `page` (hash, then a byte compare) and takes a reference.
    pub fn share(&mut self, page: &[u8], scratch: &mut [u8; PAGE]) -> Option<Id> {
        let id = *self.by_hash.get(&xxh3_128(page))?;
        self.read(id, scratch);
        if scratch[..] != *page {
            return None; // a hash collision: not the same content
        }
        self.entries[id as usize].refs += 1;
        Some(id)
    }

    /// Stores `page` (or shares an equal entry); returns the entry, with one reference taken.
    pub fn insert(&mut self, page: &[u8], scratch: &mut [u8; PAGE]) -> (Id, Stored) {
        if let Some(id) = self.share(page, scratch) {
            return (id, Stored::Shared);
        }
        let c = lz4_flex::block::compress(page);
        let (data, raw) = if c.len() <= COMPRESS_MAX {
            (c.into_boxed_slice(), false)
        } else {
            (page.to_vec().into_boxed_slice(), true)
        };
        let hash = xxh3_128(page);
        let sim = sim_keys(page);
        self.bytes += data.len() as u64;
        let e = Entry {
            refs: 1,
            hash,
            data,
            raw,
            sim,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.entries[id as usize] = e;
                id
            }
            None => {
                self.entries.push(e);
                (self.entries.len() - 1) as Id
            }
        };
        self.by_hash.entry(hash).or_insert(id);
        for k in sim {
            self.similar.insert(k, id); // one candidate per key: the newest
        }
        (id, Stored::New)
    }

    /// A reference candidate for patching `page`: an entry with an equal block at one of the
    /// two sampled offsets.
    pub fn similar(&self, page: &[u8]) -> Option<Id> {
        sim_keys(page)
            .iter()
            .find_map(|k| self.similar.get(k).copied())
    }

    /// Takes one more reference to `id` (a patch based on it).
    pub fn retain(&mut self, id: Id) {
        self.entries[id as usize].refs += 1;
    }

    /// Drops one reference; the entry is freed with its last.
    pub fn release(&mut self, id: Id) {
        let e = &mut self.entries[id as usize];
        debug_assert!(e.refs > 0, "release of a free pool entry");
        e.refs -= 1;
        if e.refs > 0 {
            return;
        }
        let (hash, sim) = (e.hash, e.sim);
        self.bytes -= e.data.len() as u64;
        e.data = Box::new([]);
        if self.by_hash.get(&hash) == Some(&id) {
            self.by_hash.remove(&hash);
        }
        for k in sim {
            if self.similar.get(&k) == Some(&id) {
                self.similar.remove(&k);
            }
        }
        self.free.push(id);
    }

    /// Writes entry `id`'s page into `out`.
    pub fn read(&self, id: Id, out: &mut [u8]) {
        let e = &self.entries[id as usize];
        if e.raw {
            out.copy_from_slice(&e.data);
        } else {
            // Entries are compressed from exactly one page by this pool, so this cannot fail.
            let n = lz4_flex::block::decompress_into(&e.data, out).unwrap_or(0);
            debug_assert_eq!(n, PAGE, "pool entry {id} decompressed to {n} bytes");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(seed: u8) -> Vec<u8> {
        (0..PAGE)
            .map(|i| (i as u8).wrapping_mul(seed) ^ (i >> 7) as u8)
            .collect()
    }

    #[test]
    fn equal_pages_share_one_entry_and_free_with_the_last_reference() {
        let mut pool = Pool::new();
        let mut s = [0u8; PAGE];
        let (a, how) = pool.insert(&page(3), &mut s);
        assert_eq!(how, Stored::New);
        let (b, how) = pool.insert(&page(3), &mut s);
        assert_eq!((a, how), (b, Stored::Shared));
        assert_eq!(pool.refs(a), 2);
        pool.release(a);
        assert_eq!(pool.len(), 1);
        pool.release(a);
        assert!(pool.is_empty());
        assert_eq!(pool.bytes(), 0);
        assert!(pool.share(&page(3), &mut s).is_none());
        assert!(pool.similar(&page(3)).is_none());
    }

    #[test]
    fn similar_pages_are_found_by_a_sampled_block() {
        let mut pool = Pool::new();
        let mut s = [0u8; PAGE];
        let (a, _) = pool.insert(&page(5), &mut s);
        let mut p = page(5);
        p[10] ^= 1;
        p[2000] ^= 1; // neither sampled block changed
        assert_eq!(pool.similar(&p), Some(a));
        let mut out = vec![0; PAGE];
        pool.read(a, &mut out);
        assert_eq!(out, page(5));
    }
}
