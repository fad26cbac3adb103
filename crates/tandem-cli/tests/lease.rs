//! The side that runs the guest keeps it paused while its lease is not certainly valid, also
//! after a failover: a real 3-member etcd cluster on 127.0.0.1, a primary and a backup with
//! `--etcd`; the primary is killed, the backup wins the key and resumes the guest; then etcd
//! loses quorum — the backup's `tandem status` says paused — and gets it back — running again.

mod common;

use std::time::{Duration, Instant};

use common::{free_port, spawn, status_json, wait_line};
use tandem_fence::cluster::{Cluster, Member};

fn state(sock: &std::path::Path) -> String {
    let v = status_json(&["--socket".as_ref(), sock.as_os_str()], None);
    v[0]["state"].as_str().unwrap().to_string()
}

fn wait_state(sock: &std::path::Path, prefix: &str, within: Duration) {
    let t = Instant::now();
    loop {
        let s = state(sock);
        if s.starts_with(prefix) {
            return;
        }
        assert!(t.elapsed() < within, "state {s:?}, waited for {prefix:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_resumed_guest_pauses_while_its_lease_is_not_valid() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let members = (1..=3)
        .map(|i| Member {
            name: format!("e{i}"),
            ip: "127.0.0.1".into(),
            client_port: free_port(),
            peer_port: free_port(),
        })
        .collect();
    let etcd_dir = dir.path().join("etcd");
    std::fs::create_dir_all(&etcd_dir).unwrap();
    let mut etcd = Cluster::start(members, &etcd_dir, None).unwrap();
    let eps = etcd.endpoints().join(",");
    let listen = format!("127.0.0.1:{}", free_port());
    let bsock = dir.path().join("b.sock");
    let bdir = dir.path().join("b");
    let (mut backup, brx) = spawn(&[
        "backup",
        "--listen",
        &listen,
        "--dir",
        bdir.to_str().unwrap(),
        "--workload",
        "idle",
        "--timeout-ms",
        "1000",
        "--etcd",
        &eps,
        "--vm-id",
        "5",
        "--control",
        bsock.to_str().unwrap(),
    ]);
    wait_line(&brx, "listening on", Duration::from_secs(60));
    let (mut primary, prx) = spawn(&[
        "primary",
        "--backup",
        &listen,
        "--workload",
        "idle",
        "--etcd",
        &eps,
        "--vm-id",
        "5",
    ]);
    wait_line(&prx, "holds VM 5 in etcd", Duration::from_secs(60));
    wait_line(&prx, " acked ", Duration::from_secs(120));
    primary.kill().unwrap();
    primary.wait().unwrap();
    let line = wait_line(&brx, "failover:", Duration::from_secs(30));
    assert!(line.contains("waiting for the primary's lease"), "{line}");
    wait_state(&bsock, "running the guest", Duration::from_secs(5));
    // Quorum lost: the backup's right runs out within 2.47 s of its last renewal.
    etcd.kill(0);
    etcd.kill(1);
    wait_state(&bsock, "paused", Duration::from_secs(6));
    wait_line(&brx, "guest paused", Duration::from_secs(5));
    etcd.restart(0).unwrap();
    etcd.restart(1).unwrap();
    wait_line(&brx, "guest continues", Duration::from_secs(30));
    wait_state(&bsock, "running the guest", Duration::from_secs(5));
    // SAFETY: SIGTERM to our own child.
    unsafe { libc::kill(backup.id() as i32, libc::SIGTERM) };
    assert!(backup.wait().unwrap().success());
}
