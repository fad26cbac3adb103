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
use crate::qmp::{Armed, Qmp, QmpError};
use crate::ram::{GuestRam, RamError};

mod pause;
mod preload;
mod start;

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
    /// `stop` and `cont` armed on monitors of their own ([`crate::qmp::Armed`]), unless QEMU
    /// did not let tandem connect to them.
    pub(crate) armed_stop: Option<Armed>,
    pub(crate) armed_cont: Option<Armed>,
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
        match Armed::run_in(&mut self.armed_stop, Armed::execute) {
            Some(r) => r?,
            None => self.qmp.execute("stop", None)?,
        };
        Ok(())
    }

    /// Resumes the guest (QMP `cont`).
    pub fn cont(&mut self) -> Result<(), VmError> {
        // Whatever stopped it, the guest runs now: the next pause must stop it itself.
        self.suspended = false;
        match Armed::run_in(&mut self.armed_cont, Armed::execute) {
            Some(r) => r?,
            None => self.qmp.execute("cont", None)?,
        };
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
