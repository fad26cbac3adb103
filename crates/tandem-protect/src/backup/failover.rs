//! The backup's failover: resume the guest on the standby from the last committed epoch, run
//! it as the owner the takeover recorded in etcd, and tell every primary that connects that it
//! was fenced.

use std::io::BufWriter;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use serde::Serialize;
use tandem_net::Policy;
use tandem_replication::{Backup, Frame};
use tandem_vm::MirrorFile;

use super::gate;
use super::keeper::Keeper;
use super::standby::Standby;
use super::{accept_within, io, BackupConfig, BackupError};
use crate::site::Site;
use crate::{unix_ms, Status};

/// What the backup did at failover (wall-clock times in Unix milliseconds).
#[derive(Serialize)]
pub struct FailoverReport {
    /// Why the primary was declared lost.
    pub reason: String,
    /// The epoch the guest resumed from.
    pub epoch: u64,
    /// When the loss was detected.
    pub detected_at_ms: u64,
    /// When the guest ran again.
    pub running_at_ms: u64,
    /// Detection to guest running (type I downtime without detection time), including the
    /// takeover in etcd.
    pub resume_ms: f64,
    /// Of which: changing the ownership record in etcd (0 without fencing).
    pub takeover_ms: f64,
    /// The silence timeout.
    pub timeout_ms: u64,
    /// Of `resume_ms`: restoring the consolidated pages into the mirror (0 without
    /// consolidation).
    pub materialise_ms: f64,
    /// Pages restored.
    pub materialised_pages: u64,
    /// Where the replica's pages were when the primary was lost (with consolidation).
    pub memory: Option<tandem_consolidate::Usage>,
    /// With a lazy restore: the guest's page faults served and how long until every
    /// consolidated page was in (the guest ran meanwhile).
    pub lazy: Option<tandem_consolidate::LazyStats>,
}

/// A lost primary the backup takes over from.
pub(super) struct Loss {
    /// Why it was declared lost.
    pub why: String,
    /// When (monotonic and Unix milliseconds).
    pub detected: Instant,
    pub at_ms: u64,
    /// The ownership this backup's takeover won (with `--etcd`).
    pub fence: Option<tandem_fence::Owner>,
}

pub(super) fn send(w: &mut impl std::io::Write, f: &Frame) -> std::io::Result<()> {
    f.write_to(w)?;
    w.flush()
}

/// The guest, resumed here.
pub(super) struct Running {
    pub vm: tandem_vm::Vm,
    pub fence: Option<tandem_fence::Owner>,
    pub epoch: u64,
}

/// Resumes the guest on the standby from the last committed epoch and reports it.
pub(super) fn failover(
    cfg: &BackupConfig,
    site: &Site,
    bk: &mut Backup<MirrorFile, Keeper>,
    standby: &mut Standby,
    loss: Loss,
    registry: &crate::metrics::Registry,
    status: &Status,
) -> Result<Running, BackupError> {
    let Loss {
        why,
        detected,
        at_ms: detected_at_ms,
        fence,
    } = loss;
    let takeover = detected.elapsed();
    let epoch = bk.committed();
    let state = bk.device_state().to_vec();
    if !standby.check_now() {
        return Err(BackupError::NoStandby { why, epoch });
    }
    let Some(mut vm) = standby.take() else {
        return Err(BackupError::NoStandby { why, epoch });
    };
    // Consolidated pages back into the mirror file the standby maps: all of them now, or
    // (lazy) those the guest touches first, the rest behind them while it runs.
    let memory = bk.keeper().usage();
    let (lazy, materialised_pages, materialise) = match restore(bk, standby, &vm, status) {
        Ok(r) => r,
        Err(e) => {
            vm.quit();
            return Err(e);
        }
    };
    // The resumed guest's output stops once this node learns another one owns the VM.
    if let Some(o) = &fence {
        o.watch();
        let o = o.clone();
        site.relays
            .set_gate(Some(std::sync::Arc::new(move || !o.is_fenced())));
    }
    site.relays
        .set_policy(Policy::Pass)
        .map_err(BackupError::Relay)?;
    vm.resume(&state)
        .map_err(|e| BackupError::Standby("resuming the standby", e))?;
    let resume = detected.elapsed();
    crate::echo_guest_console(&vm, status.clone());
    let running_at_ms = unix_ms();
    // Move the guest's MAC to this side of the bridge at once (QEMU also announces after an
    // incoming migration; this makes it explicit).
    if let Err(e) = vm.qmp.execute(
        "announce-self",
        Some(serde_json::json!({
            "initial": 50, "max": 550, "rounds": 5, "step": 100
        })),
    ) {
        tracing::warn!("announce-self: {e}");
    }
    status.info(format!(
        "failover: {why}; resumed the guest from epoch {epoch} in {:.1} ms after detection (+ up to {} ms detection timeout){}{}",
        resume.as_secs_f64() * 1000.0,
        cfg.timeout.as_millis(),
        if materialised_pages > 0 {
            format!("; of which {:.1} ms restoring {materialised_pages} consolidated pages", materialise.as_secs_f64() * 1000.0)
        } else {
            String::new()
        },
        if let Some(o) = &fence {
            format!("; of which {:.1} ms taking the VM over in etcd (generation {})", takeover.as_secs_f64() * 1000.0, o.generation())
        } else {
            String::new()
        }
    ));
    registry.failed_over(
        &why,
        epoch,
        takeover.as_secs_f64() * 1000.0,
        resume.as_secs_f64() * 1000.0,
        materialise.as_secs_f64() * 1000.0,
    );
    registry.set_owner(fence.clone());
    adopt_copy(cfg, site, epoch, registry, status);
    let lazy = match lazy {
        None => None,
        Some(l) => match l.wait() {
            (_, Ok(stats)) => {
                status.info(format!(
                    "lazy restore done {:.0} ms after the start: {} pages the guest touched first, {} installed behind them",
                    stats.done_ms, stats.faults, stats.background
                ));
                Some(stats)
            }
            (_, Err(e)) => {
                // Pages may be missing: the guest must not run on.
                vm.quit();
                return Err(BackupError::Lazy(e));
            }
        },
    };
    if memory.is_some() {
        if let Err(e) = standby.reserve() {
            status.warn(format!("the mirror's holes could not be allocated again ({e}): the resumed guest's QEMU may die when it first touches a zero page; free memory on {}", cfg.dir.display()));
        }
    }
    if let Some(p) = &cfg.report {
        let r = FailoverReport {
            reason: why,
            epoch,
            detected_at_ms,
            running_at_ms,
            resume_ms: resume.as_secs_f64() * 1000.0,
            takeover_ms: takeover.as_secs_f64() * 1000.0,
            timeout_ms: cfg.timeout.as_millis() as u64,
            materialise_ms: materialise.as_secs_f64() * 1000.0,
            materialised_pages,
            memory,
            lazy,
        };
        let json = serde_json::to_vec_pretty(&r).map_err(std::io::Error::other);
        json.and_then(|j| std::fs::write(p, j))
            .map_err(io(format!("writing {}", p.display())))?;
    }
    Ok(Running { vm, fence, epoch })
}

/// The guest runs from this node's copy of its disks now: records that in the copy's
/// directory (a primary started there boots from it) and writes the copy back to its storage
/// behind the running guest.
fn adopt_copy(
    cfg: &BackupConfig,
    site: &Site,
    epoch: u64,
    registry: &crate::metrics::Registry,
    status: &Status,
) {
    use crate::disk_copy::{self, Record, State};
    let Some(path) = site.copy_path() else {
        return;
    };
    let Some(dir) = path.parent() else {
        return;
    };
    registry.set_disks(path, "guest", !site.disks_are_volatile());
    let record = Record::new(cfg.vm_id, State::Guest, epoch, &site.mirrors);
    match disk_copy::write(dir, &record) {
        Ok(()) => status.info(format!(
            "the guest's disks are {} now (this node's copy as of epoch {epoch})",
            path.display()
        )),
        Err(e) => status.warn(format!(
            "the guest runs from {} but that could not be recorded ({}): a restart here would not boot from it",
            path.display(),
            crate::chain(&e)
        )),
    }
    let (path, st) = (path.to_path_buf(), status.clone());
    let synced = std::thread::Builder::new()
        .name("copy-sync".into())
        .spawn(move || {
            let t = Instant::now();
            match std::fs::File::open(&path).and_then(|f| f.sync_data()) {
                Ok(()) => tracing::info!(
                    "{} written back to storage in {:.1} s",
                    path.display(),
                    t.elapsed().as_secs_f64()
                ),
                Err(e) => st.warn(format!("writing {} back to storage: {e}", path.display())),
            }
        });
    if let Err(e) = synced {
        status.warn(format!("starting the copy's write-back: {e}"));
    }
}

/// Gets the consolidated pages into the standby: starts the lazy restore, or restores them all
/// (then, for a standby registered for missing faults that nobody will serve, allocates every
/// hole). Returns the lazy restore, the pages materialised and how long that took.
fn restore(
    bk: &mut Backup<MirrorFile, Keeper>,
    standby: &Standby,
    vm: &tandem_vm::Vm,
    status: &Status,
) -> Result<(Option<tandem_consolidate::Lazy>, u64, Duration), BackupError> {
    let lazy = start_lazy(bk, vm, status)?;
    let t = Instant::now();
    let pages = bk
        .materialise()
        .map_err(|e| BackupError::Io("restoring the consolidated pages".into(), e))?;
    if lazy.is_none() && vm.lazy_ram().is_some() {
        standby.reserve().map_err(|e| {
            BackupError::Io(
                "allocating the mirror of a standby registered for lazy restore".into(),
                e,
            )
        })?;
    }
    Ok((lazy, pages, t.elapsed()))
}

/// With a consolidated mirror and a standby registered for missing faults: starts serving its
/// faults from the consolidated pages (before the device state is loaded, which reads guest
/// memory). `None`: restore by materialising.
fn start_lazy(
    bk: &mut Backup<MirrorFile, Keeper>,
    vm: &tandem_vm::Vm,
    status: &Status,
) -> Result<Option<tandem_consolidate::Lazy>, BackupError> {
    let Some(ram) = vm.lazy_ram() else {
        return Ok(None);
    };
    if !bk.keeper().is_consolidated() {
        return Ok(None);
    }
    let uffd = match vm.lazy_uffd() {
        Ok(fd) => fd,
        Err(e) => {
            status.warn(format!(
                "lazy restore unavailable ({}): restoring every consolidated page first",
                crate::chain(&e)
            ));
            return Ok(None);
        }
    };
    let Some((replica, pool)) = bk.keeper_mut().take_consolidated() else {
        return Ok(None);
    };
    tandem_consolidate::Lazy::start(uffd, ram.start, replica, pool)
        .map(Some)
        .map_err(|e| BackupError::Io("starting the lazy-restore thread".into(), e))
}

/// Runs the resumed guest here, fencing every primary that connects, until told to stop.
/// `(vm_id, session)`: the VM and the session this node took over.
pub(super) fn run_resumed(
    r: Running,
    (vm_id, session): (u64, u64),
    site: &Site,
    listener: &Receiver<gate::Vetted>,
    (_registry, beat): (&crate::metrics::Registry, &crate::service::Beat),
    status: &Status,
) -> Result<(), BackupError> {
    let Running {
        mut vm,
        fence,
        epoch,
    } = r;
    while !status.stop().stopping() {
        if let Some(st) = vm.exit_status() {
            return Err(BackupError::Exited(st.to_string()));
        }
        // Another node owns the VM (an operator override): this copy stops, releasing
        // nothing more.
        if let Some(what) = fence.as_ref().and_then(|o| o.fenced()) {
            site.relays.discard_held();
            vm.kill();
            return Err(BackupError::FencedBy(what));
        }
        let accepted = accept_within(listener, Some(Duration::from_millis(100)), status, beat);
        if let Some(v) = accepted {
            tell_fenced(v, vm_id, epoch, session, status);
        }
    }
    // The only copy: shut down cleanly (ACPI) rather than pulled from under the guest.
    if vm.shut_down() {
        status.info("the guest powered off");
    }
    crate::primary::guest_shut_down(fence.as_ref(), site, status);
    Ok(())
}

/// Tells a primary that connected that the guest runs here (resumed from `epoch`, taken over
/// from `session`): it must stop its copy.
pub fn tell_fenced(v: gate::Vetted, vm_id: u64, epoch: u64, session: u64, status: &Status) {
    let s = v.conn;
    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
    let fenced = tandem_replication::wire::fenced_frame(vm_id, epoch, session);
    let mut w = BufWriter::new(s);
    let _ = send(&mut w, &fenced);
    status.info("told a connecting primary that the guest runs here (fenced)");
}
