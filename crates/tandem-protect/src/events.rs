//! What a daemon tells its owner, as typed events: its status lines and every change of role
//! and protection, each epoch, a failover or switchover, being fenced. A [`DaemonHandle`]
//! delivers them on a channel; the `tandem` binary prints the lines (and `--json-events` all of
//! them, one JSON object per line).
//!
//! [`DaemonHandle`]: crate::DaemonHandle

use serde::Serialize;

/// One thing a daemon says.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Event {
    /// A status line for a human: progress and state changes (`primary: ...`).
    Info {
        /// The line, with the daemon's role in front.
        text: String,
    },
    /// A status line about something wrong that the daemon survives (or why it stops).
    Warn {
        /// The line, with the daemon's role in front.
        text: String,
    },
    /// The daemon serves in this role now: `primary` (runs the guest) or `backup`.
    Role {
        /// `primary` or `backup`.
        role: &'static str,
    },
    /// The guest is protected: a backup that can fail over acknowledged its latest epoch, and
    /// its output is released only on acknowledgements.
    Protected,
    /// The guest is no longer protected (the link is down, the backup re-syncs, the primary
    /// changed role); its output is held (or passes, once recorded as unreplicated).
    Unprotected,
    /// The primary runs without a replica, recorded in etcd: its output passes
    /// unacknowledged (`on`), or it is replicated again (`!on`).
    Unreplicated {
        /// Whether the guest runs without a replica now.
        on: bool,
    },
    /// The primary's epoch was acknowledged by its backup.
    Acked {
        /// The epoch.
        epoch: u64,
    },
    /// The backup committed an epoch (what it would resume from).
    Committed {
        /// The epoch.
        epoch: u64,
    },
    /// This backup resumed the guest from its last committed epoch.
    FailedOver {
        /// Why (`lost`, `handover`, ...).
        reason: String,
        /// The epoch it resumed from.
        epoch: u64,
        /// The takeover in etcd (0 without fencing), in ms.
        takeover_ms: f64,
        /// From deciding to the guest running, in ms.
        resume_ms: f64,
    },
    /// A planned switchover left the guest with the backup from `epoch`.
    SwitchedOver {
        /// The last epoch this copy ran.
        epoch: u64,
        /// Whether the backup acknowledged that epoch.
        acked: bool,
    },
    /// Another copy runs the VM (etcd's ownership record says so, or the backup that took
    /// over): this copy stops.
    Fenced {
        /// Who runs it, in words.
        by: String,
    },
    /// The backup listens for its primary; its standby QEMU is ready.
    Listening {
        /// The address it listens on.
        addr: String,
        /// The standby QEMU's pid (0 if unknown).
        standby_pid: u32,
    },
    /// The primary's guest booted and is ready.
    GuestRunning {
        /// QEMU's pid.
        qemu_pid: u32,
        /// Boot to ready, in ms.
        boot_ms: u64,
    },
    /// The primary adopted a running guest (`tandem adopt`): it runs in tandem's QEMU now,
    /// without a reboot.
    Adopted {
        /// tandem's QEMU's pid.
        qemu_pid: u32,
        /// The guest's downtime in ms (QEMU's, plus the switch to the new QEMU).
        downtime_ms: u64,
        /// The whole migration, in ms.
        migrate_ms: u64,
        /// Bytes the migration sent.
        transferred: u64,
    },
    /// This daemon owns the VM in etcd at `generation` (a fresh boot's claim).
    Owner {
        /// The record's generation.
        generation: u64,
    },
}

impl Event {
    /// The event as one JSON object (for `--json-events` and logs).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self)
            .unwrap_or_else(|e| format!("{{\"event\":\"unprintable\",\"error\":\"{e}\"}}"))
    }
}

#[cfg(test)]
mod tests {
    use super::Event;

    #[test]
    fn events_are_tagged_json_objects() {
        let e = Event::FailedOver {
            reason: "lost".into(),
            epoch: 7,
            takeover_ms: 2.5,
            resume_ms: 20.0,
        };
        let v: serde_json::Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(v["event"], "failed_over");
        assert_eq!(v["epoch"], 7);
        assert_eq!(Event::Protected.to_json(), r#"{"event":"protected"}"#);
    }
}
