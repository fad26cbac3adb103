//! The trace recorder: boots a guest, takes a checkpoint every epoch without replicating and
//! writes each epoch's dirty pages to a trace file (crates/tandem-trace) on a writer thread.
//! The trace is written under a `.partial` name and renamed when complete.

use std::fs::File;
use std::io::BufWriter;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::time::Duration;

use tandem_trace::{EpochRecord, TraceError, TraceHeader, TraceWriter};
use tandem_vm::epoch::{run_pipeline, Checkpoint, Fixed};
use tandem_vm::{EpochSink, Guest, VmConfig, VmError, PAGE_SIZE};

use tandem_protect::vmspec::{boot, BootError};

use crate::StartLoad;

/// What to record.
pub struct RecordConfig {
    /// The VM.
    pub vm: VmConfig,
    /// Epoch length.
    pub epoch: Duration,
    /// How long to record.
    pub duration: Duration,
    /// Output trace file.
    pub output: PathBuf,
    /// zstd level for trace frames.
    pub level: i32,
    /// Host-side load started once the guest is ready.
    pub load: Option<StartLoad>,
}

/// What a recording holds.
#[derive(Debug)]
pub struct Recorded {
    /// The guest's workload.
    pub workload: String,
    /// Epochs recorded.
    pub epochs: u64,
    /// Dirty pages over all epochs.
    pub dirty_pages: u64,
    /// Pause of every epoch, in milliseconds.
    pub pauses_ms: Vec<f64>,
    /// Operations the host-side load completed, if there was one.
    pub load_ops: Option<u64>,
    /// Bytes of the trace file.
    pub bytes: u64,
}

/// The recording failed; no trace was left under the output name.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Zero epoch length or duration.
    #[error("the epoch length and the duration must be positive")]
    Zero,
    /// The guest did not come up.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// QEMU or QMP failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The trace file could not be created or renamed.
    #[error("{0}")]
    File(String, #[source] std::io::Error),
    /// The trace writer failed.
    #[error("writing the trace")]
    Trace(#[from] TraceError),
    /// The writer thread stopped early.
    #[error("the trace writer stopped early")]
    WriterStopped,
    /// The host-side load failed during the recording.
    #[error("the load on the guest's workload failed during recording: {0}")]
    Load(String),
}

enum Msg {
    Base(Vec<u8>),
    Epoch(EpochRecord),
}

/// Records a trace as `cfg` says; `progress` sees every checkpoint.
pub fn record(
    cfg: &RecordConfig,
    progress: &mut dyn FnMut(&Checkpoint<'_>),
) -> Result<Recorded, RecordError> {
    if cfg.epoch.is_zero() || cfg.duration.is_zero() {
        return Err(RecordError::Zero);
    }
    let vmc = cfg.vm.clone();
    let (mut vm, ready) = boot(&vmc)?;
    let load = match &cfg.load {
        Some(start) => start(&vmc).map_err(RecordError::Load)?,
        None => None,
    };
    let header = TraceHeader {
        page_size: PAGE_SIZE as u32,
        mem_bytes: vmc.mem_mib << 20,
        epoch_ms: cfg.epoch.as_millis().min(u32::MAX as u128) as u32,
        meta: serde_json::json!({
            "workload": vmc.label(),
            "dirty_log": vm.dirty_log_name(),
            "accel": vmc.accel,
            "qemu": format!("{}.{}.{}", vm.qmp.version.0, vm.qmp.version.1, vm.qmp.version.2),
            "boot_to_ready_ms": ready.as_millis() as u64,
            "tandem": env!("CARGO_PKG_VERSION"),
        }),
    };
    let file_err = |what: String| move |e| RecordError::File(what, e);
    if let Some(dir) = cfg.output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(file_err(format!("creating {}", dir.display())))?;
    }
    let tmp = cfg.output.with_extension("partial");
    let file = File::create(&tmp).map_err(file_err(format!("creating {}", tmp.display())))?;
    let mut writer = TraceWriter::new(BufWriter::with_capacity(1 << 20, file), header, cfg.level)?;
    let (tx, rx) = sync_channel::<Msg>(256);
    let writer_thread = std::thread::spawn(move || -> Result<u64, TraceError> {
        for m in rx {
            match m {
                Msg::Base(mem) => writer.write_base(&mem)?,
                Msg::Epoch(e) => writer.write_epoch(&e)?,
            }
        }
        let n = writer.bytes_written();
        writer.finish()?;
        Ok(n)
    });
    // Base image and dirty-log reset in the same pause, so epoch 1 is relative to the base.
    let base = vm.initial_copy(&mut || {})?;
    let mut sink = TraceSink {
        tx,
        progress,
        dirty_pages: 0,
        pauses_ms: Vec::new(),
        stopped: false,
    };
    sink.stopped = sink.tx.send(Msg::Base(base)).is_err();
    let epochs = run_pipeline(&mut vm, &mut Fixed(cfg.epoch), cfg.duration, 1, &mut sink)?;
    let load_ops = load
        .map(|l| l.stop().map_err(RecordError::Load))
        .transpose()?;
    let TraceSink {
        tx,
        dirty_pages,
        pauses_ms,
        stopped,
        ..
    } = sink;
    drop(tx);
    let bytes = writer_thread
        .join()
        .map_err(|_| RecordError::WriterStopped)??;
    if stopped {
        return Err(RecordError::WriterStopped);
    }
    std::fs::rename(&tmp, &cfg.output).map_err(file_err(format!("renaming {}", tmp.display())))?;
    vm.quit();
    Ok(Recorded {
        workload: vmc.label().to_string(),
        epochs,
        dirty_pages,
        pauses_ms,
        load_ops,
        bytes,
    })
}

/// The trace writer as the epoch pipeline's sink.
struct TraceSink<'p> {
    tx: SyncSender<Msg>,
    progress: &'p mut dyn FnMut(&Checkpoint<'_>),
    dirty_pages: u64,
    pauses_ms: Vec<f64>,
    stopped: bool,
}

impl EpochSink for TraceSink<'_> {
    fn checkpoint(&mut self, cp: &Checkpoint<'_>) -> bool {
        self.dirty_pages += cp.pfns.len() as u64;
        self.pauses_ms.push(cp.timing.total_us() as f64 / 1000.0);
        let rec = EpochRecord {
            epoch: cp.epoch,
            at_us: cp.at.as_micros() as u64,
            timing: cp.timing,
            device_state_len: cp.device_state.len() as u32,
            pfns: cp.pfns.to_vec(),
            data: cp.pages.to_vec(),
        };
        if self.tx.send(Msg::Epoch(rec)).is_err() {
            self.stopped = true;
            return false;
        }
        (self.progress)(cp);
        !self.stopped
    }
}
