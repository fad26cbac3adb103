//! Network output commit for tandem.
//!
//! The guest's NIC is QEMU's `-netdev stream` connected to a unix socket owned by a [`Relay`].
//! Frames from the guest are held per epoch and written to a tap device only once the backup
//! acknowledged the epoch they belong to; frames to the guest pass at once. The tap sits on a
//! bridge (in a network namespace, [`netns`], when the clients are there).

#![warn(missing_docs)]

pub mod netns;
pub mod relay;
pub mod tap;

pub use relay::{Gate, Policy, Relay, RelayError, RelayStats};
pub use tap::{open_tap, TapError};
