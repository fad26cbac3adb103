//! A write that fails while saving (the disk fills up, an I/O error) at each step of an
//! append: the append is rolled back, the store stays consistent and restorable, the saver
//! skips that checkpoint and stores the next one as a base, so no chain is ever broken.

use std::path::Path;

use tandem_codec::{Codec, Config};
use tandem_store::format::{RecordKind, ENTRY_LEN, INDEX_HEADER};
use tandem_store::store::WriteFault;
use tandem_store::{Meta, Outcome, Saver, Store};

const P: usize = 4096;
const PAGES: usize = 32;

const FAULTS: [WriteFault; 4] = [
    WriteFault::SegmentWrite,
    WriteFault::SegmentSync,
    WriteFault::IndexWrite,
    WriteFault::IndexSync,
];

fn initial_ram() -> Vec<u8> {
    let mut ram: Vec<u8> = (0..PAGES * P).map(|i| (i / 7 % 199) as u8).collect();
    ram[..2 * P].fill(0);
    ram
}

/// The guest writes a few pages; returns them as a checkpoint would.
fn step(ram: &mut [u8], k: u64) -> (Vec<u64>, Vec<u8>) {
    let mut pfns: Vec<u64> = (0..4).map(|j| (k * 5 + j * 11) % PAGES as u64).collect();
    pfns.sort_unstable();
    pfns.dedup();
    let mut data = Vec::new();
    for &p in &pfns {
        let pg = &mut ram[p as usize * P..(p as usize + 1) * P];
        pg[(k as usize * 37) % P] = k as u8;
        pg[(p as usize * 3 + 1) % P] ^= 0x3c;
        data.extend_from_slice(pg);
    }
    (pfns, data)
}

fn saved(o: &Outcome) -> (RecordKind, u64) {
    match o {
        Outcome::Saved { entry, .. } => (entry.kind, entry.id),
        Outcome::Skipped { error, .. } => panic!("skipped: {error}"),
    }
}

/// Files in the store: (segment name, length) sorted, and the index length.
fn files(dir: &Path) -> (Vec<(String, u64)>, u64) {
    let mut segs: Vec<(String, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("seg-"))
        .map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            (n, e.metadata().unwrap().len())
        })
        .collect();
    segs.sort();
    (segs, std::fs::metadata(dir.join("index")).unwrap().len())
}

/// The store holds exactly `want` (id → RAM), verifies, and has no torn tail.
fn check(dir: &Path, want: &[(u64, Vec<u8>)]) {
    let s = Store::open(dir).unwrap();
    assert!(s.torn_tail().is_none(), "{:?}", s.torn_tail());
    let ids: Vec<u64> = s.entries().iter().map(|e| e.id).collect();
    let want_ids: Vec<u64> = want.iter().map(|w| w.0).collect();
    assert_eq!(ids, want_ids);
    assert!(s.verify(|_| {}).is_empty(), "{:?}", s.verify(|_| {}));
    for (id, ram) in want {
        let mut got = vec![0u8; PAGES * P];
        s.materialize(*id, &mut got).unwrap();
        assert!(got == *ram, "checkpoint {id}");
    }
    // Every byte of every segment belongs to a committed record.
    let (segs, index) = files(dir);
    assert_eq!(index, (INDEX_HEADER + ids.len() * ENTRY_LEN) as u64);
    for (name, len) in segs {
        let end = s
            .entries()
            .iter()
            .filter(|e| Store::segment_name(e) == name)
            .map(|e| e.offset + e.len as u64)
            .max();
        assert_eq!(end, Some(len), "{name}");
    }
}

#[test]
fn a_failed_append_is_rolled_back_at_every_step() {
    for kind in [RecordKind::Delta, RecordKind::Base] {
        for fault in FAULTS {
            let d = tempfile::tempdir().unwrap();
            let mut ram = initial_ram();
            let store = Store::create(d.path(), ram.len() as u64).unwrap();
            let mut saver =
                Saver::new(store, ram.clone(), Codec::Tandem, Config::default(), 0).unwrap();
            let mut want = Vec::new();
            for k in 0..3 {
                let (pfns, data) = if k == 0 {
                    (Vec::new(), Vec::new())
                } else {
                    step(&mut ram, k)
                };
                let o = saver
                    .checkpoint(&pfns, &data, b"dev", Meta::default())
                    .unwrap();
                want.push((saved(&o).1, ram.clone()));
            }
            drop(saver);
            let before = files(d.path());
            let mut s = Store::open_append(d.path()).unwrap();
            s.inject_write_fault(fault);
            let e = s
                .append(kind, b"never committed", b"dev", Meta::default())
                .unwrap_err();
            assert!(e.is_disk_full(), "{kind:?} {fault:?}: {e}");
            assert_eq!(s.entries().len(), 3);
            assert_eq!(files(d.path()), before, "{kind:?} {fault:?}");
            drop(s);
            check(d.path(), &want);
            // The same handle type appends again from the committed end.
            let mut s = Store::open_append(d.path()).unwrap();
            s.inject_write_fault(fault);
            assert!(s.append(kind, b"x", b"", Meta::default()).is_err());
            let e = s.append(kind, b"ok", b"", Meta::default()).unwrap();
            assert_eq!(e.id, 4, "{kind:?} {fault:?}");
        }
    }
}

#[test]
fn the_saver_skips_a_failed_checkpoint_and_stores_a_base_next() {
    for fault in FAULTS {
        let d = tempfile::tempdir().unwrap();
        let mut ram = initial_ram();
        let store = Store::create(d.path(), ram.len() as u64).unwrap();
        let mut saver =
            Saver::new(store, ram.clone(), Codec::Tandem, Config::default(), 100).unwrap();
        let mut want = Vec::new();
        let mut kinds = Vec::new();
        for k in 0..12u64 {
            let (pfns, data) = if k == 0 {
                (Vec::new(), Vec::new())
            } else {
                step(&mut ram, k)
            };
            // Checkpoints 5 and 6 of the guest fail (two in a row), so does 9.
            if [5, 6, 9].contains(&k) {
                saver.store_mut().inject_write_fault(fault);
            }
            match saver
                .checkpoint(&pfns, &data, format!("dev-{k}").as_bytes(), Meta::default())
                .unwrap()
            {
                Outcome::Saved { entry, .. } => {
                    kinds.push((entry.id, entry.kind));
                    want.push((entry.id, ram.clone()));
                }
                Outcome::Skipped {
                    would_be,
                    error,
                    streak,
                } => {
                    assert!([5, 6, 9].contains(&k), "{k}: {error}");
                    assert!(error.is_disk_full(), "{error}");
                    assert_eq!(would_be, want.last().unwrap().0 + 1);
                    assert_eq!(streak, if k == 6 { 2 } else { 1 });
                }
            }
        }
        assert_eq!(saver.skipped(), 3);
        use RecordKind::{Base, Delta};
        // After every failure the next stored checkpoint is a base: the encoder had moved
        // past the skipped one, a delta would have referred to content never stored.
        assert_eq!(
            kinds,
            [
                (1, Base),
                (2, Delta),
                (3, Delta),
                (4, Delta),
                (5, Delta),
                (6, Base),
                (7, Delta),
                (8, Base),
                (9, Delta)
            ],
            "{fault:?}"
        );
        assert!(saver.ram() == &ram[..]);
        drop(saver);
        check(d.path(), &want);
    }
}
