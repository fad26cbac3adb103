//! How much CPU the record's zstd pass spends, chosen per epoch from which stage is slower:
//! the encoder, or everything after it (link, backup's apply, acknowledgement). When the link
//! keeps up with the encoder, a lower (down to negative, "fast") level ships sooner; when the
//! link is the bottleneck, a higher level sends fewer bytes. The decoder needs no notice.

/// Lowest level chosen (zstd's negative levels trade ratio for speed).
pub const MIN: i32 = -5;
/// Highest level chosen.
pub const MAX: i32 = 3;

/// The level for the next epochs after an acknowledged epoch encoded at `level` in
/// `encode_us` and acknowledged `wait_us` after it was sent.
pub fn next(level: i32, encode_us: u64, wait_us: u64) -> i32 {
    let level = level.clamp(MIN, MAX);
    if encode_us > wait_us {
        // The encoder is the slower stage: spend less CPU per byte.
        (level - 1).max(MIN)
    } else if encode_us.saturating_mul(2) < wait_us {
        // The rest takes more than twice as long: the link is the bottleneck, fewer bytes pay.
        // (Between the two, the level holds: no see-saw around a balanced pipeline.)
        (level + 1).min(MAX)
    } else {
        level
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slower_stage_moves_the_level_within_bounds() {
        assert_eq!(next(1, 5_000, 2_000), 0);
        assert_eq!(next(MIN, 5_000, 2_000), MIN);
        assert_eq!(next(1, 1_000, 10_000), 2);
        assert_eq!(next(MAX, 1_000, 10_000), MAX);
        assert_eq!(next(1, 1_000, 1_900), 1);
        assert_eq!(next(19, 1_000, 3_000), MAX);
    }
}
