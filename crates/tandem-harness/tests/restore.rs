//! The `kv` guest (2 vCPUs) under stock QEMU: checkpoint, kill, restore in a fresh QEMU; redis's data
//! and the console counter continue from the checkpoint. Needs the guest image
//! (`./tandem setup`).

use std::time::Duration;

use tandem_harness::kv::{wait_for_server, KvClient};
use tandem_harness::{kv_port, lab_config};
use tandem_test_support::free_port;
use tandem_vm::devstate::Method;
use tandem_vm::{DirtyMode, NicNet, Vm};

fn boot(workload: &str, dirty: DirtyMode) -> Vm {
    let mut cfg = lab_config(&format!("test-{workload}"), workload, 256).unwrap();
    cfg.dirty = dirty;
    // Two vCPUs: the checkpoint carries both CPUs' state and the restored guest runs on both.
    cfg.vcpus = 2;
    let mut vm = Vm::launch(&cfg).unwrap_or_else(|e| panic!("launch {workload}: {e}"));
    vm.wait_ready(Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("{workload} not ready: {e}"));
    vm
}

/// Checkpoint a running kv guest, kill it, restore in a fresh QEMU: the console counter and
/// redis's data continue from the checkpoint (and writes after it are gone). The device state
/// is QEMU's `migrate` stream (a VM's first capture).
#[test]
fn restore_continues_from_checkpoint() {
    checkpoint_kill_restore(1, Method::Migrate);
}

/// The same from the fast device state (`xen-save-devices-state` framed as a migration
/// stream: every capture after a VM's first).
#[test]
fn restore_continues_from_a_fast_device_state() {
    checkpoint_kill_restore(3, Method::Fast);
}

fn checkpoint_kill_restore(captures: usize, method: Method) {
    let mut vm = boot("kv", DirtyMode::None);
    let port = kv_port(vm.config()).unwrap();
    let mut c = wait_for_server(port, Duration::from_secs(60)).unwrap();
    let mut state = Vec::new();
    for _ in 1..captures {
        vm.stop().unwrap();
        vm.capture_device_state(&mut state).unwrap();
        vm.cont().unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    c.set(b"before", b"checkpoint").unwrap();
    std::thread::sleep(Duration::from_secs(2));

    vm.stop().unwrap();
    vm.capture_device_state(&mut state).unwrap();
    assert_eq!(vm.devstate_method(), (Some(method), None));
    assert!(
        state.len() > 10_000,
        "device state suspiciously small: {}",
        state.len()
    );
    let image = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
    vm.save_ram(image.path()).unwrap();
    vm.console.poll().unwrap();
    let tick_at_checkpoint =
        tandem_labguest::last_tick(&vm.console).expect("guest printed no tick");
    vm.cont().unwrap();
    c.set(b"after", b"checkpoint").unwrap();
    std::thread::sleep(Duration::from_secs(2));
    drop(c);
    vm.kill();
    let mut cfg = vm.config().clone();
    drop(vm);

    cfg.nics[0].net = NicNet::User {
        forwards: vec![format!("tcp:127.0.0.1:{}-:6379", free_port())],
    };
    let mut restored = Vm::restore(&cfg, image.path(), &state).unwrap();
    assert_eq!(restored.qmp.status().unwrap(), "paused");
    restored.cont().unwrap();
    let first = tandem_labguest::wait_tick(&mut restored.console, Duration::from_secs(30)).unwrap();
    assert!(
        first == tick_at_checkpoint + 1 || first == tick_at_checkpoint,
        "console counter restarted: checkpoint at tick {tick_at_checkpoint}, restored guest printed tick {first}"
    );
    assert!(
        !restored.console.text().contains("Linux version"),
        "guest rebooted"
    );
    let mut c = wait_for_server(kv_port(&cfg).unwrap(), Duration::from_secs(60)).unwrap();
    assert_eq!(
        c.get(b"before").unwrap().as_deref(),
        Some(&b"checkpoint"[..])
    );
    assert_eq!(
        c.get(b"after").unwrap(),
        None,
        "write after the checkpoint survived the restore"
    );
    // The guest keeps working after the restore.
    c.set(b"again", b"yes").unwrap();
    assert_eq!(
        KvClient::get(&mut c, b"again").unwrap().as_deref(),
        Some(&b"yes"[..])
    );
}
