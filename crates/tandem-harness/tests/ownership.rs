//! The VM's ownership record with real daemons and a real 3-member etcd cluster on 127.0.0.1
//! (docs/FENCING.md): both daemons must fence the same way; a takeover whose reply is lost
//! still wins; the old primary, restarted, never boots a fresh guest (exit status 3); the
//! operator's override names the generation it throws away, and the node running the guest
//! stops when the record no longer names it; a `fenced` from a stranger is not believed.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{free_port, spawn, wait_event, wait_line, Proc};
use tandem_harness::etcd_cluster::{Cluster, Proxy, ProxyMode};

fn cluster(dir: &std::path::Path) -> Cluster {
    common::local_etcd(dir)
}

fn backup(
    dir: &std::path::Path,
    listen: &str,
    etcd: Option<&str>,
    vm: &str,
) -> (Proc, std::sync::mpsc::Receiver<String>) {
    let bdir = dir.join("b");
    let desc = common::lab_vm("idle", 64);
    let mut args = vec![
        "backup",
        "--listen",
        listen,
        "--dir",
        bdir.to_str().unwrap(),
        "--vm-config",
        &desc,
        "--timeout-ms",
        "500",
        "--vm-id",
        vm,
        "--json-events",
    ];
    if let Some(e) = etcd {
        args.extend(["--etcd", e]);
    }
    let (p, rx) = spawn(&args);
    wait_event(&rx, "listening", Duration::from_secs(60), |_| true);
    (p, rx)
}

fn primary(
    listen: &str,
    etcd: Option<&str>,
    vm: &str,
) -> (Proc, std::sync::mpsc::Receiver<String>) {
    let desc = common::lab_vm("idle", 64);
    let mut args = vec![
        "primary",
        "--backup",
        listen,
        "--vm-config",
        &desc,
        "--vm-id",
        vm,
        "--json-events",
    ];
    if let Some(e) = etcd {
        args.extend(["--etcd", e]);
    }
    spawn(&args)
}

fn tandem(args: &[&str]) -> std::process::Output {
    std::process::Command::new(tandem_harness::product_exe().unwrap())
        .args(args)
        .output()
        .unwrap()
}

/// VM 5 as `tandem list --json` shows it, once `until` holds (within 20 s).
fn list_until(eps: &str, until: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let t = Instant::now();
    loop {
        let out = tandem(&["list", "--etcd", eps, "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let vm = v
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["vm_id"] == 5)
            .cloned()
            .unwrap_or_default();
        if until(&vm) {
            return vm;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "tandem list: {v:#}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn sigterm(p: &mut Proc) {
    // SAFETY: SIGTERM to our own child.
    unsafe { libc::kill(p.id() as i32, libc::SIGTERM) };
    let _ = p.wait();
}

#[test]
fn both_daemons_must_fence_the_same_way() {
    // Finding 1: a primary with --etcd and a backup without it (or the other way round):
    // on a partition the backup took over while the primary recorded "none" and let output
    // out — two copies. Now the backup refuses the session and says why on both sides.
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let etcd = cluster(dir.path());
    let eps = etcd.endpoints().join(",");
    for (b_etcd, p_etcd, says) in [
        (None, Some(eps.as_str()), "this backup runs without --etcd"),
        (
            Some(eps.as_str()),
            None,
            "the primary does not fence with etcd",
        ),
    ] {
        let listen = format!("127.0.0.1:{}", free_port());
        let (mut b, brx) = backup(dir.path(), &listen, b_etcd, "4");
        let (mut p, prx) = primary(&listen, p_etcd, "4");
        let line = wait_line(
            &prx,
            "the backup refused the session",
            Duration::from_secs(90),
        );
        assert!(line.contains(says), "{line}");
        assert!(line.contains("--etcd"), "{line}");
        let line = wait_line(&brx, "refusing the session", Duration::from_secs(5));
        assert!(line.contains("fencing mismatch"), "{line}");
        // The backup never held a consistent copy of this primary: nothing to take over.
        p.kill().unwrap();
        let _ = p.wait();
        std::thread::sleep(Duration::from_secs(2));
        assert!(
            b.try_wait().unwrap().is_none(),
            "the backup must not fail over"
        );
        sigterm(&mut b);
        // Each pair starts on a new VM record.
        let _ = tandem(&[
            "fence",
            "stop",
            "--etcd",
            &eps,
            "--vm-id",
            "4",
            "--generation",
            "1",
        ]);
    }
}

#[test]
fn a_takeover_survives_a_lost_reply_and_the_old_primary_never_boots_again() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let etcd = cluster(dir.path());
    let eps = etcd.endpoints().join(",");
    // The backup asks etcd through a proxy in front of the first member.
    let up: SocketAddr = etcd.endpoints()[0]
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let proxy = Proxy::start("127.0.0.1:0".parse().unwrap(), up).unwrap();
    let mut beps = vec![format!("http://{}", proxy.addr())];
    beps.extend(etcd.endpoints()[1..].iter().cloned());
    let beps = beps.join(",");
    let listen = format!("127.0.0.1:{}", free_port());
    let (mut b, brx) = backup(dir.path(), &listen, Some(&beps), "5");
    let (mut p, prx) = primary(&listen, Some(&eps), "5");
    wait_event(&prx, "owner", Duration::from_secs(60), |_| true);
    wait_event(&prx, "acked", Duration::from_secs(120), |_| true);
    // `tandem list`: the cluster's VMs from etcd, from the daemons' reports.
    let vm5 = list_until(&eps, |v| v["protected"] == true);
    let runs_on = vm5["runs_on"].as_str().unwrap().to_string();
    assert!(runs_on.starts_with("primary@"), "{vm5:#}");
    assert!(
        vm5["backup"].as_str().unwrap().starts_with("backup@"),
        "{vm5:#}"
    );
    assert!(vm5["committed_epoch"].as_u64() >= Some(1), "{vm5:#}");
    assert_eq!(vm5["nodes"][&runs_on]["stale"], false, "{vm5:#}");

    // Finding 3: the takeover's transaction commits but its reply is lost; the old campaign
    // gave its lease back and the VM stayed down for good. Now the record read back names
    // this backup's write: it won.
    proxy.set(ProxyMode::DropTxnReplies(1));
    p.kill().unwrap();
    let _ = p.wait();
    let line = wait_line(&brx, "failover:", Duration::from_secs(30));
    assert!(
        line.contains("taking the VM over in etcd (generation 2)"),
        "{line}"
    );
    assert_eq!(
        proxy.mode(),
        ProxyMode::Pass,
        "the takeover's reply was dropped"
    );
    let vm5 = list_until(&eps, |v| {
        v["runs_on"]
            .as_str()
            .is_some_and(|n| n.starts_with("backup@"))
            && v["nodes"][v["runs_on"].as_str().unwrap()]["stale"] == false
    });
    assert_eq!(vm5["protected"], false, "{vm5:#}");
    // The dead primary's report goes stale.
    let vm5 = list_until(&eps, |v| {
        v["nodes"].as_object().is_some_and(|n| {
            n.iter()
                .any(|(k, r)| k.starts_with("primary@") && r["stale"] == true)
        })
    });
    assert!(vm5["backup"].is_null(), "{vm5:#}");

    // Finding 2: the old primary, restarted (a unit's Restart=), must not boot the
    // pre-failover image next to the guest the backup runs: refused, exit status 3.
    let t = Instant::now();
    let desc = common::lab_vm("idle", 64);
    let out = std::process::Command::new(tandem_harness::product_exe().unwrap())
        .args([
            "primary",
            "--backup",
            &listen,
            "--vm-config",
            &desc,
            "--vm-id",
            "5",
            "--etcd",
            &eps,
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("backup@") && err.contains("generation 2"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(30));

    // The record, as an operator sees it.
    let out = tandem(&["fence", "show", "--etcd", &eps, "--vm-id", "5", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v[0]["record"]["gen"], 2, "{v:#}");
    assert_eq!(v[0]["record"]["state"], "unprotected", "{v:#}");
    // An override must name the generation it throws away.
    let out = tandem(&[
        "fence",
        "stop",
        "--etcd",
        &eps,
        "--vm-id",
        "5",
        "--generation",
        "1",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("generation 1"));

    // Finding 6: the node running the guest reads the record back: an override stops it
    // (nothing more is released; it exits with status 3).
    let out = tandem(&[
        "fence",
        "stop",
        "--etcd",
        &eps,
        "--vm-id",
        "5",
        "--generation",
        "2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t = Instant::now();
    let st = loop {
        if let Some(st) = b.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the fenced backup kept running"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(st.code(), Some(3));
    // Now a fresh boot may claim the VM (generation 3), and a shutdown releases it again.
    let (mut p, prx) = primary(&listen, Some(&eps), "5");
    let owner = wait_event(&prx, "owner", Duration::from_secs(60), |_| true);
    assert_eq!(owner["generation"], 3, "{owner}");
    wait_event(&prx, "guest_running", Duration::from_secs(60), |_| true);
    // SAFETY: SIGUSR1 to our own child (end protection, shut the guest down).
    unsafe { libc::kill(p.id() as i32, libc::SIGUSR1) };
    assert!(p.wait().unwrap().success());
    let out = tandem(&["fence", "show", "--etcd", &eps, "--vm-id", "5"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("stopped by"),
        "{out:?}"
    );
}

#[test]
fn a_fenced_frame_from_a_stranger_is_not_believed() {
    // Finding 8: on a plain link an unauthenticated `fenced` frame killed the primary. A peer
    // at the backup's address now has to name a session of this primary (without etcd), or
    // etcd has to confirm it.
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let fake = std::thread::spawn(move || {
        for _ in 0..2 {
            let (mut s, _) = listener.accept().unwrap();
            let mut r = std::io::BufReader::new(s.try_clone().unwrap());
            let hello = tandem_replication::Frame::read_from(&mut r)
                .unwrap()
                .unwrap();
            // Whatever follows the hello (the initial copy) is read and dropped.
            std::thread::spawn(move || {
                let mut sink = [0u8; 1 << 16];
                while matches!(r.read(&mut sink), Ok(n) if n > 0) {}
            });
            let f = tandem_replication::wire::fenced_frame(hello.vm_id, 9, 0xdead_beef);
            f.write_to(&mut s).unwrap();
        }
    });
    let (mut p, prx) = primary(&addr, None, "6");
    let line = wait_line(&prx, "not believed", Duration::from_secs(120));
    assert!(line.contains("names no session of this primary"), "{line}");
    fake.join().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        p.try_wait().unwrap().is_none(),
        "the primary stopped on a stranger's word"
    );
    sigterm(&mut p);
}
