//! Time of one epoch's device-state delta on the primary, tandem's encoder against the
//! previous one (a new zstd context and a new XOR buffer every epoch), side by side:
//! `cargo run --release -p tandem-replication --example devstate_delta`.
//!
//! The stream is 600 KiB (QEMU's device state here is about that) with 200 bytes changed per
//! epoch, 300 epochs per side, three rounds alternating the sides.

use std::time::Instant;

use tandem_replication::devstate::encode_delta_into;

/// The encoder without a kept previous state: a copy of the stream and a zstd context per
/// epoch.
fn per_epoch_context(prev: &[u8], cur: &[u8], out: &mut Vec<u8>) {
    let mut x = cur.to_vec();
    for (o, p) in x.iter_mut().zip(prev) {
        *o ^= p;
    }
    out.clear();
    out.extend_from_slice(&(cur.len() as u32).to_le_bytes());
    out.extend_from_slice(&zstd::bulk::compress(&x, 1).unwrap_or_default());
}

fn main() {
    let n = 600 << 10;
    let mut prev: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    let mut out = Vec::new();
    for round in 1..=3 {
        for (name, reused) in [("per-epoch context", false), ("reused context", true)] {
            // The reused side's own copy of the previous state, as `Primary` keeps one.
            let mut kept = prev.clone();
            let mut us = Vec::new();
            for k in 0..300usize {
                let mut cur = prev.clone();
                for j in 0..200 {
                    cur[(k * 7919 + j * 104_729) % n] ^= 0x5a;
                }
                let t = Instant::now();
                if reused {
                    encode_delta_into(&mut kept, &cur, &mut out);
                } else {
                    per_epoch_context(&prev, &cur, &mut out);
                }
                us.push(t.elapsed().as_micros());
                let back = tandem_replication::devstate::decode_delta(&prev, &out);
                assert_eq!(back.ok().as_deref(), Some(&cur[..]), "{name}: round trip");
                prev = cur;
            }
            us.sort_unstable();
            println!(
                "round {round}, {name}: median {} µs, p90 {} µs, {} bytes",
                us[us.len() / 2],
                us[us.len() * 9 / 10],
                out.len()
            );
        }
    }
}
