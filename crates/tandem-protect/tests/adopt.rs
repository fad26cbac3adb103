//! `tandem adopt` on a real guest: a QEMU started by hand (plain `-m`, anonymous RAM, its own
//! QMP socket) runs the lab guest; a primary adopts it by live migration, protects it, and the
//! backup fails over. The guest's console counter shows it never rebooted: it goes on in
//! tandem's QEMU and then in the backup's.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::wait_for;
use tandem_protect::backup::BackupConfig;
use tandem_protect::primary::{AdoptConfig, PrimaryConfig};
use tandem_protect::{backup, primary, Event, VmSpec};
use tandem_test_support::free_port;
use tandem_vm::console::Console;

/// The QEMU an operator started: killed when the test ends.
struct Source(Child);

impl Drop for Source {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `vm`'s guest the way a person would: the same devices, but RAM from plain `-m`
/// (QEMU's own anonymous memory, named `pc.ram`) and no tandem anywhere.
fn start_by_hand(vm: &VmSpec, dir: &Path) -> (Source, PathBuf, PathBuf) {
    let c = vm.config("source").unwrap();
    let (qmp, serial) = (dir.join("source-qmp.sock"), dir.join("source-console.log"));
    let child = Command::new("qemu-system-x86_64")
        .args(tandem_vm::qemu_args::by_hand(&c, &qmp, &serial, &[]))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("source-qemu.log")).unwrap())
        .spawn()
        .expect("qemu-system-x86_64 runs");
    (Source(child), qmp, serial)
}

#[test]
fn a_running_guest_is_adopted_without_a_reboot_protected_and_failed_over() {
    let dir = tempfile::Builder::new()
        .prefix("tandem-adopt-")
        .tempdir_in("/dev/shm")
        .unwrap();
    let (pdir, bdir) = (dir.path().join("primary"), dir.path().join("backup"));
    for d in [&pdir, &bdir] {
        std::fs::create_dir(d).unwrap();
    }
    let image = tandem_labguest::GuestImage::default();
    let desc = tandem_labguest::write_description(dir.path(), "memtouch", &image, 0).unwrap();
    // The running QEMU's name for guest RAM, as an adopting description says it.
    let text = std::fs::read_to_string(&desc).unwrap();
    std::fs::write(&desc, format!("ram_block = \"pc.ram\"\n{text}")).unwrap();
    let mut vm = VmSpec::described(&desc);
    vm.mem = 192;

    let (_source, qmp, serial) = start_by_hand(&vm, dir.path());
    let mut console = Console::new(&serial);
    let first = tandem_labguest::wait_tick(&mut console, Duration::from_secs(180)).unwrap();
    let before = tandem_labguest::tick_above(&serial, first, Duration::from_secs(30)).unwrap();

    let backup_port = free_port();
    let mut bc = BackupConfig::new(format!("127.0.0.1:{backup_port}"), &bdir, vm.clone());
    bc.vm_id = 43;
    let b = backup::spawn(bc);

    let mut pc = PrimaryConfig::new(format!("127.0.0.1:{backup_port}"), vm);
    pc.vm_id = 43;
    pc.dir = Some(pdir.clone());
    pc.adopt = Some(AdoptConfig::new(&qmp));
    let p = primary::spawn(pc);

    let (mut ps, mut bs) = (Vec::new(), Vec::new());
    let adopted = wait_for(&p, &mut ps, Duration::from_secs(120), |e| {
        matches!(e, Event::Adopted { .. })
    });
    let Event::Adopted {
        qemu_pid,
        downtime_ms,
        transferred,
        ..
    } = adopted
    else {
        unreachable!()
    };
    eprintln!("adopted: downtime {downtime_ms} ms, {transferred} bytes sent");
    assert!(transferred > 0);
    assert!(
        !ps.iter().any(|e| matches!(e, Event::GuestRunning { .. })),
        "the guest was booted, not adopted: {ps:#?}"
    );
    // The counter goes on in tandem's QEMU: no reboot (a boot would start it at 1 again and
    // print the ready line first).
    let moved = tandem_labguest::tick_above(
        &pdir.join("guest-console.log"),
        before,
        Duration::from_secs(30),
    )
    .unwrap();
    let here = std::fs::read_to_string(pdir.join("guest-console.log")).unwrap();
    assert!(!here.contains(tandem_labguest::READY), "{here}");
    eprintln!("ticks: {before} by hand, {moved} in tandem's QEMU");

    wait_for(&p, &mut ps, Duration::from_secs(120), |e| {
        *e == Event::Protected
    });
    wait_for(
        &p,
        &mut ps,
        Duration::from_secs(60),
        |e| matches!(e, Event::Acked { epoch } if *epoch >= 5),
    );

    // tandem's QEMU dies on the primary: the backup resumes the adopted guest, still the
    // same boot.
    let killed = Command::new("kill")
        .args(["-9", &qemu_pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    wait_for(&b, &mut bs, Duration::from_secs(60), |e| {
        matches!(e, Event::FailedOver { .. })
    });
    let resumed = tandem_labguest::tick_above(
        &bdir.join("guest-console.log"),
        moved,
        Duration::from_secs(30),
    )
    .unwrap();
    let there = std::fs::read_to_string(bdir.join("guest-console.log")).unwrap();
    assert!(!there.contains(tandem_labguest::READY), "{there}");
    eprintln!("ticks: {resumed} on the backup");
    let _ = p.join();
    b.request_shutdown();
    b.join().expect("the backup ends cleanly");
}
