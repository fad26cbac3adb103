//! The backup's side of an epoch: verify everything, then commit disk writes, memory and
//! device state together, or change nothing.

use tandem_codec::{decode, DecodeError, Plan};

use crate::wire::{section, sections, Frame, Kind};

/// Why the backup refused a frame. The mirror and the committed epoch are unchanged.
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
    /// Structure is wrong.
    #[error("malformed {0}")]
    Malformed(String),
    /// The memory record failed verification.
    #[error("epoch memory record rejected")]
    Decode(#[from] DecodeError),
    /// Writing the backup's disk copy failed (a local I/O error: this backup can no longer
    /// guarantee a consistent failover).
    #[error("writing the backup's disk copy failed; this backup is no longer consistent")]
    DiskIo(#[source] std::io::Error),
}

/// The backup's copy of the guest's data disk.
pub trait DiskCopy {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Writes `data` at `offset` (inside the size; checked by the caller).
    fn write_at(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()>;
    /// Makes the whole disk zeros again (a new initial copy starts).
    fn zero(&mut self) -> std::io::Result<()>;
}

impl DiskCopy for Vec<u8> {
    fn size(&self) -> u64 {
        self.len() as u64
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn zero(&mut self) -> std::io::Result<()> {
        self.fill(0);
        Ok(())
    }
}

/// A disk copy in a raw image file.
pub struct FileDisk {
    file: std::fs::File,
    size: u64,
}

impl FileDisk {
    /// Uses `file` (its current length is the disk size).
    pub fn new(file: std::fs::File) -> std::io::Result<Self> {
        let size = file.metadata()?.len();
        Ok(FileDisk { file, size })
    }
}

impl DiskCopy for FileDisk {
    fn size(&self) -> u64 {
        self.size
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.file, data, offset)
    }
    fn zero(&mut self) -> std::io::Result<()> {
        // Truncate and extend: the file becomes sparse zeros of the same size.
        self.file.set_len(0)?;
        self.file.set_len(self.size)
    }
}

/// What a handled frame did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Session established.
    Hello,
    /// Initial memory chunk stored.
    Base,
    /// Epoch committed; acknowledge it.
    Committed(u64),
    /// Liveness only.
    Heartbeat,
    /// Initial disk chunk stored.
    DiskBase,
    /// The primary ended replication on purpose.
    Bye,
}

const PAGE: usize = tandem_codec::format::PAGE;

/// Backup state: the RAM mirror (any byte buffer or mapping of the guest's size), the
/// device state of the last committed epoch, and its sequence number.
pub struct Backup<M> {
    vm_id: Option<u64>,
    mirror: M,
    disk: Option<Box<dyn DiskCopy + Send>>,
    committed: u64,
    device_state: Vec<u8>,
    plan: Plan,
}

impl<M: AsRef<[u8]> + AsMut<[u8]>> Backup<M> {
    /// A backup writing into `mirror` (guest-sized).
    pub fn new(mirror: M) -> Self {
        Backup {
            vm_id: None,
            mirror,
            disk: None,
            committed: 0,
            device_state: Vec::new(),
            plan: Plan::default(),
        }
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
        match f.kind {
            Kind::Hello => {
                let p = &f.payload;
                if p.len() != 20 {
                    return Err(ApplyError::Malformed("hello payload".into()));
                }
                let mem = u64::from_le_bytes(p[..8].try_into().unwrap_or_default());
                let ps = u32::from_le_bytes(p[8..12].try_into().unwrap_or_default());
                let disk = u64::from_le_bytes(p[12..20].try_into().unwrap_or_default());
                if ps as usize != PAGE || mem != self.mirror.as_ref().len() as u64 {
                    return Err(ApplyError::Geometry(format!(
                        "primary has {mem} bytes in {ps}-byte pages, mirror has {} in {PAGE}",
                        self.mirror.as_ref().len()
                    )));
                }
                if disk != self.disk_size() {
                    return Err(ApplyError::Geometry(format!(
                        "primary has a {disk}-byte data disk, this backup keeps {} bytes (start both with the same --disk-mib)",
                        self.disk_size()
                    )));
                }
                if self.vm_id.is_some() && f.seq != self.committed {
                    return Err(ApplyError::SeqGap {
                        expected: self.committed,
                        got: f.seq,
                    });
                }
                if self.vm_id.is_some() && self.committed == 0 {
                    // A new initial copy after an interrupted one: the primary sends only
                    // non-zero pages and disk chunks, so start again from zeros.
                    self.mirror.as_mut().fill(0);
                    if let Some(d) = self.disk.as_mut() {
                        d.zero().map_err(ApplyError::DiskIo)?;
                    }
                }
                self.vm_id = Some(vm);
                Ok(Applied::Hello)
            }
            Kind::Base => {
                if self.committed != 0 {
                    return Err(ApplyError::Malformed(
                        "base chunk after the first epoch".into(),
                    ));
                }
                let p = &f.payload;
                let first = p
                    .get(..8)
                    .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
                let data = p.get(8..).unwrap_or_default();
                let m = self.mirror.as_mut();
                match first {
                    Some(first)
                        if data.len() % PAGE == 0
                            && (first as usize)
                                .checked_mul(PAGE)
                                .and_then(|o| o.checked_add(data.len()))
                                .is_some_and(|end| end <= m.len()) =>
                    {
                        let o = first as usize * PAGE;
                        m[o..o + data.len()].copy_from_slice(data);
                        Ok(Applied::Base)
                    }
                    _ => Err(ApplyError::Malformed("base chunk outside the guest".into())),
                }
            }
            Kind::DiskBase => {
                if self.committed != 0 {
                    return Err(ApplyError::Malformed(
                        "disk base chunk after the first epoch".into(),
                    ));
                }
                let size = self.disk_size();
                let p = &f.payload;
                let off = p
                    .get(..8)
                    .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
                let data = p.get(8..).unwrap_or_default();
                match (off, self.disk.as_mut()) {
                    (Some(off), Some(d))
                        if off
                            .checked_add(data.len() as u64)
                            .is_some_and(|end| end <= size) =>
                    {
                        d.write_at(off, data).map_err(ApplyError::DiskIo)?;
                        Ok(Applied::DiskBase)
                    }
                    _ => Err(ApplyError::Malformed("disk chunk outside the disk".into())),
                }
            }
            Kind::Epoch => {
                if f.seq != self.committed + 1 {
                    return Err(ApplyError::SeqGap {
                        expected: self.committed + 1,
                        got: f.seq,
                    });
                }
                let secs = sections(&f.payload)
                    .ok_or_else(|| ApplyError::Malformed("epoch sections".into()))?;
                let (mut memory, mut dev, mut dev_delta, mut disk) = (None, None, None, None);
                for (k, b) in secs {
                    let slot = match k {
                        section::MEMORY => &mut memory,
                        section::DEVICE_STATE => &mut dev,
                        section::DEVICE_STATE_DELTA => &mut dev_delta,
                        section::DISK => &mut disk,
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
                let memory =
                    memory.ok_or_else(|| ApplyError::Malformed("epoch without memory".into()))?;
                let dev = match (dev, dev_delta) {
                    (Some(d), None) => d.to_vec(),
                    (None, Some(d)) => crate::devstate::decode_delta(&self.device_state, d)
                        .map_err(|e| ApplyError::Malformed(e.to_string()))?,
                    _ => {
                        return Err(ApplyError::Malformed(
                            "epoch needs exactly one device-state section".into(),
                        ))
                    }
                };
                let writes = match disk {
                    None => Vec::new(),
                    Some(_) if self.disk.is_none() => {
                        return Err(ApplyError::Malformed(
                            "disk writes for a backup without a disk copy".into(),
                        ))
                    }
                    Some(b) => {
                        tandem_disk::decode_writes(b, self.disk_size()).ok_or_else(|| {
                            ApplyError::Malformed("disk section (a write outside the disk?)".into())
                        })?
                    }
                };
                decode(memory, self.mirror.as_ref(), &mut self.plan)?;
                if self.plan.epoch != f.seq {
                    return Err(ApplyError::Malformed(format!(
                        "memory record of epoch {} in frame of epoch {}",
                        self.plan.epoch, f.seq
                    )));
                }
                // Everything verified: commit disk writes, memory and device state together.
                if let Some(d) = self.disk.as_mut() {
                    for (off, data) in writes {
                        d.write_at(off, data).map_err(ApplyError::DiskIo)?;
                    }
                }
                self.plan.commit(self.mirror.as_mut());
                self.device_state = dev;
                self.committed = f.seq;
                Ok(Applied::Committed(f.seq))
            }
            Kind::Heartbeat => Ok(Applied::Heartbeat),
            Kind::Bye => Ok(Applied::Bye),
            Kind::Ack => Err(ApplyError::Malformed("ack sent to a backup".into())),
        }
    }
}
