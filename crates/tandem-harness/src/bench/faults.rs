//! `tandem bench --faults N`: a soak of at least N random faults against replicated `kv`
//! guests. Each round starts a backup and a primary, injects a random sequence of faults the
//! pair survives (partitions, a corrupt frame, backup restarts) and one that ends the
//! primary (host, QEMU or tandem killed, QEMU hung, handover), then checks what every demo
//! round checks: no acknowledged write lost, no frame of the primary after the failover,
//! exactly one copy of the guest, nothing left behind.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::ProgressBar;
use serde::Serialize;
use tandem_net::NetLab;

use crate::demo::fault::Fault;
use crate::demo::round::{self, Opts, RoundResult};

#[derive(Serialize, Default)]
struct Kind {
    injected: u64,
    /// Rounds ending in this fault's failover.
    failovers: u64,
    /// Median time from this fault to the guest running on the backup, over its failovers.
    fault_to_running_ms_p50: f64,
    #[serde(skip)]
    times: Vec<f64>,
}

#[derive(Serialize)]
struct Report {
    ok: bool,
    faults: u64,
    rounds: usize,
    seconds: f64,
    by_fault: BTreeMap<String, Kind>,
    acked_keys_checked: u64,
    acked_keys_lost: u64,
    primary_frames_after_failover: u64,
    primary_copies_left_running: u64,
    resyncs: u64,
    leftovers: Vec<String>,
    kill_to_running_ms_p50: f64,
    rounds_detail: Vec<RoundResult>,
}

fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// The faults of one round: 0–3 survivable ones, then one that ends the primary.
fn draw(seed: &mut u64, round: usize) -> Vec<Fault> {
    let survivable = [
        Fault::Partition(500),
        Fault::Partition(1500),
        Fault::CorruptFrame,
        Fault::BackupRestart,
    ];
    let terminal = [
        Fault::HostKill,
        Fault::QemuKill,
        Fault::PauseKill,
        Fault::TandemKill,
        Fault::QemuStop,
        Fault::Handover,
    ];
    let mut v: Vec<Fault> = (0..next(seed) % 4)
        .map(|_| survivable[(next(seed) % survivable.len() as u64) as usize])
        .collect();
    v.push(terminal[(round + (next(seed) % 2) as usize) % terminal.len()]);
    v
}

/// What every round of the soak shares.
struct Soak<'a> {
    exe: &'a Path,
    lab: &'a NetLab,
    dir: &'a Path,
    mem: u64,
    pb: &'a ProgressBar,
}

impl Soak<'_> {
    /// Runs round `r` with a random draw of faults and prints its one-line result.
    fn round(&self, r: usize, seed: &mut u64) -> anyhow::Result<RoundResult> {
        let faults = draw(seed, r);
        let o = Opts {
            mem: self.mem,
            before: Duration::from_millis(2000 + next(seed) % 2000),
            after: Duration::from_secs(1),
            faults: faults.clone(),
            backup_tmpfs: r.is_multiple_of(5),
            ..Opts::kv(self.exe.to_path_buf(), self.lab, self.dir.to_path_buf())
        };
        let res = round::run(r, &o, self.pb)
            .with_context(|| format!("round {r} ({faults:?}; logs in {})", self.dir.display()))?;
        Ok(res)
    }

    /// Prints a round's one-line result above the progress bar.
    fn say(&self, r: usize, res: &RoundResult) {
        crate::demo::say(
            self.pb,
            format!(
                "round {r}: {} | {} acked keys, {} lost, {} primary frames after failover, primary copy stopped: {}, leftovers: {}",
                res.faults.join(", "),
                res.acked_keys_checked,
                res.acked_keys_lost,
                res.primary_frames_after_failover,
                res.primary_copy_stopped,
                res.leftovers.len()
            ),
        );
    }
}

/// Tallies the injected faults by kind, with the failovers each led to.
fn by_fault(rounds: &[RoundResult]) -> BTreeMap<String, Kind> {
    let mut by_fault: BTreeMap<String, Kind> = BTreeMap::new();
    for r in rounds {
        for f in &r.faults {
            let (name, what) = f.split_once(": ").unwrap_or((f, ""));
            let k = by_fault.entry(name.to_string()).or_default();
            k.injected += 1;
            if what == "failover" {
                k.failovers += 1;
                k.times.push(r.kill_to_running_ms);
            }
        }
    }
    for k in by_fault.values_mut() {
        k.fault_to_running_ms_p50 = tandem_protect::stats::quantile(&k.times, 0.5);
    }
    by_fault
}

impl Report {
    /// Sums up the soak's rounds; `t` is when the soak started.
    fn new(injected: u64, rounds: Vec<RoundResult>, t: Instant) -> Report {
        let by_fault = by_fault(&rounds);
        let sum = |f: &dyn Fn(&RoundResult) -> u64| rounds.iter().map(f).sum::<u64>();
        let kill: Vec<f64> = rounds.iter().map(|r| r.kill_to_running_ms).collect();
        Report {
            ok: rounds.iter().all(|r| r.ok()),
            faults: injected,
            rounds: rounds.len(),
            seconds: t.elapsed().as_secs_f64(),
            by_fault,
            acked_keys_checked: sum(&|r| r.acked_keys_checked),
            acked_keys_lost: sum(&|r| r.acked_keys_lost),
            primary_frames_after_failover: sum(&|r| r.primary_frames_after_failover),
            primary_copies_left_running: sum(&|r| u64::from(!r.primary_copy_stopped)),
            resyncs: sum(&|r| r.resyncs),
            leftovers: rounds.iter().flat_map(|r| r.leftovers.clone()).collect(),
            kill_to_running_ms_p50: tandem_protect::stats::quantile(&kill, 0.5),
            rounds_detail: rounds,
        }
    }

    /// Prints the report as JSON or as the human-readable summary.
    fn print(&self, mem: u64, json: bool) -> anyhow::Result<()> {
        let rep = self;
        if json {
            println!("{}", serde_json::to_string_pretty(rep)?);
        } else {
            println!(
                "fault soak: {} faults in {} rounds, {:.0} s, kv guest {mem} MiB, 1 Gbit/s link",
                rep.faults, rep.rounds, rep.seconds
            );
            for (k, v) in &rep.by_fault {
                println!(
                    "  {k:<16} injected {:>3}, led to failover {:>3} (fault -> guest running p50 {:.0} ms)",
                    v.injected, v.failovers, v.fault_to_running_ms_p50
                );
            }
            println!(
                "  checks: {} acknowledged keys read back, {} lost; {} primary frames after failover; {} primary copies left running; {} re-syncs; {} leftovers; fault -> guest running p50 {:.0} ms  =>  {}",
                rep.acked_keys_checked,
                rep.acked_keys_lost,
                rep.primary_frames_after_failover,
                rep.primary_copies_left_running,
                rep.resyncs,
                rep.leftovers.len(),
                rep.kill_to_running_ms_p50,
                if rep.ok { "OK" } else { "FAILED" }
            );
        }
        Ok(())
    }
}

pub fn run(n: u64, seed: Option<u64>, mem: u64, json: bool) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let lab = NetLab::create(&format!("tz{}", std::process::id() % 100_000), 1000)
        .context("creating the network lab (needs root)")?;
    let dir = tempfile::Builder::new()
        .prefix("tandem-faults-")
        .tempdir_in("/dev/shm")?;
    tandem_vm::stale::mark_owned(dir.path())?;
    let mut seed = seed.unwrap_or_else(tandem_protect::unix_ms) | 1;
    let pb = indicatif::ProgressBar::new(n);
    pb.enable_steady_tick(Duration::from_millis(200));
    let t = Instant::now();
    let soak = Soak {
        exe: &exe,
        lab: &lab,
        dir: dir.path(),
        mem,
        pb: &pb,
    };
    let (mut injected, mut rounds) = (0u64, Vec::new());
    while injected < n {
        let r = rounds.len() + 1;
        let res = soak.round(r, &mut seed)?;
        injected += res.faults.len() as u64;
        pb.set_position(injected.min(n));
        soak.say(r, &res);
        rounds.push(res);
    }
    pb.finish_and_clear();
    let rep = Report::new(injected, rounds, t);
    rep.print(mem, json)?;
    if !rep.ok {
        anyhow::bail!("the fault soak found a failure (see above)");
    }
    Ok(())
}
