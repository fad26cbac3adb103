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

/// The serial console is a socket an operator attaches to (`tandem console`), and whatever
/// the guest prints there is in the console log too.
#[test]
fn the_console_socket_shows_what_the_log_keeps() {
    use std::io::Read;
    let image = GuestImage::default();
    let cfg = tandem_labguest::config("test-console", "memtouch", &image);
    let mut vm = Vm::launch(&cfg).unwrap_or_else(|e| panic!("launch: {e}"));
    let mut sock = std::os::unix::net::UnixStream::connect(vm.console_socket())
        .expect("connect to the console socket");
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut seen = Vec::new();
    let t = std::time::Instant::now();
    let mut buf = [0u8; 4096];
    // A complete line the guest printed while attached.
    let line = loop {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "nothing on the console socket: {seen:?}"
        );
        if let Ok(n) = sock.read(&mut buf) {
            seen.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&seen);
        let lines: Vec<&str> = text.split('\n').collect();
        if let Some(l) = lines[..lines.len().saturating_sub(1)]
            .iter()
            .skip(1)
            .map(|l| l.trim())
            .find(|l| l.len() > 10)
        {
            break l.to_string();
        }
    };
    vm.wait_ready(Duration::from_secs(120)).unwrap();
    let log = std::fs::read_to_string(vm.serial_path()).unwrap();
    assert!(log.contains(&line), "{line:?} not in the console log");
}

/// A guest restored from a fast (`xen-save-devices-state`) device state can reboot: the
/// restored QEMU gets the firmware and option ROMs from the stream, which a QEMU waiting for a
/// migration does not keep of its own.
#[test]
fn a_guest_restored_from_a_fast_device_state_reboots() {
    let mut vm = boot("memtouch", DirtyMode::Auto);
    let mut state = Vec::new();
    // The first capture learns the frame (migrate), the second is the fast path.
    for _ in 0..2 {
        vm.stop().unwrap();
        vm.capture_device_state(&mut state).unwrap();
        vm.cont().unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    vm.stop().unwrap();
    vm.capture_device_state(&mut state).unwrap();
    assert_eq!(
        vm.devstate_method().0,
        Some(tandem_vm::devstate::Method::Fast),
        "{:?}",
        vm.devstate_method()
    );
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("ram.img");
    vm.save_ram(&image).unwrap();
    let cfg = vm.config().clone();
    vm.kill();
    let mut restored = Vm::restore(&cfg, &image, &state).expect("restore");
    restored.cont().unwrap();
    let log = restored.serial_path();
    let boots = |log: &std::path::Path| {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .matches("TANDEM-READY")
            .count()
    };
    let before = boots(&log);
    restored.qmp.execute("system_reset", None).unwrap();
    let t = std::time::Instant::now();
    while boots(&log) <= before {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the restored guest did not boot again after a reset: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}
