//! `tandem primary` and `tandem backup`: continuous replication over TCP with failover onto a
//! standby QEMU pre-started on the backup's mirror file. Network and disk output commit are not
//! implemented yet (see docs/REPLICATION.md).

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tandem_codec::{Codec, Config, Encoder};
use tandem_replication::wire::{epoch_payload, section};
use tandem_replication::{base_payload, hello_payload, Applied, Backup, Frame, Kind, WireError};
use tandem_vm::epoch::{run_epochs, Fixed};
use tandem_vm::{DirtyMode, MirrorFile, Vm, PAGE_SIZE};

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
    /// Append one JSON line per acknowledged epoch to this file.
    #[arg(long)]
    pub metrics_jsonl: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (GET /metrics).
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

#[derive(clap::Args)]
pub struct BackupArgs {
    /// Address to listen on (host:port).
    #[arg(long)]
    pub listen: String,
    /// Directory for the mirror file (use a tmpfs such as /dev/shm).
    #[arg(long)]
    pub dir: PathBuf,
    /// The VM as the primary runs it (the standby uses the same command line).
    #[command(flatten)]
    pub vm: VmArgs,
    /// Fail over when the primary has been silent this long.
    #[arg(long, default_value_t = 1000)]
    pub timeout_ms: u64,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn install_stop_handler() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

fn send(w: &mut impl Write, f: &Frame) -> anyhow::Result<()> {
    f.write_to(w).context("writing to the backup")?;
    w.flush().context("writing to the backup")
}

pub fn primary(a: PrimaryArgs) -> anyhow::Result<()> {
    let cfg = a.vm.config("primary")?;
    let (mut vm, ready, load) = boot(&cfg)?;
    println!(
        "primary: guest ready in {:.1} s, QEMU pid {}, kv port {:?}",
        ready.as_secs_f64(),
        vm.pid(),
        cfg.kv_port
    );
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
    let frame = |kind, seq, payload| Frame {
        kind,
        vm_id: a.vm_id,
        seq,
        payload,
    };
    send(&mut w, &frame(Kind::Hello, 0, hello_payload(bytes)))?;
    // Initial copy: dirty log reset and RAM copied in one pause, sent while the guest runs.
    vm.stop()?;
    let mut scratch = Vec::new();
    vm.harvest(&mut scratch)?;
    // SAFETY: the guest is stopped while its memory is copied.
    let base = unsafe { vm.ram().as_slice() }.to_vec();
    vm.cont()?;
    for (i, c) in base.chunks(1024 * PAGE_SIZE).enumerate() {
        send(
            &mut w,
            &frame(Kind::Base, 0, base_payload((i * 1024) as u64, c)),
        )?;
    }
    let mut enc = Encoder::new(a.codec, &base, Config::default())?;
    drop(base);
    let acked = Arc::new(AtomicU64::new(0));
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
    // The reader only timestamps acknowledgements; the epoch loop, which owns each epoch's
    // record, turns them into metrics (no race between sending and a fast ack).
    let ack_at: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let reader = {
        let (acked, ack_at) = (acked.clone(), ack_at.clone());
        let mut r = BufReader::new(stream);
        std::thread::spawn(move || {
            while let Ok(Some(f)) = Frame::read_from(&mut r) {
                if f.kind == Kind::Ack {
                    ack_at
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(f.seq, Instant::now());
                    acked.store(f.seq, Ordering::SeqCst);
                }
            }
        })
    };
    let mut pending: std::collections::VecDeque<(EpochMetrics, Instant)> = Default::default();
    let mut drain =
        |pending: &mut std::collections::VecDeque<(EpochMetrics, Instant)>| -> anyhow::Result<()> {
            let mut acks = ack_at.lock().unwrap_or_else(|e| e.into_inner());
            while let Some((m, sent_at)) = pending.front() {
                let Some(at) = acks.remove(&m.epoch) else {
                    break;
                };
                let mut m = m.clone();
                let us = at.saturating_duration_since(*sent_at).as_micros() as u64;
                m.ack_latency_us = Some(us);
                registry.acked(m.epoch, us);
                if let Some(out) = jsonl.as_mut() {
                    serde_json::to_writer(&mut *out, &m)?;
                    out.write_all(b"\n")?;
                }
                pending.pop_front();
            }
            Ok(())
        };
    let ops = load.as_ref().map(|l| l.ops.clone());
    let (mut raw, mut sent, mut pauses) = (0u64, 0u64, Vec::new());
    let mut rec = Vec::new();
    let mut err = None;
    let mut last = Instant::now();
    let epochs = run_epochs(
        &mut vm,
        &mut Fixed(Duration::from_millis(a.epoch_ms)),
        Duration::from_secs(a.duration),
        |cp| {
            rec.clear();
            let seq = cp.epoch as u64;
            let t = Instant::now();
            if let Err(e) = enc.encode(seq, cp.pfns, cp.pages, &mut rec) {
                err = Some(anyhow::Error::new(e));
                return false;
            }
            let encode_us = t.elapsed().as_micros() as u64;
            let payload = epoch_payload(&[
                (section::MEMORY, &rec),
                (section::DEVICE_STATE, cp.device_state),
            ]);
            let tm = cp.timing;
            let mut m = EpochMetrics {
                epoch: seq,
                stop_us: tm.stop_us,
                harvest_us: tm.harvest_us,
                copy_us: tm.copy_us,
                devstate_us: tm.devstate_us,
                cont_us: tm.cont_us,
                pause_us: tm.total_us(),
                dirty_pages: cp.pfns.len() as u64,
                raw_bytes: (cp.pages.len() + cp.device_state.len()) as u64,
                sent_bytes: (payload.len() + tandem_replication::wire::HEADER_LEN) as u64,
                encode_us,
                ..Default::default()
            };
            sent += m.sent_bytes;
            raw += m.raw_bytes;
            pauses.push(tm.total_us() as f64 / 1000.0);
            let t = Instant::now();
            if let Err(e) = send(&mut w, &frame(Kind::Epoch, seq, payload)) {
                err = Some(e);
                return false;
            }
            m.transfer_us = t.elapsed().as_micros() as u64;
            registry.sent(&m);
            pending.push_back((m, t));
            if let Err(e) = drain(&mut pending) {
                err = Some(e);
                return false;
            }
            if last.elapsed() >= Duration::from_secs(1) {
                last = Instant::now();
                println!(
                "primary: epoch {seq} acked {} | raw {:.1} MiB sent {:.2} MiB | pause p50 {:.1} ms p99 {:.1} ms{}",
                acked.load(Ordering::SeqCst),
                raw as f64 / (1 << 20) as f64,
                sent as f64 / (1 << 20) as f64,
                quantile(&pauses, 0.5),
                quantile(&pauses, 0.99),
                ops.as_ref().map(|o| format!(" | kv ops {}", o.load(Ordering::Relaxed))).unwrap_or_default()
            );
            }
            !STOP.load(Ordering::SeqCst)
        },
    )?;
    if let Some(e) = err {
        return Err(e);
    }
    // Collect the last acknowledgements (up to a second) before reporting.
    let wait_until = Instant::now() + Duration::from_secs(1);
    while !pending.is_empty() && Instant::now() < wait_until {
        std::thread::sleep(Duration::from_millis(10));
        drain(&mut pending)?;
    }
    drop(w);
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

enum LinkEnd {
    /// Ctrl-C / SIGTERM.
    Stop,
    /// The primary is gone (closed, silent, broken link).
    Lost(String),
    /// We refused a frame and dropped the link.
    Dropped(String),
}

/// Applies and acknowledges frames from one connection until it ends.
fn serve_link(
    bk: &mut Backup<MirrorFile>,
    stream: TcpStream,
    timeout: Duration,
) -> anyhow::Result<LinkEnd> {
    // Until the first epoch commits there is nothing to fail over to: allow the initial copy
    // time; afterwards silence beyond the timeout means the primary is gone.
    const SETUP: Duration = Duration::from_secs(60);
    let silence = if bk.committed() == 0 { SETUP } else { timeout };
    stream.set_read_timeout(Some(silence))?;
    stream.set_nodelay(true)?;
    let mut r = BufReader::with_capacity(1 << 20, stream.try_clone()?);
    let mut w = BufWriter::new(stream);
    loop {
        if STOP.load(Ordering::SeqCst) {
            return Ok(LinkEnd::Stop);
        }
        let f = match Frame::read_from(&mut r) {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(LinkEnd::Lost("the primary closed the link".into())),
            Err(WireError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                let t = if bk.committed() == 0 { SETUP } else { timeout };
                return Ok(LinkEnd::Lost(format!(
                    "the primary was silent for {} ms",
                    t.as_millis()
                )));
            }
            Err(WireError::Io(e)) => return Ok(LinkEnd::Lost(format!("link error: {e}"))),
            Err(e) => {
                eprintln!(
                    "backup: refusing input: {e}; link dropped, mirror stays at epoch {}",
                    bk.committed()
                );
                return Ok(LinkEnd::Dropped(format!("refused input ({e})")));
            }
        };
        match bk.handle(&f) {
            Ok(Applied::Committed(seq)) => {
                if seq == 1 {
                    r.get_ref().set_read_timeout(Some(timeout))?;
                }
                let ack = Frame {
                    kind: Kind::Ack,
                    vm_id: f.vm_id,
                    seq,
                    payload: Vec::new(),
                };
                if send(&mut w, &ack).is_err() {
                    return Ok(LinkEnd::Lost("the link broke while acknowledging".into()));
                }
            }
            Ok(_) => {}
            Err(e) => {
                eprintln!(
                    "backup: refusing frame {:?} #{}: {e}; link dropped, mirror stays at epoch {}",
                    f.kind,
                    f.seq,
                    bk.committed()
                );
                return Ok(LinkEnd::Dropped(format!("refused a bad frame ({e})")));
            }
        }
    }
}

/// Waits up to `timeout` for a new connection.
fn accept_within(l: &TcpListener, timeout: Duration) -> anyhow::Result<Option<TcpStream>> {
    l.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    let r = loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                break Some(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break None,
            Err(e) => return Err(e.into()),
        }
    };
    l.set_nonblocking(false)?;
    Ok(r)
}

pub fn backup(a: BackupArgs) -> anyhow::Result<()> {
    install_stop_handler();
    let mut cfg = a.vm.config("standby")?;
    cfg.dirty = DirtyMode::None;
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    let mirror_path = a.dir.join("mirror.ram");
    // SAFETY: this process is the mirror's only writer; the standby QEMU maps it but runs only
    // after `resume`, which is called once the mirror is no longer written.
    let mirror = unsafe { MirrorFile::create(&mirror_path, cfg.mem_mib << 20) }?;
    let mut standby = Vm::standby(&cfg, &mirror_path).context("starting the standby QEMU")?;
    let mut bk = Backup::new(mirror);
    let listener =
        TcpListener::bind(&a.listen).with_context(|| format!("listening on {}", a.listen))?;
    println!(
        "backup: listening on {}, standby QEMU pid {} ready on {}",
        a.listen,
        standby.pid(),
        mirror_path.display()
    );
    let timeout = Duration::from_millis(a.timeout_ms);
    let (mut stream, peer) = listener.accept()?;
    println!("backup: primary connected from {peer}");
    let why = loop {
        match serve_link(&mut bk, stream, timeout)? {
            LinkEnd::Stop => return Ok(()),
            LinkEnd::Lost(why) => break why,
            LinkEnd::Dropped(why) => {
                // Refused input: drop the link but do not fail over while the primary may be
                // alive; it is lost only if it does not come back within the timeout.
                match accept_within(&listener, timeout)? {
                    Some(s) => {
                        println!("backup: primary reconnected");
                        stream = s;
                    }
                    None => {
                        break format!(
                            "{why}; the primary did not reconnect within {} ms",
                            a.timeout_ms
                        )
                    }
                }
            }
        }
    };
    let detected = Instant::now();
    if bk.committed() == 0 {
        bail!("primary lost ({why}) before any epoch was committed: nothing to resume");
    }
    let epoch = bk.committed();
    let state = bk.device_state().to_vec();
    drop(bk);
    standby.resume(&state).context("resuming the standby")?;
    let resumed = detected.elapsed();
    println!(
        "backup: failover: {why}; resumed the guest from epoch {epoch} in {:.1} ms after detection (+{} ms detection timeout); kv port {:?}",
        resumed.as_secs_f64() * 1000.0,
        a.timeout_ms,
        cfg.kv_port
    );
    while !STOP.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
    }
    standby.quit();
    Ok(())
}
