//! Per-epoch replication metrics: JSON lines and a Prometheus text endpoint.
//!
//! Everything here is bounded: pauses and acknowledgement latencies go into fixed-bucket
//! histograms (not lists of every epoch), and the endpoint serves at most
//! [`http::MAX_CLIENTS`] connections at once, each on a short-lived thread with
//! [`http::CLIENT_TIMEOUT`] to send its request and take its answer.
//!
//! The exporter is std-only: `metrics-exporter-prometheus` would bring hyper and tokio for one
//! plain-text page, which a small HTTP/1.0 responder serves just as well.

use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;
use tandem_vm::schedule::{Reason, Wait};

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
    /// Why the epoch ended: `time` (its longest wait), `output` (network output waited),
    /// `disk` (the write log's limit), `converged` (the dirty set stopped growing), `start`
    /// (a session's first), `handover` (a planned stop's last).
    #[serde(serialize_with = "reason_name")]
    pub cut: Reason,
    /// How long the guest ran in the epoch before its pause (or early suspension).
    pub ran_us: u64,
    /// The last rule that held the checkpoint back while network output waited for it:
    /// `min_run`, `budget` (the guest-time budget), `busy` (the busy hold), `ack` (the
    /// previous checkpoint's acknowledgement); `None`: output did not wait, or was cut at
    /// the first poll that could.
    #[serde(serialize_with = "wait_name")]
    pub waited: Option<Wait>,
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
    /// Time to encode the epoch after the pause (wall time: with QEMU's vCPU threads on the
    /// same cores it includes waiting for one, for the rest of a memory record begun in the
    /// pause, and for the sender between the parts of a large epoch).
    pub encode_us: u64,
    /// The encoding threads' CPU time for the same work (the memory record's included,
    /// wherever it ran): what the encoder costs the host.
    pub encode_cpu_us: u64,
    /// The wall time of the memory record on the encoder's thread, which began it in the
    /// pause (0: the epoch was encoded after the pause, on the loop's thread).
    pub encode_ahead_us: u64,
    /// zstd level the memory record was encoded at.
    pub level: i32,
    /// Whether the memory record took long run patches (the codec's per-epoch trial chose
    /// them over the prefix path; docs/CODEC.md).
    pub long_patches: bool,
    /// Whether the memory record sent whole pages as word deltas (the codec's per-epoch
    /// measurement; docs/CODEC.md).
    pub word_deltas: bool,
    /// Whether the memory record went without the reference prefix (the codec's check found
    /// it saving too little; docs/CODEC.md).
    pub prefix_off: bool,
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

/// A [`Reason`] in the JSON lines: its name.
fn reason_name<S: serde::Serializer>(r: &Reason, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.name())
}

/// A [`Wait`] in the JSON lines: its name, or null.
fn wait_name<S: serde::Serializer>(w: &Option<Wait>, s: S) -> Result<S::Ok, S::Error> {
    w.map(Wait::name).serialize(s)
}

impl EpochMetrics {
    /// The encoding stage's wall time: the memory record on the encoder's thread (begun in
    /// the pause) or the encoding after the pause, whichever was longer.
    pub fn encode_stage_us(&self) -> u64 {
        self.encode_us.max(self.encode_ahead_us)
    }
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
    prefix_off_epochs: u64,
    /// Epochs per reason they ended for, in the order of `Reason::ALL`.
    cuts: [u64; Reason::ALL.len()],
    /// Epochs per rule that last held their waiting output back, in the order of `Wait::ALL`.
    waits: [u64; Wait::ALL.len()],
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
            prefix_off_epochs: 0,
            cuts: [0; Reason::ALL.len()],
            waits: [0; Wait::ALL.len()],
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
        s.prefix_off_epochs += u64::from(m.prefix_off);
        s.cuts[m.cut.index()] += 1;
        if let Some(w) = m.waited {
            s.waits[w.index()] += 1;
        }
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

mod http;
mod process;
mod render;
mod who;

pub use http::serve;

#[cfg(test)]
mod tests;
