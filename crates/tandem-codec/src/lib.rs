//! tandem's epoch codec: encodes the dirty pages of one checkpoint, given the reference state
//! both sides share, into a compact record (format.rs) and decodes it back bit-exactly. No I/O.
//!
//! Techniques (each a selectable [`Codec`], all emitting the same record format):
//! zero pages; identical-page and 64 B block sharing within the epoch and against held
//! references (xxh3 hints, always byte-verified); FGBI 64 B block hashes; FITDOC 8 B word
//! deltas with an LRU buffer (or a full mirror); Gerofi et al.'s popcount similarity over
//! 512 B areas with an 18-bit content table and a 5120-page recently-dirtied cache; Difference
//! Engine's HashSimilarityDetector(2,1) patching; hybrid compression (sparse, WKdm, LZ4, zstd);
//! QEMU XBZRLE, Remus raw, whole-page zstd-1 and LZ4 as baselines; and `tandem`, which picks per
//! page the smallest within a CPU budget.
//!
//! Decoding builds the complete [`Plan`] (every new page) against the untouched pre-epoch
//! mirror and checks every reference, length and checksum first; only then [`Plan::commit`]
//! writes the mirror. A page referenced by another page of the same epoch is resolved to its
//! pre-epoch content (mirror) or, explicitly, to its new content (an earlier entry).

#![warn(missing_docs)]

pub mod anchors;
mod apply;
mod bodies;
pub mod code;
mod config;
mod decoder;
mod encoder;
pub mod format;
#[cfg(feature = "fuzz")]
pub mod fuzz;
pub mod level;
pub mod prefix;
mod record;
pub mod runs;
mod simd;
pub mod simhash;
mod split;
pub mod state;
mod strategies;
mod trial;
pub mod wkdm;
pub mod words;

pub use decoder::{decode, pages_read, pages_read_with, Plan};
pub use encoder::{Codec, Config, EncodeStats, Encoder};
pub use strategies::Budget;
pub use trial::Trial;

/// Why a record was rejected. Nothing was applied.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The record ends early.
    #[error("truncated epoch record: {0}")]
    Truncated(String),
    /// Structure is wrong.
    #[error("malformed epoch record: {0}")]
    Malformed(String),
    /// Unknown format version.
    #[error("epoch record version {0} is not supported (this build reads versions 1 to 5; a newer tandem wrote it: upgrade this host)")]
    Version(u16),
    /// A checksum does not match.
    #[error("epoch record checksum mismatch in the {0}")]
    Checksum(&'static str),
    /// A size limit is exceeded.
    #[error("epoch record exceeds a limit: {0}")]
    Limit(String),
    /// A declared length is more than the record can hold (refused before allocating it).
    #[error("epoch record declares {declared} bytes of {what}, but can hold at most {max}")]
    Length {
        /// What the length is of.
        what: String,
        /// The length the record declares.
        declared: u64,
        /// The most the record can hold.
        max: u64,
    },
    /// One page's code is invalid.
    #[error("epoch record entry {index}: {what}")]
    Page {
        /// Entry index.
        index: usize,
        /// What is wrong.
        what: String,
    },
}

/// Why an epoch could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// Caller's input is inconsistent.
    #[error("invalid encoder input: {0}")]
    Input(String),
    /// zstd failed.
    #[error("zstd compression failed")]
    Compress(#[source] std::io::Error),
    /// An earlier record failed after the reference state had advanced past its epoch.
    #[error("the encoder's state ran ahead of a record that failed; start a new encoder (a full resync)")]
    Diverged,
}

/// One step of xorshift64 (13, 7, 17), the unit tests' generator.
#[cfg(test)]
pub(crate) fn xorshift64(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// Pseudo-random test bytes (xorshift64), shared by the unit tests.
#[cfg(test)]
pub(crate) fn test_bytes(mut x: u64, n: usize) -> Vec<u8> {
    (0..n)
        .map(|_| {
            x = xorshift64(x);
            x as u8
        })
        .collect()
}
