//! Time of one epoch's device-state delta on the primary (and its decoding on the backup):
//! tandem's encoder (the changed runs
//! only) against the one before it (every byte XORed and compressed, with the same reused
//! zstd context), side by side:
//! `cargo run --release -p tandem-replication --example devstate_delta`.
//!
//! The stream is 600 KiB (QEMU's device state with the ROM pages framed in is about that)
//! with 200 bytes changed per epoch, either spread over the whole stream (the worst case for
//! the runs) or in three places (registers, queue indices, timers: how QEMU's changes
//! cluster), 300 epochs per side, three rounds alternating the sides.

use std::time::Instant;

use tandem_replication::devstate::{decode_delta, decode_runs, encode_runs_into};

/// The encoder before the sparse form: the whole stream XORed and compressed.
fn dense(prev: &mut Vec<u8>, cur: &[u8], out: &mut Vec<u8>) {
    prev.resize(cur.len(), 0);
    for (o, p) in prev.iter_mut().zip(cur) {
        *o ^= p;
    }
    out.clear();
    tandem_codec::prefix::compress_alone(prev, 1, out).expect("in memory");
    out.splice(0..0, (cur.len() as u32).to_le_bytes());
    prev.copy_from_slice(cur);
}

fn main() {
    let n = 600 << 10;
    for spread in [true, false] {
        let mut prev: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        let mut out = Vec::new();
        for round in 1..=3 {
            for (name, sparse) in [("before (dense)", false), ("tandem (runs)", true)] {
                let mut kept = prev.clone();
                let (mut us, mut back_us) = (Vec::new(), Vec::new());
                for k in 0..300usize {
                    let mut cur = prev.clone();
                    for j in 0..200 {
                        let at = if spread {
                            (k * 7919 + j * 104_729) % n
                        } else {
                            [4096, 200_000, 500_000][j % 3] + (k + j) % 64
                        };
                        cur[at] ^= 0x5a;
                    }
                    let t = Instant::now();
                    if sparse {
                        encode_runs_into(&mut kept, &cur, &mut out);
                    } else {
                        dense(&mut kept, &cur, &mut out);
                    }
                    us.push(t.elapsed().as_micros());
                    let t = Instant::now();
                    let back = if sparse {
                        decode_runs(&prev, &out)
                    } else {
                        decode_delta(&prev, &out)
                    };
                    back_us.push(t.elapsed().as_micros());
                    assert_eq!(back.ok().as_deref(), Some(&cur[..]), "{name}: round trip");
                    prev = cur;
                }
                us.sort_unstable();
                back_us.sort_unstable();
                println!(
                    "{} changes, round {round}, {name}: encode median {} µs, p90 {} µs; \
                     decode median {} µs; {} bytes",
                    if spread { "spread" } else { "clustered" },
                    us[us.len() / 2],
                    us[us.len() * 9 / 10],
                    back_us[back_us.len() / 2],
                    out.len()
                );
            }
        }
    }
}
