//! Pieces of a demo round: restarting the backup, the small full tmpfs, waiting for the pair
//! to settle after a fault, and the search for anything a round left behind.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::daemon::Daemon;
use crate::netlab::BACKUP_IP;
use indicatif::ProgressBar;

use super::fault::{self, Fault, Proxy};
use super::round::{Epochs, Opts};
use crate::etcd_cluster::ProxyMode;

/// The daemons of a round and how to restart the backup.
pub struct Pair<'a> {
    pub o: &'a Opts<'a>,
    pub rdir: PathBuf,
    pub bargs: Vec<String>,
    pub backup: Daemon,
    pub backups_started: usize,
}

impl Pair<'_> {
    pub fn start_backup(&mut self) -> anyhow::Result<()> {
        self.backups_started += 1;
        let log = self
            .rdir
            .join(format!("backup{}.log", self.backups_started));
        self.backup = Daemon::spawn("backup", &self.o.lab.backup, &self.o.exe, &self.bargs, log)?;
        self.backup
            .wait_line("listening on", Duration::from_secs(60))?;
        Ok(())
    }
}

/// The flags both daemons of a round share. The guest is the description `--vm-config`
/// names, else the lab guest running the round's workload with a 64 MiB scratch data disk.
pub fn common(o: &Opts<'_>, v: &mut Vec<String>) -> anyhow::Result<()> {
    v.extend(["--tap-netns", &o.lab.clients].map(String::from));
    if let Some(d) = &o.tls_dir {
        v.extend(["--tls-dir".to_string(), d.display().to_string()]);
    }
    if let Some(e) = o.etcd {
        // A VM id per round: each round's guest is another VM for etcd.
        v.extend(e.daemon_args(o.vm_id));
    }
    let desc = match &o.vm_config {
        Some(d) => d.clone(),
        None => crate::lab_description(&o.dir, &o.workload, 64)?,
    };
    v.extend(["--vm-config".to_string(), desc.display().to_string()]);
    v.extend(["--mem".to_string(), o.mem.to_string()]);
    if let Some(n) = o.vcpus {
        v.extend(["--vcpus".to_string(), n.to_string()]);
    }
    Ok(())
}

/// A tmpfs for the backup's directory, just big enough for the mirror, the disk copy and a
/// little more; filled up after the backup allocated its files.
pub fn mount_small_tmpfs(dir: &Path, mem_mib: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let size = format!("size={}m,mode=0700", mem_mib + 64 + 16);
    let st = std::process::Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &size,
            "tandem-fault",
            &dir.display().to_string(),
        ])
        .stdout(std::process::Stdio::null())
        .status()?;
    if !st.success() {
        bail!("mount -t tmpfs on {} failed", dir.display());
    }
    Ok(())
}

pub fn fill(dir: &Path) -> u64 {
    use std::io::Write;
    let Ok(mut f) = std::fs::File::create(dir.join("filler")) else {
        return 0;
    };
    let chunk = vec![0x5au8; 1 << 20];
    let mut n = 0u64;
    while f.write_all(&chunk).is_ok() {
        n += chunk.len() as u64;
    }
    let small = vec![0x5au8; 4096];
    while f.write_all(&small).is_ok() {
        n += small.len() as u64;
    }
    n
}

/// The backup's failover report at `path`, once it is there whole (`None` until then: it
/// may be missing or half-written).
pub fn read_report(path: &Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// Waits until the primary acknowledged `n` more epochs (replication carries on) or the
/// backup failed over; true on failover.
pub fn settle(
    ep: &mut Epochs,
    jsonl: &Path,
    report: &Path,
    n: u64,
    timeout: Duration,
) -> anyhow::Result<bool> {
    ep.poll(jsonl);
    let from = ep.acked;
    let t = Instant::now();
    loop {
        if report.exists() {
            return Ok(true);
        }
        ep.poll(jsonl);
        if ep.acked >= from + n {
            return Ok(false);
        }
        if t.elapsed() > timeout {
            bail!(
                "neither progress nor a failover within {timeout:?} after the fault (acked {})",
                ep.acked
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Processes and files of this round still there after it.
pub fn leftovers(rdir: &Path, pids: &[u32]) -> Vec<String> {
    let mut out = Vec::new();
    let needle = rdir.display().to_string();
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for p in procs.flatten() {
            let Ok(pid) = p.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if pid == std::process::id() || !fault::alive(pid) {
                continue;
            }
            let cmd = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(&needle) {
                out.push(format!("process {pid}: {}", cmd.trim()));
            }
        }
    }
    for f in ["backup/mirror.ram", "backup/disk.img", "primary/disk.img"] {
        if rdir.join(f).exists() {
            out.push(format!("file {}", rdir.join(f).display()));
        }
    }
    if let Ok(shm) = std::fs::read_dir("/dev/shm") {
        for e in shm.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".ram") && pids.iter().any(|p| name.contains(&format!("-{p}-"))) {
                out.push(format!("file /dev/shm/{name}"));
            }
        }
    }
    out
}

/// The primary a round injects faults into.
pub struct Target<'a> {
    pub primary: &'a mut Daemon,
    pub qemu: u32,
    pub proxy: Option<&'a Proxy>,
    pub bpids: &'a mut Vec<u32>,
}

/// What the faults did: one line each, and when the last one was injected.
pub struct Injected {
    pub done: Vec<String>,
    pub at: Instant,
    pub at_unix: u64,
}

/// Injects the round's faults one after the other until one of them ends the primary's copy
/// (a host kill is appended when none does).
#[allow(clippy::too_many_arguments)]
pub fn inject_faults(
    round: usize,
    o: &Opts<'_>,
    pb: &ProgressBar,
    pair: &mut Pair<'_>,
    t: Target<'_>,
    ep: &mut Epochs,
    jsonl: &Path,
    report: &Path,
) -> anyhow::Result<Injected> {
    let (mut at, mut at_unix) = (Instant::now(), tandem_protect::unix_ms());
    let mut done = Vec::new();
    let mut faults = o.faults.clone();
    if !faults.last().is_some_and(|f| f.ends_primary()) {
        faults.push(Fault::HostKill);
    }
    for f in faults {
        pb.set_message(format!("round {round}: injecting {f}"));
        (at, at_unix) = (Instant::now(), tandem_protect::unix_ms());
        match f {
            Fault::HostKill => t.primary.kill_host(),
            Fault::AmbiguousKill => {
                // Reset at the next round's start.
                let e = o.etcd.context("ambiguous-host-kill needs --etcd")?;
                e.set_proxy(ProxyMode::DropReplies(u32::MAX));
                t.primary.kill_host();
            }
            Fault::QemuKill => fault::signal(t.qemu, libc::SIGKILL),
            Fault::PauseKill => fault::signal(t.primary.pid(), libc::SIGUSR2),
            Fault::TandemKill => fault::signal(t.primary.pid(), libc::SIGKILL),
            Fault::QemuStop => fault::signal(t.qemu, libc::SIGSTOP),
            Fault::Handover => fault::signal(t.primary.pid(), libc::SIGTERM),
            Fault::Partition(ms) => {
                fault::partition(&o.lab.primary, &[BACKUP_IP])?;
                std::thread::sleep(Duration::from_millis(ms));
                fault::heal(&o.lab.primary);
            }
            Fault::Isolate(ms) => {
                fault::partition(&o.lab.primary, &[BACKUP_IP, crate::netlab::ETCD_NET])?;
                std::thread::sleep(Duration::from_millis(ms));
                fault::heal(&o.lab.primary);
            }
            Fault::BackupEtcdCut(ms) => {
                fault::partition(&o.lab.backup, &[crate::netlab::ETCD_NET])?;
                std::thread::sleep(Duration::from_millis(ms));
                fault::heal(&o.lab.backup);
            }
            Fault::EtcdMemberKill => {
                let e = o.etcd.context("etcd-member-kill needs --etcd")?;
                e.cluster().kill(0);
            }
            Fault::EtcdQuorumLoss(ms) => {
                let e = o.etcd.context("etcd-quorum-loss needs --etcd")?;
                let mut c = e.cluster();
                // The member killed by an earlier etcd-member-kill stays down.
                c.restart(0)?;
                c.kill(1);
                c.kill(2);
                std::thread::sleep(Duration::from_millis(ms));
                c.restart(1)?;
                c.restart(2)?;
            }
            Fault::CorruptFrame => {
                if let Some(p) = t.proxy {
                    p.corrupt();
                }
            }
            Fault::AckStop(ms) => {
                fault::signal(t.primary.pid(), libc::SIGWINCH);
                std::thread::sleep(Duration::from_millis(ms));
                fault::signal(t.primary.pid(), libc::SIGCONT);
            }
            Fault::DaemonStop(ms) => {
                fault::signal(t.primary.pid(), libc::SIGSTOP);
                std::thread::sleep(Duration::from_millis(ms));
                fault::signal(t.primary.pid(), libc::SIGCONT);
            }
            Fault::PrimaryEtcdCut(ms) => {
                fault::partition(&o.lab.primary, &[crate::netlab::ETCD_NET])?;
                std::thread::sleep(Duration::from_millis(ms));
                fault::heal(&o.lab.primary);
            }
            Fault::OneWay(ms) => {
                fault::partition_ways(&o.lab.primary, &[BACKUP_IP], true, false)?;
                std::thread::sleep(Duration::from_millis(ms));
                fault::heal(&o.lab.primary);
            }
            Fault::Flap(ms) => {
                let t0 = Instant::now();
                while t0.elapsed() < Duration::from_millis(ms) {
                    fault::partition(&o.lab.primary, &[BACKUP_IP])?;
                    std::thread::sleep(Duration::from_millis(300));
                    fault::heal(&o.lab.primary);
                    std::thread::sleep(Duration::from_millis(300));
                }
            }
            Fault::EtcdLeaderKill => {
                let e = o.etcd.context("etcd-leader-kill needs --etcd")?;
                let mut c = e.cluster();
                let i = c.leader().unwrap_or(0);
                c.kill(i);
            }
            Fault::EtcdSlow(ms) | Fault::EtcdAmbiguous(ms) => {
                let e = o.etcd.context("the etcd proxy needs --etcd")?;
                e.set_proxy(match f {
                    // Slower than the daemons' 300 ms request timeout.
                    Fault::EtcdSlow(_) => ProxyMode::Delay(Duration::from_millis(450)),
                    _ => ProxyMode::DropReplies(u32::MAX),
                });
                std::thread::sleep(Duration::from_millis(ms));
                e.set_proxy(ProxyMode::Pass);
            }
            Fault::EnospcHello(ms) => {
                let hog = Hog::start(&pair.rdir.join("backup"));
                if let Some(p) = t.proxy {
                    p.corrupt();
                }
                std::thread::sleep(Duration::from_millis(ms));
                hog.stop();
            }
            Fault::BackupRestart => {
                pair.backup.kill_host();
                std::thread::sleep(Duration::from_millis(300));
                pair.start_backup()?;
                t.bpids.push(pair.backup.pid());
            }
        }
        let failed_over =
            f.ends_primary() || settle(ep, jsonl, report, 10, Duration::from_secs(90))?;
        done.push(format!(
            "{f}: {}",
            if failed_over {
                "failover"
            } else {
                "replication carried on"
            }
        ));
        if failed_over {
            break;
        }
    }
    Ok(Injected { done, at, at_unix })
}

/// Waits for the backup's failover report.
pub fn await_report(
    round: usize,
    pb: &ProgressBar,
    pair: &mut Pair<'_>,
    report: &Path,
) -> anyhow::Result<serde_json::Value> {
    pb.set_message(format!("round {round}: waiting for failover"));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = read_report(report) {
            return Ok(v);
        }
        if pair.backup.exited() || Instant::now() > deadline {
            bail!(
                "the backup did not fail over; its log:\n{}",
                std::fs::read_to_string(&pair.backup.log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Another writer on the backup's tmpfs that takes every byte freed there, until stopped
/// (its file is then deleted).
struct Hog {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: std::thread::JoinHandle<()>,
    path: PathBuf,
}

impl Hog {
    fn start(dir: &Path) -> Hog {
        use std::io::Write;
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let path = dir.join("hog");
        let (s, p) = (stop.clone(), path.clone());
        let handle = std::thread::spawn(move || {
            let Ok(mut f) = std::fs::File::create(&p) else {
                return;
            };
            let chunk = vec![0x5au8; 4096];
            while !s.load(Ordering::SeqCst) {
                if f.write_all(&chunk).is_err() {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
        Hog { stop, handle, path }
    }

    fn stop(self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = self.handle.join();
        let _ = std::fs::remove_file(&self.path);
    }
}
