//! The demo's etcd: a 3-member cluster in its own namespace over mutual TLS, as a production
//! cluster would be, and for the fault campaign a proxy in front of the first member that it
//! makes slow or drops replies of (ambiguous outcomes); the daemons then reach the first member
//! only through the proxy. (The proxy adds ~40 ms to some requests over TLS — a TCP artefact of
//! the extra hop —, so the demo and the failover timings talk to the members directly.)

use std::net::SocketAddr;
use std::sync::{Mutex, MutexGuard};

use crate::etcd_cluster::{Cluster, ClusterTls, Member, Proxy, ProxyMode};
use crate::netlab::NetLab;
use anyhow::Context;

/// The address the proxy listens on: the etcd bridge's own address.
const PROXY_IP: &str = "10.79.0.1";
const PROXY_PORT: u16 = 2479;

/// The demo's etcd cluster and the proxy in front of its first member.
pub struct EtcdLab {
    cluster: Mutex<Cluster>,
    proxy: Option<Proxy>,
    /// The members' namespace.
    pub ns: String,
}

impl EtcdLab {
    /// Adds the etcd segment to `lab` and starts a 3-member cluster on it (data in `dir`),
    /// with the proxy in front of its first member if `proxied`.
    pub fn start(
        lab: &mut NetLab,
        dir: &std::path::Path,
        proxied: bool,
    ) -> anyhow::Result<EtcdLab> {
        let ns = lab.add_etcd().context("adding the etcd namespace")?;
        let members = crate::netlab::ETCD_IPS
            .iter()
            .enumerate()
            .map(|(i, ip)| Member {
                name: format!("e{}", i + 1),
                ip: ip.to_string(),
                client_port: 2379,
                peer_port: 2380,
            })
            .collect();
        let d = dir.join("etcd");
        std::fs::create_dir_all(&d)?;
        // As a production cluster: https with the members' certificates (valid for the proxy's
        // address too), client certificates required (the daemons get --etcd-ca/...).
        let mut ips = crate::netlab::ETCD_IPS.to_vec();
        ips.push(PROXY_IP);
        let tls = ClusterTls::generate(&d.join("keys"), &ips)?;
        let cluster = Cluster::start_with(members, &d, Some(&ns), Some(tls))?;
        let listen: SocketAddr = format!("{PROXY_IP}:{PROXY_PORT}").parse()?;
        let up: SocketAddr = format!("{}:2379", crate::netlab::ETCD_IPS[0]).parse()?;
        // Started inside the namespace: its threads connect to the member from there.
        let proxy = if proxied {
            Some(
                tandem_net::netns::in_netns(Some(&ns), move || Proxy::start(listen, up))?
                    .context("starting the etcd proxy")?,
            )
        } else {
            None
        };
        Ok(EtcdLab {
            cluster: Mutex::new(cluster),
            proxy,
            ns,
        })
    }

    /// Stops the proxy and the members and removes the members' data; their logs stay.
    pub fn stop_and_remove_data(self) {
        drop(self.proxy);
        let cluster = self.cluster.into_inner().unwrap_or_else(|e| e.into_inner());
        cluster.stop_and_remove_data();
    }

    /// The cluster (to kill and restart members).
    pub fn cluster(&self) -> MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The endpoints the daemons get: the members (the proxy in place of the first one).
    pub fn endpoints(&self) -> Vec<String> {
        let mut v = self.cluster().endpoints();
        if self.proxy.is_some() {
            v[0] = format!("https://{PROXY_IP}:{PROXY_PORT}");
        }
        v
    }

    /// The fencing flags a daemon of VM `vm_id` gets (endpoints, client TLS, VM id).
    pub fn daemon_args(&self, vm_id: u64) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(t) = self.client_tls() {
            v.extend(["--etcd-ca".to_string(), t.ca.display().to_string()]);
            if let (Some(cert), Some(key)) = (&t.cert, &t.key) {
                v.extend(["--etcd-cert".to_string(), cert.display().to_string()]);
                v.extend(["--etcd-key".to_string(), key.display().to_string()]);
            }
        }
        v.extend([
            "--etcd".to_string(),
            self.endpoints().join(","),
            "--vm-id".into(),
            vm_id.to_string(),
        ]);
        v
    }

    /// What a client needs for the members' TLS.
    pub fn client_tls(&self) -> Option<tandem_fence::EtcdTls> {
        self.cluster().client_tls().cloned()
    }

    /// Makes the first member slow or drop replies (or pass them again); without the proxy
    /// nothing happens.
    pub fn set_proxy(&self, mode: ProxyMode) {
        if let Some(p) = &self.proxy {
            p.set(mode);
        }
    }
}
