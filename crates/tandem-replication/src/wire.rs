//! Frames on the replication link.
//!
//! ```text
//! +--------------------------------------------------------------------+
//! | header (32 bytes, little-endian)                                   |
//! |   0 magic "TNDR"   4 version u16 = 1   6 kind u8   7 flags u8 = 0   |
//! |   8 vm_id u64     16 seq u64          24 len u32                    |
//! |  28 crc32c u32 over header bytes 0..28 and the payload              |
//! | payload: len bytes (≤ 1 GiB)                                        |
//! +--------------------------------------------------------------------+
//! kinds: 1 hello (payload: mem_bytes u64, page_size u32, disk_bytes u64
//!                 [, start_epoch u64 — the epoch the initial copy belongs to; absent = 0
//!                 [, session u64 — random id of this replication session, which the primary
//!                    records in etcd as the replica that may take over; absent = 0]])
//!        2 base chunk (payload: first_pfn u64 + pages) — initial copy of guest memory
//!        3 epoch (payload: sections, each kind u8 + len u32 + bytes:
//!                 1 memory record (tandem-codec), 2 device state, 3 disk writes,
//!                 4 device state as a delta against the previous epoch's)
//!        4 ack (backup → primary, seq = committed epoch
//!               [, payload flags u8: bit 0 = the backup can fail over to it])
//!        5 heartbeat (primary → backup [, payload progress u64: epochs the primary's loop
//!               has completed, so a primary whose loop is stuck does not look alive])
//!        6 disk base chunk (payload: offset u64 + bytes) — initial copy of the data disk
//!        7 bye (primary → backup: replication ends on purpose, do not fail over)
//!        8 handover (primary → backup: the guest stopped for good after epoch seq; resume it
//!               now — a planned switch or a primary that is shutting down)
//!        9 fenced (backup → primary: the guest already runs on the backup since epoch seq;
//!               the primary must stop its copy without releasing anything)
//! ```
//! `seq` numbers epochs from 1 and keeps counting across sessions (a primary that reconnects
//! sends a new hello whose start epoch is its current epoch, then a new initial copy); base
//! chunks carry 0. A reader checks magic, version, kind, flags, length limit and checksum
//! before returning a frame; a writer refuses a payload over the limit.

use std::io::{Read, Write};

use tandem_types::framing::{crc32c, has_magic, u16_at, u32_at, u64_at};

/// Frame magic.
pub const MAGIC: &[u8; 4] = b"TNDR";
/// Protocol version.
pub const VERSION: u16 = 1;
/// Header length.
pub const HEADER_LEN: usize = 32;
/// Largest payload accepted.
pub const MAX_PAYLOAD: u32 = 1 << 30;

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Session start: guest geometry.
    Hello = 1,
    /// Initial guest memory chunk.
    Base = 2,
    /// One epoch's checkpoint.
    Epoch = 3,
    /// Backup committed `seq`.
    Ack = 4,
    /// Liveness.
    Heartbeat = 5,
    /// Initial data-disk chunk.
    DiskBase = 6,
    /// The primary ends replication on purpose (the VM is shut down): no failover.
    Bye = 7,
    /// The primary stopped its guest for good after epoch `seq`: the backup resumes it now.
    Handover = 8,
    /// The backup runs the guest (it failed over): the primary must stop its copy.
    Fenced = 9,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Base,
            3 => Kind::Epoch,
            4 => Kind::Ack,
            5 => Kind::Heartbeat,
            6 => Kind::DiskBase,
            7 => Kind::Bye,
            8 => Kind::Handover,
            9 => Kind::Fenced,
            _ => return None,
        })
    }
}

/// Section kinds inside an epoch payload.
pub mod section {
    /// A tandem-codec epoch record (guest memory).
    pub const MEMORY: u8 = 1;
    /// QEMU device state (migration stream without RAM).
    pub const DEVICE_STATE: u8 = 2;
    /// Disk writes of the epoch.
    pub const DISK: u8 = 3;
    /// Device state as a delta against the previous epoch's (see [`crate::devstate`]).
    pub const DEVICE_STATE_DELTA: u8 = 4;
}

/// A frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Kind.
    pub kind: Kind,
    /// The protected VM.
    pub vm_id: u64,
    /// Epoch sequence number (0 for hello and base chunks).
    pub seq: u64,
    /// Payload.
    pub payload: Vec<u8>,
}

/// Errors reading a frame.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The connection failed or closed.
    #[error("replication link I/O")]
    Io(#[from] std::io::Error),
    /// Not a tandem frame.
    #[error("bad frame magic (not a tandem replication peer?)")]
    Magic,
    /// Another protocol version.
    #[error("replication protocol version {0} is not supported (this tandem speaks {VERSION})")]
    Version(u16),
    /// Unknown kind or flags.
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// Checksum mismatch.
    #[error("frame checksum mismatch (corrupted on the link)")]
    Checksum,
}

impl Frame {
    /// Serialises the frame; a payload over [`MAX_PAYLOAD`] is refused (`InvalidInput`).
    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        if self.payload.len() > MAX_PAYLOAD as usize {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{:?} frame payload of {} bytes exceeds the limit of {MAX_PAYLOAD}",
                    self.kind,
                    self.payload.len()
                ),
            ));
        }
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(MAGIC);
        h[4..6].copy_from_slice(&VERSION.to_le_bytes());
        h[6] = self.kind as u8;
        h[8..16].copy_from_slice(&self.vm_id.to_le_bytes());
        h[16..24].copy_from_slice(&self.seq.to_le_bytes());
        h[24..28].copy_from_slice(&(self.payload.len() as u32).to_le_bytes());
        let crc = crc32c(&[&h[..28], &self.payload]);
        h[28..32].copy_from_slice(&crc.to_le_bytes());
        w.write_all(&h)?;
        w.write_all(&self.payload)
    }

    /// Reads one frame; `Ok(None)` on a clean end of stream before a header.
    pub fn read_from(r: &mut impl Read) -> Result<Option<Frame>, WireError> {
        let mut h = [0u8; HEADER_LEN];
        let mut got = 0;
        while got < HEADER_LEN {
            match r.read(&mut h[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => return Err(WireError::Io(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        if !has_magic(&h, MAGIC) {
            return Err(WireError::Magic);
        }
        let version = u16_at(&h, 4);
        if version != VERSION {
            return Err(WireError::Version(version));
        }
        let kind = Kind::from_u8(h[6])
            .ok_or_else(|| WireError::Malformed(format!("unknown kind {}", h[6])))?;
        if h[7] != 0 {
            return Err(WireError::Malformed(format!("unknown flags {:#x}", h[7])));
        }
        let len = u32_at(&h, 24);
        if len > MAX_PAYLOAD {
            return Err(WireError::Malformed(format!(
                "payload of {len} bytes exceeds {MAX_PAYLOAD}"
            )));
        }
        let mut payload = Vec::new();
        r.take(len as u64).read_to_end(&mut payload)?;
        if payload.len() != len as usize {
            return Err(WireError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        if crc32c(&[&h[..28], &payload]) != u32_at(&h, 28) {
            return Err(WireError::Checksum);
        }
        Ok(Some(Frame {
            kind,
            vm_id: u64_at(&h, 8),
            seq: u64_at(&h, 16),
            payload,
        }))
    }
}

/// Builds an epoch payload from sections.
pub fn epoch_payload(sections: &[(u8, &[u8])]) -> Vec<u8> {
    let mut out = Vec::with_capacity(sections.iter().map(|s| s.1.len() + 5).sum());
    for (k, b) in sections {
        out.push(*k);
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    out
}

/// Splits an epoch payload into sections; `None` if malformed.
pub fn sections(p: &[u8]) -> Option<Vec<(u8, &[u8])>> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < p.len() {
        let k = *p.get(pos)?;
        let len = u32::from_le_bytes(p.get(pos + 1..pos + 5)?.try_into().ok()?) as usize;
        let body = p.get(pos + 5..pos + 5 + len)?;
        out.push((k, body));
        pos += 5 + len;
    }
    Some(out)
}

/// The hello payload: guest geometry and the epoch the following initial copy belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Guest RAM in bytes.
    pub mem_bytes: u64,
    /// Page size the primary uses.
    pub page_size: u32,
    /// Data disk size in bytes (0 = none).
    pub disk_bytes: u64,
    /// Epoch number of the initial copy: the first epoch of the session is `start_epoch + 1`.
    pub start_epoch: u64,
    /// Random id of the session (0: none; fencing records it as the eligible replica).
    pub session: u64,
}

impl Hello {
    /// Serialises (36 bytes; the 20- and 28-byte forms of earlier primaries lack the start
    /// epoch and the session).
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(36);
        p.extend_from_slice(&self.mem_bytes.to_le_bytes());
        p.extend_from_slice(&self.page_size.to_le_bytes());
        p.extend_from_slice(&self.disk_bytes.to_le_bytes());
        p.extend_from_slice(&self.start_epoch.to_le_bytes());
        p.extend_from_slice(&self.session.to_le_bytes());
        p
    }

    /// Parses a hello payload; `None` if it has neither known length.
    pub fn parse(p: &[u8]) -> Option<Hello> {
        if ![20, 28, 36].contains(&p.len()) {
            return None;
        }
        Some(Hello {
            mem_bytes: u64_at(p, 0),
            page_size: u32_at(p, 8),
            disk_bytes: u64_at(p, 12),
            // Absent in the 20-byte form: reads as 0.
            start_epoch: u64_at(p, 20),
            session: u64_at(p, 28),
        })
    }
}

/// Ack flag: the backup can resume the guest from the acknowledged epoch (its standby QEMU
/// is alive and its copies are consistent).
pub const ACK_CAN_FAIL_OVER: u8 = 1;

/// An acknowledgement of `seq` with the backup's status.
pub fn ack_frame(vm_id: u64, seq: u64, can_fail_over: bool) -> Frame {
    Frame {
        kind: Kind::Ack,
        vm_id,
        seq,
        payload: vec![if can_fail_over { ACK_CAN_FAIL_OVER } else { 0 }],
    }
}

/// Whether an ack says the backup can fail over (an empty payload, from an earlier backup,
/// says nothing and counts as yes).
pub fn ack_can_fail_over(f: &Frame) -> bool {
    f.payload.first().is_none_or(|b| b & ACK_CAN_FAIL_OVER != 0)
}

/// A heartbeat carrying the primary's progress (epochs its loop has completed).
pub fn heartbeat_frame(vm_id: u64, progress: u64) -> Frame {
    Frame {
        kind: Kind::Heartbeat,
        vm_id,
        seq: 0,
        payload: progress.to_le_bytes().to_vec(),
    }
}

/// The progress a heartbeat carries, if any.
pub fn heartbeat_progress(f: &Frame) -> Option<u64> {
    (f.payload.len() >= 8).then(|| u64_at(&f.payload, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_accepts_the_short_form() {
        let h = Hello {
            mem_bytes: 1 << 28,
            page_size: 4096,
            disk_bytes: 1 << 26,
            start_epoch: 77,
            session: 0xfeed,
        };
        assert_eq!(Hello::parse(&h.encode()), Some(h));
        let short = &h.encode()[..20];
        assert_eq!(
            Hello::parse(short),
            Some(Hello {
                start_epoch: 0,
                session: 0,
                ..h
            })
        );
        assert_eq!(
            Hello::parse(&h.encode()[..28]),
            Some(Hello { session: 0, ..h })
        );
        assert_eq!(Hello::parse(&[0; 21]), None);
    }

    #[test]
    fn oversized_payload_is_refused_not_truncated() {
        struct Sink;
        impl Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let f = Frame {
            kind: Kind::Epoch,
            vm_id: 1,
            seq: 1,
            payload: vec![0; MAX_PAYLOAD as usize + 1],
        };
        let e = f.write_to(&mut Sink).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    }

    #[test]
    fn ack_and_heartbeat_payloads() {
        assert!(ack_can_fail_over(&ack_frame(1, 2, true)));
        assert!(!ack_can_fail_over(&ack_frame(1, 2, false)));
        assert_eq!(heartbeat_progress(&heartbeat_frame(1, 42)), Some(42));
        let mut old = heartbeat_frame(1, 0);
        old.payload.clear();
        assert_eq!(heartbeat_progress(&old), None);
        assert!(ack_can_fail_over(&Frame {
            payload: vec![],
            ..ack_frame(1, 2, false)
        }));
    }
}
