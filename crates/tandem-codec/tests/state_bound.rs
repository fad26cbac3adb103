//! tandem's reference state stays within a quarter of guest memory, with its
//! compressed tier full of compressible pages, full of incompressible ones, or both; and at
//! the lowest zstd level the store holds raw pages in all of its bytes.

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
fn at_the_lowest_level_the_store_holds_raw_pages_in_all_its_bytes() {
    // A 1 024-page guest (the store: 256 pages' bytes, a quarter of them the compressed tier)
    // rewriting a cycle of 768 compressible pages. Once the link's level controller went to
    // its lowest level (the encoder is the slower stage), the tier compresses nothing and its
    // bytes hold raw pages: the records and the state are those of the store without a tier
    // (`cold = false`), whether the level was configured or set after the first epochs.
    let pages = 1024u64;
    let base: Vec<u8> = (0..pages).flat_map(|p| page(p, 0, true)).collect();
    let min = tandem_codec::level::MIN;
    // (level, set after two epochs, compressed tier)
    let runs = [(min, false, true), (min, true, true), (min, false, false)];
    let mut sent = Vec::new();
    for (level, later, cold) in runs {
        let mut cfg = Config {
            zstd_level: if later { 1 } else { level },
            cache_bytes: 256 * P,
            ..Config::default()
        };
        cfg.budget.cold = cold;
        let mut enc = Encoder::new(Codec::Tandem, &base, cfg).unwrap();
        let mut rec = Vec::new();
        let mut bytes = Vec::new();
        for k in 0..24u64 {
            if later && k == 2 {
                enc.set_level(level);
            }
            let first = k % 6 * 128;
            let set: Vec<u64> = (first..first + 128).collect();
            let data: Vec<u8> = set.iter().flat_map(|&p| page(p, k + 1, true)).collect();
            rec.clear();
            enc.encode(k + 1, &set, &data, &mut rec).unwrap();
            bytes.push(rec.len());
        }
        assert!(enc.state_bytes() <= base.len() / 2);
        sent.push((bytes, enc.state_bytes()));
    }
    assert_eq!(
        sent[0], sent[2],
        "configured at level MIN: the store without a tier"
    );
    assert_eq!(
        sent[1].0[12..],
        sent[2].0[12..],
        "set to level MIN: the same, once the cycle went round twice"
    );
}
