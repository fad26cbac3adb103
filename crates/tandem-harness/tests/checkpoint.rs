//! `tandem checkpoint` with real guests: restore equals saved for random checkpoints and the
//! restored guest runs; a saver killed at random points (and aborted at each step of a
//! compaction) leaves a store that verifies and restores; a flipped byte is named and only the
//! checkpoints that depend on it refuse to restore.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The lab guest running `workload`, as a VM description (no scratch disk: checkpoints of the
/// lab guest hold its RAM and device state).
fn lab_vm(workload: &str) -> String {
    // Marked as this test process's: the next `tandem` run after it removes it.
    let dir = tandem_vm::stale::owned_tempdir("tandem-test-vm-", None)
        .unwrap()
        .keep();
    tandem_harness::lab_description(&dir, workload, 0)
        .unwrap()
        .display()
        .to_string()
}

fn tandem(args: &[&str]) -> Output {
    let out = Command::new(tandem_harness::product_exe().unwrap())
        .args(args)
        .output()
        .expect("run tandem");
    eprintln!(
        "tandem {}:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn ids(dir: &Path) -> Vec<u64> {
    let out = tandem(&["checkpoint", "list", dir.to_str().unwrap(), "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_u64().unwrap())
        .collect()
}

fn pick(v: &[u64], salt: u64) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64;
    v[((t ^ salt.wrapping_mul(0x9e37_79b9)) % v.len() as u64) as usize]
}

fn restore(dir: &Path, id: u64) -> Output {
    let id = id.to_string();
    tandem(&[
        "checkpoint",
        "restore",
        dir.to_str().unwrap(),
        "--id",
        &id,
        "--vm-config",
        &lab_vm("sqlite"),
        "--run-seconds",
        "1",
        "--json",
    ])
}

fn restores_and_runs(dir: &Path, id: u64) {
    let out = restore(dir, id);
    assert!(out.status.success(), "restore {id}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ram_checksum_verified"], true);
    assert_eq!(v["status_after_resume"], "running", "{v}");
}

#[test]
fn restore_equals_saved_and_damage_is_contained() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("store");
    let s = dir.to_str().unwrap();
    let out = tandem(&[
        "checkpoint",
        "save",
        "--dir",
        s,
        "--vm-config",
        &lab_vm("sqlite"),
        "--interval",
        "150",
        "--count",
        "14",
        "--keep",
        "10",
        "--base-every",
        "6",
        "--json",
    ]);
    assert!(out.status.success());
    let listed = ids(&dir);
    assert_eq!(listed.len(), 10, "{listed:?}");
    // Restore-equals-saved: `restore` checks the rebuilt RAM against the checksum recorded at
    // save time before the guest runs, then the guest's console counter must continue.
    for salt in 0..2 {
        restores_and_runs(&dir, pick(&listed, salt));
    }
    // Flip one byte inside a delta record.
    let out = tandem(&["checkpoint", "list", s, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entries = v.as_array().unwrap();
    let victim = entries
        .iter()
        .skip(1)
        .find(|e| e["kind"] == "delta")
        .expect("a delta");
    let (vid, seg, off) = (
        victim["id"].as_u64().unwrap(),
        format!("seg-{:08}.tseg", victim["segment"].as_u64().unwrap()),
        victim["offset"].as_u64().unwrap(),
    );
    let path = dir.join(&seg);
    let mut b = std::fs::read(&path).unwrap();
    b[off as usize + 100] ^= 0x20;
    std::fs::write(&path, &b).unwrap();
    let out = tandem(&["checkpoint", "verify", s]);
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("checkpoint {vid} ")) && text.contains(&seg),
        "{text}"
    );
    let out = restore(&dir, vid);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("damaged") && err.contains(&seg), "{err}");
    // Unaffected: the checkpoint before the damaged one.
    restores_and_runs(&dir, vid - 1);
}

/// Starts a saver in its own process group (so its QEMU dies with it).
fn saver(dir: &Path, extra: &[&str]) -> std::process::Child {
    Command::new(tandem_harness::product_exe().unwrap())
        .args([
            "checkpoint",
            "save",
            "--dir",
            dir.to_str().unwrap(),
            "--vm-config",
            &lab_vm("sqlite"),
            "--interval",
            "100",
            "--keep",
            "4",
            "--base-every",
            "50",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()
        .unwrap()
}

fn kill_group(c: &mut std::process::Child) {
    // SAFETY: kill(2) on our child's process group.
    unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
    let _ = c.wait();
}

fn count(dir: &Path) -> usize {
    std::fs::read(dir.join("index")).map_or(0, |b| b.len().saturating_sub(32) / 64)
}

fn check_after_crash(dir: &Path, before: &[u64]) {
    let s = dir.to_str().unwrap();
    let out = tandem(&["checkpoint", "verify", s]);
    assert!(
        out.status.success(),
        "the store must verify after the crash"
    );
    let after = ids(dir);
    assert!(!after.is_empty());
    // Nothing committed is lost: what was listed is still there, except what retention
    // dropped (all of it older than what is kept now).
    let first = after[0];
    for id in before.iter().filter(|&&i| i >= first) {
        assert!(after.contains(id), "checkpoint {id} vanished: {after:?}");
    }
    restores_and_runs(dir, *after.last().unwrap());
}

#[test]
fn a_killed_saver_leaves_a_store_that_verifies_and_restores() {
    let d = tempfile::tempdir().unwrap();
    // SIGKILL at random points while checkpoints (and compactions) run.
    for (i, wait) in [7u64, 11].iter().enumerate() {
        let dir = d.path().join(format!("kill{i}"));
        let mut c = saver(&dir, &[]);
        let t = Instant::now();
        while count(&dir) < *wait as usize && t.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(pick(
            &[0, 37, 91, 160, 230],
            i as u64,
        )));
        let before = ids(&dir);
        kill_group(&mut c);
        check_after_crash(&dir, &before);
    }
    // Abort at each step of a compaction.
    for point in ["segment", "index", "renamed"] {
        let dir = d.path().join(point);
        let mut c = saver(&dir, &["--fault-compact", point]);
        let t = Instant::now();
        while c.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(20));
        }
        kill_group(&mut c);
        check_after_crash(&dir, &[]);
    }
}

fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(secs), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_second_saver_on_the_same_store_is_refused_while_the_first_continues() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("store");
    let mut first = saver(&dir, &[]);
    wait_for("the first saver's checkpoints", 120, || count(&dir) >= 2);
    let out = tandem(&[
        "checkpoint",
        "save",
        "--dir",
        dir.to_str().unwrap(),
        "--vm-config",
        &lab_vm("sqlite"),
        "--count",
        "1",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(dir.to_str().unwrap())
            && err.contains(&format!("pid {}", first.id()))
            && err.contains("only one process may write a store at a time"),
        "{err}"
    );
    // The first one was not disturbed: it is running and its checkpoints keep coming.
    assert!(first.try_wait().unwrap().is_none());
    let n = ids(&dir).last().copied().unwrap();
    wait_for("more checkpoints", 60, || {
        ids(&dir).last().is_some_and(|&l| l >= n + 3)
    });
    assert!(first.try_wait().unwrap().is_none());
    // SAFETY: kill(2) on our child (not its group: it stops its QEMU itself).
    unsafe { libc::kill(first.id() as i32, libc::SIGINT) };
    let t = Instant::now();
    while first.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = first.try_wait().unwrap();
    kill_group(&mut first);
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    check_after_crash(&dir, &[]);
}

/// A small tmpfs mounted for one test; unmounted (and its saver killed) on drop.
struct Tmpfs {
    path: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl Tmpfs {
    fn mount(path: &Path, mib: u64) -> Tmpfs {
        std::fs::create_dir_all(path).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(path)
            .status()
            .unwrap();
        assert!(ok.success(), "mount tmpfs (needs root)");
        Tmpfs {
            path: path.into(),
            child: None,
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            kill_group(c);
        }
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

#[test]
fn a_full_disk_skips_checkpoints_and_the_saver_carries_on() {
    let d = tempfile::tempdir().unwrap();
    // 84 MiB, 46 of them taken by a ballast file: the first base (~31 MiB for this guest)
    // fits. Once it is in, a second ballast leaves 2 MiB, which the deltas after it (80-200
    // KiB each, depending on the codec) fill well before the 90th checkpoint. Removing both
    // makes room for a new base and the rest.
    let mut fs = Tmpfs::mount(&d.path().join("mnt"), 84);
    let ballast = fs.path.join("ballast");
    std::fs::write(&ballast, vec![1u8; 46 << 20]).unwrap();
    let dir = fs.path.join("store");
    let mut c = Command::new(tandem_harness::product_exe().unwrap())
        .args(["checkpoint", "save", "--dir", dir.to_str().unwrap()])
        .args([
            "--vm-config",
            &lab_vm("sqlite"),
            "--interval",
            "150",
            "--count",
            "90",
        ])
        .arg("--json")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stderr = c.stderr.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            eprintln!("saver: {l}");
            let _ = tx.send(l);
        }
    });
    let mut stdout = c.stdout.take().unwrap();
    fs.child = Some(c);
    let wait_line = |pat: &str, secs: u64| -> String {
        let t = Instant::now();
        loop {
            let left = Duration::from_secs(secs).saturating_sub(t.elapsed());
            match rx.recv_timeout(left) {
                Ok(l) if l.contains(pat) => return l,
                Ok(_) => {}
                Err(e) => panic!("no line with {pat:?}: {e}"),
            }
        }
    };
    wait_line("saved up to checkpoint", 120);
    let st = rustix::fs::statvfs(&fs.path).unwrap();
    let free = st.f_bavail * st.f_frsize;
    let ballast2 = fs.path.join("ballast2");
    if free > 2 << 20 {
        // The saver may fill the rest first: a short write is as good.
        let _ = std::fs::write(&ballast2, vec![1u8; (free - (2 << 20)) as usize]);
    }
    let full = wait_line("is full", 240);
    assert!(
        full.contains(dir.to_str().unwrap())
            && full.contains("was NOT saved")
            && full.contains("it would have been checkpoint")
            && full.contains("Free space")
            && full.contains("next one saved will be a full base"),
        "{full}"
    );
    let saver = fs.child.as_mut().unwrap();
    assert!(saver.try_wait().unwrap().is_none(), "the saver must go on");
    // Meanwhile the store is consistent.
    assert!(tandem(&["checkpoint", "verify", dir.to_str().unwrap()])
        .status
        .success());
    std::fs::remove_file(&ballast).unwrap();
    let _ = std::fs::remove_file(&ballast2);
    let again = wait_line("saving again", 120);
    let id: u64 = again
        .split("saving again: checkpoint ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{again}"));
    // The saver ends by itself after its --count, cleanly.
    let saver = fs.child.as_mut().unwrap();
    let t = Instant::now();
    while saver.try_wait().unwrap().is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "saver did not finish"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = saver.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let mut out = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut out).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["checkpoints"], 90, "{v}");
    assert!(v["skipped"].as_u64().unwrap() >= 1, "{v}");
    // The first checkpoint saved after the failure is a base; the store verifies and its
    // last checkpoint restores.
    let list = tandem(&["checkpoint", "list", dir.to_str().unwrap(), "--json"]);
    let entries: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let e = entries
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == id)
        .unwrap_or_else(|| panic!("checkpoint {id} listed"));
    assert_eq!(e["kind"], "base", "{e}");
    let listed = ids(&dir);
    assert!(listed.windows(2).all(|w| w[1] == w[0] + 1), "{listed:?}");
    assert!(tandem(&["checkpoint", "verify", dir.to_str().unwrap()])
        .status
        .success());
    restores_and_runs(&dir, *listed.last().unwrap());
}
