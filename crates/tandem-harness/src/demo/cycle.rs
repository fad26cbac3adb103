//! The demo's HA cycle (re-protection and switchover, docs/REPLICATION.md): node A
//! (`tandem primary --listen`) and node B (`tandem backup --peer`) in the lab's two host
//! namespaces, the verifying redis client on the clients' bridge. `tandem switchover` moves
//! the guest to B with A as its backup, a second one fails it back; then A's host dies, B
//! resumes the guest and protects it on A restarted as a backup, and B's host dies in turn:
//! A resumes it. Every acknowledged write must survive all four moves, and redis must never
//! restart.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::netlab::{BACKUP_IP, GUEST_IP, PRIMARY_IP};
use anyhow::{bail, Context};
use indicatif::ProgressBar;
use serde::Serialize;

use super::client::{self, Writers};
use super::daemon::Daemon;
use super::round::Opts;
use super::steps::common;

/// What one move of the guest took.
#[derive(Serialize, Clone, Debug)]
pub struct Move {
    /// `switchover A→B`, `failback B→A`, `host kill A → B`, `host kill B → A`.
    pub what: String,
    /// The epoch the guest resumed from on the other node.
    pub epoch: u64,
    /// Request (switchover) or kill (failover) to the guest running on the other node.
    pub to_running_ms: f64,
    /// Of which the takeover in etcd (one compare-and-swap of the VM's ownership record).
    pub takeover_ms: f64,
    /// Request or kill (failover: restart of the dead node as a backup) until the guest is
    /// protected again (a full copy of RAM and disk, sent while the guest runs).
    pub to_protected_ms: Option<f64>,
    /// The longest client round trip that completed after the move began, measured until
    /// every connection completed one that began after it.
    pub client_gap_ms: f64,
}

/// The HA cycle's result.
#[derive(Serialize, Clone, Debug)]
pub struct CycleResult {
    pub moves: Vec<Move>,
    pub acked_keys_checked: u64,
    pub acked_keys_lost: u64,
    pub first_lost_key: Option<String>,
    /// redis kept its run id through every move (the guest never rebooted).
    pub guest_continued: bool,
    pub client_ops: u64,
}

impl CycleResult {
    pub fn ok(&self) -> bool {
        self.acked_keys_lost == 0 && self.acked_keys_checked > 0 && self.guest_continued
    }
}

pub(super) struct Node {
    pub(super) name: &'static str,
    pub(super) ns: String,
    pub(super) me: String,
    pub(super) peer: String,
    pub(super) dir: PathBuf,
    pub(super) sock: PathBuf,
    pub(super) tap: &'static str,
}

pub(super) fn status(sock: &Path) -> Option<serde_json::Value> {
    tandem_protect::control::ask(sock).ok()
}

fn num(v: &serde_json::Value, path: &[&str]) -> f64 {
    let mut x = v;
    for k in path {
        x = &x[*k];
    }
    x.as_f64().unwrap_or(0.0)
}

/// Waits until the node at `sock` is a backup that committed an epoch after `after`.
pub(super) fn wait_protected(sock: &Path, after: u64, timeout: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        if let Some(v) = status(sock) {
            if v["role"] == "backup"
                && v["state"].as_str().unwrap_or("").starts_with("protecting")
                && v["committed_epoch"].as_u64().unwrap_or(0) > after
            {
                return Ok(());
            }
        }
        if t.elapsed() > timeout {
            bail!(
                "{} was not protecting the guest within {timeout:?}",
                sock.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until the node at `sock` runs the guest after `before` failovers; its last one.
pub(super) fn wait_failover(
    sock: &Path,
    before: u64,
    timeout: Duration,
) -> anyhow::Result<serde_json::Value> {
    let t = Instant::now();
    loop {
        if let Some(v) = status(sock) {
            if v["failovers"].as_u64().unwrap_or(0) > before {
                return Ok(v["last_failover"].clone());
            }
        }
        if t.elapsed() > timeout {
            bail!(
                "{} did not resume the guest within {timeout:?}",
                sock.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Node {
    fn start(&self, o: &Opts<'_>, role: &str, log: PathBuf) -> anyhow::Result<Daemon> {
        self.start_with(o, role, log, &[])
    }

    /// Starts the node in `role` with `extra` flags.
    pub(super) fn start_with(
        &self,
        o: &Opts<'_>,
        role: &str,
        log: PathBuf,
        extra: &[String],
    ) -> anyhow::Result<Daemon> {
        let mut args: Vec<String> = vec![role.into()];
        match role {
            "primary" => args.extend([
                "--backup".into(),
                self.peer.clone(),
                "--listen".into(),
                self.me.clone(),
                "--backup-dir".into(),
                self.dir.display().to_string(),
                "--epoch-ms".into(),
                o.epoch_ms.to_string(),
                "--timeout-ms".into(),
                o.timeout_ms.to_string(),
            ]),
            _ => args.extend([
                "--listen".into(),
                self.me.clone(),
                "--peer".into(),
                self.peer.clone(),
                "--dir".into(),
                self.dir.display().to_string(),
                "--epoch-ms".into(),
                o.epoch_ms.to_string(),
                "--timeout-ms".into(),
                o.timeout_ms.to_string(),
            ]),
        }
        args.extend([
            "--tap".into(),
            self.tap.into(),
            "--control".into(),
            self.sock.display().to_string(),
        ]);
        args.extend(extra.iter().cloned());
        common(o, &mut args)?;
        let _ = std::fs::remove_file(&self.sock);
        let mut d = Daemon::spawn(self.name, &self.ns, &o.exe, &args, log)?;
        let pat = if role == "primary" {
            "guest ready"
        } else {
            "listening on"
        };
        d.wait_line(pat, Duration::from_secs(240))?;
        Ok(d)
    }

    /// `tandem switchover` against this node; (handover epoch, handed-over ms, protected ms).
    fn switchover(&self, exe: &Path) -> anyhow::Result<(u64, f64, f64)> {
        let out = Command::new(exe)
            .args(["switchover", "--json", "--socket"])
            .arg(&self.sock)
            .output()
            .context("running tandem switchover")?;
        if !out.status.success() {
            bail!(
                "tandem switchover on {} failed: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        Ok((
            v["handover_epoch"].as_u64().unwrap_or(0),
            num(&v, &["handed_over_ms"]),
            num(&v, &["protected_again_ms"]),
        ))
    }
}

/// Waits until every client connection completed a round trip that began after `from` (at
/// most 30 s; TCP's retransmission backoff after a long outage takes seconds), then returns
/// the longest round trip that completed since `from`.
fn gap(w: &Writers, from: Instant) -> f64 {
    let deadline = from + Duration::from_secs(30);
    loop {
        let done = {
            let lat = w.latencies.lock().unwrap_or_else(|e| e.into_inner());
            let after = lat
                .iter()
                .filter(|(t, ms)| *t >= from && *t - Duration::from_secs_f64(ms / 1000.0) >= from)
                .count();
            after >= w.acked.len()
        };
        if done || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let lat = w.latencies.lock().unwrap_or_else(|e| e.into_inner());
    lat.iter()
        .filter(|(t, _)| *t >= from)
        .map(|(_, ms)| *ms)
        .fold(0.0, f64::max)
}

/// The two nodes of a cycle in `rdir`: A in the primary's namespace, B in the backup's.
pub(super) fn nodes(o: &Opts<'_>, rdir: &Path) -> (Node, Node) {
    let a = Node {
        name: "node A",
        ns: o.lab.primary.clone(),
        me: format!("{PRIMARY_IP}:7000"),
        peer: format!("{BACKUP_IP}:7000"),
        dir: rdir.join("a"),
        sock: rdir.join("a.sock"),
        tap: "tdp0",
    };
    let b = Node {
        name: "node B",
        ns: o.lab.backup.clone(),
        me: format!("{BACKUP_IP}:7000"),
        peer: format!("{PRIMARY_IP}:7000"),
        dir: rdir.join("b"),
        sock: rdir.join("b.sock"),
        tap: "tdb0",
    };
    (a, b)
}

pub fn run(o: &Opts<'_>, pb: &ProgressBar) -> anyhow::Result<CycleResult> {
    let rdir = o.dir.join("cycle");
    std::fs::create_dir_all(&rdir)?;
    let (a, b) = nodes(o, &rdir);
    pb.set_message("HA cycle: starting node B (backup) and node A (primary)");
    let mut nb = b.start(o, "backup", rdir.join("b.log"))?;
    let mut na = a.start(o, "primary", rdir.join("a.log"))?;
    wait_protected(&b.sock, 2, Duration::from_secs(120))?;
    let addr: SocketAddr = format!("{GUEST_IP}:6379").parse()?;
    let mut probe = client::wait_ready(&o.lab.clients, addr, Duration::from_secs(60))?;
    let (run_id, _) = client::server_identity(&mut probe)?;
    let w = Writers::start(&o.lab.clients, addr, o.conns, o.batch);
    let mut moves = Vec::new();
    std::thread::sleep(o.before);

    for (from, to, what) in [(&a, &b, "switchover A→B"), (&b, &a, "failback B→A")] {
        pb.set_message(format!("HA cycle: {what} (tandem switchover)"));
        let (t, t_unix) = (Instant::now(), tandem_protect::unix_ms());
        let (epoch, handed, protected) = from.switchover(&o.exe)?;
        let fo = status(&to.sock).map(|v| v["last_failover"].clone());
        // When the other node ran the guest (its failover record), else when this one
        // reported the handover done.
        let running = fo
            .as_ref()
            .map(|f| num(f, &["at_unix_ms"]) - t_unix as f64)
            .filter(|ms| *ms > 0.0)
            .unwrap_or(handed);
        moves.push(Move {
            what: what.into(),
            epoch,
            to_running_ms: running,
            takeover_ms: fo.map_or(0.0, |f| num(&f, &["takeover_ms"])),
            to_protected_ms: Some(protected),
            client_gap_ms: 0.0,
        });
        let m = moves.last_mut().expect("just pushed");
        m.client_gap_ms = gap(&w, t);
        std::thread::sleep(o.after);
    }

    // Node A's host dies while it runs the guest: B resumes it and, once A is back as a
    // backup, protects it there.
    pb.set_message("HA cycle: killing node A's host; node B resumes the guest");
    let before = status(&b.sock).map_or(0, |v| v["failovers"].as_u64().unwrap_or(0));
    let t = Instant::now();
    na.kill_host();
    let fo = wait_failover(&b.sock, before, Duration::from_secs(30))?;
    let running = t.elapsed();
    let client_gap_ms = gap(&w, t);
    pb.set_message("HA cycle: restarting node A as a backup; node B copies the guest to it");
    std::thread::sleep(Duration::from_secs(1));
    let restart = Instant::now();
    let mut na = a.start(o, "backup", rdir.join("a-restarted.log"))?;
    wait_protected(&a.sock, 0, Duration::from_secs(120))?;
    moves.push(Move {
        what: "host kill A → B, A restarted as backup".into(),
        epoch: num(&fo, &["epoch"]) as u64,
        to_running_ms: running.as_secs_f64() * 1000.0,
        takeover_ms: num(&fo, &["takeover_ms"]),
        to_protected_ms: Some(restart.elapsed().as_secs_f64() * 1000.0),
        client_gap_ms,
    });
    std::thread::sleep(o.after);

    pb.set_message("HA cycle: killing node B's host; node A resumes the guest");
    let before = status(&a.sock).map_or(0, |v| v["failovers"].as_u64().unwrap_or(0));
    let t = Instant::now();
    nb.kill_host();
    let fo = wait_failover(&a.sock, before, Duration::from_secs(30))?;
    let running = t.elapsed();
    let client_gap_ms = gap(&w, t);
    std::thread::sleep(o.after);
    moves.push(Move {
        what: "host kill B → A (no backup left)".into(),
        epoch: num(&fo, &["epoch"]) as u64,
        to_running_ms: running.as_secs_f64() * 1000.0,
        takeover_ms: num(&fo, &["takeover_ms"]),
        to_protected_ms: None,
        client_gap_ms,
    });
    let ops = w.ops.load(std::sync::atomic::Ordering::Relaxed);
    let acked = w.stop();
    let mut c = client::wait_ready(&o.lab.clients, addr, Duration::from_secs(30))?;
    let (checked, lost, first) = client::verify(&mut c, &acked)?;
    let (run_id_after, _) = client::server_identity(&mut c)?;
    na.terminate(Duration::from_secs(20));
    Ok(CycleResult {
        moves,
        acked_keys_checked: checked,
        acked_keys_lost: lost,
        first_lost_key: first,
        guest_continued: run_id_after == run_id,
        client_ops: ops,
    })
}
