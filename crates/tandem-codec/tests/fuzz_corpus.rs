//! Replays the committed fuzz corpora of the codec's targets on stable.

fn corpus(name: &str) -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(name);
    std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect()
}

#[test]
fn replay_epoch_decode() {
    let inputs = corpus("epoch_decode");
    assert!(inputs.len() >= 5);
    for i in inputs {
        tandem_codec::fuzz::decode_raw(&i);
    }
}

#[test]
fn replay_epoch_roundtrip() {
    let inputs = corpus("epoch_roundtrip");
    assert!(inputs.len() >= 5);
    for i in inputs {
        tandem_codec::fuzz::roundtrip_structured(&i);
    }
}
