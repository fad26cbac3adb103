//! Records whose page codes are compressed (format version 4, FLAG_CODES_ZSTD): written when
//! it pays, decoded exactly, and a lying or broken codes frame is refused with nothing applied.

use tandem_codec::format::{FLAG_CODES_ZSTD, HEADER_LEN};
use tandem_codec::runs::{get_uleb, put_uleb};
use tandem_codec::{decode, pages_read, pages_read_with, Codec, Config, Encoder, Plan};

const P: usize = 4096;
const PAGES: usize = 1024;

/// A guest of 1024 distinct pages, then an epoch that changes 8 bytes in each of 512 of
/// them: 512 small run patches, ~2.5 KB of regular page codes.
fn epoch() -> (Vec<u8>, Vec<u64>, Vec<u8>) {
    let truth: Vec<u8> = (0..PAGES * P)
        .map(|i| ((i / P) as u8) ^ (i as u8).wrapping_mul(31))
        .collect();
    let pfns: Vec<u64> = (0..512).map(|k| 2 * k).collect();
    let mut data = Vec::new();
    for &p in &pfns {
        let mut pg = truth[p as usize * P..(p as usize + 1) * P].to_vec();
        pg[100..108].copy_from_slice(&p.to_le_bytes());
        data.extend_from_slice(&pg);
    }
    (truth, pfns, data)
}

fn record(codec: Codec) -> (Vec<u8>, Vec<u8>, Vec<u64>, Vec<u8>) {
    let (truth, pfns, data) = epoch();
    let mut enc = Encoder::new(codec, &truth, Config::default()).unwrap();
    let mut rec = Vec::new();
    enc.encode(1, &pfns, &data, &mut rec).unwrap();
    (rec, truth, pfns, data)
}

/// Checks that `plan`, committed onto `truth`, writes `data` into `pfns`.
fn assert_writes(plan: &Plan, truth: &[u8], pfns: &[u64], data: &[u8]) {
    let mut mem = truth.to_vec();
    plan.commit(&mut mem);
    for (k, &p) in pfns.iter().enumerate() {
        assert_eq!(
            &mem[p as usize * P..(p as usize + 1) * P],
            &data[k * P..(k + 1) * P]
        );
    }
}

fn flags(rec: &[u8]) -> u16 {
    u16::from_le_bytes([rec[10], rec[11]])
}

/// Rewrites the ops section (`f` on a copy) and fixes lengths and checksums.
fn with_ops(rec: &[u8], f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let ops_len = u32::from_le_bytes(rec[28..32].try_into().unwrap()) as usize;
    let mut ops = rec[HEADER_LEN..HEADER_LEN + ops_len].to_vec();
    f(&mut ops);
    let mut out = rec[..HEADER_LEN].to_vec();
    out[28..32].copy_from_slice(&(ops.len() as u32).to_le_bytes());
    out[40..44].copy_from_slice(&crc32c::crc32c(&ops).to_le_bytes());
    let crc = crc32c::crc32c(&out[..48]);
    out[48..52].copy_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&ops);
    out.extend_from_slice(&rec[HEADER_LEN + ops_len..]);
    out
}

#[test]
fn many_regular_codes_are_compressed_and_decode_exactly() {
    for codec in [Codec::Tandem, Codec::XbzrleZstd, Codec::Fgbi, Codec::Zstd] {
        let (rec, truth, pfns, data) = record(codec);
        assert_ne!(flags(&rec) & FLAG_CODES_ZSTD, 0, "{codec:?}");
        let mut plan = Plan::default();
        decode(&rec, &truth, &mut plan).unwrap();
        assert_writes(&plan, &truth, &pfns, &data);
        if codec == Codec::Tandem {
            let read = pages_read(&rec, PAGES as u64).unwrap().unwrap();
            assert!(pfns.iter().all(|p| read.binary_search(p).is_ok()));
        }
    }
    // tandem-v1 stays as it was measured.
    let (rec, ..) = record(Codec::TandemV1);
    assert_eq!(flags(&rec) & FLAG_CODES_ZSTD, 0);
}

#[test]
fn a_lying_or_broken_codes_frame_is_refused() {
    let (rec, truth, ..) = record(Codec::XbzrleZstd);
    // xbzrle+zstd has no frame table or run-header length: the ops section is the codes'
    // length (ULEB128) and their zstd frame.
    let uleb_len = |ops: &[u8]| {
        let mut n = 0;
        get_uleb(ops, &mut n).unwrap();
        n
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "declares more codes than the entries can take",
            with_ops(&rec, |ops| {
                let n = uleb_len(ops);
                ops.splice(..n, [0xff, 0xff, 0xff, 0x7f]);
            }),
        ),
        (
            "declares one byte fewer than the frame holds",
            with_ops(&rec, |ops| {
                let mut pos = 0;
                let v = get_uleb(ops, &mut pos).unwrap();
                let mut head = Vec::new();
                put_uleb(&mut head, v - 1);
                ops.splice(..pos, head);
            }),
        ),
        (
            "a corrupt frame",
            with_ops(&rec, |ops| {
                let n = ops.len();
                ops[n / 2] ^= 0x5a;
                ops[n - 3] ^= 0xa5;
            }),
        ),
        (
            "a truncated frame",
            with_ops(&rec, |ops| ops.truncate(ops.len() - 5)),
        ),
        ("no length", with_ops(&rec, |ops| ops.clear())),
    ];
    for (what, bad) in cases {
        let mut plan = Plan::default();
        assert!(decode(&bad, &truth, &mut plan).is_err(), "{what}");
        assert!(plan.pfns.is_empty() && plan.data.is_empty(), "{what}");
        let mut mem = truth.clone();
        plan.commit(&mut mem);
        assert!(mem == truth, "{what}: a refused record applies nothing");
    }
    // The flag in a version 3 record is unknown there.
    let mut v3 = rec.clone();
    v3[8..10].copy_from_slice(&3u16.to_le_bytes());
    let crc = crc32c::crc32c(&v3[..48]);
    v3[48..52].copy_from_slice(&crc.to_le_bytes());
    let e = decode(&v3, &truth, &mut Plan::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown flags"), "{e}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Arbitrary page codes behind a well-formed zstd frame, and an arbitrary declared
    /// length: decoded or refused, never a panic, and a refused record applies nothing.
    #[test]
    fn arbitrary_compressed_codes_never_panic(
        codes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..3000),
        declared in proptest::prelude::any::<Option<u32>>(),
    ) {
        let (rec, truth, ..) = record(Codec::XbzrleZstd);
        let frame = zstd::bulk::compress(&codes, 1).unwrap();
        let bad = with_ops(&rec, |ops| {
            ops.clear();
            put_uleb(ops, declared.map_or(codes.len() as u64, u64::from));
            ops.extend_from_slice(&frame);
        });
        let _ = pages_read(&bad, PAGES as u64);
        let mut plan = Plan::default();
        if decode(&bad, &truth, &mut plan).is_err() {
            proptest::prop_assert!(plan.pfns.is_empty() && plan.data.is_empty());
        }
    }
}

#[test]
fn codes_listed_then_decoded_with_one_plan_are_never_stale() {
    let (rec, truth, pfns, data) = record(Codec::XbzrleZstd);
    let (other, ..) = record(Codec::Zstd);
    let corrupt = with_ops(&rec, |ops| {
        let n = ops.len();
        ops[n / 2] ^= 0x5a;
        ops[n - 3] ^= 0xa5;
    });
    let mut plan = Plan::default();
    let check = |plan: &Plan| assert_writes(plan, &truth, &pfns, &data);
    // Listed, then decoded: the codes kept by the listing are used.
    assert!(pages_read_with(&rec, PAGES as u64, &mut plan).is_ok());
    decode(&rec, &truth, &mut plan).unwrap();
    check(&plan);
    // Another record, or a damaged copy of this one, after it: never the kept codes.
    let _ = pages_read_with(&corrupt, PAGES as u64, &mut plan);
    assert!(decode(&corrupt, &truth, &mut plan).is_err());
    decode(&other, &truth, &mut plan).unwrap();
    decode(&rec, &truth, &mut plan).unwrap();
    check(&plan);
}
