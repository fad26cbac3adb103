//! `tandem run` (the unit tandem@VM) on two "hosts" of 127.0.0.1 with a real 3-member etcd
//! cluster: the role comes from the ownership record, and stopping and starting a node's
//! daemon in each role — what `systemctl restart` does — never loses the VM, never boots a
//! second copy and loses no acknowledged write: the node running a protected guest hands it
//! over and comes back as its backup; a backup comes back as a backup; the node running the
//! guest without a backup shuts it down, records it stopped, and boots it again when it comes
//! back — from its own copy of the guest's disks when the guest ran from it (after a handover
//! or a failover), a named file on real storage. A redis client writes to the guest all along
//! (append-only file on the guest's writable disk, fsynced per write) and every write redis
//! acknowledged is read back after each step.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{free_port, spawn, wait_event, wait_line, Proc};
use tandem_harness::etcd_cluster::Cluster;

fn cluster(dir: &std::path::Path) -> Cluster {
    common::local_etcd(dir)
}

/// The node's configuration file: the same keys on both nodes but for its directories and VM
/// description (both "hosts" share this machine): its RAM mirror in `shm`, its state (and
/// copy of the guest's disks) in `dir`.
fn config(
    (shm, dir): (&Path, &Path),
    node: &str,
    nodes: &[(&str, String)],
    eps: &str,
    vm: &Path,
) -> String {
    let nodes: String = nodes
        .iter()
        .map(|(n, a)| format!("{n} = \"{a}\"\n"))
        .collect();
    let etcd: Vec<String> = eps.split(',').map(|e| format!("\"{e}\"")).collect();
    let text = format!(
        "vm_id = 7\nprimary = \"a\"\nvm_config = \"{}\"\n[nodes]\n{nodes}\
         [paths]\nmirror_dir = \"{}/{node}-mirror\"\nstate_dir = \"{d}/{node}-state\"\n\
         [fencing]\netcd = [{}]\n[replication]\ntimeout_ms = 500\nepoch_ms = 50\n",
        vm.display(),
        shm.display(),
        etcd.join(", "),
        d = dir.display()
    );
    let path = dir.join(format!("{node}.toml"));
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn run(cfg: &str, node: &str) -> (Proc, std::sync::mpsc::Receiver<String>) {
    spawn(&["run", "--config", cfg, "--node", node, "--json-events"])
}

/// SIGTERM (systemctl stop) and the exit status.
fn stop(p: &mut Proc) -> std::process::ExitStatus {
    // SAFETY: kill(2) on our child's pid.
    unsafe { libc::kill(p.id() as i32, libc::SIGTERM) };
    p.wait().unwrap()
}

fn record(eps: &str) -> serde_json::Value {
    let out = std::process::Command::new(tandem_harness::product_exe().unwrap())
        .args(["fence", "show", "--etcd", eps, "--vm-id", "7", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0]["record"].clone()
}

/// The lab guest running redis, whose append-only file is on a writable disk of the VM's own
/// (an ext4 file on node `node`'s storage; the backup's file is only sized, never used),
/// forwarded from 127.0.0.1:`port` (each node its own port: both share this machine).
fn kv_vm(dir: &Path, node: &str, port: u16, format: bool) -> std::path::PathBuf {
    let disk = dir.join(format!("{node}-data.img"));
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    if format {
        let ok = std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"])
            .arg(&disk)
            .status()
            .unwrap();
        assert!(ok.success());
    }
    let text = tandem_labguest::description("kv", &tandem_labguest::GuestImage::default(), 0)
        + &format!(
            "forward = [\"tcp:127.0.0.1:{port}-:6379\"]\n\n[[disk]]\npath = {:?}\nformat = \"raw\"\n",
            disk.display().to_string()
        );
    let path = dir.join(format!("{node}-vm.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Waits until the copy at `path` is recorded as the guest's disks (the node resumed it).
fn guest_disks_at(path: &Path) {
    let record = path.with_file_name("guest-disks.json");
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(&record).unwrap_or_default();
        if text.contains("\"state\": \"guest\"") {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} does not record the guest's disks: {text}",
            record.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn value(i: u64) -> Vec<u8> {
    format!("value-{i}-{}", "x".repeat((i % 50) as usize)).into_bytes()
}

/// A redis connection to whichever node runs the guest.
fn connect(ports: &[u16]) -> Option<tandem_harness::kv::KvClient> {
    ports.iter().find_map(|&p| {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], p));
        let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)).ok()?;
        let mut c = tandem_harness::kv::KvClient::from_stream(s, Duration::from_secs(5)).ok()?;
        // A guest booted again serves once redis has replayed its append-only file.
        let t = Instant::now();
        while let Err(e) = c.get(b"key:0") {
            if !e.to_string().contains("LOADING") || t.elapsed() > Duration::from_secs(60) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Each acknowledged write is on the guest's disk before the reply (a guest that is
        // shut down and booted again loses none).
        c.pipeline(&[vec![b"CONFIG", b"SET", b"appendfsync", b"always"]])
            .ok()?;
        Some(c)
    })
}

/// A client writing `key:N` = value(N) for N = 0, 1, ... to whichever node runs the guest,
/// retrying a write until redis acknowledges it; `acked` is how many were.
struct Writer {
    stop: Arc<AtomicBool>,
    pause: Arc<AtomicBool>,
    acked: Arc<AtomicU64>,
    done: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn start(ports: [u16; 2]) -> Writer {
        let (stop, pause, acked) = (Arc::default(), Arc::default(), Arc::new(AtomicU64::new(0)));
        let (s, p, a) = (Arc::clone(&stop), Arc::clone(&pause), Arc::clone(&acked));
        let done = std::thread::spawn(move || {
            let s: Arc<AtomicBool> = s;
            let p: Arc<AtomicBool> = p;
            let mut client = None;
            while !s.load(Ordering::SeqCst) {
                if p.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                let Some(c) = client.as_mut() else {
                    client = connect(&ports);
                    if client.is_none() {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    continue;
                };
                let i = a.load(Ordering::SeqCst);
                match c.set(format!("key:{i}").as_bytes(), &value(i)) {
                    Ok(()) => {
                        a.store(i + 1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(_) => client = None,
                }
            }
        });
        Writer {
            stop,
            pause,
            acked,
            done: Some(done),
        }
    }

    /// Waits until `more` further writes were acknowledged (the guest serves again).
    fn wait_more(&self, more: u64) {
        let (from, t) = (self.acked.load(Ordering::SeqCst), Instant::now());
        while self.acked.load(Ordering::SeqCst) < from + more {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "redis in the guest acknowledged no write for 120 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Reads back every acknowledged write from the guest (wherever it runs).
    fn check(&self, ports: [u16; 2], step: &str) -> u64 {
        self.pause.store(true, Ordering::SeqCst);
        let n = self.acked.load(Ordering::SeqCst);
        let t = Instant::now();
        let mut c = loop {
            match connect(&ports) {
                Some(c) => break c,
                None if t.elapsed() < Duration::from_secs(120) => {
                    std::thread::sleep(Duration::from_millis(200))
                }
                None => panic!("{step}: the guest's redis does not answer"),
            }
        };
        for i in 0..n {
            let got = c.get(format!("key:{i}").as_bytes()).unwrap();
            assert_eq!(
                got.as_deref(),
                Some(value(i).as_slice()),
                "{step}: acknowledged write {i} of {n} lost"
            );
        }
        self.pause.store(false, Ordering::SeqCst);
        eprintln!("{step}: all {n} acknowledged writes are there");
        n
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(d) = self.done.take() {
            let _ = d.join();
        }
    }
}

#[test]
fn restarting_either_node_in_any_role_never_loses_the_vm_or_a_write() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    // The nodes' state directories (the guest's disks after a failover) on real storage.
    let disks = tempfile::tempdir().unwrap();
    let etcd = cluster(dir.path());
    let eps = etcd.endpoints().join(",");
    let ports = [free_port(), free_port()];
    let nodes = [
        ("a", format!("127.0.0.1:{}", free_port())),
        ("b", format!("127.0.0.1:{}", free_port())),
    ];
    let cfg_a = config(
        (dir.path(), disks.path()),
        "a",
        &nodes,
        &eps,
        &kv_vm(disks.path(), "a", ports[0], true),
    );
    let cfg_b = config(
        (dir.path(), disks.path()),
        "b",
        &nodes,
        &eps,
        &kv_vm(disks.path(), "b", ports[1], false),
    );
    let long = Duration::from_secs(120);
    let copy_b = disks.path().join("b-state/guest-disks.raw");
    let copy_a = disks.path().join("a-state/guest-disks.raw");

    // A new VM: a (primary = "a") boots it, b serves as its backup.
    let (mut b, brx) = run(&cfg_b, "b");
    wait_line(&brx, "serves as the backup (a new VM)", long);
    let (mut a, arx) = run(&cfg_a, "a");
    wait_line(&arx, "runs the guest (a new VM)", long);
    wait_event(&arx, "guest_running", long, |_| true);
    wait_event(&arx, "protected", long, |_| true);
    let w = Writer::start(ports);
    w.wait_more(100);

    // Restart the node running the protected guest: it hands the guest over to b (no fresh
    // boot anywhere), and comes back as b's backup; b protects the guest onto it. The guest's
    // disks are b's copy now.
    assert!(stop(&mut a).success(), "a's daemon ends cleanly on SIGTERM");
    let taken = wait_event(&brx, "failed_over", long, |_| true);
    assert!(taken["epoch"].as_u64() > Some(0), "{taken}");
    guest_disks_at(&copy_b);
    let (mut a, arx) = run(&cfg_a, "a");
    wait_line(&arx, "serves as the backup", long);
    wait_event(&brx, "protected", long, |_| true);
    assert_eq!(record(&eps)["node"], "b");
    assert_eq!(record(&eps)["state"], "protected");
    w.wait_more(100);
    w.check(ports, "after the handover to b");

    // Restart the backup: it comes back as the backup; the guest stays on b, protected again.
    assert!(stop(&mut a).success());
    let (mut a, arx) = run(&cfg_a, "a");
    wait_line(&arx, "serves as the backup", long);
    wait_event(&brx, "protected", long, |_| true);
    w.wait_more(100);

    // Stop the backup for good: b runs the guest without a replica (recorded in etcd). Then
    // stop b: no backup to hand over to, the guest is shut down and recorded stopped by b;
    // b, started again, boots it from its copy (the newest disks), and a is its backup again.
    assert!(stop(&mut a).success());
    wait_event(&brx, "unreplicated", long, |v| v["on"] == true);
    w.wait_more(100);
    assert!(stop(&mut b).success());
    let r = record(&eps);
    assert_eq!(
        (r["state"].as_str(), r["node"].as_str()),
        (Some("stopped"), Some("b")),
        "{r}"
    );
    let (mut b, brx) = run(&cfg_b, "b");
    wait_line(&brx, "runs the guest", long);
    wait_line(&brx, &format!("booting from {}", copy_b.display()), long);
    wait_event(&brx, "guest_running", long, |_| true);
    w.check(ports, "after b booted the guest again from its copy");
    let (_a, arx) = run(&cfg_a, "a");
    wait_line(&arx, "serves as the backup", long);
    wait_event(&brx, "protected", long, |_| true);
    w.wait_more(100);

    // A host failure of b: a fails over and runs the guest from its own copy. With user
    // networking nothing holds the guest's replies, so the client pauses and one more epoch
    // commits before the kill (the relay's output commit is tested in failover.rs).
    w.pause.store(true, Ordering::SeqCst);
    std::thread::sleep(Duration::from_secs(1));
    b.kill().unwrap();
    let _ = b.wait();
    wait_event(&arx, "failed_over", long, |_| true);
    guest_disks_at(&copy_a);
    w.pause.store(false, Ordering::SeqCst);
    w.wait_more(50);
    // Stopped now (b is gone): shut down, recorded stopped by a, booted again from a's copy.
    let mut a = _a;
    assert!(stop(&mut a).success());
    assert_eq!(record(&eps)["state"], "stopped");
    let (_a, arx) = run(&cfg_a, "a");
    wait_line(&arx, &format!("booting from {}", copy_a.display()), long);
    wait_event(&arx, "guest_running", long, |_| true);
    w.check(ports, "after a failover to a and a restart of a");

    // b comes back as the backup; restarting a hands the guest over from a's copy to b's,
    // and a's copy is only a copy again: a comes back as the backup without keeping it aside.
    let (_b, brx) = run(&cfg_b, "b");
    wait_line(&brx, "serves as the backup", long);
    wait_event(&arx, "protected", long, |_| true);
    w.wait_more(50);
    let mut a = _a;
    assert!(stop(&mut a).success());
    wait_event(&brx, "failed_over", long, |_| true);
    guest_disks_at(&copy_b);
    let (_a, arx) = run(&cfg_a, "a");
    wait_line(&arx, "serves as the backup", long);
    wait_event(&brx, "protected", long, |_| true);
    assert!(!copy_a.with_extension("raw.prev").exists());
    let n = w.check(ports, "after handing the guest over from a's copy to b's");
    assert!(n >= 500, "only {n} writes acknowledged");
}
