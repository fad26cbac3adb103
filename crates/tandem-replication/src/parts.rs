//! How an epoch is split into parts: a first epoch after a long initial sync or a burst of
//! disk writes can hold more than one frame may carry (1 GiB), so the primary sends it as
//! [`Kind::EpochPart`](crate::Kind::EpochPart) frames of disjoint page groups and disk
//! writes, and the epoch frame that commits them all. The backup applies each part at once
//! and keeps what it overwrote, so that an epoch whose last frame never comes, or is refused,
//! is undone whole ([`crate::backup`]).
//!
//! ```text
//!   part 1: memory record of pages [0, P)           + disk writes of bytes [0, D)
//!   part 2: memory record of pages [P, 2P)          + disk writes of bytes [D, 2D)
//!   ...
//!   epoch:  memory record of the last pages          + the last disk writes
//!           + device state                             (commits the epoch: acknowledged)
//! ```
//! Every part is a memory record of its own, encoded after the previous one (a record may
//! refer to pages an earlier part of the same epoch wrote: the backup applies parts in order).

use std::borrow::Cow;
use std::ops::Range;

use tandem_disk::image::Write;

/// The largest part of an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parts {
    /// Dirty pages per part.
    pub max_pages: usize,
    /// Bytes of disk writes per part (a larger write is split).
    pub max_disk_bytes: usize,
}

/// One part: its page range (indices into the epoch's dirty pages) and disk writes.
pub(crate) type Part<'a> = (Range<usize>, Option<Cow<'a, [Write]>>);

impl Parts {
    /// Never split (an epoch too large for one frame is refused).
    pub const WHOLE: Parts = Parts {
        max_pages: usize::MAX,
        max_disk_bytes: usize::MAX,
    };

    /// The daemon's default: 64 Ki pages (256 MiB of guest memory) and 256 MiB of disk writes
    /// per part — a part's frame stays far below the 1 GiB frame bound whatever the codec
    /// makes of it, and the backup's undo log grows by at most that much per part.
    pub const DEFAULT: Parts = Parts {
        max_pages: 65_536,
        max_disk_bytes: 256 << 20,
    };

    /// Whether an epoch of `pages` dirty pages and `writes` goes out whole, in one frame
    /// ([`Parts::split`] gives one part). Asked inside the checkpoint pause: it neither
    /// allocates nor copies.
    pub fn whole(&self, pages: usize, writes: Option<&[Write]>) -> bool {
        pages <= self.max_pages.max(1) && writes.is_none_or(|w| self.disk_fits(w))
    }

    /// Whether `writes` fit one part.
    fn disk_fits(&self, writes: &[Write]) -> bool {
        writes.iter().map(|w| w.1.len()).sum::<usize>() <= self.max_disk_bytes.max(1)
    }

    /// Splits an epoch of `pages` dirty pages and `writes` (None: no replicated disk): at
    /// least one part; the last one carries the disk section whenever `writes` is given.
    pub(crate) fn split<'a>(&self, pages: usize, writes: Option<&'a [Write]>) -> Vec<Part<'a>> {
        let max_pages = self.max_pages.max(1);
        let mem: Vec<Range<usize>> = (0..pages.div_ceil(max_pages).max(1))
            .map(|i| i * max_pages..((i + 1) * max_pages).min(pages))
            .collect();
        let disk = writes.map(|w| self.group(w)).unwrap_or_default();
        let n = mem.len().max(disk.len());
        let mut disk = disk.into_iter();
        (0..n)
            .map(|i| {
                let range = mem.get(i).cloned().unwrap_or(pages..pages);
                let mut d = disk.next();
                if i + 1 == n && d.is_none() && writes.is_some() {
                    d = Some(Cow::Borrowed(&[][..]));
                }
                (range, d)
            })
            .collect()
    }

    /// Groups of consecutive writes of at most `max_disk_bytes` each (a larger write is cut).
    fn group<'a>(&self, writes: &'a [Write]) -> Vec<Cow<'a, [Write]>> {
        let max = self.max_disk_bytes.max(1);
        if self.disk_fits(writes) {
            return vec![Cow::Borrowed(writes)];
        }
        let mut out = Vec::new();
        let mut group: Vec<Write> = Vec::new();
        let mut bytes = 0;
        for (off, data) in writes {
            for (i, piece) in data.chunks(max).enumerate() {
                if bytes + piece.len() > max && !group.is_empty() {
                    out.push(Cow::Owned(std::mem::take(&mut group)));
                    bytes = 0;
                }
                group.push((off + (i * max) as u64, piece.to_vec()));
                bytes += piece.len();
            }
        }
        if !group.is_empty() {
            out.push(Cow::Owned(group));
        }
        out
    }
}

impl Default for Parts {
    fn default() -> Self {
        Parts::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_epoch_is_one_part_and_keeps_its_disk_section() {
        let w: Vec<Write> = vec![(0, vec![1; 10])];
        let p = Parts::DEFAULT.split(5, Some(&w));
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].0, 0..5);
        assert!(matches!(p[0].1, Some(Cow::Borrowed(_))));
        let p = Parts::DEFAULT.split(0, Some(&[]));
        assert_eq!(
            (p.len(), p[0].0.clone(), p[0].1.as_deref()),
            (1, 0..0, Some(&[][..]))
        );
        assert!(Parts::DEFAULT.split(3, None)[0].1.is_none());
    }

    #[test]
    fn pages_and_writes_are_cut_into_bounded_parts_that_cover_everything() {
        let parts = Parts {
            max_pages: 4,
            max_disk_bytes: 8,
        };
        let w: Vec<Write> = vec![(100, vec![1; 3]), (200, vec![2; 20]), (300, vec![3; 2])];
        let p = parts.split(10, Some(&w));
        let ranges: Vec<_> = p.iter().map(|x| x.0.clone()).collect();
        assert_eq!(ranges, vec![0..4, 4..8, 8..10, 10..10]);
        let mut bytes: Vec<(u64, u8)> = Vec::new();
        for (_, d) in &p {
            let d = d.as_deref().unwrap_or_default();
            assert!(d.iter().map(|x| x.1.len()).sum::<usize>() <= 8);
            for (o, data) in d {
                bytes.extend(data.iter().enumerate().map(|(i, b)| (o + i as u64, *b)));
            }
        }
        let want: Vec<(u64, u8)> = w
            .iter()
            .flat_map(|(o, d)| d.iter().enumerate().map(move |(i, b)| (o + i as u64, *b)))
            .collect();
        assert_eq!(bytes, want, "every byte once, in order");
        assert!(p.last().and_then(|x| x.1.as_ref()).is_some());
    }

    #[test]
    fn whole_says_what_split_does() {
        let parts = Parts {
            max_pages: 4,
            max_disk_bytes: 8,
        };
        let small: Vec<Write> = vec![(0, vec![1; 3]), (9, vec![2; 5])];
        let large: Vec<Write> = vec![(0, vec![1; 3]), (9, vec![2; 6])];
        let one_big: Vec<Write> = vec![(0, vec![1; 9])];
        for pages in [0, 1, 4, 5, 9] {
            for w in [
                None,
                Some(&[][..]),
                Some(&small[..]),
                Some(&large[..]),
                Some(&one_big[..]),
            ] {
                assert_eq!(
                    parts.whole(pages, w),
                    parts.split(pages, w).len() == 1,
                    "{pages} pages, {w:?}"
                );
            }
        }
    }
}
