//! `tandem watch`: boots a guest (redis driven by a host client by default), checkpoints it
//! every epoch without replicating and shows live dirty-memory statistics, then a summary.

use std::io::Write;
use std::time::{Duration, Instant};

use serde::Serialize;
use tandem_vm::epoch::{run_epochs, Fixed};
use tandem_vm::PAGE_SIZE;

use crate::vmargs::{boot, VmArgs};
use tandem_protect::stats::{mean, quantile};

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

#[derive(Serialize)]
struct Summary {
    workload: String,
    mem_mib: u64,
    dirty_log: String,
    boot_to_ready_ms: u64,
    epochs: u64,
    dirty_pages_per_epoch_mean: f64,
    dirty_pages_per_epoch_p99: f64,
    dirty_mib_per_s: f64,
    pause_ms_p50: f64,
    pause_ms_p99: f64,
    pause_ms_median_components: [f64; 5],
    device_state_kib: f64,
    client_ops_per_s: Option<f64>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let cfg = a.vm.config("watch")?;
    eprintln!(
        "tandem watch: booting a {} MiB Linux guest under QEMU ({}) running `{}`...",
        cfg.mem_mib, cfg.accel, cfg.workload
    );
    let (mut vm, ready, load) = boot(&cfg)?;
    let log = vm.dirty_log_name().unwrap_or("none").to_string();
    eprintln!(
        "guest ready after {:.1} s; dirty log: {log}; checkpoint every {} ms for {} s",
        ready.as_secs_f64(),
        a.epoch_ms,
        a.duration
    );
    // Start from a clean dirty log: the first epoch should not carry every page the boot wrote.
    vm.reset_dirty_log()?;
    let (mut dirty, mut pause, mut comps, mut dev) =
        (Vec::new(), Vec::new(), vec![Vec::new(); 5], 0usize);
    let start = Instant::now();
    let mut last_print = Instant::now();
    let mut last_ops = 0u64;
    let epochs = run_epochs(
        &mut vm,
        &mut Fixed(Duration::from_millis(a.epoch_ms)),
        Duration::from_secs(a.duration),
        |cp| {
            dirty.push(cp.pfns.len() as f64);
            pause.push(cp.timing.total_us() as f64 / 1000.0);
            let t = cp.timing;
            for (v, x) in
                comps
                    .iter_mut()
                    .zip([t.stop_us, t.harvest_us, t.copy_us, t.devstate_us, t.cont_us])
            {
                v.push(x as f64 / 1000.0);
            }
            dev = cp.device_state.len();
            if last_print.elapsed() >= Duration::from_secs(1) {
                let o = load.as_ref().map_or(0, |l| l.ops());
                let rate = (o - last_ops) as f64 / last_print.elapsed().as_secs_f64();
                last_ops = o;
                last_print = Instant::now();
                let recent = &dirty[dirty.len().saturating_sub(10)..];
                eprint!(
                "\r[{:>4.0}s] epoch {:>4}  dirty {:>6.0} pages/epoch ({:>5.1} MiB/s)  pause p50 {:>5.1} ms p99 {:>5.1} ms{}   ",
                start.elapsed().as_secs_f64(),
                cp.epoch,
                mean(recent),
                mean(recent) * PAGE_SIZE as f64 * 1000.0 / a.epoch_ms as f64 / (1 << 20) as f64,
                quantile(&pause, 0.5),
                quantile(&pause, 0.99),
                if load.is_some() { format!("  client {rate:>6.0} ops/s") } else { String::new() }
            );
                let _ = std::io::stderr().flush();
            }
            true
        },
    )?;
    eprintln!();
    let elapsed = start.elapsed().as_secs_f64();
    let total_ops = match load {
        Some(l) => Some(l.stop().map_err(anyhow::Error::msg)?),
        None => None,
    };
    let s = Summary {
        workload: cfg.workload.clone(),
        mem_mib: cfg.mem_mib,
        dirty_log: log,
        boot_to_ready_ms: ready.as_millis() as u64,
        epochs,
        dirty_pages_per_epoch_mean: mean(&dirty),
        dirty_pages_per_epoch_p99: quantile(&dirty, 0.99),
        dirty_mib_per_s: dirty.iter().sum::<f64>() * PAGE_SIZE as f64 / elapsed / (1 << 20) as f64,
        pause_ms_p50: quantile(&pause, 0.5),
        pause_ms_p99: quantile(&pause, 0.99),
        pause_ms_median_components: [0, 1, 2, 3, 4].map(|i| quantile(&comps[i], 0.5)),
        device_state_kib: dev as f64 / 1024.0,
        client_ops_per_s: total_ops.map(|o| o as f64 / elapsed),
    };
    vm.quit();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        let c = s.pause_ms_median_components;
        println!(
            "summary: {} epochs of {} ms on a {} MiB `{}` guest (dirty log {})",
            s.epochs, a.epoch_ms, s.mem_mib, s.workload, s.dirty_log
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
        if let Some(o) = s.client_ops_per_s {
            println!("  kv client          {o:.0} ops/s against redis in the guest, checkpointed throughout");
        }
    }
    Ok(())
}
