//! Tests of the run streams (runs.rs).

use super::*;

#[test]
fn xbzrle_vectors_from_qemu_unit_tests() {
    // QEMU tests/unit/test-xbzrle.c, test_encode_decode_1_byte: one changed byte at the
    // end of a zero page encodes as uleb(4095) + uleb(1) + 1 byte = 4 bytes.
    let old = vec![0u8; 4096];
    let mut new = old.clone();
    new[4095] = 1;
    let mut out = Vec::new();
    assert_eq!(encode(&old, &new, 1, 4096, &mut out), Some(4));
    assert_eq!(out, [0xff, 0x1f, 0x01, 0x01]);
    // test_encode_decode_unchanged: identical pages encode to nothing.
    out.clear();
    assert_eq!(encode(&old, &old, 1, 4096, &mut out), Some(0));
    // test_encode_decode_overflow: every other byte changed overflows a page-sized buffer.
    let alt: Vec<u8> = (0..4096).map(|i| (i % 2) as u8).collect();
    out.clear();
    assert_eq!(encode(&old, &alt, 1, 4096, &mut out), None);
    assert!(out.is_empty());
}

#[test]
fn roundtrip_units() {
    let old: Vec<u8> = (0..4096).map(|i| (i * 7) as u8).collect();
    let mut new = old.clone();
    new[0] ^= 1;
    new[100..180].fill(3);
    new[4000] = 9;
    for unit in [1, 8] {
        let mut out = Vec::new();
        encode(&old, &new, unit, 4096, &mut out).unwrap();
        let mut page = old.clone();
        assert!(apply(&out, unit, &mut page));
        assert_eq!(page, new);
    }
}

/// The byte-at-a-time definition the fast scanner must match exactly.
fn reference(old: &[u8], new: &[u8], unit: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let n = new.len() / unit;
    let same = |i: usize| old[i * unit..(i + 1) * unit] == new[i * unit..(i + 1) * unit];
    let mut i = 0;
    while i < n {
        let s = i;
        while i < n && same(i) {
            i += 1;
        }
        if i == n {
            break;
        }
        let l = i;
        while i < n && !same(i) {
            i += 1;
        }
        put_uleb(&mut out, (l - s) as u64);
        put_uleb(&mut out, (i - l) as u64);
        out.extend_from_slice(&new[l * unit..i * unit]);
    }
    out
}

proptest::proptest! {
    #[test]
    fn fast_scanner_matches_reference(edits in proptest::collection::vec((0usize..4096, 0usize..40, proptest::prelude::any::<u8>()), 0..30)) {
        let old: Vec<u8> = (0..4096).map(|i| (i * 31 % 251) as u8).collect();
        let mut new = old.clone();
        for (at, len, v) in edits {
            for b in new.iter_mut().skip(at).take(len) {
                *b ^= v | 1;
            }
        }
        for unit in [1, 8] {
            let mut out = Vec::new();
            encode(&old, &new, unit, usize::MAX, &mut out).unwrap();
            proptest::prop_assert_eq!(&out, &reference(&old, &new, unit));
        }
        // The masked scanner writes the same stream, and stops at the same limits.
        let mask = crate::encoder::diff_mask(&old, &new);
        let mut out = Vec::new();
        encode_masked(&old, &new, mask, 0, usize::MAX, usize::MAX, &mut out).unwrap();
        proptest::prop_assert_eq!(&out, &reference(&old, &new, 1));
        for limit in [0, 16, 512] {
            let (mut a, mut b) = (vec![7u8], vec![7u8]);
            let ra = encode(&old, &new, 1, limit, &mut a);
            proptest::prop_assert_eq!(encode_masked(&old, &new, mask, 0, limit, limit, &mut b), ra);
            proptest::prop_assert_eq!(a, b);
        }
        // Joined runs: the page round-trips, no stream is longer than maximal runs plus
        // the joined bytes, and no two runs are `gap` or fewer bytes apart.
        for gap in [1, 6, 64] {
            let mut j = Vec::new();
            encode_masked(&old, &new, mask, gap, usize::MAX, usize::MAX, &mut j).unwrap();
            let mut page = old.clone();
            proptest::prop_assert!(apply(&j, 1, &mut page));
            proptest::prop_assert_eq!(&page, &new);
            let mut last_end = None;
            walk(&j, 1, 4096, |from, lit| {
                if let Some(e) = last_end {
                    assert!(from - e > gap, "runs {e}..{from} closer than {gap}");
                }
                last_end = Some(from + lit.len());
            });
            if !j.is_empty() {
                let limited = encode_masked(&old, &new, mask, gap, j.len() - 1, j.len() - 1, &mut Vec::new());
                proptest::prop_assert_eq!(limited, None);
            }
        }
    }
}

#[test]
fn regular_patches_may_pass_the_limit_irregular_ones_not() {
    let old: Vec<u8> = (0..4096).map(|i| (i * 31 % 251) as u8).collect();
    let mask_of = |new: &[u8]| crate::encoder::diff_mask(&old, new);
    // One byte of every 8-byte element changed (a counter in an array): 512 runs with
    // the same header, 1 536 bytes.
    let mut strided = old.clone();
    strided.iter_mut().step_by(8).for_each(|b| *b ^= 0x40);
    let m = mask_of(&strided);
    let mut out = Vec::new();
    assert_eq!(
        encode_masked(&old, &strided, m, 6, 512, 512, &mut out),
        None
    );
    assert!(out.is_empty(), "the buffer is restored");
    let n = encode_masked(&old, &strided, m, 6, 512, 3072, &mut out).unwrap();
    assert_eq!(n, 1536);
    let mut page = old.clone();
    assert!(apply(&out, 1, &mut page));
    assert_eq!(page, strided);
    // ... but not past the higher limit.
    assert_eq!(
        encode_masked(&old, &strided, m, 6, 512, 1535, &mut Vec::new()),
        None
    );
    // As many changed bytes at irregular distances stop at the lower limit.
    let mut irregular = old.clone();
    let mut at = 0;
    for k in 0.. {
        at += 7 + (k * 7919) % 11;
        if at >= 4096 {
            break;
        }
        irregular[at] ^= 0x40;
    }
    let m = mask_of(&irregular);
    assert_eq!(
        encode_masked(&old, &irregular, m, 6, 512, 3072, &mut Vec::new()),
        None
    );
    assert!(encode_masked(&old, &irregular, m, 6, 4096, 4096, &mut Vec::new()).is_some());
}

proptest::proptest! {
    #[test]
    fn split_then_join_is_the_stream(edits in proptest::collection::vec((0usize..4096, 1usize..40), 0..30), gap in 0usize..9) {
        let old = vec![0u8; 4096];
        let mut new = old.clone();
        for (at, len) in edits {
            for b in new.iter_mut().skip(at).take(len) {
                *b = b.wrapping_add(1 + at as u8 % 7);
            }
        }
        let mask = crate::encoder::diff_mask(&old, &new);
        let mut stream = vec![];
        encode_masked(&old, &new, mask, gap, usize::MAX, usize::MAX, &mut stream).unwrap();
        let (mut heads, mut lits) = (vec![], vec![]);
        split(&stream, &mut heads, &mut lits);
        proptest::prop_assert_eq!(heads.len() + lits.len(), stream.len());
        let (mut h, mut l, mut out) = (0, 0, vec![]);
        join(&heads, &mut h, &lits, &mut l, stream.len(), &mut out).unwrap();
        proptest::prop_assert_eq!((h, l), (heads.len(), lits.len()));
        proptest::prop_assert_eq!(&out, &stream);
        // Cut short or asked for the wrong length: an error, never a panic.
        if !stream.is_empty() {
            let (mut h, mut l, mut o) = (0, 0, vec![]);
            proptest::prop_assert!(join(&heads[..heads.len() - 1], &mut h, &lits, &mut l, stream.len(), &mut o).is_err());
            let (mut h, mut l, mut o) = (0, 0, vec![]);
            proptest::prop_assert!(join(&heads, &mut h, &lits, &mut l, stream.len() - 1, &mut o).is_err());
        }
    }
}

#[test]
fn malformed_streams_are_rejected() {
    let mut page = vec![0u8; 4096];
    for bad in [&[0x80][..], &[0xff, 0x1f, 0x02, 1], &[0, 0]] {
        assert!(!check(bad, 1, 4096));
    }
    assert!(check(&[0xff, 0x1f, 0x01, 1], 1, 4096));
    assert!(!apply(&[0x80], 1, &mut page));
    assert!(!apply(&[0xff, 0x1f, 0x02, 1], 1, &mut page)); // runs past the end
    assert!(!apply(&[0, 0], 1, &mut page)); // empty literal run
    assert!(!apply(
        &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 1, 0],
        8,
        &mut page
    ));
}

#[test]
fn a_patch_that_repeats_itself_may_pass_the_limit_with_maximal_runs() {
    let old: Vec<u8> = (0..4096).map(|i| (i * 31 % 251) as u8).collect();
    // Two bytes of every 8-byte element set to the same value: with 6-byte gaps joined it is
    // one run of the whole page, past any limit; with maximal runs, 512 equal runs.
    let mut field = old.clone();
    for e in field.chunks_mut(8) {
        e[4..6].copy_from_slice(&[0x08, 0x02]);
    }
    let m = crate::encoder::diff_mask(&old, &field);
    assert_eq!(
        encode_masked(&old, &field, m, 6, 512, 3072, &mut Vec::new()),
        None
    );
    let mut out = Vec::new();
    // 4 bytes per run (less where an old byte already held the value).
    let n = encode_masked_repeating(&old, &field, m, 128, 3072, &mut out).unwrap();
    assert!((1900..=2048).contains(&n), "{n}");
    let mut page = old.clone();
    assert!(apply(&out, 1, &mut page));
    assert_eq!(page, field);
    // The same positions with values that differ from element to element: the headers
    // repeat, the literals do not. Regular for `encode_masked`, not past 128 bytes here.
    let mut varied = old.clone();
    for (k, e) in varied.chunks_mut(8).enumerate() {
        e[4..6].copy_from_slice(&[k as u8, 0x80 | (k >> 8) as u8]);
    }
    let m = crate::encoder::diff_mask(&old, &varied);
    assert!(encode_masked(&old, &varied, m, 0, 128, 3072, &mut Vec::new()).is_some());
    let mut out = Vec::new();
    assert_eq!(
        encode_masked_repeating(&old, &varied, m, 128, 3072, &mut out),
        None
    );
    assert!(out.is_empty(), "the buffer is restored");
}
