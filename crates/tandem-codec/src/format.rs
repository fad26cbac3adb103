//! The epoch record: one checkpoint's memory, self-contained given the pre-epoch mirror.
//!
//! ```text
//! +----------------------------------------------------------------------+
//! | header (52 bytes, little-endian)                                     |
//! |   0 magic "TNDMEPC1"        8 version u16 = 6    10 flags u16        |
//! |  12 page_size u32 = 4096   16 epoch u64          24 entries u32      |
//! |  28 ops_len u32            32 data_stored_len u32                    |
//! |  36 data_raw_len u32       40 crc32c(ops) u32    44 crc32c(data) u32 |
//! |  48 crc32c(header bytes 0..48) u32                                   |
//! +----------------------------------------------------------------------+
//! | ops section, ops_len bytes:                                          |
//! |   [flags bit 2 only] frame table: uleb F, then per frame: uleb n,    |
//! |   n uleb prefix pfns, uleb raw length, uleb stored length            |
//! |   [flags bit 3 only] uleb H: bytes of run headers at the data's end  |
//! |   `entries` page codes (see code.rs); flags bit 4: uleb length of    |
//! |   the codes, then the codes as one zstd frame                        |
//! |   flags bit 5: compact codes and prefix pfns ([`FLAG_COMPACT`])      |
//! +----------------------------------------------------------------------+
//! | data section: payloads in page order, data_stored_len bytes;         |
//! |   flags bit 0: zstd-compressed, bit 1: LZ4-compressed (to raw_len)   |
//! |   bit 2 (with bit 0): F zstd frames, each compressed with a reference|
//! |   prefix, the pre-epoch content of its listed pages concatenated in  |
//! |   list order, which the decoder rebuilds from its mirror (prefix.rs) |
//! |   bit 3: the decoded data ends with H bytes of run headers: those of |
//! |   every 1-byte run patch, in page order; their payloads hold only    |
//! |   the literals (runs.rs split / join)                                |
//! +----------------------------------------------------------------------+
//! ```
//! Version 1 (no prefix flag), 2 (no split flag), 3 (no compressed codes), 4 (no compact
//! codes) and 5 (no word-delta pages, code.rs `Body::Words`) records are still read.
//! Limits: entries ≤ 2²⁴ (64 GiB of pages per epoch), ops ≤ 256 MiB, data ≤ 1 GiB decoded,
//! one page's payload ≤ [`MAX_PAGE_PAYLOAD`]. Declared lengths are checked against what the
//! record can hold before anything is allocated from them: the decoded data length against the
//! stored length times the compressor's largest expansion ([`MAX_ZSTD_RATIO`],
//! [`MAX_LZ4_RATIO`]) here, and against the sum of the page codes' payloads in the decoder.

use crate::DecodeError;
use tandem_types::framing::{crc32c, has_magic, u16_at, u32_at, u64_at};

/// Record magic.
pub const MAGIC: &[u8; 8] = b"TNDMEPC1";
/// Record format version written.
pub const VERSION: u16 = 6;
/// Oldest record format version read (version 1 has no reference prefix).
pub const MIN_VERSION: u16 = 1;
/// Header length.
pub const HEADER_LEN: usize = 52;
/// Page size this format carries.
pub const PAGE: usize = tandem_types::PAGE_SIZE;
/// Most page entries in one record.
pub const MAX_ENTRIES: u32 = 1 << 24;
/// Largest ops section.
pub const MAX_OPS: u32 = 256 << 20;
/// Largest data section (decoded).
pub const MAX_DATA: u32 = 1 << 30;
/// Largest payload of one page code. The encoders emit at most a page and a bit (64 raw
/// 64-byte blocks with their tags: 4160 bytes); a larger one is refused before decoding.
pub const MAX_PAGE_PAYLOAD: u32 = 2 * PAGE as u32;
/// Fewest ops bytes one page code takes (page number and tag).
pub const MIN_CODE_LEN: usize = 2;
/// zstd's largest expansion: no block is shorter than 4 bytes (3-byte header + 1 RLE byte) or
/// decodes to more than 128 KiB.
pub const MAX_ZSTD_RATIO: u64 = 32 * 1024;
/// LZ4's largest expansion: one input byte adds at most 255 bytes of match length.
pub const MAX_LZ4_RATIO: u64 = 255;
/// Flag: data section is zstd-compressed.
pub const FLAG_ZSTD: u16 = 1;
/// Flag: data section is LZ4-compressed.
pub const FLAG_LZ4: u16 = 2;
/// Flag (with [`FLAG_ZSTD`], version 2): the data section is zstd frames with reference
/// prefixes, described by a frame table at the start of the ops section.
pub const FLAG_PREFIX: u16 = 4;
/// Flag (version 3): the run headers of every 1-byte run patch (`Runs { unit: 1 }`) follow
/// all payloads, in page order, as one region whose length is a ULEB128 in the ops section;
/// each such page's payload holds only its literals. zstd then sees literals among literals
/// and headers among headers (with their own frame: kv −2.5 %, idle −1.5 %, compile and
/// sqlite −0.6 %).
pub const FLAG_SPLIT: u16 = 8;
/// Flag (version 4): the page codes are one zstd frame, after the ULEB128 of their length
/// (the frame table and the run-header length before them stay plain). Per-page metadata is
/// 8–19 % of a small-edit record (kv, memtouch) and regular: page numbers that step by one,
/// the same tags and lengths.
pub const FLAG_CODES_ZSTD: u16 = 16;
/// Flag (version 5): page codes and the frame table in their compact form. A page code's
/// `Mirror` base is its own page unless tag bit 7 is set, and then a zigzag ULEB128 relative
/// to its own page follows (code.rs); each prefix page of the frame table is a zigzag ULEB128
/// relative to the one before it (the first to 0). The plain form spelt the own page out
/// again for almost every entry: 36–50 % of the compressed page codes (kv 1 116 → 613 bytes
/// per epoch, memtouch 2 108 → 226).
pub const FLAG_COMPACT: u16 = 32;
/// Longest page code: page number, tag, base argument, block mask, payload length.
pub const MAX_CODE_LEN: u64 = 10 + 1 + 10 + 8 + 10;
/// Most pages in a reference prefix (1 GiB of references).
pub const MAX_PREFIX_PAGES: u64 = 1 << 18;

/// Parsed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Format version ([`VERSION`] when written; what a parsed record says).
    pub version: u16,
    /// Flags.
    pub flags: u16,
    /// Epoch number.
    pub epoch: u64,
    /// Page entries.
    pub entries: u32,
    /// Ops section length.
    pub ops_len: u32,
    /// Stored data length.
    pub data_stored_len: u32,
    /// Decoded data length.
    pub data_raw_len: u32,
    /// CRC32C of ops.
    pub crc_ops: u32,
    /// CRC32C of stored data.
    pub crc_data: u32,
}

impl Header {
    /// Serialises the header.
    pub fn write(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&(PAGE as u32).to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        for v in [
            self.entries,
            self.ops_len,
            self.data_stored_len,
            self.data_raw_len,
            self.crc_ops,
            self.crc_data,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out[start..]);
        out.extend_from_slice(&crc.to_le_bytes());
    }

    /// Parses and checks the header and section bounds of `rec`.
    pub fn read(rec: &[u8]) -> Result<Header, DecodeError> {
        if rec.len() < HEADER_LEN {
            return Err(DecodeError::Truncated(format!(
                "record of {} bytes is shorter than its header",
                rec.len()
            )));
        }
        if !has_magic(rec, MAGIC) {
            return Err(DecodeError::Malformed(
                "bad magic: not a tandem epoch record".into(),
            ));
        }
        let u16_at = |o: usize| u16_at(rec, o);
        let u32_at = |o: usize| u32_at(rec, o);
        let version = u16_at(8);
        if !(MIN_VERSION..=VERSION).contains(&version) {
            return Err(DecodeError::Version(version));
        }
        if crc32c(&[&rec[..48]]) != u32_at(48) {
            return Err(DecodeError::Checksum("header"));
        }
        let h = Header {
            version,
            flags: u16_at(10),
            epoch: u64_at(rec, 16),
            entries: u32_at(24),
            ops_len: u32_at(28),
            data_stored_len: u32_at(32),
            data_raw_len: u32_at(36),
            crc_ops: u32_at(40),
            crc_data: u32_at(44),
        };
        if u32_at(12) as usize != PAGE {
            return Err(DecodeError::Malformed(format!(
                "page size {} (only {PAGE} is supported)",
                u32_at(12)
            )));
        }
        let prefix_ok = version >= 2 && h.flags & FLAG_ZSTD != 0;
        let known =
            FLAG_ZSTD | FLAG_LZ4 | FLAG_PREFIX | FLAG_SPLIT | FLAG_CODES_ZSTD | FLAG_COMPACT;
        if h.flags & !known != 0
            || h.flags & (FLAG_ZSTD | FLAG_LZ4) == FLAG_ZSTD | FLAG_LZ4
            || (h.flags & FLAG_PREFIX != 0 && !prefix_ok)
            || (h.flags & FLAG_SPLIT != 0 && version < 3)
            || (h.flags & FLAG_CODES_ZSTD != 0 && version < 4)
            || (h.flags & FLAG_COMPACT != 0 && version < 5)
        {
            return Err(DecodeError::Malformed(format!(
                "unknown flags {:#x}",
                h.flags
            )));
        }
        if h.entries > MAX_ENTRIES
            || h.ops_len > MAX_OPS
            || h.data_raw_len > MAX_DATA
            || h.data_stored_len > MAX_DATA
        {
            return Err(DecodeError::Limit(format!(
                "{} entries, {} ops bytes, {} data bytes",
                h.entries, h.ops_len, h.data_raw_len
            )));
        }
        let packed = h.flags & (FLAG_ZSTD | FLAG_LZ4) != 0;
        if !packed && h.data_stored_len != h.data_raw_len {
            return Err(DecodeError::Malformed(
                "stored and raw data lengths differ without compression".into(),
            ));
        }
        let (ratio, name) = if h.flags & FLAG_ZSTD != 0 {
            (MAX_ZSTD_RATIO, "zstd")
        } else {
            (MAX_LZ4_RATIO, "LZ4")
        };
        let most = h.data_stored_len as u64 * ratio;
        if packed && h.data_raw_len as u64 > most {
            return Err(DecodeError::Length {
                what: format!(
                    "decoded data ({} {name}-compressed bytes)",
                    h.data_stored_len
                ),
                declared: h.data_raw_len as u64,
                max: most,
            });
        }
        let total = HEADER_LEN as u64 + h.ops_len as u64 + h.data_stored_len as u64;
        if (rec.len() as u64) < total {
            return Err(DecodeError::Truncated(format!(
                "record has {} bytes, header announces {total}",
                rec.len()
            )));
        }
        if (rec.len() as u64) > total {
            return Err(DecodeError::Malformed(format!(
                "{} trailing bytes after the record",
                rec.len() as u64 - total
            )));
        }
        Ok(h)
    }
}

/// The page codes: the rest of the ops section as stored, or (FLAG_CODES_ZSTD) its zstd frame
/// decoded into `buf`, after checking its declared length against what `entries` codes and
/// the frame can hold.
pub(crate) fn codes_section<'a>(
    h: &Header,
    rest: &'a [u8],
    cache: &'a mut CodesCache,
) -> Result<&'a [u8], DecodeError> {
    if h.flags & FLAG_CODES_ZSTD == 0 {
        return Ok(rest);
    }
    let mut pos = 0;
    let raw = crate::runs::get_uleb(rest, &mut pos)
        .ok_or_else(|| DecodeError::Truncated("page codes length".into()))?;
    let frame = &rest[pos..];
    let most = (h.entries as u64 * MAX_CODE_LEN)
        .min(MAX_OPS as u64)
        .min(frame.len() as u64 * MAX_ZSTD_RATIO);
    if raw > most {
        return Err(DecodeError::Length {
            what: format!(
                "page codes ({} entries, {} zstd bytes)",
                h.entries,
                frame.len()
            ),
            declared: raw,
            max: most,
        });
    }
    // Checked above for this header, so a hit decodes exactly as a miss would.
    if cache.valid && cache.from == rest {
        return Ok(&cache.codes);
    }
    cache.valid = false;
    let buf = &mut cache.codes;
    buf.clear();
    buf.resize(raw as usize, 0);
    let n = crate::prefix::decompress(frame, &[], &mut buf[..])
        .map_err(|e| DecodeError::Malformed(format!("page codes zstd: {e}")))?;
    if n as u64 != raw {
        return Err(DecodeError::Malformed(format!(
            "page codes decode to {n} bytes, the ops section declares {raw}"
        )));
    }
    cache.from.clear();
    cache.from.extend_from_slice(rest);
    cache.valid = true;
    Ok(&cache.codes)
}

/// Decompressed page codes, kept with the compressed bytes they came from, so that a record
/// whose pages are listed ([`crate::pages_read_with`]) and then decoded with the same
/// [`crate::Plan`] decompresses its codes once. Identical input gives identical output, so a
/// hit needs no other check.
#[derive(Debug, Default, Clone)]
pub(crate) struct CodesCache {
    /// The ops section after the prefix frames and split lengths (the length and the frame).
    from: Vec<u8>,
    /// What it decompressed to.
    codes: Vec<u8>,
    /// Whether `codes` is `from` decompressed (false after a refused frame).
    valid: bool,
}
