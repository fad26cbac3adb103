//! What a primary or backup attaches to its QEMU besides RAM: the network relay (a tap on the
//! clients' bridge) and the scratch data disk (tandem's NBD server on a unix socket).

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tandem_disk::Image;
use tandem_net::{Policy, Relay, RelayStats};
use tandem_vm::{Boot, MirrorHealth, MirrorSlice, NicNet, VmConfig};

/// How a side attaches its guest's network and data disk.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct SiteConfig {
    /// Network namespace holding the clients' bridge. The guest's NIC then goes through
    /// tandem's relay and a tap on that bridge, and its output is held until acknowledged
    /// (needs root). Without it the guest uses QEMU user networking and nothing is held.
    pub tap_netns: Option<String>,
    /// Bridge inside --tap-netns.
    pub bridge: String,
    /// Tap device name (default: tdp0 on the primary, tdb0 on the backup).
    pub tap: Option<String>,
    /// Guest address on the bridge (CIDR), for a guest that takes it on its kernel command
    /// line (the description's `[boot] address_arg`).
    pub guest_ip: String,
}

impl Default for SiteConfig {
    fn default() -> Self {
        SiteConfig {
            tap_netns: None,
            bridge: "br0".into(),
            tap: None,
            guest_ip: "10.77.0.2/24".into(),
        }
    }
}

/// Which side a site is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Output held until acknowledged; a fresh data disk.
    Primary,
    /// Output dropped until failover; an empty disk copy the primary fills.
    Backup,
}

/// The relay or data disk could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SiteError {
    /// The tap device could not be created.
    #[error("creating tap {tap} on {bridge} in namespace {netns}")]
    Tap {
        /// Tap name.
        tap: String,
        /// Bridge.
        bridge: String,
        /// Namespace.
        netns: String,
        /// Cause.
        #[source]
        source: tandem_net::TapError,
    },
    /// The relay could not listen for QEMU.
    #[error("starting the network relay")]
    Relay(#[source] tandem_net::RelayError),
    /// A disk's size could not be read.
    #[error(transparent)]
    Desc(#[from] tandem_vm::desc::DescError),
    /// Data disk size out of range.
    #[error("data disk of {0} MiB is too large")]
    DiskSize(u64),
    /// mkfs.ext4 could not run.
    #[error("running mkfs.ext4 (install Debian's e2fsprogs package)")]
    MkfsSpawn(#[source] std::io::Error),
    /// mkfs.ext4 failed.
    #[error("mkfs.ext4 failed: {0}")]
    Mkfs(String),
    /// A file of the disk could not be created or served.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// The disk image could not be opened.
    #[error("opening {0}")]
    Image(String, #[source] std::io::Error),
}

/// The relay and disk of one side. Dropping it removes the tap and stops serving.
pub struct Site {
    /// The network relays, one per bridged NIC (empty with user networking only).
    pub relays: Relays,
    /// The data disk (when the VM asks for a scratch disk).
    pub disk: Option<Arc<Image>>,
    /// Where the data disk file was created (its name may be removed already).
    pub disk_path: Option<PathBuf>,
    /// Writable disks of your own VM, as slices of the replica/copy (empty for a VM without writable disks).
    pub mirrors: Vec<MirrorSlice>,
    /// The backup's copy of the writable disks ([`crate::disk_copy`]), kept open while the
    /// standby or the resumed guest may use it.
    copy: Option<(std::fs::File, PathBuf)>,
    /// Whether the primary's disk mirrors still capture every write.
    pub mirror_health: MirrorHealth,
    nbd_sock: Option<PathBuf>,
    /// Ends the NBD servers' accept loops when the site goes (a node changing role).
    nbd_stop: Arc<std::sync::atomic::AtomicBool>,
    /// Every socket an NBD server of this site listens on.
    nbd_socks: Vec<PathBuf>,
}

impl Drop for Site {
    fn drop(&mut self) {
        self.nbd_stop
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for s in &self.nbd_socks {
            // Wake the accept loop so that it sees the stop, then remove the socket.
            let _ = std::os::unix::net::UnixStream::connect(s);
            let _ = std::fs::remove_file(s);
        }
    }
}

impl Site {
    /// Sets up the relay and the data disk in `dir` and points `cfg` at them. Call before QEMU
    /// starts (QEMU connects to both at start-up). A backup keeps its copy of the writable
    /// disks in `copy_dir` ([`crate::disk_copy`]; a primary's is ignored).
    pub fn prepare(
        a: &SiteConfig,
        dir: &Path,
        copy_dir: &Path,
        role: Role,
        cfg: &mut VmConfig,
    ) -> Result<Site, SiteError> {
        let relays = Relays::attach(a, dir, role, cfg)?;
        if cfg.writable_disk().is_some() {
            let at = match role {
                Role::Primary => dir,
                Role::Backup => copy_dir,
            };
            return Self::with_capture(relays, dir, at, role, cfg);
        }
        let nbd_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mib = cfg.scratch_disk_mib;
        let (disk, disk_path) = if mib == 0 {
            (None, None)
        } else {
            if mib > 1 << 20 {
                return Err(SiteError::DiskSize(mib));
            }
            let path = dir.join("disk.img");
            let io = |e| SiteError::Io(format!("creating {}", path.display()), e);
            let f = std::fs::File::create(&path).map_err(io)?;
            f.set_len(mib << 20).map_err(io)?;
            drop(f);
            let image = match role {
                Role::Primary => {
                    // A fresh ext4 (no lazy init: no background writes after mount).
                    let out = std::process::Command::new("mkfs.ext4")
                        .args([
                            "-q",
                            "-F",
                            "-L",
                            "tandem-data",
                            "-E",
                            "lazy_itable_init=0,lazy_journal_init=0",
                        ])
                        .arg(&path)
                        .output()
                        .map_err(SiteError::MkfsSpawn)?;
                    if !out.status.success() {
                        return Err(SiteError::Mkfs(
                            String::from_utf8_lossy(&out.stderr).trim().to_string(),
                        ));
                    }
                    Image::open(&path)
                }
                // The backup's copy starts empty; the primary sends its contents.
                Role::Backup => Image::open_unlogged(&path),
            }
            .map_err(|e| SiteError::Image(path.display().to_string(), e))?;
            if role == Role::Primary {
                // The scratch disk lives on in the NBD server's open file: a killed primary
                // leaves nothing behind. (The backup removes its copy once it opened it too.)
                let _ = std::fs::remove_file(&path);
            }
            let image = Arc::new(image);
            let sock = dir.join("nbd.sock");
            let _ = std::fs::remove_file(&sock);
            let listener = UnixListener::bind(&sock)
                .map_err(|e| SiteError::Io(format!("listening on {}", sock.display()), e))?;
            let served = image.clone();
            let stop = nbd_stop.clone();
            std::thread::spawn(move || tandem_disk::nbd::serve_until(listener, served, stop));
            cfg.data_disk = Some(sock.clone());
            (Some(image), Some((path, sock)))
        };
        let (disk_path, nbd_sock) = disk_path.unzip();
        Ok(Site {
            relays,
            disk,
            disk_path,
            nbd_socks: nbd_sock.iter().cloned().collect(),
            nbd_sock,
            nbd_stop,
            mirrors: Vec::new(),
            copy: None,
            mirror_health: MirrorHealth::default(),
        })
    }

    /// Your own VM's writable disks, captured (docs/VM_DESCRIPTION.md): one file holds every
    /// writable disk at 1 MiB-aligned offsets. On the primary it is tandem's replica, fed by a
    /// `blockdev-mirror` per disk through the NBD server ([`Site::start_capture`]), and its write
    /// log is each epoch's disk section; on the backup it is the copy the epochs are applied to
    /// (`at/guest-disks.raw`, named: the guest's disks after a failover), and the standby opens
    /// each disk as a raw slice of it. The primary's replica is `at/disk.img`, unnamed once
    /// served.
    fn with_capture(
        relays: Relays,
        dir: &Path,
        at: &Path,
        role: Role,
        cfg: &mut VmConfig,
    ) -> Result<Site, SiteError> {
        let (slices, total) = capture_slices(cfg)?;
        let path = match role {
            Role::Primary => at.join("disk.img"),
            Role::Backup => crate::disk_copy::path(at),
        };
        let io = |e| SiteError::Io(format!("creating {}", path.display()), e);
        let f = std::fs::File::create(&path).map_err(io)?;
        f.set_len(total).map_err(io)?;
        drop(f);
        let mut site = Site {
            relays,
            disk: None,
            disk_path: Some(path.clone()),
            nbd_sock: None,
            nbd_stop: Arc::default(),
            nbd_socks: Vec::new(),
            mirrors: slices.clone(),
            copy: None,
            mirror_health: MirrorHealth::default(),
        };
        match role {
            Role::Primary => site.serve_capture(&path, dir)?,
            Role::Backup => {
                let copy = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(|e| SiteError::Io(format!("opening {}", path.display()), e))?;
                open_slices(cfg, &slices, &path);
                site.copy = Some((copy, path));
            }
        }
        Ok(site)
    }

    /// A backup's site whose guest now runs here and is protected in turn: the data disk logs
    /// its writes from now on, and writable disks get a capture file in `dir` that
    /// [`Site::start_capture`] mirrors them into (the copy they run from stays as it is).
    pub fn become_primary(&mut self, dir: &Path) -> Result<(), SiteError> {
        if self.mirrors.is_empty() {
            if let Some(d) = &self.disk {
                d.start_logging();
            }
            return Ok(());
        }
        let total = self
            .mirrors
            .iter()
            .map(|m| (m.offset + m.size).next_multiple_of(1 << 20))
            .max()
            .unwrap_or(0);
        let path = dir.join("capture.img");
        let io = |e| SiteError::Io(format!("creating {}", path.display()), e);
        let f = std::fs::File::create(&path).map_err(io)?;
        f.set_len(total).map_err(io)?;
        drop(f);
        self.serve_capture(&path, dir)?;
        self.mirror_health = MirrorHealth::default();
        Ok(())
    }

    /// Opens the capture file at `path` (its name then goes: the NBD server holds it) and
    /// serves it on `dir/capture.sock`, where the disk mirrors write.
    fn serve_capture(&mut self, path: &Path, dir: &Path) -> Result<(), SiteError> {
        let image =
            Image::open(path).map_err(|e| SiteError::Image(path.display().to_string(), e))?;
        let _ = std::fs::remove_file(path);
        let image = Arc::new(image);
        let sock = dir.join("capture.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = UnixListener::bind(&sock)
            .map_err(|e| SiteError::Io(format!("listening on {}", sock.display()), e))?;
        let (served, stop) = (image.clone(), self.nbd_stop.clone());
        std::thread::spawn(move || tandem_disk::nbd::serve_until(listener, served, stop));
        self.disk = Some(image);
        self.nbd_socks.push(sock.clone());
        self.nbd_sock = Some(sock);
        Ok(())
    }

    /// The capture of `cfg`'s writable disks alone, as on a primary without network relays
    /// (the checkpoint saver's).
    pub fn capture_only(dir: &Path, cfg: &mut VmConfig) -> Result<Site, SiteError> {
        Self::with_capture(Relays::default(), dir, dir, Role::Primary, cfg)
    }

    /// Starts (or restarts) capturing the writable disks of a running VM: a mirror per disk
    /// into the replica, each finished with its full pass before this returns. A no-op
    /// without writable disks.
    pub fn start_capture(&self, vm: &mut tandem_vm::Vm) -> Result<(), tandem_vm::VmError> {
        self.start_capture_with(vm, &mut |_, _| {})
    }

    /// [`Site::start_capture`], calling `progress(done, total)` during the full pass.
    pub fn start_capture_with(
        &self,
        vm: &mut tandem_vm::Vm,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), tandem_vm::VmError> {
        let Some(sock) = self.nbd_sock.as_ref().filter(|_| !self.mirrors.is_empty()) else {
            return Ok(());
        };
        vm.share_mirror_health(self.mirror_health.clone());
        vm.start_mirrors(sock, &self.mirrors, self.capture_timeout(), progress)
    }

    /// Whether the guest's writable disks are this node's copy on a tmpfs (a backup's
    /// `--disk-dir` in memory): a guest resumed here and shut down leaves no disk a fresh boot
    /// could use once the host restarts.
    pub fn disks_are_volatile(&self) -> bool {
        self.copy
            .as_ref()
            .is_some_and(|(_, p)| p.parent().is_some_and(in_memory_fs))
    }

    /// The backup's copy of the writable disks (the guest's disks once it resumed here).
    pub fn copy_path(&self) -> Option<&Path> {
        self.copy.as_ref().map(|(_, p)| p.as_path())
    }

    /// Writes the backup's copy back to its storage (after a resume: the guest's disks).
    pub fn sync_copy(&self) -> std::io::Result<()> {
        self.copy.as_ref().map_or(Ok(()), |(f, _)| f.sync_data())
    }

    /// Disk bytes written since the last take of the write log (0 without a disk).
    pub fn disk_log_bytes(&self) -> u64 {
        self.disk.as_ref().map_or(0, |d| {
            let u = d.log_usage();
            u.bytes + u.range_bytes
        })
    }

    /// How long a full mirror pass may take: at ≥ 20 MB/s, and never less than a minute.
    pub fn capture_timeout(&self) -> std::time::Duration {
        let bytes: u64 = self.mirrors.iter().map(|m| m.size).sum();
        std::time::Duration::from_secs((bytes / 20_000_000).max(60))
    }
}

/// Where each writable disk of `cfg` lies in the one file that holds them all (1 MiB-aligned
/// offsets), and that file's size.
pub fn capture_slices(cfg: &VmConfig) -> Result<(Vec<MirrorSlice>, u64), SiteError> {
    let mut slices = Vec::new();
    let mut total = 0u64;
    for (i, d) in cfg.disks.iter().enumerate().filter(|(_, d)| !d.readonly) {
        let size = match d.slice {
            // A disk that is a slice of a node's copy (a guest booted from it).
            Some((_, size)) => size,
            None => tandem_vm::desc::virtual_size(&d.path, d.format)?,
        };
        slices.push(MirrorSlice {
            disk: i,
            offset: total,
            size,
        });
        total = (total + size).next_multiple_of(1 << 20);
    }
    Ok((slices, total))
}

/// Points `cfg`'s writable disks at their slices of the raw file `path` (a backup's copy, a
/// restored checkpoint's disks).
pub fn open_slices(cfg: &mut VmConfig, slices: &[MirrorSlice], path: &Path) {
    for s in slices {
        let d = &mut cfg.disks[s.disk];
        d.path = path.to_path_buf();
        d.format = tandem_vm::DiskFormat::Raw;
        d.slice = Some((s.offset, s.size));
    }
}

/// Whether `dir` is on a tmpfs or hugetlbfs (its files are memory, gone with the host).
pub fn in_memory_fs(dir: &Path) -> bool {
    const TMPFS: i64 = 0x0102_1994;
    const HUGETLBFS: i64 = 0x9584_58f6;
    // f_type's integer type differs between architectures.
    #[allow(clippy::unnecessary_cast)]
    rustix::fs::statfs(dir).is_ok_and(|s| [TMPFS, HUGETLBFS].contains(&(s.f_type as i64)))
}

/// The name of the tap QEMU opens for NIC `i` of the daemon working in `dir` (with
/// `vnet_hdr`): the same for the same directory, so that one a killed daemon left behind is
/// taken over, and different for every daemon of a host.
fn guest_tap_name(dir: &Path, role: Role, i: usize) -> String {
    let h = dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3)
        });
    let r = match role {
        Role::Primary => 'p',
        Role::Backup => 'b',
    };
    format!("tq{:06x}{r}{i}", h & 0xff_ffff)
}

/// The relays of one side, one per bridged NIC: each epoch boundary and release applies to
/// all of them.
#[derive(Clone, Default)]
pub struct Relays(Vec<Arc<Relay>>);

impl Relays {
    /// Turns every bridged NIC of `cfg` into a tap on its bridge with a relay between it and
    /// QEMU's stream netdev (`--tap-netns` first puts user-networking NICs on `a.bridge`).
    fn attach(
        a: &SiteConfig,
        dir: &Path,
        role: Role,
        cfg: &mut VmConfig,
    ) -> Result<Relays, SiteError> {
        if let Some(ns) = &a.tap_netns {
            for n in &mut cfg.nics {
                if matches!(n.net, NicNet::User { .. }) {
                    n.net = NicNet::Bridge {
                        bridge: a.bridge.clone(),
                        netns: Some(ns.clone()),
                    };
                }
            }
            // A guest booting its kernel may take its address on the command line.
            if let (Boot::Kernel { cmdline, .. }, Some(key)) = (&mut cfg.boot, &cfg.address_arg) {
                cmdline.push_str(&format!(" {key}={}", a.guest_ip));
            }
        }
        let (prefix, policy) = match role {
            Role::Primary => ("tdp", Policy::Hold),
            Role::Backup => ("tdb", Policy::Standby),
        };
        let mut relays = Vec::new();
        let cfg_vnet_hdr = cfg.vnet_hdr;
        for (i, n) in cfg.nics.iter_mut().enumerate() {
            let NicNet::Bridge { bridge, netns } = &n.net else {
                continue;
            };
            let name = match (&a.tap, i) {
                (Some(t), 0) => t.clone(),
                _ => format!("{prefix}{i}"),
            };
            // A tap this process just gave up (a node changing role) disappears once the old
            // relay's threads closed it, within ~100 ms: a busy name is retried for 3 s.
            let since = std::time::Instant::now();
            let tap = loop {
                match tandem_net::open_tap_with(netns.as_deref(), &name, Some(bridge), cfg_vnet_hdr)
                {
                    Err(tandem_net::TapError::Create(_, e))
                        if e.raw_os_error() == Some(libc::EBUSY)
                            && since.elapsed() < std::time::Duration::from_secs(3) =>
                    {
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                    r => {
                        break r.map_err(|source| SiteError::Tap {
                            tap: name.clone(),
                            bridge: bridge.clone(),
                            netns: netns.clone().unwrap_or_else(|| "(tandem's own)".into()),
                            source,
                        })?
                    }
                }
            };
            if cfg_vnet_hdr {
                // QEMU opens a tap of tandem's own namespace with virtio-net headers; the
                // relay takes its frames through a packet socket.
                let ifname = guest_tap_name(dir, role, i);
                tandem_net::guest_tap(&ifname).map_err(|source| SiteError::Tap {
                    tap: ifname.clone(),
                    bridge: "(none: QEMU's side)".into(),
                    netns: "(tandem's own)".into(),
                    source,
                })?;
                let relay = Relay::attach_tap(&ifname, OwnedFd::from(tap), policy)
                    .map_err(SiteError::Relay)?;
                relays.push(Arc::new(relay));
                n.net = NicNet::Tap { ifname };
                continue;
            }
            let socket = dir.join(format!("net{i}.sock"));
            let relay =
                Relay::listen(&socket, OwnedFd::from(tap), policy).map_err(SiteError::Relay)?;
            relays.push(Arc::new(relay));
            n.net = NicNet::Stream { socket };
        }
        if relays.is_empty() && role == Role::Primary {
            tracing::warn!("no bridged NIC (--tap-netns or [[nic]] bridge): the guest uses QEMU user networking and its network output is NOT held until acknowledged");
        }
        Ok(Relays(relays))
    }

    /// Whether there is no relay (user networking only).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Seals epoch `epoch`'s output on every relay (in the pause).
    pub fn seal(&self, epoch: u64) {
        for r in &self.0 {
            r.seal(epoch);
        }
    }

    /// Releases output up to epoch `epoch` on every relay while `allowed` says so (checked
    /// before each frame); the frames released so far, and whether everything up to `epoch`
    /// left.
    pub fn release_while(
        &self,
        epoch: u64,
        allowed: &dyn Fn() -> bool,
    ) -> Result<(u64, bool), tandem_net::RelayError> {
        let mut complete = true;
        for r in &self.0 {
            complete &= r.release_while(epoch, allowed)?.1;
        }
        Ok((self.stats().released_frames, complete))
    }

    /// Waits until no release is in progress on any relay.
    pub fn quiesce(&self) {
        for r in &self.0 {
            r.quiesce();
        }
    }

    /// Drops every held frame (this copy of the guest will never run again).
    pub fn discard_held(&self) {
        for r in &self.0 {
            r.discard_held();
        }
    }

    /// Guest frames held since the last seal, on every relay.
    pub fn unsealed_frames(&self) -> u64 {
        self.0.iter().map(|r| r.unsealed_frames()).sum()
    }

    /// Installs the fencing gate on every relay: no guest frame leaves while it is closed.
    pub fn set_gate(&self, gate: Option<tandem_net::Gate>) {
        for r in &self.0 {
            r.set_gate(gate.clone());
        }
    }

    /// Switches every relay to `p`.
    pub fn set_policy(&self, p: Policy) -> Result<(), tandem_net::RelayError> {
        self.0.iter().try_for_each(|r| r.set_policy(p))
    }

    /// The relays' counters, summed.
    pub fn stats(&self) -> RelayStats {
        let mut t = RelayStats::default();
        for r in &self.0 {
            let s = r.stats();
            t.held_frames += s.held_frames;
            t.held_bytes += s.held_bytes;
            t.released_frames += s.released_frames;
            t.inbound_frames += s.inbound_frames;
            t.dropped_frames += s.dropped_frames;
            t.overflow_frames += s.overflow_frames;
        }
        t
    }
}
