#![no_main]
//! Bytes as an NBD client stream and as an epoch's disk-write section: never a panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_disk::fuzz::disk_input(data);
});
