//! Your own VM's writable disks in the store: a checkpoint's disks are consistent with its
//! memory (both taken in the same pause).
//!
//! ```text
//! D/disks             which disks, where each lies in one combined image, the disk bases
//! D/disk-<ID>.img     a disk base: the combined image at checkpoint ID (raw, sparse)
//! record disk section the disks' writes since the previous checkpoint (zstd of
//!                     tandem_disk::image::encode_writes: count u32, then offset u64 |
//!                     length u32 | bytes per write)
//!
//! disks file: magic "TNDMDSK1" | version u32 = 1 | count u32 (1..=64) | total u64
//!   per disk:  index u32 | offset u64 | size u64 | path_len u16 (≤ 4096) | path (UTF-8)
//!   bases u32 (≤ 4096), per base: id u64 | xxh3 u64 of the image file
//!   crc32c u32 over everything before it
//! ```
//! Checkpoint K's disks are the newest base B ≤ K with the disk sections of checkpoints
//! B+1..=K applied in order. A base is written (fsynced, its hash recorded in `disks`, which
//! is replaced by rename) before the checkpoint it belongs to is committed; a base newer than
//! the last committed checkpoint (a crash, a skipped checkpoint) is ignored by readers and
//! removed by the next writer. Compaction writes a base for the oldest kept checkpoint before
//! it commits and removes the older bases after.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tandem_types::framing::{has_magic, u32_at, u64_at};

use crate::format::{decode_record, disk_writes};
use crate::store::{io, sync_dir, Store, StoreError};

const MAGIC: &[u8; 8] = b"TNDMDSK1";
const VERSION: u32 = 1;
const MAX_DISKS: usize = 64;
const MAX_PATH: usize = 4096;
const MAX_BASES: usize = 4096;
/// Largest combined disk image (16 TiB).
pub const MAX_DISK_BYTES: u64 = 1 << 44;
const CHUNK: usize = 1 << 20;

/// One writable disk of the VM.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DiskSpec {
    /// Its position among the VM description's disks.
    pub index: u32,
    /// Where it starts in the combined image.
    pub offset: u64,
    /// Its virtual size.
    pub size: u64,
    /// Its path when the checkpoints were saved (for messages).
    pub path: String,
}

/// The store's disks and bases.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DiskLayout {
    /// The disks, in the order of the VM description.
    pub disks: Vec<DiskSpec>,
    /// Size of the combined image.
    pub total: u64,
    /// Disk bases: checkpoint id and the xxh3 of the image file.
    pub bases: Vec<(u64, u64)>,
}

impl DiskLayout {
    /// A layout without bases; checks the disks lie inside `total` without overlapping.
    pub fn new(disks: Vec<DiskSpec>, total: u64) -> Result<DiskLayout, String> {
        let l = DiskLayout {
            disks,
            total,
            bases: Vec::new(),
        };
        l.check()?;
        Ok(l)
    }

    fn check(&self) -> Result<(), String> {
        if self.disks.is_empty() || self.disks.len() > MAX_DISKS {
            return Err(format!("{} disks (1 to {MAX_DISKS})", self.disks.len()));
        }
        if self.total > MAX_DISK_BYTES || self.bases.len() > MAX_BASES {
            return Err("disk layout exceeds the format's limits".into());
        }
        let mut end = 0u64;
        for d in &self.disks {
            let e = d.offset.checked_add(d.size).filter(|&e| e <= self.total);
            match e {
                Some(e) if d.offset >= end && d.path.len() <= MAX_PATH => end = e,
                _ => return Err(format!("disk {} lies outside the combined image", d.index)),
            }
        }
        Ok(())
    }

    /// Serialises the layout.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.disks.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.total.to_le_bytes());
        for d in &self.disks {
            b.extend_from_slice(&d.index.to_le_bytes());
            b.extend_from_slice(&d.offset.to_le_bytes());
            b.extend_from_slice(&d.size.to_le_bytes());
            b.extend_from_slice(&(d.path.len() as u16).to_le_bytes());
            b.extend_from_slice(d.path.as_bytes());
        }
        b.extend_from_slice(&(self.bases.len() as u32).to_le_bytes());
        for (id, h) in &self.bases {
            b.extend_from_slice(&id.to_le_bytes());
            b.extend_from_slice(&h.to_le_bytes());
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses and checks a layout.
    pub fn decode(b: &[u8]) -> Result<DiskLayout, String> {
        if b.len() < 28 || !has_magic(b, MAGIC) {
            return Err("not a tandem disks file (bad magic)".into());
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32c::crc32c(body) != u32_at(crc, 0) {
            return Err("disks file checksum mismatch".into());
        }
        if u32_at(b, 8) != VERSION {
            return Err(format!(
                "disks file version {} is not supported",
                u32_at(b, 8)
            ));
        }
        let n = u32_at(b, 12) as usize;
        if n == 0 || n > MAX_DISKS {
            return Err(format!("{n} disks (1 to {MAX_DISKS})"));
        }
        let total = u64_at(b, 16);
        let short = || "disks file is truncated".to_string();
        let mut pos = 24;
        let mut disks = Vec::with_capacity(n);
        for _ in 0..n {
            let h = body.get(pos..pos + 22).ok_or_else(short)?;
            let len = u16::from_le_bytes([h[20], h[21]]) as usize;
            let path = body.get(pos + 22..pos + 22 + len).ok_or_else(short)?;
            disks.push(DiskSpec {
                index: u32_at(h, 0),
                offset: u64_at(h, 4),
                size: u64_at(h, 12),
                path: String::from_utf8_lossy(path).into_owned(),
            });
            pos += 22 + len;
        }
        let nb = u32_at(body.get(pos..pos + 4).ok_or_else(short)?, 0) as usize;
        if nb > MAX_BASES || body.len() != pos + 4 + nb * 16 {
            return Err("disks file has a wrong length".into());
        }
        let bases = (0..nb)
            .map(|i| {
                let o = pos + 4 + i * 16;
                (u64_at(body, o), u64_at(body, o + 8))
            })
            .collect();
        let l = DiskLayout {
            disks,
            total,
            bases,
        };
        l.check()?;
        Ok(l)
    }
}

/// File name of the disk base of checkpoint `id`.
pub fn base_name(id: u64) -> String {
    format!("disk-{id:016}.img")
}

/// Reads `D/disks` if the store has disks.
pub(crate) fn read_layout(dir: &Path) -> Result<Option<DiskLayout>, StoreError> {
    let p = dir.join("disks");
    match fs::read(&p) {
        Ok(b) => DiskLayout::decode(&b)
            .map(Some)
            .map_err(|why| StoreError::NotAStore(dir.display().to_string(), why)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StoreError::Io(p.display().to_string(), e)),
    }
}

/// Replaces `D/disks` atomically.
pub(crate) fn write_layout(dir: &Path, l: &DiskLayout) -> Result<(), StoreError> {
    let tmp = dir.join("disks.tmp");
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(&l.encode()).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    let p = dir.join("disks");
    fs::rename(&tmp, &p).map_err(io(&p))?;
    sync_dir(dir)
}

/// xxh3 of a file's bytes, read in 1 MiB chunks.
fn hash_file(f: &mut File, path: &Path) -> Result<u64, StoreError> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            return Ok(h.digest());
        }
        h.update(&buf[..n]);
    }
}

impl Store {
    /// The store's disks, if its checkpoints include disks.
    pub fn disks(&self) -> Option<&DiskLayout> {
        self.disks.as_ref()
    }

    /// Where a new disk base is prepared before [`Store::add_disk_base`] takes it.
    pub fn disk_base_scratch(&self) -> PathBuf {
        self.dir.join("disk-new.tmp")
    }

    /// Takes the finished combined image at `file` (in the store directory) as the disk base
    /// of checkpoint `id`, which must be the next checkpoint to be committed or an existing
    /// one: syncs it, records its hash and renames it into place.
    pub fn add_disk_base(&mut self, id: u64, file: &Path) -> Result<(), StoreError> {
        let Some(mut l) = self.disks.clone() else {
            return Err(StoreError::NotAStore(
                self.dir.display().to_string(),
                "it holds no disks".into(),
            ));
        };
        let mut f = File::open(file).map_err(io(file))?;
        let len = f.metadata().map_err(io(file))?.len();
        if len != l.total {
            return Err(StoreError::Disk(format!(
                "a disk base of {len} bytes for a {}-byte disk layout",
                l.total
            )));
        }
        f.sync_all().map_err(io(file))?;
        let h = hash_file(&mut f, file)?;
        let dst = self.dir.join(base_name(id));
        fs::rename(file, &dst).map_err(io(&dst))?;
        l.bases.retain(|b| b.0 != id);
        l.bases.push((id, h));
        l.bases.sort_unstable();
        write_layout(&self.dir, &l)?;
        self.disks = Some(l);
        Ok(())
    }

    /// Forgets the disk bases newer than the last committed checkpoint (a skipped checkpoint
    /// or a crash left them) and deletes their files.
    pub fn drop_uncommitted_disk_bases(&mut self) -> Result<(), StoreError> {
        let last = self.entries.last().map_or(0, |e| e.id);
        self.drop_disk_bases(|id| id > last)
    }

    pub(crate) fn drop_disk_bases(&mut self, gone: impl Fn(u64) -> bool) -> Result<(), StoreError> {
        let Some(mut l) = self.disks.clone() else {
            return Ok(());
        };
        let (drop, keep): (Vec<_>, Vec<_>) = l.bases.iter().partition(|b| gone(b.0));
        if drop.is_empty() {
            return Ok(());
        }
        l.bases = keep;
        write_layout(&self.dir, &l)?;
        for (id, _) in drop {
            let _ = fs::remove_file(self.dir.join(base_name(id)));
        }
        self.disks = Some(l);
        Ok(())
    }

    /// Writes checkpoint `id`'s disks, as one combined raw image, into a new file at `out`
    /// (sparse; removed again on failure). The base's hash and every record on the way are
    /// checked.
    pub fn materialize_disks(&self, id: u64, out: &Path) -> Result<(), StoreError> {
        let r = self.materialize_disks_into(id, out);
        if r.is_err() {
            let _ = fs::remove_file(out);
        }
        r
    }

    fn materialize_disks_into(&self, id: u64, out: &Path) -> Result<(), StoreError> {
        let l = self
            .disks
            .as_ref()
            .ok_or_else(|| StoreError::Disk(format!("{} holds no disks", self.dir.display())))?;
        let last = self.entries.last().map_or(0, |e| e.id);
        let &(bid, bhash) = l
            .bases
            .iter()
            .rev()
            .find(|b| b.0 <= id && b.0 <= last)
            .ok_or_else(|| {
                StoreError::Disk(format!("no disk base at or before checkpoint {id}"))
            })?;
        let first = self.entries.first().map_or(u64::MAX, |e| e.id);
        if !self.entries.iter().any(|e| e.id == id) {
            return Err(StoreError::NoCheckpoint(id, format!("{first}..={last}")));
        }
        if id > bid && first > bid + 1 {
            return Err(StoreError::Disk(format!(
                "the disk writes between disk base {bid} and checkpoint {id} are no longer in the store"
            )));
        }
        let bpath = self.dir.join(base_name(bid));
        let mut src = File::open(&bpath).map_err(io(&bpath))?;
        let dst = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(out)
            .map_err(io(out))?;
        dst.set_len(l.total).map_err(io(out))?;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut buf = vec![0u8; CHUNK];
        let mut off = 0u64;
        loop {
            let n = src.read(&mut buf).map_err(io(&bpath))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            if buf[..n].iter().any(|&b| b != 0) {
                dst.write_all_at(&buf[..n], off).map_err(io(out))?;
            }
            off += n as u64;
        }
        if off != l.total || h.digest() != bhash {
            return Err(StoreError::Disk(format!(
                "disk base {} is damaged (its contents do not match the hash recorded in {}/disks)",
                bpath.display(),
                self.dir.display()
            )));
        }
        for e in self.entries.iter().filter(|e| e.id > bid && e.id <= id) {
            let b = self.read(e)?;
            let r = decode_record(&b).map_err(|w| self.damaged(e, w))?;
            let section = disk_writes(&r).map_err(|w| self.damaged(e, w))?;
            if section.is_empty() {
                continue;
            }
            let Some(writes) = tandem_disk::image::decode_writes(&section, l.total) else {
                return Err(self.damaged(e, "its disk writes do not parse".into()));
            };
            for (o, d) in writes {
                dst.write_all_at(d, o).map_err(io(out))?;
            }
        }
        dst.sync_all().map_err(io(out))?;
        Ok(())
    }

    /// Checks every disk base against its hash (`verify`); the first damaged one.
    pub fn verify_disk_bases(&self) -> Result<(), StoreError> {
        let Some(l) = &self.disks else {
            return Ok(());
        };
        for &(id, want) in &l.bases {
            let p = self.dir.join(base_name(id));
            let mut f = File::open(&p).map_err(io(&p))?;
            if hash_file(&mut f, &p)? != want {
                return Err(StoreError::Disk(format!(
                    "disk base {} is damaged (its contents do not match its recorded hash)",
                    p.display()
                )));
            }
        }
        Ok(())
    }

    /// Whether checkpoint `id` has a disk base.
    pub(crate) fn has_disk_base(&self, id: u64) -> bool {
        self.disks
            .as_ref()
            .is_some_and(|l| l.bases.iter().any(|b| b.0 == id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> DiskLayout {
        let mut l = DiskLayout::new(
            vec![
                DiskSpec {
                    index: 0,
                    offset: 0,
                    size: 4096,
                    path: "/a.qcow2".into(),
                },
                DiskSpec {
                    index: 2,
                    offset: 1 << 20,
                    size: 8192,
                    path: "/b.raw".into(),
                },
            ],
            (1 << 20) + 8192,
        )
        .unwrap();
        l.bases = vec![(1, 7), (9, 8)];
        l
    }

    #[test]
    fn layout_round_trips_and_every_flipped_byte_is_caught() {
        let l = layout();
        let b = l.encode();
        assert_eq!(DiskLayout::decode(&b).unwrap(), l);
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x10;
            assert!(DiskLayout::decode(&c).is_err(), "flip at {i}");
        }
        assert!(DiskLayout::decode(&b[..b.len() - 1]).is_err());
    }

    #[test]
    fn overlapping_or_outside_disks_are_refused() {
        let d = |offset, size| DiskSpec {
            index: 0,
            offset,
            size,
            path: String::new(),
        };
        assert!(DiskLayout::new(vec![d(0, 10), d(5, 10)], 100).is_err());
        assert!(DiskLayout::new(vec![d(0, 200)], 100).is_err());
        assert!(DiskLayout::new(vec![], 100).is_err());
        assert!(DiskLayout::new(vec![d(0, 50), d(50, 50)], 100).is_ok());
    }
}
