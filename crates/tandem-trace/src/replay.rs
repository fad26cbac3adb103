//! Replaying a trace in memory: the guest's RAM as it was before each epoch.

use std::io::Read;

use crate::{EpochRecord, TraceError, TraceFrame, TraceHeader, TraceReader};

/// Replays the trace read from `input`: for each epoch calls `on_epoch(memory before the
/// epoch, epoch)`, then applies the epoch. Returns the header and the final memory.
pub fn replay<R: Read, E: From<TraceError>>(
    input: R,
    mut on_epoch: impl FnMut(&[u8], &EpochRecord) -> Result<(), E>,
) -> Result<(TraceHeader, Vec<u8>), E> {
    let mut r = TraceReader::new(input)?;
    let h = r.header().clone();
    let ps = h.page_size as usize;
    let mut mem = vec![0u8; h.mem_bytes as usize];
    while let Some(frame) = r.next_frame()? {
        match frame {
            TraceFrame::Base { first_pfn, data } => {
                let o = first_pfn as usize * ps;
                mem[o..o + data.len()].copy_from_slice(&data);
            }
            TraceFrame::Epoch(e) => {
                on_epoch(&mem, &e)?;
                for (i, &pfn) in e.pfns.iter().enumerate() {
                    let o = pfn as usize * ps;
                    mem[o..o + ps].copy_from_slice(&e.data[i * ps..(i + 1) * ps]);
                }
            }
            TraceFrame::End { .. } => {}
        }
    }
    Ok((h, mem))
}
