//! Word deltas (format version 6): a page sent whole, as its 8-byte little-endian words each
//! minus the word before it (the first minus zero), wrapping. The record's zstd pass then sees
//! arrays of counters, indexes and pointers as what they are — a few small steps repeating —
//! instead of one short match per word: a page of `v ^ w` for w = 0..511 (memtouch's full
//! rewrite) compresses 22× smaller at level −5, and zstd gets through it 7× faster, because
//! its matches are long.
//!
//! Text, code and compressed data lose by it (their bytes are not numbers), so the encoder
//! measures, per epoch, which way this epoch's whole pages compress smaller (`measure`): a
//! sample of up to [`SAMPLE`] pages that tandem would send whole, spread over the epoch, is
//! compressed both ways at zstd's fastest level the encoder uses ([`crate::level::MIN`]: the
//! comparison is wanted, not the ratio; 0.04–0.06 ms an epoch on kv); word deltas are taken
//! for the epoch when they measure below [`WIN_BY`] of the plain pages. An epoch with fewer than
//! [`MIN_DECIDING`] such pages keeps the previous choice. The sample and the line were set
//! before any trace was run with them, and are not tuned (docs/CODEC.md).

use crate::format::PAGE;
use crate::state::PrevStore;
use crate::strategies::Pre;

/// Most pages compressed both ways per epoch.
pub const SAMPLE: usize = 16;
/// Fewest sampled pages that decide.
pub const MIN_DECIDING: usize = 4;
/// Word deltas are taken when they measure below this fraction of the plain pages
/// (numerator, denominator).
pub const WIN_BY: (usize, usize) = (9, 10);
/// Places looked at for sampled pages, spread evenly over the epoch (a store lookup each).
const PROBES: usize = 4 * SAMPLE;

/// Appends the word deltas of `page` (one page) to `out`.
pub fn encode(page: &[u8], out: &mut Vec<u8>) {
    debug_assert_eq!(page.len(), PAGE);
    let word = |w: &[u8]| u64::from_le_bytes(w.try_into().unwrap_or_default());
    // A stretch at a time through a buffer on the stack, so that `out` (the record, much
    // larger than the caches) is written once rather than zero-filled first.
    const STRETCH: usize = 512;
    let mut buf = [0u8; STRETCH];
    for (k, stretch) in page.chunks_exact(STRETCH).enumerate() {
        let at = k * STRETCH;
        let before = if at == 0 { 0 } else { word(&page[at - 8..at]) };
        buf[..8].copy_from_slice(&word(&stretch[..8]).wrapping_sub(before).to_le_bytes());
        // Each word minus its neighbour before it: no carried state, so the loop vectorises.
        let pairs = stretch.chunks_exact(8).zip(stretch[8..].chunks_exact(8));
        for ((b, w), d) in pairs.zip(buf[8..].chunks_exact_mut(8)) {
            d.copy_from_slice(&word(w).wrapping_sub(word(b)).to_le_bytes());
        }
        out.extend_from_slice(&buf);
    }
}

/// Writes the page of which `payload` holds the word deltas into `page`; false when the
/// payload is not one page long.
pub fn decode(payload: &[u8], page: &mut [u8]) -> bool {
    if payload.len() != PAGE || page.len() != PAGE {
        return false;
    }
    let mut acc = 0u64;
    for (d, o) in payload.chunks_exact(8).zip(page.chunks_exact_mut(8)) {
        acc = acc.wrapping_add(u64::from_le_bytes(d.try_into().unwrap_or_default()));
        o.copy_from_slice(&acc.to_le_bytes());
    }
    true
}

/// Whether tandem would send page `pfn` whole, with nothing to match it against: no held
/// previous version, every block changed (when block hashes say which), not zero, not a copy
/// of another page of the epoch.
pub(crate) fn whole(prev: &PrevStore, pfn: u64, pre: &Pre, blocks: bool) -> bool {
    !pre.zero
        && !pre.unchanged
        && pre.dup_of.is_none()
        && (!blocks || pre.mask == u64::MAX)
        && prev.get(pfn).is_none()
}

/// What one epoch's measurement found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Measured {
    /// Pages compressed both ways.
    pub pages: usize,
    /// Their compressed bytes as they are.
    pub plain: usize,
    /// ... and as word deltas.
    pub deltas: usize,
}

impl Measured {
    /// Word deltas won (None: too few pages to decide).
    pub fn deltas_win(&self) -> Option<bool> {
        (self.pages >= MIN_DECIDING).then(|| self.deltas * WIN_BY.1 < self.plain * WIN_BY.0)
    }
}

/// Compresses a sample of this epoch's whole pages plainly and as word deltas.
pub(crate) fn measure(
    prev: &PrevStore,
    pfns: &[u64],
    data: &[u8],
    pre: &[Pre],
    blocks: bool,
) -> std::io::Result<Measured> {
    let n = pfns.len();
    let mut plain = Vec::new();
    let mut deltas = Vec::new();
    let mut pages = 0;
    let step = n.div_ceil(PROBES).max(1);
    for i in (0..n).step_by(step) {
        if pages == SAMPLE {
            break;
        }
        if whole(prev, pfns[i], &pre[i], blocks) {
            let page = &data[i * PAGE..(i + 1) * PAGE];
            plain.extend_from_slice(page);
            encode(page, &mut deltas);
            pages += 1;
        }
    }
    if pages < MIN_DECIDING {
        return Ok(Measured {
            pages,
            ..Measured::default()
        });
    }
    let level = crate::level::MIN;
    let mut z = Vec::new();
    crate::prefix::compress_alone(&plain, level, &mut z)?;
    let plain = z.len();
    crate::prefix::compress_alone(&deltas, level, &mut z)?;
    Ok(Measured {
        pages,
        plain,
        deltas: z.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn word_deltas_round_trip(page in proptest::collection::vec(any::<u8>(), PAGE)) {
            let mut d = Vec::new();
            encode(&page, &mut d);
            prop_assert_eq!(d.len(), PAGE);
            let w = |b: &[u8], i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
            for i in 0..PAGE / 8 {
                let before = if i == 0 { 0 } else { w(&page, i - 1) };
                prop_assert_eq!(w(&d, i), w(&page, i).wrapping_sub(before), "word {}", i);
            }
            let mut back = vec![0u8; PAGE];
            prop_assert!(decode(&d, &mut back));
            prop_assert_eq!(back, page);
        }
    }

    #[test]
    fn whole_pages_of_counters_go_as_word_deltas_which_older_versions_refuse() {
        use crate::{decode, Codec, Config, Encoder, Plan};
        let pages = 64usize;
        let base = vec![0u8; pages * PAGE];
        let cfg = Config {
            cache_bytes: 4 * PAGE,
            ..Config::default()
        };
        let mut enc = Encoder::new(Codec::Tandem, &base, cfg).unwrap();
        let pfns: Vec<u64> = (0..pages as u64).collect();
        let data: Vec<u8> = (0..pages as u64)
            .flat_map(|p| (0..512u64).flat_map(move |w| ((p << 32 | 77) ^ w).to_le_bytes()))
            .collect();
        let mut rec = Vec::new();
        let s = enc.encode(1, &pfns, &data, &mut rec).unwrap();
        assert!(s.word_deltas, "{:?}", s.words);
        let (mut mirror, mut plan) = (base.clone(), Plan::default());
        decode(&rec, &mirror, &mut plan).unwrap();
        plan.commit(&mut mirror);
        assert!(mirror == data);
        // The same record stamped version 5 (its header checksum made good): refused.
        rec[8..10].copy_from_slice(&5u16.to_le_bytes());
        let crc = crc32c::crc32c(&rec[..48]);
        rec[48..52].copy_from_slice(&crc.to_le_bytes());
        let e = decode(&rec, &base, &mut plan).unwrap_err().to_string();
        assert!(e.contains("format version 6"), "{e}");
    }

    #[test]
    fn a_payload_of_another_length_is_refused() {
        let mut page = vec![0u8; PAGE];
        assert!(!decode(&[0u8; PAGE - 8], &mut page));
        assert!(!decode(&[0u8; PAGE + 8], &mut page));
    }

    #[test]
    fn counters_measure_smaller_as_deltas_and_text_does_not() {
        let counters: Vec<u8> = (0..8u64)
            .flat_map(|p| (0..512u64).flat_map(move |w| (((p + 9) << 32 | p) ^ w).to_le_bytes()))
            .collect();
        let text: Vec<u8> = (0..8 * PAGE)
            .map(|i| b"the quick brown fox jumps over the lazy dog "[(i * 7 + i / 13) % 44])
            .collect();
        let prev = PrevStore::direct(1 << 20);
        let pre = vec![
            Pre {
                mask: u64::MAX,
                ..Pre::default()
            };
            8
        ];
        let pfns: Vec<u64> = (0..8).collect();
        let m = measure(&prev, &pfns, &counters, &pre, true).unwrap();
        assert_eq!(m.pages, 8);
        assert_eq!(m.deltas_win(), Some(true), "{m:?}");
        let m = measure(&prev, &pfns, &text, &pre, true).unwrap();
        assert_eq!(m.deltas_win(), Some(false), "{m:?}");
        // Too few whole pages (zero ones are not whole) decide nothing.
        let zero = vec![
            Pre {
                zero: true,
                ..Pre::default()
            };
            8
        ];
        let m = measure(&prev, &pfns, &counters, &zero, true).unwrap();
        assert_eq!(m.deltas_win(), None);
    }
}
