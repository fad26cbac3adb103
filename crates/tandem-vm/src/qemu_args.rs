//! The QEMU command line of a tandem guest: guest RAM in a shared file (so tandem maps it
//! too), the described boot, disks and NICs, optional NBD data disk, the serial console on a
//! unix socket an operator attaches to (`tandem console`) and logged whole to a file, QMP on a
//! unix socket, then the description's extra arguments.

use std::path::Path;

use crate::desc::{Boot, DiskBus, NicNet};
use crate::vm::VmConfig;

/// How a QEMU starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Paused (`-S`): the caller arms what it needs, then `cont`.
    Paused,
    /// Paused, waiting for a migration stream (`-S -incoming defer`): a restore or a standby.
    Incoming,
    /// Waiting for a migration stream and running the guest as soon as it is loaded
    /// (`-incoming defer` without `-S`): adopting a running VM ([`crate::adopt`]).
    IncomingRun,
}

/// The QEMU command line for `config`.
pub fn qemu_args(
    config: &VmConfig,
    ram: &Path,
    qmp: &Path,
    serial: &Path,
    start: Start,
) -> Vec<String> {
    let mem = format!("{}M", config.mem_mib);
    let id = &config.ram_block;
    let mut a: Vec<String> = vec![
        "-name".into(),
        format!("tandem-{}", config.name),
        "-accel".into(),
        config.accel.clone(),
        "-machine".into(),
        format!("{},memory-backend={id}", config.machine),
        "-object".into(),
        format!(
            "memory-backend-file,id={id},size={mem},mem-path={},share=on",
            ram.display()
        ),
        "-m".into(),
        mem,
        "-smp".into(),
        match &config.topology {
            Some(t) => format!("{},{t}", config.vcpus),
            None => config.vcpus.to_string(),
        },
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
    ];
    if start != Start::IncomingRun {
        a.push("-S".into());
    }
    if config.legacy_virtio {
        a.extend(["-global".into(), "virtio-pci.disable-modern=on".into()]);
    }
    if let Boot::Kernel {
        kernel,
        initrd,
        cmdline,
    } = &config.boot
    {
        a.extend(["-kernel".into(), kernel.display().to_string()]);
        if let Some(i) = initrd {
            a.extend(["-initrd".into(), i.display().to_string()]);
        }
        a.extend(["-append".into(), cmdline.clone()]);
    }
    // PCI buses first when disks or NICs sit behind them (`pci = "BUS:SLOT.FN"`); otherwise
    // the order stays as it was (devices without an address keep their slots).
    let behind = config
        .disks
        .iter()
        .filter_map(|d| d.pci)
        .chain(config.nics.iter().filter_map(|n| n.pci))
        .any(|p| p.bus != 0);
    let (buses, rest) = if behind {
        split_buses(&config.extra_args)
    } else {
        (Vec::new(), config.extra_args.clone())
    };
    a.extend(buses);
    disks(config, &mut a);
    nics(config, &mut a);
    a.extend([
        "-chardev".into(),
        // The console: a socket an operator attaches to, everything logged to the file
        // (also while nobody is attached). logappend=on: QEMU opens the log O_APPEND, so a
        // rotation that truncates it (tandem-protect's console follower) leaves no hole.
        format!(
            "socket,id=ser0,path={},server=on,wait=off,logfile={},logappend=on",
            console_socket(qmp).display(),
            serial.display()
        ),
        "-serial".into(),
        "chardev:ser0".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", qmp.display()),
    ]);
    if let Some(sock) = &config.data_disk {
        a.extend([
            "-drive".into(),
            format!(
                "file=nbd+unix:///?socket={},format=raw,if=none,id=data",
                sock.display()
            ),
            "-device".into(),
            "virtio-blk-pci,drive=data".into(),
        ]);
    }
    if start != Start::Paused {
        a.extend(["-incoming".into(), "defer".into()]);
    }
    a.extend(rest);
    a
}

/// The monitors of the commands tandem arms ahead of each checkpoint pause
/// ([`crate::qmp::Armed`]): one per command, next to the QMP socket `qmp`.
pub const ARMED: [&str; 3] = ["stop", crate::devstate::fast::XEN_SAVE, "cont"];

/// The socket of the monitor that `command` (one of [`ARMED`]) is armed on.
pub fn armed_socket(qmp: &Path, command: &str) -> std::path::PathBuf {
    let short = command.split('-').next().unwrap_or(command);
    qmp.with_file_name(format!("qmp-{short}.sock"))
}

/// QEMU's arguments for the [`ARMED`] commands' monitors (tandem's own QEMU only: a QEMU run
/// by hand has none, and tandem's commands then go to its one monitor).
pub fn armed_monitors(qmp: &Path) -> Vec<String> {
    ARMED
        .iter()
        .flat_map(|c| {
            [
                "-qmp".to_string(),
                format!("unix:{},server=on,wait=off", armed_socket(qmp, c).display()),
            ]
        })
        .collect()
}

/// The serial console's socket: next to the QMP socket `qmp` (in the VM's runtime directory,
/// whose short path fits a unix socket's).
pub fn console_socket(qmp: &Path) -> std::path::PathBuf {
    qmp.with_file_name("console.sock")
}

/// The `-device` arguments of `extra` that create PCI buses, and the rest, in order.
fn split_buses(extra: &[String]) -> (Vec<String>, Vec<String>) {
    let (mut buses, mut rest) = (Vec::new(), Vec::new());
    let mut it = extra.iter();
    while let Some(a) = it.next() {
        if a.trim_start_matches('-') == "device" {
            if let Some(v) = it.next() {
                let model = v.split(',').next().unwrap_or("");
                let model = model.strip_prefix("driver=").unwrap_or(model);
                let to = if crate::desc::PCI_BUS_MODELS.contains(&model) {
                    &mut buses
                } else {
                    &mut rest
                };
                to.extend([a.clone(), v.clone()]);
                continue;
            }
        }
        rest.push(a.clone());
    }
    (buses, rest)
}

/// `-drive` + `-device` per disk; one virtio-scsi controller if any disk needs it. With
/// firmware boot the first disk gets `bootindex=0`.
fn disks(config: &VmConfig, a: &mut Vec<String>) {
    if config.disks.iter().any(|d| d.bus == DiskBus::VirtioScsi) {
        a.extend(["-device".into(), "virtio-scsi-pci,id=scsi0".into()]);
    }
    for (i, d) in config.disks.iter().enumerate() {
        // QEMU's option syntax doubles commas inside values.
        let path = d.path.display().to_string().replace(',', ",,");
        let mut drive = format!("file={path},format={},if=none,id=disk{i}", d.format.name());
        if let Some(c) = &d.cache {
            drive.push_str(&format!(",cache={c}"));
        }
        if let Some(x) = &d.aio {
            drive.push_str(&format!(",aio={x}"));
        }
        if d.readonly {
            drive.push_str(",readonly=on");
        }
        if let Some((offset, size)) = d.slice {
            // Several slices of one copy file are open in one QEMU: no image locking.
            drive.push_str(&format!(",offset={offset},size={size},file.locking=off"));
        }
        let mut dev = match d.bus {
            DiskBus::VirtioBlk => format!("virtio-blk-pci,drive=disk{i}"),
            DiskBus::VirtioScsi => format!("scsi-hd,drive=disk{i},bus=scsi0.0"),
        };
        if i == 0 && config.boot == Boot::Firmware {
            dev.push_str(",bootindex=0");
        }
        if let (Some(p), DiskBus::VirtioBlk) = (d.pci, d.bus) {
            dev.push_str(&format!(",{}", p.qemu()));
        }
        a.extend(["-drive".into(), drive, "-device".into(), dev]);
    }
}

/// `-netdev` + `-device` per NIC.
fn nics(config: &VmConfig, a: &mut Vec<String>) {
    for (i, n) in config.nics.iter().enumerate() {
        let netdev = match &n.net {
            NicNet::User { forwards } => {
                let mut s = format!("user,id=n{i}");
                for f in forwards {
                    s.push_str(&format!(",hostfwd={f}"));
                }
                s
            }
            NicNet::Stream { socket } => format!(
                "stream,id=n{i},server=off,addr.type=unix,addr.path={}",
                socket.display()
            ),
            NicNet::Tap { ifname } => {
                format!("tap,id=n{i},ifname={ifname},script=no,downscript=no,vnet_hdr=on")
            }
            // Not started yet: a bridged NIC is turned into a relay's stream by the daemon
            // that owns the relay; a VM started directly gets no network on it.
            NicNet::Bridge { .. } => format!("user,id=n{i},restrict=on"),
        };
        let mut dev = format!("{},netdev=n{i},mac={}", n.model, n.mac);
        if let Some(p) = n.pci {
            dev.push_str(&format!(",{}", p.qemu()));
        }
        a.extend(["-netdev".into(), netdev, "-device".into(), dev]);
    }
}

/// The command line (without the binary) of a QEMU running `c` the way a person starts it, to
/// be adopted later (`tandem adopt`): tandem's own, with what tandem owns taken out — RAM from
/// plain `-m` (QEMU's anonymous memory, whose RAM block is `pc.ram`: describe it with
/// `ram_block = "pc.ram"`), no `-S` — its QMP socket at `qmp`, its console in `serial`, and
/// NIC `i`'s backend `-netdev` replaced by `netdevs[i]` (e.g.
/// `tap,id=n0,ifname=tap0,script=no,downscript=no`; the id must stay `n{i}`) where given.
pub fn by_hand(c: &VmConfig, qmp: &Path, serial: &Path, netdevs: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = qemu_args(c, "/unused".as_ref(), qmp, serial, Start::Paused).into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-S" => {}
            // tandem's memory backend: plain -m names guest RAM pc.ram.
            "-object" => drop(it.next()),
            "-machine" => {
                let m = it.next().unwrap_or_default();
                let kept: Vec<&str> = m
                    .split(',')
                    .filter(|o| !o.starts_with("memory-backend="))
                    .collect();
                out.extend(["-machine".to_string(), kept.join(",")]);
            }
            "-netdev" => {
                let n = it.next().unwrap_or_default();
                let i: Option<usize> = n
                    .split(',')
                    .find_map(|o| o.strip_prefix("id=n"))
                    .and_then(|i| i.parse().ok());
                let given = i.and_then(|i| netdevs.get(i));
                out.extend(["-netdev".to_string(), given.map_or(n, |g| g.to_string())]);
            }
            _ => out.push(a),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tandems_memory_backend_and_pause_go_and_the_nic_goes_on_the_given_network() {
        let mut c = VmConfig::custom("h");
        c.nics = vec![NicDesc {
            mac: "52:54:00:00:00:09".into(),
            model: "virtio-net-pci".into(),
            net: NicNet::User {
                forwards: Vec::new(),
            },
            pci: None,
        }];
        let a = by_hand(
            &c,
            "/q".as_ref(),
            "/s".as_ref(),
            &["tap,id=n0,ifname=t0,script=no,downscript=no"],
        )
        .join(" ");
        assert!(a.contains("-machine q35 "), "{a}");
        assert!(a.contains("-m 256M"), "{a}");
        assert!(!a.contains("memory-backend"), "{a}");
        assert!(!a.contains(" -S"), "{a}");
        assert!(a.contains("-netdev tap,id=n0,ifname=t0"), "{a}");
        assert!(
            a.contains("virtio-net-pci,netdev=n0,mac=52:54:00:00:00:09"),
            "{a}"
        );
    }

    /// A raw virtio-blk disk at `path`, writable, QEMU's defaults otherwise.
    fn blk(path: &str) -> DiskDesc {
        DiskDesc::new(path, DiskFormat::Raw)
    }

    /// The command line of `c`, as one string.
    fn line(c: &VmConfig, start: Start) -> String {
        qemu_args(c, "/r".as_ref(), "/q".as_ref(), "/s".as_ref(), start).join(" ")
    }
    use crate::desc::{DiskDesc, DiskFormat, NicDesc};

    #[test]
    fn described_vm_becomes_a_command_line() {
        let mut c = VmConfig::custom("web");
        c.vcpus = 2;
        c.machine = "pc".into();
        c.disks = vec![
            DiskDesc {
                path: "/img/a,b.qcow2".into(),
                format: DiskFormat::Qcow2,
                bus: DiskBus::VirtioScsi,
                cache: Some("none".into()),
                aio: Some("native".into()),
                readonly: false,
                slice: None,
                pci: None,
            },
            DiskDesc {
                readonly: true,
                slice: Some((1 << 20, 1 << 30)),
                pci: Some(crate::desc::PciAddr::parse("0x07").unwrap()),
                ..DiskDesc::new("/img/data.raw", DiskFormat::Raw)
            },
        ];
        c.nics = vec![NicDesc {
            mac: "52:54:00:aa:bb:cc".into(),
            model: "e1000".into(),
            net: NicNet::User {
                forwards: vec!["tcp:127.0.0.1:2222-:22".into()],
            },
            pci: Some(crate::desc::PciAddr::parse("03.0").unwrap()),
        }];
        c.extra_args = vec!["-rtc".into(), "base=utc".into()];
        let a = line(&c, Start::Paused);
        for want in [
            "-machine pc,memory-backend=ram0",
            "-smp 2",
            "-device virtio-scsi-pci,id=scsi0",
            "file=/img/a,,b.qcow2,format=qcow2,if=none,id=disk0,cache=none,aio=native",
            "scsi-hd,drive=disk0,bus=scsi0.0,bootindex=0",
            "file=/img/data.raw,format=raw,if=none,id=disk1,readonly=on,offset=1048576,size=1073741824,file.locking=off",
            "virtio-blk-pci,drive=disk1,addr=0x7.0",
            "user,id=n0,hostfwd=tcp:127.0.0.1:2222-:22",
            "e1000,netdev=n0,mac=52:54:00:aa:bb:cc,addr=0x3.0",
        ] {
            assert!(a.contains(want), "{want} missing from {a}");
        }
        assert!(a.ends_with("-rtc base=utc"), "{a}");
        assert!(
            !a.contains("disable-modern"),
            "a described VM keeps its devices"
        );
        assert!(!a.contains("-kernel"));
    }

    #[test]
    fn a_kernel_boot_with_legacy_virtio() {
        use crate::desc::{DiskDesc, NicDesc};
        let mut c = VmConfig::custom("k");
        c.legacy_virtio = true;
        c.boot = Boot::Kernel {
            kernel: "/img/vmlinuz".into(),
            initrd: Some("/img/initrd".into()),
            cmdline: "console=ttyS0 app=kv".into(),
        };
        c.disks = vec![DiskDesc {
            readonly: true,
            ..blk("/img/apps.img")
        }];
        c.nics = vec![NicDesc {
            mac: "52:54:00:12:34:56".into(),
            model: "virtio-net-pci".into(),
            net: NicNet::User {
                forwards: vec!["tcp:127.0.0.1:6000-:6379".into()],
            },
            pci: None,
        }];
        let a = line(&c, Start::Incoming);
        for want in [
            "-smp 1",
            "-kernel /img/vmlinuz -initrd /img/initrd -append console=ttyS0 app=kv",
            "apps.img,format=raw,if=none,id=disk0,readonly=on",
            "user,id=n0,hostfwd=tcp:127.0.0.1:6000-:6379",
            "virtio-net-pci,netdev=n0,mac=52:54:00:12:34:56",
            "-incoming defer",
            "-global virtio-pci.disable-modern=on",
        ] {
            assert!(a.contains(want), "{want} missing from {a}");
        }
        assert!(!a.contains("bootindex"));
        assert!(a.contains(" -S "), "{a}");
    }

    #[test]
    fn an_adopting_qemu_runs_the_guest_once_loaded_under_the_sources_ram_block_name() {
        let mut c = VmConfig::custom("a");
        c.ram_block = "pc.ram".into();
        let a = line(&c, Start::IncomingRun);
        assert!(a.contains("-machine q35,memory-backend=pc.ram"), "{a}");
        assert!(a.contains("memory-backend-file,id=pc.ram,size=256M,mem-path=/r,share=on"));
        assert!(a.contains("-incoming defer"), "{a}");
        assert!(!a.contains(" -S"), "{a}");
    }

    #[test]
    fn buses_come_before_the_devices_behind_them() {
        let mut c = VmConfig::custom("lv");
        c.vcpus = 2;
        c.topology = Some("sockets=2,cores=1,threads=1".into());
        c.disks = vec![DiskDesc {
            format: DiskFormat::Qcow2,
            pci: Some(crate::desc::PciAddr::parse("04:00.0").unwrap()),
            ..blk("/img/a.qcow2")
        }];
        c.extra_args = [
            "-rtc",
            "base=utc",
            "-device",
            "pcie-root-port,id=pci.4,bus=pcie.0,addr=0x1.0x3,chassis=4",
        ]
        .map(String::from)
        .to_vec();
        let a = line(&c, Start::Paused);
        let port = a.find("pcie-root-port").unwrap();
        let disk = a
            .find("virtio-blk-pci,drive=disk0,bootindex=0,bus=pci.4,addr=0x0.0")
            .unwrap();
        assert!(port < disk, "{a}");
        assert!(a.ends_with("-rtc base=utc"), "{a}");
        assert!(a.contains("-smp 2,sockets=2,cores=1,threads=1"), "{a}");
    }
}
