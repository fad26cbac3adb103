//! One writer at a time (the store's lock), and index entries that pass their checksum but
//! lie: huge offsets and lengths, exhausted ids and segment numbers, records out of place, an
//! implausible guest size. Opening, verifying, restoring and appending give errors (or ignore
//! the entry as an inconsistent tail), never a panic or wrapped arithmetic, and never cost a
//! committed checkpoint.

use std::path::Path;

use proptest::prelude::*;
use tandem_codec::{Codec, Config, Encoder};
use tandem_store::format::{encode_record, index_header, Entry, RecordKind};
use tandem_store::ramhash::RamHash;
use tandem_store::{encode_base, Meta, Store, StoreError};

const P: usize = 4096;
const PAGES: usize = 16;

/// A store of `n` checkpoints (one base, then deltas); the RAM at each.
fn save(dir: &Path, n: u64) -> Vec<Vec<u8>> {
    let mut ram: Vec<u8> = (0..PAGES * P).map(|i| (i / 3 % 251) as u8).collect();
    let mut s = Store::create(dir, ram.len() as u64).unwrap();
    let meta = |ram: &[u8]| Meta {
        ram_hash: RamHash::of(ram).value(),
        ..Default::default()
    };
    let b = encode_base(1, &ram, Codec::Tandem, Config::default()).unwrap();
    s.append(RecordKind::Base, &b, b"dev-1", meta(&ram))
        .unwrap();
    let mut enc = Encoder::new(Codec::Tandem, &ram, Config::default()).unwrap();
    let mut states = vec![ram.clone()];
    for id in 2..=n {
        let p = (id as usize * 5) % PAGES;
        ram[p * P + id as usize] ^= 0x5a;
        let mut rec = Vec::new();
        enc.encode(id, &[p as u64], &ram[p * P..(p + 1) * P], &mut rec)
            .unwrap();
        s.append(RecordKind::Delta, &rec, b"dev", meta(&ram))
            .unwrap();
        states.push(ram.clone());
    }
    states
}

fn append_raw_entry(dir: &Path, e: &Entry) {
    let mut idx = std::fs::read(dir.join("index")).unwrap();
    idx.extend_from_slice(&e.encode());
    std::fs::write(dir.join("index"), idx).unwrap();
}

/// Every listed checkpoint restores to what was saved, and the store verifies.
fn intact(dir: &Path, states: &[Vec<u8>]) {
    let s = Store::open(dir).unwrap();
    assert_eq!(s.entries().len(), states.len());
    assert!(s.verify(|_| {}).is_empty());
    for (i, want) in states.iter().enumerate() {
        let mut ram = vec![0u8; PAGES * P];
        s.materialize(i as u64 + 1, &mut ram).unwrap();
        assert!(ram == *want, "checkpoint {}", i + 1);
    }
}

#[test]
fn a_second_writer_is_refused_naming_the_directory_and_the_holder() {
    let d = tempfile::tempdir().unwrap();
    let states = save(d.path(), 3);
    let mut first = Store::open_append(d.path()).unwrap();
    // A second writer, as create or as append: refused, the first keeps its index.
    for second in [
        Store::open_append(d.path()),
        Store::create(d.path(), (PAGES * P) as u64),
    ] {
        let e = second.unwrap_err();
        assert!(
            matches!(&e, StoreError::Locked { pid: Some(p), .. } if *p == std::process::id()),
            "{e:?}"
        );
        let msg = e.to_string();
        let pid = format!("pid {}", std::process::id());
        assert!(
            msg.contains(&d.path().display().to_string())
                && msg.contains(&pid)
                && msg.contains("only one process may write"),
            "{msg}"
        );
    }
    // Readers need no lock.
    intact(d.path(), &states);
    let e = first
        .append(RecordKind::Base, b"x", b"", Meta::default())
        .unwrap();
    assert_eq!(e.id, 4);
    assert_eq!(Store::open(d.path()).unwrap().entries().len(), 4);
    // Released with the handle.
    drop(first);
    Store::open_append(d.path()).unwrap();
}

#[test]
fn two_concurrent_writers_one_wins_and_nothing_is_lost() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let d = tempfile::tempdir().unwrap();
    save(d.path(), 2);
    let start = std::sync::Barrier::new(2);
    let tried = AtomicUsize::new(0);
    let results: Vec<Result<usize, StoreError>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    let opened = Store::open_append(d.path());
                    tried.fetch_add(1, Ordering::SeqCst);
                    let mut st = opened?;
                    for _ in 0..20 {
                        st.append(RecordKind::Base, b"y", b"", Meta::default())?;
                    }
                    // Hold the store until the other writer has tried too.
                    while tried.load(Ordering::SeqCst) < 2 {
                        std::thread::yield_now();
                    }
                    Ok(st.entries().len())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok = results.iter().filter(|r| r.is_ok()).count();
    let locked = results
        .iter()
        .filter(|r| matches!(r, Err(StoreError::Locked { .. })))
        .count();
    assert_eq!((ok, locked), (1, 1), "{results:?}");
    let s = Store::open(d.path()).unwrap();
    assert_eq!(s.entries().len(), 22);
    assert!(s.torn_tail().is_none());
}

#[test]
fn an_entry_whose_offset_plus_length_overflows_is_ignored_not_a_panic() {
    let d = tempfile::tempdir().unwrap();
    let states = save(d.path(), 4);
    let last = *Store::open(d.path()).unwrap().entries().last().unwrap();
    for (offset, len) in [(u64::MAX - 10, 100), (u64::MAX, u32::MAX), (1 << 63, 1)] {
        let dir = tempfile::tempdir().unwrap();
        for f in ["index", "seg-00000001.tseg"] {
            std::fs::copy(d.path().join(f), dir.path().join(f)).unwrap();
        }
        append_raw_entry(
            dir.path(),
            &Entry {
                id: 5,
                offset,
                len,
                ..last
            },
        );
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(s.entries().len(), 4);
        assert!(s.torn_tail().unwrap().contains("after checkpoint 4"));
        assert!(matches!(
            s.materialize(5, &mut vec![0u8; PAGES * P]),
            Err(StoreError::NoCheckpoint(5, _))
        ));
        // Appending cuts the bad entry and continues; nothing committed is lost.
        let mut w = Store::open_append(dir.path()).unwrap();
        w.append(RecordKind::Base, b"z", b"", Meta::default())
            .unwrap();
        drop(w);
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(s.entries().len(), 5);
        intact_prefix(&s, &states);
    }
}

fn intact_prefix(s: &Store, states: &[Vec<u8>]) {
    for (i, want) in states.iter().enumerate() {
        let mut ram = vec![0u8; PAGES * P];
        s.materialize(i as u64 + 1, &mut ram).unwrap();
        assert!(ram == *want, "checkpoint {}", i + 1);
    }
}

/// A store whose only checkpoint is a real base with the given id, in segment `seg`.
fn store_with_base(dir: &Path, id: u64, seg: u32) {
    let ram = vec![7u8; PAGES * P];
    let b = encode_base(id, &ram, Codec::Tandem, Config::default()).unwrap();
    let rec = encode_record(RecordKind::Base, id, &b, b"d").unwrap();
    std::fs::write(dir.join(format!("seg-{seg:08}.tseg")), &rec).unwrap();
    let mut idx = index_header((PAGES * P) as u64).to_vec();
    idx.extend_from_slice(
        &Entry {
            kind: RecordKind::Base,
            id,
            segment: seg,
            offset: 0,
            len: rec.len() as u32,
            ram_hash: RamHash::of(&ram).value(),
            time_ms: 0,
            pause_us: 0,
            dirty_pages: 0,
        }
        .encode(),
    );
    std::fs::write(dir.join("index"), idx).unwrap();
}

#[test]
fn a_compacted_store_with_bases_inside_a_segment_reopens_whole() {
    // Compaction copies later records, bases included, after the new base in one segment.
    let d = tempfile::tempdir().unwrap();
    let mut ram: Vec<u8> = (0..PAGES * P).map(|i| (i % 13) as u8).collect();
    let store = Store::create(d.path(), ram.len() as u64).unwrap();
    let mut saver =
        tandem_store::Saver::new(store, ram.clone(), Codec::Tandem, Config::default(), 3).unwrap();
    let mut states = Vec::new();
    for k in 0..10u64 {
        let (pfns, data) = if k == 0 {
            (Vec::new(), Vec::new())
        } else {
            let p = (k as usize * 3) % PAGES;
            ram[p * P + k as usize] ^= 0x11;
            (vec![p as u64], ram[p * P..(p + 1) * P].to_vec())
        };
        saver
            .checkpoint(&pfns, &data, b"d", Meta::default())
            .unwrap();
        states.push((k + 1, ram.clone()));
    }
    let s = saver.store_mut();
    assert_eq!(s.compact(8, Codec::Tandem, Config::default()).unwrap(), 2);
    let inner_bases = s
        .entries()
        .iter()
        .skip(1)
        .filter(|e| e.kind == RecordKind::Base && e.offset > 0)
        .count();
    assert!(inner_bases >= 2, "{:?}", s.entries());
    drop(saver);
    let s = Store::open(d.path()).unwrap();
    assert!(s.torn_tail().is_none(), "{:?}", s.torn_tail());
    assert_eq!(s.entries().len(), 8);
    assert!(s.verify(|_| {}).is_empty());
    for (id, want) in &states[2..] {
        let mut got = vec![0u8; PAGES * P];
        s.materialize(*id, &mut got).unwrap();
        assert!(got == *want, "checkpoint {id}");
    }
    // And appending continues after it.
    drop(s);
    let mut w = Store::open_append(d.path()).unwrap();
    assert_eq!(w.entries().len(), 8);
    w.append(RecordKind::Delta, b"x", b"", Meta::default())
        .unwrap();
}

#[test]
fn exhausted_ids_and_segment_numbers_are_errors() {
    // The last id: listed and restorable; the next one is refused, and an entry after it
    // (whose id would wrap to 0) is an inconsistent tail.
    let d = tempfile::tempdir().unwrap();
    store_with_base(d.path(), u64::MAX, 1);
    let s = Store::open(d.path()).unwrap();
    assert_eq!(s.entries().len(), 1);
    assert!(s.verify(|_| {}).is_empty());
    let mut w = Store::open_append(d.path()).unwrap();
    let e = w
        .append(RecordKind::Delta, b"x", b"", Meta::default())
        .unwrap_err();
    assert!(matches!(e, StoreError::Exhausted(_)), "{e}");
    drop(w);
    let first = Store::open(d.path()).unwrap().entries()[0];
    append_raw_entry(
        d.path(),
        &Entry {
            kind: RecordKind::Delta,
            id: 0,
            offset: first.len as u64,
            ..first
        },
    );
    let s = Store::open(d.path()).unwrap();
    assert_eq!(s.entries().len(), 1);
    assert!(s.torn_tail().is_some());
    // The last segment number: a new base (new segment) or a compaction is refused.
    let d = tempfile::tempdir().unwrap();
    store_with_base(d.path(), 1, u32::MAX);
    let mut w = Store::open_append(d.path()).unwrap();
    let e = w
        .append(RecordKind::Base, b"x", b"", Meta::default())
        .unwrap_err();
    assert!(matches!(e, StoreError::Exhausted(_)), "{e}");
    w.append(RecordKind::Delta, b"x", b"", Meta::default())
        .unwrap();
    let e = w.compact(1, Codec::Tandem, Config::default()).unwrap_err();
    assert!(matches!(e, StoreError::Exhausted(_)), "{e}");
}

#[test]
fn an_implausible_guest_size_is_refused_at_open() {
    for mem in [0, u64::MAX, 1 << 62, 4097] {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("index"), index_header(mem)).unwrap();
        let e = Store::open(d.path()).unwrap_err();
        assert!(
            e.to_string().contains("implausible guest size"),
            "{mem}: {e}"
        );
    }
}

fn crafted() -> impl Strategy<Value = (bool, u64, u32, u64, u32)> {
    let id = prop_oneof![Just(5u64), Just(6), Just(0), Just(u64::MAX), any::<u64>()];
    let seg = prop_oneof![Just(1u32), Just(2), Just(u32::MAX), any::<u32>()];
    let off = prop_oneof![
        Just(0u64),
        0u64..20_000,
        (0u64..64).prop_map(|k| u64::MAX - k),
        any::<u64>()
    ];
    let len = prop_oneof![
        Just(0u32),
        0u32..20_000,
        (0u32..64).prop_map(|k| u32::MAX - k),
        any::<u32>()
    ];
    (any::<bool>(), id, seg, off, len)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Any checksum-valid entry after four good ones: open, list, verify, restore and append
    /// give errors or ignore it, and the four good checkpoints stay intact.
    #[test]
    fn crafted_crc_valid_entries_never_panic_or_cost_a_checkpoint((base, id, segment, offset, len) in crafted()) {
        let d = tempfile::tempdir().unwrap();
        let states = save(d.path(), 4);
        let good = *Store::open(d.path()).unwrap().entries().last().unwrap();
        let kind = if base { RecordKind::Base } else { RecordKind::Delta };
        let e = Entry { kind, id, segment, offset, len, ..good };
        append_raw_entry(d.path(), &e);
        let s = Store::open(d.path()).unwrap();
        prop_assert!(s.entries().len() <= 5);
        let problems = s.verify(|_| {});
        if s.entries().len() == 5 {
            // Listed only if it sits where an append would put it; it holds no real record.
            prop_assert!(!problems.is_empty());
            prop_assert!(s.materialize(id, &mut vec![0u8; PAGES * P]).is_err());
        } else {
            prop_assert!(problems.is_empty(), "{:?}", problems);
        }
        intact_prefix(&s, &states);
        drop(s);
        let mut w = Store::open_append(d.path()).unwrap();
        let _ = w.append(RecordKind::Base, b"w", b"", Meta::default());
        let _ = w.append(RecordKind::Delta, b"v", b"", Meta::default());
        drop(w);
        intact_prefix(&Store::open(d.path()).unwrap(), &states);
    }
}
