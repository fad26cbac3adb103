//! Replays the committed corpus of the `devstate_frame` fuzz target.

#[test]
fn replay_devstate_frame() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/devstate_frame");
    let (mut n, mut framed) = (0, 0);
    for e in std::fs::read_dir(&dir).expect("corpus directory") {
        framed += tandem_vm::devstate::fast::fuzz_frame(&std::fs::read(e.unwrap().path()).unwrap())
            as usize;
        n += 1;
    }
    assert!(n >= 5, "corpus has {n} inputs");
    assert!(framed >= 4, "only {framed} inputs framed a stream");
}
