//! Watching a guest: a checkpoint every epoch without replicating or saving, for the live
//! dirty-memory and pause statistics of `tandem watch`.

use std::time::{Duration, Instant};

use serde::Serialize;
use tandem_vm::epoch::{run_pipeline, Checkpoint, Fixed};
use tandem_vm::{EpochSink, VmError, PAGE_SIZE};

use crate::vmspec::{boot, BootError, VmSpec, VmSpecError};
use crate::Status;
use tandem_types::stats::{mean, quantile};

/// What to watch.
pub struct WatchConfig {
    /// The VM.
    pub vm: VmSpec,
    /// Epoch length.
    pub epoch: Duration,
    /// How long to watch.
    pub duration: Duration,
}

/// The statistics once a second.
#[derive(Debug, Clone, Copy)]
pub struct Live {
    /// Since the first epoch.
    pub elapsed: Duration,
    /// The latest epoch.
    pub epoch: u64,
    /// Mean dirty pages per epoch over the last 10 epochs.
    pub dirty_pages_recent: f64,
    /// Guest writes in MiB/s over the last 10 epochs.
    pub dirty_mib_per_s: f64,
    /// Pause median so far, ms.
    pub pause_ms_p50: f64,
    /// Pause 99th percentile so far, ms.
    pub pause_ms_p99: f64,
}

/// What a watch saw.
#[derive(Debug, Serialize)]
pub struct WatchSummary {
    /// What the guest runs (the description's `label`, `custom` without one).
    pub workload: String,
    /// Guest RAM.
    pub mem_mib: u64,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// The dirty log used.
    pub dirty_log: String,
    /// Boot to ready.
    pub boot_to_ready_ms: u64,
    /// Epochs taken.
    pub epochs: u64,
    /// Mean dirty pages per epoch.
    pub dirty_pages_per_epoch_mean: f64,
    /// Their 99th percentile.
    pub dirty_pages_per_epoch_p99: f64,
    /// Guest writes in MiB/s.
    pub dirty_mib_per_s: f64,
    /// Pause median, ms.
    pub pause_ms_p50: f64,
    /// Pause 99th percentile, ms.
    pub pause_ms_p99: f64,
    /// Medians of stop, harvest, copy, device state and cont, ms.
    pub pause_ms_median_components: [f64; 5],
    /// Device state per checkpoint.
    pub device_state_kib: f64,
}

/// The watch failed.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The VM description is unusable.
    #[error(transparent)]
    Spec(#[from] VmSpecError),
    /// The guest did not come up.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// QEMU or QMP failed.
    #[error(transparent)]
    Vm(#[from] VmError),
}

/// Boots the VM, checkpoints it every epoch for the duration; `live` gets the statistics
/// once a second.
pub fn watch(
    cfg: &WatchConfig,
    status: &Status,
    live: &mut dyn FnMut(&Live),
) -> Result<WatchSummary, WatchError> {
    let vmc = cfg.vm.config("watch")?;
    let (mut vm, ready) = boot(&vmc)?;
    let log = vm.dirty_log_name().unwrap_or("none").to_string();
    status.info(format!(
        "guest ready after {:.1} s; dirty log: {log}; checkpoint every {} ms for {} s",
        ready.as_secs_f64(),
        cfg.epoch.as_millis(),
        cfg.duration.as_secs()
    ));
    // Start from a clean dirty log: the first epoch should not carry every page the boot wrote.
    vm.reset_dirty_log()?;
    let mut sink = WatchSink {
        epoch: cfg.epoch,
        live,
        dirty: Vec::new(),
        pause: Vec::new(),
        comps: vec![Vec::new(); 5],
        dev: 0,
        start: Instant::now(),
        last_print: Instant::now(),
    };
    let epochs = run_pipeline(&mut vm, &mut Fixed(cfg.epoch), cfg.duration, 1, &mut sink)?;
    let elapsed = sink.start.elapsed().as_secs_f64();
    let s = WatchSummary {
        workload: vmc.label().to_string(),
        mem_mib: vmc.mem_mib,
        vcpus: vmc.vcpus,
        dirty_log: log,
        boot_to_ready_ms: ready.as_millis() as u64,
        epochs,
        dirty_pages_per_epoch_mean: mean(&sink.dirty),
        dirty_pages_per_epoch_p99: quantile(&sink.dirty, 0.99),
        dirty_mib_per_s: sink.dirty.iter().sum::<f64>() * PAGE_SIZE as f64
            / elapsed
            / (1 << 20) as f64,
        pause_ms_p50: quantile(&sink.pause, 0.5),
        pause_ms_p99: quantile(&sink.pause, 0.99),
        pause_ms_median_components: [0, 1, 2, 3, 4].map(|i| quantile(&sink.comps[i], 0.5)),
        device_state_kib: sink.dev as f64 / 1024.0,
    };
    vm.quit();
    Ok(s)
}

/// The statistics as the epoch pipeline's sink.
struct WatchSink<'a> {
    epoch: Duration,
    live: &'a mut dyn FnMut(&Live),
    dirty: Vec<f64>,
    pause: Vec<f64>,
    comps: Vec<Vec<f64>>,
    dev: usize,
    start: Instant,
    last_print: Instant,
}

impl EpochSink for WatchSink<'_> {
    fn checkpoint(&mut self, cp: &Checkpoint<'_>) -> bool {
        self.dirty.push(cp.pfns.len() as f64);
        self.pause.push(cp.timing.total_us() as f64 / 1000.0);
        for (v, x) in self.comps.iter_mut().zip(cp.timing.components_us()) {
            v.push(x as f64 / 1000.0);
        }
        self.dev = cp.device_state.len();
        if self.last_print.elapsed() >= Duration::from_secs(1) {
            self.last_print = Instant::now();
            let recent = mean(&self.dirty[self.dirty.len().saturating_sub(10)..]);
            (self.live)(&Live {
                elapsed: self.start.elapsed(),
                epoch: cp.epoch,
                dirty_pages_recent: recent,
                dirty_mib_per_s: recent * PAGE_SIZE as f64
                    / self.epoch.as_secs_f64().max(1e-6)
                    / (1 << 20) as f64,
                pause_ms_p50: quantile(&self.pause, 0.5),
                pause_ms_p99: quantile(&self.pause, 0.99),
            });
        }
        true
    }
}
