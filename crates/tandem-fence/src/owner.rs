//! The ownership record in etcd: every transition of [`crate::record`] as one compare-and-swap
//! on the record's mod revision, made idempotent by reading back.
//!
//! A transaction whose reply is lost may have committed (etcd issue #12290: a timed-out
//! request is resent to the next member by [`crate::etcd::Client`]). The write is kept as
//! *pending* with the revision it compared against, and resent (same op id) until a reply or a
//! read shows either the op id — our own write, which counts as won — or a newer revision that
//! is not ours: then the pending write can never commit any more and has definitely lost.
//! Nothing is decided on an unknown outcome; the caller retries later and the pending write
//! is resolved first.
//!
//! [`Owner`] is the node that runs the guest: it makes the owner's transitions and reads the
//! record back every `watch_every`, so that a change it did not make (a takeover, an operator
//! override) stops its copy even when no other message reaches it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::etcd::{Client, Compare, EtcdError, Op};
use crate::record::{owned_by, plan, Record, Refusal, Transition};

/// How a node takes part in fencing. In configuration files: `endpoints`, `vm_id` and `node`
/// are required; durations are written as `"300ms"`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct FenceConfig {
    /// etcd client URLs (`http://host:2379`).
    pub endpoints: Vec<String>,
    /// Key prefix (default `/tandem`).
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// The protected VM.
    pub vm_id: u64,
    /// This node's name in the record (for operators and logs).
    pub node: String,
    /// Timeout of one request to one endpoint (default 300 ms).
    #[serde(default = "default_request_timeout", with = "humantime_serde")]
    pub request_timeout: Duration,
    /// TLS to etcd (`https://` endpoints).
    #[serde(default)]
    pub tls: Option<crate::etcd::EtcdTls>,
    /// How often the owner reads the record back (default 500 ms).
    #[serde(default = "default_watch_every", with = "humantime_serde")]
    pub watch_every: Duration,
}

fn default_prefix() -> String {
    "/tandem".into()
}

fn default_request_timeout() -> Duration {
    Duration::from_millis(300)
}

fn default_watch_every() -> Duration {
    Duration::from_millis(500)
}

impl FenceConfig {
    /// Defaults: prefix `/tandem`, requests 300 ms per endpoint, read back every 500 ms.
    pub fn new(endpoints: Vec<String>, vm_id: u64, node: impl Into<String>) -> Self {
        FenceConfig {
            endpoints,
            prefix: default_prefix(),
            vm_id,
            node: node.into(),
            request_timeout: default_request_timeout(),
            tls: None,
            watch_every: default_watch_every(),
        }
    }

    /// The VM's ownership record.
    pub fn key(&self) -> String {
        format!("{}/vm/{}/owner", self.prefix, self.vm_id)
    }

    /// This node's status report (`tandem list`): `PREFIX/vm/ID/node/NODE`.
    pub fn report_key(&self) -> String {
        self.report_key_of(&self.node)
    }

    /// Node `node`'s status report: `PREFIX/vm/ID/node/NODE`.
    pub fn report_key_of(&self, node: &str) -> String {
        format!("{}/vm/{}/node/{node}", self.prefix, self.vm_id)
    }

    /// The libvirt domain the VM was adopted from (its marked definition, which each node's
    /// libvirt is given): `PREFIX/vm/ID/libvirt`.
    pub fn libvirt_key(&self) -> String {
        format!("{}/vm/{}/libvirt", self.prefix, self.vm_id)
    }
}

/// Fencing failed.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// etcd could not be asked; a write's outcome is unknown until it is asked again.
    #[error("etcd (outcome unknown until it answers again)")]
    Etcd(#[from] EtcdError),
    /// The record does not allow it.
    #[error("VM {vm_id} ({key}): {refusal}")]
    Refused {
        /// The VM.
        vm_id: u64,
        /// The record's key.
        key: String,
        /// Why.
        refusal: Refusal,
    },
    /// The key holds something that is not an ownership record.
    #[error("{key} holds {value:?}, which is not a tandem ownership record: nothing is changed; inspect it with `etcdctl get {key}`")]
    Corrupt {
        /// The key.
        key: String,
        /// Its value, shortened.
        value: String,
    },
    /// The record kept changing under us.
    #[error("the record of VM {0} changed on every one of 16 attempts: another writer keeps changing it")]
    Contention(u64),
}

impl FenceError {
    /// The refusal, if the record did not allow the transition.
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            FenceError::Refused { refusal, .. } => Some(refusal),
            _ => None,
        }
    }

    /// Whether the outcome is unknown (etcd did not answer): try again later.
    pub fn unknown(&self) -> bool {
        matches!(self, FenceError::Etcd(_))
    }
}

/// What both daemons of a replication session must agree on: the same record in the same
/// etcd cluster (carried in the hello; docs/FENCING.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    /// etcd's cluster id (0: not known yet).
    pub cluster_id: u64,
    /// FNV-1a of the record's key (prefix and VM id).
    pub key_hash: u64,
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A random 64-bit id (op ids, sessions).
pub fn random_id() -> u64 {
    use std::io::Read;
    let mut b = [0u8; 8];
    let ok = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if ok.is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        b = (t.as_nanos() as u64 ^ ((std::process::id() as u64) << 40)).to_le_bytes();
    }
    u64::from_le_bytes(b).max(1)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The record as read: its value (`None`: no record) and mod revision (0: absent).
type Seen = (Option<Record>, i64);

/// One VM's record in one etcd cluster.
pub struct Fence {
    client: Client,
    cfg: FenceConfig,
    /// A write whose outcome is not known yet.
    pending: Mutex<Option<Pending>>,
    /// The record as last read or written, with its revision.
    last: Mutex<Option<Seen>>,
}

/// A write whose outcome is not known yet: the record, the revision it compares against and
/// the transition it makes.
#[derive(Clone)]
struct Pending {
    record: Record,
    rev: i64,
    t: Transition,
}

impl Fence {
    /// A client of the cluster for the VM of `cfg` (no request is made yet).
    pub fn connect(cfg: FenceConfig) -> Result<Arc<Fence>, FenceError> {
        let client = Client::with_tls(&cfg.endpoints, cfg.request_timeout, cfg.tls.as_ref())?;
        Ok(Arc::new(Fence {
            client,
            cfg,
            pending: Mutex::new(None),
            last: Mutex::new(None),
        }))
    }

    /// The configuration.
    pub fn config(&self) -> &FenceConfig {
        &self.cfg
    }

    /// What the hello carries (the cluster id is known after the first answer).
    pub fn descriptor(&self) -> Descriptor {
        Descriptor {
            cluster_id: self.client.cluster_id(),
            key_hash: fnv1a(&self.cfg.key()),
        }
    }

    fn parse(&self, kv: Option<crate::etcd::Kv>) -> Result<Seen, FenceError> {
        match kv {
            None => Ok((None, 0)),
            Some(kv) => match Record::parse(&kv.value) {
                Some(r) => Ok((Some(r), kv.mod_revision)),
                None => Err(FenceError::Corrupt {
                    key: self.cfg.key(),
                    value: String::from_utf8_lossy(&kv.value)
                        .chars()
                        .take(120)
                        .collect(),
                }),
            },
        }
    }

    /// Writes this node's status report (unconditionally: nothing depends on it; the record
    /// alone decides who runs the guest).
    pub fn report(&self, doc: &[u8]) -> Result<(), FenceError> {
        let put = crate::etcd::Op::Put(self.cfg.report_key(), doc.to_vec(), 0);
        self.client.txn(&[], &[put], &[])?;
        Ok(())
    }

    /// Node `node`'s last status report, if it wrote one.
    pub fn report_of(&self, node: &str) -> Result<Option<Vec<u8>>, FenceError> {
        Ok(self
            .client
            .get(&self.cfg.report_key_of(node))?
            .map(|kv| kv.value))
    }

    /// Writes the definition of the libvirt domain the VM was adopted from (unconditionally:
    /// the adopting node alone writes it, once; the record alone decides who runs the guest).
    pub fn put_libvirt(&self, doc: &[u8]) -> Result<(), FenceError> {
        let put = crate::etcd::Op::Put(self.cfg.libvirt_key(), doc.to_vec(), 0);
        self.client.txn(&[], &[put], &[])?;
        Ok(())
    }

    /// The definition of the libvirt domain the VM was adopted from, if it was.
    pub fn libvirt(&self) -> Result<Option<Vec<u8>>, FenceError> {
        Ok(self.client.get(&self.cfg.libvirt_key())?.map(|kv| kv.value))
    }

    /// Reads the record.
    pub fn read(&self) -> Result<Option<Record>, FenceError> {
        Ok(self.read_seen()?.0)
    }

    fn read_seen(&self) -> Result<Seen, FenceError> {
        let kv = self.client.get(&self.cfg.key())?;
        let seen = self.parse(kv)?;
        self.remember(&seen);
        Ok(seen)
    }

    /// Keeps the record as last seen (a write may be planned on it: its compare-and-swap
    /// fails if it changed since).
    fn remember(&self, seen: &Seen) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(seen.clone());
    }

    fn refused(&self, refusal: Refusal) -> FenceError {
        FenceError::Refused {
            vm_id: self.cfg.vm_id,
            key: self.cfg.key(),
            refusal,
        }
    }

    /// Sends the pending write, if any, and forgets it once decided. Returns `None` without
    /// one; else the record as it is now and whether the pending write is in it (ours; it
    /// committed now or earlier) or not (the revision moved on to someone else's write, so it
    /// can never commit), with the transition it made.
    fn resolve(&self) -> Result<Option<(Seen, bool, Transition)>, FenceError> {
        let Some(p) = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        else {
            return Ok(None);
        };
        let key = self.cfg.key();
        let r = self.client.txn(
            &[Compare::ModRevision(key.clone(), p.rev)],
            &[
                Op::Put(key.clone(), p.record.encode(), 0),
                Op::Get(key.clone()),
            ],
            &[Op::Get(key)],
        )?;
        let seen = self.parse(r.reads.first().cloned().flatten())?;
        self.remember(&seen);
        let ours = seen.0.as_ref().is_some_and(|c| c.op == p.record.op);
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(Some((seen, ours, p.t)))
    }

    /// Makes transition `t`; returns the record after it.
    fn apply(&self, t: &Transition) -> Result<Record, FenceError> {
        // The record as last seen saves a round trip when it is still current (the
        // compare-and-swap checks that); a refusal or "nothing to write" is only ever
        // decided on a record read now.
        let mut seen = None;
        let mut cached = self.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for _ in 0..16 {
            match self.resolve()? {
                // Our write of this transition (now, or in an earlier call whose reply was
                // lost): done.
                Some(((Some(r), _), true, pt)) if pt == *t => return Ok(r),
                Some((s, _, _)) => {
                    seen = Some(s);
                    cached = None;
                }
                None => {}
            }
            let (from_cache, (current, rev)) = match (seen.take(), cached.take()) {
                (Some(s), _) => (false, s),
                (None, Some(c)) => (true, c),
                (None, None) => (false, self.read_seen()?),
            };
            let planned = plan(current.as_ref(), t, random_id(), unix_ms());
            let planned = match planned {
                Ok(Some(_)) => planned,
                _ if from_cache => continue,
                _ => planned,
            }
            .map_err(|r| self.refused(r))?;
            let Some(record) = planned else {
                // The record says it already (nothing to write).
                return current.ok_or_else(|| self.refused(Refusal::NotEligible(None)));
            };
            *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(Pending {
                record,
                rev,
                t: t.clone(),
            });
        }
        Err(FenceError::Contention(self.cfg.vm_id))
    }

    /// Reads the record every `every` on a thread of its own while the fence is in use, so
    /// that the connection to etcd stays open (a takeover then costs one round trip, not a
    /// TLS handshake) and the cluster id is known.
    pub fn keep_warm(self: &Arc<Self>, every: Duration) {
        let weak = Arc::downgrade(self);
        let _ = std::thread::Builder::new()
            .name("tandem-etcd".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                let Some(f) = weak.upgrade() else { return };
                let _ = f.read();
            });
    }

    /// Claims the VM for a fresh guest on this node: only a new VM (no record) or one stopped
    /// on purpose. The guest may boot once this returns.
    pub fn boot(self: &Arc<Self>) -> Result<Owner, FenceError> {
        let r = self.apply(&Transition::Boot {
            node: self.cfg.node.clone(),
        })?;
        Ok(Owner::new(self.clone(), r))
    }

    /// The backup that received session `session` takes the VM over: only if the record
    /// names that session as the one that may. The guest may resume once this returns.
    pub fn take_over(self: &Arc<Self>, session: u64) -> Result<Owner, FenceError> {
        let r = self.apply(&Transition::Takeover {
            node: self.cfg.node.clone(),
            session,
        })?;
        Ok(Owner::new(self.clone(), r))
    }

    /// An operator declares the copy of generation `gen` gone: the record says stopped, and a
    /// fresh boot may claim the VM. Whatever that copy did since its generation began is
    /// thrown away.
    pub fn override_stop(&self, gen: u64) -> Result<Record, FenceError> {
        self.apply(&Transition::Override { gen })
    }
}

struct OwnerInner {
    fence: Arc<Fence>,
    gen: u64,
    record: Mutex<Record>,
    /// Set once this node learned that it no longer owns the VM (what the record said).
    fenced: Mutex<Option<String>>,
    fenced_flag: AtomicBool,
    /// The owner ended its ownership on purpose (stopped, handed over): no more read-backs.
    done: AtomicBool,
}

/// This node runs the guest (it booted or took over generation [`Owner::generation`]).
/// Cloning shares it.
#[derive(Clone)]
pub struct Owner {
    inner: Arc<OwnerInner>,
}

impl Owner {
    fn new(fence: Arc<Fence>, r: Record) -> Owner {
        Owner {
            inner: Arc::new(OwnerInner {
                fence,
                gen: r.gen,
                record: Mutex::new(r),
                fenced: Mutex::new(None),
                fenced_flag: AtomicBool::new(false),
                done: AtomicBool::new(false),
            }),
        }
    }

    /// The generation this node runs.
    pub fn generation(&self) -> u64 {
        self.inner.gen
    }

    /// The record as this node last wrote or read it.
    pub fn record(&self) -> Record {
        self.inner
            .record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The fence (for its descriptor and configuration).
    pub fn fence(&self) -> &Arc<Fence> {
        &self.inner.fence
    }

    fn node(&self) -> String {
        self.inner.fence.cfg.node.clone()
    }

    fn mark_fenced(&self, what: String) {
        let mut f = self.inner.fenced.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            tracing::warn!("VM {}: {what}", self.inner.fence.cfg.vm_id);
            *f = Some(what);
        }
        self.inner.fenced_flag.store(true, Ordering::SeqCst);
    }

    /// Whether this node learned that it no longer owns the VM.
    pub fn is_fenced(&self) -> bool {
        self.inner.fenced_flag.load(Ordering::SeqCst)
    }

    /// What the record said when this node learned it no longer owns the VM.
    pub fn fenced(&self) -> Option<String> {
        self.inner
            .fenced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn owner_transition(&self, t: Transition) -> Result<(), FenceError> {
        match self.inner.fence.apply(&t) {
            Ok(r) => {
                *self.inner.record.lock().unwrap_or_else(|e| e.into_inner()) = r;
                Ok(())
            }
            Err(e) => {
                if let Some(Refusal::Fenced(r)) = e.refusal() {
                    self.mark_fenced(r.as_ref().map_or_else(
                        || "the ownership record is gone".to_string(),
                        Record::describe,
                    ));
                }
                Err(e)
            }
        }
    }

    /// Records that the backup of session `session` may take over (before that session's
    /// epochs count).
    pub fn protect(&self, session: u64) -> Result<(), FenceError> {
        self.owner_transition(Transition::Protect {
            node: self.node(),
            gen: self.inner.gen,
            session,
        })
    }

    /// Records that no backup may take over (before output passes without
    /// acknowledgements).
    pub fn unprotect(&self) -> Result<(), FenceError> {
        self.owner_transition(Transition::Unprotect {
            node: self.node(),
            gen: self.inner.gen,
        })
    }

    /// Records that the guest was shut down on purpose: a fresh boot may claim the VM.
    pub fn stop(&self) -> Result<(), FenceError> {
        let r = self.owner_transition(Transition::Stop {
            node: self.node(),
            gen: self.inner.gen,
        });
        if r.is_ok() {
            self.end();
        }
        r
    }

    /// Ends this node's ownership without writing (the guest was handed over, or this copy
    /// stopped): the read-back stops.
    pub fn end(&self) {
        self.inner.done.store(true, Ordering::SeqCst);
    }

    /// Whether the record read now still names this node's generation (`Err`: etcd did not
    /// answer). A record that does not marks this owner fenced.
    pub fn check(&self) -> Result<bool, FenceError> {
        let r = self.inner.fence.read()?;
        let node = self.node();
        if owned_by(r.as_ref(), &node, self.inner.gen) {
            if let Some(r) = r {
                *self.inner.record.lock().unwrap_or_else(|e| e.into_inner()) = r;
            }
            return Ok(true);
        }
        self.mark_fenced(r.as_ref().map_or_else(
            || "the ownership record was deleted".to_string(),
            Record::describe,
        ));
        Ok(false)
    }

    /// Reads the record back every `watch_every` on a thread of its own until the owner is
    /// dropped or [`Owner::end`]s: a record that no longer names this node's generation marks
    /// it fenced ([`Owner::is_fenced`]).
    pub fn watch(&self) {
        let weak: Weak<OwnerInner> = Arc::downgrade(&self.inner);
        let every = self.inner.fence.cfg.watch_every;
        let _ = std::thread::Builder::new()
            .name("tandem-owner".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                let Some(inner) = weak.upgrade() else { return };
                if inner.done.load(Ordering::SeqCst) || inner.fenced_flag.load(Ordering::SeqCst) {
                    return;
                }
                let _ = (Owner { inner }).check();
            });
    }
}
