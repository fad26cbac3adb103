//! The store directory: `index` plus `seg-NNNNNNNN.tseg` segment files (see [`crate::format`])
//! and the writer's `lock` file (see [`crate::lock`]).
//!
//! Commit order for a checkpoint: record appended to the current segment → segment fsynced →
//! index entry appended → index fsynced. A base starts a new segment. An append that fails
//! (disk full, I/O error) is rolled back before it returns: the index and the segment are cut
//! back to the last committed checkpoint (a segment created for it is deleted), so the store
//! stays as it was and later appends continue from there. Compaction: `compact.rs`; restore
//! and verification: `replay.rs`.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tandem_codec::EncodeError;

use crate::disks::{read_layout, write_layout, DiskLayout};
use crate::format::{
    encode_record_with_disk, follows, index_header, index_header_version, parse_index_header,
    Entry, RecordKind, ENTRY_LEN, INDEX_HEADER, INDEX_VERSION_DISKS,
};
use crate::lock::holder;
pub use crate::writefault::WriteFault;
use crate::writefault::{sync, write_at};

pub use crate::compact::{encode_base, CrashPoint};

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
    /// Another process holds the store's writer lock.
    #[error("{dir} is in use by another checkpoint saver ({}, see {dir}/lock): only one process may write a store at a time; wait for it to finish or stop it, or save into another directory", holder(.pid))]
    Locked {
        /// Store directory.
        dir: String,
        /// Pid recorded by the holder, if readable.
        pid: Option<u32>,
    },
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
    /// A checkpoint part exceeds a format limit.
    #[error("{what} of {len} bytes exceeds the store's limit of {max}")]
    TooLarge {
        /// Which part.
        what: &'static str,
        /// Its size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Checkpoint ids or segment numbers are used up.
    #[error("{0} are exhausted (start a new store)")]
    Exhausted(&'static str),
    /// Guest RAM for a replay could not be allocated.
    #[error("cannot allocate {0} bytes of guest RAM")]
    Memory(u64),
    /// A failed append could not be rolled back; the handle refuses further appends.
    #[error("{0}: a failed append could not be undone; reopen the store (its committed checkpoints are intact)")]
    Poisoned(String),
    /// The checkpoints' disks cannot be written or rebuilt.
    #[error("{0}")]
    Disk(String),
    /// Encoding failed.
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

impl StoreError {
    /// Whether this is the file system running out of space (or quota).
    pub fn is_disk_full(&self) -> bool {
        let full = [
            rustix::io::Errno::NOSPC.raw_os_error(),
            rustix::io::Errno::DQUOT.raw_os_error(),
        ];
        matches!(self, StoreError::Io(_, e) if e.raw_os_error().is_some_and(|c| full.contains(&c)))
    }
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |e| StoreError::Io(path.display().to_string(), e)
}

pub(crate) fn seg_name(n: u32) -> String {
    format!("seg-{n:08}.tseg")
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// A zero-filled buffer of `len` bytes, or an error if it cannot be allocated. Fresh zeroed
/// memory from the allocator is not touched until written (large guests stay cheap).
pub(crate) fn zeroed(len: u64) -> Result<Vec<u8>, StoreError> {
    let n = usize::try_from(len).map_err(|_| StoreError::Memory(len))?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).map_err(|_| StoreError::Memory(len))?;
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return Err(StoreError::Memory(len));
    }
    // SAFETY: `p` comes from the global allocator with the layout of `[u8; n]` (size n,
    // alignment 1), all n bytes are initialised (zero), and length = capacity = n.
    Ok(unsafe { Vec::from_raw_parts(p, n, n) })
}

/// Metadata recorded with a checkpoint.
#[derive(Debug, Clone, Copy, Default)]
pub struct Meta {
    /// RAM checksum ([`crate::ramhash::RamHash::value`]).
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
    pub(crate) dir: PathBuf,
    pub(crate) mem_bytes: u64,
    pub(crate) entries: Vec<Entry>,
    pub(crate) torn: Option<String>,
    /// The checkpoints' disks (index version 2), if they include disks.
    pub(crate) disks: Option<DiskLayout>,
    pub(crate) index: Option<File>,
    /// Current segment: number, file, committed end.
    pub(crate) seg: Option<(u32, File, u64)>,
    /// The writer lock, held while this handle can append.
    lock: Option<File>,
    poisoned: Option<String>,
    fault: Option<WriteFault>,
}

impl Store {
    /// Creates a store for a guest of `mem_bytes` in `dir` (created if missing, must not hold
    /// a store) and takes its writer lock.
    pub fn create(dir: &Path, mem_bytes: u64) -> Result<Store, StoreError> {
        Self::create_inner(dir, mem_bytes, None)
    }

    /// [`Store::create`] for checkpoints that include the VM's writable disks (`layout`, no
    /// bases yet: the saver adds the first with its first checkpoint).
    pub fn create_with_disks(
        dir: &Path,
        mem_bytes: u64,
        layout: DiskLayout,
    ) -> Result<Store, StoreError> {
        Self::create_inner(dir, mem_bytes, Some(layout))
    }

    fn create_inner(
        dir: &Path,
        mem_bytes: u64,
        disks: Option<DiskLayout>,
    ) -> Result<Store, StoreError> {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let lock = crate::lock::lock(dir)?;
        let index = dir.join("index");
        if index.exists() {
            return Err(StoreError::Exists(dir.display().to_string()));
        }
        parse_index_header(&index_header(mem_bytes))
            .map_err(|why| StoreError::NotAStore(dir.display().to_string(), why))?;
        let header = match &disks {
            Some(l) => {
                write_layout(dir, l)?;
                index_header_version(mem_bytes, INDEX_VERSION_DISKS)
            }
            None => index_header(mem_bytes),
        };
        let tmp = dir.join("index.tmp");
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(&header).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        fs::rename(&tmp, &index).map_err(io(&index))?;
        sync_dir(dir)?;
        Self::open_locked(dir, lock)
    }

    /// Opens a store read-only, without the writer lock. A torn or damaged tail of the index
    /// is ignored (see [`Store::torn_tail`]).
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
        let disks = read_layout(dir)?;
        if (tandem_types::framing::u32_at(&bytes, 8) == INDEX_VERSION_DISKS) != disks.is_some() {
            return Err(StoreError::NotAStore(
                dir.display().to_string(),
                "its index and its disks file disagree on whether the checkpoints include disks (a file is missing)".into(),
            ));
        }
        let mut entries: Vec<Entry> = Vec::new();
        let mut torn = None;
        let mut seg_len = std::collections::HashMap::new();
        let mut pos = INDEX_HEADER;
        while pos < bytes.len() {
            let e = bytes.get(pos..pos + ENTRY_LEN).and_then(Entry::decode);
            let ok = e.filter(|e| {
                let next = follows(entries.last(), e);
                let len = *seg_len.entry(e.segment).or_insert_with(|| {
                    fs::metadata(dir.join(seg_name(e.segment)))
                        .ok()
                        .map(|m| m.len())
                });
                let fits = e
                    .offset
                    .checked_add(e.len as u64)
                    .zip(len)
                    .is_some_and(|(end, len)| end <= len);
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
            disks,
            index: None,
            seg: None,
            lock: None,
            poisoned: None,
            fault: None,
        })
    }

    /// Opens a store for appending: takes the writer lock (fails with [`StoreError::Locked`]
    /// if another process holds it), cuts a torn tail off (warned) and deletes segments no
    /// committed entry refers to (left by a crash).
    pub fn open_append(dir: &Path) -> Result<Store, StoreError> {
        let lock = crate::lock::lock(dir)?;
        Self::open_locked(dir, lock)
    }

    fn open_locked(dir: &Path, lock: File) -> Result<Store, StoreError> {
        let mut s = Self::open(dir)?;
        s.lock = Some(lock);
        if let Some(t) = &s.torn {
            tracing::warn!("{}: {t}", dir.display());
        }
        let path = dir.join("index");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io(&path))?;
        f.set_len(s.index_len()).map_err(io(&path))?;
        f.sync_all().map_err(io(&path))?;
        s.index = Some(f);
        s.remove_unreferenced()?;
        s.drop_uncommitted_disk_bases()?;
        if let Some(last) = s.entries.last().copied() {
            let p = dir.join(seg_name(last.segment));
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&p)
                .map_err(io(&p))?;
            // `open` checked that the record lies inside the segment.
            let end = last.offset + last.len as u64;
            f.set_len(end).map_err(io(&p))?;
            s.seg = Some((last.segment, f, end));
        }
        Ok(s)
    }

    /// Length of the index holding exactly the committed entries.
    pub(crate) fn index_len(&self) -> u64 {
        (INDEX_HEADER + self.entries.len() * ENTRY_LEN) as u64
    }

    pub(crate) fn remove_unreferenced(&self) -> Result<(), StoreError> {
        let used: std::collections::HashSet<String> =
            self.entries.iter().map(|e| seg_name(e.segment)).collect();
        for d in fs::read_dir(&self.dir).map_err(io(&self.dir))?.flatten() {
            let name = d.file_name().to_string_lossy().into_owned();
            let scratch = ["index.tmp", "disks.tmp", "disk-new.tmp"].contains(&name.as_str());
            if (name.starts_with("seg-") && !used.contains(&name)) || scratch {
                tracing::info!("removing {name}: no committed checkpoint refers to it");
                let _ = fs::remove_file(d.path());
            }
        }
        sync_dir(&self.dir)
    }

    /// The number for a new segment.
    pub(crate) fn next_segment(&self) -> Result<u32, StoreError> {
        let used = self.entries.iter().map(|e| e.segment).max().unwrap_or(0);
        let cur = self.seg.as_ref().map_or(0, |s| s.0);
        used.max(cur)
            .checked_add(1)
            .ok_or(StoreError::Exhausted("segment numbers"))
    }

    /// Guest RAM size of the checkpoints.
    pub fn mem_bytes(&self) -> u64 {
        self.mem_bytes
    }

    /// Committed checkpoints, oldest first.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The id the next appended checkpoint gets.
    pub fn next_id(&self) -> Result<u64, StoreError> {
        match self.entries.last() {
            None => Ok(1),
            Some(e) => {
                e.id.checked_add(1)
                    .ok_or(StoreError::Exhausted("checkpoint ids"))
            }
        }
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

    /// Makes the next append fail at `at` (tests).
    #[doc(hidden)]
    pub fn inject_write_fault(&mut self, at: WriteFault) {
        self.fault = Some(at);
    }

    /// Appends a checkpoint (durable and visible when this returns). A base starts a new
    /// segment. On failure nothing is committed and the files are cut back to the last
    /// committed checkpoint, so the store stays consistent and the next append continues
    /// from it.
    pub fn append(
        &mut self,
        kind: RecordKind,
        memory: &[u8],
        device_state: &[u8],
        meta: Meta,
    ) -> Result<Entry, StoreError> {
        self.append_with_disk(kind, memory, device_state, &[], meta)
    }

    /// [`Store::append`] with the disks' writes since the previous checkpoint (encoded with
    /// `tandem_disk::image::encode_writes`; empty for none).
    pub fn append_with_disk(
        &mut self,
        kind: RecordKind,
        memory: &[u8],
        device_state: &[u8],
        disk: &[u8],
        meta: Meta,
    ) -> Result<Entry, StoreError> {
        if let Some(why) = &self.poisoned {
            return Err(StoreError::Poisoned(why.clone()));
        }
        if self.index.is_none() {
            return Err(StoreError::NotAStore(
                self.dir.display().to_string(),
                "opened read-only".into(),
            ));
        }
        let id = self.next_id()?;
        if self.entries.is_empty() && kind != RecordKind::Base {
            return Err(StoreError::NotAStore(
                self.dir.display().to_string(),
                "the first checkpoint must be a base".into(),
            ));
        }
        if !disk.is_empty() && self.disks.is_none() {
            return Err(StoreError::Disk(format!(
                "{} holds no disks: disk writes cannot be stored",
                self.dir.display()
            )));
        }
        let rec = encode_record_with_disk(kind, id, memory, device_state, disk)?;
        let len = u32::try_from(rec.len()).map_err(|_| StoreError::TooLarge {
            what: "checkpoint record",
            len: rec.len() as u64,
            max: u32::MAX as u64,
        })?;
        // A base starts a new segment; the current one is kept until the base is committed.
        let mut previous = None;
        if kind == RecordKind::Base || self.seg.is_none() {
            let n = self.next_segment()?;
            let p = self.dir.join(seg_name(n));
            let f = OpenOptions::new()
                .create_new(true)
                .read(true)
                .write(true)
                .open(&p)
                .map_err(io(&p))?;
            previous = Some(self.seg.replace((n, f, 0)));
            if let Err(e) = sync_dir(&self.dir) {
                self.roll_back(previous);
                return Err(e);
            }
        }
        match self.commit(kind, id, &rec, len, meta) {
            Ok(e) => {
                if let Some((_, _, end)) = self.seg.as_mut() {
                    *end = e.offset + len as u64;
                }
                self.entries.push(e);
                Ok(e)
            }
            Err(err) => {
                self.roll_back(previous);
                Err(err)
            }
        }
    }

    /// Writes and syncs the record, then the index entry.
    fn commit(
        &mut self,
        kind: RecordKind,
        id: u64,
        rec: &[u8],
        len: u32,
        meta: Meta,
    ) -> Result<Entry, StoreError> {
        let at = self.index_len();
        let (Some((n, f, end)), Some(idx)) = (&self.seg, &self.index) else {
            return Err(StoreError::NotAStore(
                self.dir.display().to_string(),
                "opened read-only".into(),
            ));
        };
        let fault = &mut self.fault;
        let p = self.dir.join(seg_name(*n));
        end.checked_add(len as u64)
            .ok_or(StoreError::Exhausted("segment offsets"))?;
        write_at(fault, WriteFault::SegmentWrite, f, rec, *end).map_err(io(&p))?;
        sync(fault, WriteFault::SegmentSync, f).map_err(io(&p))?;
        let e = Entry {
            kind,
            id,
            segment: *n,
            offset: *end,
            len,
            ram_hash: meta.ram_hash,
            time_ms: meta.time_ms,
            pause_us: meta.pause_us,
            dirty_pages: meta.dirty_pages,
        };
        let ip = self.dir.join("index");
        write_at(fault, WriteFault::IndexWrite, idx, &e.encode(), at).map_err(io(&ip))?;
        sync(fault, WriteFault::IndexSync, idx).map_err(io(&ip))?;
        Ok(e)
    }

    /// Undoes a failed append: the index and the current segment are cut back to the
    /// committed checkpoints; a segment created for the append is deleted and the previous
    /// one restored (`previous`). If that fails too, the handle refuses further appends.
    fn roll_back(&mut self, previous: Option<Option<(u32, File, u64)>>) {
        let mut failed = Vec::new();
        let ip = self.dir.join("index");
        if let Some(idx) = &self.index {
            if let Err(e) = idx.set_len(self.index_len()).and_then(|()| idx.sync_data()) {
                failed.push(format!("{}: {e}", ip.display()));
            }
        }
        match previous {
            Some(prev) => {
                if let Some((n, f, _)) = std::mem::replace(&mut self.seg, prev) {
                    drop(f);
                    let p = self.dir.join(seg_name(n));
                    if let Err(e) = fs::remove_file(&p) {
                        failed.push(format!("{}: {e}", p.display()));
                    }
                    if let Err(e) = sync_dir(&self.dir) {
                        failed.push(e.to_string());
                    }
                }
            }
            None => {
                if let Some((n, f, end)) = &self.seg {
                    if let Err(e) = f.set_len(*end).and_then(|()| f.sync_data()) {
                        failed.push(format!("{}: {e}", self.dir.join(seg_name(*n)).display()));
                    }
                }
            }
        }
        if !failed.is_empty() {
            self.poisoned = Some(failed.join("; "));
        }
    }

    pub(crate) fn read(&self, e: &Entry) -> Result<Vec<u8>, StoreError> {
        let p = self.dir.join(seg_name(e.segment));
        let f = File::open(&p).map_err(io(&p))?;
        let len = f.metadata().map_err(io(&p))?.len();
        if e.offset
            .checked_add(e.len as u64)
            .is_none_or(|end| end > len)
        {
            return Err(self.damaged(
                e,
                format!("record lies past the end of the {len}-byte segment"),
            ));
        }
        let mut b = vec![0u8; e.len as usize];
        f.read_exact_at(&mut b, e.offset).map_err(io(&p))?;
        Ok(b)
    }

    pub(crate) fn damaged(&self, e: &Entry, why: String) -> StoreError {
        StoreError::Damaged {
            id: e.id,
            segment: seg_name(e.segment),
            offset: e.offset,
            why,
        }
    }
}
