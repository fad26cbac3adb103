//! The tiered store with compression off: while the encoder is the slower stage even at
//! zstd's fastest level (`Encoder::set_level` at `level::MIN`), the tier takes nothing in, and
//! its quarter of the bytes goes to the main and probation lists as raw slots: the store is
//! then the scan-resistant store of the whole budget (`cold=off`'s), which holds what those
//! bytes can hold raw. When compression comes back, the lists shrink to three quarters again:
//! the least recent pages of the main list go to the tier (compressed at the next settle: up
//! to a quarter of the store's pages at once, copied aside until then, once per switch; the
//! encoder's two-level hysteresis keeps switches rare), and the pages in slots past the
//! smaller bound move down into free slots so that the slab's memory shrinks with it. The
//! store's bytes stay within its budget either way.

use super::{scan_resistant_caps, Lru, NIL, PAGE};

impl Lru {
    /// Turns a tiered store's compression on or off (a store without a tier, or one already
    /// so, is left as it is).
    pub(super) fn set_tier(&mut self, on: bool) {
        let Some(c) = self.cold.as_mut() else {
            return;
        };
        if c.active == on {
            return;
        }
        c.active = on;
        // The lists' pages: three quarters of the store's with the tier on, all of them off.
        let lists = self.caps[0] + self.caps[1];
        let tier = c.budget() / PAGE;
        if on {
            self.caps = scan_resistant_caps(lists - tier);
            self.shrink();
        } else {
            c.clear();
            self.caps = scan_resistant_caps(lists + tier);
        }
    }

    /// Evicts the lists down to their bounds and moves the pages of slots past their sum into
    /// free slots below it, then releases the slab's memory past it.
    fn shrink(&mut self) {
        for list in [1, 0] {
            while self.lists[list].len > self.caps[list] {
                let s = self.evict(list);
                self.free.push(s);
            }
        }
        let n = self.caps[0] + self.caps[1];
        if self.pfn.len() > n {
            let mut low: Vec<u32> = self
                .free
                .iter()
                .copied()
                .filter(|&s| (s as usize) < n)
                .collect();
            for s in n..self.pfn.len() {
                let s = s as u32;
                let pfn = self.pfn[s as usize];
                if self.map.get(&pfn) != Some(&s) {
                    continue; // a free slot
                }
                // At most n pages are held, so a free slot below n is left for each one above.
                let t = low.pop().expect("a free slot below the bound");
                self.relocate(s, t);
            }
            self.free = low;
            self.pfn.truncate(n);
            self.prev.truncate(n);
            self.next.truncate(n);
            self.seg.truncate(n);
            self.data.truncate(n * PAGE);
            self.data.shrink_to_fit();
            for v in [&mut self.prev, &mut self.next] {
                v.shrink_to_fit();
            }
            self.pfn.shrink_to_fit();
            self.seg.shrink_to_fit();
        }
        self.free.shrink_to_fit();
    }

    /// Moves the held page of slot `s` into the free slot `t`, on the same list and at the
    /// same place in it.
    fn relocate(&mut self, s: u32, t: u32) {
        let (su, tu) = (s as usize, t as usize);
        self.data.copy_within(su * PAGE..(su + 1) * PAGE, tu * PAGE);
        let (p, n, seg) = (self.prev[su], self.next[su], self.seg[su]);
        (self.pfn[tu], self.prev[tu], self.next[tu], self.seg[tu]) = (self.pfn[su], p, n, seg);
        let e = &mut self.lists[seg as usize];
        if p != NIL {
            self.next[p as usize] = t;
        } else {
            e.head = t;
        }
        if n != NIL {
            self.prev[n as usize] = t;
        } else {
            e.tail = t;
        }
        self.map.insert(self.pfn[tu], t);
    }
}
