//! Nothing but tests: `tests/replay.rs` replays every committed cargo-fuzz corpus
//! (`fuzz/corpus/`) on stable Rust, so CI checks each decoder and parser against them without
//! a nightly toolchain. The fuzz entry points it calls are behind each crate's `fuzz` feature,
//! outside the default build.
