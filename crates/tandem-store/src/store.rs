//! The store directory: `index` plus `seg-NNNNNNNN.tseg` segment files (see [`crate::format`]).
//!
//! Commit order for a checkpoint: record appended to the current segment → segment fsynced →
//! index entry appended → index fsynced. A base starts a new segment. Compaction writes a new
//! segment (a base for the oldest kept checkpoint, then the later records copied as they are)
//! and a complete new index, fsyncs both, renames the index into place and fsyncs the
//! directory; only then are unreferenced segments deleted. A crash at any point leaves either
//! the old or the new index, each referring only to synced data.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tandem_codec::{decode, Codec, Config, DecodeError, EncodeError, Encoder, Plan};

use crate::format::{
    decode_record, device_state, encode_record, index_header, parse_index_header, Entry,
    RecordKind, ENTRY_LEN, INDEX_HEADER,
};
use crate::ramhash::RamHash;

const PAGE: usize = tandem_codec::format::PAGE;

/// Store errors. Each names what is wrong and, for damage, the checkpoint and segment.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// File-system error on a path.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// The directory is not a checkpoint store.
    #[error("{0} is not a usable checkpoint store: {1}")]
    NotAStore(String, String),
    /// `create` on a directory that already has a store.
    #[error("{0} already holds a checkpoint store (choose an empty directory)")]
    Exists(String),
    /// No such checkpoint.
    #[error("no checkpoint {0} in the store (it has {1})")]
    NoCheckpoint(u64, String),
    /// A record failed its checks.
    #[error("checkpoint {id} is damaged ({segment} at offset {offset}): {why}")]
    Damaged {
        /// Damaged checkpoint.
        id: u64,
        /// Segment file.
        segment: String,
        /// Record offset.
        offset: u64,
        /// What failed.
        why: String,
    },
    /// A checkpoint whose chain contains a damaged record.
    #[error("checkpoint {id} cannot be restored: it is rebuilt from checkpoint {damaged}, which is damaged ({segment}: {why}); checkpoints before {damaged} and from the next base on are unaffected")]
    DependsOnDamaged {
        /// Requested checkpoint.
        id: u64,
        /// Damaged checkpoint in its chain.
        damaged: u64,
        /// Segment file.
        segment: String,
        /// What failed.
        why: String,
    },
    /// Guest size mismatch.
    #[error("guest RAM is {got} bytes, the store holds {expected}-byte checkpoints")]
    Geometry {
        /// Store's guest size.
        expected: u64,
        /// Caller's.
        got: u64,
    },
    /// Encoding failed.
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |e| StoreError::Io(path.display().to_string(), e)
}

fn seg_name(n: u32) -> String {
    format!("seg-{n:08}.tseg")
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// Metadata recorded with a checkpoint.
#[derive(Debug, Clone, Copy, Default)]
pub struct Meta {
    /// RAM checksum ([`RamHash::value`]).
    pub ram_hash: u64,
    /// Wall-clock time (Unix ms).
    pub time_ms: u64,
    /// Guest pause (µs).
    pub pause_us: u32,
    /// Dirty pages.
    pub dirty_pages: u32,
}

/// An open store.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    mem_bytes: u64,
    entries: Vec<Entry>,
    torn: Option<String>,
    index: Option<File>,
    seg: Option<(u32, File, u64)>,
}

impl Store {
    /// Creates a store for a guest of `mem_bytes` in `dir` (created if missing, must not hold
    /// a store).
    pub fn create(dir: &Path, mem_bytes: u64) -> Result<Store, StoreError> {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let index = dir.join("index");
        if index.exists() {
            return Err(StoreError::Exists(dir.display().to_string()));
        }
        let tmp = dir.join("index.tmp");
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(&index_header(mem_bytes)).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        fs::rename(&tmp, &index).map_err(io(&index))?;
        sync_dir(dir)?;
        Self::open_append(dir)
    }

    /// Opens a store read-only. A torn or damaged tail of the index is ignored (see
    /// [`Store::torn_tail`]).
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        let path = dir.join("index");
        let bytes = fs::read(&path).map_err(|e| {
            StoreError::NotAStore(
                dir.display().to_string(),
                format!("cannot read its index: {e}"),
            )
        })?;
        let mem_bytes = parse_index_header(&bytes)
            .map_err(|why| StoreError::NotAStore(dir.display().to_string(), why))?;
        let mut entries: Vec<Entry> = Vec::new();
        let mut torn = None;
        let mut pos = INDEX_HEADER;
        while pos < bytes.len() {
            let e = bytes.get(pos..pos + ENTRY_LEN).and_then(Entry::decode);
            let ok = e.filter(|e| {
                let next = entries
                    .last()
                    .map_or(e.kind == RecordKind::Base, |p| e.id == p.id + 1);
                let seg = dir.join(seg_name(e.segment));
                let fits = fs::metadata(&seg).is_ok_and(|m| e.offset + e.len as u64 <= m.len());
                next && fits
            });
            match ok {
                Some(e) => entries.push(e),
                None => {
                    torn = Some(format!(
                        "ignored {} byte(s) of torn or inconsistent index tail after {}",
                        bytes.len() - pos,
                        entries
                            .last()
                            .map_or("the header".into(), |e| format!("checkpoint {}", e.id))
                    ));
                    break;
                }
            }
            pos += ENTRY_LEN;
        }
        Ok(Store {
            dir: dir.into(),
            mem_bytes,
            entries,
            torn,
            index: None,
            seg: None,
        })
    }

    /// Opens a store for appending: a torn tail is cut off (warned) and segments no committed
    /// entry refers to (left by a crash) are deleted.
    pub fn open_append(dir: &Path) -> Result<Store, StoreError> {
        let mut s = Self::open(dir)?;
        if let Some(t) = &s.torn {
            tracing::warn!("{}: {t}", dir.display());
        }
        let path = dir.join("index");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io(&path))?;
        f.set_len((INDEX_HEADER + s.entries.len() * ENTRY_LEN) as u64)
            .map_err(io(&path))?;
        f.sync_all().map_err(io(&path))?;
        s.index = Some(f);
        s.remove_unreferenced()?;
        if let Some(last) = s.entries.last().copied() {
            let p = dir.join(seg_name(last.segment));
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&p)
                .map_err(io(&p))?;
            let end = last.offset + last.len as u64;
            f.set_len(end).map_err(io(&p))?;
            s.seg = Some((last.segment, f, end));
        }
        Ok(s)
    }

    fn remove_unreferenced(&self) -> Result<(), StoreError> {
        let used: std::collections::HashSet<String> =
            self.entries.iter().map(|e| seg_name(e.segment)).collect();
        for d in fs::read_dir(&self.dir).map_err(io(&self.dir))?.flatten() {
            let name = d.file_name().to_string_lossy().into_owned();
            if (name.starts_with("seg-") && !used.contains(&name)) || name == "index.tmp" {
                tracing::info!("removing {name}: no committed checkpoint refers to it");
                let _ = fs::remove_file(d.path());
            }
        }
        sync_dir(&self.dir)
    }

    /// Guest RAM size of the checkpoints.
    pub fn mem_bytes(&self) -> u64 {
        self.mem_bytes
    }

    /// Committed checkpoints, oldest first.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// What was ignored at the index's tail, if anything.
    pub fn torn_tail(&self) -> Option<&str> {
        self.torn.as_deref()
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Segment file name of an entry.
    pub fn segment_name(e: &Entry) -> String {
        seg_name(e.segment)
    }

    /// Appends a checkpoint (durable and visible when this returns). A base starts a new
    /// segment.
    pub fn append(
        &mut self,
        kind: RecordKind,
        memory: &[u8],
        device_state: &[u8],
        meta: Meta,
    ) -> Result<Entry, StoreError> {
        let id = self.entries.last().map_or(1, |e| e.id + 1);
        if self.entries.is_empty() && kind != RecordKind::Base {
            return Err(StoreError::NotAStore(
                self.dir.display().to_string(),
                "the first checkpoint must be a base".into(),
            ));
        }
        let rec = encode_record(kind, id, memory, device_state);
        if kind == RecordKind::Base || self.seg.is_none() {
            let n = self.entries.iter().map(|e| e.segment).max().unwrap_or(0) + 1;
            let p = self.dir.join(seg_name(n));
            let f = OpenOptions::new()
                .create_new(true)
                .read(true)
                .write(true)
                .open(&p)
                .map_err(io(&p))?;
            sync_dir(&self.dir)?;
            self.seg = Some((n, f, 0));
        }
        let (n, f, end) = self
            .seg
            .as_mut()
            .ok_or_else(|| StoreError::NotAStore(String::new(), "no open segment".into()))?;
        let p = self.dir.join(seg_name(*n));
        f.write_all_at(&rec, *end).map_err(io(&p))?;
        f.sync_data().map_err(io(&p))?;
        let e = Entry {
            kind,
            id,
            segment: *n,
            offset: *end,
            len: rec.len() as u32,
            ram_hash: meta.ram_hash,
            time_ms: meta.time_ms,
            pause_us: meta.pause_us,
            dirty_pages: meta.dirty_pages,
        };
        *end += rec.len() as u64;
        let ip = self.dir.join("index");
        let idx = self.index.as_mut().ok_or_else(|| {
            StoreError::NotAStore(ip.display().to_string(), "opened read-only".into())
        })?;
        let at = (INDEX_HEADER + self.entries.len() * ENTRY_LEN) as u64;
        idx.write_all_at(&e.encode(), at).map_err(io(&ip))?;
        idx.sync_data().map_err(io(&ip))?;
        self.entries.push(e);
        Ok(e)
    }

    fn read(&self, e: &Entry) -> Result<Vec<u8>, StoreError> {
        let p = self.dir.join(seg_name(e.segment));
        let f = File::open(&p).map_err(io(&p))?;
        let mut b = vec![0u8; e.len as usize];
        f.read_exact_at(&mut b, e.offset).map_err(io(&p))?;
        Ok(b)
    }

    fn damaged(&self, e: &Entry, why: String) -> StoreError {
        StoreError::Damaged {
            id: e.id,
            segment: seg_name(e.segment),
            offset: e.offset,
            why,
        }
    }

    /// Applies one record of `e` onto `ram`; returns its device state.
    fn apply(
        &self,
        e: &Entry,
        ram: &mut [u8],
        plan: &mut Plan,
        zeroed: bool,
    ) -> Result<Vec<u8>, StoreError> {
        let bytes = self.read(e)?;
        let r = decode_record(&bytes).map_err(|w| self.damaged(e, w))?;
        if r.id != e.id || r.kind != e.kind {
            return Err(self.damaged(e, format!("record is checkpoint {} ({:?})", r.id, r.kind)));
        }
        if e.kind == RecordKind::Base && !zeroed {
            ram.fill(0);
        }
        decode(r.memory, ram, plan).map_err(|d: DecodeError| self.damaged(e, d.to_string()))?;
        if plan.epoch != e.id {
            return Err(self.damaged(e, format!("memory record of epoch {}", plan.epoch)));
        }
        plan.commit(ram);
        device_state(&r).map_err(|w| self.damaged(e, w))
    }

    /// The chain of `id`: its base and the deltas up to it.
    fn chain(&self, id: u64) -> Result<&[Entry], StoreError> {
        let i = self
            .entries
            .iter()
            .position(|e| e.id == id)
            .ok_or_else(|| {
                let have = match (self.entries.first(), self.entries.last()) {
                    (Some(a), Some(b)) => format!("checkpoints {} to {}", a.id, b.id),
                    _ => "no checkpoints".into(),
                };
                StoreError::NoCheckpoint(id, have)
            })?;
        let b = self.entries[..=i]
            .iter()
            .rposition(|e| e.kind == RecordKind::Base)
            .unwrap_or(0);
        Ok(&self.entries[b..=i])
    }

    /// Rebuilds guest RAM of checkpoint `id` into `ram` (guest-sized) and returns its device
    /// state. Every record of the chain is checked, and so is the RAM checksum at the end.
    pub fn materialize(&self, id: u64, ram: &mut [u8]) -> Result<Vec<u8>, StoreError> {
        self.materialize_into(id, ram, false)
    }

    /// [`Store::materialize`] into memory known to be all zeros (a fresh file or allocation):
    /// the base is written without clearing first, which keeps a tmpfs file sparse.
    pub fn materialize_zeroed(&self, id: u64, ram: &mut [u8]) -> Result<Vec<u8>, StoreError> {
        self.materialize_into(id, ram, true)
    }

    fn materialize_into(
        &self,
        id: u64,
        ram: &mut [u8],
        zeroed: bool,
    ) -> Result<Vec<u8>, StoreError> {
        if ram.len() as u64 != self.mem_bytes {
            return Err(StoreError::Geometry {
                expected: self.mem_bytes,
                got: ram.len() as u64,
            });
        }
        let chain = self.chain(id)?;
        let mut plan = Plan::default();
        let mut dev = Vec::new();
        for (i, e) in chain.iter().enumerate() {
            dev = self
                .apply(e, ram, &mut plan, zeroed && i == 0)
                .map_err(|err| match err {
                    StoreError::Damaged {
                        id: d,
                        segment,
                        why,
                        ..
                    } if d != id => StoreError::DependsOnDamaged {
                        id,
                        damaged: d,
                        segment,
                        why,
                    },
                    other => other,
                })?;
        }
        let last = chain[chain.len() - 1];
        if RamHash::of(ram).value() != last.ram_hash {
            return Err(self.damaged(&last, "guest RAM checksum differs after replay".into()));
        }
        Ok(dev)
    }

    /// Checks every record and every checkpoint's RAM checksum by replaying each chain.
    /// Returns one line per problem (empty = the store verifies).
    pub fn verify(&self, mut progress: impl FnMut(u64)) -> Vec<StoreError> {
        let mut out = Vec::new();
        let mut ram = vec![0u8; self.mem_bytes as usize];
        let mut plan = Plan::default();
        let mut broken = false;
        for e in &self.entries {
            progress(e.id);
            if e.kind == RecordKind::Base {
                broken = false;
            }
            if broken {
                continue;
            }
            let fresh = std::ptr::eq(e, &self.entries[0]);
            match self.apply(e, &mut ram, &mut plan, fresh) {
                Err(err) => {
                    out.push(err);
                    broken = true;
                }
                Ok(_) if RamHash::of(&ram).value() != e.ram_hash => {
                    out.push(self.damaged(e, "guest RAM checksum differs after replay".into()));
                    broken = true;
                }
                Ok(_) => {}
            }
        }
        out
    }

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
        let first = self.entries.len() - keep;
        let r = self.entries[first];
        let mut ram = vec![0u8; self.mem_bytes as usize];
        let dev = self.materialize_zeroed(r.id, &mut ram)?;
        let base = encode_base(r.id, &ram, codec, cfg)?;
        drop(ram);
        let n = self.entries.iter().map(|e| e.segment).max().unwrap_or(0) + 1;
        let sp = self.dir.join(seg_name(n));
        let seg = OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(&sp)
            .map_err(io(&sp))?;
        let rec = encode_record(RecordKind::Base, r.id, &base, &dev);
        let mut entries = vec![Entry {
            kind: RecordKind::Base,
            segment: n,
            offset: 0,
            len: rec.len() as u32,
            ..r
        }];
        seg.write_all_at(&rec, 0).map_err(io(&sp))?;
        let mut end = rec.len() as u64;
        for e in &self.entries[first + 1..] {
            let b = self.read(e)?;
            decode_record(&b).map_err(|w| self.damaged(e, w))?;
            seg.write_all_at(&b, end).map_err(io(&sp))?;
            entries.push(Entry {
                segment: n,
                offset: end,
                ..*e
            });
            end += b.len() as u64;
        }
        if crash == Some(CrashPoint::SegmentWritten) {
            return Ok(0);
        }
        seg.sync_all().map_err(io(&sp))?;
        let tmp = self.dir.join("index.tmp");
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        let mut bytes = index_header(self.mem_bytes).to_vec();
        for e in &entries {
            bytes.extend_from_slice(&e.encode());
        }
        f.write_all(&bytes).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        if crash == Some(CrashPoint::NewIndexWritten) {
            return Ok(0);
        }
        let ip = self.dir.join("index");
        fs::rename(&tmp, &ip).map_err(io(&ip))?;
        sync_dir(&self.dir)?;
        if crash == Some(CrashPoint::Renamed) {
            return Ok(0);
        }
        // The new state is committed; old segments are garbage from here on.
        let dropped = first;
        self.entries = entries;
        self.index = Some(
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&ip)
                .map_err(io(&ip))?,
        );
        self.seg = Some((n, seg, end));
        self.remove_unreferenced()?;
        Ok(dropped)
    }
}

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

/// Encodes all of `ram` as a base record (a codec record against an all-zero image).
pub fn encode_base(id: u64, ram: &[u8], codec: Codec, cfg: Config) -> Result<Vec<u8>, StoreError> {
    let zeros = vec![0u8; ram.len()];
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
