//! Seed 002's adaptive schedule with the guest-time budget and the busy hold
//! (docs/SCHEDULING.md, "The policy").

use std::time::Duration;

use super::{Cut, Pending, Reason, Schedule, Wait};
use crate::vm::PauseTiming;

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
    /// Why the last epoch ended ([`Schedule::reason`]).
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
    /// The last rule that held back this epoch's cut while output waited.
    waited: Option<Wait>,
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
            waited: None,
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
        self.waited = None;
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

    fn reason(&self) -> Reason {
        self.last_reason
    }

    fn waited(&self) -> Option<Wait> {
        self.waited
    }

    fn early(&mut self, ran: Duration, p: &Pending) -> Cut {
        let (cut, held) = self.decide(ran, p);
        if cut != Cut::Checkpoint && p.output_frames > 0 {
            // What held the output back this time (`decide` says which rule, else the
            // acknowledgement it waits for).
            self.waited = Some(held.unwrap_or(Wait::Ack));
        }
        cut
    }
}

impl Adaptive {
    /// [`Schedule::early`]'s rules, with the rule that held the guest's waiting output back
    /// when one did.
    fn decide(&mut self, ran: Duration, p: &Pending) -> (Cut, Option<Wait>) {
        self.ran = ran;
        if !self.suspended && p.busy.is_some() {
            self.busy_now = p.busy;
        }
        if ran < self.min_run_now {
            return (Cut::Run, Some(Wait::MinRun));
        }
        if p.disk_bytes >= self.cfg.disk_limit {
            self.last_reason = Reason::Disk;
            return (Cut::Checkpoint, None);
        }
        if !self.suspended && !self.within_budget(ran) {
            return (Cut::Run, Some(Wait::Budget));
        }
        if p.output_frames > 0 && p.unacked < self.cfg.max_unacked {
            if let Some(hold) = self.cfg.busy_hold {
                let allowed = *self.output_allowed_at.get_or_insert(ran);
                if p.busy_recent.is_some_and(|b| b >= BUSY) && ran < allowed + hold {
                    return (Cut::Run, Some(Wait::Busy));
                }
            }
            self.last_reason = Reason::Output;
            return (Cut::Checkpoint, None);
        }
        if self.suspended {
            // Suspended: only the acknowledgement (above) or the longest wait ends it.
            return (Cut::Suspend, None);
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
                            return (Cut::Checkpoint, None);
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
                return (Cut::Suspend, None);
            }
        }
        (Cut::Run, None)
    }
}

#[cfg(test)]
mod tests;
