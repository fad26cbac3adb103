//! One demo round: backup and primary in their namespaces, a real client on the clients'
//! bridge, a host failure of the primary, failover, and the checks.

use std::io::{Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::bail;
use indicatif::ProgressBar;
use serde::Serialize;
use tandem_net::lab::{BACKUP_IP, GUEST_IP};
use tandem_net::NetLab;

use super::capture::Capture;
use super::client::{self, Writers};
use super::daemon::{rate, Daemon};
use super::fault::{self, Fault, Proxy};
use super::steps::{
    await_report, common, fill, inject_faults, leftovers, mount_small_tmpfs, Pair, Target,
};
use tandem_protect::stats::quantile;

pub struct Opts<'a> {
    pub exe: PathBuf,
    /// Guest workload: `kv` gets the verifying client; others report their own progress.
    pub workload: String,
    pub lab: &'a NetLab,
    pub dir: PathBuf,
    pub mem: u64,
    pub epoch_ms: u64,
    pub timeout_ms: u64,
    pub codec: String,
    pub conns: usize,
    pub batch: usize,
    /// Client time before the kill.
    pub before: Duration,
    /// Client time after failover.
    pub after: Duration,
    /// Stall the primary in the middle of this epoch's transfer, then kill it.
    pub stall_epoch: Option<u64>,
    /// Faults injected one after the other; a round whose faults leave the primary running
    /// ends with a host kill, so that every round ends with a failover to check.
    pub faults: Vec<Fault>,
    /// Put the backup's directory on a tmpfs that is full (all but the preallocated mirror
    /// and disk copy) while the guest writes to its disk.
    pub backup_tmpfs: bool,
}

#[derive(Serialize, Clone, Debug)]
pub struct RoundResult {
    pub round: usize,
    pub workload: String,
    pub epoch_ms: u64,
    pub kill_point: String,
    pub epochs_acked: u64,
    pub raw_mib: f64,
    pub sent_mib: f64,
    pub sent_over_raw: f64,
    pub pause_ms_p50: f64,
    pub pause_ms_p99: f64,
    /// Guest throughput unit: client `ops` (kv), sqlite `txns`, compiled `objs`; none for idle.
    pub unit: String,
    /// Throughput per second while replicated, and on the backup after failover (unprotected,
    /// the native baseline of the same run).
    pub rate_replicated: Option<f64>,
    pub rate_after_failover: Option<f64>,
    pub client_latency_ms_p50: f64,
    pub client_latency_ms_p99: f64,
    pub failover_epoch: u64,
    pub failover_reason: String,
    pub detection_ms: f64,
    pub resume_after_detection_ms: f64,
    pub kill_to_running_ms: f64,
    pub client_gap_ms: f64,
    pub acked_keys_checked: u64,
    pub acked_keys_lost: u64,
    pub first_lost_key: Option<String>,
    pub client_reconnects: u64,
    /// The guest continued without rebooting (kv: same redis run_id and growing uptime;
    /// sqlite/compile: the progress counter resumed near its last value); unknown for idle.
    pub guest_continued: Option<bool>,
    pub redis_run_id: String,
    pub redis_uptime_before_s: u64,
    pub redis_uptime_after_s: u64,
    /// Faults injected in this round, in order, with what each led to.
    pub faults: Vec<String>,
    /// Re-syncs the primary made (a new session after a lost link).
    pub resyncs: u64,
    /// Guest frames the primary's relay let out (captured on the clients' bridge).
    pub primary_frames_captured: u64,
    /// Of those, frames that arrived after the backup ran the guest (must be 0).
    pub primary_frames_after_failover: u64,
    /// The primary's copy of the guest was gone after the failover (exactly one copy runs).
    pub primary_copy_stopped: bool,
    /// Processes or files of this round left behind after it (must be empty).
    pub leftovers: Vec<String>,
}

impl RoundResult {
    pub fn ok(&self) -> bool {
        self.acked_keys_lost == 0
            && (self.workload != "kv" || self.acked_keys_checked > 0)
            && self.guest_continued != Some(false)
            && self.primary_frames_after_failover == 0
            && self.primary_copy_stopped
            && self.leftovers.is_empty()
    }
}

/// The primary's per-epoch JSON lines, read as they grow.
#[derive(Default)]
pub(crate) struct Epochs {
    pos: u64,
    partial: String,
    pub acked: u64,
    raw: u64,
    sent: u64,
    pauses: Vec<f64>,
}

impl Epochs {
    pub fn poll(&mut self, path: &Path) {
        let Ok(mut f) = std::fs::File::open(path) else {
            return;
        };
        if f.seek(SeekFrom::Start(self.pos)).is_err() {
            return;
        }
        let mut s = String::new();
        if let Ok(n) = f.read_to_string(&mut s) {
            self.pos += n as u64;
        }
        self.partial.push_str(&s);
        while let Some(i) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=i).collect();
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                let g = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
                self.acked = self.acked.max(g("epoch"));
                self.raw += g("raw_bytes");
                self.sent += g("sent_bytes");
                self.pauses.push(g("pause_us") as f64 / 1000.0);
            }
        }
    }
}

const MIB: f64 = (1 << 20) as f64;

pub fn run(round: usize, o: &Opts<'_>, pb: &ProgressBar) -> anyhow::Result<RoundResult> {
    let rdir = o.dir.join(format!("round{round}"));
    std::fs::create_dir_all(&rdir)?;
    let report = rdir.join("failover.json");
    let mut bargs: Vec<String> = vec![
        "backup".into(),
        "--listen".into(),
        format!("{BACKUP_IP}:7000"),
        "--dir".into(),
        rdir.join("backup").display().to_string(),
        "--timeout-ms".into(),
        o.timeout_ms.to_string(),
        "--report".into(),
        report.display().to_string(),
    ];
    common(o, &mut bargs);
    if o.backup_tmpfs {
        mount_small_tmpfs(&rdir.join("backup"), o.mem)?;
    }
    let r = run_mounted(round, o, pb, &rdir, bargs);
    if o.backup_tmpfs {
        let _ = std::process::Command::new("umount")
            .arg(rdir.join("backup"))
            .status();
    }
    r
}

fn run_mounted(
    round: usize,
    o: &Opts<'_>,
    pb: &ProgressBar,
    rdir: &Path,
    bargs: Vec<String>,
) -> anyhow::Result<RoundResult> {
    let report = rdir.join("failover.json");
    pb.set_message(format!(
        "round {round}: starting the backup (standby QEMU, relay, NBD)"
    ));
    let backup = Daemon::spawn(
        "backup",
        &o.lab.backup,
        &o.exe,
        &bargs,
        rdir.join("backup.log"),
    )?;
    let mut pair = Pair {
        o,
        rdir: rdir.to_path_buf(),
        bargs,
        backup,
        backups_started: 1,
    };
    pair.backup
        .wait_line("listening on", Duration::from_secs(60))?;
    let mut bpids = vec![pair.backup.pid()];
    let filled = if o.backup_tmpfs {
        fill(&rdir.join("backup"))
    } else {
        0
    };
    let backup_addr: SocketAddr = format!("{BACKUP_IP}:7000").parse()?;
    let proxy = if o.faults.contains(&Fault::CorruptFrame) {
        Some(Proxy::start(&o.lab.primary, backup_addr)?)
    } else {
        None
    };
    let jsonl = rdir.join("epochs.jsonl");
    let mut pargs: Vec<String> = vec![
        "primary".into(),
        "--backup".into(),
        proxy.as_ref().map_or(backup_addr, |p| p.addr).to_string(),
        "--dir".into(),
        rdir.join("primary").display().to_string(),
        "--epoch-ms".into(),
        o.epoch_ms.to_string(),
        "--codec".into(),
        o.codec.clone(),
        "--metrics-jsonl".into(),
        jsonl.display().to_string(),
        "--fault-hooks".into(),
    ];
    if let Some(e) = o.stall_epoch {
        pargs.extend(["--fault-stall-epoch".into(), e.to_string()]);
    }
    common(o, &mut pargs);
    pb.set_message(format!(
        "round {round}: booting the primary guest (redis) and copying it to the backup"
    ));
    let mut primary = Daemon::spawn(
        "primary",
        &o.lab.primary,
        &o.exe,
        &pargs,
        rdir.join("primary.log"),
    )?;
    let ready = primary.wait_line("guest ready", Duration::from_secs(240))?;
    let qemu: u32 = ready
        .split("QEMU pid ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(0);
    let capture = Capture::start(&o.lab.clients, "tdp0")?;
    let (t0, t0_unix) = (Instant::now(), tandem_protect::unix_ms());
    let at = |unix: u64| t0 + Duration::from_millis(unix.saturating_sub(t0_unix));
    let addr: SocketAddr = format!("{GUEST_IP}:6379").parse()?;
    let kv = o.workload == "kv";
    let mut identity_before = (String::new(), 0);
    let writers = if kv {
        let mut probe = client::wait_ready(&o.lab.clients, addr, Duration::from_secs(60))?;
        identity_before = client::server_identity(&mut probe)?;
        Some(Writers::start(&o.lab.clients, addr, o.conns, o.batch))
    } else {
        None
    };
    let ops = |w: &Option<Writers>| w.as_ref().map_or(0, |w| w.ops.load(Ordering::Relaxed));
    let started = Instant::now();
    let mut ep = Epochs::default();
    let mut last = Instant::now();
    let mut last_ops = 0u64;
    // Replicated phase.
    loop {
        std::thread::sleep(Duration::from_millis(50));
        ep.poll(&jsonl);
        if last.elapsed() >= Duration::from_secs(1) {
            let n = ops(&writers);
            let rate = (n - last_ops) as f64 / last.elapsed().as_secs_f64();
            last_ops = n;
            last = Instant::now();
            pb.set_message(format!(
                "round {round}: replicating `{}` | epoch {} acked | raw {:.1} MiB sent {:.2} MiB | pause p50 {:.1} ms p99 {:.1} ms{}",
                o.workload,
                ep.acked,
                ep.raw as f64 / MIB,
                ep.sent as f64 / MIB,
                quantile(&ep.pauses, 0.5),
                quantile(&ep.pauses, 0.99),
                if kv { format!(" | client {rate:.0} ops/s") } else { String::new() }
            ));
        }
        if primary.exited() || pair.backup.exited() {
            bail!(
                "a daemon exited during replication; logs in {}",
                rdir.display()
            );
        }
        match o.stall_epoch {
            Some(_) if primary.saw("stalled in the middle") => break,
            Some(_) if started.elapsed() > Duration::from_secs(120) => {
                bail!("the primary never reached the stall epoch")
            }
            None if started.elapsed() >= o.before && ep.acked >= 3 => break,
            _ => {}
        }
    }
    // Faults, one after the other, until one of them ends the primary's copy.
    let ops_at_kill = ops(&writers);
    let replicated_s = started.elapsed().as_secs_f64();
    let inj = inject_faults(
        round,
        o,
        pb,
        &mut pair,
        Target {
            primary: &mut primary,
            qemu,
            proxy: proxy.as_ref(),
            bpids: &mut bpids,
        },
        &mut ep,
        &jsonl,
        &report,
    )?;
    let (kill_at, kill_unix, done) = (inj.at, inj.at_unix, inj.done);
    let rep = await_report(round, pb, &mut pair, &report)?;
    let g = |k: &str| rep.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
    let ops_at_running = ops(&writers);
    // Exactly one copy: the primary's QEMU must be gone (a fenced or hung primary stops its
    // copy; give a partitioned one time to reconnect and be told).
    let t = Instant::now();
    while qemu != 0 && fault::alive(qemu) && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let primary_copy_stopped = qemu != 0 && !fault::alive(qemu);
    // After failover: the guest runs on the backup, unprotected (native speed).
    let t = Instant::now();
    while t.elapsed() < o.after {
        std::thread::sleep(Duration::from_millis(200));
        pb.set_message(format!(
            "round {round}: running on the backup{}",
            if kv {
                format!(
                    " | client {} ops since failover",
                    ops(&writers) - ops_at_running
                )
            } else {
                String::new()
            }
        ));
    }
    let end = Instant::now();
    let after_s = t.elapsed().as_secs_f64();
    let (mut checked, mut lost, mut first_lost, mut reconnects) = (0, 0, None, 0);
    let (mut lat_p50, mut lat_p99, mut gap) = (f64::NAN, f64::NAN, f64::NAN);
    let mut identity_after = (String::new(), 0);
    let (rate_replicated, rate_after, unit, continued) = if let Some(w) = writers {
        let after_ops = w.ops.load(Ordering::Relaxed) - ops_at_running;
        let latencies = w.latencies.clone();
        reconnects = w.reconnects.load(Ordering::Relaxed);
        let acked = w.stop();
        pb.set_message(format!(
            "round {round}: reading back every acknowledged write"
        ));
        let mut verifier = match client::connect(&o.lab.clients, addr) {
            Ok(c) => c,
            Err(_) => client::wait_ready(&o.lab.clients, addr, Duration::from_secs(30))?,
        };
        (checked, lost, first_lost) = client::verify(&mut verifier, &acked)?;
        identity_after = client::server_identity(&mut verifier)?;
        let lat = latencies.lock().unwrap_or_else(|e| e.into_inner());
        let before_kill: Vec<f64> = lat
            .iter()
            .filter(|(at, _)| *at < kill_at)
            .map(|x| x.1)
            .collect();
        (lat_p50, lat_p99) = (quantile(&before_kill, 0.5), quantile(&before_kill, 0.99));
        gap = lat
            .iter()
            .find(|(at, _)| *at > kill_at)
            .map(|(at, _)| at.duration_since(kill_at).as_secs_f64() * 1000.0)
            .unwrap_or(f64::NAN);
        let same = !identity_before.0.is_empty()
            && identity_before.0 == identity_after.0
            && identity_after.1 >= identity_before.1;
        (
            Some(ops_at_kill as f64 / replicated_s),
            Some(after_ops as f64 / after_s),
            "ops",
            Some(same),
        )
    } else {
        let p = primary
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let b = pair
            .backup
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let unit = match o.workload.as_str() {
            "sqlite" => "txns",
            "compile" => "objs",
            _ => "",
        };
        // Continued, not rebooted: the backup's counter picks up where the checkpoint was
        // (near the primary's last value), not from the start.
        let continued = match (p.last(), b.first()) {
            (Some(pl), Some(bf)) => Some(bf.1 * 2 >= pl.1 && bf.1 > 10),
            _ => None,
        };
        (
            rate(&p, started, kill_at),
            rate(&b, kill_at, end),
            unit,
            continued,
        )
    };
    // The primary's relay let nothing out once the backup ran the guest (200 ms for frames
    // released at the very last ack to cross the bridge).
    let running = at(g("running_at_ms")) + Duration::from_millis(200);
    let after_failover = capture.after(running) as u64;
    let captured = capture.total() as u64;
    drop(capture);
    pair.backup.terminate(Duration::from_secs(15));
    primary.terminate(Duration::from_secs(5));
    let resyncs = std::fs::read_to_string(rdir.join("primary.log"))
        .unwrap_or_default()
        .matches("initial copy sent")
        .count()
        .saturating_sub(1) as u64;
    let mut pids = bpids;
    pids.push(primary.pid());
    std::thread::sleep(Duration::from_millis(300));
    let left = leftovers(rdir, &pids);
    let _ = filled;
    let detected = g("detected_at_ms");
    Ok(RoundResult {
        round,
        workload: o.workload.clone(),
        epoch_ms: o.epoch_ms,
        kill_point: match o.stall_epoch {
            Some(e) => format!("in the middle of epoch {e}'s transfer"),
            None => format!(
                "{} at a random time, {:.1} s into replication",
                done.last()
                    .map_or("", |d| d.split(':').next().unwrap_or("")),
                replicated_s
            ),
        },
        epochs_acked: ep.acked,
        raw_mib: ep.raw as f64 / MIB,
        sent_mib: ep.sent as f64 / MIB,
        sent_over_raw: ep.sent as f64 / ep.raw.max(1) as f64,
        pause_ms_p50: quantile(&ep.pauses, 0.5),
        pause_ms_p99: quantile(&ep.pauses, 0.99),
        unit: unit.into(),
        rate_replicated,
        rate_after_failover: rate_after,
        client_latency_ms_p50: lat_p50,
        client_latency_ms_p99: lat_p99,
        failover_epoch: g("epoch"),
        failover_reason: rep
            .get("reason")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .into(),
        detection_ms: detected.saturating_sub(kill_unix) as f64,
        resume_after_detection_ms: rep
            .get("resume_ms")
            .and_then(|v| v.as_f64())
            .unwrap_or(f64::NAN),
        kill_to_running_ms: g("running_at_ms").saturating_sub(kill_unix) as f64,
        client_gap_ms: gap,
        acked_keys_checked: checked,
        acked_keys_lost: lost,
        first_lost_key: first_lost,
        client_reconnects: reconnects,
        guest_continued: continued,
        redis_run_id: identity_after.0,
        redis_uptime_before_s: identity_before.1,
        redis_uptime_after_s: identity_after.1,
        faults: done,
        resyncs,
        primary_frames_captured: captured,
        primary_frames_after_failover: after_failover,
        primary_copy_stopped,
        leftovers: left,
    })
}
