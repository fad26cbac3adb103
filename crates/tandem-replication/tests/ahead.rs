//! Memory records encoded ahead (`Primary::lend_encoder`, `MemoryJob::encode` on another
//! thread, `Primary::epoch_encoded`): the frames are the ones `Primary::epoch` makes of the
//! same epochs, the backup applies them, and a record of another epoch ends the session.

use tandem_codec::{Codec, Config};
use tandem_replication::{Backup, EpochInput, Parts, Primary, PrimaryError};

const PAGES: usize = 256;
const DISK: usize = 64 * 1024;
const VM: u64 = 0x5a;

type Guest = tandem_test_support::FakeGuest;

fn primary(g: &Guest) -> Primary {
    let mut p = Primary::new(VM, Codec::Tandem, Config::default());
    p.begin(0, &g.mem, DISK as u64).unwrap();
    p
}

#[test]
fn a_record_encoded_ahead_makes_the_frame_the_epoch_makes_whole() {
    let mut g = Guest::new(PAGES, DISK);
    let (mut whole, mut ahead) = (primary(&g), primary(&g));
    let mut bk = Backup::new(vec![0u8; PAGES * 4096]);
    bk.handle(&whole.begin(0, &g.mem, 0).unwrap()).unwrap();
    for f in whole.base_frames(&g.mem, 16) {
        bk.handle(&f).unwrap();
    }
    for seq in 1..=25u64 {
        let (pfns, pages, _) = g.step(seq);
        // Device state that changes a little every epoch, like QEMU's.
        let mut dev = vec![7u8; 3000];
        dev[seq as usize * 11] = seq as u8;
        let input = EpochInput {
            seq,
            pfns: &pfns,
            pages: &pages,
            device_state: &dev,
            disk_writes: None,
        };
        assert!(Parts::DEFAULT.whole(pfns.len(), None));
        let expected = whole.epoch(&input).unwrap();
        let job = ahead.lend_encoder(seq).unwrap();
        assert_eq!(job.seq(), seq);
        // While the encoder is lent, nothing else can be encoded.
        assert!(matches!(ahead.epoch(&input), Err(PrimaryError::NoSession)));
        let (pf, pg) = (pfns.clone(), pages.clone());
        let rec = std::thread::spawn(move || job.encode(&pf, &pg))
            .join()
            .unwrap();
        let without_pages = EpochInput {
            pages: &[],
            ..input
        };
        let got = ahead.epoch_encoded(&without_pages, rec).unwrap();
        assert_eq!(got.0, expected.0, "epoch {seq}'s frame");
        assert_eq!(got.1, expected.1, "epoch {seq}'s sizes");
        bk.handle(&got.0).unwrap();
        assert_eq!(bk.committed(), seq);
        assert_eq!(bk.mirror(), &g.mem[..], "backup's memory after epoch {seq}");
        assert_eq!(bk.device_state(), &dev[..]);
    }
}

#[test]
fn a_record_of_another_epoch_ends_the_session() {
    let mut g = Guest::new(PAGES, DISK);
    let mut p = primary(&g);
    let (pfns, pages, _) = g.step(1);
    let rec = p.lend_encoder(1).unwrap().encode(&pfns, &pages);
    let input = EpochInput {
        seq: 2,
        pfns: &pfns,
        pages: &pages,
        device_state: &[1, 2, 3],
        disk_writes: None,
    };
    let err = p.epoch_encoded(&input, rec).unwrap_err();
    assert!(
        matches!(
            err,
            PrimaryError::WrongRecord {
                seq: 2,
                record_seq: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("not of epoch 2"), "{err}");
    // The encoder moved past what the backup holds: no epoch is assembled any more.
    assert!(matches!(p.epoch(&input), Err(PrimaryError::NoSession)));
}

#[test]
fn a_record_encoded_ahead_carries_the_epochs_disk_writes() {
    let mut g = Guest::new(PAGES, DISK);
    let (mut whole, mut ahead) = (primary(&g), primary(&g));
    for seq in 1..=10u64 {
        let (pfns, pages, writes) = g.step(seq);
        let input = EpochInput {
            seq,
            pfns: &pfns,
            pages: &pages,
            device_state: &[seq as u8; 100],
            disk_writes: Some(&writes),
        };
        let expected = whole.epoch(&input).unwrap();
        let rec = ahead.lend_encoder(seq).unwrap().encode(&pfns, &pages);
        let got = ahead.epoch_encoded(&input, rec).unwrap();
        assert_eq!(got, expected, "epoch {seq}");
        assert_eq!(got.1.disk_writes, writes.len() as u64);
    }
}
