//! One primary's link at a time: applying and acknowledging its frames ([`Link::serve`]),
//! and serving primaries as they connect until one is lost while a consistent epoch exists
//! ([`Link::until_lost`]).

use super::*;

/// How serving one connection ended.
pub(super) enum LinkEnd {
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

/// What the backup serves its primaries with: the replica, the standby QEMU and the daemon's
/// settings and status.
pub(super) struct Link<'a> {
    pub(super) bk: &'a mut Backup<MirrorFile, Keeper>,
    pub(super) standby: &'a mut Standby,
    pub(super) timeout: Duration,
    pub(super) stall: Duration,
    pub(super) status: Status,
    /// A primary connected during the last [`Link::until_lost`].
    pub(super) reconnected: bool,
    /// The fence this backup takes over with (its descriptor goes into each hello check).
    pub(super) fence: Option<std::sync::Arc<tandem_fence::Fence>>,
    /// What each ack promises: no takeover sooner than this after the last bytes received.
    pub(super) promise: Duration,
    pub(super) registry: crate::metrics::Registry,
    pub(super) beat: crate::service::Beat,
    /// When the replica's memory use was last published.
    pub(super) memory_at: Instant,
}

impl Link<'_> {
    /// Applies and acknowledges frames from one connection until it ends.
    pub(super) fn serve(&mut self, vetted: gate::Vetted) -> std::io::Result<LinkEnd> {
        let gate::Vetted {
            conn: stream,
            hello,
        } = vetted;
        let mut first = Some(hello);
        // During an initial copy there is nothing to fail over to: allow it time.
        const SETUP: Duration = Duration::from_secs(60);
        let mut in_setup = !self.bk.consistent();
        // An epoch is arriving in parts (the state says so until it commits).
        let mut in_parts = false;
        stream.set_read_timeout(Some(if self.bk.consistent() {
            self.timeout
        } else {
            SETUP
        }))?;
        stream.set_write_timeout(Some(self.timeout))?;
        stream.tcp().set_nodelay(true)?;
        self.registry.set_link_up(true);
        self.registry
            .set_peer(stream.peer_addr().ok().map(|a| a.to_string()));
        let mut r = BufReader::with_capacity(1 << 20, stream.try_clone()?);
        let mut w = BufWriter::new(stream);
        // The cluster id may have become known since the last session.
        if let Some(fence) = &self.fence {
            self.bk.set_fencing(wire_fencing(fence));
        }
        let (mut progress, mut progress_at) = (self.bk.committed(), Instant::now());
        self.standby.check();
        loop {
            self.beat.beat();
            if self.status.stop().stopping() {
                return Ok(LinkEnd::Stop);
            }
            let next = match first.take() {
                Some(f) => Ok(Some(f)),
                None => Frame::read_from(&mut r),
            };
            let f = match next {
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
                    self.status.warn(format!(
                        "refusing input: {e}; link dropped, mirror stays at epoch {}",
                        self.bk.committed()
                    ));
                    return Ok(LinkEnd::Dropped(format!("refused input ({e})")));
                }
            };
            let applied = match self.bk.handle(&f) {
                Ok(a) => a,
                Err(e) if f.kind == tandem_replication::Kind::Hello => {
                    // Tell the primary why (it logs it and retries later), then drop.
                    let why = crate::chain(&e);
                    let _ = send(&mut w, &refused_frame(f.vm_id, &why));
                    self.status.warn(format!(
                        "refusing the session: {why}; mirror stays at epoch {}",
                        self.bk.committed()
                    ));
                    return Ok(LinkEnd::Dropped(format!("refused a session ({why})")));
                }
                Err(e) => {
                    self.status.warn(format!(
                        "refusing frame {:?} #{}: {e}; link dropped, mirror stays at epoch {}",
                        f.kind,
                        f.seq,
                        self.bk.committed()
                    ));
                    return Ok(LinkEnd::Dropped(format!("refused a bad frame ({e})")));
                }
            };
            match applied {
                Applied::Hello => {
                    self.registry
                        .set_state("receiving the initial copy (cannot fail over yet)");
                    self.status.info(format!("session from epoch {}: receiving the initial copy (no failover possible until its first epoch commits)", self.bk.committed()));
                    r.get_ref().set_read_timeout(Some(SETUP))?;
                    in_setup = true;
                }
                Applied::Committed(seq) => {
                    self.registry.committed(seq);
                    if self.memory_at.elapsed() >= Duration::from_secs(1) {
                        self.memory_at = Instant::now();
                        self.registry.set_memory(self.bk.keeper().usage());
                    }
                    let was_in_parts = std::mem::take(&mut in_parts);
                    if in_setup || was_in_parts {
                        self.registry.set_state(
                            "protecting: standby ready to resume the last committed epoch",
                        );
                    }
                    // A waitpid(WNOHANG) per epoch: the ack says whether failover is possible.
                    let standby_ok = self.standby.check() && self.bk.consistent();
                    (progress, progress_at) = (seq, Instant::now());
                    if std::mem::take(&mut in_setup) {
                        // The session's first epoch: silence now means a lost primary.
                        r.get_ref().set_read_timeout(Some(self.timeout))?;
                    }
                    let ack = ack_frame(f.vm_id, seq, standby_ok, self.promise);
                    if send(&mut w, &ack).is_err() {
                        return Ok(LinkEnd::Lost("the link broke while acknowledging".into()));
                    }
                    // The consolidation clock, once the acknowledgement is on its way.
                    self.bk.tick();
                }
                Applied::Heartbeat(p) => {
                    if p.is_some_and(|p| p > progress) {
                        (progress, progress_at) = (p.unwrap_or(progress), Instant::now());
                    }
                }
                Applied::Bye => return Ok(LinkEnd::Bye),
                Applied::Handover(n) => return Ok(LinkEnd::Handover(n)),
                Applied::Part(seq) => {
                    progress_at = Instant::now();
                    in_parts = true;
                    let kept = self.bk.partial().map_or(0, |p| p.1);
                    self.registry.set_state(format!(
                        "receiving epoch {seq} in parts ({} MiB kept to undo them unless it commits); {}",
                        kept >> 20,
                        if self.bk.consistent() {
                            format!("standby ready to resume epoch {}", self.bk.committed())
                        } else {
                            "cannot fail over until it commits".into()
                        }
                    ));
                }
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

/// Waits up to `timeout` for a vetted connection (`None`: wait as long as it takes, but
/// return when asked to stop).
pub(super) fn accept_within(
    incoming: &Receiver<gate::Vetted>,
    timeout: Option<Duration>,
    status: &Status,
    beat: &crate::service::Beat,
) -> Option<gate::Vetted> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        beat.beat();
        if let Ok(v) = incoming.recv_timeout(Duration::from_millis(10)) {
            let peer = v
                .conn
                .peer_addr()
                .map_or_else(|_| "?".into(), |a| a.to_string());
            let tls = if v.conn.is_tls() { " (TLS)" } else { "" };
            status.info(format!("primary connected from {peer}{tls}"));
            return Some(v);
        }
        if status.stop().stopping() || deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
    }
}

impl Link<'_> {
    /// Serves primaries until one is lost while a consistent epoch exists (its reason), or
    /// the daemon is asked to stop (`None`).
    pub(super) fn until_lost(
        &mut self,
        listener: &Receiver<gate::Vetted>,
        mut wait: Option<Duration>,
    ) -> Result<Option<String>, BackupError> {
        self.reconnected = false;
        loop {
            let accepted = accept_within(listener, wait, &self.status, &self.beat);
            let Some(stream) = accepted else {
                if self.status.stop().stopping() {
                    return Ok(None);
                }
                // The primary did not come back after a refused frame.
                if self.bk.consistent() {
                    return Ok(Some(format!(
                        "the primary did not reconnect within {} ms",
                        self.stall.as_millis()
                    )));
                }
                wait = None;
                continue;
            };
            wait = None;
            self.reconnected = true;
            let end = match self.serve(stream) {
                Ok(end) => end,
                Err(e) => LinkEnd::Lost(format!("link error: {e}")),
            };
            // An epoch sent in parts whose epoch frame never came is undone whole.
            if let Some(seq) = self.bk.discard_partial() {
                self.status.warn(format!(
                    "the link ended inside epoch {seq} (sent in parts): its parts are undone, mirror at epoch {}",
                    self.bk.committed()
                ));
                if self.bk.consistent() {
                    self.registry
                        .set_state("protecting: standby ready to resume the last committed epoch");
                }
            }
            self.registry.set_link_up(false);
            self.registry.set_peer(None);
            match end {
                LinkEnd::Stop => return Ok(None),
                LinkEnd::Bye => self.status.info(format!(
                    "the primary ended replication on purpose after epoch {}; no failover; waiting for a new session",
                    self.bk.committed()
                )),
                LinkEnd::Handover(n) => {
                    return Ok(Some(format!("the primary handed the guest over at epoch {n}")))
                }
                LinkEnd::Lost(why) if self.bk.consistent() => return Ok(Some(why)),
                LinkEnd::Lost(why) => self.status.warn(format!(
                    "primary lost ({why}) without a consistent epoch to resume (initial copy incomplete); waiting for a primary"
                )),
                // Refused input: the primary reconnects for a re-sync; only if it does not
                // come back within the stall time is it lost.
                LinkEnd::Dropped(why) => {
                    self.status.warn(format!(
                        "{why}; waiting up to {} ms for the primary to reconnect and re-sync",
                        self.stall.as_millis()
                    ));
                    wait = Some(self.stall)
                }
            }
        }
    }
}
