//! Disk output commit for tandem: the guest's disk is served by tandem's own NBD server; writes
//! land on the primary's image at once and are logged per epoch, so the backup can apply them to
//! its copy only when the epoch commits.

#![warn(missing_docs)]

#[cfg(feature = "fuzz")]
pub mod fuzz;
pub mod image;
pub mod nbd;

pub use image::{decode_writes, encode_writes, Image, LogUsage};
