//! What a daemon says about itself: its identity and state for `tandem status` (the control
//! socket, docs/OPERATIONS.md) and `tandem_role`.

use super::{Reason, Registry};
use crate::Event;

/// What `tandem status` and `tandem_role` say about a daemon (docs/OPERATIONS.md).
#[derive(Clone, Default)]
pub(super) struct Who {
    pub(super) role: &'static str,
    pub(super) vm_id: u64,
    pub(super) node: Option<String>,
    /// A short state a human reads ("protected", "running the guest", ...); the primary's
    /// is derived from its flags when empty.
    pub(super) state: String,
    pub(super) peer: Option<String>,
    pub(super) started_ms: u64,
    pub(super) last_ack_ms: u64,
    pub(super) unprotected: bool,
    pub(super) failovers: u64,
    pub(super) last_failover: Option<serde_json::Value>,
    pub(super) switchovers: u64,
    pub(super) last_switchover: Option<serde_json::Value>,
    /// A backup with consolidated memory: where its replica's pages are.
    pub(super) memory: Option<tandem_consolidate::Usage>,
    /// A long copy under way ([`crate::progress::Progress`]).
    pub(super) progress: Option<serde_json::Value>,
    /// Where the guest's writable disks are on this node (`tandem status`'s `disks`).
    pub(super) disks: Option<serde_json::Value>,
}

/// Identity, state and the status document.
impl Registry {
    /// Who this daemon is: `role` (`primary`, `backup`) and the VM it protects.
    pub fn set_identity(&self, role: &'static str, vm_id: u64, node: Option<String>) {
        {
            let mut s = self.lock();
            (s.who.role, s.who.vm_id, s.who.node) = (role, vm_id, node);
        }
        self.emit(Some(Event::Role { role }));
    }

    /// This node changes role (a switchover, or a backup that resumed the guest and protects
    /// it in turn): the link, protection flags and ownership of the old role are cleared (a
    /// node that handed the guest over must not report the next owner's record as its fence).
    pub fn switch_role(&self, role: &'static str) {
        let was_protected = {
            let mut s = self.lock();
            s.owner = None;
            s.who.role = role;
            s.who.state.clear();
            s.who.peer = None;
            s.who.unprotected = false;
            s.link_up = false;
            std::mem::take(&mut s.protected)
        };
        self.emit(was_protected.then_some(Event::Unprotected));
        self.emit(Some(Event::Role { role }));
    }

    /// A planned switchover left the guest with the backup from `epoch` (`acked`: the backup
    /// confirmed the last epoch).
    pub fn switched_over(&self, epoch: u64, acked: bool) {
        {
            let mut s = self.lock();
            s.who.switchovers += 1;
            s.who.last_switchover = Some(serde_json::json!({
                "at_unix_ms": crate::unix_ms(), "epoch": epoch, "acked": acked,
            }));
        }
        self.emit(Some(Event::SwitchedOver { epoch, acked }));
    }

    /// Whether the primary's guest is protected now (a backup that can fail over acknowledged
    /// its last epoch).
    pub fn is_protected(&self) -> bool {
        let s = self.lock();
        s.protected && s.who.role == "primary"
    }

    /// The daemon's state in words (the primary derives its own when none is set).
    pub fn set_state(&self, state: impl Into<String>) {
        self.lock().who.state = state.into();
    }

    /// The peer on the replication link (`None`: not connected).
    pub fn set_peer(&self, peer: Option<String>) {
        self.lock().who.peer = peer;
    }

    /// The backup's committed epoch (what it could resume from).
    pub fn committed(&self, epoch: u64) {
        let new = {
            let mut s = self.lock();
            let new = epoch != s.acked;
            s.acked = epoch;
            s.who.last_ack_ms = crate::unix_ms();
            new
        };
        self.emit(new.then_some(Event::Committed { epoch }));
    }

    /// The guest's output passes unprotected (recorded in etcd).
    pub fn set_unprotected(&self, unprotected: bool) {
        let changed = {
            let mut s = self.lock();
            std::mem::replace(&mut s.who.unprotected, unprotected) != unprotected
        };
        self.emit(changed.then_some(Event::Unreplicated { on: unprotected }));
    }

    /// A long copy under way (`None`: none).
    pub fn set_progress(&self, progress: Option<serde_json::Value>) {
        self.lock().who.progress = progress;
    }

    /// Where the guest's writable disks are on this node: `path`, and `what` they are
    /// (`copy`: a backup's copy receiving epochs; `guest`: the disks the guest runs from,
    /// this node's copy since a failover), `durable` whether they outlive the host's memory.
    pub fn set_disks(&self, path: &std::path::Path, what: &str, durable: bool) {
        self.lock().who.disks = Some(serde_json::json!({
            "path": path, "what": what, "durable": durable,
        }));
    }

    /// A backup with consolidated memory: where its replica's pages are now.
    pub fn set_memory(&self, usage: Option<tandem_consolidate::Usage>) {
        self.lock().who.memory = usage;
    }

    /// A failover happened here: the backup resumed the guest from `epoch`, after
    /// `materialise_ms` restoring its consolidated pages (0 without consolidation).
    pub fn failed_over(
        &self,
        reason: &str,
        epoch: u64,
        takeover_ms: f64,
        resume_ms: f64,
        materialise_ms: f64,
    ) {
        {
            let mut s = self.lock();
            s.who.failovers += 1;
            s.who.role = "backup";
            s.who.state = format!("running the guest (failed over from epoch {epoch})");
            s.who.last_failover = Some(serde_json::json!({
                "at_unix_ms": crate::unix_ms(), "reason": reason, "epoch": epoch,
                "takeover_ms": takeover_ms, "resume_ms": resume_ms,
                "materialise_ms": materialise_ms,
            }));
        }
        self.emit(Some(Event::FailedOver {
            reason: reason.to_string(),
            epoch,
            takeover_ms,
            resume_ms,
        }));
    }

    /// The document `tandem status` prints.
    pub fn status(&self) -> serde_json::Value {
        let s = self.lock();
        let w = &s.who;
        let fenced = s.owner.as_ref().and_then(|o| o.fenced());
        let state = if let Some(f) = &fenced {
            format!("fenced: etcd's record says the VM is {f} (this copy stops)")
        } else if !w.state.is_empty() {
            w.state.clone()
        } else if s.protected {
            "protected".into()
        } else if s.link_up {
            "copying the guest to the backup (not yet protected; output held)".into()
        } else if w.unprotected {
            "running WITHOUT a replica (recorded in etcd; output passes)".into()
        } else {
            "waiting for a backup (output held)".into()
        };
        let now = crate::unix_ms();
        serde_json::json!({
            "role": w.role,
            "vm_id": w.vm_id,
            "node": w.node,
            "pid": std::process::id(),
            "state": state,
            "committed_epoch": s.acked,
            "lag_epochs": (w.role == "primary").then(|| s.last.epoch.saturating_sub(s.acked)),
            "zstd_level": (s.epochs > 0).then_some(s.last.level),
            "long_patches": (s.epochs > 0).then_some(s.last.long_patches),
            "word_deltas": (s.epochs > 0).then_some(s.last.word_deltas),
            "prefix_off": (s.epochs > 0).then_some(s.last.prefix_off),
            "guest_busy_pct": s.last.busy_pct,
            "epochs_cut": (s.epochs > 0).then(|| {
                Reason::ALL
                    .into_iter()
                    .filter(|r| s.cuts[r.index()] > 0)
                    .map(|r| (r.name().to_string(), s.cuts[r.index()].into()))
                    .collect::<serde_json::Map<String, serde_json::Value>>()
            }),
            "last_ack_ms_ago": (w.last_ack_ms > 0).then(|| now.saturating_sub(w.last_ack_ms)),
            "link": if s.link_up { "up" } else { "down" },
            "peer": w.peer,
            "owner": s.owner.as_ref().map(|o| {
                let r = o.record();
                serde_json::json!({
                    "generation": o.generation(), "state": r.state, "session":
                    r.session.map(|x| format!("{x:016x}")), "fenced": o.is_fenced(),
                })
            }),
            "held_frames": s.held_frames,
            "failovers": w.failovers,
            "last_failover": w.last_failover,
            "switchovers": w.switchovers,
            "last_switchover": w.last_switchover,
            "uptime_s": now.saturating_sub(w.started_ms) / 1000,
            "progress": w.progress,
            "disks": w.disks,
            "memory": w.memory.map(|u| serde_json::json!({
                "pages": u.pages, "plain": u.plain + u.pooled_raw, "zero": u.zero,
                "shared": u.shared, "patched": u.patched, "compressed": u.compressed,
                "resident_bytes": u.resident() as u64,
            })),
        })
    }
}
