//! A backup whose mirror is consolidated (tandem-consolidate's page keeper) applies every epoch
//! of sessions built with the library's `Primary`, and materialises exactly the guest's memory.

use tandem_codec::{Codec, Config};
use tandem_consolidate::Consolidated;
use tandem_replication::{Applied, Backup, EpochInput, Frame, PageKeeper, Primary};
use tandem_test_support::FakeGuest;

const P: usize = 4096;
const PAGES: usize = 128;
const DISK: usize = 64 * 1024;
const VM: u64 = 0x51;

fn epoch_frame(p: &mut Primary, g: &mut FakeGuest, seq: u64) -> Frame {
    let (pfns, pages, writes) = g.step(seq);
    let dev = vec![seq as u8; 500];
    p.epoch(&EpochInput {
        seq,
        pfns: &pfns,
        pages: &pages,
        device_state: &dev,
        disk_writes: Some(&writes),
    })
    .unwrap()
    .0
}

/// Hello and initial copy of a session starting at `start`.
fn session_start(p: &mut Primary, g: &FakeGuest, start: u64) -> Vec<Frame> {
    let mut v = vec![p.begin(start, &g.mem, DISK as u64).unwrap()];
    v.extend(p.base_frames(&g.mem, 16));
    v.extend(p.disk_base_frames(&g.disk, 4096));
    v
}

fn apply<M: AsRef<[u8]> + AsMut<[u8]>, K: PageKeeper>(bk: &mut Backup<M, K>, frames: &[Frame]) {
    for f in frames {
        bk.handle(f).unwrap();
    }
}

#[test]
fn a_consolidated_mirror_applies_every_epoch_and_materialises_exactly() {
    use std::sync::{Arc, Mutex};
    let mut g = FakeGuest::new(PAGES, DISK);
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    let pool = Arc::new(Mutex::new(tandem_consolidate::Pool::new()));
    // A clock that goes round the whole mirror after every epoch: every page not used by
    // that epoch leaves the mirror, so the next epochs must restore what they read.
    let keeper = Consolidated::new(PAGES * P, pool.clone(), std::time::Duration::from_nanos(1));
    let mut bk = Backup::with_keeper(tandem_consolidate::shm(PAGES * P).unwrap(), keeper)
        .with_disk(Box::new(vec![0u8; DISK]));
    for start in [0, 20] {
        if start > 0 {
            for seq in 11..=start {
                let _ = epoch_frame(&mut p, &mut g, seq); // lost with the link
            }
        }
        apply(&mut bk, &session_start(&mut p, &g, start));
        for seq in start + 1..=start + 10 {
            let f = epoch_frame(&mut p, &mut g, seq);
            assert_eq!(bk.handle(&f).unwrap(), Applied::Committed(seq));
            bk.tick();
        }
        let u = bk.keeper().usage();
        assert!(u.plain < PAGES as u64 / 2, "the clock moved little: {u:?}");
        assert!(
            bk.mirror() != &g.mem[..],
            "consolidated pages read as holes"
        );
        assert!(bk.materialise().unwrap() > 0);
        assert!(bk.mirror() == &g.mem[..], "session from {start}");
    }
    assert!(!pool.lock().unwrap().is_empty() || bk.keeper().usage().plain == PAGES as u64);
}
