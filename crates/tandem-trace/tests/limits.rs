//! Small frames declaring huge lengths are refused from what the frame can hold, before any
//! buffer is sized by the declared length.

use tandem_trace::{TraceError, TraceHeader, TraceReader, TraceWriter};

/// A trace header (and metadata) for a guest of `mem_bytes` in pages of `page_size`.
fn header(page_size: u32, mem_bytes: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let h = TraceHeader {
        page_size,
        mem_bytes,
        epoch_ms: 100,
        meta: serde_json::json!({}),
    };
    drop(TraceWriter::new(&mut out, h, 1).unwrap());
    out
}

/// Appends a frame with a valid checksum.
fn frame(out: &mut Vec<u8>, kind: u8, codec: u8, raw_len: u32, stored: &[u8]) {
    out.extend_from_slice(&[kind, codec, 0, 0]);
    out.extend_from_slice(&raw_len.to_le_bytes());
    out.extend_from_slice(&(stored.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(stored).to_le_bytes());
    out.extend_from_slice(stored);
}

fn first_frame(bytes: &[u8]) -> TraceError {
    let mut r = TraceReader::new(bytes).unwrap();
    r.next_frame().expect_err("must be refused")
}

#[test]
fn a_tiny_zstd_frame_declaring_256_mib_is_refused_before_decompressing() {
    let mut t = header(4096, 1 << 20);
    let z = zstd::bulk::compress(&[1u8; 16], 1).unwrap();
    frame(&mut t, 2, 1, 256 << 20, &z);
    assert!(t.len() < 200);
    let e = first_frame(&t);
    assert!(
        matches!(&e, TraceError::Corrupt { what, .. } if what.contains("hold at most")),
        "{e}"
    );
}

#[test]
fn an_epoch_declaring_more_pages_than_its_frame_holds_is_refused() {
    // 1 TiB in 512-byte pages: 2^31 pages, so the count passes the guest-size check; the
    // frame holds none of them.
    let mut t = header(512, 1 << 40);
    let mut p = Vec::new();
    p.extend_from_slice(&1u32.to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes());
    p.extend_from_slice(&[0u8; 24]);
    p.extend_from_slice(&(u32::MAX >> 1).to_le_bytes());
    p.extend_from_slice(&[0u8; 8]);
    frame(&mut t, 2, 0, p.len() as u32, &p);
    let e = first_frame(&t);
    assert!(
        matches!(&e, TraceError::Corrupt { what, .. } if what.contains("the frame holds at most 0")),
        "{e}"
    );
}
