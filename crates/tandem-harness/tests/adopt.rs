//! `tandem adopt` fenced by a real etcd cluster: the lab guest started by hand (a plain QEMU)
//! is adopted by a `tandem adopt` process while a `tandem backup` waits. etcd records that it
//! runs without a replica before its output may pass; once protected, the primary host dies
//! and the backup takes it over in etcd and resumes it — the same boot throughout.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{free_port, spawn, wait_event, wait_line, Proc};

fn fence_show(eps: &str) -> String {
    let out = Command::new(tandem_harness::product_exe().unwrap())
        .args(["fence", "show", "--etcd", eps, "--vm-id", "9"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn an_adopted_guest_is_fenced_protected_and_taken_over_without_a_reboot() {
    let dir = tempfile::Builder::new()
        .prefix("tandem-adopt-fenced-")
        .tempdir_in("/dev/shm")
        .unwrap();
    let etcd = common::local_etcd(dir.path());
    let eps = etcd.endpoints().join(",");
    // The description of the VM as it runs: plain -m names guest RAM pc.ram.
    let desc = PathBuf::from(common::lab_vm("idle", 0));
    let text = std::fs::read_to_string(&desc).unwrap();
    std::fs::write(&desc, format!("ram_block = \"pc.ram\"\n{text}")).unwrap();
    let desc = desc.display().to_string();

    // The VM as a person started it.
    let cfg = tandem_protect::VmSpec::described(&desc)
        .config("source")
        .unwrap();
    let (qmp, console) = (
        dir.path().join("source-qmp.sock"),
        dir.path().join("source-console.log"),
    );
    let _source = Proc(
        Command::new("qemu-system-x86_64")
            .args(tandem_vm::qemu_args::by_hand(&cfg, &qmp, &console, &[]))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let before = tandem_labguest::tick_above(&console, 1, Duration::from_secs(180)).unwrap();

    let listen = format!("127.0.0.1:{}", free_port());
    let bdir = dir.path().join("b");
    let (mut b, brx) = spawn(&[
        "backup",
        "--listen",
        &listen,
        "--dir",
        bdir.to_str().unwrap(),
        "--vm-config",
        &desc,
        "--timeout-ms",
        "500",
        "--vm-id",
        "9",
        "--etcd",
        &eps,
        "--json-events",
    ]);
    wait_event(&brx, "listening", Duration::from_secs(60), |_| true);
    let pdir = dir.path().join("p");
    let (mut p, prx) = spawn(&[
        "adopt",
        "--qmp",
        qmp.to_str().unwrap(),
        "--backup",
        &listen,
        "--dir",
        pdir.to_str().unwrap(),
        "--vm-config",
        &desc,
        "--vm-id",
        "9",
        "--etcd",
        &eps,
        "--json-events",
    ]);
    wait_event(&prx, "owner", Duration::from_secs(60), |_| true);
    // Output may pass only once etcd says no backup can take over yet.
    wait_line(&prx, "runs WITHOUT a replica", Duration::from_secs(60));
    let adopted = wait_event(&prx, "adopted", Duration::from_secs(120), |_| true);
    assert!(
        adopted["downtime_ms"].as_u64().unwrap() < 5_000,
        "{adopted}"
    );
    let moved = tandem_labguest::tick_above(
        &pdir.join("guest-console.log"),
        before,
        Duration::from_secs(30),
    )
    .unwrap();
    wait_event(&prx, "protected", Duration::from_secs(120), |_| true);
    wait_event(&prx, "acked", Duration::from_secs(60), |v| {
        v["epoch"].as_u64() >= Some(5)
    });
    assert!(
        fence_show(&eps).contains("protected"),
        "{}",
        fence_show(&eps)
    );

    // The primary host dies (tandem and its QEMU): the backup takes the VM over in etcd and
    // resumes the adopted guest, the same boot.
    p.kill().unwrap();
    p.wait().unwrap();
    wait_event(&brx, "failed_over", Duration::from_secs(60), |_| true);
    let resumed = tandem_labguest::tick_above(
        &bdir.join("guest-console.log"),
        moved,
        Duration::from_secs(30),
    )
    .unwrap();
    let there = std::fs::read_to_string(bdir.join("guest-console.log")).unwrap();
    assert!(!there.contains(tandem_labguest::READY), "{there}");
    eprintln!("ticks: {before} by hand, {moved} adopted, {resumed} after the failover");
    b.kill().unwrap();
    let _ = b.wait();
}
