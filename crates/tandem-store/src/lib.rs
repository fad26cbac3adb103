//! Incremental checkpoints of a VM on disk (docs/STORE.md).
//!
//! A store is a directory: segment files holding checkpoint records (a full **base** or a
//! **delta**: the codec's epoch record against the previous checkpoint, plus the device state)
//! and an **index** of committed checkpoints. A checkpoint becomes visible only once its record
//! is durable (fsync) and its index entry is appended and synced; a torn tail is ignored with a
//! warning. Retention folds old deltas into a new base by writing a new segment and a new index
//! and renaming it into place, so the store is restorable at every step. One process writes a
//! store at a time (an advisory lock, [`lock`]); a failed append (disk full) is rolled back and
//! [`Saver`] carries on with a base. No QEMU here.

#![warn(missing_docs)]

mod compact;
pub mod disks;
pub mod format;
#[cfg(feature = "fuzz")]
pub mod fuzz;
pub mod lock;
pub mod ramhash;
mod rebuild;
pub mod saver;
pub mod store;
mod writefault;

pub use format::{Entry, RecordKind};
pub use saver::{Outcome, Saver};
pub use store::{encode_base, Meta, Store, StoreError};
