//! Decoding: build and verify the complete plan (every new page's content) against the
//! untouched pre-epoch mirror, then commit it in one pass. A bad record changes nothing.

use crate::bodies::{decode_areas, decode_blocks};
use crate::code::{Base, Body, Method, PageCode};
use crate::format::{
    Header, FLAG_LZ4, FLAG_PREFIX, FLAG_ZSTD, HEADER_LEN, MAX_PAGE_PAYLOAD, MAX_PREFIX_PAGES,
    MIN_CODE_LEN, PAGE,
};
use crate::runs;
use crate::DecodeError;

/// A fully decoded epoch, not yet applied.
#[derive(Debug, Default, Clone)]
pub struct Plan {
    /// Epoch number of the record.
    pub epoch: u64,
    /// Pages written, ascending.
    pub pfns: Vec<u64>,
    /// New contents, one page per entry of `pfns`, when the record is not committed in place
    /// (on the one-pass path it stays empty and `commit` reads the decompressed section).
    pub data: Vec<u8>,
    /// Decompressed data section (after the reference prefix, if any), kept to reuse its
    /// allocation and, on the one-pass path, read by `commit`.
    scratch: Vec<u8>,
    /// The validated codes of a record committed in place (apply.rs); `None` when `data`
    /// holds every new page.
    inplace: Option<crate::apply::InPlace>,
    /// The data section put back in page order (FLAG_SPLIT records).
    joined: Vec<u8>,
    /// The decompressed page codes (FLAG_CODES_ZSTD records).
    codes: crate::format::CodesCache,
}

impl Plan {
    /// Writes every page into `mirror` (the whole guest memory, the same content `decode`
    /// was given). Cannot fail: `decode` checked everything.
    pub fn commit(&self, mirror: &mut [u8]) {
        if let Some(p) = &self.inplace {
            return crate::apply::commit(p, &self.scratch, mirror);
        }
        for (i, &pfn) in self.pfns.iter().enumerate() {
            let o = pfn as usize * PAGE;
            mirror[o..o + PAGE].copy_from_slice(&self.data[i * PAGE..(i + 1) * PAGE]);
        }
    }
}

pub(crate) fn bad(i: usize, what: impl Into<String>) -> DecodeError {
    DecodeError::Page {
        index: i,
        what: what.into(),
    }
}

/// Where bases and references resolve: the pre-epoch mirror.
pub(crate) struct DecodeCtx<'a> {
    pub(crate) mirror: &'a [u8],
    pub(crate) pages: u64,
}

impl DecodeCtx<'_> {
    fn push_base(&self, base: Base, i: usize, data: &mut Vec<u8>) -> Result<(), DecodeError> {
        match base {
            Base::Zero => data.resize(data.len() + PAGE, 0),
            Base::Mirror(p) => {
                if p >= self.pages {
                    let what = format!(
                        "references page {p} outside the guest's {} pages",
                        self.pages
                    );
                    return Err(bad(i, what));
                }
                data.extend_from_slice(&self.mirror[p as usize * PAGE..(p as usize + 1) * PAGE]);
            }
            Base::Epoch(j) => {
                if j as usize >= i {
                    return Err(bad(
                        i,
                        format!("references entry {j}, which is not earlier"),
                    ));
                }
                data.extend_from_within(j as usize * PAGE..(j as usize + 1) * PAGE);
            }
        }
        Ok(())
    }
}

/// Decodes `rec` against `mirror` (pre-epoch guest memory, `pages` × 4096 bytes) into `plan`.
///
/// Every length the record declares is checked against what it can hold before anything is
/// allocated from it: the entry count against the ops section, each payload against
/// [`MAX_PAGE_PAYLOAD`], the decoded data length against the sum of the payloads (and, in
/// [`Header::read`], against the compressor's largest expansion of the stored bytes).
pub fn decode(rec: &[u8], mirror: &[u8], plan: &mut Plan) -> Result<(), DecodeError> {
    let r = decode_into(rec, mirror, plan);
    if r.is_err() {
        // A refused record leaves a plan that commits nothing.
        plan.pfns.clear();
        plan.data.clear();
        plan.inplace = None;
    }
    r
}

/// The pre-epoch pages decoding `rec` may read, for a backup whose mirror holds only part
/// of guest memory (the rest consolidated elsewhere): every page written, every page used as
/// a base and every reference-prefix page, sorted and unique. `None` when a body may read
/// any page (Gerofi's areas and FGBI's blocks carry their references inside the compressed
/// payload): then the whole mirror must be present. Checks only the header and the ops
/// section; [`decode`] still verifies everything.
pub fn pages_read(rec: &[u8], pages: u64) -> Result<Option<Vec<u64>>, DecodeError> {
    pages_read_with(rec, pages, &mut Plan::default())
}

/// [`pages_read`], keeping the record's decompressed page codes in `plan`, so that
/// [`decode`] of the same record with the same plan does not decompress them again (what a
/// consolidated backup does on every epoch).
pub fn pages_read_with(
    rec: &[u8],
    pages: u64,
    plan: &mut Plan,
) -> Result<Option<Vec<u64>>, DecodeError> {
    let h = Header::read(rec)?;
    let ops = &rec[HEADER_LEN..HEADER_LEN + h.ops_len as usize];
    if crc32c::crc32c(ops) != h.crc_ops {
        return Err(DecodeError::Checksum("ops section"));
    }
    let mut pos = 0;
    let mut out = Vec::new();
    if h.flags & FLAG_PREFIX != 0 {
        let most = MAX_PREFIX_PAGES.min(4 * h.entries as u64);
        for f in crate::prefix::read_frames(ops, &mut pos, pages, most, compact(&h))
            .map_err(DecodeError::Malformed)?
        {
            out.extend(f.pfns);
        }
    }
    crate::split::split_len(&h, ops, &mut pos)?;
    for c in read_codes(
        &h,
        crate::format::codes_section(&h, &ops[pos..], &mut plan.codes)?,
        pages,
    )? {
        if matches!(c.body, Body::Areas | Body::Blocks(_)) {
            return Ok(None);
        }
        out.push(c.pfn);
        match c.base {
            Base::Mirror(p) if p < pages => out.push(p),
            _ => {}
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(Some(out))
}

fn decode_into(rec: &[u8], mirror: &[u8], plan: &mut Plan) -> Result<(), DecodeError> {
    let h = Header::read(rec)?;
    let pages = (mirror.len() / PAGE) as u64;
    let ops = &rec[HEADER_LEN..HEADER_LEN + h.ops_len as usize];
    let stored = &rec[HEADER_LEN + h.ops_len as usize..];
    if crc32c::crc32c(ops) != h.crc_ops {
        return Err(DecodeError::Checksum("ops section"));
    }
    if crc32c::crc32c(stored) != h.crc_data {
        return Err(DecodeError::Checksum("data section"));
    }
    let mut pos = 0;
    let frames = if h.flags & FLAG_PREFIX != 0 {
        let most = MAX_PREFIX_PAGES.min(4 * h.entries as u64);
        let f = crate::prefix::read_frames(ops, &mut pos, pages, most, compact(&h))
            .map_err(DecodeError::Malformed)?;
        let raw: u64 = f.iter().map(|f| f.raw).sum();
        let stored_sum: u64 = f.iter().map(|f| f.stored).sum();
        if raw != h.data_raw_len as u64 || stored_sum != stored.len() as u64 {
            return Err(DecodeError::Malformed(format!(
                "zstd frames of {raw} bytes ({stored_sum} stored), data section of {} ({})",
                h.data_raw_len,
                stored.len()
            )));
        }
        f
    } else {
        Vec::new()
    };
    let split = crate::split::split_len(&h, ops, &mut pos)?;
    let codes = read_codes(
        &h,
        crate::format::codes_section(&h, &ops[pos..], &mut plan.codes)?,
        pages,
    )?;
    plan.inplace = None;
    plan.epoch = h.epoch;
    let mut scratch = std::mem::take(&mut plan.scratch);
    let src = Source {
        stored,
        mirror,
        frames: &frames,
        split,
    };
    let r = if crate::apply::simple(&codes) {
        one_pass(&h, codes, &src, pages, plan, &mut scratch)
    } else {
        decode_with(&h, &codes, &src, pages, plan, &mut scratch)
    };
    plan.scratch = scratch;
    r
}

/// Whether the record's page codes and frame table are in their compact form.
fn compact(h: &Header) -> bool {
    h.flags & crate::format::FLAG_COMPACT != 0
}

/// Parses every page code (the ops section is stored as is) and checks that their payloads
/// add up to the declared decoded data length.
fn read_codes(h: &Header, ops: &[u8], pages: u64) -> Result<Vec<PageCode>, DecodeError> {
    let n = h.entries as usize;
    if (n as u64) > pages {
        return Err(DecodeError::Limit(format!(
            "{n} entries for a guest of {pages} pages"
        )));
    }
    let most = ops.len() / MIN_CODE_LEN;
    if n > most {
        return Err(DecodeError::Length {
            what: format!("page codes ({n} entries)"),
            declared: (n * MIN_CODE_LEN) as u64,
            max: ops.len() as u64,
        });
    }
    let mut codes = Vec::with_capacity(n);
    let (mut pos, mut prev) = (0usize, None);
    let mut total = 0u64;
    let compact = compact(h);
    for i in 0..n {
        let c = PageCode::read(ops, &mut pos, prev, compact).map_err(|e| bad(i, e))?;
        if c.body == Body::Words && (h.version < 6 || c.base != Base::Zero || c.len != PAGE as u32)
        {
            return Err(bad(
                i,
                "word deltas need format version 6, a zero base and one page of payload",
            ));
        }
        if c.pfn >= pages {
            return Err(bad(
                i,
                format!("page {} outside the guest's {pages} pages", c.pfn),
            ));
        }
        if c.len > MAX_PAGE_PAYLOAD {
            return Err(DecodeError::Length {
                what: format!("payload for entry {i}"),
                declared: c.len as u64,
                max: MAX_PAGE_PAYLOAD as u64,
            });
        }
        total += c.len as u64;
        prev = Some(c.pfn);
        codes.push(c);
    }
    if pos != ops.len() {
        return Err(DecodeError::Malformed(format!(
            "{} trailing bytes in the ops section",
            ops.len() - pos
        )));
    }
    let raw = h.data_raw_len as u64;
    if raw > total {
        return Err(DecodeError::Length {
            what: "decoded data".into(),
            declared: raw,
            max: total,
        });
    }
    if raw < total {
        return Err(DecodeError::Malformed(format!(
            "payloads add up to {total} bytes, data section has {raw}"
        )));
    }
    Ok(codes)
}

/// The one-pass path: decodes the data section into `scratch` and validates every code
/// (apply.rs); the new pages are written only by `commit`.
fn one_pass(
    h: &Header,
    codes: Vec<PageCode>,
    src: &Source<'_>,
    pages: u64,
    plan: &mut Plan,
    scratch: &mut Vec<u8>,
) -> Result<(), DecodeError> {
    let at = decompress(h, src, scratch)?;
    plan.pfns.clear();
    plan.pfns.extend(codes.iter().map(|c| c.pfn));
    plan.data.clear();
    let data = &scratch[at..at + h.data_raw_len as usize];
    let p = crate::apply::validate(codes, data, at, pages, src.split)?;
    plan.inplace = Some(p);
    Ok(())
}

/// Decodes the data section into `scratch` (copying it when stored uncompressed) in page
/// order (a FLAG_SPLIT section joined back); returns where it starts there (after the
/// reference prefix).
fn data_section(
    h: &Header,
    src: &Source<'_>,
    codes: &[PageCode],
    scratch: &mut Vec<u8>,
    joined: &mut Vec<u8>,
) -> Result<usize, DecodeError> {
    let at = decompress(h, src, scratch)?;
    if let Some(heads) = src.split {
        let raw = h.data_raw_len as usize;
        crate::split::join_section(&scratch[at..at + raw], heads, codes, joined)?;
        scratch[at..at + raw].copy_from_slice(joined);
    }
    Ok(at)
}

/// Decodes the data section into `scratch` as stored; returns where it starts there.
fn decompress(h: &Header, src: &Source<'_>, scratch: &mut Vec<u8>) -> Result<usize, DecodeError> {
    let raw_len = h.data_raw_len as usize;
    if !src.frames.is_empty() {
        return frames(src, raw_len, scratch);
    }
    scratch.clear();
    if h.flags & (FLAG_ZSTD | FLAG_LZ4) == 0 {
        scratch.extend_from_slice(src.stored);
        return Ok(0);
    }
    scratch.resize(raw_len, 0);
    let n = if h.flags & FLAG_ZSTD != 0 {
        crate::prefix::decompress(src.stored, &[], &mut scratch[..])
            .map_err(|e| DecodeError::Malformed(format!("data section zstd: {e}")))?
    } else {
        lz4_flex::block::decompress_into(src.stored, scratch)
            .map_err(|e| DecodeError::Malformed(format!("data section lz4: {e}")))?
    };
    if n != raw_len {
        return Err(DecodeError::Malformed(format!(
            "data section decodes to {n} bytes, header declares {raw_len}"
        )));
    }
    Ok(0)
}

/// Decodes the zstd frames of a prefixed data section behind the first frame's prefix in
/// `scratch` (so that frame sees one contiguous window); later frames decode with their own
/// prefix built aside. Returns where the payloads start. `scratch` keeps its largest length
/// across records (bytes past this record's data are never read): zeroing a megabyte of
/// it for every record that zstd then overwrites cost a tenth of the decode.
fn frames(src: &Source<'_>, raw_len: usize, scratch: &mut Vec<u8>) -> Result<usize, DecodeError> {
    let first = &src.frames[0];
    let plen = first.pfns.len() * PAGE;
    if scratch.len() < plen + raw_len {
        scratch.resize(plen + raw_len, 0);
    }
    crate::prefix::fill(src.mirror, &first.pfns, &mut scratch[..plen]);
    let (mut off, mut soff) = (plen, 0usize);
    let mut aside = Vec::new();
    for (k, f) in src.frames.iter().enumerate() {
        // `decode_into` checked that the lengths add up to the sections.
        let (raw, stored) = (f.raw as usize, f.stored as usize);
        let frame = &src.stored[soff..soff + stored];
        let n = if k == 0 {
            let (p, d) = scratch.split_at_mut(plen);
            crate::prefix::decompress(frame, p, &mut d[..raw])
        } else {
            aside.clear();
            crate::prefix::build(src.mirror, &f.pfns, &mut aside);
            crate::prefix::decompress(frame, &aside, &mut scratch[off..off + raw])
        }
        .map_err(|e| DecodeError::Malformed(format!("data section zstd frame {k}: {e}")))?;
        if n != raw {
            return Err(DecodeError::Malformed(format!(
                "zstd frame {k} decodes to {n} bytes, the frame table says {raw}"
            )));
        }
        off += raw;
        soff += stored;
    }
    Ok(plen)
}

/// What the data section decodes from.
struct Source<'a> {
    stored: &'a [u8],
    pub(crate) mirror: &'a [u8],
    /// With a reference prefix: the zstd frames (their prefix pages and lengths).
    frames: &'a [crate::prefix::FrameSpec],
    /// FLAG_SPLIT: bytes of run headers at the end of the decoded data.
    split: Option<usize>,
}

fn decode_with(
    h: &Header,
    codes: &[PageCode],
    src: &Source<'_>,
    pages: u64,
    plan: &mut Plan,
    scratch: &mut Vec<u8>,
) -> Result<(), DecodeError> {
    let mirror = src.mirror;
    let at = data_section(h, src, codes, scratch, &mut plan.joined)?;
    let data: &[u8] = &scratch[at..];
    let n = codes.len();
    plan.pfns.clear();
    plan.data.clear();
    plan.data.reserve(n * PAGE);
    let ctx = DecodeCtx { mirror, pages };
    let mut at = 0usize;
    let mut tmp = vec![0u8; PAGE];
    for (i, c) in codes.iter().enumerate() {
        let payload = &data[at..at + c.len as usize];
        at += c.len as usize;
        // Append the base (one copy; no separate zeroing pass over the plan).
        ctx.push_base(c.base, i, &mut plan.data)?;
        let (done, rest) = plan.data.split_at_mut(i * PAGE);
        let out = &mut rest[..PAGE];
        match c.body {
            Body::Same => {}
            Body::Runs { unit } => {
                if !runs::apply(payload, unit as usize, out) {
                    return Err(bad(i, "malformed run stream"));
                }
            }
            Body::Xor(m) => {
                // On a zero base the XOR image is the page itself: decode in place.
                let dst: &mut [u8] = if c.base == Base::Zero { out } else { &mut tmp };
                let ok = match m {
                    Method::Raw => {
                        payload.len() == PAGE && {
                            dst.copy_from_slice(payload);
                            true
                        }
                    }
                    Method::Lz4 => {
                        lz4_flex::block::decompress_into(payload, dst).ok() == Some(PAGE)
                    }
                    Method::Zstd => crate::prefix::decompress(payload, &[], dst) == Ok(PAGE),
                    Method::Wkdm => crate::wkdm::decompress(payload, dst),
                };
                if !ok {
                    return Err(bad(i, format!("{m:?} payload does not decode to one page")));
                }
                if c.base != Base::Zero {
                    for (o, t) in rest[..PAGE].iter_mut().zip(tmp.iter()) {
                        *o ^= t;
                    }
                }
            }
            Body::Blocks(mask) => decode_blocks(i, mask, payload, done, out)?,
            Body::RawBlocks(mask) => {
                // `read_codes` made the payload exactly one 64-byte block per mask bit.
                let mut blocks = payload.chunks_exact(64);
                for b in (0..64).filter(|b| mask & (1 << b) != 0) {
                    if let Some(src) = blocks.next() {
                        out[b * 64..(b + 1) * 64].copy_from_slice(src);
                    }
                }
            }
            Body::Areas => decode_areas(&ctx, i, payload, done, out)?,
            Body::Words => {
                // `read_codes` checked the zero base and the length.
                if !crate::words::decode(payload, out) {
                    return Err(bad(i, "word deltas are not one page long"));
                }
            }
        }
        plan.pfns.push(c.pfn);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DecodeError;

    fn record(
        flags: u16,
        entries: u32,
        codes: &[PageCode],
        stored: &[u8],
        raw_len: u32,
    ) -> Vec<u8> {
        let (mut ops, mut prev) = (Vec::new(), None);
        for c in codes {
            c.write(prev, flags & crate::format::FLAG_COMPACT != 0, &mut ops);
            prev = Some(c.pfn);
        }
        let h = Header {
            version: crate::format::VERSION,
            flags,
            epoch: 7,
            entries,
            ops_len: ops.len() as u32,
            data_stored_len: stored.len() as u32,
            data_raw_len: raw_len,
            crc_ops: crc32c::crc32c(&ops),
            crc_data: crc32c::crc32c(stored),
        };
        let mut out = Vec::new();
        h.write(&mut out);
        out.extend_from_slice(&ops);
        out.extend_from_slice(stored);
        out
    }

    fn raw_page(pfn: u64, len: u32) -> PageCode {
        PageCode {
            pfn,
            base: Base::Zero,
            body: Body::Xor(Method::Raw),
            len,
        }
    }

    /// Decodes `rec` against a 16-page mirror; the error and the scratch buffer it kept.
    fn refuse(rec: &[u8]) -> (DecodeError, usize) {
        let mirror = vec![0u8; 16 * PAGE];
        let mut plan = Plan::default();
        let e = decode(rec, &mirror, &mut plan).expect_err("must be refused");
        (e, plan.scratch.capacity().max(plan.data.capacity()))
    }

    #[test]
    fn a_small_record_declaring_a_huge_decoded_length_is_refused_before_allocating() {
        let page = vec![0x5au8; PAGE];
        let z = zstd::bulk::compress(&page, 1).unwrap_or_default();
        // The same record with the true length decodes.
        let ok = record(FLAG_ZSTD, 1, &[raw_page(3, PAGE as u32)], &z, PAGE as u32);
        let mut plan = Plan::default();
        let mut m = vec![0u8; 16 * PAGE];
        decode(&ok, &m, &mut plan).unwrap();
        plan.commit(&mut m);
        assert_eq!(&m[3 * PAGE..4 * PAGE], &page[..]);
        // ~100 bytes declaring 1 GiB of decoded data.
        let rec = record(FLAG_ZSTD, 1, &[raw_page(3, PAGE as u32)], &z, 1 << 30);
        assert!(rec.len() < 120, "{}", rec.len());
        let (e, kept) = refuse(&rec);
        assert!(
            matches!(&e, DecodeError::Length { declared, .. } if *declared == 1 << 30),
            "{e}"
        );
        assert_eq!(kept, 0, "nothing allocated from the declared length");
        // Within zstd's expansion of 19 bytes, but more than its one page code carries.
        let rec = record(FLAG_ZSTD, 1, &[raw_page(3, PAGE as u32)], &z, 500_000);
        let (e, kept) = refuse(&rec);
        assert!(
            matches!(&e, DecodeError::Length { declared, max, .. } if *declared == 500_000 && *max == PAGE as u64),
            "{e}"
        );
        assert_eq!(kept, 0);
    }

    #[test]
    fn a_page_payload_larger_than_any_encoding_is_refused() {
        // 16 KiB stored: zstd could expand that to 512 MiB, no page code can.
        let stored = vec![0x33u8; 16 << 10];
        let rec = record(FLAG_ZSTD, 1, &[raw_page(1, 1 << 29)], &stored, 1 << 29);
        let (e, kept) = refuse(&rec);
        assert!(
            matches!(&e, DecodeError::Length { what, declared, .. } if what.contains("entry 0") && *declared == 1 << 29),
            "{e}"
        );
        assert_eq!(kept, 0);
    }

    #[test]
    fn decoded_lengths_beyond_the_compressors_expansion_are_refused() {
        // Two raw pages (8 KiB) said to be LZ4 in 10 bytes: LZ4 cannot expand that far.
        let codes = [raw_page(1, PAGE as u32), raw_page(2, PAGE as u32)];
        let rec = record(FLAG_LZ4, 2, &codes, &[0x1f; 10], 2 * PAGE as u32);
        let (e, kept) = refuse(&rec);
        assert!(
            matches!(&e, DecodeError::Length { max, .. } if *max == 10 * crate::format::MAX_LZ4_RATIO),
            "{e}"
        );
        assert_eq!(kept, 0);
        // zstd: 1 stored byte cannot hold 64 KiB.
        let rec = record(FLAG_ZSTD, 1, &[raw_page(1, PAGE as u32)], &[0], 1 << 16);
        assert!(matches!(refuse(&rec).0, DecodeError::Length { .. }));
    }

    #[test]
    fn an_entry_count_beyond_the_ops_section_is_refused() {
        // 16 entries declared, one code present: refused before sizing anything by 16.
        let rec = record(0, 16, &[raw_page(1, PAGE as u32)], &[7; PAGE], PAGE as u32);
        let (e, _) = refuse(&rec);
        assert!(
            matches!(&e, DecodeError::Length { what, .. } if what.contains("16 entries")),
            "{e}"
        );
    }
}
