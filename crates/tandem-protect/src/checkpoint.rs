//! The checkpoint saver: boots a guest and takes incremental checkpoints into a store
//! directory (crates/tandem-store, docs/STORE.md) — one now, or every interval until a count
//! or a stop request. The store is the epoch pipeline's sink ([`StoreSink`]); a checkpoint the
//! store cannot take (disk full) is skipped and reported, never half-written.

pub mod disks;
mod report;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;
use tandem_codec::{Codec, Config};
use tandem_store::format::RecordKind;
use tandem_store::{Meta, Outcome, Saver, Store, StoreError};
use tandem_vm::epoch::{run_pipeline, Checkpoint, Pending};
use tandem_vm::{EpochSink, Vm, VmError, PAGE_SIZE};

use crate::vmspec::{boot, BootError, VmSpec, VmSpecError};
use crate::Status;
use disks::{check_layout, CaptureError, DiskCapture};
use report::SaveLog;
use tandem_types::stats::quantile;

/// What the saver does. Plain data: in a configuration file `dir` is required; durations are
/// written as `"1s"`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct SaveConfig {
    /// Store directory (created if missing; an existing store is continued with a new base).
    pub dir: PathBuf,
    /// The VM.
    pub vm: VmSpec,
    /// Take a checkpoint every interval (without it: one checkpoint, then stop).
    #[serde(with = "humantime_serde")]
    pub interval: Option<Duration>,
    /// Schedule adaptively instead (docs/SCHEDULING.md): for the store, a checkpoint also
    /// comes early when the disks' writes reach the limit; `interval` is then the longest.
    pub adaptive: Option<tandem_vm::schedule::AdaptiveConfig>,
    /// Stop after this many checkpoints.
    pub count: Option<u64>,
    /// Keep the newest N checkpoints; older ones are folded into a new base.
    pub keep: Option<usize>,
    /// Write a full base every N checkpoints (bounds restore chains).
    pub base_every: u64,
    /// Memory codec.
    pub codec: Codec,
    /// Fault injection for the lab's tests: abort the process at this compaction step.
    #[cfg(feature = "fault-hooks")]
    #[serde(skip)]
    pub fault_compact: Option<tandem_store::store::CrashPoint>,
}

impl Default for SaveConfig {
    fn default() -> Self {
        SaveConfig::new("", VmSpec::default())
    }
}

impl SaveConfig {
    /// One checkpoint of `vm` into the store at `dir`, with the tandem codec and a full base
    /// every 100 checkpoints.
    pub fn new(dir: impl Into<PathBuf>, vm: VmSpec) -> Self {
        SaveConfig {
            dir: dir.into(),
            vm,
            interval: None,
            adaptive: None,
            count: None,
            keep: None,
            base_every: 100,
            codec: Codec::Tandem,
            #[cfg(feature = "fault-hooks")]
            fault_compact: None,
        }
    }
}

/// What a save run did.
#[derive(Debug, Serialize)]
pub struct SaveSummary {
    /// The store directory.
    pub dir: String,
    /// Checkpoints taken (saved + skipped).
    pub checkpoints: u64,
    /// Checkpoints the store could not take (disk full, write errors).
    pub skipped: u64,
    /// Pause of the first checkpoint (the base).
    pub first_pause_ms: f64,
    /// Median pause of the later ones.
    pub pause_ms_p50: f64,
    /// Their 99th percentile.
    pub pause_ms_p99: f64,
    /// Median of pause + encode + fsync.
    pub checkpoint_ms_p50: f64,
    /// Mean delta record size.
    pub delta_bytes_mean: f64,
    /// Size of the first base.
    pub base_bytes: u64,
    /// Retention compactions done.
    pub compactions: u64,
    /// Checkpoints in the store at the end.
    pub kept: usize,
    /// Device state size.
    pub device_state_bytes: u64,
    /// Mean dirty pages per checkpoint.
    pub dirty_pages_mean: f64,
}

/// Why the saver stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// The VM description is unusable.
    #[error(transparent)]
    Spec(#[from] VmSpecError),
    /// The guest did not come up.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// The store's directory is not private to tandem's user.
    #[error(transparent)]
    PrivateDir(#[from] tandem_vm::PrivateDirError),
    /// The writable disks could not be captured.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// The store's checkpoints hold other disks than this VM's.
    #[error("{dir} does not fit this VM: {why}; save into a new directory")]
    Disks {
        /// The store.
        dir: String,
        /// What differs.
        why: String,
    },
    /// The store directory holds checkpoints of another guest size.
    #[error("{dir} holds checkpoints of a {store_mib} MiB guest; this VM has {vm_mib} MiB")]
    Size {
        /// The store.
        dir: String,
        /// Its guest size.
        store_mib: u64,
        /// This VM's.
        vm_mib: u64,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The only checkpoint asked for was not saved.
    #[error("the checkpoint was not saved")]
    NotSaved(#[source] StoreError),
    /// QEMU or QMP failed.
    #[error(transparent)]
    Vm(#[from] VmError),
}

/// Opens (continuing) or creates the store for a guest of `bytes` (with `disks`, its
/// checkpoints include them). Takes the store's writer lock before the guest boots: a second
/// saver stops here.
fn open_store(
    cfg: &SaveConfig,
    bytes: u64,
    disks: Option<&tandem_store::disks::DiskLayout>,
) -> Result<Store, SaveError> {
    if !cfg.dir.join("index").exists() {
        return Ok(match disks {
            Some(l) => Store::create_with_disks(&cfg.dir, bytes, l.clone())?,
            None => Store::create(&cfg.dir, bytes)?,
        });
    }
    let s = Store::open_append(&cfg.dir)?;
    let differs = match (s.disks(), disks) {
        (None, None) => None,
        (Some(a), Some(b)) => check_layout(a, b).err(),
        (Some(_), None) => {
            Some("its checkpoints include disks, this VM has no writable disk".into())
        }
        (None, Some(_)) => Some("its checkpoints hold no disks, this VM has writable disks".into()),
    };
    if let Some(why) = differs {
        return Err(SaveError::Disks {
            dir: cfg.dir.display().to_string(),
            why,
        });
    }
    if s.mem_bytes() != bytes {
        return Err(SaveError::Size {
            dir: cfg.dir.display().to_string(),
            store_mib: s.mem_bytes() >> 20,
            vm_mib: bytes >> 20,
        });
    }
    Ok(s)
}

/// The first checkpoint, taken by [`live_copy`].
struct First {
    ram: Vec<u8>,
    dev: Vec<u8>,
    pause: Duration,
    /// The disk writes since the disk capture's copy began (taken in the same pause), or
    /// why they are incomplete.
    writes: Result<Vec<tandem_disk::image::Write>, String>,
}

/// The first checkpoint's memory, pre-copied while the guest runs: the dirty log restarts (a
/// short pause), all of RAM is copied with the guest running, and the checkpoint pause then
/// copies only the pages written meanwhile.
fn live_copy(vm: &mut Vm, disks: Option<&DiskCapture>) -> Result<First, VmError> {
    vm.reset_dirty_log()?;
    let mut shadow = vec![0u8; vm.ram().len()];
    for (pfn, page) in shadow.chunks_mut(PAGE_SIZE).enumerate() {
        vm.ram().copy_page(pfn as u64, page);
    }
    let (mut pfns, mut pages, mut dev) = (Vec::new(), Vec::new(), Vec::new());
    let mut writes = Ok(Vec::new());
    let mut in_pause = || {
        if let Some(d) = disks {
            writes = d.take();
        }
    };
    let timing = vm.checkpoint_with(&mut pfns, &mut pages, &mut dev, &mut in_pause)?;
    for (&p, page) in pfns.iter().zip(pages.chunks(PAGE_SIZE)) {
        let o = p as usize * PAGE_SIZE;
        shadow[o..o + PAGE_SIZE].copy_from_slice(page);
    }
    Ok(First {
        ram: shadow,
        dev,
        pause: Duration::from_micros(timing.total_us() as u64),
        writes,
    })
}

/// Boots the VM and saves checkpoints as `cfg` says.
pub fn save(cfg: SaveConfig, status: Status) -> Result<SaveSummary, SaveError> {
    let mut vmc = cfg.vm.config("save")?;
    let bytes = vmc.mem_mib << 20;
    tandem_vm::private_dir(&cfg.dir)?;
    let capture = match vmc.writable_disk() {
        Some(_) => Some(DiskCapture::prepare(&cfg.dir, &mut vmc)?),
        None => None,
    };
    let mut store = open_store(&cfg, bytes, capture.as_ref().map(|c| c.layout()))?;
    let (mut vm, ready) = boot(&vmc)?;
    status.info(format!(
        "guest `{}` ready in {:.1} s; saving into {}",
        vmc.label(),
        ready.as_secs_f64(),
        cfg.dir.display()
    ));
    let codec_cfg = Config::default();
    let scratch = store.disk_base_scratch();
    if let Some(c) = &capture {
        status.info(format!(
            "copying the writable disks ({} MiB) into the first disk base",
            c.layout().total >> 20
        ));
        c.start(&mut vm, &scratch)?;
    }
    let First {
        ram: shadow,
        dev,
        pause: first_pause,
        writes,
    } = live_copy(&mut vm, capture.as_ref())?;
    if capture.is_some() {
        let writes =
            writes.map_err(|why| StoreError::Disk(format!("the disk capture broke: {why}")))?;
        DiskCapture::apply(&scratch, &writes)?;
        store.add_disk_base(store.next_id()?, &scratch)?;
    }
    // The saver keeps the shadow, its hashes and the encoder current from every checkpoint;
    // a checkpoint the store could not take (disk full) is skipped and the next is a base.
    let saver = Saver::new(store, shadow, cfg.codec, codec_cfg, cfg.base_every)?;
    let meta = Meta {
        time_ms: crate::unix_ms(),
        pause_us: first_pause.as_micros() as u32,
        dirty_pages: (bytes as usize / PAGE_SIZE) as u32,
        ..Meta::default()
    };
    let mut sink = StoreSink::new(saver, &cfg, status.clone());
    sink.capture = capture.as_ref();
    let first = sink.saver.checkpoint(&[], &[], &dev, meta)?;
    sink.log.outcome(&first);
    let base_bytes = match first {
        Outcome::Saved { memory_bytes, .. } => memory_bytes as u64,
        // Without the first disk base no later checkpoint's disks could be rebuilt.
        Outcome::Skipped { error, .. }
            if cfg.interval.is_none() || cfg.count == Some(1) || capture.is_some() =>
        {
            return Err(SaveError::NotSaved(error));
        }
        Outcome::Skipped { .. } => 0,
    };
    sink.dev_len = dev.len() as u64;
    if let Some(every) = cfg.interval.filter(|_| cfg.count != Some(1)) {
        let every = every.max(Duration::from_millis(1));
        let adaptive = cfg.adaptive.map(|mut a| {
            a.max_wait = every;
            a
        });
        let mut schedule = tandem_vm::schedule::build(every, adaptive);
        run_pipeline(&mut vm, schedule.as_mut(), Duration::MAX, 1, &mut sink)?;
        if let Some(e) = sink.err.take() {
            return Err(e.into());
        }
    }
    vm.quit();
    if let Some(keep) = cfg.keep {
        // Leave exactly the newest `keep` (between compactions up to keep/2 more exist).
        match sink.saver.store_mut().compact(keep, cfg.codec, codec_cfg) {
            Ok(n) if n > 0 => sink.compactions += 1,
            Ok(_) => {}
            Err(e) => sink.log.compaction_failed(&e),
        }
    }
    Ok(sink.summary(&cfg, first_pause, base_bytes))
}

/// The checkpoint store as the epoch pipeline's sink: saves each checkpoint, applies
/// retention, keeps the statistics.
pub struct StoreSink<'a> {
    saver: Saver,
    capture: Option<&'a DiskCapture>,
    writes: Result<Vec<tandem_disk::image::Write>, String>,
    cfg: &'a SaveConfig,
    log: SaveLog,
    status: Status,
    err: Option<StoreError>,
    pauses: Vec<f64>,
    totals: Vec<f64>,
    deltas: Vec<f64>,
    dirty: Vec<f64>,
    dev_len: u64,
    compactions: u64,
    compact_at: usize,
    taken: u64,
    last_print: Instant,
}

impl<'a> StoreSink<'a> {
    fn new(saver: Saver, cfg: &'a SaveConfig, status: Status) -> Self {
        StoreSink {
            saver,
            capture: None,
            writes: Ok(Vec::new()),
            cfg,
            log: SaveLog::new(&cfg.dir, status.clone()),
            status,
            err: None,
            pauses: Vec::new(),
            totals: Vec::new(),
            deltas: Vec::new(),
            dirty: Vec::new(),
            dev_len: 0,
            compactions: 0,
            compact_at: 0,
            taken: 1,
            last_print: Instant::now(),
        }
    }

    /// Folds old checkpoints in batches: at most keep/2 extra between compactions.
    fn retain(&mut self, keep: usize) {
        let n = self.saver.store().entries().len();
        if n <= keep + (keep / 2).max(1) || n < self.compact_at {
            return;
        }
        let (codec, codec_cfg) = (self.cfg.codec, Config::default());
        if let Some(cp) = crate::faults::compact_crash(self.cfg) {
            let r = self
                .saver
                .store_mut()
                .compact_until(keep, codec, codec_cfg, Some(cp));
            self.status.warn(format!(
                "fault injection: aborting during compaction ({cp:?}): {r:?}"
            ));
            std::process::abort();
        }
        match self.saver.store_mut().compact(keep, codec, codec_cfg) {
            Ok(_) => self.compactions += 1,
            Err(e) => {
                // Nothing changed; try again after keep/2 more checkpoints.
                self.compact_at = n + (keep / 2).max(1);
                self.log.compaction_failed(&e);
            }
        }
    }

    fn summary(&self, cfg: &SaveConfig, first_pause: Duration, base_bytes: u64) -> SaveSummary {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        SaveSummary {
            dir: cfg.dir.display().to_string(),
            checkpoints: self.taken,
            skipped: self.saver.skipped(),
            first_pause_ms: first_pause.as_secs_f64() * 1000.0,
            pause_ms_p50: quantile(&self.pauses, 0.5),
            pause_ms_p99: quantile(&self.pauses, 0.99),
            checkpoint_ms_p50: quantile(&self.totals, 0.5),
            delta_bytes_mean: mean(&self.deltas),
            base_bytes,
            compactions: self.compactions,
            kept: self.saver.store().entries().len(),
            device_state_bytes: self.dev_len,
            dirty_pages_mean: mean(&self.dirty),
        }
    }
}

impl EpochSink for StoreSink<'_> {
    fn pending(&self) -> Pending {
        Pending {
            disk_bytes: self.capture.map_or(0, |c| c.log_bytes()),
            ..Pending::default()
        }
    }

    fn in_pause(&mut self, _epoch: tandem_vm::Epoch) {
        if let Some(c) = self.capture {
            self.writes = c.take();
        }
    }

    fn checkpoint(&mut self, cp: &Checkpoint<'_>) -> bool {
        let t = Instant::now();
        let writes = match std::mem::replace(&mut self.writes, Ok(Vec::new())) {
            Ok(w) => w,
            Err(why) => {
                // The disks' state at this checkpoint is unknown: stop rather than store a
                // checkpoint whose disks would not match its memory.
                self.err = Some(StoreError::Disk(format!("the disk capture broke: {why}")));
                return false;
            }
        };
        let meta = Meta {
            time_ms: crate::unix_ms(),
            pause_us: cp.timing.total_us(),
            dirty_pages: cp.pfns.len() as u32,
            ..Meta::default()
        };
        match self
            .saver
            .checkpoint_with_disk(cp.pfns, cp.pages, cp.device_state, writes, meta)
        {
            Ok(o) => {
                self.log.outcome(&o);
                if let Outcome::Saved {
                    entry,
                    memory_bytes,
                } = o
                {
                    if entry.kind == RecordKind::Delta {
                        self.deltas.push(memory_bytes as f64);
                    }
                }
            }
            Err(e) => {
                self.err = Some(e);
                return false;
            }
        }
        if let Some(keep) = self.cfg.keep {
            self.retain(keep);
        }
        let pause_ms = cp.timing.total_us() as f64 / 1000.0;
        self.pauses.push(pause_ms);
        self.dirty.push(cp.pfns.len() as f64);
        self.dev_len = cp.device_state.len() as u64;
        self.totals
            .push(pause_ms + t.elapsed().as_secs_f64() * 1000.0);
        self.taken += 1;
        if self.last_print.elapsed() >= Duration::from_secs(1) {
            self.last_print = Instant::now();
            self.status.info(format!(
                "saved up to checkpoint {}: pause p50 {:.1} ms, delta {:.0} KiB (mean), {} in the store",
                self.saver.store().entries().last().map_or(0, |e| e.id),
                quantile(&self.pauses, 0.5),
                self.deltas.iter().sum::<f64>() / self.deltas.len().max(1) as f64 / 1024.0,
                self.saver.store().entries().len()
            ));
        }
        self.taken < self.cfg.count.unwrap_or(u64::MAX) && !self.status.stop().stopping()
    }
}
