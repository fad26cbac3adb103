//! Writes seed inputs for the `trace_reader` fuzz target into the directory given.

use tandem_trace::{EpochRecord, Timing, TraceHeader, TraceWriter};

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: trace_corpus DIR"));
    std::fs::create_dir_all(&dir).expect("create corpus dir");
    let header = |pages: u64| TraceHeader {
        page_size: 4096,
        mem_bytes: pages * 4096,
        epoch_ms: 100,
        meta: serde_json::json!({ "workload": "seed" }),
    };
    let epoch = |n: u32, pfns: Vec<u64>| EpochRecord {
        epoch: n.into(),
        at_us: n as u64 * 100_000,
        timing: Timing {
            stop_us: 500,
            harvest_us: 300,
            copy_us: 800,
            devstate_us: 4000,
            cont_us: 500,
            ..Default::default()
        },
        device_state_len: 600_000,
        data: pfns.iter().flat_map(|&p| vec![p as u8; 4096]).collect(),
        pfns,
    };
    let write = |name: &str, pages: u64, epochs: Vec<EpochRecord>, level: i32| {
        let mut w = TraceWriter::new(Vec::new(), header(pages), level).unwrap();
        let base: Vec<u8> = (0..pages * 4096).map(|i| (i / 4096 % 3) as u8).collect();
        w.write_base(&base).unwrap();
        for e in &epochs {
            w.write_epoch(e).unwrap();
        }
        let bytes = w.finish().unwrap();
        std::fs::write(dir.join(name), &bytes).unwrap();
        bytes
    };
    write("empty-epochs", 4, vec![], 1);
    let b = write(
        "two-epochs",
        8,
        vec![epoch(1, vec![0, 3]), epoch(2, vec![7])],
        1,
    );
    write("stored-frames", 2, vec![epoch(1, vec![1])], -7);
    std::fs::write(dir.join("truncated"), &b[..b.len() - 5]).unwrap();
    std::fs::write(dir.join("header-only"), &b[..48]).unwrap();
}
