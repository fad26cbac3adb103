//! Pieces of a demo round: restarting the backup, the small full tmpfs, waiting for the pair
//! to settle after a fault, and the search for anything a round left behind.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::bail;

use super::daemon::Daemon;
use super::fault;
use super::round::{Epochs, Opts};

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

pub fn common(o: &Opts<'_>, v: &mut Vec<String>) {
    v.extend(["--workload", &o.workload, "--tap-netns", &o.lab.clients].map(String::from));
    v.extend(["--mem".to_string(), o.mem.to_string()]);
}

/// A tmpfs for the backup's directory, just big enough for the mirror, the disk copy and a
/// little more; filled up after the backup allocated its files.
pub fn mount_small_tmpfs(dir: &Path, mem_mib: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let size = format!("size={}m", mem_mib + 64 + 16);
    let st = std::process::Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &size,
            "tandem-fault",
            &dir.display().to_string(),
        ])
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
