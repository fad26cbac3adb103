//! `tandem bench --faults N`: a Jepsen-style campaign of at least N faults against replicated
//! `kv` guests fenced by a real 3-member etcd cluster over mutual TLS (docs/FENCING.md). Each
//! round starts a backup and a primary (the link over mutual TLS), drives redis with the
//! demo's writers and four list appenders whose history is recorded, injects random faults
//! in combination — partitions of the link, of etcd and of both (symmetric, one-way,
//! flapping), a daemon stopped past the backup's promise, etcd members and its leader killed,
//! quorum lost, a slow and an ambiguous etcd member (a proxy the harness runs in front of one
//! member), ENOSPC during a hello, corrupt frames, backup restarts — and ends with one that
//! ends the primary (host, QEMU or tandem killed, QEMU hung, handover, isolation, a host kill
//! whose takeover reply is lost); rounds with a corrupt frame run the link in plain TCP (the
//! proxy that flips a byte must see frames), the others over TLS. Every 8th round kills the old primary at a step of a
//! switchover instead; every 13th is a double fault (no copy left: the restarted primary
//! must refuse to boot). Every round checks: each acknowledged write read back, the history
//! valid (each acknowledged append present, in order, nothing never written), redis never
//! restarted, no frame of the old primary on the clients' bridge once the backup ran the
//! guest, exactly one copy left, nothing left behind, the VM running again on the backup.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::netlab::NetLab;
use anyhow::Context;
use indicatif::ProgressBar;
use serde::Serialize;

use crate::demo::etcdlab::EtcdLab;
use crate::demo::fault::Fault;
use crate::demo::round::{self, Opts, RoundResult};

#[derive(Serialize, Default)]
struct Kind {
    injected: u64,
    /// Rounds ending in this fault's failover.
    failovers: u64,
    /// Median time from this fault to the guest running on the backup, over its failovers.
    fault_to_running_ms_p50: f64,
    /// Rounds with this fault that found an anomaly.
    rounds_with_anomalies: u64,
    #[serde(skip)]
    times: Vec<f64>,
}

#[derive(Serialize)]
struct Report {
    ok: bool,
    fencing: bool,
    faults: u64,
    rounds: usize,
    seconds: f64,
    by_fault: BTreeMap<String, Kind>,
    acked_keys_checked: u64,
    acked_keys_lost: u64,
    appends_ok: u64,
    appends_unknown: u64,
    history_anomalies: u64,
    primary_frames_after_failover: u64,
    primary_copies_left_running: u64,
    /// Rounds in which the VM did not run again although a host and an etcd quorum remained
    /// (a round that failed to fail over).
    vm_left_down: u64,
    /// Double faults whose restarted primary refused to boot (as it must).
    fresh_boots_refused: u64,
    resyncs: u64,
    leftovers: Vec<String>,
    errors: Vec<String>,
    kill_to_running_ms_p50: f64,
    rounds_detail: Vec<RoundResult>,
}

fn next(seed: &mut u64) -> u64 {
    *seed = crate::xorshift64(*seed);
    *seed
}

fn pick<T: Copy>(seed: &mut u64, v: &[T]) -> T {
    v[(next(seed) % v.len() as u64) as usize]
}

/// The faults of one regular round: 0–3 the pair may survive, then one that ends the primary.
fn draw(seed: &mut u64, fenced: bool, tmpfs: bool) -> Vec<Fault> {
    let mut survivable = vec![
        Fault::Partition(300),
        Fault::OneWay(300),
        Fault::Flap(1500),
        Fault::CorruptFrame,
        Fault::BackupRestart,
        Fault::DaemonStop(200),
    ];
    let mut terminal = vec![
        Fault::HostKill,
        Fault::HostKill,
        Fault::QemuKill,
        Fault::PauseKill,
        Fault::TandemKill,
        Fault::QemuStop,
        Fault::Handover,
        Fault::DaemonStop(3000),
        Fault::Partition(3000),
        Fault::OneWay(3000),
    ];
    if fenced {
        survivable.extend([
            Fault::BackupEtcdCut(2000),
            Fault::PrimaryEtcdCut(2000),
            Fault::EtcdMemberKill,
            Fault::EtcdLeaderKill,
            Fault::EtcdQuorumLoss(2000),
            Fault::EtcdSlow(1500),
            Fault::EtcdAmbiguous(1500),
        ]);
        terminal.extend([Fault::Isolate(3000), Fault::AmbiguousKill, Fault::HostKill]);
    }
    if tmpfs {
        survivable.push(Fault::EnospcHello(2000));
    }
    let mut v: Vec<Fault> = (0..next(seed) % 4)
        .map(|_| pick(seed, &survivable))
        .collect();
    // One etcd member down at a time in a round (a second would be a quorum loss, which
    // has its own fault and restarts what it killed).
    let mut dead = false;
    v.retain(|f| {
        let kills = matches!(f, Fault::EtcdMemberKill | Fault::EtcdLeaderKill);
        let keep = !(kills && dead);
        dead |= kills;
        keep
    });
    v.push(pick(seed, &terminal));
    v
}

/// What every round of the campaign shares.
struct Campaign<'a> {
    exe: &'a Path,
    lab: &'a NetLab,
    etcd: Option<&'a EtcdLab>,
    tls: Option<std::path::PathBuf>,
    dir: &'a Path,
    mem: u64,
    pb: &'a ProgressBar,
}

impl Campaign<'_> {
    fn opts(&self, r: usize, seed: &mut u64) -> Opts<'_> {
        Opts {
            mem: self.mem,
            before: Duration::from_millis(2000 + next(seed) % 2000),
            after: Duration::from_secs(1),
            timeout_ms: 500,
            backup_tmpfs: r.is_multiple_of(5),
            etcd: self.etcd,
            tls_dir: self.tls.clone(),
            vm_id: r as u64,
            consolidate: Some((4.0, "lazy".into())),
            ..Opts::kv(self.exe.to_path_buf(), self.lab, self.dir.to_path_buf())
        }
    }

    /// Runs round `r`: a regular one, a switchover killed at a step, or a double fault.
    fn round(&self, r: usize, seed: &mut u64) -> anyhow::Result<RoundResult> {
        let mut o = self.opts(r, seed);
        if self.etcd.is_some() && r.is_multiple_of(13) {
            return crate::demo::double::run(r, &o, self.pb);
        }
        if r.is_multiple_of(8) {
            let steps = crate::demo::swkill::STEPS;
            let step = steps[(r / 8) % steps.len()];
            o.backup_tmpfs = false;
            return crate::demo::swkill::run(r, &o, step, self.pb);
        }
        o.faults = draw(seed, self.etcd.is_some(), o.backup_tmpfs);
        // The proxy that corrupts a frame on the link needs to see frames: no TLS then.
        if o.faults.iter().any(|f| f.needs_link_proxy()) {
            o.tls_dir = None;
        }
        let faults = o.faults.clone();
        round::run(r, &o, self.pb)
            .with_context(|| format!("round {r} ({faults:?}; logs in {})", self.dir.display()))
    }

    /// Prints a round's one-line result above the progress bar.
    fn say(&self, r: usize, res: &RoundResult) {
        let h = res.history.as_ref();
        crate::demo::say(
            self.pb,
            format!(
                "round {r}: {} | {:.0} ms to running | {} acked keys, {} lost | appends {} ok {} unknown, {} anomalies | primary frames after failover {} | copy stopped {} | leftovers {}{}",
                res.faults.join(", "),
                res.kill_to_running_ms,
                res.acked_keys_checked,
                res.acked_keys_lost,
                h.map_or(0, |h| h.ok),
                h.map_or(0, |h| h.unknown),
                h.map_or(0, |h| h.anomalies()),
                res.primary_frames_after_failover,
                res.primary_copy_stopped,
                res.leftovers.len(),
                if res.ok() || res.faults.iter().any(|f| f.starts_with("backup-kill-primary-restart")) { "" } else { "  <= ANOMALY" }
            ),
        );
    }
}

/// Whether a round passed its checks (a double fault: its restarted primary refused).
fn passed(r: &RoundResult) -> bool {
    if r.faults
        .iter()
        .any(|f| f.starts_with("backup-kill-primary-restart"))
    {
        return r.primary_copy_stopped && r.leftovers.is_empty();
    }
    r.ok()
}

/// Tallies the injected faults by kind, with the failovers each led to.
fn by_fault(rounds: &[RoundResult]) -> BTreeMap<String, Kind> {
    let mut by_fault: BTreeMap<String, Kind> = BTreeMap::new();
    for r in rounds {
        for f in &r.faults {
            let (name, what) = f.rsplit_once(": ").unwrap_or((f, ""));
            let k = by_fault.entry(name.to_string()).or_default();
            k.injected += 1;
            if !passed(r) {
                k.rounds_with_anomalies += 1;
            }
            if what == "failover" {
                k.failovers += 1;
                k.times.push(r.kill_to_running_ms);
            }
        }
    }
    for k in by_fault.values_mut() {
        k.fault_to_running_ms_p50 = tandem_types::stats::quantile(&k.times, 0.5);
    }
    by_fault
}

impl Report {
    /// Sums up the campaign's rounds; `t` is when it started.
    fn new(
        injected: u64,
        rounds: Vec<RoundResult>,
        errors: Vec<String>,
        fencing: bool,
        t: Instant,
    ) -> Report {
        let by_fault = by_fault(&rounds);
        let sum = |f: &dyn Fn(&RoundResult) -> u64| rounds.iter().map(f).sum::<u64>();
        let kill: Vec<f64> = rounds
            .iter()
            .filter(|r| r.kill_to_running_ms > 0.0)
            .map(|r| r.kill_to_running_ms)
            .collect();
        let double = |r: &RoundResult| {
            r.faults
                .iter()
                .any(|f| f.starts_with("backup-kill-primary-restart"))
        };
        Report {
            ok: errors.is_empty() && rounds.iter().all(passed),
            fencing,
            faults: injected,
            rounds: rounds.len(),
            seconds: t.elapsed().as_secs_f64(),
            by_fault,
            acked_keys_checked: sum(&|r| r.acked_keys_checked),
            acked_keys_lost: sum(&|r| r.acked_keys_lost),
            appends_ok: sum(&|r| r.history.as_ref().map_or(0, |h| h.ok)),
            appends_unknown: sum(&|r| r.history.as_ref().map_or(0, |h| h.unknown)),
            history_anomalies: sum(&|r| r.history.as_ref().map_or(0, |h| h.anomalies())),
            primary_frames_after_failover: sum(&|r| r.primary_frames_after_failover),
            primary_copies_left_running: sum(&|r| u64::from(!double(r) && !r.primary_copy_stopped)),
            vm_left_down: errors
                .iter()
                .filter(|e| e.contains("did not fail over") || e.contains("did not resume"))
                .count() as u64,
            fresh_boots_refused: sum(&|r| u64::from(double(r) && r.primary_copy_stopped)),
            resyncs: sum(&|r| r.resyncs),
            leftovers: rounds.iter().flat_map(|r| r.leftovers.clone()).collect(),
            errors,
            kill_to_running_ms_p50: tandem_types::stats::quantile(&kill, 0.5),
            rounds_detail: rounds,
        }
    }

    /// Prints the report as JSON or as the human-readable summary.
    fn print(&self, mem: u64, json: bool) -> anyhow::Result<()> {
        let rep = self;
        if json {
            println!("{}", serde_json::to_string_pretty(rep)?);
            return Ok(());
        }
        println!(
            "fault campaign: {} faults in {} rounds, {:.0} s, kv guest {mem} MiB, 1 Gbit/s link over mutual TLS, {}",
            rep.faults,
            rep.rounds,
            rep.seconds,
            if rep.fencing { "fenced by a 3-member etcd cluster over mutual TLS" } else { "no fencing" }
        );
        for (k, v) in &rep.by_fault {
            println!(
                "  {k:<32} injected {:>3}, led to failover {:>3} (fault -> guest running p50 {:>6.0} ms), rounds with anomalies {}",
                v.injected, v.failovers, v.fault_to_running_ms_p50, v.rounds_with_anomalies
            );
        }
        println!(
            "  checks: {} acknowledged keys read back, {} lost; {} acknowledged appends ({} unknown), {} history anomalies; {} primary frames after failover; {} primary copies left running; VM left down {} times; {} double faults refused a fresh boot; {} re-syncs; {} leftovers; {} errors; fault -> guest running p50 {:.0} ms  =>  {}",
            rep.acked_keys_checked,
            rep.acked_keys_lost,
            rep.appends_ok,
            rep.appends_unknown,
            rep.history_anomalies,
            rep.primary_frames_after_failover,
            rep.primary_copies_left_running,
            rep.vm_left_down,
            rep.fresh_boots_refused,
            rep.resyncs,
            rep.leftovers.len(),
            rep.errors.len(),
            rep.kill_to_running_ms_p50,
            if rep.ok { "OK" } else { "FAILED" }
        );
        for e in &rep.errors {
            println!("  error: {e}");
        }
        Ok(())
    }
}

/// Runs at least `n` faults (fenced by etcd unless `no_etcd`).
pub fn run(n: u64, seed: Option<u64>, mem: u64, no_etcd: bool, json: bool) -> anyhow::Result<()> {
    let exe = crate::product_exe()?;
    let mut lab = NetLab::create(&format!("tz{}", std::process::id() % 100_000), 1000)
        .context("creating the network lab (needs root)")?;
    let dir = tandem_vm::stale::owned_tmpfs_dir("tandem-faults-")?;
    let etcd = if no_etcd {
        None
    } else {
        Some(EtcdLab::start(&mut lab, dir.path(), true)?)
    };
    let keys = dir.path().join("keys");
    let sans = [crate::netlab::BACKUP_IP, crate::netlab::PRIMARY_IP].map(String::from);
    tandem_protect::tls::generate(&keys, &sans, None)?;
    let mut seed = seed.unwrap_or_else(tandem_protect::unix_ms) | 1;
    eprintln!(
        "fault campaign: seed {seed}, logs in {}",
        dir.path().display()
    );
    let pb = indicatif::ProgressBar::new(n);
    pb.enable_steady_tick(Duration::from_millis(200));
    let t = Instant::now();
    let c = Campaign {
        exe: &exe,
        lab: &lab,
        etcd: etcd.as_ref(),
        tls: Some(keys),
        dir: dir.path(),
        mem,
        pb: &pb,
    };
    let (mut injected, mut rounds, mut errors) = (0u64, Vec::new(), Vec::new());
    let mut r = 0;
    while injected < n {
        r += 1;
        match c.round(r, &mut seed) {
            Ok(res) => {
                injected += res.faults.len() as u64;
                c.say(r, &res);
                rounds.push(res);
            }
            Err(e) => {
                let msg = format!("round {r}: {e:#}");
                crate::demo::say(&pb, format!("{msg}  <= ERROR"));
                errors.push(msg);
                if errors.len() >= 5 {
                    break;
                }
            }
        }
        pb.set_position(injected.min(n));
    }
    pb.finish_and_clear();
    let rep = Report::new(injected, rounds, errors, etcd.is_some(), t);
    rep.print(mem, json)?;
    if !rep.ok {
        let kept = dir.keep();
        anyhow::bail!(
            "the fault campaign found a failure (see above; logs kept in {})",
            kept.display()
        );
    }
    Ok(())
}
