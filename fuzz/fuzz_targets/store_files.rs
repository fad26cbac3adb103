#![no_main]
//! Bytes as a checkpoint store's index and segment: open, verify and restore give errors,
//! never a panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_store::fuzz::store_files(data);
});
