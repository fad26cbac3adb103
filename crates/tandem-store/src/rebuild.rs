//! Reading checkpoints back: rebuild guest RAM of a checkpoint from its chain (its base and the
//! deltas up to it), checking every record and the RAM checksum; verify the whole store.

use tandem_codec::{decode, Plan};

use crate::format::{decode_record, device_state, Entry, RecordKind};
use crate::ramhash::RamHash;
use crate::store::{zeroed, Store, StoreError};

impl Store {
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
        decode(r.memory, ram, plan).map_err(|d| self.damaged(e, d.to_string()))?;
        if plan.epoch != e.id {
            return Err(self.damaged(e, format!("memory record of epoch {}", plan.epoch)));
        }
        plan.commit(ram);
        if let Some(l) = &self.disks {
            // The disk section is checked here too, so `verify` covers it.
            let d = crate::format::disk_writes(&r).map_err(|w| self.damaged(e, w))?;
            if !d.is_empty() && tandem_disk::image::decode_writes(&d, l.total).is_none() {
                return Err(self.damaged(e, "its disk writes do not parse".into()));
            }
        } else if !r.disk_zstd.is_empty() {
            return Err(self.damaged(e, "disk writes in a store without disks".into()));
        }
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
        if let Err(e) = self.verify_disk_bases() {
            out.push(e);
        }
        if self.entries.is_empty() {
            return out;
        }
        let mut ram = match zeroed(self.mem_bytes) {
            Ok(r) => r,
            Err(e) => return vec![e],
        };
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
}
