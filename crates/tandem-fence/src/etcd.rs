//! A small etcd v3 client over etcd's JSON gateway (`/v3/...`, HTTP POST, keys and values in
//! base64, 64-bit integers as strings). It needs only an HTTP client, so the daemons stay
//! synchronous (see docs/FENCING.md for why not the gRPC `etcd-client` crate).
//!
//! Every request tries the endpoints in turn, starting with the last one that answered, each
//! with a short timeout: a member cut from its quorum does not answer linearizable requests,
//! and the next member is tried.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};

/// A failed etcd request.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint answered.
    #[error("no etcd endpoint answered ({endpoints}): {last}")]
    Unreachable {
        /// The endpoints tried.
        endpoints: String,
        /// The last endpoint's error.
        last: String,
    },
    /// An endpoint answered with something that is not the expected JSON.
    #[error("etcd answered {path} with an unexpected reply: {reply}")]
    Reply {
        /// The request path.
        path: &'static str,
        /// The reply, shortened.
        reply: String,
    },
    /// No endpoints were given.
    #[error("no etcd endpoints given (use --etcd http://HOST:2379[,...])")]
    NoEndpoints,
    /// The TLS material for etcd could not be read.
    #[error("etcd TLS: {0}")]
    Tls(String),
}

/// TLS to etcd (`https://` endpoints): the CA that signed the members' certificates and, for
/// clusters with `--client-cert-auth`, this client's certificate and key (PEM files).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdTls {
    /// CA certificate(s).
    pub ca: std::path::PathBuf,
    /// Client certificate chain.
    pub cert: Option<std::path::PathBuf>,
    /// Client private key.
    pub key: Option<std::path::PathBuf>,
}

impl EtcdTls {
    fn config(&self) -> Result<ureq::tls::TlsConfig, EtcdError> {
        use ureq::tls::{parse_pem, Certificate, ClientCert, PemItem, PrivateKey, RootCerts};
        // One process-wide provider (ring, as the replication link's TLS); set once.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|e| EtcdError::Tls(format!("reading {}: {e}", p.display())))
        };
        let certs = |p: &std::path::Path| -> Result<Vec<Certificate<'static>>, EtcdError> {
            let pem = read(p)?;
            let c: Vec<_> = parse_pem(&pem)
                .filter_map(|i| match i {
                    Ok(PemItem::Certificate(c)) => Some(c.to_owned()),
                    _ => None,
                })
                .collect();
            if c.is_empty() {
                return Err(EtcdError::Tls(format!(
                    "{} holds no PEM certificate",
                    p.display()
                )));
            }
            Ok(c)
        };
        let mut b = ureq::tls::TlsConfig::builder()
            .provider(ureq::tls::TlsProvider::Rustls)
            .root_certs(RootCerts::new_with_certs(&certs(&self.ca)?));
        match (&self.cert, &self.key) {
            (Some(c), Some(k)) => {
                let key = PrivateKey::from_pem(&read(k)?).map_err(|e| {
                    EtcdError::Tls(format!("{} holds no PEM private key: {e}", k.display()))
                })?;
                b = b.client_cert(Some(ClientCert::new_with_certs(&certs(c)?, key)));
            }
            (None, None) => {}
            _ => {
                return Err(EtcdError::Tls(
                    "a client certificate needs its key and the other way round (--etcd-cert with --etcd-key)".into(),
                ))
            }
        }
        Ok(b.build())
    }
}

/// A key as etcd stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    /// The value.
    pub value: Vec<u8>,
    /// Revision of the key's creation (0: absent).
    pub create_revision: i64,
    /// Revision of its last change.
    pub mod_revision: i64,
    /// The lease it is attached to (0: none).
    pub lease: i64,
}

/// One comparison of a transaction (all must hold).
#[derive(Debug, Clone)]
pub enum Compare {
    /// The key's create revision equals this (0: the key does not exist).
    CreateRevision(String, i64),
    /// The key's mod revision equals this (0: the key does not exist).
    ModRevision(String, i64),
    /// The key exists with this value.
    Value(String, Vec<u8>),
}

/// One operation of a transaction.
#[derive(Debug, Clone)]
pub enum Op {
    /// Put a value, attached to a lease (0: none).
    Put(String, Vec<u8>, i64),
    /// Read a key.
    Get(String),
    /// Delete a key.
    Delete(String),
}

/// The outcome of a transaction.
#[derive(Debug, Clone, Default)]
pub struct TxnResult {
    /// Whether every comparison held (the success branch ran).
    pub succeeded: bool,
    /// The keys read by the branch that ran, in order (`None`: absent).
    pub reads: Vec<Option<Kv>>,
}

/// An etcd client over the JSON gateway.
pub struct Client {
    endpoints: Vec<String>,
    agent: ureq::Agent,
    preferred: AtomicUsize,
    cluster_id: AtomicU64,
}

fn b64(s: &[u8]) -> String {
    B64.encode(s)
}

fn int(v: &Value) -> i64 {
    match v {
        // Unsigned ids (cluster_id) may exceed i64: keep their bits.
        Value::String(s) => s
            .parse::<i64>()
            .or_else(|_| s.parse::<u64>().map(|u| u as i64))
            .unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn kv_of(v: &Value) -> Option<Kv> {
    kv_at(v.get("kvs")?.as_array()?.first()?)
}

fn kv_at(first: &Value) -> Option<Kv> {
    Some(Kv {
        value: first
            .get("value")
            .and_then(Value::as_str)
            .and_then(|s| B64.decode(s).ok())
            .unwrap_or_default(),
        create_revision: first.get("create_revision").map_or(0, int),
        mod_revision: first.get("mod_revision").map_or(0, int),
        lease: first.get("lease").map_or(0, int),
    })
}

impl Client {
    /// A client of the cluster at `endpoints` (`http://host:port`), each request bounded by
    /// `timeout` per endpoint.
    pub fn new(endpoints: &[String], timeout: Duration) -> Result<Client, EtcdError> {
        Self::with_tls(endpoints, timeout, None)
    }

    /// Like [`Client::new`], with TLS for `https://` endpoints.
    pub fn with_tls(
        endpoints: &[String],
        timeout: Duration,
        tls: Option<&EtcdTls>,
    ) -> Result<Client, EtcdError> {
        if endpoints.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        if tls.is_none() && endpoints.iter().any(|e| e.starts_with("https://")) {
            return Err(EtcdError::Tls(
                "https:// endpoints need the CA of the etcd members (--etcd-ca, and --etcd-cert/--etcd-key if the cluster asks for client certificates)".into(),
            ));
        }
        let mut b = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false);
        if let Some(t) = tls {
            b = b.tls_config(t.config()?);
        }
        let agent = b.build().into();
        Ok(Client {
            endpoints: endpoints
                .iter()
                .map(|e| e.trim_end_matches('/').to_string())
                .collect(),
            agent,
            preferred: AtomicUsize::new(0),
            cluster_id: AtomicU64::new(0),
        })
    }

    /// The cluster id from the last answer's header (0: none yet).
    pub fn cluster_id(&self) -> u64 {
        self.cluster_id.load(Ordering::Relaxed)
    }

    /// The endpoints, comma-separated.
    pub fn endpoints(&self) -> String {
        self.endpoints.join(",")
    }

    /// POSTs `body` to `path` on the first endpoint that answers with JSON; gateway errors
    /// (`{"error": ...}`, e.g. no leader) count as "did not answer" and the next is tried.
    fn post(&self, path: &'static str, body: &Value) -> Result<Value, EtcdError> {
        let n = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed) % n;
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            let url = format!("{}{path}", self.endpoints[at]);
            let t = std::time::Instant::now();
            let r = self
                .agent
                .post(&url)
                .send_json(body)
                .and_then(|r| r.into_body().read_json::<Value>());
            tracing::debug!(
                "etcd {path} at {}: {:.1} ms{}",
                self.endpoints[at],
                t.elapsed().as_secs_f64() * 1000.0,
                if r.is_ok() { "" } else { " (failed)" }
            );
            match r {
                Ok(v) if v.get("error").is_some() => {
                    last = format!("{}: {}", self.endpoints[at], v["error"]);
                }
                Ok(v) => {
                    self.preferred.store(at, Ordering::Relaxed);
                    if let Some(id) = v.get("header").and_then(|h| h.get("cluster_id")) {
                        self.cluster_id.store(int(id) as u64, Ordering::Relaxed);
                    }
                    return Ok(v);
                }
                Err(e) => last = format!("{}: {e}", self.endpoints[at]),
            }
        }
        Err(EtcdError::Unreachable {
            endpoints: self.endpoints(),
            last,
        })
    }

    /// The answering member's status (its header's member id, the leader's id).
    pub fn status(&self) -> Result<Value, EtcdError> {
        self.post("/v3/maintenance/status", &json!({}))
    }

    /// Reads one key.
    pub fn get(&self, key: &str) -> Result<Option<Kv>, EtcdError> {
        let v = self.post("/v3/kv/range", &json!({ "key": b64(key.as_bytes()) }))?;
        if v.get("header").is_none() {
            return Err(reply("/v3/kv/range", &v));
        }
        Ok(kv_of(&v))
    }

    /// Reads every key that starts with `prefix` (at most `limit`), with its name.
    pub fn range_prefix(&self, prefix: &str, limit: u64) -> Result<Vec<(String, Kv)>, EtcdError> {
        let mut end = prefix.as_bytes().to_vec();
        match end.last_mut() {
            Some(b) if *b < 0xff => *b += 1,
            _ => end.push(0),
        }
        let v = self.post(
            "/v3/kv/range",
            &json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&end), "limit": limit }),
        )?;
        if v.get("header").is_none() {
            return Err(reply("/v3/kv/range", &v));
        }
        Ok(range_kvs(&v))
    }

    /// Runs a transaction: if every comparison holds, `success`, else `failure`.
    pub fn txn(
        &self,
        compare: &[Compare],
        success: &[Op],
        failure: &[Op],
    ) -> Result<TxnResult, EtcdError> {
        let cmp: Vec<Value> = compare
            .iter()
            .map(|c| match c {
                Compare::CreateRevision(k, r) => json!({"key": b64(k.as_bytes()),
                    "target": "CREATE", "create_revision": r.to_string(), "result": "EQUAL"}),
                Compare::ModRevision(k, r) => json!({"key": b64(k.as_bytes()),
                    "target": "MOD", "mod_revision": r.to_string(), "result": "EQUAL"}),
                Compare::Value(k, v) => json!({"key": b64(k.as_bytes()),
                    "target": "VALUE", "value": b64(v), "result": "EQUAL"}),
            })
            .collect();
        let ops = |ops: &[Op]| -> Vec<Value> {
            ops.iter()
                .map(|o| match o {
                    Op::Put(k, v, lease) => json!({"request_put": {"key": b64(k.as_bytes()),
                        "value": b64(v), "lease": lease.to_string()}}),
                    Op::Get(k) => json!({"request_range": {"key": b64(k.as_bytes())}}),
                    Op::Delete(k) => json!({"request_delete_range": {"key": b64(k.as_bytes())}}),
                })
                .collect()
        };
        let body = json!({"compare": cmp, "success": ops(success), "failure": ops(failure)});
        let v = self.post("/v3/kv/txn", &body)?;
        txn_result(&v).ok_or_else(|| reply("/v3/kv/txn", &v))
    }
}

/// A transaction reply (`None`: not one).
pub(crate) fn txn_result(v: &Value) -> Option<TxnResult> {
    v.get("header")?;
    let reads = v
        .get("responses")
        .and_then(Value::as_array)
        .map(|rs| {
            rs.iter()
                .filter_map(|r| r.get("response_range"))
                .map(kv_of)
                .collect()
        })
        .unwrap_or_default();
    Some(TxnResult {
        succeeded: v.get("succeeded").and_then(Value::as_bool).unwrap_or(false),
        reads,
    })
}

/// Every key of a range reply, with its name.
pub(crate) fn range_kvs(v: &Value) -> Vec<(String, Kv)> {
    let Some(kvs) = v.get("kvs").and_then(Value::as_array) else {
        return Vec::new();
    };
    kvs.iter()
        .filter_map(|e| {
            let key = e
                .get("key")
                .and_then(Value::as_str)
                .and_then(|s| B64.decode(s).ok())?;
            Some((String::from_utf8_lossy(&key).into_owned(), kv_at(e)?))
        })
        .collect()
}

/// A range reply's first key.
#[cfg(feature = "fuzz")]
pub(crate) fn range_kv(v: &Value) -> Option<Kv> {
    kv_of(v)
}

fn reply(path: &'static str, v: &Value) -> EtcdError {
    let reply = v.to_string().chars().take(200).collect();
    EtcdError::Reply { path, reply }
}
