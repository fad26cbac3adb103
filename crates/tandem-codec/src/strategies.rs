//! Per-page encoders of each codec. Each is a pure function of the pre-epoch reference state
//! and the page, so pages encode in parallel with deterministic output.

use crate::code::{area, block, Base, Body, Method};
use crate::format::PAGE;
use crate::runs;
use crate::simhash::{de_hashes, popcount_hash};
use crate::state::{Buckets, PageIndex, PrevStore};

/// Facts computed for every page before encoding.
#[derive(Clone, Copy, Default)]
pub struct Pre {
    pub zero: bool,
    /// Content equals the held previous version: the page is left out of the record.
    pub unchanged: bool,
    pub hash: u64,
    /// 64-byte blocks that changed: FGBI and tandem from block hashes, tandem exactly (by
    /// comparison) when the previous version is held.
    pub mask: u64,
    /// Entry index (position among the pages that are not left out).
    pub entry: u32,
    /// Earlier entry with identical content (verified), if any.
    pub dup_of: Option<u32>,
}

/// What a tandem page wants from the record's reference prefix, and the anchors of its new
/// content (indexed once the epoch is encoded).
#[derive(Clone, Copy, Default)]
pub struct Refs {
    /// The page's own previous version.
    pub own: bool,
    /// Other held pages sharing content with it (found by anchors).
    pub others: [Option<u64>; 2],
    /// Anchors of the page's changed content.
    pub anchors: [u64; crate::anchors::MAX],
    /// How many of `anchors` are set.
    pub n: usize,
}

/// Read-only encoding context for one epoch.
pub struct EncodeCtx<'a> {
    /// Content-defined anchors of content sent earlier (tandem).
    pub anchors: Option<&'a crate::anchors::Index>,
    pub prev: Option<&'a PrevStore>,
    pub page_index: Option<&'a PageIndex>,
    pub de: Option<&'a [Buckets; 2]>,
    pub areas: Option<&'a Buckets>,
    /// FGBI: intra-epoch block sharing, per page: (block, earlier global block number).
    pub block_refs: &'a [Vec<(u8, u64)>],
}

/// A page's payload: its own bytes, or the page itself (raw pages, no copy).
pub enum Payload {
    /// Encoded bytes.
    Own(Vec<u8>),
    /// The page's new content verbatim.
    Page,
    /// The page's new content as word deltas (words.rs), written straight into the record.
    Words,
    /// The 64-byte blocks of the page's new content set in the mask, in order, copied
    /// straight into the record (`RawBlocks`).
    Blocks(u64),
}

impl Payload {
    /// Bytes of the payload.
    pub(crate) fn len(&self) -> usize {
        match self {
            Payload::Own(v) => v.len(),
            Payload::Page | Payload::Words => PAGE,
            Payload::Blocks(mask) => mask.count_ones() as usize * 64,
        }
    }
}

/// The encoded page: base, body, payload.
pub type Coded = (Base, Body, Payload);

pub fn is_zero(p: &[u8]) -> bool {
    crate::simd::is_zero(p)
}

pub fn raw(_new: &[u8]) -> Coded {
    (Base::Zero, Body::Xor(Method::Raw), Payload::Page)
}

fn runs_vs(base: Base, old: &[u8], new: &[u8], unit: usize, limit: usize) -> Option<Coded> {
    let mut out = Vec::new();
    runs::encode(old, new, unit, limit, &mut out)
        .map(|_| (base, Body::Runs { unit: unit as u8 }, Payload::Own(out)))
}

fn smaller(a: Option<Coded>, b: Option<Coded>) -> Option<Coded> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b.2.len() < a.2.len() { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// QEMU XBZRLE: zero page, else delta against the cached previous version, else raw.
pub fn xbzrle(c: &EncodeCtx<'_>, pfn: u64, new: &[u8], pre: &Pre) -> Coded {
    if pre.zero {
        return (Base::Zero, Body::Same, Payload::Own(Vec::new()));
    }
    match c.prev.and_then(|p| p.get(pfn)) {
        Some(old) => runs_vs(Base::Mirror(pfn), old, new, 1, PAGE).unwrap_or_else(|| raw(new)),
        None => raw(new),
    }
}

/// FITDOC: 8-byte-word delta against the buffered previous version, else the whole page.
pub fn fitdoc(c: &EncodeCtx<'_>, pfn: u64, new: &[u8]) -> Coded {
    match c.prev.and_then(|p| p.get(pfn)) {
        Some(old) => runs_vs(Base::Mirror(pfn), old, new, 8, PAGE).unwrap_or_else(|| raw(new)),
        None => raw(new),
    }
}

/// FGBI: only the 64-byte blocks whose hash changed, each shared / zero / sparse / WKdm / raw.
pub fn fgbi(c: &EncodeCtx<'_>, i: usize, pfn: u64, new: &[u8], pre: &Pre) -> Coded {
    let mut out = Vec::new();
    let refs: &[(u8, u64)] = c.block_refs.get(i).map_or(&[], |v| v.as_slice());
    for b in (0..64).filter(|b| pre.mask & (1 << b) != 0) {
        let blk = &new[b * 64..(b + 1) * 64];
        if let Some(&(_, r)) = refs.iter().find(|(rb, _)| *rb as usize == b) {
            out.push(block::EPOCH_REF);
            runs::put_uleb(&mut out, r);
            continue;
        }
        if is_zero(blk) {
            out.push(block::ZERO);
            continue;
        }
        let mut sparse = Vec::new();
        let s = runs::encode(&[0u8; 64], blk, 1, 62, &mut sparse);
        let wk = crate::wkdm::compress(blk);
        let best_alt = s.map(|l| l + 1).unwrap_or(usize::MAX).min(wk.len() + 1);
        if best_alt < 64 {
            if s.is_some() && sparse.len() <= wk.len() {
                out.push(block::SPARSE);
                runs::put_uleb(&mut out, sparse.len() as u64);
                out.extend_from_slice(&sparse);
            } else {
                out.push(block::WKDM);
                runs::put_uleb(&mut out, wk.len() as u64);
                out.extend_from_slice(&wk);
            }
        } else {
            out.push(block::RAW);
            out.extend_from_slice(blk);
        }
    }
    (Base::Mirror(pfn), Body::Blocks(pre.mask), Payload::Own(out))
}

/// Gerofi et al.: per 512-byte area, the most similar area among the recently dirtied pages
/// (content hash) and the page's own previous version (address), coded as runs of the
/// difference; zero and unmatched areas as such.
pub fn gerofi(c: &EncodeCtx<'_>, pfn: u64, new: &[u8], pre: &Pre) -> Coded {
    const A: usize = 512;
    if pre.zero {
        return (Base::Zero, Body::Same, Payload::Own(Vec::new()));
    }
    let own = c.prev.and_then(|p| p.get(pfn));
    let base = if own.is_some() {
        Base::Mirror(pfn)
    } else {
        Base::Zero
    };
    let mut out = Vec::new();
    for a in 0..PAGE / A {
        let na = &new[a * A..(a + 1) * A];
        let base_area: &[u8] = match own {
            Some(o) => &o[a * A..(a + 1) * A],
            None => &[0u8; A],
        };
        if na == base_area {
            out.push(area::SAME);
            continue;
        }
        if is_zero(na) {
            out.push(area::ZERO);
            continue;
        }
        let mut best: Option<(u64, u8, Vec<u8>)> = None;
        let mut consider = |q: u64, qa: usize, content: &[u8]| {
            let limit = best.as_ref().map(|b| b.2.len()).unwrap_or(A - 16);
            let mut d = Vec::new();
            if runs::encode(&content[qa * A..(qa + 1) * A], na, 1, limit, &mut d).is_some()
                && best.as_ref().is_none_or(|b| d.len() < b.2.len())
            {
                best = Some((q, qa as u8, d));
            }
        };
        if let Some(o) = own {
            consider(pfn, a, o);
        }
        if let (Some(idx), Some(prev)) = (c.areas, c.prev) {
            for v in idx.get(popcount_hash(na) as u64) {
                let (q, qa) = (v >> 8, (v & 0xff) as usize);
                if let Some(content) = prev.get(q) {
                    consider(q, qa, content);
                }
            }
        }
        match best {
            Some((q, qa, d)) => {
                out.push(area::DELTA);
                out.push(1);
                runs::put_uleb(&mut out, q);
                out.push(qa);
                runs::put_uleb(&mut out, d.len() as u64);
                out.extend_from_slice(&d);
            }
            None => {
                out.push(area::RAW);
                out.extend_from_slice(na);
            }
        }
    }
    (base, Body::Areas, Payload::Own(out))
}

/// Compressed literal page: the smaller of LZ4 and WKdm, or raw.
fn literal(new: &[u8]) -> Coded {
    let lz = lz4_flex::block::compress(new);
    let mut best = if lz.len() < PAGE {
        (Base::Zero, Body::Xor(Method::Lz4), Payload::Own(lz))
    } else {
        raw(new)
    };
    let wk = crate::wkdm::compress(new);
    if wk.len() < best.2.len() {
        best = (Base::Zero, Body::Xor(Method::Wkdm), Payload::Own(wk));
    }
    best
}

/// Identical page among held references (hash hint, byte-verified).
fn identical(c: &EncodeCtx<'_>, new: &[u8], pre: &Pre) -> Option<Coded> {
    let q = c.page_index?.get(pre.hash)?;
    (c.prev?.get(q)? == new).then(|| (Base::Mirror(q), Body::Same, Payload::Own(Vec::new())))
}

/// Held pages that HashSimilarityDetector(2,1) proposes for `new` (one per table).
fn de_candidates<'a>(
    c: &'a EncodeCtx<'_>,
    new: &[u8],
) -> impl Iterator<Item = (u64, &'a [u8])> + 'a {
    let hashes = de_hashes(new);
    c.de.into_iter()
        .zip(c.prev)
        .flat_map(move |(tables, prev)| {
            tables.iter().zip(hashes).filter_map(move |(t, h)| {
                let q = t.get(h).next()? >> 8;
                Some((q, prev.get(q)?))
            })
        })
}

/// Difference Engine: share identical pages, patch against a similar page found by
/// HashSimilarityDetector(2,1), else compress (LZ4 standing in for LZO, or WKdm).
pub fn de(c: &EncodeCtx<'_>, new: &[u8], pre: &Pre) -> Coded {
    if pre.zero {
        return (Base::Zero, Body::Same, Payload::Own(Vec::new()));
    }
    if let Some(j) = pre.dup_of {
        return (Base::Epoch(j), Body::Same, Payload::Own(Vec::new()));
    }
    if let Some(s) = identical(c, new, pre) {
        return s;
    }
    let mut best = Some(literal(new));
    for (q, r) in de_candidates(c, new) {
        let limit = best.as_ref().map(|b| b.2.len()).unwrap_or(PAGE);
        best = smaller(best, runs_vs(Base::Mirror(q), r, new, 1, limit));
        let x: Vec<u8> = r.iter().zip(new).map(|(a, b)| a ^ b).collect();
        let mut z = Vec::new();
        // An in-memory compression fails only on allocation; the candidate is then skipped.
        let ok = crate::prefix::compress_alone(&x, 1, &mut z).is_ok() && !z.is_empty();
        if ok && z.len() < best.as_ref().map(|b| b.2.len()).unwrap_or(PAGE) {
            best = Some((Base::Mirror(q), Body::Xor(Method::Zstd), Payload::Own(z)));
        }
    }
    best.unwrap_or_else(|| raw(new))
}

/// Changed 64-byte blocks only, raw and untagged: the record's zstd pass (with the
/// reference prefix) compresses them together.
fn blocks_only(pfn: u64, mask: u64) -> Coded {
    if mask == u64::MAX {
        return (Base::Zero, Body::Xor(Method::Raw), Payload::Page);
    }
    (
        Base::Mirror(pfn),
        Body::RawBlocks(mask),
        Payload::Blocks(mask),
    )
}

/// tandem's default. A page whose held previous version differs in a few bytes is a run
/// patch; otherwise its changed 64-byte blocks go raw into the record and the page's previous
/// version joins the record's reference prefix (prefix.rs), where the record's single zstd
/// pass finds the new bytes in the old ones, shifted or not. The second value says whether the
/// page's previous version is wanted in the prefix.
pub fn tandem(
    c: &EncodeCtx<'_>,
    pfn: u64,
    new: &[u8],
    pre: &Pre,
    budget: &Budget,
    long: bool,
    words: bool,
) -> (Coded, Refs) {
    let none = Refs::default();
    if pre.zero {
        return ((Base::Zero, Body::Same, Payload::Own(Vec::new())), none);
    }
    if let Some(j) = pre.dup_of {
        return ((Base::Epoch(j), Body::Same, Payload::Own(Vec::new())), none);
    }
    let old = c.prev.and_then(|p| p.get(pfn));
    if let Some(old) = old {
        let mut out = Vec::with_capacity(budget.good_enough.min(PAGE) + 32);
        if let Some(unit) = patch(old, new, pre.mask, budget, long, &mut out) {
            return (
                (Base::Mirror(pfn), Body::Runs { unit }, Payload::Own(out)),
                none,
            );
        }
    }
    if let Some(s) = identical(c, new, pre) {
        return (s, none);
    }
    let changed = if old.is_some() || budget.blocks {
        pre.mask
    } else {
        u64::MAX
    };
    let mut best = blocks_only(pfn, changed);
    let mut refs = Refs {
        own: old.is_some() && budget.prefix,
        ..none
    };
    // Pages without a held previous version (their content is new to the store: a fresh
    // page, or one written elsewhere first) and held pages of which much changed (content
    // moved in from elsewhere: a write-ahead log's copy of a database page, a B-tree split)
    // look up their anchors. A small edit of a held page has its previous version in the
    // prefix, and scanning it would cost a pass over its changed bytes for little.
    let scan = old.is_none() || changed.count_ones() as usize >= budget.held_anchors;
    if let Some(ix) = c.anchors.filter(|_| scan) {
        refs.n = crate::anchors::find(new, changed, &mut refs.anchors);
        if budget.prefix {
            // Held pages that share content with this one join the prefix.
            let mut k = 0;
            for &h in &refs.anchors[..refs.n] {
                let Some(q) = ix.get(h) else { continue };
                let held = c.prev.is_some_and(|p| p.get(q).is_some());
                if q != pfn && held && !refs.others.contains(&Some(q)) {
                    refs.others[k] = Some(q);
                    k += 1;
                    if k == refs.others.len() {
                        break;
                    }
                }
            }
        }
    }
    if refs.own {
        return (best, refs);
    }
    if budget.similarity && best.2.len() > budget.similar_above {
        for (q, r) in de_candidates(c, new) {
            let limit = best.2.len();
            if let Some(d) = runs_vs(Base::Mirror(q), r, new, 1, limit) {
                best = d;
            }
        }
    }
    // A page sent whole with nothing in the prefix to match it against: as word deltas when
    // this epoch's measurement chose them (words.rs).
    if words && refs.others.iter().all(Option::is_none) && matches!(best.2, Payload::Page) {
        best = (Base::Zero, Body::Words, Payload::Words);
    }
    (best, refs)
}

/// The run patch tandem sends for a held page (`mask`: its exactly changed 64-byte blocks)
/// under `budget`, written to `out`: a small one, or with `long` (the epoch's trial chose
/// them, trial.rs) one of up to [`crate::trial::LONG_PATCH`] bytes. Returns its unit (1 or
/// 8), or `None` (`out` left empty) when the page takes the prefix path.
pub fn patch(
    old: &[u8],
    new: &[u8],
    mask: u64,
    budget: &Budget,
    long: bool,
    out: &mut Vec<u8>,
) -> Option<u8> {
    let limit = if long {
        crate::trial::LONG_PATCH.max(budget.good_enough)
    } else {
        budget.good_enough
    };
    let gapped = runs::encode_masked(
        old,
        new,
        mask,
        budget.run_gap,
        limit,
        budget.regular_up_to,
        out,
    );
    if gapped.is_some() {
        return Some(1);
    }
    if budget.run_gap > 0 && long {
        // Runs joined across short gaps may cover the page where maximal runs still fit.
        if runs::encode_masked(old, new, mask, 0, limit, limit, out).is_some() {
            return Some(1);
        }
    } else if budget.run_gap > 0 && budget.regular_up_to > budget.good_enough {
        // Joining runs across short gaps turns a field changed in every element of an array
        // of 8-byte elements (2 bytes changed, 6 not) into one run over the whole page;
        // maximal runs keep it regular. Only a regular patch that repeats itself is taken (a
        // field set to one value in every element): below 128 bytes an irregular one would
        // have been under `good_enough` with the gaps joined, and where the changed bytes
        // differ from element to element the prefix path costs about the same (measured on
        // PostgreSQL's line pointers, docs/BENCHMARKS.md). `out` was left empty by the failed
        // scan and is reused.
        let repeating = runs::encode_masked_repeating(
            old,
            new,
            mask,
            128.min(budget.good_enough),
            budget.regular_up_to,
            out,
        );
        if repeating.is_some() {
            return Some(1);
        }
    }
    if budget.word_runs && runs::encode(old, new, 8, limit, out).is_some() {
        return Some(8);
    }
    None
}

/// CPU budget knobs of the tandem strategy.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// A page whose run patch against its previous version fits in this many bytes is sent
    /// as that patch (no prefix, no further search).
    pub good_enough: usize,
    /// ... or in this many bytes when it is regular: 16 runs or more, at least half of them
    /// repeating the previous run's header, at most 4 bytes per run (one short field changed
    /// in every element of an array; runs.rs, `encode_masked`).
    pub regular_up_to: usize,
    /// Run patches join replaced runs separated by at most this many unchanged bytes (0:
    /// maximal runs, as XBZRLE). A run header costs two bytes or more, and a field of which
    /// only some bytes changed (a pointer, a counter) stays one literal for zstd.
    pub run_gap: usize,
    /// Reference-prefix compression (prefix.rs): previous versions of the other changed pages
    /// become the zstd prefix of the record.
    pub prefix: bool,
    /// Content-defined anchors (anchors.rs) pick held pages sharing content with a page that
    /// has no held previous version, for the prefix.
    pub anchors: bool,
    /// ... and with a held page of which at least this many 64-byte blocks changed (above 64:
    /// none; the encoder also skips them at negative zstd levels, see `Encoder::set_level`).
    pub held_anchors: usize,
    /// Before coding an epoch, measure on a sample of its pages whether run patches of any
    /// length or the prefix path send fewer bytes for held pages of which much changed, and
    /// take the winner for the epoch (trial.rs); off: always the prefix path.
    pub trial: bool,
    /// Without a prefix reference: look for similar held pages (DE 2,1 index) ...
    pub similarity: bool,
    /// ... when the page codes into more than this many bytes.
    pub similar_above: usize,
    /// Also try FITDOC's 8-byte-word runs against the previous version (a second scan).
    pub word_runs: bool,
    /// Keep 64-bit hashes of every page's 128-byte blocks (1/16 of guest memory) so pages
    /// missing from the bounded store still send only their changed blocks.
    pub blocks: bool,
    /// A full store takes in a page that comes back after more pages than it holds only for a
    /// fixed sample of page numbers (state.rs, `Admission`), so a cycle larger than the store
    /// keeps part of itself held instead of none (plain LRU).
    pub admission: bool,
    /// A quarter of the store's bytes keep the pages pushed out of it as zstd frames
    /// (state/cold.rs), so a compressible cycle larger than the store stays held. Only with
    /// `admission`. Off by default: where it pays (memtouch's cycle) it halves the bytes but
    /// quarters the encoder's speed, below tandem-v1's; off, the store's bytes are all raw
    /// (docs/CODEC.md, "The compressed tier: an option, not the default").
    pub cold: bool,
    /// Measure per epoch whether pages sent whole compress smaller as word deltas (words.rs)
    /// and send them so for the epoch when they do.
    pub words: bool,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            good_enough: 512,
            regular_up_to: 3072,
            run_gap: 6,
            prefix: true,
            anchors: true,
            held_anchors: 16,
            trial: true,
            similarity: false,
            similar_above: 512,
            blocks: true,
            word_runs: false,
            admission: true,
            cold: false,
            words: true,
        }
    }
}

/// The previous default (`tandem-v1`, kept as a same-run reference): run patch against the
/// held version (stop at 64 bytes), identical held page, changed blocks from 64-byte block
/// hashes (tagged), patch against a similar held page (DE 2,1), LZ4 literal; no prefix.
pub fn tandem_v1(c: &EncodeCtx<'_>, pfn: u64, new: &[u8], pre: &Pre) -> Coded {
    const GOOD_ENOUGH: usize = 64;
    if pre.zero {
        return (Base::Zero, Body::Same, Payload::Own(Vec::new()));
    }
    if let Some(j) = pre.dup_of {
        return (Base::Epoch(j), Body::Same, Payload::Own(Vec::new()));
    }
    let mut best: Option<Coded> = None;
    if let Some(old) = c.prev.and_then(|p| p.get(pfn)) {
        best = runs_vs(Base::Mirror(pfn), old, new, 1, PAGE);
        if best.as_ref().is_some_and(|b| b.2.len() <= GOOD_ENOUGH) {
            return best.unwrap_or_else(|| raw(new));
        }
    }
    if let Some(s) = identical(c, new, pre) {
        return s;
    }
    if best.is_none() && pre.mask != u64::MAX {
        let mut out = Vec::with_capacity(pre.mask.count_ones() as usize * 65);
        for b in (0..64).filter(|b| pre.mask & (1 << b) != 0) {
            let blk = &new[b * 64..(b + 1) * 64];
            if is_zero(blk) {
                out.push(block::ZERO);
            } else {
                out.push(block::RAW);
                out.extend_from_slice(blk);
            }
        }
        best = Some((Base::Mirror(pfn), Body::Blocks(pre.mask), Payload::Own(out)));
        if best.as_ref().is_some_and(|b| b.2.len() <= GOOD_ENOUGH) {
            return best.unwrap_or_else(|| raw(new));
        }
    }
    if best.as_ref().is_none_or(|b| b.2.len() > 512) {
        for (q, r) in de_candidates(c, new) {
            let limit = best.as_ref().map(|b| b.2.len()).unwrap_or(PAGE);
            best = smaller(best, runs_vs(Base::Mirror(q), r, new, 1, limit));
        }
    }
    if best.as_ref().is_none_or(|b| b.2.len() > 1024) {
        let lz = lz4_flex::block::compress(new);
        if lz.len() < PAGE {
            best = smaller(
                best,
                Some((Base::Zero, Body::Xor(Method::Lz4), Payload::Own(lz))),
            );
        }
    }
    best.unwrap_or_else(|| raw(new))
}
