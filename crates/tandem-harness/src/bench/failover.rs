//! `tandem bench --failover`: how long a dead or isolated primary's guest takes to run again on
//! the backup, with etcd fencing and, in the same run, without it (the baseline: no fencing at
//! all). Rounds alternate between the kinds so that the machine's drift hits all alike; each
//! is a full demo round (every acknowledged write read back, the history checked, no frame of
//! the old primary after the failover).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::netlab::NetLab;
use anyhow::Context;
use serde::Serialize;

use crate::demo::etcdlab::EtcdLab;
use crate::demo::fault::Fault;
use crate::demo::round::{self, Opts, RoundResult};
use tandem_types::stats::quantile;

#[derive(Serialize)]
struct Row {
    kind: String,
    rounds: usize,
    fault_to_running_ms_p50: f64,
    fault_to_running_ms_p90: f64,
    fault_to_running_ms_max: f64,
    detection_ms_p50: f64,
    takeover_ms_p50: f64,
    resume_ms_p50: f64,
    all_checks_passed: bool,
}

/// One kind of round: a fault, fenced or not, with the backup's detection timeout.
struct Case {
    kind: &'static str,
    fault: Fault,
    fenced: bool,
    timeout_ms: u64,
}

pub fn run(kills: usize, json: bool) -> anyhow::Result<()> {
    let exe = crate::product_exe()?;
    let mut lab = NetLab::create(&format!("tf{}", std::process::id() % 100_000), 1000)
        .context("creating the network lab (needs root)")?;
    let dir = tandem_vm::stale::owned_tmpfs_dir("tandem-failover-")?;
    let etcd = EtcdLab::start(&mut lab, dir.path(), false)?;
    let keys = dir.path().join("keys");
    let sans = [crate::netlab::BACKUP_IP, crate::netlab::PRIMARY_IP].map(String::from);
    tandem_protect::tls::generate(&keys, &sans, None)?;
    let cases = [
        Case {
            kind: "host-kill, etcd fencing",
            fault: Fault::HostKill,
            fenced: true,
            timeout_ms: 500,
        },
        Case {
            kind: "host-kill, no fencing (baseline)",
            fault: Fault::HostKill,
            fenced: false,
            timeout_ms: 500,
        },
        Case {
            kind: "isolate, etcd fencing, detection 500 ms",
            fault: Fault::Isolate(3000),
            fenced: true,
            timeout_ms: 500,
        },
        Case {
            kind: "isolate, etcd fencing, detection 100 ms",
            fault: Fault::Isolate(3000),
            fenced: true,
            timeout_ms: 100,
        },
    ];
    // Host kills every round; isolations every other one.
    let mut plan = Vec::new();
    for i in 0..kills {
        plan.push(0);
        plan.push(1);
        if i % 2 == 0 {
            plan.push(2);
            plan.push(3);
        }
    }
    let pb = indicatif::ProgressBar::new(plan.len() as u64);
    pb.enable_steady_tick(Duration::from_millis(200));
    let mut done: BTreeMap<usize, Vec<RoundResult>> = BTreeMap::new();
    for (r, &c) in plan.iter().enumerate() {
        let case = &cases[c];
        let o = Opts {
            before: Duration::from_millis(3000 + (r as u64 * 397) % 1500),
            after: Duration::from_secs(1),
            faults: vec![case.fault],
            timeout_ms: case.timeout_ms,
            etcd: case.fenced.then_some(&etcd),
            tls_dir: Some(keys.clone()),
            vm_id: r as u64 + 1,
            consolidate: Some((4.0, "lazy".into())),
            ..Opts::kv(exe.clone(), &lab, dir.path().to_path_buf())
        };
        let res = round::run(r + 1, &o, &pb)
            .with_context(|| format!("round {} ({})", r + 1, case.kind))?;
        crate::demo::say(
            &pb,
            format!(
                "round {}: {}: {:.0} ms to running (detection {:.0} ms, takeover {:.1} ms, resume {:.1} ms){}",
                r + 1,
                case.kind,
                res.kill_to_running_ms,
                res.detection_ms,
                res.takeover_ms,
                res.resume_after_detection_ms,
                if res.ok() { "" } else { "  <= CHECKS FAILED" }
            ),
        );
        done.entry(c).or_default().push(res);
        pb.inc(1);
    }
    pb.finish_and_clear();
    let rows: Vec<Row> = done
        .iter()
        .map(|(&c, rs)| {
            let f = |g: &dyn Fn(&RoundResult) -> f64| rs.iter().map(g).collect::<Vec<f64>>();
            let t = f(&|r| r.kill_to_running_ms);
            Row {
                kind: cases[c].kind.into(),
                rounds: rs.len(),
                fault_to_running_ms_p50: quantile(&t, 0.5),
                fault_to_running_ms_p90: quantile(&t, 0.9),
                fault_to_running_ms_max: t.iter().cloned().fold(0.0, f64::max),
                detection_ms_p50: quantile(&f(&|r| r.detection_ms), 0.5),
                takeover_ms_p50: quantile(&f(&|r| r.takeover_ms), 0.5),
                resume_ms_p50: quantile(&f(&|r| r.resume_after_detection_ms), 0.5),
                all_checks_passed: rs.iter().all(|r| r.ok()),
            }
        })
        .collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("failover: kv guest 256 MiB, 1 Gbit/s link over mutual TLS, etcd over mutual TLS");
        for r in &rows {
            println!(
                "  {:<42} {:>3} rounds: fault -> guest running p50 {:>5.0} ms, p90 {:>5.0} ms, max {:>5.0} ms (detection p50 {:.0} ms, takeover p50 {:.1} ms, resume p50 {:.1} ms); checks {}",
                r.kind, r.rounds, r.fault_to_running_ms_p50, r.fault_to_running_ms_p90, r.fault_to_running_ms_max,
                r.detection_ms_p50, r.takeover_ms_p50, r.resume_ms_p50,
                if r.all_checks_passed { "OK" } else { "FAILED" }
            );
        }
    }
    if !rows.iter().all(|r| r.all_checks_passed) {
        anyhow::bail!("a round failed its checks");
    }
    Ok(())
}
