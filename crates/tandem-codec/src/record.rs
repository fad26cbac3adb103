//! Encoder phase 4: serialises the coded pages into one record (format.rs) and compresses its
//! data section, with the reference prefix (prefix.rs) where the strategy asked for one. Also
//! the encoder's fan-out over threads.

use crate::code::Body;
use crate::code::PageCode;
use crate::encoder::{Codec, Encoder};
use crate::format::{
    Header, FLAG_CODES_ZSTD, FLAG_COMPACT, FLAG_LZ4, FLAG_PREFIX, FLAG_SPLIT, FLAG_ZSTD, MAX_DATA,
    MAX_PREFIX_PAGES, PAGE,
};
use crate::prefix::MAX_FRAMES;
use crate::strategies::{Coded, Payload, Refs};
use crate::EncodeError;

/// Buffers an encoder reuses across epochs (its zstd contexts are per thread, `prefix::compress_frame`).
#[derive(Default)]
pub struct Buffers {
    ops: Vec<u8>,
    /// Reference prefix (previous versions, in list order) followed by the payloads.
    data: Vec<u8>,
    stored: Vec<u8>,
    prefix: Vec<u64>,
    codes: Vec<u8>,
    /// The page codes compressed (FLAG_CODES_ZSTD).
    zcodes: Vec<u8>,
    /// Run headers of the record's byte-run patches, sent after all payloads (FLAG_SPLIT).
    heads: Vec<u8>,
}

impl Buffers {
    /// Bytes these buffers hold (their capacity, kept for the next epoch).
    pub fn bytes(&self) -> usize {
        self.ops.capacity()
            + self.data.capacity()
            + self.stored.capacity()
            + self.prefix.capacity() * 8
            + self.codes.capacity()
            + self.zcodes.capacity()
            + self.heads.capacity()
    }
}

/// Fewest bytes of page codes worth trying to compress (a zstd frame costs ~10 bytes).
const CODES_ZSTD_MIN: usize = 256;

/// Fewest run-header bytes given a zstd frame of their own.
const HEAD_FRAME_MIN: usize = 512;

/// One zstd frame being built: its prefix pages (a range of the prefix list) and its
/// payload bytes (a range of the payload stream).
struct Cut {
    pages: std::ops::Range<usize>,
    data: std::ops::Range<usize>,
}

/// The encoder's persistent worker pool for `n` items, when it has one and every worker gets
/// at least `min_per_thread` of them (a small epoch stays on the calling thread: handing it
/// out costs more than encoding it).
pub(crate) fn pool_for(
    pool: Option<&rayon::ThreadPool>,
    min_per_thread: usize,
    n: usize,
) -> Option<&rayon::ThreadPool> {
    pool.filter(|_| n >= 2 * min_per_thread.max(1))
}

/// Maps `f` over `0..n` in order, on the worker pool when [`pool_for`] gives it.
pub fn par_map<T: Send, F: Fn(usize) -> T + Sync>(
    pool: Option<&rayon::ThreadPool>,
    min_per_thread: usize,
    n: usize,
    f: F,
) -> Vec<T> {
    use rayon::prelude::*;
    match pool_for(pool, min_per_thread, n) {
        Some(p) => p.install(|| {
            (0..n)
                .into_par_iter()
                .with_min_len(min_per_thread.max(1))
                .map(&f)
                .collect()
        }),
        None => (0..n).map(f).collect(),
    }
}

/// [`par_map`] over the `chunk`-byte chunks of `data`: `f(i, chunk i)` for each, in order,
/// each chunk written by one call only. Same rule for when the pool is used.
pub(crate) fn par_chunks_map<E: Send, T: Send, F: Fn(usize, &mut [E]) -> T + Sync>(
    pool: Option<&rayon::ThreadPool>,
    min_per_thread: usize,
    data: &mut [E],
    chunk: usize,
    f: F,
) -> Vec<T> {
    use rayon::prelude::*;
    let min = min_per_thread.max(1);
    match pool_for(pool, min, data.len() / chunk) {
        Some(p) => p.install(|| {
            data.par_chunks_mut(chunk)
                .enumerate()
                .with_min_len(min)
                .map(|(i, d)| f(i, d))
                .collect()
        }),
        None => data
            .chunks_mut(chunk)
            .enumerate()
            .map(|(i, d)| f(i, d))
            .collect(),
    }
}

/// Empties a working buffer that held `used` elements this epoch, keeping its allocation for
/// the next (a new one costs a page fault per page) unless it is far larger than that (more
/// than twice `used` and than 1 MiB).
pub(crate) fn keep<T>(buf: &mut Vec<T>, used: usize) {
    buf.clear();
    let floor = (1 << 20) / std::mem::size_of::<T>().max(1);
    if buf.capacity() > (2 * used).max(floor) {
        buf.shrink_to(used);
    }
}

/// A record laid out in the encoder's [`Buffers`] by [`Encoder::lay_out`], waiting for
/// [`finish`] to compress it.
pub(crate) struct Laid {
    /// Per entry: prefix pages and payload bytes up to and including it.
    marks: Vec<(usize, usize)>,
    /// Bytes of reference prefix at the start of `Buffers::data`.
    plen: usize,
    /// Bytes of run headers at the end of the payloads.
    heads: usize,
    /// Bytes of payloads and run headers.
    raw_len: usize,
    entries: u32,
}

impl Laid {
    /// Bytes of reference prefix, and of payloads and run headers.
    pub(crate) fn lens(&self) -> (usize, usize) {
        (self.plen, self.raw_len)
    }
}

impl Encoder {
    /// Phase 4, first half: serialises the coded pages in page order into the encoder's
    /// buffers, with the reference prefix copied out of the store (so the state may advance
    /// while [`finish`] compresses).
    pub(crate) fn lay_out(
        &mut self,
        pfns: &[u64],
        data: &[u8],
        coded: &[Option<(Coded, Refs)>],
    ) -> Result<Laid, EncodeError> {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let codec = self.codec;
        let b = &mut self.buf;
        b.ops.clear();
        b.codes.clear();
        b.data.clear();
        b.prefix.clear();
        b.heads.clear();
        // tandem sends its run patches' headers apart from their literals (format.rs).
        let split = codec == Codec::Tandem;
        // Every codec but tandem-v1 (kept as it was measured) gets the same container: compact
        // page codes, compressed when that pays.
        let compact = codec != Codec::TandemV1;
        // The prefix: previous versions of the pages asked for, in page order (each page's
        // own version then lies a roughly constant distance before its payload). `marks`:
        // per entry, prefix pages and payload bytes up to and including it.
        let mut marks = Vec::new();
        if let Some(prev) = self.prev.as_ref() {
            let mut seen = crate::state::FxMap::default();
            for (i, c) in coded.iter().enumerate() {
                let Some((_, r)) = c else { continue };
                let own = r.own.then_some(pfns[i]);
                for q in r.others.into_iter().flatten().chain(own) {
                    // The decoder refuses longer prefixes (format.rs): beyond the limit pages
                    // go without one (a huge epoch of a big guest).
                    if b.prefix.len() as u64 >= MAX_PREFIX_PAGES {
                        break;
                    }
                    if let (Some(old), None) = (prev.get(q), seen.insert(q, ())) {
                        b.prefix.push(q);
                        b.data.extend_from_slice(old);
                    }
                }
                marks.push((b.prefix.len(), 0));
            }
        }
        let plen = b.data.len();
        let mut prev_pfn = None;
        let mut entries = 0u32;
        for (i, c) in coded.iter().enumerate() {
            let Some(((base, body, payload), _)) = c else {
                continue;
            };
            let code = PageCode {
                pfn: pfns[i],
                base: *base,
                body: *body,
                len: payload.len() as u32,
            };
            code.write(prev_pfn, compact, &mut b.codes);
            match payload {
                Payload::Own(v) if split && *body == (Body::Runs { unit: 1 }) => {
                    crate::runs::split(v, &mut b.heads, &mut b.data)
                }
                Payload::Own(v) => b.data.extend_from_slice(v),
                Payload::Page => b.data.extend_from_slice(page(i)),
                Payload::Words => crate::words::encode(page(i), &mut b.data),
                Payload::Blocks(mask) => copy_blocks(page(i), *mask, &mut b.data),
            }
            if let Some(m) = marks.get_mut(entries as usize) {
                m.1 = b.data.len() - plen;
            }
            prev_pfn = Some(pfns[i]);
            entries += 1;
        }
        let heads = b.heads.len();
        if heads > 0 {
            b.data.extend_from_slice(&b.heads);
        }
        let raw_len = b.data.len() - plen;
        if raw_len > MAX_DATA as usize {
            return Err(EncodeError::Input(format!(
                "epoch data of {raw_len} bytes exceeds the record limit"
            )));
        }
        Ok(Laid {
            marks,
            plen,
            heads,
            raw_len,
            entries,
        })
    }
}

/// Appends the 64-byte blocks of `page` set in `mask`, in order: each run of adjacent blocks
/// in one copy.
fn copy_blocks(page: &[u8], mask: u64, out: &mut Vec<u8>) {
    let mut m = mask;
    while m != 0 {
        let start = m.trailing_zeros() as usize;
        // Ones from `start` on (64 when they reach the top).
        let run = (!(m >> start)).trailing_zeros() as usize;
        let end = start + run;
        out.extend_from_slice(&page[start * 64..end * 64]);
        m = if end >= 64 { 0 } else { m & (u64::MAX << end) };
    }
}

/// Phase 4, second half: compresses the record [`Encoder::lay_out`] left in `b` and appends
/// it to `out`; returns the number of entries, of prefix pages, and of bytes the data and the
/// frame table take (what the prefix's side costs when the check of trial.rs compares it
/// with one plain frame). It touches nothing but `b`, so it can run beside the state update.
pub(crate) fn finish(
    b: &mut Buffers,
    laid: Laid,
    (codec, level, frame_bytes): (Codec, i32, usize),
    pool: Option<&rayon::ThreadPool>,
    epoch: u64,
    out: &mut Vec<u8>,
) -> Result<(u32, usize, usize), EncodeError> {
    let Laid {
        marks,
        plen,
        heads,
        raw_len,
        entries,
    } = laid;
    let compact = codec != Codec::TandemV1;
    // Bytes of the frame table (its prefix page lists among them); none for a plain frame.
    let mut table = 0;
    // Enough run headers get a zstd frame of their own (their own entropy tables); fewer
    // would not pay for the frame's header and table entry.
    let head_frame = heads >= HEAD_FRAME_MIN;
    let mut flags = 0;
    match codec {
        // A record without prefix pages or a run-header frame is one plain zstd frame: no
        // frame table.
        Codec::Tandem if raw_len > 0 && (plen > 0 || head_frame) => {
            // Frames of about `frame_bytes` (prefix and payload), cut between entries; no
            // more than the decoder takes, and the run headers last (in the last frame or
            // in one of their own).
            let inline = raw_len - if head_frame { heads } else { 0 };
            let most = MAX_FRAMES as usize - 2;
            let step = frame_bytes.max(1).max((plen + inline).div_ceil(most));
            let mut cuts = Vec::new();
            let (mut p0, mut d0) = (0, 0);
            for &(p, d) in &marks {
                if (p - p0) * PAGE + (d - d0) >= step {
                    cuts.push(Cut {
                        pages: p0..p,
                        data: d0..d,
                    });
                    (p0, d0) = (p, d);
                }
            }
            if p0 < b.prefix.len() || d0 < inline || cuts.is_empty() {
                cuts.push(Cut {
                    pages: p0..b.prefix.len(),
                    data: d0..inline,
                });
            }
            if head_frame {
                let pages = b.prefix.len();
                cuts.push(Cut {
                    pages: pages..pages,
                    data: inline..raw_len,
                });
            }
            let frames = compress_frames(b, &cuts, plen, level, pool)?;
            let at = b.ops.len();
            crate::prefix::write_frames(&frames, compact, &mut b.ops);
            table = b.ops.len() - at;
            flags = FLAG_ZSTD | FLAG_PREFIX;
        }
        Codec::Zstd | Codec::Fgbi | Codec::XbzrleZstd | Codec::TandemV1 | Codec::Tandem
            if raw_len > 0 =>
        {
            let stored = &mut b.stored;
            crate::prefix::compress_alone(&b.data[plen..], level, stored)
                .map_err(EncodeError::Compress)?;
            if stored.len() < raw_len {
                flags = FLAG_ZSTD;
            }
        }
        Codec::Lz4 if raw_len > 0 => {
            let payload = &b.data[plen..];
            let stored = &mut b.stored;
            stored.clear();
            stored.resize(lz4_flex::block::get_maximum_output_size(raw_len), 0);
            let n = lz4_flex::block::compress_into(payload, stored)
                .map_err(|e| EncodeError::Input(e.to_string()))?;
            stored.truncate(n);
            flags = FLAG_LZ4;
        }
        _ => {}
    }
    if compact {
        flags |= FLAG_COMPACT;
    }
    if heads > 0 {
        flags |= FLAG_SPLIT;
        crate::runs::put_uleb(&mut b.ops, heads as u64);
    }
    // With a zstd pass, the page codes get one too when it makes them smaller (`compact`:
    // not tandem-v1).
    let mut packed = false;
    if flags & FLAG_ZSTD != 0 && compact && b.codes.len() >= CODES_ZSTD_MIN {
        crate::prefix::compress_alone(&b.codes, level, &mut b.zcodes)
            .map_err(EncodeError::Compress)?;
        packed = b.zcodes.len() + 4 < b.codes.len();
    }
    if packed {
        flags |= FLAG_CODES_ZSTD;
        crate::runs::put_uleb(&mut b.ops, b.codes.len() as u64);
        b.ops.extend_from_slice(&b.zcodes);
    } else {
        b.ops.extend_from_slice(&b.codes);
    }
    let payload = &b.data[plen..];
    let stored = &b.stored;
    let stored_data: &[u8] = if flags & (FLAG_ZSTD | FLAG_LZ4) == 0 {
        payload
    } else {
        stored
    };
    Header {
        version: crate::format::VERSION,
        flags,
        epoch,
        entries,
        ops_len: b.ops.len() as u32,
        data_stored_len: stored_data.len() as u32,
        data_raw_len: raw_len as u32,
        crc_ops: crc32c::crc32c(&b.ops),
        crc_data: crc32c::crc32c(stored_data),
    }
    .write(out);
    out.extend_from_slice(&b.ops);
    out.extend_from_slice(stored_data);
    Ok((entries, b.prefix.len(), stored_data.len() + table))
}

impl Buffers {
    /// The payloads and run headers of the record last laid out and finished (after `plen`
    /// bytes of prefix) compressed alone at `level`: what they take without the prefix.
    /// Returns the bytes. It overwrites the stored data, which [`finish`] has already copied
    /// into the record.
    pub(crate) fn without_prefix(&mut self, plen: usize, level: i32) -> std::io::Result<usize> {
        crate::prefix::compress_alone(&self.data[plen..], level, &mut self.stored)?;
        Ok(self.stored.len())
    }
}

/// Compresses each cut as one zstd frame with its prefix pages (on the worker pool, with the
/// same output for any thread count) into `b.stored`; returns the frame table.
fn compress_frames(
    b: &mut Buffers,
    cuts: &[Cut],
    plen: usize,
    level: i32,
    pool: Option<&rayon::ThreadPool>,
) -> Result<Vec<crate::prefix::FrameSpec>, EncodeError> {
    use rayon::prelude::*;
    let (prefix, payload) = b.data.split_at(plen);
    let part = |c: &Cut| {
        (
            &prefix[c.pages.start * PAGE..c.pages.end * PAGE],
            &payload[c.data.clone()],
        )
    };
    let mut outs: Vec<Vec<u8>> = vec![Vec::new(); cuts.len()];
    if cuts.len() == 1 {
        outs[0] = std::mem::take(&mut b.stored);
    }
    // Each thread compresses with its own reused context (`prefix::compress_frame`).
    let one = |(c, o): (&Cut, &mut Vec<u8>)| {
        let (p, d) = part(c);
        crate::prefix::compress_frame(p, d, level, o)
    };
    let r: std::io::Result<()> = match pool {
        Some(pool) if cuts.len() > 1 => {
            pool.install(|| cuts.par_iter().zip(outs.par_iter_mut()).try_for_each(one))
        }
        _ => cuts.iter().zip(outs.iter_mut()).try_for_each(one),
    };
    r.map_err(EncodeError::Compress)?;
    let frames = cuts
        .iter()
        .zip(&outs)
        .map(|(c, o)| crate::prefix::FrameSpec {
            pfns: b.prefix[c.pages.clone()].to_vec(),
            raw: c.data.len() as u64,
            stored: o.len() as u64,
        })
        .collect();
    if cuts.len() == 1 {
        b.stored = std::mem::take(&mut outs[0]);
    } else {
        b.stored.clear();
        for o in &outs {
            b.stored.extend_from_slice(o);
        }
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn copied_blocks_are_the_masks_blocks_in_order(mask: u64, seed: u64) {
            let page = crate::test_bytes(seed, PAGE);
            let mut out = vec![7u8; 3];
            copy_blocks(&page, mask, &mut out);
            let mut want = vec![7u8; 3];
            for b in (0..64).filter(|b| mask >> b & 1 == 1) {
                want.extend_from_slice(&page[b * 64..(b + 1) * 64]);
            }
            prop_assert_eq!(out, want);
        }
    }

    #[test]
    fn copied_blocks_at_both_ends() {
        let page = crate::test_bytes(1, PAGE);
        for mask in [u64::MAX, 1, 1 << 63, u64::MAX << 1, u64::MAX >> 1, 0] {
            let mut out = Vec::new();
            copy_blocks(&page, mask, &mut out);
            assert_eq!(out.len(), mask.count_ones() as usize * 64, "{mask:#x}");
        }
    }
}
