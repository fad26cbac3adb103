//! Entry point shared by the corpus replay test (tandem-consolidate's `fuzz` module runs the
//! same frames against a consolidated mirror too, for the cargo-fuzz target).

use crate::{Backup, Frame};

/// Size of the fuzzed backup's disk copy.
pub const FUZZ_DISK: usize = 16 * 1024;

/// Reads frames from `data` and feeds them to a backup with a 16-page mirror and a 16 KiB disk
/// copy: every input must be refused or applied, never panic.
pub fn frames_into_backup(data: &[u8]) {
    let mut bk = Backup::new(vec![0u8; 16 * tandem_codec::format::PAGE])
        .with_disk(Box::new(vec![0u8; FUZZ_DISK]));
    let mut r = data;
    while let Ok(Some(f)) = Frame::read_from(&mut r) {
        let _ = bk.handle(&f);
        bk.tick();
    }
}
