//! The primary's side of the protocol, the mirror of [`crate::Backup`]: session start (hello
//! and the initial copy), epoch assembly (memory record, device-state delta, disk writes) and
//! the validation of acknowledgements. No I/O: the daemon moves the frames.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tandem_codec::{Codec, Config, EncodeError, Encoder};

use crate::devstate::encode_runs_into;
use crate::parts::Parts;
use crate::wire::{
    ack_can_fail_over, ack_promise, epoch_payload, fenced_session, section, Fencing, Frame, Hello,
    Kind, HEADER_LEN,
};
use crate::{base_payload, MAX_EPOCH_PAYLOAD};

mod ahead;
pub use ahead::{MemoryJob, MemoryRecord};

const PAGE: usize = tandem_codec::format::PAGE;

/// Why an epoch could not be assembled.
#[derive(Debug, thiserror::Error)]
pub enum PrimaryError {
    /// The memory record could not be encoded.
    #[error("encoding the epoch's memory")]
    Encode(#[from] EncodeError),
    /// An epoch before the session's initial copy.
    #[error("no session: send hello and the initial copy first")]
    NoSession,
    /// The epoch (or one of its parts) would not fit in one frame.
    #[error("epoch {seq} needs {bytes} bytes in one frame, more than the frame limit of {MAX_EPOCH_PAYLOAD} (send it in parts)")]
    TooLarge {
        /// Epoch.
        seq: u64,
        /// Payload size.
        bytes: usize,
    },
    /// A memory record encoded ahead for another epoch than the one assembled.
    #[error("the memory record encoded ahead is of epoch {record_seq} ({record_pages} pages), not of epoch {seq} ({pages} pages)")]
    WrongRecord {
        /// Epoch assembled.
        seq: u64,
        /// Its dirty pages.
        pages: usize,
        /// Epoch of the record.
        record_seq: u64,
        /// Pages of the record.
        record_pages: usize,
    },
    /// A part of the epoch could not be handed on (the link is gone).
    #[error("a part of epoch {seq} could not be sent")]
    PartNotSent {
        /// Epoch.
        seq: u64,
    },
}

/// Why an incoming frame was refused by the primary.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AckError {
    /// Another VM's acknowledgement.
    #[error("ack for VM {got:#x}, this primary runs VM {expected:#x}")]
    WrongVm {
        /// Our VM.
        expected: u64,
        /// VM in the frame.
        got: u64,
    },
    /// An ack for an epoch that was never sent in this session.
    #[error("ack for epoch {got}, which was not sent (sent up to {sent})")]
    NotSent {
        /// Acknowledged epoch.
        got: u64,
        /// Last epoch sent.
        sent: u64,
    },
    /// An ack going backwards.
    #[error("ack for epoch {got} after epoch {acked} was acknowledged")]
    Backwards {
        /// Acknowledged epoch.
        got: u64,
        /// Previously acknowledged.
        acked: u64,
    },
    /// A frame the backup never sends.
    #[error("unexpected {0:?} frame from the backup")]
    Unexpected(Kind),
}

/// What the backup told the primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Epochs up to `seq` are committed; release their output.
    Acked {
        /// Newest committed epoch.
        seq: u64,
        /// Epochs this ack covers with their send time, oldest first.
        epochs: usize,
        /// The backup can resume the guest from it.
        can_fail_over: bool,
        /// The backup takes over no sooner than this long after the last bytes it received
        /// (`None`: an earlier backup that makes no promise).
        promise: Option<Duration>,
    },
    /// The guest runs on the backup since `epoch`, which took over `session` (`None`: it
    /// does not say): stop this copy without releasing anything, once believed.
    Fenced {
        /// The epoch it resumed from.
        epoch: u64,
        /// The session it says it took over.
        session: Option<u64>,
    },
    /// The backup refused the session.
    Refused(String),
    /// A heartbeat.
    Heartbeat,
}

/// Acknowledgement bookkeeping of one session: which epochs were sent and when, which are
/// acknowledged. Shared between the thread that sends and the one that reads acks.
#[derive(Debug)]
pub struct Acks {
    vm_id: u64,
    acked: u64,
    sent: u64,
    inflight: VecDeque<(u64, Instant)>,
    can_fail_over: bool,
}

impl Acks {
    /// A session of `vm_id` whose initial copy belongs to epoch `start`.
    pub fn new(vm_id: u64, start: u64) -> Self {
        Acks {
            vm_id,
            acked: start,
            sent: start,
            inflight: VecDeque::new(),
            can_fail_over: false,
        }
    }

    /// Records that epoch `seq` was handed to the link at `at`.
    pub fn sent(&mut self, seq: u64, at: Instant) {
        self.sent = self.sent.max(seq);
        self.inflight.push_back((seq, at));
    }

    /// Newest acknowledged epoch.
    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// Newest epoch sent.
    pub fn last_sent(&self) -> u64 {
        self.sent
    }

    /// Whether the backup said, in its last ack, that it can fail over.
    pub fn can_fail_over(&self) -> bool {
        self.can_fail_over
    }

    /// Age of the oldest unacknowledged epoch.
    pub fn oldest_unacked(&self, now: Instant) -> Option<Duration> {
        self.inflight
            .front()
            .map(|(_, t)| now.saturating_duration_since(*t))
    }

    /// Validates a frame from the backup. An ack must name this VM and an epoch that was sent
    /// and not yet acknowledged; it acknowledges every earlier epoch too. The send times of
    /// the epochs it covers are appended to `latencies` (send time, epoch).
    pub fn on_frame(
        &mut self,
        f: &Frame,
        latencies: &mut Vec<(u64, Instant)>,
    ) -> Result<Reply, AckError> {
        if f.vm_id != self.vm_id {
            return Err(AckError::WrongVm {
                expected: self.vm_id,
                got: f.vm_id,
            });
        }
        match f.kind {
            Kind::Ack => {
                if f.seq > self.sent {
                    return Err(AckError::NotSent {
                        got: f.seq,
                        sent: self.sent,
                    });
                }
                if f.seq <= self.acked {
                    return Err(AckError::Backwards {
                        got: f.seq,
                        acked: self.acked,
                    });
                }
                self.acked = f.seq;
                self.can_fail_over = ack_can_fail_over(f);
                let mut n = 0;
                while self.inflight.front().is_some_and(|(s, _)| *s <= f.seq) {
                    if let Some((s, t)) = self.inflight.pop_front() {
                        latencies.push((s, t));
                        n += 1;
                    }
                }
                Ok(Reply::Acked {
                    seq: f.seq,
                    epochs: n,
                    can_fail_over: self.can_fail_over,
                    promise: ack_promise(f),
                })
            }
            Kind::Fenced => Ok(Reply::Fenced {
                epoch: f.seq,
                session: fenced_session(f),
            }),
            Kind::Refused => Ok(Reply::Refused(
                String::from_utf8_lossy(&f.payload).into_owned(),
            )),
            Kind::Heartbeat => Ok(Reply::Heartbeat),
            k => Err(AckError::Unexpected(k)),
        }
    }
}

/// One epoch as the primary captured it.
pub struct EpochInput<'a> {
    /// Epoch number (the session's start epoch + 1, + 2, ...).
    pub seq: u64,
    /// Dirty page numbers, ascending.
    pub pfns: &'a [u64],
    /// Their contents.
    pub pages: &'a [u8],
    /// Device state at the checkpoint.
    pub device_state: &'a [u8],
    /// The epoch's disk writes (`None` when the VM has no replicated disk).
    pub disk_writes: Option<&'a [(u64, Vec<u8>)]>,
}

/// Sizes of an assembled epoch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EpochSizes {
    /// Bytes before encoding (pages, device state, disk writes).
    pub raw: u64,
    /// Bytes of the frame on the link.
    pub sent: u64,
    /// Disk writes and their bytes.
    pub disk_writes: u64,
    /// Bytes of disk writes.
    pub disk_bytes: u64,
    /// The zstd level the memory record was encoded at.
    pub level: i32,
    /// Whether the memory record took long run patches (the codec's per-epoch trial).
    pub long_patches: bool,
    /// Whether the memory record sent whole pages as word deltas (the codec's per-epoch
    /// measurement).
    pub word_deltas: bool,
    /// Whether the memory record went without the reference prefix (the codec's check of
    /// whether it pays).
    pub prefix_off: bool,
}

impl EpochSizes {
    /// The raw sizes of epoch `e` (its pages counted from its dirty page numbers, so that a
    /// record encoded ahead, whose pages the input no longer holds, counts them too).
    fn before_encoding(e: &EpochInput<'_>) -> EpochSizes {
        let writes = e.disk_writes.unwrap_or_default();
        let disk_bytes: u64 = writes.iter().map(|w| w.1.len() as u64).sum();
        EpochSizes {
            raw: (e.pfns.len() * PAGE + e.device_state.len()) as u64 + disk_bytes,
            disk_writes: writes.len() as u64,
            disk_bytes,
            ..EpochSizes::default()
        }
    }
}

/// The primary's protocol state: VM id, codec, the encoder's reference state and the
/// previous epoch's device state (for deltas).
pub struct Primary {
    vm_id: u64,
    codec: Codec,
    config: Config,
    enc: Option<Encoder>,
    prev_dev: Vec<u8>,
    dev_delta: Vec<u8>,
    rec: Vec<u8>,
    session: u64,
    fencing: Fencing,
}

impl Primary {
    /// A primary for `vm_id` encoding memory with `codec`.
    pub fn new(vm_id: u64, codec: Codec, config: Config) -> Self {
        Primary {
            vm_id,
            codec,
            config,
            enc: None,
            prev_dev: Vec::new(),
            dev_delta: Vec::new(),
            rec: Vec::new(),
            session: 0,
            fencing: Fencing::None,
        }
    }

    /// The zstd level of the next memory records (tandem_codec::level chooses it per epoch).
    pub fn set_level(&mut self, level: i32) {
        if let Some(e) = self.enc.as_mut() {
            e.set_level(level);
        }
    }

    /// The protected VM.
    pub fn vm_id(&self) -> u64 {
        self.vm_id
    }

    fn frame(&self, kind: Kind, seq: u64, payload: Vec<u8>) -> Frame {
        Frame {
            kind,
            vm_id: self.vm_id,
            seq,
            payload,
        }
    }

    /// Sets the id the next hello carries (fencing records it in etcd as the session whose
    /// backup may take over).
    pub fn set_session(&mut self, session: u64) {
        self.session = session;
    }

    /// The session of the last hello.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// How this primary fences (its hellos say it; default: no fencing).
    pub fn set_fencing(&mut self, fencing: Fencing) {
        self.fencing = fencing;
    }

    /// Starts a session whose initial copy is `ram` (and the disk the caller sends) at epoch
    /// `start`: returns the hello frame. The encoder's reference becomes `ram`.
    pub fn begin(
        &mut self,
        start: u64,
        ram: &[u8],
        disk_bytes: u64,
    ) -> Result<Frame, PrimaryError> {
        let hello = self.hello(start, ram.len() as u64, disk_bytes);
        self.set_reference(ram)?;
        Ok(hello)
    }

    /// Starts a session of a guest of `mem_bytes` at epoch `start` whose initial copy is sent
    /// in rounds while it runs: returns the hello frame. No epoch can be encoded until
    /// [`Primary::set_reference`] says what the backup holds.
    pub fn hello(&mut self, start: u64, mem_bytes: u64, disk_bytes: u64) -> Frame {
        self.enc = None;
        self.prev_dev.clear();
        let hello = Hello {
            mem_bytes,
            page_size: tandem_codec::format::PAGE as u32,
            disk_bytes,
            start_epoch: start,
            session: self.session,
            fencing: self.fencing,
        };
        self.frame(Kind::Hello, 0, hello.encode())
    }

    /// The backup's memory after the initial copy is `ram`: the encoder's reference.
    pub fn set_reference(&mut self, ram: &[u8]) -> Result<(), PrimaryError> {
        self.enc = Some(Encoder::new(self.codec, ram, self.config)?);
        Ok(())
    }

    /// One base frame: `pages` from page `first` on, whatever they hold (a pre-copy round
    /// sends pages the guest wrote, zeros included).
    pub fn base_frame(&self, first: u64, pages: &[u8]) -> Frame {
        self.frame(Kind::Base, 0, base_payload(first, pages))
    }

    /// One disk-base frame for a write of the guest during the initial copy, zeros included.
    pub fn disk_write_frame(&self, offset: u64, data: &[u8]) -> Frame {
        self.frame(Kind::DiskBase, 0, base_payload(offset, data))
    }

    /// The initial copy of memory: runs of non-zero pages (the backup starts from zeros), at
    /// most `max_pages` each.
    pub fn base_frames<'a>(
        &'a self,
        ram: &'a [u8],
        max_pages: usize,
    ) -> impl Iterator<Item = Frame> + 'a {
        crate::nonzero_runs(ram, max_pages)
            .map(move |(first, run)| self.frame(Kind::Base, 0, base_payload(first, run)))
    }

    /// The initial copy of the data disk: its non-zero chunks of `chunk` bytes.
    pub fn disk_base_frames<'a>(
        &'a self,
        disk: &'a [u8],
        chunk: usize,
    ) -> impl Iterator<Item = Frame> + 'a {
        disk.chunks(chunk.max(1))
            .enumerate()
            .filter(|(_, c)| c.iter().any(|&b| b != 0))
            .map(move |(i, c)| self.frame(Kind::DiskBase, 0, base_payload((i * chunk) as u64, c)))
    }

    /// One disk-base frame for `data` at `offset` of the data disk (`None` if it is all
    /// zeros: the backup's copy starts zeroed).
    pub fn disk_base_frame(&self, offset: u64, data: &[u8]) -> Option<Frame> {
        data.iter()
            .any(|&b| b != 0)
            .then(|| self.frame(Kind::DiskBase, 0, base_payload(offset, data)))
    }

    /// Assembles epoch `e` into one frame and advances the encoder and device-state
    /// reference. An epoch too large for one frame is refused and ends the session: use
    /// [`Primary::epoch_parts`] for epochs of any size.
    pub fn epoch(&mut self, e: &EpochInput<'_>) -> Result<(Frame, EpochSizes), PrimaryError> {
        self.epoch_parts(e, Parts::WHOLE, |_| {
            unreachable!("an epoch assembled whole has no parts")
        })
    }

    /// Assembles epoch `e`, split as `limits` says: every part but the last goes to `part` as
    /// an [`Kind::EpochPart`] frame as soon as it is encoded (so that at most one part is held
    /// here); the last, with the device state, is returned as the [`Kind::Epoch`] frame that
    /// commits them all on the backup. `part` returning false (the link is gone) ends the
    /// session: the encoder has moved past what the backup holds.
    pub fn epoch_parts(
        &mut self,
        e: &EpochInput<'_>,
        limits: Parts,
        mut part: impl FnMut(Frame) -> bool,
    ) -> Result<(Frame, EpochSizes), PrimaryError> {
        if self.enc.is_none() {
            return Err(PrimaryError::NoSession);
        }
        let plan = limits.split(e.pfns.len(), e.disk_writes);
        let mut sizes = EpochSizes::before_encoding(e);
        let n = plan.len();
        for (i, (pages, disk)) in plan.into_iter().enumerate() {
            let last = i + 1 == n;
            let pfns = &e.pfns[pages.clone()];
            let data = &e.pages[pages.start * PAGE..pages.end * PAGE];
            let whole = last.then_some(e);
            let result = self.part_payload(e.seq, i as u32, pfns, data, disk.as_deref(), whole);
            let (payload, stats) = match result {
                Ok(p) => p,
                Err(err) => {
                    // The encoder's state may be past this epoch (EncodeError::Diverged, or
                    // parts already sent) and the backup never gets all of it: the session
                    // is over.
                    self.enc = None;
                    return Err(err);
                }
            };
            sizes.sent += (payload.len() + HEADER_LEN) as u64;
            sizes.level = stats.level;
            sizes.long_patches |= stats.long_patches;
            sizes.word_deltas |= stats.word_deltas;
            sizes.prefix_off |= stats.prefix_off;
            if last {
                return Ok((self.frame(Kind::Epoch, e.seq, payload), sizes));
            }
            if !part(self.frame(Kind::EpochPart, e.seq, payload)) {
                self.enc = None;
                return Err(PrimaryError::PartNotSent { seq: e.seq });
            }
        }
        unreachable!("Parts::split returns at least one part")
    }

    /// The payload of part `index`: the memory record of `pfns` (possibly none), its disk
    /// writes and, for the last part (`whole` is the epoch), the device-state delta.
    fn part_payload(
        &mut self,
        seq: u64,
        index: u32,
        pfns: &[u64],
        data: &[u8],
        disk: Option<&[(u64, Vec<u8>)]>,
        whole: Option<&EpochInput<'_>>,
    ) -> Result<(Vec<u8>, tandem_codec::EncodeStats), PrimaryError> {
        let enc = self.enc.as_mut().ok_or(PrimaryError::NoSession)?;
        let mut rec = std::mem::take(&mut self.rec);
        rec.clear();
        let out = match enc.encode(seq, pfns, data, &mut rec) {
            Ok(stats) => self
                .assemble(seq, index, &rec, disk, whole)
                .map(|p| (p, stats)),
            Err(e) => Err(e.into()),
        };
        self.rec = rec;
        out
    }

    /// A payload of the memory record `rec`, the disk writes `disk` and, for the last part
    /// (`whole` is the epoch), the device-state delta (which advances its reference).
    fn assemble(
        &mut self,
        seq: u64,
        index: u32,
        rec: &[u8],
        disk: Option<&[(u64, Vec<u8>)]>,
        whole: Option<&EpochInput<'_>>,
    ) -> Result<Vec<u8>, PrimaryError> {
        let mut secs: Vec<(u8, &[u8])> = vec![(section::MEMORY, rec)];
        if let Some(e) = whole {
            encode_runs_into(&mut self.prev_dev, e.device_state, &mut self.dev_delta);
            secs.push((section::DEVICE_STATE_RUNS, &self.dev_delta));
        }
        let disk = disk.map(tandem_disk::encode_writes);
        if let Some(d) = &disk {
            secs.push((section::DISK, d));
        }
        // How many parts came before this frame (absent in an epoch sent whole).
        let before = index.to_le_bytes();
        if index > 0 || whole.is_none() {
            secs.push((section::PARTS_BEFORE, &before));
        }
        let payload = epoch_payload(&secs);
        if payload.len() > MAX_EPOCH_PAYLOAD {
            return Err(PrimaryError::TooLarge {
                seq,
                bytes: payload.len(),
            });
        }
        Ok(payload)
    }

    /// A heartbeat carrying `progress` (epochs completed by the primary's loop).
    pub fn heartbeat(&self, progress: u64) -> Frame {
        crate::wire::heartbeat_frame(self.vm_id, progress)
    }

    /// Ends replication on purpose: the backup must not fail over.
    pub fn bye(&self) -> Frame {
        self.frame(Kind::Bye, 0, Vec::new())
    }

    /// The guest stopped for good after epoch `seq`: the backup resumes it.
    pub fn handover(&self, seq: u64) -> Frame {
        self.frame(Kind::Handover, seq, Vec::new())
    }
}
