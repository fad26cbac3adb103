//! How much CPU the guest's vCPUs used: the run time of QEMU's vCPU threads, which the
//! adaptive schedule's guest-time budget charges pauses by (docs/SCHEDULING.md).
//!
//! A vCPU thread runs while its vCPU executes guest code (TCG or KVM) and sleeps while the
//! guest idles (`hlt`), so the share of wall time a thread ran is the share of its time that
//! vCPU wanted; the busiest vCPU's share is what a pause takes from the guest. QMP
//! `query-cpus-fast` names the threads; `/proc/PID/task/TID/schedstat` gives each one's run
//! time in nanoseconds (its first field, the scheduler's `sum_exec_runtime`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use crate::qmp::Qmp;

/// The vCPU threads of one QEMU.
#[derive(Debug)]
pub struct VcpuClock {
    /// `/proc/PID/task/TID/schedstat` of each distinct vCPU thread (one thread runs all
    /// vCPUs under single-threaded TCG), kept open: the epoch loop reads them every
    /// millisecond while output is held, one `pread` each.
    files: Vec<File>,
}

impl VcpuClock {
    /// The vCPU threads of QEMU `pid`, from `query-cpus-fast`. `None` when QEMU does not name
    /// them or the kernel does not account their run time (schedstat reads zero for threads
    /// that have run).
    pub fn new(qmp: &mut Qmp, pid: u32) -> Option<VcpuClock> {
        let cpus = qmp.execute("query-cpus-fast", None).ok()?;
        let mut tids: Vec<u64> = cpus
            .as_array()?
            .iter()
            .filter_map(|c| c.get("thread-id")?.as_u64())
            .collect();
        tids.sort_unstable();
        tids.dedup();
        let clock = VcpuClock {
            files: tids
                .iter()
                .map(|t| File::open(format!("/proc/{pid}/task/{t}/schedstat")))
                .collect::<Result<_, _>>()
                .ok()?,
        };
        // A guest that booted has run: a zero total means the kernel keeps no run times
        // (schedstat without CONFIG_SCHED_INFO), so the clock would say it never runs.
        (!clock.files.is_empty() && clock.total().is_some_and(|t| !t.is_zero())).then_some(clock)
    }

    /// Each vCPU thread's run time so far, into `out` (cleared first), in thread order.
    pub fn read(&self, out: &mut Vec<Duration>) -> Option<()> {
        out.clear();
        let mut buf = [0u8; 128];
        for f in &self.files {
            let n = f.read_at(&mut buf, 0).ok()?;
            let line = std::str::from_utf8(&buf[..n]).ok()?;
            out.push(Duration::from_nanos(parse_schedstat(line)?));
        }
        Some(())
    }

    /// The threads' run time so far, summed.
    fn total(&self) -> Option<Duration> {
        let mut v = Vec::new();
        self.read(&mut v)?;
        Some(v.iter().sum())
    }
}

/// The run time in nanoseconds from a `schedstat` line (`RUN_NS WAIT_NS SLICES`).
fn parse_schedstat(s: &str) -> Option<u64> {
    s.split_ascii_whitespace().next()?.parse().ok()
}

/// What `time` paused or suspended took from a guest whose busiest vCPU was busy `busy` of
/// the run before it: that share of it, or all of it when the share is unknown.
pub fn lost(time: Duration, busy: Option<f64>) -> Duration {
    busy.map_or(time, |b| time.mul_f64(b.clamp(0.0, 1.0)))
}

/// The share of `wall` that the busiest vCPU ran, between readings `before` and `after` of
/// [`VcpuClock::read`], clamped to 0..=1 (1.0 when nothing can be compared).
pub fn busy_share(before: &[Duration], after: &[Duration], wall: Duration) -> f64 {
    if wall.is_zero() || before.len() != after.len() || before.is_empty() {
        return 1.0;
    }
    let ran = before
        .iter()
        .zip(after)
        .map(|(b, a)| a.saturating_sub(*b))
        .max()
        .unwrap_or(wall);
    (ran.as_secs_f64() / wall.as_secs_f64()).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_lines_parse_and_shares_clamp() {
        assert_eq!(
            parse_schedstat("1076629521 115532 7\n"),
            Some(1_076_629_521)
        );
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("x 1 2"), None);
        let ms = Duration::from_millis;
        assert!((busy_share(&[ms(10)], &[ms(15)], ms(10)) - 0.5).abs() < 1e-9);
        assert_eq!(busy_share(&[ms(10)], &[ms(40)], ms(10)), 1.0);
        assert_eq!(busy_share(&[ms(10)], &[ms(5)], ms(10)), 0.0);
        assert_eq!(busy_share(&[ms(1)], &[ms(2)], Duration::ZERO), 1.0);
        // The busiest of two vCPUs counts: one idle, one busy 80 %.
        let share = busy_share(&[ms(10), ms(10)], &[ms(10), ms(18)], ms(10));
        assert!((share - 0.8).abs() < 1e-9, "{share}");
        assert_eq!(busy_share(&[ms(1)], &[ms(2), ms(3)], ms(10)), 1.0);
    }

    #[test]
    fn this_threads_run_time_is_read_again_from_the_open_file() {
        let Ok(f) = File::open("/proc/thread-self/schedstat") else {
            return; // no schedstat in this kernel: VcpuClock::new says None there
        };
        let clock = VcpuClock { files: vec![f] };
        let (mut before, mut after) = (Vec::new(), Vec::new());
        clock.read(&mut before).expect("a number");
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(30) {
            std::hint::black_box(t.elapsed());
        }
        clock.read(&mut after).expect("a number");
        assert!(after[0] > before[0], "{before:?} → {after:?}");
    }

    #[test]
    fn a_pause_takes_the_busy_share_of_its_length() {
        let ms = Duration::from_millis;
        assert_eq!(lost(ms(10), Some(0.5)), ms(5));
        assert_eq!(lost(ms(10), Some(1.5)), ms(10));
        assert_eq!(lost(ms(10), None), ms(10), "unknown is charged whole");
    }
}
