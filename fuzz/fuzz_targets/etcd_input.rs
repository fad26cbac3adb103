#![no_main]
//! Bytes as an etcd gateway reply and as a stored replica record: never a panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_fence::fuzz::etcd_input(data);
});
