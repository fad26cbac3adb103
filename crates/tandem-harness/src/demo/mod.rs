//! `tandem demo`: the README's main job. On one machine, in network namespaces that stand in
//! for three hosts, it starts `tandem backup` and `tandem primary` running the `kv` guest
//! (redis), drives a real client from the clients' bridge with live progress, kills the
//! primary (its tandem process and QEMU together, SIGKILL, as a host failure), lets the backup
//! fail over, keeps the client going, and checks that every write the client saw acknowledged
//! before the kill is readable afterwards and that the guest did not reboot.

mod adopt;
mod capture;
mod client;
mod cycle;
mod daemon;
mod debian;
mod debian_run;
pub(crate) mod double;
pub(crate) mod etcdlab;
pub(crate) mod fault;
pub(crate) mod history;
mod libvirt;
pub(crate) mod memsample;
mod pg;
pub use pg::{pgbench_init, DebianVm, PgAt};
mod phases;
pub(crate) mod round;
mod steps;
pub(crate) mod swkill;
pub use steps::read_report;
mod vmdesc;

use std::time::Duration;

use crate::netlab::NetLab;
use anyhow::{bail, Context};
use serde::Serialize;

use round::{Opts, RoundResult};
use tandem_types::stats::quantile;

/// `tandem demo` flags.
#[derive(clap::Args)]
pub struct Args {
    /// The VM to protect: `lab` (tandem's lab guest running redis) or `debian` (the Debian 12
    /// VM from `tandem setup --debian` with PostgreSQL and SSH, described as your own VM).
    #[arg(long, default_value = "lab")]
    pub vm: String,
    /// Failover rounds (each boots a fresh primary and backup and ends with a failover;
    /// default 2 for the lab guest — a host kill and an isolation, fenced by etcd —, 1 with
    /// --faults or --no-etcd, 5 for debian).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Seconds of replicated client load before the kill (a random 0–50 % is added per round).
    #[arg(long, default_value_t = 10)]
    pub before: u64,
    /// Seconds of client load after failover.
    #[arg(long, default_value_t = 5)]
    pub after: u64,
    /// In this round (1-based), kill the primary in the middle of an epoch's transfer.
    #[arg(long)]
    pub mid_transfer_round: Option<usize>,
    /// Epoch length in milliseconds (with `--schedule adaptive`: the longest epoch).
    #[arg(long, default_value_t = 100)]
    pub epoch_ms: u64,
    /// The primary's checkpoint schedule: `adaptive` (the default, with its guest-time
    /// budget) or `fixed` (docs/SCHEDULING.md).
    #[arg(long, default_value = "adaptive")]
    pub schedule: String,
    /// With `--schedule adaptive`: the primary's `--run-per-pause`.
    #[arg(long, default_value_t = 1.0)]
    pub run_per_pause: f64,
    /// With `--schedule adaptive`: the primary's `--converge-pct` (dirty-set convergence).
    #[arg(long)]
    pub converge_pct: Option<f64>,
    /// Backup's failover timeout when the link goes silent.
    #[arg(long, default_value_t = 500)]
    pub timeout_ms: u64,
    /// Replication link rate in Mbit/s (0 = unlimited).
    #[arg(long, default_value_t = 1000)]
    pub rate_mbit: u64,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    pub mem: u64,
    /// Memory codec.
    #[arg(long, default_value = "tandem")]
    pub codec: String,
    /// Client connections and pipelined writes per round trip.
    #[arg(long, default_value_t = 8)]
    pub conns: usize,
    /// Pipelined writes per round trip (with --conns).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Seed for the kill times (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Faults to inject in every round, in order (comma-separated): host-kill, qemu-kill,
    /// pause-kill (QEMU killed inside a checkpoint pause), tandem-kill, qemu-stop, handover, partition:MS, corrupt-frame, backup-restart. A round
    /// whose faults leave the primary running ends with a host kill. Default: host-kill.
    #[arg(long, value_delimiter = ',')]
    pub faults: Vec<fault::Fault>,
    /// Put the backup's directory on a small tmpfs that is full while the guest writes.
    #[arg(long)]
    pub backup_tmpfs: bool,
    /// Keep the backup's mirror as a plain RAM file instead of consolidating its cold pages
    /// (`tandem backup --consolidate`, the demo's default: sharing, patching, compression).
    #[arg(long)]
    pub plain_mirror: bool,
    /// More flags for every round's primary (`--primary-arg=--epoch-part-pages=64`).
    #[arg(long, allow_hyphen_values = true)]
    pub primary_arg: Vec<String>,
    /// How the backup's failover gets the consolidated pages into the standby: `lazy` or
    /// `materialise` (`tandem backup --restore`).
    #[arg(long, default_value = "lazy")]
    pub restore: String,
    /// Fence with a real 3-member etcd cluster in its own namespace (docs/FENCING.md): the
    /// backup takes over only by changing the VM's ownership record. Implied by the etcd faults
    /// and by the default plan (no --rounds, no --faults: round 1 kills the primary's host,
    /// round 2 isolates it from the backup and from etcd for 6 s); with --vm debian, by
    /// --libvirt.
    #[arg(long)]
    pub etcd: bool,
    /// Do not fence with etcd in the default plan (host kills only).
    #[arg(long)]
    pub no_etcd: bool,
    /// Encrypt and mutually authenticate the replication link with lab keys (`tandem keys`);
    /// on in the default plan.
    #[arg(long)]
    pub tls: bool,
    /// How the guest's writable disk is captured: `nbd` (tandem's NBD server is the disk)
    /// or `mirror` (the guest's own raw file in QEMU's block layer, captured with
    /// blockdev-mirror; the guest is then described as your own VM would be).
    #[arg(long, default_value = "nbd")]
    pub disk_capture: String,
    /// With --vm debian: also run pgbench (4 clients) for this many seconds replicated, and
    /// again on the backup after failover (the same VM unprotected).
    #[arg(long)]
    pub pgbench: Option<u64>,
    /// With --pgbench: its scale factor (about 15 MiB of database per unit, loaded while
    /// replicated).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub pgbench_scale: u32,
    /// With --vm debian: boot the VM by hand (a plain QEMU with its own tap on the clients'
    /// bridge) and take it over with `tandem adopt` while psql commits and SSH ticks, instead
    /// of booting it under the primary.
    #[arg(long)]
    pub adopt: bool,
    /// With --adopt: a real libvirtd runs the VM (defined and started by virt-install, its
    /// NIC on the clients' bridge), `tandem vm import` describes it from its live XML and
    /// `tandem adopt --libvirt` takes it over; libvirt then shows it marked and refuses to
    /// start it. The daemons are fenced with etcd (implies --etcd), through which a second
    /// libvirtd, the backup host's, is given the domain; after the failover it is given back
    /// to that libvirt and booted from the backup's copy.
    #[arg(long, requires = "adopt")]
    pub libvirt: bool,
    /// With --vm debian: the VM's RAM in MiB.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(512..=65536))]
    pub debian_mem: u64,
    /// With --vm debian: its virtio devices' interface, `modern` (virtio 1.0 and legacy, QEMU's
    /// and libvirt's default) or `legacy` (the VM description's `legacy_virtio = true`: a
    /// smaller device state to capture in every pause; docs/VM_DESCRIPTION.md).
    #[arg(long, default_value = "modern", value_parser = ["modern", "legacy"], conflicts_with = "adopt")]
    pub debian_virtio: String,
    /// Run only the HA cycle (part of the default plan): `tandem switchover` to the backup
    /// and back, then a host kill with the dead node restarted as a backup and re-protected,
    /// then a host kill of the other node — all fenced by etcd, over TLS.
    #[arg(long)]
    pub cycle: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Summary {
    ok: bool,
    rounds: Vec<RoundResult>,
    acked_keys_checked: u64,
    acked_keys_lost: u64,
    guest_rebooted: bool,
    link: String,
    epoch_ms: u64,
    /// The primary's schedule (`--schedule`).
    schedule: String,
    mem_mib: u64,
    codec: String,
    /// Re-protection and switchover (the default plan's last part, or `--cycle`).
    cycle: Option<cycle::CycleResult>,
}

fn next(seed: &mut u64) -> u64 {
    // xorshift64*: only jitters the kill times.
    *seed ^= *seed >> 12;
    *seed ^= *seed << 25;
    *seed ^= *seed >> 27;
    seed.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// Runs the demo.
pub fn run(a: Args) -> anyhow::Result<()> {
    let json = a.json;
    let r = run_demo(a);
    if let (true, Err(e)) = (json, &r) {
        // A script reading --json gets a document whatever happened.
        let v = serde_json::json!({"ok": false, "error": format!("{e:#}")});
        println!("{v}");
    }
    r
}

fn run_demo(a: Args) -> anyhow::Result<()> {
    match a.vm.as_str() {
        "lab" => {}
        "debian" => return debian_run::run(a),
        other => bail!("--vm {other:?}: use lab or debian"),
    }
    if a.pgbench.is_some() {
        bail!("--pgbench needs --vm debian (the lab guest runs redis)");
    }
    if a.adopt {
        bail!("--adopt needs --vm debian (the VM booted by hand and adopted)");
    }
    // The embedded default: a host kill, then a partition that isolates the primary from the
    // backup and from etcd, both fenced by a real etcd cluster.
    let default_plan = a.rounds.is_none() && a.faults.is_empty() && !a.no_etcd && !a.cycle;
    let rounds = if a.cycle {
        0
    } else {
        a.rounds.unwrap_or(if default_plan { 2 } else { 1 })
    };
    let with_cycle = default_plan || a.cycle;
    if rounds == 0 && !a.cycle {
        bail!("--rounds must be at least 1");
    }
    let exe = crate::product_exe()?;
    let mut lab = NetLab::create(&format!("td{}", std::process::id() % 100_000), a.rate_mbit)
        .context("creating the network lab (tandem demo needs root for network namespaces)")?;
    let dir = tandem_vm::stale::owned_tmpfs_dir("tandem-demo-")?;
    if !matches!(a.restore.as_str(), "lazy" | "materialise") {
        bail!("--restore {:?}: use lazy or materialise", a.restore);
    }
    if a.no_etcd && (a.etcd || a.faults.iter().any(|f| f.needs_etcd())) {
        bail!("--no-etcd cannot be combined with --etcd or the etcd faults");
    }
    let tls_dir = if with_cycle || a.tls {
        let k = dir.path().join("keys");
        // Either node may serve as the backup (the HA cycle): both addresses.
        let sans = [crate::netlab::BACKUP_IP, crate::netlab::PRIMARY_IP].map(String::from);
        tandem_protect::tls::generate(&k, &sans, None)?;
        Some(k)
    } else {
        None
    };
    let etcd = if with_cycle || a.etcd || a.faults.iter().any(|f| f.needs_etcd()) {
        // The proxy only for the faults that need it (it costs some requests ~40 ms).
        let proxied = a.faults.iter().any(|f| f.needs_etcd_proxy());
        Some(etcdlab::EtcdLab::start(&mut lab, dir.path(), proxied)?)
    } else {
        None
    };
    let mut seed = a.seed.unwrap_or_else(tandem_protect::unix_ms) | 1;
    eprintln!(
        "tandem demo: clients on bridge br0 in netns {}, primary host {}, backup host {} (link {}); logs in {}",
        lab.clients, lab.primary, lab.backup, lab.shaping, dir.path().display()
    );
    if tls_dir.is_some() {
        eprintln!("tandem demo: replication link encrypted and mutually authenticated (TLS 1.3, lab keys as `tandem keys` makes them)");
    }
    if let Some(e) = &etcd {
        eprintln!(
            "tandem demo: etcd cluster of 3 members in netns {} ({}, mutual TLS); the VM's ownership record per round: /tandem/vm/ROUND/owner (a takeover is one compare-and-swap, no lease)",
            e.ns,
            e.endpoints().join(",")
        );
    }
    let pb = indicatif::ProgressBar::new_spinner();
    pb.enable_steady_tick(Duration::from_millis(200));
    // What every round and the HA cycle share.
    let base = Opts {
        mem: a.mem,
        epoch_ms: a.epoch_ms,
        schedule: a.schedule.clone(),
        run_per_pause: a.run_per_pause,
        converge_pct: a.converge_pct,
        timeout_ms: a.timeout_ms,
        codec: a.codec.clone(),
        conns: a.conns,
        batch: a.batch,
        etcd: etcd.as_ref(),
        tls_dir: tls_dir.clone(),
        consolidate: (!a.plain_mirror).then(|| (4.0, a.restore.clone())),
        primary_args: a.primary_arg.clone(),
        ..Opts::kv(exe.clone(), &lab, dir.path().to_path_buf())
    };
    let mut results = Vec::new();
    for r in 1..=rounds {
        let jitter = next(&mut seed) % (a.before * 500 + 1);
        let stall = (a.mid_transfer_round == Some(r)).then(|| 20 + next(&mut seed) % 40);
        let o = Opts {
            before: Duration::from_millis(a.before * 1000 + jitter),
            after: Duration::from_secs(a.after),
            stall_epoch: stall,
            faults: if default_plan && r % 2 == 0 {
                vec![fault::Fault::Isolate(6000)]
            } else if a.faults.is_empty() {
                vec![fault::Fault::HostKill]
            } else {
                a.faults.clone()
            },
            backup_tmpfs: a.backup_tmpfs,
            vm_id: r as u64,
            vm_config: match a.disk_capture.as_str() {
                "nbd" => None,
                "mirror" => Some(vmdesc::described_vm(dir.path(), a.mem)?),
                other => bail!("--disk-capture {other:?}: use nbd or mirror"),
            },
            ..base.clone()
        };
        let res = match round::run(r, &o, &pb) {
            Ok(res) => res,
            Err(e) => {
                // Keep the logs of a failed round for the operator.
                let kept = dir.keep();
                return Err(e.context(format!("round {r} (logs kept in {})", kept.display())));
            }
        };
        say(&pb, format!(
            "round {r}: {}; backup resumed epoch {}{} {:.0} ms after the fault ({:.0} ms detection + {:.1} ms resume{}){}; {} keys read back, {} missing an acknowledged write; primary frames after failover: {}; primary copy stopped: {}; leftovers: {}; redis {}",
            res.faults.join(", "),
            res.failover_epoch,
            if res.epochs_in_parts > 0 { format!(" ({} acknowledged epochs were sent in parts)", res.epochs_in_parts) } else { String::new() },
            res.kill_to_running_ms,
            res.detection_ms,
            res.resume_after_detection_ms,
            if res.takeover_ms > 0.0 { format!(", of which {:.1} ms taking the VM over in etcd", res.takeover_ms) } else { String::new() },
            memory_line(&res),
            res.acked_keys_checked,
            res.acked_keys_lost,
            res.primary_frames_after_failover,
            if res.primary_copy_stopped { "yes" } else { "NO" },
            if res.leftovers.is_empty() { "none".to_string() } else { res.leftovers.join(", ") },
            if res.guest_continued == Some(true) { "kept running (same process, no reboot)" } else { "RESTARTED" }
        ));
        results.push(res);
    }
    let cycle = if with_cycle {
        let o = Opts {
            schedule: "fixed".into(),
            before: Duration::from_secs(a.before.min(5)),
            after: Duration::from_secs(a.after.min(3)),
            faults: Vec::new(),
            vm_id: rounds as u64 + 1,
            vm_config: match a.disk_capture.as_str() {
                "mirror" => Some(vmdesc::described_vm(dir.path(), a.mem)?),
                _ => None,
            },
            ..base.clone()
        };
        let c = match cycle::run(&o, &pb) {
            Ok(c) => c,
            Err(e) => {
                let kept = dir.keep();
                return Err(e.context(format!("HA cycle (logs kept in {})", kept.display())));
            }
        };
        for m in &c.moves {
            say(&pb, format!(
                "HA cycle: {}: guest running on the other node from epoch {} after {:.0} ms{}{}; longest client round trip {:.0} ms",
                m.what,
                m.epoch,
                m.to_running_ms,
                if m.takeover_ms > 0.0 { format!(" (of which {:.1} ms taking it over in etcd)", m.takeover_ms) } else { String::new() },
                m.to_protected_ms.map_or(String::new(), |p| format!(", protected again after {:.1} s (full copy while it runs)", p / 1000.0)),
                m.client_gap_ms
            ));
        }
        Some(c)
    } else {
        None
    };
    pb.finish_and_clear();
    if std::env::var_os("TANDEM_DEMO_KEEP").is_some() {
        eprintln!("logs kept in {}", dir.keep().display());
    }
    let s = Summary {
        ok: results.iter().all(|r| r.ok()) && cycle.as_ref().is_none_or(|c| c.ok()),
        cycle,
        acked_keys_checked: results.iter().map(|r| r.acked_keys_checked).sum(),
        acked_keys_lost: results.iter().map(|r| r.acked_keys_lost).sum(),
        guest_rebooted: results.iter().any(|r| r.guest_continued != Some(true)),
        link: lab.shaping.clone(),
        epoch_ms: a.epoch_ms,
        schedule: a.schedule.clone(),
        mem_mib: a.mem,
        codec: a.codec.clone(),
        rounds: results,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print_summary(&s);
    }
    if !s.ok {
        bail!("the checks failed (see the summary above)");
    }
    Ok(())
}

/// The shares of `m` as `tandem status` prints them ("?" when empty).
pub(crate) fn format_shares(m: &std::collections::BTreeMap<String, f64>) -> String {
    match tandem_protect::control::format_shares(m.iter().map(|(k, &v)| (k.as_str(), v))) {
        s if s.is_empty() => "?".into(),
        s => s,
    }
}

/// The mean of each key's share over the rounds (a key a round lacks counts 0 there).
fn mean_shares<'a>(
    all: impl Iterator<Item = &'a std::collections::BTreeMap<String, f64>>,
) -> std::collections::BTreeMap<String, f64> {
    let mut sum = std::collections::BTreeMap::<String, f64>::new();
    let mut n = 0;
    for m in all {
        n += 1;
        for (k, v) in m {
            *sum.entry(k.clone()).or_default() += v;
        }
    }
    sum.values_mut().for_each(|v| *v /= n.max(1) as f64);
    sum
}

fn print_summary(s: &Summary) {
    if let Some(c) = &s.cycle {
        println!(
            "HA cycle: {} moves of the guest (switchover, failback, host kill + re-protection, host kill); {} keys read back, {} missing an acknowledged write; redis {}  =>  {}",
            c.moves.len(),
            c.acked_keys_checked,
            c.acked_keys_lost,
            if c.guest_continued { "never restarted" } else { "RESTARTED" },
            if c.ok() { "OK" } else { "FAILED" }
        );
    }
    if s.rounds.is_empty() {
        return;
    }
    let col = |f: &dyn Fn(&RoundResult) -> f64| s.rounds.iter().map(f).collect::<Vec<f64>>();
    let med = |f: &dyn Fn(&RoundResult) -> f64| quantile(&col(f), 0.5);
    println!(
        "summary: {} failover round(s), {} MiB guest, {} schedule ({} ms longest epoch), codec {}, link {}",
        s.rounds.len(),
        s.mem_mib,
        s.schedule,
        s.epoch_ms,
        s.codec,
        s.link
    );
    println!(
        "  replication      {:.1} MiB raw -> {:.2} MiB sent ({:.3}x, zstd level {}..{}); pause p50 {:.1} ms, p99 {:.1} ms (guest stopped p50 {:.1} ms); encoder {:.0} % of a core ({:.0} % CPU)",
        col(&|r| r.raw_mib).iter().sum::<f64>(),
        col(&|r| r.sent_mib).iter().sum::<f64>(),
        med(&|r| r.sent_over_raw),
        s.rounds.iter().map(|r| r.zstd_levels[0]).min().unwrap_or(0),
        s.rounds.iter().map(|r| r.zstd_levels[2]).max().unwrap_or(0),
        med(&|r| r.pause_ms_p50),
        med(&|r| r.pause_ms_p99),
        med(&|r| r.stopped_ms_p50),
        100.0 * med(&|r| r.encoder_core_share),
        100.0 * med(&|r| r.encoder_cpu_share)
    );
    let (rep, native) = (
        med(&|r| r.rate_replicated.unwrap_or(f64::NAN)),
        med(&|r| r.rate_after_failover.unwrap_or(f64::NAN)),
    );
    println!(
        "  client ({})   {:.0} ops/s replicated vs {:.0} unprotected (the backup after failover): {:.0} %; latency p50 {:.0} ms, p99 {:.0} ms; guest time lost to pauses {:.1} % + suspends {:.1} % (vCPU time lost {:.1} %)",
        s.rounds.first().map_or("", |r| r.client.as_str()),
        rep,
        native,
        100.0 * rep / native,
        med(&|r| r.client_latency_ms_p50),
        med(&|r| r.client_latency_ms_p99),
        100.0 * med(&|r| r.pause_share),
        100.0 * med(&|r| r.suspend_share),
        100.0 * med(&|r| r.cpu_lost_share)
    );
    println!(
        "  schedule         the guest ran {:.1} ms (median) before each pause; epochs cut by {}; output held back last by {}",
        med(&|r| r.ran_ms_p50),
        format_shares(&mean_shares(s.rounds.iter().map(|r| &r.epochs_cut))),
        format_shares(&mean_shares(s.rounds.iter().map(|r| &r.output_held_by)))
    );
    println!(
        "  failover         kill -> guest running {:.0} ms (median; detection {:.0} ms, resume {:.1} ms); client gap {:.0} ms",
        med(&|r| r.kill_to_running_ms),
        med(&|r| r.detection_ms),
        med(&|r| r.resume_after_detection_ms),
        med(&|r| r.client_gap_ms)
    );
    let sum = |f: &dyn Fn(&RoundResult) -> u64| s.rounds.iter().map(f).sum::<u64>();
    println!(
        "  checks           {} keys read back, {} missing an acknowledged write; guest rebooted: {}; primary frames after failover: {}; primary copies left running: {}; leftovers: {}  =>  {}",
        s.acked_keys_checked,
        s.acked_keys_lost,
        if s.guest_rebooted { "YES" } else { "no" },
        sum(&|r| r.primary_frames_after_failover),
        sum(&|r| u64::from(!r.primary_copy_stopped)),
        sum(&|r| r.leftovers.len() as u64),
        if s.ok { "OK" } else { "FAILED" }
    );
}

/// Prints a line above the progress spinner, or to stderr when there is no terminal (the
/// spinner is hidden then and would swallow it).
pub(crate) fn say(pb: &indicatif::ProgressBar, line: String) {
    if pb.is_hidden() {
        eprintln!("{line}");
    } else {
        pb.println(line);
    }
}

/// "; backup kept the replica in N MiB of 256 (pages: …)": the backup's consolidated memory
/// at the failover, and what restoring it cost.
fn memory_line(res: &round::RoundResult) -> String {
    let Some(u) = res
        .memory
        .clone()
        .and_then(|m| serde_json::from_value::<tandem_consolidate::Usage>(m).ok())
    else {
        return String::new();
    };
    let page = tandem_consolidate::PAGE as f64;
    let restore = match res
        .lazy
        .clone()
        .and_then(|l| serde_json::from_value::<tandem_consolidate::LazyStats>(l).ok())
    {
        Some(l) => format!(
            "restored lazily: the guest ran at once, {} pages it touched first were served, all in {:.0} ms after the resume began",
            l.faults, l.done_ms
        ),
        None => format!("restored in {:.0} ms of the resume", res.materialise_ms),
    };
    let restore = if res.first_second_ops.is_finite() && res.later_ops_per_s.is_finite() {
        format!(
            "{restore}; client: {:.0} requests in the first second after failover, {:.0}/s after",
            res.first_second_ops, res.later_ops_per_s
        )
    } else {
        restore
    };
    format!(
        "; backup kept the replica in {:.1} MiB of {:.0} (pages: {} plain, {} zero, {} shared, {} patched, {} compressed), {restore}",
        u.resident() / round::MIB,
        u.pages as f64 * page / round::MIB,
        u.plain + u.pooled_raw,
        u.zero,
        u.shared,
        u.patched,
        u.compressed,
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    #[test]
    fn shares_are_averaged_over_rounds_and_printed_largest_first() {
        let a = BTreeMap::from([("output".to_string(), 1.0)]);
        let b = BTreeMap::from([("output".to_string(), 0.5), ("time".to_string(), 0.498)]);
        let b = BTreeMap::from_iter(b.into_iter().chain([("start".to_string(), 0.002)]));
        let m = super::mean_shares([&a, &b].into_iter());
        assert_eq!(
            super::format_shares(&m),
            "output 75 %, time 25 %, start <1 %"
        );
        assert_eq!(super::format_shares(&BTreeMap::new()), "?");
    }
}
