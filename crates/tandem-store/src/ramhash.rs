//! The checksum of a guest's RAM recorded with each checkpoint: xxh3 over the array of per-page
//! xxh3 hashes. The saver keeps the per-page array and updates only dirty pages (cheap per
//! checkpoint); a restore hashes every page once.

use xxhash_rust::xxh3::xxh3_64;

const PAGE: usize = tandem_codec::format::PAGE;

/// Per-page hashes of a guest's RAM.
pub struct RamHash {
    pages: Vec<u64>,
}

impl RamHash {
    /// Hashes every page of `ram`.
    pub fn of(ram: &[u8]) -> Self {
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8);
        let per = (ram.len() / PAGE).div_ceil(threads).max(1) * PAGE;
        let parts: Vec<Vec<u64>> = std::thread::scope(|s| {
            let hs: Vec<_> = ram
                .chunks(per)
                .map(|part| s.spawn(move || part.chunks(PAGE).map(xxh3_64).collect::<Vec<u64>>()))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect()
        });
        RamHash {
            pages: parts.concat(),
        }
    }

    /// Updates the pages `pfns` whose new contents are `data` (one page per pfn).
    pub fn update(&mut self, pfns: &[u64], data: &[u8]) {
        for (&p, page) in pfns.iter().zip(data.chunks(PAGE)) {
            if let Some(h) = self.pages.get_mut(p as usize) {
                *h = xxh3_64(page);
            }
        }
    }

    /// The RAM checksum.
    pub fn value(&self) -> u64 {
        let mut bytes = Vec::with_capacity(self.pages.len() * 8);
        for h in &self.pages {
            bytes.extend_from_slice(&h.to_le_bytes());
        }
        xxh3_64(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incremental_equals_full() {
        let mut ram: Vec<u8> = (0..16 * PAGE).map(|i| (i % 7) as u8).collect();
        let mut h = RamHash::of(&ram);
        ram[3 * PAGE + 5] = 99;
        ram[9 * PAGE] = 1;
        let mut data = ram[3 * PAGE..4 * PAGE].to_vec();
        data.extend_from_slice(&ram[9 * PAGE..10 * PAGE]);
        h.update(&[3, 9], &data);
        assert_eq!(h.value(), RamHash::of(&ram).value());
    }
}
