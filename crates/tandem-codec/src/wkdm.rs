//! WKdm (Wilson & Kaplan): a dictionary compressor for in-memory data, ported from its
//! published description (no Rust implementation exists).
//!
//! Input is a sequence of 32-bit little-endian words. A 16-entry direct-mapped dictionary is
//! indexed by a hash of a word's upper 22 bits. Each word is classified and tagged (2 bits):
//! `0` zero word; `1` exact dictionary hit (+4-bit index); `2` partial hit, upper 22 bits equal
//! (+4-bit index, +10 low bits); `3` miss (+32-bit word, which enters the dictionary). Partial
//! hits also replace the dictionary entry. Output, after a 2-byte word count:
//! tags (4 per byte) | indexes (2 per byte) | low bits (10 bits each, LSB-first bit stream) |
//! full words (4 bytes each).

const DICT: usize = 16;

fn slot(w: u32) -> usize {
    // Hash the upper 22 bits into 4 bits (multiplicative hash).
    (((w >> 10).wrapping_mul(0x9E37_79B1)) >> 28) as usize
}

struct Bits {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl Bits {
    fn push(&mut self, v: u32, width: u32) {
        self.acc |= (v as u64) << self.n;
        self.n += width;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }
    fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

/// Compresses `data` (length a multiple of 4, at most 4 × 65535 bytes).
pub fn compress(data: &[u8]) -> Vec<u8> {
    assert!(
        data.len().is_multiple_of(4) && data.len() / 4 <= u16::MAX as usize,
        "wkdm input size"
    );
    let n = data.len() / 4;
    let mut dict = [0u32; DICT];
    let mut tags = Bits {
        out: Vec::with_capacity(n / 4 + 1),
        acc: 0,
        n: 0,
    };
    let mut idx = Bits {
        out: Vec::new(),
        acc: 0,
        n: 0,
    };
    let mut low = Bits {
        out: Vec::new(),
        acc: 0,
        n: 0,
    };
    let mut full = Vec::new();
    for c in data.chunks_exact(4) {
        let w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        let s = slot(w);
        if w == 0 {
            tags.push(0, 2);
        } else if dict[s] == w {
            tags.push(1, 2);
            idx.push(s as u32, 4);
        } else if dict[s] >> 10 == w >> 10 {
            tags.push(2, 2);
            idx.push(s as u32, 4);
            low.push(w & 0x3ff, 10);
            dict[s] = w;
        } else {
            tags.push(3, 2);
            full.extend_from_slice(&w.to_le_bytes());
            dict[s] = w;
        }
    }
    let (tags, idx, low) = (tags.finish(), idx.finish(), low.finish());
    let mut out = Vec::with_capacity(8 + tags.len() + idx.len() + low.len() + full.len());
    out.extend_from_slice(&(n as u16).to_le_bytes());
    out.extend_from_slice(&(idx.len() as u16).to_le_bytes());
    out.extend_from_slice(&(low.len() as u16).to_le_bytes());
    out.extend_from_slice(&tags);
    out.extend_from_slice(&idx);
    out.extend_from_slice(&low);
    out.extend_from_slice(&full);
    out
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    acc: u64,
    n: u32,
}

impl Reader<'_> {
    fn take(&mut self, width: u32) -> Option<u32> {
        while self.n < width {
            let b = *self.buf.get(self.pos)?;
            self.pos += 1;
            self.acc |= (b as u64) << self.n;
            self.n += 8;
        }
        let v = (self.acc & ((1u64 << width) - 1)) as u32;
        self.acc >>= width;
        self.n -= width;
        Some(v)
    }
}

/// Decompresses into `out` (whose length must equal the encoded word count × 4).
pub fn decompress(src: &[u8], out: &mut [u8]) -> bool {
    let hdr = |i: usize| {
        src.get(i..i + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
    };
    let (Some(n), Some(idx_len), Some(low_len)) = (hdr(0), hdr(2), hdr(4)) else {
        return false;
    };
    if n * 4 != out.len() {
        return false;
    }
    let tags_len = (2 * n).div_ceil(8);
    let t0 = 6;
    let (i0, l0) = (t0 + tags_len, t0 + tags_len + idx_len);
    let f0 = l0 + low_len;
    if src.len() < f0 {
        return false;
    }
    let mut tags = Reader {
        buf: &src[t0..i0],
        pos: 0,
        acc: 0,
        n: 0,
    };
    let mut idx = Reader {
        buf: &src[i0..l0],
        pos: 0,
        acc: 0,
        n: 0,
    };
    let mut low = Reader {
        buf: &src[l0..f0],
        pos: 0,
        acc: 0,
        n: 0,
    };
    let mut full = src[f0..].chunks_exact(4);
    let mut dict = [0u32; DICT];
    for o in out.chunks_exact_mut(4) {
        let w = match tags.take(2) {
            Some(0) => 0,
            Some(1) => match idx.take(4) {
                Some(s) => dict[s as usize],
                None => return false,
            },
            Some(2) => {
                let (Some(s), Some(l)) = (idx.take(4), low.take(10)) else {
                    return false;
                };
                let w = (dict[s as usize] & !0x3ff) | l;
                dict[s as usize] = w;
                w
            }
            Some(3) => {
                let Some(c) = full.next() else { return false };
                let w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                dict[slot(w)] = w;
                w
            }
            _ => return false,
        };
        o.copy_from_slice(&w.to_le_bytes());
    }
    full.next().is_none() && full.remainder().is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_compresses_typical_memory() {
        let mut page = vec![0u8; 4096];
        for (i, c) in page.chunks_exact_mut(8).enumerate() {
            // pointer-like values sharing upper bits, and small integers
            let v: u64 = if i % 3 == 0 {
                0xffff_8880_0012_3000 + (i as u64) * 64
            } else {
                i as u64 % 17
            };
            c.copy_from_slice(&v.to_le_bytes());
        }
        let z = compress(&page);
        assert!(z.len() < 2048, "wkdm did not compress: {}", z.len());
        let mut out = vec![0u8; 4096];
        assert!(decompress(&z, &mut out));
        assert_eq!(out, page);
    }

    #[test]
    fn rejects_garbage() {
        let mut out = vec![0u8; 4096];
        assert!(!decompress(&[1, 2, 3], &mut out));
        assert!(!decompress(&[0, 4, 0, 0, 0, 0], &mut out));
        let mut z = compress(&[7u8; 4096]);
        z.pop();
        assert!(!decompress(&z, &mut out));
    }
}
