//! Round trips and corruption handling of the trace format.

use proptest::prelude::*;
use tandem_trace::{
    EpochRecord, Timing, TraceError, TraceFrame, TraceHeader, TraceReader, TraceWriter,
};

const PS: usize = 4096;

fn header(pages: u64) -> TraceHeader {
    TraceHeader {
        page_size: PS as u32,
        mem_bytes: pages * PS as u64,
        epoch_ms: 100,
        meta: serde_json::json!({ "workload": "test" }),
    }
}

fn write(pages: u64, base: &[u8], epochs: &[EpochRecord]) -> Vec<u8> {
    let mut w = TraceWriter::new(Vec::new(), header(pages), 1).unwrap();
    w.write_base(base).unwrap();
    for e in epochs {
        w.write_epoch(e).unwrap();
    }
    w.finish().unwrap()
}

fn read_all(bytes: &[u8]) -> Result<Vec<TraceFrame>, TraceError> {
    let mut r = TraceReader::new(bytes)?;
    let mut out = Vec::new();
    while let Some(f) = r.next_frame()? {
        out.push(f);
    }
    Ok(out)
}

fn epoch(n: u32, pfns: Vec<u64>, fill: u8) -> EpochRecord {
    let data = pfns
        .iter()
        .flat_map(|&p| vec![fill ^ p as u8; PS])
        .collect();
    EpochRecord {
        epoch: n.into(),
        at_us: n as u64 * 100_000,
        timing: Timing {
            stop_us: 1,
            harvest_us: 2,
            copy_us: 3,
            devstate_us: 4,
            cont_us: 5,
            ..Default::default()
        },
        device_state_len: 800_000,
        pfns,
        data,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn roundtrip(sets in proptest::collection::vec(proptest::collection::btree_set(0u64..2048, 0..40), 0..6), seed: u8) {
        let pages = 2048;
        let base: Vec<u8> = (0..pages as usize * PS).map(|i| (i / 4096) as u8 ^ seed).collect();
        let epochs: Vec<EpochRecord> = sets.into_iter().enumerate()
            .map(|(i, s)| epoch(i as u32 + 1, s.into_iter().collect(), seed)).collect();
        let bytes = write(pages, &base, &epochs);
        let frames = read_all(&bytes).unwrap();
        let mut mem = vec![0u8; base.len()];
        let mut got = Vec::new();
        for f in frames {
            match f {
                TraceFrame::Base { first_pfn, data } => {
                    let o = first_pfn as usize * PS;
                    mem[o..o + data.len()].copy_from_slice(&data);
                }
                TraceFrame::Epoch(e) => got.push(e),
                TraceFrame::End { epochs: n, .. } => prop_assert_eq!(n as usize, epochs.len()),
            }
        }
        prop_assert_eq!(mem, base);
        prop_assert_eq!(got, epochs);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let _ = read_all(&bytes);
    }
}

#[test]
fn every_truncation_is_an_error_naming_an_offset() {
    let base = vec![7u8; 64 * PS];
    let bytes = write(
        64,
        &base,
        &[epoch(1, vec![1, 5, 9], 3), epoch(2, vec![0, 63], 4)],
    );
    read_all(&bytes).unwrap();
    for cut in (0..bytes.len()).step_by(97) {
        let err = read_all(&bytes[..cut]).expect_err("truncated trace accepted");
        let msg = err.to_string();
        assert!(
            msg.contains("offset") || matches!(err, TraceError::BadMagic),
            "cut {cut}: {msg}"
        );
    }
}

#[test]
fn flipped_bytes_are_detected() {
    let base = vec![1u8; 16 * PS];
    let bytes = write(16, &base, &[epoch(1, vec![2, 3], 9)]);
    for pos in (0..bytes.len()).step_by(31) {
        let mut b = bytes.clone();
        b[pos] ^= 0x40;
        assert!(read_all(&b).is_err(), "flip at {pos} not detected");
    }
}

#[test]
fn writer_rejects_unsorted_pages() {
    let mut w = TraceWriter::new(Vec::new(), header(8), 1).unwrap();
    let mut e = epoch(1, vec![3, 2], 0);
    assert!(w.write_epoch(&e).is_err());
    e.pfns = vec![2, 8];
    assert!(w.write_epoch(&e).is_err());
}
