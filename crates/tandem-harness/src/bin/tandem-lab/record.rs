//! `tandem record`, `tandem traces` and `tandem trace info` (`trace prng`: prng.rs).

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tandem_harness::recorder::RecordConfig;
use tandem_trace::{Timing, TraceHeader};
use tandem_types::stats::quantile;

use tandem_args::VmArgs;
use tandem_harness::kv_load;
use tandem_vm::VmConfig;

/// The VM a lab command starts: the lab guest running `--workload`, or the VM of
/// `--vm-config`.
#[derive(clap::Args, Clone, Debug)]
pub struct LabVmArgs {
    /// The lab guest's workload (tandem_labguest::WORKLOADS: idle, memtouch, memheavy,
    /// compile, sqlite, kv, kvheavy, disk, luatext, luagc, alloc, awktext, archive, httpd;
    /// ignored with --vm-config).
    #[arg(long, default_value = "kv")]
    pub workload: String,
    /// The lab guest's image directory (default: the cache that `./tandem setup` fills).
    #[arg(long)]
    pub image: Option<PathBuf>,
    #[command(flatten)]
    pub vm: VmArgs,
}

impl LabVmArgs {
    /// The lab guest running `workload` in `mem` MiB, the other flags at their defaults.
    fn lab(workload: &str, mem: u64) -> Self {
        let mut vm = VmArgs::described(PathBuf::new(), mem);
        vm.vm_config = None;
        LabVmArgs {
            workload: workload.into(),
            image: None,
            vm,
        }
    }

    /// The VM's configuration (named `name`).
    fn config(&self, name: &str) -> anyhow::Result<VmConfig> {
        if self.vm.vm_config.is_some() {
            return Ok(self.vm.spec().config(name)?);
        }
        tandem_labguest::check_workload(&self.workload)?;
        let image = tandem_labguest::GuestImage::at(self.image.as_deref());
        image.check()?;
        let mut c = match (&self.image, self.workload.as_str()) {
            (None, w) => tandem_harness::lab_config(name, w, self.vm.mem)?,
            (Some(_), w) => tandem_labguest::config(name, w, &image),
        };
        c.mem_mib = self.vm.mem;
        c.vcpus = self.vm.vcpus;
        c.dirty = self.vm.dirty_log;
        c.qemu = self.vm.qemu.clone();
        c.accel = self.vm.accel.clone();
        c.check()?;
        Ok(c)
    }
}

#[derive(clap::Args)]
pub struct RecordArgs {
    #[command(flatten)]
    pub vm: LabVmArgs,
    /// Epoch length in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub epoch_ms: u64,
    /// Seconds to record.
    #[arg(long, default_value_t = 30)]
    pub duration: u64,
    /// Output trace file.
    #[arg(short = 'o', long)]
    pub output: PathBuf,
    /// zstd level for trace frames.
    #[arg(long, default_value_t = 1)]
    pub level: i32,
}

#[derive(clap::Args)]
pub struct TracesArgs {
    /// Epoch length in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub epoch_ms: u64,
    /// Seconds per trace.
    #[arg(long, default_value_t = 30)]
    pub duration: u64,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    pub mem: u64,
    /// Workloads to record: the lab guest's (see `record --workload`; the codec's split in
    /// docs/CODEC.md: idle, compile, sqlite, kv, memtouch, disk, pgbench tuned on; luatext,
    /// luagc, alloc, awktext, archive, httpd held out), or
    /// `pgbench`: PostgreSQL in the Debian VM (needs `tandem setup --debian`) under 4 pgbench
    /// clients, recorded after `pgbench -i` (its RAM is the VM description's, not --mem).
    #[arg(long, value_delimiter = ',', default_value = "idle,compile,sqlite,kv")]
    pub workloads: Vec<String>,
    /// Re-record traces that already exist.
    #[arg(long)]
    pub force: bool,
}

#[derive(clap::Subcommand)]
pub enum TraceCmd {
    /// Per-epoch and total figures of a trace.
    Info {
        /// Trace file.
        file: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Bytes per epoch that continue a xorshift64 stream (the `alloc` workload's generator):
    /// a lower bound of what any general-purpose codec sends for the trace.
    Prng {
        /// Trace files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
}

/// Standard location of a recorded trace in the cache.
pub fn trace_path(workload: &str, mem: u64, epoch_ms: u64) -> PathBuf {
    tandem_labguest::cache_dir()
        .join("traces")
        .join(format!("{workload}-{mem}m-{epoch_ms}ms.trace"))
}

pub fn record(a: RecordArgs) -> anyhow::Result<()> {
    record_with(a, kv_load())
}

/// `tandem record` with `load` on the guest once it is ready.
fn record_with(a: RecordArgs, load: tandem_harness::StartLoad) -> anyhow::Result<()> {
    let cfg = RecordConfig {
        vm: a.vm.config("record")?,
        epoch: Duration::from_millis(a.epoch_ms),
        duration: Duration::from_secs(a.duration),
        output: a.output.clone(),
        level: a.level,
        load: Some(load),
    };
    match &a.vm.vm.vm_config {
        Some(p) => eprintln!("booting the VM of {} ({})...", p.display(), a.vm.vm.accel),
        None => eprintln!(
            "booting {} guest ({} MiB, {})...",
            a.vm.workload, a.vm.vm.mem, a.vm.vm.accel
        ),
    }
    let pb = ProgressBar::new(a.duration);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len}s {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let r = tandem_harness::recorder::record(&cfg, &mut |cp| {
        pb.set_position(cp.at.as_secs().min(a.duration));
        pb.set_message(format!(
            "epoch {} dirty {} pages, pause {:.1} ms",
            cp.epoch,
            cp.pfns.len(),
            cp.timing.total_us() as f64 / 1000.0
        ));
    });
    pb.finish_and_clear();
    let r = r?;
    println!(
        "recorded {} epochs of {} ({} dirty pages, pause p50 {:.1} ms p99 {:.1} ms{}) into {} ({:.1} MiB)",
        r.epochs,
        r.workload,
        r.dirty_pages,
        quantile(&r.pauses_ms, 0.5),
        quantile(&r.pauses_ms, 0.99),
        r.load_ops
            .map(|o| format!(", client {:.0} ops/s", o as f64 / a.duration as f64))
            .unwrap_or_default(),
        a.output.display(),
        r.bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}

pub fn traces(a: TracesArgs) -> anyhow::Result<()> {
    for w in &a.workloads {
        if w == "pgbench" {
            pgbench_trace(&a)?;
            continue;
        }
        tandem_labguest::check_workload(w)?;
        let out = trace_path(w, a.mem, a.epoch_ms);
        if out.exists() && !a.force {
            println!("{w}: {} exists (use --force to re-record)", out.display());
            continue;
        }
        let vm = LabVmArgs::lab(w, a.mem);
        record(RecordArgs {
            vm,
            epoch_ms: a.epoch_ms,
            duration: a.duration,
            output: out,
            level: 1,
        })?;
    }
    Ok(())
}

/// The `pgbench` trace: PostgreSQL in the Debian test VM (its own description, 1 GiB), 4
/// pgbench clients at scale 4, recorded once the tables are initialised.
fn pgbench_trace(a: &TracesArgs) -> anyhow::Result<()> {
    let desc = tandem_harness::demo::DebianVm::cached()?.desc;
    let text = std::fs::read_to_string(&desc)?;
    let file = tandem_protect::vmfile::VmFile::parse(&text)
        .with_context(|| format!("reading {}", desc.display()))?;
    let mem = file.mem.unwrap_or(1024);
    let out = trace_path("pgbench", mem, a.epoch_ms);
    if out.exists() && !a.force {
        println!(
            "pgbench: {} exists (use --force to re-record)",
            out.display()
        );
        return Ok(());
    }
    let mut vm = LabVmArgs::lab("idle", mem);
    vm.vm.vm_config = Some(desc);
    let load = tandem_harness::pgload::pgbench_load(4, 4, a.duration);
    record_with(
        RecordArgs {
            vm,
            epoch_ms: a.epoch_ms,
            duration: a.duration,
            output: out,
            level: 1,
        },
        load,
    )
}

#[derive(Serialize, Default, Clone)]
pub struct EpochInfo {
    pub epoch: tandem_types::Epoch,
    pub at_ms: f64,
    pub dirty_pages: u64,
    pub zero_pages: u64,
    pub unchanged_pages: u64,
    pub pause_us: u64,
    pub timing: Timing,
    pub device_state_bytes: u32,
}

#[derive(Serialize, Default)]
pub struct TraceInfo {
    pub file: String,
    pub header: Option<TraceHeader>,
    pub epochs: u64,
    pub guest_memory_bytes: u64,
    pub dirty_pages: u64,
    pub zero_pages: u64,
    pub unchanged_pages: u64,
    pub per_epoch: Vec<EpochInfo>,
}

fn is_zero(p: &[u8]) -> bool {
    p.chunks_exact(8).all(|w| w == [0u8; 8])
}

/// Per-epoch and total page classification of a trace.
pub fn analyse(path: &Path) -> anyhow::Result<TraceInfo> {
    let mut info = TraceInfo {
        file: path.display().to_string(),
        ..Default::default()
    };
    let f = File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let input = BufReader::with_capacity(1 << 20, f);
    let (h, _) = tandem_trace::replay(input, |mem, e| -> anyhow::Result<()> {
        let ps = e.data.len() / e.pfns.len().max(1);
        let mut ei = EpochInfo {
            epoch: e.epoch,
            at_ms: e.at_us as f64 / 1000.0,
            dirty_pages: e.pfns.len() as u64,
            pause_us: u64::from(e.timing.total_us()),
            timing: e.timing,
            device_state_bytes: e.device_state_len,
            ..Default::default()
        };
        for (i, &pfn) in e.pfns.iter().enumerate() {
            let new = &e.data[i * ps..(i + 1) * ps];
            ei.zero_pages += is_zero(new) as u64;
            ei.unchanged_pages += (new == &mem[pfn as usize * ps..(pfn as usize + 1) * ps]) as u64;
        }
        info.epochs += 1;
        info.dirty_pages += ei.dirty_pages;
        info.zero_pages += ei.zero_pages;
        info.unchanged_pages += ei.unchanged_pages;
        info.per_epoch.push(ei);
        Ok(())
    })?;
    info.guest_memory_bytes = h.mem_bytes;
    info.header = Some(h);
    Ok(info)
}

pub fn trace_cmd(c: TraceCmd) -> anyhow::Result<()> {
    match c {
        TraceCmd::Prng { files, json } => crate::prng::run(&files, json),
        TraceCmd::Info { file, json } => {
            let info = analyse(&file)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&info)?);
                return Ok(());
            }
            let h = info.header.as_ref().context("no header")?;
            println!(
                "trace {}: {} MiB guest, epoch {} ms, meta {}",
                info.file,
                h.mem_bytes >> 20,
                h.epoch_ms,
                h.meta
            );
            println!(
                "{:>6} {:>9} {:>7} {:>6} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "epoch",
                "at_ms",
                "dirty",
                "zero",
                "unchanged",
                "pause_ms",
                "stop",
                "harvest",
                "copy",
                "devstate",
                "cont"
            );
            for e in &info.per_epoch {
                let t = e.timing;
                let ms = |v: u32| v as f64 / 1000.0;
                println!(
                    "{:>6} {:>9.1} {:>7} {:>6} {:>9} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                    e.epoch, e.at_ms, e.dirty_pages, e.zero_pages, e.unchanged_pages, e.pause_us as f64 / 1000.0,
                    ms(t.stop_us), ms(t.harvest_us), ms(t.copy_us), ms(t.devstate_us), ms(t.cont_us)
                );
            }
            let pct = |n: u64| 100.0 * n as f64 / info.dirty_pages.max(1) as f64;
            println!(
                "total: {} epochs, guest memory {} bytes, {} dirty pages ({:.1} per epoch), {} zero ({:.1}%), {} written but unchanged ({:.1}%)",
                info.epochs, info.guest_memory_bytes, info.dirty_pages,
                info.dirty_pages as f64 / info.epochs.max(1) as f64,
                info.zero_pages, pct(info.zero_pages), info.unchanged_pages, pct(info.unchanged_pages)
            );
            Ok(())
        }
    }
}
