//! A real etcd cluster of local members (Debian's `etcd-server`), for the namespace lab, the
//! demo and the tests. Production points tandem at the operator's cluster instead.
//!
//! Members use a short heartbeat (50 ms) and election timeout (500 ms), as on a LAN, so a
//! lost leader is replaced within about a second.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tandem_fence::etcd::Client;

/// The cluster could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The etcd binary is missing.
    #[error("etcd is not installed (Debian package etcd-server; `tandem setup` installs it)")]
    Missing,
    /// A member could not be started.
    #[error("starting etcd member {0}")]
    Spawn(String, #[source] std::io::Error),
    /// The lab's TLS material could not be made.
    #[error("making the lab's etcd certificates: {0}")]
    Keys(String),
    /// The members did not form a cluster in time.
    #[error("the etcd cluster did not become healthy within {0:?} (member logs in {1}){2}")]
    Unhealthy(Duration, PathBuf, String),
}

/// One member's addresses.
#[derive(Debug, Clone)]
pub struct Member {
    /// Name (`e1`).
    pub name: String,
    /// IP address it listens on.
    pub ip: String,
    /// Client port.
    pub client_port: u16,
    /// Peer port.
    pub peer_port: u16,
}

impl Member {
    /// Its client URL.
    pub fn client_url(&self) -> String {
        format!("http://{}:{}", self.ip, self.client_port)
    }

    fn peer_url(&self) -> String {
        format!("http://{}:{}", self.ip, self.peer_port)
    }
}

/// TLS of a lab cluster: the members serve `https` client URLs with a certificate of the lab
/// CA and require client certificates of it (`--client-cert-auth`), as a production cluster
/// would.
#[derive(Debug, Clone)]
pub struct ClusterTls {
    /// The members' certificate and key.
    pub server_cert: PathBuf,
    /// The members' key.
    pub server_key: PathBuf,
    /// What a client needs (CA, client certificate and key).
    pub client: tandem_fence::EtcdTls,
}

impl ClusterTls {
    /// A lab CA, a member certificate for `ips` (and 127.0.0.1) and a client certificate,
    /// written to `dir`.
    pub fn generate(dir: &Path, ips: &[&str]) -> Result<ClusterTls, ClusterError> {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
        let k = |e: rcgen::Error| ClusterError::Keys(e.to_string());
        let w = |name: &str, text: String| -> Result<PathBuf, ClusterError> {
            let p = dir.join(name);
            std::fs::write(&p, text)
                .map_err(|e| ClusterError::Keys(format!("{}: {e}", p.display())))?;
            Ok(p)
        };
        std::fs::create_dir_all(dir).map_err(|e| ClusterError::Keys(e.to_string()))?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(k)?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_key = KeyPair::generate().map_err(k)?;
        let ca_cert = ca.self_signed(&ca_key).map_err(k)?;
        let mut sans: Vec<String> = ips.iter().map(|s| s.to_string()).collect();
        sans.extend(["127.0.0.1".to_string(), "localhost".to_string()]);
        let leaf = |sans: Vec<String>| -> Result<(String, String), ClusterError> {
            let p = CertificateParams::new(sans).map_err(k)?;
            let key = KeyPair::generate().map_err(k)?;
            let cert = p.signed_by(&key, &ca_cert, &ca_key).map_err(k)?;
            Ok((cert.pem(), key.serialize_pem()))
        };
        let (sc, sk) = leaf(sans)?;
        let (cc, ck) = leaf(vec!["tandem-client".to_string()])?;
        Ok(ClusterTls {
            server_cert: w("etcd-server.pem", sc)?,
            server_key: w("etcd-server.key", sk)?,
            client: tandem_fence::EtcdTls {
                ca: w("etcd-ca.pem", ca_cert.pem())?,
                cert: Some(w("etcd-client.pem", cc)?),
                key: Some(w("etcd-client.key", ck)?),
            },
        })
    }
}

/// A running cluster; dropping it kills the members.
pub struct Cluster {
    members: Vec<Member>,
    children: Vec<Option<Child>>,
    dir: PathBuf,
    netns: Option<String>,
    tls: Option<ClusterTls>,
}

impl Cluster {
    /// Starts `members` with their data and logs under `dir`, inside network namespace
    /// `netns` if given, and waits until every member answers.
    pub fn start(
        members: Vec<Member>,
        dir: &Path,
        netns: Option<&str>,
    ) -> Result<Cluster, ClusterError> {
        Self::start_with(members, dir, netns, None)
    }

    /// Like [`Cluster::start`], serving clients over mutual TLS with `tls`.
    pub fn start_with(
        members: Vec<Member>,
        dir: &Path,
        netns: Option<&str>,
        tls: Option<ClusterTls>,
    ) -> Result<Cluster, ClusterError> {
        if !Path::new("/usr/bin/etcd").exists() && which("etcd").is_none() {
            return Err(ClusterError::Missing);
        }
        let mut c = Cluster {
            children: members.iter().map(|_| None).collect(),
            members,
            dir: dir.to_path_buf(),
            netns: netns.map(str::to_string),
            tls,
        };
        for i in 0..c.members.len() {
            c.spawn(i, true)?;
        }
        c.wait_healthy(Duration::from_secs(20))?;
        Ok(c)
    }

    /// The client URLs.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| self.url(m)).collect()
    }

    /// What a client needs for the members' TLS (`None`: plain http).
    pub fn client_tls(&self) -> Option<&tandem_fence::EtcdTls> {
        self.tls.as_ref().map(|t| &t.client)
    }

    fn url(&self, m: &Member) -> String {
        match &self.tls {
            Some(_) => m.client_url().replacen("http://", "https://", 1),
            None => m.client_url(),
        }
    }

    /// The members.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    fn spawn(&mut self, i: usize, new: bool) -> Result<(), ClusterError> {
        let m = &self.members[i];
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{}.log", m.name)))
            .map_err(|e| ClusterError::Spawn(m.name.clone(), e))?;
        let err = log
            .try_clone()
            .map_err(|e| ClusterError::Spawn(m.name.clone(), e))?;
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "etcd"]);
                c
            }
            None => Command::new("etcd"),
        };
        let url = self.url(m);
        if let Some(t) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&t.server_cert)
                .arg("--key-file")
                .arg(&t.server_key)
                .arg("--trusted-ca-file")
                .arg(&t.client.ca)
                .arg("--client-cert-auth");
        }
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(self.dir.join(&m.name))
            .arg("--listen-client-urls")
            .arg(&url)
            .arg("--advertise-client-urls")
            .arg(&url)
            .arg("--listen-peer-urls")
            .arg(m.peer_url())
            .arg("--initial-advertise-peer-urls")
            .arg(m.peer_url())
            .arg("--initial-cluster")
            .arg(initial.join(","))
            .arg("--initial-cluster-state")
            .arg(if new { "new" } else { "existing" })
            .arg("--initial-cluster-token")
            .arg("tandem-lab")
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err);
        let child = cmd
            .spawn()
            .map_err(|e| ClusterError::Spawn(m.name.clone(), e))?;
        self.children[i] = Some(child);
        Ok(())
    }

    /// Waits until every running member answers a status request.
    pub fn wait_healthy(&self, within: Duration) -> Result<(), ClusterError> {
        let t = Instant::now();
        loop {
            let ok = self
                .members
                .iter()
                .zip(&self.children)
                .filter(|(_, c)| c.is_some())
                .all(|(m, _)| self.answers(m));
            if ok {
                return Ok(());
            }
            if t.elapsed() > within {
                return Err(ClusterError::Unhealthy(
                    within,
                    self.dir.clone(),
                    self.log_tails(),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The last lines of every member's log, and which members have exited, for an error.
    fn log_tails(&self) -> String {
        let mut out = String::new();
        for (m, c) in self.members.iter().zip(&self.children) {
            let log = std::fs::read_to_string(self.dir.join(format!("{}.log", m.name)))
                .unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(4)..].join("\n    ");
            let state = if c.is_some() {
                "started"
            } else {
                "not running"
            };
            out.push_str(&format!(
                "\n  {} ({state}, {}):\n    {tail}",
                m.name,
                m.client_url()
            ));
        }
        out
    }

    /// Whether member `m` answers a linearizable read (inside the cluster's namespace with
    /// `etcdctl`, from Debian's etcd-client, when there is one).
    fn answers(&self, m: &Member) -> bool {
        let tls = self.client_tls();
        match &self.netns {
            None => Client::with_tls(&[self.url(m)], Duration::from_millis(500), tls)
                .and_then(|c| c.get("/tandem/health"))
                .is_ok(),
            Some(ns) => Command::new("ip")
                .args(["netns", "exec", ns, "etcdctl", "--endpoints"])
                .arg(self.url(m))
                .args(tls.map_or_else(Vec::new, |t| {
                    let mut a = vec![format!("--cacert={}", t.ca.display())];
                    if let (Some(c), Some(k)) = (&t.cert, &t.key) {
                        a.push(format!("--cert={}", c.display()));
                        a.push(format!("--key={}", k.display()));
                    }
                    a
                }))
                .args(["--command-timeout=500ms", "get", "/tandem/health"])
                .env("ETCDCTL_API", "3")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success()),
        }
    }

    /// The index of the member that leads the cluster now (`None`: no running member says).
    pub fn leader(&self) -> Option<usize> {
        let mut ids = Vec::new();
        let mut leader = None;
        for (i, m) in self.members.iter().enumerate() {
            if self.children[i].is_none() {
                ids.push(None);
                continue;
            }
            let (id, l) = self.status(m).unwrap_or((0, 0));
            ids.push((id != 0).then_some(id));
            if l != 0 {
                leader = Some(l);
            }
        }
        let l = leader?;
        ids.iter().position(|id| *id == Some(l))
    }

    /// A member's own id and the leader's, as it reports them.
    fn status(&self, m: &Member) -> Option<(u64, u64)> {
        let tls = self.client_tls();
        let v: serde_json::Value = match &self.netns {
            None => {
                let c = Client::with_tls(&[self.url(m)], Duration::from_millis(500), tls).ok()?;
                c.status().ok()?
            }
            Some(ns) => {
                let out = Command::new("ip")
                    .args(["netns", "exec", ns, "etcdctl", "--endpoints"])
                    .arg(self.url(m))
                    .args(tls.map_or_else(Vec::new, |t| {
                        let mut a = vec![format!("--cacert={}", t.ca.display())];
                        if let (Some(c), Some(k)) = (&t.cert, &t.key) {
                            a.push(format!("--cert={}", c.display()));
                            a.push(format!("--key={}", k.display()));
                        }
                        a
                    }))
                    .args([
                        "--command-timeout=500ms",
                        "endpoint",
                        "status",
                        "-w",
                        "json",
                    ])
                    .env("ETCDCTL_API", "3")
                    .stderr(Stdio::null())
                    .output()
                    .ok()?;
                let all: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
                all.get(0)?.get("Status")?.clone()
            }
        };
        let num = |x: Option<&serde_json::Value>| -> u64 {
            match x {
                Some(serde_json::Value::Number(n)) => n.as_u64().unwrap_or(0),
                Some(serde_json::Value::String(s)) => s.parse().unwrap_or(0),
                _ => 0,
            }
        };
        Some((
            num(v.get("header").and_then(|h| h.get("member_id"))),
            num(v.get("leader")),
        ))
    }

    /// Kills member `i` (SIGKILL), as a crashed host would lose it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills every member still running.
    fn kill_all(&mut self) {
        for i in 0..self.children.len() {
            self.kill(i);
        }
    }

    /// Restarts a killed member from its data directory.
    pub fn restart(&mut self, i: usize) -> Result<(), ClusterError> {
        if self.children[i].is_none() {
            self.spawn(i, false)?;
        }
        Ok(())
    }

    /// Stops every member and removes their data directories (~120 MiB each, mostly
    /// preallocated write-ahead log); their logs stay.
    pub fn stop_and_remove_data(mut self) {
        self.kill_all();
        for m in &self.members {
            let _ = std::fs::remove_dir_all(self.dir.join(&m.name));
        }
    }

    /// Restarts every killed member and waits until all answer.
    pub fn restart_all(&mut self) -> Result<(), ClusterError> {
        for i in 0..self.children.len() {
            self.restart(i)?;
        }
        self.wait_healthy(Duration::from_secs(20))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(bin))
            .find(|p| p.exists())
    })
}

/// What a [`Proxy`] does to the replies of the member behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProxyMode {
    /// Passes everything on.
    #[default]
    Pass,
    /// Holds every reply this long before passing it on (a slow member or network).
    Delay(Duration),
    /// Passes requests on, then drops the next `n` replies and closes their connections: the
    /// request may have committed, the client cannot know (an ambiguous outcome).
    DropReplies(u32),
    /// Like `DropReplies`, for replies to transactions only (`POST /v3/kv/txn`; plain http
    /// only: the proxy cannot see into TLS).
    DropTxnReplies(u32),
}

/// A TCP proxy in front of one etcd member that delays or drops its replies, for tests and
/// the fault campaign. It forwards bytes without parsing them, so it works for TLS too.
pub struct Proxy {
    addr: std::net::SocketAddr,
    mode: std::sync::Arc<std::sync::Mutex<ProxyMode>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    /// Listens on `listen` (`ip:0` for any port) and forwards to `upstream`.
    pub fn start(
        listen: std::net::SocketAddr,
        upstream: std::net::SocketAddr,
    ) -> std::io::Result<Proxy> {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{Arc, Mutex};
        let l = std::net::TcpListener::bind(listen)?;
        let addr = l.local_addr()?;
        let mode = Arc::new(Mutex::new(ProxyMode::Pass));
        let stop = Arc::new(AtomicBool::new(false));
        let (m, st) = (mode.clone(), stop.clone());
        std::thread::spawn(move || {
            for c in l.incoming() {
                if st.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(down) = c else { continue };
                let Ok(up) =
                    std::net::TcpStream::connect_timeout(&upstream, Duration::from_secs(1))
                else {
                    continue;
                };
                proxy_pair(down, up, m.clone());
            }
        });
        Ok(Proxy { addr, mode, stop })
    }

    /// The address clients use (its endpoint: `http://ADDR` or `https://ADDR`).
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Changes what it does from the next reply on.
    pub fn set(&self, mode: ProxyMode) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = mode;
    }

    /// What it does now (a drop count goes down as replies are dropped).
    pub fn mode(&self) -> ProxyMode {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = std::net::TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
    }
}

fn proxy_pair(
    down: std::net::TcpStream,
    up: std::net::TcpStream,
    mode: std::sync::Arc<std::sync::Mutex<ProxyMode>>,
) {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    let (Ok(mut d_in), Ok(mut u_out)) = (down.try_clone(), up.try_clone()) else {
        return;
    };
    // A transaction went up on this connection: its reply is the next one.
    let txn = std::sync::Arc::new(AtomicBool::new(false));
    let t = txn.clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match d_in.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if buf[..n].windows(11).any(|w| w == b"/v3/kv/txn ") {
                t.store(true, Ordering::SeqCst);
            }
            if u_out.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = u_out.shutdown(std::net::Shutdown::Write);
    });
    let (mut u_in, mut d_out) = (up, down);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match u_in.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let was_txn = txn.swap(false, Ordering::SeqCst);
            let drop_it = {
                let mut m = mode.lock().unwrap_or_else(|e| e.into_inner());
                match *m {
                    ProxyMode::Pass => false,
                    ProxyMode::Delay(d) => {
                        drop(m);
                        std::thread::sleep(d);
                        false
                    }
                    ProxyMode::DropReplies(k) | ProxyMode::DropTxnReplies(k)
                        if was_txn || matches!(*m, ProxyMode::DropReplies(_)) =>
                    {
                        *m = match (*m, k) {
                            (_, 0 | 1) => ProxyMode::Pass,
                            (ProxyMode::DropReplies(_), k) => ProxyMode::DropReplies(k - 1),
                            (_, k) => ProxyMode::DropTxnReplies(k - 1),
                        };
                        true
                    }
                    _ => false,
                }
            };
            if drop_it || d_out.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = d_out.shutdown(std::net::Shutdown::Both);
        let _ = u_in.shutdown(std::net::Shutdown::Both);
    });
}
