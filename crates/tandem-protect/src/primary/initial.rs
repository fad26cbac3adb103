//! A session's initial sync, as live migration does it (issue 39): the guest runs throughout
//! but for one short pause that restarts the dirty log.
//!
//! ```text
//!  pause ─┐ restart the dirty log, seal the relays, take the disk log
//!         └─ guest runs ───────────────────────────────────────────────► first checkpoint
//!  round 0: copy all RAM (running) ─ hello ─ base frames ─ data disk     (pause: only the
//!  round 1: harvest the log (running) ─ pages written meanwhile ─ disk log   pages written
//!  round 2: ... until few pages remain, the rounds stop shrinking, or     in the last round)
//!           `max_rounds` is reached
//! ```
//!
//! A page copied while the guest writes it is written again after the harvest that re-armed
//! it, so a later round or the first checkpoint sends it again; the backup takes base frames
//! until that checkpoint commits, in order, so it ends with the right contents. The encoder's
//! reference is what the backup holds (`shadow`), built once the rounds are over.

use std::io::Write;
use std::time::{Duration, Instant};

use tandem_vm::{Vm, VmError, PAGE_SIZE};

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
    /// Rounds after the full copy at most (0: none; the first checkpoint carries everything
    /// written during the full copy).
    pub max_rounds: u32,
    /// Stop once a round found at most this many pages written (default 8 192, 32 MiB: the
    /// first checkpoint's pause copies them in a few tens of milliseconds).
    pub target_pages: u64,
}

impl Default for Precopy {
    fn default() -> Self {
        Precopy {
            max_rounds: 10,
            target_pages: 8192,
        }
    }
}

/// Whether pre-copy goes on after a round that found `now` pages written (`before`: the
/// round before it), as QEMU's migration decides: not once few remain, nor when the rounds
/// stop shrinking (the guest writes as fast as the link ships).
pub(super) fn go_on(p: &Precopy, round: u32, before: Option<u64>, now: u64) -> bool {
    if round >= p.max_rounds || now <= p.target_pages {
        return false;
    }
    match before {
        // Less than 10 % fewer pages than the round before: more rounds gain nothing.
        Some(b) => now * 10 < b * 9,
        None => true,
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
    /// here on is held until the session's first ack.
    pub(super) fn initial_copy(
        &mut self,
        vm: &mut Vm,
        w: &mut impl Write,
        shared: &Shared,
    ) -> Result<(), CopyError> {
        let (site, epoch) = (self.site, self.epoch);
        let started = Instant::now();
        vm.restart_dirty_log(&mut || {
            site.relays.seal(epoch);
            if let Some(d) = &site.disk {
                // From here on every write is in the log (rounds and epochs ship it).
                d.take_epoch_writes();
            }
        })?;
        self.watchdog.beat();
        // Round 0: all of RAM, copied while the guest runs into what the backup will hold.
        let mut shadow = vec![0u8; vm.ram().len()];
        for (pfn, page) in shadow.chunks_mut(PAGE_SIZE).enumerate() {
            vm.ram().copy_page(pfn as u64, page);
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
        self.rounds(vm, &mut shadow, w, shared)?;
        // Building the encoder's state (block hashes of all guest RAM) is proportional to
        // RAM: seconds for GiBs on a loaded host.
        let mib = ram_bytes >> 20;
        self.watchdog
            .allow(Duration::from_secs(10) + Duration::from_millis(10 * mib));
        self.proto
            .set_reference(&shadow)
            .map_err(|e| CopyError::Link(format!("the encoder: {e}")))?;
        self.watchdog.beat();
        Ok(())
    }

    /// Pre-copy rounds: what the guest wrote during the last round, sent while it runs.
    fn rounds(
        &mut self,
        vm: &mut Vm,
        shadow: &mut [u8],
        w: &mut impl Write,
        shared: &Shared,
    ) -> Result<(), CopyError> {
        let p = self.opts.precopy;
        let (mut before, mut round) = (None, 0);
        let mut pfns = Vec::new();
        while round < p.max_rounds {
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
                "pre-copy round {round}: {n} pages written during the last round ({} MiB), disk {} KiB, sent in {:.0} ms",
                bytes >> 20,
                disk >> 10,
                t.elapsed().as_secs_f64() * 1000.0
            ));
            if !go_on(&p, round, before, n) {
                break;
            }
            before = Some(n);
        }
        Ok(())
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
    fn rounds_stop_when_few_pages_remain_or_they_stop_shrinking() {
        let p = Precopy::default();
        assert!(go_on(&p, 1, None, 100_000));
        assert!(go_on(&p, 2, Some(100_000), 50_000));
        assert!(!go_on(&p, 3, Some(50_000), 46_000), "shrank by 8 %");
        assert!(!go_on(&p, 3, Some(50_000), 60_000), "grew");
        assert!(!go_on(&p, 3, Some(50_000), 8192), "at the target");
        assert!(!go_on(&p, 10, Some(500_000), 50_000), "max rounds");
        let none = Precopy { max_rounds: 0, ..p };
        assert!(!go_on(&none, 0, None, 1 << 20));
    }

    #[test]
    fn runs_are_contiguous_and_bounded() {
        assert_eq!(runs(&[], 4), vec![]);
        assert_eq!(runs(&[1, 2, 3, 7, 8, 10], 4), vec![(1, 3), (7, 2), (10, 1)]);
        assert_eq!(runs(&[0, 1, 2, 3, 4, 5], 4), vec![(0, 4), (4, 2)]);
    }
}
