//! A round that kills the node handing the guest over at one step of a switchover (`tandem
//! switchover` against node A, whose daemon kills its own host at the step: the last epoch
//! sent, its output released, the handover frame written). Node B must run the guest from
//! what it committed, with every acknowledged write, the history valid, and no frame of A on
//! the clients' bridge once B runs the guest.

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::netlab::GUEST_IP;
use indicatif::ProgressBar;

use super::capture::Capture;
use super::client::{self, Writers};
use super::cycle::{nodes, status, wait_failover, wait_protected};
use super::fault;
use super::history::{self, Appenders};
use super::phases::Clock;
use super::round::{Opts, RoundResult};
use super::steps::leftovers;

/// The steps a switchover can be killed at.
pub const STEPS: [&str; 3] = ["handover-shipped", "handover-released", "handover-sent"];

/// Appenders beside the writers.
const APPENDERS: usize = 4;

/// Runs round `round`: a switchover whose old primary dies at `step`.
pub fn run(
    round: usize,
    o: &Opts<'_>,
    step: &str,
    pb: &ProgressBar,
) -> anyhow::Result<RoundResult> {
    let rdir = o.dir.join(format!("round{round}"));
    std::fs::create_dir_all(&rdir)?;
    if let Some(e) = o.etcd {
        e.set_proxy(crate::etcd_cluster::ProxyMode::Pass);
        e.cluster().restart_all()?;
    }
    let (a, b) = nodes(o, &rdir);
    pb.set_message(format!(
        "round {round}: nodes for a switchover killed at {step}"
    ));
    let mut nb = b.start_with(o, "backup", rdir.join("b.log"), &[])?;
    let extra = ["--fault-kill-at".to_string(), step.to_string()];
    let mut na = a.start_with(o, "primary", rdir.join("a.log"), &extra)?;
    wait_protected(&b.sock, 2, Duration::from_secs(120))?;
    let capture = Capture::start(&o.lab.clients, a.tap)?;
    let clock = Clock::now();
    let addr: SocketAddr = format!("{GUEST_IP}:6379").parse()?;
    let mut probe = client::wait_ready(&o.lab.clients, addr, Duration::from_secs(60))?;
    let (run_id, uptime) = client::server_identity(&mut probe)?;
    let w = Writers::start(&o.lab.clients, addr, o.conns, o.batch);
    let ap = Appenders::start(&o.lab.clients, addr, APPENDERS);
    std::thread::sleep(o.before);
    let before = status(&b.sock).map_or(0, |v| v["failovers"].as_u64().unwrap_or(0));
    pb.set_message(format!("round {round}: switchover, node A dies at {step}"));
    let (t, t_unix) = (Instant::now(), tandem_protect::unix_ms());
    // A dies during it: the command's own result does not matter.
    let _ = Command::new(&o.exe)
        .args(["switchover", "--json", "--socket"])
        .arg(&a.sock)
        .output();
    let fo = wait_failover(&b.sock, before, Duration::from_secs(60))?;
    let running_unix = fo["at_unix_ms"].as_u64().unwrap_or(t_unix);
    let a_stopped = {
        let t = Instant::now();
        while !na.exited() && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(100));
        }
        na.exited()
    };
    std::thread::sleep(o.after);
    let acked = w.stop();
    let hist = ap.stop();
    let mut c = client::wait_ready(&o.lab.clients, addr, Duration::from_secs(30))?;
    let (checked, lost, first_lost) = client::verify(&mut c, &acked)?;
    let lists = history::read_lists(&mut c, APPENDERS)?;
    let check = history::check(&hist, &lists);
    let (run_id_after, uptime_after) = client::server_identity(&mut c)?;
    let running = clock.at(running_unix) + Duration::from_millis(200);
    let after = capture.after(running) as u64;
    let captured = capture.total() as u64;
    drop(capture);
    nb.terminate(Duration::from_secs(15));
    na.kill_host();
    std::thread::sleep(Duration::from_millis(300));
    let left = leftovers(&rdir, &[nb.pid(), na.pid()]);
    let _ = t;
    Ok(RoundResult {
        round,
        workload: "kv".into(),
        schedule: o.schedule.clone(),
        client: format!("{}x{}", o.conns, o.batch),
        epoch_ms: o.epoch_ms,
        kill_point: format!("switchover, node A killed at {step}"),
        failover_epoch: fo["epoch"].as_u64().unwrap_or(0),
        failover_reason: fo["reason"].as_str().unwrap_or("").into(),
        takeover_ms: fo["takeover_ms"].as_f64().unwrap_or(0.0),
        kill_to_running_ms: running_unix.saturating_sub(t_unix) as f64,
        acked_keys_checked: checked,
        acked_keys_lost: lost,
        first_lost_key: first_lost,
        guest_continued: Some(run_id == run_id_after && uptime_after >= uptime),
        redis_run_id: run_id_after,
        redis_uptime_before_s: uptime,
        redis_uptime_after_s: uptime_after,
        faults: vec![format!("switchover-kill:{step}: failover")],
        primary_frames_captured: captured,
        primary_frames_after_failover: after,
        primary_copy_stopped: a_stopped && !fault::alive(na.pid()),
        leftovers: left,
        history: Some(check),
        ..RoundResult::default()
    })
}
