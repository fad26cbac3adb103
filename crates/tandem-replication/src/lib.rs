//! tandem's replication link: the primary ships each epoch (memory record, device state) as a
//! framed, checksummed message; the backup verifies it completely, commits it to its RAM mirror
//! and disk copy and acknowledges. No QEMU here: callers bring the mirror (a buffer or a mapping of the
//! standby's RAM file) and the transport (any `Read`/`Write`).

#![warn(missing_docs)]

pub mod backup;
pub mod devstate;
pub mod disk;
#[cfg(feature = "fuzz")]
pub mod fuzz;
pub mod keeper;
pub mod parts;
pub mod primary;
mod staged;
pub mod wire;

pub use backup::{Applied, ApplyError, Backup};
pub use disk::{DiskCopy, FileDisk};
pub use keeper::{PageKeeper, Plain};
pub use parts::Parts;
pub use primary::{
    AckError, Acks, EpochInput, EpochSizes, MemoryJob, MemoryRecord, Primary, PrimaryError, Reply,
};
pub use wire::{Fencing, Frame, Hello, Kind, WireError};

/// The hello payload for a guest of `mem_bytes` with a data disk of `disk_bytes` (0 = none),
/// whose initial copy belongs to epoch 0.
pub fn hello_payload(mem_bytes: u64, disk_bytes: u64) -> Vec<u8> {
    Hello {
        mem_bytes,
        page_size: tandem_codec::format::PAGE as u32,
        disk_bytes,
        start_epoch: 0,
        session: 0,
        fencing: wire::Fencing::None,
    }
    .encode()
}

/// A base chunk payload: `data` holds whole pages starting at `first_pfn`.
pub fn base_payload(first_pfn: u64, data: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(8 + data.len());
    p.extend_from_slice(&first_pfn.to_le_bytes());
    p.extend_from_slice(data);
    p
}

/// Largest epoch payload a primary sends (the frame limit).
pub const MAX_EPOCH_PAYLOAD: usize = wire::MAX_PAYLOAD as usize;

/// Runs of consecutive non-zero pages of `mem` (at most `max_pages` each), with their first
/// page number.
pub fn nonzero_runs(mem: &[u8], max_pages: usize) -> impl Iterator<Item = (u64, &[u8])> {
    const PAGE: usize = tandem_codec::format::PAGE;
    let pages = mem.len() / PAGE;
    let max_pages = max_pages.max(1);
    // A slice compare is memcmp even in a debug build: a byte loop there scans a 1 GiB
    // guest's zero pages slower than the primary's watchdog allows between two frames.
    static ZERO: [u8; PAGE] = [0; PAGE];
    let zero = move |p: usize| mem[p * PAGE..(p + 1) * PAGE] == ZERO[..];
    let mut p = 0;
    std::iter::from_fn(move || {
        while p < pages && zero(p) {
            p += 1;
        }
        if p >= pages {
            return None;
        }
        let start = p;
        while p < pages && p - start < max_pages && !zero(p) {
            p += 1;
        }
        Some((start as u64, &mem[start * PAGE..p * PAGE]))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonzero_runs_cover_exactly_the_nonzero_pages() {
        const PAGE: usize = tandem_codec::format::PAGE;
        let mut mem = vec![0u8; 20 * PAGE];
        for p in [0usize, 1, 2, 5, 9, 10, 19] {
            mem[p * PAGE + 7] = 1;
        }
        let runs: Vec<(u64, usize)> = nonzero_runs(&mem, 2)
            .map(|(f, r)| (f, r.len() / PAGE))
            .collect();
        assert_eq!(runs, vec![(0, 2), (2, 1), (5, 1), (9, 2), (19, 1)]);
    }
}
