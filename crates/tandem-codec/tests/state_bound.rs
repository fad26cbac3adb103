//! tandem's reference state stays within a quarter of guest memory, with its
//! compressed tier full of compressible pages, full of incompressible ones, or both; and the
//! tier stops taking pages in at the lowest zstd level.

use tandem_codec::{decode, Codec, Config, Encoder, Plan};

const P: usize = 4096;

fn page(pfn: u64, round: u64, compressible: bool) -> Vec<u8> {
    let mut x = (pfn << 20 | round) | 1;
    (0..P / 8)
        .flat_map(|w| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = if compressible {
                (round << 32) | (pfn << 9) | w as u64
            } else {
                x
            };
            v.to_le_bytes()
        })
        .collect()
}

#[test]
fn tandem_state_stays_within_a_quarter_of_guest_memory() {
    // A 32 MiB guest rewriting all of its memory in a cycle of 8 epochs of 1 024 pages.
    let pages = 8192u64;
    for (mix, cold, similarity) in [
        (0u64, true, false),
        (1, true, false),
        (2, true, false),
        (2, false, false),
        (2, true, true),
    ] {
        let kind = |pfn: u64| match mix {
            0 => true,
            1 => false,
            _ => !pfn.is_multiple_of(3),
        };
        let base: Vec<u8> = (0..pages).flat_map(|p| page(p, 0, kind(p))).collect();
        let mut cfg = Config::default();
        cfg.budget.cold = cold;
        cfg.budget.similarity = similarity;
        let mut enc = Encoder::new(Codec::Tandem, &base, cfg).unwrap();
        let (mut mirror, mut plan) = (base.clone(), Plan::default());
        let mut most = 0;
        for k in 0..20u64 {
            let first = k % 8 * 1024;
            let set: Vec<u64> = (first..first + 1024).collect();
            let data: Vec<u8> = set
                .iter()
                .flat_map(|&p| page(p, k / 8 + 1, kind(p)))
                .collect();
            let mut rec = Vec::new();
            enc.encode(k + 1, &set, &data, &mut rec).unwrap();
            decode(&rec, &mirror, &mut plan).unwrap();
            plan.commit(&mut mirror);
            for (&p, d) in set.iter().zip(data.chunks_exact(P)) {
                assert_eq!(&mirror[p as usize * P..(p as usize + 1) * P], d);
            }
            most = most.max(enc.state_bytes());
        }
        assert!(
            most <= base.len() / 4,
            "mix {mix}, compressed tier {cold}, similarity {similarity}: {most} bytes of state for a guest of {}",
            base.len()
        );
    }
}

#[test]
fn at_the_lowest_level_the_compressed_tier_takes_nothing_in() {
    // A 1 024-page guest (the store: 256 pages' bytes, half raw) rewriting a cycle of 768
    // compressible pages: the tier takes in at least its sample, unless the link's level
    // controller went to its lowest level (the encoder is the slower stage).
    let pages = 1024u64;
    let base: Vec<u8> = (0..pages).flat_map(|p| page(p, 0, true)).collect();
    let mut state = Vec::new();
    // The third encoder is configured at the lowest level instead of being set to it.
    let min = tandem_codec::level::MIN;
    for (level, set) in [(min + 1, true), (min, true), (min, false)] {
        let cfg = Config {
            zstd_level: if set { 1 } else { level },
            ..Config::default()
        };
        let mut enc = Encoder::new(Codec::Tandem, &base, cfg).unwrap();
        if set {
            enc.set_level(level);
        }
        let mut rec = Vec::new();
        for k in 0..12u64 {
            let first = k % 6 * 128;
            let set: Vec<u64> = (first..first + 128).collect();
            let data: Vec<u8> = set.iter().flat_map(|&p| page(p, k + 1, true)).collect();
            rec.clear();
            enc.encode(k + 1, &set, &data, &mut rec).unwrap();
        }
        state.push(enc.state_bytes());
    }
    assert!(
        state[1] < state[0],
        "state at level MIN {} bytes, above it {}",
        state[1],
        state[0]
    );
    assert_eq!(state[2], state[1], "configured at level MIN as set to it");
}
