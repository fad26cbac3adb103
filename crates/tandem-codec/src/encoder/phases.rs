//! The phases of [`Encoder::encode`] after the input check: the pre-pass, entry numbering
//! and trials, page coding, and the state update; the record's layout and compression are
//! in record.rs.

use super::*;

impl Encoder {
    /// Phase 1, in parallel: which pages are zero or unchanged, their hashes, and which
    /// 64-byte blocks changed (by comparison with a held previous version, else from block
    /// hashes). Returns the per-page facts; writes the new block hashes into `hashes`
    /// (`PAGE / granule` per page, in the order of `pfns`).
    pub(super) fn prepass(&self, pfns: &[u64], data: &[u8], hashes: &mut Vec<u64>) -> Vec<Pre> {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let strategy = self.codec.strategy();
        let tandem = strategy == Codec::Tandem;
        let hashing = matches!(strategy, Codec::De | Codec::Tandem | Codec::TandemV1);
        let (granule, bh) = (self.granule, &self.block_hashes);
        let per = PAGE.checked_div(granule).unwrap_or(0);
        let prev = self.prev.as_ref();
        let skips = !matches!(
            strategy,
            Codec::Remus | Codec::Zstd | Codec::Lz4 | Codec::Fgbi
        );
        // `h`: the page's new block hashes (`per` of them), every one written below.
        let one = |i: usize, h: &mut [u64]| {
            let (pfn, p) = (pfns[i], page(i));
            let mut x = Pre {
                zero: st::is_zero(p),
                ..Default::default()
            };
            let old = if skips {
                prev.and_then(|s| s.get(pfn))
            } else {
                None
            };
            match old {
                Some(o) if tandem => {
                    x.mask = diff_mask(o, p);
                    x.unchanged = x.mask == 0;
                }
                Some(o) => x.unchanged = o == p,
                None => {}
            }
            if per > 0 {
                let stored = &bh[pfn as usize * per..(pfn as usize + 1) * per];
                let bits = (granule / 64) as u32;
                let all = if bits == 64 {
                    u64::MAX
                } else {
                    (1u64 << bits) - 1
                };
                match old {
                    Some(_) if tandem => {
                        // Held: the comparison found the changed blocks; hash only those.
                        for (g, hv) in h.iter_mut().enumerate() {
                            *hv = if x.mask >> (g as u32 * bits) & all != 0 {
                                xxhash_rust::xxh3::xxh3_64(&p[g * granule..(g + 1) * granule])
                            } else {
                                stored[g]
                            };
                        }
                    }
                    _ => {
                        block_hashes(p, granule, h);
                        x.mask = (0..per)
                            .filter(|&g| h[g] != stored[g])
                            .fold(0, |m, g| m | all << (g as u32 * bits));
                        x.unchanged |= x.mask == 0;
                    }
                }
            }
            if hashing && !x.unchanged && !x.zero {
                x.hash = if per > 0 && tandem {
                    page_hash(h)
                } else {
                    xxhash_rust::xxh3::xxh3_64(p)
                };
            }
            x
        };
        // One buffer for all pages' hashes, kept between epochs (a `[u64; 64]` per page
        // returned and then unzipped cost memheavy's encoder 6 % in zeroing and copying).
        hashes.clear();
        hashes.resize(pfns.len() * per, 0);
        if per == 0 {
            return self.par_map(pfns.len(), |i| one(i, &mut []));
        }
        let min = self.cfg.min_pages_per_thread;
        crate::record::par_chunks_map(self.pool.as_deref(), min, hashes, per, one)
    }

    /// Phase 2, sequential: numbers the entries (pages not left out), finds pages identical
    /// to an earlier page of this epoch (hash match, then byte-verified) and, for FGBI, blocks
    /// identical to a block of an earlier entry. Returns FGBI's block references per page.
    pub(super) fn number_entries(&self, data: &[u8], pre: &mut [Pre]) -> Vec<Vec<(u8, u64)>> {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let strategy = self.codec.strategy();
        let hashing = matches!(strategy, Codec::De | Codec::Tandem | Codec::TandemV1);
        let n = pre.len();
        let mut entry = 0u32;
        let mut first: FxMap<u64, usize> = FxMap::default();
        let mut blocks: HashMap<&[u8], u64> = HashMap::new();
        let mut block_refs = vec![Vec::new(); if strategy == Codec::Fgbi { n } else { 0 }];
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
            if strategy == Codec::Fgbi {
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

    /// tandem (with `Budget::trial`): measures its two ways on a sample of this epoch's pages
    /// and keeps the winner (trial.rs).
    pub(super) fn trial(
        &mut self,
        pfns: &[u64],
        data: &[u8],
        pre: &[Pre],
    ) -> Result<crate::Trial, EncodeError> {
        let Some(prev) = self.prev.as_ref() else {
            return Ok(Default::default());
        };
        if self.codec.strategy() != Codec::Tandem || !self.cfg.budget.trial {
            return Ok(Default::default());
        }
        let t = crate::trial::measure(
            prev,
            pfns,
            data,
            pre,
            &self.cfg.budget,
            self.level,
            self.trial_sample,
        )
        .map_err(EncodeError::Compress)?;
        let changed = t.runs_win().is_some_and(|w| w != self.long_patches);
        if let Some(w) = t.runs_win() {
            self.long_patches = w;
        }
        self.trial_sample = t.next_sample(changed);
        Ok(t)
    }

    /// tandem (with `Budget::trial`): after a record encoded with the reference prefix
    /// (`used`, `plen` bytes of it, `raw_len` bytes of payload whose data and frame table
    /// took `stored`), compresses its payload again without the prefix when a check is due
    /// (trial.rs, `PrefixChoice`); returns both sizes when it did: with the prefix its data
    /// and frame table (which lists the prefix pages), without it one plain frame. The record
    /// is already made: a failed check is no check.
    pub(super) fn check_prefix(
        &mut self,
        used: bool,
        (plen, raw_len): (usize, usize),
        stored: usize,
    ) -> Option<(usize, usize)> {
        if plen == 0 || !self.prefix.wants_check(used, raw_len) {
            return None;
        }
        let without = self.buf.without_prefix(plen, self.level).ok()?;
        Some((stored, without))
    }

    /// tandem (with `Budget::words`): measures whether this epoch's whole pages compress
    /// smaller as word deltas and keeps the answer when the sample decides (words.rs).
    pub(super) fn measure_words(
        &mut self,
        pfns: &[u64],
        data: &[u8],
        pre: &[Pre],
    ) -> Result<crate::words::Measured, EncodeError> {
        let Some(prev) = self.prev.as_ref() else {
            return Ok(Default::default());
        };
        if self.codec.strategy() != Codec::Tandem || !self.cfg.budget.words {
            return Ok(Default::default());
        }
        let blocks = self.cfg.budget.blocks;
        let m =
            crate::words::measure(prev, pfns, data, pre, blocks).map_err(EncodeError::Compress)?;
        if let Some(w) = m.deltas_win() {
            self.word_deltas = w;
        }
        Ok(m)
    }

    /// tandem: the largest run patch taken (the trial's choice); 0 for the other codecs.
    pub(super) fn patch_limit(&self) -> usize {
        match self.codec.strategy() {
            Codec::Tandem if self.long_patches => {
                crate::trial::LONG_PATCH.max(self.cfg.budget.good_enough)
            }
            Codec::Tandem => self.cfg.budget.good_enough,
            _ => 0,
        }
    }

    /// Phase 3, in parallel: each page that is not left out, coded by this codec's strategy,
    /// and whether its previous version is wanted in the record's reference prefix.
    pub(super) fn code_pages(
        &self,
        pfns: &[u64],
        data: &[u8],
        pre: &[Pre],
        block_refs: &[Vec<(u8, u64)>],
    ) -> Vec<Option<(Coded, Refs)>> {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let strategy = self.codec.strategy();
        let mut ctx = EncodeCtx {
            anchors: self.anchors.as_ref(),
            prev: self.prev.as_ref(),
            page_index: self.page_index.as_ref(),
            de: self.de.as_ref(),
            areas: self.areas.as_ref(),
            block_refs,
        };
        let mut budget = self.cfg.budget;
        // The last check found the reference prefix worth less than it costs (trial.rs).
        budget.prefix &= self.prefix.use_prefix();
        if self.level < 0 {
            // The encoder is the slower stage (level.rs): no anchor scan over held pages ...
            budget.held_anchors = usize::MAX;
        }
        if self.level <= crate::level::MIN {
            // ... and at its fastest setting none at all: on pages new to the store the scan
            // took a fifth of memheavy's encoding time, for at most 1.1 % of bytes (CODEC.md).
            ctx.anchors = None;
        }
        self.par_map(pfns.len(), |i| {
            let (pfn, p, x) = (pfns[i], page(i), &pre[i]);
            if x.unchanged {
                return None;
            }
            Some(match strategy {
                Codec::Tandem => st::tandem(
                    &ctx,
                    pfn,
                    p,
                    x,
                    &budget,
                    self.long_patches,
                    self.word_deltas,
                ),
                s => (
                    match s {
                        Codec::Xbzrle => st::xbzrle(&ctx, pfn, p, x),
                        Codec::Fitdoc => st::fitdoc(&ctx, pfn, p),
                        Codec::Fgbi => st::fgbi(&ctx, i, pfn, p, x),
                        Codec::Gerofi => st::gerofi(&ctx, pfn, p, x),
                        Codec::De => st::de(&ctx, p, x),
                        Codec::TandemV1 => st::tandem_v1(&ctx, pfn, p, x),
                        _ => st::raw(p),
                    },
                    Refs::default(),
                ),
            })
        })
    }

    /// Phase 5: advances the reference state (previous versions, block hashes, indexes) to
    /// the post-epoch content.
    pub(super) fn advance(
        &mut self,
        pfns: &[u64],
        data: &[u8],
        pre: &[Pre],
        block_new: &[u64],
        coded: &[Option<(Coded, Refs)>],
    ) {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let strategy = self.codec.strategy();
        let hashing = matches!(strategy, Codec::De | Codec::Tandem | Codec::TandemV1);
        let per = PAGE.checked_div(self.granule).unwrap_or(0);
        if let Some(s) = self.prev.as_mut() {
            let changed = (0..pfns.len()).filter(|&i| !pre[i].unchanged);
            s.put_batch(changed.map(|i| (pfns[i], page(i))));
        }
        for i in 0..pfns.len() {
            let (pfn, p) = (pfns[i], page(i));
            if pre[i].unchanged {
                continue;
            }
            if let (Some(ix), Some((_, r))) = (self.anchors.as_mut(), &coded[i]) {
                for &h in &r.anchors[..r.n] {
                    ix.put(h, pfn);
                }
            }
            if per > 0 {
                self.block_hashes[pfn as usize * per..(pfn as usize + 1) * per]
                    .copy_from_slice(&block_new[i * per..(i + 1) * per]);
            }
            if !pre[i].zero && (hashing || strategy == Codec::Gerofi) {
                let de = (per == 64).then(|| DE_BLOCKS.map(|b| block_new[i * per + b]));
                self.index_page(pfn, p, pre[i].hash, de);
            }
        }
        if let Some(s) = self.prev.as_mut() {
            s.settle(self.pool.as_deref());
        }
    }
}
