//! The encoder's page scans, vectorised: which 64-byte blocks of a page changed, and whether a
//! page is all zero. AVX2 when the CPU has it (detected at run time, once), else the portable
//! code, which the compiler vectorises with SSE2 (every x86-64 has it) or the target's own.

/// Bit b set when 64-byte block b of `old` and `new` differ (both one 4 KiB page).
pub fn diff_mask(old: &[u8], new: &[u8]) -> u64 {
    assert!(old.len() == 4096 && new.len() == 4096);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above), the only requirement of calling a
        // function compiled for it.
        return unsafe { avx2::diff_mask(old, new) };
    }
    diff_mask_portable(old, new)
}

/// Whether every byte of `p` is zero.
pub fn is_zero(p: &[u8]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if p.len().is_multiple_of(128) && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: as in `diff_mask`: AVX2 is present.
        return unsafe { avx2::is_zero(p) };
    }
    is_zero_portable(p)
}

fn diff_mask_portable(old: &[u8], new: &[u8]) -> u64 {
    let mut m = 0u64;
    for (b, (o, n)) in old.chunks_exact(64).zip(new.chunks_exact(64)).enumerate() {
        // Eight words XOR-ed and OR-ed: the compiler vectorises this (SSE2 on any x86-64).
        let mut x = 0u64;
        for (a, c) in o.chunks_exact(8).zip(n.chunks_exact(8)) {
            x |= u64::from_le_bytes(a.try_into().unwrap_or_default())
                ^ u64::from_le_bytes(c.try_into().unwrap_or_default());
        }
        m |= ((x != 0) as u64) << b;
    }
    m
}

fn is_zero_portable(p: &[u8]) -> bool {
    p.chunks_exact(16)
        .all(|c| u128::from_le_bytes(c.try_into().unwrap_or_default()) == 0)
        && p.chunks_exact(16).remainder().iter().all(|&b| b == 0)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_or_si256, _mm256_testz_si256, _mm256_xor_si256,
    };

    /// 32 bytes at `p[at..at + 32]`.
    #[target_feature(enable = "avx2")]
    fn load(p: &[u8], at: usize) -> __m256i {
        let s = &p[at..at + 32];
        // SAFETY: `s` is 32 readable bytes (the slice above is bounds-checked); the unaligned
        // load has no alignment requirement.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn diff_mask(old: &[u8], new: &[u8]) -> u64 {
        let mut m = 0u64;
        for b in 0..64 {
            let at = b * 64;
            let x0 = _mm256_xor_si256(load(old, at), load(new, at));
            let x1 = _mm256_xor_si256(load(old, at + 32), load(new, at + 32));
            let x = _mm256_or_si256(x0, x1);
            m |= ((_mm256_testz_si256(x, x) == 0) as u64) << b;
        }
        m
    }

    /// `p.len()` is a multiple of 128.
    #[target_feature(enable = "avx2")]
    pub(super) fn is_zero(p: &[u8]) -> bool {
        (0..p.len()).step_by(128).all(|at| {
            let a = _mm256_or_si256(load(p, at), load(p, at + 32));
            let b = _mm256_or_si256(load(p, at + 64), load(p, at + 96));
            let x = _mm256_or_si256(a, b);
            _mm256_testz_si256(x, x) == 1
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn vector_and_portable_scans_agree(edits in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 0..40)) {
            let old = crate::test_bytes(7, 4096);
            let mut new = old.clone();
            let mut zero = vec![0u8; 4096];
            for &(at, v) in &edits {
                new[at] ^= v;
                zero[at] = v;
            }
            proptest::prop_assert_eq!(diff_mask(&old, &new), diff_mask_portable(&old, &new));
            proptest::prop_assert_eq!(is_zero(&zero), is_zero_portable(&zero));
            proptest::prop_assert_eq!(is_zero(&zero), zero.iter().all(|&b| b == 0));
            let want = (0..64).filter(|b| old[b * 64..b * 64 + 64] != new[b * 64..b * 64 + 64]).fold(0u64, |m, b| m | 1 << b);
            proptest::prop_assert_eq!(diff_mask(&old, &new), want);
        }
    }

    #[test]
    fn short_and_odd_lengths_are_zero_checked_whole() {
        assert!(is_zero(&[0u8; 64]));
        assert!(!is_zero(&[0, 0, 0, 1]));
        let mut p = vec![0u8; 4096 + 17];
        assert!(is_zero(&p));
        p[4096 + 16] = 1;
        assert!(!is_zero(&p));
    }
}
