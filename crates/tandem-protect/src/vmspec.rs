//! The VM a daemon starts: its TOML description (docs/VM_DESCRIPTION.md), and the memory, dirty
//! log, QEMU binary and accelerator, which the description's keys override.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tandem_vm::{DirtyMode, Vm, VmConfig, VmError};

use crate::vmfile::{VmFile, VmFileError};

/// What the daemons need to start a guest.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct VmSpec {
    /// Guest RAM in MiB.
    pub mem: u64,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Dirty log.
    pub dirty_log: DirtyMode,
    /// QEMU binary.
    pub qemu: PathBuf,
    /// Accelerator (tcg or kvm).
    pub accel: String,
    /// VM description file (docs/VM_DESCRIPTION.md): how the VM boots, its disks and NICs;
    /// its keys override the fields above.
    pub vm_config: Option<PathBuf>,
}

/// The VM description is unusable.
#[derive(Debug, thiserror::Error)]
pub enum VmSpecError {
    /// The description file cannot be read.
    #[error("reading the VM description {0}")]
    Read(PathBuf, #[source] std::io::Error),
    /// The description file is not valid.
    #[error("VM description {0} (see docs/VM_DESCRIPTION.md for its keys)")]
    Parse(PathBuf, #[source] toml::de::Error),
    /// The description says something that cannot be.
    #[error("VM description {0}")]
    File(PathBuf, #[source] VmFileError),
    /// QEMU or tandem cannot honour the description.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// An unknown dirty-log mode.
    #[error("VM description {0}: {1}")]
    DirtyLog(PathBuf, String),
    /// No description given.
    #[error("no VM to run: describe it in a TOML file (docs/VM_DESCRIPTION.md; `tandem vm import` writes one from a libvirt domain) and give --vm-config FILE")]
    NoDescription,
    /// Guest memory out of range.
    #[error("guest memory {0} MiB is out of range (16..=65536)")]
    Mem(u64),
}

/// The guest did not come up.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// QEMU did not start.
    #[error("starting the guest")]
    Launch(#[source] VmError),
    /// The guest did not say it is ready.
    #[error("waiting for the guest to be ready")]
    Ready(#[source] VmError),
}

impl Default for VmSpec {
    fn default() -> Self {
        VmSpec {
            mem: 256,
            vcpus: 1,
            dirty_log: DirtyMode::Auto,
            qemu: "qemu-system-x86_64".into(),
            accel: "tcg".into(),
            vm_config: None,
        }
    }
}

impl VmSpec {
    /// The VM a description file describes (docs/VM_DESCRIPTION.md).
    pub fn described(path: impl Into<PathBuf>) -> Self {
        VmSpec {
            vm_config: Some(path.into()),
            ..VmSpec::default()
        }
    }

    /// The description file, if any, with the directory its relative paths start from.
    fn file(&self) -> Result<Option<(VmFile, PathBuf)>, VmSpecError> {
        let Some(p) = &self.vm_config else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(p).map_err(|e| VmSpecError::Read(p.clone(), e))?;
        let f = VmFile::parse(&text).map_err(|e| VmSpecError::Parse(p.clone(), e))?;
        let base = p.parent().map_or_else(PathBuf::new, Path::to_path_buf);
        Ok(Some((f, base)))
    }

    /// These fields with the description file's keys applied.
    pub fn resolved(&self) -> Result<VmSpec, VmSpecError> {
        let mut a = self.clone();
        let Some((f, _)) = self.file()? else {
            return Ok(a);
        };
        let p = self.vm_config.clone().unwrap_or_default();
        if let Some(v) = f.mem {
            a.mem = v;
        }
        if let Some(v) = f.vcpus {
            a.vcpus = v;
        }
        if let Some(v) = f.dirty_log {
            a.dirty_log = v.parse().map_err(|e| VmSpecError::DirtyLog(p.clone(), e))?;
        }
        if let Some(v) = f.qemu {
            a.qemu = v;
        }
        if let Some(v) = f.accel {
            a.accel = v;
        }
        Ok(a)
    }

    /// The QEMU-level configuration of this VM, named `name` (its runtime directory). Checked
    /// before anything starts.
    pub fn config(&self, name: &str) -> Result<VmConfig, VmSpecError> {
        let r = self.resolved()?;
        if !(16..=65536).contains(&r.mem) {
            return Err(VmSpecError::Mem(r.mem));
        }
        let Some((f, base)) = self.file()? else {
            return Err(VmSpecError::NoDescription);
        };
        let p = self.vm_config.clone().unwrap_or_default();
        let mut c = VmConfig::custom(name);
        c.mem_mib = r.mem;
        c.vcpus = r.vcpus;
        c.dirty = r.dirty_log;
        c.qemu = r.qemu.clone();
        c.accel = r.accel.clone();
        f.apply(&mut c, &base)
            .map_err(|e| VmSpecError::File(p.clone(), e))?;
        if let Some(m) = &f.machine {
            c.machine = m.clone();
        }
        if f.topology.is_some() {
            c.topology = f.topology.clone();
        }
        if let Some(id) = &f.ram_block {
            c.ram_block = id.clone();
        }
        c.vnet_hdr = f.vnet_hdr.unwrap_or(false);
        if f.ready.is_some() {
            c.ready = f.ready.clone();
        }
        c.extra_args = f.extra_args.clone();
        c.check()?;
        Ok(c)
    }
}

/// Boots `cfg` and waits for it to be ready. Returns the VM and its boot-to-ready time.
pub fn boot(cfg: &VmConfig) -> Result<(Vm, Duration), BootError> {
    let t = std::time::Instant::now();
    let mut vm = Vm::launch(cfg).map_err(BootError::Launch)?;
    vm.wait_ready(Duration::from_secs(180))
        .map_err(BootError::Ready)?;
    Ok((vm, t.elapsed()))
}
