//! `tandem bench --store`: per guest size and workload, a real `tandem checkpoint save` run
//! (one base, then a chain of deltas), restores from the deepest and from the base, and in
//! the same run the baselines: QEMU's own full save of the same VM (migrate to a file) and
//! page-granular incremental saving (every dirty page raw plus device state, the
//! Firecracker-diff / Remus unit), computed from the same checkpoints' dirty-page counts.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;

use super::Args;
use crate::boot;

#[derive(Serialize)]
struct Row {
    mem_mib: u64,
    workload: String,
    checkpoints: u64,
    pause_ms_p50: f64,
    pause_ms_p99: f64,
    checkpoint_ms_p50: f64,
    first_pause_ms: f64,
    delta_bytes_mean: f64,
    page_granular_bytes_mean: f64,
    base_bytes: u64,
    qemu_full_save_bytes: u64,
    qemu_full_save_ms: f64,
    delta_over_full_save: f64,
    delta_over_page_granular: f64,
    restore_deep_ms: f64,
    restore_deep_chain: u64,
    restore_deep_rebuild_ms: f64,
    restore_base_ms: f64,
}

fn json(args: &[String]) -> anyhow::Result<serde_json::Value> {
    let exe = crate::product_exe()?;
    let out = Command::new(exe)
        .args(args)
        .output()
        .context("running tandem")?;
    if !out.status.success() {
        bail!(
            "tandem {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn f(v: &serde_json::Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(f64::NAN)
}

fn qemu_full_save(w: &str, mem: u64, dir: &Path) -> anyhow::Result<(u64, f64)> {
    let cfg = crate::lab_config("fullsave", w, mem)?;
    let (mut vm, _, load) = boot(&cfg)?;
    std::thread::sleep(Duration::from_secs(3));
    let t = Instant::now();
    vm.stop()?;
    let bytes = vm.full_save(&dir.join("qemu-full.save"))?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    vm.cont()?;
    if let Some(l) = load {
        l.stop().map_err(anyhow::Error::msg)?;
    }
    vm.quit();
    Ok((bytes, ms))
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let workloads = if a.workloads.is_empty() {
        ["kv", "sqlite", "compile"].map(String::from).to_vec()
    } else {
        a.workloads.clone()
    };
    if a.count < 2 {
        bail!("--count must be at least 2 (a base and a delta)");
    }
    let pb = indicatif::ProgressBar::new_spinner();
    pb.enable_steady_tick(Duration::from_millis(200));
    let mut rows = Vec::new();
    let mems = if a.mems.is_empty() {
        vec![256, 1024]
    } else {
        a.mems.clone()
    };
    for &mem in &mems {
        for w in &workloads {
            // On disk (not tmpfs): the fsyncs are part of what is measured.
            let tmp = tempfile::Builder::new()
                .prefix("tandem-storebench-")
                .tempdir_in("/var/tmp")?;
            let store = tmp.path().join("store");
            let desc = crate::lab_description(tmp.path(), w, 0)?;
            let s = |x: &dyn ToString| x.to_string();
            pb.set_message(format!("{mem} MiB {w}: saving {} checkpoints", a.count));
            let save = json(&[
                s(&"checkpoint"),
                s(&"save"),
                s(&"--dir"),
                store.display().to_string(),
                s(&"--vm-config"),
                desc.display().to_string(),
                s(&"--mem"),
                s(&mem),
                s(&"--interval"),
                s(&a.interval),
                s(&"--count"),
                s(&a.count),
                s(&"--base-every"),
                s(&1_000_000),
                s(&"--json"),
            ])?;
            let restore = |id: u64| {
                json(&[
                    s(&"checkpoint"),
                    s(&"restore"),
                    store.display().to_string(),
                    s(&"--id"),
                    s(&id),
                    s(&"--vm-config"),
                    desc.display().to_string(),
                    s(&"--mem"),
                    s(&mem),
                    s(&"--run-seconds"),
                    s(&0),
                    s(&"--json"),
                ])
            };
            pb.set_message(format!("{mem} MiB {w}: restoring"));
            let deep = restore(a.count)?;
            let base = restore(1)?;
            pb.set_message(format!("{mem} MiB {w}: QEMU full save of the same VM"));
            let (full, full_ms) = qemu_full_save(w, mem, tmp.path())?;
            let delta = f(&save, "delta_bytes_mean");
            let page = f(&save, "dirty_pages_mean") * 4096.0 + f(&save, "device_state_bytes");
            let r = Row {
                mem_mib: mem,
                workload: w.clone(),
                checkpoints: save["checkpoints"].as_u64().unwrap_or(0),
                pause_ms_p50: f(&save, "pause_ms_p50"),
                pause_ms_p99: f(&save, "pause_ms_p99"),
                checkpoint_ms_p50: f(&save, "checkpoint_ms_p50"),
                first_pause_ms: f(&save, "first_pause_ms"),
                delta_bytes_mean: delta,
                page_granular_bytes_mean: page,
                base_bytes: save["base_bytes"].as_u64().unwrap_or(0),
                qemu_full_save_bytes: full,
                qemu_full_save_ms: full_ms,
                delta_over_full_save: delta / full as f64,
                delta_over_page_granular: delta / page,
                restore_deep_ms: f(&deep, "total_ms"),
                restore_deep_chain: deep["chain_records"].as_u64().unwrap_or(0),
                restore_deep_rebuild_ms: f(&deep, "rebuild_ms"),
                restore_base_ms: f(&base, "total_ms"),
            };
            crate::demo::say(&pb, line(&r));
            rows.push(r);
        }
    }
    pb.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        for r in &rows {
            println!("{}", line(r));
        }
    }
    Ok(())
}

fn line(r: &Row) -> String {
    format!(
        "{:>5} MiB {:<8} | pause p50 {:.1} p99 {:.1} ms, checkpoint p50 {:.1} ms | delta {:.0} KiB = {:.4}x QEMU full save ({:.1} MiB, {:.0} ms), {:.3}x page-granular ({:.0} KiB) | restore {:.0} ms through {} records ({:.0} ms rebuild), {:.0} ms from the base",
        r.mem_mib,
        r.workload,
        r.pause_ms_p50,
        r.pause_ms_p99,
        r.checkpoint_ms_p50,
        r.delta_bytes_mean / 1024.0,
        r.delta_over_full_save,
        r.qemu_full_save_bytes as f64 / (1 << 20) as f64,
        r.qemu_full_save_ms,
        r.delta_over_page_granular,
        r.page_granular_bytes_mean / 1024.0,
        r.restore_deep_ms,
        r.restore_deep_chain,
        r.restore_deep_rebuild_ms,
        r.restore_base_ms
    )
}
