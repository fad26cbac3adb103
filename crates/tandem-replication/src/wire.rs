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
//!                    records in etcd as the one whose backup may take over; absent = 0
//!                 [, fencing u8 (1 etcd; 0 none), etcd cluster id u64, hash of the VM's
//!                    ownership key u64 — both daemons must fence the same way; absent:
//!                    no etcd fencing (or an older primary)]]])
//!        2 base chunk (payload: first_pfn u64 + pages) — initial copy of guest memory
//!        3 epoch (payload: sections, each kind u8 + len u32 + bytes:
//!                 1 memory record (tandem-codec), 2 device state, 3 disk writes,
//!                 4 device state as a delta against the previous epoch's (every byte),
//!                 5 parts before this frame u32 — in an epoch sent in parts,
//!                 6 device state as the runs that changed since the previous epoch's —
//!                   what a primary sends; 4 is still applied, from an older primary)
//!        4 ack (backup → primary, seq = committed epoch
//!               [, payload flags u8: bit 0 = the backup can fail over to it
//!               [, promise_ms u32: the backup takes over no sooner than this long after the
//!                  last bytes it received from the primary]])
//!        5 heartbeat (primary → backup [, payload progress u64: epochs the primary's loop
//!               has completed, so a primary whose loop is stuck does not look alive])
//!        6 disk base chunk (payload: offset u64 + bytes) — initial copy of the data disk
//!        7 bye (primary → backup: replication ends on purpose, do not fail over)
//!        8 handover (primary → backup: the guest stopped for good after epoch seq; resume it
//!               now — a planned switch or a primary that is shutting down)
//!        9 fenced (backup → primary: the guest already runs on the backup since epoch seq;
//!               the primary must stop its copy without releasing anything
//!               [, payload session u64: the session the backup took over, which the primary
//!                  checks against its own before believing it])
//!       10 refused (backup → primary: the session is refused, payload: why, UTF-8 ≤ 1 KiB)
//!       11 epoch part (payload: sections as in an epoch — memory record 1, disk writes 3 —
//!               of a part of epoch seq too large for one frame; applied at once, undone
//!               unless the epoch frame of the same seq commits it: see crate::parts)
//! ```
//! `seq` numbers epochs from 1 and keeps counting across sessions (a primary that reconnects
//! sends a new hello whose start epoch is its current epoch, then a new initial copy); base
//! chunks carry 0. A reader checks magic, version, kind, flags, length limit and checksum
//! before returning a frame; a writer refuses a payload over the limit.

use std::io::{Read, Write};
use std::time::Duration;

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
    /// The backup refuses the session (why, in the payload).
    Refused = 10,
    /// A part of epoch `seq`, committed by its epoch frame (see [`crate::parts`]).
    EpochPart = 11,
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
            10 => Kind::Refused,
            11 => Kind::EpochPart,
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
    /// How many parts of the epoch came before this frame, u32 (see [`crate::parts`]);
    /// absent: none.
    pub const PARTS_BEFORE: u8 = 5;
    /// Device state as the runs that changed since the previous epoch's (see
    /// [`crate::devstate`]); what the primary sends since the runs form.
    pub const DEVICE_STATE_RUNS: u8 = 6;
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
        let h = self.header()?;
        w.write_all(&h)?;
        w.write_all(&self.payload)
    }

    /// The frame's header (its checksum covers the payload); a payload over
    /// [`MAX_PAYLOAD`] is refused (`InvalidInput`).
    pub fn header(&self) -> std::io::Result<[u8; HEADER_LEN]> {
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
        Ok(h)
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

/// How a daemon fences, as its hello says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fencing {
    /// An older primary that does not say.
    Unstated,
    /// No fencing: the backup cannot tell a partition from a dead primary.
    None,
    /// An ownership record in an etcd cluster.
    Etcd {
        /// etcd's cluster id (0: the daemon could not ask it yet).
        cluster_id: u64,
        /// Hash of the record's key (prefix and VM id).
        key_hash: u64,
    },
}

impl Fencing {
    /// Why a backup fencing as `self` must refuse a primary fencing as `primary` (`None`: they
    /// agree). A cluster id of 0 (not known yet) matches any.
    pub fn mismatch(&self, primary: &Fencing) -> Option<String> {
        match (self, primary) {
            (Fencing::None, Fencing::None | Fencing::Unstated) => None,
            (Fencing::Etcd { .. }, Fencing::Unstated) => Some(
                "the primary does not fence with etcd (it runs without --etcd, or is an older tandem), this backup does: give both daemons the same --etcd (a backup that fences alone could take over while the primary runs on)".into(),
            ),
            (Fencing::Etcd { .. }, Fencing::None) => Some(
                "the primary runs without --etcd, this backup fences with etcd: give both daemons the same --etcd (a backup that fences alone could take over while the primary runs on)".into(),
            ),
            (Fencing::None | Fencing::Unstated, Fencing::Etcd { .. }) => Some(
                "the primary fences with etcd, this backup runs without --etcd: give both daemons the same --etcd (else both could let output out after a partition)".into(),
            ),
            (
                Fencing::Etcd { cluster_id: a, key_hash: ka },
                Fencing::Etcd { cluster_id: b, key_hash: kb },
            ) => {
                if ka != kb {
                    Some("the primary's ownership record in etcd is another key than this backup's: give both daemons the same --etcd-prefix and --vm-id".into())
                } else if *a != 0 && *b != 0 && a != b {
                    Some(format!("the primary fences in etcd cluster {b:x}, this backup in cluster {a:x}: give both daemons the same --etcd"))
                } else {
                    None
                }
            }
            (Fencing::Unstated, Fencing::None | Fencing::Unstated) => None,
        }
    }
}

/// The hello payload: guest geometry, the epoch the following initial copy belongs to, the
/// session and how the primary fences.
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
    /// Random id of the session (0: none; fencing records it as the one whose backup may
    /// take over).
    pub session: u64,
    /// How the primary fences.
    pub fencing: Fencing,
}

impl Hello {
    /// Serialises: 53 bytes with etcd fencing, else the 36-byte form that earlier backups
    /// read too (a backup that fences reads its missing fencing as "not stated" and refuses
    /// it). The 20- and 28-byte forms of earlier primaries lack the start epoch and the
    /// session.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(53);
        p.extend_from_slice(&self.mem_bytes.to_le_bytes());
        p.extend_from_slice(&self.page_size.to_le_bytes());
        p.extend_from_slice(&self.disk_bytes.to_le_bytes());
        p.extend_from_slice(&self.start_epoch.to_le_bytes());
        p.extend_from_slice(&self.session.to_le_bytes());
        if let Fencing::Etcd {
            cluster_id,
            key_hash,
        } = self.fencing
        {
            p.push(1);
            p.extend_from_slice(&cluster_id.to_le_bytes());
            p.extend_from_slice(&key_hash.to_le_bytes());
        }
        p
    }

    /// Parses a hello payload; `None` if it has no known length or an unknown fencing kind.
    pub fn parse(p: &[u8]) -> Option<Hello> {
        if ![20, 28, 36, 53].contains(&p.len()) {
            return None;
        }
        let fencing = match p.get(36) {
            None => Fencing::Unstated,
            Some(0) => Fencing::None,
            Some(1) => Fencing::Etcd {
                cluster_id: u64_at(p, 37),
                key_hash: u64_at(p, 45),
            },
            Some(_) => return None,
        };
        Some(Hello {
            mem_bytes: u64_at(p, 0),
            page_size: u32_at(p, 8),
            disk_bytes: u64_at(p, 12),
            // Absent in the 20-byte form: reads as 0.
            start_epoch: u64_at(p, 20),
            session: u64_at(p, 28),
            fencing,
        })
    }
}

/// Ack flag: the backup can resume the guest from the acknowledged epoch (its standby QEMU
/// is alive and its copies are consistent).
pub const ACK_CAN_FAIL_OVER: u8 = 1;

/// An acknowledgement of `seq` with the backup's status and its promise: it takes over no
/// sooner than `promise` after the last bytes it received from the primary.
pub fn ack_frame(vm_id: u64, seq: u64, can_fail_over: bool, promise: Duration) -> Frame {
    let mut payload = vec![if can_fail_over { ACK_CAN_FAIL_OVER } else { 0 }];
    let ms = promise.as_millis().min(u32::MAX as u128) as u32;
    payload.extend_from_slice(&ms.to_le_bytes());
    Frame {
        kind: Kind::Ack,
        vm_id,
        seq,
        payload,
    }
}

/// Whether an ack says the backup can fail over (an empty payload, from an earlier backup,
/// says nothing and counts as yes).
pub fn ack_can_fail_over(f: &Frame) -> bool {
    f.payload.first().is_none_or(|b| b & ACK_CAN_FAIL_OVER != 0)
}

/// The backup's promise in an ack (`None`: an earlier backup that makes none).
pub fn ack_promise(f: &Frame) -> Option<Duration> {
    (f.payload.len() >= 5).then(|| Duration::from_millis(u64::from(u32_at(&f.payload, 1))))
}

/// The backup runs the guest since `epoch`, having taken over session `session`.
pub fn fenced_frame(vm_id: u64, epoch: u64, session: u64) -> Frame {
    Frame {
        kind: Kind::Fenced,
        vm_id,
        seq: epoch,
        payload: session.to_le_bytes().to_vec(),
    }
}

/// The session a `fenced` frame says the backup took over (`None`: it does not say).
pub fn fenced_session(f: &Frame) -> Option<u64> {
    (f.payload.len() >= 8).then(|| u64_at(&f.payload, 0))
}

/// Longest reason a `refused` frame carries.
pub const MAX_REFUSAL: usize = 1024;

/// The backup refuses the session, saying why (shortened to [`MAX_REFUSAL`] bytes).
pub fn refused_frame(vm_id: u64, why: &str) -> Frame {
    let mut end = why.len().min(MAX_REFUSAL);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    Frame {
        kind: Kind::Refused,
        vm_id,
        seq: 0,
        payload: why.as_bytes()[..end].to_vec(),
    }
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
            fencing: Fencing::Etcd {
                cluster_id: 1,
                key_hash: 2,
            },
        };
        assert_eq!(Hello::parse(&h.encode()), Some(h));
        let short = &h.encode()[..20];
        assert_eq!(
            Hello::parse(short),
            Some(Hello {
                start_epoch: 0,
                session: 0,
                fencing: Fencing::Unstated,
                ..h
            })
        );
        assert_eq!(
            Hello::parse(&h.encode()[..28]),
            Some(Hello {
                session: 0,
                fencing: Fencing::Unstated,
                ..h
            })
        );
        assert_eq!(
            Hello::parse(&h.encode()[..36]),
            Some(Hello {
                fencing: Fencing::Unstated,
                ..h
            })
        );
        // Without fencing the 36-byte form, which earlier backups read too.
        let none = Hello {
            fencing: Fencing::None,
            ..h
        };
        assert_eq!(none.encode().len(), 36);
        assert_eq!(
            Hello::parse(&none.encode()),
            Some(Hello {
                fencing: Fencing::Unstated,
                ..h
            })
        );
        let mut explicit = h.encode();
        explicit[36] = 0;
        assert_eq!(Hello::parse(&explicit).unwrap().fencing, Fencing::None);
        let mut bad = h.encode();
        bad[36] = 2;
        assert_eq!(Hello::parse(&bad), None);
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
    fn both_daemons_must_fence_the_same_way() {
        let etcd = |c, k| Fencing::Etcd {
            cluster_id: c,
            key_hash: k,
        };
        assert_eq!(Fencing::None.mismatch(&Fencing::None), None);
        assert_eq!(Fencing::None.mismatch(&Fencing::Unstated), None);
        assert_eq!(etcd(1, 2).mismatch(&etcd(1, 2)), None);
        assert_eq!(etcd(0, 2).mismatch(&etcd(1, 2)), None);
        for (b, p) in [
            (Fencing::None, etcd(1, 2)),
            (etcd(1, 2), Fencing::None),
            (etcd(1, 2), Fencing::Unstated),
            (etcd(1, 2), etcd(1, 3)),
            (etcd(1, 2), etcd(4, 2)),
        ] {
            let why = b.mismatch(&p).unwrap();
            assert!(why.contains("--etcd") || why.contains("upgrade"), "{why}");
        }
    }

    #[test]
    fn ack_fenced_and_refused_payloads() {
        let a = ack_frame(1, 2, true, Duration::from_millis(500));
        assert!(ack_can_fail_over(&a));
        assert_eq!(ack_promise(&a), Some(Duration::from_millis(500)));
        assert!(!ack_can_fail_over(&ack_frame(1, 2, false, Duration::ZERO)));
        let old = Frame {
            payload: vec![1],
            ..a.clone()
        };
        assert_eq!(ack_promise(&old), None);
        assert_eq!(fenced_session(&fenced_frame(1, 9, 0xab)), Some(0xab));
        assert_eq!(
            fenced_session(&Frame {
                payload: vec![],
                ..fenced_frame(1, 9, 0xab)
            }),
            None
        );
        let long = "é".repeat(MAX_REFUSAL);
        let r = refused_frame(1, &long);
        assert!(r.payload.len() <= MAX_REFUSAL);
        assert!(std::str::from_utf8(&r.payload).is_ok());
    }

    #[test]
    fn ack_and_heartbeat_payloads() {
        assert!(ack_can_fail_over(&ack_frame(1, 2, true, Duration::ZERO)));
        assert!(!ack_can_fail_over(&ack_frame(1, 2, false, Duration::ZERO)));
        assert_eq!(heartbeat_progress(&heartbeat_frame(1, 42)), Some(42));
        let mut old = heartbeat_frame(1, 0);
        old.payload.clear();
        assert_eq!(heartbeat_progress(&old), None);
        assert!(ack_can_fail_over(&Frame {
            payload: vec![],
            ..ack_frame(1, 2, false, Duration::ZERO)
        }));
    }
}
