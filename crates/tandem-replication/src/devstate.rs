//! Device state on the link, as a delta against the previous epoch's.
//!
//! QEMU's device-state stream (≈600 KiB here, mostly unchanged between epochs) is XORed with
//! the previous epoch's stream and compressed with zstd, so unchanged bytes cost almost
//! nothing. The backup commits epochs strictly in order, so "previous" is always the device
//! state it committed last (empty before the first epoch).
//!
//! ```text
//! len u32 (little-endian, the new stream's length, ≤ MAX_DEVICE_STATE) | zstd frame of
//! (new[i] XOR previous[i]), previous read as zeros past its end
//! ```

/// Largest device state accepted.
pub const MAX_DEVICE_STATE: usize = 64 << 20;

/// Device-state delta errors.
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    /// Header missing or length over the limit.
    #[error("device-state delta header (length over {MAX_DEVICE_STATE} or truncated)")]
    Header,
    /// zstd could not decode, or the length does not match.
    #[error("device-state delta does not decompress to its declared length")]
    Body,
}

fn xor_into(out: &mut [u8], prev: &[u8]) {
    for (o, p) in out.iter_mut().zip(prev) {
        *o ^= p;
    }
}

/// Encodes `cur` against `prev` into `out` (cleared first).
pub fn encode_delta(prev: &[u8], cur: &[u8], out: &mut Vec<u8>) {
    encode_delta_into(&mut prev.to_vec(), cur, out);
}

/// [`encode_delta`] for the primary's every epoch: the XOR image is made in `prev`'s own
/// buffer, which then holds `cur` (the next epoch's previous state), so no buffer of the
/// device state's size is allocated or copied beyond that.
pub fn encode_delta_into(prev: &mut Vec<u8>, cur: &[u8], out: &mut Vec<u8>) {
    // previous read as zeros past its end
    prev.resize(cur.len(), 0);
    xor_into(prev, cur);
    // Level 1, with the thread's reused zstd context. An in-memory encode fails only on
    // allocation, which aborts first; an empty body would be refused by the backup.
    if tandem_codec::prefix::compress_alone(prev, 1, out).is_err() {
        out.clear();
    }
    out.splice(0..0, (cur.len() as u32).to_le_bytes());
    prev.copy_from_slice(cur);
}

/// Decodes a delta against `prev`.
pub fn decode_delta(prev: &[u8], delta: &[u8]) -> Result<Vec<u8>, DeviceStateError> {
    let len = delta
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .filter(|&l| l <= MAX_DEVICE_STATE)
        .ok_or(DeviceStateError::Header)?;
    let mut x = tandem_codec::prefix::decompress_alone(&delta[4..], len)
        .map_err(|_| DeviceStateError::Body)?;
    if x.len() != len {
        return Err(DeviceStateError::Body);
    }
    xor_into(&mut x, prev);
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn round_trip(prev in proptest::collection::vec(0u8..4, 0..3000),
                      cur in proptest::collection::vec(0u8..4, 0..3000)) {
            let mut d = Vec::new();
            encode_delta(&prev, &cur, &mut d);
            proptest::prop_assert_eq!(&decode_delta(&prev, &d).unwrap(), &cur);
            // In place, as the primary runs it: the same delta, and the buffer left at `cur`
            // (with a stale delta in `out` beforehand).
            let (mut kept, mut out) = (prev.clone(), vec![7u8; 5]);
            encode_delta_into(&mut kept, &cur, &mut out);
            proptest::prop_assert_eq!(&out, &d);
            proptest::prop_assert_eq!(kept, cur);
        }

        #[test]
        fn garbage_is_an_error_not_a_panic(prev in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..100),
                                           d in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let _ = decode_delta(&prev, &d);
        }
    }

    #[test]
    fn unchanged_state_is_tiny_and_limits_hold() {
        let s: Vec<u8> = (0..600_000).map(|i| (i * 7 % 251) as u8).collect();
        let mut d = Vec::new();
        encode_delta(&s, &s, &mut d);
        assert!(d.len() < 200, "{}", d.len());
        let mut huge = (MAX_DEVICE_STATE as u32 + 1).to_le_bytes().to_vec();
        huge.extend_from_slice(&d[4..]);
        assert!(matches!(
            decode_delta(&s, &huge),
            Err(DeviceStateError::Header)
        ));
        let mut short = ((s.len() + 1) as u32).to_le_bytes().to_vec();
        short.extend_from_slice(&d[4..]);
        assert!(matches!(
            decode_delta(&s, &short),
            Err(DeviceStateError::Body)
        ));
    }
}
