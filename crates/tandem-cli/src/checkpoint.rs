//! `tandem checkpoint save|list|restore|verify`: incremental checkpoints of a running guest in a
//! store directory (crates/tandem-store, docs/STORE.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use tandem_codec::{Codec, Config};
use tandem_store::format::RecordKind;
use tandem_store::{Meta, Outcome, Saver, Store};
use tandem_vm::epoch::{run_epochs, Fixed};
use tandem_vm::{DirtyMode, MirrorFile, Vm, PAGE_SIZE};

use crate::stats::quantile;
use crate::vmargs::{boot, VmArgs};

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Boot the VM and take checkpoints: one now, or every --interval until --count or Ctrl-C.
    Save(SaveArgs),
    /// List the checkpoints of a store.
    List {
        dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Start QEMU from checkpoint K; the guest continues from that moment.
    Restore(RestoreArgs),
    /// Check every checksum and replay every chain.
    Verify {
        dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
pub struct SaveArgs {
    /// Store directory (created if missing; an existing store is continued with a new base).
    #[arg(long)]
    pub dir: PathBuf,
    #[command(flatten)]
    pub vm: VmArgs,
    /// Take a checkpoint every MS milliseconds (without it: one checkpoint, then exit).
    #[arg(long)]
    pub interval: Option<u64>,
    /// Stop after this many checkpoints.
    #[arg(long)]
    pub count: Option<u64>,
    /// Keep the newest N checkpoints; older ones are folded into a new base.
    #[arg(long)]
    pub keep: Option<usize>,
    /// Write a full base every N checkpoints (bounds restore chains).
    #[arg(long, default_value_t = 100)]
    pub base_every: u64,
    /// Memory codec.
    #[arg(long, default_value = "tandem")]
    pub codec: Codec,
    /// Print a JSON summary.
    #[arg(long)]
    pub json: bool,
    /// Test-only fault injection: abort the process at this compaction step
    /// (segment, index, renamed).
    #[arg(long, hide = true)]
    pub fault_compact: Option<tandem_store::store::CrashPoint>,
}

#[derive(clap::Args)]
pub struct RestoreArgs {
    /// Store directory.
    pub dir: PathBuf,
    /// Checkpoint id.
    #[arg(long)]
    pub id: u64,
    #[command(flatten)]
    pub vm: VmArgs,
    /// Let the restored guest run this long, then stop it (default: until Ctrl-C).
    #[arg(long)]
    pub run_seconds: Option<u64>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct SaveSummary {
    dir: String,
    /// Checkpoints taken (saved + skipped).
    checkpoints: u64,
    /// Checkpoints the store could not take (disk full, write errors).
    skipped: u64,
    first_pause_ms: f64,
    pause_ms_p50: f64,
    pause_ms_p99: f64,
    checkpoint_ms_p50: f64,
    delta_bytes_mean: f64,
    base_bytes: u64,
    compactions: u64,
    kept: usize,
    device_state_bytes: u64,
    dirty_pages_mean: f64,
}

fn unix_ms() -> u64 {
    crate::replicate::unix_ms()
}

pub fn run(c: Cmd) -> anyhow::Result<()> {
    match c {
        Cmd::Save(a) => save(a),
        Cmd::List { dir, json } => list(&dir, json),
        Cmd::Restore(a) => restore(a),
        Cmd::Verify { dir, json } => verify(&dir, json),
    }
}

fn save(a: SaveArgs) -> anyhow::Result<()> {
    crate::replicate::install_stop_handler();
    let cfg = a.vm.config("save")?;
    let bytes = cfg.mem_mib << 20;
    // Takes the store's writer lock before the guest boots: a second saver stops here.
    let store = if a.dir.join("index").exists() {
        let s = Store::open_append(&a.dir)?;
        if s.mem_bytes() != bytes {
            bail!(
                "{} holds checkpoints of a {} MiB guest; this VM has {} MiB",
                a.dir.display(),
                s.mem_bytes() >> 20,
                cfg.mem_mib
            );
        }
        s
    } else {
        Store::create(&a.dir, bytes)?
    };
    let (mut vm, ready, load) = boot(&cfg)?;
    eprintln!(
        "checkpoint: guest `{}` ready in {:.1} s; saving into {}",
        cfg.workload,
        ready.as_secs_f64(),
        a.dir.display()
    );
    let codec_cfg = Config::default();
    // First checkpoint: a base, pre-copied while the guest runs. The dirty log restarts (a
    // short pause), all of RAM is copied with the guest running, and the checkpoint pause then
    // copies only the pages written meanwhile (the dirty log has every one of them).
    vm.reset_dirty_log()?;
    let mut shadow = vec![0u8; bytes as usize];
    for (pfn, page) in shadow.chunks_mut(PAGE_SIZE).enumerate() {
        vm.ram().copy_page(pfn as u64, page);
    }
    let (mut pfns, mut pages, mut dev) = (Vec::new(), Vec::new(), Vec::new());
    let timing = vm.checkpoint(&mut pfns, &mut pages, &mut dev)?;
    for (&p, page) in pfns.iter().zip(pages.chunks(PAGE_SIZE)) {
        let o = p as usize * PAGE_SIZE;
        shadow[o..o + PAGE_SIZE].copy_from_slice(page);
    }
    let first_pause = Duration::from_micros(timing.total_us() as u64);
    // The saver keeps the shadow, its hashes and the encoder current from every checkpoint;
    // a checkpoint the store could not take (disk full) is skipped and the next is a base.
    let mut saver = Saver::new(store, shadow, a.codec, codec_cfg, a.base_every)?;
    let meta = Meta {
        time_ms: unix_ms(),
        pause_us: first_pause.as_micros() as u32,
        dirty_pages: (bytes as usize / PAGE_SIZE) as u32,
        ..Meta::default()
    };
    let mut log = SaveLog::new(&a.dir);
    let first = saver.checkpoint(&[], &[], &dev, meta)?;
    log.outcome(&first);
    let base_bytes = match first {
        Outcome::Saved { memory_bytes, .. } => memory_bytes as u64,
        Outcome::Skipped { error, .. } if a.interval.is_none() || a.count == Some(1) => {
            return Err(error).context("the checkpoint was not saved");
        }
        Outcome::Skipped { .. } => 0,
    };
    let (mut pauses, mut totals, mut deltas) = (Vec::new(), Vec::new(), Vec::new());
    let (mut dirty, mut dev_len) = (Vec::new(), dev.len() as u64);
    let mut compactions = 0;
    let mut compact_at = 0;
    let mut taken = 1u64;
    let mut err = None;
    if let Some(ms) = a.interval.filter(|_| a.count != Some(1)) {
        let limit = a.count.unwrap_or(u64::MAX);
        let mut last_print = Instant::now();
        run_epochs(
            &mut vm,
            &mut Fixed(Duration::from_millis(ms.max(1))),
            Duration::from_secs(u64::MAX / 4),
            |cp| {
                let t = Instant::now();
                let meta = Meta {
                    time_ms: unix_ms(),
                    pause_us: cp.timing.total_us(),
                    dirty_pages: cp.pfns.len() as u32,
                    ..Meta::default()
                };
                match saver.checkpoint(cp.pfns, cp.pages, cp.device_state, meta) {
                    Ok(o) => {
                        log.outcome(&o);
                        if let Outcome::Saved {
                            entry,
                            memory_bytes,
                        } = o
                        {
                            if entry.kind == RecordKind::Delta {
                                deltas.push(memory_bytes as f64);
                            }
                        }
                    }
                    Err(e) => {
                        err = Some(anyhow::Error::from(e));
                        return false;
                    }
                }
                if let Some(keep) = a.keep {
                    // Fold in batches: at most keep/2 extra checkpoints between compactions.
                    let n = saver.store().entries().len();
                    if n > keep + (keep / 2).max(1) && n >= compact_at {
                        if let Some(cp) = a.fault_compact {
                            let r =
                                saver
                                    .store_mut()
                                    .compact_until(keep, a.codec, codec_cfg, Some(cp));
                            eprintln!("checkpoint: fault injection: aborting during compaction ({cp:?}): {r:?}");
                            std::process::abort();
                        }
                        match saver.store_mut().compact(keep, a.codec, codec_cfg) {
                            Ok(_) => compactions += 1,
                            Err(e) => {
                                // Nothing changed; try again after keep/2 more checkpoints.
                                compact_at = n + (keep / 2).max(1);
                                log.compaction_failed(&e);
                            }
                        }
                    }
                }
                pauses.push(cp.timing.total_us() as f64 / 1000.0);
                dirty.push(cp.pfns.len() as f64);
                dev_len = cp.device_state.len() as u64;
                totals.push(
                    cp.timing.total_us() as f64 / 1000.0 + t.elapsed().as_secs_f64() * 1000.0,
                );
                taken += 1;
                if last_print.elapsed() >= Duration::from_secs(1) {
                    last_print = Instant::now();
                    eprintln!(
                        "checkpoint {}: pause p50 {:.1} ms, delta {:.0} KiB (mean), {} in the store",
                        saver.store().entries().last().map_or(0, |e| e.id),
                        quantile(&pauses, 0.5),
                        deltas.iter().sum::<f64>() / deltas.len().max(1) as f64 / 1024.0,
                        saver.store().entries().len()
                    );
                }
                taken < limit && !crate::replicate::stopping()
            },
        )?;
    }
    if let Some(e) = err {
        return Err(e);
    }
    if let Some(l) = load {
        l.stop()?;
    }
    vm.quit();
    if let Some(keep) = a.keep {
        // Leave exactly the newest `keep` (between compactions up to keep/2 more exist).
        match saver.store_mut().compact(keep, a.codec, codec_cfg) {
            Ok(n) if n > 0 => compactions += 1,
            Ok(_) => {}
            Err(e) => log.compaction_failed(&e),
        }
    }
    let s = SaveSummary {
        dir: a.dir.display().to_string(),
        checkpoints: taken,
        skipped: saver.skipped(),
        first_pause_ms: first_pause.as_secs_f64() * 1000.0,
        pause_ms_p50: quantile(&pauses, 0.5),
        pause_ms_p99: quantile(&pauses, 0.99),
        checkpoint_ms_p50: quantile(&totals, 0.5),
        delta_bytes_mean: deltas.iter().sum::<f64>() / deltas.len().max(1) as f64,
        base_bytes,
        compactions,
        kept: saver.store().entries().len(),
        device_state_bytes: dev_len,
        dirty_pages_mean: dirty.iter().sum::<f64>() / dirty.len().max(1) as f64,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        println!(
            "saved {} checkpoint(s) into {}: first (base, {:.1} MiB) paused {:.0} ms; then pause p50 {:.1} ms p99 {:.1} ms, checkpoint (pause + encode + fsync) p50 {:.1} ms, delta {:.0} KiB mean; {} kept ({} compactions)",
            s.checkpoints - s.skipped, s.dir, s.base_bytes as f64 / (1 << 20) as f64, s.first_pause_ms, s.pause_ms_p50, s.pause_ms_p99,
            s.checkpoint_ms_p50, s.delta_bytes_mean / 1024.0, s.kept, s.compactions
        );
    }
    if s.skipped > 0 {
        eprintln!(
            "checkpoint: warning: {} of {} checkpoint(s) were not saved (see above); every checkpoint in the store is complete",
            s.skipped, s.checkpoints
        );
    }
    Ok(())
}

/// Reports what became of each checkpoint: skipped ones with why and what to do (in full at
/// the first of a run of failures, then a reminder every 5 s), and the first one saved again.
struct SaveLog {
    dir: String,
    seq: u64,
    failing: bool,
    last_reminder: Instant,
}

impl SaveLog {
    fn new(dir: &std::path::Path) -> Self {
        SaveLog {
            dir: dir.display().to_string(),
            seq: 0,
            failing: false,
            last_reminder: Instant::now(),
        }
    }

    fn outcome(&mut self, o: &Outcome) {
        self.seq += 1;
        match o {
            Outcome::Saved { entry, .. } => {
                if self.failing {
                    eprintln!(
                        "checkpoint: saving again: checkpoint {} (#{} of this run) is a full {}",
                        entry.id,
                        self.seq,
                        format!("{:?}", entry.kind).to_lowercase()
                    );
                }
                self.failing = false;
            }
            Outcome::Skipped {
                would_be,
                error,
                streak,
            } => {
                self.failing = true;
                let why = chain(error);
                let what = if error.is_disk_full() {
                    format!("the disk holding {} is full", self.dir)
                } else {
                    format!("writing to {} failed", self.dir)
                };
                if *streak == 1 {
                    eprintln!(
                        "checkpoint: {what}: checkpoint #{} of this run (it would have been checkpoint {would_be}) was NOT saved ({why}). The guest keeps running and the store is intact, ending at the last saved checkpoint. Free space there (or lower --keep); tandem retries at every checkpoint, and the next one saved will be a full base.",
                        self.seq
                    );
                    self.last_reminder = Instant::now();
                } else if self.last_reminder.elapsed() >= Duration::from_secs(5) {
                    eprintln!(
                        "checkpoint: {what}: still not saving ({streak} checkpoint(s) skipped in a row, latest #{}: {why})",
                        self.seq
                    );
                    self.last_reminder = Instant::now();
                }
            }
        }
    }

    fn compaction_failed(&self, e: &tandem_store::StoreError) {
        let full = if e.is_disk_full() { " (disk full)" } else { "" };
        eprintln!(
            "checkpoint: retention could not fold old checkpoints in {}{full}: {}; nothing was dropped, the store is intact; it is tried again later",
            self.dir,
            chain(e)
        );
    }
}

/// An error with its sources, `a: b: c`.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s = format!("{s}: {c}");
        src = c.source();
    }
    s
}

fn open(dir: &std::path::Path) -> anyhow::Result<Store> {
    let s = Store::open(dir)?;
    if let Some(t) = s.torn_tail() {
        eprintln!(
            "warning: {}: {t} (a crash while saving; nothing committed is lost)",
            dir.display()
        );
    }
    Ok(s)
}

fn list(dir: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let s = open(dir)?;
    if json {
        println!("{}", serde_json::to_string_pretty(s.entries())?);
        return Ok(());
    }
    println!(
        "{:>6}  {:<5}  {:>10}  {:>8}  {:>7}  {:<18}  time (unix ms)",
        "id", "kind", "bytes", "pause ms", "dirty", "segment"
    );
    for e in s.entries() {
        println!(
            "{:>6}  {:<5}  {:>10}  {:>8.1}  {:>7}  {:<18}  {}",
            e.id,
            format!("{:?}", e.kind).to_lowercase(),
            e.len,
            e.pause_us as f64 / 1000.0,
            e.dirty_pages,
            Store::segment_name(e),
            e.time_ms
        );
    }
    Ok(())
}

fn verify(dir: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let s = open(dir)?;
    let pb = indicatif::ProgressBar::new(s.entries().len() as u64);
    let problems = s.verify(|_| pb.inc(1));
    pb.finish_and_clear();
    let lines: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
    if json {
        println!(
            "{}",
            serde_json::json!({"checkpoints": s.entries().len(), "ok": lines.is_empty(), "problems": lines})
        );
    } else {
        for l in &lines {
            println!("DAMAGED: {l}");
        }
    }
    if !lines.is_empty() {
        bail!("{} problem(s) in {}", lines.len(), dir.display());
    }
    if !json {
        println!(
            "{}: {} checkpoint(s), every record and RAM checksum verified",
            dir.display(),
            s.entries().len()
        );
    }
    Ok(())
}

#[derive(Serialize)]
struct RestoreSummary {
    id: u64,
    chain_records: usize,
    rebuild_ms: f64,
    qemu_start_ms: f64,
    resume_ms: f64,
    total_ms: f64,
    ram_checksum_verified: bool,
    guest_tick_after_resume: Option<u64>,
}

fn restore(a: RestoreArgs) -> anyhow::Result<()> {
    crate::replicate::install_stop_handler();
    let s = open(&a.dir)?;
    let mut cfg = a.vm.config("restore")?;
    cfg.dirty = DirtyMode::None;
    if cfg.mem_mib << 20 != s.mem_bytes() {
        bail!(
            "checkpoint is of a {} MiB guest; pass --mem {}",
            s.mem_bytes() >> 20,
            s.mem_bytes() >> 20
        );
    }
    let idx = s.entries().iter().position(|e| e.id == a.id);
    let chain = idx.map(|i| {
        i + 1
            - s.entries()[..=i]
                .iter()
                .rposition(|e| e.kind == RecordKind::Base)
                .unwrap_or(0)
    });
    let t = Instant::now();
    let path = PathBuf::from(format!(
        "/dev/shm/tandem-restore-{}.ram",
        std::process::id()
    ));
    // SAFETY: this process is the file's only writer until QEMU starts on it below.
    let mut ram = unsafe { MirrorFile::create(&path, s.mem_bytes()) }?;
    let dev = match s.materialize_zeroed(a.id, ram.as_mut()) {
        Ok(d) => d,
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            return Err(e).context(format!("restoring checkpoint {}", a.id));
        }
    };
    drop(ram);
    let rebuilt = t.elapsed();
    let started = Instant::now();
    let vm = Vm::standby(&cfg, &path);
    let _ = std::fs::remove_file(&path);
    let mut vm = vm.context("starting QEMU on the restored memory")?;
    let qemu_start = started.elapsed();
    let r = Instant::now();
    vm.resume(&dev)
        .context("loading the checkpoint's device state")?;
    let resumed = r.elapsed();
    let total = t.elapsed();
    let tick = vm.console.wait_tick(Duration::from_secs(20)).ok();
    let summary = RestoreSummary {
        id: a.id,
        chain_records: chain.unwrap_or(0),
        rebuild_ms: rebuilt.as_secs_f64() * 1000.0,
        qemu_start_ms: qemu_start.as_secs_f64() * 1000.0,
        resume_ms: resumed.as_secs_f64() * 1000.0,
        total_ms: total.as_secs_f64() * 1000.0,
        ram_checksum_verified: true,
        guest_tick_after_resume: tick,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!(
            "restored checkpoint {} in {:.0} ms (rebuilt through {} record(s) in {:.0} ms, RAM checksum verified; QEMU start {:.0} ms; device state + cont {:.0} ms); the guest runs{}",
            a.id, summary.total_ms, summary.chain_records, summary.rebuild_ms, summary.qemu_start_ms, summary.resume_ms,
            tick.map(|t| format!(" (console tick {t})")).unwrap_or_default()
        );
    }
    let until = a
        .run_seconds
        .map(|s| Instant::now() + Duration::from_secs(s));
    while !crate::replicate::stopping() && until.is_none_or(|u| Instant::now() < u) {
        std::thread::sleep(Duration::from_millis(100));
    }
    vm.quit();
    Ok(())
}
