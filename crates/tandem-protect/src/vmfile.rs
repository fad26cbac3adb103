//! The TOML VM description (docs/VM_DESCRIPTION.md). Two shapes: the lab guest (`workload`
//! set: kernel, initramfs, apps disk and NIC come from `./tandem setup`'s image) or your own VM
//! (`[boot]`, `[[disk]]`, `[[nic]]`). Keys shared by both: `mem`, `vcpus`, `machine`,
//! `extra_args`, `ready`, `dirty_log`, `qemu`, `accel`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tandem_vm::{Boot, DiskBus, DiskDesc, DiskFormat, NicDesc, NicNet, VmConfig};

/// The file.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VmFile {
    /// The lab guest's workload (the lab guest when set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// Guest RAM in MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem: Option<u64>,
    /// Virtual CPUs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    /// Machine type (q35, pc).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine: Option<String>,
    /// Console text that means the guest is ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// Dirty log (auto, uffd, hash).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dirty_log: Option<String>,
    /// QEMU binary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qemu: Option<PathBuf>,
    /// Accelerator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accel: Option<String>,
    /// The lab guest's image directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<PathBuf>,
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
}

/// The description says something that cannot be.
#[derive(Debug, thiserror::Error)]
pub enum VmFileError {
    /// Lab guest keys mixed with your-own-VM keys.
    #[error("`workload` makes this the lab guest, which brings its own boot, disks and NIC: remove `workload` to describe your own VM, or remove [boot], [[disk]] and [[nic]]")]
    LabMixed,
    /// A value out of its set.
    #[error("{0}")]
    Invalid(String),
    /// A disk image cannot be read to detect its format.
    #[error("disk image {0}")]
    Detect(PathBuf, #[source] std::io::Error),
}

impl VmFile {
    /// Whether this describes your own VM rather than the lab guest.
    pub fn is_custom(&self) -> bool {
        self.workload.is_none() && (self.boot.is_some() || !self.disk.is_empty())
    }

    /// Reads the file; `toml::de::Error` names the line.
    pub fn parse(text: &str) -> Result<VmFile, toml::de::Error> {
        toml::from_str(text)
    }

    /// Your own VM's boot, disks and NICs into `c` (relative paths against `base`).
    pub fn apply_custom(&self, c: &mut VmConfig, base: &Path) -> Result<(), VmFileError> {
        if self.workload.is_some()
            && (self.boot.is_some() || !self.disk.is_empty() || !self.nic.is_empty())
        {
            return Err(VmFileError::LabMixed);
        }
        if !self.is_custom() {
            if !self.nic.is_empty() {
                return Err(VmFileError::Invalid(
                    "[[nic]] without [boot] or [[disk]]: describe the VM's disks (or its kernel) too".into(),
                ));
            }
            return Ok(());
        }
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
            }) => Boot::Kernel {
                kernel: abs(k),
                initrd: initrd.as_deref().map(abs),
                cmdline: cmdline.clone().unwrap_or_default(),
            },
            Some(BootFile {
                kernel: Some(_),
                firmware: Some(_),
                ..
            }) => {
                return Err(VmFileError::Invalid(
                    "[boot]: give either `firmware` or `kernel`, not both".into(),
                ))
            }
            Some(b) if b.initrd.is_some() || b.cmdline.is_some() => {
                return Err(VmFileError::Invalid(
                    "[boot]: `initrd` and `cmdline` need a `kernel` (direct kernel boot)".into(),
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
        })
    }
}

impl VmFile {
    /// The description of `c`, as a file that describes the same VM (`tandem vm show`): the
    /// lab guest comes out as the plain VM it is.
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
                    NicNet::Stream { .. } => (None, None, Vec::new()),
                };
                NicFile {
                    mac: n.mac.clone(),
                    model: Some(n.model.clone()),
                    bridge,
                    netns,
                    forward,
                }
            })
            .collect();
        VmFile {
            mem: Some(c.mem_mib),
            vcpus: Some(c.vcpus),
            machine: Some(c.machine.clone()),
            ready: c.ready.clone(),
            accel: Some(c.accel.clone()),
            qemu: Some(c.qemu.clone()),
            boot: Some(boot),
            disk,
            nic,
            extra_args: c.extra_args.clone(),
            ..VmFile::default()
        }
    }

    /// As TOML text.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
    }
}
