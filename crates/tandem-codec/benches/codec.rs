//! Criterion micro-benchmarks of the codec on a synthetic epoch (1 024 dirty pages of a
//! 64 MiB guest: sparse edits, shifted copies, zero pages, fresh data), against memcpy of the
//! same bytes measured in the same run. Real-trace figures come from `tandem bench --trace`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tandem_codec::{decode, Codec, Config, Encoder, Plan};

const P: usize = 4096;

fn epoch() -> (Vec<u8>, Vec<u64>, Vec<u8>) {
    let pages = 16384usize;
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let base: Vec<u8> = (0..pages * P / 8)
        .flat_map(|i| ((i as u64 % 977) * 0x0101_0101).to_le_bytes())
        .collect();
    let pfns: Vec<u64> = (0..1024u64)
        .map(|i| i * 13 % pages as u64)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut data = Vec::with_capacity(pfns.len() * P);
    for (k, &p) in pfns.iter().enumerate() {
        let mut pg = base[p as usize * P..(p as usize + 1) * P].to_vec();
        match k % 4 {
            0 => (0..8).for_each(|_| pg[(rnd() % P as u64) as usize] ^= 0x41),
            1 => pg.rotate_left(24),
            2 => pg.fill(0),
            _ => pg
                .chunks_exact_mut(8)
                .for_each(|c| c.copy_from_slice(&rnd().to_le_bytes())),
        }
        data.extend_from_slice(&pg);
    }
    (base, pfns, data)
}

fn bench(c: &mut Criterion) {
    let (base, pfns, data) = epoch();
    let mut g = c.benchmark_group("epoch");
    g.throughput(Throughput::Bytes(data.len() as u64));
    g.sample_size(20);
    g.bench_function("memcpy-baseline", |b| {
        let mut dst = vec![0u8; data.len()];
        b.iter(|| dst.copy_from_slice(std::hint::black_box(&data)))
    });
    for codec in [
        Codec::Remus,
        Codec::Xbzrle,
        Codec::Fitdoc,
        Codec::Fgbi,
        Codec::Tandem,
    ] {
        // Encode the same epoch twice so the second sees a warm reference state.
        g.bench_with_input(
            BenchmarkId::new("encode", codec.name()),
            &codec,
            |b, &codec| {
                let mut e = Encoder::new(codec, &base, Config::default()).unwrap();
                let mut rec = Vec::new();
                e.encode(1, &pfns, &data, &mut rec).unwrap();
                b.iter(|| {
                    rec.clear();
                    e.encode(2, &pfns, &data, &mut rec).unwrap()
                })
            },
        );
        let mut e = Encoder::new(codec, &base, Config::default()).unwrap();
        let mut rec = Vec::new();
        e.encode(1, &pfns, &data, &mut rec).unwrap();
        g.bench_with_input(BenchmarkId::new("decode", codec.name()), &rec, |b, rec| {
            let mut plan = Plan::default();
            b.iter(|| decode(rec, &base, &mut plan).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
