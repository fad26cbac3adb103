//! Retention: the oldest kept checkpoint becomes a base in a new segment, later records are
//! copied after it byte for byte, and a complete new index (`index.tmp`, fsynced) is renamed
//! over `index`; only then are unreferenced segments deleted. A crash at any point leaves
//! either the old or the new index, each referring only to synced data. A compaction that
//! fails (disk full) before the rename deletes what it wrote and leaves the store as it was.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;

use tandem_codec::{Codec, Config, Encoder};

use crate::format::{
    decode_record, encode_record, index_header_version, Entry, RecordKind, INDEX_VERSION,
    INDEX_VERSION_DISKS,
};
use crate::store::{io, seg_name, sync_dir, zeroed, Store, StoreError};

const PAGE: usize = tandem_codec::format::PAGE;

/// Where a compaction can be cut short in tests.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// New segment written, not synced, no new index.
    SegmentWritten,
    /// New index written and synced as `index.tmp`, not renamed.
    NewIndexWritten,
    /// New index in place, old segments not yet deleted.
    Renamed,
}

impl std::str::FromStr for CrashPoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "segment" => Ok(CrashPoint::SegmentWritten),
            "index" => Ok(CrashPoint::NewIndexWritten),
            "renamed" => Ok(CrashPoint::Renamed),
            _ => Err(format!("unknown crash point {s:?}")),
        }
    }
}

/// Files a compaction writes, and whether its new index is in place.
struct Written {
    segment: std::path::PathBuf,
    tmp: std::path::PathBuf,
    renamed: bool,
}

impl Store {
    /// Keeps the newest `keep` checkpoints: the oldest kept one becomes a base in a new
    /// segment, later records are copied after it, and a new index replaces the old one
    /// atomically. Returns the number of checkpoints dropped.
    pub fn compact(&mut self, keep: usize, codec: Codec, cfg: Config) -> Result<usize, StoreError> {
        self.compact_until(keep, codec, cfg, None)
    }

    /// [`Store::compact`] that stops dead at `crash` (leaving the files as a crash there
    /// would), for crash-safety tests.
    #[doc(hidden)]
    pub fn compact_until(
        &mut self,
        keep: usize,
        codec: Codec,
        cfg: Config,
        crash: Option<CrashPoint>,
    ) -> Result<usize, StoreError> {
        let keep = keep.max(1);
        if self.entries.len() <= keep {
            return Ok(0);
        }
        let n = self.next_segment()?;
        let mut w = Written {
            segment: self.dir.join(seg_name(n)),
            tmp: self.dir.join("index.tmp"),
            renamed: false,
        };
        let r = self.compact_into(n, &mut w, keep, codec, cfg, crash);
        if r.is_err() && !w.renamed {
            // Not committed: the old index still rules; remove what this attempt wrote.
            for p in [&w.segment, &w.tmp] {
                let _ = fs::remove_file(p);
            }
        }
        r
    }

    fn compact_into(
        &mut self,
        n: u32,
        w: &mut Written,
        keep: usize,
        codec: Codec,
        cfg: Config,
        crash: Option<CrashPoint>,
    ) -> Result<usize, StoreError> {
        let first = self.entries.len() - keep;
        let r = self.entries[first];
        let mut ram = zeroed(self.mem_bytes)?;
        let dev = self.materialize_zeroed(r.id, &mut ram)?;
        let base = encode_base(r.id, &ram, codec, cfg)?;
        drop(ram);
        // With disks, R's disks become a disk base too (before the commit: a base of a
        // committed checkpoint is valid whether or not the compaction finishes).
        if self.disks.is_some() && !self.has_disk_base(r.id) {
            let scratch = self.disk_base_scratch();
            let _ = fs::remove_file(&scratch);
            self.materialize_disks(r.id, &scratch)?;
            self.add_disk_base(r.id, &scratch)?;
        }
        let sp = &w.segment.clone();
        let seg = OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(sp)
            .map_err(io(sp))?;
        let rec = encode_record(RecordKind::Base, r.id, &base, &dev)?;
        let len = |l: usize| {
            u32::try_from(l).map_err(|_| StoreError::TooLarge {
                what: "checkpoint record",
                len: l as u64,
                max: u32::MAX as u64,
            })
        };
        let mut entries = vec![Entry {
            kind: RecordKind::Base,
            segment: n,
            offset: 0,
            len: len(rec.len())?,
            ..r
        }];
        seg.write_all_at(&rec, 0).map_err(io(sp))?;
        let mut end = rec.len() as u64;
        for e in &self.entries[first + 1..] {
            let b = self.read(e)?;
            decode_record(&b).map_err(|why| self.damaged(e, why))?;
            seg.write_all_at(&b, end).map_err(io(sp))?;
            entries.push(Entry {
                segment: n,
                offset: end,
                len: len(b.len())?,
                ..*e
            });
            end = end
                .checked_add(b.len() as u64)
                .ok_or(StoreError::Exhausted("segment offsets"))?;
        }
        if crash == Some(CrashPoint::SegmentWritten) {
            return Ok(0);
        }
        seg.sync_all().map_err(io(sp))?;
        let tmp = &w.tmp.clone();
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(tmp)
            .map_err(io(tmp))?;
        let version = if self.disks.is_some() {
            INDEX_VERSION_DISKS
        } else {
            INDEX_VERSION
        };
        let mut bytes = index_header_version(self.mem_bytes, version).to_vec();
        for e in &entries {
            bytes.extend_from_slice(&e.encode());
        }
        f.write_all(&bytes).map_err(io(tmp))?;
        f.sync_all().map_err(io(tmp))?;
        if crash == Some(CrashPoint::NewIndexWritten) {
            return Ok(0);
        }
        let ip = self.dir.join("index");
        fs::rename(tmp, &ip).map_err(io(&ip))?;
        w.renamed = true;
        // Committed once the rename is durable; from here on this handle follows the new
        // index (its file is `f`), whatever happens next.
        let dropped = first;
        self.entries = entries;
        self.index = Some(f);
        self.seg = Some((n, seg, end));
        sync_dir(&self.dir)?;
        if crash == Some(CrashPoint::Renamed) {
            return Ok(0);
        }
        // The new state is committed; old segments and disk bases are garbage from here on.
        self.remove_unreferenced()?;
        self.drop_disk_bases(|id| id < r.id)?;
        Ok(dropped)
    }
}

/// Encodes all of `ram` as a base record (a codec record against an all-zero image).
pub fn encode_base(id: u64, ram: &[u8], codec: Codec, cfg: Config) -> Result<Vec<u8>, StoreError> {
    let zeros = zeroed(ram.len() as u64)?;
    let mut enc = Encoder::new(codec, &zeros, cfg)?;
    drop(zeros);
    let mut pfns = Vec::new();
    let mut pages = Vec::new();
    for (i, p) in ram.chunks(PAGE).enumerate() {
        if p.iter().any(|&b| b != 0) {
            pfns.push(i as u64);
            pages.extend_from_slice(p);
        }
    }
    let mut out = Vec::new();
    enc.encode(id, &pfns, &pages, &mut out)?;
    Ok(out)
}
