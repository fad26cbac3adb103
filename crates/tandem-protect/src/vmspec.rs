//! The VM a daemon starts: the guest, its memory, dirty log, QEMU binary and accelerator,
//! optionally read from a TOML description whose keys override the fields.

use std::path::PathBuf;
use std::time::Duration;

use tandem_vm::{DirtyMode, GuestImage, Vm, VmConfig, VmError};

/// What the daemons need to start a guest.
#[derive(Clone, Debug)]
pub struct VmSpec {
    /// Guest workload: idle, memtouch, compile, sqlite or kv.
    pub workload: String,
    /// Guest RAM in MiB.
    pub mem: u64,
    /// Dirty log.
    pub dirty_log: DirtyMode,
    /// QEMU binary.
    pub qemu: PathBuf,
    /// Accelerator (tcg or kvm).
    pub accel: String,
    /// Guest image directory (default: the cache that `tandem setup` fills).
    pub image: Option<PathBuf>,
    /// VM description file; its keys override the fields above.
    pub vm_config: Option<PathBuf>,
}

/// The VM description is unusable.
#[derive(Debug, thiserror::Error)]
pub enum VmSpecError {
    /// The description file cannot be read.
    #[error("reading the VM description {0}")]
    Read(PathBuf, #[source] std::io::Error),
    /// The description file is not valid.
    #[error("VM description {0} (keys: workload, mem, dirty_log, qemu, accel, image)")]
    Parse(PathBuf, #[source] toml::de::Error),
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
    /// The host-side load could not start.
    #[error("starting the load on the guest's workload: {0}")]
    Load(String),
}

/// The TOML form of the VM fields.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct VmFile {
    workload: Option<String>,
    mem: Option<u64>,
    dirty_log: Option<String>,
    qemu: Option<PathBuf>,
    accel: Option<String>,
    image: Option<PathBuf>,
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
            dirty_log: DirtyMode::Auto,
            qemu: "qemu-system-x86_64".into(),
            accel: "tcg".into(),
            image: None,
            vm_config: None,
        }
    }

    /// These fields with the description file's keys applied.
    pub fn resolved(&self) -> Result<VmSpec, VmSpecError> {
        let mut a = self.clone();
        let Some(p) = &self.vm_config else {
            return Ok(a);
        };
        let text = std::fs::read_to_string(p).map_err(|e| VmSpecError::Read(p.clone(), e))?;
        let f: VmFile = toml::from_str(&text).map_err(|e| VmSpecError::Parse(p.clone(), e))?;
        if let Some(v) = f.workload {
            a.workload = v;
        }
        if let Some(v) = f.mem {
            a.mem = v;
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

    /// The QEMU-level configuration of this VM, named `name` (its runtime directory).
    pub fn config(&self, name: &str) -> Result<VmConfig, VmSpecError> {
        let r = self.resolved()?;
        tandem_vm::image::check_workload(&r.workload)?;
        if !(16..=65536).contains(&r.mem) {
            return Err(VmSpecError::Mem(r.mem));
        }
        let mut c = VmConfig::new(name, &r.workload);
        c.mem_mib = r.mem;
        c.dirty = r.dirty_log;
        c.qemu = r.qemu.clone();
        c.accel = r.accel.clone();
        if let Some(d) = &r.image {
            c.image = GuestImage { dir: d.clone() };
        }
        if r.workload == "kv" {
            c.kv_port = Some(free_port().map_err(VmSpecError::Port)?);
        }
        Ok(c)
    }
}

/// A free local TCP port (bound and released).
pub fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Host-side load driving the guest's workload (the lab's redis client), held while a daemon
/// runs and stopped before the guest shuts down.
pub trait Load: Send {
    /// Stops the load and returns the operations it completed; an error says what went
    /// wrong with the workload.
    fn stop(self: Box<Self>) -> Result<u64, String>;

    /// Operations completed so far.
    fn ops(&self) -> u64 {
        0
    }
}

/// Starts the host-side load for a guest that is ready (or none for this workload).
pub type StartLoad =
    std::sync::Arc<dyn Fn(&VmConfig) -> Result<Option<Box<dyn Load>>, String> + Send + Sync>;

/// A booted guest: the VM, its boot-to-ready time and the host-side load, if any.
pub type Booted = (Vm, Duration, Option<Box<dyn Load>>);

/// Boots `cfg`, waits for the workload and starts the host-side load, if `load` gives one.
/// Returns the VM, boot-to-ready time and the load.
pub fn boot(cfg: &VmConfig, load: Option<&StartLoad>) -> Result<Booted, BootError> {
    let t = std::time::Instant::now();
    let mut vm = Vm::launch(cfg).map_err(BootError::Launch)?;
    vm.wait_ready(Duration::from_secs(180))
        .map_err(BootError::Ready)?;
    let ready = t.elapsed();
    let load = match load {
        Some(f) => f(cfg).map_err(BootError::Load)?,
        None => None,
    };
    Ok((vm, ready, load))
}
