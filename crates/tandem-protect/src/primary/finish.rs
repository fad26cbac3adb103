//! What becomes of the primary's copy of the guest once replication ended: killed after a
//! handover or when fenced, shut down after `bye`, or kept for the backup role of a node.

use tandem_vm::Vm;

use super::session::End;
use super::{fence, Ended, PrimaryError};
use crate::site::Site;
use crate::Status;

/// What becomes of this copy of the guest once replication ended.
pub(super) fn finish(
    end: Option<End>,
    site: &Site,
    mut vm: Vm,
    summary: &str,
    status: &Status,
    fencing: Option<&fence::Fencing>,
) -> Result<Ended, PrimaryError> {
    match end {
        Some(End::FencedBy(by)) => {
            site.relays.discard_held();
            vm.kill();
            status.event(crate::Event::Fenced { by: by.clone() });
            Err(PrimaryError::FencedBy(by))
        }
        Some(End::Fenced(n)) => {
            site.relays.discard_held();
            vm.kill();
            status.event(crate::Event::Fenced {
                by: format!("the backup runs the guest since epoch {n}"),
            });
            Err(PrimaryError::Fenced(n))
        }
        Some(End::HandedOver { epoch, acked }) => {
            if acked {
                copies_left(&vm, status);
            }
            vm.kill();
            if let Some(f) = fencing {
                f.hand_over();
            }
            if acked {
                status.info(format!(
                    "handed the guest over to the backup at epoch {epoch}; {summary}"
                ));
            } else {
                status.info(format!("handover at epoch {epoch} was not acknowledged: the backup resumes from the last epoch it committed; this copy is stopped; {summary}"));
            }
            // The request stays set until the node serves as the backup (node.rs clears it):
            // until then no connection to this node's port is answered.
            if status.stop().switchover_requested() {
                return Ok(Ended::SwitchedOver { epoch, acked });
            }
            Ok(Ended::Stopped)
        }
        Some(End::Shutdown) | Some(End::Lost(_)) | None => {
            let what = if end.is_none()
                && status.stop().stopping()
                && !status.stop().shutdown_requested()
            {
                "stopped while no backup was connected: nothing to hand the guest over to; guest shut down"
            } else if status.stop().stopping() {
                "replication ended on request; guest shut down"
            } else {
                "replication ended (duration reached); guest shut down"
            };
            status.info(format!("{what}; {summary}"));
            if vm.shut_down() {
                status.info("the guest powered off");
            }
            fence::guest_shut_down(fencing.map(fence::Fencing::owner).as_ref(), site, status);
            Ok(Ended::Stopped)
        }
    }
}

/// The guest was handed over and the other node resumed it: a copy of this node's that was
/// its disks (a guest resumed or booted from it) is only a copy again, so that this node never
/// boots it ([`crate::disk_copy`]).
fn copies_left(vm: &Vm, status: &Status) {
    let mut dirs: Vec<&std::path::Path> = vm
        .config()
        .disks
        .iter()
        .filter(|d| !d.readonly && d.slice.is_some())
        .filter(|d| d.path.file_name() == Some(crate::disk_copy::FILE.as_ref()))
        .filter_map(|d| d.path.parent())
        .collect();
    dirs.dedup();
    for d in dirs {
        if let Err(e) = crate::disk_copy::guest_left(d) {
            status.warn(crate::chain(&e));
        }
    }
}
