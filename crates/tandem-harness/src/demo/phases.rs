//! The phases of a demo round, in the order `round::run_mounted` goes through them: start the
//! backup and the primary, start the client, replicate, run on the backup after failover,
//! read the results back, stop everything, and put the round's result together.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::bail;
use indicatif::ProgressBar;

use super::capture::Capture;
use super::client::{self, Writers};
use super::daemon::{qemu_pid, rate, Daemon};
use super::fault;
use super::round::{Epochs, Opts, RoundResult, MIB};
use super::steps::{common, leftovers, Pair};
use tandem_types::stats::quantile;

/// What every phase of a round shares: the round, its options and its files.
pub struct RoundCtx<'a> {
    pub round: usize,
    pub o: &'a Opts<'a>,
    pub pb: &'a ProgressBar,
    pub rdir: &'a Path,
    /// The backup's failover report.
    pub report: PathBuf,
    /// The primary's per-epoch JSON lines.
    pub jsonl: PathBuf,
    /// The daemons' memory, sampled from their start on.
    pub mem: super::memsample::MemSampler,
}

/// The client on the clients' bridge: writers for `kv`, none for other workloads.
pub struct Client {
    pub addr: SocketAddr,
    pub writers: Option<Writers>,
    /// The list appenders whose history is checked (kv only).
    pub appenders: Option<super::history::Appenders>,
    /// Redis run id and uptime before the kill (kv only).
    pub identity_before: (String, u64),
}

impl Client {
    /// Operations the writers completed so far (0 without writers).
    pub fn ops(&self) -> u64 {
        self.writers
            .as_ref()
            .map_or(0, |w| w.ops.load(Ordering::Relaxed))
    }
}

/// List appenders beside the writers in every kv round (their history is checked).
const APPENDERS: usize = 4;

/// The same moment on the monotonic clock and the Unix clock, to convert the backup's times.
pub struct Clock {
    pub t0: Instant,
    pub t0_unix: u64,
}

impl Clock {
    /// Starts the clock now.
    pub fn now() -> Clock {
        let (t0, t0_unix) = (Instant::now(), tandem_protect::unix_ms());
        Clock { t0, t0_unix }
    }

    /// The instant of a Unix time in ms.
    pub fn at(&self, unix: u64) -> Instant {
        self.t0 + Duration::from_millis(unix.saturating_sub(self.t0_unix))
    }
}

/// When the round's phases began and ended, with the client's operation counts then.
pub struct Timeline {
    pub started: Instant,
    pub replicated_s: f64,
    pub ops_at_kill: u64,
    pub kill_at: Instant,
    pub kill_unix: u64,
    pub ops_at_running: u64,
    pub end: Instant,
    pub after_s: f64,
}

/// What the guest did, as the client (kv) or the guest's progress counter saw it.
pub struct Outcome {
    rate_replicated: Option<f64>,
    rate_after: Option<f64>,
    unit: &'static str,
    continued: Option<bool>,
    checked: u64,
    lost: u64,
    first_lost: Option<String>,
    reconnects: u64,
    lat_p50: f64,
    lat_p99: f64,
    /// Every request's latency before the fault (ms), for plots.
    lat: Vec<f64>,
    gap: f64,
    /// Requests completed in the first second after the client's first success after the
    /// kill, and per second over the rest of the run on the backup.
    first_second: (f64, f64),
    identity_before: (String, u64),
    identity_after: (String, u64),
    /// The list appenders' history, checked.
    history: Option<super::history::Check>,
}

/// The checks made after both daemons stopped.
pub struct Checks {
    pub primary_copy_stopped: bool,
    pub captured: u64,
    pub after_failover: u64,
    pub resyncs: u64,
    pub left: Vec<String>,
}

/// An integer field of the backup's failover report (0 when missing).
pub fn field(rep: &serde_json::Value, k: &str) -> u64 {
    rep.get(k).and_then(|v| v.as_u64()).unwrap_or(0)
}

/// Waits up to 30 s for the primary's QEMU to be gone; true when it is.
pub fn copy_stopped(qemu: u32) -> bool {
    let t = Instant::now();
    while qemu != 0 && fault::alive(qemu) && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    qemu != 0 && !fault::alive(qemu)
}

impl<'a> RoundCtx<'a> {
    /// The context of round `round` in `rdir`.
    pub fn new(round: usize, o: &'a Opts<'a>, pb: &'a ProgressBar, rdir: &'a Path) -> Self {
        RoundCtx {
            round,
            o,
            pb,
            rdir,
            report: rdir.join("failover.json"),
            jsonl: rdir.join("epochs.jsonl"),
            mem: super::memsample::MemSampler::start(),
        }
    }

    /// Starts the backup and waits until it listens.
    pub fn start_backup(&self, bargs: Vec<String>) -> anyhow::Result<Pair<'a>> {
        let (round, o, rdir) = (self.round, self.o, self.rdir);
        self.pb.set_message(format!(
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
        self.mem.watch(super::memsample::BACKUP, pair.backup.pid());
        pair.backup
            .wait_line("listening on", Duration::from_secs(60))?;
        Ok(pair)
    }

    /// Starts the primary replicating to `backup` and waits until its guest is ready; returns
    /// it with its QEMU's pid (0 if unknown).
    pub fn start_primary(&self, backup: SocketAddr) -> anyhow::Result<(Daemon, u32)> {
        let (round, o, rdir) = (self.round, self.o, self.rdir);
        let pargs = self.primary_args(backup)?;
        self.pb.set_message(format!(
            "round {round}: booting the primary guest (redis) and copying it to the backup"
        ));
        let mut primary = Daemon::spawn(
            "primary",
            &o.lab.primary,
            &o.exe,
            &pargs,
            rdir.join("primary.log"),
        )?;
        self.mem.watch(super::memsample::PRIMARY, primary.pid());
        let ready = primary.wait_line("guest ready", Duration::from_secs(240))?;
        let qemu = qemu_pid(&ready);
        // The client starts once the initial sync is done: its pre-copy rounds may throttle
        // a busy guest to a few per cent of its time for a minute (a large guest), in which
        // it answers no connection.
        self.pb.set_message(format!(
            "round {round}: initial sync (pre-copy rounds while the guest runs)"
        ));
        primary.wait_line("replicating from epoch", Duration::from_secs(1200))?;
        Ok((primary, qemu))
    }

    /// The primary's command line, replicating to `backup`.
    pub fn primary_args(&self, backup: SocketAddr) -> anyhow::Result<Vec<String>> {
        let (o, rdir) = (self.o, self.rdir);
        let mut pargs: Vec<String> = vec![
            "primary".into(),
            "--backup".into(),
            backup.to_string(),
            "--dir".into(),
            rdir.join("primary").display().to_string(),
            "--epoch-ms".into(),
            o.epoch_ms.to_string(),
            "--schedule".into(),
            o.schedule.clone(),
            "--run-per-pause".into(),
            o.run_per_pause.to_string(),
            "--codec".into(),
            o.codec.clone(),
            "--converge-pct".into(),
            o.converge_pct.unwrap_or(0.0).to_string(),
            "--metrics-jsonl".into(),
            self.jsonl.display().to_string(),
            "--fault-hooks".into(),
        ];
        if let Some(e) = o.stall_epoch {
            pargs.extend(["--fault-stall-epoch".into(), e.to_string()]);
        }
        if let Some(ms) = o.stop_budget_ms {
            pargs.extend(["--stop-budget-ms".into(), ms.to_string()]);
        }
        if let Some(pct) = o.time_budget_pct {
            pargs.extend(["--time-budget-pct".into(), pct.to_string()]);
        }
        if let Some(n) = o.precopy_rounds {
            pargs.extend(["--precopy-rounds".into(), n.to_string()]);
        }
        pargs.extend(o.primary_args.iter().cloned());
        if let Some(d) = &o.devstate {
            pargs.extend(["--devstate".into(), d.clone()]);
        }
        common(o, &mut pargs)?;
        Ok(pargs)
    }

    /// Starts the writers against the guest at `addr` (kv only, after noting redis' identity).
    pub fn start_client(&self, addr: SocketAddr) -> anyhow::Result<Client> {
        let o = self.o;
        let kv = tandem_labguest::serves_kv(&o.workload);
        let mut identity_before = (String::new(), 0);
        let (writers, appenders) = if kv {
            let mut probe = client::wait_ready(&o.lab.clients, addr, Duration::from_secs(60))?;
            identity_before = client::server_identity(&mut probe)?;
            (
                Some(Writers::start(&o.lab.clients, addr, o.conns, o.batch)),
                Some(super::history::Appenders::start(
                    &o.lab.clients,
                    addr,
                    APPENDERS,
                )),
            )
        } else {
            (None, None)
        };
        Ok(Client {
            addr,
            writers,
            appenders,
            identity_before,
        })
    }

    /// The replicated phase: shows progress until the kill point; returns the epochs read so
    /// far and when the phase started.
    pub fn replicate(
        &self,
        primary: &mut Daemon,
        backup: &mut Daemon,
        client: &Client,
    ) -> anyhow::Result<(Epochs, Instant)> {
        let (round, o) = (self.round, self.o);
        let kv = tandem_labguest::serves_kv(&o.workload);
        let started = Instant::now();
        let mut ep = Epochs::default();
        let mut last = Instant::now();
        let mut last_ops = 0u64;
        loop {
            std::thread::sleep(Duration::from_millis(50));
            ep.poll(&self.jsonl);
            if last.elapsed() >= Duration::from_secs(1) {
                let n = client.ops();
                let rate = (n - last_ops) as f64 / last.elapsed().as_secs_f64();
                last_ops = n;
                last = Instant::now();
                self.pb.set_message(format!(
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
            if primary.exited() || backup.exited() {
                bail!(
                    "a daemon exited during replication; logs in {}",
                    self.rdir.display()
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
        Ok((ep, started))
    }

    /// After failover: the guest runs on the backup, unprotected (native speed), for
    /// `o.after`; returns when that ended and how long it took in seconds.
    pub fn run_on_backup(&self, client: &Client, ops_at_running: u64) -> (Instant, f64) {
        let round = self.round;
        let kv = tandem_labguest::serves_kv(&self.o.workload);
        let t = Instant::now();
        while t.elapsed() < self.o.after {
            std::thread::sleep(Duration::from_millis(200));
            self.pb.set_message(format!(
                "round {round}: running on the backup{}",
                if kv {
                    format!(
                        " | client {} ops since failover",
                        client.ops() - ops_at_running
                    )
                } else {
                    String::new()
                }
            ));
        }
        let end = Instant::now();
        let after_s = t.elapsed().as_secs_f64();
        (end, after_s)
    }

    /// What the guest did: from the client's writes read back (kv) or the progress counters.
    pub fn outcome(
        &self,
        client: Client,
        primary: &Daemon,
        backup: &Daemon,
        tl: &Timeline,
    ) -> anyhow::Result<Outcome> {
        match client.writers {
            Some(w) => {
                self.kv_outcome(w, client.appenders, client.addr, client.identity_before, tl)
            }
            None => Ok(self.progress_outcome(primary, backup, tl)),
        }
    }

    /// Stops the writers, reads back every acknowledged write and checks redis kept running.
    fn kv_outcome(
        &self,
        w: Writers,
        appenders: Option<super::history::Appenders>,
        addr: SocketAddr,
        identity_before: (String, u64),
        tl: &Timeline,
    ) -> anyhow::Result<Outcome> {
        let (round, o, kill_at) = (self.round, self.o, tl.kill_at);
        let after_ops = w.ops.load(Ordering::Relaxed) - tl.ops_at_running;
        let latencies = w.latencies.clone();
        let reconnects = w.reconnects.load(Ordering::Relaxed);
        let acked = w.stop();
        let history = appenders.map(super::history::Appenders::stop);
        self.pb.set_message(format!(
            "round {round}: reading back every acknowledged write"
        ));
        let mut verifier = match client::connect(&o.lab.clients, addr) {
            Ok(c) => c,
            Err(_) => client::wait_ready(&o.lab.clients, addr, Duration::from_secs(30))?,
        };
        let (checked, lost, first_lost) = client::verify(&mut verifier, &acked)?;
        let history = match history {
            Some(h) => {
                let lists = super::history::read_lists(&mut verifier, APPENDERS)?;
                Some(super::history::check(&h, &lists))
            }
            None => None,
        };
        let identity_after = client::server_identity(&mut verifier)?;
        let lat = latencies.lock().unwrap_or_else(|e| e.into_inner());
        let before_kill: Vec<f64> = lat
            .iter()
            .filter(|(at, _)| *at < kill_at)
            .map(|x| x.1)
            .collect();
        let (lat_p50, lat_p99) = (quantile(&before_kill, 0.5), quantile(&before_kill, 0.99));
        let gap = lat
            .iter()
            .find(|(at, _)| *at > kill_at)
            .map(|(at, _)| at.duration_since(kill_at).as_secs_f64() * 1000.0)
            .unwrap_or(f64::NAN);
        let same = !identity_before.0.is_empty()
            && identity_before.0 == identity_after.0
            && identity_after.1 >= identity_before.1;
        Ok(Outcome {
            rate_replicated: Some(tl.ops_at_kill as f64 / tl.replicated_s),
            rate_after: Some(after_ops as f64 / tl.after_s),
            unit: "ops",
            continued: Some(same),
            checked,
            lost,
            first_lost,
            reconnects,
            lat_p50,
            lat_p99,
            lat: before_kill,
            gap,
            first_second: first_second(&lat, kill_at, tl.end),
            identity_before,
            identity_after,
            history,
        })
    }

    /// Rates and continuity from the guest's progress lines on the primary and the backup.
    fn progress_outcome(&self, primary: &Daemon, backup: &Daemon, tl: &Timeline) -> Outcome {
        let p = primary
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let b = backup
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let unit = match self.o.workload.as_str() {
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
        Outcome {
            rate_replicated: rate(&p, tl.started, tl.kill_at),
            rate_after: rate(&b, tl.kill_at, tl.end),
            unit,
            continued,
            checked: 0,
            lost: 0,
            first_lost: None,
            reconnects: 0,
            lat_p50: f64::NAN,
            lat_p99: f64::NAN,
            lat: Vec::new(),
            gap: f64::NAN,
            first_second: (f64::NAN, f64::NAN),
            identity_before: (String::new(), 0),
            identity_after: (String::new(), 0),
            history: None,
        }
    }

    /// Counts the primary's frames after `running`, stops both daemons and looks for what the
    /// round left behind (`bpids`: every backup's pid).
    pub fn teardown(
        &self,
        capture: Capture,
        running: Instant,
        backup: &mut Daemon,
        primary: &mut Daemon,
        bpids: Vec<u32>,
        primary_copy_stopped: bool,
    ) -> Checks {
        let after_failover = capture.after(running) as u64;
        let captured = capture.total() as u64;
        drop(capture);
        backup.terminate(Duration::from_secs(15));
        primary.terminate(Duration::from_secs(5));
        let resyncs = std::fs::read_to_string(self.rdir.join("primary.log"))
            .unwrap_or_default()
            .matches("initial copy sent")
            .count()
            .saturating_sub(1) as u64;
        let mut pids = bpids;
        pids.push(primary.pid());
        std::thread::sleep(Duration::from_millis(300));
        let left = leftovers(self.rdir, &pids);
        Checks {
            primary_copy_stopped,
            captured,
            after_failover,
            resyncs,
            left,
        }
    }

    /// Puts the round's result together (`done`: the faults injected, with what each led to).
    pub fn result(
        &self,
        ep: &Epochs,
        rep: &serde_json::Value,
        done: Vec<String>,
        tl: &Timeline,
        g: Outcome,
        c: Checks,
    ) -> RoundResult {
        let o = self.o;
        let kill_unix = tl.kill_unix;
        let detected = field(rep, "detected_at_ms");
        RoundResult {
            round: self.round,
            workload: o.workload.clone(),
            schedule: o.schedule.clone(),
            client: format!("{}x{}", o.conns, o.batch),
            devstate: o.devstate.clone().unwrap_or_else(|| "xen-save".into()),
            tls: o.tls_dir.is_some(),
            epoch_ms: o.epoch_ms,
            kill_point: match o.stall_epoch {
                Some(e) => format!("in the middle of epoch {e}'s transfer"),
                None => format!(
                    "{} at a random time, {:.1} s into replication",
                    done.last()
                        .map_or("", |d| d.split(':').next().unwrap_or("")),
                    tl.replicated_s
                ),
            },
            epochs_acked: ep.acked,
            raw_mib: ep.raw as f64 / MIB,
            sent_mib: ep.sent as f64 / MIB,
            sent_over_raw: ep.sent as f64 / ep.raw.max(1) as f64,
            pause_ms_p50: quantile(&ep.pauses, 0.5),
            pause_ms_p99: quantile(&ep.pauses, 0.99),
            stopped_ms_p50: quantile(&ep.stopped, 0.5),
            ack_ms_p50: quantile(&ep.acks, 0.5),
            pause_share: ep.pauses.iter().sum::<f64>() / 1000.0 / tl.replicated_s.max(1e-3),
            suspend_share: ep.suspended_ms / 1000.0 / tl.replicated_s.max(1e-3),
            cpu_lost_share: ep.lost_cpu_ms / 1000.0 / tl.replicated_s.max(1e-3),
            encoder_core_share: ep.encode_ms / 1000.0 / tl.replicated_s.max(1e-3),
            encoder_cpu_share: ep.encode_cpu_ms / 1000.0 / tl.replicated_s.max(1e-3),
            epochs_in_parts: ep.in_parts,
            daemon_anon_mib_peak: self.mem.peaks_mib(),
            precopy_rounds: o.precopy_rounds,
            pause_components_ms_p50: ep.component_p50s(),
            epochs_cut: ep.cut_shares(),
            ran_ms_p50: quantile(&ep.ran, 0.5),
            output_held_by: ep.held_shares(),
            first_epoch_pages: ep.points.first().map_or(0, |p| p.dirty_pages),
            first_epoch_pause_ms: ep.points.first().map_or(0.0, |p| p.pause_ms),
            zstd_levels: ep.levels(),
            unit: g.unit.into(),
            rate_replicated: g.rate_replicated,
            rate_after_failover: g.rate_after,
            client_latency_ms_p50: g.lat_p50,
            client_latency_ms_p99: g.lat_p99,
            latency_samples_ms: g.lat,
            epoch_points: ep.points.clone(),
            failover_epoch: field(rep, "epoch"),
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
            takeover_ms: rep
                .get("takeover_ms")
                .and_then(|v| v.as_f64())
                .unwrap_or(0.0),
            materialise_ms: rep
                .get("materialise_ms")
                .and_then(|v| v.as_f64())
                .unwrap_or(0.0),
            memory: rep.get("memory").filter(|m| !m.is_null()).cloned(),
            lazy: rep.get("lazy").filter(|m| !m.is_null()).cloned(),
            kill_to_running_ms: field(rep, "running_at_ms").saturating_sub(kill_unix) as f64,
            client_gap_ms: g.gap,
            first_second_ops: g.first_second.0,
            later_ops_per_s: g.first_second.1,
            acked_keys_checked: g.checked,
            acked_keys_lost: g.lost,
            first_lost_key: g.first_lost,
            client_reconnects: g.reconnects,
            guest_continued: g.continued,
            redis_run_id: g.identity_after.0,
            redis_uptime_before_s: g.identity_before.1,
            redis_uptime_after_s: g.identity_after.1,
            faults: done,
            resyncs: c.resyncs,
            primary_frames_captured: c.captured,
            primary_frames_after_failover: c.after_failover,
            primary_copy_stopped: c.primary_copy_stopped,
            leftovers: c.left,
            history: g.history,
        }
    }
}

/// Requests completed in the first second after the first one that completed after `kill`,
/// and the rate per second from then until `end` (the guest's first-second slowdown, e.g.
/// while a lazy restore installs its pages).
fn first_second(lat: &[(Instant, f64)], kill: Instant, end: Instant) -> (f64, f64) {
    let Some(t0) = lat.iter().map(|x| x.0).filter(|&t| t > kill).min() else {
        return (f64::NAN, f64::NAN);
    };
    let t1 = t0 + Duration::from_secs(1);
    let first = lat.iter().filter(|x| x.0 >= t0 && x.0 < t1).count() as f64;
    let rest = lat.iter().filter(|x| x.0 >= t1 && x.0 < end).count() as f64;
    let secs = end.saturating_duration_since(t1).as_secs_f64();
    (first, if secs > 0.5 { rest / secs } else { f64::NAN })
}
