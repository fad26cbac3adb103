//! Replays the committed corpus of the `replication_frames` fuzz target.

#[test]
fn replay_replication_frames() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus/replication_frames");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("corpus directory") {
        tandem_replication::fuzz::frames_into_backup(&std::fs::read(e.unwrap().path()).unwrap());
        n += 1;
    }
    assert!(n >= 5, "corpus has {n} inputs");
}
