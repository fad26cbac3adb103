//! Fencing for tandem: which copy of a protected VM runs it, decided by one ownership record
//! per VM in an etcd cluster, every change a compare-and-swap (docs/FENCING.md).
//!
//! Protected output needs no lease: the primary releases it only on an acknowledgement of its
//! session's backup, and a backup that took over never acknowledges again. Only the switch to
//! running without a replica and the backup's takeover must be serialised — one
//! compare-and-swap each on the record, so a takeover waits for no lease to expire.
//!
//! - [`record`]: the record, its states and transitions (pure).
//! - [`owner`]: the transitions as idempotent compare-and-swaps in etcd; the owner's
//!   read-back.
//! - [`etcd`]: a small etcd v3 client over the JSON gateway.

#![warn(missing_docs)]

pub mod etcd;
#[cfg(feature = "fuzz")]
pub mod fuzz;
pub mod owner;
pub mod record;

pub use etcd::EtcdTls;
pub use owner::{random_id, Descriptor, Fence, FenceConfig, FenceError, Owner};
pub use record::{Record, Refusal, State, Transition};
