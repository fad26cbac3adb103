//! The leader key of one VM, held with an etcd lease.
//!
//! ```text
//! <prefix>/vm/<id>/leader   "<node>"            attached to the holder's lease
//! <prefix>/vm/<id>/replica  "none" | "session:<hex>"   who may take over (written by the holder)
//! ```
//!
//! The holder may let guest output out only while `now < deadline`, where the deadline is
//! `send time of the last successful keepalive + TTL·(1 − drift) − margin`; etcd deletes the
//! key no earlier than TTL after it processed that keepalive, which is after it was sent, so
//! the holder's right ends before any other node can win the key (docs/FENCING.md).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::etcd::{Client, Compare, EtcdError, Kv, Op};

/// How a node takes part in fencing.
#[derive(Debug, Clone)]
pub struct FenceConfig {
    /// etcd client URLs (`http://host:2379`).
    pub endpoints: Vec<String>,
    /// Key prefix (default `/tandem`).
    pub prefix: String,
    /// The protected VM.
    pub vm_id: u64,
    /// This node's name in the leader key (for operators and logs).
    pub node: String,
    /// Lease TTL (etcd counts whole seconds; at least 2 s).
    pub ttl: Duration,
    /// Bound on the clock-rate difference between this host and etcd's leader.
    pub drift: f64,
    /// Subtracted from the deadline: covers the release in progress and scheduling delays.
    pub margin: Duration,
    /// Timeout of one request to one endpoint.
    pub request_timeout: Duration,
    /// TLS to etcd (`https://` endpoints).
    pub tls: Option<crate::etcd::EtcdTls>,
}

impl FenceConfig {
    /// Defaults: prefix `/tandem`, TTL 3 s, drift 1 %, margin 500 ms, requests 300 ms.
    pub fn new(endpoints: Vec<String>, vm_id: u64, node: impl Into<String>) -> Self {
        FenceConfig {
            endpoints,
            prefix: "/tandem".into(),
            vm_id,
            node: node.into(),
            ttl: Duration::from_secs(3),
            drift: 0.01,
            margin: Duration::from_millis(500),
            request_timeout: Duration::from_millis(300),
            tls: None,
        }
    }

    /// The VM's leader key.
    pub fn leader_key(&self) -> String {
        format!("{}/vm/{}/leader", self.prefix, self.vm_id)
    }

    /// The VM's replica record.
    pub fn replica_key(&self) -> String {
        format!("{}/vm/{}/replica", self.prefix, self.vm_id)
    }

    /// How long the holder's right lasts after a keepalive was sent.
    pub fn right(&self) -> Duration {
        self.ttl
            .mul_f64(1.0 - self.drift)
            .saturating_sub(self.margin)
    }

    /// The keepalive period (TTL / 6).
    pub fn keepalive_every(&self) -> Duration {
        self.ttl / 6
    }
}

/// Which replica may take the VM over, as recorded in etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replica {
    /// None: the VM runs unprotected; no backup may take over.
    None,
    /// The backup that received replication session `.0` (from its hello).
    Session(u64),
}

impl Replica {
    /// The stored value.
    pub fn encode(self) -> Vec<u8> {
        match self {
            Replica::None => b"none".to_vec(),
            Replica::Session(s) => format!("session:{s:016x}").into_bytes(),
        }
    }

    /// Parses a stored value.
    pub fn parse(v: &[u8]) -> Option<Replica> {
        let s = std::str::from_utf8(v).ok()?;
        if s == "none" {
            return Some(Replica::None);
        }
        let hex = s.strip_prefix("session:")?;
        u64::from_str_radix(hex, 16).ok().map(Replica::Session)
    }
}

/// Fencing failed.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// etcd could not be asked.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// Another node holds the VM.
    #[error("VM {vm_id} is held by {by:?} in etcd ({key}); another copy of the guest may run")]
    Held {
        /// The VM.
        vm_id: u64,
        /// The leader key.
        key: String,
        /// Its value (the holder's node name).
        by: String,
    },
    /// A replica may take the VM over: booting a fresh guest would throw it away.
    #[error("etcd records that a backup holds a replica of VM {vm_id} ({key} = {value:?}): start that backup so it resumes the guest, or delete the key (etcdctl del {key}) to boot a fresh one")]
    ReplicaExists {
        /// The VM.
        vm_id: u64,
        /// The replica key.
        key: String,
        /// Its value.
        value: String,
    },
    /// This backup's replica is not the one recorded.
    #[error("this backup may not take VM {vm_id} over: etcd records {recorded:?} as its replica, this backup holds session {session:016x}")]
    NotEligible {
        /// The VM.
        vm_id: u64,
        /// The recorded replica.
        recorded: String,
        /// This backup's session.
        session: u64,
    },
    /// The lease ran out (or the key was taken) while this node held the VM.
    #[error("lost the leader key of VM {0}: the lease expired or another node holds it")]
    Lost(u64),
}

struct Inner {
    client: Client,
    cfg: FenceConfig,
    lease: AtomicI64,
    create_rev: AtomicI64,
    /// Mod revision of this holder's last successful write of the replica record (0: the
    /// last write's outcome is unknown).
    replica_rev: AtomicI64,
    start: Instant,
    /// Microseconds since `start` until which output may leave (0: never).
    deadline_us: AtomicU64,
    lost: AtomicBool,
    stop: AtomicBool,
    recorded: Mutex<Option<Replica>>,
}

impl Inner {
    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    fn extend(&self, sent: Instant) {
        let until = (sent + self.cfg.right()).saturating_duration_since(self.start);
        self.deadline_us
            .fetch_max(until.as_micros() as u64, Ordering::SeqCst);
    }
}

/// This node holds the VM's leader key. Cloning shares it.
#[derive(Clone)]
pub struct Holder {
    inner: Arc<Inner>,
}

/// How a campaign ends when it did not fail.
pub enum Outcome {
    /// This node holds the key now.
    Won(Holder),
    /// Another node holds it (its value).
    Held(String),
}

fn text(v: &[u8]) -> String {
    String::from_utf8_lossy(v).into_owned()
}

/// What a campaign claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// A primary booting a fresh guest: no replica session may be recorded.
    Fresh,
    /// A backup holding replication session `.0` resumes the guest.
    Takeover(u64),
    /// A holder whose lease expired takes the key back, if the replica record is still the
    /// one it wrote last (same mod revision: nobody took over or booted a fresh guest since).
    Reacquire {
        /// The mod revision of the holder's last successful write of the replica record.
        replica_rev: i64,
        /// What it wrote.
        replica: Replica,
    },
}

/// Campaigns for the VM's leader key: `If(leader absent ∧ replica condition) Then put leader
/// (with a new lease) and the replica record` (`none`, or the same record for
/// [`Claim::Reacquire`]).
pub fn campaign(cfg: &FenceConfig, claim: Claim) -> Result<Outcome, FenceError> {
    let client = Client::with_tls(&cfg.endpoints, cfg.request_timeout, cfg.tls.as_ref())?;
    let (leader, replica) = (cfg.leader_key(), cfg.replica_key());
    let after = match claim {
        Claim::Reacquire { replica: r, .. } => r,
        _ => Replica::None,
    };
    // A key that is held needs no lease to find out (the backup asks every 100 ms).
    if let Some(l) = client.get(&leader)? {
        return Ok(Outcome::Held(text(&l.value)));
    }
    let cond = match claim {
        Claim::Takeover(s) => Compare::Value(replica.clone(), Replica::Session(s).encode()),
        Claim::Reacquire { replica_rev, .. } => Compare::ModRevision(replica.clone(), replica_rev),
        Claim::Fresh => {
            let seen = client.get(&replica)?;
            if let Some(kv) = &seen {
                if matches!(Replica::parse(&kv.value), Some(Replica::Session(_))) {
                    return Err(FenceError::ReplicaExists {
                        vm_id: cfg.vm_id,
                        key: replica,
                        value: text(&kv.value),
                    });
                }
            }
            Compare::ModRevision(replica.clone(), seen.map_or(0, |kv| kv.mod_revision))
        }
    };
    let sent = Instant::now();
    let (lease, _ttl) = client.grant(cfg.ttl.as_secs().max(2))?;
    let txn = client.txn(
        &[Compare::CreateRevision(leader.clone(), 0), cond],
        &[
            Op::Put(leader.clone(), cfg.node.as_bytes().to_vec(), lease),
            Op::Put(replica.clone(), after.encode(), 0),
            Op::Get(leader.clone()),
            Op::Get(replica.clone()),
        ],
        &[Op::Get(leader.clone()), Op::Get(replica.clone())],
    );
    let r = match txn {
        Ok(r) => r,
        Err(e) => {
            // The reply was lost, but the transaction may have committed: if the key is on
            // our lease, we won; otherwise give the lease back and report the error.
            if let (Ok(Some(l)), Ok(rep)) = (client.get(&leader), client.get(&replica)) {
                if l.lease == lease {
                    let rev = rep.map_or(0, |kv| kv.mod_revision);
                    return won(client, cfg, lease, l.create_revision, rev, after, sent);
                }
            }
            let _ = client.revoke(lease);
            return Err(e.into());
        }
    };
    if !r.succeeded {
        let _ = client.revoke(lease);
        if let Some(Some(l)) = r.reads.first() {
            return Ok(Outcome::Held(text(&l.value)));
        }
        let recorded = r.reads.get(1).cloned().flatten().map(|kv| text(&kv.value));
        return Err(match claim {
            Claim::Takeover(session) => FenceError::NotEligible {
                vm_id: cfg.vm_id,
                recorded: recorded.unwrap_or_else(|| "nothing".into()),
                session,
            },
            Claim::Reacquire { .. } => FenceError::Lost(cfg.vm_id),
            // The replica record changed between our read and the transaction.
            Claim::Fresh => FenceError::ReplicaExists {
                vm_id: cfg.vm_id,
                key: replica,
                value: recorded.unwrap_or_default(),
            },
        });
    }
    let read = |i: usize| r.reads.get(i).cloned().flatten();
    let create_rev = read(0).map_or(0, |kv: Kv| kv.create_revision);
    let replica_rev = read(1).map_or(0, |kv: Kv| kv.mod_revision);
    won(client, cfg, lease, create_rev, replica_rev, after, sent)
}

/// The holder of a won key: starts its keepalive thread.
fn won(
    client: Client,
    cfg: &FenceConfig,
    lease: i64,
    create_rev: i64,
    replica_rev: i64,
    recorded: Replica,
    sent: Instant,
) -> Result<Outcome, FenceError> {
    let inner = Arc::new(Inner {
        client,
        cfg: cfg.clone(),
        lease: AtomicI64::new(lease),
        create_rev: AtomicI64::new(create_rev),
        replica_rev: AtomicI64::new(replica_rev),
        start: sent,
        deadline_us: AtomicU64::new(0),
        lost: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        recorded: Mutex::new(Some(recorded)),
    });
    inner.extend(sent);
    let me = Arc::downgrade(&inner);
    std::thread::Builder::new()
        .name("tandem-lease".into())
        .spawn(move || keepalive_loop(me))
        .map_err(|e| EtcdError::Unreachable {
            endpoints: cfg.endpoints.join(","),
            last: format!("cannot start the keepalive thread: {e}"),
        })?;
    Ok(Outcome::Won(Holder { inner }))
}

/// Renews the lease every TTL/6 until the holder is dropped, resigns or the lease is gone.
fn keepalive_loop(weak: std::sync::Weak<Inner>) {
    let mut failing = false;
    loop {
        let Some(me) = weak.upgrade() else { return };
        if me.stop.load(Ordering::SeqCst) || me.lost.load(Ordering::SeqCst) {
            return;
        }
        let every = me.cfg.keepalive_every();
        let sent = Instant::now();
        match me.client.keepalive(me.lease.load(Ordering::SeqCst)) {
            Ok(Some(_)) => {
                me.extend(sent);
                if std::mem::take(&mut failing) {
                    tracing::info!("lease renewed again");
                }
            }
            Ok(None) => {
                tracing::warn!("the lease of VM {} expired", me.cfg.vm_id);
                me.lost.store(true, Ordering::SeqCst);
                return;
            }
            Err(e) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!("cannot renew the lease: {e}");
                }
            }
        }
        let pause = every.saturating_sub(sent.elapsed());
        drop(me);
        std::thread::sleep(pause);
    }
}

impl Holder {
    /// Whether output may leave now (the lease is certainly still valid).
    pub fn valid(&self) -> bool {
        let i = &self.inner;
        !i.lost.load(Ordering::SeqCst) && i.now_us() < i.deadline_us.load(Ordering::SeqCst)
    }

    /// Time left until the deadline (zero when past it).
    pub fn remaining(&self) -> Duration {
        let i = &self.inner;
        if i.lost.load(Ordering::SeqCst) {
            return Duration::ZERO;
        }
        Duration::from_micros(
            i.deadline_us
                .load(Ordering::SeqCst)
                .saturating_sub(i.now_us()),
        )
    }

    /// Whether etcd said the lease is gone (renewing cannot bring it back).
    pub fn expired(&self) -> bool {
        self.inner.lost.load(Ordering::SeqCst)
    }

    /// A check for the relay: output may pass while it returns true.
    pub fn gate(&self) -> Arc<dyn Fn() -> bool + Send + Sync> {
        let me = self.clone();
        Arc::new(move || me.valid())
    }

    /// The replica this holder last recorded.
    pub fn recorded(&self) -> Option<Replica> {
        *self
            .inner
            .recorded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Records which replica may take over, guarded by this holder's key (`If(create
    /// revision of leader == ours)`). Call it before letting any output out that depends on
    /// it: `None` before unprotected output, `Session(s)` before a session's epochs count.
    pub fn record(&self, replica: Replica) -> Result<(), FenceError> {
        let i = &self.inner;
        // Until the outcome is known, nothing is known: no reacquire on a stale record.
        *i.recorded.lock().unwrap_or_else(|e| e.into_inner()) = None;
        i.replica_rev.store(0, Ordering::SeqCst);
        let r = i.client.txn(
            &[Compare::CreateRevision(
                i.cfg.leader_key(),
                i.create_rev.load(Ordering::SeqCst),
            )],
            &[
                Op::Put(i.cfg.replica_key(), replica.encode(), 0),
                Op::Get(i.cfg.replica_key()),
            ],
            &[],
        )?;
        if !r.succeeded {
            i.lost.store(true, Ordering::SeqCst);
            return Err(FenceError::Lost(i.cfg.vm_id));
        }
        let rev = r
            .reads
            .first()
            .cloned()
            .flatten()
            .map_or(0, |kv| kv.mod_revision);
        i.replica_rev.store(rev, Ordering::SeqCst);
        *i.recorded.lock().unwrap_or_else(|e| e.into_inner()) = Some(replica);
        Ok(())
    }

    /// The claim that takes this holder's key back after its lease expired (`None`: the last
    /// write of the replica record has an unknown outcome, so taking the key back could revive
    /// a stale copy).
    pub fn reacquire_claim(&self) -> Option<Claim> {
        let rev = self.inner.replica_rev.load(Ordering::SeqCst);
        let replica = self.recorded()?;
        (rev > 0).then_some(Claim::Reacquire {
            replica_rev: rev,
            replica,
        })
    }

    /// Gives the key up at once (planned handover): the lease is revoked, so the key is
    /// deleted and the backup need not wait for it to expire. Output stops first.
    pub fn resign(&self) -> Result<(), FenceError> {
        let i = &self.inner;
        i.lost.store(true, Ordering::SeqCst);
        i.stop.store(true, Ordering::SeqCst);
        i.client.revoke(i.lease.load(Ordering::SeqCst))?;
        Ok(())
    }

    /// The configuration it was won with.
    pub fn config(&self) -> &FenceConfig {
        &self.inner.cfg
    }

    /// The leader key's node name.
    pub fn node(&self) -> &str {
        &self.inner.cfg.node
    }

    /// The VM's leader key.
    pub fn key(&self) -> String {
        self.inner.cfg.leader_key()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_records_round_trip_and_garbage_is_refused() {
        for r in [
            Replica::None,
            Replica::Session(0),
            Replica::Session(u64::MAX),
        ] {
            assert_eq!(Replica::parse(&r.encode()), Some(r));
        }
        for bad in [&b""[..], b"nonex", b"session:", b"session:xyz", b"\xff"] {
            assert_eq!(Replica::parse(bad), None);
        }
    }

    #[test]
    fn the_right_ends_before_the_ttl() {
        let c = FenceConfig::new(vec![], 1, "n");
        assert_eq!(c.right(), Duration::from_millis(2470));
        assert_eq!(c.keepalive_every(), Duration::from_millis(500));
        assert_eq!(c.leader_key(), "/tandem/vm/1/leader");
    }
}
