//! The primary's side of fencing (docs/FENCING.md): it claims the VM's ownership record in
//! etcd before the guest boots, records each session as the one whose backup may take over
//! before the session's epochs count, records "unprotected" before it lets output out without
//! acknowledgements, and stops its copy once the record names anyone else.
//!
//! No lease and no deadline: protected output leaves only on an acknowledgement of the
//! session's backup, and a backup that took over never acknowledges again. The guest runs on
//! while etcd is unreachable; only output that would need the record to change waits.

use std::time::{Duration, Instant};

use tandem_fence::{Fence, FenceConfig, FenceError, Owner, Refusal};
use tandem_net::Policy;
use tandem_replication::Fencing as WireFencing;

use crate::site::Site;
use crate::Status;

/// The primary's ownership of the VM.
pub struct Fencing {
    owner: Owner,
    status: Status,
    /// Output passes unprotected (the relays are in `Pass`).
    pub unprotected: bool,
    /// A failure to go unprotected was reported (once per streak).
    warned: bool,
    /// A session was recorded in etcd since output last went unprotected.
    session_recorded: bool,
    registry: Option<crate::metrics::Registry>,
}

/// Why a fencing step did not happen.
pub enum Blocked {
    /// etcd did not answer (the outcome is unknown): try again later.
    Unknown(String),
    /// The record names another owner: this copy must stop (what it says).
    Fenced(String),
}

/// How often a boot that waits for etcd says so.
const BOOT_SAY: Duration = Duration::from_secs(30);

impl Fencing {
    /// Claims the VM for a fresh guest: only a new VM or one stopped on purpose. Waits for
    /// etcd to answer as long as it takes (a claim whose outcome is unknown when the daemon
    /// exits could leave the record naming a guest that never ran); a stop request ends the
    /// wait.
    pub fn acquire(cfg: FenceConfig, site: &Site, status: Status) -> Result<Fencing, FenceError> {
        let fence = Fence::connect(cfg)?;
        let mut said: Option<Instant> = None;
        let owner = loop {
            match fence.boot() {
                Ok(o) => break o,
                Err(e) if e.unknown() && !status.stop().stopping() => {
                    if said.is_none_or(|t| t.elapsed() >= BOOT_SAY) {
                        status.warn(format!(
                            "cannot claim VM {} in etcd yet ({}); retrying until etcd answers",
                            fence.config().vm_id,
                            crate::chain(&e),
                        ));
                        said = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(e),
            }
        };
        let cfg = fence.config();
        status.event(crate::Event::Owner {
            generation: owner.generation(),
        });
        status.info(format!(
            "owns VM {} in etcd ({} at {}; generation {})",
            cfg.vm_id,
            cfg.key(),
            cfg.endpoints.join(","),
            owner.generation()
        ));
        Ok(Self::owning(owner, site, status, false))
    }

    /// The ownership a node's backup role won when it took the guest over (its output passes
    /// since the resume, and the record says so).
    pub fn resumed(owner: Owner, site: &Site, status: Status) -> Fencing {
        Self::owning(owner, site, status, true)
    }

    fn owning(owner: Owner, site: &Site, status: Status, unprotected: bool) -> Fencing {
        owner.watch();
        let o = owner.clone();
        // Output of any kind stops once this node learns that another copy owns the VM.
        site.relays
            .set_gate(Some(std::sync::Arc::new(move || !o.is_fenced())));
        Fencing {
            owner,
            status,
            unprotected,
            warned: false,
            session_recorded: false,
            registry: None,
        }
    }

    /// Reports the ownership in `registry`.
    pub fn attach_metrics(&mut self, registry: crate::metrics::Registry) {
        registry.set_owner(Some(self.owner.clone()));
        self.registry = Some(registry);
    }

    /// What the hello says about fencing.
    pub fn wire(&self) -> WireFencing {
        let d = self.owner.fence().descriptor();
        WireFencing::Etcd {
            cluster_id: d.cluster_id,
            key_hash: d.key_hash,
        }
    }

    /// What the record said when this node learned it no longer owns the VM.
    pub fn fenced(&self) -> Option<String> {
        self.owner.fenced()
    }

    /// Reads the record now: `Ok(false)` when it names another owner.
    pub fn check(&self) -> Result<bool, String> {
        self.owner.check().map_err(|e| crate::chain(&e))
    }

    fn blocked(&self, e: FenceError) -> Blocked {
        match e.refusal() {
            Some(Refusal::Fenced(_)) => {
                Blocked::Fenced(self.owner.fenced().unwrap_or_else(|| crate::chain(&e)))
            }
            _ => Blocked::Unknown(crate::chain(&e)),
        }
    }

    /// A new session `session` begins: it is recorded as the one whose backup may take over.
    /// Output that passes unprotected keeps passing until the session's first checkpoint
    /// ([`Fencing::hold`]): the backup can resume no earlier state.
    pub fn begin_session(&mut self, session: u64) -> Result<(), Blocked> {
        self.owner.protect(session).map_err(|e| self.blocked(e))?;
        self.session_recorded = true;
        Ok(())
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

    /// The backup is lost: record in etcd that no backup may take over, then let the output
    /// out (held frames first). While etcd cannot be told, output stays held. `Err`: the
    /// record names another owner (a backup took over first).
    pub fn go_unprotected(&mut self, site: &Site) -> Result<(), String> {
        // Already passing, and no session recorded since.
        if self.unprotected && !self.session_recorded {
            return Ok(());
        }
        match self.owner.unprotect() {
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
                        self.owner.fence().config().vm_id
                    ));
                }
                Err(e) => self.status.warn(format!("releasing output: {e}")),
            },
            Err(e) => match self.blocked(e) {
                Blocked::Fenced(what) => return Err(what),
                Blocked::Unknown(why) if !std::mem::replace(&mut self.warned, true) => {
                    self.status.warn(format!(
                        "cannot record in etcd that the VM runs without a replica ({why}); output stays held; retrying"
                    ))
                }
                Blocked::Unknown(_) => {}
            },
        }
        Ok(())
    }

    /// The guest was handed over: the backup takes the record over; this node stops reading
    /// it back.
    pub fn hand_over(&self) {
        self.owner.end();
    }

    /// A handle that outlives this hold (for [`release_unused`]).
    pub fn owner(&self) -> Owner {
        self.owner.clone()
    }
}

/// The daemon fails before any of its guest's output left the host (no frame released, none
/// passed): nothing of this copy can be missed, so etcd's record says stopped again and a
/// restart may boot the guest. Without this, a boot that failed (QEMU would not start, a disk
/// could not be captured) would leave the record naming a copy that never ran, and every
/// restart would be refused.
pub fn release_unused(owner: &Owner, site: &Site, status: &Status) {
    if site.relays.is_empty() || site.relays.stats().released_frames > 0 {
        return;
    }
    let t = Instant::now();
    loop {
        match owner.stop() {
            Ok(()) => {
                return status.info(
                    "nothing of this guest left the host: etcd's record says stopped again (a restart may boot it)",
                )
            }
            Err(e) if e.unknown() && t.elapsed() < Duration::from_secs(5) => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(_) => return,
        }
    }
}

/// The guest `owner` ran here was shut down: its disks are written back and the record says
/// stopped (a fresh boot here may claim the VM again) — unless they were this node's copy on a
/// tmpfs, gone with the host: then the record keeps naming this node, so that no fresh boot
/// starts from older disks, and a human decides (docs/OPERATIONS.md).
pub(crate) fn guest_shut_down(owner: Option<&Owner>, site: &Site, status: &Status) {
    let Some(owner) = owner else {
        return;
    };
    if site.disks_are_volatile() {
        return status.warn(
            "the guest's disks were this node's copy on a tmpfs: its ownership record stays as it is, so that no fresh boot starts from older disks; `tandem fence stop --generation G` once you have decided",
        );
    }
    if let Err(e) = site.sync_copy() {
        status.warn(format!("writing the guest's disks back to storage: {e}"));
    }
    record_stopped(owner, status)
}

/// Records in etcd that the guest `owner` ran here was shut down. Tries for up to 5 s.
pub(super) fn record_stopped(owner: &Owner, status: &Status) {
    let t = Instant::now();
    loop {
        match owner.stop() {
            Ok(()) => return,
            Err(e) if e.unknown() && t.elapsed() < Duration::from_secs(5) => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => {
                return status.warn(format!(
                    "recording the shutdown in etcd failed ({}): the record still names this node; `tandem fence stop` releases it",
                    crate::chain(&e)
                ))
            }
        }
    }
}
