//! A dirty log that replays recorded harvests: each harvest returns the next recorded set of
//! page numbers (for tests of the code around a dirty log, and for driving a real guest's
//! pipeline with a known dirty set).

use std::collections::VecDeque;

use super::{DirtyLog, DirtyLogError, HarvestStats};

/// Recorded harvests, returned one per [`DirtyLog::harvest`]; empty once they run out.
#[derive(Debug, Default, Clone)]
pub struct ReplayLog {
    harvests: VecDeque<Vec<u64>>,
}

impl ReplayLog {
    /// A log that returns `harvests` in order (each is sorted and deduplicated).
    pub fn new(harvests: impl IntoIterator<Item = Vec<u64>>) -> Self {
        ReplayLog {
            harvests: harvests
                .into_iter()
                .map(|mut h| {
                    h.sort_unstable();
                    h.dedup();
                    h
                })
                .collect(),
        }
    }

    /// Harvests not yet returned.
    pub fn remaining(&self) -> usize {
        self.harvests.len()
    }
}

impl DirtyLog for ReplayLog {
    fn name(&self) -> &'static str {
        "replay"
    }

    fn harvest(&mut self, out: &mut Vec<u64>) -> Result<HarvestStats, DirtyLogError> {
        let h = self.harvests.pop_front().unwrap_or_default();
        out.extend_from_slice(&h);
        Ok(HarvestStats {
            pages: h.len() as u64,
            ranges: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn harvests_come_back_sorted_in_order_then_empty() {
        let mut l = ReplayLog::new([vec![5, 1, 5], vec![9]]);
        let mut out = Vec::new();
        l.harvest(&mut out).unwrap();
        assert_eq!(out, [1, 5]);
        out.clear();
        l.harvest(&mut out).unwrap();
        assert_eq!(out, [9]);
        out.clear();
        assert_eq!(l.harvest(&mut out).unwrap().pages, 0);
        assert!(out.is_empty() && l.remaining() == 0);
    }
}
