//! What to run: the VM as described ([`crate::desc`]) plus how tandem runs it (dirty log, QEMU
//! binary, accelerator).

use std::path::PathBuf;

use crate::desc::{self, Boot, DiskDesc, NicDesc};
use crate::vm::{DirtyMode, VmError};

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
    /// How the vCPUs are laid out (`sockets=2,cores=1,threads=1`; None: QEMU's default for
    /// the machine type). The guest sees it in CPUID: an adopted guest keeps its own.
    pub topology: Option<String>,
    /// The id of the guest RAM's memory backend, which is also the name of its RAM block in
    /// QEMU's migration stream (`ram0`; a QEMU started with plain `-m`, and libvirt, name it
    /// `pc.ram`). A guest adopted from a running QEMU keeps that QEMU's name, and its standby
    /// must use the same one.
    pub ram_block: String,
    /// How it boots.
    pub boot: Boot,
    /// Bridged NICs reach their relay through a tap with virtio-net headers (`vnet_hdr=on`,
    /// what libvirt gives a virtio NIC on a bridge: the guest keeps checksum and segmentation
    /// offloads) instead of QEMU's stream netdev. A VM adopted from a QEMU whose virtio NIC
    /// is on such a tap needs it: QEMU refuses to load its NIC's state otherwise.
    pub vnet_hdr: bool,
    /// Its disks, in order (the first is the boot disk for firmware boot).
    pub disks: Vec<DiskDesc>,
    /// Its NICs.
    pub nics: Vec<NicDesc>,
    /// Extra QEMU arguments (checked against what tandem owns).
    pub extra_args: Vec<String>,
    /// Console text that means the guest is ready (`None`: ready once QEMU runs it).
    pub ready: Option<String>,
    /// Console lines containing one of these are echoed by the daemons (`guest: ...`), e.g.
    /// an application's progress lines.
    pub echo: Vec<String>,
    /// A shutdown presses the ACPI power button and waits this long for the guest to power
    /// off before QEMU quits ([`crate::Vm::shut_down`]); zero: quit at once.
    pub shutdown_timeout: std::time::Duration,
    /// What the guest runs, in a word, for reports (status, checkpoint metadata); `None`:
    /// `custom`.
    pub label: Option<String>,
    /// With direct kernel boot: the command-line key through which the guest takes its
    /// address on a bridge (`KEY=ADDR/PREFIX` is appended when its NIC is bridged).
    pub address_arg: Option<String>,
    /// A scratch data disk of this many MiB (0: none) that tandem creates, formats (ext4) and
    /// serves over NBD ([`VmConfig::data_disk`]); its writes are replicated with the epochs.
    pub scratch_disk_mib: u64,
    /// Dirty-log mode.
    pub dirty: DirtyMode,
    /// QEMU binary.
    pub qemu: PathBuf,
    /// Accelerator (`tcg` here; `kvm` on a real host).
    pub accel: String,
    /// Threads for the hash fallback.
    pub hash_threads: usize,
    /// The scratch data disk's NBD unix socket (set by the daemon that serves it).
    pub data_disk: Option<PathBuf>,
    /// Capture device state with `xen-save-devices-state` after the first `migrate`
    /// ([`crate::devstate::fast`]); false: always `migrate`.
    pub fast_devstate: bool,
    /// Run virtio-pci devices in legacy mode only (`-global virtio-pci.disable-modern=on`):
    /// a modern virtio-pci device saves a 1 024-entry queue-state array with every device
    /// state, ~45 KB of QEMU's slowest serialisation per device; the lab guest (Linux,
    /// transitional drivers) runs legacy and its device state shrinks from ~170 KB to ~35 KB
    /// (docs/VM_LAB.md, "The fast path"). The description's `legacy_virtio`.
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
    /// A VM with nothing attached yet (firmware boot, 256 MiB, one vCPU, q35).
    pub fn custom(name: &str) -> Self {
        VmConfig {
            name: name.into(),
            mem_mib: 256,
            vcpus: 1,
            machine: "q35".into(),
            topology: None,
            ram_block: "ram0".into(),
            boot: Boot::Firmware,
            vnet_hdr: false,
            disks: Vec::new(),
            nics: Vec::new(),
            extra_args: Vec::new(),
            ready: None,
            echo: Vec::new(),
            shutdown_timeout: std::time::Duration::from_secs(30),
            label: None,
            address_arg: None,
            scratch_disk_mib: 0,
            dirty: DirtyMode::Auto,
            qemu: PathBuf::from("qemu-system-x86_64"),
            accel: "tcg".into(),
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

    /// What the guest runs, for reports (`custom` without a label).
    pub fn label(&self) -> &str {
        self.label.as_deref().unwrap_or("custom")
    }

    /// The first disk the guest can write, if any (tandem does not capture those yet: see
    /// docs/VM_DESCRIPTION.md).
    pub fn writable_disk(&self) -> Option<&DiskDesc> {
        self.disks.iter().find(|d| !d.readonly)
    }

    /// Checks everything that can be checked before QEMU starts.
    pub fn check(&self) -> Result<(), VmError> {
        if self.scratch_disk_mib > 1 << 20 {
            return Err(VmError::ScratchDisk(self.scratch_disk_mib));
        }
        desc::check_ram_block(&self.ram_block)?;
        if let Some(t) = &self.topology {
            desc::check_topology(t, self.vcpus)?;
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
