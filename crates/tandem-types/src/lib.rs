//! The words every tandem crate shares, defined once: the guest page size, the epoch number
//! and the components of a checkpoint pause (used by the VM's epoch loop, traces, the
//! replication metrics and the checkpoint store), and the framing helper under the four
//! binary formats ([`framing`]).

#![warn(missing_docs)]

use serde::{Deserialize, Serialize};

pub mod framing;
pub mod stats;

/// Size of a guest page in bytes (x86-64 base pages; dirty logs, codecs and formats work in
/// these units).
pub const PAGE_SIZE: usize = 4096;

/// An epoch number: checkpoints of one guest are numbered from 1 and the numbers keep
/// counting across replication sessions. (The trace format stores it as `u32` on disk.)
pub type Epoch = u64;

/// Pause components of one checkpoint, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseTiming {
    /// QMP `stop`.
    pub stop_us: u32,
    /// Dirty-log harvest.
    pub harvest_us: u32,
    /// Copy of the dirty pages (and the boundary work: relay seal, disk write log).
    pub copy_us: u32,
    /// Device-state capture.
    pub devstate_us: u32,
    /// QMP `cont`.
    pub cont_us: u32,
    /// How long QEMU held the guest's vCPUs stopped within the pause: its `RESUME` event's
    /// timestamp minus its `STOP` event's. Shorter than the pause by the two commands'
    /// transit (the guest still runs while `stop` travels and runs again before `cont`'s
    /// reply arrives). 0: not known (a guest stopped before the pause, events unseen).
    /// Not a component of [`PauseTiming::total_us`].
    #[serde(default)]
    pub stopped_us: u32,
}

impl PauseTiming {
    /// The components in order: stop, harvest, copy, device state, cont (µs).
    pub fn components_us(&self) -> [u32; 5] {
        [
            self.stop_us,
            self.harvest_us,
            self.copy_us,
            self.devstate_us,
            self.cont_us,
        ]
    }

    /// The whole pause (type II downtime), saturating at `u32::MAX` µs.
    pub fn total_us(&self) -> u32 {
        self.components_us()
            .iter()
            .fold(0u32, |a, &v| a.saturating_add(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn total_adds_components_and_saturates() {
        let t = PauseTiming {
            stop_us: 1,
            harvest_us: 2,
            copy_us: 3,
            devstate_us: 4,
            cont_us: 5,
            stopped_us: 14,
        };
        assert_eq!(t.total_us(), 15, "QEMU's stopped time is not a component");
        let big = PauseTiming {
            stop_us: u32::MAX,
            cont_us: 1,
            ..t
        };
        assert_eq!(big.total_us(), u32::MAX);
    }
}
