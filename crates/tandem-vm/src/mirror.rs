//! Disk capture through QEMU's own block layer: each writable disk is mirrored into a slice of
//! tandem's NBD export with `blockdev-mirror` (`sync: full`, `copy-mode: write-blocking`) and
//! the job is never completed. The full pass copies the disk; afterwards every guest write
//! completes only once the NBD server has it too, so when `stop` returns (QEMU drains block
//! I/O) every write of the epoch is in tandem's write log. A job that fails or is cancelled
//! marks the capture broken ([`MirrorHealth`]): that epoch's writes are incomplete.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::vm::{Vm, VmError};

/// Whether every disk mirror still captures every write (shared with the daemon's epoch
/// sink, which must not ship an epoch whose writes are incomplete).
#[derive(Clone, Default)]
pub struct MirrorHealth(Arc<Mutex<Option<String>>>);

impl MirrorHealth {
    /// Why the capture is broken, if it is.
    pub fn broken(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set(&self, why: Option<String>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = why;
    }
}

/// One disk mirrored into `[offset, offset + size)` of the NBD export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MirrorSlice {
    /// Index of the disk in the VM's description.
    pub disk: usize,
    /// Where its bytes start in the export.
    pub offset: u64,
    /// Its virtual size.
    pub size: u64,
}

fn job(i: usize) -> String {
    format!("tandem-mirror{i}")
}

impl Vm {
    /// Starts mirroring `slices` into the NBD export on `socket` and waits until every job
    /// finished its full pass (`timeout` for all), calling `progress(done, total)` (bytes of
    /// all jobs, as QEMU reports them) while it waits. Jobs of an earlier call are cancelled
    /// first.
    pub fn start_mirrors(
        &mut self,
        socket: &Path,
        slices: &[MirrorSlice],
        timeout: Duration,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), VmError> {
        self.cancel_mirrors();
        for s in slices {
            let node = format!("tandem-target{}", s.disk);
            self.qmp.execute(
                "blockdev-add",
                Some(json!({
                    "driver": "raw", "node-name": node, "offset": s.offset, "size": s.size,
                    "file": {"driver": "nbd", "server": {"type": "unix", "path": socket}, "export": ""}
                })),
            )?;
            let started = self.qmp.execute(
                "blockdev-mirror",
                Some(json!({
                    "job-id": job(s.disk), "device": format!("disk{}", s.disk), "target": node,
                    "sync": "full", "copy-mode": "write-blocking",
                    "auto-finalize": false, "auto-dismiss": false
                })),
            );
            if let Err(e) = started {
                // Leave no target node behind: the next attempt adds it again.
                let _ = self
                    .qmp
                    .execute("blockdev-del", Some(json!({"node-name": node})));
                return Err(e.into());
            }
            self.mirrors.push(s.disk);
        }
        let t = Instant::now();
        loop {
            let jobs = self.qmp.execute("query-block-jobs", None)?;
            let mut ready = 0;
            let (mut done, mut total) = (0, 0);
            for j in jobs.as_array().into_iter().flatten() {
                let ours = j["device"]
                    .as_str()
                    .is_some_and(|d| self.mirrors.iter().any(|&i| job(i) == d));
                if !ours {
                    continue;
                }
                done += j["offset"].as_u64().unwrap_or(0);
                total += j["len"].as_u64().unwrap_or(0);
                if j["status"] == "concluded" || j["status"] == "aborting" {
                    return Err(VmError::Mirror(format!(
                        "disk mirror {} ended during its first pass: {}",
                        j["device"],
                        j["error"].as_str().unwrap_or("no reason given")
                    )));
                }
                if j["ready"] == true && j["actively-synced"] != false {
                    ready += 1;
                }
            }
            progress(done, total);
            if ready == self.mirrors.len() {
                break;
            }
            if t.elapsed() > timeout {
                return Err(VmError::Mirror(format!(
                    "disk mirrors not ready after {} s ({ready} of {})",
                    timeout.as_secs(),
                    self.mirrors.len()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Events read while waiting: a job that failed after its last poll must not be
        // forgotten (its writes would be missing from every later epoch).
        let events = self.qmp.take_events();
        if let Some(why) = events.iter().find_map(|e| mirror_failure(e, &self.mirrors)) {
            return Err(VmError::Mirror(why));
        }
        self.mirror_health.set(None);
        Ok(())
    }

    /// Cancels the mirror jobs and removes their target nodes (errors are ignored: the jobs
    /// may have failed already).
    pub fn cancel_mirrors(&mut self) {
        for i in std::mem::take(&mut self.mirrors) {
            let _ = self.qmp.execute(
                "block-job-cancel",
                Some(json!({"device": job(i), "force": true})),
            );
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(10) {
                let Ok(jobs) = self.qmp.execute("query-block-jobs", None) else {
                    break;
                };
                let st = jobs
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|j| j["device"] == job(i).as_str())
                    .map(|j| j["status"].as_str().unwrap_or("").to_string());
                match st.as_deref() {
                    None => break,
                    Some("concluded") => {
                        let _ = self.qmp.execute("job-dismiss", Some(json!({"id": job(i)})));
                        break;
                    }
                    Some(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
            let _ = self.qmp.execute(
                "blockdev-del",
                Some(json!({"node-name": format!("tandem-target{i}")})),
            );
        }
    }

    /// Reports mirror failures into `h` (a view the daemon shares with its epoch sink).
    pub fn share_mirror_health(&mut self, h: MirrorHealth) {
        self.mirror_health = h;
    }

    /// Shared view of whether the mirrors still capture every write.
    pub fn mirror_health(&self) -> MirrorHealth {
        self.mirror_health.clone()
    }

    /// Looks through the QMP events read so far (called right after `stop`, so they cover
    /// every write of the epoch) for one of our jobs failing or ending; drops the others.
    pub(crate) fn check_mirror_events(&mut self) {
        for e in self.qmp.take_events() {
            if let Some(why) = mirror_failure(&e, &self.mirrors) {
                self.mirror_health.set(Some(why));
            }
        }
    }
}

/// Why event `e` means one of `mirrors` no longer captures writes, if it does.
fn mirror_failure(e: &Value, mirrors: &[usize]) -> Option<String> {
    let kind = e["event"].as_str()?;
    if !matches!(
        kind,
        "BLOCK_JOB_ERROR" | "BLOCK_JOB_CANCELLED" | "BLOCK_JOB_COMPLETED"
    ) {
        return None;
    }
    let dev = e["data"]["device"].as_str()?;
    if !mirrors.iter().any(|&i| job(i) == dev) {
        return None;
    }
    let detail = e["data"]["error"]
        .as_str()
        .or(e["data"]["operation"].as_str())
        .unwrap_or("");
    Some(
        format!("disk mirror {dev}: {kind} {detail}")
            .trim()
            .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_jobs_failing_break_the_capture() {
        let err = json!({"event": "BLOCK_JOB_ERROR", "data": {"device": "tandem-mirror1", "operation": "write", "action": "report"}});
        assert!(mirror_failure(&err, &[1]).unwrap().contains("write"));
        assert_eq!(mirror_failure(&err, &[0]), None);
        let other = json!({"event": "STOP", "data": {}});
        assert_eq!(mirror_failure(&other, &[1]), None);
        let done = json!({"event": "BLOCK_JOB_COMPLETED", "data": {"device": "tandem-mirror0", "error": "Input/output error"}});
        assert!(mirror_failure(&done, &[0])
            .unwrap()
            .contains("Input/output error"));
    }
}
