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

thread_local! {
    /// The XOR image and the compressed frame of the last delta this thread encoded: kept
    /// for the next epoch, as a new buffer of the device state's size costs its page faults
    /// (so about twice the largest device state, ≤ 2 × MAX_DEVICE_STATE, stays allocated on
    /// the thread that encodes epochs).
    static SCRATCH: std::cell::RefCell<(Vec<u8>, Vec<u8>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Encodes `cur` against `prev` into `out` (cleared first).
pub fn encode_delta(prev: &[u8], cur: &[u8], out: &mut Vec<u8>) {
    SCRATCH.with(|cell| {
        let (x, z) = &mut *cell.borrow_mut();
        x.clear();
        x.extend_from_slice(cur);
        xor_into(x, prev);
        out.clear();
        out.extend_from_slice(&(cur.len() as u32).to_le_bytes());
        // Level 1: this runs on the primary for every epoch, with the thread's reused zstd
        // context. An in-memory encode fails only on allocation, which aborts first.
        if tandem_codec::prefix::compress_alone(x, 1, z).is_ok() {
            out.extend_from_slice(z);
        }
    })
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
            proptest::prop_assert_eq!(decode_delta(&prev, &d).unwrap(), cur);
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
