//! What the saver tells the operator about each checkpoint: skipped ones with why and what to
//! do (in full at the first of a run of failures, then a reminder every 5 s), and the first
//! one saved again.

use std::time::{Duration, Instant};

use tandem_store::{Outcome, StoreError};

use crate::{chain, Status};

/// The saver's running account of saved and skipped checkpoints.
pub struct SaveLog {
    dir: String,
    seq: u64,
    failing: bool,
    last_reminder: Instant,
    status: Status,
}

impl SaveLog {
    /// Reports about the store in `dir`.
    pub fn new(dir: &std::path::Path, status: Status) -> Self {
        SaveLog {
            dir: dir.display().to_string(),
            seq: 0,
            failing: false,
            last_reminder: Instant::now(),
            status,
        }
    }

    /// What became of the next checkpoint.
    pub fn outcome(&mut self, o: &Outcome) {
        self.seq += 1;
        match o {
            Outcome::Saved { entry, .. } => {
                if self.failing {
                    self.status.warn(format!(
                        "saving again: checkpoint {} (#{} of this run) is a full {}",
                        entry.id,
                        self.seq,
                        format!("{:?}", entry.kind).to_lowercase()
                    ));
                }
                self.failing = false;
            }
            Outcome::Skipped {
                would_be,
                error,
                streak,
            } => {
                self.failing = true;
                let why = chain(error);
                let what = if error.is_disk_full() {
                    format!("the disk holding {} is full", self.dir)
                } else {
                    format!("writing to {} failed", self.dir)
                };
                if *streak == 1 {
                    self.status.warn(format!(
                        "{what}: checkpoint #{} of this run (it would have been checkpoint {would_be}) was NOT saved ({why}). The guest keeps running and the store is intact, ending at the last saved checkpoint. Free space there (or lower --keep); tandem retries at every checkpoint, and the next one saved will be a full base.",
                        self.seq
                    ));
                    self.last_reminder = Instant::now();
                } else if self.last_reminder.elapsed() >= Duration::from_secs(5) {
                    self.status.warn(format!(
                        "{what}: still not saving ({streak} checkpoint(s) skipped in a row, latest #{}: {why})",
                        self.seq
                    ));
                    self.last_reminder = Instant::now();
                }
            }
        }
    }

    /// Retention failed (nothing was dropped).
    pub fn compaction_failed(&self, e: &StoreError) {
        let full = if e.is_disk_full() { " (disk full)" } else { "" };
        self.status.warn(format!(
            "retention could not fold old checkpoints in {}{full}: {}; nothing was dropped, the store is intact; it is tried again later",
            self.dir,
            chain(e)
        ));
    }
}
