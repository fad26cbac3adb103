//! Fencing for tandem: which copy of a protected VM may let output out, decided by an etcd
//! cluster (docs/FENCING.md).
//!
//! - [`etcd`]: a small etcd v3 client over the JSON gateway.
//! - [`lease`]: the VM's leader key held with a lease, the holder's release deadline, the
//!   replica record, and the guarded campaigns of a primary and a backup.
//! - [`cluster`]: starts a real etcd cluster of local members (lab and tests).

#![warn(missing_docs)]

pub mod cluster;
pub mod etcd;
pub mod fuzz;
pub mod lease;

pub use etcd::EtcdTls;
pub use lease::{campaign, Claim, FenceConfig, FenceError, Holder, Outcome, Replica};
