//! `tandem watch`: boots a guest, checkpoints it
//! every epoch without replicating and shows live dirty-memory statistics, then a summary.

use std::io::Write;
use std::time::Duration;

use tandem_protect::watcher::{watch, WatchConfig};

use tandem_args::VmArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub vm: VmArgs,
    /// Seconds of live statistics.
    #[arg(long, default_value_t = 20)]
    pub duration: u64,
    /// Epoch length in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub epoch_ms: u64,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let cfg = WatchConfig {
        vm: a.vm.spec(),
        epoch: Duration::from_millis(a.epoch_ms.max(1)),
        duration: Duration::from_secs(a.duration),
    };
    eprintln!(
        "tandem watch: booting the VM of {} under QEMU ({})...",
        a.vm.vm_config
            .as_deref()
            .map_or_else(|| "(none)".into(), |p| p.display().to_string()),
        a.vm.accel
    );
    let s = watch(&cfg, &crate::daemons::stderr(""), &mut |l| {
        eprint!(
            "\r[{:>4.0}s] epoch {:>4}  dirty {:>6.0} pages/epoch ({:>5.1} MiB/s)  pause p50 {:>5.1} ms p99 {:>5.1} ms   ",
            l.elapsed.as_secs_f64(),
            l.epoch,
            l.dirty_pages_recent,
            l.dirty_mib_per_s,
            l.pause_ms_p50,
            l.pause_ms_p99,
        );
        let _ = std::io::stderr().flush();
    })?;
    eprintln!();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        let c = s.pause_ms_median_components;
        println!(
            "summary: {} epochs of {} ms on a {} MiB, {}-vCPU guest `{}` (dirty log {})",
            s.epochs, a.epoch_ms, s.mem_mib, s.vcpus, s.workload, s.dirty_log
        );
        println!(
            "  boot to ready      {:.1} s",
            s.boot_to_ready_ms as f64 / 1000.0
        );
        println!(
            "  dirty pages/epoch  mean {:.0}, p99 {:.0} ({:.1} MiB/s of guest writes)",
            s.dirty_pages_per_epoch_mean, s.dirty_pages_per_epoch_p99, s.dirty_mib_per_s
        );
        println!(
            "  pause              p50 {:.2} ms, p99 {:.2} ms",
            s.pause_ms_p50, s.pause_ms_p99
        );
        println!("  pause medians (ms) stop {:.2} | harvest {:.2} | copy {:.2} | device state {:.2} | cont {:.2}", c[0], c[1], c[2], c[3], c[4]);
        println!(
            "  device state       {:.0} KiB per checkpoint",
            s.device_state_kib
        );
    }
    Ok(())
}
