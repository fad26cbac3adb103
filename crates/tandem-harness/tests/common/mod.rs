//! Shared by the integration tests: one `tandem demo --json` run and the checks every round
//! must pass; daemons as child processes whose output lines are watched.
#![allow(dead_code)] // each test binary uses its own part

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// Runs `tandem demo` with `faults` and `extra` flags; checks every round (every acknowledged
/// write read back, redis kept running, no primary frame after failover, exactly one copy,
/// nothing left behind) and returns the rounds.
pub fn demo_rounds(faults: &str, extra: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-lab"))
        .args(["demo", "--json", "--timeout-ms", "2000", "--before", "3"])
        .args(["--after", "2", "--faults", faults])
        .args(extra)
        .output()
        .expect("run tandem demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "tandem demo --faults {faults} failed:\n{stdout}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(v["ok"], true, "{v:#}");
    let rounds = v["rounds"].as_array().unwrap().clone();
    for r in &rounds {
        assert!(r["acked_keys_checked"].as_u64().unwrap() > 0, "{r:#}");
        assert_eq!(r["acked_keys_lost"], 0, "{r:#}");
        assert_eq!(r["guest_continued"], true, "{r:#}");
        assert_eq!(r["primary_frames_after_failover"], 0, "{r:#}");
        assert!(r["primary_frames_captured"].as_u64().unwrap() > 0, "{r:#}");
        assert_eq!(r["primary_copy_stopped"], true, "{r:#}");
        assert_eq!(r["leftovers"].as_array().unwrap().len(), 0, "{r:#}");
    }
    rounds
}

/// One round of [`demo_rounds`].
pub fn demo(faults: &str, extra: &[&str]) -> serde_json::Value {
    demo_rounds(faults, extra).remove(0)
}

/// What each fault of a round led to (`"partition:500: replication carried on"`).
pub fn outcomes(r: &serde_json::Value) -> Vec<String> {
    r["faults"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect()
}

/// A daemon of a test: killed when the test ends early (an orphan would keep the test
/// harness's output open and hang the run).
pub struct Proc(pub Child);

impl std::ops::Deref for Proc {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Runs tandem with stdout and stderr merged, line by line, into a channel.
pub fn spawn(args: &[&str]) -> (Proc, Receiver<String>) {
    let mut c = Command::new(tandem_harness::product_exe().unwrap())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tandem");
    let (tx, rx) = channel();
    let out: Box<dyn std::io::Read + Send> = Box::new(c.stdout.take().unwrap());
    let err: Box<dyn std::io::Read + Send> = Box::new(c.stderr.take().unwrap());
    for stream in [out, err] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                eprintln!("  | {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    (Proc(c), rx)
}

pub fn wait_line(rx: &Receiver<String>, pat: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.contains(pat) => return l,
            Ok(_) => {}
            Err(_) => panic!("no line containing {pat:?} within {timeout:?}"),
        }
    }
}

pub fn number_after(line: &str, key: &str) -> u64 {
    let rest = &line[line
        .find(key)
        .unwrap_or_else(|| panic!("{key:?} in {line:?}"))
        + key.len()..];
    rest.chars()
        .take_while(|c| c.is_ascii_digit())
        .collect::<String>()
        .parse()
        .unwrap()
}

/// A redis connection to the lab guest (10.77.0.2:6379) from the clients' namespace `ns`,
/// retried for up to 60 s; replies wait up to `reply`.
pub fn guest_redis(ns: &str, reply: Duration) -> tandem_harness::kv::KvClient {
    let guest: std::net::SocketAddr = "10.77.0.2:6379".parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = tandem_net::netns::in_netns(Some(ns), move || {
            std::net::TcpStream::connect_timeout(&guest, Duration::from_secs(2))
        })
        .unwrap();
        match s {
            Ok(s) => return tandem_harness::kv::KvClient::from_stream(s, reply).unwrap(),
            Err(e) if Instant::now() > deadline => panic!("redis in the guest: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

#[allow(unused_imports)] // each test binary uses its own part
pub use tandem_test_support::free_port;

/// `tandem status --json` with `args` (e.g. `--socket P`), the run directory `run` if given.
pub fn status_json(
    args: &[&std::ffi::OsStr],
    run: Option<&std::path::Path>,
) -> Vec<serde_json::Value> {
    let mut c = Command::new(tandem_harness::product_exe().unwrap());
    c.args(["status", "--json"]).args(args);
    if let Some(r) = run {
        c.env("TANDEM_RUN_DIR", r);
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The lab guest running `workload` as a VM description for the product's `--vm-config`, with
/// a scratch data disk of `scratch_disk_mib` MiB (0: none), in a directory of its own.
pub fn lab_vm(workload: &str, scratch_disk_mib: u64) -> String {
    // Marked as this test process's: the next `tandem` run after it removes it.
    let dir = tandem_vm::stale::owned_tempdir("tandem-test-vm-", None)
        .unwrap()
        .keep();
    tandem_harness::lab_description(&dir, workload, scratch_disk_mib)
        .unwrap()
        .display()
        .to_string()
}

/// Waits for the next event named `kind` (`listening`, `guest_running`, `acked`,
/// `failed_over`, ...) that `accept` takes, from a daemon run with `--json-events`; returns it.
pub fn wait_event(
    rx: &Receiver<String>,
    kind: &str,
    timeout: Duration,
    accept: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&l) else {
                    continue;
                };
                if v["event"] == kind && accept(&v) {
                    return v;
                }
            }
            Err(_) => panic!("no {kind:?} event within {timeout:?}"),
        }
    }
}

/// Whether `line` is the daemon's event named `kind`.
pub fn is_event(line: &str, kind: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(line).is_ok_and(|v| v["event"] == kind)
}

/// A 3-member etcd cluster on 127.0.0.1 (Debian's etcd-server), its data under `dir/etcd`.
pub fn local_etcd(dir: &std::path::Path) -> tandem_harness::etcd_cluster::Cluster {
    use tandem_harness::etcd_cluster::{Cluster, Member};
    let members = (1..=3)
        .map(|i| Member {
            name: format!("e{i}"),
            ip: "127.0.0.1".into(),
            client_port: free_port(),
            peer_port: free_port(),
        })
        .collect();
    let d = dir.join("etcd");
    std::fs::create_dir_all(&d).unwrap();
    Cluster::start(members, &d, None).expect("etcd cluster (tandem-lab setup installs etcd-server)")
}
