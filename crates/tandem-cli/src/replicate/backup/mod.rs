//! `tandem backup`: applies and acknowledges epochs; when the primary is gone, resumes the
//! guest on the standby QEMU (pre-started on the mirror file with `-incoming defer`), whose
//! NIC and data disk are already attached to this side's relay and NBD server.
//!
//! It runs until told to stop. A primary that reconnects starts a new session (a full
//! re-sync); a refused frame drops the link and waits for that reconnect. It fails over when
//! the primary is lost (link closed or broken, silence, or epochs that stop advancing) while it
//! holds a consistent epoch, or at once on a handover; afterwards it answers every primary
//! that connects with `fenced`.

mod standby;

use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tandem_net::Policy;
use tandem_replication::wire::ack_frame;
use tandem_replication::{Applied, Backup, FileDisk, Frame, Kind, WireError};
use tandem_vm::{DirtyMode, MirrorFile};

use super::site::{Role, Site, SiteArgs};
use super::{install_stop_handler, send, stopping, unix_ms};
use crate::vmargs::VmArgs;
use standby::Standby;

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
    /// Fail over when the primary's epochs have not advanced for this long although it still
    /// sends heartbeats (a primary stuck in QEMU); also how long a primary whose frame was
    /// refused has to reconnect. Default: 3 × --timeout-ms.
    #[arg(long)]
    pub stall_ms: Option<u64>,
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
    /// Ctrl-C / SIGTERM.
    Stop,
    /// The primary ended replication on purpose.
    Bye,
    /// The primary stopped its guest for good: resume now.
    Handover(u64),
    /// The primary is gone (closed, silent, broken link, no progress).
    Lost(String),
    /// We refused a frame and dropped the link.
    Dropped(String),
}

struct Link<'a> {
    bk: &'a mut Backup<MirrorFile>,
    standby: &'a mut Standby,
    timeout: Duration,
    stall: Duration,
}

impl Link<'_> {
    /// Applies and acknowledges frames from one connection until it ends.
    fn serve(&mut self, stream: TcpStream) -> anyhow::Result<LinkEnd> {
        // During an initial copy there is nothing to fail over to: allow it time.
        const SETUP: Duration = Duration::from_secs(60);
        let mut in_setup = !self.bk.consistent();
        stream.set_read_timeout(Some(if self.bk.consistent() {
            self.timeout
        } else {
            SETUP
        }))?;
        stream.set_write_timeout(Some(self.timeout))?;
        stream.set_nodelay(true)?;
        let mut r = BufReader::with_capacity(1 << 20, stream.try_clone()?);
        let mut w = BufWriter::new(stream);
        let (mut progress, mut progress_at) = (self.bk.committed(), Instant::now());
        self.standby.check();
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
                    return Ok(LinkEnd::Lost("the primary went silent".into()));
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
                        self.bk.committed()
                    );
                    return Ok(LinkEnd::Dropped(format!("refused input ({e})")));
                }
            };
            let applied = match self.bk.handle(&f) {
                Ok(a) => a,
                Err(e) => {
                    eprintln!(
                        "backup: refusing frame {:?} #{}: {e}; link dropped, mirror stays at epoch {}",
                        f.kind,
                        f.seq,
                        self.bk.committed()
                    );
                    return Ok(LinkEnd::Dropped(format!("refused a bad frame ({e})")));
                }
            };
            match applied {
                Applied::Hello => {
                    println!("backup: session from epoch {}: receiving the initial copy (no failover possible until its first epoch commits)", self.bk.committed());
                    r.get_ref().set_read_timeout(Some(SETUP))?;
                    in_setup = true;
                }
                Applied::Committed(seq) => {
                    // A waitpid(WNOHANG) per epoch: the ack says whether failover is possible.
                    let standby_ok = self.standby.check() && self.bk.consistent();
                    (progress, progress_at) = (seq, Instant::now());
                    if std::mem::take(&mut in_setup) {
                        // The session's first epoch: silence now means a lost primary.
                        r.get_ref().set_read_timeout(Some(self.timeout))?;
                    }
                    if send(&mut w, &ack_frame(f.vm_id, seq, standby_ok)).is_err() {
                        return Ok(LinkEnd::Lost("the link broke while acknowledging".into()));
                    }
                }
                Applied::Heartbeat(p) => {
                    if p.is_some_and(|p| p > progress) {
                        (progress, progress_at) = (p.unwrap_or(progress), Instant::now());
                    }
                }
                Applied::Bye => return Ok(LinkEnd::Bye),
                Applied::Handover(n) => return Ok(LinkEnd::Handover(n)),
                Applied::Base | Applied::DiskBase => progress_at = Instant::now(),
            }
            if self.bk.consistent() && progress_at.elapsed() > self.stall {
                return Ok(LinkEnd::Lost(format!(
                    "the primary's epochs stopped advancing at epoch {progress} for {} ms although its link is up",
                    progress_at.elapsed().as_millis()
                )));
            }
        }
    }
}

/// Waits up to `timeout` for a new connection (`None`: wait as long as it takes, but return
/// when asked to stop).
fn accept_within(l: &TcpListener, timeout: Option<Duration>) -> anyhow::Result<Option<TcpStream>> {
    l.set_nonblocking(true)?;
    let deadline = timeout.map(|t| Instant::now() + t);
    let r = loop {
        match l.accept() {
            Ok((s, peer)) => {
                s.set_nonblocking(false)?;
                println!("backup: primary connected from {peer}");
                break Some(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if stopping() || deadline.is_some_and(|d| Instant::now() >= d) {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10))
            }
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
    let mirror = unsafe { MirrorFile::create(&mirror_path, cfg.mem_mib << 20) }
        .context("creating the RAM mirror")?;
    let mut bk = Backup::new(mirror);
    if let Some(p) = &site.disk_path {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(p)?;
        bk = bk
            .with_disk(Box::new(FileDisk::new(f).with_context(|| {
                format!("allocating the disk copy {}", p.display())
            })?));
        // Both this process and its NBD server hold the file open: nothing is left behind.
        let _ = std::fs::remove_file(p);
    }
    let mut standby = Standby::start(&cfg, &mirror_path)?;
    let listener =
        TcpListener::bind(&a.listen).with_context(|| format!("listening on {}", a.listen))?;
    println!(
        "backup: listening on {}, standby QEMU pid {} ready on {}",
        a.listen,
        standby.pid().unwrap_or(0),
        mirror_path.display()
    );
    let timeout = Duration::from_millis(a.timeout_ms.max(1));
    let mut link = Link {
        bk: &mut bk,
        standby: &mut standby,
        timeout,
        stall: Duration::from_millis(a.stall_ms.unwrap_or(3 * a.timeout_ms).max(1)),
    };
    let mut wait: Option<Duration> = None;
    let why = loop {
        let Some(stream) = accept_within(&listener, wait)? else {
            if stopping() {
                link.standby.quit();
                return Ok(());
            }
            // The primary did not come back after a refused frame.
            if link.bk.consistent() {
                break format!(
                    "the primary did not reconnect within {} ms",
                    link.stall.as_millis()
                );
            }
            wait = None;
            continue;
        };
        wait = None;
        match link.serve(stream)? {
            LinkEnd::Stop => {
                link.standby.quit();
                return Ok(());
            }
            LinkEnd::Bye => println!(
                "backup: the primary ended replication on purpose after epoch {}; no failover; waiting for a new session",
                link.bk.committed()
            ),
            LinkEnd::Handover(n) => break format!("the primary handed the guest over at epoch {n}"),
            LinkEnd::Lost(why) if link.bk.consistent() => break why,
            LinkEnd::Lost(why) => eprintln!(
                "backup: primary lost ({why}) without a consistent epoch to resume (initial copy incomplete); waiting for a primary"
            ),
            // Refused input: the primary reconnects for a re-sync; only if it does not come
            // back within the timeout is it lost.
            LinkEnd::Dropped(why) => {
                eprintln!(
                    "backup: {why}; waiting up to {} ms for the primary to reconnect and re-sync",
                    link.stall.as_millis()
                );
                wait = Some(link.stall)
            }
        }
    };
    failover(&a, &site, &mut bk, &mut standby, &listener, why)
}

fn failover(
    a: &BackupArgs,
    site: &Site,
    bk: &mut Backup<MirrorFile>,
    standby: &mut Standby,
    listener: &TcpListener,
    why: String,
) -> anyhow::Result<()> {
    let detected = Instant::now();
    let detected_at_ms = unix_ms();
    let epoch = bk.committed();
    let state = bk.device_state().to_vec();
    if !standby.check_now() {
        anyhow::bail!("primary lost ({why}) but the standby QEMU is not running: cannot resume the guest from epoch {epoch}");
    }
    let mut vm = standby.take().context("no standby")?;
    if let Some(r) = &site.relay {
        r.set_policy(Policy::Pass)?;
    }
    vm.resume(&state).context("resuming the standby")?;
    let resume = detected.elapsed();
    super::echo_guest_progress(vm.serial_path(), "backup");
    let running_at_ms = unix_ms();
    // Move the guest's MAC to this side of the bridge at once (QEMU also announces after an
    // incoming migration; this makes it explicit).
    if let Err(e) = vm.qmp.execute(
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
    // The guest runs here now: any primary that connects is told to stop its copy.
    let vm_id = bk.vm_id().unwrap_or(0);
    while !stopping() {
        if let Some(st) = vm.exit_status() {
            anyhow::bail!("the resumed guest's QEMU exited ({st})");
        }
        if let Some(s) = accept_within(listener, Some(Duration::from_millis(100)))? {
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let fenced = Frame {
                kind: Kind::Fenced,
                vm_id,
                seq: epoch,
                payload: Vec::new(),
            };
            let mut w = BufWriter::new(s);
            let _ = send(&mut w, &fenced);
            println!("backup: told a connecting primary that the guest runs here (fenced)");
        }
    }
    vm.quit();
    Ok(())
}
