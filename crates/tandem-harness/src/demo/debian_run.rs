//! `tandem demo --vm debian`: rounds of boot (or adoption), protect, commit, kill, fail over,
//! check ([`super::debian`]), and their summary.

use std::time::Duration;

use anyhow::{bail, Context};
use serde::Serialize;
use tandem_types::stats::quantile;

use super::etcdlab::EtcdLab;
use indicatif::ProgressBar;

use super::debian::DebianRound;
use super::{debian, next, pg, say, Args};
use crate::netlab::NetLab;

#[derive(Serialize)]
struct DebianSummary {
    ok: bool,
    rounds: Vec<debian::DebianRound>,
    commits_acked: u64,
    commits_lost: u64,
    link: String,
    epoch_ms: u64,
}

/// `tandem demo --vm debian`: rounds of boot, protect, commit, kill, fail over, check.
pub(super) fn run(a: Args) -> anyhow::Result<()> {
    let rounds = a.rounds.unwrap_or(5);
    if rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if a.disk_capture != "nbd" || !a.faults.is_empty() || a.backup_tmpfs {
        bail!("--vm debian always captures its disk by mirroring and kills the primary host; --disk-capture, --faults and --backup-tmpfs are for the lab guest");
    }
    let vm = pg::DebianVm::cached()?;
    let exe = crate::product_exe()?;
    let mut lab = NetLab::create(&format!("td{}", std::process::id() % 100_000), a.rate_mbit)
        .context("creating the network lab (tandem demo needs root for network namespaces)")?;
    // On disk, not /dev/shm: the overlay and the backup's disk copy grow with the guest's writes.
    // Earlier runs' logs stay, the last ten of them.
    tandem_vm::stale::prune_kept(&vm.dir, "tandem-demo-debian-", 10);
    let dir = tandem_vm::stale::owned_tempdir("tandem-demo-debian-", Some(&vm.dir))?;
    let shm = tandem_vm::stale::owned_tmpfs_dir("tandem-demo-debian-")?;
    // With --libvirt the daemons are fenced (as the unit runs them): the backup host's libvirt
    // learns the adopted domain through etcd.
    let mut etcd = if a.libvirt || a.etcd {
        Some(EtcdLab::start(&mut lab, dir.path(), false)?)
    } else {
        None
    };
    let mut seed = a.seed.unwrap_or_else(tandem_protect::unix_ms) | 1;
    eprintln!(
        "tandem demo --vm debian: {rounds} round(s); clients on bridge br0 in netns {}, primary host {}, backup host {} (link {}); logs in {}",
        lab.clients, lab.primary, lab.backup, lab.shaping, dir.path().display()
    );
    let pb = indicatif::ProgressBar::new_spinner();
    pb.enable_steady_tick(Duration::from_millis(200));
    let mut out = Vec::new();
    for r in 1..=rounds {
        let jitter = next(&mut seed) % (a.before * 500 + 1);
        let o = debian::DebianOpts {
            exe: exe.clone(),
            lab: &lab,
            vm: vm.clone(),
            dir: dir.path().to_path_buf(),
            shm: shm.path().to_path_buf(),
            epoch_ms: a.epoch_ms,
            schedule: a.schedule.clone(),
            primary_args: a.primary_arg.clone(),
            timeout_ms: a.timeout_ms,
            codec: a.codec.clone(),
            before: Duration::from_millis(a.before * 1000 + jitter),
            after: Duration::from_secs(a.after),
            pgbench: a.pgbench,
            pgbench_scale: a.pgbench_scale,
            mem: a.debian_mem,
            legacy_virtio: a.debian_virtio == "legacy",
            adopt: a.adopt,
            libvirt: a.libvirt,
            etcd: etcd.as_ref(),
        };
        let res = match debian::round(r, &o, &pb) {
            Ok(res) => res,
            Err(e) => {
                let kept = dir.keep();
                return Err(e.context(format!("round {r} (logs kept in {})", kept.display())));
            }
        };
        line(&pb, &res);
        // Each round's overlay and disk copy can go once it is checked (its logs stay).
        let rdir = dir.path().join(format!("round{r}"));
        let _ = std::fs::remove_file(rdir.join("disk.qcow2"));
        out.push(res);
    }
    pb.finish_and_clear();
    // The members' data (~370 MB of preallocated write-ahead log) goes once they are
    // stopped; their logs stay with the rounds'.
    if let Some(e) = etcd.take() {
        e.stop_and_remove_data();
    }
    let kept = dir.keep();
    eprintln!("logs of every round: {}", kept.display());
    let s = DebianSummary {
        ok: out.iter().all(|r| r.ok()),
        commits_acked: out.iter().map(|r| r.commits_acked).sum(),
        commits_lost: out.iter().map(|r| r.commits_lost).sum(),
        link: lab.shaping.clone(),
        epoch_ms: a.epoch_ms,
        rounds: out,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        let med = |f: &dyn Fn(&debian::DebianRound) -> f64| {
            quantile(&s.rounds.iter().map(f).collect::<Vec<f64>>(), 0.5)
        };
        println!(
            "summary: Debian 12 + PostgreSQL, {} kill(s), link {}, {} ms epochs: {} commits acknowledged, {} lost; boot {:.0} s; pause p50 {:.1} ms p99 {:.1} ms (guest stopped p50 {:.1} ms); guest time lost {:.0} % (vCPU time {:.0} %); {:.1} commits/s replicated vs {:.1} after failover (commit latency p50 {:.0} ms); kill -> guest running {:.0} ms (median)  =>  {}",
            s.rounds.len(),
            s.link,
            s.epoch_ms,
            s.commits_acked,
            s.commits_lost,
            med(&|r| r.boot_s),
            med(&|r| r.pause_ms_p50),
            med(&|r| r.pause_ms_p99),
            med(&|r| r.stopped_ms_p50),
            100.0 * med(&|r| r.paused_share),
            100.0 * med(&|r| r.cpu_lost_share),
            med(&|r| r.commits_per_s_replicated),
            med(&|r| r.commits_per_s_after_failover),
            med(&|r| r.commit_latency_ms_p50),
            med(&|r| r.kill_to_running_ms),
            if s.ok { "OK" } else { "FAILED" }
        );
    }
    if !s.ok {
        bail!("the checks failed (see the rounds above)");
    }
    Ok(())
}

/// One line per round for the operator.
fn line(pb: &ProgressBar, d: &DebianRound) {
    if let Some(a) = &d.adoption {
        say(
            pb,
            format!(
                "round {}: booted {} in {:.0} s; `tandem adopt` had the guest running in its QEMU {:.1} s after it started; guest stopped {:.0} ms; longest wait for a commit while it moved {:.0} ms; old QEMU {}",
                d.round,
                if a.libvirt.is_some() { "by libvirt (virt-install)" } else { "by hand" },
                a.boot_s,
                a.adopt_s,
                a.downtime_ms,
                a.commit_gap_ms,
                if a.source_quit { "quit" } else { "STILL RUNNING" }
            ),
        );
        if let Some(l) = &a.libvirt {
            say(
                pb,
                format!(
                    "round {}: libvirt after the adoption: domain {}, autostart {}, title {:?}; `virsh start` {}; import named {} element(s) not carried over",
                    d.round,
                    l.state_after,
                    l.autostart,
                    l.title,
                    if l.start_refused { "refused by tandem's hook" } else { "NOT REFUSED" },
                    l.unmapped.len()
                ),
            );
        }
        if let Some(b) = &d.libvirt_backup {
            say(
                pb,
                format!(
                    "round {}: the backup host's libvirt after the failover: domain {}, {}, {}; `virsh start` {}; given back after protection ended: {}",
                    d.round,
                    if b.defined { b.state.as_str() } else { "NOT DEFINED" },
                    if b.marked { "marked" } else { "NOT MARKED" },
                    if b.disk_on_copy { "its disk a slice of the backup's copy" } else { "its disk NOT ON THE COPY" },
                    if b.start_refused { "refused by tandem's hook" } else { "NOT REFUSED" },
                    match (b.given_back, b.given_back_lost) {
                        (false, _) => format!(
                            "virsh start FAILED ({})",
                            b.give_back_error.as_deref().unwrap_or("no error recorded")
                        ),
                        (true, Some(0)) => "libvirt booted it from the backup's copy, every acknowledged commit there".to_string(),
                        (true, Some(n)) => format!("libvirt booted it from the backup's copy, {n} COMMITS MISSING"),
                        (true, None) => "libvirt booted it, commits NOT CHECKED".to_string(),
                    }
                ),
            );
        }
        if let Some(h) = &d.hardware {
            say(
                pb,
                format!(
                    "round {}: after a reboot under tandem the guest sees {} ({} PCI functions, {} NICs, vCPUs and flags compared){}",
                    d.round,
                    if h.differences.is_empty() { "the hardware libvirt gave it" } else { "OTHER HARDWARE" },
                    h.before.iter().filter(|l| l.starts_with("pci ")).count(),
                    h.before.iter().filter(|l| l.starts_with("nic ")).count(),
                    if h.differences.is_empty() { String::new() } else { format!(": {}", h.differences.join("; ")) }
                ),
            );
        }
        if let Some(p) = d.pgbench_during_adoption {
            say(
                pb,
                format!(
                    "round {}: pgbench (4 clients) while it moved: {:.1} TPS (latency {:.0} ms)",
                    d.round, p.tps, p.latency_ms
                ),
            );
        }
    }
    if let (Some(a), Some(b)) = (d.pgbench_replicated, d.pgbench_after_failover) {
        say(
            pb,
            format!(
                "round {}: pgbench (4 clients) {:.1} TPS replicated (latency {:.0} ms) vs {:.1} TPS on the same VM after failover, unprotected (latency {:.0} ms): {:.0} %",
                d.round,
                a.tps,
                a.latency_ms,
                b.tps,
                b.latency_ms,
                100.0 * a.tps / b.tps
            ),
        );
    }
    say(
        pb,
        format!(
            "round {}: booted in {:.0} s, protected {:.0} s later; killed {:.1} s into replication; guest running on the backup {:.0} ms after the kill ({:.0} ms detection + {:.1} ms resume); {} commits acknowledged, {} lost; psql session {}, SSH session {} ({} ticks after failover); postmaster start {}; pg_amcheck {}; primary frames after failover {}; leftovers {}  =>  {}",
            d.round,
            d.boot_s,
            d.protect_s,
            d.kill_after_s,
            d.kill_to_running_ms,
            d.detection_ms,
            d.resume_after_detection_ms,
            d.commits_acked,
            d.commits_lost,
            if d.psql_session_survived { "survived" } else { "LOST" },
            if d.ssh_session_survived { "survived" } else { "LOST" },
            d.ssh_ticks_after_failover,
            if d.postmaster_start_before == d.postmaster_start_after { "unchanged" } else { "CHANGED" },
            d.amcheck,
            d.primary_frames_after_failover,
            if d.leftovers.is_empty() { "none".to_string() } else { d.leftovers.join(", ") },
            if d.ok() { "OK" } else { "FAILED" }
        ),
    );
}
