//! The encoder: reference state + one strategy per codec, parallel and deterministic.

pub use crate::config::{Codec, Config};

use std::collections::HashMap;

use crate::format::PAGE;
use crate::simhash::{de_hashes, popcount_hash, DE_BLOCKS};
use crate::state::{Buckets, FxMap, Lru, PageIndex, PrevStore};
use crate::strategies::{self as st, Coded, EncodeCtx, Pre, Refs};
use crate::EncodeError;

/// What one `encode` call did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncodeStats {
    /// Dirty pages given.
    pub pages_in: usize,
    /// Pages in the record (the rest were written but unchanged).
    pub entries: usize,
    /// Record bytes.
    pub bytes: usize,
    /// Pages whose previous version formed the record's reference prefix.
    pub prefix_pages: usize,
    /// zstd level used for the record.
    pub level: i32,
    /// tandem's per-epoch trial (trial.rs): what it measured (all zero when it did not run).
    pub trial: crate::Trial,
    /// tandem: the largest run patch taken this epoch (the trial's choice: `good_enough`, or
    /// `trial::LONG_PATCH` when long run patches won); 0 for the other codecs.
    pub patch_limit: usize,
    /// tandem: whether this epoch took long run patches (the trial's choice), not the
    /// prefix path.
    pub long_patches: bool,
    /// tandem: whether this epoch went without the reference prefix because the last check
    /// found it saving too little (trial.rs, `PrefixChoice`).
    pub prefix_off: bool,
    /// tandem: this record's data stored with its reference prefix, and compressed again
    /// without it, when the epoch checked whether the prefix pays (trial.rs, `PrefixChoice`).
    pub prefix_check: Option<(usize, usize)>,
    /// tandem: what this epoch's measurement of word deltas found (words.rs; all zero when it
    /// did not run).
    pub words: crate::words::Measured,
    /// tandem: whether this epoch sent any page as word deltas (the measurement chose them
    /// and the epoch had whole pages to send).
    pub word_deltas: bool,
    /// Microseconds spent in: pre-pass, reference resolution, page encoding, serialisation and
    /// record compression, state update. With a worker pool and an epoch large enough for it,
    /// the state update runs beside the record's compression: the fourth is then the wall
    /// time until both are done, and the fifth (the update's own time) overlaps it, so the
    /// five add up to more than the call took.
    pub phase_us: [u64; 5],
}

/// Encodes epochs of one guest with one codec; holds the reference state.
pub struct Encoder {
    pub(crate) codec: Codec,
    pub(crate) cfg: Config,
    pages: u64,
    pub(crate) prev: Option<PrevStore>,
    page_index: Option<PageIndex>,
    de: Option<[Buckets; 2]>,
    areas: Option<Buckets>,
    anchors: Option<crate::anchors::Index>,
    /// xxh3 of every page's blocks of `granule` bytes (FGBI: 64, tandem: 128).
    block_hashes: Vec<u64>,
    granule: usize,
    pub(crate) level: i32,
    /// Persistent worker threads (with `threads` > 1), reused every epoch.
    pub(crate) pool: Option<std::sync::Arc<rayon::ThreadPool>>,
    // Buffers reused across epochs (large allocations each epoch cost faults).
    pub(crate) buf: crate::record::Buffers,
    /// A record failed after the state had advanced past its epoch (phase 5 runs beside the
    /// compression): every later epoch is refused.
    diverged: bool,
    /// tandem: whether long run patches won the last trial that decided (trial.rs).
    long_patches: bool,
    /// tandem: most pages the next epoch's trial samples (trial.rs, `Trial::next_sample`).
    trial_sample: usize,
    /// tandem: whether the epochs use the reference prefix (trial.rs, `PrefixChoice`).
    prefix: crate::trial::PrefixChoice,
    /// tandem: whether word deltas won the last measurement that decided (words.rs).
    word_deltas: bool,
    /// The epoch's new block hashes (`PAGE / granule` per page), kept between epochs.
    block_new: Vec<u64>,
}

/// Guest memory from which [`hash_all`] splits the work over threads.
const HASH_SPLIT_BYTES: usize = 64 << 20;

/// The block hashes of every page of `base` into `out` (`PAGE / granule` per page). For GiBs
/// this takes seconds on one core, and on a primary a busy guest's writes meanwhile become
/// the first epoch, so large bases are split over up to four threads.
fn hash_all(base: &[u8], granule: usize, out: &mut [u64]) {
    let per = PAGE / granule;
    let hash = |b: &[u8], h: &mut [u64]| {
        for (p, h) in b.chunks_exact(PAGE).zip(h.chunks_exact_mut(per)) {
            block_hashes(p, granule, h);
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    if base.len() < HASH_SPLIT_BYTES || threads == 1 {
        return hash(base, out);
    }
    let chunk = (base.len() / PAGE).div_ceil(threads);
    std::thread::scope(|s| {
        for (b, h) in base.chunks(chunk * PAGE).zip(out.chunks_mut(chunk * per)) {
            s.spawn(move || hash(b, h));
        }
    });
}

fn block_hashes(page: &[u8], granule: usize, out: &mut [u64]) {
    for (h, b) in out.iter_mut().zip(page.chunks_exact(granule)) {
        *h = xxhash_rust::xxh3::xxh3_64(b);
    }
}

/// The page's content hash derived from its block hashes (one short hash instead of a second
/// pass over the page).
fn page_hash(blocks: &[u64]) -> u64 {
    let mut b = [0u8; 512];
    for (d, h) in b.chunks_exact_mut(8).zip(blocks) {
        d.copy_from_slice(&h.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&b[..blocks.len() * 8])
}

pub(crate) use crate::simd::diff_mask;

/// The level zstd runs at for `level`: within -7..=19, and 0 read as zstd's default, 3 (so
/// `EncodeStats::level` reports what ran).
fn effective_level(level: i32) -> i32 {
    match level.clamp(-7, 19) {
        0 => zstd::DEFAULT_COMPRESSION_LEVEL,
        l => l,
    }
}

impl Encoder {
    /// An encoder whose reference state starts from `base`, the guest memory both sides hold
    /// before epoch 1 (its length sets the guest size).
    pub fn new(codec: Codec, base: &[u8], cfg: Config) -> Result<Self, EncodeError> {
        if base.is_empty() || !base.len().is_multiple_of(PAGE) {
            return Err(EncodeError::Input(format!(
                "base image of {} bytes is not whole pages",
                base.len()
            )));
        }
        let pages = (base.len() / PAGE) as u64;
        let full = cfg.full_mirror || codec.full();
        let strategy = codec.strategy();
        let tandem = strategy == Codec::Tandem;
        let granule = match strategy {
            Codec::Fgbi | Codec::TandemV1 => 64,
            Codec::Tandem if cfg.budget.blocks => 128,
            _ => 0,
        };
        let hash_bytes = base.len().checked_div(granule).unwrap_or(0) * 8;
        // tandem's similarity tables (off by default) take at most a sixteenth of guest memory.
        let sim_bits = if tandem {
            let fit = (base.len() / 1024).max(1).ilog2();
            cfg.index_bits.min(fit)
        } else {
            cfg.index_bits
        };
        // tandem's whole state stays within a quarter of guest memory: the store gets what
        // the block hashes and indexes leave of it (and at most `cache_bytes`).
        let store_bytes = if tandem {
            let quarter = base.len() / 4;
            // Page index (~24 B per entry, 4 entries per stored page), anchors (1 MiB), slack,
            // the admission's clock per page, and the two similarity tables when they are on
            // (4 slots of 8 B per bucket). Below ~8 MiB of guest the store's floor of 64 pages
            // is more than the quarter.
            let similarity = if cfg.budget.similarity {
                2 * (32usize << sim_bits)
            } else {
                0
            };
            let index =
                4 * (cfg.cache_bytes / PAGE) * 24 + (2 << 20) + pages as usize * 4 + similarity;
            cfg.cache_bytes
                .min(quarter.saturating_sub(hash_bytes + index))
                .max(64 * PAGE)
        } else {
            cfg.cache_bytes
        };
        let lru = |bytes: usize| PrevStore::Lru(Box::new(Lru::new(bytes / PAGE)));
        let prev = match strategy {
            Codec::Remus | Codec::Zstd | Codec::Lz4 | Codec::Fgbi => None,
            _ if full => Some(PrevStore::Mirror(base.to_vec())),
            Codec::Xbzrle => Some(PrevStore::direct(cfg.cache_bytes)),
            Codec::Gerofi => Some(PrevStore::Lru(Box::new(Lru::new(cfg.rdp_pages)))),
            Codec::Tandem if cfg.budget.cold && cfg.budget.admission => Some(PrevStore::Lru(
                Box::new(Lru::tiered(store_bytes / PAGE, pages)),
            )),
            Codec::Tandem if cfg.budget.admission => Some(PrevStore::Lru(Box::new(
                Lru::scan_resistant(store_bytes / PAGE, pages),
            ))),
            _ => Some(lru(store_bytes)),
        };
        let shares = matches!(strategy, Codec::De | Codec::Tandem | Codec::TandemV1);
        let similar =
            matches!(strategy, Codec::De | Codec::TandemV1) || (tandem && cfg.budget.similarity);
        let mut e = Encoder {
            codec,
            cfg,
            pages,
            page_index: shares.then(|| PageIndex::new(4 * store_bytes / PAGE)),
            de: similar.then(|| [Buckets::new(sim_bits), Buckets::new(sim_bits)]),
            areas: (strategy == Codec::Gerofi).then(|| Buckets::new(cfg.index_bits)),
            anchors: (tandem && cfg.budget.anchors).then(|| crate::anchors::Index::new(17)),
            block_hashes: Vec::new(),
            granule,
            prev,
            level: 0,
            pool: None,
            buf: Default::default(),
            diverged: false,
            long_patches: false,
            word_deltas: false,
            block_new: Vec::new(),
            trial_sample: crate::trial::SAMPLE,
            prefix: Default::default(),
        };
        // The configured level acts as a later `set_level` would (the store's tier too).
        e.set_level(cfg.zstd_level);
        if cfg.threads > 1 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(cfg.threads)
                .thread_name(|i| format!("tandem-encode-{i}"))
                .build()
                .map_err(|e| EncodeError::Input(format!("starting encoder threads: {e}")))?;
            e.pool = Some(std::sync::Arc::new(pool));
        }
        if let Some(per) = PAGE.checked_div(granule) {
            e.block_hashes = vec![0; pages as usize * per];
            hash_all(base, granule, &mut e.block_hashes);
        }
        if full {
            // Index the base so identical and similar pages can be found from epoch 1.
            for (pfn, p) in base.chunks_exact(PAGE).enumerate() {
                if !st::is_zero(p) {
                    let h = e.hash_of(pfn as u64, p);
                    e.index_page(pfn as u64, p, h, None);
                }
            }
        }
        Ok(e)
    }

    /// The codec.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// The zstd level of the next records (tandem, fgbi, zstd1, xbzrle+zstd).
    pub fn level(&self) -> i32 {
        self.level
    }

    /// Sets the zstd level of the next records: lower (down to negative levels) costs less
    /// CPU per byte and sends more bytes. The decoder needs no notice. At
    /// [`crate::level::MIN`] and below (the encoder is the slower stage even at its fastest
    /// setting), tandem's store also stops compressing the pages it pushes out of its main
    /// list and holds pages raw in all of its bytes instead (state/switch.rs), and skips the
    /// anchor scan of every page (pages new to the store then go without other held pages in
    /// their prefix); it compresses again from two levels above (a level that moves by one
    /// around `MIN` does not switch the store back and forth). At negative levels, tandem
    /// skips the anchor scan of held pages (`Budget::held_anchors`). Level 0 is zstd's
    /// default, 3.
    pub fn set_level(&mut self, level: i32) {
        self.level = effective_level(level);
        if let Some(s) = self.prev.as_mut() {
            if self.level <= crate::level::MIN {
                s.set_compressing(false);
            } else if self.level >= crate::level::MIN + 2 {
                s.set_compressing(true);
            }
        }
    }

    /// Bytes of reference state held (stores, indexes, hashes).
    pub fn state_bytes(&self) -> usize {
        self.prev.as_ref().map_or(0, |p| p.bytes())
            + self.page_index.as_ref().map_or(0, |p| p.bytes())
            + self.de.as_ref().map_or(0, |d| d[0].bytes() + d[1].bytes())
            + self.areas.as_ref().map_or(0, |a| a.bytes())
            + self.anchors.as_ref().map_or(0, |a| a.bytes())
            + self.block_hashes.capacity() * 8
    }

    /// Working memory kept between epochs, apart from the reference state: the record's
    /// buffers (its reference prefix, payloads and output), the epoch's new block hashes and
    /// the compressed tier's staging (`Budget::cold`), all about the size of the largest
    /// epoch so far. Not counted: the zstd contexts, one per encoder thread for records and
    /// one for the compressed tier's pages (~2.5 MiB for a prefix frame at the automatic
    /// levels, −5 to 3; more at a high fixed `--zstd-level`).
    pub fn work_bytes(&self) -> usize {
        self.buf.bytes()
            + self.block_new.capacity() * 8
            + self.prev.as_ref().map_or(0, |p| p.work_bytes())
    }

    /// Content hash of a held page as the pre-pass computes it.
    fn hash_of(&self, pfn: u64, p: &[u8]) -> u64 {
        if self.granule > 0 && self.codec.strategy() == Codec::Tandem {
            let per = PAGE / self.granule;
            page_hash(&self.block_hashes[pfn as usize * per..(pfn as usize + 1) * per])
        } else {
            xxhash_rust::xxh3::xxh3_64(p)
        }
    }

    fn index_page(&mut self, pfn: u64, p: &[u8], hash: u64, de: Option<[u64; 2]>) {
        if let Some(ix) = self.page_index.as_mut() {
            ix.put(hash, pfn);
        }
        if let Some(t) = self.de.as_mut() {
            for (k, h) in de.unwrap_or_else(|| de_hashes(p)).into_iter().enumerate() {
                t[k].put(h, pfn << 8);
            }
        }
        if let Some(a) = self.areas.as_mut() {
            for (i, area) in p.chunks_exact(512).enumerate() {
                if !st::is_zero(area) {
                    a.put(popcount_hash(area) as u64, pfn << 8 | i as u64);
                }
            }
        }
    }

    fn par_map<T: Send, F: Fn(usize) -> T + Sync>(&self, n: usize, f: F) -> Vec<T> {
        crate::record::par_map(self.pool.as_deref(), self.cfg.min_pages_per_thread, n, f)
    }

    /// Encodes one epoch: `pfns` (strictly ascending) were written and now hold `data`.
    /// Appends the record to `out` and advances the reference state.
    pub fn encode(
        &mut self,
        epoch: u64,
        pfns: &[u64],
        data: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<EncodeStats, EncodeError> {
        if self.diverged {
            return Err(EncodeError::Diverged);
        }
        self.check_input(pfns, data)?;
        let mut phase = [0u64; 5];
        let mut t = std::time::Instant::now();
        let mut lap = |k: usize, t: &mut std::time::Instant| {
            phase[k] += t.elapsed().as_micros() as u64;
            *t = std::time::Instant::now();
        };
        // 1. Pre-pass (parallel): zero / unchanged / hashes / changed blocks. The store first
        // brings back the compressed previous versions of these pages.
        if let Some(s) = self.prev.as_mut() {
            s.promote(pfns, self.pool.as_deref());
        }
        let mut block_new = std::mem::take(&mut self.block_new);
        let mut pre = self.prepass(pfns, data, &mut block_new);
        lap(0, &mut t);
        // 2. Sequential: entry numbers, intra-epoch identical pages and blocks; tandem's trial
        // of its two ways for pages of which much changed.
        let block_refs = self.number_entries(data, &mut pre);
        let trial = self.trial(pfns, data, &pre)?;
        let words = self.measure_words(pfns, data, &pre)?;
        lap(1, &mut t);
        // 3. Parallel: encode every page that is not left out.
        let coded = self.code_pages(pfns, data, &pre, &block_refs);
        let word_pages = coded
            .iter()
            .flatten()
            .filter(|((_, body, _), _)| *body == crate::code::Body::Words)
            .count();
        lap(2, &mut t);
        // 4. The record laid out (the prefix copied out of the store), then compressed while
        // the state advances (5) beside it when the epoch is large enough for the pool.
        let laid = self.lay_out(pfns, data, &coded)?;
        let (plen, raw_len) = laid.lens();
        let start = out.len();
        let how = (self.codec, self.level, self.cfg.frame_bytes);
        let pool = self.pool.clone();
        let beside =
            crate::record::pool_for(pool.as_deref(), self.cfg.min_pages_per_thread, pfns.len());
        let mut buf = std::mem::take(&mut self.buf);
        let finish = |buf: &mut crate::record::Buffers, out: &mut Vec<u8>| {
            crate::record::finish(buf, laid, how, pool.as_deref(), epoch, out)
        };
        let r = match beside {
            Some(p) => {
                let (r, advance_us) = p.install(|| {
                    rayon::join(
                        || finish(&mut buf, out),
                        || {
                            let t = std::time::Instant::now();
                            self.advance(pfns, data, &pre, &block_new, &coded);
                            t.elapsed().as_micros() as u64
                        },
                    )
                });
                lap(3, &mut t);
                phase[4] = advance_us;
                // The state has moved past this epoch: without its record the decoder can no
                // longer follow.
                self.diverged = r.is_err();
                r
            }
            None => finish(&mut buf, out).inspect(|_| {
                lap(3, &mut t);
                self.advance(pfns, data, &pre, &block_new, &coded);
                lap(4, &mut t);
            }),
        };
        self.buf = buf;
        let tandem_prefix = self.codec.strategy() == Codec::Tandem && self.cfg.budget.prefix;
        let used_prefix = tandem_prefix && self.prefix.use_prefix();
        let mut prefix_check = None;
        if let (Ok((_, _, stored)), true) = (&r, tandem_prefix && self.cfg.budget.trial) {
            let t0 = std::time::Instant::now();
            prefix_check = self.check_prefix(used_prefix, (plen, raw_len), *stored);
            self.prefix.update(raw_len, prefix_check);
            phase[3] += t0.elapsed().as_micros() as u64;
        }
        // Kept for the next epoch, unless far larger than this one needed (a huge first one).
        let used = block_new.len();
        crate::record::keep(&mut block_new, used);
        self.block_new = block_new;
        let (entries, prefix_pages, _) = r?;
        Ok(EncodeStats {
            pages_in: pfns.len(),
            entries: entries as usize,
            bytes: out.len() - start,
            prefix_pages,
            level: self.level,
            trial,
            patch_limit: self.patch_limit(),
            long_patches: self.codec.strategy() == Codec::Tandem && self.long_patches,
            prefix_off: tandem_prefix && !used_prefix,
            prefix_check,
            words,
            word_deltas: word_pages > 0,
            phase_us: phase,
        })
    }

    /// Page numbers ascend, lie inside the guest and match the data.
    fn check_input(&self, pfns: &[u64], data: &[u8]) -> Result<(), EncodeError> {
        if data.len() != pfns.len() * PAGE {
            return Err(EncodeError::Input(format!(
                "{} pages but {} bytes of data",
                pfns.len(),
                data.len()
            )));
        }
        if !pfns.windows(2).all(|w| w[0] < w[1]) || pfns.last().is_some_and(|&p| p >= self.pages) {
            return Err(EncodeError::Input(format!(
                "page numbers must ascend and lie below {}",
                self.pages
            )));
        }
        Ok(())
    }
}

mod phases;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_block_hashes_equal_the_ones_of_one_thread() {
        let base = crate::test_bytes(0x5eed, HASH_SPLIT_BYTES + 3 * PAGE);
        let per = PAGE / 128;
        let mut split = vec![0u64; base.len() / PAGE * per];
        hash_all(&base, 128, &mut split);
        let mut one = vec![0u64; split.len()];
        for (p, h) in base.chunks_exact(PAGE).zip(one.chunks_exact_mut(per)) {
            block_hashes(p, 128, h);
        }
        assert!(split == one);
    }
}
