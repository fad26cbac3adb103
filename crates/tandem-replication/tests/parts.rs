//! Epochs sent in parts (`Primary::epoch_parts`, `Kind::EpochPart`): applied part by part
//! and committed by the epoch frame, they leave the backup where one frame would; an epoch
//! whose last frame is refused, never comes, or is followed by a new session is undone whole.

use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use tandem_codec::{Codec, Config};
use tandem_replication::{
    Applied, ApplyError, Backup, DiskCopy, EpochInput, Frame, Kind, Parts, Primary,
};

const P: usize = 4096;
const PAGES: usize = 128;
const DISK: usize = 64 * 1024;
const VM: u64 = 0x77;

type Guest = tandem_test_support::FakeGuest;

/// The backup's disk copy, readable by the test.
#[derive(Clone)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Shared {
    fn get(&self) -> Vec<u8> {
        self.0.lock().unwrap().clone()
    }
}

impl DiskCopy for Shared {
    fn size(&self) -> u64 {
        DISK as u64
    }
    fn read_at(&self, o: u64, b: &mut [u8]) -> std::io::Result<()> {
        self.0.lock().unwrap().read_at(o, b)
    }
    fn write_at(&mut self, o: u64, d: &[u8]) -> std::io::Result<()> {
        self.0.lock().unwrap().write_at(o, d)
    }
    fn zero(&mut self) -> std::io::Result<()> {
        self.0.lock().unwrap().zero()
    }
}

thread_local! {
    static DISK_COPY: std::cell::RefCell<Option<Shared>> = const { std::cell::RefCell::new(None) };
}

/// The disk copy of the backup `start` made last on this thread.
fn disk_copy() -> Vec<u8> {
    DISK_COPY.with(|d| d.borrow().as_ref().unwrap().get())
}

/// Backup after the initial copy of `g`.
fn start(p: &mut Primary, g: &Guest) -> Backup<Vec<u8>> {
    let disk = Shared(Arc::new(Mutex::new(vec![0u8; DISK])));
    DISK_COPY.with(|d| *d.borrow_mut() = Some(disk.clone()));
    let mut bk = Backup::new(vec![0u8; PAGES * P]).with_disk(Box::new(disk));
    let mut frames = vec![p.begin(0, &g.mem, DISK as u64).unwrap()];
    frames.extend(p.base_frames(&g.mem, 16));
    frames.extend(p.disk_base_frames(&g.disk, 4096));
    for f in &frames {
        bk.handle(f).unwrap();
    }
    bk
}

/// A large step of the guest: `n` pages (every page when `n` ≥ PAGES), and its disk writes.
fn big_step(g: &mut Guest, seq: u64, n: usize) -> tandem_test_support::Step {
    // The fake guest's own step for its disk writes; its memory writes are replaced by ours.
    let mem = g.mem.clone();
    let (_, _, writes) = g.step(seq);
    g.mem = mem;
    let pfns: Vec<u64> = (0..PAGES as u64)
        .step_by((PAGES / n.clamp(1, PAGES)).max(1))
        .collect();
    let mut pages = Vec::new();
    for &pfn in &pfns {
        let o = pfn as usize * P;
        // Half the page changes, so the codec has something to delta against.
        for b in &mut g.mem[o..o + P / 2] {
            *b = b.wrapping_add(seq as u8 | 1);
        }
        pages.extend_from_slice(&g.mem[o..o + P]);
    }
    (pfns, pages, writes)
}

/// Epoch `seq` in parts of at most `parts` (the part frames, then the epoch frame).
fn epoch_in_parts(
    p: &mut Primary,
    g: &mut Guest,
    seq: u64,
    n: usize,
    parts: Parts,
) -> (Vec<Frame>, Frame) {
    let (pfns, pages, writes) = big_step(g, seq, n);
    let dev = vec![seq as u8; 300];
    let mut sent = Vec::new();
    let (last, _) = p
        .epoch_parts(
            &EpochInput {
                seq,
                pfns: &pfns,
                pages: &pages,
                device_state: &dev,
                disk_writes: Some(&writes),
            },
            parts,
            |f| {
                sent.push(f);
                true
            },
        )
        .unwrap();
    (sent, last)
}

/// A guest, its primary and a backup that committed epoch 1, sent in parts.
fn after_epoch_one() -> (Guest, Primary, Backup<Vec<u8>>) {
    let mut g = Guest::new(PAGES, DISK);
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    let mut bk = start(&mut p, &g);
    let (parts, last) = epoch_in_parts(&mut p, &mut g, 1, PAGES, SMALL);
    for f in parts.iter().chain([&last]) {
        bk.handle(f).unwrap();
    }
    (g, p, bk)
}

const SMALL: Parts = Parts {
    max_pages: 10,
    max_disk_bytes: 1000,
};

#[test]
fn an_epoch_in_parts_commits_whole_on_its_epoch_frame() {
    let mut g = Guest::new(PAGES, DISK);
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    let mut bk = start(&mut p, &g);
    for seq in 1..=3 {
        let (parts, last) = epoch_in_parts(&mut p, &mut g, seq, PAGES, SMALL);
        assert!(
            parts.len() >= 12,
            "128 pages in parts of 10: {}",
            parts.len()
        );
        for f in &parts {
            assert_eq!(f.kind, Kind::EpochPart);
            assert_eq!(bk.handle(f).unwrap(), Applied::Part(seq));
            assert_eq!(bk.committed(), seq - 1, "a part commits nothing");
        }
        assert!(bk.partial().is_some_and(|(s, bytes)| s == seq && bytes > 0));
        assert_eq!(bk.handle(&last).unwrap(), Applied::Committed(seq));
        assert_eq!(bk.partial(), None);
        assert!(bk.mirror() == &g.mem[..], "mirror after epoch {seq}");
        assert!(disk_copy() == g.disk, "disk copy after epoch {seq}");
        assert_eq!(bk.device_state(), &vec![seq as u8; 300][..]);
    }
    // A small epoch afterwards is one frame, as before.
    let (parts, last) = epoch_in_parts(&mut p, &mut g, 4, 4, Parts::DEFAULT);
    assert!(parts.is_empty());
    assert_eq!(bk.handle(&last).unwrap(), Applied::Committed(4));
    assert!(bk.mirror() == &g.mem[..]);
}

/// The backup holds exactly the committed epoch `seq` of `g` (memory and disk).
fn assert_at(bk: &Backup<Vec<u8>>, g: &Guest, seq: u64) {
    assert_eq!(bk.committed(), seq);
    assert_eq!(bk.partial(), None);
    assert!(bk.consistent());
    assert!(
        bk.mirror() == &g.mem[..],
        "mirror is not the committed epoch's"
    );
    assert!(
        disk_copy() == g.disk,
        "disk copy is not the committed epoch's"
    );
}

#[test]
fn a_refused_epoch_frame_undoes_its_parts() {
    let (mut g, mut p, mut bk) = after_epoch_one();
    let committed = Guest {
        mem: g.mem.clone(),
        disk: g.disk.clone(),
    };
    let (parts, mut last) = epoch_in_parts(&mut p, &mut g, 2, PAGES, SMALL);
    for f in &parts {
        bk.handle(f).unwrap();
    }
    assert!(
        bk.mirror() != &committed.mem[..],
        "the parts are applied in place"
    );
    // The epoch frame's memory record is damaged: everything of epoch 2 is undone.
    let n = last.payload.len();
    last.payload[n / 2] ^= 0x40;
    assert!(bk.handle(&last).is_err());
    assert_at(&bk, &committed, 1);
    assert_eq!(bk.device_state(), &vec![1u8; 300][..]);
}

#[test]
fn a_link_that_ends_inside_an_epoch_leaves_the_committed_one() {
    let (mut g, mut p, mut bk) = after_epoch_one();
    let committed = Guest {
        mem: g.mem.clone(),
        disk: g.disk.clone(),
    };
    let (parts, _) = epoch_in_parts(&mut p, &mut g, 2, PAGES, SMALL);
    for f in &parts[..parts.len() / 2] {
        bk.handle(f).unwrap();
    }
    // The daemon discards a partial epoch when the connection ends; materialise (the
    // standby's resume) does it too.
    assert_eq!(bk.discard_partial(), Some(2));
    assert_eq!(bk.discard_partial(), None);
    assert_at(&bk, &committed, 1);
    for f in &parts[..3] {
        bk.handle(f).unwrap();
    }
    bk.materialise().unwrap();
    assert_at(&bk, &committed, 1);
}

#[test]
fn parts_out_of_order_or_of_another_epoch_are_refused_and_undone() {
    let (mut g, mut p, mut bk) = after_epoch_one();
    let committed = Guest {
        mem: g.mem.clone(),
        disk: g.disk.clone(),
    };
    let (parts, _) = epoch_in_parts(&mut p, &mut g, 2, PAGES, SMALL);
    bk.handle(&parts[0]).unwrap();
    // A later part before its predecessor: its record does not verify against the mirror.
    assert!(bk.handle(&parts[2]).is_err());
    assert_at(&bk, &committed, 1);
    // A part of a later epoch.
    let mut skip = parts[0].clone();
    skip.seq = 3;
    assert!(matches!(
        bk.handle(&skip),
        Err(ApplyError::SeqGap {
            expected: 2,
            got: 3
        })
    ));
    // A part with device state: only its epoch frame may carry it.
    let mut with_dev = parts[0].clone();
    with_dev.payload.extend_from_slice(&[4, 1, 0, 0, 0, 0]);
    bk.handle(&parts[0]).unwrap();
    assert!(matches!(
        bk.handle(&with_dev),
        Err(ApplyError::Malformed(_))
    ));
    assert_at(&bk, &committed, 1);
}

#[test]
fn a_new_session_during_an_epoch_voids_its_parts() {
    let mut g = Guest::new(PAGES, DISK);
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    let mut bk = start(&mut p, &g);
    let (parts, _) = epoch_in_parts(&mut p, &mut g, 1, PAGES, SMALL);
    for f in &parts[..4] {
        bk.handle(f).unwrap();
    }
    // The primary lost the link and starts over from its current memory.
    let mut frames = vec![p.begin(1, &g.mem, DISK as u64).unwrap()];
    frames.extend(p.base_frames(&g.mem, 16));
    frames.extend(p.disk_base_frames(&g.disk, 4096));
    for f in &frames {
        bk.handle(f).unwrap();
    }
    assert_eq!(bk.partial(), None);
    let (parts, last) = epoch_in_parts(&mut p, &mut g, 2, PAGES, SMALL);
    for f in parts.iter().chain([&last]) {
        bk.handle(f).unwrap();
    }
    assert_at(&bk, &g, 2);
}

#[test]
fn a_part_that_cannot_be_sent_ends_the_session() {
    let mut g = Guest::new(PAGES, DISK);
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    let _bk = start(&mut p, &g);
    let (pfns, pages, writes) = big_step(&mut g, 1, PAGES);
    let input = EpochInput {
        seq: 1,
        pfns: &pfns,
        pages: &pages,
        device_state: &[],
        disk_writes: Some(&writes),
    };
    let r = p.epoch_parts(&input, SMALL, |_| false);
    assert!(matches!(
        r,
        Err(tandem_replication::PrimaryError::PartNotSent { seq: 1 })
    ));
    // The encoder is past what the backup holds: no epoch until a new session.
    assert!(matches!(
        p.epoch(&input),
        Err(tandem_replication::PrimaryError::NoSession)
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Any part sizes give the backup the guest's memory and disk, and the same device state.
    #[test]
    fn any_split_replicates_the_same_state(
        max_pages in 1usize..64,
        max_disk_bytes in 1usize..5000,
        sizes in proptest::collection::vec(1usize..=PAGES, 1..4),
    ) {
        let mut g = Guest::new(PAGES, DISK);
        let mut p = Primary::new(VM, Codec::Tandem, Config::default());
        let mut bk = start(&mut p, &g);
        let parts = Parts { max_pages, max_disk_bytes };
        for (i, n) in sizes.into_iter().enumerate() {
            let seq = i as u64 + 1;
            let (frames, last) = epoch_in_parts(&mut p, &mut g, seq, n, parts);
            for f in frames.iter().chain([&last]) {
                bk.handle(f).unwrap();
            }
            prop_assert!(bk.mirror() == &g.mem[..]);
            prop_assert!(disk_copy() == g.disk);
            prop_assert_eq!(bk.device_state(), &vec![seq as u8; 300][..]);
        }
    }
}
