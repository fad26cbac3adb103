//! The codec's compressed tier (tandem-codec, state/cold.rs) keeps each page pushed out of its
//! store compressed, and pays a compression and a decompression for every trip a page makes
//! through it. This measures two candidates on a recorded trace's pages: zstd at level −1 (the
//! tier's) and LZ4, in µs per page each way, and the share of the page bytes their blocks take
//! (a page that does not shrink counts whole, as the tier keeps it).
//!
//! ```sh
//! cargo run --release -p tandem-harness --example cold_tier -- ~/.cache/tandem/traces/kv-256m-100ms.trace
//! cargo run --release -p tandem-harness --example cold_tier -- counters
//! ```
//!
//! Pages: the pre-epoch content of the first 400 dirty pages of each epoch, at most 60 000;
//! `counters`: 60 000 pages of 64-bit words that count (the page pattern of the codec's test
//! `a_cycle_larger_than_the_raw_store_is_held_compressed`).

use std::time::{Duration, Instant};

use anyhow::Context;
use tandem_codec::format::PAGE;

const PER_EPOCH: usize = 400;
const MOST: usize = 60_000;

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .context("usage: cold_tier TRACE|counters (a trace recorded by `tandem traces`)")?;
    let pages = if path == "counters" {
        counter_pages()
    } else {
        trace_pages(&path)?
    };
    let mut zc = tandem_codec::prefix::Compressor::default();
    let zstd = measure(
        &pages,
        |p| {
            let mut out = Vec::new();
            zc.compress(&[], p, -1, &mut out).map(|()| out).ok()
        },
        |b, dst| tandem_codec::prefix::decompress(b, &[], dst) == Ok(PAGE),
    )?;
    let lz4 = measure(
        &pages,
        |p| Some(lz4_flex::block::compress(p)),
        |b, dst| lz4_flex::block::decompress_into(b, dst).ok() == Some(PAGE),
    )?;
    println!("{path}: {} pages", pages.len());
    println!(
        "| compressor | compress µs/page | decompress µs/page | round trip | bytes / page bytes |"
    );
    println!("|---|---|---|---|---|");
    for (name, (c, d, share)) in [("zstd −1", zstd), ("LZ4", lz4)] {
        println!("| {name} | {c:.2} | {d:.2} | {:.2} | {share:.3} |", c + d);
    }
    Ok(())
}

/// The pre-epoch content of the first dirty pages of each epoch of the trace at `path`.
fn trace_pages(path: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {path}"))?;
    let mut pages: Vec<Vec<u8>> = Vec::new();
    tandem_trace::replay::<_, tandem_trace::TraceError>(std::io::BufReader::new(file), |mem, e| {
        for &p in e.pfns.iter().take(PER_EPOCH) {
            if pages.len() < MOST {
                pages.push(mem[p as usize * PAGE..(p as usize + 1) * PAGE].to_vec());
            }
        }
        Ok(())
    })
    .with_context(|| format!("reading {path}"))?;
    anyhow::ensure!(!pages.is_empty(), "{path} has no dirty pages");
    Ok(pages)
}

/// Pages whose 64-bit words count: a round, the page number and the word's index.
fn counter_pages() -> Vec<Vec<u8>> {
    (0..MOST as u64)
        .map(|p| {
            (0..PAGE as u64 / 8)
                .flat_map(|w| (((p % 7) << 40) | (p << 16) | (w * 3)).to_le_bytes())
                .collect()
        })
        .collect()
}

/// µs per page to compress and to decompress every page, and the share of the bytes kept.
fn measure(
    pages: &[Vec<u8>],
    mut pack: impl FnMut(&[u8]) -> Option<Vec<u8>>,
    unpack: impl Fn(&[u8], &mut [u8]) -> bool,
) -> anyhow::Result<(f64, f64, f64)> {
    let t = Instant::now();
    let blocks = pages
        .iter()
        .map(|p| pack(p).context("a page failed to compress"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let packing = t.elapsed();
    let mut dst = vec![0u8; PAGE];
    let mut unpacking = Duration::ZERO;
    for (b, p) in blocks.iter().zip(pages) {
        let t = Instant::now();
        let ok = unpack(b, &mut dst);
        unpacking += t.elapsed();
        anyhow::ensure!(ok && dst == *p, "a page did not come back exactly");
    }
    let kept: usize = blocks.iter().map(|b| b.len().min(PAGE)).sum();
    let per = |d: Duration| d.as_secs_f64() * 1e6 / pages.len() as f64;
    Ok((
        per(packing),
        per(unpacking),
        kept as f64 / (pages.len() * PAGE) as f64,
    ))
}
