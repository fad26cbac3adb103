//! The fixed-interval epoch loop: run the guest for an epoch, then take a checkpoint pause.
//! A scheduler seam ([`Schedule`]) lets an adaptive scheduler replace the fixed interval.

use std::time::{Duration, Instant};

use crate::vm::{PauseTiming, Vm, VmError};

/// Decides how long the guest runs before the next checkpoint.
pub trait Schedule {
    /// The next epoch's run time, given the previous checkpoint's dirty-page count and pause.
    fn next_interval(&mut self, last_dirty: usize, last_pause: &PauseTiming) -> Duration;
}

/// A fixed epoch length (Remus style).
pub struct Fixed(pub Duration);

impl Schedule for Fixed {
    fn next_interval(&mut self, _: usize, _: &PauseTiming) -> Duration {
        self.0
    }
}

/// One checkpoint, borrowed from the loop's buffers.
pub struct Checkpoint<'a> {
    /// Epoch number, from 1.
    pub epoch: u32,
    /// Time since the loop started, at the checkpoint.
    pub at: Duration,
    /// Pause components.
    pub timing: PauseTiming,
    /// Dirty page numbers, ascending.
    pub pfns: &'a [u64],
    /// Their contents, one page per entry of `pfns`.
    pub pages: &'a [u8],
    /// Device state at the checkpoint.
    pub device_state: &'a [u8],
}

/// Runs epochs until `until` returns true or `duration` passes, calling `on_checkpoint` after
/// each pause (the guest is already running again). Returns the number of epochs.
pub fn run_epochs(
    vm: &mut Vm,
    schedule: &mut dyn Schedule,
    duration: Duration,
    on_checkpoint: impl FnMut(&Checkpoint<'_>) -> bool,
) -> Result<u32, VmError> {
    run_epochs_with(vm, schedule, duration, |_| {}, on_checkpoint)
}

/// [`run_epochs`] with `in_pause(epoch)` called while the guest is stopped for each checkpoint
/// (see [`Vm::checkpoint_with`]).
pub fn run_epochs_with(
    vm: &mut Vm,
    schedule: &mut dyn Schedule,
    duration: Duration,
    mut in_pause: impl FnMut(u32),
    mut on_checkpoint: impl FnMut(&Checkpoint<'_>) -> bool,
) -> Result<u32, VmError> {
    let (mut pfns, mut pages, mut dev) = (Vec::new(), Vec::new(), Vec::new());
    let start = Instant::now();
    let mut next = start + schedule.next_interval(0, &PauseTiming::default());
    let mut epoch = 0;
    while start.elapsed() < duration {
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        let timing = vm
            .checkpoint_with(&mut pfns, &mut pages, &mut dev, &mut || in_pause(epoch + 1))
            .map_err(|e| vm.explain(e))?;
        epoch += 1;
        // The next epoch starts when the guest resumed.
        next = Instant::now() + schedule.next_interval(pfns.len(), &timing);
        let cp = Checkpoint {
            epoch,
            at: start.elapsed(),
            timing,
            pfns: &pfns,
            pages: &pages,
            device_state: &dev,
        };
        if !on_checkpoint(&cp) {
            break;
        }
    }
    Ok(epoch)
}
