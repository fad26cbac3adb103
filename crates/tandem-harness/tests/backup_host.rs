//! `tandem backup-host --config FILE`: one backup process protects two kv guests (each on its
//! own clients' bridge in its own network namespace) with their mirrors consolidated into one
//! pool. The
//! first primary host dies: only its VM fails over, from consolidated memory, and redis
//! answers there with every acknowledged write; the second stays protected by the same
//! process, and fails over in turn when its host dies.

mod common;

use std::sync::mpsc::Receiver;
use std::time::Duration;

use common::{free_port, guest_redis, spawn, wait_event, wait_line};

struct Vm {
    lab: tandem_harness::netlab::NetLab,
    addr: String,
    dir: tempfile::TempDir,
    report: std::path::PathBuf,
    desc: String,
}

fn vm(id: u64) -> Vm {
    let lab = tandem_harness::netlab::NetLab::create(
        &format!("th{}{id}", std::process::id() % 10_000),
        0,
    )
    .expect("network lab (this test needs root)");
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    Vm {
        lab,
        addr: format!("127.0.0.1:{}", free_port()),
        report: dir.path().join("failover.json"),
        desc: common::lab_vm("kv", 32),
        dir,
    }
}

/// VM `id`'s `[[replica]]` table in backup-host's TOML file.
fn replica(id: u64, v: &Vm) -> String {
    format!(
        "[[replica]]\nvm_id = {id}\nlisten = \"{}\"\ndir = \"{}\"\ntimeout = \"2s\"\nreport = \"{}\"\n\
         [replica.vm]\nvm_config = \"{}\"\n[replica.site]\ntap_netns = \"{}\"\n",
        v.addr,
        v.dir.path().join("backup").display(),
        v.report.display(),
        v.desc,
        v.lab.clients,
    )
}

/// Starts the primary of VM `id`; returns it, its output and its QEMU's pid.
fn primary(id: u64, v: &Vm) -> (common::Proc, Receiver<String>, u32) {
    let id = id.to_string();
    let (p, rx) = spawn(&[
        "primary",
        "--vm-id",
        &id,
        "--backup",
        &v.addr,
        "--vm-config",
        &v.desc,
        "--tap-netns",
        &v.lab.clients,
        "--json-events",
    ]);
    let ready = wait_event(&rx, "guest_running", Duration::from_secs(180), |_| true);
    (p, rx, ready["qemu_pid"].as_u64().unwrap() as u32)
}

fn acked_at_least(rx: &Receiver<String>, n: u64) -> u64 {
    let e = wait_event(rx, "acked", Duration::from_secs(120), |v| {
        v["epoch"].as_u64() >= Some(n)
    });
    e["epoch"].as_u64().unwrap()
}

fn kill_host(p: &mut common::Proc, qemu: u32) {
    p.kill().unwrap();
    // SAFETY: plain kill(2) of a process id we read from the primary's output.
    unsafe { libc::kill(qemu as i32, libc::SIGKILL) };
    p.wait().unwrap();
}

/// The failover report, written once the restore finished (after the failover line): read
/// until it is there whole, for up to 120 s.
fn report(v: &Vm) -> serde_json::Value {
    let t = std::time::Instant::now();
    loop {
        if let Some(j) = tandem_harness::demo::read_report(&v.report) {
            return j;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no whole failover report at {}",
            v.report.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn one_backup_host_fails_over_each_vm_on_its_own_from_consolidated_memory() {
    let (v1, v2) = (vm(1), vm(2));
    // The operator's form: one TOML file with both replicas and the pool they share.
    let file = v1.dir.path().join("host.toml");
    let toml = format!(
        "[consolidate]\nrevolution = \"1s\"\n\n{}\n{}",
        replica(1, &v1),
        replica(2, &v2)
    );
    std::fs::write(&file, toml).unwrap();
    let (host, hrx) = spawn(&["backup-host", "--config", file.to_str().unwrap()]);
    let mut host = host;
    // Both replicas listen (in either order).
    wait_line(&hrx, "listening on", Duration::from_secs(60));
    wait_line(&hrx, "listening on", Duration::from_secs(60));
    let (mut p1, rx1, q1) = primary(1, &v1);
    let (mut p2, rx2, q2) = primary(2, &v2);
    let mut kv1 = guest_redis(&v1.lab.clients, Duration::from_secs(30));
    let mut kv2 = guest_redis(&v2.lab.clients, Duration::from_secs(30));
    // Each acknowledged write was released only after the backup committed its epoch.
    for i in 0..200 {
        kv1.set(format!("vm1-{i}").as_bytes(), b"acked").unwrap();
        kv2.set(format!("vm2-{i}").as_bytes(), b"acked").unwrap();
    }
    // Some clock revolutions: the mirrors' cold pages move into the pool.
    acked_at_least(&rx1, 60);
    acked_at_least(&rx2, 60);
    kill_host(&mut p1, q1);
    let line = wait_line(&hrx, "failover:", Duration::from_secs(30));
    assert!(line.starts_with("vm 1: "), "{line}");
    let r = report(&v1);
    let mem = &r["memory"];
    let consolidated = ["zero", "shared", "patched", "compressed"]
        .map(|k| mem[k].as_u64().unwrap())
        .iter()
        .sum::<u64>();
    assert!(
        consolidated > mem["pages"].as_u64().unwrap() / 2,
        "most of an idle-ish guest's pages are consolidated: {r:#}"
    );
    // Lazy restore (the default): the guest ran at once; its first touches were served
    // from the pool and the rest installed behind them.
    let lazy = &r["lazy"];
    assert!(lazy["background"].as_u64().unwrap() > 0, "{r:#}");
    assert_eq!(r["materialised_pages"], 0, "{r:#}");
    // Every acknowledged write is there, on the same connection.
    for i in 0..200 {
        let got = kv1.get(format!("vm1-{i}").as_bytes()).unwrap();
        assert_eq!(got.as_deref(), Some(&b"acked"[..]), "vm1-{i}");
    }
    kv1.set(b"after-failover", b"ok").unwrap();
    // VM 2 is still protected by the same process: its epochs keep being acknowledged.
    let before = acked_at_least(&rx2, 0);
    acked_at_least(&rx2, before + 10);
    assert!(!v2.report.exists(), "VM 2 must not fail over with VM 1");
    kill_host(&mut p2, q2);
    let line = wait_line(&hrx, "failover:", Duration::from_secs(30));
    assert!(line.starts_with("vm 2: "), "{line}");
    for i in 0..200 {
        let got = kv2.get(format!("vm2-{i}").as_bytes()).unwrap();
        assert_eq!(got.as_deref(), Some(&b"acked"[..]), "vm2-{i}");
    }
    // SAFETY: SIGTERM to our own child asks it to stop both resumed guests.
    unsafe { libc::kill(host.id() as i32, libc::SIGTERM) };
    let st = host.wait().unwrap();
    assert!(st.success(), "backup-host exited with {st}");
}
