//! The checkpoint pause of a [`Vm`]: stop, harvest the dirty log, copy the dirty pages, run
//! the caller's boundary work, capture device state, cont.

use std::time::Instant;

use super::{PauseTiming, Vm, VmError};
use crate::qmp::Armed;
use crate::ram::PAGE_SIZE;

impl Vm {
    /// One checkpoint pause: stop, harvest, copy dirty pages into `pages` (one page per entry
    /// of `dirty`, in order), capture device state into `device_state`, cont.
    pub fn checkpoint(
        &mut self,
        dirty: &mut Vec<u64>,
        pages: &mut Vec<u8>,
        device_state: &mut Vec<u8>,
    ) -> Result<PauseTiming, VmError> {
        self.checkpoint_with(dirty, pages, device_state, &mut || {})
    }

    /// [`Vm::checkpoint`] calling `in_pause` while the guest is stopped (after the copy), for
    /// state that must share the memory checkpoint's boundary: the epoch's disk writes (QEMU
    /// drains block I/O on `stop`) and the network relay's epoch seal.
    pub fn checkpoint_with(
        &mut self,
        dirty: &mut Vec<u64>,
        pages: &mut Vec<u8>,
        device_state: &mut Vec<u8>,
        in_pause: &mut dyn FnMut(),
    ) -> Result<PauseTiming, VmError> {
        self.pause_and_capture(dirty, pages, device_state, &mut |_, _| in_pause(), true)
    }

    /// The last checkpoint of this VM: like [`Vm::checkpoint_with`] but the guest stays
    /// stopped (a handover to the backup: this copy must never run again).
    pub fn checkpoint_final(
        &mut self,
        dirty: &mut Vec<u64>,
        pages: &mut Vec<u8>,
        device_state: &mut Vec<u8>,
        in_pause: &mut dyn FnMut(),
    ) -> Result<PauseTiming, VmError> {
        self.pause_and_capture(dirty, pages, device_state, &mut |_, _| in_pause(), false)
    }

    fn pause_and_capture(
        &mut self,
        dirty: &mut Vec<u64>,
        pages: &mut Vec<u8>,
        device_state: &mut Vec<u8>,
        in_pause: &mut crate::epoch::Boundary<'_>,
        cont: bool,
    ) -> Result<PauseTiming, VmError> {
        let mut t = PauseTiming::default();
        let us = |i: Instant| i.elapsed().as_micros().min(u32::MAX as u128) as u32;
        let s = Instant::now();
        // An early-suspended guest is stopped already. Otherwise `stop` goes first, armed on
        // a monitor of its own (qmp/armed.rs: QEMU parsed it while the guest ran), then the
        // armed device-state capture once `stop` replied (QEMU runs different monitors'
        // commands in no promised order). Without armed commands, `stop` and the capture go
        // out back to back on the one monitor: QEMU runs them in order. Either way QEMU
        // serialises the devices (the longest step) while this thread harvests and copies
        // (both need only the stopped guest, hence the wait for `stop`'s reply first).
        let stop = if std::mem::take(&mut self.suspended) {
            None
        } else if let Some(fired) = Armed::run_in(&mut self.armed_stop, Armed::fire) {
            fired?;
            Some(None)
        } else {
            Some(Some(self.qmp.start("stop", None)?))
        };
        let mut started = match stop {
            Some(None) => None,
            ref s => self.devstate.begin(&mut self.qmp, s.is_none()),
        };
        // When QEMU had the vCPUs stopped: its STOP event comes before `stop`'s reply. (An
        // early-suspended guest's was taken with an earlier epoch's events: unknown.)
        let mut stopped_at = None;
        match stop {
            // On an error the begun capture's reply is left unread: `Qmp::reply` skips replies
            // of other commands, and the checkpoint is abandoned.
            Some(Some(stop)) => {
                self.qmp.reply(stop)?;
                stopped_at = self.qmp.event_time_us("STOP");
            }
            Some(None) => {
                let reply = |a: &mut Armed| a.reply().map(|_| a.event_time_us("STOP"));
                stopped_at = Armed::run_in(&mut self.armed_stop, reply).expect("fired above")?;
                started = self.devstate.begin(&mut self.qmp, true);
            }
            None => {}
        }
        // The main monitor gets the armed commands' events too, and may have nobody reading
        // it otherwise: take what it has (a reply read early waits for its `Qmp::reply`).
        self.qmp.drain_events()?;
        // Block I/O is drained now: a failed disk mirror has reported itself (and the queue of
        // STOP/RESUME events is emptied every epoch).
        self.check_mirror_events();
        t.stop_us = us(s);
        let s = Instant::now();
        dirty.clear();
        let harvested = self.harvest(dirty);
        t.harvest_us = us(s);
        let s = Instant::now();
        if harvested.is_ok() {
            pages.resize(dirty.len() * PAGE_SIZE, 0);
            for (i, &pfn) in dirty.iter().enumerate() {
                self.ram
                    .copy_page(pfn, &mut pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
            }
            in_pause(dirty, pages);
        }
        t.copy_us = us(s);
        let s = Instant::now();
        // Always collect a begun capture's reply, so the QMP stream stays in step; after a
        // failed harvest do not start a `migrate` for a checkpoint that is abandoned anyway.
        let harvested = match (harvested, started.is_some()) {
            (Err(e), false) => return Err(e),
            (h, _) => h,
        };
        let method = self.devstate.finish(&mut self.qmp, started, device_state);
        harvested?;
        self.last_devstate = Some(method?);
        t.devstate_us = us(s);
        if cont {
            let s = Instant::now();
            self.cont()?;
            t.cont_us = us(s);
            // The RESUME event comes before `cont`'s reply.
            let resumed_at = match &self.armed_cont {
                Some(a) => a.event_time_us("RESUME"),
                None => self.qmp.event_time_us("RESUME"),
            };
            if let (Some(a), Some(b)) = (stopped_at, resumed_at) {
                t.stopped_us = b.saturating_sub(a).min(u32::MAX as u64) as u32;
            }
        }
        // The fast capture's file is framed once the guest runs (QEMU rewrites it only at
        // the next capture): the copy is not part of the pause.
        self.devstate.complete(device_state)?;
        self.rearm();
        Ok(t)
    }

    /// Arms the pause's commands for the next pause, now that their replies are in (QEMU
    /// parses them while the guest runs). A monitor that failed is dropped: its command goes
    /// to the main monitor from then on.
    fn rearm(&mut self) {
        for armed in [&mut self.armed_stop, &mut self.armed_cont] {
            // A failure is logged and the monitor dropped.
            let _ = Armed::run_in(armed, Armed::arm);
        }
        self.devstate.rearm();
    }

    /// Stops the guest, resets the dirty log and lets the guest run again (so the next epoch
    /// does not carry what was written before, e.g. by the boot).
    pub fn reset_dirty_log(&mut self) -> Result<(), VmError> {
        self.restart_dirty_log(&mut || {})
    }

    /// [`Vm::reset_dirty_log`] with `boundary` run while the guest is stopped (the relays'
    /// seal and the disk log's reset of a session's initial sync): a short pause, whatever
    /// the guest's size.
    pub fn restart_dirty_log(&mut self, boundary: &mut dyn FnMut()) -> Result<(), VmError> {
        let r = (|| {
            self.stop()?;
            self.harvest(&mut Vec::new())?;
            boundary();
            self.cont()
        })();
        r.map_err(|e| self.explain(e))
    }
}

impl crate::epoch::Guest for Vm {
    fn mem_bytes(&self) -> usize {
        self.ram().len()
    }

    fn pause(
        &mut self,
        dirty: &mut Vec<u64>,
        pages: &mut Vec<u8>,
        device_state: &mut Vec<u8>,
        boundary: &mut crate::epoch::Boundary<'_>,
        cont: bool,
    ) -> Result<PauseTiming, VmError> {
        self.pause_and_capture(dirty, pages, device_state, boundary, cont)
            .map_err(|e| self.explain(e))
    }

    fn suspend(&mut self) -> Result<bool, VmError> {
        self.stop().map_err(|e| self.explain(e))?;
        self.suspended = true;
        Ok(true)
    }

    fn dirty_count(&mut self) -> Option<u64> {
        self.dirty.as_mut()?.count()?.ok()
    }

    fn cpu_times(&mut self, out: &mut Vec<std::time::Duration>) -> bool {
        if self.vcpu_clock.is_none() {
            let pid = self.pid();
            self.vcpu_clock = Some(crate::vcpu::VcpuClock::new(&mut self.qmp, pid));
        }
        self.vcpu_clock
            .as_ref()
            .and_then(|c| c.as_ref()?.read(out))
            .is_some()
    }

    fn initial_copy(&mut self, boundary: &mut dyn FnMut()) -> Result<Vec<u8>, VmError> {
        let r = (|| {
            self.stop()?;
            self.harvest(&mut Vec::new())?;
            boundary();
            // SAFETY: the guest is stopped while its memory is copied.
            let ram = unsafe { self.ram().as_slice() }.to_vec();
            self.cont()?;
            Ok(ram)
        })();
        r.map_err(|e| self.explain(e))
    }
}
