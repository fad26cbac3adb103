//! `tandem backup` as a systemd `Type=notify` service would run it: a datagram socket plays
//! systemd's NOTIFY_SOCKET with WATCHDOG_USEC set, and must receive READY=1, STATUS= lines,
//! WATCHDOG=1 pings that stop while the daemon is hung (SIGSTOP) and come back after, and
//! STOPPING=1 at the end. The unit templates in dist/systemd pass `systemd-analyze verify`.

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn recv_until(s: &UnixDatagram, what: &str, within: Duration) -> Vec<String> {
    let t = Instant::now();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while t.elapsed() < within {
        if let Ok(n) = s.recv(&mut buf) {
            let m = String::from_utf8_lossy(&buf[..n]).to_string();
            let hit = m.lines().any(|l| l.starts_with(what));
            seen.push(m);
            if hit {
                return seen;
            }
        }
    }
    panic!("no {what} within {within:?}; got {seen:?}");
}

/// Kills the daemon if the test fails half-way (an orphan would hold the test's output).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn backup_notifies_systemd_and_stops_pinging_while_hung() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let sock = dir.path().join("notify.sock");
    let s = UnixDatagram::bind(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let port = tandem_test_support::free_port();
    // systemd sets WATCHDOG_PID to the service's main pid: a shell that execs tandem knows it.
    let mut backup = KillOnDrop(
        Command::new("sh")
            .args(["-c", "WATCHDOG_PID=$$ exec \"$0\" \"$@\""])
            .arg(tandem_harness::product_exe().unwrap())
            .args(["backup", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--dir", dir.path().join("b").to_str().unwrap()])
            .arg("--vm-config")
            .arg(tandem_harness::lab_description(dir.path(), "idle", 64).unwrap())
            .arg("--control")
            .arg(dir.path().join("b.sock"))
            .env("NOTIFY_SOCKET", &sock)
            .stderr(Stdio::null())
            .env("WATCHDOG_USEC", "2000000")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    recv_until(&s, "READY=1", Duration::from_secs(60));
    let st = recv_until(&s, "STATUS=", Duration::from_secs(5));
    assert!(
        st.last().unwrap().contains("backup vm 1") && st.last().unwrap().contains("standby"),
        "{st:?}"
    );
    recv_until(&s, "WATCHDOG=1", Duration::from_secs(3));
    // Hung: no pings at all while stopped; they resume once it runs again.
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(backup.0.id() as i32, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_millis(300));
    while s.recv(&mut [0u8; 4096]).is_ok() {}
    let mut buf = [0u8; 4096];
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(2500) {
        if let Ok(n) = s.recv(&mut buf) {
            panic!(
                "a stopped daemon sent {:?}",
                String::from_utf8_lossy(&buf[..n])
            );
        }
    }
    // SAFETY: as above.
    unsafe { libc::kill(backup.0.id() as i32, libc::SIGCONT) };
    recv_until(&s, "WATCHDOG=1", Duration::from_secs(3));
    // SAFETY: as above; SIGTERM asks the backup to stop.
    unsafe { libc::kill(backup.0.id() as i32, libc::SIGTERM) };
    recv_until(&s, "STOPPING=1", Duration::from_secs(30));
    assert!(backup.0.wait().unwrap().success());
}

#[test]
fn unit_templates_pass_systemd_analyze_verify() {
    let Ok(out) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("systemd-analyze is not installed; skipping");
        return;
    };
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dist/systemd");
    let mut units = Vec::new();
    for name in [
        "tandem@.service",
        "tandem-primary@.service",
        "tandem-backup@.service",
    ] {
        // An instance of the template, with an executable that exists here.
        let text = std::fs::read_to_string(src.join(name)).unwrap().replace(
            "/usr/bin/tandem",
            &tandem_harness::product_exe().unwrap().display().to_string(),
        );
        let unit = dir.path().join(name.replace("@.", "@vm1."));
        std::fs::write(&unit, text).unwrap();
        units.push(unit);
    }
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .args(&units)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !err.contains("Unknown key"),
        "systemd-analyze verify: {err}"
    );
}
