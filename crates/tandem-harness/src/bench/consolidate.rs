//! `tandem bench --consolidate --trace A B C D`: several replicas on one backup, each fed its
//! trace's epochs through the real codec (tandem, as the primary sends them) into a mirror
//! file in /dev/shm whose cold pages the NRU clock consolidates into one shared pool
//! (tandem-consolidate). Reports the memory each replica costs, split by kind, against plain
//! mirrors and against what KSM merges of the same memories in anonymous memory; the apply
//! rate with restores; and how long materialising each replica for a failover takes.

use std::io::BufReader;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use tandem_codec::{Codec, Encoder, Plan};
use tandem_consolidate::{Pool, Replica, Usage, PAGE};
use tandem_trace::{TraceFrame, TraceReader};

const MIB: f64 = (1 << 20) as f64;

struct Vm {
    name: String,
    reader: TraceReader<BufReader<std::fs::File>>,
    epoch_ms: u64,
    /// The primary's memory (anonymous, so KSM can be shown on it at the end).
    truth: memmap2::MmapMut,
    file: std::fs::File,
    mirror: memmap2::MmapMut,
    enc: Option<Encoder>,
    replica: Replica,
    plan: Plan,
    /// A plain mirror fed the same records: the apply time without consolidation.
    plain: memmap2::MmapMut,
    plain_apply: Duration,
    /// Pages the epochs wrote.
    written: u64,
    /// Pages a *sparse* plain mirror would hold (tandem preallocates its plain mirrors; a
    /// sparse one would hold the non-zero pages of the initial copy and every page an epoch
    /// wrote): the stricter baseline.
    allocated: Vec<bool>,
    rec: Vec<u8>,
    epochs: u64,
    record_bytes: u64,
    restored: u64,
    apply: Duration,
    scan: Duration,
    done: bool,
}

/// One replica's row.
#[derive(Serialize)]
struct Row {
    trace: String,
    epochs: u64,
    usage: Usage,
    resident_mib: f64,
    /// Bytes of the mirror file actually allocated (tmpfs blocks), MiB.
    file_mib: f64,
    nonzero_mib: f64,
    /// What a sparse plain mirror would hold (see `Vm::allocated`), MiB.
    sparse_mib: f64,
    /// Bookkeeping of the replica's page map and patch table, MiB.
    meta_mib: f64,
    /// Pages restored from the pool because an epoch read or wrote them.
    restored: u64,
    apply_ms_per_epoch: f64,
    /// Guest pages applied per second of apply time, as MB/s of page data.
    apply_mb_s: f64,
    /// The same on a plain mirror.
    plain_apply_ms_per_epoch: f64,
    scan_ms_per_epoch: f64,
    materialise_ms: f64,
}

#[derive(Serialize)]
struct Report {
    replicas: Vec<Row>,
    plain_mib: f64,
    nonzero_mib: f64,
    /// Sparse plain mirrors (the stricter baseline).
    sparse_mib: f64,
    /// Replicas' memory plus all bookkeeping (pool and page maps).
    consolidated_mib: f64,
    pool_mib: f64,
    meta_mib: f64,
    ratio_to_plain: f64,
    ksm: Result<Ksm, String>,
    clock_s: f64,
}

fn open(path: &Path) -> anyhow::Result<Vm> {
    let f =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let reader = TraceReader::new(BufReader::with_capacity(1 << 20, f))
        .with_context(|| format!("reading trace {}", path.display()))?;
    let h = reader.header().clone();
    if h.page_size as usize != PAGE {
        bail!(
            "{}: page size {} (tandem uses {PAGE})",
            path.display(),
            h.page_size
        );
    }
    let len = h.mem_bytes as usize;
    let file = tempfile::tempfile_in("/dev/shm").context("creating a mirror file in /dev/shm")?;
    file.set_len(len as u64)?;
    // SAFETY: the file is this function's own unlinked temporary file; nothing else maps or
    // resizes it.
    let mirror = unsafe { memmap2::MmapMut::map_mut(&file) }?;
    Ok(Vm {
        name: path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        reader,
        epoch_ms: h.epoch_ms.max(1) as u64,
        truth: memmap2::MmapMut::map_anon(len)?,
        file,
        mirror,
        enc: None,
        replica: Replica::new((len / PAGE) as u64),
        plan: Plan::default(),
        plain: memmap2::MmapMut::map_anon(len)?,
        plain_apply: Duration::ZERO,
        written: 0,
        allocated: vec![false; len / PAGE],
        rec: Vec::new(),
        epochs: 0,
        record_bytes: 0,
        restored: 0,
        apply: Duration::ZERO,
        scan: Duration::ZERO,
        done: false,
    })
}

/// Feeds `vm` up to and including its next epoch.
fn step(vm: &mut Vm, pool: &mut Pool, clock: Duration) -> anyhow::Result<()> {
    let pages = vm.replica.pages();
    loop {
        let Some(frame) = vm.reader.next_frame()? else {
            vm.done = true;
            return Ok(());
        };
        match frame {
            TraceFrame::Base { first_pfn, data } => {
                for (i, p) in data.chunks(PAGE).enumerate() {
                    if p.iter().any(|&b| b != 0) {
                        vm.allocated[first_pfn as usize + i] = true;
                    }
                }
                let o = first_pfn as usize * PAGE;
                vm.truth[o..o + data.len()].copy_from_slice(&data);
                vm.mirror[o..o + data.len()].copy_from_slice(&data); // the initial copy
                vm.plain[o..o + data.len()].copy_from_slice(&data);
            }
            TraceFrame::Epoch(e) => {
                let cfg = tandem_codec::Config::default();
                let enc = match &mut vm.enc {
                    Some(e) => e,
                    None => vm.enc.insert(Encoder::new(Codec::Tandem, &vm.truth, cfg)?),
                };
                vm.rec.clear();
                enc.encode(e.epoch, &e.pfns, &e.data, &mut vm.rec)?;
                for (i, &p) in e.pfns.iter().enumerate() {
                    let o = p as usize * PAGE;
                    vm.truth[o..o + PAGE].copy_from_slice(&e.data[i * PAGE..(i + 1) * PAGE]);
                }
                // The backup: restore what the record reads, decode, commit; and the same
                // record on a plain mirror, for the overhead (in alternating order, so that
                // neither always finds the record warm in the cache).
                let plain_first = vm.epochs % 2 == 1;
                if plain_first {
                    apply_plain(vm)?;
                }
                let t = Instant::now();
                let reads = tandem_codec::pages_read(&vm.rec, pages)?;
                vm.restored += match reads {
                    Some(r) => vm.replica.restore(pool, &mut vm.mirror, &r)?,
                    None => vm.replica.restore_all(pool, &mut vm.mirror)?,
                };
                tandem_codec::decode(&vm.rec, &vm.mirror, &mut vm.plan)?;
                vm.plan.commit(&mut vm.mirror);
                vm.replica.written(&vm.plan.pfns);
                vm.apply += t.elapsed();
                vm.written += vm.plan.pfns.len() as u64;
                for &p in &vm.plan.pfns {
                    vm.allocated[p as usize] = true;
                }
                if !plain_first {
                    apply_plain(vm)?;
                }
                // The clock: one revolution per `clock` of guest time.
                let t = Instant::now();
                let budget = (pages * vm.epoch_ms).div_ceil(clock.as_millis().max(1) as u64);
                vm.replica.scan(pool, &mut vm.mirror, budget);
                vm.scan += t.elapsed();
                vm.epochs += 1;
                vm.record_bytes += vm.rec.len() as u64;
                return Ok(());
            }
            TraceFrame::End { .. } => {}
        }
    }
}

fn apply_plain(vm: &mut Vm) -> anyhow::Result<()> {
    let t = Instant::now();
    tandem_codec::decode(&vm.rec, &vm.plain, &mut vm.plan)?;
    vm.plan.commit(&mut vm.plain);
    vm.plain_apply += t.elapsed();
    Ok(())
}

/// Runs the benchmark.
pub fn run(traces: &[PathBuf], clock_s: f64, json: bool) -> anyhow::Result<()> {
    if traces.is_empty() {
        bail!("--consolidate needs --trace FILE... (one replica per trace)");
    }
    if clock_s.is_nan() || clock_s <= 0.0 {
        bail!("--clock-s must be positive");
    }
    let clock = Duration::from_secs_f64(clock_s);
    let mut vms = traces
        .iter()
        .map(|p| open(p))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut pool = Pool::new();
    let pb = indicatif::ProgressBar::new_spinner();
    pb.set_message("replaying the replicas' epochs, round robin");
    while vms.iter().any(|v| !v.done) {
        for vm in vms.iter_mut().filter(|v| !v.done) {
            step(vm, &mut pool, clock).with_context(|| format!("replica {}", vm.name))?;
        }
        pb.tick();
    }
    pb.finish_and_clear();
    let mut rows = Vec::new();
    let (mut plain, mut nonzero) = (0.0, 0.0);
    for vm in &vms {
        let usage = vm.replica.usage(&pool);
        let nz = vm
            .truth
            .chunks(PAGE)
            .filter(|p| p.iter().any(|&b| b != 0))
            .count();
        plain += vm.truth.len() as f64 / MIB;
        nonzero += (nz * PAGE) as f64 / MIB;
        rows.push(Row {
            trace: vm.name.clone(),
            epochs: vm.epochs,
            usage,
            resident_mib: usage.resident() / MIB,
            file_mib: (vm.file.metadata()?.blocks() * 512) as f64 / MIB,
            nonzero_mib: (nz * PAGE) as f64 / MIB,
            sparse_mib: (vm.allocated.iter().filter(|&&a| a).count() * PAGE) as f64 / MIB,
            meta_mib: vm.replica.meta_bytes() as f64 / MIB,
            restored: vm.restored,
            apply_ms_per_epoch: ms(vm.apply) / vm.epochs.max(1) as f64,
            apply_mb_s: (vm.written * PAGE as u64) as f64 / 1e6 / vm.apply.as_secs_f64().max(1e-9),
            plain_apply_ms_per_epoch: ms(vm.plain_apply) / vm.epochs.max(1) as f64,
            scan_ms_per_epoch: ms(vm.scan) / vm.epochs.max(1) as f64,
            materialise_ms: 0.0,
        });
    }
    let pool_mib = pool.bytes() as f64 / MIB;
    let meta_mib = pool.meta_bytes() as f64 / MIB + rows.iter().map(|r| r.meta_mib).sum::<f64>();
    let consolidated: f64 = rows.iter().map(|r| r.resident_mib).sum::<f64>() + meta_mib;
    // Failover by materialisation: every consolidated page back into the mirror file.
    for (vm, row) in vms.iter_mut().zip(&mut rows) {
        let t = Instant::now();
        vm.replica.restore_all(&mut pool, &mut vm.mirror)?;
        row.materialise_ms = ms(t.elapsed());
        if vm.mirror[..] != vm.truth[..] || vm.plain[..] != vm.truth[..] {
            bail!(
                "replica {}: the materialised mirror differs from the guest's memory",
                vm.name
            );
        }
    }
    let truths: Vec<&mut memmap2::MmapMut> = vms.iter_mut().map(|v| &mut v.truth).collect();
    let ksm = crate::bench::ksm::measure(truths).map_err(|e| format!("{e:#}"));
    let sparse: f64 = rows.iter().map(|r| r.sparse_mib).sum();
    let report = Report {
        sparse_mib: sparse,
        plain_mib: plain,
        nonzero_mib: nonzero,
        consolidated_mib: consolidated,
        pool_mib,
        meta_mib,
        ratio_to_plain: consolidated / plain,
        ksm,
        clock_s,
        replicas: rows,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print(&report);
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn print(r: &Report) {
    println!("replica                        epochs  shared patched compr.  zero  plain   MiB  (file) apply ms/ep (plain)  MB/s  scan ms/ep  restored  materialise ms");
    for x in &r.replicas {
        let u = &x.usage;
        println!(
            "{:<30} {:>6} {:>7} {:>7} {:>6} {:>5} {:>6} {:>6.1} {:>6.1} {:>11.2} {:>7.2} {:>5.0} {:>11.2} {:>9} {:>15.1}",
            x.trace,
            x.epochs,
            u.shared,
            u.patched,
            u.compressed,
            u.zero,
            u.plain + u.pooled_raw,
            x.resident_mib,
            x.file_mib,
            x.apply_ms_per_epoch,
            x.plain_apply_ms_per_epoch,
            x.apply_mb_s,
            x.scan_ms_per_epoch,
            x.restored,
            x.materialise_ms
        );
    }
    println!(
        "plain mirrors {:.1} MiB (preallocated, as tandem's backup keeps them); sparse plain mirrors would hold {:.1} MiB (non-zero now: {:.1} MiB); consolidated {:.1} MiB = {:.3}x plain, {:.3}x sparse (pool data {:.1} MiB, bookkeeping {:.1} MiB included); clock revolution {} s of guest time",
        r.plain_mib, r.sparse_mib, r.nonzero_mib, r.consolidated_mib, r.ratio_to_plain, r.consolidated_mib / r.sparse_mib, r.pool_mib, r.meta_mib, r.clock_s
    );
    match &r.ksm {
        Ok(k) => println!(
            "KSM on the same memories in anonymous memory (what it reaches; it cannot merge file-backed mirrors): {:.1} MiB = {:.3}x plain ({} pages sharing, {} zero pages merged, {} full scans, {:.1} s)",
            k.resident_mib, k.resident_mib / r.plain_mib, k.pages_sharing, k.zero_pages, k.full_scans, k.seconds
        ),
        Err(e) => println!("KSM: not measured ({e})"),
    }
}

pub use crate::bench::ksm::Ksm;
