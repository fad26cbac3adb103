//! The primary daemon: boots the guest and protects it until told to stop. Each session sends
//! a hello and an initial copy, then checkpoints every epoch and ships it on a sender thread
//! while the guest runs the next one; guest output is released epoch by epoch as the backup
//! acknowledges. A lost link keeps the output held and reconnects with a full re-sync; only
//! an explicit operator request ends replication without a failover.
//!
//! Stopping ([`crate::signals`]): SIGTERM or SIGINT hands the guest over (a last checkpoint
//! with the guest left stopped, then the backup resumes it); SIGUSR1 ends protection and shuts
//! the guest down (`bye`: the backup does not fail over); `duration` (benchmarks) does the
//! same as SIGUSR1 when it expires.

mod adopt;
mod ahead;
mod fence;
pub use adopt::AdoptConfig;
pub(crate) use fence::guest_shut_down;
mod connect;
mod finish;
mod initial;
mod link;
mod session;
mod sink;
mod watchdog;

use crate::conn::Conn;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_codec::{Codec, Config};
use tandem_replication::Primary;
use tandem_vm::{Vm, VmError};

use crate::frontend::{Frontend, FrontendConfig};
use crate::site::{Role, Site, SiteConfig, SiteError};
use crate::vmspec::{boot, BootError, VmSpec, VmSpecError};
use crate::Status;
use connect::{client_tls, sessions};
use finish::finish;
pub use initial::Precopy;
use session::{Daemon, End};
pub use tandem_replication::Parts;
use watchdog::Watchdog;

/// What the primary daemon runs. Plain data: in a configuration file every field is
/// optional but `backup` and durations are written as `"100ms"`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct PrimaryConfig {
    /// Backup address (host:port).
    pub backup: String,
    /// The protected VM.
    pub vm: VmSpec,
    /// Its network relay and data disk.
    pub site: SiteConfig,
    /// Directory for the data disk and sockets (default: a temporary directory).
    pub dir: Option<PathBuf>,
    /// Epoch length (with `adaptive`, its longest wait is the epoch length instead).
    #[serde(with = "humantime_serde")]
    pub epoch: Duration,
    /// Schedule checkpoints adaptively (seed 002, docs/SCHEDULING.md) instead of every `epoch`.
    pub adaptive: Option<tandem_vm::schedule::AdaptiveConfig>,
    /// Capture device state through `xen-save-devices-state` after the first checkpoint
    /// (default; docs/VM_LAB.md, "The fast path"); false: always through `migrate`.
    pub fast_devstate: bool,
    /// For benchmarks: end protection and shut the guest down after this long.
    #[serde(with = "humantime_serde")]
    pub duration: Option<Duration>,
    /// Memory codec.
    pub codec: Codec,
    /// zstd level of the memory records; `None` (default): chosen per epoch from whether the
    /// encoder or the link is the slower stage (`tandem_codec::level`).
    pub zstd_level: Option<i32>,
    /// Threads of the memory encoder (default 1). More pay on large epochs on a host with
    /// cores to spare: the per-page work splits from 1 024 dirty pages on
    /// (`tandem_codec::Config::min_pages_per_thread` per thread).
    pub encoder_threads: usize,
    /// The initial sync's pre-copy rounds (initial.rs).
    pub precopy: Precopy,
    /// Epochs larger than this are sent in parts (the first after a busy initial sync, a
    /// burst of disk writes), committed together on the backup.
    #[serde(skip)]
    pub parts: tandem_replication::Parts,
    /// Identifier of the protected VM (the backup refuses frames of any other).
    pub vm_id: u64,
    /// Send a heartbeat when nothing else was sent for this long.
    #[serde(with = "humantime_serde")]
    pub heartbeat: Duration,
    /// The backup is lost when an epoch stays unacknowledged this long (also the socket's
    /// TCP_USER_TIMEOUT); output stays held and the primary reconnects.
    #[serde(with = "humantime_serde")]
    pub ack_timeout: Duration,
    /// Kill QEMU when the main loop makes no progress for this long (default: the larger of
    /// 3 s and 20 epochs).
    #[serde(with = "humantime_serde")]
    pub stall: Option<Duration>,
    /// Append one JSON line per acknowledged epoch to this file.
    pub metrics_jsonl: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (GET /metrics).
    pub metrics_listen: Option<String>,
    /// Faults the primary injects into itself (the lab's tests only).
    #[cfg(feature = "fault-hooks")]
    #[serde(skip)]
    pub faults: crate::faults::Faults,
    /// Fence with the VM's ownership record in etcd (docs/FENCING.md); `None`: no fencing
    /// (the backup cannot tell a partition from a dead host, and output stays held without a
    /// backup).
    pub fence: Option<tandem_fence::FenceConfig>,
    /// The control socket `tandem status` asks (default: in /run/tandem).
    pub control: Option<PathBuf>,
    /// Mutual TLS on the replication link (the files are read at each connection, so renewed
    /// certificates take effect at the next one).
    pub tls: Option<ClientTls>,
    /// Adopt the guest a QEMU already runs (live migration, no reboot) instead of booting
    /// the described VM (`tandem adopt`).
    pub adopt: Option<AdoptConfig>,
}

/// The primary's side of mutual TLS.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientTls {
    /// The CA, certificate and key files.
    #[serde(flatten)]
    pub files: crate::tls::TlsFiles,
    /// The name the backup's certificate must carry (default: the host of `backup`).
    pub server_name: Option<String>,
}

impl Default for PrimaryConfig {
    fn default() -> Self {
        PrimaryConfig::new("", VmSpec::default())
    }
}

impl PrimaryConfig {
    /// Defaults for replicating `vm` to `backup`.
    pub fn new(backup: impl Into<String>, vm: VmSpec) -> Self {
        PrimaryConfig {
            backup: backup.into(),
            vm,
            site: SiteConfig::default(),
            dir: None,
            epoch: Duration::from_millis(100),
            adaptive: None,
            fast_devstate: true,
            duration: None,
            codec: Codec::Tandem,
            zstd_level: None,
            encoder_threads: 1,
            precopy: Precopy::default(),
            parts: tandem_replication::Parts::DEFAULT,
            vm_id: 1,
            heartbeat: Duration::from_millis(100),
            ack_timeout: Duration::from_secs(2),
            stall: None,
            metrics_jsonl: None,
            metrics_listen: None,
            #[cfg(feature = "fault-hooks")]
            faults: Default::default(),
            fence: None,
            control: None,
            tls: None,
            adopt: None,
        }
    }
}

/// Why the primary stopped with an error (the backup fails over unless it was fenced).
#[derive(Debug, thiserror::Error)]
pub enum PrimaryError {
    /// The working directory could not be created.
    #[error("creating the working directory {0}")]
    Dir(PathBuf, #[source] std::io::Error),
    /// The working directory is not private to tandem's user.
    #[error(transparent)]
    PrivateDir(tandem_vm::PrivateDirError),
    /// This node's copy of the guest's disks is unusable or unreadable.
    #[error(transparent)]
    Copy(#[from] crate::disk_copy::CopyError),
    /// This node served as the backup since the description's disks were last used: they are
    /// older than the VM's.
    #[error("this node's disks are older than the VM's: it served as its backup since ({0} says so), so the guest last ran on the other node; start the VM there, or delete that file to boot from the description's disks anyway")]
    StaleDisks(PathBuf),
    /// The VM description is unusable.
    #[error(transparent)]
    Spec(#[from] VmSpecError),
    /// Relay or data disk set-up failed.
    #[error(transparent)]
    Site(#[from] SiteError),
    /// The guest did not come up.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// The metrics endpoint or file could not be opened.
    #[error("metrics {0}")]
    Metrics(String, #[source] std::io::Error),
    /// QEMU or QMP failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// QEMU exited while no backup was connected.
    #[error("QEMU exited ({0}) while the primary waited for the backup")]
    QemuExited(String),
    /// An epoch could not be encoded.
    #[error("encoding an epoch")]
    Encode(#[from] tandem_replication::PrimaryError),
    /// The thread encoding the final epoch's memory stopped.
    #[error("the encoder's thread stopped before the final epoch was encoded")]
    EncoderStopped,
    /// The final epoch's disk writes could not be read back.
    #[error("reading back the final epoch's disk writes")]
    FinalWrites(#[source] std::io::Error),
    /// The watchdog killed a QEMU that stopped answering.
    #[error("the watchdog killed the hung QEMU")]
    Watchdog(#[source] Box<PrimaryError>),
    /// The backup resumed the guest: this copy was stopped.
    #[error("the backup resumed the guest (from epoch {0}): this copy was stopped and its held output discarded")]
    Fenced(u64),
    /// Fencing in etcd failed (the VM runs elsewhere or ran there last, etcd is down).
    #[error("fencing")]
    Fence(#[from] tandem_fence::FenceError),
    /// The ownership record names another node.
    #[error("etcd's ownership record says the VM is {0}: this copy was stopped and its held output discarded")]
    FencedBy(String),
    /// No backup address was given.
    #[error("no backup address: give the backup's host:port")]
    NoBackup,
    /// The TLS files are unusable.
    #[error("TLS to the backup")]
    Tls(#[from] crate::tls::TlsError),
    /// The running guest could not be adopted.
    #[error("adopting the running guest")]
    Adopt(#[from] tandem_vm::adopt::AdoptError),
    /// The adoption did not begin.
    #[error("not adopting the running guest ({0}); it runs on in its own QEMU")]
    AdoptRefused(String),
}

/// How the primary ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// Replication ended (a handover on SIGTERM, a shutdown, the duration): the daemon exits.
    Stopped,
    /// A planned switchover (`tandem switchover`): the backup resumes the guest from `epoch`
    /// (`acked`: it confirmed that epoch); this node may now serve as its backup.
    SwitchedOver {
        /// The handover epoch.
        epoch: u64,
        /// Whether the backup acknowledged it.
        acked: bool,
    },
}

/// A guest that already runs on this node: the backup role resumed it (failover or
/// switchover) and this node protects it in turn.
pub(crate) struct Resumed {
    /// The resumed QEMU (started as the standby, with its dirty log armed).
    pub vm: Vm,
    /// The backup's relay, disk copy and captures.
    pub site: Site,
    /// The ownership this node's takeover won (with fencing).
    pub holder: Option<tandem_fence::Owner>,
    /// The epoch the guest resumed from.
    pub epoch: u64,
    /// The backup's directory (the capture of writable disks goes there).
    pub dir: PathBuf,
    /// The replication session this node took over.
    pub session: u64,
}

/// Starts a primary in its own thread: it boots the guest described by `cfg` and protects it
/// until its handle asks it to stop (then hands the guest over to the backup) or to shut down.
pub fn spawn(cfg: PrimaryConfig) -> crate::DaemonHandle<Result<(), PrimaryError>> {
    crate::DaemonHandle::spawn(format!("primary-vm{}", cfg.vm_id), "primary", move |st| {
        run(cfg, st)
    })
}

/// Boots the guest described by `cfg` and protects it until `status`'s [`crate::Stop`] asks
/// it to stop (the blocking form of [`spawn`]).
pub fn run(cfg: PrimaryConfig, status: Status) -> Result<(), PrimaryError> {
    let fe = Frontend::start(
        FrontendConfig {
            role: "primary",
            vm_id: cfg.vm_id,
            fence: cfg.fence.clone(),
            control: cfg.control.as_deref(),
            metrics_listen: cfg.metrics_listen.as_deref(),
            switchover: Some(false),
        },
        &status,
    )
    .map_err(|e| PrimaryError::Metrics(format!("endpoint {:?}", cfg.metrics_listen), e))?;
    run_in(&cfg, &fe, status).map(|_| ())
}

/// Boots the guest and protects it, reporting through `fe`.
pub(crate) fn run_in(
    cfg: &PrimaryConfig,
    fe: &Frontend,
    status: Status,
) -> Result<Ended, PrimaryError> {
    if cfg.backup.is_empty() {
        return Err(PrimaryError::NoBackup);
    }
    if let Some(t) = &cfg.tls {
        client_tls(t, &cfg.backup)?;
    }
    let mut vmc = cfg.vm.config("primary")?;
    let tmp;
    let dir = match &cfg.dir {
        Some(d) => {
            tandem_vm::private_dir(d).map_err(PrimaryError::PrivateDir)?;
            d.clone()
        }
        None => {
            let io = |e| PrimaryError::Dir(std::env::temp_dir(), e);
            tmp = tandem_vm::stale::owned_tempdir("tandem-primary-", None).map_err(io)?;
            tmp.path().to_path_buf()
        }
    };
    vmc.console = Some(dir.join("guest-console.log"));
    if vmc.writable_disk().is_some() {
        guest_disks(&dir, cfg.vm_id, &mut vmc, fe, &status)?;
    }
    let site = Site::prepare(&cfg.site, &dir, &dir, Role::Primary, &mut vmc)?;
    // The ownership record before the guest runs: no second copy may ever boot next to
    // another.
    let fencing = match &cfg.fence {
        Some(f) => Some(fence::Fencing::acquire(f.clone(), &site, status.clone())?),
        None => None,
    };
    vmc.fast_devstate = cfg.fast_devstate;
    let owner = fencing.as_ref().map(fence::Fencing::owner);
    let release = |e: PrimaryError| {
        if let Some(o) = &owner {
            fence::release_unused(o, &site, &status);
        }
        e
    };
    let mut fencing = fencing;
    let vm = match &cfg.adopt {
        Some(a) => {
            adopt::adopt(a, &vmc, &site, fencing.as_mut(), fe, &status).inspect_err(|_| {
                // The guest never ran in tandem's QEMU: etcd's record says stopped again, so
                // that a later adoption (or boot) may claim it.
                if let Some(o) = &owner {
                    fence::record_stopped(o, &status);
                }
            })?
        }
        None => {
            let (vm, ready) = boot(&vmc).map_err(|e| release(e.into()))?;
            status.event(crate::Event::GuestRunning {
                qemu_pid: vm.pid(),
                boot_ms: ready.as_millis() as u64,
            });
            status.info(format!(
                "guest ready in {:.1} s, QEMU pid {}, network {}, replicated disk {} MiB",
                ready.as_secs_f64(),
                vm.pid(),
                if !site.relays.is_empty() {
                    "relay (output held until acked)"
                } else {
                    "user (not held)"
                },
                site.disk.as_ref().map_or(0, |d| d.size() >> 20)
            ));
            vm
        }
    };
    crate::echo_guest_console(&vm, status.clone());
    let guest = Guest {
        vm,
        // An adopted guest's output passes until its first backup has a copy.
        passing: cfg.adopt.is_some() && fencing.is_none(),
        fencing,
        epoch: 0,
    };
    protect(cfg, fe, guest, &site, status.clone()).map_err(release)
}

/// Points `vmc`'s writable disks at this node's copy in `dir` when the guest last ran from it
/// (after a failover or handover here, [`crate::disk_copy`]); refuses the description's disks
/// when this node served as the backup since they were used.
fn guest_disks(
    dir: &Path,
    vm_id: u64,
    vmc: &mut tandem_vm::VmConfig,
    fe: &Frontend,
    status: &Status,
) -> Result<(), PrimaryError> {
    use crate::disk_copy;
    let (expected, _) = crate::site::capture_slices(vmc)?;
    match disk_copy::guest_disks(dir, vm_id, &expected)? {
        Some((path, slices)) => {
            crate::site::open_slices(vmc, &slices, &path);
            fe.registry
                .set_disks(&path, "guest", !crate::site::in_memory_fs(dir));
            status.info(format!(
                "booting from {}: the guest last ran here from this node's copy of its disks",
                path.display()
            ));
            Ok(())
        }
        None if disk_copy::read(dir)?.is_some() => {
            Err(PrimaryError::StaleDisks(dir.join(disk_copy::RECORD)))
        }
        None => Ok(()),
    }
}

/// Protects a guest the backup role resumed on this node: its disks are captured again, its
/// output (passing since the resume) is recorded in etcd as unprotected, and the next backup
/// that connects gets a full copy while the guest runs.
pub(crate) fn run_resumed(
    cfg: &PrimaryConfig,
    fe: &Frontend,
    r: Resumed,
    status: Status,
) -> Result<Ended, PrimaryError> {
    let Resumed {
        vm,
        mut site,
        holder,
        epoch,
        dir,
        session: _,
    } = r;
    fe.registry.switch_role("primary");
    site.become_primary(&dir)?;
    // The takeover recorded that the guest runs here without a replica.
    let fencing = holder.map(|h| fence::Fencing::resumed(h, &site, status.clone()));
    status.info(format!(
        "protecting the resumed guest (epoch {epoch}) in turn: connecting to the next backup at {}",
        cfg.backup
    ));
    let guest = Guest {
        vm,
        passing: fencing.is_none(),
        fencing,
        epoch,
    };
    protect(cfg, fe, guest, &site, status)
}

/// A running guest and what goes with it into [`protect`].
struct Guest {
    vm: Vm,
    fencing: Option<fence::Fencing>,
    /// The epoch numbers go on from here.
    epoch: u64,
    /// The relays pass output (a resumed guest without fencing): hold it again when a session
    /// begins.
    passing: bool,
}

/// Protects a running guest until told to stop.
fn protect(
    cfg: &PrimaryConfig,
    fe: &Frontend,
    g: Guest,
    site: &Site,
    status: Status,
) -> Result<Ended, PrimaryError> {
    let Guest {
        mut vm,
        mut fencing,
        epoch,
        passing,
    } = g;
    let mut recapture = false;
    if !site.mirrors.is_empty() {
        let t = Instant::now();
        // A full pass over every disk: progress for systemd's watchdog, not a hang.
        fe.beat
            .allow(site.capture_timeout() + Duration::from_secs(30));
        let mut progress = None;
        let captured = site.start_capture_with(&mut vm, &mut |done, total| {
            progress
                .get_or_insert_with(|| {
                    crate::progress::Progress::new(
                        "first disk mirror",
                        total,
                        &status,
                        &fe.registry,
                    )
                })
                .update(done)
        });
        drop(progress);
        match captured {
            Ok(()) => status.info(format!(
                "capturing {} writable disk(s) ({} MiB) through QEMU's block layer (blockdev-mirror, write-blocking): first pass done in {:.1} s",
                site.mirrors.len(),
                site.mirrors.iter().map(|m| m.size).sum::<u64>() >> 20,
                t.elapsed().as_secs_f64()
            )),
            // A guest resumed here is the only copy: it keeps running and the capture is
            // tried again before each connection to the next backup.
            Err(e) if passing || fencing.as_ref().is_some_and(|f| f.unprotected) => {
                status.warn(format!(
                    "capturing the writable disks failed ({}); retrying before the next backup gets a copy",
                    crate::chain(&e)
                ));
                recapture = true;
            }
            Err(e) => return Err(e.into()),
        }
        fe.beat.beat();
    }
    let epoch_ms = cfg.epoch.as_millis() as u64;
    let stall = cfg
        .stall
        .unwrap_or_else(|| Duration::from_millis((20 * epoch_ms).max(3000)));
    let watchdog = Watchdog::start(vm.pid(), stall, fe.beat.clone(), status.clone());
    let registry = fe.registry.clone();
    if let Some(f) = &mut fencing {
        f.attach_metrics(registry.clone());
    }
    fe.ready();
    let jsonl = match &cfg.metrics_jsonl {
        Some(p) => Some(BufWriter::new(std::fs::File::create(p).map_err(|e| {
            PrimaryError::Metrics(format!("file {}", p.display()), e)
        })?)),
        None => None,
    };
    let mut d = Daemon {
        site,
        proto: Primary::new(
            cfg.vm_id,
            cfg.codec,
            Config {
                threads: cfg.encoder_threads.max(1),
                ..Config::default()
            },
        ),
        registry,
        opts: cfg,
        status: status.clone(),
        watchdog: watchdog.clone(),
        epoch,
        jsonl: Arc::new(Mutex::new(jsonl)),
        raw: 0,
        sent: 0,
        deadline: cfg.duration.map(|t| Instant::now() + t),
        last_session_acked: false,
        fencing,
        fenced_by: None,
        passing,
        recapture,
        sessions: Default::default(),
        no_backup_since: Instant::now(),
        heartbeat_us: Arc::new(std::sync::atomic::AtomicU64::new(
            cfg.heartbeat.as_micros() as u64
        )),
    };
    let end = sessions(&mut d, &mut vm);
    // The main loop is done with this QEMU: whatever comes next (a handover, a shutdown, a
    // role change) is not a hang.
    watchdog.stop();
    let end = match end {
        Err(e) => {
            // A guest whose QEMU is gone releases nothing any more: the backup takes over as
            // soon as it sees the link close (the daemon exits). The kernel closes QEMU's
            // sockets before its parent can reap it: wait a little for it.
            if qemu_gone(&mut vm) {
                if let Some(f) = &d.fencing {
                    f.hand_over();
                }
            }
            return Err(if watchdog.fired() {
                PrimaryError::Watchdog(Box::new(e))
            } else {
                e
            });
        }
        Ok(end) => end,
    };
    let summary = format!(
        "{} epochs, {:.1} MiB raw, {:.2} MiB sent",
        d.epoch,
        d.raw as f64 / (1 << 20) as f64,
        d.sent as f64 / (1 << 20) as f64,
    );
    let fencing = d.fencing.take();
    let registry = d.registry.clone();
    drop(d);
    let ended = finish(end, site, vm, &summary, &status, fencing.as_ref())?;
    if let Ended::SwitchedOver { epoch, acked } = ended {
        registry.switched_over(epoch, acked);
    }
    Ok(ended)
}

/// Whether QEMU has exited, waiting up to half a second for a dying one to be reapable.
fn qemu_gone(vm: &mut Vm) -> bool {
    let until = Instant::now() + Duration::from_millis(500);
    loop {
        if vm.exit_status().is_some() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
