//! One replication session: hello and the initial sync (initial.rs: pre-copy rounds while
//! the guest runs), then the epoch loop until the link is lost, the backup fences this primary,
//! or the operator stops it (handover or shutdown).

use crate::conn::Conn;
use std::io::{BufReader, BufWriter, Write};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_replication::{Acks, Frame, Primary, Reply};
use tandem_vm::epoch::{run_pipeline, Checkpoint};
use tandem_vm::{EpochSink, Guest, Vm};

use super::fence::Blocked;
use super::initial::CopyError;
use super::link::{self, Out, SenderOpts, Shared};
use super::sink::{LinkSink, Step};
use super::watchdog::Watchdog;
use super::{PrimaryConfig, PrimaryError};
use crate::faults::{self, HandoverStep};
use crate::metrics::Registry;
use crate::site::Site;
use crate::Status;

/// How a session ended (errors of the VM end the daemon instead).
pub enum End {
    /// The link broke or the backup misbehaved: reconnect and re-sync.
    Lost(String),
    /// The backup resumed the guest (it failed over): this copy must stop.
    Fenced(u64),
    /// The guest stopped for good after `epoch`; `acked` says whether the backup confirmed it.
    HandedOver { epoch: u64, acked: bool },
    /// Replication ended on purpose (`bye` sent): shut the guest down.
    Shutdown,
    /// etcd says another node holds the VM (its name): this copy must stop.
    FencedBy(String),
}

/// What lives across sessions.
pub struct Daemon<'a> {
    pub site: &'a Site,
    pub proto: Primary,
    pub registry: Registry,
    pub opts: &'a PrimaryConfig,
    pub status: Status,
    pub watchdog: Watchdog,
    /// Last epoch checkpointed (numbers keep counting across sessions).
    pub epoch: u64,
    pub jsonl: Arc<Mutex<Option<BufWriter<std::fs::File>>>>,
    pub raw: u64,
    pub sent: u64,
    pub deadline: Option<Instant>,
    /// Whether the last session got at least one acknowledgement (a session refused at once,
    /// e.g. for a geometry mismatch, makes the next attempt wait longer).
    pub last_session_acked: bool,
    /// The hold on the VM in etcd (`--etcd`).
    pub fencing: Option<super::fence::Fencing>,
    /// Set when etcd says another node holds the VM.
    pub fenced_by: Option<String>,
    /// The relays pass output (a guest resumed here without fencing): the next session holds
    /// it again.
    pub passing: bool,
    /// The first capture of the writable disks failed (a resumed guest): redo it before the
    /// next session.
    pub recapture: bool,
    /// The ids of the last sessions (a backup's `fenced` must name one of them to be
    /// believed without etcd).
    pub sessions: std::collections::VecDeque<u64>,
    /// Since when no backup acknowledged anything: the boot, or the end of the last session
    /// that got an acknowledgement. Sessions that fail before their first acknowledgement (a
    /// backup that refuses them, a link that breaks at once) do not restart it: after the ack
    /// timeout the primary goes unprotected whatever its connection attempts do.
    pub no_backup_since: Instant,
    /// The heartbeat period the backup's last promise asked for (µs), kept across sessions.
    pub heartbeat_us: Arc<std::sync::atomic::AtomicU64>,
}

pub(super) type Writes = Vec<(u64, Vec<u8>)>;

impl Daemon<'_> {
    /// Runs one session on `stream`.
    pub fn session(&mut self, vm: &mut Vm, stream: Conn) -> Result<End, PrimaryError> {
        let reader_stream = match link::tune(stream.tcp(), self.opts.ack_timeout)
            // With TLS the daemon writes to the pump's socket: bound those writes too.
            .and_then(|()| stream.set_write_timeout(Some(self.opts.ack_timeout)))
            .and_then(|()| stream.try_clone())
        {
            Ok(s) => s,
            Err(e) => return Ok(End::Lost(format!("setting up the link: {e}"))),
        };
        let session = tandem_fence::random_id();
        self.proto.set_session(session);
        self.sessions.push_back(session);
        if self.sessions.len() > 8 {
            self.sessions.pop_front();
        }
        match &mut self.fencing {
            Some(f) => {
                self.proto.set_fencing(f.wire());
                match f.begin_session(session) {
                    Ok(()) => {}
                    Err(Blocked::Unknown(why)) => {
                        return Ok(End::Lost(format!(
                            "cannot record the new session in etcd ({why})"
                        )))
                    }
                    Err(Blocked::Fenced(what)) => return Ok(End::FencedBy(what)),
                }
            }
            None => self.proto.set_fencing(tandem_replication::Fencing::None),
        }
        let start = self.epoch;
        let shared = Arc::new(
            Shared::new(Acks::new(self.proto.vm_id(), start), start)
                .with_heartbeat(self.heartbeat_us.clone()),
        );
        let reader = self.spawn_reader(reader_stream, shared.clone());
        let end = self.copy_and_run(vm, &stream, &shared);
        let end = match (self.fenced_by.take(), end) {
            (Some(by), _) => Ok(End::FencedBy(by)),
            (None, Ok(End::Fenced(n))) => Ok(self.believe_fenced(n, &shared)),
            (None, end) => end,
        };
        if let Some(why) = shared
            .refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            self.status
                .warn(format!("the backup refused the session: {why}"));
        }
        self.last_session_acked = shared.acks().acked() > start;
        if self.last_session_acked {
            self.no_backup_since = Instant::now();
        }
        // No release may start any more, and none is in progress: only then does the link
        // close (the backup may take over at once when it sees the close).
        shared.closing.store(true, Ordering::SeqCst);
        self.site.relays.quiesce();
        // Unblock the reader (and a sender stuck in a write), then collect them.
        stream.shutdown();
        let _ = reader.join();
        self.registry.set_link_up(false);
        self.registry.set_peer(None);
        self.registry.set_protected(false);
        end
    }

    fn copy_and_run(
        &mut self,
        vm: &mut Vm,
        stream: &Conn,
        shared: &Arc<Shared>,
    ) -> Result<End, PrimaryError> {
        let start = self.epoch;
        let (w, sender_stream) = match (stream.try_clone(), stream.try_clone()) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Ok(End::Lost(format!("link: {e}"))),
        };
        let mut w = BufWriter::with_capacity(1 << 20, w);
        let throttle = match self.initial_copy(vm, &mut w, shared) {
            Ok(t) => t,
            Err(CopyError::Vm(e)) => return Err(e.into()),
            Err(CopyError::Link(why)) => return Ok(self.lost_or_fenced(shared, why)),
        };
        drop(w);
        self.registry.set_link_up(true);
        let (tx, rx) = sync_channel::<Out>(2);
        let sender = link::spawn_sender(
            sender_stream,
            rx,
            shared.clone(),
            self.registry.clone(),
            SenderOpts {
                vm_id: self.proto.vm_id(),
                stall_epoch: faults::stall_epoch(self.opts),
            },
            self.status.clone(),
        );
        self.status.info(format!(
            "initial copy sent; replicating from epoch {} on",
            start + 1
        ));
        let r = self.epochs(vm, &tx, shared, throttle);
        let end = match r {
            Err(e) => Err(e),
            Ok(()) if shared.fenced.load(Ordering::SeqCst) => {
                Ok(End::Fenced(shared.fenced_at.load(Ordering::SeqCst)))
            }
            Ok(()) if shared.is_lost() => Ok(End::Lost(shared.why())),
            Ok(())
                if (self.status.stop().stopping() && !self.status.stop().shutdown_requested())
                    || self.status.stop().switchover_requested() =>
            {
                self.handover(vm, &tx, shared)
            }
            Ok(()) => Ok(self.goodbye(&tx, shared)),
        };
        drop(tx);
        let _ = sender.join();
        if matches!(end, Ok(End::HandedOver { .. })) {
            faults::kill_point(self.opts, HandoverStep::HandoverSent, &self.status);
        }
        end
    }

    /// Whether to believe a backup that says it runs the guest since `epoch`: with etcd, the
    /// record decides; without, the backup must name a session of this primary.
    fn believe_fenced(&self, epoch: u64, shared: &Shared) -> End {
        let session = *shared
            .fenced_session
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match &self.fencing {
            Some(f) => match f.check() {
                Ok(false) => End::FencedBy(f.fenced().unwrap_or_else(|| "owned elsewhere".into())),
                Ok(true) => {
                    self.status.warn("a peer at the backup's address says it runs the guest, but the ownership record in etcd names this node: not believed (is it the real backup?)");
                    End::Lost("a peer claimed to run the guest; etcd says otherwise".into())
                }
                Err(why) => End::Lost(format!(
                    "the backup says it runs the guest and etcd cannot confirm it ({why}); output stays held"
                )),
            },
            None if session.is_some_and(|s| self.sessions.contains(&s)) => End::Fenced(epoch),
            None => {
                self.status.warn(format!(
                    "a peer at the backup's address says it runs the guest since epoch {epoch}, but names no session of this primary ({}): not believed",
                    session.map_or("none".into(), |s| format!("{s:016x}"))
                ));
                End::Lost("a peer claimed to run the guest without proof".into())
            }
        }
    }

    fn lost_or_fenced(&self, shared: &Shared, why: String) -> End {
        if shared.fenced.load(Ordering::SeqCst) {
            End::Fenced(shared.fenced_at.load(Ordering::SeqCst))
        } else {
            End::Lost(why)
        }
    }

    /// The link as the pipeline's sink for this session (`qemu`: the pid for the pause-kill
    /// fault hook, 0 for none).
    fn sink<'s>(
        &'s mut self,
        shared: &'s Shared,
        tx: &'s SyncSender<Out>,
        qemu: u32,
    ) -> LinkSink<'s> {
        LinkSink {
            st: Step {
                proto: &mut self.proto,
                registry: &self.registry,
                opts: self.opts,
                site: self.site,
                shared,
                tx,
                raw: &mut self.raw,
                sent: &mut self.sent,
                status: &self.status,
            },
            watchdog: &self.watchdog,
            fencing: self.fencing.as_mut(),
            fenced_by: &mut self.fenced_by,
            passing: &mut self.passing,
            qemu,
            writes: Ok(Vec::new()),
            err: None,
            last_print: Instant::now(),
            ahead: Default::default(),
        }
    }

    /// The epoch loop of this session: the pipeline with the link as its sink.
    fn epochs(
        &mut self,
        vm: &mut Vm,
        tx: &SyncSender<Out>,
        shared: &Shared,
        throttle: super::initial::Throttle,
    ) -> Result<(), PrimaryError> {
        let duration = self.deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        let first = self.epoch + 1;
        // The first pause comes at once (`StartNow`). It (vCPUs stopped, dirty log harvested,
        // pages copied, device state captured) takes everything the guest wrote since the
        // last pre-copy round, while the encoder's state was built: up to all of its RAM on a
        // busy guest, about a millisecond per MiB of guest on a loaded host. Progress, not a
        // hang, until the first checkpoint's own beat.
        self.watchdog
            .allow(Duration::from_millis((vm.ram().len() >> 20) as u64));
        let mut sink = self.sink(shared, tx, vm.pid());
        let mut schedule = tandem_vm::schedule::StartNow::new(tandem_vm::schedule::build(
            sink.st.opts.epoch,
            sink.st.opts.adaptive,
        ));
        // The initial sync's throttle ends now, and the first checkpoint follows at once.
        throttle.release();
        let r = run_pipeline(vm, &mut schedule, duration, first, &mut sink);
        let err = sink.err.take();
        self.epoch = r?;
        err.map_or(Ok(()), Err)
    }

    /// Planned stop: one last checkpoint with the guest left stopped, shipped with a
    /// handover; the backup resumes the guest from it. This copy never runs again.
    fn handover(
        &mut self,
        vm: &mut Vm,
        tx: &SyncSender<Out>,
        shared: &Shared,
    ) -> Result<End, PrimaryError> {
        let seq = self.epoch + 1;
        let (mut pfns, mut pages, mut dev) = (Vec::new(), Vec::new(), Vec::new());
        let ack_timeout = self.opts.ack_timeout;
        let mut sink = self.sink(shared, tx, 0);
        let timing = vm.pause(
            &mut pfns,
            &mut pages,
            &mut dev,
            &mut |pfns: &[u64], pages: &mut Vec<u8>| {
                sink.in_pause(seq);
                sink.copied(seq, pfns, pages);
            },
            false,
        )?;
        let cp = Checkpoint {
            epoch: seq,
            at: Duration::ZERO,
            timing,
            suspended: Duration::ZERO,
            cut: tandem_vm::schedule::Reason::Handover,
            ran: Duration::ZERO,
            waited: None,
            busy: None,
            pfns: &pfns,
            pages: &pages,
            device_state: &dev,
        };
        let w = std::mem::replace(&mut sink.writes, Ok(Vec::new()))
            .map_err(PrimaryError::FinalWrites)?;
        let wd = sink.watchdog;
        let ahead = sink
            .ahead
            .finish(seq)
            .map_err(|_| PrimaryError::EncoderStopped)?;
        sink.st.ship(seq, &cp, &w, &|| wd.beat(), ahead)?;
        self.epoch = seq;
        faults::kill_point(self.opts, HandoverStep::HandoverShipped, &self.status);
        // The handover goes only once the last epoch's output is out: the backup resumes the
        // guest as soon as it reads it, and no frame of this copy may follow.
        let t = Instant::now();
        while shared.released.load(Ordering::SeqCst) < seq
            && !shared.is_lost()
            && t.elapsed() < ack_timeout
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        let acked = shared.released.load(Ordering::SeqCst) >= seq;
        faults::kill_point(self.opts, HandoverStep::HandoverReleased, &self.status);
        if acked {
            // The sender writes it before it stops (the session joins it).
            let _ = tx.send(Out::Control(self.proto.handover(seq)));
        }
        Ok(End::HandedOver { epoch: seq, acked })
    }

    /// Ends replication on purpose: waits for outstanding acks, then says goodbye.
    fn goodbye(&mut self, tx: &SyncSender<Out>, shared: &Shared) -> End {
        let t = Instant::now();
        while shared.acks().oldest_unacked(Instant::now()).is_some()
            && !shared.is_lost()
            && t.elapsed() < self.opts.ack_timeout
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = tx.send(Out::Control(self.proto.bye()));
        End::Shutdown
    }

    /// Reads the backup's frames: validated acks release their epochs' output, each until
    /// the deadline the backup's promise gives.
    fn spawn_reader(&self, stream: Conn, shared: Arc<Shared>) -> std::thread::JoinHandle<()> {
        let (relay, registry, jsonl, status) = (
            self.site.relays.clone(),
            self.registry.clone(),
            self.jsonl.clone(),
            self.status.clone(),
        );
        let heartbeat = self.opts.heartbeat;
        std::thread::spawn(move || {
            let mut r = BufReader::new(stream);
            let mut lat = Vec::new();
            loop {
                let f = match Frame::read_from(&mut r) {
                    Ok(Some(f)) => f,
                    Ok(None) => return shared.lose("the backup closed the link".into()),
                    Err(e) => return shared.lose(format!("reading from the backup: {e}")),
                };
                lat.clear();
                let reply = shared.acks().on_frame(&f, &mut lat);
                match reply {
                    Ok(Reply::Acked {
                        seq,
                        can_fail_over,
                        promise,
                        ..
                    }) => {
                        if let Some(p) = promise {
                            let hb = heartbeat.min(p / 4).max(Duration::from_millis(1));
                            shared
                                .heartbeat_us
                                .store(hb.as_micros() as u64, Ordering::Relaxed);
                        }
                        faults::stop_at_ack(&status);
                        let deadline = release_deadline(&shared, seq, promise, &lat);
                        let allowed = || {
                            !shared.closing.load(Ordering::SeqCst)
                                && deadline.is_none_or(|d| Instant::now() < d)
                        };
                        let (released, complete) = match relay.release_while(seq, &allowed) {
                            Ok(r) => r,
                            Err(e) => return shared.lose(format!("releasing output: {e}")),
                        };
                        if complete {
                            shared.released.fetch_max(seq, Ordering::SeqCst);
                            *shared
                                .deferred_since
                                .lock()
                                .unwrap_or_else(|e| e.into_inner()) = None;
                        } else {
                            registry.inc_release_deferred();
                            shared
                                .deferred_since
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .get_or_insert_with(Instant::now);
                        }
                        registry.set_protected(can_fail_over);
                        registry.set_backup_can_failover(can_fail_over);
                        record_acked(&shared, &registry, &jsonl, &lat, released, &status);
                    }
                    Ok(Reply::Fenced { epoch, session }) => {
                        status.warn(format!("the backup says it resumed the guest from epoch {epoch}: checking before stopping this copy (nothing is released meanwhile)"));
                        *shared
                            .fenced_session
                            .lock()
                            .unwrap_or_else(|e| e.into_inner()) = session;
                        shared.fenced_at.store(epoch, Ordering::SeqCst);
                        shared.fenced.store(true, Ordering::SeqCst);
                        shared.closing.store(true, Ordering::SeqCst);
                        return shared.lose("the backup says it runs the guest".into());
                    }
                    Ok(Reply::Refused(why)) => {
                        let msg = format!("refused by the backup: {why}");
                        *shared.refused.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
                        return shared.lose(msg);
                    }
                    Ok(Reply::Heartbeat) => {}
                    Err(e) => {
                        return shared.lose(format!("refusing the backup's frame: {e}"));
                    }
                }
            }
        })
    }
}

/// Until when the output of epochs up to `seq` may be released: the backup received all of
/// epoch `seq` no earlier than the moment its last byte was handed to the link (or, not
/// recorded yet, the moment its sending began) and promises to take over no sooner than
/// `promise` after that. 2 % of the promise and 2 ms go off for clock-rate differences and
/// the release itself. `None`: an earlier backup that makes no promise.
fn release_deadline(
    shared: &Shared,
    seq: u64,
    promise: Option<Duration>,
    covered: &[(u64, Instant)],
) -> Option<Instant> {
    let p = promise?;
    let from = shared
        .last_byte_of(seq)
        .or_else(|| covered.last().map(|&(_, t)| t));
    let right = p.mul_f64(0.98).saturating_sub(Duration::from_millis(2));
    // Without any send time nothing can be proven: release nothing on this ack.
    Some(from.map_or_else(Instant::now, |t| t + right))
}

/// Records the metrics of the epochs an ack covers: registry, and one JSON line each. A
/// failing metrics file is reported once and then left alone (metrics never stop replication).
fn record_acked(
    shared: &Shared,
    registry: &Registry,
    jsonl: &Mutex<Option<BufWriter<std::fs::File>>>,
    lat: &[(u64, Instant)],
    released: u64,
    status: &Status,
) {
    let at = Instant::now();
    let mut pending = shared.pending();
    let mut g = jsonl.lock().unwrap_or_else(|e| e.into_inner());
    for &(epoch, sent_at) in lat {
        let us = at.saturating_duration_since(sent_at).as_micros() as u64;
        registry.acked(epoch, us, released);
        while pending.front().is_some_and(|m| m.epoch < epoch) {
            pending.pop_front();
        }
        let Some(mut m) = pending.pop_front().filter(|m| m.epoch == epoch) else {
            continue;
        };
        m.ack_latency_us = Some(us);
        m.released_frames = released;
        let encode_us = m.encode_stage_us();
        shared.observe_ship(m.dirty_pages, encode_us.saturating_add(us));
        shared.observe_level(m.level, encode_us, us);
        let Some(out) = g.as_mut() else { continue };
        let r = serde_json::to_writer(&mut *out, &m)
            .map_err(std::io::Error::other)
            .and_then(|()| out.write_all(b"\n"))
            .and_then(|()| out.flush());
        if let Err(e) = r {
            status.warn(format!("writing the metrics file failed ({e}); no more metrics lines are written, replication goes on"));
            *g = None;
        }
    }
}
