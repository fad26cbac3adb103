//! A double fault: the backup's host dies, a new backup starts its initial copy, and the
//! primary's host dies before that copy is consistent — no copy of the guest is left. Then the
//! primary's daemon is started again (a unit's `Restart=`): it must refuse to boot a fresh
//! guest (exit status 3, etcd's record names the lost copy) instead of silently throwing the
//! acknowledged writes away.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::netlab::{BACKUP_IP, GUEST_IP};
use anyhow::bail;
use indicatif::ProgressBar;

use super::daemon::Daemon;
use super::phases::RoundCtx;
use super::round::{Opts, RoundResult};
use super::steps::{common, leftovers};

/// Runs round `round`.
pub fn run(round: usize, o: &Opts<'_>, pb: &ProgressBar) -> anyhow::Result<RoundResult> {
    if o.etcd.is_none() {
        bail!("the double fault needs --etcd (without fencing a restarted primary boots fresh)");
    }
    if let Some(e) = o.etcd {
        e.set_proxy(crate::etcd_cluster::ProxyMode::Pass);
        e.cluster().restart_all()?;
    }
    let rdir = o.dir.join(format!("round{round}"));
    std::fs::create_dir_all(&rdir)?;
    let mut bargs: Vec<String> = vec![
        "backup".into(),
        "--listen".into(),
        format!("{BACKUP_IP}:7000"),
        "--dir".into(),
        rdir.join("backup").display().to_string(),
        "--timeout-ms".into(),
        o.timeout_ms.to_string(),
    ];
    common(o, &mut bargs)?;
    let cx = RoundCtx::new(round, o, pb, &rdir);
    let mut pair = cx.start_backup(bargs)?;
    let backup_addr: SocketAddr = format!("{BACKUP_IP}:7000").parse()?;
    let (mut primary, _qemu) = cx.start_primary(backup_addr)?;
    let addr: SocketAddr = format!("{GUEST_IP}:6379").parse()?;
    let client = cx.start_client(addr)?;
    let (_ep, _started) = cx.replicate(&mut primary, &mut pair.backup, &client)?;
    pb.set_message(format!(
        "round {round}: backup host dies; a new backup starts copying"
    ));
    pair.backup.kill_host();
    std::thread::sleep(Duration::from_millis(300));
    pair.start_backup()?;
    pb.set_message(format!(
        "round {round}: primary host dies before the copy is consistent"
    ));
    primary.kill_host();
    // Nothing answers them any more: they give up (at their reply timeout).
    drop(client);
    let pargs = primary_args(&cx)?;
    let t = Instant::now();
    let mut again = Daemon::spawn(
        "primary",
        &o.lab.primary,
        &o.exe,
        &pargs,
        rdir.join("primary-restarted.log"),
    )?;
    let code = loop {
        if let Some(c) = again.exit_code() {
            break Some(c);
        }
        if t.elapsed() > Duration::from_secs(90) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let log = std::fs::read_to_string(rdir.join("primary-restarted.log")).unwrap_or_default();
    let refused = code == Some(3) && log.contains("generation");
    pair.backup.terminate(Duration::from_secs(15));
    again.kill_host();
    std::thread::sleep(Duration::from_millis(300));
    let left = leftovers(&rdir, &[pair.backup.pid(), primary.pid(), again.pid()]);
    Ok(RoundResult {
        round,
        workload: o.workload.clone(),
        kill_point: "backup host killed, a new backup copying, then the primary host".into(),
        faults: vec![format!(
            "backup-kill-primary-restart: {}",
            if refused {
                "fresh boot refused (exit 3): both copies lost, nothing booted in their place"
            } else {
                "NOT REFUSED"
            }
        )],
        primary_copy_stopped: refused,
        leftovers: left,
        ..RoundResult::default()
    })
}

/// The primary's command line as the round started it.
fn primary_args(cx: &RoundCtx<'_>) -> anyhow::Result<Vec<String>> {
    let backup_addr: SocketAddr = format!("{BACKUP_IP}:7000").parse()?;
    cx.primary_args(backup_addr)
}
