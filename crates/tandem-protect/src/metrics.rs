//! Per-epoch replication metrics: JSON lines and a Prometheus text endpoint.
//!
//! Everything here is bounded: pauses and acknowledgement latencies go into fixed-bucket
//! histograms (not lists of every epoch), and the endpoint serves at most [`MAX_CLIENTS`]
//! connections at once, each on a short-lived thread with [`CLIENT_TIMEOUT`] to send its request
//! and take its answer.
//!
//! The exporter is std-only: `metrics-exporter-prometheus` would bring hyper and tokio for one
//! plain-text page, which a small HTTP/1.0 responder serves just as well.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;

/// One epoch as the primary saw it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EpochMetrics {
    /// The epoch.
    pub epoch: tandem_types::Epoch,
    /// Pause components (flattened: `stop_us`, `harvest_us`, ... in the JSON lines).
    #[serde(flatten)]
    pub pause: tandem_types::PauseTiming,
    /// Total pause.
    pub pause_us: u32,
    /// The guest was stopped this long before the pause (early suspend: output waited and
    /// the dirty set reached the stop threshold).
    pub suspended_us: u64,
    /// The share of the epoch's run the guest's busiest vCPU was busy, in percent (`None`:
    /// unknown: a fixed schedule, or QEMU or the kernel cannot tell).
    pub busy_pct: Option<f64>,
    /// The vCPU time the guest lost to this epoch's pause and suspension: their length ×
    /// the busy share (their whole length when it is unknown).
    pub lost_cpu_us: u64,
    /// Pages written in the epoch.
    pub dirty_pages: u64,
    /// Bytes before encoding.
    pub raw_bytes: u64,
    /// Bytes of the frame sent.
    pub sent_bytes: u64,
    /// Time to encode the epoch (wall time: with QEMU's vCPU threads on the same cores it
    /// includes waiting for one, and for the sender between the parts of a large epoch).
    pub encode_us: u64,
    /// The encoding thread's CPU time for the same work: what the encoder costs the host.
    pub encode_cpu_us: u64,
    /// zstd level the memory record was encoded at.
    pub level: i32,
    /// Whether the memory record took long run patches (the codec's per-epoch trial chose
    /// them over the prefix path; docs/CODEC.md).
    pub long_patches: bool,
    /// Whether the memory record sent whole pages as word deltas (the codec's per-epoch
    /// measurement; docs/CODEC.md).
    pub word_deltas: bool,
    /// Time to write the frame to the link.
    pub transfer_us: u64,
    /// From handing the epoch to the link to the backup's acknowledgement.
    pub ack_latency_us: Option<u64>,
    /// Guest frames the relay held when this epoch was sealed (waiting for acknowledgements).
    pub held_frames: u64,
    /// Their bytes.
    pub held_bytes: u64,
    /// Guest frames released to the outside so far.
    pub released_frames: u64,
    /// Disk writes of this epoch.
    pub disk_writes: u64,
    /// Their bytes.
    pub disk_bytes: u64,
    /// Frames the epoch was sent in beyond one (an epoch too large for one part).
    pub parts: u64,
}

/// Upper bounds (seconds) of the pause histogram's buckets: 0.5 ms to 1 s, roughly log-spaced.
pub const PAUSE_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2,
    0.5, 1.0,
];

/// Upper bounds (seconds) of the acknowledgement-latency histogram's buckets: 1 ms to 30 s.
pub const ACK_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];

/// A Prometheus histogram with fixed buckets: constant memory however many observations.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative); one more than `bounds` for `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
    min: f64,
    max: f64,
}

impl Histogram {
    /// A histogram over `bounds` (increasing upper bounds; a last `+Inf` bucket is implied).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }

    /// Records one value (NaN and infinities are ignored).
    pub fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    /// Number of observations.
    #[allow(dead_code)] // for the daemons' reports
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of the observations.
    #[allow(dead_code)] // for the daemons' reports
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// `(upper bound, cumulative count)` per bucket, the last one `+Inf`.
    pub fn buckets(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        let bounds = self.bounds.iter().copied().chain([f64::INFINITY]);
        bounds.zip(self.counts.iter().scan(0, |acc, &c| {
            *acc += c;
            Some(*acc)
        }))
    }

    /// Estimates the `q` quantile (clamped to 0..=1) like Prometheus's `histogram_quantile`:
    /// linear interpolation inside the bucket that holds the rank. The `+Inf` bucket
    /// interpolates up to the largest observation, and the estimate never leaves the observed
    /// range. 0 when empty.
    #[allow(dead_code)] // for the primary's progress line
    pub fn quantile(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let q = if q.is_nan() { 0.5 } else { q.clamp(0.0, 1.0) };
        let rank = q * self.count as f64;
        let mut below = 0u64;
        let mut lower = 0.0;
        for (i, &c) in self.counts.iter().enumerate() {
            let upper = self.bounds.get(i).copied().unwrap_or(self.max);
            if c > 0 && (below + c) as f64 >= rank {
                let frac = ((rank - below as f64) / c as f64).clamp(0.0, 1.0);
                let est = lower + (upper - lower) * frac;
                return est.clamp(self.min, self.max);
            }
            below += c;
            lower = upper;
        }
        self.max
    }
}

#[derive(Clone)]
struct State {
    epochs: u64,
    acked: u64,
    dirty: u64,
    raw: u64,
    sent: u64,
    encode_us: u64,
    encode_cpu_us: u64,
    transfer_us: u64,
    suspended_us: u64,
    lost_cpu_us: u64,
    long_patch_epochs: u64,
    word_delta_epochs: u64,
    disk_writes: u64,
    disk_bytes: u64,
    released: u64,
    pause: Histogram,
    ack: Histogram,
    last: EpochMetrics,
    link_up: bool,
    protected: bool,
    backup_can_failover: bool,
    held_frames: u64,
    held_bytes: u64,
    reconnects: u64,
    resyncs: u64,
    hold_dropped: u64,
    release_deferred: u64,
    owner: Option<tandem_fence::Owner>,
    who: who::Who,
    /// Where the state changes go as typed events (the daemon's status sink).
    events: Option<crate::Status>,
}

impl Default for State {
    fn default() -> Self {
        State {
            epochs: 0,
            acked: 0,
            dirty: 0,
            raw: 0,
            sent: 0,
            encode_us: 0,
            encode_cpu_us: 0,
            transfer_us: 0,
            suspended_us: 0,
            lost_cpu_us: 0,
            long_patch_epochs: 0,
            word_delta_epochs: 0,
            disk_writes: 0,
            disk_bytes: 0,
            released: 0,
            pause: Histogram::new(PAUSE_BUCKETS),
            ack: Histogram::new(ACK_BUCKETS),
            last: EpochMetrics::default(),
            link_up: false,
            protected: false,
            backup_can_failover: false,
            held_frames: 0,
            held_bytes: 0,
            reconnects: 0,
            resyncs: 0,
            hold_dropped: 0,
            release_deferred: 0,
            owner: None,
            events: None,
            who: who::Who {
                role: "primary",
                started_ms: crate::unix_ms(),
                ..who::Who::default()
            },
        }
    }
}

/// Shared metrics of a running primary.
#[derive(Default, Clone)]
pub struct Registry(Arc<Mutex<State>>);

impl Registry {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// State changes from now on also go to `status` as typed events.
    pub fn set_events(&self, status: crate::Status) {
        self.lock().events = Some(status);
    }

    /// Says `e`, if there is one, outside the lock.
    fn emit(&self, e: Option<crate::Event>) {
        if let Some(e) = e {
            let sink = self.lock().events.clone();
            if let Some(s) = sink {
                s.event(e);
            }
        }
    }

    /// Records an epoch once it was sent.
    pub fn sent(&self, m: &EpochMetrics) {
        let mut s = self.lock();
        s.epochs += 1;
        s.dirty += m.dirty_pages;
        s.raw += m.raw_bytes;
        s.sent += m.sent_bytes;
        s.encode_us += m.encode_us;
        s.encode_cpu_us += m.encode_cpu_us;
        s.transfer_us += m.transfer_us;
        s.suspended_us += m.suspended_us;
        s.lost_cpu_us += m.lost_cpu_us;
        s.long_patch_epochs += u64::from(m.long_patches);
        s.word_delta_epochs += u64::from(m.word_deltas);
        s.disk_writes += m.disk_writes;
        s.disk_bytes += m.disk_bytes;
        s.pause.observe(m.pause_us as f64 / 1e6);
        (s.held_frames, s.held_bytes) = (m.held_frames, m.held_bytes);
        s.last = m.clone();
    }

    /// Records an acknowledgement and its latency.
    pub fn acked(&self, epoch: u64, latency_us: u64, released_frames: u64) {
        let e = {
            let mut s = self.lock();
            s.who.last_ack_ms = crate::unix_ms();
            let new = epoch > s.acked;
            s.acked = s.acked.max(epoch);
            s.released = s.released.max(released_frames);
            s.ack.observe(latency_us as f64 / 1e6);
            new.then_some(crate::Event::Acked { epoch })
        };
        self.emit(e);
    }

    /// A snapshot of the pause histogram (seconds), e.g. for p50/p99 on a progress line.
    pub fn pause_histogram(&self) -> Histogram {
        self.lock().pause.clone()
    }

    /// A snapshot of the acknowledgement-latency histogram (seconds).
    #[allow(dead_code)] // for the primary's progress line
    pub fn ack_latency_histogram(&self) -> Histogram {
        self.lock().ack.clone()
    }
}

/// Gauges and counters the daemon sets as its state changes.
impl Registry {
    /// The ownership of the VM this node runs (`tandem_owner_generation`, `tandem_fenced`).
    pub fn set_owner(&self, owner: Option<tandem_fence::Owner>) {
        self.lock().owner = owner;
    }

    /// An acknowledgement came after its deadline: its output waits for the next one.
    pub fn inc_release_deferred(&self) {
        self.lock().release_deferred += 1;
    }

    /// Whether the replication link to the backup is up.
    pub fn set_link_up(&self, up: bool) {
        self.lock().link_up = up;
    }

    /// Whether the guest is protected: its output is held for a backup that can fail over.
    pub fn set_protected(&self, protected: bool) {
        let e = {
            let mut s = self.lock();
            let changed = s.protected != protected;
            s.protected = protected;
            changed.then_some(if protected {
                crate::Event::Protected
            } else {
                crate::Event::Unprotected
            })
        };
        self.emit(e);
    }

    /// Whether the backup holds a complete committed copy it could fail over to (false during
    /// an initial copy or a re-sync).
    pub fn set_backup_can_failover(&self, can: bool) {
        self.lock().backup_can_failover = can;
    }

    /// Guest frames (and their bytes) the relay holds now.
    pub fn set_held(&self, frames: u64, bytes: u64) {
        let mut s = self.lock();
        (s.held_frames, s.held_bytes) = (frames, bytes);
    }

    /// One more reconnection to the backup.
    pub fn inc_reconnects(&self) {
        self.lock().reconnects += 1;
    }

    /// One more full re-sync of the backup.
    pub fn inc_resyncs(&self) {
        self.lock().resyncs += 1;
    }

    /// Guest frames the relay dropped because its hold queue was full (its running count).
    pub fn set_dropped_frames(&self, frames: u64) {
        self.lock().hold_dropped = frames;
    }
}

/// Writes one metric family with its HELP and TYPE lines.
fn family(o: &mut String, name: &str, kind: &str, help: &str, lines: &[(String, String)]) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, v) in lines {
        let _ = writeln!(o, "{name}{labels} {v}");
    }
}

fn histogram(o: &mut String, name: &str, help: &str, h: &Histogram) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (le, n) in h.buckets() {
        let le = if le.is_infinite() {
            "+Inf".to_string()
        } else {
            le.to_string()
        };
        let _ = writeln!(o, "{name}_bucket{{le=\"{le}\"}} {n}");
    }
    let _ = writeln!(o, "{name}_sum {}\n{name}_count {}", h.sum, h.count);
}

impl Registry {
    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let s = self.lock().clone();
        let (c, g) = ("counter", "gauge");
        let secs = |us: u64| (us as f64 / 1e6).to_string();
        let b = |v: bool| u8::from(v).to_string();
        #[rustfmt::skip]
        let rows = [
            ("tandem_epochs_total", c, s.epochs.to_string(), "Epochs checkpointed and sent."),
            ("tandem_acked_epoch", g, s.acked.to_string(), "Last epoch the backup acknowledged."),
            ("tandem_dirty_pages_total", c, s.dirty.to_string(), "Dirty pages harvested."),
            ("tandem_raw_bytes_total", c, s.raw.to_string(),
                "Dirty page, device-state and disk-write bytes before encoding."),
            ("tandem_sent_bytes_total", c, s.sent.to_string(), "Bytes sent to the backup."),
            ("tandem_encode_seconds_total", c, secs(s.encode_us), "Time spent encoding epochs."),
            ("tandem_encode_cpu_seconds_total", c, secs(s.encode_cpu_us),
                "CPU time the encoding thread spent encoding epochs."),
            ("tandem_transfer_seconds_total", c, secs(s.transfer_us),
                "Time spent writing epochs to the link."),
            ("tandem_suspended_seconds_total", c, secs(s.suspended_us),
                "Guest time lost to early suspend (output waited, dirty set at the stop threshold)."),
            ("tandem_long_patch_epochs_total", c, s.long_patch_epochs.to_string(),
                "Epochs whose memory record took long run patches (the codec's per-epoch trial)."),
            ("tandem_word_delta_epochs_total", c, s.word_delta_epochs.to_string(),
                "Epochs whose memory record sent whole pages as word deltas (the codec's per-epoch measurement)."),
            ("tandem_guest_cpu_lost_seconds_total", c, secs(s.lost_cpu_us),
                "vCPU time the guest lost to pauses and early suspends: their length x the busiest vCPU's busy share before them (what the budget's vcpu clock charges)."),
            ("tandem_disk_writes_total", c, s.disk_writes.to_string(),
                "Guest disk writes shipped with epochs."),
            ("tandem_disk_bytes_total", c, s.disk_bytes.to_string(),
                "Guest disk-write bytes shipped with epochs."),
            ("tandem_held_frames", g, s.held_frames.to_string(),
                "Guest network frames held, waiting for acknowledgements."),
            ("tandem_held_bytes", g, s.held_bytes.to_string(),
                "Bytes of the guest network frames held."),
            ("tandem_released_frames_total", c, s.released.to_string(),
                "Guest network frames released after their epoch was acknowledged."),
            ("tandem_hold_dropped_frames_total", c, s.hold_dropped.to_string(),
                "Guest network frames dropped because the hold queue was full."),
            ("tandem_release_deferred_total", c, s.release_deferred.to_string(),
                "Acknowledgements that arrived after the backup's promise ran out: their output waited for the next one."),
            ("tandem_link_up", g, b(s.link_up), "1 while the replication link to the backup is up."),
            ("tandem_protected", g, b(s.protected),
                "1 while the guest is protected (output held for a backup that can fail over)."),
            ("tandem_backup_can_failover", g, b(s.backup_can_failover),
                "1 while the backup holds a complete committed copy it could fail over to."),
            ("tandem_runs_guest", g, b(s.who.role == "primary" || s.who.failovers > 0),
                "1 while this daemon runs the guest (a primary, or a backup that failed over)."),
            ("tandem_unreplicated", g, b(s.who.unprotected),
                "1 while the guest runs without a replica and its output passes (recorded in etcd)."),
            ("tandem_reconnects_total", c, s.reconnects.to_string(), "Reconnections to the backup."),
            ("tandem_resyncs_total", c, s.resyncs.to_string(), "Full re-syncs of the backup."),
        ];
        let mut o = String::with_capacity(4096);
        for (name, kind, v, help) in rows {
            family(&mut o, name, kind, help, &[(String::new(), v)]);
        }
        let help = "The daemon's role (label), always 1.";
        let role = (format!("{{role=\"{}\"}}", s.who.role), "1".to_string());
        family(&mut o, "tandem_role", "gauge", help, &[role]);
        let help = "Failovers this daemon performed (the backup resumed the guest).";
        family(
            &mut o,
            "tandem_failovers_total",
            "counter",
            help,
            &[(String::new(), s.who.failovers.to_string())],
        );
        if s.epochs > 0 {
            let help = "zstd level of the last epoch's memory record (chosen per epoch from whether the encoder or the link is slower, unless --zstd-level fixes it).";
            let v = s.last.level.to_string();
            family(&mut o, "tandem_zstd_level", g, help, &[(String::new(), v)]);
        }
        if let Some(h) = &s.owner {
            let help = "Generation of the VM's ownership record in etcd that this node runs.";
            let v = h.generation().to_string();
            family(
                &mut o,
                "tandem_owner_generation",
                g,
                help,
                &[(String::new(), v)],
            );
            let help = "1 once this node learned that another node owns the VM (its copy stops).";
            let v = b(h.is_fenced());
            family(&mut o, "tandem_fenced", g, help, &[(String::new(), v)]);
        }
        if let Some(u) = &s.who.memory {
            let page = tandem_consolidate::PAGE as f64;
            let kinds = [
                ("plain", (u.plain + u.pooled_raw) as f64 * page),
                ("shared", u.shared_bytes),
                ("patched", u.patch_bytes),
                ("compressed", u.compressed_bytes as f64),
            ]
            .map(|(k, v)| (format!("{{kind=\"{k}\"}}"), format!("{v:.0}")));
            let help = "Backup memory of this replica by how its pages are kept (shared and patch references split among their users).";
            family(&mut o, "tandem_replica_memory_bytes", g, help, &kinds);
            let pages = [
                ("plain", u.plain + u.pooled_raw),
                ("zero", u.zero),
                ("shared", u.shared),
                ("patched", u.patched),
                ("compressed", u.compressed),
            ]
            .map(|(k, v)| (format!("{{kind=\"{k}\"}}"), v.to_string()));
            let help = "Replica pages by how the backup keeps them.";
            family(&mut o, "tandem_replica_pages", g, help, &pages);
        }
        let help = "Guest pause per epoch (type II downtime).";
        histogram(&mut o, "tandem_pause_seconds", help, &s.pause);
        let help = "From handing an epoch to the link to its acknowledgement.";
        histogram(&mut o, "tandem_ack_latency_seconds", help, &s.ack);
        let l = &s.last;
        let comps = [
            ("stop", l.pause.stop_us),
            ("harvest", l.pause.harvest_us),
            ("copy", l.pause.copy_us),
            ("device_state", l.pause.devstate_us),
            ("cont", l.pause.cont_us),
        ]
        .map(|(c, v)| (format!("{{component=\"{c}\"}}"), secs(v.into())));
        let help = "Pause components of the last epoch.";
        family(
            &mut o,
            "tandem_last_pause_component_seconds",
            g,
            help,
            &comps,
        );
        process::render(&mut o, s.who.role);
        let base = process::identity_labels(s.who.vm_id, s.who.node.as_deref());
        process::with_labels(&o, &base)
    }
}

/// At most this many scrapes are served at once; more connections get a 503 and are closed.
pub const MAX_CLIENTS: usize = 8;

/// Time a client has to send its request, and again to take the answer.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest request head read.
const MAX_REQUEST: usize = 8192;

/// Serves `GET /metrics` on `addr` from a background thread; returns the bound address.
pub fn serve(addr: &str, reg: Registry) -> std::io::Result<SocketAddr> {
    let l = TcpListener::bind(addr)?;
    let bound = l.local_addr()?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || accept_loop(l, reg))?;
    Ok(bound)
}

/// Frees a client slot when its thread ends (or could not start).
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(l: TcpListener, reg: Registry) {
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let c = match l.accept() {
            Ok((c, _)) => c,
            Err(e) => {
                // E.g. out of descriptors: do not spin.
                tracing::debug!("metrics: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
            let _slot = Slot(active.clone());
            refuse(c);
            continue;
        }
        let slot = Slot(active.clone());
        let reg = reg.clone();
        let spawned = std::thread::Builder::new()
            .name("metrics-client".into())
            .spawn(move || {
                let _slot = slot;
                handle(c, &reg);
            });
        if let Err(e) = spawned {
            tracing::debug!("metrics: cannot start a client thread: {e}");
        }
    }
}

/// Answers 503 without waiting for anything and closes.
fn refuse(c: TcpStream) {
    let _ = c.set_nonblocking(true);
    let _ = (&c).write(
        b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    );
    let _ = c.shutdown(std::net::Shutdown::Both);
}

/// Reads the request head within the deadline; `None` when the client sent nothing usable.
fn read_head(c: &mut TcpStream, deadline: Instant) -> Option<Vec<u8>> {
    let mut req = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        c.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .ok()?;
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => req.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return None,
        }
        if req.windows(4).any(|w| w == b"\r\n\r\n")
            || req.windows(2).any(|w| w == b"\n\n")
            || req.len() >= MAX_REQUEST
        {
            break;
        }
    }
    (!req.is_empty()).then_some(req)
}

/// Writes `data` within the deadline.
fn write_within(c: &mut TcpStream, mut data: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !data.is_empty() {
        let left = deadline
            .checked_duration_since(Instant::now())
            .ok_or(std::io::ErrorKind::TimedOut)?;
        c.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
        match c.write(data) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn handle(mut c: TcpStream, reg: &Registry) {
    let Some(req) = read_head(&mut c, Instant::now() + CLIENT_TIMEOUT) else {
        return;
    };
    let line = req.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (words.next().unwrap_or_default(), words.next());
    let path = path.map(|p| p.split(|&b| b == b'?').next().unwrap_or_default());
    let (status, body) = match (method, path) {
        (b"GET", Some(b"/metrics")) => ("200 OK", reg.render()),
        (b"GET", Some(_)) => ("404 Not Found", "try /metrics\n".to_string()),
        _ => ("400 Bad Request", "GET /metrics\n".to_string()),
    };
    let resp = format!(
        "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if write_within(&mut c, resp.as_bytes(), Instant::now() + CLIENT_TIMEOUT).is_ok() {
        let _ = c.shutdown(std::net::Shutdown::Write);
    }
}

mod process;
mod who;

#[cfg(test)]
mod tests;
