//! Content-hash dirty log: the fallback for kernels without async write-protect.

use std::sync::Arc;

use super::{DirtyLog, DirtyLogError, HarvestStats};
use crate::ram::{GuestRam, PAGE_SIZE};

/// Hashes every page (xxh3-64) on `threads` cores and reports pages whose hash changed.
///
/// It sees content changes only: a page written with the same bytes is not reported, which is
/// exactly what a checkpoint needs. A 64-bit hash collision would hide a change with
/// probability 2⁻⁶⁴ per changed page.
pub struct HashLog {
    ram: Arc<GuestRam>,
    hashes: Vec<u64>,
    threads: usize,
}

impl HashLog {
    /// Takes the initial hashes now (the guest must be stopped).
    pub fn new(ram: Arc<GuestRam>, threads: usize) -> Self {
        let threads = threads.max(1);
        let mut log = HashLog {
            hashes: vec![0; ram.pages()],
            ram,
            threads,
        };
        log.rehash(&mut Vec::new(), true);
        log
    }

    fn rehash(&mut self, out: &mut Vec<u64>, initial: bool) {
        // SAFETY: the DirtyLog contract requires the guest to be stopped during a harvest.
        let mem = unsafe { self.ram.as_slice() };
        let per = self.hashes.len().div_ceil(self.threads);
        let mut parts: Vec<Vec<u64>> = Vec::new();
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .hashes
                .chunks_mut(per)
                .enumerate()
                .map(|(i, chunk)| {
                    let base = i * per;
                    s.spawn(move || {
                        let mut changed = Vec::new();
                        for (j, h) in chunk.iter_mut().enumerate() {
                            let pfn = base + j;
                            let page = &mem[pfn * PAGE_SIZE..(pfn + 1) * PAGE_SIZE];
                            let new = xxhash_rust::xxh3::xxh3_64(page);
                            if new != *h && !initial {
                                changed.push(pfn as u64);
                            }
                            *h = new;
                        }
                        changed
                    })
                })
                .collect();
            parts = handles
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect();
        });
        for p in parts {
            out.extend(p);
        }
    }
}

impl DirtyLog for HashLog {
    fn name(&self) -> &'static str {
        "hash"
    }

    fn harvest(&mut self, out: &mut Vec<u64>) -> Result<HarvestStats, DirtyLogError> {
        let before = out.len();
        self.rehash(out, false);
        Ok(HarvestStats {
            pages: (out.len() - before) as u64,
            ranges: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_exactly_changed_pages() {
        let dir = tempfile::tempdir().unwrap();
        let ram =
            Arc::new(GuestRam::create(&dir.path().join("ram"), 64 * PAGE_SIZE as u64).unwrap());
        let mut log = HashLog::new(ram.clone(), 3);
        // SAFETY: no guest runs on this file; this is the only live slice.
        let mem = unsafe { ram.as_mut_slice() };
        mem[5 * PAGE_SIZE + 17] = 1;
        mem[63 * PAGE_SIZE] = 9;
        mem[7 * PAGE_SIZE] = 0; // written, unchanged: not reported
        let mut out = Vec::new();
        log.harvest(&mut out).unwrap();
        assert_eq!(out, vec![5, 63]);
        out.clear();
        log.harvest(&mut out).unwrap();
        assert!(out.is_empty());
    }
}
