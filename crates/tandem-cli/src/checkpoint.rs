//! `tandem checkpoint save|list|restore|verify`: incremental checkpoints of a running guest in a
//! store directory (crates/tandem-store, docs/STORE.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::signals;
use anyhow::bail;
use tandem_codec::Codec;
use tandem_protect::checkpoint::SaveConfig;
use tandem_store::Store;

use tandem_args::VmArgs;

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
    /// `fixed` (every --interval) or `adaptive` (also early when the disks' writes reach
    /// 32 MiB; --interval is the longest; docs/SCHEDULING.md).
    #[arg(long, default_value = "fixed")]
    pub schedule: crate::daemons::ScheduleArg,
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
    #[command(flatten)]
    pub faults: tandem_args::SaveFaultArgs,
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
    /// Where the checkpoint's disks are written when the checkpoints include disks (a new
    /// raw file; default: restore-<id>-<time>.img in the store). The VM's own images are
    /// never written.
    #[arg(long)]
    pub disk_out: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
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
    let mut cfg = SaveConfig::new(a.dir, a.vm.spec());
    cfg.interval = a.interval.map(Duration::from_millis);
    cfg.adaptive = (a.schedule == crate::daemons::ScheduleArg::Adaptive)
        .then(tandem_vm::schedule::AdaptiveConfig::default);
    cfg.count = a.count;
    cfg.keep = a.keep;
    cfg.base_every = a.base_every;
    cfg.codec = a.codec;
    a.faults.apply(&mut cfg);
    let s = tandem_protect::checkpoint::save(
        cfg,
        crate::daemons::stderr("checkpoint").with_stop(signals::stop()),
    )?;
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

fn restore(a: RestoreArgs) -> anyhow::Result<()> {
    signals::install();
    let store = open(&a.dir)?;
    let (vm, summary) =
        tandem_protect::restorer::restore(&store, a.id, &a.vm.spec(), a.disk_out.as_deref())?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!(
            "restored checkpoint {} in {:.0} ms (rebuilt through {} record(s) in {:.0} ms, RAM checksum verified; QEMU start {:.0} ms; device state + cont {:.0} ms); QEMU says the guest is {}",
            a.id, summary.total_ms, summary.chain_records, summary.rebuild_ms, summary.qemu_start_ms, summary.resume_ms,
            summary.status_after_resume
        );
        if let Some(d) = &summary.disk_image {
            println!(
                "the checkpoint's disks were rebuilt into {d} in {:.0} ms; the restored guest writes there (your images are untouched)",
                summary.disk_rebuild_ms
            );
        }
    }
    let until = a
        .run_seconds
        .map(|s| Instant::now() + Duration::from_secs(s));
    while !signals::stopping() && until.is_none_or(|u| Instant::now() < u) {
        std::thread::sleep(Duration::from_millis(100));
    }
    vm.quit();
    Ok(())
}
