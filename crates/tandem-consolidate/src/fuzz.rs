//! Entry point shared by the cargo-fuzz target `replication_frames` and the corpus replay test.

use tandem_replication::{Backup, Frame};

use crate::{Consolidated, Pool, PAGE};

/// Size of the fuzzed backup's disk copy.
pub const FUZZ_DISK: usize = 16 * 1024;

/// Reads frames from `data` and feeds them to two backups with a 16-page mirror and a 16 KiB
/// disk copy, one plain and one whose mirror is consolidated after every epoch: every input
/// must be refused or applied, never panic, and both must end with the same memory.
pub fn frames_into_backup(data: &[u8]) {
    let mut bk = Backup::new(vec![0u8; 16 * PAGE]).with_disk(Box::new(vec![0u8; FUZZ_DISK]));
    let pool = std::sync::Arc::new(std::sync::Mutex::new(Pool::new()));
    let Ok(shm) = crate::shm(16 * PAGE) else {
        return; // no memfd here: nothing to compare with
    };
    let keeper = Consolidated::new(16 * PAGE, pool, std::time::Duration::from_nanos(1));
    let mut cons = Backup::with_keeper(shm, keeper).with_disk(Box::new(vec![0u8; FUZZ_DISK]));
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
