//! Writes seed inputs for the `replication_frames` fuzz target: `replication_corpus DIR`.

use tandem_codec::{Codec, Config, Encoder};
use tandem_replication::devstate::{encode_delta, encode_runs};
use tandem_replication::fuzz::FUZZ_DISK;
use tandem_replication::wire::{epoch_payload, section};
use tandem_replication::{base_payload, hello_payload, EpochInput, Frame, Kind, Parts, Primary};

fn main() {
    let dir = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .expect("usage: replication_corpus DIR"),
    );
    std::fs::create_dir_all(&dir).unwrap();
    const P: usize = 4096;
    let mem: Vec<u8> = (0..16 * P).map(|i| (i % 13) as u8).collect();
    let f = |kind, seq, payload| Frame {
        kind,
        vm_id: 9,
        seq,
        payload,
    };
    let mut stream = Vec::new();
    f(
        Kind::Hello,
        0,
        hello_payload(mem.len() as u64, FUZZ_DISK as u64),
    )
    .write_to(&mut stream)
    .unwrap();
    f(Kind::Base, 0, base_payload(0, &mem))
        .write_to(&mut stream)
        .unwrap();
    let mut enc = Encoder::new(Codec::Tandem, &mem, Config::default()).unwrap();
    let mut next = mem.clone();
    next[5 * P + 9] = 0xee;
    let mut rec = Vec::new();
    enc.encode(1, &[5], &next[5 * P..6 * P], &mut rec).unwrap();
    let payload = epoch_payload(&[(section::MEMORY, &rec), (section::DEVICE_STATE, b"dev")]);
    f(Kind::Epoch, 1, payload).write_to(&mut stream).unwrap();
    // Epoch 2: device-state delta (the dense form of older primaries) and disk writes.
    next[7 * P + 1] = 0x11;
    let mut rec = Vec::new();
    enc.encode(2, &[7], &next[7 * P..8 * P], &mut rec).unwrap();
    let mut delta = Vec::new();
    encode_delta(b"dev", b"dew-more", &mut delta);
    let disk = tandem_disk::encode_writes(&[(512, vec![7; 512]), (4096, vec![1; 8])]);
    let payload = epoch_payload(&[
        (section::MEMORY, &rec),
        (section::DEVICE_STATE_DELTA, &delta),
        (section::DISK, &disk),
    ]);
    f(Kind::Epoch, 2, payload).write_to(&mut stream).unwrap();
    // Epoch 3: device state as changed runs (what a primary sends).
    next[9 * P + 2] = 0x22;
    let mut rec = Vec::new();
    enc.encode(3, &[9], &next[9 * P..10 * P], &mut rec).unwrap();
    let mut runs = Vec::new();
    encode_runs(b"dew-more", b"dew-mord-and-more", &mut runs);
    let payload = epoch_payload(&[(section::MEMORY, &rec), (section::DEVICE_STATE_RUNS, &runs)]);
    f(Kind::Epoch, 3, payload).write_to(&mut stream).unwrap();
    f(Kind::DiskBase, 0, base_payload(0, &[3; 1024]))
        .write_to(&mut stream)
        .unwrap();
    f(Kind::Bye, 0, vec![]).write_to(&mut stream).unwrap();
    f(Kind::Heartbeat, 0, vec![]).write_to(&mut stream).unwrap();
    std::fs::write(dir.join("session"), &stream).unwrap();
    std::fs::write(dir.join("session-cut"), &stream[..stream.len() - 40]).unwrap();
    let mut hello_only = Vec::new();
    f(
        Kind::Hello,
        0,
        hello_payload(mem.len() as u64, FUZZ_DISK as u64),
    )
    .write_to(&mut hello_only)
    .unwrap();
    std::fs::write(dir.join("hello"), &hello_only).unwrap();
    std::fs::write(dir.join("garbage"), b"TNDR\x01\x00\x07\x00").unwrap();
    std::fs::write(dir.join("empty"), b"").unwrap();
    std::fs::write(dir.join("epoch-parts"), epochs_in_parts()).unwrap();
}

/// A session whose two epochs go in parts of 5 pages and 1 KiB of disk writes.
fn epochs_in_parts() -> Vec<u8> {
    const P: usize = 4096;
    let mut mem: Vec<u8> = (0..16 * P).map(|i| (i / 5 % 251) as u8).collect();
    let disk = vec![3u8; FUZZ_DISK];
    let mut p = Primary::new(9, Codec::Tandem, Config::default());
    let mut frames = vec![p.begin(0, &mem, FUZZ_DISK as u64).unwrap()];
    frames.extend(p.base_frames(&mem, 4));
    frames.extend(p.disk_base_frames(&disk, 4096));
    let pfns: Vec<u64> = (0..16).collect();
    for seq in 1..=2u64 {
        for b in mem.iter_mut().step_by(97) {
            *b = b.wrapping_add(seq as u8);
        }
        let writes = vec![(0u64, vec![seq as u8; 3000]), (8192, vec![7u8; 100])];
        let input = EpochInput {
            seq,
            pfns: &pfns,
            pages: &mem,
            device_state: &[1, 2, 3],
            disk_writes: Some(&writes),
        };
        let parts = Parts {
            max_pages: 5,
            max_disk_bytes: 1024,
        };
        let (last, _) = p
            .epoch_parts(&input, parts, |f| {
                frames.push(f);
                true
            })
            .unwrap();
        frames.push(last);
    }
    let mut out = Vec::new();
    for f in &frames {
        f.write_to(&mut out).unwrap();
    }
    out
}
