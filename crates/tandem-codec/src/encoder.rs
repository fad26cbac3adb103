//! The encoder: reference state + one strategy per codec, parallel and deterministic.

use std::collections::HashMap;

use crate::code::PageCode;
use crate::format::{Header, FLAG_LZ4, FLAG_ZSTD, MAX_DATA, PAGE};
use crate::simhash::{de_hashes, popcount_hash, DE_BLOCKS};
use crate::state::{Buckets, FxMap, Lru, PageIndex, PrevStore};
use crate::strategies::{self as st, Budget, Coded, Ctx, Pre};
use crate::EncodeError;

/// The codecs: tandem's default and every baseline / paper technique alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Remus: every dirty page raw.
    Remus,
    /// QEMU XBZRLE: 64 MiB direct-mapped cache, XOR + zero/non-zero runs, zero pages.
    Xbzrle,
    /// zstd level 1 over the whole dirty pages.
    Zstd,
    /// LZ4 over the whole dirty pages.
    Lz4,
    /// FITDOC: 8-byte-word delta against an LRU buffer of previous versions.
    Fitdoc,
    /// FGBI: 64-byte block hashes, block sharing, hybrid compression.
    Fgbi,
    /// Gerofi et al.: popcount similarity of 512-byte areas over recently dirtied pages.
    Gerofi,
    /// Difference Engine: sharing, HashSimilarityDetector(2,1) patching, compression.
    De,
    /// tandem's default: combines the techniques within a CPU budget.
    Tandem,
}

impl Codec {
    /// All codecs, baselines first.
    pub const ALL: [Codec; 9] = [
        Codec::Remus,
        Codec::Xbzrle,
        Codec::Zstd,
        Codec::Lz4,
        Codec::Fitdoc,
        Codec::Fgbi,
        Codec::Gerofi,
        Codec::De,
        Codec::Tandem,
    ];

    /// Name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Remus => "remus",
            Codec::Xbzrle => "xbzrle",
            Codec::Zstd => "zstd1",
            Codec::Lz4 => "lz4",
            Codec::Fitdoc => "fitdoc",
            Codec::Fgbi => "fgbi",
            Codec::Gerofi => "gerofi",
            Codec::De => "de",
            Codec::Tandem => "tandem",
        }
    }
}

impl std::str::FromStr for Codec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Codec::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown codec {s:?}; known: {}",
                    Codec::ALL.map(|c| c.name()).join(", ")
                )
            })
    }
}

/// Encoder configuration.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Worker threads (output does not depend on it).
    pub threads: usize,
    /// Fewest pages per worker thread before an epoch is split across threads.
    pub min_pages_per_thread: usize,
    /// Bound of the previous-version store (XBZRLE cache, FITDOC buffer, DE and tandem store).
    pub cache_bytes: usize,
    /// Gerofi's recently-dirtied-pages cache, in pages.
    pub rdp_pages: usize,
    /// Bits of the similarity tables (Gerofi's content table, DE's two detector tables): 18 as
    /// in both papers.
    pub index_bits: u32,
    /// Keep every page's previous version (memory = guest size) instead of a bounded store.
    pub full_mirror: bool,
    /// tandem strategy knobs.
    pub budget: Budget,
    /// zstd level for data sections.
    pub zstd_level: i32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            threads: 1,
            min_pages_per_thread: 512,
            cache_bytes: 64 << 20,
            rdp_pages: 5120,
            index_bits: 18,
            full_mirror: false,
            budget: Budget::default(),
            zstd_level: 1,
        }
    }
}

/// What one `encode` call did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncodeStats {
    /// Dirty pages given.
    pub pages_in: usize,
    /// Pages in the record (the rest were written but unchanged).
    pub entries: usize,
    /// Record bytes.
    pub bytes: usize,
    /// Microseconds spent in: pre-pass, reference resolution, page encoding, serialisation and
    /// record compression, state update.
    pub phase_us: [u64; 5],
}

/// Encodes epochs of one guest with one codec; holds the reference state.
pub struct Encoder {
    codec: Codec,
    cfg: Config,
    pages: u64,
    prev: Option<PrevStore>,
    page_index: Option<PageIndex>,
    de: Option<[Buckets; 2]>,
    areas: Option<Buckets>,
    block_hashes: Vec<u64>,
    // Buffers reused across epochs (large allocations each epoch cost page faults).
    ops: Vec<u8>,
    payload: Vec<u8>,
    stored: Vec<u8>,
    zstd: Option<zstd::bulk::Compressor<'static>>,
}

fn block_hashes(page: &[u8], out: &mut [u64]) {
    for (h, b) in out.iter_mut().zip(page.chunks_exact(64)) {
        *h = xxhash_rust::xxh3::xxh3_64(b);
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
        let lru = |bytes: usize| PrevStore::Lru(Lru::new(bytes / PAGE));
        let prev = match codec {
            Codec::Remus | Codec::Zstd | Codec::Lz4 | Codec::Fgbi => None,
            _ if cfg.full_mirror => Some(PrevStore::Mirror(base.to_vec())),
            Codec::Xbzrle => Some(PrevStore::direct(cfg.cache_bytes)),
            Codec::Gerofi => Some(PrevStore::Lru(Lru::new(cfg.rdp_pages))),
            _ => Some(lru(cfg.cache_bytes)),
        };
        let shares = matches!(codec, Codec::De | Codec::Tandem);
        let mut e = Encoder {
            codec,
            cfg,
            pages,
            page_index: shares.then(|| PageIndex::new(4 * cfg.cache_bytes / PAGE)),
            de: shares.then(|| [Buckets::new(cfg.index_bits), Buckets::new(cfg.index_bits)]),
            areas: (codec == Codec::Gerofi).then(|| Buckets::new(cfg.index_bits)),
            block_hashes: Vec::new(),
            prev,
            ops: Vec::new(),
            payload: Vec::new(),
            stored: Vec::new(),
            zstd: None,
        };
        if codec == Codec::Fgbi || (codec == Codec::Tandem && cfg.budget.blocks) {
            e.block_hashes = vec![0; pages as usize * 64];
            for (p, h) in base
                .chunks_exact(PAGE)
                .zip(e.block_hashes.chunks_exact_mut(64))
            {
                block_hashes(p, h);
            }
        }
        if cfg.full_mirror {
            // Index the base so identical and similar pages can be found from epoch 1.
            for (pfn, p) in base.chunks_exact(PAGE).enumerate() {
                if !st::is_zero(p) {
                    e.index_page(pfn as u64, p, xxhash_rust::xxh3::xxh3_64(p), None);
                }
            }
        }
        Ok(e)
    }

    /// The codec.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// Bytes of reference state held (stores, indexes, hashes).
    pub fn state_bytes(&self) -> usize {
        self.prev.as_ref().map_or(0, |p| p.bytes())
            + self.page_index.as_ref().map_or(0, |p| p.bytes())
            + self.de.as_ref().map_or(0, |d| d[0].bytes() + d[1].bytes())
            + self.areas.as_ref().map_or(0, |a| a.bytes())
            + self.block_hashes.capacity() * 8
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
        // Spawning threads costs more than encoding a small epoch: fan out only when every
        // thread gets at least `min_pages_per_thread` pages.
        let threads = self
            .cfg
            .threads
            .max(1)
            .min(n / self.cfg.min_pages_per_thread.max(1))
            .max(1);
        if threads <= 1 {
            return (0..n).map(f).collect();
        }
        let per = n.div_ceil(threads);
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let f = &f;
                    s.spawn(move || (t * per..((t + 1) * per).min(n)).map(f).collect::<Vec<T>>())
                })
                .collect();
            hs.into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        })
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
        self.check_input(pfns, data)?;
        let mut phase = [0u64; 5];
        let mut t = std::time::Instant::now();
        let mut lap = |k: usize, t: &mut std::time::Instant| {
            phase[k] += t.elapsed().as_micros() as u64;
            *t = std::time::Instant::now();
        };
        // 1. Pre-pass (parallel): zero / unchanged / hashes / FGBI masks.
        let (mut pre, block_new) = self.prepass(pfns, data);
        lap(0, &mut t);
        // 2. Sequential: entry numbers, intra-epoch identical pages and blocks.
        let block_refs = self.number_entries(data, &mut pre);
        lap(1, &mut t);
        // 3. Parallel: encode every page that is not left out.
        let coded = self.code_pages(pfns, data, &pre, &block_refs);
        lap(2, &mut t);
        let start = out.len();
        let entries = self.write_record(epoch, pfns, data, &coded, out)?;
        drop(coded);
        lap(3, &mut t);
        self.advance(pfns, data, &pre, &block_new);
        lap(4, &mut t);
        Ok(EncodeStats {
            pages_in: pfns.len(),
            entries: entries as usize,
            bytes: out.len() - start,
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

    /// Phase 1, in parallel: which pages are zero or unchanged, their hashes, and (with block
    /// hashes) which 64-byte blocks changed. Returns the per-page facts and new block hashes.
    fn prepass(&self, pfns: &[u64], data: &[u8]) -> (Vec<Pre>, Vec<[u64; 64]>) {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let codec = self.codec;
        let hashing = matches!(codec, Codec::De | Codec::Tandem);
        let blocks_on = !self.block_hashes.is_empty();
        let prev = self.prev.as_ref();
        let bh = &self.block_hashes;
        let skips = !matches!(codec, Codec::Remus | Codec::Zstd | Codec::Lz4 | Codec::Fgbi);
        let mut pre: Vec<(Pre, [u64; 64])> = self.par_map(pfns.len(), |i| {
            let (pfn, p) = (pfns[i], page(i));
            let mut x = Pre {
                zero: st::is_zero(p),
                ..Default::default()
            };
            let mut h = [0u64; 64];
            if skips {
                x.unchanged = prev.and_then(|s| s.get(pfn)).is_some_and(|o| o == p);
            }
            if hashing {
                x.hash = xxhash_rust::xxh3::xxh3_64(p);
            }
            if blocks_on {
                block_hashes(p, &mut h);
                let old = &bh[pfn as usize * 64..pfn as usize * 64 + 64];
                x.mask = (0..64)
                    .filter(|&b| h[b] != old[b])
                    .fold(0, |m, b| m | 1 << b);
                x.unchanged |= x.mask == 0;
            }
            (x, h)
        });
        pre.drain(..).unzip()
    }

    /// Phase 2, sequential: numbers the entries (pages not left out), finds pages identical
    /// to an earlier page of this epoch (hash match, then byte-verified) and, for FGBI, blocks
    /// identical to a block of an earlier entry. Returns FGBI's block references per page.
    fn number_entries(&self, data: &[u8], pre: &mut [Pre]) -> Vec<Vec<(u8, u64)>> {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let codec = self.codec;
        let hashing = matches!(codec, Codec::De | Codec::Tandem);
        let n = pre.len();
        let mut entry = 0u32;
        let mut first: FxMap<u64, usize> = FxMap::default();
        let mut blocks: HashMap<&[u8], u64> = HashMap::new();
        let mut block_refs = vec![Vec::new(); if codec == Codec::Fgbi { n } else { 0 }];
        for i in 0..n {
            if pre[i].unchanged {
                continue;
            }
            pre[i].entry = entry;
            if hashing && !pre[i].zero {
                match first.get(&pre[i].hash) {
                    Some(&j) if page(j) == page(i) => pre[i].dup_of = Some(pre[j].entry),
                    Some(_) => {}
                    None => {
                        first.insert(pre[i].hash, i);
                    }
                }
            }
            if codec == Codec::Fgbi {
                // Blocks may reference blocks of earlier entries only (decoded before this one).
                let changed = (0..64).filter(|b| pre[i].mask & (1 << b) != 0);
                let mut mine = Vec::new();
                for b in changed {
                    let blk = &page(i)[b * 64..(b + 1) * 64];
                    if st::is_zero(blk) {
                        continue;
                    }
                    match blocks.get(blk) {
                        Some(&g) => block_refs[i].push((b as u8, g)),
                        None => mine.push((blk, entry as u64 * 64 + b as u64)),
                    }
                }
                for (blk, g) in mine {
                    blocks.entry(blk).or_insert(g);
                }
            }
            entry += 1;
        }
        block_refs
    }

    /// Phase 3, in parallel: each page that is not left out, coded by this codec's strategy.
    fn code_pages(
        &self,
        pfns: &[u64],
        data: &[u8],
        pre: &[Pre],
        block_refs: &[Vec<(u8, u64)>],
    ) -> Vec<Option<Coded>> {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let codec = self.codec;
        let ctx = Ctx {
            prev: self.prev.as_ref(),
            page_index: self.page_index.as_ref(),
            de: self.de.as_ref(),
            areas: self.areas.as_ref(),
            block_refs,
        };
        let budget = self.cfg.budget;
        self.par_map(pfns.len(), |i| {
            let (pfn, p, x) = (pfns[i], page(i), &pre[i]);
            if x.unchanged {
                return None;
            }
            Some(match codec {
                Codec::Remus | Codec::Zstd | Codec::Lz4 => st::raw(p),
                Codec::Xbzrle => st::xbzrle(&ctx, pfn, p, x),
                Codec::Fitdoc => st::fitdoc(&ctx, pfn, p),
                Codec::Fgbi => st::fgbi(&ctx, i, pfn, p, x),
                Codec::Gerofi => st::gerofi(&ctx, pfn, p, x),
                Codec::De => st::de(&ctx, p, x),
                Codec::Tandem => st::tandem(&ctx, pfn, p, x, &budget),
            })
        })
    }

    /// Phase 4: serialises the coded pages in page order, compresses the data section and
    /// appends the record; returns the number of entries.
    fn write_record(
        &mut self,
        epoch: u64,
        pfns: &[u64],
        data: &[u8],
        coded: &[Option<Coded>],
        out: &mut Vec<u8>,
    ) -> Result<u32, EncodeError> {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let codec = self.codec;
        // 4. Serialise in page order.
        let (ops, payload, stored) = (&mut self.ops, &mut self.payload, &mut self.stored);
        ops.clear();
        payload.clear();
        let mut prev_pfn = None;
        let mut entries = 0u32;
        for (i, c) in coded.iter().enumerate() {
            let Some((base, body, bytes)) = c else {
                continue;
            };
            let bytes: &[u8] = match bytes {
                st::Payload::Own(v) => v,
                st::Payload::Page => page(i),
            };
            let code = PageCode {
                pfn: pfns[i],
                base: *base,
                body: *body,
                len: bytes.len() as u32,
            };
            code.write(prev_pfn, ops);
            payload.extend_from_slice(bytes);
            prev_pfn = Some(pfns[i]);
            entries += 1;
        }
        if payload.len() > MAX_DATA as usize {
            return Err(EncodeError::Input(format!(
                "epoch data of {} bytes exceeds the record limit",
                payload.len()
            )));
        }
        let mut flags = 0;
        match codec {
            Codec::Zstd | Codec::Fgbi | Codec::Tandem if !payload.is_empty() => {
                let level = self.cfg.zstd_level;
                let z = match self.zstd.as_mut() {
                    Some(z) => z,
                    None => self
                        .zstd
                        .insert(zstd::bulk::Compressor::new(level).map_err(EncodeError::Compress)?),
                };
                stored.clear();
                stored.reserve(zstd::zstd_safe::compress_bound(payload.len()));
                z.compress_to_buffer(payload.as_slice(), stored)
                    .map_err(EncodeError::Compress)?;
                if stored.len() < payload.len() {
                    flags = FLAG_ZSTD;
                }
            }
            Codec::Lz4 if !payload.is_empty() => {
                stored.clear();
                stored.resize(lz4_flex::block::get_maximum_output_size(payload.len()), 0);
                let n = lz4_flex::block::compress_into(payload, stored)
                    .map_err(|e| EncodeError::Input(e.to_string()))?;
                stored.truncate(n);
                flags = FLAG_LZ4;
            }
            _ => {}
        }
        let stored_data: &[u8] = if flags == 0 { payload } else { stored };
        Header {
            flags,
            epoch,
            entries,
            ops_len: ops.len() as u32,
            data_stored_len: stored_data.len() as u32,
            data_raw_len: payload.len() as u32,
            crc_ops: crc32c::crc32c(ops),
            crc_data: crc32c::crc32c(stored_data),
        }
        .write(out);
        out.extend_from_slice(ops);
        out.extend_from_slice(stored_data);

        Ok(entries)
    }

    /// Phase 5: advances the reference state (previous versions, block hashes, indexes) to
    /// the post-epoch content.
    fn advance(&mut self, pfns: &[u64], data: &[u8], pre: &[Pre], block_new: &[[u64; 64]]) {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let n = pfns.len();
        let codec = self.codec;
        let hashing = matches!(codec, Codec::De | Codec::Tandem);
        let blocks_on = !self.block_hashes.is_empty();
        // 5. Advance the reference state to the post-epoch content.
        for i in 0..n {
            let (pfn, p) = (pfns[i], page(i));
            if pre[i].unchanged {
                continue;
            }
            if let Some(s) = self.prev.as_mut() {
                s.put(pfn, p);
            }
            if blocks_on {
                self.block_hashes[pfn as usize * 64..pfn as usize * 64 + 64]
                    .copy_from_slice(&block_new[i]);
            }
            if !pre[i].zero && (hashing || codec == Codec::Gerofi) {
                let de = blocks_on.then(|| DE_BLOCKS.map(|b| block_new[i][b]));
                self.index_page(pfn, p, pre[i].hash, de);
            }
        }
    }
}
