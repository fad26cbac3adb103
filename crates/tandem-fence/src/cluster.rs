//! A real etcd cluster of local members (Debian's `etcd-server`), for the namespace lab, the
//! demo and the tests. Production points tandem at the operator's cluster instead.
//!
//! Members use a short heartbeat (50 ms) and election timeout (500 ms), as on a LAN, so a
//! lost leader is replaced within about a second.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::etcd::Client;

/// The cluster could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The etcd binary is missing.
    #[error("etcd is not installed (Debian package etcd-server; `tandem setup` installs it)")]
    Missing,
    /// A member could not be started.
    #[error("starting etcd member {0}")]
    Spawn(String, #[source] std::io::Error),
    /// The members did not form a cluster in time.
    #[error("the etcd cluster did not become healthy within {0:?} (member logs in {1})")]
    Unhealthy(Duration, PathBuf),
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

/// A running cluster; dropping it kills the members.
pub struct Cluster {
    members: Vec<Member>,
    children: Vec<Option<Child>>,
    dir: PathBuf,
    netns: Option<String>,
}

impl Cluster {
    /// Starts `members` with their data and logs under `dir`, inside network namespace
    /// `netns` if given, and waits until every member answers.
    pub fn start(
        members: Vec<Member>,
        dir: &Path,
        netns: Option<&str>,
    ) -> Result<Cluster, ClusterError> {
        if !Path::new("/usr/bin/etcd").exists() && which("etcd").is_none() {
            return Err(ClusterError::Missing);
        }
        let mut c = Cluster {
            children: members.iter().map(|_| None).collect(),
            members,
            dir: dir.to_path_buf(),
            netns: netns.map(str::to_string),
        };
        for i in 0..c.members.len() {
            c.spawn(i, true)?;
        }
        c.wait_healthy(Duration::from_secs(20))?;
        Ok(c)
    }

    /// The client URLs.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::client_url).collect()
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
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(self.dir.join(&m.name))
            .arg("--listen-client-urls")
            .arg(m.client_url())
            .arg("--advertise-client-urls")
            .arg(m.client_url())
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
                return Err(ClusterError::Unhealthy(within, self.dir.clone()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether member `m` answers a linearizable read (inside the cluster's namespace with
    /// `etcdctl`, from Debian's etcd-client, when there is one).
    fn answers(&self, m: &Member) -> bool {
        match &self.netns {
            None => Client::new(&[m.client_url()], Duration::from_millis(500))
                .and_then(|c| c.get("/tandem/health"))
                .is_ok(),
            Some(ns) => Command::new("ip")
                .args(["netns", "exec", ns, "etcdctl", "--endpoints"])
                .arg(m.client_url())
                .args(["--command-timeout=500ms", "get", "/tandem/health"])
                .env("ETCDCTL_API", "3")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success()),
        }
    }

    /// Kills member `i` (SIGKILL), as a crashed host would lose it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Restarts a killed member from its data directory.
    pub fn restart(&mut self, i: usize) -> Result<(), ClusterError> {
        if self.children[i].is_none() {
            self.spawn(i, false)?;
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            self.kill(i);
        }
    }
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(bin))
            .find(|p| p.exists())
    })
}
