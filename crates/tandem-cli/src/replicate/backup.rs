//! `tandem backup`: applies and acknowledges epochs; when the primary is gone, resumes the
//! guest on the standby QEMU (pre-started on the mirror file with `-incoming defer`), whose
//! NIC and data disk are already attached to this side's relay and NBD server.

use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use tandem_net::Policy;
use tandem_replication::{Applied, Backup, FileDisk, Frame, Kind, WireError};
use tandem_vm::{DirtyMode, MirrorFile, Vm};

use super::site::{Role, Site, SiteArgs};
use super::{install_stop_handler, send, stopping, unix_ms};
use crate::vmargs::VmArgs;

#[derive(clap::Args)]
pub struct BackupArgs {
    /// Address to listen on (host:port).
    #[arg(long)]
    pub listen: String,
    /// Directory for the mirror file, disk copy and sockets (use a tmpfs such as /dev/shm).
    #[arg(long)]
    pub dir: PathBuf,
    /// The VM as the primary runs it (the standby uses the same command line).
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub site: SiteArgs,
    /// Fail over when the primary has been silent this long.
    #[arg(long, default_value_t = 1000)]
    pub timeout_ms: u64,
    /// Write a JSON report of the failover here.
    #[arg(long)]
    pub report: Option<PathBuf>,
}

/// What the backup did at failover (wall-clock times in Unix milliseconds).
#[derive(Serialize)]
pub struct FailoverReport {
    pub reason: String,
    pub epoch: u64,
    pub detected_at_ms: u64,
    pub running_at_ms: u64,
    /// Detection to guest running (type I downtime without detection time).
    pub resume_ms: f64,
    pub timeout_ms: u64,
}

enum LinkEnd {
    /// Ctrl-C / SIGTERM, or the primary said goodbye.
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
    // time; afterwards silence beyond the timeout (heartbeats arrive every 100 ms) means the
    // primary is gone.
    const SETUP: Duration = Duration::from_secs(60);
    let silence = if bk.committed() == 0 { SETUP } else { timeout };
    stream.set_read_timeout(Some(silence))?;
    stream.set_nodelay(true)?;
    let mut r = BufReader::with_capacity(1 << 20, stream.try_clone()?);
    let mut w = BufWriter::new(stream);
    loop {
        if stopping() {
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
            Err(WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(LinkEnd::Lost(
                    "the link closed in the middle of a frame (the partial epoch is discarded)"
                        .into(),
                ))
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
            Ok(Applied::Bye) => {
                println!(
                    "backup: the primary ended replication on purpose after epoch {}; no failover",
                    bk.committed()
                );
                return Ok(LinkEnd::Stop);
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
    let site = Site::prepare(&a.site, &a.dir, Role::Backup, &mut cfg)?;
    let mirror_path = a.dir.join("mirror.ram");
    // SAFETY: this process is the mirror's only writer; the standby QEMU maps it but runs only
    // after `resume`, which is called once the mirror is no longer written.
    let mirror = unsafe { MirrorFile::create(&mirror_path, cfg.mem_mib << 20) }?;
    let mut standby = Vm::standby(&cfg, &mirror_path).context("starting the standby QEMU")?;
    let mut bk = Backup::new(mirror);
    if let Some(p) = &site.disk_path {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(p)?;
        bk = bk.with_disk(Box::new(FileDisk::new(f)?));
    }
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
            LinkEnd::Stop => {
                standby.quit();
                return Ok(());
            }
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
    let detected_at_ms = unix_ms();
    if bk.committed() == 0 {
        bail!("primary lost ({why}) before any epoch was committed: nothing to resume");
    }
    let epoch = bk.committed();
    let state = bk.device_state().to_vec();
    drop(bk);
    if let Some(r) = &site.relay {
        r.set_policy(Policy::Pass)?;
    }
    standby.resume(&state).context("resuming the standby")?;
    let resume = detected.elapsed();
    super::echo_guest_progress(standby.serial_path(), "backup");
    let running_at_ms = unix_ms();
    // Move the guest's MAC to this side of the bridge at once (QEMU also announces after an
    // incoming migration; this makes it explicit).
    if let Err(e) = standby.qmp.execute(
        "announce-self",
        Some(serde_json::json!({
            "initial": 50, "max": 550, "rounds": 5, "step": 100
        })),
    ) {
        tracing::warn!("announce-self: {e}");
    }
    println!(
        "backup: failover: {why}; resumed the guest from epoch {epoch} in {:.1} ms after detection (+ up to {} ms detection timeout)",
        resume.as_secs_f64() * 1000.0,
        a.timeout_ms,
    );
    if let Some(p) = &a.report {
        let r = FailoverReport {
            reason: why,
            epoch,
            detected_at_ms,
            running_at_ms,
            resume_ms: resume.as_secs_f64() * 1000.0,
            timeout_ms: a.timeout_ms,
        };
        std::fs::write(p, serde_json::to_vec_pretty(&r)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    while !stopping() {
        std::thread::sleep(Duration::from_millis(100));
    }
    standby.quit();
    Ok(())
}
