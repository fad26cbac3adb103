//! `tandem primary`: boots the guest and protects it until told to stop. Each session sends
//! a hello and an initial copy, then checkpoints every epoch and ships it on a sender thread
//! while the guest runs the next one; guest output is released epoch by epoch as the backup
//! acknowledges. A lost link keeps the output held and reconnects with a full re-sync; only
//! an explicit operator request ends replication without a failover.
//!
//! Stopping: SIGTERM or SIGINT hands the guest over (a last checkpoint with the guest left
//! stopped, then the backup resumes it); SIGUSR1 ends protection and shuts the guest down
//! (`bye`: the backup does not fail over); `--duration` (benchmarks) does the same as SIGUSR1
//! when it expires.

mod link;
mod session;
mod watchdog;

use std::io::BufWriter;
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tandem_codec::{Codec, Config};
use tandem_replication::Primary;

use super::site::{Role, Site, SiteArgs};
use super::{install_stop_handler, stopping};
use crate::metrics::Registry;
use crate::vmargs::{boot, VmArgs};
use session::{Daemon, End};
use watchdog::Watchdog;

#[derive(clap::Args)]
pub struct PrimaryArgs {
    /// Backup address (host:port).
    #[arg(long)]
    pub backup: String,
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub site: SiteArgs,
    /// Directory for the data disk and sockets (default: a temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Epoch length in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub epoch_ms: u64,
    /// For benchmarks: end protection and shut the guest down after this many seconds
    /// (default: run until stopped).
    #[arg(long)]
    pub duration: Option<u64>,
    /// Memory codec.
    #[arg(long, default_value = "tandem")]
    pub codec: Codec,
    /// Identifier of the protected VM (the backup refuses frames of any other).
    #[arg(long, default_value_t = 1)]
    pub vm_id: u64,
    /// Send a heartbeat when nothing else was sent for this long.
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
    /// The backup is lost when an epoch stays unacknowledged this long (also the socket's
    /// TCP_USER_TIMEOUT); output stays held and the primary reconnects.
    #[arg(long, default_value_t = 2000)]
    pub ack_timeout_ms: u64,
    /// Kill QEMU when the main loop makes no progress for this long (a hung QEMU), so that
    /// the backup takes over. Default: the larger of 3 s and 20 epochs.
    #[arg(long)]
    pub stall_ms: Option<u64>,
    /// Append one JSON line per acknowledged epoch to this file.
    #[arg(long)]
    pub metrics_jsonl: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (GET /metrics).
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Fault injection for tests: send half of this epoch's frame, then stall until killed.
    #[arg(long, hide = true)]
    pub fault_stall_epoch: Option<u64>,
    /// Fault injection for tests: SIGUSR2 kills QEMU inside the next checkpoint pause.
    #[arg(long, hide = true)]
    pub fault_hooks: bool,
}

/// Daemon settings used by the sessions.
pub struct Opts {
    pub epoch: Duration,
    pub heartbeat: Duration,
    pub ack_timeout: Duration,
    pub stall_epoch: Option<u64>,
}

pub fn primary(a: PrimaryArgs) -> anyhow::Result<()> {
    install_stop_handler();
    if a.fault_hooks {
        super::install_fault_hooks();
    }
    let mut cfg = a.vm.config("primary")?;
    let tmp;
    let dir = match &a.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new()
                .prefix("tandem-primary-")
                .tempdir()?;
            tandem_vm::stale::mark_owned(tmp.path())?;
            tmp.path().to_path_buf()
        }
    };
    let site = Site::prepare(&a.site, &dir, Role::Primary, &mut cfg)?;
    let (mut vm, ready, load) = boot(&cfg)?;
    println!(
        "primary: guest ready in {:.1} s, QEMU pid {}, network {}, data disk {} MiB",
        ready.as_secs_f64(),
        vm.pid(),
        if site.relay.is_some() {
            "relay (output held until acked)"
        } else {
            "user (not held)"
        },
        a.site.disk_mib
    );
    super::echo_guest_progress(vm.serial_path(), "primary");
    let epoch = Duration::from_millis(a.epoch_ms.max(1));
    let stall = Duration::from_millis(a.stall_ms.unwrap_or_else(|| (20 * a.epoch_ms).max(3000)));
    let watchdog = Watchdog::start(vm.pid(), stall);
    let registry = Registry::default();
    if let Some(addr) = &a.metrics_listen {
        let bound = crate::metrics::serve(addr, registry.clone())
            .with_context(|| format!("metrics endpoint {addr}"))?;
        println!("primary: metrics on http://{bound}/metrics");
    }
    let jsonl = match &a.metrics_jsonl {
        Some(p) => Some(BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let opts = Opts {
        epoch,
        heartbeat: Duration::from_millis(a.heartbeat_ms.max(1)),
        ack_timeout: Duration::from_millis(a.ack_timeout_ms.max(100)),
        stall_epoch: a.fault_stall_epoch,
    };
    let mut d = Daemon {
        site: &site,
        proto: Primary::new(a.vm_id, a.codec, Config::default()),
        registry: registry.clone(),
        opts: &opts,
        watchdog: watchdog.clone(),
        epoch: 0,
        jsonl: Arc::new(Mutex::new(jsonl)),
        raw: 0,
        sent: 0,
        deadline: a.duration.map(|s| Instant::now() + Duration::from_secs(s)),
        last_session_acked: false,
    };
    // Sessions that end before any acknowledgement back off (0.2 s doubling to 5 s), so a
    // backup that refuses this VM (wrong size, another VM id) is not flooded with copies.
    let mut backoff = Duration::ZERO;
    let mut sessions = 0u64;
    let end = loop {
        let Some(stream) = wait_for_backup(&a.backup, &mut d, &mut vm)? else {
            break None;
        };
        if sessions > 0 {
            registry.inc_reconnects();
            registry.inc_resyncs();
        }
        sessions += 1;
        match d.session(&mut vm, stream) {
            Ok(End::Lost(why)) => {
                let held = site.relay.as_ref().map(|r| r.stats()).unwrap_or_default();
                eprintln!(
                    "primary: link to the backup lost after epoch {} ({why}); the guest runs on with its output HELD ({} frames); reconnecting for a full re-sync",
                    d.epoch, held.held_frames
                );
                if d.deadline.is_some_and(|t| Instant::now() >= t) {
                    break None;
                }
                backoff = if d.last_session_acked {
                    Duration::ZERO
                } else {
                    (backoff * 2).clamp(Duration::from_millis(200), Duration::from_secs(5))
                };
                let until = Instant::now() + backoff;
                while Instant::now() < until && !stopping() {
                    d.watchdog.beat();
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            Ok(end) => break Some(end),
            Err(e) if watchdog.fired() => {
                return Err(e.context("the watchdog killed the hung QEMU"))
            }
            Err(e) => return Err(e),
        }
    };
    let epochs = d.epoch;
    let (raw, sent) = (d.raw, d.sent);
    drop(d);
    let summary = |what: &str| {
        println!(
            "primary: {what}; {epochs} epochs, {:.1} MiB raw, {:.2} MiB sent",
            raw as f64 / (1 << 20) as f64,
            sent as f64 / (1 << 20) as f64,
        )
    };
    match end {
        Some(End::Fenced(n)) => {
            if let Some(r) = &site.relay {
                r.discard_held();
            }
            vm.kill();
            bail!("the backup resumed the guest (from epoch {n}): this copy was stopped and its held output discarded");
        }
        Some(End::HandedOver { epoch, acked }) => {
            vm.kill();
            if acked {
                summary(&format!(
                    "handed the guest over to the backup at epoch {epoch}"
                ));
            } else {
                summary(&format!("handover at epoch {epoch} was not acknowledged: the backup resumes from the last epoch it committed; this copy is stopped"));
            }
        }
        Some(End::Shutdown) | Some(End::Lost(_)) | None => {
            if let Some(l) = load {
                l.stop()?;
            }
            summary(
                if end.is_none() && stopping() && !super::shutdown_requested() {
                    "stopped while no backup was connected: nothing to hand the guest over to; guest shut down"
                } else if stopping() {
                    "replication ended on request; guest shut down"
                } else {
                    "replication ended (duration reached); guest shut down"
                },
            );
            vm.quit();
        }
    }
    Ok(())
}

/// Connects to the backup, retrying until it answers. Meanwhile the guest runs with its
/// output held; the disk write log is dropped (the next session copies the whole disk).
/// Returns `None` when the daemon is asked to stop first.
fn wait_for_backup(
    addr: &str,
    d: &mut Daemon<'_>,
    vm: &mut tandem_vm::Vm,
) -> anyhow::Result<Option<TcpStream>> {
    let mut said = None::<Instant>;
    loop {
        d.watchdog.beat();
        if stopping() || d.deadline.is_some_and(|t| Instant::now() >= t) {
            return Ok(None);
        }
        if let Some(st) = vm.exit_status() {
            bail!("QEMU exited ({st}) while the primary waited for the backup");
        }
        if let Some(disk) = &d.site.disk {
            disk.reset_log();
        }
        match link::connect_once(addr, Duration::from_secs(1)) {
            Ok(s) => {
                println!("primary: connected to the backup at {addr}");
                return Ok(Some(s));
            }
            Err(e) => {
                if said.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    eprintln!("primary: waiting for the backup ({e:#})");
                    said = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}
