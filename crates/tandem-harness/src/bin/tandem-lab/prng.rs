//! `tandem-lab trace prng`: how much of a trace is a pseudo-random generator's output, which
//! no general-purpose codec shrinks.
//!
//! The lab's `alloc` workload (guest/allocchurn.c) fills every other 64-byte stretch of its
//! blocks with xorshift64 (13, 7, 17) output. Such a word is found exactly: it is the
//! xorshift of the word before it in the same stretch, or of the last word of the stretch
//! 64 bytes before. (A general compressor does not know the generator: zstd −19 and xz −9e
//! leave the words as long as they were; docs/BENCHMARKS.md.) The count is a lower bound of
//! the generator's bytes in the trace: a stretch's first word, whose predecessor was spent
//! on a block size and never written, and words whose predecessor lies on another page are
//! not counted.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;
use tandem_harness::xorshift64;
use xxhash_rust::xxh3::xxh3_64;

/// One trace's count.
#[derive(Serialize, Default)]
pub struct PrngCount {
    pub file: String,
    /// Epochs with dirty pages (those `tandem-lab bench --trace` counts).
    pub epochs: u64,
    /// Dirty pages per epoch whose content is not that of any page before the epoch.
    pub new_pages_per_epoch: f64,
    /// Bytes of 8-byte words that differ from the word at their place before the epoch,
    /// in those pages, per epoch.
    pub changed_bytes_per_epoch: f64,
    /// ... of which continue a xorshift64 stream.
    pub prng_bytes_per_epoch: f64,
}

/// Words of `new` that differ from `old` at their place, and how many of them continue a
/// xorshift64 stream within the page.
fn count_page(new: &[u8], old: &[u8]) -> (u64, u64) {
    let word =
        |p: &[u8], k: usize| u64::from_le_bytes(p[k * 8..k * 8 + 8].try_into().unwrap_or_default());
    let n = new.len() / 8;
    let (mut changed, mut prng) = (0, 0);
    for k in 0..n {
        let w = word(new, k);
        if w == word(old, k) {
            continue;
        }
        changed += 1;
        // xorshift(0) is 0: a zero word continues nothing.
        let follows = |j: usize| w == xorshift64(word(new, j));
        let followed = k + 1 < n && word(new, k + 1) == xorshift64(w);
        if w != 0 && ((k >= 1 && follows(k - 1)) || followed || (k >= 9 && follows(k - 9))) {
            prng += 1;
        }
    }
    (changed, prng)
}

/// Counts the generator's words in the trace at `path`.
pub fn count(path: &Path) -> anyhow::Result<PrngCount> {
    let f = File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let input = BufReader::with_capacity(1 << 20, f);
    // How many pages of memory before the epoch hold each content (by hash): a dirty page
    // equal to one of them is a copy, which codecs send as a reference.
    let mut holders: HashMap<u64, u32> = HashMap::new();
    let mut page_hash: Vec<u64> = Vec::new();
    let (mut new_pages, mut changed, mut prng, mut epochs) = (0u64, 0u64, 0u64, 0u64);
    tandem_trace::replay(input, |mem, e| -> anyhow::Result<()> {
        let ps = e.data.len() / e.pfns.len().max(1);
        if ps == 0 {
            // An epoch without dirty pages is not counted, as `tandem-lab bench --trace`
            // does not count it: the figures per epoch compare with its bytes per epoch.
            return Ok(());
        }
        if page_hash.is_empty() {
            for p in mem.chunks_exact(ps) {
                let h = xxh3_64(p);
                page_hash.push(h);
                *holders.entry(h).or_default() += 1;
            }
        }
        let hashes: Vec<u64> = e.data.chunks_exact(ps).map(xxh3_64).collect();
        for (i, &pfn) in e.pfns.iter().enumerate() {
            if holders.get(&hashes[i]).is_some_and(|&n| n > 0) {
                continue;
            }
            let at = pfn as usize * ps;
            let old = mem
                .get(at..at + ps)
                .context("page beyond the trace's memory")?;
            let (c, p) = count_page(&e.data[i * ps..(i + 1) * ps], old);
            new_pages += 1;
            changed += c;
            prng += p;
        }
        for (i, &pfn) in e.pfns.iter().enumerate() {
            let slot = page_hash
                .get_mut(pfn as usize)
                .context("page beyond the trace's memory")?;
            if let Some(n) = holders.get_mut(slot) {
                *n = n.saturating_sub(1);
            }
            *slot = hashes[i];
            *holders.entry(hashes[i]).or_default() += 1;
        }
        epochs += 1;
        Ok(())
    })?;
    let per = |n: u64| n as f64 / epochs.max(1) as f64;
    Ok(PrngCount {
        file: path.display().to_string(),
        epochs,
        new_pages_per_epoch: per(new_pages),
        changed_bytes_per_epoch: 8.0 * per(changed),
        prng_bytes_per_epoch: 8.0 * per(prng),
    })
}

/// `tandem-lab trace prng FILE...`.
pub fn run(files: &[PathBuf], json: bool) -> anyhow::Result<()> {
    let counts = files
        .iter()
        .map(|f| count(f))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&counts)?);
        return Ok(());
    }
    println!("| trace | epochs | new pages/epoch | changed bytes/epoch | xorshift64 bytes/epoch |");
    println!("|---|---|---|---|---|");
    for c in &counts {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} |",
            c.file,
            c.epochs,
            c.new_pages_per_epoch,
            c.changed_bytes_per_epoch,
            c.prng_bytes_per_epoch
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generator_stretch_is_counted_and_counters_are_not() {
        let old = vec![0u8; 4096];
        let mut new = vec![0u8; 4096];
        let mut r = 0x9e37_79b9_7f4a_7c15u64;
        // Two blocks' worth of allocchurn's pattern: 8 counter words, 8 generator words.
        for k in 0..64usize {
            let v = if k & 8 != 0 {
                r = xorshift64(r);
                r
            } else {
                1000 + 8 * k as u64
            };
            new[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        assert_eq!(count_page(&new, &old), (64, 32));
        // Unchanged words count for nothing.
        assert_eq!(count_page(&new, &new), (0, 0));
    }
}
