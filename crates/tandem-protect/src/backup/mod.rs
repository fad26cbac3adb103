//! The backup daemon: applies and acknowledges epochs; when the primary is gone, resumes the
//! guest on the standby QEMU (pre-started on the mirror file with `-incoming defer`), whose
//! NIC and data disk are already attached to this side's relay and NBD server.
//!
//! It runs until told to stop. A primary that reconnects starts a new session (a full
//! re-sync); a refused frame drops the link and waits for that reconnect. It fails over when
//! the primary is lost (link closed or broken, silence, or epochs that stop advancing) while it
//! holds a consistent epoch, or at once on a handover; afterwards it answers every primary
//! that connects with `fenced`.

mod failover;
mod gate;
mod keeper;
mod link;
mod standby;

use std::io::{BufReader, BufWriter};
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use tandem_replication::wire::{ack_frame, refused_frame};
use tandem_replication::{Applied, Backup, FileDisk, Frame, WireError};
use tandem_vm::{DirtyMode, MirrorFile, VmError};

use crate::site::{in_memory_fs, Role, Site, SiteConfig, SiteError};
use crate::vmspec::{VmSpec, VmSpecError};
use crate::{unix_ms, Status};
pub use failover::FailoverReport;
use failover::{failover, run_resumed, send, Loss};
use keeper::Keeper;
use link::{accept_within, Link};
use standby::Standby;

/// What the backup daemon runs. Plain data: in a configuration file `listen` and `dir` are
/// required, the rest optional; durations are written as `"500ms"`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct BackupConfig {
    /// Address to listen on (host:port).
    pub listen: String,
    /// Directory for the mirror file and sockets (use a tmpfs such as /dev/shm).
    pub dir: PathBuf,
    /// Directory on real storage for the copy of the VM's writable disks, which the guest
    /// runs from after a failover ([`crate::disk_copy`]). Default: `dir`, whose copy on a
    /// tmpfs is gone with the host.
    pub disk_dir: Option<PathBuf>,
    /// The VM as the primary runs it (the standby uses the same command line).
    pub vm: VmSpec,
    /// This side's relay and data disk.
    pub site: SiteConfig,
    /// Fail over when the primary has been silent this long.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Fail over when the primary's epochs have not advanced for this long although it still
    /// sends heartbeats (a primary stuck in QEMU); also how long a primary whose frame was
    /// refused has to reconnect. Default: 3 × `timeout`.
    #[serde(with = "humantime_serde")]
    pub stall: Option<Duration>,
    /// Write a JSON report of the failover here.
    pub report: Option<PathBuf>,
    /// Take over only by changing the VM's ownership record in etcd from "protected by this
    /// backup's session" to "runs here" (docs/FENCING.md).
    pub fence: Option<tandem_fence::FenceConfig>,
    /// The protected VM's id (status and metrics; the ownership record with `fence`).
    pub vm_id: u64,
    /// Serve Prometheus metrics on this address (GET /metrics).
    pub metrics_listen: Option<String>,
    /// The control socket `tandem status` asks (default: in /run/tandem).
    pub control: Option<PathBuf>,
    /// Mutual TLS on the replication link (only primaries with a certificate of its CA).
    pub tls: Option<crate::tls::TlsFiles>,
    /// Keep the mirror's cold pages consolidated (shared, patched, compressed; seed 001).
    pub consolidate: Option<Consolidate>,
    /// The libvirt domain the VM was adopted from: with `fence`, this host's libvirt is given
    /// its marked definition, its disks on this node's copy ([`crate::libvirt::keeper`]).
    pub libvirt: Option<tandem_vm::adopt::Libvirt>,
}

/// How a backup consolidates its mirror (docs/CONSOLIDATION.md).
#[derive(Clone, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Consolidate {
    /// The pool of page contents, shared by every replica this process keeps (not part of a
    /// configuration file: each backup gets its own, `backup-host` one for all its replicas).
    #[serde(skip)]
    pub pool: std::sync::Arc<std::sync::Mutex<tandem_consolidate::Pool>>,
    /// Time for the NRU clock to go once round the mirror (seed 001: scans at least 4 s
    /// apart).
    #[serde(with = "humantime_serde")]
    pub revolution: Duration,
    /// At failover, resume the guest at once and serve its pages on demand (userfaultfd in
    /// the standby), instead of restoring every consolidated page first.
    pub lazy: bool,
}

impl std::fmt::Debug for Consolidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consolidate")
            .field("revolution", &self.revolution)
            .field("lazy", &self.lazy)
            .finish_non_exhaustive()
    }
}

impl Default for Consolidate {
    /// Seed 001's clock (a revolution in 4 s) and lazy restore, in a pool of its own.
    fn default() -> Self {
        Consolidate {
            pool: Default::default(),
            revolution: Duration::from_secs(4),
            lazy: true,
        }
    }
}

impl Default for BackupConfig {
    fn default() -> Self {
        BackupConfig::new("", "", VmSpec::default())
    }
}

impl BackupConfig {
    /// Defaults for a backup of `vm` listening on `listen` with its files in `dir`.
    pub fn new(listen: impl Into<String>, dir: impl Into<PathBuf>, vm: VmSpec) -> Self {
        BackupConfig {
            listen: listen.into(),
            dir: dir.into(),
            disk_dir: None,
            vm,
            site: SiteConfig::default(),
            timeout: Duration::from_millis(500),
            stall: None,
            report: None,
            fence: None,
            vm_id: 1,
            metrics_listen: None,
            control: None,
            tls: None,
            consolidate: None,
            libvirt: None,
        }
    }
}

/// Why the backup stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// The VM description is unusable.
    #[error(transparent)]
    Spec(#[from] VmSpecError),
    /// Relay or data disk set-up failed.
    #[error(transparent)]
    Site(#[from] SiteError),
    /// A file or socket of the backup could not be set up.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// The directory is not private to tandem's user.
    #[error(transparent)]
    PrivateDir(tandem_vm::PrivateDirError),
    /// The disk copy's record could not be read or written.
    #[error("the copy of the guest's disks")]
    Copy(#[source] crate::disk_copy::CopyError),
    /// The listen address or the directory is missing.
    #[error("a backup needs a listen address (host:port) and a directory for its mirror")]
    Incomplete,
    /// The TLS files are unusable.
    #[error("TLS for primaries")]
    Tls(#[from] crate::tls::TlsError),
    /// The RAM mirror could not be created.
    #[error("creating the RAM mirror")]
    Mirror(#[source] tandem_vm::ram::RamError),
    /// The standby QEMU could not start or resume.
    #[error("{0}")]
    Standby(&'static str, #[source] VmError),
    /// The primary was lost while no standby ran.
    #[error("primary lost ({why}) but the standby QEMU is not running: cannot resume the guest from epoch {epoch}")]
    NoStandby {
        /// Why the primary was declared lost.
        why: String,
        /// The epoch that would have been resumed.
        epoch: u64,
    },
    /// The relay could not switch to passing output.
    #[error("releasing the guest's network")]
    Relay(#[source] tandem_net::RelayError),
    /// The resumed guest's QEMU exited.
    #[error("the resumed guest's QEMU exited ({0})")]
    Exited(String),
    /// The ownership record names another node: this copy was stopped.
    #[error("etcd's ownership record says the VM is {0}: the guest resumed here was stopped")]
    FencedBy(String),
    /// The etcd client could not be set up.
    #[error("fencing")]
    Fence(#[source] tandem_fence::FenceError),
    /// The lazy restore could not install every page: the resumed guest was stopped.
    #[error("the lazy restore failed; the resumed guest was stopped")]
    Lazy(#[source] tandem_consolidate::LazyError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BackupError {
    let what = what.into();
    move |e| BackupError::Io(what, e)
}

/// How a backup with `fence` fences, as hellos must say.
fn wire_fencing(fence: &tandem_fence::Fence) -> tandem_replication::Fencing {
    let d = fence.descriptor();
    tandem_replication::Fencing::Etcd {
        cluster_id: d.cluster_id,
        key_hash: d.key_hash,
    }
}

/// Binds the listen port and starts vetting connections on it.
pub(crate) fn listen(cfg: &BackupConfig, status: &Status) -> Result<Listener, BackupError> {
    let tcp_listener =
        TcpListener::bind(&cfg.listen).map_err(io(format!("listening on {}", cfg.listen)))?;
    if cfg.listen.is_empty() || cfg.dir.as_os_str().is_empty() {
        return Err(BackupError::Incomplete);
    }
    let gate = gate::Admission {
        vm_id: cfg.vm_id,
        tls: cfg
            .tls
            .as_ref()
            .map(crate::tls::server_config)
            .transpose()?,
    };
    Ok(Listener(gate::start(tcp_listener, gate, status.clone())))
}

/// The backup's listen port: vetted connections of primaries for its VM.
pub(crate) struct Listener(Receiver<gate::Vetted>);

impl Listener {
    /// Answers every primary that connects within `wait`: `Some((vm, epoch, session))` tells
    /// it that the guest runs here since `epoch`, taken over from `session` (fenced); `None`
    /// just closes the connection (this node runs a guest it booted and is nobody's backup
    /// now).
    /// A connection that arrives while `close_only()` holds is just closed (its primary
    /// retries).
    pub fn turn_away(
        &self,
        wait: Duration,
        fenced: Option<(u64, u64, u64)>,
        close_only: &dyn Fn() -> bool,
        status: &Status,
    ) {
        if let Ok(v) = self.0.recv_timeout(wait) {
            if close_only() {
                return;
            }
            match fenced {
                Some((vm_id, epoch, session)) => {
                    failover::tell_fenced(v, vm_id, epoch, session, status)
                }
                None => status.warn(
                    "a primary connected, but this node runs the guest as its primary: connection closed",
                ),
            }
        }
    }
}

/// Starts a backup in its own thread: it applies and acknowledges epochs, fails over when the
/// primary is lost while a consistent epoch exists, then runs the guest; until its handle asks
/// it to stop.
pub fn spawn(cfg: BackupConfig) -> crate::DaemonHandle<Result<(), BackupError>> {
    crate::DaemonHandle::spawn(format!("backup-vm{}", cfg.vm_id), "backup", move |st| {
        run(cfg, st)
    })
}

/// Runs the backup until `status`'s [`crate::Stop`] asks it to stop (the blocking form of
/// [`spawn`]): applies and acknowledges epochs; fails over when the primary is lost while a
/// consistent epoch exists, then runs the guest.
pub fn run(cfg: BackupConfig, status: Status) -> Result<(), BackupError> {
    let fe = crate::frontend::Frontend::start(
        crate::frontend::FrontendConfig {
            role: "backup",
            vm_id: cfg.vm_id,
            fence: cfg.fence.clone(),
            control: cfg.control.as_deref(),
            metrics_listen: cfg.metrics_listen.as_deref(),
            switchover: None,
        },
        &status,
    )
    .map_err(io(format!("serving metrics on {:?}", cfg.metrics_listen)))?;
    let _libvirt = keep_libvirt(&cfg, &status);
    let listener = listen(&cfg, &status)?;
    serve(&cfg, &fe, &listener, false, status).map(|_| ())
}

/// With `libvirt` and `fence`: gives this host's libvirt the adopted domain, in a thread that
/// ends when the returned token is dropped.
pub(crate) fn keep_libvirt(cfg: &BackupConfig, status: &Status) -> Option<std::sync::Arc<()>> {
    let (Some(l), Some(fence)) = (&cfg.libvirt, &cfg.fence) else {
        if let Some(l) = &cfg.libvirt {
            status.warn(format!(
                "libvirt domain {}: not defined on this host: its definition comes through etcd, and this backup has no --etcd",
                l.domain
            ));
        }
        return None;
    };
    let disks = match cfg.vm.config("libvirt") {
        Ok(c) => c.disks.iter().map(|d| d.path.clone()).collect(),
        Err(_) => return None, // the backup reports a bad description itself
    };
    let alive = std::sync::Arc::new(());
    crate::libvirt::keeper::spawn(
        fence.clone(),
        l.clone(),
        disks,
        cfg.disk_dir.clone().unwrap_or_else(|| cfg.dir.clone()),
        status.clone(),
        std::sync::Arc::downgrade(&alive),
    );
    Some(alive)
}

/// Serves as the backup on `listener`, reporting through `fe`. Without `reprotect` it runs
/// the guest after a failover until told to stop (`None`); with it, it returns the resumed
/// guest for this node to protect in turn (its standby was started with a dirty log).
pub(crate) fn serve(
    cfg: &BackupConfig,
    fe: &crate::frontend::Frontend,
    listener: &Listener,
    reprotect: bool,
    status: Status,
) -> Result<Option<crate::primary::Resumed>, BackupError> {
    let listener = &listener.0;
    // Setting up (tap, mirror, disk copy, standby QEMU) is progress for systemd's watchdog.
    fe.beat.allow(Duration::from_secs(60));
    let mut vmc = cfg.vm.config("standby")?;
    if !reprotect {
        vmc.dirty = DirtyMode::None;
        // A lazy restore needs the standby's RAM registered for missing faults, which a
        // standby that logs dirty pages (to protect the guest in turn) cannot have as well.
        vmc.lazy_ram = cfg.consolidate.as_ref().is_some_and(|c| c.lazy);
    }
    tandem_vm::private_dir(&cfg.dir).map_err(BackupError::PrivateDir)?;
    // The standby's console, which is the guest's after a failover.
    vmc.console = Some(cfg.dir.join("guest-console.log"));
    let copy_dir = cfg.disk_dir.as_deref().unwrap_or(&cfg.dir);
    if copy_dir != cfg.dir {
        tandem_vm::private_dir(copy_dir).map_err(BackupError::PrivateDir)?;
    }
    if vmc.writable_disk().is_some() {
        begin_copy(copy_dir, cfg.vm_id, &vmc, &status)?;
    }
    let site = Site::prepare(&cfg.site, &cfg.dir, copy_dir, Role::Backup, &mut vmc)?;
    if let Some(p) = site.copy_path() {
        let durable = !site.disks_are_volatile();
        fe.registry.set_disks(p, "copy", durable);
        if !durable {
            status.warn(format!(
                "the copy of the guest's disks, {}, is on a tmpfs: after a failover the guest's disks are gone once this host restarts; give the backup a --disk-dir on real storage",
                p.display()
            ));
        }
    }
    let mirror_path = cfg.dir.join("mirror.ram");
    if !in_memory_fs(&cfg.dir) {
        status.warn(format!(
            "{} is not on a tmpfs or hugetlbfs: the guest's RAM mirror there is written back to disk by the kernel and a failover resume takes far longer (hundreds of ms); use a directory in /dev/shm",
            cfg.dir.display()
        ));
    }
    // SAFETY: this process is the mirror's only writer; the standby QEMU maps it but runs only
    // after `resume`, which is called once the mirror is no longer written.
    let mirror = unsafe { MirrorFile::create(&mirror_path, vmc.mem_mib << 20) }
        .map_err(BackupError::Mirror)?;
    let keeper = match &cfg.consolidate {
        Some(c) => Keeper::Consolidated(Box::new(tandem_consolidate::Consolidated::new(
            mirror.as_ref().len(),
            c.pool.clone(),
            c.revolution,
        ))),
        None => Keeper::Plain(tandem_replication::Plain),
    };
    let mut bk = Backup::with_keeper(mirror, keeper);
    let fence = match &cfg.fence {
        Some(fc) => {
            let f = tandem_fence::Fence::connect(fc.clone()).map_err(BackupError::Fence)?;
            // The cluster id comes with the first answer (hellos compare it when known).
            if let Err(e) = f.read() {
                status.warn(format!(
                    "etcd does not answer yet ({}): this backup can take over only once it does",
                    crate::chain(&e)
                ));
            }
            bk.set_fencing(wire_fencing(&f));
            f.keep_warm(Duration::from_secs(2));
            Some(f)
        }
        None => None,
    };
    if let Some(p) = &site.disk_path {
        let what = || format!("opening the disk copy {}", p.display());
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(p)
            .map_err(io(what()))?;
        bk = bk.with_disk(Box::new(FileDisk::new(f).map_err(io(what()))?));
        if site.copy_path().is_none() {
            // A scratch data disk: this process and its NBD server hold it open, nothing is
            // left behind. (A copy of writable disks keeps its name: the guest's disks after a
            // failover.)
            let _ = std::fs::remove_file(p);
        }
    }
    let mut standby = Standby::start(&vmc, &mirror_path, status.clone())?;
    let registry = fe.registry.clone();
    registry.switch_role("backup");
    registry.set_state("standby: waiting for a primary");
    let beat = fe.beat.clone();
    status.event(crate::Event::Listening {
        addr: cfg.listen.clone(),
        standby_pid: standby.pid().unwrap_or(0),
    });
    status.info(format!(
        "listening on {}, standby QEMU pid {} ready on {}",
        cfg.listen,
        standby.pid().unwrap_or(0),
        mirror_path.display()
    ));
    let timeout = cfg.timeout.max(Duration::from_millis(1));
    let mut link = Link {
        bk: &mut bk,
        standby: &mut standby,
        timeout,
        stall: cfg
            .stall
            .unwrap_or(3 * timeout)
            .max(Duration::from_millis(1)),
        status: status.clone(),
        reconnected: false,
        fence: fence.clone(),
        // It takes over no sooner than its silence timeout, and no sooner than the stall
        // time (the other way it declares a primary lost).
        promise: timeout.min(cfg.stall.unwrap_or(3 * timeout)),
        registry: registry.clone(),
        beat: beat.clone(),
        memory_at: Instant::now(),
    };
    fe.ready();
    let mut wait = None;
    let mut lost: Option<(String, Instant, u64)> = None;
    let mut said = String::new();
    let owner = loop {
        let Some(why) = link.until_lost(listener, wait)? else {
            standby.quit();
            return Ok(None);
        };
        if link.reconnected {
            // A primary came back since the last attempt: this is a new loss.
            lost = None;
            said.clear();
        }
        // The first reason (and time) of this loss is the one reported.
        let (why, detected, at_ms) = lost.get_or_insert((why, Instant::now(), unix_ms())).clone();
        let Some(fence) = &fence else {
            break None;
        };
        if !link.standby.check_now() {
            // Taking over without a standby to resume would leave nobody running the guest.
            let msg = format!(
                "primary lost ({why}) but the standby QEMU is not running: not taking over"
            );
            if msg != said {
                status.warn(&msg);
                said = msg;
            }
            wait = Some(Duration::from_millis(100));
            continue;
        }
        let (msg, retry) = match fence.take_over(link.bk.session()) {
            Ok(o) => break Some((o, detected, at_ms)),
            // Not known: the write stays pending and the next attempt resolves it first.
            Err(e) if e.unknown() => (
                format!("primary lost ({why}); cannot reach etcd to take over ({}); retrying", crate::chain(&e)),
                Some(Duration::from_millis(50)),
            ),
            // The record says the primary runs without a replica, or with another session:
            // this mirror may never be resumed. Wait for a new session.
            Err(e) if e.refusal().is_some() => (
                format!("primary lost ({why}); not taking over: {}; waiting for a primary to start a new session", crate::chain(&e)),
                None,
            ),
            // A record that is not tandem's, or one that keeps changing: retried (an operator
            // may repair it).
            Err(e) => (
                format!("primary lost ({why}); cannot take over: {}; retrying every second", crate::chain(&e)),
                Some(Duration::from_secs(1)),
            ),
        };
        if msg != said {
            status.warn(&msg);
            link.registry.set_state(format!("not taking over: {msg}"));
            said = msg;
        }
        // Keep serving: a primary that reconnects starts a new session.
        wait = retry;
    };
    let (why, detected, at_ms) = lost.unwrap_or_else(|| (String::new(), Instant::now(), unix_ms()));
    let session = link.bk.session();
    let owner = owner.map(|(o, _, _)| o);
    let loss = Loss {
        why,
        detected,
        at_ms,
        fence: owner,
    };
    let running = failover(cfg, &site, &mut bk, &mut standby, loss, &registry, &status)?;
    let vm_id = bk.vm_id().unwrap_or(cfg.vm_id);
    if reprotect {
        return Ok(Some(crate::primary::Resumed {
            epoch: running.epoch,
            vm: running.vm,
            holder: running.fence,
            site,
            dir: cfg.dir.clone(),
            session,
        }));
    }
    run_resumed(
        running,
        (vm_id, session),
        &site,
        listener,
        (&registry, &beat),
        &status,
    )?;
    Ok(None)
}

/// Before a backup truncates its disk copy in `dir`: records that it is a copy receiving
/// epochs. A copy the guest last ran from (a record saying `guest`) is kept aside as
/// `guest-disks.raw.prev`, so that a backup started on the wrong node never destroys the
/// only disks of a stopped guest.
fn begin_copy(
    dir: &std::path::Path,
    vm_id: u64,
    vmc: &tandem_vm::VmConfig,
    status: &Status,
) -> Result<(), BackupError> {
    use crate::disk_copy::{self, Earlier};
    let (slices, _) = crate::site::capture_slices(vmc)?;
    let file = disk_copy::path(dir);
    match disk_copy::begin(dir, vm_id, &slices).map_err(BackupError::Copy)? {
        Earlier::Nothing => {}
        Earlier::Kept { to, epoch } => status.warn(format!(
            "the guest last ran here from {} (epoch {epoch}); serving as the backup now, so it was kept as {}: delete it once the guest runs well elsewhere",
            file.display(),
            to.display()
        )),
        Earlier::Gone { epoch } => status.warn(format!(
            "{} says the guest last ran here from {} (epoch {epoch}), but that file is gone; starting a fresh copy",
            dir.join(disk_copy::RECORD).display(),
            file.display()
        )),
    }
    Ok(())
}
