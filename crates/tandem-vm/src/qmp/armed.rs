//! Commands armed ahead, each on a QMP monitor of its own.
//!
//! QEMU reads a monitor one byte per poll of its event loop (`monitor_can_read` admits one
//! byte at a time): ~5 µs a byte on these machines, so the ~140 bytes of an
//! `xen-save-devices-state` command cost ~0.7 ms of parsing before QEMU starts saving, and
//! `stop` and `cont` ~0.15 ms each — in the middle of the checkpoint pause. An [`Armed`]
//! command is sent while the guest runs, all but its closing brace; QEMU parses it and waits.
//! [`Armed::fire`] sends the brace, one byte, and QEMU runs the command at once.
//!
//! Each armed command needs a monitor of its own: a monitor holding a partial command
//! cannot take another one. QEMU runs the commands of different monitors in no promised
//! order, so a caller fires a command only after the reply of the one it must follow.
//!
//! ```text
//!  guest runs                 pause                                          guest runs
//!  ── {"execute":"stop",… ──▶ } ─ reply ─ } (xen-save) … harvest, copy … ─ reply ─ } (cont) ─ reply
//! ```

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use super::{Qmp, QmpError, Sent};

/// A command sent to its own monitor up to its last byte.
pub struct Armed {
    qmp: Qmp,
    command: &'static str,
    args: Option<Value>,
    state: State,
}

enum State {
    /// Sent but for its closing brace.
    Armed(Sent),
    /// Sent whole; its reply is still to be read.
    Fired(Sent),
    /// Replied: to be armed again.
    Idle,
    /// A reply did not come (timeout) or the connection failed: a late reply could be taken
    /// for the next command's (armed commands have no id), so the monitor is not used again.
    Broken,
}

impl Armed {
    /// Connects to the monitor at `path` and arms `command` with `args` on it.
    pub fn connect(
        path: &Path,
        command: &'static str,
        args: Option<Value>,
    ) -> Result<Armed, QmpError> {
        let qmp = Qmp::connect(path, Duration::from_secs(5))?;
        let mut a = Armed {
            qmp,
            command,
            args,
            state: State::Idle,
        };
        a.arm()?;
        Ok(a)
    }

    /// The command this sends.
    pub fn command(&self) -> &'static str {
        self.command
    }

    /// Sends the command but for its last byte, unless it is armed or fired already. After
    /// [`Armed::reply`], at a time when QEMU's parsing it costs nothing that waits (the guest
    /// runs).
    pub fn arm(&mut self) -> Result<(), QmpError> {
        match self.state {
            State::Idle => {
                self.state = State::Broken;
                let sent = self.qmp.send_partial(self.command, self.args.clone())?;
                self.state = State::Armed(sent);
                Ok(())
            }
            State::Broken => Err(QmpError::Closed),
            State::Armed(_) | State::Fired(_) => Ok(()),
        }
    }

    /// Whether the monitor failed (see [`Armed::arm`]): its owner drops it.
    pub fn broken(&self) -> bool {
        matches!(self.state, State::Broken)
    }

    /// Sends the command's last byte: QEMU runs it. A reply left unread (a pause abandoned
    /// after firing) is read first; a command not armed is armed first (sent whole, then).
    pub fn fire(&mut self) -> Result<(), QmpError> {
        if let State::Fired(_) = self.state {
            match self.reply() {
                Ok(_) | Err(QmpError::Command { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        self.arm()?;
        let State::Armed(sent) = std::mem::replace(&mut self.state, State::Broken) else {
            unreachable!("armed above");
        };
        self.qmp.send_bytes(b"}")?;
        self.state = State::Fired(sent);
        Ok(())
    }

    /// Waits for the fired command's reply (its `return`). The events that came before the
    /// reply are kept for [`Armed::event_time_us`] until the next reply (every monitor gets
    /// every event: the VM's main monitor is where they are acted on).
    pub fn reply(&mut self) -> Result<Value, QmpError> {
        let State::Fired(sent) = std::mem::replace(&mut self.state, State::Idle) else {
            return Err(QmpError::Protocol(format!(
                "no {} was sent to wait for",
                self.command
            )));
        };
        self.qmp.events.clear();
        let r = self.qmp.reply(sent);
        if let Err(e) = &r {
            if !matches!(e, QmpError::Command { .. }) {
                self.state = State::Broken;
            }
        }
        r
    }

    /// Runs `op` on the armed command in `slot`, if there is one. An error that broke its
    /// monitor ([`Armed::broken`]) drops it, logged: the VM's main monitor takes the command
    /// from then on (a late reply on the broken one could pass for the next command's).
    pub fn run_in<T>(
        slot: &mut Option<Armed>,
        op: impl FnOnce(&mut Armed) -> Result<T, QmpError>,
    ) -> Option<Result<T, QmpError>> {
        let a = slot.as_mut()?;
        let r = op(a);
        if let Err(e) = &r {
            if a.broken() {
                tracing::warn!("QMP: the monitor of the armed {} failed: {e}", a.command);
                *slot = None;
            }
        }
        Some(r)
    }

    /// Fires the command, waits for its reply and arms it again.
    pub fn execute(&mut self) -> Result<Value, QmpError> {
        self.fire()?;
        let r = self.reply();
        if let Ok(_) | Err(QmpError::Command { .. }) = r {
            self.arm()?;
        }
        r
    }

    /// The timestamp (µs, QEMU's clock) of the latest event `name` that came before the last
    /// reply.
    pub fn event_time_us(&self, name: &str) -> Option<u64> {
        self.qmp.event_time_us(name)
    }
}

impl std::fmt::Debug for Armed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Armed")
            .field("command", &self.command)
            .finish_non_exhaustive()
    }
}
