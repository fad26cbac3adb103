//! Integration tests against stock QEMU and the lab guest built by `./tandem setup`.
//! They need the image (`./tandem setup`) and `libtandem_preload.so` (`cargo build --workspace`).

use std::collections::HashSet;
use std::time::Duration;

use tandem_labguest::GuestImage;
use tandem_test_support::free_port;
use tandem_vm::{DirtyMode, Vm, PAGE_SIZE};

fn boot(workload: &str, dirty: DirtyMode) -> Vm {
    let name = format!("test-{workload}");
    let image = GuestImage::default();
    let mut cfg = if workload == "kv" {
        tandem_labguest::config_forwarding(&name, workload, &image, free_port(), 6379)
    } else {
        tandem_labguest::config(&name, workload, &image)
    };
    cfg.dirty = dirty;
    let mut vm = Vm::launch(&cfg).unwrap_or_else(|e| panic!("launch {workload}: {e}"));
    vm.wait_ready(Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("{workload} not ready: {e}"));
    vm
}

/// Over many epochs of a busy guest, every page whose content changed since the previous
/// checkpoint is in the harvested set (0 missed pages), checked against full copies.
fn exactness(workload: &str, dirty: DirtyMode, epochs: usize) {
    let mut vm = boot(workload, dirty);
    let pages = vm.ram().pages();
    vm.stop().unwrap();
    let mut harvested = Vec::new();
    vm.harvest(&mut harvested).unwrap();
    // SAFETY: the guest is stopped.
    let mut prev = unsafe { vm.ram().as_slice() }.to_vec();
    vm.cont().unwrap();
    let (mut changed_total, mut reported_total) = (0usize, 0usize);
    for epoch in 0..epochs {
        std::thread::sleep(Duration::from_millis(100));
        vm.stop().unwrap();
        harvested.clear();
        vm.harvest(&mut harvested).unwrap();
        let set: HashSet<u64> = harvested.iter().copied().collect();
        // SAFETY: the guest is stopped.
        let now = unsafe { vm.ram().as_slice() };
        let mut missed = Vec::new();
        for p in 0..pages {
            let r = p * PAGE_SIZE..(p + 1) * PAGE_SIZE;
            if now[r.clone()] != prev[r.clone()] {
                changed_total += 1;
                if !set.contains(&(p as u64)) {
                    missed.push(p);
                }
                prev[r.clone()].copy_from_slice(&now[r]);
            }
        }
        reported_total += harvested.len();
        assert!(
            missed.is_empty(),
            "{workload}/{dirty:?} epoch {epoch}: missed pages {missed:?}"
        );
        vm.cont().unwrap();
    }
    assert!(
        changed_total > 0,
        "{workload}: the guest changed nothing in {epochs} epochs"
    );
    eprintln!(
        "{workload} {dirty:?}: {epochs} epochs, {changed_total} changed pages, {reported_total} reported, false positives {:.1}%",
        100.0 * (reported_total - changed_total) as f64 / reported_total.max(1) as f64
    );
}

#[test]
fn uffd_dirty_log_is_exact_memtouch() {
    exactness("memtouch", DirtyMode::Uffd, 30);
}

#[test]
fn uffd_dirty_log_is_exact_sqlite() {
    exactness("sqlite", DirtyMode::Uffd, 30);
}

#[test]
fn hash_dirty_log_is_exact_memtouch() {
    exactness("memtouch", DirtyMode::Hash, 10);
}
