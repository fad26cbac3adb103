//! `tandem doctor`'s checks of what production needs beyond a host that can run tandem at
//! all: KVM, the VM description and room for its disk replica, etcd with its TLS, the bridge
//! and the peer. Each check runs when its flag names what to check.

use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::doctor::Status;

type Outcome = Result<String, (Status, String, String)>;

/// What to check for production (all optional).
#[derive(clap::Args, Default)]
#[command(next_help_heading = "Production checks")]
pub struct SiteChecks {
    /// Check this VM description (docs/VM_DESCRIPTION.md), /dev/shm room for its RAM and
    /// room in --state-dir for a replica of its writable disks.
    #[arg(long)]
    pub vm_config: Option<PathBuf>,
    /// Where this host keeps a VM's durable state (the disk replica after a failover).
    #[arg(long, default_value = "/var/lib/tandem")]
    pub state_dir: PathBuf,
    /// Check that the bridge the guest's NIC joins exists (in --tap-netns, if given).
    #[arg(long)]
    pub bridge: Option<String>,
    /// Network namespace of --bridge.
    #[arg(long, requires = "bridge")]
    pub tap_netns: Option<String>,
    /// Check that the other node's replication address (host:port) accepts connections.
    #[arg(long)]
    pub peer: Option<String>,
    /// The VM whose ownership record the etcd check reads.
    #[arg(long, default_value_t = 1)]
    pub vm_id: u64,
    #[command(flatten)]
    pub fence: tandem_args::FenceArgs,
}

/// `/dev/kvm`: production guests need hardware virtualisation.
pub fn kvm() -> Outcome {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => Ok("/dev/kvm is usable: guests can run with accel = \"kvm\"".into()),
        Err(e) => Err((
            Status::Warn,
            format!("/dev/kvm: {e}; guests run under TCG (emulation, many times slower)"),
            "enable VT-x/AMD-V in the firmware, load kvm_intel or kvm_amd, and run tandem as root (or in group kvm)".into(),
        )),
    }
}

/// The VM description, and the room its RAM and disk replica need; returns guest RAM in MiB.
pub fn vm(path: &Path, state_dir: &Path) -> (Outcome, Option<u64>, Outcome) {
    let mut spec = tandem_protect::VmSpec::default();
    spec.vm_config = Some(path.to_path_buf());
    let cfg = match spec.config("doctor") {
        Ok(c) => c,
        Err(e) => {
            let fail = (
                Status::Fail,
                format!("{}: {}", path.display(), tandem_protect::chain(&e)),
                "fix the description (tandem vm check --vm-config FILE explains each key)".into(),
            );
            return (Err(fail), None, Ok("skipped: no usable description".into()));
        }
    };
    let mut bytes = 0u64;
    for d in cfg.disks.iter().filter(|d| !d.readonly) {
        match tandem_vm::desc::virtual_size(&d.path, d.format) {
            Ok(n) => bytes += n,
            Err(e) => {
                let fail = (
                    Status::Fail,
                    format!("disk {}: {e}", d.path.display()),
                    "make the disk readable by tandem's user, or fix its path".into(),
                );
                return (Err(fail), Some(cfg.mem_mib), Ok("skipped".into()));
            }
        }
    }
    let desc = Ok(format!(
        "{}: {} MiB RAM, {} vCPU(s), {} disk(s) ({} MiB writable), {} NIC(s)",
        path.display(),
        cfg.mem_mib,
        cfg.vcpus,
        cfg.disks.len(),
        bytes >> 20,
        cfg.nics.len()
    ));
    (desc, Some(cfg.mem_mib), room(state_dir, bytes))
}

/// Free space for a replica of `bytes` of writable disks.
fn room(dir: &Path, bytes: u64) -> Outcome {
    // The directory may not exist yet: its nearest existing parent's file system counts.
    let mut at = dir;
    while !at.exists() {
        at = at.parent().unwrap_or(Path::new("/"));
    }
    let st = rustix::fs::statvfs(at).map_err(|e| {
        (
            Status::Fail,
            format!("{}: {e}", at.display()),
            "create it on a local file system".into(),
        )
    })?;
    if bytes > 0 && tandem_protect::site::in_memory_fs(at) {
        return Err((
            Status::Warn,
            format!(
                "{} is on a tmpfs: the copy of the VM's writable disks there (the guest's disks after a failover) is gone when this host restarts",
                dir.display()
            ),
            "give --state-dir (state_dir in the VM's configuration file) a directory on real storage".into(),
        ));
    }
    let free = st.f_bavail * st.f_frsize;
    let need = bytes + bytes / 10;
    if free < need {
        return Err((
            Status::Fail,
            format!(
                "{} has {} MiB free; a replica of the VM's {} MiB of writable disks (what this host resumes from after a failover) needs {} MiB",
                dir.display(),
                free >> 20,
                bytes >> 20,
                need >> 20
            ),
            "free space there, or give --state-dir a larger file system".into(),
        ));
    }
    Ok(format!(
        "{}: {} MiB free for a {} MiB disk replica",
        dir.display(),
        free >> 20,
        bytes >> 20
    ))
}

/// etcd answers over its TLS, and the VM's record (if any) reads back.
pub fn etcd(f: &tandem_args::FenceArgs, vm_id: u64) -> Outcome {
    let Some(cfg) = f.config(vm_id, "doctor") else {
        return Ok("not checked (no --etcd)".into());
    };
    let endpoints = cfg.endpoints.join(",");
    let fail = |e: String| {
        (
            Status::Fail,
            format!("etcd {endpoints}: {e}"),
            "check the endpoints, the network to them, and --etcd-ca/--etcd-cert/--etcd-key (the CA must sign the members' certificates; a cluster with --client-cert-auth needs this node's certificate)".to_string(),
        )
    };
    let fence = tandem_fence::Fence::connect(cfg).map_err(|e| fail(tandem_protect::chain(&e)))?;
    let record = fence.read().map_err(|e| fail(tandem_protect::chain(&e)))?;
    Ok(format!(
        "etcd {endpoints} answers; VM {vm_id}'s ownership record: {}",
        record.map_or("none yet".into(), |r| format!(
            "generation {}, {:?}, node {}",
            r.gen, r.state, r.node
        ))
    ))
}

/// The bridge exists (in its namespace).
pub fn bridge(name: &str, netns: Option<&str>) -> Outcome {
    let sys = format!("/sys/class/net/{name}/bridge");
    let ok = match netns {
        None => Path::new(&sys).is_dir(),
        Some(ns) => std::process::Command::new("ip")
            .args(["netns", "exec", ns, "test", "-d", &sys])
            .status()
            .is_ok_and(|s| s.success()),
    };
    let where_ = netns.map_or(String::new(), |n| format!(" in namespace {n}"));
    if ok {
        Ok(format!("bridge {name}{where_} exists"))
    } else {
        Err((
            Status::Fail,
            format!("no bridge {name}{where_}"),
            format!("create it (ip link add {name} type bridge; ip link set {name} up) and enslave the uplink"),
        ))
    }
}

/// The peer's replication port accepts a connection within 2 s.
pub fn peer(addr: &str) -> Outcome {
    let fail = |e: String| {
        (
            Status::Fail,
            format!("peer {addr}: {e}"),
            "start tandem on the other host, and open the port between the hosts".to_string(),
        )
    };
    let sa = addr
        .to_socket_addrs()
        .map_err(|e| fail(e.to_string()))?
        .next()
        .ok_or_else(|| fail("resolves to no address".into()))?;
    std::net::TcpStream::connect_timeout(&sa, Duration::from_secs(2))
        .map_err(|e| fail(e.to_string()))?;
    Ok(format!("peer {addr} ({sa}) accepts connections"))
}
