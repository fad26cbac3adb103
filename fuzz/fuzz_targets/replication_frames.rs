#![no_main]
//! Bytes from the replication link into a backup: frames are refused or applied, never a panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_replication::fuzz::frames_into_backup(data);
});
