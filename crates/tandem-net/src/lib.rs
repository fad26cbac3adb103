//! Network output commit for tandem.
//!
//! The guest's NIC is QEMU's `-netdev stream` connected to a unix socket owned by a [`Relay`],
//! or a tap with virtio-net headers (`vnet_hdr=on`, as libvirt gives virtio NICs) whose frames
//! the relay takes through a packet socket.
//! Frames from the guest are held per epoch and written to a tap device only once the backup
//! acknowledged the epoch they belong to; frames to the guest pass at once. The tap sits on a
//! bridge (in a network namespace, [`netns`], when the clients are there).

#![warn(missing_docs)]

pub mod netns;
pub mod relay;
pub mod tap;

pub use relay::{Gate, Policy, Relay, RelayError, RelayStats};
pub use tap::{guest_tap, open_tap, open_tap_with, remove_tap, TapError};
