//! Writes seed inputs for the `replication_frames` fuzz target: `replication_corpus DIR`.

use tandem_codec::{Codec, Config, Encoder};
use tandem_replication::devstate::encode_delta;
use tandem_replication::fuzz::FUZZ_DISK;
use tandem_replication::wire::{epoch_payload, section};
use tandem_replication::{base_payload, hello_payload, Frame, Kind};

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
    // Epoch 2: device-state delta and disk writes.
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
}
