//! Entry points shared by the cargo-fuzz targets and the corpus replay test.

use crate::{decode, Plan};

/// Raw bytes as a record against a small fixed mirror: must reject or decode, never panic.
pub fn decode_raw(data: &[u8]) {
    let mirror: Vec<u8> = (0..16 * crate::format::PAGE)
        .map(|i| (i / 7) as u8)
        .collect();
    let mut plan = Plan::default();
    // The pages a consolidated backup restores before decoding: a list of pages inside the
    // guest (or "any"), never a panic; every page the record writes is on it.
    let reads = crate::pages_read(data, 16);
    if decode(data, &mirror, &mut plan).is_ok() {
        let mut m = mirror.clone();
        plan.commit(&mut m);
        if let Ok(Some(r)) = reads {
            assert!(plan.pfns.iter().all(|p| r.binary_search(p).is_ok()));
        }
    }
    if let Ok(Some(r)) = crate::pages_read(data, 16) {
        assert!(r.iter().all(|&p| p < 16));
    }
}

/// Structured: the input drives a small epoch (page numbers and contents), which is encoded
/// with every codec and must decode back exactly; then the record is mutated and must never
/// panic the decoder.
pub fn roundtrip_structured(data: &[u8]) {
    use crate::{Codec, Config, Encoder};
    const P: usize = crate::format::PAGE;
    let pages = 16usize;
    let base: Vec<u8> = (0..pages * P)
        .map(|i| ((i / P) as u8).wrapping_mul(3) ^ (i % 5) as u8)
        .collect();
    let mut set: Vec<u64> = data
        .iter()
        .take(8)
        .map(|b| (*b as u64) % pages as u64)
        .collect();
    set.sort_unstable();
    set.dedup();
    let mut content = Vec::with_capacity(set.len() * P);
    for (k, &p) in set.iter().enumerate() {
        let mut pg = base[p as usize * P..(p as usize + 1) * P].to_vec();
        for (j, b) in data.iter().enumerate().skip(8 + k) {
            pg[(j * 131 + k * 17) % P] = *b;
        }
        content.extend_from_slice(&pg);
    }
    for codec in Codec::ALL {
        // Small stores (a few pages), so eviction and resynchronisation happen too.
        let cfg = Config {
            cache_bytes: 4 * P,
            rdp_pages: 4,
            index_bits: 6,
            ..Config::default()
        };
        let Ok(mut enc) = Encoder::new(codec, &base, cfg) else {
            continue;
        };
        let mut rec = Vec::new();
        if enc.encode(1, &set, &content, &mut rec).is_err() {
            continue;
        }
        let mut plan = Plan::default();
        let mut mirror = base.clone();
        decode(&rec, &base, &mut plan).expect("own record must decode");
        plan.commit(&mut mirror);
        for (k, &p) in set.iter().enumerate() {
            assert_eq!(
                &mirror[p as usize * P..(p as usize + 1) * P],
                &content[k * P..(k + 1) * P]
            );
        }
        if let Some(&b) = data.first() {
            let at = (b as usize * 7919) % rec.len();
            rec[at] ^= data.get(1).copied().unwrap_or(1) | 1;
            let _ = decode(&rec, &base, &mut plan);
        }
    }
}

/// Structured, tandem over two epochs of every page of a 16-page guest: epoch 1 rewrites
/// them all (the store then holds them), epoch 2 changes bytes all over each page at steps
/// the input gives, so the per-epoch trial (trial.rs) measures and may take long run patches.
/// Both records must decode back exactly. Returns whether epoch 2 took long run patches.
pub fn roundtrip_trial(data: &[u8]) -> bool {
    use crate::{Codec, Config, Encoder};
    const P: usize = crate::format::PAGE;
    const PAGES: usize = 16;
    let base = vec![0u8; PAGES * P];
    let Ok(mut enc) = Encoder::new(Codec::Tandem, &base, Config::default()) else {
        return false;
    };
    let pfns: Vec<u64> = (0..PAGES as u64).collect();
    let mut content: Vec<u8> = (0..PAGES * P).map(|i| (i / 16 % 251) as u8).collect();
    let (mut mirror, mut plan, mut long) = (base, Plan::default(), false);
    for epoch in 1..=2u64 {
        if epoch == 2 && !data.is_empty() {
            for (k, pg) in content.chunks_exact_mut(P).enumerate() {
                let mut at = k % 7;
                for &b in data.iter().cycle().skip(k).take(P) {
                    at += 1 + (b as usize & 31);
                    if at >= P {
                        break;
                    }
                    pg[at] = pg[at].wrapping_add(b | 1);
                }
            }
        }
        let mut rec = Vec::new();
        match enc.encode(epoch, &pfns, &content, &mut rec) {
            Ok(s) => long = s.patch_limit == crate::trial::LONG_PATCH,
            Err(_) => return false,
        }
        decode(&rec, &mirror, &mut plan).expect("own record must decode");
        plan.commit(&mut mirror);
        assert_eq!(mirror, content, "epoch {epoch}");
    }
    long
}

/// Structured, tandem over one epoch that rewrites every page of a 16-page guest with a store
/// of four pages: pages of 8-byte words in steps the input gives (arrays of counters), and
/// where an input byte is odd, a page of the input's bytes instead, so that the epoch's
/// measurement (words.rs) may or may not take word deltas. The record must decode back
/// exactly, and a mutated one must not panic the decoder. Returns whether the epoch sent its
/// whole pages as word deltas.
pub fn roundtrip_words(data: &[u8]) -> bool {
    use crate::{Codec, Config, Encoder};
    const P: usize = crate::format::PAGE;
    const PAGES: usize = 16;
    let base = vec![0u8; PAGES * P];
    let cfg = Config {
        cache_bytes: 4 * P,
        rdp_pages: 4,
        index_bits: 6,
        ..Config::default()
    };
    let Ok(mut enc) = Encoder::new(Codec::Tandem, &base, cfg) else {
        return false;
    };
    let byte = |i: usize| data.get(i % data.len().max(1)).copied().unwrap_or(1);
    let mut content = Vec::with_capacity(PAGES * P);
    for k in 0..PAGES {
        let (start, step) = (byte(2 * k) as u64 * 0x1_0001, byte(2 * k + 1) as u64 | 1);
        if byte(k) % 2 == 1 && byte(k) > 200 {
            content.extend((0..P).map(|i| byte(i + k)));
        } else {
            let words = (0..P as u64 / 8).map(|w| ((k as u64) << 40 | start) + w * step);
            content.extend(words.flat_map(u64::to_le_bytes));
        }
    }
    let pfns: Vec<u64> = (0..PAGES as u64).collect();
    let mut rec = Vec::new();
    let Ok(stats) = enc.encode(1, &pfns, &content, &mut rec) else {
        return false;
    };
    let (mut mirror, mut plan) = (base.clone(), Plan::default());
    decode(&rec, &mirror, &mut plan).expect("own record must decode");
    plan.commit(&mut mirror);
    assert_eq!(mirror, content);
    if let Some(&b) = data.first() {
        let at = (b as usize * 7919) % rec.len();
        rec[at] ^= data.get(1).copied().unwrap_or(1) | 1;
        let _ = decode(&rec, &base, &mut plan);
    }
    stats.word_deltas
}
