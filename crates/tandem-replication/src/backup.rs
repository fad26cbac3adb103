//! The backup's side of an epoch: verify everything, then commit disk writes, memory and
//! device state together, or change nothing.
//!
//! The backup can resume the guest only from a *consistent* mirror: one that holds exactly a
//! committed epoch (memory, device state and disk copy of the same checkpoint). A new session's
//! initial copy makes it inconsistent until that session's first epoch commits.

use tandem_codec::{decode, DecodeError, Plan};

use crate::disk::{apply_all, DiskApplyError, DiskCopy};
use crate::keeper::{PageKeeper, Plain};
use crate::staged::Staged;
use crate::wire::{heartbeat_progress, section, sections, Fencing, Frame, Hello, Kind};

/// Why the backup refused a frame. The mirror, the disk copy and the committed epoch are
/// unchanged (except for [`ApplyError::DiskInconsistent`], after which the backup can no
/// longer fail over until a new initial copy).
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The frame belongs to another VM.
    #[error("frame for VM {got:#x}, this backup protects VM {expected:#x}")]
    WrongVm {
        /// Protected VM.
        expected: u64,
        /// VM in the frame.
        got: u64,
    },
    /// An epoch was skipped or repeated.
    #[error("epoch sequence gap: expected epoch {expected}, got {got}")]
    SeqGap {
        /// Next epoch expected.
        expected: u64,
        /// Epoch received.
        got: u64,
    },
    /// Something arrived before `hello`.
    #[error("{0:?} frame before hello")]
    BeforeHello(Kind),
    /// Guest geometry does not match the mirror.
    #[error("guest geometry mismatch: {0}")]
    Geometry(String),
    /// The primary fences otherwise than this backup.
    #[error("fencing mismatch: {0}")]
    Fencing(String),
    /// Structure is wrong.
    #[error("malformed {0}")]
    Malformed(String),
    /// The memory record failed verification.
    #[error("epoch memory record rejected")]
    Decode(#[from] DecodeError),
    /// Writing the backup's disk copy failed; the epoch's writes were undone.
    #[error("the epoch's disk writes could not be applied (undone; the copy stays at the committed epoch)")]
    DiskIo(#[source] std::io::Error),
    /// The mirror could not get memory back for the pages the epoch reads or writes (a
    /// page keeper that keeps pages elsewhere); nothing of the epoch was applied.
    #[error("the mirror could not get memory back for the epoch's pages (not applied)")]
    MirrorMemory(#[source] std::io::Error),
    /// Writing the disk copy failed and could not be undone.
    #[error(
        "the backup's disk copy is inconsistent; it cannot fail over until a new initial copy"
    )]
    DiskInconsistent(#[source] DiskApplyError),
}

/// What a handled frame did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Session established; a new initial copy follows.
    Hello,
    /// Initial memory chunk stored.
    Base,
    /// Epoch committed; acknowledge it.
    Committed(u64),
    /// Liveness, with the primary's progress if it sent it.
    Heartbeat(Option<u64>),
    /// Initial disk chunk stored.
    DiskBase,
    /// The primary ended replication on purpose.
    Bye,
    /// The primary stopped its guest for good after the committed epoch: resume it now.
    Handover(u64),
    /// A part of epoch `seq` applied, to be committed by its epoch frame (no acknowledgement).
    Part(u64),
}

const PAGE: usize = tandem_codec::format::PAGE;

/// Backup state: the RAM mirror (any byte buffer or mapping of the guest's size) and where its
/// pages are kept (`K`, [`Plain`] by default: all in the mirror), the disk copy, the device
/// state of the last committed epoch, and its sequence number.
pub struct Backup<M, K = Plain> {
    vm_id: Option<u64>,
    mirror: M,
    disk: Option<Box<dyn DiskCopy + Send>>,
    committed: u64,
    consistent: bool,
    device_state: Vec<u8>,
    plan: Plan,
    session: u64,
    fencing: Fencing,
    keeper: K,
    /// Parts of the next epoch applied but not committed (their undo log).
    staged: Option<Staged>,
}

/// The sections of one epoch or epoch-part frame, parsed and checked but not applied.
struct Sections<'a> {
    memory: &'a [u8],
    /// `None` in a part (the epoch frame carries it).
    device_state: Option<Vec<u8>>,
    writes: Vec<(u64, &'a [u8])>,
}

fn le_u64(b: Option<&[u8]>) -> Option<u64> {
    Some(u64::from_le_bytes(b?.try_into().ok()?))
}

impl<M: AsRef<[u8]> + AsMut<[u8]>> Backup<M> {
    /// A backup writing into `mirror` (guest-sized), every page kept in it.
    pub fn new(mirror: M) -> Self {
        Backup::with_keeper(mirror, Plain)
    }
}

impl<M: AsRef<[u8]> + AsMut<[u8]>, K: PageKeeper> Backup<M, K> {
    /// A backup writing into `mirror` (guest-sized) whose pages `keeper` keeps.
    pub fn with_keeper(mirror: M, keeper: K) -> Self {
        Backup {
            vm_id: None,
            mirror,
            disk: None,
            committed: 0,
            consistent: false,
            device_state: Vec::new(),
            plan: Plan::default(),
            session: 0,
            fencing: Fencing::None,
            keeper,
            staged: None,
        }
    }

    /// How this backup fences: a hello of a primary that fences otherwise is refused
    /// before anything changes (default: no fencing).
    pub fn set_fencing(&mut self, fencing: Fencing) {
        self.fencing = fencing;
    }

    /// The page keeper.
    pub fn keeper(&self) -> &K {
        &self.keeper
    }

    /// The page keeper, to change it (e.g. a lazy restore that takes the pages kept elsewhere
    /// out of it at failover).
    pub fn keeper_mut(&mut self) -> &mut K {
        &mut self.keeper
    }

    /// Puts every page kept elsewhere back into the mirror (before a standby resumes from
    /// it). Returns the pages written; an error when their memory cannot be allocated (a full
    /// tmpfs), before any is written.
    pub fn materialise(&mut self) -> std::io::Result<u64> {
        self.discard_partial();
        self.keeper.materialise(self.mirror.as_mut())
    }

    /// Undoes the parts of an epoch whose epoch frame has not come (the link ended inside a
    /// large epoch): the mirror holds the committed epoch again. Returns the epoch undone.
    /// Call it when a connection ends; [`Backup::handle`] calls it for a frame it refuses.
    pub fn discard_partial(&mut self) -> Option<u64> {
        let staged = self.staged.take()?;
        let seq = staged.seq;
        let pfns = staged.undo(self.mirror.as_mut());
        self.keeper.written(&pfns);
        Some(seq)
    }

    /// The epoch some of whose parts are applied but not committed, and the bytes its undo
    /// log holds.
    pub fn partial(&self) -> Option<(u64, u64)> {
        self.staged.as_ref().map(|s| (s.seq, s.bytes()))
    }

    /// Also keeps a copy of the guest's data disk.
    pub fn with_disk(mut self, disk: Box<dyn DiskCopy + Send>) -> Self {
        self.disk = Some(disk);
        self
    }

    fn disk_size(&self) -> u64 {
        self.disk.as_ref().map_or(0, |d| d.size())
    }

    /// Last committed epoch (0 = none).
    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// Whether mirror, device state and disk copy hold exactly the committed epoch, so the
    /// guest can be resumed from them.
    pub fn consistent(&self) -> bool {
        self.consistent
    }

    /// The session id of the current initial copy's hello (0: none or an older primary).
    pub fn session(&self) -> u64 {
        self.session
    }

    /// The protected VM, once a primary said hello.
    pub fn vm_id(&self) -> Option<u64> {
        self.vm_id
    }

    /// Device state of the last committed epoch.
    pub fn device_state(&self) -> &[u8] {
        &self.device_state
    }

    /// The mirror.
    pub fn mirror(&self) -> &[u8] {
        self.mirror.as_ref()
    }

    /// Handles one frame from the primary.
    pub fn handle(&mut self, f: &Frame) -> Result<Applied, ApplyError> {
        let vm = match (self.vm_id, f.kind) {
            (None, Kind::Hello) => f.vm_id,
            (None, k) => return Err(ApplyError::BeforeHello(k)),
            (Some(v), _) => v,
        };
        if f.vm_id != vm {
            return Err(ApplyError::WrongVm {
                expected: vm,
                got: f.vm_id,
            });
        }
        if matches!(f.kind, Kind::Hello | Kind::Bye | Kind::Handover) {
            // A new session, or the end of this one: parts of an epoch that was not
            // committed are void.
            self.discard_partial();
        }
        let r = self.dispatch(f);
        if r.is_err() {
            // Nothing of a refused frame's epoch stays applied.
            self.discard_partial();
        }
        r
    }

    fn dispatch(&mut self, f: &Frame) -> Result<Applied, ApplyError> {
        match f.kind {
            Kind::Hello => self.hello(f),
            Kind::Base => self.base(f),
            Kind::DiskBase => self.disk_base(f),
            Kind::Epoch => self.epoch(f),
            Kind::EpochPart => self.epoch_part(f),
            Kind::Heartbeat => Ok(Applied::Heartbeat(heartbeat_progress(f))),
            Kind::Bye => {
                // The guest is shut down on purpose: nothing may resume it later.
                self.consistent = false;
                Ok(Applied::Bye)
            }
            Kind::Handover => {
                if !self.consistent || f.seq != self.committed {
                    return Err(ApplyError::Malformed(format!(
                        "handover after epoch {}, this backup holds epoch {} ({})",
                        f.seq,
                        self.committed,
                        if self.consistent {
                            "consistent"
                        } else {
                            "not consistent"
                        }
                    )));
                }
                Ok(Applied::Handover(f.seq))
            }
            Kind::Ack | Kind::Fenced | Kind::Refused => Err(ApplyError::Malformed(format!(
                "{:?} frame sent to a backup",
                f.kind
            ))),
        }
    }

    fn hello(&mut self, f: &Frame) -> Result<Applied, ApplyError> {
        let h = Hello::parse(&f.payload)
            .ok_or_else(|| ApplyError::Malformed("hello payload".into()))?;
        let mirror_len = self.mirror.as_ref().len() as u64;
        if h.page_size as usize != PAGE || h.mem_bytes != mirror_len {
            return Err(ApplyError::Geometry(format!(
                "primary has {} bytes in {}-byte pages, mirror has {mirror_len} in {PAGE}",
                h.mem_bytes, h.page_size
            )));
        }
        if h.disk_bytes != self.disk_size() {
            return Err(ApplyError::Geometry(format!(
                "primary has a {}-byte data disk, this backup keeps {} bytes (start both with the same --disk-mib)",
                h.disk_bytes,
                self.disk_size()
            )));
        }
        if let Some(why) = self.fencing.mismatch(&h.fencing) {
            return Err(ApplyError::Fencing(why));
        }
        // A new initial copy follows; it sends only non-zero pages and disk chunks, so start
        // again from zeros. Until its first epoch commits there is nothing to resume — and
        // from the first byte changed on there is nothing consistent, even if zeroing fails
        // half way (a failed disk zeroing must not leave a mirror of zeros marked
        // consistent).
        self.consistent = false;
        self.session = 0;
        self.device_state.clear();
        if !self.keeper.reset(self.mirror.as_mut()) && self.vm_id.is_some() {
            self.mirror.as_mut().fill(0);
        }
        if self.vm_id.is_some() {
            if let Some(d) = self.disk.as_mut() {
                d.zero().map_err(ApplyError::DiskIo)?;
            }
        }
        self.consistent = false;
        self.committed = h.start_epoch;
        self.session = h.session;
        self.device_state.clear();
        self.vm_id = Some(f.vm_id);
        Ok(Applied::Hello)
    }

    fn base(&mut self, f: &Frame) -> Result<Applied, ApplyError> {
        if self.consistent {
            return Err(ApplyError::Malformed(
                "base chunk after the session's first epoch".into(),
            ));
        }
        let p = &f.payload;
        let data = p.get(8..).unwrap_or_default();
        let m = self.mirror.as_mut();
        let at = le_u64(p.get(..8)).and_then(|first| {
            let o = usize::try_from(first).ok()?.checked_mul(PAGE)?;
            (o.checked_add(data.len())? <= m.len() && data.len() % PAGE == 0).then_some(o)
        });
        let o = at.ok_or_else(|| ApplyError::Malformed("base chunk outside the guest".into()))?;
        // The chunk replaces these pages whole, wherever they are kept now.
        let (first, n) = ((o / PAGE) as u64, (data.len() / PAGE) as u64);
        self.keeper
            .overwrite(m, first, n)
            .map_err(ApplyError::MirrorMemory)?;
        m[o..o + data.len()].copy_from_slice(data);
        Ok(Applied::Base)
    }

    fn disk_base(&mut self, f: &Frame) -> Result<Applied, ApplyError> {
        if self.consistent {
            return Err(ApplyError::Malformed(
                "disk base chunk after the session's first epoch".into(),
            ));
        }
        let size = self.disk_size();
        let p = &f.payload;
        let data = p.get(8..).unwrap_or_default();
        let off = le_u64(p.get(..8)).filter(|off| {
            off.checked_add(data.len() as u64)
                .is_some_and(|e| e <= size)
        });
        match (off, self.disk.as_mut()) {
            (Some(off), Some(d)) => {
                d.write_at(off, data).map_err(ApplyError::DiskIo)?;
                Ok(Applied::DiskBase)
            }
            _ => Err(ApplyError::Malformed("disk chunk outside the disk".into())),
        }
    }

    /// Splits and checks the sections of an epoch or a part of one (nothing is applied).
    fn parse_epoch<'a>(&self, f: &'a Frame) -> Result<Sections<'a>, ApplyError> {
        let secs =
            sections(&f.payload).ok_or_else(|| ApplyError::Malformed("epoch sections".into()))?;
        let (mut memory, mut disk, mut before) = (None, None, None);
        // At most one device-state section, of any of its three forms: (kind, bytes).
        let mut dev: Option<(u8, &[u8])> = None;
        for (k, b) in secs {
            let slot = match k {
                section::MEMORY => &mut memory,
                section::DISK => &mut disk,
                section::PARTS_BEFORE => &mut before,
                section::DEVICE_STATE
                | section::DEVICE_STATE_DELTA
                | section::DEVICE_STATE_RUNS => {
                    if dev.replace((k, b)).is_some() {
                        return Err(ApplyError::Malformed(
                            "epoch needs exactly one device-state section".into(),
                        ));
                    }
                    continue;
                }
                other => {
                    return Err(ApplyError::Malformed(format!(
                        "unknown epoch section {other}"
                    )))
                }
            };
            if slot.replace(b).is_some() {
                return Err(ApplyError::Malformed(format!("section {k} repeated")));
            }
        }
        let memory = memory.ok_or_else(|| ApplyError::Malformed("epoch without memory".into()))?;
        let device_state = match (dev, f.kind) {
            (None, Kind::EpochPart) => None,
            (Some(_), Kind::EpochPart) => {
                return Err(ApplyError::Malformed(
                    "device state in a part of an epoch (only its epoch frame has it)".into(),
                ))
            }
            (None, _) => {
                return Err(ApplyError::Malformed(
                    "epoch needs exactly one device-state section".into(),
                ))
            }
            (Some((section::DEVICE_STATE, d)), _) => Some(d.to_vec()),
            (Some((section::DEVICE_STATE_DELTA, d)), _) => Some(
                crate::devstate::decode_delta(&self.device_state, d)
                    .map_err(|e| ApplyError::Malformed(e.to_string()))?,
            ),
            // DEVICE_STATE_RUNS, the one other kind the loop puts in the slot.
            (Some((_, d)), _) => Some(
                crate::devstate::decode_runs(&self.device_state, d)
                    .map_err(|e| ApplyError::Malformed(e.to_string()))?,
            ),
        };
        let writes = match disk {
            None => Vec::new(),
            Some(_) if self.disk.is_none() => {
                return Err(ApplyError::Malformed(
                    "disk writes for a backup without a disk copy".into(),
                ))
            }
            Some(b) => tandem_disk::decode_writes(b, self.disk_size()).ok_or_else(|| {
                ApplyError::Malformed("disk section (a write outside the disk?)".into())
            })?,
        };
        let parts_before = match before.map(<[u8; 4]>::try_from) {
            None => 0,
            Some(Ok(b)) => u32::from_le_bytes(b) as u64,
            Some(Err(_)) => return Err(ApplyError::Malformed("parts section".into())),
        };
        let staged = self.staged.as_ref().map_or(0, |s| s.parts);
        if parts_before != staged {
            return Err(ApplyError::Malformed(format!(
                "{:?} frame of epoch {} after {parts_before} parts, {staged} arrived",
                f.kind, f.seq
            )));
        }
        Ok(Sections {
            memory,
            device_state,
            writes,
        })
    }

    /// Decodes a memory record of epoch `seq` against the mirror into the plan (nothing is
    /// applied).
    fn decode_memory(&mut self, record: &[u8], seq: u64) -> Result<(), ApplyError> {
        self.restore_reads(record)?;
        decode(record, self.mirror.as_ref(), &mut self.plan)?;
        if self.plan.epoch != seq {
            return Err(ApplyError::Malformed(format!(
                "memory record of epoch {} in frame of epoch {seq}",
                self.plan.epoch
            )));
        }
        Ok(())
    }

    /// Epoch `seq` must be the next one: no gap, no repeat.
    fn check_next(&self, seq: u64) -> Result<(), ApplyError> {
        if seq != self.committed + 1 {
            return Err(ApplyError::SeqGap {
                expected: self.committed + 1,
                got: seq,
            });
        }
        Ok(())
    }

    /// Applies a part of the next epoch at once, keeping what it overwrites (see
    /// [`crate::parts`]); its epoch frame commits it, anything else undoes it.
    fn epoch_part(&mut self, f: &Frame) -> Result<Applied, ApplyError> {
        self.check_next(f.seq)?;
        let sections = self.parse_epoch(f)?;
        self.decode_memory(sections.memory, f.seq)?;
        // The old contents of the pages it writes must be in the mirror to be kept.
        if self.keeper.keeps_pages_elsewhere() {
            self.keeper
                .restore(self.mirror.as_mut(), Some(&self.plan.pfns))
                .map_err(ApplyError::MirrorMemory)?;
        }
        let staged = self.staged.get_or_insert_with(|| Staged::new(f.seq));
        staged.save(self.mirror.as_ref(), &self.plan.pfns);
        staged
            .writes
            .extend(sections.writes.iter().map(|&(o, d)| (o, d.to_vec())));
        staged.parts += 1;
        self.plan.commit(self.mirror.as_mut());
        self.keeper.written(&self.plan.pfns);
        Ok(Applied::Part(f.seq))
    }

    fn epoch(&mut self, f: &Frame) -> Result<Applied, ApplyError> {
        self.check_next(f.seq)?;
        let sections = self.parse_epoch(f)?;
        self.decode_memory(sections.memory, f.seq)?;
        // Everything verified: commit disk writes — the parts' and the epoch's, all or
        // nothing — memory and device state. A refusal from here on undoes the parts too
        // (`handle`).
        if let Some(d) = self.disk.as_mut() {
            // The parts' writes first, in order; an epoch sent whole has only its own.
            let writes: std::borrow::Cow<'_, [(u64, &[u8])]> = match &self.staged {
                None => sections.writes.as_slice().into(),
                Some(st) => (st.writes.iter().map(|(o, d)| (*o, d.as_slice())))
                    .chain(sections.writes.iter().copied())
                    .collect::<Vec<_>>()
                    .into(),
            };
            match apply_all(d.as_mut(), &writes) {
                Ok(()) => {}
                Err(DiskApplyError::Undone(e)) => return Err(ApplyError::DiskIo(e)),
                Err(e) => {
                    self.consistent = false;
                    return Err(ApplyError::DiskInconsistent(e));
                }
            }
        }
        self.staged = None;
        self.plan.commit(self.mirror.as_mut());
        self.device_state = sections.device_state.unwrap_or_default();
        self.committed = f.seq;
        self.consistent = true;
        self.keeper.written(&self.plan.pfns);
        Ok(Applied::Committed(f.seq))
    }

    /// Puts the pages the memory record reads back into the mirror, if the keeper keeps any
    /// elsewhere. Changes no content, so a record refused afterwards leaves the epoch
    /// unapplied.
    fn restore_reads(&mut self, record: &[u8]) -> Result<(), ApplyError> {
        if !self.keeper.keeps_pages_elsewhere() {
            return Ok(());
        }
        let m = self.mirror.as_mut();
        let pfns = tandem_codec::pages_read_with(record, (m.len() / PAGE) as u64, &mut self.plan)?;
        // `None`: a record that may read and write anywhere — the whole mirror.
        self.keeper
            .restore(m, pfns.as_deref())
            .map_err(ApplyError::MirrorMemory)
    }

    /// Background work of the page keeper (consolidation's clock). Call it after
    /// acknowledging an epoch, so that it is not in the acknowledgement's latency.
    pub fn tick(&mut self) {
        self.keeper.tick(self.mirror.as_mut());
    }
}
