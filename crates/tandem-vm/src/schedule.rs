//! When the epoch loop pauses the guest next: a fixed epoch length (Remus), or the adaptive
//! schedule of seed 002 (Gerofi & Ishikawa, "Workload Adaptive Checkpoint Scheduling of Virtual
//! Machine Replication"; docs/SCHEDULING.md).
//!
//! The loop asks [`Schedule::next_interval`] for the longest the guest may run after a
//! checkpoint, and — for a schedule that [`Schedule::polls`] — calls [`Schedule::early`] about
//! every millisecond while the guest runs, with what waits on the next checkpoint
//! ([`Pending`], from the epoch's sink: held network output, unacknowledged checkpoints, disk
//! writes, the shipping rate). `early` answers with a [`Cut`]: run on, checkpoint now, or
//! suspend the guest (seed 002's early suspend) until a later call says checkpoint.

use std::time::Duration;

use crate::vm::PauseTiming;

mod adaptive;

pub use adaptive::{Adaptive, AdaptiveConfig, BudgetClock};

/// What waits on the next checkpoint, as the epoch's sink sees it between checkpoints.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pending {
    /// Guest network frames held since the last checkpoint (released only after the next
    /// checkpoint is acknowledged).
    pub output_frames: u64,
    /// Checkpoints shipped and not yet acknowledged.
    pub unacked: u64,
    /// Disk bytes written since the last checkpoint.
    pub disk_bytes: u64,
    /// Guest pages written since the last checkpoint, set when the loop sampled the dirty log
    /// for this call (every [`Schedule::dirty_sample`]); `None` otherwise.
    pub dirty_pages: Option<u64>,
    /// Dirty pages the sink ships per second, end to end (encode, transfer, the backup's
    /// apply and acknowledgement), as measured over the last checkpoints; `None` before a
    /// measurement (or for a sink that holds no output).
    pub ship_pages_per_s: Option<u64>,
    /// The share of the time since the guest resumed that its busiest vCPU ran (set while
    /// output is held, for a guest that can tell): what a pause now would take from it.
    pub busy: Option<f64>,
    /// The share of the time since the previous poll that read the vCPUs (about a
    /// millisecond) that the busiest vCPU ran: whether the guest is working right now.
    pub busy_recent: Option<f64>,
}

/// Why an epoch ended: what the checkpoint was taken for ([`Schedule::reason`]), reported
/// per epoch (the metrics' JSON lines, `tandem_epochs_cut_total`, `tandem status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reason {
    /// Its longest wait passed (every epoch of a fixed schedule).
    #[default]
    Time,
    /// Network output waited for it.
    Output,
    /// The disk writes reached the limit.
    Disk,
    /// The dirty page set converged.
    Converged,
    /// A session's first checkpoint, taken at once after the initial sync.
    Start,
    /// A session's last checkpoint, the guest left stopped for the backup (a planned stop).
    Handover,
}

impl Reason {
    /// Every reason, in the order of [`Reason::index`].
    pub const ALL: [Reason; 6] = [
        Reason::Time,
        Reason::Output,
        Reason::Disk,
        Reason::Converged,
        Reason::Start,
        Reason::Handover,
    ];

    /// Its name in reports: `time`, `output`, `disk`, `converged`, `start`, `handover`.
    pub fn name(self) -> &'static str {
        match self {
            Reason::Time => "time",
            Reason::Output => "output",
            Reason::Disk => "disk",
            Reason::Converged => "converged",
            Reason::Start => "start",
            Reason::Handover => "handover",
        }
    }

    /// Its place in [`Reason::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The rule that held back a checkpoint network output waited for ([`Schedule::waited`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// The guest had not yet run its minimum after the last pause (`run_per_pause`).
    MinRun,
    /// The next pause did not fit the guest-time budget.
    Budget,
    /// The guest was busy (`busy_hold`).
    Busy,
    /// The previous checkpoint's acknowledgement (`max_unacked` in flight).
    Ack,
}

impl Wait {
    /// Every rule, in the order of [`Wait::index`].
    pub const ALL: [Wait; 4] = [Wait::MinRun, Wait::Budget, Wait::Busy, Wait::Ack];

    /// Its name in reports: `min_run`, `budget`, `busy`, `ack`.
    pub fn name(self) -> &'static str {
        match self {
            Wait::MinRun => "min_run",
            Wait::Budget => "budget",
            Wait::Busy => "busy",
            Wait::Ack => "ack",
        }
    }

    /// Its place in [`Wait::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What the guest does next, as [`Schedule::early`] decides while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Run on.
    Run,
    /// Stop the guest now but take the checkpoint later (seed 002's early suspend: the
    /// dirty set is as large as the link ships in the stop budget and output waits for an
    /// acknowledgement). Polling goes on; the checkpoint follows when a later call says
    /// [`Cut::Checkpoint`] or the epoch's longest wait passes.
    Suspend,
    /// Take the checkpoint now.
    Checkpoint,
}

/// Decides how long the guest runs before the next checkpoint.
pub trait Schedule {
    /// The longest the guest runs before the next checkpoint, given the previous
    /// checkpoint's dirty-page count and pause.
    fn next_interval(&mut self, last_dirty: usize, last_pause: &PauseTiming) -> Duration;

    /// Whether the loop should call [`Schedule::early`] while the guest runs.
    fn polls(&self) -> bool {
        false
    }

    /// How often the loop should count the guest's dirty pages for [`Schedule::early`] with
    /// `pending` waiting (`None`: not now; counting walks the guest's page tables).
    fn dirty_sample(&self, _pending: &Pending) -> Option<Duration> {
        None
    }

    /// Called about every millisecond while the guest runs or is suspended (`ran`: since it
    /// resumed from the last checkpoint).
    fn early(&mut self, _ran: Duration, _pending: &Pending) -> Cut {
        Cut::Run
    }

    /// Called as the epoch's run ends, before its pause: the share of the run its busiest
    /// vCPU was busy (`None`: unknown).
    fn ran_busy(&mut self, _share: Option<f64>) {}

    /// Why the epoch that just ended did (asked before its pause, after the last
    /// [`Schedule::early`]).
    fn reason(&self) -> Reason {
        Reason::Time
    }

    /// The last rule that held back the epoch's checkpoint while network output waited for
    /// it (`None`: output did not wait, or the cut came at the first poll that could take it).
    fn waited(&self) -> Option<Wait> {
        None
    }
}

/// A fixed epoch length (Remus style).
pub struct Fixed(pub Duration);

impl Schedule for Fixed {
    fn next_interval(&mut self, _: usize, _: &PauseTiming) -> Duration {
        self.0
    }
}

/// `inner` with its first checkpoint at once: a session's first epoch carries what the guest
/// wrote since the initial sync (held while the encoder was built), and the backup can fail
/// over only once that epoch committed, so it does not wait out a first interval.
pub struct StartNow {
    inner: Box<dyn Schedule>,
    started: bool,
    /// The epoch running is the first (its checkpoint is taken at once).
    first: bool,
}

impl StartNow {
    /// `inner`, starting with a checkpoint.
    pub fn new(inner: Box<dyn Schedule>) -> Self {
        StartNow {
            inner,
            started: false,
            first: false,
        }
    }
}

impl Schedule for StartNow {
    fn next_interval(&mut self, last_dirty: usize, last_pause: &PauseTiming) -> Duration {
        let i = self.inner.next_interval(last_dirty, last_pause);
        self.first = !std::mem::replace(&mut self.started, true);
        if self.first {
            Duration::ZERO
        } else {
            i
        }
    }

    fn polls(&self) -> bool {
        self.inner.polls()
    }

    fn dirty_sample(&self, pending: &Pending) -> Option<Duration> {
        self.inner.dirty_sample(pending)
    }

    fn early(&mut self, ran: Duration, pending: &Pending) -> Cut {
        self.inner.early(ran, pending)
    }

    fn ran_busy(&mut self, share: Option<f64>) {
        self.inner.ran_busy(share)
    }

    fn reason(&self) -> Reason {
        if self.first {
            Reason::Start
        } else {
            self.inner.reason()
        }
    }

    fn waited(&self) -> Option<Wait> {
        self.inner.waited()
    }
}

/// The schedule for an epoch length and, if given, the adaptive knobs (then `epoch` is
/// ignored: the adaptive schedule's longest wait is its `max_wait`).
pub fn build(epoch: Duration, adaptive: Option<AdaptiveConfig>) -> Box<dyn Schedule> {
    match adaptive {
        Some(cfg) => Box::new(Adaptive::new(cfg)),
        None => Box::new(Fixed(epoch)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pause of `ms` milliseconds (for the adaptive schedule's tests too).
    pub(super) fn pause(ms: u64) -> PauseTiming {
        PauseTiming {
            stop_us: (ms * 1000) as u32,
            ..Default::default()
        }
    }

    pub(super) fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn start_now_checkpoints_at_once_then_follows_its_schedule() {
        let mut s = StartNow::new(build(ms(100), Some(AdaptiveConfig::default())));
        assert_eq!(s.next_interval(0, &PauseTiming::default()), Duration::ZERO);
        assert_eq!(s.reason(), Reason::Start);
        assert!(s.polls());
        let max = AdaptiveConfig::default().max_wait;
        assert_eq!(s.next_interval(10, &pause(2)), max);
        assert_eq!(s.reason(), Reason::Time);
        let out = Pending {
            output_frames: 1,
            ..Default::default()
        };
        assert_eq!(s.early(ms(50), &out), Cut::Checkpoint);
        assert_eq!(s.reason(), Reason::Output, "the inner schedule's reason");
        assert_eq!(s.next_interval(10, &pause(2)), max);
        let mut f = StartNow::new(build(ms(100), None));
        assert_eq!(f.next_interval(0, &PauseTiming::default()), Duration::ZERO);
        assert!(!f.polls());
        assert_eq!(f.next_interval(10, &pause(2)), ms(100));
    }

    #[test]
    fn fixed_never_polls() {
        let mut f = Fixed(ms(100));
        assert!(!f.polls());
        let out = Pending {
            output_frames: 9,
            ..Default::default()
        };
        assert_eq!(f.early(Duration::from_secs(9), &out), Cut::Run);
        assert_eq!(f.reason(), Reason::Time);
    }

    #[test]
    fn reasons_are_named_and_indexed_in_order() {
        for (i, r) in Reason::ALL.into_iter().enumerate() {
            assert_eq!(r.index(), i);
        }
        for (i, w) in Wait::ALL.into_iter().enumerate() {
            assert_eq!(w.index(), i);
        }
        let waits: Vec<_> = Wait::ALL.iter().map(|w| w.name()).collect();
        assert_eq!(waits, ["min_run", "budget", "busy", "ack"]);
        let names: Vec<_> = Reason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(
            names,
            ["time", "output", "disk", "converged", "start", "handover"]
        );
    }
}
