//! A recorded trace replayed as a [`Guest`] (tandem-vm's epoch pipeline seam): the "VM" whose dirty log is the trace's. Its
//! memory starts as the trace's base image and each pause applies the next recorded epoch; the
//! device state is a deterministic stand-in of the recorded size (traces keep sizes, not
//! device states). With it the epoch pipeline, the replication protocol and the checkpoint
//! store run end to end in milliseconds, without QEMU.

use std::io::Read;

use tandem_trace::{EpochRecord, TraceFrame, TraceReader};

use tandem_vm::epoch::Guest;
use tandem_vm::{PauseTiming, VmError, PAGE_SIZE};

/// The trace cannot be replayed: `why`.
fn bad(why: impl std::fmt::Display) -> VmError {
    VmError::Guest(format!("replayed trace: {why}"))
}

/// A trace replayed as a guest.
pub struct ReplayGuest<R: Read> {
    reader: TraceReader<R>,
    mem: Vec<u8>,
    next: Option<EpochRecord>,
    epochs: u64,
}

impl<R: Read> ReplayGuest<R> {
    /// Reads the trace's base image; the first epoch is ready to replay.
    pub fn new(reader: TraceReader<R>) -> Result<Self, VmError> {
        let h = reader.header();
        if h.page_size as usize != PAGE_SIZE {
            return Err(bad(format!(
                "trace pages are {} bytes, tandem's are {PAGE_SIZE}",
                h.page_size
            )));
        }
        let mem = vec![0u8; h.mem_bytes as usize];
        let mut g = ReplayGuest {
            reader,
            mem,
            next: None,
            epochs: 0,
        };
        g.advance()?;
        Ok(g)
    }

    /// Reads frames up to the next epoch, applying base chunks on the way.
    fn advance(&mut self) -> Result<(), VmError> {
        self.next = None;
        loop {
            match self.reader.next_frame() {
                Ok(Some(TraceFrame::Base { first_pfn, data })) => {
                    let o = (first_pfn as usize).saturating_mul(PAGE_SIZE);
                    let dst = o
                        .checked_add(data.len())
                        .and_then(|end| self.mem.get_mut(o..end))
                        .ok_or_else(|| bad("base chunk outside guest memory"))?;
                    dst.copy_from_slice(&data);
                }
                Ok(Some(TraceFrame::Epoch(e))) => {
                    self.next = Some(e);
                    return Ok(());
                }
                Ok(Some(TraceFrame::End { .. })) | Ok(None) => return Ok(()),
                Err(e) => return Err(bad(e.to_string())),
            }
        }
    }

    /// Guest memory as of the last replayed epoch.
    pub fn memory(&self) -> &[u8] {
        &self.mem
    }

    /// Epochs replayed so far.
    pub fn epochs(&self) -> u64 {
        self.epochs
    }
}

/// The stand-in device state of epoch `n` with `len` bytes: mostly stable between epochs,
/// like QEMU's, with the epoch number in it.
pub fn device_state_of(n: u64, len: usize) -> Vec<u8> {
    let mut d: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    for (i, b) in n.to_le_bytes().iter().enumerate() {
        if let Some(x) = d.get_mut(i * 97) {
            *x = *b;
        }
    }
    d
}

impl<R: Read> Guest for ReplayGuest<R> {
    fn mem_bytes(&self) -> usize {
        self.mem.len()
    }

    fn pause(
        &mut self,
        dirty: &mut Vec<u64>,
        pages: &mut Vec<u8>,
        device_state: &mut Vec<u8>,
        boundary: &mut tandem_vm::epoch::Boundary<'_>,
        _cont: bool,
    ) -> Result<PauseTiming, VmError> {
        let e = self
            .next
            .take()
            .ok_or_else(|| bad("the trace has no more epochs"))?;
        for (i, &pfn) in e.pfns.iter().enumerate() {
            let o = (pfn as usize).saturating_mul(PAGE_SIZE);
            let src = &e.data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
            self.mem
                .get_mut(o..o + PAGE_SIZE)
                .ok_or_else(|| bad(format!("page {pfn} outside guest memory")))?
                .copy_from_slice(src);
        }
        dirty.clear();
        dirty.extend_from_slice(&e.pfns);
        pages.clear();
        pages.extend_from_slice(&e.data);
        boundary(dirty, pages);
        self.epochs += 1;
        *device_state = device_state_of(self.epochs, e.device_state_len as usize);
        let timing = e.timing;
        self.advance()?;
        Ok(timing)
    }

    fn initial_copy(&mut self, boundary: &mut dyn FnMut()) -> Result<Vec<u8>, VmError> {
        boundary();
        Ok(self.mem.clone())
    }

    fn finished(&self) -> bool {
        self.next.is_none()
    }
}
