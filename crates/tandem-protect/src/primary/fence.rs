//! The primary's side of fencing (docs/FENCING.md): it holds the VM's leader key in etcd
//! before the guest boots, gates every relay with the lease, records each session as the
//! replica that may take over before the session's epochs count, records "no replica" before
//! it lets output out unprotected, and keeps the guest paused while its lease is not certainly
//! valid.

use std::time::{Duration, Instant};

use tandem_fence::{campaign, Claim, FenceConfig, FenceError, Holder, Outcome, Replica};
use tandem_net::Policy;

use super::watchdog::Watchdog;
use crate::signals::stopping;
use crate::site::Site;
use crate::Status;

/// The primary's hold on the VM.
pub struct Fencing {
    holder: Holder,
    cfg: FenceConfig,
    status: Status,
    /// Output passes unprotected (the relays are in `Pass`).
    pub unprotected: bool,
    /// A failure to go unprotected was reported (once per streak).
    warned: bool,
    /// A session was recorded in etcd as the replica since output last went unprotected.
    session_recorded: bool,
    registry: Option<crate::metrics::Registry>,
}

/// How waiting for a valid lease ended.
pub enum Wait {
    /// The lease is valid: the guest may run.
    Valid,
    /// Another node holds the VM: this copy must stop.
    Fenced(String),
    /// The daemon was asked to stop.
    Stopping,
}

fn random_session() -> u64 {
    use std::io::Read;
    let mut b = [0u8; 8];
    let ok = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if ok.is_err() {
        // No /dev/urandom: time and pid still differ between sessions.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        b = (t.as_nanos() as u64 ^ ((std::process::id() as u64) << 40)).to_le_bytes();
    }
    u64::from_le_bytes(b).max(1)
}

impl Fencing {
    /// Wins the VM's leader key for a fresh guest, waiting up to two TTLs for a previous
    /// holder's lease (a primary that restarted) to expire.
    pub fn acquire(cfg: FenceConfig, site: &Site, status: Status) -> Result<Fencing, FenceError> {
        let t = Instant::now();
        let mut said = false;
        let holder = loop {
            match campaign(&cfg, Claim::Fresh)? {
                Outcome::Won(h) => break h,
                Outcome::Held(by) => {
                    if t.elapsed() > 2 * cfg.ttl + Duration::from_secs(1) || stopping() {
                        return Err(FenceError::Held {
                            vm_id: cfg.vm_id,
                            key: cfg.leader_key(),
                            by,
                        });
                    }
                    if !std::mem::replace(&mut said, true) {
                        status.warn(format!("VM {} is held by {by:?} in etcd; waiting up to {} s for its lease to expire", cfg.vm_id, (2 * cfg.ttl).as_secs()));
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        };
        site.relays.set_gate(Some(holder.gate()));
        status.info(format!(
            "holds VM {} in etcd ({} at {}; lease TTL {} s, output allowed until {:.2} s after each renewal)",
            cfg.vm_id,
            cfg.leader_key(),
            cfg.endpoints.join(","),
            cfg.ttl.as_secs(),
            cfg.right().as_secs_f64()
        ));
        Ok(Fencing {
            holder,
            cfg,
            status,
            unprotected: false,
            warned: false,
            session_recorded: false,
            registry: None,
        })
    }

    /// The hold of a node whose backup role won the key and resumed the guest (its relays are
    /// gated by `holder` already and pass output since the resume): it counts as passing with
    /// a replica still recorded, so [`Fencing::go_unprotected`] records `none` and every
    /// session holds output from its first checkpoint, whatever etcd answered.
    pub fn resumed(holder: Holder, cfg: FenceConfig, status: Status) -> Fencing {
        Fencing {
            holder,
            cfg,
            status,
            unprotected: true,
            warned: false,
            session_recorded: true,
            registry: None,
        }
    }

    /// Reports the lease's remaining right in `registry` (also after a reacquire).
    pub fn attach_metrics(&mut self, registry: crate::metrics::Registry) {
        registry.set_lease(Some(self.holder.clone()));
        self.registry = Some(registry);
    }

    /// A new session begins: it is recorded as the replica that may take over. Returns the
    /// session id for the hello. Output that passes unprotected keeps passing until the
    /// session's first checkpoint ([`Fencing::hold`]): the backup can resume no earlier state.
    pub fn begin_session(&mut self, _site: &Site) -> Result<u64, String> {
        let s = random_session();
        self.holder
            .record(Replica::Session(s))
            .map_err(|e| format!("recording the new replica in etcd: {e}"))?;
        self.session_recorded = true;
        Ok(s)
    }

    /// The session's first checkpoint (called in its pause): output is held from here on.
    pub fn hold(&mut self, site: &Site) -> Result<(), String> {
        if self.unprotected {
            site.relays
                .set_policy(Policy::Hold)
                .map_err(|e| format!("holding output again: {e}"))?;
            self.unprotected = false;
            if let Some(r) = &self.registry {
                r.set_unprotected(false);
            }
        }
        Ok(())
    }

    /// The backup is lost: record in etcd that the VM runs without a replica, then let the
    /// output out (held frames first). If etcd cannot be told, output stays held (a resumed
    /// guest's, which passes already, is held from the next session's first checkpoint).
    pub fn go_unprotected(&mut self, site: &Site) {
        // Already passing, and no session recorded since (one that failed during its initial
        // copy must not stay recorded as a replica).
        if self.unprotected && !self.session_recorded {
            return;
        }
        match self.holder.record(Replica::None) {
            Ok(()) => match site.relays.set_policy(Policy::Pass) {
                Ok(()) => {
                    self.session_recorded = false;
                    self.unprotected = true;
                    if let Some(r) = &self.registry {
                        r.set_unprotected(true);
                    }
                    self.warned = false;
                    self.status.warn(format!(
                        "recorded in etcd that VM {} runs WITHOUT a replica (no backup can take over); its output passes unprotected until a backup re-syncs",
                        self.cfg.vm_id
                    ));
                }
                Err(e) => self.status.warn(format!("releasing output: {e}")),
            },
            Err(e) if !std::mem::replace(&mut self.warned, true) => self.status.warn(format!(
                "cannot record in etcd that the VM runs without a replica ({e}); output stays held (or, on a node that resumed the guest, is held from the next session's first checkpoint); retrying"
            )),
            Err(_) => {}
        }
    }

    /// Whether the lease is certainly valid now.
    pub fn valid(&self) -> bool {
        self.holder.valid()
    }

    /// Blocks while the lease is not certainly valid (call it with the guest stopped): takes
    /// the key back if the lease expired and nobody else won it.
    pub fn wait_valid(&mut self, site: &Site, watchdog: &Watchdog) -> Wait {
        if self.holder.valid() {
            return Wait::Valid;
        }
        let t = Instant::now();
        self.status.warn(format!(
            "cannot renew the lease of VM {} in etcd: guest paused, output held (no copy may run past its lease)",
            self.cfg.vm_id
        ));
        let _paused = Paused::new(self.registry.clone());
        let mut unknown_said = false;
        loop {
            watchdog.beat();
            if stopping() {
                return Wait::Stopping;
            }
            if self.holder.valid() {
                self.status.info(format!(
                    "lease renewed after {:.1} s: guest continues",
                    t.elapsed().as_secs_f64()
                ));
                return Wait::Valid;
            }
            if self.holder.expired() {
                let Some(claim) = self.holder.reacquire_claim() else {
                    // The last record's outcome is unknown: another copy may have taken over.
                    // Stay paused (nothing is released); an operator decides.
                    if !std::mem::replace(&mut unknown_said, true) {
                        self.status.warn("the lease expired and the outcome of the last replica record in etcd is unknown: this copy stays paused and will not take the key back (if the backup runs the guest, stop this primary)");
                    }
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                };
                match campaign(&self.cfg, claim) {
                    Ok(Outcome::Won(h)) => {
                        self.holder = h;
                        site.relays.set_gate(Some(self.holder.gate()));
                        if let Some(r) = &self.registry {
                            r.set_lease(Some(self.holder.clone()));
                        }
                        self.status.info(
                            "took the leader key back after its lease expired (nobody took over)",
                        );
                        continue;
                    }
                    Ok(Outcome::Held(by)) => return Wait::Fenced(by),
                    Err(FenceError::Lost(_)) => {
                        return Wait::Fenced("a node that changed the replica record".into())
                    }
                    Err(_) => {}
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Replication ends on purpose and the guest shuts down: nobody may take over, and the
    /// key is released at once.
    pub fn shutdown(&self) {
        let _ = self.holder.record(Replica::None);
        if let Err(e) = self.holder.resign() {
            self.status.warn(format!("releasing the leader key: {e}"));
        }
    }

    /// The guest was handed over (and acknowledged): release the key so the backup takes it
    /// without waiting for the lease to expire.
    pub fn hand_over(&self) {
        if let Err(e) = self.holder.resign() {
            self.status.warn(format!(
                "releasing the leader key ({e}): the backup takes over when the lease expires"
            ));
        }
    }
}

/// Marks the guest as paused for its lease in the metrics while alive.
struct Paused(Option<crate::metrics::Registry>);

impl Paused {
    fn new(r: Option<crate::metrics::Registry>) -> Paused {
        if let Some(r) = &r {
            r.set_paused_for_lease(true);
        }
        Paused(r)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if let Some(r) = &self.0 {
            r.set_paused_for_lease(false);
        }
    }
}
