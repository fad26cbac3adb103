//! The encoder's thread: an epoch's memory record is encoded there from the moment its pages
//! are copied, while QEMU still saves the devices (the pause's longest wait, in which the
//! loop's thread only waits), and on after `cont`. The loop assembles the epoch around the
//! record once the guest runs (tandem_replication's `primary::ahead`).

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tandem_replication::{MemoryJob, MemoryRecord};

/// One epoch's pages for the encoder's thread.
struct Job {
    job: MemoryJob,
    pfns: Vec<u64>,
    pages: Vec<u8>,
}

/// A record encoded ahead, with what it cost.
pub(super) struct Done {
    pub(super) record: MemoryRecord,
    /// The encoder's thread's CPU time for it.
    pub(super) cpu: Duration,
    /// Its wall time there.
    pub(super) wall: Duration,
    pfns: Vec<u64>,
    pages: Vec<u8>,
}

/// The encoder's thread of one session, started at its first epoch.
#[derive(Default)]
pub(super) struct Ahead {
    worker: Option<(Sender<Job>, Receiver<Done>, JoinHandle<()>)>,
    /// The epoch whose record is being encoded.
    inflight: Option<u64>,
    /// Buffers an earlier epoch's job gave back (pages go to the pipeline in place of the
    /// ones taken: its next pause copies into them).
    spare_pfns: Vec<u64>,
    spare_pages: Vec<u8>,
}

impl Ahead {
    /// Whether the encoder's thread runs (it is started on the first call).
    pub(super) fn ready(&mut self) -> bool {
        if self.worker.is_none() {
            self.worker = spawn();
        }
        self.worker.is_some()
    }

    /// Starts encoding epoch `job.seq()`'s `pfns` and takes `pages` (leaving a spare buffer
    /// in their place). False if the encoder's thread is gone (the job with it).
    pub(super) fn start(&mut self, job: MemoryJob, pfns: &[u64], pages: &mut Vec<u8>) -> bool {
        let Some((tx, _, _)) = &self.worker else {
            return false;
        };
        let seq = job.seq();
        let mut mine = std::mem::take(&mut self.spare_pfns);
        mine.clear();
        mine.extend_from_slice(pfns);
        let pages = std::mem::replace(pages, std::mem::take(&mut self.spare_pages));
        let sent = tx.send(Job {
            job,
            pfns: mine,
            pages,
        });
        self.inflight = sent.is_ok().then_some(seq);
        sent.is_ok()
    }

    /// Waits for epoch `seq`'s record; `Ok(None)` if none was started for it.
    pub(super) fn finish(&mut self, seq: u64) -> Result<Option<Done>, EncoderStopped> {
        if self.inflight.take() != Some(seq) {
            return Ok(None);
        }
        let Some((_, rx, _)) = self.worker.as_ref() else {
            return Ok(None);
        };
        let mut done = rx.recv().map_err(|_| EncoderStopped)?;
        self.spare_pfns = std::mem::take(&mut done.pfns);
        self.spare_pages = std::mem::take(&mut done.pages);
        Ok(Some(done))
    }
}

/// The encoder's thread stopped before it returned a record it was given (it panicked).
#[derive(Debug)]
pub(super) struct EncoderStopped;

impl Drop for Ahead {
    fn drop(&mut self) {
        if let Some((tx, rx, handle)) = self.worker.take() {
            drop(tx);
            drop(rx);
            let _ = handle.join();
        }
    }
}

fn spawn() -> Option<(Sender<Job>, Receiver<Done>, JoinHandle<()>)> {
    let (jobs, rx) = channel::<Job>();
    let (tx, done) = channel::<Done>();
    let handle = std::thread::Builder::new()
        .name("tandem-encoder".into())
        .spawn(move || {
            for Job { job, pfns, pages } in rx {
                let (t, cpu) = (Instant::now(), super::sink::thread_cpu());
                let record = job.encode(&pfns, &pages);
                let d = Done {
                    record,
                    cpu: super::sink::thread_cpu().saturating_sub(cpu),
                    wall: t.elapsed(),
                    pfns,
                    pages,
                };
                if tx.send(d).is_err() {
                    return;
                }
            }
        })
        .ok()?;
    Some((jobs, done, handle))
}
