//! The primary's start without a boot (`tandem adopt`): the guest that a QEMU already runs
//! (started by hand or by libvirt) moves into tandem's QEMU by a live migration
//! ([`tandem_vm::adopt`]), and is protected from there like a booted one.
//!
//! The guest ran unprotected before; it keeps doing so until its first backup has a copy:
//! its output passes (recorded in etcd as "unprotected" first, with fencing) and is held
//! again from the first session's first checkpoint on.

use std::path::PathBuf;
use std::time::Duration;

use tandem_vm::adopt::{AdoptOptions, Source};
use tandem_vm::{Vm, VmConfig};

use super::fence::Fencing;
use super::PrimaryError;
use crate::frontend::Frontend;
use crate::site::Site;
use crate::Status;

/// Where the running guest is and how to migrate it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdoptConfig {
    /// The QEMU that runs the guest now: its QMP socket, or the libvirt domain.
    pub source: Source,
    /// The longest the guest may stop for the switch (QEMU's `downtime-limit`).
    #[serde(with = "humantime_serde", default = "default_downtime")]
    pub downtime_limit: Duration,
    /// The migration is cancelled, and the guest runs on where it ran, after this long.
    #[serde(with = "humantime_serde", default = "default_timeout")]
    pub timeout: Duration,
    /// Leave the source QEMU in its `postmigrate` state instead of telling it to quit (for a
    /// manager that ends it itself).
    #[serde(default)]
    pub keep_source: bool,
}

fn default_downtime() -> Duration {
    AdoptOptions::default().downtime_limit
}

fn default_timeout() -> Duration {
    AdoptOptions::default().timeout
}

impl AdoptConfig {
    /// Adopting the guest of the QEMU behind `qmp`, with the default limits.
    pub fn new(qmp: impl Into<PathBuf>) -> Self {
        Self::from(Source::Qmp(qmp.into()))
    }
}

impl From<Source> for AdoptConfig {
    /// Adopting the guest of `source`, with the default limits.
    fn from(source: Source) -> Self {
        AdoptConfig {
            source,
            downtime_limit: default_downtime(),
            timeout: default_timeout(),
            keep_source: false,
        }
    }
}

/// Lets the guest's output pass before it moves (it ran unprotected and keeps serving), then
/// migrates it into tandem's QEMU.
pub(super) fn adopt(
    a: &AdoptConfig,
    vmc: &VmConfig,
    site: &Site,
    fencing: Option<&mut Fencing>,
    fe: &Frontend,
    status: &Status,
) -> Result<Vm, PrimaryError> {
    let fence = fencing.as_ref().map(|f| f.owner().fence().clone());
    match fencing {
        Some(f) => unprotected(f, site, status)?,
        None => site
            .relays
            .set_policy(tandem_net::Policy::Pass)
            .map_err(|e| PrimaryError::AdoptRefused(format!("letting its output pass: {e}")))?,
    }
    status.info(format!(
        "adopting the guest of {}: live migration into tandem's QEMU (downtime limit {} ms)",
        a.source,
        a.downtime_limit.as_millis()
    ));
    let libvirt = match &a.source {
        Source::Libvirt(l) => Some(l),
        Source::Qmp(_) => None,
    };
    let opts = AdoptOptions {
        downtime_limit: a.downtime_limit,
        timeout: a.timeout,
        // A libvirt domain is marked before its old QEMU ends (below).
        quit_source: !a.keep_source && libvirt.is_none(),
        ..AdoptOptions::default()
    };
    // The migration's pre-copy rounds are progress for systemd's watchdog, not a hang.
    fe.beat.allow(a.timeout + Duration::from_secs(30));
    let mut bar = None;
    let (vm, done) = tandem_vm::adopt::adopt(vmc, &a.source, &opts, &mut |p| {
        if p.total > 0 {
            bar.get_or_insert_with(|| {
                crate::progress::Progress::new("adoption", p.total, status, &fe.registry)
            })
            .update(p.transferred.min(p.total));
        }
    })?;
    drop(bar);
    fe.beat.beat();
    let source_quit = match libvirt {
        Some(l) => mark_and_end(l, fence.as_deref(), status),
        None => done.source_quit,
    };
    status.event(crate::Event::Adopted {
        qemu_pid: vm.pid(),
        downtime_ms: done.downtime().as_millis() as u64,
        migrate_ms: done.total.as_millis() as u64,
        transferred: done.progress.transferred,
    });
    status.info(format!(
        "adopted the running guest without a reboot: migrated {} MiB in {:.1} s ({} pre-copy round(s)), guest stopped {} ms (QEMU's {} ms + {} ms to run here); QEMU pid {}, {}",
        done.progress.transferred >> 20,
        done.total.as_secs_f64(),
        done.progress.rounds,
        done.downtime().as_millis(),
        done.qemu_downtime.as_millis(),
        done.switch.as_millis(),
        vm.pid(),
        if source_quit {
            "the old QEMU quit"
        } else {
            "the old QEMU is left in postmigrate for its manager to end"
        }
    ));
    Ok(vm)
}

/// A libvirt domain whose guest runs in tandem's QEMU now: marked in libvirt (its hook then
/// refuses to start it) while its old QEMU is still there, paused, then that QEMU ended
/// (`virsh destroy`: libvirt sees the domain shut off); then, with fencing, its marked
/// definition recorded in etcd for the backups' libvirt ([`crate::libvirt::keeper`]). Whether
/// the old QEMU ended.
fn mark_and_end(
    l: &tandem_vm::adopt::Libvirt,
    fence: Option<&tandem_fence::Fence>,
    status: &Status,
) -> bool {
    let node = fence.map(|f| f.config().node.clone()).unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "?".into())
    });
    let marked = match crate::libvirt::inloop::mark_protected(l, &l.domain, &node) {
        Ok(()) => {
            status.info(format!(
                "libvirt domain {} marked as protected by tandem (autostart off, metadata, title); its hook refuses to start it",
                l.domain
            ));
            true
        }
        Err(e) => {
            status.warn(format!(
                "{}: libvirt could start the domain again; mark it by hand (docs/VM_DESCRIPTION.md, \"libvirt\")",
                crate::chain(&e)
            ));
            false
        }
    };
    let ended = l.run(["destroy", &l.domain]);
    // Once the old QEMU is gone (etcd may take a while): the backups' libvirt learns it.
    if let (true, Some(f)) = (marked, fence) {
        record(l, f, &node, status);
    }
    match ended {
        Ok(_) => true,
        Err(e) => {
            status.warn(format!(
                "ending the old QEMU of libvirt domain {} (virsh destroy): {e}; it is paused, its guest gone: end it with `virsh destroy {}`",
                l.domain, l.domain
            ));
            false
        }
    }
}

/// Records the marked definition in etcd (`PREFIX/vm/ID/libvirt`), where every backup of the
/// VM finds it. Tried for up to 30 s; without it the backups' libvirt does not learn the
/// domain (a warning says so), the guest is not affected.
fn record(l: &tandem_vm::adopt::Libvirt, fence: &tandem_fence::Fence, node: &str, status: &Status) {
    let xml = match l.run(["dumpxml", "--inactive", &l.domain]) {
        Ok(x) => x,
        Err(e) => {
            status.warn(format!("libvirt domain {}: reading its definition for the backups' libvirt: {e}; their libvirt will not know it", l.domain));
            return;
        }
    };
    let doc = crate::libvirt::keeper::Recorded {
        domain: l.domain.clone(),
        node: node.to_string(),
        at_unix_ms: crate::unix_ms(),
        xml,
    };
    let Ok(bytes) = serde_json::to_vec(&doc) else {
        return;
    };
    let t = std::time::Instant::now();
    loop {
        match fence.put_libvirt(&bytes) {
            Ok(()) => {
                status.info(format!(
                    "libvirt domain {}: its marked definition recorded in etcd ({}) for the backups' libvirt",
                    l.domain,
                    fence.config().libvirt_key()
                ));
                return;
            }
            Err(e) if t.elapsed() > Duration::from_secs(30) => {
                status.warn(format!(
                    "libvirt domain {}: recording its definition in etcd: {}; the backups' libvirt will not know it",
                    l.domain,
                    crate::chain(&e)
                ));
                return;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

/// With fencing: etcd records that the guest runs without a replica before its output may
/// pass. Tried for up to 30 s; the guest has not moved yet, so giving up leaves it where it
/// ran.
fn unprotected(f: &mut Fencing, site: &Site, status: &Status) -> Result<(), PrimaryError> {
    let t = std::time::Instant::now();
    loop {
        f.go_unprotected(site).map_err(PrimaryError::FencedBy)?;
        if f.unprotected {
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(30) || status.stop().stopping() {
            return Err(PrimaryError::AdoptRefused(
                "etcd could not record that the guest runs without a replica until a backup has a copy".into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
