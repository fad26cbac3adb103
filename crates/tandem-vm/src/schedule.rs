//! When the epoch loop pauses the guest next: a fixed epoch length (Remus), or the adaptive
//! schedule of seed 002 (Gerofi & Ishikawa, "Workload Adaptive Checkpoint Scheduling of Virtual
//! Machine Replication"; docs/SCHEDULING.md).
//!
//! The loop asks [`Schedule::next_interval`] for the longest the guest may run after a
//! checkpoint, and — for a schedule that [`Schedule::polls`] — calls [`Schedule::early`] about
//! every millisecond while the guest runs, with what waits on the next checkpoint
//! ([`Pending`], from the epoch's sink: held network output, unacknowledged checkpoints, disk
//! writes). `early` returning true cuts the epoch there.

use std::time::Duration;

use crate::vm::PauseTiming;

/// What waits on the next checkpoint, as the epoch's sink sees it between checkpoints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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

    /// How often the loop should count the guest's dirty pages for [`Schedule::early`]
    /// (`None`: never; counting walks the guest's page tables).
    fn dirty_sample(&self) -> Option<Duration> {
        None
    }

    /// Called about every millisecond while the guest runs (`ran`: since it resumed): true
    /// cuts the epoch now.
    fn early(&mut self, _ran: Duration, _pending: &Pending) -> bool {
        false
    }
}

/// A fixed epoch length (Remus style).
pub struct Fixed(pub Duration);

impl Schedule for Fixed {
    fn next_interval(&mut self, _: usize, _: &PauseTiming) -> Duration {
        self.0
    }
}

/// The adaptive schedule's knobs (defaults from seed 002 where it gives them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveConfig {
    /// Longest epoch when nothing waits (the paper's WAIT_MAX_THRESHOLD, 2 s there; shorter
    /// here because the pause copies the whole dirty set: default 500 ms).
    pub max_wait: Duration,
    /// Shortest run between two pauses (default 2 ms).
    pub min_run: Duration,
    /// The guest's share of time under output: an early checkpoint waits until the guest ran
    /// at least `run_per_pause` × the last pause (default 1.0: at least half the time).
    pub run_per_pause: f64,
    /// Disk writes that force a checkpoint (the paper's disk buffer limit, 50 MB there;
    /// default 32 MiB, half of the disk write log's bound).
    pub disk_limit: u64,
    /// Checkpoints in flight at most when output triggers the next (the paper waits for the
    /// previous one's acknowledgement: 1).
    pub max_unacked: u64,
    /// Dirty-page-set convergence (seed 002: < 5 % growth between dirty-log updates): cut the
    /// epoch once the dirty count grew by less than this fraction over one sample. `None`
    /// (default): off, the longest wait stands in for it.
    pub converge: Option<f64>,
    /// How often the dirty count is sampled for `converge` (default 10 ms).
    pub sample: Duration,
    /// Shortest epoch that convergence may end (default 20 ms): below it the fixed cost of a
    /// pause outweighs what an earlier checkpoint saves.
    pub converge_min_run: Duration,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        AdaptiveConfig {
            max_wait: Duration::from_millis(500),
            min_run: Duration::from_millis(2),
            run_per_pause: 1.0,
            disk_limit: 32 << 20,
            max_unacked: 1,
            converge: None,
            sample: Duration::from_millis(10),
            converge_min_run: Duration::from_millis(20),
        }
    }
}

/// Seed 002's scheduler: checkpoint as soon as network output waits for one (once the
/// previous checkpoint is acknowledged and the guest had its share of time), when the disk
/// writes reach the buffer limit, and otherwise after `max_wait`.
#[derive(Debug, Clone)]
pub struct Adaptive {
    cfg: AdaptiveConfig,
    /// The minimum run after the last pause.
    min_run_now: Duration,
    /// The previous dirty-count sample of this epoch.
    last_count: Option<u64>,
    /// Why the last epoch ended (for statistics): output, disk or time.
    pub last_reason: Reason,
}

/// Why an adaptive epoch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reason {
    /// Its longest wait passed.
    #[default]
    Time,
    /// Network output waited.
    Output,
    /// The disk writes reached the limit.
    Disk,
    /// The dirty page set converged.
    Converged,
}

impl Adaptive {
    /// The schedule with `cfg`.
    pub fn new(cfg: AdaptiveConfig) -> Self {
        Adaptive {
            cfg,
            min_run_now: cfg.min_run,
            last_count: None,
            last_reason: Reason::Time,
        }
    }
}

impl Schedule for Adaptive {
    fn next_interval(&mut self, _: usize, last_pause: &PauseTiming) -> Duration {
        let share = Duration::from_secs_f64(
            last_pause.total_us() as f64 / 1e6 * self.cfg.run_per_pause.max(0.0),
        );
        self.min_run_now = self.cfg.min_run.max(share).min(self.cfg.max_wait);
        self.last_reason = Reason::Time;
        self.last_count = None;
        self.cfg.max_wait
    }

    fn polls(&self) -> bool {
        true
    }

    fn dirty_sample(&self) -> Option<Duration> {
        self.cfg.converge.map(|_| self.cfg.sample)
    }

    fn early(&mut self, ran: Duration, p: &Pending) -> bool {
        if ran < self.min_run_now {
            return false;
        }
        if p.disk_bytes >= self.cfg.disk_limit {
            self.last_reason = Reason::Disk;
            return true;
        }
        if p.output_frames > 0 && p.unacked < self.cfg.max_unacked {
            self.last_reason = Reason::Output;
            return true;
        }
        if let (Some(limit), Some(now)) = (self.cfg.converge, p.dirty_pages) {
            let before = self.last_count.replace(now);
            if let Some(before) = before.filter(|&b| b > 0) {
                let growth = now.saturating_sub(before) as f64 / before as f64;
                if ran >= self.cfg.converge_min_run && growth < limit {
                    self.last_reason = Reason::Converged;
                    return true;
                }
            }
        }
        false
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

    fn pause(ms: u64) -> PauseTiming {
        PauseTiming {
            stop_us: (ms * 1000) as u32,
            ..Default::default()
        }
    }

    #[test]
    fn output_cuts_the_epoch_once_acked_and_after_the_guests_share() {
        let mut s = Adaptive::new(AdaptiveConfig::default());
        assert_eq!(s.next_interval(10, &pause(8)), Duration::from_millis(500));
        let out = Pending {
            output_frames: 3,
            ..Default::default()
        };
        // Not before the guest ran as long as the last pause.
        assert!(!s.early(Duration::from_millis(5), &out));
        assert!(s.early(Duration::from_millis(8), &out));
        assert_eq!(s.last_reason, Reason::Output);
        // Not while the previous checkpoint is unacknowledged.
        let unacked = Pending { unacked: 1, ..out };
        assert!(!s.early(Duration::from_millis(50), &unacked));
        // Nothing waiting: only the longest wait ends the epoch.
        assert!(!s.early(Duration::from_millis(400), &Pending::default()));
    }

    #[test]
    fn disk_writes_past_the_limit_cut_the_epoch_and_the_minimum_run_holds() {
        let mut s = Adaptive::new(AdaptiveConfig::default());
        s.next_interval(0, &pause(0));
        let disk = Pending {
            disk_bytes: 40 << 20,
            unacked: 5,
            ..Default::default()
        };
        assert!(!s.early(Duration::from_millis(1), &disk), "min_run 2 ms");
        assert!(s.early(Duration::from_millis(2), &disk));
        assert_eq!(s.last_reason, Reason::Disk);
        // A pause longer than max_wait cannot push the minimum run past it.
        s.next_interval(0, &pause(900));
        assert!(s.early(Duration::from_millis(500), &disk));
    }

    #[test]
    fn a_converged_dirty_set_cuts_the_epoch_after_the_minimum() {
        let cfg = AdaptiveConfig {
            converge: Some(0.05),
            ..AdaptiveConfig::default()
        };
        let mut s = Adaptive::new(cfg);
        assert_eq!(s.dirty_sample(), Some(Duration::from_millis(10)));
        s.next_interval(0, &pause(1));
        let at = |n| Pending {
            dirty_pages: Some(n),
            ..Default::default()
        };
        let ms = Duration::from_millis;
        assert!(!s.early(ms(10), &at(100)), "first sample");
        assert!(!s.early(ms(15), &Pending::default()), "no sample");
        assert!(!s.early(ms(20), &at(150)), "grew 50 %");
        assert!(!s.early(ms(30), &at(200)), "grew 33 %");
        assert!(s.early(ms(40), &at(205)), "grew 2.5 %");
        assert_eq!(s.last_reason, Reason::Converged);
        // Samples do not carry over into the next epoch, nor cut one shorter than the minimum.
        s.next_interval(205, &pause(1));
        assert!(!s.early(ms(10), &at(300)));
        assert!(!s.early(ms(15), &at(301)), "before converge_min_run");
        assert!(s.early(ms(25), &at(302)));
        // Off by default: no sampling.
        assert_eq!(
            Adaptive::new(AdaptiveConfig::default()).dirty_sample(),
            None
        );
    }

    #[test]
    fn fixed_never_polls() {
        let mut f = Fixed(Duration::from_millis(100));
        assert!(!f.polls());
        assert!(!f.early(
            Duration::from_secs(9),
            &Pending {
                output_frames: 9,
                ..Default::default()
            }
        ));
    }
}
