//! The VM a daemon starts: the guest, its memory, dirty log, QEMU binary and accelerator,
//! optionally read from a TOML description whose keys override the fields.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tandem_vm::{DirtyMode, GuestImage, Vm, VmConfig, VmError};

use crate::vmfile::{VmFile, VmFileError};

/// What the daemons need to start a guest.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct VmSpec {
    /// Guest workload: idle, memtouch, compile, sqlite, kv or disk.
    pub workload: String,
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
    /// Guest image directory (default: the cache that `./tandem setup` fills).
    pub image: Option<PathBuf>,
    /// VM description file (docs/VM_DESCRIPTION.md); its keys override the fields above,
    /// and its `[boot]`, `[[disk]]` and `[[nic]]` describe your own VM instead of the lab
    /// guest.
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
    /// An unknown workload or a missing guest image.
    #[error(transparent)]
    Image(#[from] tandem_vm::image::ImageError),
    /// Guest memory out of range.
    #[error("guest memory {0} MiB is out of range (16..=65536)")]
    Mem(u64),
    /// No local port for the guest's forwarded service.
    #[error("no free local TCP port")]
    Port(#[source] std::io::Error),
}

/// The guest did not come up.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// QEMU did not start.
    #[error("starting the guest")]
    Launch(#[source] VmError),
    /// The workload did not report ready.
    #[error("waiting for the guest workload")]
    Ready(#[source] VmError),
}

impl Default for VmSpec {
    fn default() -> Self {
        VmSpec::for_workload("kv", 256)
    }
}

impl VmSpec {
    /// The defaults for `workload` at `mem` MiB.
    pub fn for_workload(workload: &str, mem: u64) -> Self {
        VmSpec {
            workload: workload.into(),
            mem,
            vcpus: 1,
            dirty_log: DirtyMode::Auto,
            qemu: "qemu-system-x86_64".into(),
            accel: "tcg".into(),
            image: None,
            vm_config: None,
        }
    }

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
        if let Some(v) = f.workload {
            a.workload = v;
        }
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
        if f.image.is_some() {
            a.image = f.image;
        }
        Ok(a)
    }

    /// The QEMU-level configuration of this VM, named `name` (its runtime directory): the
    /// lab guest, or the VM the description file describes. Checked before anything starts.
    pub fn config(&self, name: &str) -> Result<VmConfig, VmSpecError> {
        let r = self.resolved()?;
        if !(16..=65536).contains(&r.mem) {
            return Err(VmSpecError::Mem(r.mem));
        }
        let file = self.file()?;
        let custom = file.as_ref().is_some_and(|(f, _)| f.is_custom());
        let mut c = if custom {
            VmConfig::custom(name)
        } else {
            tandem_vm::image::check_workload(&r.workload)?;
            let image = r
                .image
                .clone()
                .map_or_else(GuestImage::default_location, |dir| GuestImage { dir });
            VmConfig::lab(name, &r.workload, image)
        };
        c.mem_mib = r.mem;
        c.vcpus = r.vcpus;
        c.dirty = r.dirty_log;
        c.qemu = r.qemu.clone();
        c.accel = r.accel.clone();
        if let Some((f, base)) = &file {
            let p = self.vm_config.clone().unwrap_or_default();
            f.apply_custom(&mut c, base)
                .map_err(|e| VmSpecError::File(p.clone(), e))?;
            if let Some(m) = &f.machine {
                c.machine = m.clone();
            }
            if f.ready.is_some() {
                c.ready = f.ready.clone();
            }
            c.extra_args = f.extra_args.clone();
        }
        c.check()?;
        if c.workload.as_deref() == Some("kv") {
            c.kv_port = Some(free_port().map_err(VmSpecError::Port)?);
        }
        Ok(c)
    }
}

/// A free local TCP port (bound and released), for the lab guest's forwarded redis port.
fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Boots `cfg` and waits for it to be ready. Returns the VM and its boot-to-ready time.
pub fn boot(cfg: &VmConfig) -> Result<(Vm, Duration), BootError> {
    let t = std::time::Instant::now();
    let mut vm = Vm::launch(cfg).map_err(BootError::Launch)?;
    vm.wait_ready(Duration::from_secs(180))
        .map_err(BootError::Ready)?;
    Ok((vm, t.elapsed()))
}
