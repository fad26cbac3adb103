//! The Debian demo's clients, run in the clients' network namespace with the host's own
//! PostgreSQL and OpenSSH clients: a `psql` session that commits numbered rows one at a time
//! and records each commit the server acknowledged, and an SSH session printing a tick every
//! 200 ms. Both keep one TCP connection for the whole round, so a failover that loses the
//! guest's connection state shows as an ended session.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// `psql` against the guest from namespace `ns`, unaligned, tuples only, quiet.
fn psql(ns: &str, host: &str) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, "psql", "-h", host, "-U", "postgres"])
        .args(["-d", "postgres", "-X", "-A", "-t", "-q"])
        .env("PGCONNECT_TIMEOUT", "10");
    c
}

/// Runs one SQL command in a new session; its output, trimmed. A session that cannot connect
/// (psql's status 2) is tried again twice, 2 s apart: under TCG on two loaded cores a guest
/// can miss the three ARP probes of one connection attempt ("No route to host", seen once
/// after a failover of the libvirt round). An SQL error is not retried.
pub fn query(ns: &str, host: &str, sql: &str) -> anyhow::Result<String> {
    query_tries(ns, host, sql, 3)
}

fn query_tries(ns: &str, host: &str, sql: &str, tries: u32) -> anyhow::Result<String> {
    let mut attempt = 0;
    let out = loop {
        let out = psql(ns, host)
            .args(["-v", "ON_ERROR_STOP=1", "-c", sql])
            .output()
            .context("running psql (install postgresql-client with `tandem setup`)")?;
        attempt += 1;
        if out.status.code() == Some(2) && attempt < tries {
            eprintln!(
                "psql could not connect to {host} (attempt {attempt}: {}); trying again in 2 s",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            std::thread::sleep(Duration::from_secs(2));
            continue;
        }
        break out;
    };
    if !out.status.success() {
        bail!(
            "psql -c {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Waits until PostgreSQL in the guest accepts a session from the clients' namespace.
pub fn wait_ready(ns: &str, host: &str, timeout: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        // It polls anyway: one attempt per round, no retry messages while the guest boots.
        match query_tries(ns, host, "SELECT 1", 1) {
            Ok(_) => return Ok(()),
            Err(e) if t.elapsed() > timeout => {
                return Err(e.context(format!("PostgreSQL at {host} does not answer")))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

/// The committing client: one `psql` session, one INSERT per commit (autocommit), each
/// acknowledged commit's id and time recorded as psql prints the row it returned.
pub struct Committer {
    child: Child,
    stop: Arc<AtomicBool>,
    /// Acknowledged ids with the time of the acknowledgement.
    pub acked: Arc<Mutex<Vec<(Instant, u64)>>>,
    /// Why the session ended early, if it did.
    pub failed: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl Committer {
    /// Creates the table if needed and starts committing rows `round * 10^9 + n`.
    pub fn start(ns: &str, host: &str, round: u64) -> anyhow::Result<Committer> {
        query(
            ns,
            host,
            "CREATE TABLE IF NOT EXISTS tandem_demo (id bigint PRIMARY KEY, \
             at timestamptz NOT NULL DEFAULT now(), pad text NOT NULL)",
        )?;
        let mut child = psql(ns, host)
            .args(["-v", "ON_ERROR_STOP=1"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting psql")?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            bail!("psql without pipes");
        };
        let stop = Arc::new(AtomicBool::new(false));
        let acked: Arc<Mutex<Vec<(Instant, u64)>>> = Arc::default();
        let failed: Arc<Mutex<Option<String>>> = Arc::default();
        let (s, a, f) = (stop.clone(), acked.clone(), failed.clone());
        let thread = std::thread::spawn(move || {
            if let Err(e) = commit_loop(stdin, BufReader::new(stdout), round, &s, &a) {
                if !s.load(Ordering::SeqCst) {
                    *f.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                }
            }
        });
        Ok(Committer {
            child,
            stop,
            acked,
            failed,
            thread: Some(thread),
        })
    }

    /// Commits acknowledged so far.
    pub fn count(&self) -> u64 {
        self.acked.lock().unwrap_or_else(|e| e.into_inner()).len() as u64
    }

    /// Stops committing; returns every acknowledged id and whether the session was still
    /// alive (it never lost its connection).
    pub fn stop(mut self) -> (Vec<(Instant, u64)>, Option<String>) {
        self.stop.store(true, Ordering::SeqCst);
        // The loop sees the flag after its current commit, closes psql's input and returns.
        // A commit that never returns (the guest's database stopped answering, e.g. its
        // disk I/O hangs) is a failed session, not a demo that waits forever.
        if let Some(t) = self.thread.take() {
            let asked = Instant::now();
            while !t.is_finished() && asked.elapsed() < COMMIT_STUCK {
                std::thread::sleep(Duration::from_millis(20));
            }
            if !t.is_finished() {
                *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!(
                    "the session's last commit got no answer in {} s: the guest's PostgreSQL stopped answering (its logs are in the guest)",
                    COMMIT_STUCK.as_secs()
                ));
                let _ = self.child.kill();
            }
            let _ = t.join();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let failed = self
            .failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let acked = std::mem::take(&mut *self.acked.lock().unwrap_or_else(|e| e.into_inner()));
        (acked, failed)
    }
}

/// How long a commit may take when the session is stopped before it counts as stuck.
const COMMIT_STUCK: Duration = Duration::from_secs(30);

fn commit_loop(
    mut stdin: ChildStdin,
    mut out: BufReader<std::process::ChildStdout>,
    round: u64,
    stop: &AtomicBool,
    acked: &Mutex<Vec<(Instant, u64)>>,
) -> anyhow::Result<()> {
    let mut line = String::new();
    for n in 1u64.. {
        if stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let id = round * 1_000_000_000 + n;
        writeln!(
            stdin,
            "INSERT INTO tandem_demo (id, pad) VALUES ({id}, repeat('t', 300)) RETURNING id;"
        )?;
        stdin.flush()?;
        line.clear();
        if out.read_line(&mut line)? == 0 {
            bail!("psql ended: the database session was lost");
        }
        let got: u64 = line
            .trim()
            .parse()
            .with_context(|| format!("unexpected psql output {line:?}"))?;
        if got != id {
            bail!("psql returned id {got} for the insert of {id}");
        }
        acked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((Instant::now(), id));
    }
    Ok(())
}

/// Ids of `ids` missing from the table (checked in one query per 5000 ids).
pub fn missing(ns: &str, host: &str, ids: &[u64]) -> anyhow::Result<Vec<u64>> {
    let mut lost = Vec::new();
    for chunk in ids.chunks(5000) {
        let list: Vec<String> = chunk.iter().map(u64::to_string).collect();
        let sql = format!(
            "SELECT x FROM unnest(ARRAY[{}]::bigint[]) AS x \
             WHERE NOT EXISTS (SELECT 1 FROM tandem_demo WHERE id = x)",
            list.join(",")
        );
        for l in query(ns, host, &sql)?.lines().filter(|l| !l.is_empty()) {
            lost.push(l.trim().parse()?);
        }
    }
    Ok(lost)
}

/// What a pgbench run measured.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Pgbench {
    /// Transactions per second (without initial connection time).
    pub tps: f64,
    /// Mean latency in ms.
    pub latency_ms: f64,
}

/// Where pgbench reaches the guest's PostgreSQL.
#[derive(Debug, Clone, Copy)]
pub enum PgAt<'a> {
    /// From network namespace `ns`, at the guest's address `host` (the demo's clients).
    Netns {
        /// The clients' namespace.
        ns: &'a str,
        /// The guest's address.
        host: &'a str,
    },
    /// From the host, at a port of 127.0.0.1 that the VM's description forwards to the
    /// guest's 5432 (recording a trace).
    Port(u16),
}

impl PgAt<'_> {
    /// `pgbench` as user postgres against the guest, ready for its own arguments.
    pub fn pgbench(&self) -> Command {
        let mut c = match *self {
            PgAt::Netns { ns, host } => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "pgbench", "-h", host]);
                c
            }
            PgAt::Port(port) => {
                let mut c = Command::new("pgbench");
                c.args(["-h", "127.0.0.1", "-p", &port.to_string()]);
                c
            }
        };
        c.args(["-U", "postgres"]);
        c
    }
}

/// Initialises pgbench's tables at scale `scale` (first call) in the guest's database.
pub fn pgbench_init(at: PgAt<'_>, scale: u32) -> anyhow::Result<()> {
    let out = at
        .pgbench()
        .args(["-i", "-q", "-s", &scale.to_string(), "postgres"])
        .output()
        .context("running pgbench (install postgresql-client with `tandem setup`)")?;
    if !out.status.success() {
        bail!(
            "pgbench -i: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Runs pgbench's TPC-B-like script with `clients` clients for `secs` seconds.
pub fn pgbench(ns: &str, host: &str, clients: u32, secs: u64) -> anyhow::Result<Pgbench> {
    let out = PgAt::Netns { ns, host }
        .pgbench()
        .arg("-n")
        .args([
            "-c",
            &clients.to_string(),
            "-j",
            "2",
            "-T",
            &secs.to_string(),
            "postgres",
        ])
        .output()
        .context("running pgbench")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "pgbench: {}{}",
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let num = |key: &str| -> Option<f64> {
        let l = text.lines().find(|l| l.starts_with(key))?;
        l.split('=').nth(1)?.split_whitespace().next()?.parse().ok()
    };
    Ok(Pgbench {
        tps: num("tps").context("no tps in pgbench's output")?,
        latency_ms: num("latency average").unwrap_or(f64::NAN),
    })
}

/// An SSH session to the guest that prints a tick every 200 ms.
pub struct Ticker {
    child: Child,
    /// Arrival times of the ticks.
    pub ticks: Arc<Mutex<Vec<Instant>>>,
}

/// `ssh` to root@host from namespace `ns` with the test VM's key.
pub fn ssh(ns: &str, key: &Path, host: &str) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, "ssh", "-i"])
        .arg(key)
        .args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
        ])
        .args([
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=20",
            "-o",
            "LogLevel=ERROR",
        ])
        .arg(format!("root@{host}"));
    c
}

impl Ticker {
    /// Opens the session; returns once the first tick arrived.
    pub fn start(ns: &str, key: &Path, host: &str) -> anyhow::Result<Ticker> {
        let mut child = ssh(ns, key, host)
            .arg("while :; do echo tick; sleep 0.2; done")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting ssh (install openssh-client with `tandem setup`)")?;
        let out = child.stdout.take().context("ssh without a pipe")?;
        let ticks: Arc<Mutex<Vec<Instant>>> = Arc::default();
        let t = ticks.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                if l.is_err() {
                    break;
                }
                t.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Instant::now());
            }
        });
        let started = Instant::now();
        while ticks.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            if started.elapsed() > Duration::from_secs(30) || child.try_wait()?.is_some() {
                bail!("the SSH session to {host} did not start");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Ticker { child, ticks })
    }

    /// Whether the session is still open, and the ticks after `t`.
    pub fn alive_and_ticks_after(&mut self, t: Instant) -> (bool, usize) {
        let alive = matches!(self.child.try_wait(), Ok(None));
        let n = self
            .ticks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|&&x| x > t)
            .count();
        (alive, n)
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `pg_amcheck` on every database of the guest (heap and B-tree checks, indexes against
/// their heap); its output when it found corruption or failed.
pub fn amcheck(ns: &str, key: &Path, host: &str) -> anyhow::Result<Result<(), String>> {
    let out = ssh(ns, key, host)
        // Debian keeps pg_amcheck with the server's binaries, off PATH.
        .arg("runuser -u postgres -- \"$(ls /usr/lib/postgresql/*/bin/pg_amcheck | tail -n 1)\" --install-missing --all --heapallindexed 2>&1")
        .stdin(Stdio::null())
        .output()
        .context("running ssh")?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok(if out.status.success() {
        Ok(())
    } else {
        Err(format!("exit {:?}: {text}", out.status.code()))
    })
}

/// The test VM's files, from `tandem setup --debian`.
#[derive(Clone)]
pub struct DebianVm {
    /// Directory holding them.
    pub dir: PathBuf,
    /// The disk image.
    pub image: PathBuf,
    /// The SSH key for root.
    pub key: PathBuf,
    /// Its description (vm.toml: 1 GiB, 2 vCPUs, the disk, forwarded ports).
    pub desc: PathBuf,
}

impl DebianVm {
    /// The cached VM (in tandem's cache directory, `$TANDEM_CACHE` if set), or what to run
    /// to build it.
    pub fn cached() -> anyhow::Result<DebianVm> {
        let dir = tandem_labguest::debian_dir();
        let vm = DebianVm {
            image: dir.join("debian.qcow2"),
            key: dir.join("id_ed25519"),
            desc: dir.join("vm.toml"),
            dir,
        };
        if let Some(missing) = [&vm.image, &vm.key, &vm.desc]
            .into_iter()
            .find(|p| !p.exists())
        {
            bail!(
                "the Debian test VM is not built ({} missing): run `./tandem setup --debian` (a few minutes, once)",
                missing.display()
            );
        }
        Ok(vm)
    }
}
