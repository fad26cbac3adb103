//! Writes seed inputs for the `store_files` fuzz target: `store_corpus DIR`. Each seed is
//! `[entries/4 as one byte] + index entries + segment bytes` of a small real store.

use tandem_codec::{Codec, Config, Encoder};
use tandem_store::format::{RecordKind, INDEX_HEADER};
use tandem_store::ramhash::RamHash;
use tandem_store::{encode_base, Meta, Store};

fn main() {
    let out = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: store_corpus DIR"));
    std::fs::create_dir_all(&out).unwrap();
    let tmp = std::env::temp_dir().join(format!("tandem-store-corpus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let mut ram: Vec<u8> = (0..16 * 4096).map(|i| (i % 11) as u8).collect();
    let mut s = Store::create(&tmp, ram.len() as u64).unwrap();
    let h = RamHash::of(&ram);
    let b = encode_base(1, &ram, Codec::Tandem, Config::default()).unwrap();
    s.append(
        RecordKind::Base,
        &b,
        b"dev",
        Meta {
            ram_hash: h.value(),
            ..Default::default()
        },
    )
    .unwrap();
    let mut enc = Encoder::new(Codec::Tandem, &ram, Config::default()).unwrap();
    for id in 2..4u64 {
        ram[id as usize * 4096 + 3] = id as u8;
        let page = ram[id as usize * 4096..(id as usize + 1) * 4096].to_vec();
        let mut rec = Vec::new();
        enc.encode(id, &[id], &page, &mut rec).unwrap();
        let h = RamHash::of(&ram);
        s.append(
            RecordKind::Delta,
            &rec,
            b"dev",
            Meta {
                ram_hash: h.value(),
                ..Default::default()
            },
        )
        .unwrap();
    }
    let index = std::fs::read(tmp.join("index")).unwrap();
    let seg = std::fs::read(tmp.join("seg-00000001.tseg")).unwrap();
    let entries = &index[INDEX_HEADER..];
    let mut seed = vec![(entries.len() / 4) as u8];
    seed.extend_from_slice(entries);
    seed.extend_from_slice(&seg);
    std::fs::write(out.join("store"), &seed).unwrap();
    std::fs::write(out.join("store-cut"), &seed[..seed.len() - 50]).unwrap();
    std::fs::write(out.join("empty"), b"").unwrap();
    let _ = std::fs::remove_dir_all(&tmp);
    disks_seeds(&out.join("../store_disks"));
}

/// Seeds for `store_disks`: `[disks file length u16][disks file][entries/4][entries][segment]`
/// of a small real store with a 64 KiB disk written between checkpoints.
fn disks_seeds(out: &std::path::Path) {
    use tandem_store::disks::{DiskLayout, DiskSpec};
    std::fs::create_dir_all(out).unwrap();
    let tmp = std::env::temp_dir().join(format!("tandem-disks-corpus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let total = 64 * 1024u64;
    let layout = DiskLayout::new(
        vec![DiskSpec {
            index: 0,
            offset: 0,
            size: total,
            path: "/vm/disk.raw".into(),
        }],
        total,
    )
    .unwrap();
    let ram: Vec<u8> = (0..16 * 4096).map(|i| (i % 13) as u8).collect();
    let mut s = Store::create_with_disks(&tmp, ram.len() as u64, layout).unwrap();
    // The fuzz entry writes the base as bytes i as u8; use the same here.
    let base: Vec<u8> = (0..total).map(|i| i as u8).collect();
    let scratch = s.disk_base_scratch();
    std::fs::write(&scratch, &base).unwrap();
    s.add_disk_base(1, &scratch).unwrap();
    let mut saver = tandem_store::Saver::new(s, ram, Codec::Tandem, Config::default(), 0).unwrap();
    saver.checkpoint(&[], &[], b"dev", Meta::default()).unwrap();
    for id in 2..5u64 {
        let w = vec![(id * 4096, vec![id as u8; 1024]), (100, vec![7u8; 10])];
        saver
            .checkpoint_with_disk(&[id], &vec![id as u8; 4096], b"dev", w, Meta::default())
            .unwrap();
    }
    let disks = std::fs::read(tmp.join("disks")).unwrap();
    let index = std::fs::read(tmp.join("index")).unwrap();
    let seg = std::fs::read(tmp.join("seg-00000001.tseg")).unwrap();
    let entries = &index[INDEX_HEADER..];
    let mut seed = (disks.len() as u16).to_le_bytes().to_vec();
    seed.extend_from_slice(&disks);
    seed.push((entries.len() / 4) as u8);
    seed.extend_from_slice(entries);
    seed.extend_from_slice(&seg);
    std::fs::write(out.join("store"), &seed).unwrap();
    std::fs::write(out.join("store-cut"), &seed[..seed.len() - 50]).unwrap();
    let mut flipped = seed.clone();
    flipped[10] ^= 0xff;
    std::fs::write(out.join("disks-flipped"), &flipped).unwrap();
    std::fs::write(out.join("empty"), b"").unwrap();
    let _ = std::fs::remove_dir_all(&tmp);
}
