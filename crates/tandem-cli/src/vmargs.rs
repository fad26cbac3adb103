//! The VM and site flags shared by every command that starts a guest, turned into the
//! library's plain config structs.

use std::path::PathBuf;

use tandem_protect::site::SiteConfig;
use tandem_protect::VmSpec;
use tandem_vm::DirtyMode;

#[derive(clap::Args, Clone, Debug)]
pub struct VmArgs {
    /// Guest workload: idle, memtouch, compile, sqlite, kv or disk.
    #[arg(long, default_value = "kv")]
    pub workload: String,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    pub mem: u64,
    /// Virtual CPUs.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    /// Dirty log: auto (uffd-wp if the kernel has it, else hash), uffd, hash.
    #[arg(long, default_value = "auto")]
    pub dirty_log: DirtyMode,
    /// QEMU binary.
    #[arg(long, default_value = "qemu-system-x86_64")]
    pub qemu: PathBuf,
    /// Accelerator: tcg (works everywhere) or kvm.
    #[arg(long, default_value = "tcg")]
    pub accel: String,
    /// Guest image directory (default: the cache that `tandem setup` fills).
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// VM description file (TOML, docs/VM_DESCRIPTION.md): the lab guest's keys (workload,
    /// mem, vcpus, ...) override the flags; [boot], [[disk]] and [[nic]] describe your own VM.
    #[arg(long)]
    pub vm_config: Option<PathBuf>,
}

impl VmArgs {
    /// The defaults for `workload` at `mem` MiB (what the flags default to).
    pub fn for_workload(workload: &str, mem: u64) -> Self {
        let s = VmSpec::for_workload(workload, mem);
        VmArgs {
            workload: s.workload,
            mem: s.mem,
            vcpus: s.vcpus,
            dirty_log: s.dirty_log,
            qemu: s.qemu,
            accel: s.accel,
            image: s.image,
            vm_config: s.vm_config,
        }
    }

    /// The library's VM description.
    pub fn spec(&self) -> VmSpec {
        VmSpec {
            workload: self.workload.clone(),
            mem: self.mem,
            vcpus: self.vcpus,
            dirty_log: self.dirty_log,
            qemu: self.qemu.clone(),
            accel: self.accel.clone(),
            image: self.image.clone(),
            vm_config: self.vm_config.clone(),
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct SiteArgs {
    /// Network namespace holding the clients' bridge. The guest's NIC then goes through
    /// tandem's relay and a tap on that bridge, and its output is held until acknowledged
    /// (needs root). Without it the guest uses QEMU user networking and nothing is held.
    #[arg(long)]
    pub tap_netns: Option<String>,
    /// Bridge inside --tap-netns.
    #[arg(long, default_value = tandem_net::lab::BRIDGE)]
    pub bridge: String,
    /// Tap device name (default: tdp0 on the primary, tdb0 on the backup).
    #[arg(long)]
    pub tap: Option<String>,
    /// Guest address on the bridge (CIDR).
    #[arg(long, default_value = tandem_net::lab::GUEST_CIDR)]
    pub guest_ip: String,
    /// Data disk served by tandem's NBD server, in MiB (0 = none). Both sides must agree.
    #[arg(long, default_value_t = 64)]
    pub disk_mib: u64,
}

impl SiteArgs {
    pub fn config(&self) -> SiteConfig {
        SiteConfig {
            tap_netns: self.tap_netns.clone(),
            bridge: self.bridge.clone(),
            tap: self.tap.clone(),
            guest_ip: self.guest_ip.clone(),
            disk_mib: self.disk_mib,
        }
    }
}

pub use tandem_harness::kv_load;
