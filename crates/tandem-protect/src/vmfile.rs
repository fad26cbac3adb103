//! The TOML VM description (docs/VM_DESCRIPTION.md): how the VM boots (`[boot]`), its disks
//! (`[[disk]]`) and NICs (`[[nic]]`), and `mem`, `vcpus`, `machine`, `topology`, `ram_block`, `vnet_hdr`, `extra_args`, `ready`,
//! `dirty_log`, `qemu`, `accel`, `label`, `legacy_virtio`, `scratch_disk_mib`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tandem_vm::{Boot, DiskBus, DiskDesc, DiskFormat, NicDesc, NicNet, VmConfig};

/// The file.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VmFile {
    /// What the guest runs, in a word, for reports.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Guest RAM in MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem: Option<u64>,
    /// Virtual CPUs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    /// Machine type (q35, pc).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine: Option<String>,
    /// vCPU topology (`sockets=2,cores=1,threads=1`; default: QEMU's for the machine type).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topology: Option<String>,
    /// The name of the guest RAM's block in QEMU's migration stream (default `ram0`; a QEMU
    /// started with plain `-m`, and libvirt, name it `pc.ram`): a VM adopted from a running
    /// QEMU keeps that QEMU's name (`tandem adopt`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ram_block: Option<String>,
    /// Bridged NICs reach tandem's relay through a tap with virtio-net headers, as libvirt
    /// runs virtio NICs (the guest keeps its offloads; needed to adopt such a VM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vnet_hdr: Option<bool>,
    /// Console text that means the guest is ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// Console lines containing one of these are echoed by the daemons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub echo: Vec<String>,
    /// Seconds a shutdown waits for the guest to power off after the ACPI power button
    /// before QEMU quits (0: quit at once).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_timeout_s: Option<u64>,
    /// Dirty log (auto, uffd, hash).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dirty_log: Option<String>,
    /// QEMU binary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qemu: Option<PathBuf>,
    /// Accelerator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accel: Option<String>,
    /// Legacy-only virtio-pci (smaller device state; the guest needs transitional drivers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub legacy_virtio: Option<bool>,
    /// A scratch data disk of this many MiB that tandem creates, formats and serves.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scratch_disk_mib: Option<u64>,
    /// How it boots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot: Option<BootFile>,
    /// Disks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk: Vec<DiskFile>,
    /// NICs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nic: Vec<NicFile>,
    /// Extra QEMU arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_args: Vec<String>,
}

/// `[boot]`.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BootFile {
    /// `seabios` (the default without a kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub firmware: Option<String>,
    /// Direct kernel boot: the kernel.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    /// Its initrd.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    /// Its command line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    /// The command-line key through which the guest takes its address on a bridge.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address_arg: Option<String>,
}

/// `[[disk]]`.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DiskFile {
    /// Image file.
    pub path: PathBuf,
    /// qcow2 or raw (default: detected from the file).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// virtio-blk (default) or virtio-scsi.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bus: Option<String>,
    /// QEMU cache mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<String>,
    /// QEMU aio mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aio: Option<String>,
    /// Read-only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub readonly: bool,
    /// PCI address on the root bus, `SLOT[.FUNCTION]` in hex (virtio-blk only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pci: Option<String>,
}

/// `[[nic]]`.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NicFile {
    /// MAC address.
    pub mac: String,
    /// Device model (default virtio-net-pci).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Bridge to attach to (through tandem's relay); without it, QEMU user networking.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// Network namespace of the bridge.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
    /// User networking host forwards (`tcp:127.0.0.1:2222-:22`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forward: Vec<String>,
    /// PCI address on the root bus, `SLOT[.FUNCTION]` in hex.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pci: Option<String>,
}

/// The description says something that cannot be.
#[derive(Debug, thiserror::Error)]
pub enum VmFileError {
    /// Nothing to boot from.
    #[error("no [boot] and no [[disk]]: describe how the VM boots (a kernel in [boot], or its boot disk as the first [[disk]])")]
    NothingToBoot,
    /// A value out of its set.
    #[error("{0}")]
    Invalid(String),
    /// A disk image cannot be read to detect its format.
    #[error("disk image {0}")]
    Detect(PathBuf, #[source] std::io::Error),
}

impl VmFile {
    /// Whether this describes something to boot (a kernel or a disk).
    pub fn is_bootable(&self) -> bool {
        self.boot.is_some() || !self.disk.is_empty()
    }

    /// Reads the file; `toml::de::Error` names the line.
    pub fn parse(text: &str) -> Result<VmFile, toml::de::Error> {
        toml::from_str(text)
    }

    /// The VM's boot, disks, NICs and the keys tandem acts on into `c` (relative paths
    /// against `base`).
    pub fn apply(&self, c: &mut VmConfig, base: &Path) -> Result<(), VmFileError> {
        if !self.is_bootable() {
            return Err(VmFileError::NothingToBoot);
        }
        c.label = self.label.clone();
        c.echo = self.echo.clone();
        if let Some(s) = self.shutdown_timeout_s {
            c.shutdown_timeout = std::time::Duration::from_secs(s);
        }
        if let Some(l) = self.legacy_virtio {
            c.legacy_virtio = l;
        }
        c.scratch_disk_mib = self.scratch_disk_mib.unwrap_or(0);
        c.address_arg = None;
        let abs = |p: &Path| {
            if p.is_absolute() {
                p.to_path_buf()
            } else {
                base.join(p)
            }
        };
        c.boot = match &self.boot {
            Some(BootFile {
                kernel: Some(k),
                initrd,
                cmdline,
                firmware: None,
                address_arg,
            }) => {
                c.address_arg = address_arg.clone();
                Boot::Kernel {
                    kernel: abs(k),
                    initrd: initrd.as_deref().map(abs),
                    cmdline: cmdline.clone().unwrap_or_default(),
                }
            }
            Some(BootFile {
                kernel: Some(_),
                firmware: Some(_),
                ..
            }) => {
                return Err(VmFileError::Invalid(
                    "[boot]: give either `firmware` or `kernel`, not both".into(),
                ))
            }
            Some(b) if b.initrd.is_some() || b.cmdline.is_some() || b.address_arg.is_some() => {
                return Err(VmFileError::Invalid(
                    "[boot]: `initrd`, `cmdline` and `address_arg` need a `kernel` (direct kernel boot)".into(),
                ))
            }
            Some(b) => match b.firmware.as_deref() {
                None | Some("seabios") => Boot::Firmware,
                Some(f) => {
                    return Err(VmFileError::Invalid(format!(
                        "[boot] firmware {f:?} is not supported: use \"seabios\" or a kernel (UEFI needs pflash variables tandem does not replicate yet)"
                    )))
                }
            },
            None => Boot::Firmware,
        };
        c.disks = self
            .disk
            .iter()
            .map(|d| d.desc(&abs(&d.path)))
            .collect::<Result<_, _>>()?;
        c.nics = self
            .nic
            .iter()
            .map(NicFile::desc)
            .collect::<Result<_, _>>()?;
        if c.scratch_disk_mib > 0 && c.writable_disk().is_some() {
            return Err(VmFileError::Invalid(
                "`scratch_disk_mib` with a writable [[disk]]: tandem captures one or the other; make the scratch disk one of your [[disk]]s".into(),
            ));
        }
        Ok(())
    }
}

impl DiskFile {
    fn desc(&self, path: &Path) -> Result<DiskDesc, VmFileError> {
        let format = match self.format.as_deref() {
            Some("qcow2") => DiskFormat::Qcow2,
            Some("raw") => DiskFormat::Raw,
            None => DiskFormat::detect(path).map_err(|e| VmFileError::Detect(path.into(), e))?,
            Some(f) => {
                return Err(VmFileError::Invalid(format!(
                    "disk {}: format {f:?} is not supported: use qcow2 or raw (convert with `qemu-img convert -O qcow2`)",
                    path.display()
                )))
            }
        };
        let bus = match self.bus.as_deref() {
            None | Some("virtio-blk") | Some("virtio") => DiskBus::VirtioBlk,
            Some("virtio-scsi") | Some("scsi") => DiskBus::VirtioScsi,
            Some(b) => {
                return Err(VmFileError::Invalid(format!(
                    "disk {}: bus {b:?} is not supported: use virtio-blk or virtio-scsi",
                    path.display()
                )))
            }
        };
        Ok(DiskDesc {
            path: path.into(),
            format,
            bus,
            cache: self.cache.clone(),
            aio: self.aio.clone(),
            readonly: self.readonly,
            slice: None,
            pci: pci(self.pci.as_deref())?,
        })
    }
}

impl NicFile {
    fn desc(&self) -> Result<NicDesc, VmFileError> {
        if self.netns.is_some() && self.bridge.is_none() {
            return Err(VmFileError::Invalid(format!(
                "NIC {}: `netns` names where `bridge` lives; give the bridge too",
                self.mac
            )));
        }
        let net = match &self.bridge {
            Some(b) => {
                if !self.forward.is_empty() {
                    return Err(VmFileError::Invalid(format!(
                        "NIC {}: `forward` is for user networking; a bridged NIC is reached through its bridge",
                        self.mac
                    )));
                }
                NicNet::Bridge {
                    bridge: b.clone(),
                    netns: self.netns.clone(),
                }
            }
            None => NicNet::User {
                forwards: self.forward.clone(),
            },
        };
        Ok(NicDesc {
            mac: self.mac.clone(),
            model: self
                .model
                .clone()
                .unwrap_or_else(|| "virtio-net-pci".into()),
            net,
            pci: pci(self.pci.as_deref())?,
        })
    }
}

fn pci(s: Option<&str>) -> Result<Option<tandem_vm::PciAddr>, VmFileError> {
    s.map(tandem_vm::PciAddr::parse)
        .transpose()
        .map_err(|e| VmFileError::Invalid(e.to_string()))
}

impl VmFile {
    /// The description of `c`, as a file that describes the same VM (`tandem vm show`).
    pub fn from_config(c: &VmConfig) -> VmFile {
        let boot = match &c.boot {
            Boot::Firmware => BootFile {
                firmware: Some("seabios".into()),
                ..BootFile::default()
            },
            Boot::Kernel {
                kernel,
                initrd,
                cmdline,
            } => BootFile {
                firmware: None,
                kernel: Some(kernel.clone()),
                initrd: initrd.clone(),
                cmdline: Some(cmdline.clone()),
                address_arg: c.address_arg.clone(),
            },
        };
        let disk = c
            .disks
            .iter()
            .map(|d| DiskFile {
                path: d.path.clone(),
                format: Some(d.format.name().into()),
                bus: Some(
                    match d.bus {
                        DiskBus::VirtioBlk => "virtio-blk",
                        DiskBus::VirtioScsi => "virtio-scsi",
                    }
                    .into(),
                ),
                cache: d.cache.clone(),
                aio: d.aio.clone(),
                readonly: d.readonly,
                pci: d.pci.map(|p| p.to_string()),
            })
            .collect();
        let nic = c
            .nics
            .iter()
            .map(|n| {
                let (bridge, netns, forward) = match &n.net {
                    NicNet::User { forwards } => (None, None, forwards.clone()),
                    NicNet::Bridge { bridge, netns } => {
                        (Some(bridge.clone()), netns.clone(), Vec::new())
                    }
                    NicNet::Stream { .. } | NicNet::Tap { .. } => (None, None, Vec::new()),
                };
                NicFile {
                    mac: n.mac.clone(),
                    model: Some(n.model.clone()),
                    bridge,
                    netns,
                    forward,
                    pci: n.pci.map(|p| p.to_string()),
                }
            })
            .collect();
        VmFile {
            mem: Some(c.mem_mib),
            vcpus: Some(c.vcpus),
            machine: Some(c.machine.clone()),
            topology: c.topology.clone(),
            ram_block: (c.ram_block != "ram0").then(|| c.ram_block.clone()),
            vnet_hdr: c.vnet_hdr.then_some(true),
            ready: c.ready.clone(),
            accel: Some(c.accel.clone()),
            qemu: Some(c.qemu.clone()),
            boot: Some(boot),
            disk,
            nic,
            extra_args: c.extra_args.clone(),
            label: c.label.clone(),
            echo: c.echo.clone(),
            shutdown_timeout_s: Some(c.shutdown_timeout.as_secs()),
            legacy_virtio: c.legacy_virtio.then_some(true),
            scratch_disk_mib: (c.scratch_disk_mib > 0).then_some(c.scratch_disk_mib),
            ..VmFile::default()
        }
    }

    /// As TOML text.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
    }
}
