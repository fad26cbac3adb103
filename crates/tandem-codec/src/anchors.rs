//! Content-defined anchors: positions chosen by the bytes before them (a gear rolling hash
//! over the last 64 bytes), so the same content yields the same anchors wherever it lies in a
//! page. tandem indexes the anchors of new content it sends and looks up those of a page it
//! holds no previous version of, or of which much changed (content moved in from elsewhere);
//! a held page found that way joins the record's reference prefix, where zstd finds the
//! shared content, shifted or not.

/// Most anchors taken from one page.
pub const MAX: usize = 8;
/// An anchor where the rolling hash's top bits are zero: one every 2^9 = 512 bytes on average.
const SHIFT: u32 = 64 - 9;

const fn gear() -> [u64; 256] {
    let mut t = [0u64; 256];
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut i = 0;
    while i < 256 {
        // splitmix64
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        t[i] = z ^ (z >> 31);
        i += 1;
    }
    t
}

static GEAR: [u64; 256] = gear();

/// Anchors of the content in the 64-byte blocks of `page` set in `mask` (contiguous changed
/// blocks are scanned as one stretch); zero stretches give none. Returns how many were found.
pub fn find(page: &[u8], mask: u64, out: &mut [u64; MAX]) -> usize {
    let mut n = 0;
    for r in stretches(mask) {
        if n == MAX {
            break;
        }
        n = stretch(&page[r], out, n);
    }
    n
}

/// Byte ranges of the runs of contiguous blocks set in `mask`, in order.
fn stretches(mask: u64) -> impl Iterator<Item = std::ops::Range<usize>> {
    let mut b = 0;
    std::iter::from_fn(move || {
        while b < 64 && mask >> b & 1 == 0 {
            b += 1;
        }
        let start = b;
        while b < 64 && mask >> b & 1 == 1 {
            b += 1;
        }
        (start < 64).then(|| start * 64..b * 64)
    })
}

/// A hash below this (top bits zero) at a non-zero byte is an anchor.
const LIMIT: u64 = 1 << SHIFT;
/// Bytes before the first position that can be an anchor: the hash covers the last 64.
const WARM: usize = 63;
/// Independent hash chains scanning one stretch.
const LANES: usize = 4;

/// Appends the anchors of `s` to `out[n..]`, in the order of their positions, until it is
/// full; returns the new count. The hash at a position depends only on the 64 bytes ending
/// there (each step shifts the older bytes' share one bit further out), so a long stretch is
/// cut into [`LANES`] parts scanned side by side, each started 63 bytes early: the same
/// anchors as one scan ([`stretch_serial`]), without its one-byte-at-a-time dependency chain.
fn stretch(s: &[u8], out: &mut [u64; MAX], n: usize) -> usize {
    let m = s.len().saturating_sub(WARM) / LANES;
    if m < 64 {
        return stretch_serial(s, WARM, out, n);
    }
    // Lane k tests positions WARM + k*m .. WARM + (k+1)*m; the rest, serially, afterwards.
    let mut h = [0u64; LANES];
    for (k, hk) in h.iter_mut().enumerate() {
        for &x in &s[k * m..k * m + WARM] {
            *hk = (*hk << 1).wrapping_add(GEAR[x as usize]);
        }
    }
    let lane = |k: usize| &s[WARM + k * m..WARM + (k + 1) * m];
    let mut found = [[0u64; MAX]; LANES];
    let mut count = [0usize; LANES];
    let steps = lane(0).iter().zip(lane(1)).zip(lane(2)).zip(lane(3));
    for (((&x0, &x1), &x2), &x3) in steps {
        let x = [x0, x1, x2, x3];
        for k in 0..LANES {
            h[k] = (h[k] << 1).wrapping_add(GEAR[x[k] as usize]);
        }
        if h[0].min(h[1]).min(h[2].min(h[3])) < LIMIT {
            for k in 0..LANES {
                if h[k] < LIMIT && x[k] != 0 && count[k] < MAX {
                    found[k][count[k]] = h[k];
                    count[k] += 1;
                }
            }
        }
    }
    let mut n = n;
    for k in 0..LANES {
        for &a in &found[k][..count[k]] {
            if n == MAX {
                return n;
            }
            out[n] = a;
            n += 1;
        }
    }
    let tail = WARM + LANES * m;
    stretch_serial(&s[tail - WARM..], WARM, out, n)
}

/// [`stretch`] one byte at a time: anchors at positions `first` and later.
fn stretch_serial(s: &[u8], first: usize, out: &mut [u64; MAX], mut n: usize) -> usize {
    let mut h = 0u64;
    for (i, &x) in s.iter().enumerate() {
        if n == MAX {
            break;
        }
        h = (h << 1).wrapping_add(GEAR[x as usize]);
        if i >= first && h < LIMIT && x != 0 {
            out[n] = h;
            n += 1;
        }
    }
    n
}

/// Anchor → page holding that content, direct-mapped (a newer page replaces an older one).
pub struct Index {
    slots: Vec<(u32, u32)>,
    bits: u32,
}

impl Index {
    /// 2^bits slots of 8 bytes.
    pub fn new(bits: u32) -> Self {
        let bits = bits.clamp(4, 26);
        Index {
            slots: vec![(0, 0); 1 << bits],
            bits,
        }
    }

    fn slot(&self, h: u64) -> (usize, u32) {
        // The top bits are zero by construction: index by the low ones, tag by the middle.
        ((h & ((1 << self.bits) - 1)) as usize, (h >> 24) as u32)
    }

    /// The page last seen with anchor `h`.
    pub fn get(&self, h: u64) -> Option<u64> {
        let (i, tag) = self.slot(h);
        let (t, p) = self.slots[i];
        (p != 0 && t == tag).then(|| p as u64 - 1)
    }

    /// Remembers that `pfn` holds content with anchor `h`.
    pub fn put(&mut self, h: u64, pfn: u64) {
        let (i, tag) = self.slot(h);
        if let Ok(p) = u32::try_from(pfn + 1) {
            self.slots[i] = (tag, p);
        }
    }

    /// Memory held.
    pub fn bytes(&self) -> usize {
        self.slots.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::PAGE;

    #[test]
    fn anchors_survive_a_shift() {
        let page = crate::test_bytes(0x1234_5678_9abc_def1u64, PAGE);
        let mut shifted = vec![7u8; 200];
        shifted.extend_from_slice(&page[..PAGE - 200]);
        let (mut a, mut b) = ([0; MAX], [0; MAX]);
        let na = find(&page, u64::MAX, &mut a);
        let nb = find(&shifted, u64::MAX, &mut b);
        assert!(na > 2, "{na}");
        let common = a[..na].iter().filter(|h| b[..nb].contains(h)).count();
        assert!(common >= na - 2, "{common} of {na}");
        assert_eq!(find(&[0u8; PAGE], u64::MAX, &mut a), 0);
        let mut ix = Index::new(10);
        ix.put(a[0], 42);
        assert_eq!(ix.get(a[0]), Some(42));
    }

    proptest::proptest! {
        /// The lanes find exactly the anchors of one serial scan, in the same order.
        #[test]
        fn lanes_find_what_one_scan_finds(seed in proptest::prelude::any::<u64>(),
                                          mask in proptest::prelude::any::<u64>(),
                                          zeros in 0usize..PAGE) {
            let mut page = crate::test_bytes(seed, PAGE);
            page[zeros..(zeros + 300).min(PAGE)].fill(0);
            for mask in [mask, u64::MAX, mask | 0xffff_0000] {
                let (mut a, mut b) = ([0; MAX], [0; MAX]);
                let na = find(&page, mask, &mut a);
                let mut nb = 0;
                for r in stretches(mask) {
                    nb = stretch_serial(&page[r], WARM, &mut b, nb);
                }
                proptest::prop_assert_eq!(&a[..na], &b[..nb]);
            }
        }
    }
}
