//! `tandem bench --backup-host`: real guests (one per `--workloads` entry, default idle,
//! compile, sqlite, kv), each with its own primary and clients' bridge, protected by one
//! `tandem backup-host` process. Run once with `--consolidate` and once with plain mirrors,
//! side by side: the memory the backup host holds (mirror files' allocated pages, its own
//! heap, the standby QEMUs), each replica's split, and then one primary host killed: that
//! VM's failover time.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;

const MIB: f64 = (1 << 20) as f64;

/// One guest's processes and files.
struct Guest {
    lab: crate::netlab::NetLab,
    workload: String,
    addr: String,
    primary: Option<Child>,
    qemu: u32,
}

#[derive(Serialize)]
struct Run {
    consolidated: bool,
    /// Per replica: (workload, the backup's `memory` document).
    replicas: Vec<(String, serde_json::Value)>,
    /// Pages allocated in the mirror files (tmpfs blocks), MiB.
    mirror_files_mib: f64,
    /// The backup-host process's private memory (pool, page maps, buffers), MiB.
    host_anon_mib: f64,
    /// The standby QEMUs' private memory, MiB.
    standby_anon_mib: f64,
    guest_ram_mib: f64,
    failover: serde_json::Value,
}

fn kids(pid: u32) -> Vec<u32> {
    let mut v = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                v.extend(s.split_whitespace().filter_map(|x| x.parse::<u32>().ok()));
            }
        }
    }
    v
}

fn status_kib(pid: u32, key: &str) -> f64 {
    crate::demo::memsample::status_kib(pid, key).unwrap_or(0) as f64
}

/// Allocated bytes of the mirror files `pid` holds open (unlinked `mirror.ram` files).
fn mirror_bytes(pid: u32) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for fd in fds.flatten() {
            let target = std::fs::read_link(fd.path()).unwrap_or_default();
            if target.to_string_lossy().contains("mirror.ram") {
                total += std::fs::metadata(fd.path()).map_or(0, |m| m.blocks() * 512);
            }
        }
    }
    total
}

fn lines_to(child: &mut Child, log: PathBuf) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().expect("piped"));
    let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().expect("piped"));
    for s in [out, err] {
        let (tx, log) = (tx.clone(), log.clone());
        std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .ok();
            for l in BufReader::new(s).lines().map_while(Result::ok) {
                if let Some(f) = f.as_mut() {
                    let _ = std::io::Write::write_all(f, format!("{l}\n").as_bytes());
                }
                let _ = tx.send(l);
            }
        });
    }
    rx
}

fn wait_for(
    rx: &std::sync::mpsc::Receiver<String>,
    pat: &str,
    t: Duration,
) -> anyhow::Result<String> {
    let end = Instant::now() + t;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.contains(pat) => return Ok(l),
            Ok(_) => {}
            Err(_) => bail!("no {pat:?} within {t:?}"),
        }
    }
}

fn number_after(l: &str, key: &str) -> u32 {
    l.split(key)
        .nth(1)
        .map(|r| {
            r.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn one(workloads: &[String], consolidate: bool, seconds: u64, dir: &Path) -> anyhow::Result<Run> {
    let exe = crate::product_exe()?;
    let mut guests = Vec::new();
    for (i, w) in workloads.iter().enumerate() {
        let lab = crate::netlab::NetLab::create(&format!("tbh{}{i}", std::process::id() % 1000), 0)
            .context("creating a network lab (needs root)")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        guests.push(Guest {
            lab,
            workload: w.clone(),
            addr: format!("127.0.0.1:{port}"),
            primary: None,
            qemu: 0,
        });
    }
    let mut args: Vec<String> = vec!["backup-host".into()];
    if consolidate {
        args.push("--consolidate".into());
    }
    let mut descs = Vec::new();
    for g in &guests {
        descs.push(crate::lab_description(dir, &g.workload, 32)?);
    }
    for (i, g) in guests.iter().enumerate() {
        args.push("--replica".into());
        args.push(format!(
            "--vm-id {} --listen {} --dir {} --vm-config {} --tap-netns {} --timeout-ms 2000 --report {} --control {}",
            i + 1,
            g.addr,
            dir.join(format!("b{i}")).display(),
            descs[i].display(),
            g.lab.clients,
            dir.join(format!("failover{i}.json")).display(),
            dir.join(format!("b{i}.sock")).display(),
        ));
    }
    let mut host = Command::new(&exe)
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let hrx = lines_to(&mut host, dir.join("backup-host.log"));
    for _ in &guests {
        wait_for(&hrx, "listening on", Duration::from_secs(120))?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for (i, g) in guests.iter_mut().enumerate() {
        let mut p = Command::new(&exe)
            .args([
                "primary",
                "--vm-id",
                &(i + 1).to_string(),
                "--backup",
                &g.addr,
            ])
            .arg("--vm-config")
            .arg(&descs[i])
            .args(["--tap-netns", &g.lab.clients])
            .arg("--control")
            .arg(dir.join(format!("p{i}.sock")))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let rx = lines_to(&mut p, dir.join(format!("primary{i}.log")));
        g.qemu = number_after(
            &wait_for(&rx, "QEMU pid", Duration::from_secs(300))?,
            "QEMU pid ",
        );
        g.primary = Some(p);
        if tandem_labguest::serves_kv(&g.workload) {
            clients.push(writer(g.lab.clients.clone(), stop.clone()));
        }
    }
    // Protected, then `seconds` of replication.
    let t = Instant::now();
    for i in 0..guests.len() {
        loop {
            let st = tandem_protect::control::ask(&dir.join(format!("p{i}.sock")));
            if st.is_ok_and(|v| v["state"] == "protected") {
                break;
            }
            if t.elapsed() > Duration::from_secs(600) {
                bail!("VM {} was not protected within 600 s", i + 1);
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    std::thread::sleep(Duration::from_secs(seconds));
    let hp = host.id();
    let mut replicas = Vec::new();
    for (i, g) in guests.iter().enumerate() {
        let st = tandem_protect::control::ask(&dir.join(format!("b{i}.sock")))?;
        replicas.push((g.workload.clone(), st["memory"].clone()));
    }
    let guest_ram_mib = 256.0 * guests.len() as f64;
    let mirror = mirror_bytes(hp);
    let host_anon = status_kib(hp, "RssAnon:");
    let standby: f64 = kids(hp).iter().map(|&k| status_kib(k, "RssAnon:")).sum();
    // The first VM's host dies.
    let g = &mut guests[0];
    if let Some(mut p) = g.primary.take() {
        let _ = p.kill();
        // SAFETY: plain kill(2) of the QEMU pid the primary printed.
        unsafe { libc::kill(g.qemu as i32, libc::SIGKILL) };
        let _ = p.wait();
    }
    wait_for(&hrx, "failover:", Duration::from_secs(60))?;
    let report = dir.join("failover0.json");
    let t = Instant::now();
    while !report.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let failover: serde_json::Value = serde_json::from_slice(&std::fs::read(&report)?)?;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    for g in &mut guests {
        if let Some(mut p) = g.primary.take() {
            // SAFETY: plain kill(2) of our own child and of the QEMU pid it printed.
            unsafe { libc::kill(p.id() as i32, libc::SIGKILL) };
            // SAFETY: as above.
            unsafe { libc::kill(g.qemu as i32, libc::SIGKILL) };
            let _ = p.wait();
        }
    }
    // SAFETY: SIGTERM to our own child.
    unsafe { libc::kill(host.id() as i32, libc::SIGTERM) };
    let _ = host.wait();
    Ok(Run {
        consolidated: consolidate,
        replicas,
        mirror_files_mib: mirror as f64 / MIB,
        host_anon_mib: host_anon / 1024.0,
        standby_anon_mib: standby / 1024.0,
        guest_ram_mib,
        failover,
    })
}

/// A redis writer in the clients' namespace `ns` until `stop`.
fn writer(ns: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let guest: std::net::SocketAddr = ([10, 77, 0, 2], 6379).into();
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let s = tandem_net::netns::in_netns(Some(&ns), move || {
                std::net::TcpStream::connect_timeout(&guest, Duration::from_secs(2))
            });
            let Ok(Ok(s)) = s else {
                std::thread::sleep(Duration::from_millis(500));
                continue;
            };
            let Ok(mut kv) = crate::kv::KvClient::from_stream(s, Duration::from_secs(5)) else {
                continue;
            };
            while !stop.load(Ordering::Relaxed) {
                let v = format!("value-{i}-{}", "x".repeat(200));
                if kv
                    .set(format!("key-{}", i % 20_000).as_bytes(), v.as_bytes())
                    .is_err()
                {
                    break;
                }
                i += 1;
            }
        }
    })
}

/// Runs the benchmark: consolidated, then plain mirrors.
pub fn run(workloads: &[String], seconds: u64, json: bool) -> anyhow::Result<()> {
    let workloads: Vec<String> = if workloads.is_empty() {
        ["idle", "compile", "sqlite", "kv"]
            .map(String::from)
            .to_vec()
    } else {
        workloads.to_vec()
    };
    let mut runs = Vec::new();
    for consolidate in [true, false] {
        let dir = tempfile::Builder::new()
            .prefix("tandem-bench-host-")
            .tempdir_in("/dev/shm")?;
        eprintln!(
            "backup-host with {} replicas ({}), {}: booting, protecting, {seconds} s, one host kill",
            workloads.len(),
            workloads.join(", "),
            if consolidate { "consolidated" } else { "plain mirrors" }
        );
        let r = one(&workloads, consolidate, seconds, dir.path());
        match r {
            Ok(r) => runs.push(r),
            Err(e) => {
                let kept = dir.keep();
                return Err(e.context(format!("logs kept in {}", kept.display())));
            }
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&runs)?);
        return Ok(());
    }
    for r in &runs {
        let resident = r.mirror_files_mib + r.host_anon_mib;
        println!(
            "{}: mirror files {:.1} MiB + backup-host heap {:.1} MiB = {:.1} MiB = {:.3}x of {:.0} MiB guest RAM (standby QEMUs' own memory {:.1} MiB besides); VM 1 failover: resumed {:.1} ms after detection{}",
            if r.consolidated { "consolidated" } else { "plain mirrors" },
            r.mirror_files_mib,
            r.host_anon_mib,
            resident,
            resident / r.guest_ram_mib,
            r.guest_ram_mib,
            r.standby_anon_mib,
            r.failover["resume_ms"].as_f64().unwrap_or(f64::NAN),
            match r.failover["lazy"].as_object() {
                Some(l) => format!(
                    ", lazy restore done {:.0} ms later ({} pages on fault)",
                    l["done_ms"].as_f64().unwrap_or(f64::NAN),
                    l["faults"]
                ),
                None => String::new(),
            }
        );
        for (w, m) in &r.replicas {
            if !m.is_null() {
                println!(
                    "  {w:<8} {:>6.1} MiB charged: {} plain, {} zero, {} shared, {} patched, {} compressed pages",
                    m["resident_bytes"].as_f64().unwrap_or(0.0) / MIB,
                    m["plain"], m["zero"], m["shared"], m["patched"], m["compressed"]
                );
            }
        }
    }
    Ok(())
}
