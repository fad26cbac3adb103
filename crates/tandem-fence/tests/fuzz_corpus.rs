//! Replays the committed corpus of the `etcd_input` fuzz target.

#[test]
fn replay_etcd_input() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/etcd_input");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("corpus directory") {
        tandem_fence::fuzz::etcd_input(&std::fs::read(e.unwrap().path()).unwrap());
        n += 1;
    }
    assert!(n >= 5, "corpus has {n} inputs");
}
