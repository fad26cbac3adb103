//! Re-protection and planned switchover, with real processes on a lab bridge: node A
//! (`tandem primary --listen`) protects a kv guest on node B (`tandem backup --peer`);
//! `tandem switchover` moves the guest to B with A as its backup, a second one fails back;
//! then A dies as a host does, B resumes the guest and protects it again on A restarted as a
//! backup, and B dies in turn: A resumes it. Every key acknowledged on the way survives, and
//! the guest (redis) never restarts.

mod common;

use std::process::Command;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use common::{free_port, spawn, wait_event, Proc};

struct Lab {
    lab: tandem_harness::netlab::NetLab,
    a: String,
    b: String,
    asock: std::path::PathBuf,
    bsock: std::path::PathBuf,
    adir: tempfile::TempDir,
    bdir: tempfile::TempDir,
    _run: tempfile::TempDir,
    vm: String,
}

impl Lab {
    fn common(&self, tap: &str) -> Vec<String> {
        [
            "--vm-config",
            &self.vm,
            "--tap-netns",
            &self.lab.clients,
            "--tap",
            tap,
            "--json-events",
        ]
        .map(String::from)
        .to_vec()
    }

    /// Node A as `tandem primary --listen A`.
    fn primary_a(&self) -> (Proc, Receiver<String>) {
        let mut args: Vec<String> = [
            "primary",
            "--backup",
            &self.b,
            "--listen",
            &self.a,
            "--backup-dir",
            self.adir.path().to_str().unwrap(),
            "--control",
            self.asock.to_str().unwrap(),
            "--timeout-ms",
            "2000",
        ]
        .map(String::from)
        .to_vec();
        args.extend(self.common("tdp0"));
        let r: Vec<&str> = args.iter().map(String::as_str).collect();
        spawn(&r)
    }

    /// A node as `tandem backup --listen ME --peer PEER`.
    fn backup(&self, a_side: bool) -> (Proc, Receiver<String>) {
        let (me, peer, dir, sock, tap) = if a_side {
            (&self.a, &self.b, &self.adir, &self.asock, "tdp0")
        } else {
            (&self.b, &self.a, &self.bdir, &self.bsock, "tdb0")
        };
        let mut args: Vec<String> = [
            "backup",
            "--listen",
            me,
            "--peer",
            peer,
            "--dir",
            dir.path().to_str().unwrap(),
            "--control",
            sock.to_str().unwrap(),
            "--timeout-ms",
            "2000",
        ]
        .map(String::from)
        .to_vec();
        args.extend(self.common(tap));
        let r: Vec<&str> = args.iter().map(String::as_str).collect();
        spawn(&r)
    }
}

fn status(sock: &std::path::Path) -> serde_json::Value {
    let out = Command::new(tandem_harness::product_exe().unwrap())
        .args(["status", "--json", "--socket"])
        .arg(sock)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0].clone()
}

/// Waits until the node at `sock` is the backup of a protected guest with an epoch committed
/// after `after`.
fn wait_protected(sock: &std::path::Path, after: u64) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Ok(o) = Command::new(tandem_harness::product_exe().unwrap())
            .args(["status", "--json", "--socket"])
            .arg(sock)
            .output()
        {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&o.stdout) {
                let v = &v[0];
                if v["role"] == "backup"
                    && v["state"].as_str().unwrap_or("").starts_with("protecting")
                    && v["committed_epoch"].as_u64().unwrap_or(0) > after
                {
                    return v.clone();
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} never protected",
            sock.display()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn switchover(sock: &std::path::Path) -> serde_json::Value {
    let out = Command::new(tandem_harness::product_exe().unwrap())
        .args(["switchover", "--json", "--socket"])
        .arg(sock)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "switchover failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn kv(ns: &str) -> tandem_harness::kv::KvClient {
    common::guest_redis(ns, Duration::from_secs(60))
}

/// Writes `key`, then checks every key written so far.
fn write_and_check(c: &mut tandem_harness::kv::KvClient, keys: &mut Vec<String>, key: &str) {
    c.set(key.as_bytes(), b"acked").unwrap();
    keys.push(key.to_string());
    for k in keys.iter() {
        assert_eq!(
            c.get(k.as_bytes()).unwrap().as_deref(),
            Some(&b"acked"[..]),
            "key {k} lost"
        );
    }
}

fn run_id(c: &mut tandem_harness::kv::KvClient) -> String {
    let info = c.info("server").unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .unwrap_or("")
        .trim()
        .to_string()
}

/// SIGKILL, as a host failure: its QEMU dies with it (parent-death signal).
fn kill_host(p: &mut Proc, sock: &std::path::Path) {
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(p.id() as i32, libc::SIGKILL) };
    p.wait().unwrap();
    let _ = std::fs::remove_file(sock);
}

#[test]
fn switchover_failback_and_reprotection_after_failover() {
    let lab =
        tandem_harness::netlab::NetLab::create(&format!("ts{}", std::process::id() % 100_000), 0)
            .expect("network lab (this test needs root)");
    let run = tempfile::tempdir().unwrap();
    let l = Lab {
        a: format!("127.0.0.1:{}", free_port()),
        b: format!("127.0.0.1:{}", free_port()),
        asock: run.path().join("a.sock"),
        bsock: run.path().join("b.sock"),
        adir: tempfile::tempdir_in("/dev/shm").unwrap(),
        bdir: tempfile::tempdir_in("/dev/shm").unwrap(),
        _run: run,
        vm: common::lab_vm("kv", 32),
        lab,
    };
    let (mut nb, brx) = l.backup(false);
    wait_event(&brx, "listening", Duration::from_secs(60), |_| true);
    let (mut na, arx) = l.primary_a();
    wait_protected(&l.bsock, 3);
    let mut c = kv(&l.lab.clients);
    let rid = run_id(&mut c);
    let mut keys = Vec::new();
    write_and_check(&mut c, &mut keys, "k-on-a");

    // Planned switchover: B runs the guest, A is its backup.
    let s = switchover(&l.asock);
    let epoch = s["handover_epoch"].as_u64().unwrap();
    assert_eq!(status(&l.bsock)["role"], "primary");
    assert_eq!(status(&l.asock)["role"], "backup");
    assert!(status(&l.asock)["committed_epoch"].as_u64().unwrap() > epoch);
    write_and_check(&mut c, &mut keys, "k-on-b");

    // Failback: A runs it again, B is its backup.
    let s = switchover(&l.bsock);
    assert_eq!(status(&l.asock)["role"], "primary");
    assert_eq!(status(&l.bsock)["switchovers"], 1);
    let epoch = s["handover_epoch"].as_u64().unwrap();
    write_and_check(&mut c, &mut keys, "k-on-a-again");
    wait_protected(&l.bsock, epoch + 3);

    // A dies as a host does: B resumes the guest, and protects it on A restarted as a backup.
    kill_host(&mut na, &l.asock);
    wait_event(&brx, "failed_over", Duration::from_secs(30), |_| true);
    write_and_check(&mut c, &mut keys, "k-after-failover");
    drop(arx);
    let (mut na, arx) = l.backup(true);
    let v = wait_protected(&l.asock, 0);
    assert_eq!(status(&l.bsock)["role"], "primary");
    write_and_check(&mut c, &mut keys, "k-reprotected");
    wait_protected(&l.asock, v["committed_epoch"].as_u64().unwrap() + 3);

    // B dies too: A resumes the guest from its new replica, nothing acknowledged is lost.
    kill_host(&mut nb, &l.bsock);
    wait_event(&arx, "failed_over", Duration::from_secs(30), |_| true);
    write_and_check(&mut c, &mut keys, "k-on-a-after-second-failover");
    assert_eq!(
        run_id(&mut c),
        rid,
        "redis restarted: the guest did not continue"
    );
    // SAFETY: SIGTERM to our own child.
    unsafe { libc::kill(na.id() as i32, libc::SIGTERM) };
    let _ = na.wait();
}

/// The demo's HA cycle, fenced by a 3-member etcd cluster over mutual TLS, with the replication
/// link over mutual TLS, and the guest's disk captured by mirroring (as your own VM's is):
/// switchover, failback, host kill + re-protection, host kill — every acknowledged write kept.
#[test]
fn ha_cycle_fenced_by_etcd_over_tls() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-lab"))
        .args(["demo", "--cycle", "--json", "--disk-capture", "mirror"])
        .args(["--timeout-ms", "2000", "--before", "3", "--after", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo --cycle failed: {err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let c = &v["cycle"];
    assert_eq!(c["acked_keys_lost"], 0, "{c:#}");
    assert!(c["acked_keys_checked"].as_u64().unwrap() > 0, "{c:#}");
    assert_eq!(c["guest_continued"], true, "{c:#}");
    let moves = c["moves"].as_array().unwrap();
    assert_eq!(moves.len(), 4, "{c:#}");
    for m in &moves[..3] {
        assert!(m["to_protected_ms"].as_f64().unwrap() > 0.0, "{m:#}");
    }
    // Every move took the VM over in etcd (one compare-and-swap, no lease to wait out).
    for m in moves {
        assert!(m["takeover_ms"].as_f64().unwrap() > 0.0, "{m:#}");
    }
    assert!(err.contains("mutual TLS"), "{err}");
}
