//! The one-pass path of decoding: records whose pages are all "simple" codes (same as a base,
//! run patches, raw blocks, raw pages: everything tandem's own strategy emits) are validated
//! completely at decode time without building the new pages, and [`Plan::commit`] then writes
//! them straight into the mirror. Only pages that another page of the same epoch uses as a
//! pre-epoch base are copied aside first (staged). A record with any other code takes the
//! general path (decoder.rs), which builds every new page before committing.
//!
//! The guarantee is the same on both paths: every check that can fail runs in `decode`; the
//! commit only copies and cannot fail, so a bad record changes nothing.

use crate::code::{Base, Body, Method, PageCode};
use crate::decoder::bad;
use crate::format::PAGE;
use crate::runs;
use crate::split::Piece;
use crate::DecodeError;

/// A validated record kept for an in-place commit.
#[derive(Debug, Default, Clone)]
pub(crate) struct InPlace {
    codes: Vec<PageCode>,
    /// Where each code's payload lies, from the start of the data section.
    offs: Vec<Piece>,
    /// Pages written this epoch that another entry reads as a pre-epoch base (sorted).
    stage: Vec<u64>,
    /// Where the data section starts in the plan's scratch buffer.
    data_at: usize,
    /// Where the run headers (FLAG_SPLIT) start and end in the scratch buffer.
    heads: std::ops::Range<usize>,
}

/// Whether every code can be applied in place.
pub(crate) fn simple(codes: &[PageCode]) -> bool {
    codes.iter().all(|c| {
        matches!(
            c.body,
            Body::Same
                | Body::Runs { .. }
                | Body::RawBlocks(_)
                | Body::Xor(Method::Raw)
                | Body::Words
        )
    })
}

/// Validates `codes` against the decoded data section `data` (which starts at `data_at` in
/// the plan's scratch buffer) and keeps them for [`commit`]. With `split` (FLAG_SPLIT: the
/// last `split` bytes of `data` are run headers), each 1-byte run patch is checked in its
/// split form, which `commit` applies as it is.
pub(crate) fn validate(
    codes: Vec<PageCode>,
    data: &[u8],
    data_at: usize,
    pages: u64,
    split: Option<usize>,
) -> Result<InPlace, DecodeError> {
    let (offs, heads_at) = crate::split::pieces(data, split, &codes)?;
    let mut stage = Vec::new();
    for (i, (c, p)) in codes.iter().zip(&offs).enumerate() {
        let payload = match *p {
            Piece::Whole(o) => Some(&data[o..o + c.len as usize]),
            Piece::Runs(..) => None,
        };
        match c.base {
            Base::Zero => {}
            Base::Mirror(q) if q >= pages => {
                return Err(bad(
                    i,
                    format!("references page {q} outside the guest's {pages} pages"),
                ))
            }
            Base::Mirror(q) => {
                // Another page's pre-epoch content: staged if this epoch overwrites it.
                if q != c.pfn && codes.binary_search_by_key(&q, |c| c.pfn).is_ok() {
                    stage.push(q);
                }
            }
            Base::Epoch(j) if j as usize >= i => {
                return Err(bad(
                    i,
                    format!("references entry {j}, which is not earlier"),
                ))
            }
            Base::Epoch(_) => {}
        }
        let ok = match (c.body, payload) {
            (_, None) | (Body::Same | Body::RawBlocks(_), _) => true,
            (Body::Runs { unit }, Some(p)) => runs::check(p, unit as usize, PAGE),
            (Body::Xor(_) | Body::Words, Some(p)) => p.len() == PAGE,
            _ => false,
        };
        if !ok {
            return Err(bad(i, format!("malformed {:?} payload", c.body)));
        }
    }
    stage.sort_unstable();
    stage.dedup();
    Ok(InPlace {
        codes,
        offs,
        stage,
        data_at,
        heads: data_at + heads_at..data_at + data.len(),
    })
}

/// Writes the validated record into `mirror`, in entry order.
pub(crate) fn commit(p: &InPlace, data: &[u8], mirror: &mut [u8]) {
    let span = |q: u64| q as usize * PAGE..(q as usize + 1) * PAGE;
    let mut staged = Vec::with_capacity(p.stage.len() * PAGE);
    for &q in &p.stage {
        staged.extend_from_slice(&mirror[span(q)]);
    }
    for (i, c) in p.codes.iter().enumerate() {
        let n = c.len as usize;
        let dst = span(c.pfn);
        // Base (in place when it is the page's own pre-epoch content).
        match c.base {
            Base::Zero => {
                if !matches!(c.body, Body::Xor(_) | Body::Words) {
                    mirror[dst.clone()].fill(0);
                }
            }
            Base::Mirror(q) if q == c.pfn => {}
            Base::Mirror(q) => match p.stage.binary_search(&q) {
                Ok(k) => mirror[dst.clone()].copy_from_slice(&staged[k * PAGE..(k + 1) * PAGE]),
                Err(_) => mirror.copy_within(span(q), dst.start),
            },
            Base::Epoch(j) => {
                // Entry j (< i) is already written in place.
                let src = span(p.codes[j as usize].pfn);
                mirror.copy_within(src, dst.start);
            }
        }
        let page = &mut mirror[dst];
        let payload = match p.offs[i] {
            Piece::Whole(o) => &data[p.data_at + o..p.data_at + o + n],
            Piece::Runs(lit, mut h) => {
                // Validated: it cannot fail.
                let heads = &data[p.heads.clone()];
                let mut lit = p.data_at + lit;
                let _ = runs::walk_split(heads, &mut h, data, &mut lit, n, PAGE, |at, _, l| {
                    page[at..at + l.len()].copy_from_slice(l)
                });
                continue;
            }
        };
        match c.body {
            Body::Runs { unit } => {
                runs::apply(payload, unit as usize, page);
            }
            Body::RawBlocks(mask) => {
                let mut blocks = payload.chunks_exact(64);
                for b in (0..64).filter(|b| mask & (1 << b) != 0) {
                    if let Some(src) = blocks.next() {
                        page[b * 64..(b + 1) * 64].copy_from_slice(src);
                    }
                }
            }
            Body::Xor(_) if c.base == Base::Zero => page.copy_from_slice(payload),
            // On a zero base (checked by `read_codes`), one page long (checked above).
            Body::Words => {
                crate::words::decode(payload, page);
            }
            Body::Xor(_) => {
                for (o, x) in page.iter_mut().zip(payload) {
                    *o ^= x;
                }
            }
            _ => {}
        }
    }
}
