//! The replication link over a real unix socket pair: primary encodes epochs with the codec,
//! backup verifies, commits and acks; bad frames are refused with the mirror unchanged.

use std::io::{BufReader, BufWriter, Write};
use std::os::unix::net::UnixStream;

use tandem_codec::{Codec, Config, Encoder};
use tandem_replication::wire::{epoch_payload, section, VERSION};
use tandem_replication::{
    base_payload, hello_payload, Applied, ApplyError, Backup, EpochInput, Frame, Kind, Primary,
    WireError,
};

const P: usize = 4096;
const PAGES: usize = 256;
const VM: u64 = 0x7a4d_0001;

fn step(mem: &mut [u8], epoch: u64) -> (Vec<u64>, Vec<u8>) {
    let mut pfns: Vec<u64> = (0..40)
        .map(|k| (epoch * 37 + k * 11) % PAGES as u64)
        .collect();
    pfns.sort_unstable();
    pfns.dedup();
    let mut data = Vec::new();
    for &p in &pfns {
        let pg = &mut mem[p as usize * P..(p as usize + 1) * P];
        pg[(epoch as usize * 13) % P] ^= 0x5a;
        pg[(p as usize * 7) % P] = epoch as u8;
        data.extend_from_slice(pg);
    }
    (pfns, data)
}

fn frame(kind: Kind, seq: u64, payload: Vec<u8>) -> Frame {
    Frame {
        kind,
        vm_id: VM,
        seq,
        payload,
    }
}

/// The frames a primary sends for `epochs` epochs from `mem`, built by the library's
/// `Primary` (the daemon's own code). The initial copy goes in 64-page chunks.
fn primary_frames(mem: &mut [u8], epochs: u64) -> Vec<Frame> {
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    let mut out = vec![p.begin(0, mem, 0).unwrap()];
    out.extend(p.base_frames(mem, 64));
    for e in 1..=epochs {
        let (pfns, data) = step(mem, e);
        let dev = vec![e as u8; 1000];
        let input = EpochInput {
            seq: e,
            pfns: &pfns,
            pages: &data,
            device_state: &dev,
            disk_writes: None,
        };
        out.push(p.epoch(&input).unwrap().0);
    }
    out
}

fn initial() -> Vec<u8> {
    (0..PAGES * P).map(|i| (i / 3 % 251) as u8).collect()
}

#[test]
fn epochs_over_a_socket_are_committed_and_acked() {
    let (a, b) = UnixStream::pair().unwrap();
    let mut mem = initial();
    let frames = primary_frames(&mut mem, 30);
    let backup = std::thread::spawn(move || {
        let mut bk = Backup::new(vec![0u8; PAGES * P]);
        let mut r = BufReader::new(b.try_clone().unwrap());
        let mut w = BufWriter::new(b);
        while let Some(f) = Frame::read_from(&mut r).unwrap() {
            if let Applied::Committed(seq) = bk.handle(&f).unwrap() {
                Frame {
                    kind: Kind::Ack,
                    vm_id: VM,
                    seq,
                    payload: vec![],
                }
                .write_to(&mut w)
                .unwrap();
                w.flush().unwrap();
            }
        }
        bk
    });
    let mut r = BufReader::new(a.try_clone().unwrap());
    let mut w = BufWriter::new(a.try_clone().unwrap());
    let mut acked = 0;
    for f in &frames {
        f.write_to(&mut w).unwrap();
        w.flush().unwrap();
        if f.kind == Kind::Epoch {
            let ack = Frame::read_from(&mut r).unwrap().unwrap();
            assert_eq!((ack.kind, ack.seq), (Kind::Ack, f.seq));
            acked = ack.seq;
        }
    }
    a.shutdown(std::net::Shutdown::Write).unwrap();
    let bk = backup.join().unwrap();
    assert_eq!(acked, 30);
    assert_eq!(bk.committed(), 30);
    assert_eq!(bk.device_state(), &vec![30u8; 1000][..]);
    assert!(
        bk.mirror() == &mem[..],
        "mirror differs from the primary's memory"
    );
}

/// Applies `frames[..upto]`, returning the backup.
fn backup_after(frames: &[Frame], upto: usize) -> Backup<Vec<u8>> {
    let mut bk = Backup::new(vec![0u8; PAGES * P]);
    for f in &frames[..upto] {
        bk.handle(f).unwrap();
    }
    bk
}

#[test]
fn bad_frames_are_refused_and_change_nothing() {
    let mut mem = initial();
    let frames = primary_frames(&mut mem, 5);
    let first_epoch = frames.iter().position(|f| f.kind == Kind::Epoch).unwrap();
    let upto = first_epoch + 2; // epochs 1 and 2 committed
    let check = |mutate: &dyn Fn(&mut Frame), want: &dyn Fn(&ApplyError) -> bool| {
        let mut bk = backup_after(&frames, upto);
        let before = bk.mirror().to_vec();
        let mut f = frames[upto].clone();
        mutate(&mut f);
        let err = bk.handle(&f).expect_err("bad frame accepted");
        assert!(want(&err), "unexpected error: {err}");
        assert_eq!(bk.committed(), 2);
        assert!(
            bk.mirror() == &before[..],
            "mirror changed by a refused frame"
        );
        assert_eq!(bk.device_state(), &vec![2u8; 1000][..]);
        // The right frame still applies afterwards.
        assert_eq!(bk.handle(&frames[upto]).unwrap(), Applied::Committed(3));
    };
    check(&|f| f.vm_id ^= 1, &|e| {
        matches!(e, ApplyError::WrongVm { .. })
    });
    check(&|f| f.seq = 4, &|e| {
        matches!(
            e,
            ApplyError::SeqGap {
                expected: 3,
                got: 4
            }
        )
    });
    check(&|f| f.seq = 2, &|e| matches!(e, ApplyError::SeqGap { .. }));
    check(
        &|f| {
            let n = f.payload.len();
            f.payload[n / 3] ^= 0x10; // inside the memory record: its CRC catches it
        },
        &|e| matches!(e, ApplyError::Decode(_) | ApplyError::Malformed(_)),
    );
    check(&|f| f.payload.truncate(10), &|e| {
        matches!(e, ApplyError::Malformed(_))
    });
}

#[test]
fn link_level_corruption_and_versions_are_detected() {
    let f = frame(Kind::Heartbeat, 0, vec![1, 2, 3]);
    let mut bytes = Vec::new();
    f.write_to(&mut bytes).unwrap();
    assert_eq!(Frame::read_from(&mut &bytes[..]).unwrap(), Some(f));
    let mut bad = bytes.clone();
    bad[33] ^= 1;
    assert!(matches!(
        Frame::read_from(&mut &bad[..]),
        Err(WireError::Checksum)
    ));
    let mut v2 = bytes.clone();
    v2[4..6].copy_from_slice(&(VERSION + 1).to_le_bytes());
    assert!(matches!(
        Frame::read_from(&mut &v2[..]),
        Err(WireError::Version(2))
    ));
    let mut magic = bytes.clone();
    magic[0] = b'X';
    assert!(matches!(
        Frame::read_from(&mut &magic[..]),
        Err(WireError::Magic)
    ));
    assert!(matches!(
        Frame::read_from(&mut &bytes[..20]),
        Err(WireError::Io(_))
    ));
    assert_eq!(Frame::read_from(&mut &b""[..]).unwrap(), None);
}

#[test]
fn nothing_before_hello_and_geometry_must_match() {
    let mut bk = Backup::new(vec![0u8; PAGES * P]);
    assert!(matches!(
        bk.handle(&frame(Kind::Base, 0, base_payload(0, &[0; P]))),
        Err(ApplyError::BeforeHello(Kind::Base))
    ));
    assert!(matches!(
        bk.handle(&frame(
            Kind::Hello,
            0,
            hello_payload(2 * (PAGES * P) as u64, 0)
        )),
        Err(ApplyError::Geometry(_))
    ));
    bk.handle(&frame(Kind::Hello, 0, hello_payload((PAGES * P) as u64, 0)))
        .unwrap();
    assert!(matches!(
        bk.handle(&frame(Kind::Base, 0, base_payload(PAGES as u64, &[0; P]))),
        Err(ApplyError::Malformed(_))
    ));
}

proptest::proptest! {
    #[test]
    fn any_bytes_never_panic_the_reader(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
        let _ = Frame::read_from(&mut &bytes[..]);
    }
}

#[test]
fn disk_writes_commit_with_their_epoch_or_not_at_all() {
    const DISK: usize = 64 * 1024;
    let mut mem = initial();
    let mut bk = Backup::new(mem.clone()).with_disk(Box::new(vec![0u8; DISK]));
    // Geometry: the disk size must match.
    assert!(matches!(
        bk.handle(&frame(
            Kind::Hello,
            0,
            hello_payload(mem.len() as u64, 4096)
        )),
        Err(ApplyError::Geometry(_))
    ));
    bk.handle(&frame(
        Kind::Hello,
        0,
        hello_payload(mem.len() as u64, DISK as u64),
    ))
    .unwrap();
    let mut base = 8u64.to_le_bytes().to_vec();
    base.extend_from_slice(b"base");
    assert_eq!(
        bk.handle(&frame(Kind::DiskBase, 0, base)).unwrap(),
        Applied::DiskBase
    );
    let mut enc = Encoder::new(Codec::Tandem, &mem, Config::default()).unwrap();
    let mut epoch = |mem: &mut Vec<u8>, e: u64, disk: &[u8]| {
        let (pfns, data) = step(mem, e);
        let mut rec = Vec::new();
        enc.encode(e, &pfns, &data, &mut rec).unwrap();
        frame(
            Kind::Epoch,
            e,
            epoch_payload(&[
                (section::MEMORY, &rec),
                (section::DEVICE_STATE, b"dev"),
                (section::DISK, disk),
            ]),
        )
    };
    let good =
        tandem_disk::encode_writes(&[(100, b"hello".to_vec()), (DISK as u64 - 2, b"zz".to_vec())]);
    let f1 = epoch(&mut mem, 1, &good);
    assert_eq!(bk.handle(&f1).unwrap(), Applied::Committed(1));
    // A write past the end of the disk: the whole epoch is refused, memory included.
    let bad = tandem_disk::encode_writes(&[(DISK as u64 - 1, b"xx".to_vec())]);
    let before = bk.mirror().to_vec();
    let f2 = epoch(&mut mem, 2, &bad);
    assert!(matches!(bk.handle(&f2), Err(ApplyError::Malformed(_))));
    assert_eq!(bk.mirror(), &before[..]);
    assert_eq!(bk.committed(), 1);
}

#[test]
fn device_state_deltas_chain_and_bad_ones_are_refused() {
    use tandem_replication::devstate::{encode_delta, encode_runs};
    let mut mem = initial();
    let mut bk = Backup::new(mem.clone());
    bk.handle(&frame(Kind::Hello, 0, hello_payload(mem.len() as u64, 0)))
        .unwrap();
    let mut enc = Encoder::new(Codec::Tandem, &mem, Config::default()).unwrap();
    let mut prev = Vec::new();
    for e in 1..=6u64 {
        let (pfns, data) = step(&mut mem, e);
        let mut rec = Vec::new();
        enc.encode(e, &pfns, &data, &mut rec).unwrap();
        let mut dev: Vec<u8> = (0..5000 + e as usize * 10)
            .map(|i| (i % 97) as u8)
            .collect();
        dev[e as usize * 3] = 0xee;
        // The runs form (what a primary sends) and the dense form of older primaries
        // alternate: both chain on the state the other left.
        let (kind, mut delta) = (
            if e % 2 == 1 {
                section::DEVICE_STATE_RUNS
            } else {
                section::DEVICE_STATE_DELTA
            },
            Vec::new(),
        );
        if kind == section::DEVICE_STATE_RUNS {
            encode_runs(&prev, &dev, &mut delta);
        } else {
            encode_delta(&prev, &dev, &mut delta);
        }
        if e == 6 {
            // A delta of either form that does not decompress: refused whole, state unchanged.
            let mut runs = Vec::new();
            encode_runs(&prev, &dev, &mut runs);
            for (kind, delta) in [
                (section::DEVICE_STATE_DELTA, &delta),
                (section::DEVICE_STATE_RUNS, &runs),
            ] {
                let mut bad = delta.clone();
                bad.truncate(bad.len() - 3);
                let before = bk.device_state().to_vec();
                let f = frame(
                    Kind::Epoch,
                    e,
                    epoch_payload(&[(section::MEMORY, &rec), (kind, &bad)]),
                );
                assert!(matches!(bk.handle(&f), Err(ApplyError::Malformed(_))));
                assert_eq!(bk.device_state(), &before[..]);
                assert_eq!(bk.committed(), 5);
            }
            // Two device-state sections in one epoch: refused.
            let f = frame(
                Kind::Epoch,
                e,
                epoch_payload(&[
                    (section::MEMORY, &rec),
                    (section::DEVICE_STATE_RUNS, &runs),
                    (section::DEVICE_STATE_DELTA, &delta),
                ]),
            );
            assert!(matches!(bk.handle(&f), Err(ApplyError::Malformed(_))));
            assert_eq!(bk.committed(), 5);
            return;
        }
        let f = frame(
            Kind::Epoch,
            e,
            epoch_payload(&[(section::MEMORY, &rec), (kind, &delta)]),
        );
        assert_eq!(bk.handle(&f).unwrap(), Applied::Committed(e));
        assert_eq!(bk.device_state(), &dev[..]);
        prev = dev;
    }
}

#[test]
fn a_repeated_initial_copy_starts_from_zeros() {
    let disk = tempfile::NamedTempFile::new().unwrap();
    disk.as_file().set_len(8192).unwrap();
    let f = disk.reopen().unwrap();
    let mut bk = Backup::new(vec![0u8; PAGES * P])
        .with_disk(Box::new(tandem_replication::FileDisk::new(f).unwrap()));
    let hello = frame(Kind::Hello, 0, hello_payload((PAGES * P) as u64, 8192));
    bk.handle(&hello).unwrap();
    bk.handle(&frame(Kind::Base, 0, base_payload(3, &[7; P])))
        .unwrap();
    bk.handle(&frame(Kind::DiskBase, 0, base_payload(100, &[9; 50])))
        .unwrap();
    assert!(bk.mirror().contains(&7));
    assert!(std::fs::read(disk.path()).unwrap().contains(&9));
    // The primary starts over before its first epoch committed.
    bk.handle(&hello).unwrap();
    assert!(bk.mirror().iter().all(|&b| b == 0));
    let d = std::fs::read(disk.path()).unwrap();
    assert_eq!(d.len(), 8192);
    assert!(d.iter().all(|&b| b == 0));
}
