//! The epoch pipeline end to end in milliseconds, without QEMU: a recorded trace (written
//! here) replayed as a guest, through `run_pipeline`, into the replication protocol (the
//! library's `Primary` and `Backup`, the daemon's own code) and into the checkpoint store
//! (`Saver`); the backup's mirror and every stored checkpoint equal the replayed memory.

use std::time::Duration;

use tandem_codec::{Codec, Config};
use tandem_harness::trace_guest::{device_state_of, ReplayGuest};
use tandem_replication::{Applied, Backup, EpochInput, Primary};
use tandem_store::{Meta, Outcome, Saver, Store};
use tandem_trace::{EpochRecord, TraceHeader, TraceReader, TraceWriter};
use tandem_vm::epoch::{run_pipeline, Checkpoint, Fixed};
use tandem_vm::{Epoch, EpochSink, Guest, PAGE_SIZE};

const PAGES: usize = 512;

/// A trace of `epochs` epochs of a guest writing a few pages each, in memory.
fn trace(epochs: u32) -> Vec<u8> {
    let header = TraceHeader {
        page_size: PAGE_SIZE as u32,
        mem_bytes: (PAGES * PAGE_SIZE) as u64,
        epoch_ms: 100,
        meta: serde_json::json!({"workload": "synthetic"}),
    };
    let mut w = TraceWriter::new(Vec::new(), header, 1).unwrap();
    let mut mem: Vec<u8> = (0..PAGES * PAGE_SIZE)
        .map(|i| (i / 5 % 241) as u8)
        .collect();
    w.write_base(&mem).unwrap();
    for e in 1..=epochs {
        let mut pfns: Vec<u64> = (0..30)
            .map(|k| ((e as u64) * 17 + k * 13) % PAGES as u64)
            .collect();
        pfns.sort_unstable();
        pfns.dedup();
        let mut data = Vec::new();
        for &p in &pfns {
            let pg = &mut mem[p as usize * PAGE_SIZE..(p as usize + 1) * PAGE_SIZE];
            pg[(e as usize * 31) % PAGE_SIZE] ^= 0x3c;
            pg[..8].copy_from_slice(&(e as u64).to_le_bytes());
            data.extend_from_slice(pg);
        }
        w.write_epoch(&EpochRecord {
            epoch: e.into(),
            at_us: e as u64 * 100_000,
            timing: Default::default(),
            device_state_len: 4000,
            pfns,
            data,
        })
        .unwrap();
    }
    w.finish().unwrap()
}

fn guest(bytes: &[u8]) -> ReplayGuest<&[u8]> {
    ReplayGuest::new(TraceReader::new(bytes).unwrap()).unwrap()
}

/// The replication link as a sink, in-process: every checkpoint goes through `Primary` and is
/// applied by `Backup`.
struct Link {
    proto: Primary,
    backup: Backup<Vec<u8>>,
    sealed: Vec<Epoch>,
}

impl EpochSink for Link {
    fn in_pause(&mut self, epoch: Epoch) {
        self.sealed.push(epoch);
    }
    fn checkpoint(&mut self, cp: &Checkpoint<'_>) -> bool {
        let input = EpochInput {
            seq: cp.epoch,
            pfns: cp.pfns,
            pages: cp.pages,
            device_state: cp.device_state,
            disk_writes: None,
        };
        let (f, _) = self.proto.epoch(&input).unwrap();
        assert_eq!(
            self.backup.handle(&f).unwrap(),
            Applied::Committed(cp.epoch)
        );
        true
    }
}

#[test]
fn a_replayed_trace_replicates_to_an_identical_mirror() {
    let t = trace(40);
    let mut g = guest(&t);
    let mut link = Link {
        proto: Primary::new(7, Codec::Tandem, Config::default()),
        backup: Backup::new(vec![0u8; PAGES * PAGE_SIZE]),
        sealed: Vec::new(),
    };
    let base = g.initial_copy(&mut || {}).unwrap();
    link.backup
        .handle(&link.proto.begin(0, &base, 0).unwrap())
        .unwrap();
    for f in link.proto.base_frames(&base, 64) {
        link.backup.handle(&f).unwrap();
    }
    let last = run_pipeline(
        &mut g,
        &mut Fixed(Duration::ZERO),
        Duration::MAX,
        1,
        &mut link,
    )
    .unwrap();
    assert_eq!(last, 40);
    assert_eq!(
        link.sealed,
        (1..=40).collect::<Vec<_>>(),
        "every boundary sealed once, in order"
    );
    assert!(g.finished());
    assert!(link.backup.consistent());
    assert!(
        link.backup.mirror() == g.memory(),
        "mirror differs from the replayed memory"
    );
    assert_eq!(link.backup.device_state(), &device_state_of(40, 4000)[..]);
}

#[test]
fn a_replayed_trace_checkpoints_into_a_store_that_restores_every_epoch() {
    let t = trace(12);
    let mut g = guest(&t);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::create(dir.path(), (PAGES * PAGE_SIZE) as u64).unwrap();
    let base = g.initial_copy(&mut || {}).unwrap();
    let mut saver = Saver::new(store, base, Codec::Tandem, Config::default(), 5).unwrap();
    let mut memories = Vec::new();
    let mut ids = Vec::new();
    let mut sink = |cp: &Checkpoint<'_>| {
        match saver
            .checkpoint(cp.pfns, cp.pages, cp.device_state, Meta::default())
            .unwrap()
        {
            Outcome::Saved { entry, .. } => ids.push(entry.id),
            Outcome::Skipped { error, .. } => panic!("{error}"),
        }
        memories.push(saver.ram().to_vec());
        true
    };
    tandem_vm::epoch::run_epochs(&mut g, &mut Fixed(Duration::ZERO), Duration::MAX, &mut sink)
        .unwrap();
    assert_eq!(memories.last().map(|m| &m[..]), Some(g.memory()));
    let store = Store::open(dir.path()).unwrap();
    for (id, mem) in ids.iter().zip(&memories) {
        let mut ram = vec![0u8; PAGES * PAGE_SIZE];
        store.materialize_zeroed(*id, &mut ram).unwrap();
        assert!(&ram == mem, "checkpoint {id} restores different memory");
    }
}
