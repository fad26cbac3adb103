//! tandem's replication link: the primary ships each epoch (memory record, device state) as a
//! framed, checksummed message; the backup verifies it completely, commits it to its RAM mirror
//! and disk copy and acknowledges. No QEMU here: callers bring the mirror (a buffer or a mapping of the
//! standby's RAM file) and the transport (any `Read`/`Write`).

#![warn(missing_docs)]

pub mod backup;
pub mod devstate;
pub mod fuzz;
pub mod wire;

pub use backup::{Applied, ApplyError, Backup, DiskCopy, FileDisk};
pub use wire::{Frame, Kind, WireError};

/// The hello payload for a guest of `mem_bytes` with a data disk of `disk_bytes` (0 = none).
pub fn hello_payload(mem_bytes: u64, disk_bytes: u64) -> Vec<u8> {
    let mut p = mem_bytes.to_le_bytes().to_vec();
    p.extend_from_slice(&(tandem_codec::format::PAGE as u32).to_le_bytes());
    p.extend_from_slice(&disk_bytes.to_le_bytes());
    p
}

/// A base chunk payload: `data` holds whole pages starting at `first_pfn`.
pub fn base_payload(first_pfn: u64, data: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(8 + data.len());
    p.extend_from_slice(&first_pfn.to_le_bytes());
    p.extend_from_slice(data);
    p
}
