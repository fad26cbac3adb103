//! An adoption that cannot be done leaves the guest running where it ran: refused before
//! anything moves (wrong size, wrong RAM name, a paused guest, hardware the running VM does not
//! have, a NIC backend without the virtio-net headers the running one has). QEMUs without a
//! guest: firmware only.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tandem_vm::adopt::{adopt, AdoptError, AdoptOptions};
use tandem_vm::qmp::Qmp;
use tandem_vm::{DirtyMode, DiskDesc, DiskFormat, NicDesc, NicNet, VmConfig};

struct Source {
    child: Child,
    qmp: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Source {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The machine of every QEMU started by hand here: q35, plain `-m 128`, no default devices.
const PLAIN: [&str; 7] = [
    "-machine",
    "q35",
    "-m",
    "128",
    "-nodefaults",
    "-display",
    "none",
];

/// A QEMU started by hand: plain `-m 128`, no devices.
fn source() -> Source {
    let dir = tempfile::tempdir().unwrap();
    let qmp = dir.path().join("qmp.sock");
    let child = Command::new("qemu-system-x86_64")
        .args(PLAIN)
        .args(["-accel", "tcg", "-qmp"])
        .arg(format!("unix:{},server=on,wait=off", qmp.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64 runs");
    Source {
        child,
        qmp,
        _dir: dir,
    }
}

fn status(qmp: &Path) -> String {
    Qmp::connect(qmp, Duration::from_secs(10))
        .unwrap()
        .status()
        .unwrap()
}

fn config(mem_mib: u64, ram_block: &str) -> VmConfig {
    let mut c = VmConfig::custom("adopt-refusal");
    c.mem_mib = mem_mib;
    c.ram_block = ram_block.into();
    c.dirty = DirtyMode::None;
    c
}

/// A read-only raw virtio-blk disk, as a QEMU started with `-drive ...,readonly=on` and
/// `virtio-blk-pci` has it.
fn raw_disk(path: PathBuf) -> DiskDesc {
    DiskDesc {
        readonly: true,
        ..DiskDesc::new(path, DiskFormat::Raw)
    }
}

fn try_adopt(c: &VmConfig, s: &Source) -> AdoptError {
    // Wait for the source's socket like the adoption would.
    drop(Qmp::connect(&s.qmp, Duration::from_secs(10)).unwrap());
    match adopt(
        c,
        &tandem_vm::adopt::Source::Qmp(s.qmp.clone()),
        &AdoptOptions::default(),
        &mut |_| {},
    ) {
        Ok(_) => panic!("adopted a VM it should have refused"),
        Err(e) => e,
    }
}

#[test]
fn refusals_leave_the_running_guest_running() {
    let s = source();
    let e = try_adopt(&config(256, "pc.ram"), &s);
    assert!(
        matches!(
            e,
            AdoptError::Memory {
                source_mib: 128,
                described_mib: 256
            }
        ),
        "{e}"
    );
    assert_eq!(status(&s.qmp), "running");

    let e = try_adopt(&config(128, "ram0"), &s);
    assert!(e.to_string().contains("ram_block = \"pc.ram\""), "{e}");
    assert_eq!(status(&s.qmp), "running");

    Qmp::connect(&s.qmp, Duration::from_secs(10))
        .unwrap()
        .execute("stop", None)
        .unwrap();
    let e = try_adopt(&config(128, "pc.ram"), &s);
    assert!(
        matches!(e, AdoptError::NotRunning(ref st) if st == "paused"),
        "{e}"
    );
}

#[test]
fn other_hardware_is_refused_before_anything_moves() {
    let s = source();
    // tandem's QEMU would have a disk and a NIC the running VM does not. QEMU's migration
    // would accept that (the new devices just stay in their reset state): the comparison of
    // both QEMUs' hardware refuses it first.
    let disk = s._dir.path().join("disk.raw");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let mut c = config(128, "pc.ram");
    c.disks = vec![raw_disk(disk)];
    c.nics = vec![NicDesc {
        mac: "52:54:00:00:00:01".into(),
        model: "e1000".into(),
        net: NicNet::User {
            forwards: Vec::new(),
        },
        pci: None,
    }];
    let e = try_adopt(&c, &s);
    let AdoptError::Hardware(lines) = &e else {
        panic!("{e}: {e:?}")
    };
    // The disk and the NIC, and the virtio disk's features.
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("PCI: ")).count(),
        2,
        "{e}"
    );
    assert_eq!(lines.len(), 3, "{e}");
    assert!(
        lines.iter().all(|l| l.contains("tandem's QEMU would have")),
        "{e}"
    );
    assert!(e.to_string().contains("nothing was migrated"), "{e}");
    assert_eq!(status(&s.qmp), "running");
}

#[test]
fn a_nic_backend_without_virtio_net_headers_is_refused_before_anything_moves() {
    // The running VM's virtio NIC is on a tap with virtio-net headers; tandem's QEMU would put
    // it on user networking, which has none. The PCI layout and the MAC are the same, but the
    // NIC offers other features, and QEMU would refuse to load its state only once the guest
    // stopped for the switch: refused before anything moves, with the way out named.
    let ns = format!("tdadopt{}", std::process::id() % 100_000);
    let ip = |args: &[&str]| {
        assert!(
            Command::new("ip").args(args).status().unwrap().success(),
            "ip {args:?} (the tests need root)"
        );
    };
    ip(&["netns", "add", &ns]);
    ip(&["-n", &ns, "tuntap", "add", "dev", "t0", "mode", "tap"]);
    let dir = tempfile::tempdir().unwrap();
    let qmp = dir.path().join("qmp.sock");
    // Something to boot from, the same in both QEMUs (and first, as tandem places it).
    let disk = dir.path().join("disk.raw");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let child = Command::new("ip")
        .args(["netns", "exec", &ns, "qemu-system-x86_64"])
        .args(PLAIN)
        .arg("-drive")
        .arg(format!(
            "file={},format=raw,if=none,id=disk0,readonly=on",
            disk.display()
        ))
        .args(["-device", "virtio-blk-pci,drive=disk0,bootindex=0"])
        .args([
            "-accel",
            "tcg",
            "-netdev",
            "tap,id=n0,ifname=t0,script=no,downscript=no",
        ])
        .args([
            "-device",
            "virtio-net-pci,netdev=n0,mac=52:54:00:00:00:07",
            "-qmp",
        ])
        .arg(format!("unix:{},server=on,wait=off", qmp.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let s = Source {
        child,
        qmp,
        _dir: dir,
    };
    let mut c = config(128, "pc.ram");
    c.nics = vec![NicDesc {
        mac: "52:54:00:00:00:07".into(),
        model: "virtio-net-pci".into(),
        net: NicNet::User {
            forwards: Vec::new(),
        },
        pci: None,
    }];
    c.disks = vec![raw_disk(disk)];
    let e = try_adopt(&c, &s);
    let st = status(&s.qmp);
    drop(s);
    let _ = Command::new("ip").args(["netns", "del", &ns]).status();
    let AdoptError::Hardware(lines) = &e else {
        panic!("{e}: {e:?}")
    };
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("virtio: the running VM has virtio-net offering")),
        "{e}"
    );
    assert!(e.to_string().contains("set vnet_hdr = true"), "{e}");
    assert_eq!(st, "running");
}
