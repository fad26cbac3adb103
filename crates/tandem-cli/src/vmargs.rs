//! VM description shared by every command that starts a guest.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use tandem_vm::{DirtyMode, GuestImage, Vm, VmConfig};

#[derive(clap::Args, Clone, Debug)]
pub struct VmArgs {
    /// Guest workload: idle, memtouch, compile, sqlite or kv.
    #[arg(long, default_value = "kv")]
    pub workload: String,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    pub mem: u64,
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
    /// VM description file (TOML with any of: workload, mem, dirty_log, qemu, accel, image);
    /// its keys override the flags.
    #[arg(long)]
    pub vm_config: Option<PathBuf>,
}

/// The TOML form of the VM flags.
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

impl VmArgs {
    /// These flags with the `--vm-config` file's keys applied.
    fn resolved(&self) -> anyhow::Result<VmArgs> {
        let mut a = self.clone();
        let Some(p) = &self.vm_config else {
            return Ok(a);
        };
        let text = std::fs::read_to_string(p)
            .with_context(|| format!("reading the VM description {}", p.display()))?;
        let f: VmFile = toml::from_str(&text).with_context(|| {
            format!(
                "VM description {} (keys: workload, mem, dirty_log, qemu, accel, image)",
                p.display()
            )
        })?;
        if let Some(v) = f.workload {
            a.workload = v;
        }
        if let Some(v) = f.mem {
            a.mem = v;
        }
        if let Some(v) = f.dirty_log {
            a.dirty_log = v.parse().map_err(anyhow::Error::msg)?;
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
}

impl VmArgs {
    /// The defaults for `workload` at `mem` MiB (what the flags default to).
    pub fn for_workload(workload: &str, mem: u64) -> Self {
        VmArgs {
            workload: workload.into(),
            mem,
            dirty_log: DirtyMode::Auto,
            qemu: "qemu-system-x86_64".into(),
            accel: "tcg".into(),
            image: None,
            vm_config: None,
        }
    }

    pub fn config(&self, name: &str) -> anyhow::Result<VmConfig> {
        let r = self.resolved()?;
        let this = &r;
        this.config_resolved(name)
    }

    fn config_resolved(&self, name: &str) -> anyhow::Result<VmConfig> {
        tandem_vm::image::check_workload(&self.workload)?;
        if !(16..=65536).contains(&self.mem) {
            anyhow::bail!("--mem {} MiB is out of range (16..=65536)", self.mem);
        }
        let mut c = VmConfig::new(name, &self.workload);
        c.mem_mib = self.mem;
        c.dirty = self.dirty_log;
        c.qemu = self.qemu.clone();
        c.accel = self.accel.clone();
        if let Some(d) = &self.image {
            c.image = GuestImage { dir: d.clone() };
        }
        if self.workload == "kv" {
            c.kv_port = Some(free_port()?);
        }
        Ok(c)
    }
}

pub fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("no free local TCP port")?;
    Ok(l.local_addr()?.port())
}

/// Boots, waits for the workload, starts the host-side kv load if any. Returns boot-to-ready.
pub fn boot(cfg: &VmConfig) -> anyhow::Result<(Vm, Duration, Option<tandem_vm::kv::KvLoad>)> {
    let t = std::time::Instant::now();
    let mut vm = Vm::launch(cfg).context("starting the guest")?;
    vm.wait_ready(Duration::from_secs(180))
        .context("waiting for the guest workload")?;
    let ready = t.elapsed();
    let load = match cfg.kv_port {
        Some(port) => {
            tandem_vm::kv::wait_for_server(port, Duration::from_secs(60))
                .context("redis in the guest does not answer")?;
            Some(tandem_vm::kv::KvLoad::start(port, 50_000).context("starting the kv client")?)
        }
        None => None,
    };
    Ok((vm, ready, load))
}
