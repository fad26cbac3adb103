#![no_main]
//! Structured: the input shapes an epoch; every codec must round-trip it exactly, and a
//! mutated record must not panic the decoder.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_codec::fuzz::roundtrip_structured(data);
});
