//! The daemons' control socket: a unix socket that reads one request line and answers with one
//! JSON document, then closes. `status` (or nothing) gets the daemon's status (role, committed
//! epoch, lag, ownership generation in etcd, link, last failover and why); `switchover` asks a primary for a
//! planned switchover (`tandem switchover`). `tandem status` reads every socket in the run
//! directory.
//!
//! Sockets live in `/run/tandem` (override with `TANDEM_RUN_DIR`), one per daemon, named
//! `<role>-vm<id>-<pid>.sock`; a daemon removes its own when it ends, `tandem status` removes
//! those of daemons that died.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::metrics::Registry;

/// The directory of the control sockets.
pub fn run_dir() -> PathBuf {
    std::env::var_os("TANDEM_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/tandem"))
}

/// A control socket failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The socket could not be created.
    #[error("creating the control socket {0}")]
    Bind(PathBuf, #[source] std::io::Error),
    /// The run directory could not be read.
    #[error("reading {0} (is a tandem daemon running on this host?)")]
    Dir(PathBuf, #[source] std::io::Error),
    /// A daemon did not answer.
    #[error("asking {0}")]
    Ask(PathBuf, #[source] std::io::Error),
    /// A daemon answered something that is not a status document.
    #[error("{0} answered something that is not a status document")]
    Reply(PathBuf),
}

/// Answers a request other than `status` (the daemon's commands).
pub type Handler = std::sync::Arc<dyn Fn(&str) -> serde_json::Value + Send + Sync>;

/// Serves the status of `registry` on a socket; removes it when dropped.
pub struct Control {
    path: PathBuf,
}

/// Reads the request line of a control connection: empty when the client sent none within
/// 300 ms (clients of older versions just read).
fn request(c: &mut UnixStream) -> String {
    let _ = c.set_read_timeout(Some(Duration::from_millis(300)));
    let mut buf = Vec::new();
    let mut b = [0u8; 1];
    while buf.len() < 64 {
        match c.read(&mut b) {
            Ok(1) if b[0] != b'\n' => buf.push(b[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&buf).trim().to_string()
}

impl Control {
    /// Listens on `path` (its directory is created) and answers on a background thread.
    pub fn serve(path: &Path, registry: Registry) -> Result<Control, ControlError> {
        Self::serve_with(path, registry, None)
    }

    /// Like [`Control::serve`], with `handler` answering every request but `status`.
    pub fn serve_with(
        path: &Path,
        registry: Registry,
        handler: Option<Handler>,
    ) -> Result<Control, ControlError> {
        let bind = |e| ControlError::Bind(path.to_path_buf(), e);
        if let Some(d) = path.parent() {
            // Made 0700 by the process's umask (077); the socket itself is 0600: only
            // tandem's user can connect (and so stop or hand over the guest).
            std::fs::create_dir_all(d).map_err(bind)?;
        }
        let _ = std::fs::remove_file(path);
        let l = UnixListener::bind(path).map_err(bind)?;
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                for c in l.incoming() {
                    let Ok(mut c) = c else { continue };
                    let _ = c.set_write_timeout(Some(Duration::from_secs(1)));
                    let req = request(&mut c);
                    let reply = match (req.as_str(), &handler) {
                        ("" | "status", _) => registry.status(),
                        (cmd, Some(h)) => h(cmd),
                        (cmd, None) => serde_json::json!({
                            "ok": false,
                            "error": format!("this daemon does not take {cmd:?}")
                        }),
                    };
                    let mut doc = reply.to_string();
                    doc.push('\n');
                    let _ = c.write_all(doc.as_bytes());
                }
            })
            .map_err(bind)?;
        Ok(Control {
            path: path.to_path_buf(),
        })
    }

    /// The default socket of a daemon: `<run dir>/<role>-vm<id>-<pid>.sock`.
    pub fn default_path(role: &str, vm_id: u64) -> PathBuf {
        run_dir().join(format!("{role}-vm{vm_id}-{}.sock", std::process::id()))
    }

    /// A daemon's socket at `path` (default [`Control::default_path`]); a socket that cannot be
    /// created is reported on `status` and the daemon goes on without one.
    pub fn serve_or_warn(
        path: Option<&Path>,
        role: &str,
        vm_id: u64,
        registry: Registry,
        status: &crate::Status,
    ) -> Option<Control> {
        Self::serve_or_warn_with(path, role, vm_id, registry, None, status)
    }

    /// [`Control::serve_or_warn`] with a command handler.
    pub fn serve_or_warn_with(
        path: Option<&Path>,
        role: &str,
        vm_id: u64,
        registry: Registry,
        handler: Option<Handler>,
        status: &crate::Status,
    ) -> Option<Control> {
        let path = path.map_or_else(|| Control::default_path(role, vm_id), Path::to_path_buf);
        match Control::serve_with(&path, registry, handler) {
            Ok(c) => Some(c),
            Err(e) => {
                status.warn(format!(
                    "no control socket ({}): `tandem status` will not see this daemon",
                    crate::chain(&e)
                ));
                None
            }
        }
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Asks the daemon at `path` for its status.
pub fn ask(path: &Path) -> Result<serde_json::Value, ControlError> {
    let v = command(path, "status")?;
    if v.get("role").is_none() {
        return Err(ControlError::Reply(path.to_path_buf()));
    }
    Ok(v)
}

/// Sends the request `cmd` to the daemon at `path`; its JSON answer.
pub fn command(path: &Path, cmd: &str) -> Result<serde_json::Value, ControlError> {
    let err = |e| ControlError::Ask(path.to_path_buf(), e);
    let mut c = UnixStream::connect(path).map_err(err)?;
    c.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(err)?;
    c.write_all(format!("{cmd}\n").as_bytes()).map_err(err)?;
    let _ = c.shutdown(std::net::Shutdown::Write);
    let mut s = String::new();
    c.take(1 << 20).read_to_string(&mut s).map_err(err)?;
    let v: serde_json::Value =
        serde_json::from_str(&s).map_err(|_| ControlError::Reply(path.to_path_buf()))?;
    if !v.is_object() {
        return Err(ControlError::Reply(path.to_path_buf()));
    }
    Ok(v)
}

/// Asks every daemon with a socket in `dir`; removes sockets nobody listens on any more.
pub fn ask_all(dir: &Path) -> Result<Vec<(PathBuf, serde_json::Value)>, ControlError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(ControlError::Dir(dir.to_path_buf(), e)),
    };
    let mut paths: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "sock"))
        .collect();
    paths.sort();
    let mut out = Vec::new();
    for p in paths {
        match ask(&p) {
            Ok(v) => out.push((p, v)),
            Err(ControlError::Ask(_, e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                // The daemon died without removing its socket.
                let _ = std::fs::remove_file(&p);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Shares (0 to 1) by name as "a 60 %, b 40 %, c <1 %", largest first; empty for none.
pub fn format_shares<'a>(shares: impl IntoIterator<Item = (&'a str, f64)>) -> String {
    let mut by: Vec<_> = shares.into_iter().collect();
    by.sort_by(|a, b| b.1.total_cmp(&a.1));
    let v: Vec<_> = by
        .iter()
        .map(|(k, v)| match 100.0 * v {
            p if p < 0.5 => format!("{k} <1 %"),
            p => format!("{k} {p:.0} %"),
        })
        .collect();
    v.join(", ")
}

/// One line per daemon, for people.
pub fn describe(v: &serde_json::Value) -> String {
    let f = |k: &str| v.get(k).cloned().unwrap_or(serde_json::Value::Null);
    let mut line = format!(
        "{} vm {} (pid {}{}): {}; committed epoch {}",
        f("role").as_str().unwrap_or("?"),
        f("vm_id"),
        f("pid"),
        f("node")
            .as_str()
            .map(|n| format!(", {n}"))
            .unwrap_or_default(),
        f("state").as_str().unwrap_or("?"),
        f("committed_epoch"),
    );
    if let Some(l) = f("lag_epochs").as_u64() {
        line += &format!(", lag {l} epoch(s)");
    }
    if let Some(a) = f("last_ack_ms_ago").as_u64() {
        line += &format!(" (last {a} ms ago)");
    }
    if let Some(l) = f("zstd_level").as_i64() {
        line += &format!(", zstd level {l}");
        if f("long_patches").as_bool() == Some(true) {
            line += " with long run patches";
        }
        if f("word_deltas").as_bool() == Some(true) {
            line += " with word deltas";
        }
        if f("prefix_off").as_bool() == Some(true) {
            line += " without the reference prefix";
        }
    }
    if let Some(b) = f("guest_busy_pct").as_f64() {
        line += &format!(", guest busy {b:.0} % of its last run");
    }
    if let Some(cuts) = f("epochs_cut").as_object() {
        let all = cuts.values().filter_map(|v| v.as_u64()).sum::<u64>().max(1) as f64;
        let shares = format_shares(
            cuts.iter()
                .filter_map(|(k, v)| Some((k.as_str(), v.as_u64()? as f64 / all))),
        );
        if !shares.is_empty() {
            line += &format!(", epochs cut by {shares}");
        }
    }
    if let Some(p) = f("progress").as_object() {
        line += &format!(
            "; {} {}% of {} MiB",
            p["what"].as_str().unwrap_or("copy"),
            p["percent"],
            p["total_bytes"].as_u64().unwrap_or(0) >> 20
        );
        if let Some(eta) = p["eta_s"].as_f64() {
            line += &format!(", about {eta:.0} s left");
        }
    }
    if let Some(d) = f("disks").as_object() {
        let path = d["path"].as_str().unwrap_or("?");
        let volatile = if d["durable"].as_bool() == Some(false) {
            " (in memory: gone with this host)"
        } else {
            ""
        };
        line += &match d["what"].as_str() {
            Some("guest") => format!("; the guest's disks: {path}{volatile}"),
            _ => format!("; disk copy {path}{volatile}"),
        };
    }
    line += &format!("; link {}", f("link").as_str().unwrap_or("?"));
    if let Some(p) = f("peer").as_str() {
        line += &format!(" to {p}");
    }
    if let Some(g) = f("owner").get("generation").and_then(|g| g.as_u64()) {
        line += &format!("; owner generation {g} in etcd");
    }
    match f("last_failover") {
        serde_json::Value::Null => {}
        lf => {
            line += &format!(
                "; failed over from epoch {} ({})",
                lf["epoch"],
                lf["reason"].as_str().unwrap_or("?")
            )
        }
    }
    line
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_status_line_says_where_the_guests_disks_are() {
        let doc = serde_json::json!({
            "role": "primary", "vm_id": 7, "pid": 1, "state": "protected",
            "committed_epoch": 9, "link": "up",
            "disks": {"path": "/var/lib/tandem/web1/guest-disks.raw", "what": "guest", "durable": true},
        });
        let line = super::describe(&doc);
        assert!(
            line.contains("; the guest's disks: /var/lib/tandem/web1/guest-disks.raw; link up"),
            "{line}"
        );
        let mut doc = doc;
        doc["disks"]["what"] = "copy".into();
        doc["disks"]["durable"] = false.into();
        let line = super::describe(&doc);
        assert!(
            line.contains(
                "; disk copy /var/lib/tandem/web1/guest-disks.raw (in memory: gone with this host)"
            ),
            "{line}"
        );
    }

    #[test]
    fn the_status_line_says_why_epochs_ended() {
        let doc = serde_json::json!({
            "role": "primary", "vm_id": 7, "pid": 1, "state": "protected",
            "committed_epoch": 9, "link": "up",
            "epochs_cut": {"output": 6, "time": 3, "start": 1},
        });
        let line = super::describe(&doc);
        assert!(
            line.contains(", epochs cut by output 60 %, time 30 %, start 10 %"),
            "{line}"
        );
    }
}
