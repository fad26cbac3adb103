//! On-disk formats of the checkpoint store.
//!
//! ```text
//! index (file `index`):
//!   header 32 bytes: magic "TNDMIDX1" | version u32 (1, or 2: with disks, see
//!                    crate::disks) | page_size u32 | mem_bytes u64 |
//!                    reserved u32 | crc32c u32 over bytes 0..28
//!   entries, 64 bytes each, appended in checkpoint order:
//!      0 magic "TIDX"   4 kind u8 (1 base, 2 delta)   5..8 zero
//!      8 id u64        16 segment u32   20 len u32 (record bytes)   24 offset u64
//!     32 ram_hash u64 (xxh3 over the per-page xxh3 of guest RAM at the checkpoint)
//!     40 time_ms u64 (Unix)   48 pause_us u32   52 dirty_pages u32   56 reserved u32
//!     60 crc32c u32 over bytes 0..60
//!
//! segment record (file `seg-NNNNNNNN.tseg`, records back to back):
//!   header 32 bytes: magic "TSEG" | kind u8 | 3 zero | id u64 | mem_len u32 | dev_len u32 |
//!                    disk_len u32 (0 in version 1) | crc32c u32 over header bytes 0..28
//!                    and the payload
//!   payload: memory record (tandem-codec epoch record; a base is a record against an all-zero
//!            image) | device state, zstd-compressed | disk writes since the previous
//!            checkpoint, zstd-compressed (version 2, see crate::disks)
//! ```
//! Limits: a whole record ≤ 4 GiB − 1, device state ≤ 64 MiB (compressed and raw), a disk
//! section ≤ 2 GiB (compressed and raw), guest RAM
//! a non-zero multiple of the page size ≤ 1 TiB. Every offset and length read from the index or
//! a record is checked against these and against the file holding it before it is used.

/// Index header magic.
pub const INDEX_MAGIC: &[u8; 8] = b"TNDMIDX1";
/// Index format version of a store without disks.
pub const INDEX_VERSION: u32 = 1;
/// Index format version of a store with disks.
pub const INDEX_VERSION_DISKS: u32 = 2;
/// Largest disk section of a record (compressed, and decompressed).
pub const MAX_DISK_SECTION: u64 = 2 << 30;
/// Index header length.
pub const INDEX_HEADER: usize = 32;
/// Index entry length.
pub const ENTRY_LEN: usize = 64;
/// Segment record header length.
pub const RECORD_HEADER: usize = 32;
/// Largest device state accepted (compressed, and decompressed).
pub const MAX_DEVICE_STATE: u32 = 64 << 20;
/// Largest guest RAM a store holds.
pub const MAX_MEM: u64 = 1 << 40;
/// zstd's largest expansion (see [`tandem_codec::format::MAX_ZSTD_RATIO`]).
const MAX_ZSTD_RATIO: u64 = tandem_codec::format::MAX_ZSTD_RATIO;

/// What a record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RecordKind {
    /// The whole guest RAM (against zeros).
    Base = 1,
    /// Changes since the previous checkpoint.
    Delta = 2,
}

impl RecordKind {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(RecordKind::Base),
            2 => Some(RecordKind::Delta),
            _ => None,
        }
    }
}

/// One committed checkpoint in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Entry {
    /// Base or delta.
    pub kind: RecordKind,
    /// Checkpoint id (increasing by one).
    pub id: u64,
    /// Segment number.
    pub segment: u32,
    /// Record offset in the segment.
    pub offset: u64,
    /// Record length.
    pub len: u32,
    /// Checksum of guest RAM at the checkpoint (see [`crate::ramhash`]).
    pub ram_hash: u64,
    /// Wall-clock time of the checkpoint (Unix ms).
    pub time_ms: u64,
    /// Guest pause of the checkpoint in µs.
    pub pause_us: u32,
    /// Dirty pages in the checkpoint.
    pub dirty_pages: u32,
}

use tandem_types::framing::{has_magic, u32_at, u64_at};

/// The index header for a guest of `mem_bytes` (a store without disks).
pub fn index_header(mem_bytes: u64) -> [u8; INDEX_HEADER] {
    index_header_version(mem_bytes, INDEX_VERSION)
}

/// The index header of format `version`.
pub fn index_header_version(mem_bytes: u64, version: u32) -> [u8; INDEX_HEADER] {
    let mut h = [0u8; INDEX_HEADER];
    h[..8].copy_from_slice(INDEX_MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    h[12..16].copy_from_slice(&(tandem_codec::format::PAGE as u32).to_le_bytes());
    h[16..24].copy_from_slice(&mem_bytes.to_le_bytes());
    let crc = crc32c::crc32c(&h[..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Parses the index header; returns the guest size or what is wrong.
pub fn parse_index_header(h: &[u8]) -> Result<u64, String> {
    if h.len() < INDEX_HEADER || !has_magic(h, INDEX_MAGIC) {
        return Err("not a tandem checkpoint index (bad magic)".into());
    }
    if crc32c::crc32c(&h[..28]) != u32_at(h, 28) {
        return Err("index header checksum mismatch".into());
    }
    let v = u32_at(h, 8);
    if v != INDEX_VERSION && v != INDEX_VERSION_DISKS {
        return Err(format!(
            "index version {v} is not supported (this tandem reads {INDEX_VERSION} and {INDEX_VERSION_DISKS})"
        ));
    }
    if u32_at(h, 12) as usize != tandem_codec::format::PAGE {
        return Err(format!("page size {} is not supported", u32_at(h, 12)));
    }
    let mem = u64_at(h, 16);
    if mem == 0 || mem > MAX_MEM || !mem.is_multiple_of(tandem_codec::format::PAGE as u64) {
        return Err(format!(
            "implausible guest size of {mem} bytes (a multiple of 4096 up to {MAX_MEM})"
        ));
    }
    Ok(mem)
}

impl Entry {
    /// Serialises the entry.
    pub fn encode(&self) -> [u8; ENTRY_LEN] {
        let mut b = [0u8; ENTRY_LEN];
        b[..4].copy_from_slice(b"TIDX");
        b[4] = self.kind as u8;
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.segment.to_le_bytes());
        b[20..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.ram_hash.to_le_bytes());
        b[40..48].copy_from_slice(&self.time_ms.to_le_bytes());
        b[48..52].copy_from_slice(&self.pause_us.to_le_bytes());
        b[52..56].copy_from_slice(&self.dirty_pages.to_le_bytes());
        let crc = crc32c::crc32c(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses an entry; `None` if the magic, kind or checksum is wrong (a torn or damaged
    /// entry).
    pub fn decode(b: &[u8]) -> Option<Entry> {
        if b.len() < ENTRY_LEN
            || !has_magic(b, b"TIDX")
            || crc32c::crc32c(&b[..60]) != u32_at(b, 60)
        {
            return None;
        }
        Some(Entry {
            kind: RecordKind::from_u8(b[4])?,
            id: u64_at(b, 8),
            segment: u32_at(b, 16),
            len: u32_at(b, 20),
            offset: u64_at(b, 24),
            ram_hash: u64_at(b, 32),
            time_ms: u64_at(b, 40),
            pause_us: u32_at(b, 48),
            dirty_pages: u32_at(b, 52),
        })
    }
}

/// Whether `e` can follow `prev` in the index: the next id, and where appends and compaction
/// put records — right after its predecessor in the same segment (compaction copies later
/// bases there too), or, for a base, at the start of a newer segment. Anything else is damage
/// or a crafted entry, and trusting it would let `open_append` cut committed records off
/// their segment.
pub(crate) fn follows(prev: Option<&Entry>, e: &Entry) -> bool {
    let base = e.kind == RecordKind::Base;
    match prev {
        None => base && e.offset == 0,
        Some(p) if p.id.checked_add(1) == Some(e.id) => {
            let after =
                e.segment == p.segment && p.offset.checked_add(p.len as u64) == Some(e.offset);
            after || (base && e.offset == 0 && e.segment > p.segment)
        }
        Some(_) => false,
    }
}

/// Builds a segment record without disk writes; fails if a part exceeds the format's limits.
pub fn encode_record(
    kind: RecordKind,
    id: u64,
    memory: &[u8],
    device_state: &[u8],
) -> Result<Vec<u8>, crate::StoreError> {
    encode_record_with_disk(kind, id, memory, device_state, &[])
}

/// Builds a segment record with a disk section (`disk`: the encoded writes, empty for none).
pub fn encode_record_with_disk(
    kind: RecordKind,
    id: u64,
    memory: &[u8],
    device_state: &[u8],
    disk: &[u8],
) -> Result<Vec<u8>, crate::StoreError> {
    let too_large = |what, len: usize, max: u64| crate::StoreError::TooLarge {
        what,
        len: len as u64,
        max,
    };
    let max_dev = MAX_DEVICE_STATE as u64;
    if device_state.len() as u64 > max_dev {
        return Err(too_large("device state", device_state.len(), max_dev));
    }
    let zstd = |data: &[u8]| {
        let mut out = Vec::new();
        tandem_codec::prefix::compress_alone(data, 1, &mut out)
            .map(|()| out)
            .map_err(|e| crate::StoreError::Encode(tandem_codec::EncodeError::Compress(e)))
    };
    let dev = zstd(device_state)?;
    if dev.len() as u64 > max_dev {
        return Err(too_large("compressed device state", dev.len(), max_dev));
    }
    if disk.len() as u64 > MAX_DISK_SECTION {
        return Err(too_large("disk writes", disk.len(), MAX_DISK_SECTION));
    }
    let disk = if disk.is_empty() {
        Vec::new()
    } else {
        zstd(disk)?
    };
    let total = RECORD_HEADER + memory.len() + dev.len() + disk.len();
    if total as u64 > u32::MAX as u64 {
        return Err(too_large("checkpoint record", total, u32::MAX as u64));
    }
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(b"TSEG");
    out.push(kind as u8);
    out.extend_from_slice(&[0; 3]);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&(memory.len() as u32).to_le_bytes());
    out.extend_from_slice(&(dev.len() as u32).to_le_bytes());
    out.extend_from_slice(&(disk.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(memory);
    out.extend_from_slice(&dev);
    out.extend_from_slice(&disk);
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[..28]), &out[RECORD_HEADER..]);
    out[28..32].copy_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// A parsed segment record.
#[derive(Debug)]
pub struct SegmentRecord<'a> {
    /// Base or delta.
    pub kind: RecordKind,
    /// Checkpoint id.
    pub id: u64,
    /// The codec record.
    pub memory: &'a [u8],
    /// Compressed device state.
    pub device_state_zstd: &'a [u8],
    /// Compressed disk writes (empty: none).
    pub disk_zstd: &'a [u8],
}

/// Parses and checks a segment record (whole buffer).
pub fn decode_record(b: &[u8]) -> Result<SegmentRecord<'_>, String> {
    if b.len() < RECORD_HEADER || !has_magic(b, b"TSEG") {
        return Err("bad record magic".into());
    }
    let kind = RecordKind::from_u8(b[4]).ok_or_else(|| format!("unknown record kind {}", b[4]))?;
    let mem_len = u32_at(b, 16) as u64;
    let dev_len = u32_at(b, 20) as u64;
    let disk_len = u32_at(b, 24) as u64;
    if dev_len > MAX_DEVICE_STATE as u64 {
        return Err(format!("device state of {dev_len} bytes exceeds the limit"));
    }
    if disk_len > MAX_DISK_SECTION {
        return Err(format!(
            "disk section of {disk_len} bytes exceeds the limit"
        ));
    }
    if RECORD_HEADER as u64 + mem_len + dev_len + disk_len != b.len() as u64 {
        return Err("record length does not match its header".into());
    }
    let (mem_len, dev_len) = (mem_len as usize, dev_len as usize);
    let crc = tandem_types::framing::crc32c(&[&b[..28], &b[RECORD_HEADER..]]);
    if crc != u32_at(b, 28) {
        return Err("record checksum mismatch".into());
    }
    Ok(SegmentRecord {
        kind,
        id: u64_at(b, 8),
        memory: &b[RECORD_HEADER..RECORD_HEADER + mem_len],
        device_state_zstd: &b[RECORD_HEADER + mem_len..RECORD_HEADER + mem_len + dev_len],
        disk_zstd: &b[RECORD_HEADER + mem_len + dev_len..],
    })
}

/// Decompresses a record's disk writes (empty when it has none), bounded like
/// [`device_state`].
pub fn disk_writes(r: &SegmentRecord<'_>) -> Result<Vec<u8>, String> {
    let z = r.disk_zstd;
    if z.is_empty() {
        return Ok(Vec::new());
    }
    let most = (z.len() as u64)
        .saturating_mul(MAX_ZSTD_RATIO)
        .min(MAX_DISK_SECTION);
    let cap = match zstd::zstd_safe::get_frame_content_size(z) {
        Ok(Some(n)) if n > most => {
            return Err(format!(
                "disk writes declare {n} bytes, their {} compressed bytes hold at most {most}",
                z.len()
            ))
        }
        Ok(Some(n)) => n,
        _ => most,
    };
    tandem_codec::prefix::decompress_alone(z, cap as usize)
        .map_err(|e| format!("disk writes do not decompress: {e}"))
}

/// Decompresses a record's device state (at most [`MAX_DEVICE_STATE`] bytes, and no more
/// than its compressed size can expand to: the buffer is sized by that, not by a guess).
pub fn device_state(r: &SegmentRecord<'_>) -> Result<Vec<u8>, String> {
    let z = r.device_state_zstd;
    let most = (z.len() as u64)
        .saturating_mul(MAX_ZSTD_RATIO)
        .min(MAX_DEVICE_STATE as u64);
    let cap = match zstd::zstd_safe::get_frame_content_size(z) {
        Ok(Some(n)) if n > most => {
            return Err(format!(
                "device state declares {n} bytes, its {} compressed bytes hold at most {most}",
                z.len()
            ))
        }
        Ok(Some(n)) => n,
        _ => most,
    };
    tandem_codec::prefix::decompress_alone(z, cap as usize)
        .map_err(|e| format!("device state does not decompress: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn records_round_trip(mem in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2000),
                              dev in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2000),
                              id in 0u64..1000, base in proptest::prelude::any::<bool>()) {
            let kind = if base { RecordKind::Base } else { RecordKind::Delta };
            let disk: Vec<u8> = mem.iter().rev().copied().collect();
            let r = encode_record_with_disk(kind, id, &mem, &dev, &disk).unwrap();
            let p = decode_record(&r).unwrap();
            proptest::prop_assert_eq!((p.kind, p.id, p.memory), (kind, id, &mem[..]));
            proptest::prop_assert_eq!(device_state(&p).unwrap(), dev);
            proptest::prop_assert_eq!(disk_writes(&p).unwrap(), disk);
        }

        #[test]
        fn entries_round_trip(id in proptest::prelude::any::<u64>(), seg in proptest::prelude::any::<u32>(),
                              off in proptest::prelude::any::<u64>(), h in proptest::prelude::any::<u64>()) {
            let e = Entry { kind: RecordKind::Delta, id, segment: seg, offset: off, len: 77, ram_hash: h,
                            time_ms: 5, pause_us: 6, dirty_pages: 7 };
            proptest::prop_assert_eq!(Entry::decode(&e.encode()), Some(e));
        }
    }

    #[test]
    fn any_flipped_byte_is_detected() {
        let r = encode_record_with_disk(RecordKind::Delta, 3, b"memory-record", b"device", b"disk")
            .unwrap();
        for i in 0..r.len() {
            let mut b = r.clone();
            b[i] ^= 0x40;
            assert!(decode_record(&b).is_err(), "flip at {i}");
        }
        let e = Entry {
            kind: RecordKind::Base,
            id: 1,
            segment: 1,
            offset: 0,
            len: 9,
            ram_hash: 1,
            time_ms: 2,
            pause_us: 3,
            dirty_pages: 4,
        }
        .encode();
        for i in 0..ENTRY_LEN {
            let mut b = e;
            b[i] ^= 1;
            assert_eq!(Entry::decode(&b), None, "flip at {i}");
        }
        assert!(parse_index_header(&index_header(1 << 28)).is_ok());
    }
}
