//! The epoch pipeline: one loop that runs the guest for an epoch, takes a checkpoint pause and
//! hands the checkpoint to a sink — the replication link, the checkpoint store, the trace
//! writer or the watch statistics. The [`Schedule`] seam decides epoch lengths; the [`Guest`]
//! seam is a real QEMU ([`crate::Vm`]) or a recorded trace replayed (tandem-harness's `ReplayGuest`),
//! so the pipeline, the protocol and the store can be tested in milliseconds without QEMU.

use std::time::{Duration, Instant};

pub use tandem_types::Epoch;

use crate::vm::{PauseTiming, VmError};

pub use crate::schedule::{Cut, Fixed, Pending, Schedule};

/// How often a polling schedule is asked whether to cut the epoch.
const POLL: Duration = Duration::from_millis(1);

/// Work at a checkpoint's boundary, called in the pause with the dirty page numbers and the
/// copied pages (see [`Guest::pause`]).
pub type Boundary<'a> = dyn FnMut(&[u64], &mut Vec<u8>) + 'a;

/// What the epoch pipeline needs from a VM.
pub trait Guest {
    /// Guest memory in bytes.
    fn mem_bytes(&self) -> usize;

    /// One checkpoint pause: stop, harvest the dirty log into `dirty` (ascending), copy those
    /// pages into `pages`, call `boundary` with them (still stopped: state that must share
    /// the checkpoint's boundary, such as the relay's seal and the disk write log; it may
    /// swap `pages` for another buffer), capture device state, and — if `cont` — let the
    /// guest run again.
    fn pause(
        &mut self,
        dirty: &mut Vec<u64>,
        pages: &mut Vec<u8>,
        device_state: &mut Vec<u8>,
        boundary: &mut Boundary<'_>,
        cont: bool,
    ) -> Result<PauseTiming, VmError>;

    /// The initial copy: in one pause, reset the dirty log, call `boundary` and copy all of
    /// guest memory; the guest runs again afterwards. Epoch 1 is relative to this copy.
    fn initial_copy(&mut self, boundary: &mut dyn FnMut()) -> Result<Vec<u8>, VmError>;

    /// Pages written since the last pause, counted while the guest runs (`None`: this guest
    /// cannot count).
    fn dirty_count(&mut self) -> Option<u64> {
        None
    }

    /// Each of the guest's vCPUs' run time so far, into `out` (false: this guest cannot
    /// tell). Between two readings, a vCPU's share of the wall time is how busy it was.
    fn cpu_times(&mut self, _out: &mut Vec<Duration>) -> bool {
        false
    }

    /// Stops the guest ahead of its next pause (seed 002's early suspend); the next
    /// [`Guest::pause`] then skips its stop. `Ok(false)`: this guest cannot be suspended and
    /// runs on.
    fn suspend(&mut self) -> Result<bool, VmError> {
        Ok(false)
    }

    /// Whether the guest has no more epochs to give (a replayed trace that ended).
    fn finished(&self) -> bool {
        false
    }
}

/// One checkpoint, borrowed from the loop's buffers.
pub struct Checkpoint<'a> {
    /// Epoch number.
    pub epoch: Epoch,
    /// Time since the loop started, at the checkpoint.
    pub at: Duration,
    /// Pause components.
    pub timing: PauseTiming,
    /// How long the guest was suspended before the pause (early suspend), on top of it.
    pub suspended: Duration,
    /// Why the epoch ended ([`crate::schedule::Schedule::reason`]).
    pub cut: crate::schedule::Reason,
    /// How long the guest ran in the epoch, from its resume to the pause (or to its early
    /// suspension).
    pub ran: Duration,
    /// The last rule that held the checkpoint back while network output waited for it
    /// ([`crate::schedule::Schedule::waited`]).
    pub waited: Option<crate::schedule::Wait>,
    /// The share of the epoch's run (up to the pause or suspension) that the guest's busiest
    /// vCPU was busy; `None` when the guest cannot tell or the schedule does not poll.
    pub busy: Option<f64>,
    /// Dirty page numbers, ascending.
    pub pfns: &'a [u64],
    /// Their contents, one page per entry of `pfns` (unless the sink took them in
    /// [`EpochSink::copied`]: then what it gave in their place).
    pub pages: &'a [u8],
    /// Device state at the checkpoint.
    pub device_state: &'a [u8],
}

/// Where checkpoints go.
pub trait EpochSink {
    /// Called while the guest is stopped for checkpoint `epoch`, after its pages were copied:
    /// take what belongs to the same boundary (seal the relay's queue, take the disk log).
    fn in_pause(&mut self, _epoch: Epoch) {}

    /// Called right after [`EpochSink::in_pause`], still in the pause, with the epoch's dirty
    /// pages: a sink that encodes them beside the rest of the pause (QEMU saving the devices)
    /// may swap `pages` for a buffer of its own, which its [`EpochSink::checkpoint`] then
    /// gets as [`Checkpoint::pages`].
    fn copied(&mut self, _epoch: Epoch, _pfns: &[u64], _pages: &mut Vec<u8>) {}

    /// What waits on the next checkpoint (for a schedule that cuts epochs early).
    fn pending(&self) -> Pending {
        Pending::default()
    }

    /// Called once the guest runs again. Return false to end the loop.
    fn checkpoint(&mut self, cp: &Checkpoint<'_>) -> bool;
}

/// A closure as a sink without boundary work.
struct FnSink<F>(F);

impl<F: FnMut(&Checkpoint<'_>) -> bool> EpochSink for FnSink<F> {
    fn checkpoint(&mut self, cp: &Checkpoint<'_>) -> bool {
        (self.0)(cp)
    }
}

/// Runs epochs numbered from `first` until the sink says stop, `duration` passes or the guest
/// is finished. Returns the last epoch checkpointed (`first - 1` if none).
pub fn run_pipeline(
    guest: &mut dyn Guest,
    schedule: &mut dyn Schedule,
    duration: Duration,
    first: Epoch,
    sink: &mut dyn EpochSink,
) -> Result<Epoch, VmError> {
    let (mut pfns, mut pages, mut dev) = (Vec::new(), Vec::new(), Vec::new());
    let start = Instant::now();
    let mut next = start + schedule.next_interval(0, &PauseTiming::default());
    let mut epoch = first.saturating_sub(1);
    let mut resumed = start;
    let mut sampled = start;
    // The vCPUs' run time when the guest resumed: only a polling schedule uses it.
    let (mut cpu_resumed, mut cpu_now) = (Vec::new(), Vec::new());
    // The vCPUs' run time at the last poll that read it, and when.
    let (mut cpu_polled, mut polled_at) = (Vec::new(), start);
    let mut cpu = schedule.polls() && guest.cpu_times(&mut cpu_resumed);
    while start.elapsed() < duration && !guest.finished() {
        let mut suspended_at = None;
        loop {
            let now = Instant::now();
            if now >= next {
                break;
            }
            if !schedule.polls() {
                std::thread::sleep(next - now);
                break;
            }
            let mut pending = sink.pending();
            if pending.output_frames > 0 && suspended_at.is_none() {
                pending.busy = cpu
                    .then(|| busy_since(guest, &cpu_resumed, &mut cpu_now, now - resumed))
                    .flatten();
                if pending.busy.is_some() {
                    // Since the last poll of this run that read them, else since the resume.
                    let (before, at) = if polled_at > resumed {
                        (&cpu_polled, polled_at)
                    } else {
                        (&cpu_resumed, resumed)
                    };
                    pending.busy_recent = Some(crate::vcpu::busy_share(before, &cpu_now, now - at));
                    std::mem::swap(&mut cpu_polled, &mut cpu_now);
                    polled_at = now;
                }
            }
            if let Some(every) = schedule.dirty_sample(&pending) {
                if now - sampled.max(resumed) >= every {
                    sampled = now;
                    pending.dirty_pages = guest.dirty_count();
                }
            }
            match schedule.early(now - resumed, &pending) {
                Cut::Run => {}
                Cut::Checkpoint => break,
                Cut::Suspend if suspended_at.is_none() => {
                    if guest.suspend()? {
                        suspended_at = Some(Instant::now());
                    }
                }
                Cut::Suspend => {}
            }
            std::thread::sleep((next - now).min(POLL));
        }
        let suspended = suspended_at.map_or(Duration::ZERO, |t| t.elapsed());
        let ran = suspended_at.unwrap_or_else(Instant::now) - resumed;
        let busy = cpu
            .then(|| busy_since(guest, &cpu_resumed, &mut cpu_now, ran))
            .flatten();
        schedule.ran_busy(busy);
        let (cut, waited) = (schedule.reason(), schedule.waited());
        let this = epoch + 1;
        let timing = guest.pause(
            &mut pfns,
            &mut pages,
            &mut dev,
            &mut |pfns: &[u64], pages: &mut Vec<u8>| {
                sink.in_pause(this);
                sink.copied(this, pfns, pages);
            },
            true,
        )?;
        epoch = this;
        // The next epoch starts when the guest resumed.
        resumed = Instant::now();
        cpu = cpu && guest.cpu_times(&mut cpu_resumed);
        next = resumed + schedule.next_interval(pfns.len(), &timing);
        let cp = Checkpoint {
            epoch,
            at: start.elapsed(),
            timing,
            suspended,
            cut,
            ran,
            waited,
            busy,
            pfns: &pfns,
            pages: &pages,
            device_state: &dev,
        };
        if !sink.checkpoint(&cp) {
            break;
        }
    }
    Ok(epoch)
}

/// The share of `ran` the guest's busiest vCPU ran since they read `cpu_resumed`.
fn busy_since(
    guest: &mut dyn Guest,
    cpu_resumed: &[Duration],
    now: &mut Vec<Duration>,
    ran: Duration,
) -> Option<f64> {
    guest
        .cpu_times(now)
        .then(|| crate::vcpu::busy_share(cpu_resumed, now, ran))
}

/// [`run_pipeline`] from epoch 1 with a closure as the sink; returns the number of epochs.
pub fn run_epochs(
    guest: &mut dyn Guest,
    schedule: &mut dyn Schedule,
    duration: Duration,
    on_checkpoint: impl FnMut(&Checkpoint<'_>) -> bool,
) -> Result<Epoch, VmError> {
    run_pipeline(guest, schedule, duration, 1, &mut FnSink(on_checkpoint))
}
