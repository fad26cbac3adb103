//! Replays the committed corpus of every fuzz target: never a panic; the valid seeds decode.

use tandem_test_support::replay_corpus;

#[test]
fn epoch_decode() {
    replay_corpus("epoch_decode", 5, tandem_codec::fuzz::decode_raw);
}

#[test]
fn epoch_roundtrip() {
    // The trial's long run patches and word deltas must be among what the corpus exercises,
    // and so must their absence.
    let long = std::cell::Cell::new(0);
    let (words, seeds) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    replay_corpus("epoch_roundtrip", 5, |d| {
        tandem_codec::fuzz::roundtrip_structured(d);
        long.set(long.get() + tandem_codec::fuzz::roundtrip_trial(d) as usize);
        words.set(words.get() + tandem_codec::fuzz::roundtrip_words(d) as usize);
        seeds.set(seeds.get() + 1);
    });
    assert!(long.get() > 0, "no seed takes long run patches");
    assert!(words.get() > 0, "no seed takes word deltas");
    assert!(words.get() < seeds.get(), "every seed takes word deltas");
}

#[test]
fn replication_frames() {
    // Plain and consolidated backups side by side (the cargo-fuzz target's entry), and the
    // plain one alone.
    replay_corpus(
        "replication_frames",
        5,
        tandem_consolidate::fuzz::frames_into_backup,
    );
    replay_corpus(
        "replication_frames",
        5,
        tandem_replication::fuzz::frames_into_backup,
    );
}

#[test]
fn disk_input() {
    replay_corpus("disk_input", 5, tandem_disk::fuzz::disk_input);
}

#[test]
fn etcd_input() {
    replay_corpus("etcd_input", 5, tandem_fence::fuzz::etcd_input);
}

#[test]
fn store_files_and_disks() {
    replay_corpus("store_files", 3, tandem_store::fuzz::store_files);
    replay_corpus("store_disks", 3, tandem_store::fuzz::store_disks);
}

#[test]
fn trace_reader() {
    replay_corpus("trace_reader", 5, |d| {
        tandem_trace::fuzz::read_all(d);
    });
    // The valid seed decodes completely.
    let two = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/corpus/trace_reader/two-epochs"),
    )
    .unwrap();
    assert_eq!(tandem_trace::fuzz::read_all(&two), 1 + 2 + 1);
}

#[test]
fn devstate_frame() {
    let framed = std::cell::Cell::new(0);
    replay_corpus("devstate_frame", 5, |d| {
        framed.set(framed.get() + usize::from(tandem_vm::devstate::fast::fuzz_frame(d)));
    });
    assert!(
        framed.get() >= 4,
        "only {} inputs framed a stream",
        framed.get()
    );
}
