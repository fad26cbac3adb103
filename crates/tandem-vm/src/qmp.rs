//! A small synchronous QMP client over a unix socket, with file-descriptor passing (`getfd`).
//!
//! Why not the `qapi` crate: its sync client owns the socket as a plain byte stream and cannot
//! attach `SCM_RIGHTS` ancillary data to a command, which tandem needs for every device-state
//! capture and restore (`getfd` + `migrate fd:NAME`). The handful of commands tandem issues are
//! built with `serde_json` here; replies and events are parsed generically.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod armed;
pub use armed::Armed;

/// Errors of the QMP client.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// Could not connect to QEMU's monitor socket.
    #[error("cannot connect to QMP socket {path}")]
    Connect {
        /// Socket path.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the socket failed.
    #[error("QMP socket I/O")]
    Io(#[from] std::io::Error),
    /// QEMU closed the monitor (it exited).
    #[error("QEMU closed the QMP connection (did it exit?)")]
    Closed,
    /// QEMU sent something that is not QMP.
    #[error("malformed QMP message: {0}")]
    Protocol(String),
    /// A command returned an error.
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        /// Command name.
        command: String,
        /// QMP error class.
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// Timed out waiting for something.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
    /// libvirt (virsh) failed to pass a command to the domain's QEMU.
    #[error("libvirt: {0}")]
    Libvirt(String),
}

/// A connected QMP session in command mode.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    events: VecDeque<Value>,
    /// Replies read ahead of their [`Qmp::reply`] ([`Qmp::drain_events`]).
    early: VecDeque<Value>,
    next_id: u64,
    /// QEMU version reported in the greeting, e.g. (7, 2, 22).
    pub version: (u64, u64, u64),
}

/// A command sent with [`Qmp::start`] whose reply is still to be read.
#[must_use = "read the reply with Qmp::reply"]
#[derive(Debug)]
pub struct Sent {
    /// `None`: sent without one, on a monitor that has one command in flight at most.
    id: Option<u64>,
    command: String,
}

/// A QMP command object: `execute`, its `id` if it has one, its `arguments`.
fn command_json(command: &str, id: Option<u64>, args: Option<Value>) -> Value {
    let mut cmd = json!({ "execute": command });
    if let Some(id) = id {
        cmd["id"] = id.into();
    }
    if let Some(a) = args {
        cmd["arguments"] = a;
    }
    cmd
}

impl Qmp {
    /// Connects to `path`, retrying until `timeout` (QEMU creates the socket at startup), reads
    /// the greeting and enters command mode.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(source) => {
                    return Err(QmpError::Connect {
                        path: path.display().to_string(),
                        source,
                    })
                }
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let writer = stream.try_clone()?;
        let mut qmp = Qmp {
            reader: BufReader::new(stream),
            writer,
            events: VecDeque::new(),
            early: VecDeque::new(),
            next_id: 1,
            version: (0, 0, 0),
        };
        let greeting = qmp.read_message()?;
        let v = &greeting["QMP"]["version"]["qemu"];
        qmp.version = (
            v["major"].as_u64().unwrap_or(0),
            v["minor"].as_u64().unwrap_or(0),
            v["micro"].as_u64().unwrap_or(0),
        );
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!(
                "expected greeting, got {greeting}"
            )));
        }
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    QmpError::Timeout(Duration::from_secs(30), "a QMP reply".into())
                }
                _ => QmpError::Io(e),
            })?;
        if n == 0 {
            return Err(QmpError::Closed);
        }
        serde_json::from_str(&line).map_err(|e| QmpError::Protocol(format!("{e}: {line:.200}")))
    }

    fn send(&mut self, cmd: &Value, fd: Option<BorrowedFd<'_>>) -> Result<(), QmpError> {
        let mut bytes = serde_json::to_vec(cmd).map_err(|e| QmpError::Protocol(e.to_string()))?;
        bytes.push(b'\n');
        match fd {
            None => self.writer.write_all(&bytes)?,
            Some(fd) => {
                use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
                let fds = [fd];
                let mut space =
                    [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut anc = SendAncillaryBuffer::new(&mut space);
                anc.push(SendAncillaryMessage::ScmRights(&fds));
                let iov = [std::io::IoSlice::new(&bytes)];
                let sent = sendmsg(self.writer.as_fd(), &iov, &mut anc, SendFlags::empty())
                    .map_err(std::io::Error::from)?;
                if sent < bytes.len() {
                    self.writer.write_all(&bytes[sent..])?;
                }
            }
        }
        Ok(())
    }

    fn roundtrip(
        &mut self,
        command: &str,
        args: Option<Value>,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Value, QmpError> {
        let sent = self.send_command(command, args, fd)?;
        self.reply(sent)
    }

    fn send_command(
        &mut self,
        command: &str,
        args: Option<Value>,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Sent, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&command_json(command, Some(id), args), fd)?;
        Ok(Sent {
            id: Some(id),
            command: command.into(),
        })
    }

    /// Sends `command` but for its closing brace: QEMU parses it and waits for the rest
    /// ([`Armed`]). Without an id: its monitor has no other command in flight, and every
    /// byte counts.
    fn send_partial(&mut self, command: &str, args: Option<Value>) -> Result<Sent, QmpError> {
        let cmd = command_json(command, None, args);
        let bytes = serde_json::to_vec(&cmd).map_err(|e| QmpError::Protocol(e.to_string()))?;
        // A JSON object ends with its closing brace.
        self.writer.write_all(&bytes[..bytes.len() - 1])?;
        Ok(Sent {
            id: None,
            command: command.into(),
        })
    }

    /// Sends raw bytes (the rest of a command sent with [`Qmp::send_partial`]).
    fn send_bytes(&mut self, bytes: &[u8]) -> Result<(), QmpError> {
        self.writer.write_all(bytes)?;
        Ok(())
    }

    /// Reads what QEMU has sent so far without waiting for more: events are kept for
    /// [`Qmp::take_events`], replies for their [`Qmp::reply`]. For a monitor whose events
    /// nobody waits for (QEMU buffers what is not read, without bound).
    pub fn drain_events(&mut self) -> Result<(), QmpError> {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        loop {
            if self.reader.buffer().is_empty() {
                let mut fds = [PollFd::new(self.reader.get_ref(), PollFlags::IN)];
                if poll(&mut fds, Some(&now)).map_err(std::io::Error::from)? == 0 {
                    return Ok(());
                }
            }
            // QEMU writes a message whole: a readable socket holds a line, or its rest
            // follows at once.
            let msg = self.read_message()?;
            if msg.get("event").is_some() {
                self.events.push_back(msg);
            } else {
                self.early.push_back(msg);
            }
        }
    }

    /// Sends `command` without waiting: QEMU runs it while the caller does other work; collect
    /// the outcome with [`Qmp::reply`] before the next command.
    pub fn start(&mut self, command: &str, args: Option<Value>) -> Result<Sent, QmpError> {
        self.send_command(command, args, None)
    }

    /// Waits for the reply to a command sent with [`Qmp::start`] and returns its `return`.
    pub fn reply(&mut self, sent: Sent) -> Result<Value, QmpError> {
        loop {
            let msg = match self.early.pop_front() {
                Some(m) => m,
                None => self.read_message()?,
            };
            if msg.get("event").is_some() {
                self.events.push_back(msg);
                continue;
            }
            if msg.get("id").and_then(Value::as_u64) != sent.id {
                continue;
            }
            if let Some(err) = msg.get("error") {
                return Err(QmpError::Command {
                    command: sent.command,
                    class: err["class"].as_str().unwrap_or("?").into(),
                    desc: err["desc"].as_str().unwrap_or("?").into(),
                });
            }
            return Ok(msg.get("return").cloned().unwrap_or(Value::Null));
        }
    }

    /// Runs `command` with optional arguments and returns its `return` value.
    pub fn execute(&mut self, command: &str, args: Option<Value>) -> Result<Value, QmpError> {
        self.roundtrip(command, args, None)
    }

    /// Passes `fd` to QEMU under `name` (QMP `getfd`), replacing an earlier fd of that name.
    pub fn getfd(&mut self, name: &str, fd: BorrowedFd<'_>) -> Result<(), QmpError> {
        self.roundtrip("getfd", Some(json!({ "fdname": name })), Some(fd))
            .map(|_| ())
    }

    /// The timestamp (µs since the epoch, QEMU's clock) of the latest event named `name`
    /// received and not yet taken.
    pub fn event_time_us(&self, name: &str) -> Option<u64> {
        let e = self.events.iter().rev().find(|e| e["event"] == name)?;
        let t = &e["timestamp"];
        Some(t["seconds"].as_u64()? * 1_000_000 + t["microseconds"].as_u64()?)
    }

    /// Events received so far and not yet taken.
    pub fn take_events(&mut self) -> Vec<Value> {
        self.events.drain(..).collect()
    }

    /// The runstate as QEMU reports it (`running`, `paused`, `postmigrate`, `inmigrate`, ...).
    pub fn status(&mut self) -> Result<String, QmpError> {
        let r = self.execute("query-status", None)?;
        Ok(r["status"].as_str().unwrap_or("unknown").to_string())
    }

    /// Sets migration capabilities, e.g. `[("x-ignore-shared", true)]`.
    pub fn set_migrate_caps(&mut self, caps: &[(&str, bool)]) -> Result<(), QmpError> {
        let list: Vec<Value> = caps
            .iter()
            .map(|(c, s)| json!({ "capability": c, "state": s }))
            .collect();
        self.execute(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": list })),
        )
        .map(|_| ())
    }

    /// Polls `query-migrate` until the migration completes, fails or `timeout` passes.
    pub fn wait_migration(&mut self, timeout: Duration) -> Result<Value, QmpError> {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.execute("query-migrate", None)?;
            match r["status"].as_str().unwrap_or("") {
                "completed" => return Ok(r),
                "failed" | "cancelled" => {
                    return Err(QmpError::Command {
                        command: "migrate".into(),
                        class: r["status"].as_str().unwrap_or("failed").into(),
                        desc: r["error-desc"].as_str().unwrap_or("no description").into(),
                    })
                }
                _ => {}
            }
            if Instant::now() > deadline {
                return Err(QmpError::Timeout(timeout, "migration to complete".into()));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}
