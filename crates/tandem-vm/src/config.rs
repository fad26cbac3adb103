//! What to run: the VM as described ([`crate::desc`]) plus how tandem runs it (dirty log, QEMU
//! binary, accelerator). The lab guest built by `./tandem setup` is one such VM
//! ([`VmConfig::lab`]): direct kernel boot of its kernel and initramfs, its read-only apps disk
//! and one NIC.

use std::path::PathBuf;

use crate::desc::{self, Boot, DiskBus, DiskDesc, DiskFormat, NicDesc, NicNet};
use crate::image::{check_workload, GuestImage};
use crate::vm::{DirtyMode, VmError};

/// The lab guest's MAC address.
pub const LAB_MAC: &str = "52:54:00:12:34:56";

/// What to run.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Short name, used in file names.
    pub name: String,
    /// Guest RAM in MiB.
    pub mem_mib: u64,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// QEMU machine type (q35, pc).
    pub machine: String,
    /// How it boots.
    pub boot: Boot,
    /// Its disks, in order (the first is the boot disk for firmware boot).
    pub disks: Vec<DiskDesc>,
    /// Its NICs.
    pub nics: Vec<NicDesc>,
    /// Extra QEMU arguments (checked against what tandem owns).
    pub extra_args: Vec<String>,
    /// Console text that means the guest is ready (`None`: ready once QEMU runs it).
    pub ready: Option<String>,
    /// The lab guest's workload (see [`crate::image::WORKLOADS`]); `None` for other VMs.
    pub workload: Option<String>,
    /// The lab guest's image (checked with a `./tandem setup` hint before the boot files).
    pub image: Option<GuestImage>,
    /// Dirty-log mode.
    pub dirty: DirtyMode,
    /// QEMU binary.
    pub qemu: PathBuf,
    /// Accelerator (`tcg` here; `kvm` on a real host).
    pub accel: String,
    /// Host port forwarded to the guest's TCP 6379 on the first user-networking NIC (the lab's
    /// `kv` workload), if any.
    pub kv_port: Option<u16>,
    /// Threads for the hash fallback.
    pub hash_threads: usize,
    /// A writable data disk served over NBD on this unix socket (the lab guest's `/data`).
    pub data_disk: Option<PathBuf>,
    /// Capture device state with `xen-save-devices-state` after the first `migrate`
    /// ([`crate::devstate::fast`]); false: always `migrate`.
    pub fast_devstate: bool,
    /// Run virtio-pci devices in legacy mode only (`-global virtio-pci.disable-modern=on`):
    /// a modern virtio-pci device saves a 1 024-entry queue-state array with every device
    /// state, ~45 KB of QEMU's slowest serialisation per device; the lab guest (Linux,
    /// transitional drivers) runs legacy and its device state shrinks from ~170 KB to ~35 KB
    /// (docs/VM_LAB.md, "The fast path").
    pub legacy_virtio: bool,
    /// A standby only (with no dirty log): have the preloaded library register guest RAM for
    /// userfaultfd missing faults, so that a failover can resume the guest before its RAM is
    /// complete and serve the pages it touches ([`crate::Vm::lazy_ram`]).
    pub lazy_ram: bool,
    /// Where the guest's serial console goes (default: the VM's runtime directory, removed
    /// with the VM). Daemons put it in their working directory, so that what a guest said
    /// before it died or hung is still there afterwards.
    pub console: Option<PathBuf>,
}

impl VmConfig {
    /// The lab guest running `workload`, from the image in the default cache: 256 MiB, one
    /// vCPU, TCG, automatic dirty log.
    pub fn new(name: &str, workload: &str) -> Self {
        Self::lab(name, workload, GuestImage::default_location())
    }

    /// The lab guest running `workload` from `image`.
    pub fn lab(name: &str, workload: &str, image: GuestImage) -> Self {
        let mut c = Self::custom(name);
        c.legacy_virtio = true;
        c.boot = Boot::Kernel {
            kernel: image.kernel(),
            initrd: Some(image.initrd()),
            cmdline: format!("console=ttyS0 quiet panic=-1 tandem.workload={workload}"),
        };
        c.disks = vec![DiskDesc {
            path: image.apps(),
            format: DiskFormat::Raw,
            bus: DiskBus::VirtioBlk,
            cache: None,
            aio: None,
            readonly: true,
            slice: None,
        }];
        c.nics = vec![NicDesc {
            mac: LAB_MAC.into(),
            model: "virtio-net-pci".into(),
            net: NicNet::User {
                forwards: Vec::new(),
            },
        }];
        c.ready = Some("TANDEM-READY".into());
        c.workload = Some(workload.into());
        c.image = Some(image);
        c
    }

    /// A VM with nothing attached yet (firmware boot, 256 MiB, one vCPU, q35).
    pub fn custom(name: &str) -> Self {
        VmConfig {
            name: name.into(),
            mem_mib: 256,
            vcpus: 1,
            machine: "q35".into(),
            boot: Boot::Firmware,
            disks: Vec::new(),
            nics: Vec::new(),
            extra_args: Vec::new(),
            ready: None,
            workload: None,
            image: None,
            dirty: DirtyMode::Auto,
            qemu: PathBuf::from("qemu-system-x86_64"),
            accel: "tcg".into(),
            kv_port: None,
            hash_threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2),
            data_disk: None,
            fast_devstate: true,
            legacy_virtio: false,
            lazy_ram: false,
            console: None,
        }
    }

    /// The workload's name for reports (`custom` for a VM that is not the lab guest).
    pub fn workload_name(&self) -> &str {
        self.workload.as_deref().unwrap_or("custom")
    }

    /// The first disk the guest can write, if any (tandem does not capture those yet: see
    /// docs/VM_DESCRIPTION.md).
    pub fn writable_disk(&self) -> Option<&DiskDesc> {
        self.disks.iter().find(|d| !d.readonly)
    }

    /// Checks everything that can be checked before QEMU starts.
    pub fn check(&self) -> Result<(), VmError> {
        if let Some(w) = &self.workload {
            check_workload(w)?;
        }
        if let Some(i) = &self.image {
            i.check()?;
        }
        let host = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        desc::check(
            &self.machine,
            self.vcpus,
            host,
            &self.boot,
            &self.disks,
            &self.nics,
            &self.extra_args,
        )?;
        Ok(())
    }
}
