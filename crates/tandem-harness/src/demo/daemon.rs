//! tandem daemons started by the demo inside a network namespace, each in its own process
//! group so that one `kill` takes down the daemon and its QEMU together, as a host failure.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

pub struct Daemon {
    pub name: &'static str,
    child: Child,
    lines: Receiver<String>,
    pub log: PathBuf,
    /// Guest workload progress (`guest: ... txns=N` / `objs=N`) with arrival times.
    pub progress: Arc<Mutex<Vec<(Instant, u64)>>>,
}

/// The counter of a `guest: sqlite txns=N ...` or `guest: compile objs=N` line.
fn progress_value(line: &str) -> Option<u64> {
    let rest = line.split("guest: ").nth(1)?;
    let v = rest
        .split_whitespace()
        .find_map(|f| f.strip_prefix("txns=").or_else(|| f.strip_prefix("objs=")))?;
    v.parse().ok()
}

impl Daemon {
    /// Runs `exe args` in network namespace `ns`; output goes to `log` (and to `wait_line`).
    pub fn spawn(
        name: &'static str,
        ns: &str,
        exe: &Path,
        args: &[String],
        log: PathBuf,
    ) -> anyhow::Result<Daemon> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns])
            .arg(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        // The daemon dies with the harness (a demo or bench that is killed must not leave
        // daemons running; each daemon's QEMU dies with its daemon in turn).
        // SAFETY: the closure runs between fork and exec and only calls prctl(2), which is
        // async-signal-safe; it allocates nothing. (`ip netns exec` keeps the setting: it is
        // not set-user-ID.)
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting the {name} (ip netns exec {ns} ...)"))?;
        let (tx, rx) = channel();
        let file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().context("stdout")?);
        let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().context("stderr")?);
        let progress: Arc<Mutex<Vec<(Instant, u64)>>> = Arc::default();
        for stream in [out, err] {
            let (tx, mut file, progress) = (tx.clone(), file.try_clone()?, progress.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = writeln!(file, "{line}");
                    if let Some(v) = progress_value(&line) {
                        progress
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push((Instant::now(), v));
                    }
                    let _ = tx.send(line);
                }
            });
        }
        Ok(Daemon {
            name,
            child,
            lines: rx,
            log,
            progress,
        })
    }

    /// Waits for a line containing `pat`; fails with the daemon's log if it exits first.
    pub fn wait_line(&mut self, pat: &str, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.lines.recv_timeout(Duration::from_millis(200)) {
                Ok(l) if l.contains(pat) => return Ok(l),
                Ok(_) => {}
                Err(_) => {
                    if let Ok(Some(st)) = self.child.try_wait() {
                        std::thread::sleep(Duration::from_millis(200));
                        bail!(
                            "the {} exited ({st}) before printing {pat:?}; its log ({}):\n{}",
                            self.name,
                            self.log.display(),
                            std::fs::read_to_string(&self.log).unwrap_or_default()
                        );
                    }
                    if Instant::now() > deadline {
                        bail!(
                            "the {} did not print {pat:?} within {timeout:?}; see {}",
                            self.name,
                            self.log.display()
                        );
                    }
                }
            }
        }
    }

    /// Whether a line containing `pat` arrived (non-blocking).
    pub fn saw(&mut self, pat: &str) -> bool {
        while let Ok(l) = self.lines.try_recv() {
            if l.contains(pat) {
                return true;
            }
        }
        false
    }

    /// The daemon's process id (`ip netns exec` execs it, so this is tandem's own pid).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// The exit code once the daemon exited (`None`: still running, or killed by a signal).
    pub fn exit_code(&mut self) -> Option<i32> {
        self.child.try_wait().ok().flatten().and_then(|s| s.code())
    }

    /// SIGKILL to the whole process group (the daemon and its QEMU), as a host failure.
    pub fn kill_host(&mut self) {
        // SAFETY: kill(2) on our child's process group (it was started with process_group(0)).
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.wait();
    }

    /// SIGTERM, then SIGKILL to the group if it does not exit within `grace`.
    pub fn terminate(&mut self, grace: Duration) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < grace {
            if self.exited() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill_host();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if !self.exited() {
            self.kill_host();
        }
    }
}

/// The QEMU pid in the primary's "guest ready ... QEMU pid N, ..." line (0 if absent).
pub fn qemu_pid(ready: &str) -> u32 {
    ready
        .split("QEMU pid ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(0)
}

/// Progress per second between the first and last sample inside `[from, to)`.
pub fn rate(samples: &[(Instant, u64)], from: Instant, to: Instant) -> Option<f64> {
    let inside: Vec<&(Instant, u64)> = samples
        .iter()
        .filter(|(t, _)| *t >= from && *t < to)
        .collect();
    let (a, b) = (inside.first()?, inside.last()?);
    let secs = b.0.duration_since(a.0).as_secs_f64();
    (secs > 0.5 && b.1 >= a.1).then(|| (b.1 - a.1) as f64 / secs)
}

#[cfg(test)]
mod tests {
    #[test]
    fn progress_lines_parse() {
        assert_eq!(
            super::progress_value("primary: guest: sqlite txns=120 rows=33"),
            Some(120)
        );
        assert_eq!(
            super::progress_value("backup: guest: compile objs=40"),
            Some(40)
        );
        assert_eq!(super::progress_value("primary: epoch 3 acked 2"), None);
    }
}
