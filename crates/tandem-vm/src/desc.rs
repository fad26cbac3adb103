//! What a VM is made of, as an operator describes it: firmware or direct kernel boot, disks
//! (qcow2 or raw, virtio-blk or virtio-scsi, QEMU's cache and aio modes), NICs (MAC, model, and
//! what they attach to) and extra QEMU arguments. [`crate::VmConfig`] holds these; `qemu_args`
//! turns them into a command line; [`check`] refuses what QEMU or tandem cannot honour before
//! anything starts (docs/VM_DESCRIPTION.md).

use std::path::{Path, PathBuf};

pub use crate::extra_args::check_extra_args;
pub use machine::{check_pci_buses, check_topology, PciAddr, PCI_BUS_MODELS};

mod machine;

/// How the guest boots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Boot {
    /// Through the firmware (SeaBIOS, QEMU's default) from the first disk.
    Firmware,
    /// Direct kernel boot.
    Kernel {
        /// Kernel image.
        kernel: PathBuf,
        /// Initial ramdisk.
        initrd: Option<PathBuf>,
        /// Kernel command line.
        cmdline: String,
    },
}

/// A disk image format QEMU opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskFormat {
    /// Raw image.
    Raw,
    /// qcow2 image.
    Qcow2,
}

impl DiskFormat {
    /// QEMU's name for it.
    pub fn name(self) -> &'static str {
        match self {
            DiskFormat::Raw => "raw",
            DiskFormat::Qcow2 => "qcow2",
        }
    }

    /// The format of the image at `path`, from its first bytes (qcow2 magic, else raw).
    pub fn detect(path: &Path) -> std::io::Result<DiskFormat> {
        use std::io::Read;
        let mut magic = [0u8; 4];
        let mut f = std::fs::File::open(path)?;
        let n = f.read(&mut magic)?;
        Ok(if n == 4 && &magic == b"QFI\xfb" {
            DiskFormat::Qcow2
        } else {
            DiskFormat::Raw
        })
    }
}

/// The controller a disk hangs off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskBus {
    /// virtio-blk-pci.
    VirtioBlk,
    /// A scsi-hd on a virtio-scsi-pci controller.
    VirtioScsi,
}

/// One disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskDesc {
    /// The image file (the user's; tandem never rewrites it).
    pub path: PathBuf,
    /// Its format.
    pub format: DiskFormat,
    /// The controller.
    pub bus: DiskBus,
    /// QEMU cache mode (writeback, none, writethrough, directsync, unsafe).
    pub cache: Option<String>,
    /// QEMU aio mode (threads, native, io_uring).
    pub aio: Option<String>,
    /// Read-only.
    pub readonly: bool,
    /// Only `[offset, offset + size)` of a raw file (a backup's copy holds every disk of the
    /// VM in one file).
    pub slice: Option<(u64, u64)>,
    /// Its PCI address on the root bus (virtio-blk only; default: QEMU's next free slot, in
    /// the description's order).
    pub pci: Option<PciAddr>,
}

impl DiskDesc {
    /// A writable virtio-blk disk at `path` in `format`, QEMU's cache and aio modes, the next
    /// free PCI slot.
    pub fn new(path: impl Into<PathBuf>, format: DiskFormat) -> Self {
        DiskDesc {
            path: path.into(),
            format,
            bus: DiskBus::VirtioBlk,
            cache: None,
            aio: None,
            readonly: false,
            slice: None,
            pci: None,
        }
    }
}

/// What a NIC attaches to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NicNet {
    /// QEMU user networking, with `hostfwd` rules (`tcp:127.0.0.1:2222-:22`).
    User {
        /// Host forwards.
        forwards: Vec<String>,
    },
    /// A bridge: tandem creates a tap on it and puts its relay between the tap and QEMU, so
    /// that output is held until acknowledged.
    Bridge {
        /// The bridge.
        bridge: String,
        /// The network namespace it lives in (default: tandem's own).
        netns: Option<String>,
    },
    /// QEMU's stream netdev on a unix socket (what a bridged NIC becomes once its relay runs).
    Stream {
        /// The relay's socket.
        socket: PathBuf,
    },
    /// A tap QEMU opens with virtio-net headers (`vnet_hdr=on`) whose other side is a relay
    /// (what a bridged NIC becomes once its relay runs, for a VM described with `vnet_hdr`).
    Tap {
        /// The tap's name in QEMU's network namespace.
        ifname: String,
    },
}

/// One NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicDesc {
    /// MAC address (`52:54:00:...`).
    pub mac: String,
    /// QEMU device model.
    pub model: String,
    /// What it attaches to.
    pub net: NicNet,
    /// Its PCI address on the root bus (default: QEMU's next free slot, after the disks).
    pub pci: Option<PciAddr>,
}

/// The virtual size of the image at `path` (`qemu-img info`; works while QEMU has it open).
pub fn virtual_size(path: &Path, format: DiskFormat) -> Result<u64, DescError> {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "-U", "--output=json", "-f", format.name()])
        .arg(path)
        .output()
        .map_err(|source| DescError::File {
            what: "qemu-img (install Debian's qemu-utils package) for disk",
            path: path.into(),
            source,
        })?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["virtual-size"].as_u64().ok_or_else(|| {
        invalid(format!(
            "disk {}: qemu-img info failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    })
}

/// Creates a qcow2 copy-on-write overlay at `overlay` over the qcow2 image `base` (which is
/// then only read).
pub fn create_overlay(base: &Path, overlay: &Path) -> Result<(), DescError> {
    let out = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(base)
        .arg(overlay)
        .output()
        .map_err(|source| DescError::File {
            what: "qemu-img (install Debian's qemu-utils package) for overlay",
            path: overlay.into(),
            source,
        })?;
    if !out.status.success() {
        return Err(invalid(format!(
            "qemu-img create {}: {}",
            overlay.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// NIC models tandem accepts.
pub const NIC_MODELS: &[&str] = &["virtio-net-pci", "e1000", "e1000e", "rtl8139"];
/// QEMU cache modes.
pub const CACHE_MODES: &[&str] = &["writeback", "none", "writethrough", "directsync", "unsafe"];
/// QEMU aio modes.
pub const AIO_MODES: &[&str] = &["threads", "native", "io_uring"];

/// The description cannot be honoured.
#[derive(Debug, thiserror::Error)]
pub enum DescError {
    /// An extra argument collides with what tandem owns.
    #[error("extra QEMU argument {arg}: {why}")]
    Owned {
        /// The argument.
        arg: String,
        /// Why tandem refuses it and what to use instead.
        why: &'static str,
    },
    /// An extra argument that is not on the allow-list.
    #[error("extra QEMU argument {arg}: {why}")]
    NotAllowed {
        /// The argument.
        arg: String,
        /// Why it is refused.
        why: String,
    },
    /// A memory backend in the extra arguments.
    #[error("extra QEMU argument {0}: guest RAM is tandem's shared memory backend; remove it")]
    MemoryBackend(String),
    /// A file is missing or unreadable.
    #[error("{what} {path}")]
    File {
        /// What the file is for.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// Why it cannot be used.
        source: std::io::Error,
    },
    /// The image is not in the format the description names.
    #[error("disk {path}: described as {described} but the file is {actual}")]
    Format {
        /// The image.
        path: PathBuf,
        /// The described format.
        described: &'static str,
        /// The detected one.
        actual: &'static str,
    },
    /// Any other value out of range.
    #[error("{0}")]
    Invalid(String),
}

fn invalid(msg: impl Into<String>) -> DescError {
    DescError::Invalid(msg.into())
}

/// A memory backend id QEMU accepts as the guest RAM's name (`ram_block`): a letter, then
/// letters, digits, `-`, `.` or `_`, at most 64 characters.
pub fn check_ram_block(id: &str) -> Result<(), DescError> {
    let ok = id.len() <= 64
        && id.starts_with(|c: char| c.is_ascii_alphabetic())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "ram_block {id:?}: a letter, then letters, digits, '-', '.' or '_' (at most 64), e.g. \"pc.ram\" for a QEMU started with plain -m"
        )))
    }
}

/// A MAC address tandem can give a NIC: six hex octets, unicast.
pub fn check_mac(mac: &str) -> Result<(), DescError> {
    let octets: Vec<&str> = mac.split(':').collect();
    let ok = octets.len() == 6
        && octets
            .iter()
            .all(|o| o.len() == 2 && u8::from_str_radix(o, 16).is_ok());
    if !ok {
        return Err(invalid(format!(
            "NIC MAC address {mac:?} is not six hex octets such as 52:54:00:12:34:56"
        )));
    }
    let first = u8::from_str_radix(octets[0], 16).unwrap_or(1);
    if first & 1 == 1 {
        return Err(invalid(format!(
            "NIC MAC address {mac} is a multicast address; use a unicast one (52:54:00:...)"
        )));
    }
    Ok(())
}

fn readable(what: &'static str, path: &Path) -> Result<(), DescError> {
    std::fs::File::open(path)
        .and_then(|f| f.metadata())
        .and_then(|m| {
            use std::os::unix::fs::FileTypeExt;
            // A block device is a raw disk (an LVM volume, a partition).
            if m.is_file() || m.file_type().is_block_device() {
                Ok(())
            } else {
                Err(std::io::Error::other(
                    "neither a regular file nor a block device",
                ))
            }
        })
        .map_err(|source| DescError::File {
            what,
            path: path.into(),
            source,
        })
}

/// Checks a description before anything starts: files exist and are readable, formats match,
/// machine, vCPUs, MACs, models, cache and aio modes are usable, extra arguments do not
/// collide. `host_cpus`: what the host allows.
pub fn check(
    machine: &str,
    vcpus: u32,
    host_cpus: u32,
    boot: &Boot,
    disks: &[DiskDesc],
    nics: &[NicDesc],
    extra_args: &[String],
) -> Result<(), DescError> {
    let plain = machine
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
    let machine_ok = plain
        && (["q35", "pc"].contains(&machine)
            || machine.starts_with("pc-q35-")
            || machine.starts_with("pc-i440fx-"));
    if !machine_ok {
        return Err(invalid(format!(
            "machine {machine:?} is not supported: use q35 or pc (or a versioned pc-q35-*/pc-i440fx-*)"
        )));
    }
    if vcpus == 0 || vcpus > host_cpus {
        return Err(invalid(format!(
            "{vcpus} vCPUs: this host allows 1 to {host_cpus}"
        )));
    }
    if let Boot::Kernel { kernel, initrd, .. } = boot {
        readable("boot kernel", kernel)?;
        if let Some(i) = initrd {
            readable("boot initrd", i)?;
        }
    }
    if *boot == Boot::Firmware && disks.is_empty() {
        return Err(invalid(
            "firmware boot needs a disk to boot from: add a [[disk]] or a [boot] kernel",
        ));
    }
    for d in disks {
        check_disk(d)?;
    }
    let mut macs = std::collections::HashSet::new();
    for n in nics {
        check_mac(&n.mac)?;
        if !macs.insert(n.mac.to_ascii_lowercase()) {
            return Err(invalid(format!("two NICs have the MAC address {}", n.mac)));
        }
        if let NicNet::User { forwards } = &n.net {
            for f in forwards {
                let (proto, rest) = f.split_once(':').unwrap_or(("", ""));
                let ok = ["tcp", "udp"].contains(&proto)
                    && rest.contains('-')
                    && !f.contains(',')
                    && f.chars()
                        .all(|c| c.is_ascii_alphanumeric() || ":.-".contains(c));
                if !ok {
                    return Err(invalid(format!(
                        "NIC {} forward {f:?} is not a host forward such as tcp:127.0.0.1:2222-:22",
                        n.mac
                    )));
                }
            }
        }
        if let NicNet::Bridge { bridge, netns } = &n.net {
            check_bridge(&n.mac, bridge, netns.as_deref())?;
        }
        if !NIC_MODELS.contains(&n.model.as_str()) {
            return Err(invalid(format!(
                "NIC model {:?} is not supported: use one of {}",
                n.model,
                NIC_MODELS.join(", ")
            )));
        }
    }
    machine::check_pci(disks, nics)?;
    let addrs: Vec<PciAddr> = disks
        .iter()
        .filter_map(|d| d.pci)
        .chain(nics.iter().filter_map(|n| n.pci))
        .collect();
    machine::check_pci_buses(&addrs, extra_args)?;
    check_extra_args(extra_args)
}

/// A bridge of this network namespace must exist and be a bridge; another namespace must
/// exist (tandem creates the tap inside it, which fails clearly if its bridge is missing).
fn check_bridge(mac: &str, bridge: &str, netns: Option<&str>) -> Result<(), DescError> {
    let plain = |s: &str| !s.is_empty() && !s.contains('/') && s != "." && s != "..";
    if !plain(bridge) || netns.is_some_and(|n| !plain(n)) {
        return Err(invalid(format!(
            "NIC {mac}: {bridge:?} is not a bridge name"
        )));
    }
    match netns {
        Some(ns) if !std::path::Path::new("/run/netns").join(ns).exists() => Err(invalid(format!(
            "NIC {mac}: network namespace {ns} does not exist (ip netns add {ns})"
        ))),
        Some(_) => Ok(()),
        None if !std::path::Path::new("/sys/class/net")
            .join(bridge)
            .join("bridge")
            .is_dir() =>
        {
            Err(invalid(format!(
                "NIC {mac}: bridge {bridge} does not exist on this host or is not a bridge (create it: ip link add {bridge} type bridge; ip link set {bridge} up)"
            )))
        }
        None => Ok(()),
    }
}

fn check_disk(d: &DiskDesc) -> Result<(), DescError> {
    readable("disk image", &d.path)?;
    if d.slice.is_some() {
        // A slice of a backup's copy: raw by construction, its first bytes are another disk's.
        return Ok(());
    }
    let actual = DiskFormat::detect(&d.path).map_err(|source| DescError::File {
        what: "disk image",
        path: d.path.clone(),
        source,
    })?;
    if actual != d.format {
        return Err(DescError::Format {
            path: d.path.clone(),
            described: d.format.name(),
            actual: actual.name(),
        });
    }
    if let Some(c) = &d.cache {
        if !CACHE_MODES.contains(&c.as_str()) {
            return Err(invalid(format!(
                "disk {}: cache {c:?} is not one of {}",
                d.path.display(),
                CACHE_MODES.join(", ")
            )));
        }
    }
    if let Some(a) = &d.aio {
        if !AIO_MODES.contains(&a.as_str()) {
            return Err(invalid(format!(
                "disk {}: aio {a:?} is not one of {}",
                d.path.display(),
                AIO_MODES.join(", ")
            )));
        }
        let direct = matches!(d.cache.as_deref(), Some("none") | Some("directsync"));
        if a == "native" && !direct {
            return Err(invalid(format!(
                "disk {}: aio \"native\" needs cache \"none\" or \"directsync\" (QEMU refuses it otherwise)",
                d.path.display()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs() {
        check_mac("52:54:00:12:34:56").unwrap();
        assert!(check_mac("52:54:00:12:34").is_err());
        assert!(check_mac("01:00:5e:00:00:01")
            .unwrap_err()
            .to_string()
            .contains("multicast"));
        assert!(check_mac("zz:54:00:12:34:56").is_err());
    }

    #[test]
    fn formats_are_detected_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("a.img");
        std::fs::write(&raw, vec![0u8; 4096]).unwrap();
        let qcow = dir.path().join("b.qcow2");
        let mut q = b"QFI\xfb".to_vec();
        q.resize(4096, 0);
        std::fs::write(&qcow, q).unwrap();
        assert_eq!(DiskFormat::detect(&raw).unwrap(), DiskFormat::Raw);
        assert_eq!(DiskFormat::detect(&qcow).unwrap(), DiskFormat::Qcow2);
        let disk = |path: &Path, format| DiskDesc::new(path, format);
        let ok = |d: DiskDesc| check("q35", 1, 2, &Boot::Firmware, &[d], &[], &[]);
        ok(disk(&raw, DiskFormat::Raw)).unwrap();
        let e = ok(disk(&raw, DiskFormat::Qcow2)).unwrap_err();
        assert!(
            e.to_string()
                .contains("described as qcow2 but the file is raw"),
            "{e}"
        );
        let e = ok(disk(&dir.path().join("missing"), DiskFormat::Raw)).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
        let mut d = disk(&raw, DiskFormat::Raw);
        d.aio = Some("native".into());
        assert!(ok(d).unwrap_err().to_string().contains("cache"));
        let e = check(
            "q35",
            3,
            2,
            &Boot::Firmware,
            &[disk(&raw, DiskFormat::Raw)],
            &[],
            &[],
        );
        assert!(e.unwrap_err().to_string().contains("allows 1 to 2"));
        let e = check(
            "virt",
            1,
            2,
            &Boot::Firmware,
            &[disk(&raw, DiskFormat::Raw)],
            &[],
            &[],
        );
        assert!(e.unwrap_err().to_string().contains("q35 or pc"));
        let e = check("q35", 1, 2, &Boot::Firmware, &[], &[], &[]);
        assert!(e.unwrap_err().to_string().contains("needs a disk"));
    }
}
