//! Replays the committed fuzz corpus on stable: every input must be handled without a panic.

#[test]
fn replay_trace_reader_corpus() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/trace_reader");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("fuzz corpus directory") {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        tandem_trace::fuzz::read_all(&data);
        n += 1;
    }
    assert!(n >= 5, "corpus has only {n} inputs");
    // The valid seeds decode completely.
    let two = std::fs::read(dir.join("two-epochs")).unwrap();
    assert_eq!(tandem_trace::fuzz::read_all(&two), 1 + 2 + 1);
}
