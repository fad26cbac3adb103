//! `tandem bench --replication`: for each workload and epoch length, one demo round (backup and
//! primary in namespaces, rate-limited link, host failure of the primary at the end of the
//! measured window). The guest's throughput on the backup after failover — the same guest,
//! same network path, no replication — is the native baseline of the same run; bytes on the
//! link are compared with the Remus baseline of the same epochs (raw dirty pages + device
//! state + disk writes).

use std::time::Duration;

use crate::netlab::NetLab;
use anyhow::Context;

use super::Args;
use crate::demo::round::{self, Opts, RoundResult};

pub fn run(a: &Args) -> anyhow::Result<()> {
    let workloads = if a.workloads.is_empty() {
        ["kv", "sqlite", "compile", "idle"]
            .map(String::from)
            .to_vec()
    } else {
        a.workloads.clone()
    };
    for w in &workloads {
        tandem_labguest::check_workload(w)?;
    }
    let epochs = if a.epochs_ms.is_empty() {
        vec![25, 100]
    } else {
        a.epochs_ms.clone()
    };
    let schedules = if a.schedules.is_empty() {
        vec!["fixed".to_string()]
    } else {
        a.schedules.clone()
    };
    let links = if a.links.is_empty() {
        vec!["plain".to_string()]
    } else {
        a.links.clone()
    };
    if let Some(l) = links
        .iter()
        .find(|l| !["plain", "tls"].contains(&l.as_str()))
    {
        anyhow::bail!("--links {l:?}: use plain and/or tls");
    }
    if let Some(s) = schedules.iter().find(|s| !SCHEDULES.contains(&s.as_str())) {
        anyhow::bail!("--schedules {s:?}: use any of {}", SCHEDULES.join(", "));
    }
    let clients = clients(a)?;
    let devstates: Vec<Option<String>> = if a.devstate.is_empty() {
        vec![None]
    } else {
        a.devstate.iter().cloned().map(Some).collect()
    };
    if let Some(d) = a
        .devstate
        .iter()
        .find(|d| !["migrate", "xen-save"].contains(&d.as_str()))
    {
        anyhow::bail!("--devstate {d:?}: use migrate and/or xen-save");
    }
    let exe = crate::product_exe()?;
    let lab = NetLab::create(&format!("tb{}", std::process::id() % 100_000), a.rate_mbit)
        .context("creating the network lab (needs root)")?;
    let dir = tempfile::Builder::new()
        .prefix("tandem-bench-")
        .tempdir_in("/dev/shm")?;
    let pb = indicatif::ProgressBar::new_spinner();
    pb.enable_steady_tick(Duration::from_millis(200));
    let mut rows: Vec<RoundResult> = Vec::new();
    let mut n = 0;
    let keys = dir.path().join("keys");
    if links.iter().any(|l| l == "tls") {
        tandem_protect::tls::generate(&keys, &[crate::netlab::BACKUP_IP.to_string()], None)?;
    }
    let axes: Vec<(&String, u64, &String, &Option<String>)> = schedules
        .iter()
        .flat_map(|s| epochs.iter().map(move |&ms| (s, ms)))
        .flat_map(|(s, ms)| links.iter().map(move |l| (s, ms, l)))
        .flat_map(|(s, ms, l)| devstates.iter().map(move |d| (s, ms, l, d)))
        .collect();
    for w in &workloads {
        // The client axis applies to kv (the other workloads bring their own load).
        let clients = if tandem_labguest::serves_kv(w) {
            &clients[..]
        } else {
            &clients[..1]
        };
        let precopies: Vec<Option<u32>> = if a.precopy_rounds.is_empty() {
            vec![None]
        } else {
            a.precopy_rounds.iter().copied().map(Some).collect()
        };
        for (&(schedule, ms, link, devstate), &(conns, batch), &pre) in axes
            .iter()
            .flat_map(|x| clients.iter().map(move |c| (x, c)))
            .flat_map(|(x, c)| precopies.iter().map(move |p| (x, c, p)))
        {
            n += 1;
            // `adaptive-nostop`: the adaptive schedule without its stop threshold;
            // `adaptive-nobudget`: without its guest-time budget; `adaptive-wall`: with the
            // budget charging pauses in wall time rather than the guest's vCPU time.
            let (sched, stop, budget) = match schedule.as_str() {
                "adaptive-nostop" => ("adaptive", Some(0), None),
                "adaptive-nobudget" => ("adaptive", a.stop_budget_ms, Some(0.0)),
                "adaptive-wall" => ("adaptive", a.stop_budget_ms, None),
                s => (s, a.stop_budget_ms, None),
            };
            let o = Opts {
                workload: w.clone(),
                mem: a.mem,
                vcpus: a.vcpus,
                epoch_ms: ms,
                schedule: sched.into(),
                run_per_pause: a.run_per_pause,
                converge_pct: a.converge_pct,
                stop_budget_ms: stop,
                time_budget_pct: budget,
                precopy_rounds: pre,
                primary_args: a
                    .primary_arg
                    .iter()
                    .cloned()
                    .chain((schedule == "adaptive-wall").then(|| "--time-budget-clock=wall".into()))
                    .collect(),
                devstate: devstate.clone(),
                conns,
                batch,
                before: Duration::from_secs(a.seconds),
                after: Duration::from_secs(a.seconds),
                tls_dir: (link == "tls").then(|| keys.clone()),
                ..Opts::kv(exe.clone(), &lab, dir.path().to_path_buf())
            };
            let mut r = round::run(n, &o, &pb)
                .with_context(|| format!("{w}, {schedule} schedule at {ms} ms"))?;
            r.schedule.clone_from(schedule);
            crate::demo::say(&pb, line(&r));
            rows.push(r);
        }
    }
    pb.finish_and_clear();
    if let Some(path) = &a.plots {
        let command: Vec<String> = std::env::args().collect();
        std::fs::write(path, super::plot::html(&rows, &command.join(" ")))
            .with_context(|| format!("writing the plots to {}", path.display()))?;
        eprintln!("plots: {}", path.display());
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "replication, {} MiB guest, link {}, {} s replicated + {} s after failover per row",
            a.mem, lab.shaping, a.seconds, a.seconds
        );
        for r in &rows {
            println!("{}", line(r));
        }
    }
    Ok(())
}

/// The primary schedules `--schedules` takes.
const SCHEDULES: &[&str] = &[
    "fixed",
    "adaptive",
    "adaptive-nostop",
    "adaptive-nobudget",
    "adaptive-wall",
];

/// The kv client axis as (connections, requests in flight each): `latency` is
/// `--latency-conns` connections with one request in flight, `pipelined` is `--conns` ×
/// `--batch`, `demo` is `tandem demo`'s client (8 × 32); without `--clients`, the one client
/// `--conns` × `--batch`.
fn clients(a: &Args) -> anyhow::Result<Vec<(usize, usize)>> {
    if a.clients.is_empty() {
        return Ok(vec![(a.conns, a.batch)]);
    }
    a.clients
        .iter()
        .map(|c| match c.as_str() {
            "latency" => Ok((a.latency_conns.max(1), 1)),
            "pipelined" => Ok((a.conns.max(1), a.batch.max(1))),
            // `tandem demo`'s own client.
            "demo" => Ok((8, 32)),
            other => anyhow::bail!("--clients {other:?}: use latency, pipelined and/or demo"),
        })
        .collect()
}

/// The median run before a pause, the epochs' shares by why they ended and by what held
/// their waiting output back, largest first.
fn cuts(r: &RoundResult) -> String {
    format!(
        "run p50 {:.1} ms, cut by {}, output held by {}",
        r.ran_ms_p50,
        crate::demo::format_shares(&r.epochs_cut),
        crate::demo::format_shares(&r.output_held_by)
    )
}

fn line(r: &RoundResult) -> String {
    let thr = match (r.rate_replicated, r.rate_after_failover) {
        (Some(x), Some(y)) => {
            let p = if y < 10.0 { 2 } else { 0 };
            format!(
                "{x:.p$} vs native {y:.p$} {}/s ({:.0} %)",
                r.unit,
                100.0 * x / y
            )
        }
        _ => "throughput n/a".into(),
    };
    let lat = if r.client_latency_ms_p50.is_nan() {
        String::new()
    } else {
        format!(
            " | latency p50 {:.0} ms p99 {:.0} ms",
            r.client_latency_ms_p50, r.client_latency_ms_p99
        )
    };
    format!(
        "{:<8} {:>15} {:>3} ms {:>6}{}{} | {thr}{lat} | link {:.2} MiB vs Remus {:.1} MiB ({:.3}x, zstd level {}..{} median {}) | pause p50 {:.1} ms p99 {:.1} ms, guest stopped p50 {:.1} ms ({:.0} % of the time{}, vCPU time lost {:.0} %; p50 stop/harvest/copy/devstate/cont {}) | ack p50 {:.1} ms | {} | encoder {:.0} % of a core ({:.0} % CPU) | first epoch {} pages, pause {:.1} ms{}{} | daemons' memory peak primary {:.0} MiB backup {:.0} MiB | failover {:.0} ms after kill ({:.0} detection + {:.1} resume)",
        r.workload,
        r.schedule,
        r.epoch_ms,
        if tandem_labguest::serves_kv(&r.workload) { r.client.as_str() } else { "" },
        if r.tls { " TLS" } else { "" },
        if r.devstate == "migrate" {
            " devstate migrate"
        } else {
            ""
        },
        r.sent_mib,
        r.raw_mib,
        r.sent_over_raw,
        r.zstd_levels[0],
        r.zstd_levels[2],
        r.zstd_levels[1],
        r.pause_ms_p50,
        r.pause_ms_p99,
        r.stopped_ms_p50,
        100.0 * r.pause_share,
        if r.suspend_share > 0.0 {
            format!(" + {:.1} % suspended", 100.0 * r.suspend_share)
        } else {
            String::new()
        },
        100.0 * r.cpu_lost_share,
        r.pause_components_ms_p50
            .iter()
            .map(|c| format!("{c:.2}"))
            .collect::<Vec<_>>()
            .join("/"),
        r.ack_ms_p50,
        cuts(r),
        100.0 * r.encoder_core_share,
        100.0 * r.encoder_cpu_share,
        r.first_epoch_pages,
        r.first_epoch_pause_ms,
        r.precopy_rounds
            .map_or(String::new(), |n| format!(" (precopy rounds {n})")),
        if r.epochs_in_parts > 0 {
            format!(", {} epochs in parts", r.epochs_in_parts)
        } else {
            String::new()
        },
        r.daemon_anon_mib_peak[0],
        r.daemon_anon_mib_peak[1],
        r.kill_to_running_ms,
        r.detection_ms,
        r.resume_after_detection_ms
    )
}
