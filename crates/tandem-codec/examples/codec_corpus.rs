//! Writes seed inputs for the codec's fuzz targets: `codec_corpus FUZZ_CORPUS_DIR`.

use tandem_codec::{Codec, Config, Encoder};

fn main() {
    let root = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .expect("usage: codec_corpus FUZZ_CORPUS_DIR"),
    );
    let dec = root.join("epoch_decode");
    let rt = root.join("epoch_roundtrip");
    std::fs::create_dir_all(&dec).unwrap();
    std::fs::create_dir_all(&rt).unwrap();
    const P: usize = 4096;
    // Same mirror as tandem_codec::fuzz::decode_raw, so seeds exercise real decoding.
    let base: Vec<u8> = (0..16 * P).map(|i| (i / 7) as u8).collect();
    let set = [1u64, 4, 5, 9];
    let mut data = Vec::new();
    for (k, &p) in set.iter().enumerate() {
        let mut pg = base[p as usize * P..(p as usize + 1) * P].to_vec();
        pg[k * 100] ^= 0x5a;
        if k == 2 {
            pg.fill(0);
        }
        data.extend_from_slice(&pg);
    }
    for codec in Codec::ALL {
        let mut e = Encoder::new(codec, &base, Config::default()).unwrap();
        let mut rec = Vec::new();
        e.encode(1, &set, &data, &mut rec).unwrap();
        std::fs::write(dec.join(codec.name()), &rec).unwrap();
    }
    // A record with a reference prefix: shifted pages against held previous versions.
    let shifted: Vec<u8> = set
        .iter()
        .flat_map(|&p| {
            let mut pg = base[p as usize * P..(p as usize + 1) * P].to_vec();
            pg.rotate_right(37);
            pg
        })
        .collect();
    let cfg = Config {
        full_mirror: true,
        ..Config::default()
    };
    let mut e = Encoder::new(Codec::Tandem, &base, cfg).unwrap();
    let mut rec = Vec::new();
    let st = e.encode(1, &set, &shifted, &mut rec).unwrap();
    assert!(st.prefix_pages > 0);
    std::fs::write(dec.join("tandem-prefix"), &rec).unwrap();
    for (i, seed) in [
        &b"\x01\x02\x03\x04\x05\x06\x07\x08hello"[..],
        &[0u8; 32],
        &[255u8; 64],
        b"\x0f\x0f\x00\x01abcdefghijklmnop",
        &[7u8; 9],
    ]
    .iter()
    .enumerate()
    {
        std::fs::write(rt.join(format!("seed{i}")), seed).unwrap();
    }
}
