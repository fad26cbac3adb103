#![no_main]
//! Feeds arbitrary bytes to the trace reader: it must return frames or an error, never panic,
//! never allocate beyond its limits.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_trace::fuzz::read_all(data);
});
