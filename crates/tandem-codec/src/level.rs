//! How much CPU the record's zstd pass spends, chosen per epoch from which stage is slower:
//! the encoder, or everything after it (link, backup's apply, acknowledgement). When the link
//! keeps up with the encoder, a lower (down to negative, "fast") level ships sooner; when the
//! link is the bottleneck, a higher level sends fewer bytes. The decoder needs no notice.

/// Lowest level chosen (zstd's negative levels trade ratio for speed). Level 0 is never
/// chosen: zstd reads it as its default, level 3.
pub const MIN: i32 = -5;
/// Highest level chosen.
pub const MAX: i32 = 3;

/// The level for the next epochs after an acknowledged epoch encoded at `level` in
/// `encode_us` and acknowledged `wait_us` after it was sent.
pub fn next(level: i32, encode_us: u64, wait_us: u64) -> i32 {
    // zstd reads level 0 as its default, 3.
    let level = if level == 0 { 3 } else { level }.clamp(MIN, MAX);
    let step = if encode_us > wait_us {
        // The encoder is the slower stage: spend less CPU per byte.
        -1
    } else if encode_us.saturating_mul(2) < wait_us {
        // The rest takes more than twice as long: the link is the bottleneck, fewer bytes pay.
        // (Between the two, the level holds: no see-saw around a balanced pipeline.)
        1
    } else {
        0
    };
    match (level + step).clamp(MIN, MAX) {
        // Between 1 and -1 there is no level 0.
        0 => step,
        l => l,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slower_stage_moves_the_level_within_bounds() {
        assert_eq!(next(1, 5_000, 2_000), -1);
        assert_eq!(next(-1, 1_000, 10_000), 1);
        assert_eq!(next(0, 1_000, 1_900), 3, "level 0 is zstd's 3");
        assert_eq!(next(0, 5_000, 2_000), 2);
        assert_eq!(next(MIN, 5_000, 2_000), MIN);
        assert_eq!(next(1, 1_000, 10_000), 2);
        assert_eq!(next(MAX, 1_000, 10_000), MAX);
        assert_eq!(next(1, 1_000, 1_900), 1);
        assert_eq!(next(19, 1_000, 3_000), MAX);
    }
}
