//! Encoder phase 4: serialises the coded pages into one record (format.rs) and compresses its
//! data section, with the reference prefix (prefix.rs) where the strategy asked for one. Also
//! the encoder's fan-out over threads.

use crate::code::PageCode;
use crate::encoder::{Codec, Encoder};
use crate::format::{Header, FLAG_LZ4, FLAG_PREFIX, FLAG_ZSTD, MAX_DATA, PAGE};
use crate::strategies::{Coded, Payload, Refs};
use crate::EncodeError;

/// Buffers and compression contexts an encoder reuses across epochs.
#[derive(Default)]
pub struct Buffers {
    ops: Vec<u8>,
    /// Reference prefix (previous versions, in list order) followed by the payloads.
    data: Vec<u8>,
    stored: Vec<u8>,
    prefix: Vec<u64>,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    refz: Option<crate::prefix::Compressor>,
}

/// Maps `f` over `0..n` on up to `threads` scoped threads, in order. Spawning costs more than
/// encoding a small epoch: it fans out only when every thread gets `min_per_thread` items.
pub fn par_map<T: Send, F: Fn(usize) -> T + Sync>(
    threads: usize,
    min_per_thread: usize,
    n: usize,
    f: F,
) -> Vec<T> {
    let threads = threads.max(1).min(n / min_per_thread.max(1)).max(1);
    if threads <= 1 {
        return (0..n).map(f).collect();
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let f = &f;
                s.spawn(move || (t * per..((t + 1) * per).min(n)).map(f).collect::<Vec<T>>())
            })
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

impl Encoder {
    /// Phase 4: serialises the coded pages in page order, compresses the data section and
    /// appends the record; returns the number of entries and of prefix pages.
    pub(crate) fn write_record(
        &mut self,
        epoch: u64,
        pfns: &[u64],
        data: &[u8],
        coded: &[Option<(Coded, Refs)>],
        out: &mut Vec<u8>,
    ) -> Result<(u32, usize), EncodeError> {
        let page = |i: usize| &data[i * PAGE..(i + 1) * PAGE];
        let codec = self.codec;
        let level = self.level;
        let b = &mut self.buf;
        b.ops.clear();
        b.data.clear();
        b.prefix.clear();
        // The prefix: previous versions of the pages asked for, in page order (each page's
        // own version then lies a roughly constant distance before its payload).
        if let Some(prev) = self.prev.as_ref() {
            let mut seen = crate::state::FxMap::default();
            for (i, c) in coded.iter().enumerate() {
                let Some((_, r)) = c else { continue };
                let own = r.own.then_some(pfns[i]);
                for q in r.others.into_iter().flatten().chain(own) {
                    if let (Some(old), None) = (prev.get(q), seen.insert(q, ())) {
                        b.prefix.push(q);
                        b.data.extend_from_slice(old);
                    }
                }
            }
        }
        let plen = b.data.len();
        if !b.prefix.is_empty() {
            crate::prefix::write_list(&b.prefix, &mut b.ops);
        }
        let mut prev_pfn = None;
        let mut entries = 0u32;
        for (i, c) in coded.iter().enumerate() {
            let Some(((base, body, bytes), _)) = c else {
                continue;
            };
            let bytes: &[u8] = match bytes {
                Payload::Own(v) => v,
                Payload::Page => page(i),
            };
            let code = PageCode {
                pfn: pfns[i],
                base: *base,
                body: *body,
                len: bytes.len() as u32,
            };
            code.write(prev_pfn, &mut b.ops);
            b.data.extend_from_slice(bytes);
            prev_pfn = Some(pfns[i]);
            entries += 1;
        }
        let raw_len = b.data.len() - plen;
        if raw_len > MAX_DATA as usize {
            return Err(EncodeError::Input(format!(
                "epoch data of {raw_len} bytes exceeds the record limit"
            )));
        }
        let payload = &b.data[plen..];
        let stored = &mut b.stored;
        let mut flags = 0;
        match codec {
            Codec::Tandem if raw_len > 0 => {
                let z = b.refz.get_or_insert_with(Default::default);
                z.compress(&b.data, plen, level, stored)
                    .map_err(EncodeError::Compress)?;
                // With a prefix the list is already in the ops: the frame must be used.
                if plen > 0 {
                    flags = FLAG_ZSTD | FLAG_PREFIX;
                } else if stored.len() < raw_len {
                    flags = FLAG_ZSTD;
                }
            }
            Codec::Zstd | Codec::Fgbi | Codec::XbzrleZstd | Codec::TandemV1 if raw_len > 0 => {
                let z = match b.zstd.as_mut() {
                    Some(z) => z,
                    None => b
                        .zstd
                        .insert(zstd::bulk::Compressor::new(level).map_err(EncodeError::Compress)?),
                };
                z.set_compression_level(level)
                    .map_err(EncodeError::Compress)?;
                stored.clear();
                stored.reserve(zstd::zstd_safe::compress_bound(raw_len));
                z.compress_to_buffer(payload, stored)
                    .map_err(EncodeError::Compress)?;
                if stored.len() < raw_len {
                    flags = FLAG_ZSTD;
                }
            }
            Codec::Lz4 if raw_len > 0 => {
                stored.clear();
                stored.resize(lz4_flex::block::get_maximum_output_size(raw_len), 0);
                let n = lz4_flex::block::compress_into(payload, stored)
                    .map_err(|e| EncodeError::Input(e.to_string()))?;
                stored.truncate(n);
                flags = FLAG_LZ4;
            }
            _ => {}
        }
        let stored_data: &[u8] = if flags == 0 { payload } else { stored };
        Header {
            flags,
            epoch,
            entries,
            ops_len: b.ops.len() as u32,
            data_stored_len: stored_data.len() as u32,
            data_raw_len: raw_len as u32,
            crc_ops: crc32c::crc32c(&b.ops),
            crc_data: crc32c::crc32c(stored_data),
        }
        .write(out);
        out.extend_from_slice(&b.ops);
        out.extend_from_slice(stored_data);
        Ok((entries, b.prefix.len()))
    }
}
