//! What the kernel's KSM merges of some memories, for comparison with tandem's consolidation.
//! KSM only scans anonymous private memory marked `MADV_MERGEABLE`, so it is measured on
//! anonymous copies: its best case; a backup's file-backed mirrors are out of its reach.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;

const KSM: &str = "/sys/kernel/mm/ksm";

/// KSM's result.
#[derive(Serialize)]
pub struct Ksm {
    /// Memory of the copies after merging, MiB.
    pub resident_mib: f64,
    /// Pages that map a shared KSM page instead of their own.
    pub pages_sharing: u64,
    /// Zero pages merged into the kernel's zero page.
    pub zero_pages: u64,
    /// Full scans KSM made while measuring.
    pub full_scans: u64,
    /// How long it took.
    pub seconds: f64,
}

fn read(name: &str) -> anyhow::Result<u64> {
    let p = Path::new(KSM).join(name);
    let s = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    s.trim()
        .parse()
        .with_context(|| format!("{}: not a number", p.display()))
}

fn write(name: &str, v: u64) -> anyhow::Result<()> {
    let p = Path::new(KSM).join(name);
    std::fs::write(&p, v.to_string())
        .with_context(|| format!("writing {} (needs root)", p.display()))
}

/// Marks `maps` mergeable, runs KSM until two more full scans found nothing new, and reports
/// what it saved. Restores KSM's settings afterwards.
pub fn measure(maps: Vec<&mut memmap2::MmapMut>) -> anyhow::Result<Ksm> {
    if !Path::new(KSM).exists() {
        bail!("this kernel has no KSM ({KSM})");
    }
    let saved: Vec<(&str, u64)> = ["run", "pages_to_scan", "sleep_millisecs", "use_zero_pages"]
        .iter()
        .map(|n| Ok((*n, read(n)?)))
        .collect::<anyhow::Result<_>>()?;
    let total: usize = maps.iter().map(|m| m.len()).sum();
    let r = run(&maps, total);
    for m in &maps {
        let _ = m.advise(memmap2::Advice::Unmergeable);
    }
    for (n, v) in saved {
        let _ = write(n, v);
    }
    r
}

fn run(maps: &[&mut memmap2::MmapMut], total: usize) -> anyhow::Result<Ksm> {
    if read("run")? != 0 {
        bail!("KSM is already running on this host: its counters would mix other processes in");
    }
    write("use_zero_pages", 1)?;
    write("pages_to_scan", 20_000)?;
    write("sleep_millisecs", 1)?;
    for m in maps {
        m.advise(memmap2::Advice::Mergeable)
            .context("madvise(MADV_MERGEABLE)")?;
    }
    let t = Instant::now();
    let scans0 = read("full_scans")?;
    write("run", 1)?;
    let mut last = (u64::MAX, u64::MAX);
    let mut stable_at = read("full_scans")?;
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = (read("pages_sharing")?, read("ksm_zero_pages").unwrap_or(0));
        let scans = read("full_scans")?;
        if now != last {
            last = now;
            stable_at = scans;
        } else if scans >= stable_at + 2 && scans >= scans0 + 3 {
            break;
        }
        if t.elapsed() > Duration::from_secs(300) {
            bail!("KSM did not settle within 300 s");
        }
    }
    let full_scans = read("full_scans")? - scans0;
    write("run", 2)?; // unmerge everything, stop
    let saved_pages = last.0 + last.1;
    Ok(Ksm {
        resident_mib: (total as f64 - (saved_pages as usize * tandem_consolidate::PAGE) as f64)
            / (1 << 20) as f64,
        pages_sharing: last.0,
        zero_pages: last.1,
        full_scans,
        seconds: t.elapsed().as_secs_f64(),
    })
}
