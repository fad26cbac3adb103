//! A session's initial sync, as live migration does it (issue 39): the guest runs throughout
//! but for one short pause that restarts the dirty log.
//!
//! ```text
//!  pause ─┐ restart the dirty log, seal the relays, take the disk log
//!         └─ guest runs ───────────────────────────────────────────────► first checkpoint
//!  round 0: copy all RAM (running) ─ hello ─ base frames ─ data disk     (pause: only the
//!  round 1: harvest the log (running) ─ pages written meanwhile ─ disk log   pages written
//!  round 2: ... until few pages remain or `max_rounds` is reached         in the last round)
//! ```
//!
//! A guest that writes faster than the link ships never converges: as QEMU's auto-converge
//! does, a round that shrank by less than 10 % throttles the guest more (half of its time at
//! first, then half of what it has left, at most 99 %: [`Throttle`], QEMU stopped and
//! continued with SIGSTOP/SIGCONT every 10 ms), until the set converges; the throttle ends
//! once the encoder's reference is built, just before the first checkpoint. That build takes
//! seconds for GiBs, and what the guest writes meanwhile is the first checkpoint: a guest the
//! rounds left unthrottled is held (99 %) once it wrote the rounds' target again.
//!
//! A page copied while the guest writes it is written again after the harvest that re-armed
//! it, so a later round or the first checkpoint sends it again; the backup takes base frames
//! until that checkpoint commits, in order, so it ends with the right contents. The encoder's
//! reference is what the backup holds (`shadow`), built once the rounds are over.

use std::io::Write;
use std::time::{Duration, Instant};

use tandem_vm::{Guest, Vm, VmError, PAGE_SIZE};

use super::link::{self, Shared};
use super::session::Daemon;
use crate::progress::Progress;

/// Why the initial sync did not complete: the VM failed (fatal), or the link (re-sync).
pub(super) enum CopyError {
    Vm(VmError),
    Link(String),
}

impl From<VmError> for CopyError {
    fn from(e: VmError) -> Self {
        CopyError::Vm(e)
    }
}

impl From<std::io::Error> for CopyError {
    fn from(e: std::io::Error) -> Self {
        CopyError::Link(format!("writing to the backup: {e}"))
    }
}

/// The pre-copy rounds' knobs ([`super::PrimaryConfig::precopy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Precopy {
    /// Rounds after the full copy (default 20; 0: none, the first checkpoint carries
    /// everything written during the full copy). Past them pre-copy ends once at most
    /// [`FIRST_EPOCH_MAX_PAGES`] remain, and after four times as many in any case.
    pub max_rounds: u32,
    /// Stop once a round found at most this many pages written (default 8 192, 32 MiB: the
    /// first checkpoint's pause copies them in a few tens of milliseconds).
    pub target_pages: u64,
}

impl Default for Precopy {
    fn default() -> Self {
        Precopy {
            max_rounds: 20,
            target_pages: 8192,
        }
    }
}

/// What pre-copy does after a round that found `now` pages written (`before`: the round
/// before it), as QEMU's migration decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Next {
    /// Few pages remain, or the rounds are used up: the first checkpoint takes the rest.
    Stop,
    /// Another round.
    Round,
    /// Another round, with the guest throttled more: the rounds stopped shrinking (less
    /// than 10 % fewer pages than the round before: the guest writes as fast as the link
    /// ships).
    Throttle,
}

/// The most pages the first checkpoint may carry when the rounds are used up (256 MiB): more
/// would make its pause long and its record large, so the rounds go on, throttling more.
pub(super) const FIRST_EPOCH_MAX_PAGES: u64 = 65_536;

pub(super) fn next(p: &Precopy, round: u32, before: Option<u64>, now: u64) -> Next {
    if now <= p.target_pages {
        return Next::Stop;
    }
    if round >= p.max_rounds {
        // Past the rounds asked for, only a first checkpoint of bounded size ends pre-copy
        // (or four times the rounds: a guest that never converges is left to it).
        if now <= FIRST_EPOCH_MAX_PAGES || round >= p.max_rounds.saturating_mul(4) {
            return Next::Stop;
        }
        return Next::Throttle;
    }
    match before {
        Some(b) if now * 10 >= b * 9 => Next::Throttle,
        _ => Next::Round,
    }
}

/// How often the guest's written pages are counted while the encoder's reference is built.
const BUILD_SAMPLE: Duration = Duration::from_millis(20);

/// Throttles a guest during pre-copy: QEMU is stopped (SIGSTOP) for `share` % of every
/// 10 ms and continued (SIGCONT) for the rest, by a thread; dropping it continues QEMU.
pub(super) struct Throttle {
    share: std::sync::Arc<std::sync::atomic::AtomicU32>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Throttle {
    /// Starts unthrottled.
    pub(super) fn new(pid: u32) -> Throttle {
        use std::sync::atomic::Ordering;
        let share = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let s = share.clone();
        let thread = std::thread::spawn(move || {
            const PERIOD: u64 = 10_000;
            loop {
                let pct = s.load(Ordering::SeqCst);
                if pct > 100 {
                    return;
                }
                if pct == 0 {
                    std::thread::sleep(Duration::from_micros(PERIOD));
                    continue;
                }
                let stop = PERIOD * u64::from(pct) / 100;
                // SAFETY: kill(2) of the QEMU this daemon started; a SIGCONT always follows.
                unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
                std::thread::sleep(Duration::from_micros(stop));
                // SAFETY: as above.
                unsafe { libc::kill(pid as i32, libc::SIGCONT) };
                std::thread::sleep(Duration::from_micros(PERIOD - stop));
            }
        });
        Throttle {
            share,
            thread: Some(thread),
        }
    }

    /// Throttles more: half of the guest's time at first, then half of what it has left each
    /// time (50, 75, 88, 94, 97 %), at most 99 %, as QEMU's auto-converge ends. Returns the
    /// share.
    pub(super) fn more(&self) -> u32 {
        use std::sync::atomic::Ordering;
        let was = self.share.load(Ordering::SeqCst);
        let now = (100 - (100 - was) / 2).min(99);
        self.share.store(now, Ordering::SeqCst);
        now
    }

    /// A throttled guest is throttled the most (99 %) while the last step before the first
    /// checkpoint runs (building the encoder's reference takes seconds for GiBs): what it
    /// writes meanwhile is the first checkpoint. An unthrottled guest stays so until it
    /// wrote enough to be held ([`Throttle::hold`]).
    pub(super) fn most(&self) {
        if self.throttled() {
            self.hold();
        }
    }

    /// Throttles the guest the most (99 %) from now on.
    pub(super) fn hold(&self) {
        self.share.store(99, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the guest is throttled at all.
    pub(super) fn throttled(&self) -> bool {
        self.share.load(std::sync::atomic::Ordering::SeqCst) > 0
    }

    /// Ends the throttle without waiting for its thread: QEMU runs freely within one period
    /// (10 ms). Dropping it then joins the thread.
    pub(super) fn release(&self) {
        self.share
            .store(u32::MAX, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        self.share
            .store(u32::MAX, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Pages written in one round, as contiguous runs of at most `max` pages: (first, count).
pub(super) fn runs(pfns: &[u64], max: usize) -> Vec<(u64, usize)> {
    let mut out: Vec<(u64, usize)> = Vec::new();
    for &p in pfns {
        match out.last_mut() {
            Some((first, n)) if *first + *n as u64 == p && *n < max.max(1) => *n += 1,
            _ => out.push((p, 1)),
        }
    }
    out
}

impl Daemon<'_> {
    /// Hello, then the initial sync while the guest runs (module docs). Network output from
    /// here on is held until the session's first ack. Returns the guest's throttle, for the
    /// caller to release just before the first checkpoint: until then the guest's writes
    /// are that checkpoint.
    pub(super) fn initial_copy(
        &mut self,
        vm: &mut Vm,
        w: &mut impl Write,
        shared: &Shared,
    ) -> Result<Throttle, CopyError> {
        let (site, epoch) = (self.site, self.epoch);
        let started = Instant::now();
        // The hash dirty log (kernels without PAGEMAP_SCAN) hashes all of RAM in this pause:
        // about a second per 4 GiB on a loaded host, which is progress, not a hang.
        let mib = (vm.ram().len() >> 20) as u64;
        self.watchdog
            .allow(Duration::from_secs(3) + Duration::from_millis(mib / 2));
        vm.restart_dirty_log(&mut || {
            site.relays.seal(epoch);
            if let Some(d) = &site.disk {
                // From here on every write is in the log (rounds and epochs ship it).
                d.take_epoch_writes();
            }
        })?;
        self.watchdog.beat();
        // Round 0: all of RAM, copied while the guest runs into what the backup will hold.
        // Zero pages are not written: the picture takes memory only for what the guest uses.
        let mut shadow = vec![0u8; vm.ram().len()];
        let mut page = [0u8; PAGE_SIZE];
        for (pfn, dst) in shadow.chunks_mut(PAGE_SIZE).enumerate() {
            vm.ram().copy_page(pfn as u64, &mut page);
            // A slice compare is memcmp even in a debug build.
            if page[..] != [0u8; PAGE_SIZE][..] {
                dst.copy_from_slice(&page);
            }
            if pfn % 16384 == 0 {
                self.watchdog.beat();
            }
        }
        let disk_bytes = site.disk.as_ref().map_or(0, |d| d.size());
        let hello = self
            .proto
            .hello(self.epoch, shadow.len() as u64, disk_bytes);
        link::send(w, &hello)?;
        self.watchdog.beat();
        let mut sent = 0usize;
        let ram_bytes = shadow.len() as u64;
        let mut progress = Progress::new(
            "initial copy",
            ram_bytes + disk_bytes,
            &self.status,
            &self.registry,
        );
        for f in self.proto.base_frames(&shadow, 1024) {
            sent += f.payload.len() - 8;
            link::send(w, &f)?;
            self.watchdog.beat();
            if shared.is_lost() {
                return Err(CopyError::Link(shared.why()));
            }
            // A base frame is a run of non-zero pages: its first page, then the pages.
            let first = f.payload[..8].try_into().map_or(0, u64::from_le_bytes);
            progress.update(first * PAGE_SIZE as u64 + (f.payload.len() - 8) as u64);
        }
        progress.update(ram_bytes);
        if let Some(d) = &site.disk {
            self.copy_disk(d, w, shared, &mut |off| progress.update(ram_bytes + off))?;
        }
        drop(progress);
        self.status.info(format!(
            "initial copy sent at epoch {} in {:.1} s: {} of {} MiB non-zero, data disk {} MiB",
            self.epoch,
            started.elapsed().as_secs_f64(),
            sent >> 20,
            ram_bytes >> 20,
            disk_bytes >> 20
        ));
        // The throttle (if the rounds needed one) holds until the encoder is built: the
        // first checkpoint then carries what a throttled guest wrote.
        let throttle = self.rounds(vm, &mut shadow, w, shared)?;
        throttle.most();
        // Building the encoder's state (block hashes of all guest RAM) is proportional to
        // RAM: seconds for GiBs on a loaded host.
        self.watchdog
            .allow(Duration::from_secs(10) + Duration::from_millis(10 * mib));
        let t = Instant::now();
        let target = self.opts.precopy.target_pages;
        let (proto, status) = (&mut self.proto, &self.status);
        let built = std::thread::scope(|s| {
            let build = s.spawn(|| proto.set_reference(&shadow));
            // Meanwhile the guest runs and what it writes is the first checkpoint. A guest
            // the rounds left unthrottled (they converged) is held as a throttled one once
            // it wrote the rounds' target again, so that checkpoint stays that small.
            while !build.is_finished() {
                std::thread::sleep(BUILD_SAMPLE);
                if throttle.throttled() {
                    continue;
                }
                if let Some(n) = vm.dirty_count() {
                    if n >= target {
                        throttle.hold();
                        status.info(format!(
                            "pre-copy: guest held at 1 % of its time until the encoder is built ({n} pages written meanwhile)"
                        ));
                    }
                }
            }
            build.join()
        });
        built
            .map_err(|_| CopyError::Link("the encoder's build panicked".into()))?
            .map_err(|e| CopyError::Link(format!("the encoder: {e}")))?;
        self.watchdog.beat();
        self.status.info(format!(
            "pre-copy: the encoder's reference built in {:.1} s",
            t.elapsed().as_secs_f64()
        ));
        Ok(throttle)
    }

    /// Pre-copy rounds: what the guest wrote during the last round, sent while it runs.
    /// Returns the guest's throttle, for the caller to end.
    fn rounds(
        &mut self,
        vm: &mut Vm,
        shadow: &mut [u8],
        w: &mut impl Write,
        shared: &Shared,
    ) -> Result<Throttle, CopyError> {
        let p = self.opts.precopy;
        let (mut before, mut round) = (None, 0);
        let mut pfns = Vec::new();
        let throttle = Throttle::new(vm.pid());
        let mut throttled = 0;
        // Round after round until `next` says stop (it does by 4 × max_rounds).
        while p.max_rounds > round / 4 {
            round += 1;
            let t = Instant::now();
            pfns.clear();
            vm.harvest(&mut pfns)?;
            self.watchdog.beat();
            let (mut bytes, mut disk) = (0u64, 0u64);
            for (first, n) in runs(&pfns, 1024) {
                let o = first as usize * PAGE_SIZE;
                let run = &mut shadow[o..o + n * PAGE_SIZE];
                for (i, page) in run.chunks_mut(PAGE_SIZE).enumerate() {
                    vm.ram().copy_page(first + i as u64, page);
                }
                link::send(w, &self.proto.base_frame(first, run))?;
                bytes += run.len() as u64;
                self.watchdog.beat();
                if shared.is_lost() {
                    return Err(CopyError::Link(shared.why()));
                }
            }
            if let Some(d) = &self.site.disk {
                let wd = &self.watchdog;
                let writes = d
                    .try_take_epoch_writes_with(&mut || wd.beat())
                    .map_err(|e| CopyError::Link(format!("reading back the disk's writes: {e}")))?;
                for (off, data) in &writes {
                    // An all-zero write must reach the copy too: no `disk_base_frame` here.
                    link::send(w, &self.proto.disk_write_frame(*off, data))?;
                    disk += data.len() as u64;
                    self.watchdog.beat();
                }
            }
            let n = pfns.len() as u64;
            self.status.info(format!(
                "pre-copy round {round}: {n} pages written during the last round ({} MiB), disk {} KiB, sent in {:.0} ms{}",
                bytes >> 20,
                disk >> 10,
                t.elapsed().as_secs_f64() * 1000.0,
                if throttled > 0 {
                    format!(", guest throttled to {} % of its time", 100 - throttled)
                } else {
                    String::new()
                }
            ));
            if self.status.stop().leaving() {
                // A stop request (handover, shutdown) is served from the epoch loop, which
                // the first checkpoint starts: no more rounds.
                break;
            }
            match next(&p, round, before, n) {
                Next::Stop => break,
                Next::Round => {}
                Next::Throttle => throttled = throttle.more(),
            }
            before = Some(n);
        }
        Ok(throttle)
    }

    /// Streams the data disk while the guest runs. Reading after the boundary is safe: a
    /// chunk may already hold later writes, but every write since the boundary is in the log
    /// and is applied again, in order, after this base.
    fn copy_disk(
        &self,
        d: &tandem_disk::Image,
        w: &mut impl Write,
        shared: &Shared,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(), CopyError> {
        let mut buf = vec![0u8; 1 << 16];
        let mut off = 0u64;
        while off < d.size() {
            let n = (d.size() - off).min(buf.len() as u64) as usize;
            d.read_at(&mut buf[..n], off)
                .map_err(|e| CopyError::Link(format!("reading the data disk: {e}")))?;
            if let Some(f) = self.proto.disk_base_frame(off, &buf[..n]) {
                link::send(w, &f)?;
            }
            // Zero chunks send nothing, but reading them is progress too.
            self.watchdog.beat();
            if shared.is_lost() {
                return Err(CopyError::Link(shared.why()));
            }
            off += n as u64;
            progress(off);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_stop_when_few_pages_remain_and_throttle_when_they_stop_shrinking() {
        let p = Precopy::default();
        assert_eq!(next(&p, 1, None, 100_000), Next::Round);
        assert_eq!(next(&p, 2, Some(100_000), 50_000), Next::Round);
        assert_eq!(next(&p, 3, Some(50_000), 46_000), Next::Throttle, "8 %");
        assert_eq!(next(&p, 3, Some(50_000), 60_000), Next::Throttle, "grew");
        assert_eq!(next(&p, 3, Some(50_000), 8192), Next::Stop, "at the target");
        assert_eq!(
            next(&p, 20, Some(500_000), 50_000),
            Next::Stop,
            "max rounds"
        );
        assert_eq!(
            next(&p, 20, Some(100_000), 70_000),
            Next::Throttle,
            "max rounds, but too much left for the first checkpoint"
        );
        assert_eq!(next(&p, 80, Some(100_000), 70_000), Next::Stop, "4 x max");
        let none = Precopy { max_rounds: 0, ..p };
        assert_eq!(next(&none, 0, None, 1 << 20), Next::Stop);
    }

    #[test]
    fn the_throttle_stops_a_process_part_of_the_time_and_lets_it_go() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let stopped = |pid: u32| {
            let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            // The state follows the command's closing parenthesis.
            s.rsplit(')').next().unwrap().trim_start().starts_with('T')
        };
        let t = Throttle::new(child.id());
        assert_eq!(t.more(), 50);
        assert_eq!(t.more(), 75);
        for _ in 0..4 {
            t.more();
        }
        assert_eq!(t.more(), 99);
        let mut seen = 0;
        for _ in 0..200 {
            seen += u32::from(stopped(child.id()));
            std::thread::sleep(Duration::from_micros(500));
        }
        assert!(seen > 100, "stopped in {seen} of 200 samples at 99 %");
        drop(t);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!stopped(child.id()), "continued once the throttle ended");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn runs_are_contiguous_and_bounded() {
        assert_eq!(runs(&[], 4), vec![]);
        assert_eq!(runs(&[1, 2, 3, 7, 8, 10], 4), vec![(1, 3), (7, 2), (10, 1)]);
        assert_eq!(runs(&[0, 1, 2, 3, 4, 5], 4), vec![(0, 4), (4, 2)]);
    }
}
