//! FLAG_SPLIT records (format.rs): the run headers of every 1-byte run patch follow all
//! payloads, so zstd codes headers among headers and literals among literals. The encoder
//! splits (record.rs, `runs::split`); here the decoder reads the header region's length and,
//! for the plan path, puts the section back in page order.

use crate::code::{Body, PageCode};
use crate::decoder::bad;
use crate::format::{Header, FLAG_SPLIT, PAGE};
use crate::runs;
use crate::DecodeError;

/// Reads the run-header length of a FLAG_SPLIT record at `*pos` (after the frame table): 1
/// to the decoded data length.
pub(crate) fn split_len(
    h: &Header,
    ops: &[u8],
    pos: &mut usize,
) -> Result<Option<usize>, DecodeError> {
    if h.flags & FLAG_SPLIT == 0 {
        return Ok(None);
    }
    let n = runs::get_uleb(ops, pos)
        .ok_or_else(|| DecodeError::Malformed("run header length truncated".into()))?;
    if n == 0 || n > h.data_raw_len as u64 {
        return Err(DecodeError::Malformed(format!(
            "{n} bytes of run headers in a data section of {}",
            h.data_raw_len
        )));
    }
    Ok(Some(n as usize))
}

/// Where one code's payload lies in a decoded data section.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Piece {
    /// In one piece, from this offset.
    Whole(usize),
    /// A run patch of a FLAG_SPLIT record: its literals from the first offset, its headers
    /// from the second, counted from the start of the header region.
    Runs(usize, usize),
}

/// The payload of every code in `data` (a decoded data section), checked: with `split` (the
/// last `split` bytes are run headers) each 1-byte run patch is checked in its split form
/// (`runs::walk_split`), and the payloads and headers must use the section exactly. Returns
/// the pieces and where the header region starts.
pub(crate) fn pieces(
    data: &[u8],
    split: Option<usize>,
    codes: &[PageCode],
) -> Result<(Vec<Piece>, usize), DecodeError> {
    let (lits, heads) = data.split_at(data.len() - split.unwrap_or(0));
    let (mut at, mut h) = (0usize, 0usize);
    let mut out = Vec::with_capacity(codes.len());
    for (i, c) in codes.iter().enumerate() {
        let n = c.len as usize;
        if split.is_some() && c.body == (Body::Runs { unit: 1 }) {
            out.push(Piece::Runs(at, h));
            runs::walk_split(heads, &mut h, lits, &mut at, n, PAGE, |_, _, _| {})
                .map_err(|e| bad(i, e))?;
        } else {
            if n > lits.len() - at {
                return Err(bad(i, "payload past the end of the data"));
            }
            out.push(Piece::Whole(at));
            at += n;
        }
    }
    if at != lits.len() || h != heads.len() {
        return Err(DecodeError::Malformed(format!(
            "payloads use {at} of {} data bytes and {h} of {} run header bytes",
            lits.len(),
            heads.len()
        )));
    }
    Ok((out, lits.len()))
}

/// Puts a FLAG_SPLIT data section (`data`, ending with `heads` bytes of run headers) back in
/// page order: each 1-byte run patch gets its headers back between its literals, for the
/// plan path. (The one-pass path applies the split form as it is, apply.rs.)
pub(crate) fn join_section(
    data: &[u8],
    heads: usize,
    codes: &[PageCode],
    out: &mut Vec<u8>,
) -> Result<(), DecodeError> {
    let (pieces, hs) = pieces(data, Some(heads), codes)?;
    out.clear();
    out.reserve(data.len());
    for (c, p) in codes.iter().zip(pieces) {
        let n = c.len as usize;
        match p {
            Piece::Whole(o) => out.extend_from_slice(&data[o..o + n]),
            Piece::Runs(mut l, mut h) => {
                // Checked by `pieces`: it cannot fail.
                let _ = runs::join(&data[hs..], &mut h, &data[..hs], &mut l, n, out);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::code::{Base, Body, PageCode};
    use crate::format::{Header, FLAG_SPLIT, PAGE};
    use crate::runs::put_uleb;
    use crate::{decode, Plan};

    /// A FLAG_SPLIT record stored uncompressed: `n` run patches of `len` bytes each, run
    /// headers `heads` and literals `lits` (each as given, however wrong).
    /// With `lz4`, a last page coded as an LZ4 literal (its payload among the literals),
    /// which sends the record down the plan path.
    fn record(lens: &[u32], heads: &[u8], lits: &[u8], declared: u64) -> Vec<u8> {
        record_with(lens, heads, lits, declared, None)
    }

    fn record_with(
        lens: &[u32],
        heads: &[u8],
        lits: &[u8],
        declared: u64,
        lz4: Option<&[u8]>,
    ) -> Vec<u8> {
        let mut ops = Vec::new();
        put_uleb(&mut ops, declared);
        let mut prev = None;
        let mut codes: Vec<PageCode> = (0..lens.len())
            .map(|k| PageCode {
                pfn: k as u64,
                base: Base::Mirror(k as u64),
                body: Body::Runs { unit: 1 },
                len: lens[k],
            })
            .collect();
        if let Some(z) = lz4 {
            codes.push(PageCode {
                pfn: lens.len() as u64,
                base: Base::Zero,
                body: Body::Xor(crate::code::Method::Lz4),
                len: z.len() as u32,
            });
        }
        for c in &codes {
            c.write(prev, false, &mut ops);
            prev = Some(c.pfn);
        }
        let mut data = lits.to_vec();
        data.extend_from_slice(lz4.unwrap_or_default());
        data.extend_from_slice(heads);
        let h = Header {
            version: crate::format::VERSION,
            flags: FLAG_SPLIT,
            epoch: 1,
            entries: codes.len() as u32,
            ops_len: ops.len() as u32,
            data_stored_len: data.len() as u32,
            data_raw_len: data.len() as u32,
            crc_ops: crc32c::crc32c(&ops),
            crc_data: crc32c::crc32c(&data),
        };
        let mut out = Vec::new();
        h.write(&mut out);
        out.extend_from_slice(&ops);
        out.extend_from_slice(&data);
        out
    }

    #[test]
    fn a_split_record_applies_its_runs() {
        // Page 0: bytes 3..5 and 100; page 1: byte 4095.
        let mut heads = Vec::new();
        for (skip, n) in [(3u64, 2u64), (95, 1), (4095, 1)] {
            put_uleb(&mut heads, skip);
            put_uleb(&mut heads, n);
        }
        let lits = [1u8, 2, 3, 4];
        let rec = record(&[2 + 2 + 2 + 1, 3 + 1], &heads, &lits, heads.len() as u64);
        let mirror = vec![9u8; 4 * PAGE];
        let mut plan = Plan::default();
        decode(&rec, &mirror, &mut plan).unwrap();
        let mut m = mirror.clone();
        plan.commit(&mut m);
        assert_eq!(&m[3..5], &[1, 2]);
        assert_eq!(m[100], 3);
        assert_eq!(m[PAGE + 4095], 4);
        assert_eq!(m.iter().filter(|&&b| b != 9).count(), 4);
        // The same runs next to a composite body: the plan path joins the section first.
        let z = lz4_flex::block::compress(&[7u8; PAGE]);
        let rec = record_with(&[7, 4], &heads, &lits, heads.len() as u64, Some(&z));
        decode(&rec, &mirror, &mut plan).unwrap();
        let mut m2 = mirror.clone();
        plan.commit(&mut m2);
        assert_eq!(&m2[..2 * PAGE], &m[..2 * PAGE]);
        assert!(m2[2 * PAGE..3 * PAGE].iter().all(|&b| b == 7));
        // One header byte too few declared: refused.
        let rec = record_with(&[7, 4], &heads, &lits, heads.len() as u64 - 1, Some(&z));
        assert!(decode(&rec, &mirror, &mut plan).is_err());
    }

    #[test]
    fn split_needs_version_3_and_newer_versions_are_named() {
        let mut heads = Vec::new();
        put_uleb(&mut heads, 0);
        put_uleb(&mut heads, 1);
        let good = record(&[3], &heads, &[1], heads.len() as u64);
        let mirror = vec![0u8; 2 * PAGE];
        let mut plan = Plan::default();
        decode(&good, &mirror, &mut plan).unwrap();
        for (version, what) in [(2u16, "unknown flags"), (7, "version 7")] {
            let mut rec = good.clone();
            rec[8..10].copy_from_slice(&version.to_le_bytes());
            let crc = crc32c::crc32c(&rec[..48]);
            rec[48..52].copy_from_slice(&crc.to_le_bytes());
            let e = decode(&rec, &mirror, &mut plan).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
    }

    proptest::proptest! {
        /// Arbitrary header regions, literals, lengths and declared header lengths: decoded
        /// or refused, never a panic, and a refused record changes nothing.
        #[test]
        fn arbitrary_split_records_never_panic(
            lens in proptest::collection::vec(0u32..40, 1..4),
            heads in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..24),
            lits in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80),
            declared in 0u64..120,
        ) {
            let rec = record(&lens, &heads, &lits, declared);
            let mirror = vec![5u8; 4 * PAGE];
            let mut plan = Plan::default();
            let mut m = mirror.clone();
            if decode(&rec, &mirror, &mut plan).is_ok() {
                plan.commit(&mut m);
            } else {
                plan.commit(&mut m);
                proptest::prop_assert!(m == mirror);
            }
        }
    }
}
