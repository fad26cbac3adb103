//! Per-page codes: every page of a record is `base` + `body`.
//!
//! - base: `Zero` (all-zero page), `Mirror(pfn)` (that page's content *before* this epoch, on
//!   both sides), or `Epoch(i)` (the new content of the i-th page of this same record, i < own
//!   index).
//! - body: `Same` (page = base), `Runs` (replace runs of 1- or 8-byte units: XBZRLE / FITDOC /
//!   sparse), `Xor` (a 4096-byte XOR image, raw or compressed with LZ4, zstd or WKdm, applied to
//!   the base: with a zero base it is a plain literal page), `Blocks` (FGBI: a 64-bit mask of
//!   replaced 64-byte blocks, each coded on its own), `RawBlocks` (the same mask, the blocks
//!   raw and untagged: tandem's, for the record's zstd pass), `Areas` (Gerofi: eight 512-byte areas, each
//!   same / zero / raw / runs against any reference area), `Words` (version 6, zero base only:
//!   the page as word deltas, words.rs, raw for the record's zstd pass).

use crate::runs::{get_rel, get_uleb, put_rel, put_uleb};

/// Where a page (or area or block) starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Base {
    /// All zero.
    Zero,
    /// Pre-epoch content of a guest page.
    Mirror(u64),
    /// New content of an earlier page of this record.
    Epoch(u32),
}

/// Compression method of an `Xor` body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Stored.
    Raw = 0,
    /// LZ4 block.
    Lz4 = 1,
    /// zstd frame.
    Zstd = 2,
    /// WKdm.
    Wkdm = 3,
}

/// How the page differs from its base. Payload lengths are implied by `len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// The page equals its base.
    Same,
    /// Run stream with `unit`-byte granularity (1 or 8).
    Runs {
        /// 1 or 8.
        unit: u8,
    },
    /// XOR image, `method`-coded.
    Xor(Method),
    /// FGBI blocks: bit i set = block i (64 bytes) is coded in the payload.
    Blocks(u64),
    /// Replaced blocks: bit i set = block i (64 bytes) follows raw, in order, with no tags
    /// (tandem: the record's zstd pass, with the reference prefix, compresses them).
    RawBlocks(u64),
    /// Gerofi areas: eight area codes in the payload.
    Areas,
    /// The page's 8-byte words, each minus the one before (words.rs), raw: 4096 bytes on a
    /// zero base (format version 6).
    Words,
}

/// One page's code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCode {
    /// Guest page number written.
    pub pfn: u64,
    /// Starting content.
    pub base: Base,
    /// Transformation.
    pub body: Body,
    /// Payload bytes in the data section.
    pub len: u32,
}

// tag byte: bits 0-1 base kind, bits 2-4 body kind, bits 5-7 body detail (0 to 3; in the
// compact form bit 7 is [`OWN_ELSEWHERE`])
const BASE_ZERO: u8 = 0;
const BASE_MIRROR: u8 = 1;
const BASE_EPOCH: u8 = 2;
const BODY_SAME: u8 = 0;
const BODY_RUNS: u8 = 1;
const BODY_XOR: u8 = 2;
const BODY_BLOCKS: u8 = 3;
const BODY_AREAS: u8 = 4;
const BODY_WORDS: u8 = 5;

/// Compact form (format version 5, [`crate::format::FLAG_COMPACT`]): tag bit 7 of a `Mirror`
/// base says an argument follows, the zigzag ULEB128 of the base page minus the entry's own
/// page; without it the base is the page's own previous version, the usual case, which the
/// plain form spells out as a whole page number.
const OWN_ELSEWHERE: u8 = 0x80;

impl PageCode {
    /// Appends the code; `prev_pfn` is the previous entry's pfn (`None` for the first);
    /// `compact`: the version-5 form (see [`OWN_ELSEWHERE`]).
    pub fn write(&self, prev_pfn: Option<u64>, compact: bool, out: &mut Vec<u8>) {
        put_uleb(
            out,
            match prev_pfn {
                None => self.pfn,
                Some(p) => self.pfn - p - 1,
            },
        );
        let (bk, barg) = match self.base {
            Base::Zero => (BASE_ZERO, None),
            Base::Mirror(p) => (BASE_MIRROR, Some(p)),
            Base::Epoch(i) => (BASE_EPOCH, Some(i as u64)),
        };
        let (body, detail) = match self.body {
            Body::Same => (BODY_SAME, 0),
            Body::Runs { unit } => (BODY_RUNS, if unit == 8 { 1 } else { 0 }),
            Body::Xor(m) => (BODY_XOR, m as u8),
            Body::Blocks(_) => (BODY_BLOCKS, 0),
            Body::RawBlocks(_) => (BODY_BLOCKS, 1),
            Body::Areas => (BODY_AREAS, 0),
            Body::Words => (BODY_WORDS, 0),
        };
        let tag = bk | (body << 2) | (detail << 5);
        match (self.base, compact) {
            (Base::Mirror(p), true) if p == self.pfn => out.push(tag),
            (Base::Mirror(p), true) => {
                out.push(tag | OWN_ELSEWHERE);
                put_rel(out, p, self.pfn);
            }
            _ => {
                out.push(tag);
                if let Some(a) = barg {
                    put_uleb(out, a);
                }
            }
        }
        if let Body::Blocks(mask) | Body::RawBlocks(mask) = self.body {
            out.extend_from_slice(&mask.to_le_bytes());
        }
        // A raw-blocks payload's length follows from its mask.
        if !matches!(self.body, Body::Same | Body::RawBlocks(_)) {
            put_uleb(out, self.len as u64);
        }
    }

    /// Reads one code (`compact`: the version-5 form). Structural checks only; references
    /// are checked by the decoder.
    pub fn read(
        buf: &[u8],
        pos: &mut usize,
        prev_pfn: Option<u64>,
        compact: bool,
    ) -> Result<PageCode, &'static str> {
        let d = get_uleb(buf, pos).ok_or("page number truncated")?;
        let pfn = match prev_pfn {
            None => d,
            Some(p) => p
                .checked_add(d)
                .and_then(|v| v.checked_add(1))
                .ok_or("page number overflows")?,
        };
        let tag = *buf.get(*pos).ok_or("page tag truncated")?;
        *pos += 1;
        let elsewhere = compact && tag & OWN_ELSEWHERE != 0;
        let tag = if compact { tag & !OWN_ELSEWHERE } else { tag };
        if elsewhere && tag & 3 != BASE_MIRROR {
            return Err("base flag on a base that is not a page");
        }
        let base = match tag & 3 {
            BASE_ZERO => Base::Zero,
            BASE_MIRROR if compact && !elsewhere => Base::Mirror(pfn),
            BASE_MIRROR if compact => {
                Base::Mirror(get_rel(buf, pos, pfn).ok_or("base page truncated or out of range")?)
            }
            BASE_MIRROR => Base::Mirror(get_uleb(buf, pos).ok_or("base page truncated")?),
            BASE_EPOCH => {
                let i = get_uleb(buf, pos).ok_or("base index truncated")?;
                Base::Epoch(u32::try_from(i).map_err(|_| "base index too large")?)
            }
            _ => return Err("unknown base kind"),
        };
        let detail = tag >> 5;
        let body = match (tag >> 2) & 7 {
            BODY_SAME if detail == 0 => Body::Same,
            BODY_RUNS if detail <= 1 => Body::Runs {
                unit: if detail == 1 { 8 } else { 1 },
            },
            BODY_XOR => Body::Xor(match detail {
                0 => Method::Raw,
                1 => Method::Lz4,
                2 => Method::Zstd,
                3 => Method::Wkdm,
                _ => return Err("unknown compression method"),
            }),
            BODY_BLOCKS if detail <= 1 => {
                let b = buf.get(*pos..*pos + 8).ok_or("block mask truncated")?;
                *pos += 8;
                let mask = u64::from_le_bytes(b.try_into().map_err(|_| "block mask")?);
                if detail == 0 {
                    Body::Blocks(mask)
                } else {
                    Body::RawBlocks(mask)
                }
            }
            BODY_AREAS if detail == 0 => Body::Areas,
            BODY_WORDS if detail == 0 => Body::Words,
            _ => return Err("unknown body kind"),
        };
        let len = if body == Body::Same {
            0
        } else if let Body::RawBlocks(mask) = body {
            mask.count_ones() * 64
        } else {
            u32::try_from(get_uleb(buf, pos).ok_or("payload length truncated")?)
                .map_err(|_| "payload length too large")?
        };
        Ok(PageCode {
            pfn,
            base,
            body,
            len,
        })
    }
}

/// Block codes inside a `Blocks` payload (one per set mask bit, in order).
pub mod block {
    /// Block is all zero.
    pub const ZERO: u8 = 0;
    /// 64 raw bytes follow.
    pub const RAW: u8 = 1;
    /// uleb length + run stream (unit 1) against a zero block (FGBI's sparse block).
    pub const SPARSE: u8 = 2;
    /// uleb length + WKdm data.
    pub const WKDM: u8 = 3;
    /// uleb: block number (page index × 64 + block) of an earlier block of this record.
    pub const EPOCH_REF: u8 = 4;
}

/// Area codes inside an `Areas` payload (eight, in order).
pub mod area {
    /// Area equals the page base's area.
    pub const SAME: u8 = 0;
    /// Area is all zero.
    pub const ZERO: u8 = 1;
    /// 512 raw bytes follow.
    pub const RAW: u8 = 2;
    /// Reference (kind u8: 1 mirror, 2 epoch; uleb page; u8 area) + uleb length + run stream
    /// (unit 1) against that reference area.
    pub const DELTA: u8 = 3;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_roundtrip() {
        let codes = [
            PageCode {
                pfn: 5,
                base: Base::Zero,
                body: Body::Same,
                len: 0,
            },
            PageCode {
                pfn: 6,
                base: Base::Mirror(77),
                body: Body::Runs { unit: 8 },
                len: 40,
            },
            PageCode {
                pfn: 900,
                base: Base::Epoch(1),
                body: Body::Xor(Method::Wkdm),
                len: 1000,
            },
            PageCode {
                pfn: 901,
                base: Base::Mirror(901),
                body: Body::Blocks(0x8000_0000_0000_0001),
                len: 130,
            },
            PageCode {
                pfn: 902,
                base: Base::Mirror(902),
                body: Body::RawBlocks(0x30),
                len: 128,
            },
            PageCode {
                pfn: 1 << 40,
                base: Base::Zero,
                body: Body::Areas,
                len: 8,
            },
            PageCode {
                pfn: (1 << 40) + 1,
                base: Base::Zero,
                body: Body::Words,
                len: 4096,
            },
        ];
        let mut sizes = Vec::new();
        for compact in [false, true] {
            let mut buf = Vec::new();
            let mut prev = None;
            for c in &codes {
                c.write(prev, compact, &mut buf);
                prev = Some(c.pfn);
            }
            let (mut pos, mut prev) = (0, None);
            for c in &codes {
                let d = PageCode::read(&buf, &mut pos, prev, compact).unwrap();
                assert_eq!(&d, c);
                prev = Some(d.pfn);
            }
            assert_eq!(pos, buf.len());
            sizes.push(buf.len());
        }
        // The two own-page bases take no argument in the compact form (901 and 902: 2 bytes
        // each); the other page base, 77 of page 6, becomes a delta of +71 (2 bytes, not 1).
        assert_eq!(sizes[0] - sizes[1], 3);
    }

    #[test]
    fn compact_bases_reach_both_ways_and_refuse_nonsense() {
        for (pfn, base) in [(10, 0), (10, 9), (10, 11), (0, 1 << 52), (1 << 52, 0)] {
            let c = PageCode {
                pfn,
                base: Base::Mirror(base),
                body: Body::Same,
                len: 0,
            };
            let mut buf = Vec::new();
            c.write(None, true, &mut buf);
            assert_eq!(PageCode::read(&buf, &mut 0, None, true), Ok(c));
        }
        // Page 1 with a base 3 below it: out of range.
        let mut buf = vec![1, BASE_MIRROR | OWN_ELSEWHERE];
        put_uleb(&mut buf, 5);
        assert!(PageCode::read(&buf, &mut 0, None, true).is_err());
        // The flag on a zero base; the flag truncated.
        assert!(PageCode::read(&[1, BASE_ZERO | OWN_ELSEWHERE], &mut 0, None, true).is_err());
        assert!(PageCode::read(&[1, BASE_MIRROR | OWN_ELSEWHERE], &mut 0, None, true).is_err());
        // Bit 7 means a Runs detail of 4+ in the plain form: refused there as before.
        assert!(PageCode::read(&[1, BASE_ZERO | 4 | 0x80], &mut 0, None, false).is_err());
    }
}
