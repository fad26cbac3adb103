//! Launching stock `qemu-system-x86_64` with guest RAM in a shared file, and driving it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::config::VmConfig;
use crate::console::{Console, ConsoleError};
use crate::desc::DescError;
use crate::devstate::{self, DeviceStateError};
use crate::dirty::{probe_pagemap_scan, DirtyLog, DirtyLogError, HashLog, UffdWpLog};
use crate::qemu_args::{qemu_args, Start};
use crate::qmp::{Qmp, QmpError};
use crate::ram::{GuestRam, RamError};

mod pause;
mod preload;

pub use preload::preload_path;
use preload::wait_registration;

/// How the dirty log is obtained (in configuration files: `auto`, `uffd`, `hash`, `none`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DirtyMode {
    /// userfaultfd async write-protect if the kernel has it, else the hash fallback (warned).
    Auto,
    /// userfaultfd async write-protect + `PAGEMAP_SCAN`; fails if unsupported.
    #[serde(alias = "uffd-wp")]
    Uffd,
    /// xxh3 of every page.
    Hash,
    /// No dirty log (plain boot).
    None,
}

impl std::str::FromStr for DirtyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DirtyMode::Auto),
            "uffd" | "uffd-wp" => Ok(DirtyMode::Uffd),
            "hash" => Ok(DirtyMode::Hash),
            "none" => Ok(DirtyMode::None),
            _ => Err(format!(
                "unknown dirty log {s:?}: use auto, uffd, hash or none"
            )),
        }
    }
}

/// Errors launching or driving a VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The scratch data disk is too large.
    #[error("scratch disk of {0} MiB: at most 1 TiB (1048576 MiB)")]
    ScratchDisk(u64),
    /// The VM description cannot be honoured.
    #[error(transparent)]
    Desc(#[from] DescError),
    /// QEMU could not be started.
    #[error("cannot start {0}: install Debian's qemu-system-x86 package, or name the binary with --qemu")]
    Spawn(String, #[source] std::io::Error),
    /// QEMU exited.
    #[error("QEMU exited ({status}); its log:\n{log}")]
    Exited {
        /// Exit status.
        status: String,
        /// QEMU's stderr.
        log: String,
    },
    /// Runtime directory or file problem.
    #[error("VM runtime files")]
    Io(#[from] std::io::Error),
    /// QMP failure.
    #[error(transparent)]
    Qmp(#[from] QmpError),
    /// RAM mapping failure.
    #[error(transparent)]
    Ram(#[from] RamError),
    /// Dirty log failure.
    #[error(transparent)]
    DirtyLog(#[from] DirtyLogError),
    /// The preloaded library could not register guest RAM.
    #[error("dirty-log registration inside QEMU failed: {0}")]
    Registration(String),
    /// Device-state capture or restore failed.
    #[error(transparent)]
    DeviceState(#[from] DeviceStateError),
    /// Console problem (including the guest not becoming ready).
    #[error(transparent)]
    Console(#[from] ConsoleError),
    /// A guest that is not a QEMU (a replayed trace) cannot go on.
    #[error("{0}")]
    Guest(String),
    /// A disk mirror could not be set up.
    #[error("{0}")]
    Mirror(String),
}

pub use tandem_types::PauseTiming;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Where a VM's guest RAM file comes from.
#[derive(Clone, Copy)]
enum RamSource<'a> {
    /// A new zeroed file, removed on drop.
    Fresh,
    /// A new file copied from a saved image, removed on drop.
    Copy(&'a Path),
    /// An existing file used as is and kept (a backup's mirror).
    InPlace(&'a Path),
    /// A new zeroed file, removed on drop, filled by a live migration from a running QEMU
    /// ([`crate::adopt`]).
    Adopting,
}

/// A running (or paused) QEMU with its QMP session, RAM mapping and dirty log.
pub struct Vm {
    child: Child,
    /// QMP session.
    pub qmp: Qmp,
    ram: Arc<GuestRam>,
    dirty: Option<Box<dyn DirtyLog>>,
    /// Guest console.
    pub console: Console,
    runtime: tempfile::TempDir,
    ram_path: PathBuf,
    keep_ram: bool,
    config: VmConfig,
    /// Disks mirrored into tandem's NBD export ([`crate::mirror`]).
    pub(crate) mirrors: Vec<usize>,
    pub(crate) mirror_health: crate::mirror::MirrorHealth,
    pub(crate) devstate: devstate::Capturer,
    pub(crate) last_devstate: Option<devstate::Method>,
    /// Stopped ahead of the next pause (early suspend): that pause skips its `stop`.
    pub(crate) suspended: bool,
    /// Guest RAM registered for missing faults ([`VmConfig::lazy_ram`]).
    lazy: Option<LazyRam>,
    /// Dropped with the VM: helpers that follow it ([`Vm::lifetime`]) end then.
    life: Arc<()>,
    /// The vCPU threads' clock, looked up on first use (`Some(None)`: QEMU or the kernel
    /// cannot tell).
    pub(crate) vcpu_clock: Option<Option<crate::vcpu::VcpuClock>>,
}

/// A standby's guest RAM registered for userfaultfd missing faults.
#[derive(Debug, Clone, Copy)]
pub struct LazyRam {
    /// Address of guest RAM in QEMU.
    pub start: u64,
    /// Its length.
    pub len: u64,
    /// The userfaultfd's number in QEMU.
    fd: i32,
}

impl Vm {
    /// Boots a fresh guest: QEMU starts paused (`-S`), the dirty log is armed, then it runs.
    pub fn launch(config: &VmConfig) -> Result<Vm, VmError> {
        Self::start(config, RamSource::Fresh, true)
    }

    /// Starts a QEMU that resumes from a checkpoint: `ram_image` is copied into its RAM file
    /// and `device_state` is loaded; the guest is left paused (call [`Vm::cont`]).
    pub fn restore(
        config: &VmConfig,
        ram_image: &Path,
        device_state: &[u8],
    ) -> Result<Vm, VmError> {
        let mut vm = Self::start(config, RamSource::Copy(ram_image), false)?;
        devstate::restore(&mut vm.qmp, device_state)?;
        Ok(vm)
    }

    /// Starts a standby QEMU (`-incoming defer -S`) whose guest RAM is `ram_file` itself —
    /// the backup's mirror — so failover needs no copy: [`Vm::resume`] loads a device state
    /// and runs the guest from whatever the file holds then. The file is kept on drop.
    pub fn standby(config: &VmConfig, ram_file: &Path) -> Result<Vm, VmError> {
        Self::start(config, RamSource::InPlace(ram_file), false)
    }

    /// Starts a QEMU waiting for a live migration from a running QEMU that it runs the guest
    /// of as soon as it is loaded, its dirty log armed ([`crate::adopt`]).
    pub(crate) fn adopting(config: &VmConfig) -> Result<Vm, VmError> {
        Self::start(config, RamSource::Adopting, false)
    }

    /// The directory of this QEMU's runtime files (sockets, logs), removed with it.
    pub(crate) fn runtime_dir(&self) -> &Path {
        self.runtime.path()
    }

    /// Loads `device_state` into a standby or restored QEMU and runs the guest.
    pub fn resume(&mut self, device_state: &[u8]) -> Result<(), VmError> {
        devstate::restore(&mut self.qmp, device_state)?;
        self.cont()
    }

    fn start(config: &VmConfig, ram: RamSource<'_>, run: bool) -> Result<Vm, VmError> {
        config.check()?;
        let runtime = crate::stale::owned_tempdir("tandem-vm-", None)?;
        let bytes = config.mem_mib << 20;
        let (ram_path, keep_ram) = ram_file(config, &ram, bytes)?;
        let start = match ram {
            RamSource::Fresh => Start::Paused,
            RamSource::Adopting => Start::IncomingRun,
            RamSource::Copy(_) | RamSource::InPlace(_) => Start::Incoming,
        };
        let mode = dirty_mode(config.dirty);
        let qmp_path = runtime.path().join("qmp.sock");
        let serial = config
            .console
            .clone()
            .unwrap_or_else(|| runtime.path().join("serial.log"));
        // A console file kept from an earlier guest must not be read as this one's (its
        // ready marker above all).
        let _ = fs::remove_file(&serial);
        if let Some(c) = &config.console {
            // The console's socket, where operators look: next to its log (`tandem console`).
            let link = c.with_extension("sock");
            let _ = fs::remove_file(&link);
            if let Err(e) =
                std::os::unix::fs::symlink(crate::qemu_args::console_socket(&qmp_path), &link)
            {
                tracing::warn!(
                    "linking the guest's console socket at {}: {e}",
                    link.display()
                );
            }
        }
        let status = runtime.path().join("uffd.status");
        let log = fs::File::create(runtime.path().join("qemu.log"))?;
        let mut cmd = Command::new(&config.qemu);
        cmd.args(qemu_args(config, &ram_path, &qmp_path, &serial, start));
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // QEMU dies with the tandem thread that started it (a killed daemon must not leave a
        // guest running that nobody checkpoints or whose output nobody holds).
        // SAFETY: the closure runs in the child between fork and exec and only calls prctl(2)
        // and getppid(2), both async-signal-safe; it allocates nothing.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() == 1 {
                    return Err(std::io::Error::other("tandem exited while starting QEMU"));
                }
                Ok(())
            });
        }
        let lazy = config.lazy_ram && mode == DirtyMode::None;
        if lazy {
            cmd.env("TANDEM_UFFD_MODE", "missing");
        }
        if mode == DirtyMode::Uffd || lazy {
            let so = preload_path().ok_or_else(|| {
                VmError::Registration("libtandem_preload.so not found (next to the tandem binary, in ../lib/tandem or /usr/lib/tandem): install the tandem package, build the whole workspace (cargo build --workspace) or set TANDEM_PRELOAD".into())
            })?;
            cmd.env("LD_PRELOAD", so)
                .env("TANDEM_RAM_PATH", &ram_path)
                .env("TANDEM_UFFD_STATUS", &status);
        }
        let ram = match GuestRam::open(&ram_path) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                return Err(Self::fail_early(
                    runtime,
                    (!keep_ram).then_some(ram_path.as_path()),
                    e.into(),
                ))
            }
        };
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let e = VmError::Spawn(config.qemu.display().to_string(), e);
                return Err(Self::fail_early(
                    runtime,
                    (!keep_ram).then_some(ram_path.as_path()),
                    e,
                ));
            }
        };
        let qmp = match Qmp::connect(&qmp_path, Duration::from_secs(20)) {
            Ok(q) => q,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Self::fail_early(
                    runtime,
                    (!keep_ram).then_some(ram_path.as_path()),
                    e.into(),
                ));
            }
        };
        // From here on `vm` owns the child and the RAM file: errors clean both up in Drop.
        // The device-state file lives in a directory of its own in /dev/shm (QEMU's other
        // runtime files if that cannot be made); both are removed with the VM, and found by
        // `clean_stale` after a kill.
        let devstate = devstate::Capturer::new(runtime.path(), config.fast_devstate);
        let mut vm = Vm {
            child,
            qmp,
            ram,
            dirty: None,
            console: Console::new(&serial),
            runtime,
            ram_path,
            keep_ram,
            config: config.clone(),
            mirrors: Vec::new(),
            mirror_health: Default::default(),
            devstate,
            last_devstate: None,
            suspended: false,
            vcpu_clock: None,
            lazy: None,
            life: Arc::new(()),
        };
        // An adopting QEMU's migration capabilities must match its source's until the
        // migration is done; the adoption prepares device-state capture afterwards.
        if start != Start::IncomingRun {
            devstate::prepare(&mut vm.qmp)?;
        }
        if lazy {
            let (start, len, fd) = wait_registration(&status, &mut vm.child)?;
            if len != bytes {
                return Err(VmError::Registration(format!(
                    "registered {len} bytes, guest RAM is {bytes}"
                )));
            }
            let fd = fd.ok_or_else(|| {
                VmError::Registration("the preloaded library did not report its descriptor".into())
            })?;
            vm.lazy = Some(LazyRam { start, len, fd });
        }
        vm.dirty = match mode {
            DirtyMode::Uffd => {
                let (start, len, _) = wait_registration(&status, &mut vm.child)?;
                if len != bytes {
                    return Err(VmError::Registration(format!(
                        "registered {len} bytes, guest RAM is {bytes}"
                    )));
                }
                Some(Box::new(UffdWpLog::new(vm.child.id(), start, len)?))
            }
            DirtyMode::Hash => Some(Box::new(HashLog::new(vm.ram.clone(), config.hash_threads))),
            _ => None,
        };
        if !vm.keep_ram {
            // QEMU and this process have the file mapped (the in-band QMP commands above ran
            // after QEMU's memory backends exist, and the dirty log is registered): unlink it
            // now so that nothing is left in /dev/shm when QEMU and tandem are killed.
            let _ = fs::remove_file(&vm.ram_path);
        }
        if run {
            vm.cont()?;
        }
        Ok(vm)
    }

    fn fail_early(runtime: tempfile::TempDir, remove: Option<&Path>, e: VmError) -> VmError {
        if let Some(p) = remove {
            let _ = fs::remove_file(p);
        }
        let log = fs::read_to_string(runtime.path().join("qemu.log")).unwrap_or_default();
        if log.trim().is_empty() {
            e
        } else {
            VmError::Exited {
                status: e.to_string(),
                log,
            }
        }
    }

    /// Where guest RAM is registered for missing faults ([`VmConfig::lazy_ram`]), if it is.
    pub fn lazy_ram(&self) -> Option<LazyRam> {
        self.lazy
    }

    /// A copy of QEMU's userfaultfd for [`Vm::lazy_ram`] (`pidfd_getfd(2)`, Linux 5.6+): its
    /// holder serves the guest's missing-page faults.
    pub fn lazy_uffd(&self) -> Result<std::os::fd::OwnedFd, VmError> {
        let Some(l) = self.lazy else {
            return Err(VmError::Registration(
                "guest RAM is not registered for missing faults".into(),
            ));
        };
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32)
            .ok_or_else(|| VmError::Registration("QEMU has no pid".into()))?;
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
            .map_err(|e| VmError::Registration(format!("pidfd_open of QEMU: {e}")))?;
        rustix::process::pidfd_getfd(&pidfd, l.fd, rustix::process::PidfdGetfdFlags::empty())
            .map_err(|e| VmError::Registration(format!("pidfd_getfd of QEMU's userfaultfd: {e}")))
    }

    /// QEMU's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How QEMU ended, if it has (a crash, an OOM kill, a `kill`): `None` while it runs.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Guest RAM mapping.
    pub fn ram(&self) -> &Arc<GuestRam> {
        &self.ram
    }

    /// A token that stops upgrading once this VM is dropped: a thread that follows the VM
    /// (its console, say) ends with it, whatever happens to QEMU's pid.
    pub fn lifetime(&self) -> std::sync::Weak<()> {
        Arc::downgrade(&self.life)
    }

    /// The guest's serial console: a unix socket that `tandem console` (or `socat -,raw
    /// UNIX-CONNECT:PATH`) attaches to.
    pub fn console_socket(&self) -> PathBuf {
        crate::qemu_args::console_socket(&self.runtime.path().join("qmp.sock"))
    }

    /// Path of the guest's serial console log.
    pub fn serial_path(&self) -> PathBuf {
        self.config
            .console
            .clone()
            .unwrap_or_else(|| self.runtime.path().join("serial.log"))
    }

    /// Path QEMU was given for the shared RAM file. A fresh or copied file is unlinked once
    /// QEMU runs (both keep it mapped); a standby's mirror file stays.
    pub fn ram_path(&self) -> &Path {
        &self.ram_path
    }

    /// The configuration this VM runs.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// Replaces the dirty log (any [`DirtyLog`]: the harvests of every later checkpoint come
    /// from it).
    pub fn set_dirty_log(&mut self, log: Box<dyn DirtyLog>) {
        self.dirty = Some(log);
    }

    /// Name of the active dirty log, if any.
    pub fn dirty_log_name(&self) -> Option<&'static str> {
        self.dirty.as_ref().map(|d| d.name())
    }

    /// Waits for the description's `ready` text on the console; returns at once for a VM
    /// without one.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<Duration, VmError> {
        let t = Instant::now();
        if let Some(marker) = self.config.ready.clone() {
            self.console
                .wait_for(&marker, 0, timeout)
                .map_err(|e| self.explain(e.into()))?;
        }
        Ok(t.elapsed())
    }

    /// Adds QEMU's log to an error if QEMU has exited.
    pub fn explain(&mut self, e: VmError) -> VmError {
        if let Ok(Some(st)) = self.child.try_wait() {
            let log = fs::read_to_string(self.runtime.path().join("qemu.log")).unwrap_or_default();
            return VmError::Exited {
                status: st.to_string(),
                log,
            };
        }
        e
    }

    /// Pauses the guest's vCPUs (QMP `stop`).
    pub fn stop(&mut self) -> Result<(), VmError> {
        self.qmp.execute("stop", None)?;
        Ok(())
    }

    /// Resumes the guest (QMP `cont`).
    pub fn cont(&mut self) -> Result<(), VmError> {
        // Whatever stopped it, the guest runs now: the next pause must stop it itself.
        self.suspended = false;
        self.qmp.execute("cont", None)?;
        Ok(())
    }

    /// Harvests the dirty log into `out` (sorted page numbers). The guest must be stopped.
    pub fn harvest(&mut self, out: &mut Vec<u64>) -> Result<(), VmError> {
        match self.dirty.as_mut() {
            Some(d) => {
                d.harvest(out)?;
                Ok(())
            }
            None => Err(VmError::Registration(
                "this VM was started without a dirty log".into(),
            )),
        }
    }

    /// Captures device state of the stopped guest into `out`.
    pub fn capture_device_state(&mut self, out: &mut Vec<u8>) -> Result<(), VmError> {
        self.last_devstate = Some(self.devstate.capture(&mut self.qmp, out)?);
        Ok(())
    }

    /// Turns the fast device-state path on or off (benchmarks compare both on one VM).
    pub fn set_fast_devstate(&mut self, fast: bool) {
        self.devstate.set_fast(fast);
    }

    /// How the last device state was captured (`migrate` or `xen-save`), and why the fast
    /// path is off if it is.
    pub fn devstate_method(&self) -> (Option<devstate::Method>, Option<&str>) {
        (self.last_devstate, self.devstate.fallback.as_deref())
    }

    /// QEMU's own full save of the stopped VM (RAM and devices, its migration format) into a
    /// new file at `path`; returns its size. The baseline the checkpoint store is measured
    /// against.
    pub fn full_save(&mut self, path: &Path) -> Result<u64, VmError> {
        let f = fs::File::create(path)?;
        Ok(devstate::full_save(&mut self.qmp, &f)?)
    }

    /// Writes guest RAM to a new file at `path` (stop the guest first for a consistent image).
    pub fn save_ram(&self, path: &Path) -> Result<(), VmError> {
        // SAFETY: read-only view of the guest's RAM; callers stop the guest for consistency.
        fs::write(path, unsafe { self.ram.as_slice() })?;
        Ok(())
    }

    /// Kills QEMU at once (SIGKILL), as a host failure would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Shuts the guest down cleanly: the ACPI power button, then up to the description's
    /// shutdown timeout for the guest to power off (its file systems flushed), then QEMU quits.
    /// Returns whether the guest powered off by itself.
    pub fn shut_down(mut self) -> bool {
        let wait = self.config.shutdown_timeout;
        if !wait.is_zero() && self.qmp.execute("system_powerdown", None).is_ok() {
            let deadline = Instant::now() + wait;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            tracing::warn!(
                "the guest did not power off within {} s of the ACPI power button; QEMU quits",
                wait.as_secs()
            );
        }
        self.quit();
        false
    }

    /// Asks QEMU to quit and waits for it.
    pub fn quit(mut self) {
        let _ = self.qmp.execute("quit", None);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.kill();
        if !self.keep_ram {
            let _ = fs::remove_file(&self.ram_path);
        }
    }
}

/// The guest RAM file for a new QEMU: a fresh or copied file in /dev/shm (removed once QEMU
/// maps it), or a standby's mirror used in place (kept).
fn ram_file(
    config: &VmConfig,
    ram: &RamSource<'_>,
    bytes: u64,
) -> Result<(PathBuf, bool), VmError> {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let fresh_path = || {
        PathBuf::from(format!(
            "{}/tandem-{}-{}-{n}.ram",
            crate::stale::TMPFS,
            config.name,
            std::process::id()
        ))
    };
    Ok(match *ram {
        RamSource::Fresh | RamSource::Adopting => {
            let p = fresh_path();
            drop(GuestRam::create(&p, bytes)?);
            (p, false)
        }
        RamSource::Copy(img) => {
            let p = fresh_path();
            fs::copy(img, &p)?;
            if fs::metadata(&p)?.len() != bytes {
                let _ = fs::remove_file(&p);
                return Err(VmError::Ram(RamError::BadSize(fs::metadata(img)?.len())));
            }
            (p, false)
        }
        RamSource::InPlace(p) => {
            if fs::metadata(p)?.len() != bytes {
                return Err(VmError::Ram(RamError::BadSize(fs::metadata(p)?.len())));
            }
            (p.to_path_buf(), true)
        }
    })
}

/// The dirty log to arm: `Auto` probes for async write-protect and falls back to hashing.
fn dirty_mode(m: DirtyMode) -> DirtyMode {
    match m {
        DirtyMode::Auto => match probe_pagemap_scan() {
            Ok(()) => DirtyMode::Uffd,
            Err(why) => {
                tracing::warn!("async write-protect dirty log unavailable ({why}); falling back to hashing every page, which costs a full read of guest RAM per epoch");
                DirtyMode::Hash
            }
        },
        m => m,
    }
}
