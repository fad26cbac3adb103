//! Entry point shared by the cargo-fuzz target and the corpus replay test.

use crate::{Backup, Frame};

/// Size of the fuzzed backup's disk copy.
pub const FUZZ_DISK: usize = 16 * 1024;

/// Reads frames from `data` and feeds them to two backups with a 16-page mirror and a 16 KiB
/// disk copy, one plain and one whose mirror is consolidated after every epoch: every input
/// must be refused or applied, never panic, and both must end with the same memory.
pub fn frames_into_backup(data: &[u8]) {
    let new = || {
        Backup::new(vec![0u8; 16 * tandem_codec::format::PAGE])
            .with_disk(Box::new(vec![0u8; FUZZ_DISK]))
    };
    let pool = std::sync::Arc::new(std::sync::Mutex::new(tandem_consolidate::Pool::new()));
    let mut bk = new();
    let Ok(shm) = tandem_consolidate::shm(16 * tandem_codec::format::PAGE) else {
        return; // no memfd here: nothing to compare with
    };
    let mut cons = Backup::new(shm)
        .with_disk(Box::new(vec![0u8; FUZZ_DISK]))
        .consolidate(pool, std::time::Duration::from_nanos(1));
    let mut r = data;
    while let Ok(Some(f)) = Frame::read_from(&mut r) {
        let a = bk.handle(&f).is_ok();
        let b = cons.handle(&f).is_ok();
        cons.tick();
        assert_eq!(
            a, b,
            "a consolidated backup decided otherwise on {:?}",
            f.kind
        );
    }
    cons.materialise()
        .expect("a heap mirror always gets its memory");
    assert!(
        bk.mirror() == cons.mirror(),
        "a consolidated backup holds other memory"
    );
}
