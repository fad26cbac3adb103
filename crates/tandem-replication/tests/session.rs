//! Sessions built with the library's `Primary` (the same code the daemon runs) and applied by
//! `Backup`: epochs with disk writes, a re-sync after a lost link, ack validation, handover
//! and bye, an epoch whose disk write fails half-way, a hello whose disk zeroing fails and
//! hellos of a primary that fences otherwise.

use std::time::{Duration, Instant};

use tandem_codec::{Codec, Config};
use tandem_replication::{
    AckError, Acks, Applied, ApplyError, Backup, DiskCopy, EpochInput, Fencing, Frame, Kind,
    Primary, Reply,
};

const P: usize = 4096;
const PAGES: usize = 128;
const DISK: usize = 64 * 1024;
const VM: u64 = 0x51;

type Guest = tandem_test_support::FakeGuest;

fn new_guest() -> Guest {
    Guest::new(PAGES, DISK)
}

fn epoch_frame(p: &mut Primary, g: &mut Guest, seq: u64) -> Frame {
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
fn session_start(p: &mut Primary, g: &Guest, start: u64) -> Vec<Frame> {
    let mut v = vec![p.begin(start, &g.mem, DISK as u64).unwrap()];
    v.extend(p.base_frames(&g.mem, 16));
    v.extend(p.disk_base_frames(&g.disk, 4096));
    v
}

fn new_backup() -> Backup<Vec<u8>> {
    Backup::new(vec![0u8; PAGES * P]).with_disk(Box::new(vec![0u8; DISK]))
}

fn apply<M: AsRef<[u8]> + AsMut<[u8]>>(bk: &mut Backup<M>, frames: &[Frame]) {
    for f in frames {
        bk.handle(f).unwrap();
    }
}

#[test]
fn epochs_with_disk_writes_and_a_resync_reach_the_same_state() {
    epochs_and_a_resync(Config::default());
}

#[test]
fn an_encoder_with_threads_replicates_the_same_state() {
    // `tandem primary --encoder-threads 2`; one page per thread, so even these small epochs
    // go to the pool (the state update beside the record's compression).
    epochs_and_a_resync(Config {
        threads: 2,
        min_pages_per_thread: 1,
        ..Config::default()
    });
}

fn epochs_and_a_resync(cfg: Config) {
    let mut g = new_guest();
    let mut p = Primary::new(VM, Codec::Tandem, cfg);
    let mut bk = new_backup();
    apply(&mut bk, &session_start(&mut p, &g, 0));
    assert!(!bk.consistent(), "no epoch committed yet");
    for seq in 1..=10 {
        let f = epoch_frame(&mut p, &mut g, seq);
        assert_eq!(bk.handle(&f).unwrap(), Applied::Committed(seq));
        assert!(bk.consistent());
    }
    assert!(bk.mirror() == &g.mem[..]);
    // The link breaks; the primary runs epochs 11..=14 unacknowledged (they never arrive),
    // then reconnects: a new session starts at epoch 14 and resends everything.
    for seq in 11..=14 {
        let _ = epoch_frame(&mut p, &mut g, seq);
    }
    let resync = session_start(&mut p, &g, 14);
    assert_eq!(bk.handle(&resync[0]).unwrap(), Applied::Hello);
    assert!(
        !bk.consistent(),
        "a re-sync in progress is nothing to resume"
    );
    apply(&mut bk, &resync[1..]);
    let f = epoch_frame(&mut p, &mut g, 15);
    assert_eq!(bk.handle(&f).unwrap(), Applied::Committed(15));
    assert!(bk.consistent());
    assert!(
        bk.mirror() == &g.mem[..],
        "mirror differs after the re-sync"
    );
    assert_eq!(bk.device_state(), &vec![15u8; 500][..]);
}

#[test]
fn acks_are_validated() {
    let t = Instant::now();
    let mut acks = Acks::new(VM, 10);
    let mut lat = Vec::new();
    let ack = |vm, seq, ok| {
        let mut f = tandem_replication::wire::ack_frame(vm, seq, ok, Duration::from_millis(300));
        f.vm_id = vm;
        f
    };
    assert_eq!(
        acks.on_frame(&ack(VM, 11, true), &mut lat),
        Err(AckError::NotSent { got: 11, sent: 10 })
    );
    acks.sent(11, t);
    acks.sent(12, t);
    assert!(matches!(
        acks.on_frame(&ack(VM + 1, 11, true), &mut lat),
        Err(AckError::WrongVm { .. })
    ));
    assert_eq!(
        acks.on_frame(&ack(VM, 12, false), &mut lat),
        Ok(Reply::Acked {
            seq: 12,
            epochs: 2,
            can_fail_over: false,
            promise: Some(Duration::from_millis(300)),
        })
    );
    assert_eq!(lat.len(), 2);
    assert!(!acks.can_fail_over());
    assert_eq!(
        acks.on_frame(&ack(VM, 12, true), &mut lat),
        Err(AckError::Backwards { got: 12, acked: 12 })
    );
    assert_eq!(acks.oldest_unacked(Instant::now()), None);
    let fenced = Frame {
        kind: Kind::Fenced,
        vm_id: VM,
        seq: 9,
        payload: vec![],
    };
    assert_eq!(
        acks.on_frame(&fenced, &mut lat),
        Ok(Reply::Fenced {
            epoch: 9,
            session: None
        })
    );
    assert_eq!(
        acks.on_frame(&tandem_replication::wire::fenced_frame(VM, 9, 7), &mut lat),
        Ok(Reply::Fenced {
            epoch: 9,
            session: Some(7)
        })
    );
    assert_eq!(
        acks.on_frame(&tandem_replication::wire::refused_frame(VM, "no"), &mut lat),
        Ok(Reply::Refused("no".into()))
    );
    let epoch = Frame {
        kind: Kind::Epoch,
        ..fenced
    };
    assert_eq!(
        acks.on_frame(&epoch, &mut lat),
        Err(AckError::Unexpected(Kind::Epoch))
    );
}

#[test]
fn handover_only_from_the_committed_epoch_and_bye_forbids_failover() {
    let mut g = new_guest();
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    let mut bk = new_backup();
    apply(&mut bk, &session_start(&mut p, &g, 0));
    assert!(bk.handle(&p.handover(0)).is_err(), "nothing committed yet");
    for seq in 1..=3 {
        bk.handle(&epoch_frame(&mut p, &mut g, seq)).unwrap();
    }
    assert!(
        bk.handle(&p.handover(2)).is_err(),
        "not the committed epoch"
    );
    assert_eq!(bk.handle(&p.handover(3)).unwrap(), Applied::Handover(3));
    assert_eq!(bk.handle(&p.bye()).unwrap(), Applied::Bye);
    assert!(
        !bk.consistent(),
        "a guest shut down on purpose must not be resumed"
    );
}

/// A disk copy whose write fails once, after `budget` writes were made (rewriting bytes that
/// were already written works again: they are allocated).
struct Full {
    d: Vec<u8>,
    budget: usize,
}

impl DiskCopy for Full {
    fn size(&self) -> u64 {
        self.d.len() as u64
    }
    fn read_at(&self, o: u64, b: &mut [u8]) -> std::io::Result<()> {
        self.d.read_at(o, b)
    }
    fn write_at(&mut self, o: u64, data: &[u8]) -> std::io::Result<()> {
        if self.budget == 0 {
            self.budget = usize::MAX;
            return Err(std::io::Error::from_raw_os_error(28));
        }
        self.budget -= 1;
        self.d.write_at(o, data)
    }
    fn zero(&mut self) -> std::io::Result<()> {
        if self.budget == 0 {
            return Err(std::io::Error::from_raw_os_error(28));
        }
        self.d.zero()
    }
}

#[test]
fn a_hello_that_fails_after_zeroing_leaves_nothing_to_fail_over_to() {
    // Finding 5: the mirror was zeroed, then zeroing the disk copy failed (ENOSPC) and the
    // backup stayed marked consistent: a later failover would resume a guest of zeros.
    let mut g = new_guest();
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    let mut bk = Backup::new(vec![0u8; PAGES * P]).with_disk(Box::new(Full {
        d: vec![0u8; DISK],
        budget: usize::MAX - 1,
    }));
    p.set_session(5);
    apply(&mut bk, &session_start(&mut p, &g, 0));
    bk.handle(&epoch_frame(&mut p, &mut g, 1)).unwrap();
    assert!(bk.consistent());
    assert_eq!(bk.session(), 5);
    // The disk copy can write no more, not even zeros.
    let mut bk = {
        let mut failing = Backup::new(vec![0u8; PAGES * P]).with_disk(Box::new(Full {
            d: vec![0u8; DISK],
            budget: 16 + 3,
        }));
        apply(&mut failing, &session_start(&mut p, &g, 1));
        failing.handle(&epoch_frame(&mut p, &mut g, 2)).unwrap();
        assert!(failing.consistent());
        failing
    };
    p.set_session(6);
    let hello = p.begin(2, &g.mem, DISK as u64).unwrap();
    assert!(matches!(bk.handle(&hello), Err(ApplyError::DiskIo(_))));
    assert!(!bk.consistent(), "a half-zeroed copy must not be resumed");
    assert_eq!(bk.session(), 0, "nor taken over as any session");
}

#[test]
fn a_primary_that_fences_otherwise_is_refused_before_anything_changes() {
    let mut g = new_guest();
    let etcd = Fencing::Etcd {
        cluster_id: 1,
        key_hash: 2,
    };
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    p.set_fencing(etcd);
    let mut bk = new_backup();
    bk.set_fencing(etcd);
    apply(&mut bk, &session_start(&mut p, &g, 0));
    bk.handle(&epoch_frame(&mut p, &mut g, 1)).unwrap();
    let mem = bk.mirror().to_vec();
    // Finding 1: a primary without --etcd (or another record) next to a backup with it.
    for other in [
        Fencing::None,
        Fencing::Etcd {
            cluster_id: 1,
            key_hash: 3,
        },
    ] {
        p.set_fencing(other);
        let hello = p.begin(1, &g.mem, DISK as u64).unwrap();
        let e = bk.handle(&hello).unwrap_err();
        assert!(matches!(e, ApplyError::Fencing(_)), "{e}");
        assert!(bk.consistent(), "a refused hello changes nothing");
        assert!(bk.mirror() == &mem[..]);
    }
    // And the other way round.
    let mut plain = new_backup();
    p.set_fencing(etcd);
    let e = plain
        .handle(&p.begin(0, &g.mem, DISK as u64).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("--etcd"), "{e}");
}

#[test]
fn a_disk_write_failing_half_way_leaves_the_committed_epoch_whole() {
    let mut g = new_guest();
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    // Initial disk chunks (16 of 4 KiB) + 3 writes per epoch for 2 epochs, then 1 more.
    let mut bk = Backup::new(vec![0u8; PAGES * P]).with_disk(Box::new(Full {
        d: vec![0u8; DISK],
        budget: 16 + 3 * 2 + 1,
    }));
    for f in session_start(&mut p, &g, 0) {
        bk.handle(&f).unwrap();
    }
    let mut mem_at_2 = Vec::new();
    for seq in 1..=3 {
        let f = epoch_frame(&mut p, &mut g, seq);
        match bk.handle(&f) {
            Ok(Applied::Committed(s)) => {
                assert!(s <= 2);
                mem_at_2 = bk.mirror().to_vec();
            }
            Err(ApplyError::DiskIo(_)) => assert_eq!(seq, 3),
            other => panic!("epoch {seq}: {other:?}"),
        }
    }
    assert_eq!(bk.committed(), 2);
    assert!(
        bk.consistent(),
        "the failed epoch was undone, epoch 2 is whole"
    );
    assert!(bk.mirror() == &mem_at_2[..]);
}
