//! What `tandem checkpoint save` does with each checkpoint, without QEMU: keep a copy of guest
//! RAM (the *shadow*), its per-page hashes and the codec's encoder current from every
//! checkpoint's dirty pages, and append a base or a delta.
//!
//! **A failed append does not stop the saver.** The store rolls the append back (it stays at
//! its last committed checkpoint, see [`Store::append`]) and [`Saver::checkpoint`] returns
//! [`Outcome::Skipped`]. The encoder has already moved past the skipped checkpoint (it encoded
//! it), so a delta encoded next would refer to content the store never received: the next
//! checkpoint that is stored after a failure is therefore always a **base**, built from the
//! shadow, and the chains in the store stay unbroken. Later checkpoints keep trying.

use tandem_codec::{Codec, Config, Encoder};

use crate::format::{Entry, RecordKind};
use crate::ramhash::RamHash;
use crate::store::{encode_base, Meta, Store, StoreError};

const PAGE: usize = tandem_codec::format::PAGE;

/// What became of one checkpoint.
#[derive(Debug)]
pub enum Outcome {
    /// Committed to the store.
    Saved {
        /// Its index entry (kind, id, size).
        entry: Entry,
        /// Bytes of its memory record (codec record).
        memory_bytes: usize,
    },
    /// Not stored; the store is unchanged and the next stored checkpoint will be a base.
    Skipped {
        /// The id it would have had (the next stored checkpoint gets it).
        would_be: u64,
        /// Why the append failed (see [`StoreError::is_disk_full`]).
        error: StoreError,
        /// Checkpoints skipped in a row, this one included.
        streak: u64,
    },
}

/// Saves checkpoints of one guest into a store.
pub struct Saver {
    store: Store,
    codec: Codec,
    cfg: Config,
    enc: Encoder,
    shadow: Vec<u8>,
    hash: RamHash,
    base_every: u64,
    /// Records in the newest chain (base included).
    chain: u64,
    need_base: bool,
    streak: u64,
    skipped: u64,
    /// Disk writes of checkpoints not stored (skipped): they go into the next stored one.
    pending_disk: Vec<tandem_disk::image::Write>,
}

impl Saver {
    /// A saver whose guest RAM is `ram` now (the content of the first checkpoint). The first
    /// checkpoint stored is a base; then one every `base_every` (0: only after failures).
    pub fn new(
        store: Store,
        ram: Vec<u8>,
        codec: Codec,
        cfg: Config,
        base_every: u64,
    ) -> Result<Saver, StoreError> {
        if ram.len() as u64 != store.mem_bytes() {
            return Err(StoreError::Geometry {
                expected: store.mem_bytes(),
                got: ram.len() as u64,
            });
        }
        let enc = Encoder::new(codec, &ram, cfg)?;
        let hash = RamHash::of(&ram);
        Ok(Saver {
            store,
            codec,
            cfg,
            enc,
            shadow: ram,
            hash,
            base_every,
            chain: 0,
            need_base: true,
            streak: 0,
            skipped: 0,
            pending_disk: Vec::new(),
        })
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The store, for compaction.
    pub fn store_mut(&mut self) -> &mut Store {
        &mut self.store
    }

    /// Checkpoints skipped so far.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Guest RAM as of the last checkpoint.
    pub fn ram(&self) -> &[u8] {
        &self.shadow
    }

    /// Takes a checkpoint: `pfns` (ascending) were written since the previous one and now
    /// hold `pages`; `meta`'s RAM checksum is filled in here. Errors are the caller's input
    /// or the encoder failing, or a store that can no longer be appended to; a failed append
    /// is an [`Outcome::Skipped`].
    pub fn checkpoint(
        &mut self,
        pfns: &[u64],
        pages: &[u8],
        device_state: &[u8],
        meta: Meta,
    ) -> Result<Outcome, StoreError> {
        self.checkpoint_with_disk(pfns, pages, device_state, Vec::new(), meta)
    }

    /// [`Saver::checkpoint`] with the disks' writes since the previous checkpoint, in the
    /// order they were made. Writes of a skipped checkpoint are kept and stored with the next
    /// checkpoint that is saved, so the disk chain never misses one.
    pub fn checkpoint_with_disk(
        &mut self,
        pfns: &[u64],
        pages: &[u8],
        device_state: &[u8],
        disk: Vec<tandem_disk::image::Write>,
        meta: Meta,
    ) -> Result<Outcome, StoreError> {
        let id = self.store.next_id()?;
        self.pending_disk.extend(disk);
        let disk = if self.pending_disk.is_empty() {
            Vec::new()
        } else {
            tandem_disk::image::encode_writes(&self.pending_disk)
        };
        // The encoder, the shadow and the hashes follow the guest whether or not the store
        // receives this checkpoint.
        let mut rec = Vec::new();
        self.enc.encode(id, pfns, pages, &mut rec)?;
        self.hash.update(pfns, pages);
        for (&p, page) in pfns.iter().zip(pages.chunks(PAGE)) {
            let o = p as usize * PAGE;
            self.shadow[o..o + PAGE].copy_from_slice(page);
        }
        let meta = Meta {
            ram_hash: self.hash.value(),
            ..meta
        };
        let base = self.need_base || (self.base_every > 0 && self.chain >= self.base_every);
        if base {
            rec = encode_base(id, &self.shadow, self.codec, self.cfg)?;
        }
        let kind = if base {
            RecordKind::Base
        } else {
            RecordKind::Delta
        };
        match self
            .store
            .append_with_disk(kind, &rec, device_state, &disk, meta)
        {
            Ok(entry) => {
                self.pending_disk.clear();
                self.chain = if base { 1 } else { self.chain + 1 };
                self.need_base = false;
                self.streak = 0;
                Ok(Outcome::Saved {
                    entry,
                    memory_bytes: rec.len(),
                })
            }
            // I/O (disk full, ...) and an oversized checkpoint concern this checkpoint only.
            Err(error @ (StoreError::Io(..) | StoreError::TooLarge { .. })) => {
                // A disk base prepared for this checkpoint is not valid for the next one.
                self.store.drop_uncommitted_disk_bases()?;
                self.need_base = true;
                self.streak += 1;
                self.skipped += 1;
                Ok(Outcome::Skipped {
                    would_be: id,
                    error,
                    streak: self.streak,
                })
            }
            Err(e) => Err(e),
        }
    }
}
