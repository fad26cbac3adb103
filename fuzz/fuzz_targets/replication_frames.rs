#![no_main]
//! Bytes from the replication link into a backup, plain and consolidated side by side: frames
//! are refused or applied alike, never a panic, and both mirrors end the same.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_consolidate::fuzz::frames_into_backup(data);
});
