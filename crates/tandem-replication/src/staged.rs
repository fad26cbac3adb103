//! The undo log of an epoch that arrives in parts ([`crate::parts`]): the backup writes each
//! part into its mirror at once and keeps the contents it overwrote, so that the epoch can be
//! undone whole when its last frame is refused or never comes. Disk writes of the parts wait
//! here and are applied with the epoch's own, all or nothing.
//!
//! Memory: one old copy of every page the parts wrote, and the parts' disk writes — at most
//! the epoch's dirty memory and disk writes minus its last part.

use std::collections::HashSet;

use tandem_disk::image::Write;

const PAGE: usize = tandem_codec::format::PAGE;

/// Parts of epoch `seq` applied to the mirror but not committed.
#[derive(Debug, Default)]
pub(crate) struct Staged {
    /// The epoch the parts belong to.
    pub(crate) seq: u64,
    /// Pages overwritten, in the order first written.
    pfns: Vec<u64>,
    /// Their contents before the epoch, one page per entry of `pfns`.
    old: Vec<u8>,
    seen: HashSet<u64>,
    /// Disk writes of the parts, in order.
    pub(crate) writes: Vec<Write>,
    /// Parts applied.
    pub(crate) parts: u64,
}

impl Staged {
    pub(crate) fn new(seq: u64) -> Self {
        Staged {
            seq,
            ..Staged::default()
        }
    }

    /// Keeps the current contents of those of `pfns` not yet kept (they are about to be
    /// overwritten by a part of the epoch).
    pub(crate) fn save(&mut self, mirror: &[u8], pfns: &[u64]) {
        for &pfn in pfns {
            if self.seen.insert(pfn) {
                let o = pfn as usize * PAGE;
                self.pfns.push(pfn);
                self.old.extend_from_slice(&mirror[o..o + PAGE]);
            }
        }
    }

    /// Puts every kept page back; returns the pages rewritten.
    pub(crate) fn undo(self, mirror: &mut [u8]) -> Vec<u64> {
        for (i, &pfn) in self.pfns.iter().enumerate() {
            let o = pfn as usize * PAGE;
            mirror[o..o + PAGE].copy_from_slice(&self.old[i * PAGE..(i + 1) * PAGE]);
        }
        self.pfns
    }

    /// Bytes held: old pages and disk writes.
    pub(crate) fn bytes(&self) -> u64 {
        (self.old.len() + self.writes.iter().map(|w| w.1.len()).sum::<usize>()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undo_restores_the_first_saved_contents_of_every_page() {
        let mut m: Vec<u8> = (0..4 * PAGE).map(|i| (i / PAGE) as u8).collect();
        let before = m.clone();
        let mut s = Staged::new(7);
        s.save(&m, &[1, 3]);
        m[PAGE..2 * PAGE].fill(9);
        m[3 * PAGE..].fill(9);
        s.save(&m, &[3, 2]); // page 3 again: its first contents stay
        m[2 * PAGE..3 * PAGE].fill(8);
        m[3 * PAGE..].fill(8);
        assert_eq!(s.bytes(), 3 * PAGE as u64);
        assert_eq!(s.undo(&mut m), vec![1, 3, 2]);
        assert_eq!(m, before);
    }
}
