#![no_main]
//! Bytes as a checkpoint store with disks (disks file, index, segment): open, verify and
//! rebuild RAM and disks give errors, never a panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_store::fuzz::store_disks(data);
});
