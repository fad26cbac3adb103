//! Replays the committed corpora of the `store_files` and `store_disks` fuzz targets.

#[test]
fn replay_store_files() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/store_files");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("corpus directory") {
        tandem_store::fuzz::store_files(&std::fs::read(e.unwrap().path()).unwrap());
        n += 1;
    }
    assert!(n >= 3, "corpus has {n} inputs");
}

#[test]
fn replay_store_disks() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/store_disks");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("corpus directory") {
        tandem_store::fuzz::store_disks(&std::fs::read(e.unwrap().path()).unwrap());
        n += 1;
    }
    assert!(n >= 3, "corpus has {n} inputs");
}
