//! `tandem bench --lab`: VM-lab measurements (boot time, pause breakdown, harvest cost against
//! dirty-page count, hash-scan rate against memcpy bandwidth, dirty pages per epoch length).

mod codec;
mod consolidate;
mod failover;
mod faults;
pub mod guarantee;
mod host;
mod ksm;
mod link;
mod plot;
mod replication;
mod store;

use std::time::{Duration, Instant};

use anyhow::bail;
use serde::Serialize;
use tandem_vm::epoch::{run_epochs, Fixed};
use tandem_vm::{DirtyLog, HashLog, Vm};

use crate::boot;
use tandem_types::stats::{mean, quantile};

/// `tandem bench` flags.
#[derive(clap::Args)]
pub struct Args {
    /// Measure the VM lab on real guests.
    #[arg(long)]
    pub lab: bool,
    /// Benchmark the codecs over recorded traces (see `tandem traces`).
    #[arg(long, num_args = 1..)]
    pub trace: Vec<std::path::PathBuf>,
    /// Codecs for --trace: a comma-separated list or `all`.
    #[arg(long, default_value = "all")]
    pub codec: String,
    /// zstd level of record data sections (tandem, fgbi, zstd1); negative levels are faster.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true)]
    pub zstd_level: i32,
    /// tandem strategy knobs for --trace, e.g. `good_enough=64,similarity=off` (docs/CODEC.md).
    #[arg(long, default_value = "")]
    pub budget: String,
    /// Bound of the codecs' previous-version stores, MiB.
    #[arg(long, default_value_t = 64)]
    pub cache_mib: usize,
    /// Keep every page's previous version instead of a bounded store.
    #[arg(long)]
    pub full_mirror: bool,
    /// Encoder threads for --trace (throughput is reported per core).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// --trace: tandem's zstd frame size in MiB (prefix and payload; larger records are cut
    /// into frames compressed in parallel by --threads).
    #[arg(long, default_value_t = 32)]
    pub frame_mib: usize,
    /// --trace: merge this many consecutive recorded epochs into one (100 ms epochs × 5 =
    /// 500 ms epochs: the union of their pages, each with its last content).
    #[arg(long, default_value_t = 1)]
    pub coalesce: usize,
    /// --trace: also a control row per codec, given only the pages whose content changed
    /// (the same treatment of written-but-unchanged pages for every codec).
    #[arg(long)]
    pub control: bool,
    /// With --trace: one replica per trace on one backup, their cold pages consolidated
    /// (sharing, patching, compression; seed 001): memory per replica against plain mirrors
    /// and KSM, apply rate, materialisation time.
    #[arg(long)]
    pub consolidate: bool,
    /// Real guests (--workloads, default idle,compile,sqlite,kv), one primary each, protected
    /// by one `tandem backup-host`: its memory consolidated and with plain mirrors, side by
    /// side, and one host kill (--seconds of replication first).
    #[arg(long)]
    pub backup_host: bool,
    /// --consolidate: guest seconds per revolution of the NRU clock (seed 001 scans at most
    /// every 4 s).
    #[arg(long, default_value_t = 4.0)]
    pub clock_s: f64,
    /// Measure replication end to end (primary + backup in namespaces, a real client, a host
    /// failure): throughput replicated vs native, bytes, pauses, failover time.
    #[arg(long)]
    pub replication: bool,
    /// Workloads (--lab default: idle,memtouch,compile,sqlite,kv; --replication default:
    /// kv,sqlite,compile,idle).
    #[arg(long, value_delimiter = ',')]
    pub workloads: Vec<String>,
    /// Epoch lengths in ms (--lab default: 25,100,500; --replication default: 25,100).
    #[arg(long, value_delimiter = ',')]
    pub epochs_ms: Vec<u64>,
    /// --replication: the primary's schedules to compare (fixed, adaptive, adaptive-nostop =
    /// adaptive without its stop threshold, adaptive-nobudget = without its guest-time
    /// budget; default fixed). With adaptive, each epoch length
    /// is its longest epoch.
    #[arg(long, value_delimiter = ',')]
    pub schedules: Vec<String>,
    /// --replication with the adaptive schedule: the primary's `--run-per-pause`.
    #[arg(long, default_value_t = 1.0)]
    pub run_per_pause: f64,
    /// --replication: also write the plots (client latency CDFs, epoch timelines) as one HTML
    /// page of SVG to this file.
    #[arg(long)]
    pub plots: Option<std::path::PathBuf>,
    /// --replication with the adaptive schedule: the primary's `--converge-pct`.
    #[arg(long)]
    pub converge_pct: Option<f64>,
    /// --replication: more flags for every primary, one per occurrence
    /// (`--primary-arg=--max-unacked=2`).
    #[arg(long, allow_hyphen_values = true)]
    pub primary_arg: Vec<String>,
    /// --replication: the primary's `--precopy-rounds` to compare (default: the primary's).
    #[arg(long, value_delimiter = ',')]
    pub precopy_rounds: Vec<u32>,
    /// --replication with the adaptive schedule: the primary's `--stop-budget-ms` (default:
    /// the primary's).
    #[arg(long)]
    pub stop_budget_ms: Option<u64>,
    /// --replication: the kv client axis, `latency` (--latency-conns connections, one request
    /// in flight each), `pipelined` (--conns × --batch) and/or `demo` (`tandem demo`'s client,
    /// 8 × 32). Default: one client, --conns × --batch.
    #[arg(long, value_delimiter = ',')]
    pub clients: Vec<String>,
    /// Connections of the `latency` client.
    #[arg(long, default_value_t = 16)]
    pub latency_conns: usize,
    /// With --replication: the link axis, `plain` and/or `tls` (mutual TLS with lab keys).
    #[arg(long, value_delimiter = ',')]
    pub links: Vec<String>,
    /// Measure the checkpoint store against QEMU's full save and page-granular increments.
    #[arg(long)]
    pub store: bool,
    /// Guest sizes in MiB for --store [default: 256,1024].
    #[arg(long, value_delimiter = ',')]
    pub mems: Vec<u64>,
    /// Checkpoints per run for --store (the first is a base, the rest one delta chain).
    #[arg(long, default_value_t = 101)]
    pub count: u64,
    /// Checkpoint interval in ms for --store.
    #[arg(long, default_value_t = 200)]
    pub interval: u64,
    /// --lab: device-state capture paths to compare, `migrate` and/or `xen-save` (default
    /// both, side by side at every epoch length). --replication: the primary's `--devstate`
    /// as an axis (default: the primary's, xen-save).
    #[arg(long, value_delimiter = ',')]
    pub devstate: Vec<String>,
    /// --lab: the guest's virtio-pci mode, `legacy` (the lab guest's default: a much smaller
    /// device state) and/or `modern` (QEMU's default), each a fresh boot.
    #[arg(long, value_delimiter = ',')]
    pub virtio: Vec<String>,
    /// Replication link rate in Mbit/s for --replication (0 = unlimited).
    #[arg(long, default_value_t = 1000)]
    pub rate_mbit: u64,
    /// kv client connections and pipelined writes per round trip for --replication.
    #[arg(long, default_value_t = 32)]
    pub conns: usize,
    /// Pipelined writes per round trip (with --conns).
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Seconds per workload and epoch length.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    pub mem: u64,
    /// --replication: the guest's virtual CPUs (default 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub vcpus: Option<u32>,
    /// Fault campaign: inject at least this many random faults, in combinations, into
    /// replicated kv guests fenced by etcd, and check every round's history
    /// (docs/BENCHMARKS.md, "Fencing").
    #[arg(long)]
    pub faults: Option<u64>,
    /// With --faults: no etcd fencing (no etcd faults, no double faults).
    #[arg(long)]
    pub no_etcd: bool,
    /// Failover times: N host kills with etcd fencing and N without (the baseline), and N/2
    /// isolations at 500 and 100 ms detection, rounds alternated (docs/BENCHMARKS.md,
    /// "Fencing").
    #[arg(long, value_name = "N")]
    pub failover: Option<usize>,
    /// Seed for --faults (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// What mutual TLS costs on the replication link: throughput, CPU and round trip, plain
    /// TCP vs TLS through the daemons' connection code (docs/BENCHMARKS.md, "Link security").
    #[arg(long)]
    pub link: bool,
    /// MiB per throughput run with --link.
    #[arg(long, default_value_t = 512)]
    pub link_mib: usize,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Row {
    workload: String,
    epoch_ms: u64,
    /// Device-state path: migrate or xen-save.
    devstate: String,
    /// virtio-pci mode of the guest's devices: legacy (the lab default) or modern.
    virtio: String,
    epochs: usize,
    dirty_mean: f64,
    dirty_p50: f64,
    dirty_p99: f64,
    pause_p50_ms: f64,
    pause_p99_ms: f64,
    /// medians: stop, harvest, copy, devstate, cont (ms)
    components_p50_ms: [f64; 5],
}

#[derive(Serialize)]
struct Bucket {
    dirty_pages: String,
    samples: usize,
    harvest_p50_ms: f64,
    harvest_p99_ms: f64,
}

#[derive(Serialize)]
struct Scan {
    mem_mib: u64,
    memcpy_gbps_1core: f64,
    hash_gbps_1core: f64,
    hash_gbps_all_cores: f64,
    threads: usize,
    hash_harvest_ms_all_cores: f64,
}

#[derive(Serialize)]
struct Report {
    boot_to_ready_ms: Vec<(String, u64)>,
    rows: Vec<Row>,
    harvest_vs_dirty: Vec<Bucket>,
    scan: Option<Scan>,
}

fn scan_rates(ram: &std::sync::Arc<tandem_vm::GuestRam>) -> Scan {
    let len = ram.len();
    // SAFETY: called while the guest is stopped.
    let src = unsafe { ram.as_slice() };
    let mut dst = vec![0u8; len];
    dst.copy_from_slice(src); // fault in
    let gbps = |d: Duration| len as f64 / d.as_secs_f64() / 1e9;
    let med = |f: &mut dyn FnMut() -> Duration| {
        let mut v: Vec<f64> = (0..5).map(|_| f().as_secs_f64()).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        Duration::from_secs_f64(v[2])
    };
    let memcpy = med(&mut || {
        let t = Instant::now();
        dst.copy_from_slice(src);
        std::hint::black_box(&dst);
        t.elapsed()
    });
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let mut one = HashLog::new(ram.clone(), 1);
    let mut all = HashLog::new(ram.clone(), threads);
    let mut out = Vec::new();
    let h1 = med(&mut || {
        let t = Instant::now();
        let _ = one.harvest(&mut out);
        t.elapsed()
    });
    let hn = med(&mut || {
        let t = Instant::now();
        let _ = all.harvest(&mut out);
        t.elapsed()
    });
    Scan {
        mem_mib: (len >> 20) as u64,
        memcpy_gbps_1core: gbps(memcpy),
        hash_gbps_1core: gbps(h1),
        hash_gbps_all_cores: gbps(hn),
        threads,
        hash_harvest_ms_all_cores: hn.as_secs_f64() * 1000.0,
    }
}

/// Runs the benchmark the flags select.
pub fn run(a: Args) -> anyhow::Result<()> {
    if a.backup_host {
        return host::run(&a.workloads, a.seconds, a.json);
    }
    if a.consolidate {
        return consolidate::run(&a.trace, a.clock_s, a.json);
    }
    if !a.trace.is_empty() {
        return run_trace(&a);
    }
    if a.link {
        return link::run(a.json, a.link_mib);
    }
    if let Some(n) = a.failover {
        return failover::run(n, a.json);
    }
    if let Some(n) = a.faults {
        return faults::run(n, a.seed, a.mem, a.no_etcd, a.json);
    }
    if a.replication {
        if !a.mems.is_empty() {
            bail!("--mems sizes the guests of --store; --replication runs one size: --mem MIB");
        }
        return replication::run(&a);
    }
    if a.store {
        return store::run(&a);
    }
    if !a.lab {
        bail!("choose what to measure: --lab (VM lab on real guests), --replication (end to end) or --trace FILE... (codecs over recorded traces)");
    }
    run_lab(a)
}

/// `--trace`: benchmarks the selected codecs over recorded traces.
fn run_trace(a: &Args) -> anyhow::Result<()> {
    let codecs: Vec<tandem_codec::Codec> = if a.codec == "all" {
        tandem_codec::Codec::ALL.to_vec()
    } else {
        a.codec
            .split(',')
            .map(|c| c.trim().parse().map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<_>>()?
    };
    if a.threads == 0 {
        bail!("--threads must be at least 1");
    }
    let mut cfg = tandem_codec::Config {
        threads: a.threads,
        zstd_level: a.zstd_level,
        cache_bytes: a.cache_mib << 20,
        full_mirror: a.full_mirror,
        frame_bytes: a.frame_mib.max(1) << 20,
        ..Default::default()
    };
    codec::parse_budget(&a.budget, &mut cfg)?;
    if a.coalesce == 0 {
        bail!("--coalesce must be at least 1");
    }
    let mut trials = Vec::new();
    for exact in [false, true] {
        if exact && !a.control {
            continue;
        }
        for &c in &codecs {
            trials.push(codec::Trial {
                codec: c,
                exact,
                coalesce: a.coalesce,
            });
        }
    }
    codec::run(&a.trace, &trials, &cfg, a.json)
}

/// `--lab`: boots every workload, measures it at every epoch length and prints the report.
fn run_lab(a: Args) -> anyhow::Result<()> {
    let mut a = a;
    if a.workloads.is_empty() {
        a.workloads = ["idle", "memtouch", "compile", "sqlite", "kv"]
            .map(String::from)
            .to_vec();
    }
    if a.epochs_ms.is_empty() {
        a.epochs_ms = vec![25, 100, 500];
    }
    if a.devstate.is_empty() {
        a.devstate = vec!["migrate".into(), "xen-save".into()];
    }
    if let Some(d) = a
        .devstate
        .iter()
        .find(|d| !["migrate", "xen-save"].contains(&d.as_str()))
    {
        bail!("--devstate {d}: choose migrate and/or xen-save");
    }
    if a.virtio.is_empty() {
        a.virtio = vec!["legacy".into()];
    }
    if let Some(v) = a
        .virtio
        .iter()
        .find(|v| !["legacy", "modern"].contains(&v.as_str()))
    {
        bail!("--virtio {v}: choose legacy and/or modern");
    }
    let mut lab = Lab {
        report: Report {
            boot_to_ready_ms: Vec::new(),
            rows: Vec::new(),
            harvest_vs_dirty: Vec::new(),
            scan: None,
        },
        harvest: Vec::new(),
    };
    for w in &a.workloads {
        for v in &a.virtio {
            lab.workload(w, v, &a)?;
        }
    }
    lab.bucket_harvests();
    let report = lab.report;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    report.print();
    Ok(())
}

/// The `--lab` report as it fills, with every checkpoint's (dirty pages, harvest ms).
struct Lab {
    report: Report,
    harvest: Vec<(u64, f64)>,
}

impl Lab {
    /// Boots workload `w`, measures it at every epoch length of `a` and shuts it down.
    fn workload(&mut self, w: &String, virtio: &str, a: &Args) -> anyhow::Result<()> {
        let mut cfg = crate::lab_config("bench", w, a.mem)?;
        cfg.legacy_virtio = virtio == "legacy";
        eprintln!("bench: booting {w} ({virtio} virtio)...");
        let (mut vm, ready, load) = boot(&cfg)?;
        self.report
            .boot_to_ready_ms
            .push((format!("{w} ({virtio})"), ready.as_millis() as u64));
        if self.report.scan.is_none() {
            vm.stop()?;
            self.report.scan = Some(scan_rates(vm.ram()));
            vm.cont()?;
        }
        // Let the workload warm up before measuring.
        std::thread::sleep(Duration::from_secs(2));
        for &ms in &a.epochs_ms {
            for d in &a.devstate {
                vm.set_fast_devstate(d == "xen-save");
                self.series(&mut vm, w, ms, (d, virtio), a.seconds)?;
            }
        }
        if let Some(l) = load {
            l.stop().map_err(anyhow::Error::msg)?;
        }
        vm.quit();
        Ok(())
    }

    /// Runs `seconds` of `ms` epochs on the booted guest and adds their row.
    fn series(
        &mut self,
        vm: &mut Vm,
        w: &String,
        ms: u64,
        (devstate, virtio): (&str, &str),
        seconds: u64,
    ) -> anyhow::Result<()> {
        let (mut dirty, mut pause, mut comps) = (Vec::new(), Vec::new(), vec![Vec::new(); 5]);
        let mut first = true;
        let harvest = &mut self.harvest;
        run_epochs(
            vm,
            &mut Fixed(Duration::from_millis(ms)),
            Duration::from_secs(seconds),
            |cp| {
                // The first checkpoint of a series covers the previous series' tail: skip it.
                if std::mem::take(&mut first) {
                    return true;
                }
                let t = cp.timing;
                dirty.push(cp.pfns.len() as f64);
                pause.push(t.total_us() as f64 / 1000.0);
                for (v, x) in comps.iter_mut().zip(t.components_us()) {
                    v.push(x as f64 / 1000.0);
                }
                harvest.push((cp.pfns.len() as u64, t.harvest_us as f64 / 1000.0));
                true
            },
        )?;
        if let (_, Some(why)) = vm.devstate_method() {
            if devstate == "xen-save" {
                bail!("xen-save-devices-state unusable on this QEMU: {why}");
            }
        }
        eprintln!(
            "bench: {w} @ {ms} ms, {devstate}: {} epochs, dirty mean {:.0}, pause p50 {:.2} ms",
            dirty.len(),
            mean(&dirty),
            quantile(&pause, 0.5)
        );
        self.report.rows.push(Row {
            workload: w.clone(),
            epoch_ms: ms,
            devstate: devstate.into(),
            virtio: virtio.into(),
            epochs: dirty.len(),
            dirty_mean: mean(&dirty),
            dirty_p50: quantile(&dirty, 0.5),
            dirty_p99: quantile(&dirty, 0.99),
            pause_p50_ms: quantile(&pause, 0.5),
            pause_p99_ms: quantile(&pause, 0.99),
            components_p50_ms: [0, 1, 2, 3, 4].map(|i| quantile(&comps[i], 0.5)),
        });
        Ok(())
    }

    /// Groups the harvest times by dirty-page count into the report's buckets.
    fn bucket_harvests(&mut self) {
        for (lo, hi) in [
            (0u64, 100u64),
            (100, 1000),
            (1000, 10_000),
            (10_000, u64::MAX),
        ] {
            let v: Vec<f64> = self
                .harvest
                .iter()
                .filter(|(d, _)| *d >= lo && *d < hi)
                .map(|(_, t)| *t)
                .collect();
            if !v.is_empty() {
                let label = if hi == u64::MAX {
                    format!(">={lo}")
                } else {
                    format!("{lo}-{}", hi - 1)
                };
                self.report.harvest_vs_dirty.push(Bucket {
                    dirty_pages: label,
                    samples: v.len(),
                    harvest_p50_ms: quantile(&v, 0.5),
                    harvest_p99_ms: quantile(&v, 0.99),
                });
            }
        }
    }
}

impl Report {
    /// Prints the report as the human-readable tables.
    fn print(&self) {
        let report = self;
        println!(
            "boot to ready (TCG): {}",
            report
                .boot_to_ready_ms
                .iter()
                .map(|(w, ms)| format!("{w} {:.2} s", *ms as f64 / 1000.0))
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!("| workload | epoch ms | device state | virtio | epochs | dirty pages mean / p50 / p99 | pause p50 / p99 ms | stop | harvest | copy | devstate | cont (p50 ms) |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
        for r in &report.rows {
            let c = r.components_p50_ms;
            println!("| {} | {} | {} | {} | {} | {:.0} / {:.0} / {:.0} | {:.2} / {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |", r.workload, r.epoch_ms, r.devstate, r.virtio, r.epochs, r.dirty_mean, r.dirty_p50, r.dirty_p99, r.pause_p50_ms, r.pause_p99_ms, c[0], c[1], c[2], c[3], c[4]);
        }
        println!(
            "\n| dirty pages | samples | harvest p50 ms | harvest p99 ms |\n|---|---|---|---|"
        );
        for b in &report.harvest_vs_dirty {
            println!(
                "| {} | {} | {:.3} | {:.3} |",
                b.dirty_pages, b.samples, b.harvest_p50_ms, b.harvest_p99_ms
            );
        }
        if let Some(s) = &report.scan {
            println!("\nhash fallback over {} MiB: xxh3 {:.2} GB/s on 1 core, {:.2} GB/s on {} threads ({:.1} ms per harvest); memcpy {:.2} GB/s on 1 core (same run)", s.mem_mib, s.hash_gbps_1core, s.hash_gbps_all_cores, s.threads, s.hash_harvest_ms_all_cores, s.memcpy_gbps_1core);
        }
    }
}
