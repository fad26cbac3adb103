//! Streaming trace writer.

use std::io::Write;

use crate::frame::{EpochRecord, KIND_BASE, KIND_END, KIND_EPOCH};
use crate::{
    TraceError, TraceHeader, BASE_CHUNK_PAGES, MAGIC, MAX_FRAME, MAX_MEM, MAX_META, VERSION,
};

/// Writes a trace frame by frame; call [`TraceWriter::finish`] to make it complete.
pub struct TraceWriter<W: Write> {
    w: W,
    header: TraceHeader,
    epochs: u32,
    dirty_pages: u64,
    bytes: u64,
    /// One zstd context (at the writer's level) for every frame.
    cctx: zstd::bulk::Compressor<'static>,
}

impl<W: Write> TraceWriter<W> {
    /// Writes the header; `level` is the zstd level for frame payloads (1 is fast).
    pub fn new(mut w: W, header: TraceHeader, level: i32) -> Result<Self, TraceError> {
        let meta =
            serde_json::to_vec(&header.meta).map_err(|e| TraceError::Limit(e.to_string()))?;
        if meta.len() > MAX_META {
            return Err(TraceError::Limit(format!(
                "metadata of {} bytes > {MAX_META}",
                meta.len()
            )));
        }
        if header.page_size == 0
            || header.mem_bytes == 0
            || header.mem_bytes > MAX_MEM
            || !header.mem_bytes.is_multiple_of(header.page_size as u64)
        {
            return Err(TraceError::Limit(format!(
                "memory size {} with page size {}",
                header.mem_bytes, header.page_size
            )));
        }
        let mut h = Vec::with_capacity(crate::HEADER_LEN);
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        h.extend_from_slice(&header.page_size.to_le_bytes());
        h.extend_from_slice(&header.mem_bytes.to_le_bytes());
        h.extend_from_slice(&header.epoch_ms.to_le_bytes());
        h.extend_from_slice(&(meta.len() as u32).to_le_bytes());
        h.extend_from_slice(&[0u8; 12]);
        let mut crc = crc32c::crc32c(&h);
        crc = crc32c::crc32c_append(crc, &meta);
        h.extend_from_slice(&crc.to_le_bytes());
        w.write_all(&h)?;
        w.write_all(&meta)?;
        let bytes = (h.len() + meta.len()) as u64;
        Ok(TraceWriter {
            w,
            header,
            epochs: 0,
            dirty_pages: 0,
            bytes,
            cctx: zstd::bulk::Compressor::new(level)?,
        })
    }

    /// Bytes written so far.
    pub fn bytes_written(&self) -> u64 {
        self.bytes
    }

    fn frame(&mut self, kind: u8, raw: &[u8]) -> Result<(), TraceError> {
        if raw.len() > MAX_FRAME {
            return Err(TraceError::Limit(format!(
                "frame of {} bytes > {MAX_FRAME}",
                raw.len()
            )));
        }
        let packed = self.cctx.compress(raw)?;
        let (codec, stored) = if packed.len() < raw.len() {
            (1u8, &packed[..])
        } else {
            (0u8, raw)
        };
        let mut h = [0u8; crate::FRAME_HEADER_LEN];
        h[0] = kind;
        h[1] = codec;
        h[4..8].copy_from_slice(&(raw.len() as u32).to_le_bytes());
        h[8..12].copy_from_slice(&(stored.len() as u32).to_le_bytes());
        h[12..16].copy_from_slice(&crc32c::crc32c(stored).to_le_bytes());
        self.w.write_all(&h)?;
        self.w.write_all(stored)?;
        self.bytes += (h.len() + stored.len()) as u64;
        Ok(())
    }

    /// Writes the initial RAM image (whole guest memory) as base chunks.
    pub fn write_base(&mut self, mem: &[u8]) -> Result<(), TraceError> {
        if mem.len() as u64 != self.header.mem_bytes {
            return Err(TraceError::Limit(format!(
                "base image of {} bytes for a guest of {}",
                mem.len(),
                self.header.mem_bytes
            )));
        }
        let ps = self.header.page_size as usize;
        let mut buf = Vec::with_capacity(BASE_CHUNK_PAGES * ps + 12);
        for (i, chunk) in mem.chunks(BASE_CHUNK_PAGES * ps).enumerate() {
            buf.clear();
            buf.extend_from_slice(&((i * BASE_CHUNK_PAGES) as u64).to_le_bytes());
            buf.extend_from_slice(&((chunk.len() / ps) as u32).to_le_bytes());
            buf.extend_from_slice(chunk);
            self.frame(KIND_BASE, &buf)?;
        }
        Ok(())
    }

    /// Writes one epoch. Page numbers must be strictly ascending and inside the guest.
    pub fn write_epoch(&mut self, e: &EpochRecord) -> Result<(), TraceError> {
        let ps = self.header.page_size as usize;
        let ascending = e.pfns.windows(2).all(|w| w[0] < w[1]);
        let inside = e.pfns.last().is_none_or(|&p| p < self.header.pages());
        if u32::try_from(e.epoch).is_err() {
            return Err(TraceError::Limit(format!(
                "epoch number {} does not fit the trace format (at most {})",
                e.epoch,
                u32::MAX
            )));
        }
        if !ascending || !inside || e.data.len() != e.pfns.len() * ps {
            return Err(TraceError::Limit(format!(
                "epoch {}: page numbers must ascend inside the guest and match the data",
                e.epoch
            )));
        }
        let mut buf = Vec::with_capacity(e.data.len() + e.pfns.len() * 2 + 64);
        e.encode(&mut buf);
        self.frame(KIND_EPOCH, &buf)?;
        self.epochs += 1;
        self.dirty_pages += e.pfns.len() as u64;
        Ok(())
    }

    /// Writes the end frame, flushes and returns the inner writer.
    pub fn finish(mut self) -> Result<W, TraceError> {
        let mut buf = Vec::with_capacity(12);
        buf.extend_from_slice(&self.epochs.to_le_bytes());
        buf.extend_from_slice(&self.dirty_pages.to_le_bytes());
        self.frame(KIND_END, &buf)?;
        self.w.flush()?;
        Ok(self.w)
    }
}
