//! Compact page codes and frame tables (format version 5, FLAG_COMPACT): written by every
//! codec but tandem-v1, decoded exactly; plain version-4 records are still read, and the flag
//! is refused in a record that claims an older version.

use tandem_codec::format::{FLAG_COMPACT, VERSION};
use tandem_codec::{decode, pages_read, Codec, Config, Encoder, Plan};

const P: usize = 4096;
const PAGES: usize = 512;

/// One epoch: its pages and their new contents.
type Epoch = (Vec<u64>, Vec<u8>);

/// A guest, then two epochs: small edits of every third page (own-page bases), then copies
/// of other pages, exact and shifted (bases elsewhere, a reference prefix).
fn epochs() -> (Vec<u8>, Vec<Epoch>) {
    let truth: Vec<u8> = (0..PAGES * P)
        .map(|i| ((i / P) as u8) ^ (i as u8).wrapping_mul(29) ^ (i / 7) as u8)
        .collect();
    let mut mem = truth.clone();
    let mut out = Vec::new();
    let pfns: Vec<u64> = (0..PAGES as u64).step_by(3).collect();
    let mut data = Vec::new();
    for &p in &pfns {
        let mut pg = mem[p as usize * P..(p as usize + 1) * P].to_vec();
        pg[200..208].copy_from_slice(&(p * 7).to_le_bytes());
        data.extend_from_slice(&pg);
    }
    for (k, &p) in pfns.iter().enumerate() {
        mem[p as usize * P..(p as usize + 1) * P].copy_from_slice(&data[k * P..(k + 1) * P]);
    }
    out.push((pfns, data));
    let pfns: Vec<u64> = (1..PAGES as u64).step_by(5).collect();
    let mut data = Vec::new();
    for (k, &p) in pfns.iter().enumerate() {
        // Pages 5k+1 are written, so 5k+3 are not: half the pages become exact copies of
        // one of those (identical-page sharing), half shifted copies.
        let src = (p as usize * 11) % (PAGES - 5) / 5 * 5 + 3;
        let old = &mem[src * P..(src + 1) * P];
        if k % 2 == 0 {
            data.extend_from_slice(old);
        } else {
            data.extend_from_slice(&old[40..]);
            data.extend_from_slice(&[p as u8; 40]);
        }
    }
    out.push((pfns, data));
    (truth, out)
}

fn flags(rec: &[u8]) -> u16 {
    u16::from_le_bytes([rec[10], rec[11]])
}

/// `rec` with its version field set to `v` (header checksum fixed).
fn with_version(rec: &[u8], v: u16) -> Vec<u8> {
    let mut r = rec.to_vec();
    r[8..10].copy_from_slice(&v.to_le_bytes());
    let crc = crc32c::crc32c(&r[..48]);
    r[48..52].copy_from_slice(&crc.to_le_bytes());
    r
}

#[test]
fn every_codec_but_tandem_v1_writes_compact_codes_that_decode_exactly() {
    for codec in Codec::ALL {
        let (truth, eps) = epochs();
        let mut enc = Encoder::new(codec, &truth, Config::default()).unwrap();
        let mut mem = truth.clone();
        for (e, (pfns, data)) in eps.iter().enumerate() {
            let mut rec = Vec::new();
            enc.encode(e as u64 + 1, pfns, data, &mut rec).unwrap();
            assert_eq!(u16::from_le_bytes([rec[8], rec[9]]), VERSION);
            assert_eq!(
                flags(&rec) & FLAG_COMPACT != 0,
                codec != Codec::TandemV1,
                "{codec:?}"
            );
            let mut plan = Plan::default();
            decode(&rec, &mem, &mut plan).unwrap();
            if codec == Codec::Tandem && e == 1 {
                // The copies: pages read that this epoch does not write (bases elsewhere,
                // coded relative to their entries).
                let read = pages_read(&rec, PAGES as u64).unwrap().unwrap();
                assert!(pfns.iter().all(|p| read.binary_search(p).is_ok()));
                assert!(read.iter().any(|p| pfns.binary_search(p).is_err()));
            }
            plan.commit(&mut mem);
            for (k, &p) in pfns.iter().enumerate() {
                assert!(
                    mem[p as usize * P..(p as usize + 1) * P] == data[k * P..(k + 1) * P],
                    "{codec:?} epoch {e} page {p}"
                );
            }
        }
    }
}

#[test]
fn plain_version_4_records_are_read_and_compact_ones_need_version_5() {
    let (truth, eps) = epochs();
    let (pfns, data) = &eps[0];
    for codec in [Codec::TandemV1, Codec::Tandem] {
        let mut enc = Encoder::new(codec, &truth, Config::default()).unwrap();
        let mut rec = Vec::new();
        enc.encode(1, pfns, data, &mut rec).unwrap();
        let old = with_version(&rec, 4);
        let mut plan = Plan::default();
        let r = decode(&old, &truth, &mut plan);
        if codec == Codec::TandemV1 {
            // tandem-v1's plain codes are what version 4 wrote.
            r.unwrap();
            let mut mem = truth.clone();
            plan.commit(&mut mem);
            assert!(mem[pfns[1] as usize * P..][..P] == data[P..2 * P]);
        } else {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("unknown flags"), "{e}");
        }
    }
}
