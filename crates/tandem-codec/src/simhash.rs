//! Similarity hashes.
//!
//! - Gerofi et al.'s bit-density hash: an area is cut into 32 sections; bit i of the 32-bit hash
//!   is set when section i's popcount reaches the threshold. The paper's threshold is "80 % of
//!   the number of bits set"; we read it as 80 % of the area's mean popcount per section (a
//!   fixed 80 % of all bits would leave almost every hash zero), so the hash encodes where the
//!   area is denser than its own average, which survives small edits.
//! - Difference Engine's HashSimilarityDetector(2,1): xxh3 of two 64-byte blocks at fixed
//!   pseudo-random offsets of a page, each indexing its own table.

/// 512-byte area hash (32 sections of 16 bytes).
pub fn popcount_hash(area: &[u8]) -> u32 {
    let sec = area.len() / 32;
    let mut counts = [0u32; 32];
    let mut total = 0;
    for (c, s) in counts.iter_mut().zip(area.chunks_exact(sec)) {
        *c = s
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()).count_ones())
            .sum();
        total += *c;
    }
    // bit set when count >= 0.8 * mean, i.e. 32*5*count >= 4*total
    let mut h = 0u32;
    for (i, &c) in counts.iter().enumerate() {
        if total > 0 && 160 * c >= 4 * total {
            h |= 1 << i;
        }
    }
    h
}

/// Block numbers (of 64) that HashSimilarityDetector(2,1) samples: fixed, chosen at random once.
pub const DE_BLOCKS: [usize; 2] = [13, 46];

/// The two DE fingerprints of a page.
pub fn de_hashes(page: &[u8]) -> [u64; 2] {
    DE_BLOCKS.map(|b| xxhash_rust::xxh3::xxh3_64(&page[b * 64..(b + 1) * 64]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn similar_areas_share_a_hash() {
        let a: Vec<u8> = (0..512)
            .map(|i| {
                if (i / 64) % 2 == 0 {
                    0xff
                } else {
                    (i % 3) as u8
                }
            })
            .collect();
        let mut b = a.clone();
        b[5] ^= 0x10;
        b[300] ^= 0x01;
        assert_eq!(popcount_hash(&a), popcount_hash(&b));
        assert_ne!(popcount_hash(&a), 0);
        assert_eq!(popcount_hash(&[0u8; 512]), 0);
    }
}
