//! The running QEMU's monitor, however it is reached: its own QMP socket (a QEMU started by
//! hand), or libvirt's (a domain libvirt runs: libvirt holds the only QMP connection, and
//! passes a command through with `virsh qemu-monitor-command`, which marks the domain
//! "tainted: custom-monitor" in its log).
//!
//! Adoption asks the source a few dozen questions and polls its migration; a `virsh` process
//! per command (~20–50 ms) is far inside what a live migration of seconds needs.

use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};

use crate::qmp::{Qmp, QmpError};

/// A QEMU monitor that runs QMP commands.
pub trait Monitor {
    /// Runs `command` with `args`; QEMU's `return` value.
    fn execute(&mut self, command: &str, args: Option<Value>) -> Result<Value, QmpError>;

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

impl Libvirt {
    /// `virsh [-c URI] ARGS...`, ready to run.
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

    /// Runs `virsh ARGS...`; its standard output, or an error carrying its message.
    pub fn run<I, S>(&self, args: I) -> Result<String, QmpError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut c = self.virsh(args);
        let out = c.output().map_err(|e| QmpError::Connect {
            path: format!("virsh (libvirt's client; install libvirt-clients): {e}"),
            source: e,
        })?;
        if !out.status.success() {
            let what: Vec<String> = c
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            return Err(QmpError::Command {
                command: format!("virsh {}", what.join(" ")),
                class: "libvirt".into(),
                desc: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Monitor for Libvirt {
    fn execute(&mut self, command: &str, args: Option<Value>) -> Result<Value, QmpError> {
        let mut cmd = json!({ "execute": command });
        if let Some(a) = args {
            cmd["arguments"] = a;
        }
        let out = self.run(["qemu-monitor-command", &self.domain, &cmd.to_string()])?;
        let reply: Value = serde_json::from_str(out.trim())
            .map_err(|e| QmpError::Protocol(format!("virsh qemu-monitor-command: {e}: {out}")))?;
        reply_value(command, reply)
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
