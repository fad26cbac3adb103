//! `tandem primary`: boots the guest, sends the initial copy, then checkpoints every epoch and
//! ships it on a sender thread while the guest runs the next epoch. Guest network output is
//! released, epoch by epoch, as the backup acknowledges.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::{BufReader, BufWriter, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use tandem_codec::{Codec, Config, Encoder};
use tandem_net::Policy;
use tandem_replication::devstate::encode_delta;
use tandem_replication::wire::{epoch_payload, section, HEADER_LEN};
use tandem_replication::{base_payload, hello_payload, Frame, Kind};
use tandem_vm::epoch::{run_epochs_with, Fixed};
use tandem_vm::PAGE_SIZE;

use super::site::{Role, Site, SiteArgs};
use super::{install_stop_handler, send, stopping};
use crate::metrics::{EpochMetrics, Registry};
use crate::stats::quantile;
use crate::vmargs::{boot, VmArgs};

#[derive(clap::Args)]
pub struct PrimaryArgs {
    /// Backup address (host:port).
    #[arg(long)]
    pub backup: String,
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub site: SiteArgs,
    /// Directory for the data disk and sockets (default: a temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Epoch length in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub epoch_ms: u64,
    /// Seconds to run (the primary then stops replicating and exits).
    #[arg(long, default_value_t = 60)]
    pub duration: u64,
    /// Memory codec.
    #[arg(long, default_value = "tandem")]
    pub codec: Codec,
    /// Identifier of the protected VM (the backup refuses frames of any other).
    #[arg(long, default_value_t = 1)]
    pub vm_id: u64,
    /// Send a heartbeat when nothing else was sent for this long.
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
    /// Append one JSON line per acknowledged epoch to this file.
    #[arg(long)]
    pub metrics_jsonl: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (GET /metrics).
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Fault injection for tests: send half of this epoch's frame, then stall until killed.
    #[arg(long, hide = true)]
    pub fault_stall_epoch: Option<u64>,
}

/// Epochs handed to the link, waiting for their acknowledgement.
type Inflight = Arc<Mutex<VecDeque<(EpochMetrics, Instant)>>>;

pub fn primary(a: PrimaryArgs) -> anyhow::Result<()> {
    install_stop_handler();
    let mut cfg = a.vm.config("primary")?;
    let tmp;
    let dir = match &a.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new()
                .prefix("tandem-primary-")
                .tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    let site = Arc::new(Site::prepare(&a.site, &dir, Role::Primary, &mut cfg)?);
    let (mut vm, ready, load) = boot(&cfg)?;
    println!(
        "primary: guest ready in {:.1} s, QEMU pid {}, network {}, data disk {} MiB",
        ready.as_secs_f64(),
        vm.pid(),
        if site.relay.is_some() {
            "relay (output held until acked)"
        } else {
            "user (not held)"
        },
        a.site.disk_mib
    );
    super::echo_guest_progress(vm.serial_path(), "primary");
    let deadline = Instant::now() + Duration::from_secs(30);
    let stream = loop {
        match TcpStream::connect(&a.backup) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("backup not reachable yet: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => {
                return Err(e).with_context(|| format!("connecting to the backup at {}", a.backup))
            }
        }
    };
    stream.set_nodelay(true)?;
    let mut w = BufWriter::with_capacity(1 << 20, stream.try_clone()?);
    let bytes = cfg.mem_mib << 20;
    let vm_id = a.vm_id;
    let frame = move |kind, seq, payload| Frame {
        kind,
        vm_id,
        seq,
        payload,
    };
    send(
        &mut w,
        &frame(Kind::Hello, 0, hello_payload(bytes, site.disk_bytes())),
    )?;
    // Initial copy: dirty log reset, disk log reset, network epoch 0 sealed and RAM and disk
    // copied in one pause; sent while the guest runs.
    vm.stop()?;
    let mut scratch = Vec::new();
    vm.harvest(&mut scratch)?;
    if let Some(r) = &site.relay {
        r.seal(0);
    }
    let mut disk_base = Vec::new();
    if let Some(d) = &site.disk {
        d.take_epoch_writes();
        disk_base.resize(d.size() as usize, 0);
        d.read_at(&mut disk_base, 0)
            .context("reading the data disk")?;
    }
    // SAFETY: the guest is stopped while its memory is copied.
    let base = unsafe { vm.ram().as_slice() }.to_vec();
    vm.cont()?;
    // The backup's mirror starts zeroed: send only runs of non-zero pages.
    let mut base_sent = 0usize;
    for (first, run) in nonzero_runs(&base, 1024) {
        base_sent += run.len();
        send(&mut w, &frame(Kind::Base, 0, base_payload(first, run)))?;
    }
    println!(
        "primary: initial copy sent: {} of {} MiB non-zero",
        base_sent >> 20,
        base.len() >> 20
    );
    const CHUNK: usize = 1 << 16;
    for (i, c) in disk_base.chunks(CHUNK).enumerate() {
        if c.iter().any(|&b| b != 0) {
            send(
                &mut w,
                &frame(Kind::DiskBase, 0, base_payload((i * CHUNK) as u64, c)),
            )?;
        }
    }
    drop(disk_base);
    let mut enc = Encoder::new(a.codec, &base, Config::default())?;
    drop(base);
    let registry = Registry::default();
    if let Some(addr) = &a.metrics_listen {
        let bound = crate::metrics::serve(addr, registry.clone())
            .with_context(|| format!("metrics endpoint {addr}"))?;
        println!("primary: metrics on http://{bound}/metrics");
    }
    let mut jsonl = match &a.metrics_jsonl {
        Some(p) => {
            Some(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?)
        }
        None => None,
    };
    let acked = Arc::new(AtomicU64::new(0));
    let link_lost = Arc::new(AtomicBool::new(false));
    let inflight: Inflight = Arc::default();

    // Acknowledgements: release that epoch's network output, then record its metrics.
    let reader = {
        let (acked, link_lost, inflight, registry, site) = (
            acked.clone(),
            link_lost.clone(),
            inflight.clone(),
            registry.clone(),
            site.clone(),
        );
        let mut r = BufReader::new(stream);
        std::thread::spawn(move || -> anyhow::Result<()> {
            while let Ok(Some(f)) = Frame::read_from(&mut r) {
                if f.kind != Kind::Ack {
                    continue;
                }
                let at = Instant::now();
                let released = match &site.relay {
                    Some(relay) => {
                        relay.release(f.seq)?;
                        relay.stats().released_frames
                    }
                    None => 0,
                };
                acked.store(f.seq, Ordering::SeqCst);
                let mut q = inflight.lock().unwrap_or_else(|e| e.into_inner());
                while q.front().is_some_and(|(m, _)| m.epoch <= f.seq) {
                    let Some((mut m, sent_at)) = q.pop_front() else {
                        break;
                    };
                    let us = at.saturating_duration_since(sent_at).as_micros() as u64;
                    m.ack_latency_us = Some(us);
                    m.released_frames = released;
                    registry.acked(m.epoch, us, released);
                    if let Some(out) = jsonl.as_mut() {
                        serde_json::to_writer(&mut *out, &m)?;
                        out.write_all(b"\n")?;
                    }
                }
            }
            link_lost.store(true, Ordering::SeqCst);
            Ok(())
        })
    };

    // The sender: epochs in order, heartbeats when idle.
    let (tx, rx) = sync_channel::<(Frame, EpochMetrics)>(2);
    let sender = {
        let (link_lost, inflight, registry) =
            (link_lost.clone(), inflight.clone(), registry.clone());
        let hb = Duration::from_millis(a.heartbeat_ms.max(1));
        let stall = a.fault_stall_epoch;
        std::thread::spawn(move || loop {
            let r = match rx.recv_timeout(hb) {
                Ok((f, mut m)) => {
                    let t = Instant::now();
                    inflight
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push_back((m.clone(), t));
                    if stall == Some(f.seq) {
                        let mut bytes = Vec::new();
                        let _ = f.write_to(&mut bytes);
                        let _ = w.write_all(&bytes[..bytes.len() / 2]);
                        let _ = w.flush();
                        eprintln!(
                            "primary: fault injection: stalled in the middle of epoch {}",
                            f.seq
                        );
                        loop {
                            std::thread::sleep(Duration::from_secs(3600));
                        }
                    }
                    let r = send(&mut w, &f);
                    m.transfer_us = t.elapsed().as_micros() as u64;
                    registry.sent(&m);
                    r
                }
                Err(RecvTimeoutError::Timeout) => {
                    send(&mut w, &frame(Kind::Heartbeat, 0, Vec::new()))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // Let the last acknowledgements arrive, then end the session.
                    let t = Instant::now();
                    while !inflight
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .is_empty()
                        && t.elapsed() < Duration::from_secs(2)
                        && !link_lost.load(Ordering::SeqCst)
                    {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    let _ = send(&mut w, &frame(Kind::Bye, 0, Vec::new()));
                    break;
                }
            };
            if let Err(e) = r {
                eprintln!("primary: {e:#}");
                link_lost.store(true, Ordering::SeqCst);
                break;
            }
        })
    };

    let disk_writes = RefCell::new(Vec::new());
    let (mut prev_dev, mut dev_delta) = (Vec::new(), Vec::new());
    let (mut raw, mut sent, mut pauses) = (0u64, 0u64, Vec::new());
    let mut rec = Vec::new();
    let mut err = None;
    let mut last = Instant::now();
    let started = Instant::now();
    let epochs = run_epochs_with(
        &mut vm,
        &mut Fixed(Duration::from_millis(a.epoch_ms)),
        Duration::from_secs(a.duration),
        |epoch| {
            if let Some(r) = &site.relay {
                r.seal(epoch as u64);
            }
            if let Some(d) = &site.disk {
                *disk_writes.borrow_mut() = d.take_epoch_writes();
            }
        },
        |cp| {
            if link_lost.load(Ordering::SeqCst) {
                return false;
            }
            rec.clear();
            let seq = cp.epoch as u64;
            let t = Instant::now();
            if let Err(e) = enc.encode(seq, cp.pfns, cp.pages, &mut rec) {
                err = Some(anyhow::Error::new(e));
                return false;
            }
            let encode_us = t.elapsed().as_micros() as u64;
            let writes = std::mem::take(&mut *disk_writes.borrow_mut());
            let disk_bytes: u64 = writes.iter().map(|w| w.1.len() as u64).sum();
            let disk = tandem_disk::encode_writes(&writes);
            encode_delta(&prev_dev, cp.device_state, &mut dev_delta);
            prev_dev.clear();
            prev_dev.extend_from_slice(cp.device_state);
            let mut secs: Vec<(u8, &[u8])> = vec![
                (section::MEMORY, &rec),
                (section::DEVICE_STATE_DELTA, &dev_delta),
            ];
            if site.disk.is_some() {
                secs.push((section::DISK, &disk));
            }
            let payload = epoch_payload(&secs);
            let held = site.relay.as_ref().map(|r| r.stats()).unwrap_or_default();
            let tm = cp.timing;
            let m = EpochMetrics {
                epoch: seq,
                stop_us: tm.stop_us,
                harvest_us: tm.harvest_us,
                copy_us: tm.copy_us,
                devstate_us: tm.devstate_us,
                cont_us: tm.cont_us,
                pause_us: tm.total_us(),
                dirty_pages: cp.pfns.len() as u64,
                raw_bytes: (cp.pages.len() + cp.device_state.len()) as u64 + disk_bytes,
                sent_bytes: (payload.len() + HEADER_LEN) as u64,
                encode_us,
                held_frames: held.held_frames,
                held_bytes: held.held_bytes,
                disk_writes: writes.len() as u64,
                disk_bytes,
                ..Default::default()
            };
            sent += m.sent_bytes;
            raw += m.raw_bytes;
            pauses.push(tm.total_us() as f64 / 1000.0);
            if tx.send((frame(Kind::Epoch, seq, payload), m)).is_err() {
                return false;
            }
            if last.elapsed() >= Duration::from_secs(1) {
                last = Instant::now();
                println!(
                    "primary: epoch {seq} acked {} | raw {:.1} MiB sent {:.2} MiB | pause p50 {:.1} ms p99 {:.1} ms | held frames {}",
                    acked.load(Ordering::SeqCst),
                    raw as f64 / (1 << 20) as f64,
                    sent as f64 / (1 << 20) as f64,
                    quantile(&pauses, 0.5),
                    quantile(&pauses, 0.99),
                    held.held_frames,
                );
            }
            !stopping()
        },
    )?;
    if let Some(e) = err {
        return Err(e);
    }
    drop(tx);
    if link_lost.load(Ordering::SeqCst) {
        // Availability over protection: keep the guest running, unprotected, and let its
        // output through (what Remus does when the backup fails).
        eprintln!(
            "primary: the backup is gone (last acknowledged epoch {}); the guest keeps running UNPROTECTED and its output is released",
            acked.load(Ordering::SeqCst)
        );
        if let Some(r) = &site.relay {
            r.set_policy(Policy::Pass)?;
        }
        let until = started + Duration::from_secs(a.duration);
        while !stopping() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // The sender collects the last acknowledgements and says goodbye.
    let _ = sender.join();
    drop(reader);
    if let Some(l) = load {
        l.stop()?;
    }
    println!(
        "primary: {epochs} epochs, {:.1} MiB raw, {:.2} MiB sent, last acked {}",
        raw as f64 / (1 << 20) as f64,
        sent as f64 / (1 << 20) as f64,
        acked.load(Ordering::SeqCst)
    );
    vm.quit();
    Ok(())
}

/// Runs of consecutive non-zero pages of `mem` (at most `max_pages` each), with their first
/// page number.
fn nonzero_runs(mem: &[u8], max_pages: usize) -> impl Iterator<Item = (u64, &[u8])> {
    let pages = mem.len() / PAGE_SIZE;
    let zero = |p: usize| {
        mem[p * PAGE_SIZE..(p + 1) * PAGE_SIZE]
            .iter()
            .all(|&b| b == 0)
    };
    let mut p = 0;
    std::iter::from_fn(move || {
        while p < pages && zero(p) {
            p += 1;
        }
        if p >= pages {
            return None;
        }
        let start = p;
        while p < pages && p - start < max_pages && !zero(p) {
            p += 1;
        }
        Some((start as u64, &mem[start * PAGE_SIZE..p * PAGE_SIZE]))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonzero_runs_cover_exactly_the_nonzero_pages() {
        let mut mem = vec![0u8; 20 * PAGE_SIZE];
        for p in [0usize, 1, 2, 5, 9, 10, 19] {
            mem[p * PAGE_SIZE + 7] = 1;
        }
        let runs: Vec<(u64, usize)> = nonzero_runs(&mem, 2)
            .map(|(f, r)| (f, r.len() / PAGE_SIZE))
            .collect();
        assert_eq!(runs, vec![(0, 2), (2, 1), (5, 1), (9, 2), (19, 1)]);
    }
}
