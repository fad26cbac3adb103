//! The store without QEMU: synthetic guest RAM evolving over checkpoints, encoded with the
//! codec as the saver does. Restore equals saved for every checkpoint, torn tails are ignored,
//! compaction is crash-safe at every step, and damage is named and contained.

use std::path::Path;

use tandem_codec::{Codec, Config, Encoder};
use tandem_store::format::RecordKind;
use tandem_store::ramhash::RamHash;
use tandem_store::store::CrashPoint;
use tandem_store::{encode_base, Meta, Store, StoreError};

const P: usize = 4096;
const PAGES: usize = 64;

fn step(ram: &mut [u8], id: u64) -> (Vec<u64>, Vec<u8>) {
    let mut pfns: Vec<u64> = (0..6).map(|k| (id * 7 + k * 13) % PAGES as u64).collect();
    pfns.sort_unstable();
    pfns.dedup();
    let mut data = Vec::new();
    for &p in &pfns {
        let pg = &mut ram[p as usize * P..(p as usize + 1) * P];
        pg[(id as usize * 31) % P] = id as u8;
        pg[(p as usize * 5) % P] ^= 0x77;
        data.extend_from_slice(pg);
    }
    (pfns, data)
}

/// Saves `n` checkpoints (a base every `base_every`), returning the RAM at each.
fn save(dir: &Path, n: u64, base_every: u64) -> Vec<Vec<u8>> {
    let mut ram: Vec<u8> = (0..PAGES * P).map(|i| (i / 5 % 200) as u8).collect();
    ram[..3 * P].fill(0);
    let mut store = Store::create(dir, ram.len() as u64).unwrap();
    let mut hash = RamHash::of(&ram);
    let base = encode_base(1, &ram, Codec::Tandem, Config::default()).unwrap();
    let meta = |h: &RamHash| Meta {
        ram_hash: h.value(),
        ..Default::default()
    };
    store
        .append(RecordKind::Base, &base, b"dev-1", meta(&hash))
        .unwrap();
    let mut enc = Encoder::new(Codec::Tandem, &ram, Config::default()).unwrap();
    let mut states = vec![ram.clone()];
    for id in 2..=n {
        let (pfns, data) = step(&mut ram, id);
        hash.update(&pfns, &data);
        let mut rec = Vec::new();
        enc.encode(id, &pfns, &data, &mut rec).unwrap();
        let dev = format!("dev-{id}");
        if id % base_every == 0 {
            let b = encode_base(id, &ram, Codec::Tandem, Config::default()).unwrap();
            store
                .append(RecordKind::Base, &b, dev.as_bytes(), meta(&hash))
                .unwrap();
        } else {
            store
                .append(RecordKind::Delta, &rec, dev.as_bytes(), meta(&hash))
                .unwrap();
        }
        states.push(ram.clone());
    }
    states
}

fn restore(s: &Store, id: u64) -> Result<(Vec<u8>, Vec<u8>), StoreError> {
    let mut ram = vec![0xaa; PAGES * P];
    let dev = s.materialize(id, &mut ram)?;
    Ok((ram, dev))
}

#[test]
fn every_checkpoint_restores_to_what_was_saved() {
    let d = tempfile::tempdir().unwrap();
    let states = save(d.path(), 25, 10);
    let s = Store::open(d.path()).unwrap();
    assert_eq!(s.entries().len(), 25);
    assert!(s.torn_tail().is_none());
    for (i, want) in states.iter().enumerate() {
        let id = i as u64 + 1;
        let (ram, dev) = restore(&s, id).unwrap();
        assert!(ram == *want, "checkpoint {id}");
        assert_eq!(dev, format!("dev-{id}").as_bytes());
    }
    assert!(s.verify(|_| {}).is_empty());
    assert!(matches!(
        restore(&s, 99),
        Err(StoreError::NoCheckpoint(99, _))
    ));
}

#[test]
fn a_torn_index_tail_is_ignored_and_cut_before_appending() {
    let d = tempfile::tempdir().unwrap();
    let states = save(d.path(), 8, 100);
    let idx = d.path().join("index");
    let len = std::fs::metadata(&idx).unwrap().len();
    // A crash in the middle of writing the last entry.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&idx)
        .unwrap()
        .set_len(len - 20)
        .unwrap();
    let s = Store::open(d.path()).unwrap();
    assert_eq!(s.entries().len(), 7);
    assert!(s.torn_tail().unwrap().contains("after checkpoint 7"));
    assert_eq!(restore(&s, 7).unwrap().0, states[6]);
    let mut s = Store::open_append(d.path()).unwrap();
    assert_eq!(
        std::fs::metadata(&idx).unwrap().len(),
        32 + 7 * 64,
        "torn tail cut"
    );
    // Appending continues after the last committed checkpoint.
    let e = s
        .append(RecordKind::Delta, b"not decodable", b"", Meta::default())
        .unwrap();
    assert_eq!(e.id, 8);
}

#[test]
fn compaction_keeps_the_newest_and_is_crash_safe_at_every_step() {
    for crash in [
        Some(CrashPoint::SegmentWritten),
        Some(CrashPoint::NewIndexWritten),
        Some(CrashPoint::Renamed),
        None,
    ] {
        let d = tempfile::tempdir().unwrap();
        let states = save(d.path(), 20, 100);
        let mut s = Store::open_append(d.path()).unwrap();
        s.compact_until(5, Codec::Tandem, Config::default(), crash)
            .unwrap();
        drop(s);
        // Whatever the crash point, the store opens, verifies, and restores what it lists.
        let s = Store::open_append(d.path()).unwrap();
        assert!(s.verify(|_| {}).is_empty(), "{crash:?}");
        let ids: Vec<u64> = s.entries().iter().map(|e| e.id).collect();
        match crash {
            Some(CrashPoint::SegmentWritten) | Some(CrashPoint::NewIndexWritten) => {
                assert_eq!(ids, (1..=20).collect::<Vec<_>>(), "{crash:?}")
            }
            _ => assert_eq!(ids, (16..=20).collect::<Vec<_>>(), "{crash:?}"),
        }
        for &id in &ids {
            assert_eq!(restore(&s, id).unwrap().0, states[id as usize - 1]);
        }
        // No garbage left behind after reopening.
        let segs = std::fs::read_dir(d.path())
            .unwrap()
            .filter(|e| {
                let n = e.as_ref().unwrap().file_name();
                let n = n.to_string_lossy();
                n.starts_with("seg-") || n == "index.tmp"
            })
            .count();
        assert_eq!(segs, 1, "{crash:?}");
    }
}

#[test]
fn a_flipped_byte_is_named_and_contained() {
    let d = tempfile::tempdir().unwrap();
    let states = save(d.path(), 30, 10);
    let s = Store::open(d.path()).unwrap();
    let victim = *s.entries().iter().find(|e| e.id == 14).unwrap();
    assert_eq!(victim.kind, RecordKind::Delta);
    let seg = d.path().join(Store::segment_name(&victim));
    let mut b = std::fs::read(&seg).unwrap();
    b[victim.offset as usize + 40] ^= 0x01;
    std::fs::write(&seg, &b).unwrap();
    let s = Store::open(d.path()).unwrap();
    let problems = s.verify(|_| {});
    assert_eq!(problems.len(), 1, "{problems:?}");
    let msg = problems[0].to_string();
    assert!(
        msg.contains("checkpoint 14") && msg.contains(&Store::segment_name(&victim)),
        "{msg}"
    );
    // The damaged one and those rebuilt through it refuse; the others restore.
    assert!(matches!(
        restore(&s, 14),
        Err(StoreError::Damaged { id: 14, .. })
    ));
    let e = restore(&s, 17).unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::DependsOnDamaged {
                id: 17,
                damaged: 14,
                ..
            }
        ),
        "{e}"
    );
    for id in [1, 9, 13, 20, 21, 30] {
        assert_eq!(restore(&s, id).unwrap().0, states[id as usize - 1], "{id}");
    }
}

#[test]
fn bad_directories_give_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let e = Store::open(d.path()).unwrap_err().to_string();
    assert!(e.contains("not a usable checkpoint store"), "{e}");
    std::fs::write(d.path().join("index"), b"garbage").unwrap();
    let e = Store::open(d.path()).unwrap_err().to_string();
    assert!(e.contains("bad magic"), "{e}");
    assert!(matches!(
        Store::create(d.path(), 4096),
        Err(StoreError::Exists(_))
    ));
    let d2 = tempfile::tempdir().unwrap();
    save(d2.path(), 3, 100);
    let s = Store::open(d2.path()).unwrap();
    let mut small = vec![0u8; P];
    assert!(matches!(
        s.materialize(1, &mut small),
        Err(StoreError::Geometry { .. })
    ));
}
