//! The memory-trace format written by `tandem record` and read by `tandem trace info` and the
//! benchmarks. See `docs/TRACE_FORMAT.md` for the diagram.
//!
//! ```text
//! +------------------------------------------------------------------+
//! | header, 48 bytes                                                  |
//! |   magic "TNDMTRC1" | version u16 | flags u16 | page_size u32      |
//! |   mem_bytes u64 | epoch_ms u32 | meta_len u32                     |
//! |   reserved [u8; 12] | crc32c u32 (of header bytes 0..44 + meta)   |
//! | meta: JSON, meta_len bytes (≤ 64 KiB)                             |
//! +------------------------------------------------------------------+
//! | frame*, each:                                                     |
//! |   kind u8 | codec u8 | reserved u16 | raw_len u32 | stored_len u32|
//! |   crc32c u32 (of the stored payload) | payload (stored_len bytes) |
//! |   kinds: 1 base chunk, 2 epoch, 3 end                             |
//! +------------------------------------------------------------------+
//! ```
//! All integers are little-endian. A trace is complete only when it ends with an end frame
//! whose counts match what came before; anything else is reported as truncated with its offset.

#![warn(missing_docs)]

mod frame;
#[cfg(feature = "fuzz")]
pub mod fuzz;
mod reader;
mod replay;
mod writer;

pub use frame::{EpochRecord, Timing, TraceFrame};
pub use reader::TraceReader;
pub use replay::replay;
pub use writer::TraceWriter;

/// File magic.
pub const MAGIC: &[u8; 8] = b"TNDMTRC1";
/// Format version written by this library.
pub const VERSION: u16 = 1;
/// Header size in bytes.
pub const HEADER_LEN: usize = 48;
/// Frame header size in bytes.
pub const FRAME_HEADER_LEN: usize = 16;
/// Largest metadata block accepted.
pub const MAX_META: usize = 64 << 10;
/// Largest decoded frame payload accepted (also bounds stored payloads).
pub const MAX_FRAME: usize = 256 << 20;
/// Largest guest memory a trace may describe (1 TiB).
pub const MAX_MEM: u64 = 1 << 40;
/// Pages per base-image chunk written by [`TraceWriter::write_base`].
pub const BASE_CHUNK_PAGES: usize = 1024;

/// Trace-wide facts from the header and its metadata.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceHeader {
    /// Guest page size (4096).
    pub page_size: u32,
    /// Guest memory size in bytes.
    pub mem_bytes: u64,
    /// Nominal epoch length.
    pub epoch_ms: u32,
    /// Free-form metadata (workload, dirty log, QEMU version, ...).
    pub meta: serde_json::Value,
}

impl TraceHeader {
    /// Number of guest pages.
    pub fn pages(&self) -> u64 {
        self.mem_bytes / self.page_size as u64
    }
}

/// Errors reading or writing a trace. Offsets are byte offsets in the file.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Underlying I/O failed.
    #[error("trace I/O")]
    Io(#[from] std::io::Error),
    /// Not a tandem trace.
    #[error("not a tandem trace (bad magic at offset 0)")]
    BadMagic,
    /// A version this build does not read.
    #[error("trace format version {0} is not supported (this tandem reads version {VERSION})")]
    Version(u16),
    /// Structural corruption.
    #[error("corrupt trace at offset {offset}: {what}")]
    Corrupt {
        /// Where.
        offset: u64,
        /// What is wrong.
        what: String,
    },
    /// The file ends early.
    #[error("truncated trace: {what} at offset {offset} (was the recording interrupted?)")]
    Truncated {
        /// Where the data stops.
        offset: u64,
        /// What was expected.
        what: String,
    },
    /// A value exceeds a documented limit.
    #[error("trace limit exceeded: {0}")]
    Limit(String),
}
