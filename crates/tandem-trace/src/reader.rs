//! Streaming trace reader: validates every byte before handing it out.

use std::io::Read;
use tandem_types::framing::{crc32c, u16_at, u32_at, u64_at};

use crate::frame::{Cursor, EpochRecord, TraceFrame, KIND_BASE, KIND_END, KIND_EPOCH};
use crate::{
    TraceError, TraceHeader, FRAME_HEADER_LEN, HEADER_LEN, MAGIC, MAX_FRAME, MAX_MEM, MAX_META,
    VERSION,
};

/// zstd's largest expansion: no block is shorter than 4 bytes or decodes to more than 128 KiB.
const MAX_ZSTD_RATIO: u64 = 32 * 1024;

/// Reads a trace frame by frame.
pub struct TraceReader<R: Read> {
    r: R,
    header: TraceHeader,
    offset: u64,
    epochs: u32,
    dirty_pages: u64,
    ended: bool,
    /// One zstd context for every frame (creating one allocates ~160 KiB).
    dctx: zstd::bulk::Decompressor<'static>,
}

/// Reads exactly `buf.len()` bytes; returns how many were read before EOF.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<usize, TraceError> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(n)
}

impl<R: Read> TraceReader<R> {
    /// Reads and checks the header.
    pub fn new(mut r: R) -> Result<Self, TraceError> {
        let mut h = [0u8; HEADER_LEN];
        let n = read_full(&mut r, &mut h)?;
        if h[..n.min(8)] != MAGIC[..n.min(8)] {
            return Err(TraceError::BadMagic);
        }
        if n < HEADER_LEN {
            return Err(TraceError::Truncated {
                offset: n as u64,
                what: "file header".into(),
            });
        }
        let u32_at = |o: usize| u32_at(&h, o);
        let version = u16_at(&h, 8);
        if version != VERSION {
            return Err(TraceError::Version(version));
        }
        let page_size = u32_at(12);
        let mem_bytes = u64_at(&h, 16);
        let epoch_ms = u32_at(24);
        let meta_len = u32_at(28) as usize;
        if meta_len > MAX_META {
            return Err(TraceError::Corrupt {
                offset: 28,
                what: format!("metadata length {meta_len} > {MAX_META}"),
            });
        }
        let mut meta = vec![0u8; meta_len];
        if read_full(&mut r, &mut meta)? < meta_len {
            return Err(TraceError::Truncated {
                offset: HEADER_LEN as u64,
                what: "metadata".into(),
            });
        }
        let crc = crc32c(&[&h[..44], &meta]);
        if crc != u32_at(44) {
            return Err(TraceError::Corrupt {
                offset: 44,
                what: "header checksum mismatch".into(),
            });
        }
        if !(page_size.is_power_of_two() && (512..=65536).contains(&page_size))
            || mem_bytes == 0
            || mem_bytes > MAX_MEM
            || !mem_bytes.is_multiple_of(page_size as u64)
        {
            return Err(TraceError::Corrupt {
                offset: 12,
                what: format!("implausible geometry: {mem_bytes} bytes in pages of {page_size}"),
            });
        }
        let meta = serde_json::from_slice(&meta).map_err(|e| TraceError::Corrupt {
            offset: HEADER_LEN as u64,
            what: format!("metadata is not JSON: {e}"),
        })?;
        Ok(TraceReader {
            r,
            header: TraceHeader {
                page_size,
                mem_bytes,
                epoch_ms,
                meta,
            },
            offset: (HEADER_LEN + meta_len) as u64,
            epochs: 0,
            dirty_pages: 0,
            dctx: zstd::bulk::Decompressor::new()?,
            ended: false,
        })
    }

    /// The trace header.
    pub fn header(&self) -> &TraceHeader {
        &self.header
    }

    /// Byte offset of the next frame.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The next frame, or `None` after a valid end frame.
    pub fn next_frame(&mut self) -> Result<Option<TraceFrame>, TraceError> {
        let at = self.offset;
        let mut h = [0u8; FRAME_HEADER_LEN];
        let n = read_full(&mut self.r, &mut h)?;
        if self.ended {
            if n == 0 {
                return Ok(None);
            }
            return Err(TraceError::Corrupt {
                offset: at,
                what: "data after the end frame".into(),
            });
        }
        if n == 0 {
            return Err(TraceError::Truncated {
                offset: at,
                what: "end frame missing".into(),
            });
        }
        if n < FRAME_HEADER_LEN {
            return Err(TraceError::Truncated {
                offset: at,
                what: "frame header cut short".into(),
            });
        }
        let (kind, codec) = (h[0], h[1]);
        let raw_len = u32_at(&h, 4) as usize;
        let stored_len = u32_at(&h, 8) as usize;
        let crc = u32_at(&h, 12);
        let corrupt = |what: String| TraceError::Corrupt { offset: at, what };
        if !(KIND_BASE..=KIND_END).contains(&kind) {
            return Err(corrupt(format!("unknown frame kind {kind}")));
        }
        if codec > 1 || h[2] != 0 || h[3] != 0 {
            return Err(corrupt(format!(
                "unknown frame codec {codec} or non-zero reserved bytes"
            )));
        }
        if raw_len > MAX_FRAME || stored_len > MAX_FRAME || (codec == 0 && raw_len != stored_len) {
            return Err(corrupt(format!(
                "frame lengths raw {raw_len} stored {stored_len} out of bounds"
            )));
        }
        // zstd cannot expand a byte into more than 32 KiB (4-byte RLE block → 128 KiB): a
        // larger declared length is refused before a buffer is sized by it.
        let most = stored_len as u64 * MAX_ZSTD_RATIO;
        if codec == 1 && raw_len as u64 > most {
            return Err(corrupt(format!(
                "frame declares {raw_len} decoded bytes, its {stored_len} zstd bytes hold at most {most}"
            )));
        }
        let mut stored = Vec::new();
        (&mut self.r)
            .take(stored_len as u64)
            .read_to_end(&mut stored)?;
        if stored.len() < stored_len {
            return Err(TraceError::Truncated {
                offset: at + (FRAME_HEADER_LEN + stored.len()) as u64,
                what: format!("frame payload of {stored_len} bytes cut short"),
            });
        }
        if crc32c::crc32c(&stored) != crc {
            return Err(corrupt("frame checksum mismatch".into()));
        }
        let raw = if codec == 1 {
            let d = (self.dctx)
                .decompress(&stored, raw_len)
                .map_err(|e| corrupt(format!("zstd payload does not decode: {e}")))?;
            if d.len() != raw_len {
                return Err(corrupt(format!(
                    "payload decodes to {} bytes, header says {raw_len}",
                    d.len()
                )));
            }
            d
        } else {
            stored
        };
        self.offset = at + (FRAME_HEADER_LEN + stored_len) as u64;
        let ps = self.header.page_size as usize;
        let pages = self.header.pages();
        let mut c = Cursor::new(&raw, at);
        let frame = match kind {
            KIND_BASE => {
                let first_pfn = c.u64("base chunk start")?;
                let count = c.u32("base chunk length")? as u64;
                if first_pfn.checked_add(count).is_none_or(|end| end > pages) {
                    return Err(corrupt(format!(
                        "base chunk {first_pfn}+{count} outside {pages} pages"
                    )));
                }
                let data = c.take(count as usize * ps, "base pages")?.to_vec();
                c.finish("base chunk")?;
                TraceFrame::Base { first_pfn, data }
            }
            KIND_EPOCH => {
                let e = EpochRecord::decode(&mut c, ps, pages)?;
                self.epochs += 1;
                self.dirty_pages += e.pfns.len() as u64;
                TraceFrame::Epoch(e)
            }
            _ => {
                let epochs = c.u32("end epoch count")?;
                let dirty_pages = c.u64("end page count")?;
                c.finish("end frame")?;
                if (epochs, dirty_pages) != (self.epochs, self.dirty_pages) {
                    return Err(corrupt(format!(
                        "end frame counts {epochs} epochs / {dirty_pages} pages, the trace holds {} / {}",
                        self.epochs, self.dirty_pages
                    )));
                }
                self.ended = true;
                TraceFrame::End {
                    epochs,
                    dirty_pages,
                }
            }
        };
        Ok(Some(frame))
    }
}
