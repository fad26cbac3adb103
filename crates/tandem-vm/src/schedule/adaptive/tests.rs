use super::*;
use crate::schedule::tests::{ms, pause};
use crate::schedule::{Cut, Pending, Schedule, Wait};
use std::time::Duration;

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
    assert_eq!(s.waited(), Some(Wait::Budget), "what paced it");
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
    assert_eq!(s.waited(), Some(Wait::Busy));
    assert_eq!(s.early(ms(5), &busy), Cut::Checkpoint);
    assert_eq!(s.waited(), Some(Wait::Busy), "the last rule that held it");
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
    assert_eq!(s.waited(), None, "cut at the first poll that could");
}

#[test]
fn says_which_rule_held_waiting_output_back() {
    let mut s = Adaptive::new(no_budget());
    s.next_interval(0, &pause(2));
    let out = Pending {
        output_frames: 1,
        ..Default::default()
    };
    assert_eq!(s.early(ms(1), &out), Cut::Run);
    assert_eq!(s.waited(), Some(Wait::MinRun));
    let unacked = Pending { unacked: 1, ..out };
    assert_eq!(s.early(ms(3), &unacked), Cut::Run);
    assert_eq!(s.waited(), Some(Wait::Ack));
    assert_eq!(s.early(ms(4), &out), Cut::Checkpoint);
    assert_eq!(s.waited(), Some(Wait::Ack), "the last rule that held it");
    s.next_interval(1, &pause(2));
    assert_eq!(s.waited(), None, "a new epoch");
    // Without output nothing is held back.
    assert_eq!(s.early(ms(1), &Pending::default()), Cut::Run);
    assert_eq!(s.waited(), None);
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
