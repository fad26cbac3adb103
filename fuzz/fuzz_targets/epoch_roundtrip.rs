#![no_main]
//! Structured: the input shapes an epoch; every codec must round-trip it exactly, and a
//! mutated record must not panic the decoder; and tandem over two epochs whose changes the
//! input places, through its per-epoch trial; and tandem over whole pages of counters or of
//! the input's bytes, through its measurement of word deltas.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_codec::fuzz::roundtrip_structured(data);
    tandem_codec::fuzz::roundtrip_trial(data);
    tandem_codec::fuzz::roundtrip_words(data);
});
