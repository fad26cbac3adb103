//! An epoch's memory record encoded ahead: the primary lends its encoder as soon as the
//! epoch's pages are copied, another thread encodes them while QEMU still saves the devices
//! (the pause's longest wait, in which the primary's own thread only waits), and the epoch is
//! assembled around the record once the device state is in. The frame is the one
//! [`Primary::epoch`] makes of the same epoch: the backup cannot tell.
//!
//! ```text
//!   loop thread:  stop | copy pages | lend ──────── device state | cont | assemble | send
//!   other thread:                     encode memory record ────────────┘
//! ```

use tandem_codec::{EncodeError, EncodeStats, Encoder};

use super::{EpochInput, EpochSizes, Frame, Kind, Primary, PrimaryError, HEADER_LEN};

/// The session's encoder, lent out to encode epoch [`MemoryJob::seq`]'s memory record on
/// another thread. No epoch can be assembled until [`Primary::epoch_encoded`] gets it back.
pub struct MemoryJob {
    enc: Encoder,
    seq: u64,
    rec: Vec<u8>,
}

/// An epoch's memory record, encoded ahead, with the encoder that made it.
pub struct MemoryRecord {
    enc: Encoder,
    seq: u64,
    rec: Vec<u8>,
    pages: usize,
    stats: Result<EncodeStats, EncodeError>,
}

impl MemoryJob {
    /// The epoch whose record this job encodes.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Encodes the epoch's dirty pages `pfns` (ascending) with their contents `pages`.
    pub fn encode(mut self, pfns: &[u64], pages: &[u8]) -> MemoryRecord {
        self.rec.clear();
        let stats = self.enc.encode(self.seq, pfns, pages, &mut self.rec);
        MemoryRecord {
            enc: self.enc,
            seq: self.seq,
            rec: self.rec,
            pages: pfns.len(),
            stats,
        }
    }
}

impl Primary {
    /// Lends the encoder to encode epoch `seq`'s memory record elsewhere (an epoch that goes
    /// out whole: see [`crate::Parts::whole`]).
    pub fn lend_encoder(&mut self, seq: u64) -> Result<MemoryJob, PrimaryError> {
        let enc = self.enc.take().ok_or(PrimaryError::NoSession)?;
        Ok(MemoryJob {
            enc,
            seq,
            rec: std::mem::take(&mut self.rec),
        })
    }

    /// Assembles epoch `e` into one frame around `rec`, its memory record encoded ahead, and
    /// takes the encoder back. `e.pages` is not read. A failed record, or one of another
    /// epoch, ends the session as [`Primary::epoch`]'s failures do.
    pub fn epoch_encoded(
        &mut self,
        e: &EpochInput<'_>,
        rec: MemoryRecord,
    ) -> Result<(Frame, EpochSizes), PrimaryError> {
        let MemoryRecord {
            enc,
            seq,
            rec,
            pages,
            stats,
        } = rec;
        if seq != e.seq || pages != e.pfns.len() {
            return Err(PrimaryError::WrongRecord {
                seq: e.seq,
                pages: e.pfns.len(),
                record_seq: seq,
                record_pages: pages,
            });
        }
        let stats = stats?;
        let payload = self.assemble(e.seq, 0, &rec, e.disk_writes, Some(e))?;
        self.enc = Some(enc);
        self.rec = rec;
        let sizes = EpochSizes {
            sent: (payload.len() + HEADER_LEN) as u64,
            level: stats.level,
            long_patches: stats.long_patches,
            word_deltas: stats.word_deltas,
            prefix_off: stats.prefix_off,
            ..EpochSizes::before_encoding(e)
        };
        Ok((self.frame(Kind::Epoch, e.seq, payload), sizes))
    }
}
