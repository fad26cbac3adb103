//! Frame payloads: base-image chunks, epochs and the end frame.

use crate::TraceError;

/// Pause components of one epoch, in microseconds (as measured by the recorder): the same
/// type the VM's epoch loop, the metrics and the store use.
pub use tandem_types::PauseTiming as Timing;

/// One epoch: the pages written during it and their contents at the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochRecord {
    /// Epoch number, from 1 (stored as a u32 in the trace: at most `u32::MAX`).
    pub epoch: tandem_types::Epoch,
    /// Microseconds since the recording started, at the checkpoint.
    pub at_us: u64,
    /// Pause components.
    pub timing: Timing,
    /// Size of the device state captured at this checkpoint.
    pub device_state_len: u32,
    /// Written page numbers, strictly ascending.
    pub pfns: Vec<u64>,
    /// Their contents, `pfns.len() * page_size` bytes.
    pub data: Vec<u8>,
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceFrame {
    /// A chunk of the initial RAM image: `data` holds consecutive pages from `first_pfn`.
    Base {
        /// First page number.
        first_pfn: u64,
        /// Page contents.
        data: Vec<u8>,
    },
    /// An epoch.
    Epoch(EpochRecord),
    /// End of trace.
    End {
        /// Epochs recorded.
        epochs: u32,
        /// Dirty pages over all epochs.
        dirty_pages: u64,
    },
}

pub(crate) const KIND_BASE: u8 = 1;
pub(crate) const KIND_EPOCH: u8 = 2;
pub(crate) const KIND_END: u8 = 3;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    offset: u64,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8], offset: u64) -> Self {
        Cursor {
            buf,
            pos: 0,
            offset,
        }
    }
    fn err(&self, what: &str) -> TraceError {
        TraceError::Corrupt {
            offset: self.offset,
            what: format!("{what} (payload byte {})", self.pos),
        }
    }
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub(crate) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], TraceError> {
        if self.buf.len() - self.pos < n {
            return Err(self.err(&format!("{what} runs past the end of the frame")));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, TraceError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().unwrap_or_default(),
        ))
    }
    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, TraceError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().unwrap_or_default(),
        ))
    }
    fn varint(&mut self, what: &str) -> Result<u64, TraceError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.take(1, what)?[0];
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err(&format!("{what}: varint longer than 10 bytes")))
    }
    pub(crate) fn finish(&self, what: &str) -> Result<(), TraceError> {
        if self.pos != self.buf.len() {
            return Err(self.err(&format!(
                "{} trailing bytes after {what}",
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}

impl EpochRecord {
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        // The writer checked that the number fits the format's u32.
        out.extend_from_slice(&(self.epoch as u32).to_le_bytes());
        out.extend_from_slice(&self.at_us.to_le_bytes());
        let t = &self.timing;
        for v in [
            t.stop_us,
            t.harvest_us,
            t.copy_us,
            t.devstate_us,
            t.cont_us,
            self.device_state_len,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(self.pfns.len() as u32).to_le_bytes());
        let mut prev = 0u64;
        for (i, &p) in self.pfns.iter().enumerate() {
            put_varint(out, if i == 0 { p } else { p - prev - 1 });
            prev = p;
        }
        out.extend_from_slice(&self.data);
    }

    pub(crate) fn decode(
        c: &mut Cursor<'_>,
        page_size: usize,
        pages: u64,
    ) -> Result<Self, TraceError> {
        let epoch = c.u32("epoch number")?;
        let at_us = c.u64("epoch time")?;
        let mut v = [0u32; 6];
        for x in v.iter_mut() {
            *x = c.u32("epoch timing")?;
        }
        let n = c.u32("dirty page count")? as u64;
        if n > pages {
            return Err(c.err(&format!("{n} dirty pages in a guest of {pages} pages")));
        }
        // Each page takes at least one page-number byte and its contents.
        let room = c.remaining() as u64 / (page_size as u64 + 1);
        if n > room {
            return Err(c.err(&format!(
                "{n} dirty pages declared, the frame holds at most {room}"
            )));
        }
        let mut pfns = Vec::with_capacity(n as usize);
        let mut next = 0u64;
        for i in 0..n {
            let d = c.varint("page number")?;
            let p = next.checked_add(d).filter(|&p| p < pages).ok_or_else(|| {
                c.err(&format!(
                    "page number {i} lies outside the guest's {pages} pages"
                ))
            })?;
            pfns.push(p);
            next = p + 1;
        }
        let data = c.take(n as usize * page_size, "page contents")?.to_vec();
        c.finish("epoch")?;
        Ok(EpochRecord {
            epoch: epoch.into(),
            at_us,
            timing: Timing {
                stop_us: v[0],
                harvest_us: v[1],
                copy_us: v[2],
                devstate_us: v[3],
                cont_us: v[4],
                // Not in the format: QEMU's stopped time is the product's, not the trace's.
                stopped_us: 0,
            },
            device_state_len: v[5],
            pfns,
            data,
        })
    }
}
