//! Checkpoints with disks, without QEMU: synthetic RAM and two disks written between
//! checkpoints. Every checkpoint's disks are rebuilt exactly, through RAM bases, compaction,
//! a skipped (disk-full) checkpoint and a reopen; a damaged disk base is named.

use std::path::Path;

use tandem_codec::{Codec, Config};
use tandem_store::disks::{DiskLayout, DiskSpec};
use tandem_store::store::WriteFault;
use tandem_store::{Meta, Outcome, Saver, Store, StoreError};

const P: usize = 4096;
const PAGES: usize = 32;
const TOTAL: u64 = (1 << 20) + 32 * 1024;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn layout() -> DiskLayout {
    DiskLayout::new(
        vec![
            DiskSpec {
                index: 0,
                offset: 0,
                size: 64 * 1024,
                path: "/vm/a.qcow2".into(),
            },
            DiskSpec {
                index: 2,
                offset: 1 << 20,
                size: 32 * 1024,
                path: "/vm/b.raw".into(),
            },
        ],
        TOTAL,
    )
    .unwrap()
}

/// Writes inside the disks (some overlapping, in order), applied to `model` too.
fn writes(rng: &mut Rng, model: &mut [u8]) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    for _ in 0..(1 + rng.next() % 5) {
        let (start, size) = if rng.next().is_multiple_of(2) {
            (0, 64 * 1024)
        } else {
            (1 << 20, 32 * 1024)
        };
        let len = 512 * (1 + rng.next() % 8);
        let off = start + (rng.next() % ((size - len) / 512)) * 512;
        let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        model[off as usize..(off + len) as usize].copy_from_slice(&data);
        out.push((off, data));
    }
    out
}

fn meta() -> Meta {
    Meta::default()
}

struct Saved {
    saver: Saver,
    disks: Vec<Vec<u8>>,
}

/// A store with disks and `n` checkpoints; `disks[k]` is checkpoint k+1's disk image.
fn save(dir: &Path, n: u64, base_every: u64, fault_at: Option<u64>) -> Saved {
    let mut rng = Rng(0x1234_5678);
    let ram: Vec<u8> = (0..PAGES * P).map(|i| (i % 7) as u8).collect();
    let mut store = Store::create_with_disks(dir, ram.len() as u64, layout()).unwrap();
    let mut model = vec![0u8; TOTAL as usize];
    for b in model[..64 * 1024].iter_mut() {
        *b = rng.next() as u8;
    }
    let scratch = store.disk_base_scratch();
    std::fs::write(&scratch, &model).unwrap();
    store.add_disk_base(1, &scratch).unwrap();
    let mut saver = Saver::new(store, ram, Codec::Tandem, Config::default(), base_every).unwrap();
    assert!(matches!(
        saver.checkpoint(&[], &[], b"dev", meta()).unwrap(),
        Outcome::Saved { .. }
    ));
    let mut disks = vec![model.clone()];
    let mut id = 2;
    while (disks.len() as u64) < n {
        let w = writes(&mut rng, &mut model);
        let pfn = id % PAGES as u64;
        let page = vec![id as u8; P];
        if fault_at == Some(id) {
            saver
                .store_mut()
                .inject_write_fault(WriteFault::SegmentSync);
        }
        match saver
            .checkpoint_with_disk(&[pfn], &page, b"dev", w, meta())
            .unwrap()
        {
            Outcome::Saved { .. } => disks.push(model.clone()),
            Outcome::Skipped { .. } => {} // its writes go into the next checkpoint
        }
        id += 1;
    }
    Saved { saver, disks }
}

fn rebuilt(store: &Store, id: u64, dir: &Path) -> Result<Vec<u8>, StoreError> {
    let out = dir.join(format!("out-{id}.img"));
    let _ = std::fs::remove_file(&out);
    store.materialize_disks(id, &out)?;
    let b = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    Ok(b)
}

#[test]
fn every_checkpoints_disks_are_rebuilt_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let s = save(&dir.path().join("s"), 12, 4, None);
    let out = tempfile::tempdir().unwrap();
    drop(s.saver);
    let store = Store::open(&dir.path().join("s")).unwrap();
    assert_eq!(store.disks().unwrap().disks, layout().disks);
    for (k, want) in s.disks.iter().enumerate() {
        assert!(
            rebuilt(&store, k as u64 + 1, out.path()).unwrap() == *want,
            "checkpoint {}",
            k + 1
        );
    }
    assert!(store.verify(|_| {}).is_empty());
    assert!(matches!(
        rebuilt(&store, 13, out.path()),
        Err(StoreError::NoCheckpoint(13, _))
    ));
}

#[test]
fn a_skipped_checkpoints_disk_writes_go_into_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let s = save(&dir.path().join("s"), 8, 0, Some(4));
    assert_eq!(s.saver.skipped(), 1);
    let out = tempfile::tempdir().unwrap();
    for (k, want) in s.disks.iter().enumerate() {
        assert!(
            rebuilt(s.saver.store(), k as u64 + 1, out.path()).unwrap() == *want,
            "checkpoint {}",
            k + 1
        );
    }
}

#[test]
fn compaction_folds_the_disk_writes_into_a_new_disk_base() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = save(&dir.path().join("s"), 10, 0, None);
    let store = s.saver.store_mut();
    assert_eq!(
        store.compact(4, Codec::Tandem, Config::default()).unwrap(),
        6
    );
    assert_eq!(store.disks().unwrap().bases.len(), 1);
    assert_eq!(store.disks().unwrap().bases[0].0, 7);
    assert!(!dir.path().join("s/disk-0000000000000001.img").exists());
    let out = tempfile::tempdir().unwrap();
    for id in 7..=10u64 {
        assert!(
            rebuilt(store, id, out.path()).unwrap() == s.disks[id as usize - 1],
            "checkpoint {id}"
        );
    }
    assert!(rebuilt(store, 3, out.path()).is_err());
    // Appending after the compaction continues the chain from the new base.
    let mut model = s.disks[9].clone();
    let w = writes(&mut Rng(99), &mut model);
    s.saver
        .checkpoint_with_disk(&[1], &vec![5u8; P], b"dev", w, meta())
        .unwrap();
    assert!(rebuilt(s.saver.store(), 11, out.path()).unwrap() == model);
}

#[test]
fn a_damaged_disk_base_is_named_and_an_uncommitted_one_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("s");
    let s = save(&d, 4, 0, None);
    drop(s.saver);
    // A base prepared for a checkpoint that was never committed (a crash in between).
    let mut w = Store::open_append(&d).unwrap();
    let scratch = w.disk_base_scratch();
    std::fs::write(&scratch, vec![0u8; TOTAL as usize]).unwrap();
    w.add_disk_base(5, &scratch).unwrap();
    drop(w);
    let w = Store::open_append(&d).unwrap();
    assert_eq!(
        w.disks().unwrap().bases,
        vec![(1, w.disks().unwrap().bases[0].1)]
    );
    assert!(!d.join("disk-0000000000000005.img").exists());
    drop(w);
    let base = d.join("disk-0000000000000001.img");
    let mut b = std::fs::read(&base).unwrap();
    b[100] ^= 1;
    std::fs::write(&base, b).unwrap();
    let store = Store::open(&d).unwrap();
    let out = tempfile::tempdir().unwrap();
    let e = rebuilt(&store, 3, out.path()).unwrap_err().to_string();
    assert!(e.contains("disk-0000000000000001.img is damaged"), "{e}");
    assert!(
        !out.path().join("out-3.img").exists(),
        "a failed rebuild leaves no file"
    );
    assert!(store
        .verify(|_| {})
        .iter()
        .any(|e| e.to_string().contains("damaged")));
}

#[test]
fn an_index_with_disks_needs_its_disks_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("s");
    drop(save(&d, 2, 0, None).saver);
    std::fs::remove_file(d.join("disks")).unwrap();
    let e = Store::open(&d).unwrap_err().to_string();
    assert!(e.contains("disks file disagree"), "{e}");
    // Disk writes into a store without disks are refused.
    let d2 = dir.path().join("plain");
    let mut s = Store::create(&d2, (PAGES * P) as u64).unwrap();
    let e = s
        .append_with_disk(tandem_store::RecordKind::Base, b"m", b"", b"w", meta())
        .unwrap_err();
    assert!(matches!(e, StoreError::Disk(_)), "{e}");
}
