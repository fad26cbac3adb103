//! The lab guest: the small Linux that `tandem-lab setup` builds into the cache (a kernel, an
//! initramfs and a read-only apps disk), which runs one workload named on its kernel command
//! line and says `TANDEM-READY` on its console when it runs.
//!
//! To tandem's product it is a VM like any other: the lab describes it in a VM description
//! file ([`description`], docs/VM_DESCRIPTION.md) and passes `--vm-config`; tests that drive
//! `tandem_vm::Vm` directly take its [`config`].

#![warn(missing_docs)]

use std::path::{Path, PathBuf};

use std::time::Duration;

use tandem_vm::console::{Console, ConsoleError};
use tandem_vm::{Boot, DiskDesc, DiskFormat, NicDesc, NicNet, VmConfig};

/// The workloads the guest image can run (`tandem.workload=` on the kernel command line).
pub const WORKLOADS: &[&str] = &[
    "idle", "memtouch", "memheavy", "compile", "sqlite", "kv", "kvheavy", "disk", "luatext",
    "luagc", "alloc", "awktext", "archive", "httpd",
];

/// Whether `workload` runs redis for a key-value client (`kv`, and `kvheavy` beside a
/// memory-heavy writer).
pub fn serves_kv(workload: &str) -> bool {
    matches!(workload, "kv" | "kvheavy")
}

/// The lab guest's MAC address.
pub const MAC: &str = "52:54:00:12:34:56";

/// What the guest prints on its console once its workload runs.
pub const READY: &str = "TANDEM-READY";

/// The workloads' progress lines (`sqlite txns=N`, `compile objs=N`, `disk mbps=X`), which
/// the daemons echo.
pub const ECHO: &[&str] = &[" txns=", " objs=", " mbps="];

/// The kernel command-line key through which the guest takes its address on a bridge.
pub const ADDRESS_ARG: &str = "tandem.ip";

/// The lab guest cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A file of the image is missing.
    #[error("guest image file {0} is missing: run `./tandem setup` to build the guest image")]
    Missing(String),
    /// The workload name is unknown.
    #[error(
        "unknown workload {0:?}: choose one of idle, memtouch, memheavy, compile, sqlite, kv, kvheavy, disk, luatext, luagc, alloc, awktext, archive, httpd"
    )]
    UnknownWorkload(String),
}

/// tandem's cache directory: `$TANDEM_CACHE`, else `$XDG_CACHE_HOME/tandem`, else
/// `~/.cache/tandem`.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("tandem");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/tmp".into());
    home.join(".cache").join("tandem")
}

/// Where `./tandem setup --debian` keeps the Debian test VM: `cache_dir()/debian`.
pub fn debian_dir() -> PathBuf {
    cache_dir().join("debian")
}

/// The kernel, initramfs and apps disk that `./tandem setup` builds.
#[derive(Debug, Clone)]
pub struct GuestImage {
    /// Directory holding the files.
    pub dir: PathBuf,
}

impl Default for GuestImage {
    fn default() -> Self {
        GuestImage {
            dir: cache_dir().join("guest"),
        }
    }
}

impl GuestImage {
    /// The image in `dir`, or in the default cache directory.
    pub fn at(dir: Option<&Path>) -> Self {
        dir.map_or_else(GuestImage::default, |d| GuestImage { dir: d.into() })
    }

    /// Kernel path.
    pub fn kernel(&self) -> PathBuf {
        self.dir.join("vmlinuz")
    }
    /// Initramfs path.
    pub fn initrd(&self) -> PathBuf {
        self.dir.join("initramfs.cpio.gz")
    }
    /// Read-only apps disk path.
    pub fn apps(&self) -> PathBuf {
        self.dir.join("apps.img")
    }

    /// Fails with a clear message if any file is missing.
    pub fn check(&self) -> Result<(), ImageError> {
        for p in [self.kernel(), self.initrd(), self.apps()] {
            if !Path::new(&p).is_file() {
                return Err(ImageError::Missing(p.display().to_string()));
            }
        }
        Ok(())
    }
}

/// Validates a workload name.
pub fn check_workload(name: &str) -> Result<(), ImageError> {
    if WORKLOADS.contains(&name) {
        Ok(())
    } else {
        Err(ImageError::UnknownWorkload(name.into()))
    }
}

/// The kernel command line that starts `workload`.
fn cmdline(workload: &str) -> String {
    format!("console=ttyS0 quiet panic=-1 tandem.workload={workload}")
}

/// The lab guest running `workload` from `image` (256 MiB, one vCPU, TCG, automatic dirty
/// log): direct kernel boot, the read-only apps disk, one user-networking NIC.
pub fn config(name: &str, workload: &str, image: &GuestImage) -> VmConfig {
    let mut c = VmConfig::custom(name);
    c.legacy_virtio = true;
    c.boot = Boot::Kernel {
        kernel: image.kernel(),
        initrd: Some(image.initrd()),
        cmdline: cmdline(workload),
    };
    c.disks = vec![DiskDesc {
        readonly: true,
        ..DiskDesc::new(image.apps(), DiskFormat::Raw)
    }];
    c.nics = vec![NicDesc {
        mac: MAC.into(),
        model: "virtio-net-pci".into(),
        net: NicNet::User {
            forwards: Vec::new(),
        },
        pci: None,
    }];
    c.ready = Some(READY.into());
    c.echo = ECHO.iter().map(|e| e.to_string()).collect();
    // Its busybox init has no ACPI handler: a shutdown quits at once.
    c.shutdown_timeout = std::time::Duration::ZERO;
    c.label = Some(workload.into());
    c.address_arg = Some(ADDRESS_ARG.into());
    c
}

/// [`config`] with the guest's TCP `guest_port` forwarded from 127.0.0.1:`host_port`.
pub fn config_forwarding(
    name: &str,
    workload: &str,
    image: &GuestImage,
    host_port: u16,
    guest_port: u16,
) -> VmConfig {
    let mut c = config(name, workload, image);
    c.nics[0].net = NicNet::User {
        forwards: vec![format!("tcp:127.0.0.1:{host_port}-:{guest_port}")],
    };
    c
}

/// The VM description (TOML, docs/VM_DESCRIPTION.md) of the lab guest running `workload` from
/// `image`, with a scratch data disk of `scratch_disk_mib` MiB (0: none) that tandem creates,
/// formats and serves (the guest mounts it on /data). Memory, vCPUs and the rest stay with the
/// flags of the command that reads it.
pub fn description(workload: &str, image: &GuestImage, scratch_disk_mib: u64) -> String {
    let q = |p: PathBuf| format!("{:?}", p.display().to_string());
    format!(
        "# The lab guest (tandem-lab setup), running {workload}.\n\
         label = {workload:?}\n\
         ready = {READY:?}\n\
         echo = {ECHO:?}\n\
         shutdown_timeout_s = 0\n\
         legacy_virtio = true\n\
         scratch_disk_mib = {scratch_disk_mib}\n\
         \n\
         [boot]\n\
         kernel = {}\n\
         initrd = {}\n\
         cmdline = {:?}\n\
         address_arg = {ADDRESS_ARG:?}\n\
         \n\
         [[disk]]\n\
         path = {}\n\
         format = \"raw\"\n\
         readonly = true\n\
         \n\
         [[nic]]\n\
         mac = {MAC:?}\n",
        q(image.kernel()),
        q(image.initrd()),
        cmdline(workload),
        q(image.apps()),
    )
}

/// Checks `workload` and `image`, then writes [`description`] to `dir/lab-WORKLOAD.toml` and
/// returns its path.
pub fn write_description(
    dir: &Path,
    workload: &str,
    image: &GuestImage,
    scratch_disk_mib: u64,
) -> Result<PathBuf, DescribeError> {
    check_workload(workload)?;
    image.check()?;
    let path = dir.join(format!("lab-{workload}.toml"));
    std::fs::write(&path, description(workload, image, scratch_disk_mib))
        .map_err(|e| DescribeError::Write(path.clone(), e))?;
    Ok(path)
}

/// The lab guest's description could not be written.
#[derive(Debug, thiserror::Error)]
pub enum DescribeError {
    /// Unknown workload or missing image.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The file cannot be written.
    #[error("writing {0}")]
    Write(PathBuf, #[source] std::io::Error),
}

/// Waits for the guest's next `tandem-tick N` console line (it prints one a second) and
/// returns N: after a restore, the counter it continues from.
pub fn wait_tick(console: &mut Console, timeout: Duration) -> Result<u64, ConsoleError> {
    let line = console.wait_for("tandem-tick", 0, timeout)?;
    line.split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .ok_or(ConsoleError::Timeout {
            needle: "a tandem-tick counter".into(),
            timeout,
            tail: line,
        })
}

/// The highest `tandem-tick N` counter the guest printed so far.
pub fn last_tick(console: &Console) -> Option<u64> {
    console.text().lines().rev().find_map(|l| {
        l.trim()
            .strip_prefix("tandem-tick ")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// Follows the console file at `path` until the guest's `tandem-tick` counter passes `after`
/// (within `within`) and returns it: a guest that carried on from a migration or a failover
/// counts on, one that rebooted starts again at 1.
pub fn tick_above(path: &Path, after: u64, within: Duration) -> Result<u64, ConsoleError> {
    let mut c = Console::new(path);
    let t = std::time::Instant::now();
    loop {
        let _ = c.poll();
        if let Some(n) = last_tick(&c).filter(|&n| n > after) {
            return Ok(n);
        }
        if t.elapsed() >= within {
            return Err(ConsoleError::Timeout {
                needle: format!("a tandem-tick counter above {after} in {}", path.display()),
                timeout: within,
                tail: c.tail(10),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
