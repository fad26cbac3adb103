//! Encoder-side reference state: previous versions of pages and the indexes that find
//! references. Invariant: every page content held here equals the decoder's pre-epoch mirror
//! for that page (it is updated with each encoded page's new content after the epoch), so any
//! reference the encoder makes resolves to the same bytes on the decoder, which keeps the whole
//! mirror. State stays small by bounding the store (LRU or direct-mapped); a page that is not
//! held is simply sent without a delta (the full-page fallback), which also resynchronises it.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::format::PAGE;

mod cold;
mod switch;
use cold::Cold;

/// Multiplicative hasher for u64 keys (page numbers, content hashes): SipHash costs more than
/// the rest of a lookup and these maps are not exposed to untrusted keys.
#[derive(Default)]
pub struct FxHasher(u64);

impl Hasher for FxHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(*b as u64);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

/// A `HashMap` with [`FxHasher`].
pub type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

const NIL: u32 = u32::MAX;

/// Previous versions of pages.
pub enum PrevStore {
    /// Every page (memory = guest size).
    Mirror(Vec<u8>),
    /// Least-recently-dirtied pages, bounded (FITDOC buffer, Gerofi RDP cache, tandem).
    Lru(Box<Lru>),
    /// QEMU XBZRLE's cache: direct-mapped by page number, power-of-two slots.
    Direct {
        /// Page number held by each slot (`u64::MAX` = empty).
        tags: Vec<u64>,
        /// Slot contents.
        data: Vec<u8>,
    },
}

/// A slab of pages with intrusive LRU lists: the main one and, with scan-resistant
/// admission, a small probation list for the pages it turns away.
pub struct Lru {
    /// Scan-resistant admission (tandem's store); `None`: every page is admitted (plain LRU).
    admission: Option<Admission>,
    map: FxMap<u64, u32>,
    pfn: Vec<u64>,
    data: Vec<u8>,
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Per slot: the list it is on (0: main, 1: probation).
    seg: Vec<u8>,
    /// The main list and the probation list.
    lists: [Ends; 2],
    /// Per list: most pages.
    caps: [usize; 2],
    /// Slots left empty by a page moved from probation into a full main list.
    free: Vec<u32>,
    /// Compressed tier for the pages pushed out of the main list (tandem's store with
    /// `Budget::cold`).
    cold: Option<Box<Cold>>,
}

/// One intrusive list of an [`Lru`].
#[derive(Clone, Copy)]
struct Ends {
    /// Most recent slot.
    head: u32,
    /// Least recent slot.
    tail: u32,
    len: usize,
}

/// The probation list's share of a scan-resistant store (1/32): enough that a page turned
/// away and written again soon after (a database page touched after a long while, then
/// several times) is still held the second time, small enough not to cost a cycle's sample.
const PROBATION_SHARE: usize = 32;

/// The main and probation lists' pages of a scan-resistant store of `cap` pages.
fn scan_resistant_caps(cap: usize) -> [usize; 2] {
    let probation = cap / PROBATION_SHARE;
    [cap - probation, probation]
}

impl Lru {
    /// A store for `cap` pages (at least 1).
    pub fn new(cap: usize) -> Self {
        let cap = cap.max(1);
        Lru {
            admission: None,
            map: FxMap::default(),
            pfn: Vec::new(),
            data: Vec::new(),
            prev: Vec::new(),
            next: Vec::new(),
            seg: Vec::new(),
            lists: [Ends {
                head: NIL,
                tail: NIL,
                len: 0,
            }; 2],
            caps: [cap, 0],
            free: Vec::new(),
            cold: None,
        }
    }

    /// A scan-resistant store of `cap` pages' bytes of which three quarters hold pages as
    /// they are and a quarter holds the pages pushed out of them compressed (see [`cold`]): a
    /// compressible cycle of up to a few times `cap` pages stays held. (Half and half sent
    /// 0.2–3.5 % more bytes on four of the tuned workloads, none fewer: docs/CODEC.md.)
    pub fn tiered(cap: usize, pages: u64) -> Self {
        let cap = cap.max(2);
        let cold = Cold::new((cap / 4) * PAGE);
        Lru {
            cold: Some(Box::new(cold)),
            ..Lru::scan_resistant(cap - cap / 4, pages)
        }
    }

    /// A store for `cap` pages of a guest of `pages` pages that does not thrash when the
    /// guest rewrites more pages in a cycle than it holds (see [`Admission`]).
    pub fn scan_resistant(cap: usize, pages: u64) -> Self {
        let cap = cap.max(1);
        Lru {
            admission: Some(Admission::new(pages)),
            caps: scan_resistant_caps(cap),
            ..Lru::new(cap)
        }
    }

    fn unlink(&mut self, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        let e = &mut self.lists[self.seg[s as usize] as usize];
        if p != NIL {
            self.next[p as usize] = n
        } else {
            e.head = n
        }
        if n != NIL {
            self.prev[n as usize] = p
        } else {
            e.tail = p
        }
        e.len -= 1;
    }

    fn push_front(&mut self, s: u32, list: usize) {
        self.seg[s as usize] = list as u8;
        let e = &mut self.lists[list];
        self.prev[s as usize] = NIL;
        self.next[s as usize] = e.head;
        if e.head != NIL {
            self.prev[e.head as usize] = s;
        }
        e.head = s;
        if e.tail == NIL {
            e.tail = s;
        }
        e.len += 1;
    }

    /// Removes the least recent page of `list`; returns its slot. A page leaving the main
    /// list goes to the compressed tier, if there is one.
    fn evict(&mut self, list: usize) -> u32 {
        let s = self.lists[list].tail;
        self.unlink(s);
        let pfn = self.pfn[s as usize];
        self.map.remove(&pfn);
        if let (0, Some(c)) = (list, self.cold.as_mut()) {
            c.defer(pfn, &self.data[s as usize * PAGE..(s as usize + 1) * PAGE]);
        }
        s
    }

    /// A slot for a page entering `list`: the list's least recent one when it is full.
    fn slot(&mut self, pfn: u64, list: usize) -> u32 {
        let s = if self.lists[list].len >= self.caps[list] {
            self.evict(list)
        } else if let Some(s) = self.free.pop() {
            s
        } else {
            let s = self.pfn.len() as u32;
            self.pfn.push(0);
            self.prev.push(NIL);
            self.next.push(NIL);
            self.seg.push(0);
            let cap = self.caps[0] + self.caps[1];
            if self.data.len() == self.data.capacity() {
                // Grow by doubling, but never past the bound (`resize` alone could double
                // the slab to almost twice its limit).
                let len = self.data.len();
                self.data
                    .reserve_exact(len.max(64 * PAGE).min(cap * PAGE - len));
            }
            self.data.resize(self.data.len() + PAGE, 0);
            s
        };
        self.pfn[s as usize] = pfn;
        self.map.insert(pfn, s);
        s
    }

    fn get(&self, pfn: u64) -> Option<&[u8]> {
        match self.map.get(&pfn) {
            Some(&s) => Some(&self.data[s as usize * PAGE..(s as usize + 1) * PAGE]),
            None => self.cold.as_ref()?.staged(pfn),
        }
    }

    fn put(&mut self, pfn: u64, content: &[u8]) {
        if let Some((s, _)) = self.place(pfn) {
            self.data[s as usize * PAGE..(s as usize + 1) * PAGE].copy_from_slice(content);
        }
    }

    /// Stores the pages of one epoch, as [`Lru::put`] one after the other would, but copies
    /// a page bound for the probation list only if it is still held when the batch ends: a
    /// guest that rewrites a cycle much larger than the store sends almost every page there,
    /// and all but the last `caps[1]` of them are pushed out again within the same epoch.
    fn put_batch<'a>(&mut self, pages: impl IntoIterator<Item = (u64, &'a [u8])>) {
        // Probation slot → the content it takes once the batch is over. Nothing reads a
        // probation slot's bytes meanwhile: pushing one out does not (only the main list's
        // pages go to the compressed tier), and a slot that moves to the main list is
        // copied at once.
        let mut later: FxMap<u32, &'a [u8]> = FxMap::default();
        for (pfn, content) in pages {
            match self.place(pfn) {
                Some((s, 1)) => {
                    later.insert(s, content);
                }
                Some((s, _)) => {
                    later.remove(&s);
                    self.data[s as usize * PAGE..(s as usize + 1) * PAGE].copy_from_slice(content);
                }
                None => {}
            }
        }
        for (s, content) in later {
            self.data[s as usize * PAGE..(s as usize + 1) * PAGE].copy_from_slice(content);
        }
    }

    /// Records that `pfn` gets a new version: returns the slot (and its list) whose bytes the
    /// caller must set to it, or `None` when the store does not keep it.
    fn place(&mut self, pfn: u64) -> Option<(u32, usize)> {
        let mut cap = self.caps[0];
        let mut from_tier = false;
        if let Some(c) = self.cold.as_mut() {
            from_tier = c.staged(pfn).is_some();
            // A compressed version, if any, is older than this one.
            c.remove(pfn);
            cap += c.capacity();
        }
        let (admit, distance) = match self.admission.as_mut() {
            Some(a) => a.admit(pfn, cap),
            None => (true, u64::MAX),
        };
        if let Some(c) = self.cold.as_mut().filter(|_| from_tier) {
            // Back from the tier after more pages than the store would hold raw (a page
            // that came back sooner would have been held anyway without the tier).
            let raw = self.caps[0] + self.caps[1] + c.budget() / PAGE;
            if distance != u64::MAX && distance > raw as u64 {
                c.came_back();
            }
        }
        let held = self.map.get(&pfn).copied();
        // Main when held there, admitted or while it has room; otherwise probation.
        let main = held.is_some_and(|s| self.seg[s as usize] == 0)
            || admit
            || (held.is_none() && self.lists[0].len < self.caps[0]);
        let list = if main { 0 } else { 1 };
        let s = match held {
            Some(s) => {
                self.unlink(s);
                if list == 0 && self.seg[s as usize] == 1 && self.lists[0].len >= self.caps[0] {
                    // Promoted from probation into a full main list.
                    let t = self.evict(0);
                    self.free.push(t);
                }
                s
            }
            None if self.caps[list] == 0 => return None,
            None => self.slot(pfn, list),
        };
        self.push_front(s, list);
        Some((s, list))
    }

    fn work_bytes(&self) -> usize {
        self.cold.as_ref().map_or(0, |c| c.work_bytes())
    }

    fn bytes(&self) -> usize {
        self.cold.as_ref().map_or(0, |c| c.bytes())
            + self.data.capacity()
            + self.pfn.capacity() * 17
            + self.map.capacity() * 16
            + self.free.capacity() * 4
            + self.admission.as_ref().map_or(0, |a| a.last.capacity() * 4)
    }
}

/// Which missing pages a full store takes in. Plain LRU holds nothing when the guest rewrites
/// a cycle of more pages than the store holds (a ring buffer, a scan over a large array): each
/// page is evicted just before it comes round again. Like LIRS, this judges a page by its
/// reuse distance, here the number of pages stored since its previous version: within the
/// main list's capacity (or a page seen for the first time), it is taken in as LRU would;
/// beyond it, only a fixed sample of page numbers, `capacity / (2 × distance)` of them, is.
/// On a cycle of W > C pages that sample (C/2W of the cycle, half of what fits, so that it
/// does not thrash among itself) is taken in and then hit every time round, and so are the
/// pages already held that it did not push out; LRU hits nothing. The pages turned away go to
/// the small probation list, so one written again soon after (a burst after a long pause) is
/// held the second time, as LRU would hold it.
struct Admission {
    /// Per page: `clock` when its last version was stored (0: never).
    last: Vec<u32>,
    clock: u32,
}

impl Admission {
    fn new(pages: u64) -> Self {
        Admission {
            last: vec![0; pages as usize],
            clock: 0,
        }
    }

    /// Records that a version of `pfn` is being stored; says whether a store of `cap` pages
    /// that does not hold it should take it in, and the page's reuse distance (`u64::MAX`
    /// for a page seen for the first time).
    fn admit(&mut self, pfn: u64, cap: usize) -> (bool, u64) {
        // 0 marks "never": the clock skips it when it wraps (after 2^32 pages stored, a
        // distance may come out wrong once; it only steers what is held).
        self.clock = self.clock.wrapping_add(1).max(1);
        let Some(l) = self.last.get_mut(pfn as usize) else {
            return (true, u64::MAX);
        };
        let prev = std::mem::replace(l, self.clock);
        if prev == 0 {
            return (true, u64::MAX);
        }
        let d = self.clock.wrapping_sub(prev) as u64;
        (d <= cap as u64 || rank(pfn) * d < 512 * cap as u64, d)
    }
}

/// The page's place in a fixed pseudo-random order of page numbers, in 0..1024: the samples
/// of admission and of the compressed tier take the pages of lowest rank.
fn rank(pfn: u64) -> u64 {
    pfn.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54
}

impl PrevStore {
    /// A direct-mapped XBZRLE cache of `bytes` (rounded down to a power of two of pages).
    pub fn direct(bytes: usize) -> Self {
        let slots = (bytes / PAGE).max(1);
        let slots = 1usize << (usize::BITS - 1 - slots.leading_zeros());
        PrevStore::Direct {
            tags: vec![u64::MAX; slots],
            data: vec![0; slots * PAGE],
        }
    }

    /// The held previous version of `pfn`.
    pub fn get(&self, pfn: u64) -> Option<&[u8]> {
        match self {
            PrevStore::Mirror(m) => m.get(pfn as usize * PAGE..(pfn as usize + 1) * PAGE),
            PrevStore::Lru(l) => l.get(pfn),
            PrevStore::Direct { tags, data } => {
                let s = pfn as usize & (tags.len() - 1);
                (tags[s] == pfn).then(|| &data[s * PAGE..(s + 1) * PAGE])
            }
        }
    }

    /// Makes the previous versions of `pfns` readable by [`PrevStore::get`]: a tiered store
    /// decompresses those it holds compressed (on `pool`'s threads, if given). Call it before
    /// reading an epoch's pages.
    pub fn promote(&mut self, pfns: &[u64], pool: Option<&rayon::ThreadPool>) {
        if let Some(c) = self.cold_mut() {
            c.stage(pfns, pool)
        }
    }

    fn cold_mut(&mut self) -> Option<&mut Cold> {
        match self {
            PrevStore::Lru(l) => l.cold.as_deref_mut(),
            _ => None,
        }
    }

    /// Ends an epoch, after its [`PrevStore::put`]s: a tiered store compresses the pages its
    /// main list pushed out (on `pool`'s threads, if given) and puts back the pages staged by
    /// [`PrevStore::promote`] and not written since; it releases both buffers.
    pub fn settle(&mut self, pool: Option<&rayon::ThreadPool>) {
        if let Some(c) = self.cold_mut() {
            c.settle(pool)
        }
    }

    /// Whether a tiered store compresses the pages it pushes out of its main list (true when
    /// made), or holds pages raw in all of its bytes, which saves the CPU of compressing them
    /// (switch.rs).
    pub fn set_compressing(&mut self, on: bool) {
        if let PrevStore::Lru(l) = self {
            l.set_tier(on);
        }
    }

    /// Records `content` as the current version of `pfn`.
    pub fn put(&mut self, pfn: u64, content: &[u8]) {
        match self {
            PrevStore::Mirror(m) => {
                if let Some(d) = m.get_mut(pfn as usize * PAGE..(pfn as usize + 1) * PAGE) {
                    d.copy_from_slice(content)
                }
            }
            PrevStore::Lru(l) => l.put(pfn, content),
            PrevStore::Direct { tags, data } => {
                let s = pfn as usize & (tags.len() - 1);
                tags[s] = pfn;
                data[s * PAGE..(s + 1) * PAGE].copy_from_slice(content);
            }
        }
    }

    /// Records the current versions of one epoch's pages, in order: the same as a
    /// [`PrevStore::put`] of each, with less copying in a scan-resistant store (see
    /// `Lru::put_batch`).
    pub fn put_batch<'a>(&mut self, pages: impl IntoIterator<Item = (u64, &'a [u8])>) {
        match self {
            PrevStore::Lru(l) => l.put_batch(pages),
            s => pages.into_iter().for_each(|(pfn, p)| s.put(pfn, p)),
        }
    }

    /// Memory held.
    pub fn bytes(&self) -> usize {
        match self {
            PrevStore::Mirror(m) => m.capacity(),
            PrevStore::Lru(l) => l.bytes(),
            PrevStore::Direct { tags, data } => tags.capacity() * 8 + data.capacity(),
        }
    }

    /// Working memory kept between epochs (the compressed tier's staging buffers).
    pub fn work_bytes(&self) -> usize {
        match self {
            PrevStore::Lru(l) => l.work_bytes(),
            _ => 0,
        }
    }
}

/// xxh3 of whole pages → page number, for identical-page sharing (verified by byte compare).
#[derive(Default)]
pub struct PageIndex {
    map: FxMap<u64, u64>,
    cap: usize,
}

impl PageIndex {
    /// An index holding at most about `cap` entries (cleared when it overflows; entries are
    /// hints, always verified).
    pub fn new(cap: usize) -> Self {
        PageIndex {
            map: FxMap::default(),
            cap: cap.max(16),
        }
    }
    /// Candidate page with this content hash.
    pub fn get(&self, h: u64) -> Option<u64> {
        self.map.get(&h).copied()
    }
    /// Remembers that `pfn` now holds content with hash `h`.
    pub fn put(&mut self, h: u64, pfn: u64) {
        if self.map.len() >= self.cap {
            self.map.clear();
        }
        self.map.insert(h, pfn);
    }
    /// Memory held.
    pub fn bytes(&self) -> usize {
        self.map.capacity() * 24
    }
}

/// A fixed table of 2^bits buckets, each a small FIFO of candidate (page, sub-unit) entries.
pub struct Buckets {
    slots: Vec<[u64; 4]>,
    bits: u32,
}

impl Buckets {
    /// 2^bits buckets of 4 entries.
    pub fn new(bits: u32) -> Self {
        let bits = bits.clamp(1, 28);
        Buckets {
            slots: vec![[u64::MAX; 4]; 1 << bits],
            bits,
        }
    }
    fn idx(&self, h: u64) -> usize {
        ((h ^ (h >> self.bits) ^ (h >> (2 * self.bits))) & ((1 << self.bits) - 1)) as usize
    }
    /// Candidates for hash `h` (packed `pfn << 8 | unit`).
    pub fn get(&self, h: u64) -> impl Iterator<Item = u64> + '_ {
        self.slots[self.idx(h)]
            .iter()
            .copied()
            .filter(|&v| v != u64::MAX)
    }
    /// Adds a candidate, evicting the oldest of the bucket.
    pub fn put(&mut self, h: u64, v: u64) {
        let i = self.idx(h);
        let b = &mut self.slots[i];
        if b.contains(&v) {
            return;
        }
        b.rotate_right(1);
        b[0] = v;
    }
    /// Memory held.
    pub fn bytes(&self) -> usize {
        self.slots.capacity() * 32
    }
}

#[cfg(test)]
mod tests;
