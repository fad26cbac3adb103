//! Early suspend (seed 002's stop threshold) on stock QEMU: the adaptive schedule stops a busy
//! guest while output waits for an acknowledgement, the checkpoint that follows skips its own
//! `stop`, and no write is lost from the dirty log across suspended epochs — a mirror built
//! from the checkpoints equals guest memory at the end. Needs the image (`tandem setup`) and
//! `libtandem_preload.so` (`cargo build --workspace`).

use std::time::{Duration, Instant};

use tandem_vm::epoch::{run_pipeline, Checkpoint, Pending};
use tandem_vm::schedule::{Adaptive, AdaptiveConfig};
use tandem_vm::{DirtyMode, Epoch, EpochSink, Vm, PAGE_SIZE};

/// Output waits on an unacknowledged checkpoint for `blocked` after each checkpoint, then the
/// "acknowledgement" arrives; the mirror takes every checkpoint's pages.
struct Sink {
    mirror: Vec<u8>,
    since: Instant,
    blocked: Duration,
    suspended: Vec<Duration>,
    epochs: u64,
}

impl EpochSink for Sink {
    fn pending(&self) -> Pending {
        Pending {
            output_frames: 1,
            unacked: u64::from(self.since.elapsed() < self.blocked),
            // 256 pages (the floor) at any rate: memtouch dirties that within milliseconds.
            ship_pages_per_s: Some(1000),
            ..Pending::default()
        }
    }

    fn checkpoint(&mut self, cp: &Checkpoint<'_>) -> bool {
        for (i, &pfn) in cp.pfns.iter().enumerate() {
            let at = pfn as usize * PAGE_SIZE;
            self.mirror[at..at + PAGE_SIZE]
                .copy_from_slice(&cp.pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
        }
        self.suspended.push(cp.suspended);
        self.epochs = cp.epoch;
        self.since = Instant::now();
        true
    }
}

#[test]
fn early_suspend_stops_the_guest_and_loses_no_write() {
    let image = tandem_labguest::GuestImage::default();
    let mut cfg = tandem_labguest::config("test-suspend", "memtouch", &image);
    cfg.dirty = DirtyMode::Uffd;
    let mut vm = Vm::launch(&cfg).unwrap_or_else(|e| panic!("launch: {e}"));
    vm.wait_ready(Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("not ready: {e}"));
    vm.stop().unwrap();
    vm.harvest(&mut Vec::new()).unwrap();
    // SAFETY: the guest is stopped while its memory is copied.
    let mirror = unsafe { vm.ram().as_slice() }.to_vec();
    vm.cont().unwrap();

    let mut sink = Sink {
        mirror,
        since: Instant::now(),
        blocked: Duration::from_millis(40),
        suspended: Vec::new(),
        epochs: 0,
    };
    let mut cfg = AdaptiveConfig::default();
    cfg.max_wait = Duration::from_millis(200);
    let mut schedule = Adaptive::new(cfg);
    let first: Epoch = 1;
    run_pipeline(
        &mut vm,
        &mut schedule,
        Duration::from_secs(3),
        first,
        &mut sink,
    )
    .unwrap();

    let suspended: Vec<&Duration> = sink.suspended.iter().filter(|d| !d.is_zero()).collect();
    assert!(
        suspended.len() * 2 >= sink.suspended.len(),
        "memtouch should reach the stop threshold in most epochs: {:?}",
        sink.suspended
    );
    eprintln!("suspended per epoch: {:?}", sink.suspended);
    // A suspension lasts until the "acknowledgement", 40 ms after the last checkpoint.
    assert!(
        suspended.iter().all(|d| **d < Duration::from_millis(200)),
        "{suspended:?}"
    );

    // The dirty log kept every write across the suspended epochs.
    vm.stop().unwrap();
    let mut last = Vec::new();
    vm.harvest(&mut last).unwrap();
    // SAFETY: the guest is stopped.
    let ram = unsafe { vm.ram().as_slice() };
    for &pfn in &last {
        let at = pfn as usize * PAGE_SIZE;
        sink.mirror[at..at + PAGE_SIZE].copy_from_slice(&ram[at..at + PAGE_SIZE]);
    }
    let differing = (0..ram.len() / PAGE_SIZE)
        .filter(|p| {
            let r = p * PAGE_SIZE..(p + 1) * PAGE_SIZE;
            sink.mirror[r.clone()] != ram[r]
        })
        .count();
    assert_eq!(
        differing, 0,
        "{differing} pages differ from the mirror after {} epochs",
        sink.epochs
    );
}
