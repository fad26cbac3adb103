//! Your own VM, for real: the Debian 12 test VM from `tandem setup --debian` (firmware boot
//! from a qcow2 disk, 2 vCPUs, 1 GiB, systemd, PostgreSQL, OpenSSH).
//!
//! - Its booted checkpoint (saved by `tandem setup --debian`, disk included) restores in
//!   seconds into a guest that serves SQL and SSH, whose PostgreSQL passes `pg_amcheck`
//!   after new writes, without writing the VM's own image; a description whose disk does not
//!   match the checkpoint's is refused before anything starts.
//! - `tandem demo --vm debian`: a host failure of the primary while a client commits; every
//!   acknowledged commit is there afterwards, the postmaster was not restarted, the psql and
//!   SSH sessions survive, `pg_amcheck` is clean and the primary's copy let nothing out.
//! - `tandem demo --vm debian --adopt --libvirt`: the same VM run by a real libvirtd
//!   (virt-install, q35 with libvirt's default devices, its NIC on a libvirt network),
//!   described by `tandem vm import` from its defined XML (the network resolved to its bridge
//!   through libvirt), adopted by `tandem adopt --libvirt` while psql commits, then failed
//!   over: no reboot, no commit lost; libvirt shows the domain marked and refuses to start
//!   it, on the adopting host and (defined there by the backup) on the backup host;
//!   rebooted under tandem, the guest finds the hardware libvirt gave it.
//!   (A QEMU started by hand is adopted in tests/adopt.rs.)

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The demos run one at a time: each runs a 1 GiB guest with 2 vCPUs under TCG.
static DEMO: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn debian_dir() -> PathBuf {
    let d = tandem_labguest::debian_dir();
    assert!(
        d.join("booted/index").is_file(),
        "the Debian test VM and its booted checkpoint are missing: run `tandem setup --debian` (./tandem test does)"
    );
    d
}

fn describe(dir: &Path, disk: &Path, format: &str) -> PathBuf {
    let desc = dir.join(format!("vm-{format}.toml"));
    std::fs::write(
        &desc,
        format!(
            "mem = 1024\nvcpus = 2\nready = \"TANDEM-READY\"\n[boot]\nfirmware = \"seabios\"\n\
             [[disk]]\npath = {:?}\nformat = \"{format}\"\ncache = \"writeback\"\n\
             [[nic]]\nmac = \"52:54:00:12:34:56\"\n\
             forward = [\"tcp:127.0.0.1:22922-:22\", \"tcp:127.0.0.1:25432-:5432\"]\n",
            disk.display().to_string()
        ),
    )
    .unwrap();
    desc
}

fn sh(cmd: &mut Command) -> (bool, String) {
    let out = cmd.stdin(Stdio::null()).output().expect("run a client");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text.trim().to_string())
}

fn psql(sql: &str) -> Command {
    let mut c = Command::new("psql");
    c.args([
        "-h",
        "127.0.0.1",
        "-p",
        "25432",
        "-U",
        "postgres",
        "-X",
        "-At",
        "-c",
        sql,
    ])
    .env("PGCONNECT_TIMEOUT", "5");
    c
}

fn ssh(key: &Path, cmd: &str) -> Command {
    let mut c = Command::new("ssh");
    c.arg("-i").arg(key);
    c.args([
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
    ])
    .args([
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "LogLevel=ERROR",
    ])
    .args(["-p", "22922", "root@127.0.0.1", cmd]);
    c
}

fn until_ok(what: &str, secs: u64, mut f: impl FnMut() -> (bool, String)) -> String {
    let t = Instant::now();
    loop {
        let (ok, out) = f();
        if ok {
            return out;
        }
        assert!(t.elapsed() < Duration::from_secs(secs), "{what}: {out}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn the_booted_checkpoint_restores_with_its_disk_and_serves_sql_and_ssh() {
    let deb = debian_dir();
    let image = deb.join("debian.qcow2");
    let before = std::fs::metadata(&image).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let desc = describe(tmp.path(), &image, "qcow2");
    let disk_out = tmp.path().join("restored.img");
    let mut child = Command::new(tandem_harness::product_exe().unwrap())
        .args(["checkpoint", "restore"])
        .arg(deb.join("booted"))
        .args(["--id", "1", "--run-seconds", "900", "--json", "--vm-config"])
        .arg(&desc)
        .arg("--disk-out")
        .arg(&disk_out)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut json = String::new();
    for l in BufReader::new(child.stdout.take().unwrap()).lines() {
        let l = l.unwrap();
        json.push_str(&l);
        if l == "}" {
            break;
        }
    }
    let v: serde_json::Value =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    eprintln!("restore: {v:#}");
    assert_eq!(v["disk_image"], disk_out.display().to_string(), "{v:#}");
    assert_eq!(v["ram_checksum_verified"], true);
    let key = deb.join("id_ed25519");
    // The restored guest runs on: PostgreSQL and sshd answer on their forwarded ports.
    until_ok("PostgreSQL after restore", 60, || sh(&mut psql("SELECT 1")));
    let state = until_ok("SSH after restore", 60, || {
        sh(&mut ssh(&key, "systemctl is-system-running --wait"))
    });
    assert!(state == "running" || state == "degraded", "{state}");
    // New writes on the restored disk, then PostgreSQL's own corruption check.
    let (ok, out) = sh(&mut psql(
        "CREATE TABLE t AS SELECT g AS id, md5(g::text) AS v FROM generate_series(1, 20000) g; \
         CREATE INDEX t_v ON t (v); CHECKPOINT; SELECT count(*) FROM t",
    ));
    assert!(ok && out.ends_with("20000"), "{out}");
    let (ok, out) = sh(&mut ssh(
        &key,
        "runuser -u postgres -- \"$(ls /usr/lib/postgresql/*/bin/pg_amcheck | tail -n 1)\" --install-missing --all --heapallindexed",
    ));
    assert!(ok, "pg_amcheck on the restored guest: {out}");
    // SAFETY: kill(2) on our own child; its stop handler quits the guest.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert!(child.wait().unwrap().success());
    // The VM's own image was not written.
    let after = std::fs::metadata(&image).unwrap();
    assert_eq!(before.len(), after.len());
    assert_eq!(before.modified().unwrap(), after.modified().unwrap());
    // A VM whose disk does not match the checkpoint's is refused before QEMU starts.
    let small = tmp.path().join("small.raw");
    std::fs::File::create(&small)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let other = describe(tmp.path(), &small, "raw");
    let out2 = tmp.path().join("never.img");
    let out = Command::new(tandem_harness::product_exe().unwrap())
        .args(["checkpoint", "restore"])
        .arg(deb.join("booted"))
        .args(["--id", "1", "--run-seconds", "1", "--vm-config"])
        .arg(&other)
        .arg("--disk-out")
        .arg(&out2)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("does not match the checkpoints' disks"),
        "{err}"
    );
    assert!(err.contains("1073741824 bytes"), "{err}");
    assert!(!out2.exists());
}

/// One round of `tandem demo --vm debian` with `flags`, one demo at a time; checks what every
/// round must show (every acknowledged commit there, the same postmaster, both sessions alive,
/// `pg_amcheck` clean) and returns the round.
fn debian_round(flags: &[&str]) -> serde_json::Value {
    let _one = DEMO.lock().unwrap_or_else(|e| e.into_inner());
    debian_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-lab"))
        .args(["demo", "--vm", "debian", "--rounds", "1", "--json"])
        .args(flags)
        .output()
        .expect("run tandem demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The demo's error is its stderr's last lines: printed first, so that a log cut short
    // (as CI's excerpt is) still shows why the round failed.
    let tail: Vec<&str> = stderr.lines().rev().take(6).collect();
    if !out.status.success() {
        eprintln!("tandem demo --vm debian {flags:?} failed; its stderr ends:");
        for l in tail.iter().rev() {
            eprintln!("  {l}");
        }
    }
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "tandem demo --vm debian {flags:?} failed ({}):\n{stdout}",
        tail.first().unwrap_or(&"no stderr")
    );
    let v: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(v["ok"], true, "{v:#}");
    let r = v["rounds"][0].clone();
    assert!(r["commits_acked"].as_u64().unwrap() > 0, "{r:#}");
    assert_eq!(r["commits_lost"], 0, "{r:#}");
    assert_eq!(r["psql_session_survived"], true, "{r:#}");
    assert_eq!(r["ssh_session_survived"], true, "{r:#}");
    assert_eq!(
        r["postmaster_start_before"], r["postmaster_start_after"],
        "{r:#}"
    );
    assert_eq!(r["amcheck"], "ok", "{r:#}");
    r
}

#[test]
fn demo_debian_a_host_failure_loses_no_acknowledged_commit() {
    let r = debian_round(&["--before", "8", "--after", "4"]);
    assert_eq!(r["primary_frames_after_failover"], 0, "{r:#}");
    assert!(
        r["commits_per_s_after_failover"].as_f64().unwrap() > 0.0,
        "{r:#}"
    );
}

#[test]
fn demo_debian_adopted_from_libvirt_without_a_reboot_then_failed_over_loses_no_commit() {
    // The VM libvirt ran was adopted while psql committed: the postmaster of that boot served
    // until after the failover, the sessions survived and no commit was lost.
    let r = debian_round(&["--adopt", "--libvirt", "--before", "6", "--after", "3"]);
    let a = &r["adoption"];
    assert_eq!(a["source_quit"], true, "{r:#}");
    assert!(a["downtime_ms"].as_f64().unwrap() >= 0.0, "{r:#}");
    // libvirt still knows the domain: shut off, autostart off, titled by tandem, and its
    // hook refuses a second QEMU on the guest's disks.
    let l = &a["libvirt"];
    assert_eq!(l["state_after"], "shut off", "{r:#}");
    // The NIC on a libvirt network was put on that network's bridge, asking libvirt.
    assert_eq!(l["nic_bridge"], "br0", "{r:#}");
    assert_eq!(l["start_refused"], true, "{r:#}");
    assert_eq!(l["autostart"], "disable", "{r:#}");
    assert!(
        l["title"].as_str().unwrap().contains("protected by tandem"),
        "{r:#}"
    );
    // The backup host's libvirt knows the domain too, from the definition the adopting node
    // recorded in etcd: defined by the backup, marked, shut off after the failover (the guest
    // runs under tandem there), its disk a slice of the backup's copy, a start refused.
    let b = &r["libvirt_backup"];
    assert_eq!(b["defined"], true, "{r:#}");
    assert_eq!(b["state"], "shut off", "{r:#}");
    assert_eq!(b["marked"], true, "{r:#}");
    assert_eq!(b["disk_on_copy"], true, "{r:#}");
    assert_eq!(b["start_refused"], true, "{r:#}");
    // Given back to that libvirt once protection ended (the guest shut down under tandem, the
    // mark removed), `virsh start` boots it from the backup's copy with every commit.
    assert_eq!(b["given_back"], true, "{r:#}");
    assert_eq!(b["given_back_lost"], 0, "{r:#}");
    // What import could not carry over is named: the serial port's host end and the guest
    // agent's channel, nothing else of virt-install's default q35 domain.
    let unmapped: Vec<&str> = l["unmapped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u.as_str().unwrap())
        .collect();
    assert_eq!(unmapped.len(), 2, "{unmapped:#?}");
    assert!(unmapped[0].starts_with("devices/serial"), "{unmapped:#?}");
    assert!(unmapped[1].starts_with("devices/channel"), "{unmapped:#?}");
    // The import's round trip: rebooted under tandem's QEMU, the guest finds the PCI
    // functions, NICs (names and MACs), vCPUs and CPU flags libvirt gave it.
    let h = &r["hardware"];
    assert_eq!(h["rebooted"], true, "{h:#}");
    assert_eq!(h["differences"].as_array().unwrap().len(), 0, "{h:#}");
    let before = h["before"].as_array().unwrap();
    assert!(
        before
            .iter()
            .filter(|l| l.as_str().unwrap().starts_with("pci "))
            .count()
            > 20,
        "{h:#}"
    );
}
