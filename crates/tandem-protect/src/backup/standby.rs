//! The backup's standby QEMU, watched: a standby that died (crash, OOM kill) is restarted on
//! the same mirror, and until it runs again the backup tells the primary it cannot fail over.

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tandem_vm::{Vm, VmConfig};

use super::BackupError;
use crate::Status;

/// The standby QEMU and what it takes to restart it.
pub struct Standby {
    cfg: VmConfig,
    /// The mirror, reachable through this process's descriptor once its name is removed.
    mirror: std::fs::File,
    vm: Option<Vm>,
    last_try: Instant,
    status: Status,
}

impl Standby {
    /// Starts the standby on the mirror at `path`, then removes the file's name: the mirror
    /// lives as long as this process or the standby maps it, and nothing is left behind.
    pub fn start(
        cfg: &VmConfig,
        path: &std::path::Path,
        status: Status,
    ) -> Result<Standby, BackupError> {
        let mirror = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| BackupError::Io(format!("opening {}", path.display()), e))?;
        let mut cfg = cfg.clone();
        let vm = match Vm::standby(&cfg, path) {
            Err(e) if cfg.lazy_ram => {
                status.warn(format!(
                    "the standby QEMU could not register its RAM for lazy restore ({}); a failover will restore every consolidated page first",
                    crate::chain(&e)
                ));
                cfg.lazy_ram = false;
                Vm::standby(&cfg, path)
            }
            r => r,
        }
        .map_err(|e| BackupError::Standby("starting the standby QEMU", e))?;
        let _ = std::fs::remove_file(path);
        Ok(Standby {
            cfg,
            mirror,
            vm: Some(vm),
            last_try: Instant::now(),
            status,
        })
    }

    fn path(&self) -> PathBuf {
        PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            self.mirror.as_raw_fd()
        ))
    }

    pub fn pid(&self) -> Option<u32> {
        self.vm.as_ref().map(|v| v.pid())
    }

    /// Whether the standby runs; restarts a dead one (at most every 2 s).
    pub fn check(&mut self) -> bool {
        if let Some(vm) = self.vm.as_mut() {
            match vm.exit_status() {
                None => return true,
                Some(st) => {
                    self.status.warn(format!("the standby QEMU exited ({st}); this backup CANNOT fail over until it runs again"));
                    self.vm = None;
                    self.last_try = Instant::now();
                }
            }
        }
        if self.last_try.elapsed() < Duration::from_secs(2) {
            return false;
        }
        self.last_try = Instant::now();
        match Vm::standby(&self.cfg, &self.path()) {
            Ok(vm) => {
                self.status
                    .info(format!("standby QEMU restarted (pid {})", vm.pid()));
                self.vm = Some(vm);
                true
            }
            Err(e) => {
                self.status.warn(format!(
                    "restarting the standby QEMU failed: {}",
                    crate::chain(&e)
                ));
                false
            }
        }
    }

    /// Like [`Standby::check`], but a dead standby is restarted now, whenever it was last
    /// tried (at failover there is no later).
    pub fn check_now(&mut self) -> bool {
        if let Some(t) = Instant::now().checked_sub(Duration::from_secs(3)) {
            self.last_try = self.last_try.min(t);
        }
        self.check()
    }

    /// Allocates every page of the mirror file again (a consolidated mirror has holes): a
    /// full tmpfs is then an error to report, not a SIGBUS in the resumed guest's QEMU when
    /// it first touches a zero page.
    pub fn reserve(&self) -> std::io::Result<()> {
        let len = self.mirror.metadata()?.len();
        match rustix::fs::fallocate(&self.mirror, rustix::fs::FallocateFlags::KEEP_SIZE, 0, len) {
            Ok(()) | Err(rustix::io::Errno::OPNOTSUPP) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The standby, to resume the guest on.
    pub fn take(&mut self) -> Option<Vm> {
        self.vm.take()
    }

    pub fn quit(&mut self) {
        if let Some(vm) = self.vm.take() {
            vm.quit();
        }
    }
}
