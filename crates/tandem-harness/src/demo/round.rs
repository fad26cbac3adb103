//! One demo round: backup and primary in their namespaces, a real client on the clients'
//! bridge, a host failure of the primary, failover, and the checks.

use std::io::{Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::netlab::NetLab;
use crate::netlab::{BACKUP_IP, GUEST_IP};
use indicatif::ProgressBar;
use serde::Serialize;

use super::capture::Capture;
use super::fault::{Fault, Proxy};
use super::phases::{copy_stopped, field, Clock, RoundCtx, Timeline};
use super::steps::{await_report, common, fill, inject_faults, mount_small_tmpfs, Target};

#[derive(Clone)]
pub struct Opts<'a> {
    pub exe: PathBuf,
    /// Guest workload: `kv` gets the verifying client; others report their own progress.
    pub workload: String,
    pub lab: &'a NetLab,
    pub dir: PathBuf,
    pub mem: u64,
    /// The guest's virtual CPUs (`None`: the daemons' default, 1).
    pub vcpus: Option<u32>,
    pub epoch_ms: u64,
    /// The primary's `--schedule`.
    pub schedule: String,
    /// The primary's `--run-per-pause` (adaptive schedule).
    pub run_per_pause: f64,
    /// The primary's `--converge-pct` (adaptive schedule), if any.
    pub converge_pct: Option<f64>,
    /// The primary's `--stop-budget-ms` (adaptive schedule; `None`: its default).
    pub stop_budget_ms: Option<u64>,
    /// The primary's `--time-budget-pct` (adaptive schedule; `None`: its default).
    pub time_budget_pct: Option<f64>,
    /// The primary's `--precopy-rounds` (`None`: its default).
    pub precopy_rounds: Option<u32>,
    /// More flags for the primary (benchmarks of knobs without an axis of their own).
    pub primary_args: Vec<String>,
    /// The primary's `--devstate` (`None`: its default, xen-save).
    pub devstate: Option<String>,
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
    /// Run the guest from this description (a writable disk captured by mirroring) instead
    /// of `--workload` with tandem's NBD data disk.
    pub vm_config: Option<PathBuf>,
    /// Fence both daemons with this etcd cluster (`--etcd`).
    pub etcd: Option<&'a super::etcdlab::EtcdLab>,
    /// The VM id (its ownership record in etcd).
    pub vm_id: u64,
    /// Mutual TLS on the replication link with the keys in this directory (`tandem keys`).
    pub tls_dir: Option<PathBuf>,
    /// The backup keeps its mirror consolidated (`tandem backup --consolidate`) with this
    /// NRU clock revolution in seconds and this `--restore` (lazy, materialise).
    pub consolidate: Option<(f64, String)>,
}

impl<'a> Opts<'a> {
    /// A round of the `kv` lab guest in `lab`, working in `dir`, with the defaults every
    /// caller starts from (256 MiB, fixed 100 ms epochs, tandem's codec, the demo's client of
    /// 8 connections × 32 pipelined writes, 10 s before and after one host kill); callers
    /// override fields with `Opts { .., ..Opts::kv(..) }`.
    pub fn kv(exe: PathBuf, lab: &'a NetLab, dir: PathBuf) -> Self {
        Opts {
            exe,
            workload: "kv".into(),
            lab,
            dir,
            mem: 256,
            epoch_ms: 100,
            schedule: "adaptive".into(),
            run_per_pause: 1.0,
            converge_pct: None,
            stop_budget_ms: None,
            time_budget_pct: None,
            precopy_rounds: None,
            vcpus: None,
            primary_args: Vec::new(),
            devstate: None,
            timeout_ms: 1000,
            codec: "tandem".into(),
            conns: 8,
            batch: 32,
            before: Duration::from_secs(10),
            after: Duration::from_secs(10),
            stall_epoch: None,
            faults: vec![Fault::HostKill],
            backup_tmpfs: false,
            vm_config: None,
            etcd: None,
            vm_id: 1,
            tls_dir: None,
            consolidate: None,
        }
    }
}

#[derive(Serialize, Clone, Debug, Default)]
pub struct RoundResult {
    pub round: usize,
    pub workload: String,
    pub schedule: String,
    /// The kv client: connections × requests in flight per connection.
    pub client: String,
    /// The primary's device-state path (`--devstate`).
    pub devstate: String,
    /// Whether the replication link used mutual TLS.
    pub tls: bool,
    pub epoch_ms: u64,
    pub kill_point: String,
    pub epochs_acked: u64,
    pub raw_mib: f64,
    pub sent_mib: f64,
    pub sent_over_raw: f64,
    pub pause_ms_p50: f64,
    pub pause_ms_p99: f64,
    /// Median time QEMU had the guest stopped in a pause (its STOP to RESUME events).
    pub stopped_ms_p50: f64,
    /// From handing an epoch to the link to the backup's acknowledgement, median (ms).
    pub ack_ms_p50: f64,
    /// Share of the replicated phase the guest spent paused for checkpoints.
    pub pause_share: f64,
    /// Share of the replicated phase the guest spent suspended early (the adaptive
    /// schedule's stop threshold), on top of `pause_share`.
    pub suspend_share: f64,
    /// Share of the replicated phase's vCPU time the guest lost to pauses and suspends (what
    /// the guest-time budget counts: their length × how busy the guest was before them).
    pub cpu_lost_share: f64,
    /// The primary's `--precopy-rounds` (`None`: its default).
    pub precopy_rounds: Option<u32>,
    /// Median pause components (ms): stop, harvest, copy, device state, cont.
    pub pause_components_ms_p50: [f64; 5],
    /// Share of the acknowledged epochs by why they ended (the primary's `cut`: time,
    /// output, disk, converged, start, handover).
    pub epochs_cut: std::collections::BTreeMap<String, f64>,
    /// Median time the guest ran in an epoch before its pause (ms).
    pub ran_ms_p50: f64,
    /// Share of the epochs by the rule that last held their waiting output back (the
    /// primary's `waited`: min_run, budget, busy, ack; `none`: cut at the first poll that
    /// could, or nothing waited).
    pub output_held_by: std::collections::BTreeMap<String, f64>,
    /// The session's first epoch (what the initial sync left): pages and pause.
    pub first_epoch_pages: u64,
    pub first_epoch_pause_ms: f64,
    /// The primary's time encoding epochs per second of the replicated phase: the share of
    /// one core its (one-thread) encoder was busy, an upper bound on its CPU.
    pub encoder_core_share: f64,
    /// The encoding thread's CPU time per second of the replicated phase: its CPU, without
    /// the time it waited for a core beside QEMU's vCPU threads.
    pub encoder_cpu_share: f64,
    /// Acknowledged epochs that were sent in parts (`--epoch-part-mib`).
    pub epochs_in_parts: u64,
    /// Peak anonymous memory (MiB) of the primary's and the backup's tandem processes from
    /// their start to the failover, initial sync included (not QEMU's, not the mirror's tmpfs
    /// file).
    pub daemon_anon_mib_peak: [f64; 2],
    /// zstd levels the primary chose for the memory records: lowest, median, highest.
    pub zstd_levels: [i64; 3],
    /// Guest throughput unit: client `ops` (kv), sqlite `txns`, compiled `objs`; none for idle.
    pub unit: String,
    /// Throughput per second while replicated, and on the backup after failover (unprotected,
    /// the native baseline of the same run).
    pub rate_replicated: Option<f64>,
    pub rate_after_failover: Option<f64>,
    pub client_latency_ms_p50: f64,
    pub client_latency_ms_p99: f64,
    /// Every request's latency while replicated (ms; plots only).
    #[serde(skip)]
    pub latency_samples_ms: Vec<f64>,
    /// The primary's epochs while replicated (plots only).
    #[serde(skip)]
    pub epoch_points: Vec<EpochPoint>,
    pub failover_epoch: u64,
    pub failover_reason: String,
    pub detection_ms: f64,
    pub resume_after_detection_ms: f64,
    /// Of the resume: taking the VM over in etcd (with --etcd).
    pub takeover_ms: f64,
    /// Of the resume: restoring the consolidated pages into the mirror.
    pub materialise_ms: f64,
    /// The replica's memory on the backup when the primary was lost (with consolidation).
    pub memory: Option<serde_json::Value>,
    /// The lazy restore of the consolidated pages (faults served, time until all were in).
    pub lazy: Option<serde_json::Value>,
    pub kill_to_running_ms: f64,
    pub client_gap_ms: f64,
    /// Client requests completed in the first second after the failover (see `later_ops_per_s`).
    pub first_second_ops: f64,
    /// Client requests per second after that first second, on the backup.
    pub later_ops_per_s: f64,
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
    /// The list appenders' history, checked (kv only): every acknowledged append present,
    /// in order, nothing never written.
    pub history: Option<super::history::Check>,
}

impl RoundResult {
    pub fn ok(&self) -> bool {
        self.acked_keys_lost == 0
            && (!tandem_labguest::serves_kv(&self.workload) || self.acked_keys_checked > 0)
            && self.guest_continued != Some(false)
            && self.primary_frames_after_failover == 0
            && self.primary_copy_stopped
            && self.leftovers.is_empty()
            && self
                .history
                .as_ref()
                .is_none_or(|h| h.anomalies() == 0 && h.ok > 0)
    }
}

/// The primary's per-epoch JSON lines, read as they grow.
#[derive(Default)]
pub(crate) struct Epochs {
    pos: u64,
    partial: String,
    pub acked: u64,
    pub raw: u64,
    pub sent: u64,
    pub pauses: Vec<f64>,
    /// Each epoch's time QEMU had the guest stopped (ms; the pause where unknown).
    pub stopped: Vec<f64>,
    /// Each epoch's acknowledgement latency (ms).
    pub acks: Vec<f64>,
    /// Milliseconds the guest was suspended early, summed.
    pub suspended_ms: f64,
    /// Milliseconds of vCPU time the guest lost to pauses and suspends, summed.
    pub lost_cpu_ms: f64,
    /// Milliseconds the primary spent encoding epochs, summed.
    pub encode_ms: f64,
    /// ... and its encoding thread's CPU time for it.
    pub encode_cpu_ms: f64,
    /// Epochs sent in more than one frame.
    pub in_parts: u64,
    /// Each epoch's pause components (ms): stop, harvest, copy, device state, cont.
    pub components: Vec<[f64; 5]>,
    /// Epochs by why they ended.
    pub cuts: std::collections::BTreeMap<String, u64>,
    /// Each epoch's run before its pause (ms).
    pub ran: Vec<f64>,
    /// Epochs by the rule that last held their waiting output back.
    pub held_by: std::collections::BTreeMap<String, u64>,
    pub points: Vec<EpochPoint>,
}

impl Epochs {
    /// The share of the epochs by why they ended.
    pub fn cut_shares(&self) -> std::collections::BTreeMap<String, f64> {
        shares(&self.cuts)
    }

    /// The share of the epochs by the rule that last held their waiting output back.
    pub fn held_shares(&self) -> std::collections::BTreeMap<String, f64> {
        shares(&self.held_by)
    }

    /// The median of each pause component (ms): stop, harvest, copy, device state, cont.
    pub fn component_p50s(&self) -> [f64; 5] {
        let mut out = [0.0; 5];
        for (i, o) in out.iter_mut().enumerate() {
            let v: Vec<f64> = self.components.iter().map(|c| c[i]).collect();
            *o = crate::demo::quantile(&v, 0.5);
        }
        out
    }
}

fn shares(
    counts: &std::collections::BTreeMap<String, u64>,
) -> std::collections::BTreeMap<String, f64> {
    let all = counts.values().sum::<u64>().max(1) as f64;
    counts
        .iter()
        .map(|(k, &n)| (k.clone(), n as f64 / all))
        .collect()
}

/// One epoch of the primary's JSON lines, for the timeline plot.
#[derive(Debug, Clone, Copy, Default)]
pub struct EpochPoint {
    /// Epoch number.
    pub epoch: u64,
    /// Pause, ms.
    pub pause_ms: f64,
    /// Pages written in the epoch.
    pub dirty_pages: u64,
    /// Bytes sent.
    pub sent_bytes: u64,
    /// Guest frames held when it was sealed.
    pub held_frames: u64,
    /// Early suspend before the pause, ms.
    pub suspended_ms: f64,
    /// zstd level of the epoch's memory record.
    pub level: i64,
}

impl Epochs {
    /// Lowest, median and highest zstd level of the acknowledged epochs.
    pub fn levels(&self) -> [i64; 3] {
        let mut v: Vec<i64> = self.points.iter().map(|p| p.level).collect();
        v.sort_unstable();
        match (v.first(), v.last()) {
            (Some(&lo), Some(&hi)) => [lo, v[v.len() / 2], hi],
            _ => [0; 3],
        }
    }

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
                let stopped = match g("stopped_us") {
                    0 => g("pause_us"),
                    s => s.min(g("pause_us")),
                };
                self.stopped.push(stopped as f64 / 1000.0);
                self.acks.push(g("ack_latency_us") as f64 / 1000.0);
                self.suspended_ms += g("suspended_us") as f64 / 1000.0;
                self.lost_cpu_ms += g("lost_cpu_us") as f64 / 1000.0;
                // The encoding stage: the memory record on the encoder's thread (begun in
                // the pause) or the encoding after it, whichever was longer.
                self.encode_ms += g("encode_us").max(g("encode_ahead_us")) as f64 / 1000.0;
                self.encode_cpu_ms += g("encode_cpu_us") as f64 / 1000.0;
                self.in_parts += u64::from(g("parts") > 0);
                if let Some(c) = v.get("cut").and_then(|c| c.as_str()) {
                    *self.cuts.entry(c.to_string()).or_default() += 1;
                    self.ran.push(g("ran_us") as f64 / 1000.0);
                    let held = v.get("waited").and_then(|w| w.as_str()).unwrap_or("none");
                    *self.held_by.entry(held.to_string()).or_default() += 1;
                }
                let ms = |k: &str| g(k) as f64 / 1000.0;
                self.components.push([
                    ms("stop_us"),
                    ms("harvest_us"),
                    ms("copy_us"),
                    ms("devstate_us"),
                    ms("cont_us"),
                ]);
                self.points.push(EpochPoint {
                    epoch: g("epoch"),
                    pause_ms: g("pause_us") as f64 / 1000.0,
                    dirty_pages: g("dirty_pages"),
                    sent_bytes: g("sent_bytes"),
                    held_frames: g("held_frames"),
                    suspended_ms: g("suspended_us") as f64 / 1000.0,
                    level: v.get("level").and_then(|x| x.as_i64()).unwrap_or(0),
                });
            }
        }
    }
}

pub(crate) const MIB: f64 = (1 << 20) as f64;

pub fn run(round: usize, o: &Opts<'_>, pb: &ProgressBar) -> anyhow::Result<RoundResult> {
    // Members an earlier round killed come back; the proxy passes replies again.
    if let Some(e) = o.etcd {
        e.set_proxy(crate::etcd_cluster::ProxyMode::Pass);
        e.cluster().restart_all()?;
    }
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
    common(o, &mut bargs)?;
    if let Some((clock, restore)) = &o.consolidate {
        bargs.extend([
            "--consolidate".into(),
            "--clock-s".into(),
            clock.to_string(),
        ]);
        bargs.extend(["--restore".into(), restore.clone()]);
    }
    if o.backup_tmpfs {
        mount_small_tmpfs(&rdir.join("backup"), o.mem)?;
    }
    let r = run_mounted(round, o, pb, &rdir, bargs);
    if o.backup_tmpfs {
        let _ = std::process::Command::new("umount")
            .arg(rdir.join("backup"))
            .stdout(std::process::Stdio::null())
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
    let cx = RoundCtx::new(round, o, pb, rdir);
    let mut pair = cx.start_backup(bargs)?;
    let mut bpids = vec![pair.backup.pid()];
    let filled = if o.backup_tmpfs {
        fill(&rdir.join("backup"))
    } else {
        0
    };
    let backup_addr: SocketAddr = format!("{BACKUP_IP}:7000").parse()?;
    let proxy = if o.faults.iter().any(|f| f.needs_link_proxy()) {
        Some(Proxy::start(&o.lab.primary, backup_addr)?)
    } else {
        None
    };
    let (mut primary, qemu) = cx.start_primary(proxy.as_ref().map_or(backup_addr, |p| p.addr))?;
    let capture = Capture::start(&o.lab.clients, "tdp0")?;
    let clock = Clock::now();
    let addr: SocketAddr = format!("{GUEST_IP}:6379").parse()?;
    let client = cx.start_client(addr)?;
    // Replicated phase.
    let (mut ep, started) = cx.replicate(&mut primary, &mut pair.backup, &client)?;
    // Faults, one after the other, until one of them ends the primary's copy.
    let ops_at_kill = client.ops();
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
        &cx.jsonl,
        &cx.report,
    )?;
    let rep = await_report(round, pb, &mut pair, &cx.report)?;
    let ops_at_running = client.ops();
    // Exactly one copy: the primary's QEMU must be gone (a fenced or hung primary stops its
    // copy; give a partitioned one time to reconnect and be told).
    let primary_copy_stopped = copy_stopped(qemu);
    // After failover: the guest runs on the backup, unprotected (native speed).
    let (end, after_s) = cx.run_on_backup(&client, ops_at_running);
    let tl = Timeline {
        started,
        replicated_s,
        ops_at_kill,
        kill_at: inj.at,
        kill_unix: inj.at_unix,
        ops_at_running,
        end,
        after_s,
    };
    let outcome = cx.outcome(client, &primary, &pair.backup, &tl)?;
    // The primary's relay let nothing out once the backup ran the guest (200 ms for frames
    // released at the very last ack to cross the bridge).
    let running = clock.at(field(&rep, "running_at_ms")) + Duration::from_millis(200);
    let checks = cx.teardown(
        capture,
        running,
        &mut pair.backup,
        &mut primary,
        bpids,
        primary_copy_stopped,
    );
    let _ = filled;
    Ok(cx.result(&ep, &rep, inj.done, &tl, outcome, checks))
}
