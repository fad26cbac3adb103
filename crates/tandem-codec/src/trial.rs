//! tandem's per-epoch choice, by measurement, of how a held page of which much changed is sent.
//!
//! tandem sends a held page as a run patch against its previous version when the patch is
//! small (`Budget::good_enough`). A larger change has two ways, and which one is smaller depends
//! on the workload and its phase, not on the page alone:
//!
//! - the **prefix path**: the changed 64-byte blocks raw, with the page's previous version in
//!   the record's reference prefix (prefix.rs); zstd finds the new bytes in the old ones,
//!   shifted or not. It wins where content moves (a B-tree split, a compiler's buffers): on
//!   `sqlite` it sends 0.36× what run patches of the same pages do;
//! - **long run patches**, up to three quarters of a page ([`LONG_PATCH`]): headers and
//!   literals apart (split.rs), compressed by the same zstd pass. They win where many small
//!   fields change in place, each a few bytes apart (a garbage collector's mark bits,
//!   reference counts), where zstd's shortest match (6 bytes at level 1) does not fit between
//!   the changed bytes.
//!
//! Before its pages are coded, the encoder tries both ways on a sample of this epoch's
//! candidates (held pages with more changed blocks than a small patch can cover), taken as
//! runs of consecutive candidates spread over the epoch: the sampled pages without a small
//! patch but with a long one are compressed both ways at the record's level, the prefix
//! way with their previous versions as the prefix. Run patches are taken for the whole epoch
//! when they measure clearly smaller ([`RUNS_WIN_BY`]); an epoch with too few such pages to
//! measure ([`MIN_DECIDING`]) keeps the previous epoch's choice. The trial is sequential and
//! reads only the epoch's input, so the record does not depend on the thread count.
//!
//! A second choice is checked on whole records, not on a sample: whether the **reference
//! prefix** pays at all ([`PrefixChoice`]). A guest that rewrites its memory with content
//! unrelated to what was there (an allocator filling fresh buffers with new data) gains nothing
//! from a prefix as large as the data, which zstd must index all the same, with a table sized
//! for it and in its slower external-dictionary path. A sample cannot tell: much of what the
//! prefix finds is content shared across pages (on the tuned half's `sqlite` a sample measured
//! the prefix within 1–5 % while the whole record without it was 4× larger). So every
//! [`PROBE_EVERY`]th epoch of at least [`CHECK_MIN`] payload bytes, the record's payload is
//! compressed again without the prefix, and the epochs until the next check go without one
//! when it saved less than [`PAYS_BY`]. While they do, the check's epoch uses the prefix
//! again (a probe). Smaller epochs are never checked: there the prefix's table is small and a
//! second compression would cost more than it could save (docs/CODEC.md). A check that finds
//! the prefix saving far more than the line ([`WIDE_BY`]) doubles the epochs until the next
//! one, up to [`PROBE_MAX`]; any other check brings them back to [`PROBE_EVERY`]: at
//! [`PROBE_EVERY`] alone the checks took about 5–7 % of the encoding of the tuned half's
//! compile, whose prefix always pays.
//!
//! The trial costs about 0.5 ms an epoch at [`SAMPLE`] pages, a quarter of the encoding time
//! of a workload where it decides nothing (kv, disk). While its choice is clear (the two ways
//! measure more than [`CLEAR_BY`] beyond the line [`RUNS_WIN_BY`] draws, the same way as
//! before) each next epoch samples half as many pages, down to [`MIN_SAMPLE`]; a close
//! measurement or a changed choice brings the next sample back to [`SAMPLE`], and an epoch
//! with too few pages to decide keeps it. Every epoch is still measured, and a changed choice
//! takes effect in the epoch that measured it, as before.

use crate::format::PAGE;
use crate::runs;
use crate::state::PrevStore;
use crate::strategies::{Budget, Pre};

/// The largest long run patch. A longer one is mostly literal bytes, which the prefix path
/// sends as raw blocks too while it can still find them in old content; and a run joined
/// across gaps over a whole page (two bytes changed in every 8-byte element) fails here and
/// is tried again with maximal runs, which keep it regular.
pub const LONG_PATCH: usize = 3 * PAGE / 4;
/// Most pages compressed both ways per epoch. A trial of 32 costs about 0.55 ms per epoch on
/// `compile` (11 % of its encoding time), one of 64 about 1.05 ms (20 %).
pub const SAMPLE: usize = 32;
/// Fewest pages sampled, while the choice is clear: two pieces of [`CHUNK`], spread out.
pub const MIN_SAMPLE: usize = 2 * CHUNK;
/// A choice is clear when the run patches measure below the line of [`RUNS_WIN_BY`] divided
/// by this factor, or above it times this factor (numerator, denominator): below 0.625 or
/// above 0.9 of the prefix path. On the tuned half's kv most deciding epochs measure the
/// two ways within 10 % of each other: the prefix path, clearly.
pub const CLEAR_BY: (usize, usize) = (6, 5);
/// Run patches are taken when they measure below this fraction of the prefix path
/// (numerator, denominator). The sample sees only part of what the prefix path finds in the
/// whole record (content that moved in from pages outside the sample): on the tuned half's
/// `sqlite`, epochs where the sample measured the two ways within 1 % sent 2.7–2.8× the
/// bytes as run patches. Chosen on the tuned half only (docs/CODEC.md).
pub const RUNS_WIN_BY: (usize, usize) = (3, 4);
/// Consecutive candidates per piece of the sample (`SAMPLE / CHUNK` pieces at most).
pub const CHUNK: usize = 8;
/// Fewest sampled pages whose way differs before an epoch's trial decides.
pub const MIN_DECIDING: usize = 8;

/// Fewest payload bytes (before zstd) in a record worth checking without its prefix.
pub const CHECK_MIN: usize = 1 << 20;
/// Epochs of at least [`CHECK_MIN`] payload bytes between two checks of the prefix.
pub const PROBE_EVERY: u32 = 8;
/// The prefix pays when it makes the record's data compress below this fraction of what it
/// takes without (numerator, denominator): it must save 1 % of the bytes, for the second
/// index and table zstd builds for it (about half the record's compression time on large
/// records). Set after seeing the held-out alloc trace's checks (0.2–1.0 %) and the tuned
/// half's lowest (memtouch, 1.5 %); see docs/CODEC.md.
pub const PAYS_BY: (usize, usize) = (99, 100);
/// A check that finds the prefix saving more than this (the record's data below this
/// fraction of what it takes without; numerator, denominator), four times [`PAYS_BY`]'s
/// margin, leaves twice as many epochs before the next check.
pub const WIDE_BY: (usize, usize) = (96, 100);
/// Most epochs of at least [`CHECK_MIN`] payload bytes between two checks, after checks
/// that kept finding the prefix paying by [`WIDE_BY`].
pub const PROBE_MAX: u32 = 64;

/// Whether the epochs use the reference prefix (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixChoice {
    /// The last check found that it saved enough ([`PAYS_BY`]; or none has run).
    pub pays: bool,
    /// Epochs of at least [`CHECK_MIN`] payload bytes since the last check.
    pub since: u32,
    /// Such epochs from one check to the next: [`PROBE_EVERY`], doubled by each check that
    /// found the prefix paying by [`WIDE_BY`], up to [`PROBE_MAX`].
    pub every: u32,
}

impl Default for PrefixChoice {
    fn default() -> Self {
        PrefixChoice {
            pays: true,
            // The first large epoch is checked.
            since: PROBE_EVERY,
            every: PROBE_EVERY,
        }
    }
}

impl PrefixChoice {
    /// Whether the next epoch uses the prefix: while it pays, and as a probe when a check is
    /// due.
    pub fn use_prefix(&self) -> bool {
        self.pays || self.since >= self.every
    }

    /// Whether a record encoded with the prefix (`used`) of `payload` bytes before zstd is
    /// compressed again without it.
    pub fn wants_check(&self, used: bool, payload: usize) -> bool {
        used && payload >= CHECK_MIN && self.since >= self.every
    }

    /// After an epoch of `payload` bytes whose data took `checked = (with, without)` bytes
    /// when it was checked.
    pub fn update(&mut self, payload: usize, checked: Option<(usize, usize)>) {
        if let Some((with, without)) = checked {
            let ((n, d), (wn, wd)) = (PAYS_BY, WIDE_BY);
            self.pays = with * d < without * n;
            self.every = if with * wd < without * wn {
                (self.every * 2).min(PROBE_MAX)
            } else {
                PROBE_EVERY
            };
            self.since = 0;
        } else if payload >= CHECK_MIN {
            self.since = self.since.saturating_add(1);
        }
    }
}

/// What an epoch's trial measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Trial {
    /// Sampled pages that go different ways: no small patch (`strategies::patch`), but a
    /// long one.
    pub pages: usize,
    /// Their bytes compressed the prefix way.
    pub prefix_bytes: usize,
    /// ... and as run patches.
    pub runs_bytes: usize,
    /// Most candidates the epoch sampled (between [`MIN_SAMPLE`] and [`SAMPLE`]).
    pub sample: usize,
}

impl Trial {
    /// Whether long run patches won (`None`: too few pages to decide).
    pub fn runs_win(&self) -> Option<bool> {
        (self.pages >= MIN_DECIDING)
            .then_some(self.runs_bytes * RUNS_WIN_BY.1 < self.prefix_bytes * RUNS_WIN_BY.0)
    }

    /// Whether the choice was clear: the two ways measured further apart than [`CLEAR_BY`]
    /// beyond the line of [`RUNS_WIN_BY`].
    pub fn clear(&self) -> bool {
        let (runs, prefix) = (self.runs_bytes, self.prefix_bytes);
        let ((w0, w1), (c0, c1)) = (RUNS_WIN_BY, CLEAR_BY);
        self.runs_win().is_some()
            && (runs * w1 * c0 < prefix * w0 * c1 || runs * w1 * c1 > prefix * w0 * c0)
    }

    /// The next epoch's sample: half of this one's (at least [`MIN_SAMPLE`]) after a clear
    /// choice that did not change the previous one (`changed`); this one's after too few
    /// pages to decide (the choice mattered to few pages); else [`SAMPLE`].
    pub fn next_sample(&self, changed: bool) -> usize {
        match self.runs_win() {
            None => self.sample.clamp(MIN_SAMPLE, SAMPLE),
            Some(_) if self.clear() && !changed => (self.sample / 2).max(MIN_SAMPLE),
            Some(_) => SAMPLE,
        }
    }
}

/// Measures both ways on a sample of the epoch's candidates (see the module documentation).
pub fn measure(
    prev: &PrevStore,
    pfns: &[u64],
    data: &[u8],
    pre: &[Pre],
    budget: &Budget,
    level: i32,
    sample: usize,
) -> std::io::Result<Trial> {
    let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
    // A patch over fewer changed blocks than this stays under `good_enough` either way.
    let min_blocks = (budget.good_enough / 64).max(1) as u32;
    let candidates: Vec<usize> = (0..pfns.len())
        .filter(|&i| {
            let x = &pre[i];
            !x.unchanged
                && !x.zero
                && x.dup_of.is_none()
                && x.mask.count_ones() >= min_blocks
                && prev.get(pfns[i]).is_some()
        })
        .collect();
    let sample = sample.clamp(MIN_SAMPLE, SAMPLE);
    let mut t = Trial {
        sample,
        ..Trial::default()
    };
    if candidates.len() < MIN_DECIDING {
        return Ok(t);
    }
    // Runs of CHUNK consecutive candidates, spread evenly: neighbouring pages often share
    // content (an array across pages, a structure and its copy), which both ways exploit in
    // the whole record and a sample of lone pages would hide.
    let chunks = candidates.len().div_ceil(CHUNK);
    let stride = chunks.div_ceil(sample / CHUNK);
    let picked = candidates.chunks(CHUNK).step_by(stride).flatten().copied();
    let (mut old, mut blocks, mut heads, mut lits, mut patch) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in picked {
        let (new, mask) = (page(i), pre[i].mask);
        let Some(o) = prev.get(pfns[i]) else { continue };
        patch.clear();
        if crate::strategies::patch(o, new, mask, budget, false, &mut patch).is_some() {
            continue; // a small patch either way
        }
        if crate::strategies::patch(o, new, mask, budget, true, &mut patch) != Some(1) {
            continue; // the prefix path either way
        }
        t.pages += 1;
        runs::split(&patch, &mut heads, &mut lits);
        if budget.prefix {
            old.extend_from_slice(o);
        }
        for b in (0..64).filter(|b| mask & (1 << b) != 0) {
            blocks.extend_from_slice(&new[b * 64..(b + 1) * 64]);
        }
    }
    if t.pages < MIN_DECIDING {
        return Ok(t);
    }
    let mut out = Vec::new();
    crate::prefix::compress_frame(&old, &blocks, level, &mut out)?;
    t.prefix_bytes = out.len();
    crate::prefix::compress_frame(&[], &lits, level, &mut out)?;
    t.runs_bytes = out.len();
    crate::prefix::compress_frame(&[], &heads, level, &mut out)?;
    t.runs_bytes += out.len();
    Ok(t)
}

#[cfg(test)]
mod tests {
    use crate::format::PAGE;
    use crate::{decode, test_bytes, Codec, Config, Encoder, Plan};

    const PAGES: usize = 256;

    /// Encodes epoch 1 (every page rewritten, so the store holds them all) and epoch 2 (each
    /// page changed by `edit`), decodes both on a separate mirror and checks it; returns
    /// epoch 2's stats.
    fn run(edit: impl Fn(usize, &mut [u8])) -> crate::EncodeStats {
        run_from(|_, _| {}, edit)
    }

    /// [`run`] with epoch 1's pages made by `first` from pseudo-random bytes.
    fn run_from(
        first: impl Fn(usize, &mut [u8]),
        edit: impl Fn(usize, &mut [u8]),
    ) -> crate::EncodeStats {
        let base = vec![0u8; PAGES * PAGE];
        let mut enc = Encoder::new(Codec::Tandem, &base, Config::default()).unwrap();
        let (mut mirror, mut plan) = (base, Plan::default());
        let pfns: Vec<u64> = (0..PAGES as u64).collect();
        let mut data = test_bytes(7, PAGES * PAGE);
        for (i, p) in data.chunks_exact_mut(PAGE).enumerate() {
            first(i, p);
        }
        let mut stats = Default::default();
        for epoch in 1..=2 {
            if epoch == 2 {
                for (i, p) in data.chunks_exact_mut(PAGE).enumerate() {
                    edit(i, p);
                }
            }
            let mut rec = Vec::new();
            stats = enc.encode(epoch, &pfns, &data, &mut rec).unwrap();
            decode(&rec, &mirror, &mut plan).unwrap();
            plan.commit(&mut mirror);
            assert_eq!(mirror, data, "epoch {epoch} round trip");
        }
        stats
    }

    /// A heap page: objects of 16 or 32 bytes, each an 8-byte header (type, mark byte, zero
    /// padding, a reference count) and pointer-like words.
    fn heap_page(i: usize, p: &mut [u8]) -> Vec<usize> {
        let sizes = test_bytes(i as u64 + 99, 256);
        let (mut at, mut heads) = (0, Vec::new());
        for (k, s) in sizes.iter().enumerate() {
            let len = 16 * (1 + *s as usize % 2);
            if at + len > PAGE {
                break;
            }
            p[at..at + len].fill(0);
            p[at] = 1 + (k % 7) as u8;
            for w in (at + 8..at + len).step_by(8) {
                let v = 0x7f00_0000_0000u64 + ((i * 4096 + w) as u64 * 48) % (1 << 30);
                p[w..w + 8].copy_from_slice(&v.to_le_bytes());
            }
            heads.push(at);
            at += len;
        }
        heads
    }

    #[test]
    fn scattered_small_changes_take_long_run_patches() {
        // A collector's pass over every object: mark byte and reference count changed in
        // each header of objects of varying sizes, all over each page (epoch 1 wrote the
        // unmarked heap).
        let base = |i: usize, p: &mut [u8]| {
            heap_page(i, p);
        };
        let s = run_from(base, |i, p| {
            for (k, h) in heap_page(i, &mut p.to_vec()).into_iter().enumerate() {
                p[h + 1] = 1;
                p[h + 4] = 2 + (k % 3) as u8;
            }
        });
        assert!(s.trial.pages >= super::MIN_DECIDING, "{:?}", s.trial);
        assert_eq!(s.trial.runs_win(), Some(true), "{:?}", s.trial);
        assert_eq!(s.patch_limit, super::LONG_PATCH);
    }

    #[test]
    fn shifted_content_keeps_the_prefix_path() {
        // Half of each page moved by 5 bytes (an insertion in a sorted page): a run patch of
        // about 2 KiB, which the prefix path finds in the previous version.
        let s = run(|_, p| p.copy_within(2048..PAGE - 5, 2053));
        assert!(s.trial.pages >= super::MIN_DECIDING, "{:?}", s.trial);
        assert_eq!(s.trial.runs_win(), Some(false), "{:?}", s.trial);
        assert_eq!(s.patch_limit, Config::default().budget.good_enough);
    }

    #[test]
    fn a_clear_choice_halves_the_next_sample_and_a_close_one_restores_it() {
        use super::{Trial, MIN_DECIDING, MIN_SAMPLE, SAMPLE};
        let t = |runs_bytes, sample| Trial {
            pages: MIN_DECIDING,
            prefix_bytes: 1000,
            runs_bytes,
            sample,
        };
        // Runs at 0.6 and 0.95 of the prefix path: clear; at 0.7 and 0.85: close to 0.75.
        assert!(t(600, SAMPLE).clear() && t(950, SAMPLE).clear());
        assert!(!t(700, SAMPLE).clear() && !t(850, SAMPLE).clear());
        assert_eq!(t(400, SAMPLE).next_sample(false), SAMPLE / 2);
        assert_eq!(t(1200, MIN_SAMPLE).next_sample(false), MIN_SAMPLE);
        assert_eq!(
            t(400, MIN_SAMPLE).next_sample(true),
            SAMPLE,
            "a changed choice"
        );
        assert_eq!(t(800, MIN_SAMPLE).next_sample(false), SAMPLE, "a close one");
        let undecided = Trial {
            pages: MIN_DECIDING - 1,
            ..t(400, MIN_SAMPLE)
        };
        assert_eq!(
            undecided.next_sample(false),
            MIN_SAMPLE,
            "too few pages: kept"
        );
    }

    #[test]
    fn an_epoch_without_large_changes_does_not_decide() {
        let s = run(|_, p| p[100] ^= 1);
        assert_eq!(s.trial.pages, 0);
        assert_eq!(s.trial.runs_win(), None);
    }

    /// Encodes `n` epochs of 2 × [`PAGES`] pages (2 MiB, above a check's minimum), each
    /// page's content made by `page(epoch, i, p)`, decodes each on a separate mirror; returns
    /// every epoch's stats.
    fn epochs(n: u64, page: impl Fn(u64, usize, &mut [u8])) -> Vec<crate::EncodeStats> {
        const PAGES: usize = 2 * super::tests::PAGES;
        let base = vec![0u8; PAGES * PAGE];
        let mut enc = Encoder::new(Codec::Tandem, &base, Config::default()).unwrap();
        let (mut mirror, mut plan) = (base, Plan::default());
        let pfns: Vec<u64> = (0..PAGES as u64).collect();
        let mut data = vec![0u8; PAGES * PAGE];
        let mut stats = Vec::new();
        for epoch in 1..=n {
            for (i, p) in data.chunks_exact_mut(PAGE).enumerate() {
                page(epoch, i, p);
            }
            let mut rec = Vec::new();
            stats.push(enc.encode(epoch, &pfns, &data, &mut rec).unwrap());
            decode(&rec, &mirror, &mut plan).unwrap();
            plan.commit(&mut mirror);
            assert_eq!(mirror, data, "epoch {epoch} round trip");
        }
        stats
    }

    #[test]
    fn fresh_content_goes_without_the_prefix_until_a_probe() {
        use super::PROBE_EVERY;
        // Every page rewritten each epoch with new bytes, half of each 8-byte word random
        // (compressible, unrelated to the page's previous content).
        let stats = epochs(u64::from(PROBE_EVERY) + 4, |e, i, p| {
            let r = test_bytes(e * 1_000 + i as u64, PAGE);
            for (w, c) in p.chunks_exact_mut(8).zip(r.chunks_exact(8)) {
                w[..4].copy_from_slice(&c[..4]);
                w[4..].fill(0);
            }
        });
        // Epoch 1 has nothing held; epoch 2 is the first checked.
        let (with, without) = stats[1].prefix_check.expect("epoch 2 checked");
        assert!(with * 100 >= without * 99, "{with} {without}");
        assert!(!stats[1].prefix_off && stats[1].prefix_pages > 0);
        // Then without a prefix, until the probe PROBE_EVERY large epochs later.
        for s in &stats[2..2 + PROBE_EVERY as usize] {
            assert!(s.prefix_off && s.prefix_pages == 0 && s.prefix_check.is_none());
        }
        let probe = &stats[2 + PROBE_EVERY as usize];
        assert!(!probe.prefix_off && probe.prefix_check.is_some());
        assert!(stats[3 + PROBE_EVERY as usize].prefix_off);
    }

    #[test]
    fn content_found_in_the_previous_versions_keeps_the_prefix() {
        // Each epoch shifts every page's content by 3 bytes: the prefix finds all of it.
        let stats = epochs(4, |e, i, p| {
            let r = test_bytes(i as u64, PAGE + 64);
            let at = 3 * e as usize % 64;
            p.copy_from_slice(&r[at..at + PAGE]);
        });
        let (with, without) = stats[1].prefix_check.expect("epoch 2 checked");
        assert!(with < without, "{with} {without}");
        assert!(stats[2..]
            .iter()
            .all(|s| !s.prefix_off && s.prefix_check.is_none()));
    }

    #[test]
    fn the_prefix_choice_checks_only_large_epochs_every_so_often() {
        use super::{PrefixChoice, CHECK_MIN, PROBE_EVERY};
        let mut c = PrefixChoice::default();
        assert!(c.use_prefix() && c.wants_check(true, CHECK_MIN));
        assert!(!c.wants_check(true, CHECK_MIN - 1), "a small epoch");
        assert!(!c.wants_check(false, CHECK_MIN), "no prefix to check");
        c.update(CHECK_MIN, Some((100, 90)));
        assert!(!c.pays && !c.use_prefix());
        for _ in 0..PROBE_EVERY - 1 {
            c.update(CHECK_MIN, None);
            c.update(10, None); // small epochs do not count
            assert!(!c.use_prefix());
        }
        c.update(CHECK_MIN, None);
        assert!(
            c.use_prefix() && c.wants_check(true, CHECK_MIN),
            "the probe"
        );
        c.update(CHECK_MIN, Some((995, 1000)));
        assert!(!c.pays, "saved under 1 %");
        c.update(CHECK_MIN, Some((80, 90)));
        assert!(c.pays && c.use_prefix() && !c.wants_check(true, CHECK_MIN));
    }

    #[test]
    fn checks_that_find_the_prefix_paying_widely_come_less_often() {
        use super::{PrefixChoice, CHECK_MIN, PROBE_EVERY, PROBE_MAX};
        let mut c = PrefixChoice::default();
        // Epochs from one check to the next, the check's (with, without) given.
        fn gap(c: &mut PrefixChoice, checked: (usize, usize)) -> u32 {
            c.update(CHECK_MIN, Some(checked));
            let mut n = 0;
            while !c.wants_check(c.use_prefix(), CHECK_MIN) {
                assert!(c.use_prefix());
                c.update(CHECK_MIN, None);
                n += 1;
            }
            n
        }
        // 10 % saved: twice as long each time, up to PROBE_MAX.
        let gaps: Vec<u32> = (0..5).map(|_| gap(&mut c, (90, 100))).collect();
        assert_eq!(gaps, [16, 32, PROBE_MAX, PROBE_MAX, PROBE_MAX]);
        // 2 % saved: it still pays, and the next check is PROBE_EVERY on.
        assert_eq!(gap(&mut c, (98, 100)), PROBE_EVERY);
        assert_eq!(gap(&mut c, (90, 100)), 2 * PROBE_EVERY);
        // Under 1 %: off, and probed every PROBE_EVERY.
        c.update(CHECK_MIN, Some((995, 1000)));
        assert!(!c.use_prefix() && c.every == PROBE_EVERY);
    }
}
