#![no_main]
//! Raw bytes as an epoch record: rejected or decoded, never a panic, never a partial apply.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_codec::fuzz::decode_raw(data);
});
