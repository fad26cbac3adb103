//! Device state on the link, as a delta against the previous epoch's.
//!
//! QEMU's device-state stream (≈600 KiB here with the ROM pages framed in, mostly unchanged
//! between epochs) goes as the bytes that changed since the previous epoch's stream: the
//! primary compares the two in blocks of [`BLOCK`] bytes and sends the changed runs, XORed
//! with what they replace, compressed with zstd. Unchanged bytes cost a comparison and
//! nothing on the link, on either side. The backup commits epochs strictly in order, so
//! "previous" is always the device state it committed last (empty before the first epoch).
//!
//! ```text
//! section 6, runs (written):  len u32 LE (≤ MAX_DEVICE_STATE)
//!                             zstd frame of:  n u32 LE
//!                                             n × (offset u32 LE, length u32 LE)  ascending,
//!                                                  disjoint, non-empty, within len
//!                                             the runs' bytes, new[i] XOR previous[i], in order
//! section 4, dense (read; what tandem sent before the runs, and what an older primary sends):
//!                             len u32 LE | zstd frame of (new[i] XOR previous[i]) for all i < len
//! ```
//!
//! In both, `previous` reads as zeros past its end; in the runs form, bytes outside the runs
//! are `previous`'s.

/// Largest device state accepted.
pub const MAX_DEVICE_STATE: usize = 64 << 20;

/// The comparison's granularity: changed runs are whole blocks (the last one may be short).
pub const BLOCK: usize = 64;

/// Device-state delta errors.
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    /// Header missing or length over the limit.
    #[error("device-state delta header (length over {MAX_DEVICE_STATE} or truncated)")]
    Header,
    /// zstd could not decode, or the length does not match.
    #[error("device-state delta does not decompress to its declared length")]
    Body,
    /// The runs are out of order, empty, or past the state's length.
    #[error("device-state delta's runs are out of order, empty or past its length")]
    Runs,
}

fn xor_into(out: &mut [u8], prev: &[u8]) {
    for (o, p) in out.iter_mut().zip(prev) {
        *o ^= p;
    }
}

/// Encodes `cur` against `prev` into `out` (cleared first) in the runs form (section 6).
pub fn encode_runs(prev: &[u8], cur: &[u8], out: &mut Vec<u8>) {
    encode_runs_into(&mut prev.to_vec(), cur, out);
}

/// Encodes `cur` against `prev` into `out` (cleared first) in the dense form (section 4), as
/// tandem did before the runs form: for tests, and inputs of an older primary.
pub fn encode_delta(prev: &[u8], cur: &[u8], out: &mut Vec<u8>) {
    let mut x = prev.to_vec();
    x.resize(cur.len(), 0);
    xor_into(&mut x, cur);
    // An in-memory encode fails only on allocation, which aborts first.
    if tandem_codec::prefix::compress_alone(&x, 1, out).is_err() {
        out.clear();
    }
    out.splice(0..0, (cur.len() as u32).to_le_bytes());
}

/// Whether `cur` differs from `prev` (zeros past its end) in `range`.
fn differs(prev: &[u8], cur: &[u8], range: std::ops::Range<usize>) -> bool {
    let kept = range.end.min(prev.len()).max(range.start);
    // `kept > start` only while `start` is inside `prev`.
    let both = kept > range.start && cur[range.start..kept] != prev[range.start..kept];
    both || cur[kept..range.end].iter().any(|&b| b != 0)
}

/// Blocks compared at once before the blocks inside are (most of a device state is
/// unchanged: one comparison skips a page of it).
const SPAN: usize = 64 * BLOCK;

/// The runs of whole blocks in which `cur` differs from `prev` (zeros past its end).
fn changed_runs(prev: &[u8], cur: &[u8]) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for span in (0..cur.len()).step_by(SPAN) {
        let span_end = (span + SPAN).min(cur.len());
        if !differs(prev, cur, span..span_end) {
            continue;
        }
        for at in (span..span_end).step_by(BLOCK) {
            let end = (at + BLOCK).min(span_end);
            if differs(prev, cur, at..end) {
                match runs.last_mut() {
                    Some((o, l)) if *o + *l == at => *l += end - at,
                    _ => runs.push((at, end - at)),
                }
            }
        }
    }
    runs
}

/// [`encode_runs`] for the primary's every epoch: `prev` (the previous epoch's state) is
/// brought up to `cur` in place, only where it changed, so no buffer of the device state's
/// size is allocated, compressed or copied.
pub fn encode_runs_into(prev: &mut Vec<u8>, cur: &[u8], out: &mut Vec<u8>) {
    let runs = changed_runs(prev, cur);
    let bytes: usize = runs.iter().map(|r| r.1).sum();
    let mut body = Vec::with_capacity(4 + 8 * runs.len() + bytes);
    body.extend_from_slice(&(runs.len() as u32).to_le_bytes());
    for &(o, l) in &runs {
        body.extend_from_slice(&(o as u32).to_le_bytes());
        body.extend_from_slice(&(l as u32).to_le_bytes());
    }
    prev.resize(cur.len(), 0);
    for &(o, l) in &runs {
        let at = body.len();
        body.extend_from_slice(&cur[o..o + l]);
        xor_into(&mut body[at..], &prev[o..o + l]);
        prev[o..o + l].copy_from_slice(&cur[o..o + l]);
    }
    // Level 1, with the thread's reused zstd context. An in-memory encode fails only on
    // allocation, which aborts first; an empty body would be refused by the backup.
    if tandem_codec::prefix::compress_alone(&body, 1, out).is_err() {
        out.clear();
    }
    out.splice(0..0, (cur.len() as u32).to_le_bytes());
}

/// The state's length from a delta's header (either form).
fn header(delta: &[u8]) -> Result<usize, DeviceStateError> {
    delta
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .filter(|&l| l <= MAX_DEVICE_STATE)
        .ok_or(DeviceStateError::Header)
}

/// Decodes a delta in the runs form (section 6) against `prev`.
pub fn decode_runs(prev: &[u8], delta: &[u8]) -> Result<Vec<u8>, DeviceStateError> {
    let len = header(delta)?;
    // Our encoder's runs are whole blocks: at most one per block.
    let cap = 4 + 8 * len.div_ceil(BLOCK) + len;
    let body = tandem_codec::prefix::decompress_alone(&delta[4..], cap)
        .map_err(|_| DeviceStateError::Body)?;
    let n = body
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or(DeviceStateError::Body)?;
    let table = body
        .get(4..4 + n.checked_mul(8).ok_or(DeviceStateError::Body)?)
        .ok_or(DeviceStateError::Body)?;
    let mut out = prev[..prev.len().min(len)].to_vec();
    out.resize(len, 0);
    let (mut data, mut end) = (&body[4 + table.len()..], 0usize);
    for e in table.chunks_exact(8) {
        let o = u32::from_le_bytes([e[0], e[1], e[2], e[3]]) as usize;
        let l = u32::from_le_bytes([e[4], e[5], e[6], e[7]]) as usize;
        if l == 0 || o < end || o + l > len {
            return Err(DeviceStateError::Runs);
        }
        let (run, rest) = data.split_at_checked(l).ok_or(DeviceStateError::Body)?;
        xor_into(&mut out[o..o + l], run);
        (data, end) = (rest, o + l);
    }
    if !data.is_empty() {
        return Err(DeviceStateError::Body);
    }
    Ok(out)
}

/// Decodes a delta in the dense form (section 4) against `prev`.
pub fn decode_delta(prev: &[u8], delta: &[u8]) -> Result<Vec<u8>, DeviceStateError> {
    decode_dense(prev, header(delta)?, &delta[4..])
}

/// The dense form: every byte XORed.
fn decode_dense(prev: &[u8], len: usize, body: &[u8]) -> Result<Vec<u8>, DeviceStateError> {
    let mut x =
        tandem_codec::prefix::decompress_alone(body, len).map_err(|_| DeviceStateError::Body)?;
    if x.len() != len {
        return Err(DeviceStateError::Body);
    }
    xor_into(&mut x, prev);
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::any;

    /// A runs delta of the given runs (`(offset, xor bytes)`) and trailing bytes, as a hostile
    /// primary could write it.
    fn runs_delta(len: u32, runs: &[(u32, &[u8])], trailing: &[u8]) -> Vec<u8> {
        let mut body = (runs.len() as u32).to_le_bytes().to_vec();
        for (o, b) in runs {
            body.extend_from_slice(&o.to_le_bytes());
            body.extend_from_slice(&(b.len() as u32).to_le_bytes());
        }
        for (_, b) in runs {
            body.extend_from_slice(b);
        }
        body.extend_from_slice(trailing);
        let mut out = Vec::new();
        tandem_codec::prefix::compress_alone(&body, 1, &mut out).unwrap();
        out.splice(0..0, len.to_le_bytes());
        out
    }

    proptest::proptest! {
        #[test]
        fn round_trip_of_a_few_changes(prev in vec(any::<u8>(), 0..5000),
                                       edits in vec((0usize..6000, any::<u8>()), 0..40),
                                       len in proptest::option::of(0usize..6000)) {
            let mut cur = prev.clone();
            if let Some(l) = len {
                cur.resize(l, 0);
            }
            for (at, b) in edits {
                if let Some(c) = cur.get_mut(at) {
                    *c = b;
                }
            }
            let (mut kept, mut out) = (prev.clone(), Vec::new());
            encode_runs_into(&mut kept, &cur, &mut out);
            proptest::prop_assert_eq!(&decode_runs(&prev, &out).unwrap(), &cur);
            proptest::prop_assert_eq!(&kept, &cur);
            let mut dense = Vec::new();
            encode_delta(&prev, &cur, &mut dense);
            proptest::prop_assert_eq!(&decode_delta(&prev, &dense).unwrap(), &cur);
        }

        #[test]
        fn round_trip(prev in vec(0u8..4, 0..3000), cur in vec(0u8..4, 0..3000)) {
            let mut d = Vec::new();
            encode_runs(&prev, &cur, &mut d);
            proptest::prop_assert_eq!(&decode_runs(&prev, &d).unwrap(), &cur);
            // In place, as the primary runs it: the same delta, and the buffer left at `cur`
            // (with a stale delta in `out` beforehand).
            let (mut kept, mut out) = (prev.clone(), vec![7u8; 5]);
            encode_runs_into(&mut kept, &cur, &mut out);
            proptest::prop_assert_eq!(&out, &d);
            proptest::prop_assert_eq!(kept, cur.clone());
            encode_delta(&prev, &cur, &mut d);
            proptest::prop_assert_eq!(&decode_delta(&prev, &d).unwrap(), &cur);
        }

        #[test]
        fn any_run_table_is_decoded_or_refused(prev in vec(any::<u8>(), 0..400),
                                               len in 0u32..400,
                                               runs in vec((0u32..450, vec(any::<u8>(), 0..80)), 0..6),
                                               trailing in vec(any::<u8>(), 0..3)) {
            let runs: Vec<(u32, &[u8])> = runs.iter().map(|(o, b)| (*o, &b[..])).collect();
            if let Ok(out) = decode_runs(&prev, &runs_delta(len, &runs, &trailing)) {
                proptest::prop_assert_eq!(out.len(), len as usize);
            }
        }

        #[test]
        fn garbage_is_an_error_not_a_panic(prev in vec(any::<u8>(), 0..100),
                                           d in vec(any::<u8>(), 0..200)) {
            let _ = decode_delta(&prev, &d);
            let _ = decode_runs(&prev, &d);
        }
    }

    #[test]
    fn runs_out_of_order_empty_or_past_the_end_are_refused() {
        let prev = vec![1u8; 300];
        let ok = runs_delta(300, &[(0, &[1, 2]), (64, &[3])], &[]);
        let mut want = prev.clone();
        (want[0], want[1], want[64]) = (0, 3, 2);
        assert_eq!(decode_runs(&prev, &ok).unwrap(), want);
        for (bad, what) in [
            (
                runs_delta(300, &[(64, &[1]), (0, &[2])], &[]),
                "out of order",
            ),
            (
                runs_delta(300, &[(0, &[1, 2]), (1, &[3])], &[]),
                "overlapping",
            ),
            (runs_delta(300, &[(10, &[])], &[]), "empty"),
            (runs_delta(300, &[(299, &[1, 2])], &[]), "past the end"),
        ] {
            assert!(
                matches!(decode_runs(&prev, &bad), Err(DeviceStateError::Runs)),
                "{what}"
            );
        }
        let trailing = runs_delta(300, &[(0, &[1])], &[9]);
        assert!(matches!(
            decode_runs(&prev, &trailing),
            Err(DeviceStateError::Body)
        ));
        let over = runs_delta(MAX_DEVICE_STATE as u32 + 1, &[], &[]);
        assert!(matches!(
            decode_runs(&prev, &over),
            Err(DeviceStateError::Header)
        ));
    }

    #[test]
    fn an_unchanged_rom_costs_nothing_on_the_link() {
        // 600 KB, of which 200 bytes change: the delta carries those blocks only.
        let prev: Vec<u8> = (0..600_000).map(|i| (i * 7 % 251) as u8).collect();
        let mut cur = prev.clone();
        for j in 0..200 {
            cur[(j * 104_729) % 600_000] ^= 0x5a;
        }
        let mut d = Vec::new();
        encode_runs(&prev, &cur, &mut d);
        assert!(d.len() < 200 * BLOCK / 2, "{}", d.len());
        assert_eq!(decode_runs(&prev, &d).unwrap(), cur);
    }

    #[test]
    fn unchanged_state_is_tiny_and_limits_hold() {
        let s: Vec<u8> = (0..600_000).map(|i| (i * 7 % 251) as u8).collect();
        for runs in [true, false] {
            let mut d = Vec::new();
            if runs {
                encode_runs(&s, &s, &mut d);
            } else {
                encode_delta(&s, &s, &mut d);
            }
            let decode = if runs { decode_runs } else { decode_delta };
            assert!(d.len() < 200, "{}", d.len());
            let mut huge = (MAX_DEVICE_STATE as u32 + 1).to_le_bytes().to_vec();
            huge.extend_from_slice(&d[4..]);
            assert!(matches!(decode(&s, &huge), Err(DeviceStateError::Header)));
            if !runs {
                let mut short = ((s.len() + 1) as u32).to_le_bytes().to_vec();
                short.extend_from_slice(&d[4..]);
                assert!(matches!(decode(&s, &short), Err(DeviceStateError::Body)));
            }
        }
    }
}
