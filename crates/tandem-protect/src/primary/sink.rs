//! The replication link as the epoch pipeline's sink: at the checkpoint boundary it seals the
//! relays' epoch and takes the disk write log (and ends the session once the ownership record
//! names another node); after the pause it encodes the epoch and hands it to the sender.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::time::{Duration, Instant};

use tandem_replication::{EpochInput, Primary};
use tandem_vm::epoch::{Checkpoint, Pending};
use tandem_vm::{Epoch, EpochSink};

use super::ahead::{Ahead, Done};
use super::link::{Out, Shared};
use super::session::Writes;
use super::watchdog::Watchdog;
use super::{PrimaryConfig, PrimaryError};
use crate::faults::take_kill_in_pause;
use crate::metrics::{EpochMetrics, Registry};
use crate::site::Site;
use crate::Status;

/// The replication link as the epoch pipeline's sink: at the checkpoint's boundary it seals
/// the relay's epoch and takes the disk write log; after the pause it ships the epoch.
pub(super) struct LinkSink<'a> {
    pub(super) st: Step<'a>,
    pub(super) watchdog: &'a Watchdog,
    pub(super) fencing: Option<&'a mut super::fence::Fencing>,
    pub(super) fenced_by: &'a mut Option<String>,
    /// Output passes (a resumed guest without fencing): held from the first checkpoint on.
    pub(super) passing: &'a mut bool,
    /// QEMU's pid, for the pause-kill fault hook (0: none).
    pub(super) qemu: u32,
    pub(super) writes: std::io::Result<Writes>,
    pub(super) err: Option<PrimaryError>,
    pub(super) last_print: Instant,
    /// The encoder's thread, which encodes an epoch's memory record from the pause on.
    pub(super) ahead: Ahead,
}

impl EpochSink for LinkSink<'_> {
    fn pending(&self) -> Pending {
        Pending {
            output_frames: self.st.site.relays.unsealed_frames(),
            unacked: self.st.shared.pending().len() as u64,
            disk_bytes: self.st.site.disk_log_bytes(),
            dirty_pages: None,
            busy: None,
            busy_recent: None,
            ship_pages_per_s: self.st.shared.ship_rate(),
        }
    }

    fn in_pause(&mut self, epoch: Epoch) {
        if self.qemu != 0 && take_kill_in_pause() {
            self.st.status.warn(format!(
                "fault injection: killing QEMU inside the pause of epoch {epoch}"
            ));
            // SAFETY: kill(2) of the QEMU this daemon started.
            unsafe { libc::kill(self.qemu as i32, libc::SIGKILL) };
        }
        self.st.site.relays.seal(epoch);
        // A session that began while output passed holds it from its first checkpoint on:
        // what passed was produced before this boundary, and the backup can resume no state
        // before it (it is consistent only once this epoch commits).
        let held = match self.fencing.as_mut() {
            Some(f) => f.hold(self.st.site),
            None if *self.passing => self
                .st
                .site
                .relays
                .set_policy(tandem_net::Policy::Hold)
                .map(|()| *self.passing = false)
                .map_err(|e| format!("holding output again: {e}")),
            None => Ok(()),
        };
        if let Err(why) = held {
            self.st.shared.lose(why);
        }
        if let Some(d) = &self.st.site.disk {
            // Ranges beyond the write log are read back here, inside the pause: every piece
            // is progress for the watchdog (a large read-back is slow, not a hang).
            let wd = &self.watchdog;
            self.writes = d.try_take_epoch_writes_with(&mut || wd.beat());
        }
        // Another node owns the VM (the read-back saw it): this copy stops here.
        if let Some(what) = self.fencing.as_ref().and_then(|f| f.fenced()) {
            *self.fenced_by = Some(what);
            self.st
                .shared
                .lose("etcd's ownership record names another node".into());
        }
        if let Some(why) = self.st.site.mirror_health.broken() {
            // A mirror failed during the epoch: its writes are incomplete.
            self.writes = Err(std::io::Error::other(why));
        }
    }

    fn copied(&mut self, epoch: Epoch, pfns: &[u64], pages: &mut Vec<u8>) {
        // An epoch that goes out whole has its memory record encoded on the encoder's thread
        // from now on, beside QEMU's saving of the devices; a larger one is encoded part by
        // part after the pause.
        let writes = match &self.writes {
            Ok(w) => self.st.site.disk.as_ref().map(|_| w.as_slice()),
            Err(_) => return,
        };
        if pfns.is_empty()
            || self.st.shared.is_lost()
            || !self.st.opts.parts.whole(pfns.len(), writes)
            || !self.ahead.ready()
        {
            return;
        }
        self.st.set_level();
        let Ok(job) = self.st.proto.lend_encoder(epoch) else {
            return;
        };
        if !self.ahead.start(job, pfns, pages) {
            self.st.shared.lose("the encoder's thread stopped".into());
        }
    }

    fn checkpoint(&mut self, cp: &Checkpoint<'_>) -> bool {
        // A large epoch (the first after a long initial sync, a burst of writes) takes about
        // 10 ms per MiB to encode on a loaded host, which is progress. Small ones only beat:
        // an allowance would delay the detection of a hang that follows.
        let mib = ((cp.pfns.len() * 4096) >> 20) as u64;
        if mib > 64 {
            self.watchdog.allow(Duration::from_millis(10 * mib));
        } else {
            self.watchdog.beat();
        }
        let shared = self.st.shared;
        shared.progress.store(cp.epoch, Ordering::SeqCst);
        if shared.is_lost() {
            return false;
        }
        let w = match std::mem::replace(&mut self.writes, Ok(Vec::new())) {
            Ok(w) => w,
            Err(e) => {
                // The epoch's disk writes are unknown: only a full copy is safe.
                shared.lose(format!(
                    "reading back the epoch's disk writes failed ({e}); re-syncing"
                ));
                return false;
            }
        };
        let wd = self.watchdog;
        let Ok(ahead) = self.ahead.finish(cp.epoch) else {
            shared.lose("the encoder's thread stopped".into());
            return false;
        };
        if let Err(e) = self.st.ship(cp.epoch, cp, &w, &|| wd.beat(), ahead) {
            self.err = Some(e);
            return false;
        }
        if self.last_print.elapsed() >= Duration::from_secs(1) {
            self.last_print = Instant::now();
            self.st.print(cp.epoch);
        }
        !shared.is_lost() && !self.st.status.stop().leaving()
    }
}

/// Borrowed state for shipping one epoch.
pub(super) struct Step<'a> {
    pub(super) proto: &'a mut Primary,
    pub(super) registry: &'a Registry,
    pub(super) opts: &'a PrimaryConfig,
    pub(super) site: &'a Site,
    pub(super) shared: &'a Shared,
    pub(super) tx: &'a SyncSender<Out>,
    pub(super) raw: &'a mut u64,
    pub(super) sent: &'a mut u64,
    pub(super) status: &'a Status,
}

impl Step<'_> {
    /// The zstd level of the next memory record: the configured one, else the level the
    /// sender chose for the link.
    fn set_level(&mut self) {
        let level = self
            .opts
            .zstd_level
            .unwrap_or_else(|| self.shared.level.load(std::sync::atomic::Ordering::Relaxed));
        self.proto.set_level(level);
    }

    /// Encodes epoch `seq` (around `ahead`, its memory record encoded on the encoder's
    /// thread, if there is one) and hands it to the sender, in parts when it is large (each
    /// part handed on is progress: `beat`); marks the link lost when the backup has not
    /// acknowledged an epoch within the ack timeout.
    pub(super) fn ship(
        &mut self,
        seq: u64,
        cp: &Checkpoint<'_>,
        writes: &Writes,
        beat: &dyn Fn(),
        ahead: Option<Done>,
    ) -> Result<(), PrimaryError> {
        let (t, cpu) = (Instant::now(), thread_cpu());
        let input = EpochInput {
            seq,
            pfns: cp.pfns,
            pages: cp.pages,
            device_state: cp.device_state,
            disk_writes: self.site.disk.as_ref().map(|_| writes.as_slice()),
        };
        let (tx, shared, opts) = (self.tx, self.shared, self.opts);
        let mut parts = 0u64;
        let (mut ahead_cpu, mut ahead_wall) = (Duration::ZERO, Duration::ZERO);
        let shipped = match ahead {
            Some(done) => {
                (ahead_cpu, ahead_wall) = (done.cpu, done.wall);
                self.proto.epoch_encoded(&input, done.record)
            }
            None => {
                self.set_level();
                self.proto.epoch_parts(&input, opts.parts, |f| {
                    parts += 1;
                    beat();
                    hand_on(tx, shared, opts, Out::Part(f), beat)
                })
            }
        };
        let (frame, sizes) = match shipped {
            Ok(s) => s,
            // The link was lost between parts: the session ends as lost and re-syncs (the
            // backup undoes the parts it got), as for any epoch the sender cannot take.
            Err(tandem_replication::PrimaryError::PartNotSent { .. }) if shared.is_lost() => {
                return Ok(())
            }
            Err(e) => return Err(e.into()),
        };
        if parts > 0 {
            self.status.info(format!(
                "epoch {seq}: {} dirty pages, {:.0} MiB of disk writes sent in {} parts",
                cp.pfns.len(),
                sizes.disk_bytes as f64 / (1 << 20) as f64,
                parts + 1
            ));
        }
        let held = self.held();
        self.registry.set_held(held.held_frames, held.held_bytes);
        self.registry.set_dropped_frames(held.overflow_frames);
        let tm = cp.timing;
        let m = EpochMetrics {
            epoch: seq,
            pause: tm,
            pause_us: tm.total_us(),
            suspended_us: cp.suspended.as_micros() as u64,
            cut: cp.cut,
            ran_us: cp.ran.as_micros() as u64,
            waited: cp.waited,
            busy_pct: cp.busy.map(|b| (b * 1000.0).round() / 10.0),
            lost_cpu_us: tandem_vm::vcpu::lost(
                Duration::from_micros(tm.total_us().into()) + cp.suspended,
                cp.busy,
            )
            .as_micros() as u64,
            dirty_pages: cp.pfns.len() as u64,
            raw_bytes: sizes.raw,
            sent_bytes: sizes.sent,
            encode_us: t.elapsed().as_micros() as u64,
            encode_cpu_us: (thread_cpu().saturating_sub(cpu) + ahead_cpu).as_micros() as u64,
            encode_ahead_us: ahead_wall.as_micros() as u64,
            level: sizes.level,
            long_patches: sizes.long_patches,
            word_deltas: sizes.word_deltas,
            prefix_off: sizes.prefix_off,
            held_frames: held.held_frames,
            held_bytes: held.held_bytes,
            disk_writes: sizes.disk_writes,
            disk_bytes: sizes.disk_bytes,
            parts,
            ..Default::default()
        };
        *self.raw += m.raw_bytes;
        *self.sent += m.sent_bytes;
        self.shared.pending().push_back(m.clone());
        hand_on(tx, shared, opts, Out::Epoch(frame, Box::new(m)), &|| {});
        check_deadline(shared, opts);
        Ok(())
    }

    /// The relays' counters (zeros without a relay).
    fn held(&self) -> tandem_net::RelayStats {
        self.site.relays.stats()
    }

    fn print(&self, seq: u64) {
        // Pause quantiles from the metrics histogram (epochs the sender has shipped).
        let pauses = self.registry.pause_histogram();
        let held = self.held();
        let acks = self.shared.acks();
        self.status.info(format!(
            "epoch {seq} acked {} | raw {:.1} MiB sent {:.2} MiB | pause p50 {:.1} ms p99 {:.1} ms | held frames {}{}",
            acks.acked(),
            *self.raw as f64 / (1 << 20) as f64,
            *self.sent as f64 / (1 << 20) as f64,
            pauses.quantile(0.5) * 1e3,
            pauses.quantile(0.99) * 1e3,
            held.held_frames,
            if acks.can_fail_over() { "" } else { " | backup CANNOT fail over" },
        ));
    }
}

/// Hands `item` to the sender, waiting while its queue is full (each wait is progress:
/// `beat`; the sender's writes time out after the ack timeout, so it cannot wait forever).
/// False when the session is lost.
fn hand_on(
    tx: &SyncSender<Out>,
    shared: &Shared,
    opts: &PrimaryConfig,
    mut item: Out,
    beat: &dyn Fn(),
) -> bool {
    loop {
        match tx.try_send(item) {
            Ok(()) => return !shared.is_lost(),
            Err(TrySendError::Full(back)) => item = back,
            Err(TrySendError::Disconnected(_)) => {
                shared.lose("the sender stopped".into());
                return false;
            }
        }
        if check_deadline(shared, opts) {
            return false;
        }
        beat();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Marks the link lost if the oldest unacknowledged epoch is older than the ack timeout,
/// or acknowledged output has waited that long because every acknowledgement came after
/// the backup's promise ran out (a backup whose `--timeout-ms` is shorter than its
/// acknowledgements take: output would never leave).
fn check_deadline(shared: &Shared, opts: &PrimaryConfig) -> bool {
    let age = shared.acks().oldest_unacked(Instant::now());
    if let Some(age) = age.filter(|a| *a > opts.ack_timeout) {
        shared.lose(format!(
            "no acknowledgement for {} ms (ack timeout {} ms)",
            age.as_millis(),
            opts.ack_timeout.as_millis()
        ));
    }
    let deferred = *shared
        .deferred_since
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(t) = deferred.filter(|t| t.elapsed() > opts.ack_timeout) {
        shared.lose(format!(
            "acknowledgements have come after the backup's promise ran out for {} ms: their output cannot leave (give the backup a longer --timeout-ms than its acknowledgements take)",
            t.elapsed().as_millis()
        ));
    }
    shared.is_lost()
}

/// This thread's CPU time so far.
pub(super) fn thread_cpu() -> std::time::Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    std::time::Duration::new(
        t.tv_sec.max(0) as u64,
        t.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

#[cfg(test)]
mod tests {
    use super::thread_cpu;
    use std::time::{Duration, Instant};

    #[test]
    fn the_encoders_cpu_time_counts_work_and_not_waiting() {
        let before = thread_cpu();
        std::thread::sleep(Duration::from_millis(50));
        let slept = thread_cpu() - before;
        assert!(
            slept < Duration::from_millis(20),
            "sleeping took {slept:?} of CPU"
        );
        // Work until 25 ms of CPU time are counted (a loaded host may take longer in wall time).
        let (start, mut x) = (Instant::now(), 1u64);
        while thread_cpu() - before < Duration::from_millis(25) {
            for _ in 0..10_000 {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "no CPU time counted"
            );
        }
        assert_ne!(x, 0);
    }
}
