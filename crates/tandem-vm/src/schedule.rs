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
}

impl StartNow {
    /// `inner`, starting with a checkpoint.
    pub fn new(inner: Box<dyn Schedule>) -> Self {
        StartNow {
            inner,
            started: false,
        }
    }
}

impl Schedule for StartNow {
    fn next_interval(&mut self, last_dirty: usize, last_pause: &PauseTiming) -> Duration {
        let i = self.inner.next_interval(last_dirty, last_pause);
        if std::mem::replace(&mut self.started, true) {
            i
        } else {
            Duration::ZERO
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
}

/// The adaptive schedule's knobs (defaults from seed 002 where it gives them). In
/// configuration files durations are written as `"500ms"`, `"2s"`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct AdaptiveConfig {
    /// Longest epoch when nothing waits (the paper's WAIT_MAX_THRESHOLD, 2 s there; shorter
    /// here because the pause copies the whole dirty set: default 500 ms).
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// Shortest run between two pauses (default 2 ms).
    #[serde(with = "humantime_serde")]
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
    #[serde(with = "humantime_serde")]
    pub sample: Duration,
    /// Seed 002's vm_stop_threshold, as time: while output waits for the previous
    /// checkpoint's acknowledgement, suspend the guest once its dirty set is as large as the
    /// sink ships in this long ([`Pending::ship_pages_per_s`] × budget), so the held output's
    /// next checkpoint does not keep growing. `None`: off.
    #[serde(with = "humantime_serde")]
    pub stop_budget: Option<Duration>,
    /// How often the dirty count is sampled while the stop threshold may apply (default
    /// 2 ms).
    #[serde(with = "humantime_serde")]
    pub stop_sample: Duration,
    /// The stop threshold never falls below this many pages (default 256: below it the
    /// fixed cost of a pause dominates the shipping time).
    pub stop_floor: u64,
    /// Shortest epoch that convergence may end (default 20 ms): below it the fixed cost of a
    /// pause outweighs what an earlier checkpoint saves.
    #[serde(with = "humantime_serde")]
    pub converge_min_run: Duration,
    /// The guest-time budget: the largest share of the guest's time that pauses and early
    /// suspends may take, over the last `budget_window` (default 0.2). An early checkpoint or
    /// suspend waits until it fits; the disk limit and the longest wait do not. `None`: off
    /// (only `run_per_pause` bounds it).
    pub time_budget: Option<f64>,
    /// The window the budget is kept over (default 1 s): time the guest ran undisturbed
    /// within it pays for bursts of short epochs.
    #[serde(with = "humantime_serde")]
    pub budget_window: Duration,
    /// What a pause costs the budget (default: the guest's vCPU time).
    pub budget_clock: BudgetClock,
    /// Output waits for a busy guest: once output could cut the epoch, the cut waits while
    /// the guest's vCPU is busy (it is still answering what it received), for at most this
    /// long (default 3 ms). `None`: cut as soon as output may.
    #[serde(with = "humantime_serde")]
    pub busy_hold: Option<Duration>,
}

/// What the guest-time budget charges a pause or suspension by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BudgetClock {
    /// The vCPU time the guest loses: a pause costs its length × the share of the run before
    /// it that the guest's busiest vCPU was busy ([`Pending::busy`]), so pausing an idle guest
    /// costs it little and a busy one the whole pause. A guest that cannot tell is charged
    /// wall time.
    #[default]
    Vcpu,
    /// Wall time: every pause costs its whole length, however idle the guest was.
    Wall,
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
            stop_budget: Some(Duration::from_millis(20)),
            stop_sample: Duration::from_millis(2),
            stop_floor: 256,
            time_budget: Some(0.2),
            budget_window: Duration::from_secs(1),
            budget_clock: BudgetClock::Vcpu,
            busy_hold: Some(Duration::from_millis(3)),
        }
    }
}

impl AdaptiveConfig {
    /// The dirty-page count at which output waiting for an acknowledgement suspends the
    /// guest (seed 002's vm_stop_threshold), given the measured shipping rate; `None` while
    /// the rule is off or nothing was measured yet.
    pub fn stop_threshold(&self, ship_pages_per_s: Option<u64>) -> Option<u64> {
        let budget = self.stop_budget?;
        let rate = ship_pages_per_s?;
        Some(((rate as f64 * budget.as_secs_f64()) as u64).max(self.stop_floor))
    }
}

/// A vCPU that ran at least this share of the last poll is busy (for `busy_hold`).
const BUSY: f64 = 0.5;

/// Seed 002's scheduler: checkpoint as soon as network output waits for one (once the
/// previous checkpoint is acknowledged and the guest had its share of time), when the disk
/// writes reach the buffer limit, and otherwise after `max_wait`.
#[derive(Debug, Clone)]
pub struct Adaptive {
    cfg: AdaptiveConfig,
    /// The minimum run after the last pause.
    min_run_now: Duration,
    /// The dirty-count sample convergence compares against: when it was taken and the count.
    last_count: Option<(Duration, u64)>,
    /// Why the last epoch ended (for statistics): output, disk or time.
    pub last_reason: Reason,
    /// Whether this epoch suspended the guest early.
    pub suspended: bool,
    /// The guest-time budget's account of the last epochs.
    budget: Budget,
    /// The last pause, expected again at the next checkpoint.
    last_pause: Duration,
    /// How long the guest had run at the last call of `early`, and since when it is suspended.
    ran: Duration,
    suspended_at: Option<Duration>,
    /// The guest's busy share in this epoch's run: as of the last call of `early`, and as
    /// the run ended ([`Schedule::ran_busy`]).
    busy_now: Option<f64>,
    busy_run: Option<f64>,
    /// When, in this epoch's run, output could first have cut it (for `busy_hold`).
    output_allowed_at: Option<Duration>,
}

/// The guest-time budget as a token bucket: every second that passes earns `budget` seconds
/// of credit, every second paused or suspended spends one, and the credit never exceeds
/// `budget × window`. A long undisturbed run pays for a burst of short epochs; once the credit
/// is spent the guest runs `(1 − budget) / budget` times each pause (4× at 20 %), never longer.
#[derive(Debug, Clone, Copy)]
struct Budget {
    /// Seconds of pause the guest may still take; negative after a pause longer than it had.
    credit: f64,
}

impl Budget {
    fn full(budget: f64, window: Duration) -> Self {
        Budget {
            credit: budget * window.as_secs_f64(),
        }
    }

    /// An epoch ended: `total` passed, and its pause and suspension cost `lost` (by the
    /// budget's clock).
    fn push(&mut self, lost: Duration, total: Duration, budget: f64, window: Duration) {
        let earned = budget * total.as_secs_f64() - lost.as_secs_f64();
        self.credit = (self.credit + earned).min(budget * window.as_secs_f64());
    }

    /// The shortest run of the current epoch after which a pause of `pause` that costs
    /// `charge` leaves the credit at zero or more: credit + budget × (run + pause) − charge
    /// >= 0.
    fn min_run(&self, pause: Duration, charge: Duration, budget: f64) -> Duration {
        let b = budget.clamp(0.01, 1.0);
        let need = (charge.as_secs_f64() - b * pause.as_secs_f64() - self.credit) / b;
        Duration::from_secs_f64(need.max(0.0))
    }
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
            suspended: false,
            budget: Budget::full(cfg.time_budget.unwrap_or(1.0), cfg.budget_window),
            last_pause: Duration::ZERO,
            ran: Duration::ZERO,
            suspended_at: None,
            busy_now: None,
            busy_run: None,
            output_allowed_at: None,
        }
    }

    /// What `time` paused or suspended costs the budget, with the guest `busy` that share.
    fn charge(&self, time: Duration, busy: Option<f64>) -> Duration {
        match self.cfg.budget_clock {
            BudgetClock::Vcpu => crate::vcpu::lost(time, busy),
            BudgetClock::Wall => time,
        }
    }

    /// Seconds of pause the guest-time budget allows now without waiting (negative: owed).
    pub fn budget_credit(&self) -> f64 {
        self.budget.credit
    }

    /// Whether an optional cut (output, convergence, suspend) at `ran` fits the budget.
    fn within_budget(&self, ran: Duration) -> bool {
        let charge = self.charge(self.last_pause, self.busy_now);
        self.cfg
            .time_budget
            .is_none_or(|b| ran >= self.budget.min_run(self.last_pause, charge, b))
    }

    /// Whether output waits on a checkpoint that cannot start yet (the previous ones are
    /// not acknowledged): the state in which the stop threshold applies.
    fn output_blocked(&self, p: &Pending) -> bool {
        p.output_frames > 0 && p.unacked >= self.cfg.max_unacked
    }
}

impl Schedule for Adaptive {
    fn next_interval(&mut self, _: usize, last_pause: &PauseTiming) -> Duration {
        let pause = Duration::from_micros(last_pause.total_us().into());
        let suspended = self.suspended_at.map_or(Duration::ZERO, |at| self.ran - at);
        if let Some(b) = self.cfg.time_budget {
            self.budget.push(
                self.charge(pause + suspended, self.busy_run),
                self.ran + pause,
                b,
                self.cfg.budget_window,
            );
        }
        (self.busy_now, self.busy_run) = (None, None);
        self.last_pause = pause;
        self.ran = Duration::ZERO;
        self.suspended_at = None;
        let share = Duration::from_secs_f64(
            last_pause.total_us() as f64 / 1e6 * self.cfg.run_per_pause.max(0.0),
        );
        self.min_run_now = self.cfg.min_run.max(share).min(self.cfg.max_wait);
        self.last_reason = Reason::Time;
        self.last_count = None;
        self.suspended = false;
        self.output_allowed_at = None;
        self.cfg.max_wait
    }

    fn polls(&self) -> bool {
        true
    }

    fn dirty_sample(&self, p: &Pending) -> Option<Duration> {
        let stop = (self.cfg.stop_budget.is_some()
            && p.ship_pages_per_s.is_some()
            && self.output_blocked(p)
            && !self.suspended)
            .then_some(self.cfg.stop_sample);
        let converge = self.cfg.converge.map(|_| self.cfg.sample);
        match (stop, converge) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn ran_busy(&mut self, share: Option<f64>) {
        self.busy_run = share;
    }

    fn early(&mut self, ran: Duration, p: &Pending) -> Cut {
        self.ran = ran;
        if !self.suspended && p.busy.is_some() {
            self.busy_now = p.busy;
        }
        if ran < self.min_run_now {
            return Cut::Run;
        }
        if p.disk_bytes >= self.cfg.disk_limit {
            self.last_reason = Reason::Disk;
            return Cut::Checkpoint;
        }
        if !self.suspended && !self.within_budget(ran) {
            return Cut::Run;
        }
        if p.output_frames > 0 && p.unacked < self.cfg.max_unacked {
            if let Some(hold) = self.cfg.busy_hold {
                let allowed = *self.output_allowed_at.get_or_insert(ran);
                if p.busy_recent.is_some_and(|b| b >= BUSY) && ran < allowed + hold {
                    return Cut::Run;
                }
            }
            self.last_reason = Reason::Output;
            return Cut::Checkpoint;
        }
        if self.suspended {
            // Suspended: only the acknowledgement (above) or the longest wait ends it.
            return Cut::Suspend;
        }
        if let (Some(limit), Some(now)) = (self.cfg.converge, p.dirty_pages) {
            // Growth is judged over one convergence sample, even when the stop threshold
            // samples more often.
            match self.last_count {
                Some((at, _)) if ran.saturating_sub(at) < self.cfg.sample => {}
                before => {
                    self.last_count = Some((ran, now));
                    if let Some((_, before)) = before.filter(|&(_, b)| b > 0) {
                        let growth = now.saturating_sub(before) as f64 / before as f64;
                        if ran >= self.cfg.converge_min_run && growth < limit {
                            self.last_reason = Reason::Converged;
                            return Cut::Checkpoint;
                        }
                    }
                }
            }
        }
        if let (Some(limit), Some(now)) =
            (self.cfg.stop_threshold(p.ship_pages_per_s), p.dirty_pages)
        {
            if self.output_blocked(p) && now >= limit {
                self.suspended = true;
                self.suspended_at = Some(ran);
                return Cut::Suspend;
            }
        }
        Cut::Run
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

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Output waits on an unacknowledged checkpoint, the link ships 50 000 pages/s, and the
    /// guest has `dirty` pages written (if counted).
    fn blocked(dirty: Option<u64>) -> Pending {
        Pending {
            output_frames: 2,
            unacked: 1,
            dirty_pages: dirty,
            ship_pages_per_s: Some(50_000),
            ..Default::default()
        }
    }

    /// The defaults without the guest-time budget, to test the other rules alone.
    fn no_budget() -> AdaptiveConfig {
        AdaptiveConfig {
            time_budget: None,
            ..AdaptiveConfig::default()
        }
    }

    #[test]
    fn output_waits_until_the_pause_fits_the_guest_time_budget() {
        let mut s = Adaptive::new(AdaptiveConfig::default());
        let out = Pending {
            output_frames: 1,
            ..Default::default()
        };
        // A guest that ran undisturbed for a second pays for a burst of short epochs.
        s.next_interval(0, &pause(0));
        assert_eq!(s.early(ms(1000), &Pending::default()), Cut::Run);
        s.next_interval(0, &pause(4));
        assert_eq!(s.early(ms(4), &out), Cut::Checkpoint, "1 % lost so far");
        let mut cuts = 0;
        let mut lost = 0;
        let mut t = 0;
        // Output comes all the time: epochs of 4 ms pauses for three seconds.
        while t < 3000 {
            let mut ran = 4;
            while s.early(ms(ran), &out) == Cut::Run {
                ran += 1;
                assert!(
                    ran < 100,
                    "the budget never lets output cut: {:?}",
                    s.budget
                );
            }
            cuts += 1;
            t += ran + 4;
            lost += 4;
            s.next_interval(0, &pause(4));
        }
        // Over three seconds the guest lost the budget plus the second's saved credit, at most;
        // in steady state runs of 16 ms per 4 ms pause, never more.
        let share = lost as f64 / t as f64;
        assert!(
            share <= (0.2 * 3.0 + 0.2) / 3.0 + 0.01,
            "lost {share:.3} of the time"
        );
        assert!(share >= 0.19, "the budget is used, not wasted: {share:.3}");
        assert!(cuts > 100, "{cuts}");
        let mut ran = 0;
        while s.early(ms(ran), &out) == Cut::Run {
            ran += 1;
        }
        assert!((15..=17).contains(&ran), "steady run {ran} ms");
        // The disk limit does not wait for the budget.
        let disk = Pending {
            disk_bytes: 64 << 20,
            ..Default::default()
        };
        assert_eq!(s.early(ms(4), &disk), Cut::Checkpoint);
    }

    /// The run an output-bound guest settles at with 4 ms pauses, its vCPUs `busy` that
    /// share of each run, under `clock`.
    fn steady_run(clock: BudgetClock, busy: Option<f64>) -> u64 {
        let mut s = Adaptive::new(AdaptiveConfig {
            budget_clock: clock,
            ..AdaptiveConfig::default()
        });
        let out = Pending {
            output_frames: 1,
            busy,
            ..Default::default()
        };
        s.next_interval(0, &pause(4));
        let mut ran = 0;
        // Two seconds of epochs spend the saved credit; the last run is the steady one.
        for _ in 0..500 {
            ran = 0;
            while s.early(ms(ran), &out) == Cut::Run {
                ran += 1;
                assert!(ran < 100, "output never cuts: {:?}", s.budget);
            }
            s.ran_busy(busy);
            s.next_interval(0, &pause(4));
        }
        ran
    }

    #[test]
    fn the_budget_charges_pauses_by_how_busy_the_guest_was() {
        // Busy throughout, or unknown: each 4 ms pause costs 4 ms, so 16 ms runs at 20 %.
        assert!((15..=17).contains(&steady_run(BudgetClock::Vcpu, Some(1.0))));
        assert!((15..=17).contains(&steady_run(BudgetClock::Vcpu, None)));
        // A guest busy a quarter of the time loses 1 ms of vCPU time per pause: the budget
        // would allow 1 ms runs, and the guest's half of the time (run ≥ pause) holds.
        assert_eq!(steady_run(BudgetClock::Vcpu, Some(0.25)), 4);
        // Half busy: 2 ms per pause needs 6 ms of run at 20 %.
        assert!((5..=7).contains(&steady_run(BudgetClock::Vcpu, Some(0.5))));
        // The wall clock charges the whole pause, however idle the guest.
        assert!((15..=17).contains(&steady_run(BudgetClock::Wall, Some(0.25))));
    }

    #[test]
    fn suspended_time_counts_against_the_budget() {
        let w = Duration::from_secs(1);
        let mut b = Budget::full(0.2, w);
        assert!((b.credit - 0.2).abs() < 1e-9);
        // Credit never exceeds budget × window.
        b.push(ms(0), ms(800), 0.2, w);
        assert!((b.credit - 0.2).abs() < 1e-9);
        // 300 ms lost of 400: 0.2 + 0.08 - 0.3 = -0.02 s.
        b.push(ms(300), ms(400), 0.2, w);
        assert!((b.credit + 0.02).abs() < 1e-9, "{}", b.credit);
        // A 10 ms pause now needs (0.008 + 0.02) / 0.2 = 140 ms of run.
        let need = b.min_run(ms(10), ms(10), 0.2);
        assert!((need.as_secs_f64() - 0.14).abs() < 1e-6, "{need:?}");
        // The same pause of a guest busy a fifth of the time costs 2 ms: (0.002 - 0.002 +
        // 0.02) / 0.2 = 100 ms.
        let need = b.min_run(ms(10), ms(2), 0.2);
        assert!((need.as_secs_f64() - 0.1).abs() < 1e-6, "{need:?}");
        let mut s = Adaptive::new(AdaptiveConfig::default());
        s.next_interval(0, &pause(0));
        assert_eq!(s.early(ms(10), &blocked(Some(5000))), Cut::Suspend);
        assert_eq!(s.early(ms(600), &blocked(None)), Cut::Suspend);
        s.next_interval(0, &pause(0));
        // 600 ms passed (earning 120 ms), 590 ms suspended: 200 + 120 - 590 ms.
        let after = s.budget_credit();
        assert!((after + 0.27).abs() < 1e-3, "{after}");
        // Now output waits until the guest earned the next pause back.
        let out = Pending {
            output_frames: 1,
            ..Default::default()
        };
        assert_eq!(s.early(ms(1000), &out), Cut::Run);
        assert_eq!(s.early(ms(1360), &out), Cut::Checkpoint);
    }

    #[test]
    fn output_cuts_the_epoch_once_acked_and_after_the_guests_share() {
        let mut s = Adaptive::new(no_budget());
        assert_eq!(s.next_interval(10, &pause(8)), ms(500));
        let out = Pending {
            output_frames: 3,
            ..Default::default()
        };
        // Not before the guest ran as long as the last pause.
        assert_eq!(s.early(ms(5), &out), Cut::Run);
        assert_eq!(s.early(ms(8), &out), Cut::Checkpoint);
        assert_eq!(s.last_reason, Reason::Output);
        // Not while the previous checkpoint is unacknowledged.
        let unacked = Pending { unacked: 1, ..out };
        assert_eq!(s.early(ms(50), &unacked), Cut::Run);
        // Nothing waiting: only the longest wait ends the epoch.
        assert_eq!(s.early(ms(400), &Pending::default()), Cut::Run);
    }

    #[test]
    fn output_waits_for_a_busy_guest_up_to_the_hold() {
        let mut s = Adaptive::new(no_budget());
        s.next_interval(0, &pause(2));
        let busy = Pending {
            output_frames: 4,
            busy_recent: Some(0.9),
            ..Default::default()
        };
        // Output could cut at 2 ms; the guest is still busy: up to 3 ms more.
        assert_eq!(s.early(ms(2), &busy), Cut::Run);
        assert_eq!(s.early(ms(4), &busy), Cut::Run);
        assert_eq!(s.early(ms(5), &busy), Cut::Checkpoint);
        // A guest that went idle is cut at once, and so is one that cannot tell.
        for now in [Some(0.1), None] {
            s.next_interval(0, &pause(2));
            assert_eq!(s.early(ms(2), &busy), Cut::Run);
            let idle = Pending {
                busy_recent: now,
                ..busy
            };
            assert_eq!(s.early(ms(3), &idle), Cut::Checkpoint);
        }
        // Without a hold, output cuts while the guest is busy.
        let mut s = Adaptive::new(AdaptiveConfig {
            busy_hold: None,
            ..no_budget()
        });
        s.next_interval(0, &pause(2));
        assert_eq!(s.early(ms(2), &busy), Cut::Checkpoint);
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
        assert_eq!(s.early(ms(1), &disk), Cut::Run, "min_run 2 ms");
        assert_eq!(s.early(ms(2), &disk), Cut::Checkpoint);
        assert_eq!(s.last_reason, Reason::Disk);
        // A pause longer than max_wait cannot push the minimum run past it.
        s.next_interval(0, &pause(900));
        assert_eq!(s.early(ms(500), &disk), Cut::Checkpoint);
    }

    #[test]
    fn a_converged_dirty_set_cuts_the_epoch_after_the_minimum() {
        let cfg = AdaptiveConfig {
            converge: Some(0.05),
            stop_budget: None,
            ..no_budget()
        };
        let mut s = Adaptive::new(cfg);
        assert_eq!(s.dirty_sample(&Pending::default()), Some(ms(10)));
        s.next_interval(0, &pause(1));
        let at = |n| Pending {
            dirty_pages: Some(n),
            ..Default::default()
        };
        assert_eq!(s.early(ms(10), &at(100)), Cut::Run, "first sample");
        assert_eq!(s.early(ms(15), &Pending::default()), Cut::Run, "no sample");
        assert_eq!(s.early(ms(20), &at(150)), Cut::Run, "grew 50 %");
        assert_eq!(s.early(ms(30), &at(200)), Cut::Run, "grew 33 %");
        assert_eq!(
            s.early(ms(32), &at(201)),
            Cut::Run,
            "closer than one sample"
        );
        assert_eq!(s.early(ms(40), &at(205)), Cut::Checkpoint, "grew 2.5 %");
        assert_eq!(s.last_reason, Reason::Converged);
        // Samples do not carry over into the next epoch, nor cut one shorter than the minimum.
        s.next_interval(205, &pause(1));
        assert_eq!(s.early(ms(5), &at(300)), Cut::Run);
        assert_eq!(
            s.early(ms(10), &at(300)),
            Cut::Run,
            "closer than one sample"
        );
        assert_eq!(
            s.early(ms(15), &at(301)),
            Cut::Run,
            "before converge_min_run"
        );
        assert_eq!(
            s.early(ms(20), &at(301)),
            Cut::Run,
            "closer than one sample"
        );
        assert_eq!(s.early(ms(25), &at(302)), Cut::Checkpoint);
        // Off by default: no sampling without waiting output.
        let d = Adaptive::new(AdaptiveConfig::default());
        assert_eq!(d.dirty_sample(&Pending::default()), None);
    }

    #[test]
    fn the_stop_threshold_suspends_until_the_ack_then_checkpoints() {
        let cfg = no_budget();
        // 50 000 pages/s × 20 ms = 1 000 pages; never below the floor.
        assert_eq!(cfg.stop_threshold(Some(50_000)), Some(1000));
        assert_eq!(cfg.stop_threshold(Some(10)), Some(256));
        assert_eq!(cfg.stop_threshold(None), None);
        let mut s = Adaptive::new(cfg);
        s.next_interval(0, &pause(1));
        // Sampled only while output waits on an unacknowledged checkpoint.
        assert_eq!(s.dirty_sample(&blocked(None)), Some(ms(2)));
        let unblocked = Pending {
            unacked: 0,
            ..blocked(None)
        };
        assert_eq!(s.dirty_sample(&unblocked), None);
        assert_eq!(s.early(ms(3), &blocked(Some(999))), Cut::Run);
        assert_eq!(s.early(ms(4), &blocked(None)), Cut::Run);
        assert_eq!(s.early(ms(5), &blocked(Some(1000))), Cut::Suspend);
        assert!(s.suspended);
        // Suspended: no more sampling; stays so until the acknowledgement.
        assert_eq!(s.dirty_sample(&blocked(None)), None);
        assert_eq!(s.early(ms(9), &blocked(None)), Cut::Suspend);
        assert_eq!(s.early(ms(12), &unblocked), Cut::Checkpoint);
        assert_eq!(s.last_reason, Reason::Output);
        s.next_interval(1000, &pause(1));
        assert!(!s.suspended);
        // Without a measured rate, or with the rule off, nothing suspends.
        let no_rate = Pending {
            ship_pages_per_s: None,
            ..blocked(Some(1 << 20))
        };
        assert_eq!(s.early(ms(5), &no_rate), Cut::Run);
        let mut off = Adaptive::new(AdaptiveConfig {
            stop_budget: None,
            ..cfg
        });
        off.next_interval(0, &pause(1));
        assert_eq!(off.dirty_sample(&blocked(None)), None);
        assert_eq!(off.early(ms(5), &blocked(Some(1 << 20))), Cut::Run);
    }

    #[test]
    fn start_now_checkpoints_at_once_then_follows_its_schedule() {
        let mut s = StartNow::new(build(ms(100), Some(AdaptiveConfig::default())));
        assert_eq!(s.next_interval(0, &PauseTiming::default()), Duration::ZERO);
        assert!(s.polls());
        let max = AdaptiveConfig::default().max_wait;
        assert_eq!(s.next_interval(10, &pause(2)), max);
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
    }
}
