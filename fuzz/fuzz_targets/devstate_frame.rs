#![no_main]
//! Bytes as a `migrate` device-state stream and a `xen-save-devices-state` file: never a panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tandem_vm::devstate::fast::fuzz_frame(data);
});
