//! The running QEMU's monitor, however it is reached: its own QMP socket (a QEMU started by
//! hand), or libvirt's (a domain libvirt runs: libvirt holds the only QMP connection, and
//! passes a command through with `virsh qemu-monitor-command`, which marks the domain
//! "tainted: custom-monitor" in its log).
//!
//! Adoption asks the source a few dozen questions and polls its migration; a `virsh` process
//! per command (~20–50 ms) is far inside what a live migration of seconds needs. The
//! migration's connection is handed to the source as a file descriptor (`getfd`, through
//! libvirt with `--pass-fds`): a QEMU libvirt runs as its own user, confined, could not open a
//! socket in tandem's private runtime directory.

use std::io::Read;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::qmp::{Qmp, QmpError};

/// A QEMU monitor that runs QMP commands.
pub trait Monitor {
    /// Runs `command` with `args`; QEMU's `return` value.
    fn execute(&mut self, command: &str, args: Option<Value>) -> Result<Value, QmpError>;

    /// Hands `fd` to QEMU under `name` (QMP `getfd`).
    fn send_fd(&mut self, name: &str, fd: BorrowedFd<'_>) -> Result<(), QmpError>;

    /// The guest's run state (`running`, `paused`, `postmigrate`, ...).
    fn status(&mut self) -> Result<String, QmpError> {
        let r = self.execute("query-status", None)?;
        Ok(r["status"].as_str().unwrap_or("unknown").to_string())
    }
}

impl Monitor for Qmp {
    fn execute(&mut self, command: &str, args: Option<Value>) -> Result<Value, QmpError> {
        Qmp::execute(self, command, args)
    }

    fn send_fd(&mut self, name: &str, fd: BorrowedFd<'_>) -> Result<(), QmpError> {
        self.getfd(name, fd)
    }
}

/// Where the running guest's QEMU is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// A QEMU with a QMP socket of its own, started by hand or by a tool that leaves it free.
    Qmp(PathBuf),
    /// A libvirt domain.
    Libvirt(Libvirt),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Qmp(p) => write!(f, "the QEMU at {}", p.display()),
            Source::Libvirt(l) => write!(f, "libvirt domain {}", l.domain),
        }
    }
}

impl Source {
    /// What to check when the source cannot be reached.
    pub fn hint(&self) -> &'static str {
        match self {
            Source::Qmp(_) => "a QMP socket serves one client at a time: is libvirt or another tool connected to it? A libvirt domain is adopted with --libvirt",
            Source::Libvirt(_) => "is the domain running (`virsh list`), and does --connect name the libvirt that runs it?",
        }
    }
}

/// A libvirt domain, reached through `virsh`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Libvirt {
    /// The domain's name.
    pub domain: String,
    /// libvirt's connection URI (`virsh -c`); None: virsh's default
    /// (`$LIBVIRT_DEFAULT_URI`, else `qemu:///system` for root).
    #[serde(default)]
    pub uri: Option<String>,
}

/// The longest a virsh call may take (a hung libvirtd must not hang an adoption).
const VIRSH_TIMEOUT: Duration = Duration::from_secs(30);

/// The fd number a passed descriptor has in virsh.
const PASSED_FD: i32 = 3;

impl Libvirt {
    /// `virsh [-c URI] -q ARGS...`, ready to run.
    pub fn virsh<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut c = Command::new("virsh");
        if let Some(u) = &self.uri {
            c.args(["-c", u]);
        }
        c.arg("-q").args(args);
        c
    }

    /// Runs `virsh ARGS...` (at most 30 s); its standard output, or its error message.
    pub fn run<I, S>(&self, args: I) -> Result<String, QmpError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        self.run_with(self.virsh(args), None)
    }

    /// Runs the virsh command `c`, `fd` open in it as descriptor 3.
    fn run_with(&self, mut c: Command, fd: Option<BorrowedFd<'_>>) -> Result<String, QmpError> {
        let what: Vec<String> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let what = format!("virsh {}", what.join(" "));
        if let Some(fd) = fd {
            let raw = fd.as_raw_fd();
            use std::os::unix::process::CommandExt;
            // SAFETY: runs in the child between fork and exec and only calls dup2(2) and
            // fcntl(2), both async-signal-safe, on descriptors of this process (raw stays
            // open: the caller borrows it for the whole call).
            unsafe {
                c.pre_exec(move || {
                    let r = if raw == PASSED_FD {
                        libc::fcntl(PASSED_FD, libc::F_SETFD, 0)
                    } else {
                        libc::dup2(raw, PASSED_FD)
                    };
                    if r < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                })
            };
        }
        let mut child = c
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                QmpError::Libvirt(format!(
                    "running virsh (libvirt's client; install libvirt-clients): {e}"
                ))
            })?;
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break s;
            }
            if t.elapsed() > VIRSH_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                return Err(QmpError::Timeout(VIRSH_TIMEOUT, what));
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let (mut out, mut err) = (String::new(), String::new());
        if let Some(mut o) = child.stdout.take() {
            o.read_to_string(&mut out)?;
        }
        if let Some(mut e) = child.stderr.take() {
            e.read_to_string(&mut err)?;
        }
        if !status.success() {
            return Err(QmpError::Libvirt(format!("{what}: {}", err.trim())));
        }
        Ok(out)
    }

    fn monitor(
        &self,
        command: &str,
        args: Option<Value>,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Value, QmpError> {
        let mut cmd = json!({ "execute": command });
        if let Some(a) = args {
            cmd["arguments"] = a;
        }
        let mut v = vec!["qemu-monitor-command".to_string(), self.domain.clone()];
        if fd.is_some() {
            v.extend(["--pass-fds".to_string(), PASSED_FD.to_string()]);
        }
        v.push(cmd.to_string());
        let out = self.run_with(self.virsh(&v), fd)?;
        let reply: Value = serde_json::from_str(out.trim())
            .map_err(|e| QmpError::Protocol(format!("virsh qemu-monitor-command: {e}: {out}")))?;
        reply_value(command, reply)
    }
}

impl Monitor for Libvirt {
    fn execute(&mut self, command: &str, args: Option<Value>) -> Result<Value, QmpError> {
        self.monitor(command, args, None)
    }

    fn send_fd(&mut self, name: &str, fd: BorrowedFd<'_>) -> Result<(), QmpError> {
        self.monitor("getfd", Some(json!({ "fdname": name })), Some(fd))
            .map(|_| ())
    }
}

/// QMP's reply: its `return`, or its `error` as [`QmpError::Command`].
fn reply_value(command: &str, mut reply: Value) -> Result<Value, QmpError> {
    if let Some(e) = reply.get("error") {
        return Err(QmpError::Command {
            command: command.into(),
            class: e["class"].as_str().unwrap_or("?").into(),
            desc: e["desc"].as_str().unwrap_or("?").into(),
        });
    }
    match reply.get_mut("return") {
        Some(v) => Ok(v.take()),
        None => Err(QmpError::Protocol(format!(
            "reply to {command} without return or error: {reply}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_gives_its_return_or_its_error() {
        let ok = reply_value(
            "query-status",
            json!({"return": {"status": "running"}, "id": "x"}),
        );
        assert_eq!(ok.unwrap()["status"], "running");
        let err = reply_value(
            "migrate",
            json!({"error": {"class": "GenericError", "desc": "busy"}}),
        );
        assert!(
            matches!(err, Err(QmpError::Command { ref class, ref desc, .. }) if class == "GenericError" && desc == "busy")
        );
        assert!(matches!(
            reply_value("x", json!({"id": 1})),
            Err(QmpError::Protocol(_))
        ));
    }

    #[test]
    fn virsh_gets_the_connection_uri() {
        let l = Libvirt {
            domain: "web".into(),
            uri: Some("qemu:///system".into()),
        };
        let c = l.virsh(["domstate", "web"]);
        let args: Vec<_> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(args, ["-c", "qemu:///system", "-q", "domstate", "web"]);
    }
}
