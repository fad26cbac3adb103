//! tandem's harness: everything that exercises the product rather than being it — the demo
//! (`tandem demo`: a redis guest replicated between network namespaces, failed over and
//! verified), the benchmarks (`tandem bench`), the namespace lab (`tandem lab`) and the
//! host-side loads: redis for the lab's `kv` workload, pgbench for a trace of the Debian VM.
//!
//! Like the binary, this is application code: it uses anyhow and clap, and it drives the
//! daemons as real `tandem` processes (the binary it is linked into). The product crates
//! (tandem-protect and below) use neither.

#![warn(missing_docs)]

pub mod bench;
pub mod demo;
pub mod etcd_cluster;
pub mod kv;
pub mod lab;
pub mod netlab;
pub mod pgload;
pub mod recorder;
pub mod trace_guest;

use std::sync::Arc;
use std::time::Duration;

use tandem_vm::{Vm, VmConfig};

/// Host-side load driving the guest's workload (redis for `kv`, pgbench for the Debian VM),
/// held while the lab runs a guest and stopped before the guest shuts down.
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
pub type StartLoad = Arc<dyn Fn(&VmConfig) -> Result<Option<Box<dyn Load>>, String> + Send + Sync>;

/// A booted lab guest: the VM, its boot-to-ready time and the host-side load, if any.
pub type Booted = (Vm, Duration, Option<Box<dyn Load>>);

/// One step of xorshift64 (13, 7, 17): the fault campaign's draws, and the generator the
/// lab's `alloc` workload fills its blocks with (guest/allocchurn.c).
pub fn xorshift64(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// The product binary (`tandem`) the lab drives as daemons: next to this executable (the
/// `tandem-lab` binary), or one directory up (a test binary in `target/*/deps`).
pub fn product_exe() -> anyhow::Result<std::path::PathBuf> {
    let me = std::env::current_exe().map_err(|e| anyhow::anyhow!("locating this binary: {e}"))?;
    let dir = me
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_default();
    for d in [
        Some(dir.clone()),
        dir.parent().map(std::path::Path::to_path_buf),
    ]
    .into_iter()
    .flatten()
    {
        let p = d.join("tandem");
        if p.is_file() {
            return Ok(p);
        }
    }
    anyhow::bail!(
        "the tandem binary is not next to {} (build the whole workspace: cargo build --workspace)",
        me.display()
    )
}

/// The lab guest running `workload` in `mem` MiB, for code that drives `tandem_vm::Vm`
/// directly; the `kv` guest's redis is forwarded from a free local port ([`kv_port`]).
pub fn lab_config(name: &str, workload: &str, mem: u64) -> anyhow::Result<VmConfig> {
    tandem_labguest::check_workload(workload)?;
    let image = tandem_labguest::GuestImage::default();
    image.check()?;
    let mut c = if tandem_labguest::serves_kv(workload) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        tandem_labguest::config_forwarding(name, workload, &image, port, 6379)
    } else {
        tandem_labguest::config(name, workload, &image)
    };
    c.mem_mib = mem;
    Ok(c)
}

/// The local port forwarded to the guest's redis (6379), if any.
pub fn kv_port(cfg: &VmConfig) -> Option<u16> {
    cfg.nics.iter().find_map(|n| match &n.net {
        tandem_vm::NicNet::User { forwards } => forwards.iter().find_map(|f| {
            let (host, guest) = f.split_once('-')?;
            (guest == ":6379").then(|| host.rsplit(':').next()?.parse().ok())?
        }),
        _ => None,
    })
}

/// Writes the lab guest's description for `workload` (with a scratch data disk of
/// `scratch_disk_mib` MiB for the daemons to serve; 0: none) into `dir`, for the product's
/// `--vm-config`.
pub fn lab_description(
    dir: &std::path::Path,
    workload: &str,
    scratch_disk_mib: u64,
) -> anyhow::Result<std::path::PathBuf> {
    Ok(tandem_labguest::write_description(
        dir,
        workload,
        &tandem_labguest::GuestImage::default(),
        scratch_disk_mib,
    )?)
}

/// The lab's host-side load: a redis client writing keys while the `kv` guest runs with
/// user networking (its port forwarded); no load for other workloads.
pub fn kv_load() -> StartLoad {
    Arc::new(|cfg: &VmConfig| {
        let Some(port) = kv_port(cfg) else {
            return Ok(None);
        };
        kv::wait_for_server(port, Duration::from_secs(60))
            .map_err(|e| format!("redis in the guest does not answer: {e}"))?;
        let load =
            kv::KvLoad::start(port, 50_000).map_err(|e| format!("starting the kv client: {e}"))?;
        Ok(Some(Box::new(KvLoad(load)) as Box<dyn Load>))
    })
}

struct KvLoad(kv::KvLoad);

impl Load for KvLoad {
    fn stop(self: Box<Self>) -> Result<u64, String> {
        self.0.stop().map_err(|e| e.to_string())
    }

    fn ops(&self) -> u64 {
        self.0.ops.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Boots, waits for the workload, starts the host-side kv load if any.
pub fn boot(cfg: &VmConfig) -> anyhow::Result<Booted> {
    let (vm, ready) = tandem_protect::boot(cfg)?;
    let load = kv_load()(cfg)
        .map_err(|e| anyhow::anyhow!("starting the load on the guest's workload: {e}"))?;
    Ok((vm, ready, load))
}
