//! The disk image behind the NBD server, and the log of each epoch's writes.
//!
//! The log is bounded. Writes are copied into it until their bytes reach the log limit
//! ([`Image::set_log_limit`], default [`DEFAULT_LOG_LIMIT`]); after that, further writes of the
//! epoch are logged as ranges only (merged, sorted by offset), and
//! [`Image::take_epoch_writes`] — called while the guest is stopped, so the file holds the
//! epoch's final bytes — reads their data back from the file. The ranges come after the copied
//! writes in the result, so replaying the result in order onto a copy of the image as it was at
//! the previous take reproduces the image. The ranges are bounded too: past
//! [`MAX_LOG_RANGES`] they are widened to a coarser granule (re-sending some unchanged bytes).

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// One write of an epoch: offset and bytes (TRIM is logged as zeros).
pub type Write = (u64, Vec<u8>);

/// Default bound of the bytes copied into an epoch's write log: 64 MiB.
pub const DEFAULT_LOG_LIMIT: u64 = 64 << 20;

/// At most this many disjoint ranges are kept for an epoch's overflowing writes.
pub const MAX_LOG_RANGES: usize = 1 << 16;

/// Range data read back by [`Image::take_epoch_writes`] comes in pieces of at most this size.
const RANGE_PIECE: u64 = 4 << 20;

/// Bookkeeping counted per copied write on top of its bytes.
const ENTRY_BYTES: u64 = std::mem::size_of::<Write>() as u64;

/// How much an epoch's write log holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogUsage {
    /// Writes copied into the log.
    pub writes: usize,
    /// Memory they take: their bytes plus a fixed bookkeeping cost per write. Stays within
    /// the log limit.
    pub bytes: u64,
    /// Disjoint ranges logged without data (at most [`MAX_LOG_RANGES`]).
    pub ranges: usize,
    /// Bytes those ranges cover (read back from the file at the take).
    pub range_bytes: u64,
}

#[derive(Default)]
struct Log {
    writes: Vec<Write>,
    bytes: u64,
    /// The copy limit was reached this epoch: every further write is a range.
    overflowed: bool,
    /// Disjoint, non-adjacent ranges: start -> end (exclusive).
    ranges: BTreeMap<u64, u64>,
    /// Ranges are aligned to this (1 = exact).
    granule: u64,
    max_ranges: usize,
}

impl Log {
    fn new() -> Self {
        Log {
            granule: 1,
            max_ranges: MAX_LOG_RANGES,
            ..Log::default()
        }
    }

    /// Adds `[start, end)` (aligned to the granule, within `size`) and merges.
    fn add_range(&mut self, start: u64, end: u64, size: u64) {
        if start >= end {
            return;
        }
        let g = self.granule.max(1);
        let mut s = start - start % g;
        let mut e = end
            .checked_next_multiple_of(g)
            .unwrap_or(u64::MAX)
            .min(size.max(end));
        if let Some((&ps, &pe)) = self.ranges.range(..=s).next_back() {
            if pe >= s {
                s = ps;
                e = e.max(pe);
                self.ranges.remove(&ps);
            }
        }
        while let Some((&ns, &ne)) = self.ranges.range(s..).next() {
            if ns > e {
                break;
            }
            e = e.max(ne);
            self.ranges.remove(&ns);
        }
        self.ranges.insert(s, e);
        while self.ranges.len() > self.max_ranges {
            self.coarsen(size);
        }
    }

    /// Widens every range to a 16 times coarser granule (at least 4 KiB) and merges.
    fn coarsen(&mut self, size: u64) {
        self.granule = if self.granule < 4096 {
            4096
        } else {
            self.granule.saturating_mul(16)
        };
        let old = std::mem::take(&mut self.ranges);
        let max = std::mem::replace(&mut self.max_ranges, usize::MAX);
        for (s, e) in old {
            self.add_range(s, e, size);
        }
        self.max_ranges = max;
    }

    /// Whether `[o, o + len)` lies inside one range.
    fn covered(&self, o: u64, len: u64) -> bool {
        self.ranges
            .range(..=o)
            .next_back()
            .is_some_and(|(_, &e)| o.saturating_add(len) <= e)
    }
}

/// A raw image file; writes land at once and are also logged for the current epoch.
pub struct Image {
    file: File,
    size: u64,
    log: Mutex<Log>,
    limit: AtomicU64,
    logging: std::sync::atomic::AtomicBool,
}

impl Image {
    /// Opens a raw image read-write.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let size = file.metadata()?.len();
        Ok(Image {
            file,
            size,
            log: Mutex::new(Log::new()),
            limit: AtomicU64::new(DEFAULT_LOG_LIMIT),
            logging: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// Opens a raw image read-write without a write log (a backup's disk after failover).
    pub fn open_unlogged(path: &Path) -> std::io::Result<Self> {
        Ok(Image {
            logging: std::sync::atomic::AtomicBool::new(false),
            ..Self::open(path)?
        })
    }

    /// Starts logging writes (a backup's disk whose guest now runs here and is protected in
    /// turn: the next initial copy reads the whole image after this, so nothing is missed).
    pub fn start_logging(&self) {
        self.reset_log();
        self.logging.store(true, Ordering::Release);
    }

    /// Export size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    /// Writes and logs.
    pub fn write_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        self.file.write_all_at(data, offset)?;
        if !self.logging.load(Ordering::Acquire) {
            return Ok(());
        }
        let len = data.len() as u64;
        let limit = self.limit.load(Ordering::Relaxed);
        let mut log = self.lock();
        let cost = len.saturating_add(ENTRY_BYTES);
        if !log.overflowed && log.bytes.saturating_add(cost) <= limit && len <= u32::MAX as u64 {
            log.bytes += cost;
            log.writes.push((offset, data.to_vec()));
        } else {
            log.overflowed = true;
            log.add_range(offset, offset.saturating_add(len), self.size);
        }
        Ok(())
    }

    /// Makes written data durable.
    pub fn flush(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    /// Bounds the bytes copied into an epoch's write log (from the next write on); writes past
    /// it are logged as ranges and read back from the file at the take.
    pub fn set_log_limit(&self, bytes: u64) {
        self.limit.store(bytes, Ordering::Relaxed);
    }

    /// The current log limit in bytes.
    pub fn log_limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// What the current epoch's log holds.
    pub fn log_usage(&self) -> LogUsage {
        let log = self.lock();
        LogUsage {
            writes: log.writes.len(),
            bytes: log.bytes,
            ranges: log.ranges.len(),
            range_bytes: log.ranges.iter().map(|(s, e)| e - s).sum(),
        }
    }

    /// Drops the current epoch's log without reading anything (a primary that lost its backup
    /// and will send the whole disk again).
    pub fn reset_log(&self) {
        *self.lock() = Log::new();
    }

    /// Takes the writes logged since the previous call: the epoch's disk writes. Call it while
    /// the guest is stopped, so the boundary matches the memory checkpoint and the file holds
    /// the epoch's final bytes. Replaying the result in order onto a copy of the image as it
    /// was at the previous take reproduces the image.
    ///
    /// If reading a range back from the file fails, the error is logged and that range is
    /// missing from the result; use [`Image::try_take_epoch_writes`] where that must stop
    /// replication (the backup's copy then needs a full re-sync).
    pub fn take_epoch_writes(&self) -> Vec<Write> {
        let log = std::mem::replace(&mut *self.lock(), Log::new());
        let mut out = Vec::new();
        if let Err(e) = self.collect(log, &mut out, &mut || {}) {
            tracing::error!("disk log: reading back an epoch's writes from the image: {e}");
        }
        out
    }

    /// [`Image::take_epoch_writes`], failing if a range cannot be read back from the file. The
    /// epoch's log is gone either way: after an error, re-sync the whole disk.
    pub fn try_take_epoch_writes(&self) -> std::io::Result<Vec<Write>> {
        self.try_take_epoch_writes_with(&mut || {})
    }

    /// [`Image::try_take_epoch_writes`], calling `piece` after each piece (4 MiB) read back
    /// from the file: a caller inside the guest's pause tells its watchdog it makes progress.
    pub fn try_take_epoch_writes_with(
        &self,
        piece: &mut dyn FnMut(),
    ) -> std::io::Result<Vec<Write>> {
        let log = std::mem::replace(&mut *self.lock(), Log::new());
        let mut out = Vec::new();
        self.collect(log, &mut out, piece)?;
        Ok(out)
    }

    /// The copied writes (minus those a range covers whole), then the ranges' data read back.
    fn collect(
        &self,
        mut log: Log,
        out: &mut Vec<Write>,
        piece: &mut dyn FnMut(),
    ) -> std::io::Result<()> {
        *out = std::mem::take(&mut log.writes);
        if log.ranges.is_empty() {
            return Ok(());
        }
        out.retain(|(o, d)| !log.covered(*o, d.len() as u64));
        for (&s, &e) in &log.ranges {
            let e = e.min(self.size);
            let mut o = s;
            while o < e {
                let n = (e - o).min(RANGE_PIECE);
                let mut buf = vec![0u8; n as usize];
                self.file.read_exact_at(&mut buf, o)?;
                out.push((o, buf));
                o += n;
                piece();
            }
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Serialises an epoch's writes: count u32, then per write offset u64, length u32, bytes.
pub fn encode_writes(writes: &[Write]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + writes.iter().map(|w| 12 + w.1.len()).sum::<usize>());
    out.extend_from_slice(&(writes.len() as u32).to_le_bytes());
    for (o, d) in writes {
        out.extend_from_slice(&o.to_le_bytes());
        out.extend_from_slice(&(d.len() as u32).to_le_bytes());
        out.extend_from_slice(d);
    }
    out
}

/// Parses an epoch's writes, checking every write lies inside a disk of `size` bytes.
pub fn decode_writes(b: &[u8], size: u64) -> Option<Vec<(u64, &[u8])>> {
    let n = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
    let mut out = Vec::with_capacity(n.min(1 << 16));
    let mut pos = 4;
    for _ in 0..n {
        let o = u64::from_le_bytes(b.get(pos..pos + 8)?.try_into().ok()?);
        let l = u32::from_le_bytes(b.get(pos + 8..pos + 12)?.try_into().ok()?) as usize;
        let d = b.get(pos + 12..pos + 12 + l)?;
        if o.checked_add(l as u64)? > size {
            return None;
        }
        out.push((o, d));
        pos += 12 + l;
    }
    (pos == b.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: deterministic random numbers without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    fn image(size: usize, rng: &mut Rng) -> (tempfile::TempDir, Image, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        let init: Vec<u8> = (0..size).map(|_| rng.next() as u8).collect();
        std::fs::write(&path, &init).unwrap();
        (dir, Image::open(&path).unwrap(), init)
    }

    fn contents(img: &Image) -> Vec<u8> {
        let mut b = vec![0u8; img.size() as usize];
        img.read_at(&mut b, 0).unwrap();
        b
    }

    fn replay(copy: &mut [u8], writes: &[Write]) {
        for (o, d) in writes {
            copy[*o as usize..*o as usize + d.len()].copy_from_slice(d);
        }
    }

    #[test]
    fn writes_beyond_the_log_limit_replay_to_the_same_image() {
        let mut overflowed_epochs = 0;
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let size = 256 << 10;
            let (_d, img, mut copy) = image(size, &mut rng);
            let limit = [0, 1000, 16 << 10, 64 << 10][seed as usize % 4];
            img.set_log_limit(limit);
            assert_eq!(img.log_limit(), limit);
            for _epoch in 0..5 {
                let mut max_write = 0;
                for _ in 0..rng.below(60) {
                    let big = rng.below(8) == 0;
                    let len = 1 + rng.below(if big { 40_000 } else { 3000 });
                    let off = rng.below(size as u64 - len + 1);
                    let data: Vec<u8> = if rng.below(5) == 0 {
                        vec![0; len as usize] // a TRIM
                    } else {
                        (0..len).map(|_| rng.next() as u8).collect()
                    };
                    img.write_at(&data, off).unwrap();
                    max_write = max_write.max(len + ENTRY_BYTES);
                    let u = img.log_usage();
                    assert!(u.bytes <= limit, "{u:?} over the limit {limit}");
                    assert!(u.bytes <= limit + max_write);
                    assert!(u.ranges <= MAX_LOG_RANGES);
                }
                if img.log_usage().ranges > 0 {
                    overflowed_epochs += 1;
                }
                let writes = img.try_take_epoch_writes().unwrap();
                assert_eq!(img.log_usage(), LogUsage::default(), "the log is per epoch");
                replay(&mut copy, &writes);
                assert!(copy == contents(&img), "seed {seed}: replay differs");
            }
        }
        assert!(overflowed_epochs > 20, "{overflowed_epochs}");
    }

    #[test]
    fn ranges_are_merged_and_coarsened_within_their_bound() {
        let mut rng = Rng(7);
        let (_d, img, mut copy) = image(1 << 20, &mut rng);
        img.set_log_limit(0);
        img.lock().max_ranges = 8;
        // Overlapping and adjacent writes merge into one range.
        img.write_at(&[1; 100], 1000).unwrap();
        img.write_at(&[2; 100], 1100).unwrap();
        img.write_at(&[3; 50], 1050).unwrap();
        let u = img.log_usage();
        assert_eq!((u.writes, u.bytes, u.ranges, u.range_bytes), (0, 0, 1, 200));
        // 100 disjoint writes: coarsened to at most 8 ranges.
        for i in 0..100u64 {
            img.write_at(&[i as u8; 10], 4000 + i * 9000).unwrap();
        }
        let u = img.log_usage();
        assert!(u.ranges <= 8, "{u:?}");
        let mut pieces = 0;
        let writes = img.try_take_epoch_writes_with(&mut || pieces += 1).unwrap();
        assert!(writes.iter().all(|w| w.1.len() as u64 <= RANGE_PIECE));
        assert_eq!(pieces, writes.len(), "one call per piece read back");
        replay(&mut copy, &writes);
        assert!(copy == contents(&img));
    }

    #[test]
    fn copied_writes_a_range_covers_are_not_sent_twice() {
        let mut rng = Rng(11);
        let (_d, img, mut copy) = image(64 << 10, &mut rng);
        img.set_log_limit(200 + 2 * ENTRY_BYTES);
        img.write_at(&[1; 100], 0).unwrap();
        img.write_at(&[2; 100], 10_000).unwrap();
        // Over the limit: a range covering the first write whole and the second one in part.
        img.write_at(&[3; 300], 0).unwrap();
        img.write_at(&[4; 10], 10_050).unwrap();
        let writes = img.take_epoch_writes();
        let shape: Vec<(u64, usize)> = writes.iter().map(|w| (w.0, w.1.len())).collect();
        assert_eq!(shape, [(10_000, 100), (0, 300), (10_050, 10)]);
        replay(&mut copy, &writes);
        assert!(copy == contents(&img));
    }

    #[test]
    fn unlogged_image_starts_logging_on_request() {
        let mut rng = Rng(5);
        let (d, img, _) = image(64 << 10, &mut rng);
        drop(img);
        let img = Image::open_unlogged(&d.path().join("disk.img")).unwrap();
        img.write_at(&[7; 10], 0).unwrap();
        assert!(img.take_epoch_writes().is_empty());
        img.start_logging();
        img.write_at(&[8; 10], 4096).unwrap();
        assert_eq!(img.take_epoch_writes(), vec![(4096, vec![8; 10])]);
        let mut b = [0u8; 10];
        img.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [7; 10]);
    }

    #[test]
    fn reset_log_drops_copies_and_ranges() {
        let mut rng = Rng(3);
        let (_d, img, _) = image(64 << 10, &mut rng);
        img.set_log_limit(100);
        img.write_at(&[1; 50], 0).unwrap();
        img.write_at(&[1; 500], 100).unwrap();
        assert_ne!(img.log_usage(), LogUsage::default());
        img.reset_log();
        assert_eq!(img.log_usage(), LogUsage::default());
        assert!(img.take_epoch_writes().is_empty());
        // Logging goes on after the reset, copying again up to the limit.
        img.write_at(&[9; 10], 0).unwrap();
        assert_eq!(img.take_epoch_writes(), vec![(0, vec![9; 10])]);
    }

    #[test]
    fn unlogged_image_logs_nothing() {
        let mut rng = Rng(5);
        let (d, _img, _) = image(4096, &mut rng);
        let img = Image::open_unlogged(&d.path().join("disk.img")).unwrap();
        img.write_at(&[1; 10], 0).unwrap();
        assert_eq!(img.log_usage(), LogUsage::default());
        assert!(img.take_epoch_writes().is_empty());
    }
}
