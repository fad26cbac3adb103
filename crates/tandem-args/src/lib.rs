//! Command-line arguments shared by tandem's two binaries (`tandem`, the product, and
//! `tandem-lab`, the demo and benchmarks), turned into the library's plain config structs: the
//! VM and site flags of every command that starts a guest, and the fencing and link-security
//! flags of the daemons.

#![warn(missing_docs)]

pub mod logging;

use std::path::PathBuf;
use std::time::Duration;

use tandem_protect::site::SiteConfig;
use tandem_protect::VmSpec;
use tandem_vm::DirtyMode;

/// The VM a command starts.
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Virtual machine")]
pub struct VmArgs {
    /// VM description file (TOML, docs/VM_DESCRIPTION.md): how the VM boots, its disks and
    /// NICs; its keys (mem, vcpus, ...) override the flags. `tandem vm import` writes one
    /// from a libvirt domain.
    #[arg(long)]
    pub vm_config: Option<PathBuf>,
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
}

impl VmArgs {
    /// The VM described in `vm_config`, with the flags' defaults at `mem` MiB.
    pub fn described(vm_config: PathBuf, mem: u64) -> Self {
        let s = VmSpec::default();
        VmArgs {
            vm_config: Some(vm_config),
            mem,
            vcpus: s.vcpus,
            dirty_log: s.dirty_log,
            qemu: s.qemu,
            accel: s.accel,
        }
    }

    /// The library's VM description.
    pub fn spec(&self) -> VmSpec {
        let mut s = VmSpec::default();
        s.mem = self.mem;
        s.vcpus = self.vcpus;
        s.dirty_log = self.dirty_log;
        s.qemu = self.qemu.clone();
        s.accel = self.accel.clone();
        s.vm_config = self.vm_config.clone();
        s
    }
}

/// Where the guest's NIC goes.
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Guest network")]
pub struct SiteArgs {
    /// Network namespace holding the clients' bridge. The guest's NIC then goes through
    /// tandem's relay and a tap on that bridge, and its output is held until acknowledged
    /// (needs root). Without it the guest uses QEMU user networking and nothing is held.
    #[arg(long)]
    pub tap_netns: Option<String>,
    /// Bridge inside --tap-netns.
    #[arg(long, default_value = "br0")]
    pub bridge: String,
    /// Tap device name (default: tdp0 on the primary, tdb0 on the backup).
    #[arg(long)]
    pub tap: Option<String>,
    /// Guest address on the bridge (CIDR), for a guest that takes it on its kernel command
    /// line (the description's `[boot] address_arg`).
    /// (Hidden: the lab's guests take it; a production guest configures its own address.)
    #[arg(long, default_value = "10.77.0.2/24", hide = true)]
    pub guest_ip: String,
}

impl SiteArgs {
    /// The library's site configuration.
    pub fn config(&self) -> SiteConfig {
        let mut s = SiteConfig::default();
        s.tap_netns = self.tap_netns.clone();
        s.bridge = self.bridge.clone();
        s.tap = self.tap.clone();
        s.guest_ip = self.guest_ip.clone();
        s
    }
}

/// Fencing flags, the same on both daemons.
#[derive(clap::Args, Clone, Default)]
#[command(next_help_heading = "Fencing (etcd)")]
pub struct FenceArgs {
    /// Fence with the VM's ownership record in this etcd cluster (client URLs,
    /// comma-separated, e.g. http://10.79.0.11:2379,http://10.79.0.12:2379): the backup takes
    /// over, and the primary runs without a replica, only by one compare-and-swap each on it
    /// (docs/FENCING.md). Give both daemons the same. Without it the backup cannot tell a
    /// partition from a dead primary.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Key prefix in etcd (the record is PREFIX/vm/VM-ID/owner).
    #[arg(long, default_value = "/tandem")]
    pub etcd_prefix: String,
    /// This node's name in the ownership record (default: ROLE@HOSTNAME).
    #[arg(long)]
    pub node: Option<String>,
    /// Timeout of one etcd request to one member, in ms (the next member is tried after it).
    #[arg(long, default_value_t = 300)]
    pub etcd_timeout_ms: u64,
    /// CA certificate(s) of the etcd members (PEM), for https:// endpoints.
    #[arg(long)]
    pub etcd_ca: Option<PathBuf>,
    /// This node's client certificate for etcd (PEM; clusters with --client-cert-auth).
    #[arg(long, requires_all = ["etcd_key", "etcd_ca"])]
    pub etcd_cert: Option<PathBuf>,
    /// The key of --etcd-cert (PEM).
    #[arg(long, requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
}

impl FenceArgs {
    /// The fencing configuration of VM `vm_id` for a daemon in `role` (`None` without --etcd).
    pub fn config(&self, vm_id: u64, role: &str) -> Option<tandem_fence::FenceConfig> {
        if self.etcd.is_empty() {
            return None;
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let node = self
            .node
            .clone()
            .unwrap_or_else(|| format!("{role}@{}", host.trim()));
        let mut c = tandem_fence::FenceConfig::new(self.etcd.clone(), vm_id, node);
        c.request_timeout = Duration::from_millis(self.etcd_timeout_ms.max(10));
        c.prefix = self.etcd_prefix.trim_end_matches('/').to_string();
        c.tls = self.etcd_ca.as_ref().map(|ca| tandem_fence::EtcdTls {
            ca: ca.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
        });
        Some(c)
    }
}

/// Mutual TLS on the replication link, the same on both daemons.
#[derive(clap::Args, Clone, Default)]
#[command(next_help_heading = "Replication link security")]
pub struct TlsArgs {
    /// Encrypt and mutually authenticate the replication link with the files in this
    /// directory: ca.pem, and primary.pem + primary.key or backup.pem + backup.key (what
    /// `tandem keys` writes). --tls-ca/--tls-cert/--tls-key override single files (your PKI).
    #[arg(long)]
    pub tls_dir: Option<PathBuf>,
    /// CA certificate(s) the peer's certificate must chain to (PEM).
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    /// This side's certificate chain (PEM).
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// This side's private key (PEM).
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
}

impl TlsArgs {
    /// The PEM files of `role` (`primary` or `backup`), if TLS was asked for.
    pub fn files(&self, role: &str) -> anyhow::Result<Option<tandem_protect::tls::TlsFiles>> {
        let base = self
            .tls_dir
            .as_ref()
            .map(|d| tandem_protect::tls::TlsFiles::in_dir(d, role));
        let pick = |given: &Option<PathBuf>, from_dir: Option<PathBuf>, what: &str| {
            given
                .clone()
                .or(from_dir)
                .ok_or_else(|| anyhow::anyhow!("TLS needs {what}: give --tls-dir or --tls-{what}"))
        };
        if base.is_none()
            && self.tls_ca.is_none()
            && self.tls_cert.is_none()
            && self.tls_key.is_none()
        {
            return Ok(None);
        }
        Ok(Some(tandem_protect::tls::TlsFiles {
            ca: pick(&self.tls_ca, base.as_ref().map(|b| b.ca.clone()), "ca")?,
            cert: pick(
                &self.tls_cert,
                base.as_ref().map(|b| b.cert.clone()),
                "cert",
            )?,
            key: pick(&self.tls_key, base.as_ref().map(|b| b.key.clone()), "key")?,
        }))
    }
}

/// The primary's fault-injection flags for the lab's tests (hidden; present only when built
/// with the `fault-hooks` feature, as the lab builds the `tandem` binary).
#[cfg(feature = "fault-hooks")]
#[derive(clap::Args, Clone, Debug, Default)]
pub struct FaultArgs {
    /// Send half of this epoch's frame, then stall until killed.
    #[arg(long, hide = true)]
    pub fault_stall_epoch: Option<u64>,
    /// SIGUSR2 kills QEMU inside the next checkpoint pause; SIGWINCH stops the daemon between
    /// an acknowledgement and its release.
    #[arg(long, hide = true)]
    pub fault_hooks: bool,
    /// Kill this host (the process group) at a handover step.
    #[arg(long, hide = true)]
    pub fault_kill_at: Option<KillAtArg>,
}

/// The primary's fault-injection flags: none in this build (no `fault-hooks` feature).
#[cfg(not(feature = "fault-hooks"))]
#[derive(clap::Args, Clone, Debug, Default)]
pub struct FaultArgs {}

/// `--fault-kill-at`.
#[cfg(feature = "fault-hooks")]
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum KillAtArg {
    /// The last epoch was sent.
    HandoverShipped,
    /// Its output was released.
    HandoverReleased,
    /// The handover frame was written.
    HandoverSent,
}

impl FaultArgs {
    /// Installs the signal hooks if asked and puts the faults into `cfg`.
    pub fn apply(&self, _cfg: &mut tandem_protect::primary::PrimaryConfig) {
        #[cfg(feature = "fault-hooks")]
        {
            use tandem_protect::faults::{Faults, HandoverStep};
            if self.fault_hooks {
                tandem_protect::faults::install_signal_hooks();
            }
            _cfg.faults = Faults {
                stall_epoch: self.fault_stall_epoch,
                kill_at: self.fault_kill_at.map(|k| match k {
                    KillAtArg::HandoverShipped => HandoverStep::HandoverShipped,
                    KillAtArg::HandoverReleased => HandoverStep::HandoverReleased,
                    KillAtArg::HandoverSent => HandoverStep::HandoverSent,
                }),
            };
        }
    }
}

/// The checkpoint saver's fault-injection flag for the lab's tests (hidden; only with the
/// `fault-hooks` feature).
#[cfg(feature = "fault-hooks")]
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SaveFaultArgs {
    /// Abort the process at this compaction step (segment, index, renamed).
    #[arg(long, hide = true)]
    pub fault_compact: Option<tandem_store::store::CrashPoint>,
}

/// The checkpoint saver's fault-injection flag: none in this build.
#[cfg(not(feature = "fault-hooks"))]
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SaveFaultArgs {}

impl SaveFaultArgs {
    /// Puts the fault into `cfg`.
    pub fn apply(&self, _cfg: &mut tandem_protect::checkpoint::SaveConfig) {
        #[cfg(feature = "fault-hooks")]
        {
            _cfg.fault_compact = self.fault_compact;
        }
    }
}
