//! A node that changes role (docs/REPLICATION.md, "Re-protection and switchover"): a primary
//! started with `--listen` serves as the backup after a planned switchover; a backup started
//! with `--peer` protects the guest it resumed (failover or switchover) by connecting to the
//! next backup at its peer's address and copying RAM and disks live. One frontend (control
//! socket, metrics, systemd) and one listen port serve the node's whole life.
//!
//! ```text
//!   tandem primary --backup B --listen A        tandem backup --listen B --peer A
//!   ┌──────────── node A ────────────┐          ┌──────────── node B ────────────┐
//!   │ primary ──switchover──► backup │          │ backup ──failover/handover──►   │
//!   │    ▲                      │    │          │    ▲        primary (resumed)   │
//!   │    └── primary (resumed) ◄┘    │          │    └──────── switchover ◄──┘    │
//!   └────────────────────────────────┘          └─────────────────────────────────┘
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::backup::{self, BackupConfig, BackupError};
use crate::frontend::{Frontend, FrontendConfig};
use crate::primary::{self, Ended, PrimaryConfig, PrimaryError, Resumed};
use crate::Status;

/// Both roles of one node.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct NodeConfig {
    /// The primary role (its `backup` is the peer's listen address).
    pub primary: PrimaryConfig,
    /// The backup role (its `listen` is this node's address; `dir` a tmpfs).
    pub backup: BackupConfig,
}

impl NodeConfig {
    /// A node with these two roles.
    pub fn new(primary: PrimaryConfig, backup: BackupConfig) -> Self {
        NodeConfig { primary, backup }
    }
}

/// The role a node starts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// Boot the guest and protect it.
    Primary,
    /// Wait for a primary and mirror it.
    Backup,
}

/// Why a node stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The primary role failed.
    #[error("as the primary")]
    Primary(#[from] PrimaryError),
    /// The backup role failed.
    #[error("as the backup")]
    Backup(#[from] BackupError),
    /// The metrics endpoint could not be served.
    #[error("serving metrics on {0}")]
    Metrics(String, #[source] std::io::Error),
}

enum Next {
    Boot,
    Protect(Box<Resumed>),
    Mirror,
}

/// Starts a node in its own thread, in the role `start`; it changes role at each switchover
/// and failover until its handle asks it to stop.
pub fn spawn(start: Start, cfg: NodeConfig) -> crate::DaemonHandle<Result<(), NodeError>> {
    let who = match start {
        Start::Primary => "primary",
        Start::Backup => "backup",
    };
    crate::DaemonHandle::spawn(format!("node-vm{}", cfg.primary.vm_id), who, move |st| {
        run(start, cfg, st)
    })
}

/// Runs the node until `status`'s [`crate::Stop`] asks it to stop (the blocking form of
/// [`spawn`]), changing role at each switchover and failover.
pub fn run(start: Start, cfg: NodeConfig, status: Status) -> Result<(), NodeError> {
    let vm_id = cfg.primary.vm_id;
    let fe = Frontend::start(
        FrontendConfig {
            role: match start {
                Start::Primary => "primary",
                Start::Backup => "backup",
            },
            vm_id,
            fence: cfg.primary.fence.clone(),
            control: cfg.primary.control.as_deref(),
            metrics_listen: cfg.primary.metrics_listen.as_deref(),
            switchover: Some(true),
        },
        &status,
    )
    .map_err(|e| NodeError::Metrics(format!("{:?}", cfg.primary.metrics_listen), e))?;
    let _libvirt = backup::keep_libvirt(&cfg.backup, &status);
    let listener = Mutex::new(backup::listen(&cfg.backup, &status)?);
    let mut next = match start {
        Start::Primary => Next::Boot,
        Start::Backup => Next::Mirror,
    };
    loop {
        next = match next {
            Next::Mirror => {
                let l = listener.lock().unwrap_or_else(|e| e.into_inner());
                match backup::serve(&cfg.backup, &fe, &l, true, status.with_role("backup"))? {
                    Some(r) => Next::Protect(Box::new(r)),
                    None => return Ok(()),
                }
            }
            run_as_primary => {
                // While this node runs the guest, a primary that connects to its listen port
                // is an old copy: it is told that the guest runs here (after a resume), or
                // turned away (a guest booted here).
                let fenced = match &run_as_primary {
                    Next::Protect(r) => Some((vm_id, r.epoch, r.session)),
                    _ => None,
                };
                let done = AtomicBool::new(false);
                let stop = status.stop();
                let ended = std::thread::scope(|sc| {
                    sc.spawn(|| {
                        let l = listener.lock().unwrap_or_else(|e| e.into_inner());
                        while !done.load(Ordering::SeqCst) {
                            // From a switchover request on, the next primary is about to
                            // connect (to this node as its backup): leave its connection
                            // queued for the backup role.
                            if stop.switchover_requested() {
                                std::thread::sleep(Duration::from_millis(10));
                                continue;
                            }
                            l.turn_away(
                                Duration::from_millis(20),
                                fenced,
                                &|| stop.switchover_requested(),
                                &status,
                            );
                        }
                    });
                    // `done` is set however the primary role ends (a panic included).
                    let _done = SetOnDrop(&done);
                    let st = status.with_role("primary");
                    match run_as_primary {
                        Next::Protect(r) => primary::run_resumed(&cfg.primary, &fe, *r, st),
                        _ => primary::run_in(&cfg.primary, &fe, st),
                    }
                });
                // A refused request (no backup connected) was cleared already.
                status.stop().clear_switchover();
                let ended = ended?;
                match ended {
                    Ended::Stopped => return Ok(()),
                    Ended::SwitchedOver { epoch, acked } => {
                        status.info(format!(
                            "switchover: the guest continues on {} from epoch {epoch}{}; this node serves as its backup now",
                            cfg.primary.backup,
                            if acked { "" } else { " (the handover was not acknowledged: it resumes from the last epoch it committed)" }
                        ));
                        Next::Mirror
                    }
                }
            }
        };
    }
}

/// Sets a flag when dropped.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}
