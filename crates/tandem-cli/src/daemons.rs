//! `tandem primary` and `tandem backup`: flags → the library's configs; the daemons live in
//! tandem-protect.

use std::path::PathBuf;
use std::time::Duration;
use tandem_vm::schedule::{AdaptiveConfig, BudgetClock};

use tandem_codec::Codec;
use tandem_protect::backup::BackupConfig;
use tandem_protect::primary::{ClientTls, PrimaryConfig};
use tandem_protect::{DaemonHandle, Event, Line, Status};

use crate::signals;

mod adopt;
pub use adopt::{adopt, AdoptArgs};

use tandem_args::{FenceArgs, SiteArgs, TlsArgs, VmArgs};

#[derive(clap::Args)]
pub struct PrimaryArgs {
    /// Backup address (host:port).
    #[arg(long, help_heading = "Replication")]
    pub backup: String,
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub site: SiteArgs,
    /// Directory for the data disk and sockets (default: a temporary directory).
    #[arg(long, help_heading = "Service and monitoring")]
    pub dir: Option<PathBuf>,
    /// Epoch length in milliseconds (with `--schedule adaptive`: the longest epoch).
    #[arg(long, default_value_t = 100, help_heading = "Checkpoint schedule")]
    pub epoch_ms: u64,
    /// When to checkpoint: `adaptive` (seed 002: as soon as network output waits and the
    /// previous checkpoint is acknowledged, within the guest-time budget; when the disk writes
    /// reach 32 MiB; else after --epoch-ms; docs/SCHEDULING.md) or `fixed` (every
    /// --epoch-ms, Remus).
    #[arg(long, default_value = "adaptive", help_heading = "Checkpoint schedule")]
    pub schedule: ScheduleArg,
    /// With `--schedule adaptive`: the largest share of the guest's time, in percent, that
    /// pauses and early suspends may take (a budget that a second of quiet refills, so bursts
    /// of requests get short epochs); 0: no budget, only --run-per-pause bounds it.
    #[arg(long, default_value_t = 20.0, help_heading = "Checkpoint schedule")]
    pub time_budget_pct: f64,
    /// With `--schedule adaptive`: what a pause costs the budget — `vcpu`: its length × the
    /// share of the run before it that the guest's busiest vCPU was busy (pausing an idle
    /// guest costs it little); `wall`: its whole length.
    #[arg(long, default_value = "vcpu", help_heading = "Checkpoint schedule")]
    pub time_budget_clock: BudgetClockArg,
    /// With `--schedule adaptive`: once output could cut the epoch, wait at most this many
    /// milliseconds while the guest's busiest vCPU is still busy (it is still answering what
    /// it received: one pause then serves more replies); 0: cut at once.
    #[arg(long, default_value_t = 3, help_heading = "Checkpoint schedule")]
    pub busy_hold_ms: u64,
    /// With `--schedule adaptive`: checkpoints in flight at most when output triggers the
    /// next (seed 002: 1, the next waits for the previous one's acknowledgement).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=8), help_heading = "Checkpoint schedule")]
    pub max_unacked: u64,
    /// With `--schedule adaptive`: the shortest run between two pauses, in ms (the guest also
    /// runs at least as long as the last pause took).
    #[arg(long, default_value_t = 2, help_heading = "Checkpoint schedule")]
    pub min_run_ms: u64,
    /// With `--schedule adaptive`: while output keeps coming, the guest runs at least this
    /// many times as long as the last pause (1.0: half of the time is the guest's).
    #[arg(long, default_value_t = 1.0, help_heading = "Checkpoint schedule")]
    pub run_per_pause: f64,
    /// With `--schedule adaptive`: dirty-page-set convergence (seed 002) — end the epoch once
    /// the dirty count grew by less than this percentage over 10 ms (the paper: 5); 0: off.
    #[arg(long, default_value_t = 0.0, help_heading = "Checkpoint schedule")]
    pub converge_pct: f64,
    /// With `--schedule adaptive`: seed 002's stop threshold as time — while output waits for
    /// an acknowledgement, suspend the guest once its dirty set is as large as the link ships
    /// (encode to acknowledgement, measured) in this many ms; 0: off.
    #[arg(long, default_value_t = 20, help_heading = "Checkpoint schedule")]
    pub stop_budget_ms: u64,
    /// How device state is captured after the first checkpoint: `xen-save` (QMP
    /// `xen-save-devices-state`, framed as a migration stream; falls back to `migrate` by
    /// itself if QEMU refuses it) or `migrate` (always a full migration to a pipe).
    #[arg(long, default_value = "xen-save", value_parser = ["xen-save", "migrate"], help_heading = "Replication")]
    pub devstate: String,
    /// For benchmarks: end protection and shut the guest down after this many seconds
    /// (default: run until stopped).
    #[arg(long, help_heading = "Service and monitoring")]
    pub duration: Option<u64>,
    /// Memory codec.
    #[arg(long, default_value = "tandem", help_heading = "Replication")]
    pub codec: Codec,
    /// zstd level of the memory records: `auto` (chosen per epoch, -5 to 3, lower when the
    /// encoder is slower than the link and higher when the link is the bottleneck; each
    /// epoch's level is in the metrics lines) or a fixed level.
    #[arg(long, default_value = "auto", value_parser = parse_level, help_heading = "Replication")]
    pub zstd_level: Level,
    /// Threads of the memory encoder. More pay on large epochs when the host has cores to
    /// spare beside QEMU: the per-page work splits from 1 024 dirty pages on.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64), help_heading = "Replication")]
    pub encoder_threads: u16,
    /// Pre-copy rounds of a session's initial sync: after the full copy, what the guest wrote
    /// meanwhile is sent again while it runs, until few pages remain; rounds that stop
    /// shrinking throttle the guest (as live migration's auto-converge). Past this many, the
    /// rounds end once at most 256 MiB remain; 0: the first checkpoint carries it all.
    #[arg(long, default_value_t = 20, help_heading = "Replication")]
    pub precopy_rounds: u32,
    /// Pre-copy ends once a round found at most this many MiB written (the first
    /// checkpoint's pause copies them).
    #[arg(long, default_value_t = 32, help_heading = "Replication")]
    pub precopy_target_mib: u64,
    /// An epoch with more dirty memory or disk writes than this many MiB is sent in parts of
    /// this size, which the backup applies one by one and commits together (an epoch of any
    /// size fits; the backup keeps the pages a part overwrote until the epoch commits).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=512), help_heading = "Replication")]
    pub epoch_part_mib: u64,
    /// Parts of this many pages and 4 KiB of disk writes per page instead (tests: every
    /// epoch of a small guest in parts).
    #[arg(long, hide = true, value_parser = clap::value_parser!(u64).range(1..))]
    pub epoch_part_pages: Option<u64>,
    /// Identifier of the protected VM (the backup refuses frames of any other).
    #[arg(long, default_value_t = 1, help_heading = "Replication")]
    pub vm_id: u64,
    /// Send a heartbeat when nothing else was sent for this long.
    #[arg(long, default_value_t = 100, help_heading = "Replication")]
    pub heartbeat_ms: u64,
    /// The backup is lost when an epoch stays unacknowledged this long (also the socket's
    /// TCP_USER_TIMEOUT); output stays held and the primary reconnects.
    #[arg(long, default_value_t = 2000, help_heading = "Replication")]
    pub ack_timeout_ms: u64,
    /// Kill QEMU when the main loop makes no progress for this long (a hung QEMU), so that
    /// the backup takes over. Default: the larger of 3 s and 20 epochs.
    #[arg(long, help_heading = "Replication")]
    pub stall_ms: Option<u64>,
    /// Append one JSON line per acknowledged epoch to this file.
    #[arg(long, help_heading = "Service and monitoring")]
    pub metrics_jsonl: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (GET /metrics).
    #[arg(long, help_heading = "Service and monitoring")]
    pub metrics_listen: Option<String>,
    #[command(flatten)]
    pub fence: FenceArgs,
    /// The control socket `tandem status` asks (default: /run/tandem/primary-vmID-PID.sock).
    #[arg(long, help_heading = "Service and monitoring")]
    pub control: Option<PathBuf>,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// The name the backup's certificate must carry (default: the host of --backup).
    #[arg(long, help_heading = "Replication")]
    pub tls_server_name: Option<String>,
    /// Print every event (status lines, role and protection changes, epochs, failover) as
    /// one JSON object per line on stdout, instead of the status lines.
    #[arg(long, help_heading = "Service and monitoring")]
    pub json_events: bool,
    #[command(flatten)]
    pub faults: tandem_args::FaultArgs,
    /// This node's own replication address (host:port): after a planned switchover
    /// (`tandem switchover`) it serves as the backup of the guest there, and while it runs
    /// the guest it turns away old copies that connect. Without it a switchover is refused.
    #[arg(
        long,
        help_heading = "Switchover (this node serves as the backup afterwards)"
    )]
    pub listen: Option<String>,
    /// With --listen: the backup role's directory for the RAM mirror (a tmpfs). Its copy of
    /// the guest's disks goes to --dir.
    #[arg(
        long,
        requires = "listen",
        help_heading = "Switchover (this node serves as the backup afterwards)"
    )]
    pub backup_dir: Option<PathBuf>,
    /// With --listen: the backup role fails over when the primary has been silent this long.
    #[arg(
        long,
        default_value_t = 500,
        help_heading = "Switchover (this node serves as the backup afterwards)"
    )]
    pub timeout_ms: u64,
}

#[derive(clap::Args)]
pub struct BackupArgs {
    /// Address to listen on (host:port).
    #[arg(long, help_heading = "Replication")]
    pub listen: String,
    /// Directory for the RAM mirror and sockets (use a tmpfs such as /dev/shm).
    #[arg(long, help_heading = "Service and monitoring")]
    pub dir: PathBuf,
    /// Directory on real storage for the copy of the VM's writable disks: after a failover
    /// the guest runs from it, and a primary started on it boots from it (default: --dir,
    /// gone with the host if that is a tmpfs).
    #[arg(long, help_heading = "Service and monitoring")]
    pub disk_dir: Option<PathBuf>,
    /// The libvirt domain the VM was adopted from (`tandem adopt --libvirt`): with --etcd,
    /// this host's libvirt is given its marked definition (the hook refuses to start it), its
    /// disks on this node's copy (docs/VM_DESCRIPTION.md, "libvirt").
    #[arg(long, value_name = "DOMAIN", help_heading = "Service and monitoring")]
    pub libvirt: Option<String>,
    /// libvirt's connection URI for --libvirt (virsh -c; default: virsh's own).
    #[arg(
        long,
        value_name = "URI",
        requires = "libvirt",
        help_heading = "Service and monitoring"
    )]
    pub connect: Option<String>,
    /// The VM as the primary runs it (the standby uses the same command line).
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub site: SiteArgs,
    /// Fail over when the primary has been silent this long (down to 100 ms: the primary's
    /// heartbeat shortens itself to a quarter of it).
    #[arg(long, default_value_t = 500, help_heading = "Replication")]
    pub timeout_ms: u64,
    /// Fail over when the primary's epochs have not advanced for this long although it still
    /// sends heartbeats (a primary stuck in QEMU); also how long a primary whose frame was
    /// refused has to reconnect. Default: 3 × --timeout-ms.
    #[arg(long, help_heading = "Replication")]
    pub stall_ms: Option<u64>,
    /// Write a JSON report of the failover here.
    #[arg(long, help_heading = "Service and monitoring")]
    pub report: Option<PathBuf>,
    #[command(flatten)]
    pub consolidation: ConsolidateArgs,
    /// The protected VM's identifier (its ownership record in etcd, with --etcd).
    #[arg(long, default_value_t = 1, help_heading = "Replication")]
    pub vm_id: u64,
    #[command(flatten)]
    pub fence: FenceArgs,
    /// Serve Prometheus metrics on this address (GET /metrics).
    #[arg(long, help_heading = "Service and monitoring")]
    pub metrics_listen: Option<String>,
    /// The control socket `tandem status` asks (default: /run/tandem/backup-vmID-PID.sock).
    #[arg(long, help_heading = "Service and monitoring")]
    pub control: Option<PathBuf>,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Protect the guest after this backup resumed it (failover or switchover): replicate it
    /// to a backup at this address (host:port; typically the old primary's host, restarted
    /// as `tandem backup`, or one that took part in a switchover). Without it the resumed
    /// guest runs unprotected until stopped.
    #[arg(
        long,
        help_heading = "Re-protection (after this node resumed the guest)"
    )]
    pub peer: Option<String>,
    /// With --peer: epoch length in milliseconds once this node protects the guest.
    #[arg(
        long,
        default_value_t = 100,
        help_heading = "Re-protection (after this node resumed the guest)"
    )]
    pub epoch_ms: u64,
    /// With --peer: the next backup is lost when an epoch stays unacknowledged this long.
    #[arg(
        long,
        default_value_t = 2000,
        help_heading = "Re-protection (after this node resumed the guest)"
    )]
    pub ack_timeout_ms: u64,
    /// With --peer: the name the next backup's certificate must carry (default: its host).
    #[arg(
        long,
        requires = "peer",
        help_heading = "Re-protection (after this node resumed the guest)"
    )]
    pub tls_server_name: Option<String>,
    /// Print every event (status lines, epochs committed, failover) as one JSON object per
    /// line on stdout, instead of the status lines.
    #[arg(long, help_heading = "Service and monitoring")]
    pub json_events: bool,
}

#[derive(clap::Args)]
pub struct KeysArgs {
    /// Where to write ca.pem, primary.pem/.key and backup.pem/.key.
    #[arg(long)]
    pub dir: PathBuf,
    /// Names and addresses the certificates are valid for (repeat; default: localhost,
    /// 127.0.0.1 and the lab's replication addresses 10.78.0.1 and 10.78.0.2).
    #[arg(long)]
    pub san: Vec<String>,
    /// The VMs the certificates may serve (repeat; default: every VM). A daemon refuses a
    /// peer whose certificate does not name its VM (vm-ID.tandem.invalid).
    #[arg(long = "vm")]
    pub vms: Vec<u64>,
}

/// `tandem keys`: a lab CA and a certificate for each side.
pub fn keys(a: KeysArgs) -> anyhow::Result<()> {
    let sans = if a.san.is_empty() {
        ["localhost", "127.0.0.1", "10.78.0.1", "10.78.0.2"]
            .map(String::from)
            .to_vec()
    } else {
        a.san
    };
    let vms = (!a.vms.is_empty()).then_some(a.vms.as_slice());
    let files = tandem_protect::tls::generate(&a.dir, &sans, vms)?;
    for f in files {
        println!("{}", f.display());
    }
    let for_vms = match vms {
        None => "every VM".to_string(),
        Some(v) => format!(
            "VM {}",
            v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
        ),
    };
    eprintln!(
        "keys: a lab CA and certificates for primary and backup, valid for {} and {for_vms}; the CA's key was not kept (use your PKI in production)",
        sans.join(", ")
    );
    Ok(())
}

#[derive(clap::Args)]
pub struct StatusArgs {
    /// Ask this control socket only (default: every daemon in /run/tandem, or
    /// $TANDEM_RUN_DIR).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// One JSON document: an array of the daemons' status.
    #[arg(long)]
    pub json: bool,
}

pub fn status(a: StatusArgs) -> anyhow::Result<()> {
    use tandem_protect::control;
    let all = match &a.socket {
        Some(p) => vec![(p.clone(), control::ask(p)?)],
        None => control::ask_all(&control::run_dir())?,
    };
    if a.json {
        let docs: Vec<_> = all.into_iter().map(|(_, v)| v).collect();
        println!("{}", serde_json::to_string_pretty(&docs)?);
    } else if all.is_empty() {
        println!(
            "no tandem daemon runs on this host (no control socket in {})",
            control::run_dir().display()
        );
    } else {
        for (_, v) in &all {
            println!("{}", control::describe(v));
        }
    }
    Ok(())
}

/// Runs a daemon to its end: the process's stop signals go to it, its events to the terminal
/// (status lines: progress on stdout, warnings on stderr; with `json`, every event as a JSON
/// line on stdout).
pub fn follow<T>(h: DaemonHandle<T>, json: bool) -> T {
    signals::forward_to(h.stopper());
    // SIGPIPE is ignored in daemons: a closed stdout must not end (or panic) them.
    let print = |e: Event| {
        use std::io::Write as _;
        let _ = match e {
            e if json => writeln!(std::io::stdout(), "{}", e.to_json()),
            Event::Info { text } => writeln!(std::io::stdout(), "{text}"),
            Event::Warn { text } => writeln!(std::io::stderr(), "{text}"),
            _ => Ok(()),
        };
    };
    loop {
        match h.events().recv_timeout(Duration::from_millis(100)) {
            Ok(e) => print(e),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !h.is_finished() => {}
            Err(_) => break,
        }
    }
    while let Ok(e) = h.events().try_recv() {
        print(e);
    }
    h.join()
}

/// Status lines all on stderr (for commands whose stdout is their result, e.g. `--json`).
pub fn stderr(who: &'static str) -> Status {
    Status::new(who, |l| match l {
        Line::Info(s) | Line::Warn(s) => eprintln!("{s}"),
    })
}

/// `--time-budget-clock`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetClockArg {
    /// The guest's vCPU time.
    Vcpu,
    /// Wall time.
    Wall,
}

/// `--schedule`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleArg {
    /// Every --epoch-ms.
    Fixed,
    /// Seed 002's adaptive schedule.
    Adaptive,
}

pub fn primary(a: PrimaryArgs) -> anyhow::Result<()> {
    primary_with(a, None)
}

pub(crate) fn primary_with(
    a: PrimaryArgs,
    adopt: Option<tandem_protect::primary::AdoptConfig>,
) -> anyhow::Result<()> {
    let ms = Duration::from_millis;
    let mut cfg = PrimaryConfig::new(a.backup.clone(), a.vm.spec());
    cfg.adopt = adopt;
    cfg.site = a.site.config();
    cfg.dir = a.dir;
    cfg.epoch = ms(a.epoch_ms.max(1));
    cfg.adaptive = (a.schedule == ScheduleArg::Adaptive).then(|| {
        let mut s = AdaptiveConfig::default();
        s.max_wait = ms(a.epoch_ms.max(1));
        s.min_run = ms(a.min_run_ms);
        s.run_per_pause = a.run_per_pause.max(0.0);
        s.converge = (a.converge_pct > 0.0).then_some(a.converge_pct / 100.0);
        s.stop_budget = (a.stop_budget_ms > 0).then(|| ms(a.stop_budget_ms));
        s.max_unacked = a.max_unacked;
        s.time_budget = (a.time_budget_pct > 0.0).then(|| (a.time_budget_pct / 100.0).min(1.0));
        s.busy_hold = (a.busy_hold_ms > 0).then(|| ms(a.busy_hold_ms));
        s.budget_clock = match a.time_budget_clock {
            BudgetClockArg::Vcpu => BudgetClock::Vcpu,
            BudgetClockArg::Wall => BudgetClock::Wall,
        };
        s
    });
    cfg.fast_devstate = a.devstate == "xen-save";
    cfg.duration = a.duration.map(Duration::from_secs);
    cfg.codec = a.codec;
    cfg.zstd_level = a.zstd_level.0;
    cfg.encoder_threads = a.encoder_threads.into();
    cfg.precopy = tandem_protect::primary::Precopy {
        max_rounds: a.precopy_rounds,
        target_pages: a.precopy_target_mib << 8,
    };
    let part_pages = a.epoch_part_pages.unwrap_or(a.epoch_part_mib << 8);
    cfg.parts = tandem_protect::primary::Parts {
        max_pages: part_pages as usize,
        max_disk_bytes: (part_pages << 12) as usize,
    };
    cfg.vm_id = a.vm_id;
    cfg.heartbeat = ms(a.heartbeat_ms.max(1));
    cfg.ack_timeout = ms(a.ack_timeout_ms.max(100));
    cfg.stall = a.stall_ms.map(ms);
    cfg.metrics_jsonl = a.metrics_jsonl;
    cfg.metrics_listen = a.metrics_listen;
    cfg.fence = a.fence.config(a.vm_id, "primary");
    cfg.control = a.control;
    cfg.tls = a.tls.files("primary")?.map(|files| ClientTls {
        files,
        server_name: a.tls_server_name.clone(),
    });
    a.faults.apply(&mut cfg);
    let Some(listen) = a.listen else {
        return Ok(follow(tandem_protect::primary::spawn(cfg), a.json_events)?);
    };
    let dir = a
        .backup_dir
        .unwrap_or_else(|| PathBuf::from(format!("/dev/shm/tandem-vm{}", a.vm_id)));
    let mut backup = BackupConfig::new(listen, dir, a.vm.spec());
    backup.disk_dir = cfg.dir.clone();
    backup.site = a.site.config();
    backup.timeout = ms(a.timeout_ms.max(1));
    backup.fence = cfg.fence.clone();
    backup.vm_id = a.vm_id;
    backup.tls = a.tls.files("primary")?;
    let node = tandem_protect::node::NodeConfig::new(cfg, backup);
    Ok(follow(
        tandem_protect::node::spawn(tandem_protect::node::Start::Primary, node),
        a.json_events,
    )?)
}

/// `--restore`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreArg {
    /// Resume at once; pages on demand.
    Lazy,
    /// Restore every page, then resume.
    Materialise,
}

/// `--consolidate`, `--clock-s`, `--restore`: of `tandem backup`, and of `tandem backup-host`
/// for all its replicas.
#[derive(clap::Args)]
pub struct ConsolidateArgs {
    /// Keep the mirror's cold pages consolidated (shared, patched against similar pages,
    /// compressed; seed 001, docs/CONSOLIDATION.md), in one pool for all replicas of the
    /// process.
    #[arg(long)]
    pub consolidate: bool,
    /// With --consolidate: seconds for the NRU clock to go once round each mirror.
    #[arg(long, default_value_t = 4.0)]
    pub clock_s: f64,
    /// With --consolidate: how a failover gets the consolidated pages into the standby:
    /// `lazy` resumes the guest at once and serves the pages it touches first (userfaultfd),
    /// `materialise` restores them all before resuming.
    #[arg(long, value_enum, default_value = "lazy")]
    pub restore: RestoreArg,
}

impl ConsolidateArgs {
    /// Whether any of the flags was given a value other than its default.
    pub fn given(&self) -> bool {
        self.consolidate || self.clock_s != 4.0 || self.restore != RestoreArg::Lazy
    }

    /// A pool for this process's replicas (`None` without --consolidate).
    pub fn config(&self) -> anyhow::Result<Option<tandem_protect::backup::Consolidate>> {
        if !self.consolidate {
            return Ok(None);
        }
        let clock_s = self.clock_s;
        if !(clock_s.is_finite() && clock_s > 0.0) {
            anyhow::bail!("--clock-s must be a positive number of seconds, not {clock_s}");
        }
        let mut c = tandem_protect::backup::Consolidate::default();
        c.revolution = Duration::from_secs_f64(clock_s);
        c.lazy = self.restore == RestoreArg::Lazy;
        Ok(Some(c))
    }
}

/// The backup daemon's configuration from its flags, consolidating into `consolidate`'s pool.
pub fn backup_config(
    a: &BackupArgs,
    consolidate: Option<tandem_protect::backup::Consolidate>,
) -> anyhow::Result<BackupConfig> {
    let ms = Duration::from_millis;
    let mut b = BackupConfig::new(a.listen.clone(), a.dir.clone(), a.vm.spec());
    b.disk_dir = a.disk_dir.clone();
    b.site = a.site.config();
    b.timeout = ms(a.timeout_ms.max(1));
    b.stall = a.stall_ms.map(ms);
    b.report = a.report.clone();
    b.fence = a.fence.config(a.vm_id, "backup");
    b.vm_id = a.vm_id;
    b.metrics_listen = a.metrics_listen.clone();
    b.control = a.control.clone();
    b.tls = a.tls.files("backup")?;
    b.consolidate = consolidate;
    b.libvirt = a.libvirt.clone().map(|domain| tandem_vm::adopt::Libvirt {
        domain,
        uri: a.connect.clone(),
    });
    Ok(b)
}

pub fn backup(a: BackupArgs) -> anyhow::Result<()> {
    let ms = Duration::from_millis;
    let cfg = backup_config(&a, a.consolidation.config()?)?;
    let Some(peer) = a.peer else {
        return Ok(follow(tandem_protect::backup::spawn(cfg), a.json_events)?);
    };
    let mut primary = PrimaryConfig::new(peer.clone(), a.vm.spec());
    primary.site = a.site.config();
    primary.epoch = ms(a.epoch_ms.max(1));
    primary.ack_timeout = ms(a.ack_timeout_ms.max(100));
    primary.vm_id = a.vm_id;
    primary.fence = cfg.fence.clone();
    primary.control = cfg.control.clone();
    primary.metrics_listen = cfg.metrics_listen.clone();
    primary.tls = a.tls.files("backup")?.map(|files| ClientTls {
        files,
        server_name: a.tls_server_name.clone(),
    });
    let node = tandem_protect::node::NodeConfig::new(primary, cfg);
    Ok(follow(
        tandem_protect::node::spawn(tandem_protect::node::Start::Backup, node),
        a.json_events,
    )?)
}

/// `--zstd-level`: `auto` or a fixed level.
#[derive(Debug, Clone, Copy)]
pub struct Level(Option<i32>);

fn parse_level(s: &str) -> Result<Level, String> {
    if s == "auto" {
        return Ok(Level(None));
    }
    match s.parse::<i32>() {
        Ok(l) if (-7..=19).contains(&l) => Ok(Level(Some(l))),
        _ => Err(format!("{s:?}: choose auto or a zstd level from -7 to 19")),
    }
}
