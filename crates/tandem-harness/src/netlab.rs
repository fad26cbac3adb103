//! A network lab on one machine, built from namespaces as a real deployment would have hosts:
//!
//! ```text
//!   ns <p>-cl (clients)                    ns <p>-pr (primary)      ns <p>-bk (backup)
//!   br0 10.77.0.1/24                        rep0 10.78.0.1/24 ====== rep0 10.78.0.2/24
//!    ├─ tap of the primary's relay            (veth, rate-limited with tc netem, or tbf
//!    └─ tap of the backup's relay              where the kernel has no netem)
//!   guest: 10.77.0.2 (its MAC moves to the backup's tap after failover)
//! ```
//!
//! Dropping the lab deletes the namespaces and everything in them.

use tandem_net::tap::{ip, TapError};

/// The clients' bridge's own (fixed) MAC address.
pub const BRIDGE_MAC: &str = "02:74:64:00:00:01";

/// The etcd segment's bridge's own (fixed) MAC address.
pub const ETCD_BRIDGE_MAC: &str = "02:74:64:00:00:02";

/// Guest address on the clients' bridge.
pub const GUEST_IP: &str = "10.77.0.2";
/// Guest address with prefix length, for the guest's kernel command line.
pub const GUEST_CIDR: &str = "10.77.0.2/24";
/// Bridge name inside the clients' namespace.
pub const BRIDGE: &str = "br0";
/// The primary's address on the replication link.
pub const PRIMARY_IP: &str = "10.78.0.1";
/// The backup's address on the replication link.
pub const BACKUP_IP: &str = "10.78.0.2";
/// The etcd segment (namespace `<p>-et`, see [`NetLab::add_etcd`]).
pub const ETCD_NET: &str = "10.79.0.0/24";
/// The etcd members' addresses on it.
pub const ETCD_IPS: [&str; 3] = ["10.79.0.11", "10.79.0.12", "10.79.0.13"];

/// Lab errors.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// Not root.
    #[error("network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); run as root")]
    NotRoot,
    /// An `ip` or `tc` command failed.
    #[error(transparent)]
    Command(#[from] TapError),
    /// Bad prefix.
    #[error("lab prefix {0:?} must be 1..8 alphanumeric characters")]
    Prefix(String),
}

/// The namespaces of one lab.
pub struct NetLab {
    /// Clients' namespace (bridge, taps, clients).
    pub clients: String,
    /// Primary host's namespace.
    pub primary: String,
    /// Backup host's namespace.
    pub backup: String,
    /// How the link is limited (`netem rate …`, `tbf rate …` or `none`).
    pub shaping: String,
    /// The etcd members' namespace, once added.
    pub etcd: Option<String>,
}

fn tc(ns: &str, args: &[&str]) -> Result<(), TapError> {
    let out = std::process::Command::new("tc")
        .args(["-n", ns])
        .args(args)
        .output()
        .map_err(|e| TapError::Ip(args.join(" "), format!("cannot run tc: {e}")))?;
    if !out.status.success() {
        return Err(TapError::Ip(
            format!("tc {}", args.join(" ")),
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(())
}

impl NetLab {
    /// Creates the namespaces `<prefix>-cl`, `<prefix>-pr`, `<prefix>-bk`, the bridge and the
    /// replication link limited to `rate_mbit` Mbit/s each way (0 = unlimited). Leftovers of
    /// an earlier lab with the same prefix are removed first.
    pub fn create(prefix: &str, rate_mbit: u64) -> Result<NetLab, LabError> {
        if prefix.is_empty()
            || prefix.len() > 8
            || !prefix.chars().all(|c| c.is_ascii_alphanumeric())
        {
            return Err(LabError::Prefix(prefix.into()));
        }
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(LabError::NotRoot);
        }
        let mut lab = NetLab {
            clients: format!("{prefix}-cl"),
            primary: format!("{prefix}-pr"),
            backup: format!("{prefix}-bk"),
            shaping: "none".into(),
            etcd: None,
        };
        lab.delete();
        lab.shaping = lab.build(rate_mbit)?;
        Ok(lab)
    }

    fn build(&self, rate_mbit: u64) -> Result<String, LabError> {
        for ns in [&self.clients, &self.primary, &self.backup] {
            ip(None, &["netns", "add", ns])?;
            ip(Some(ns), &["link", "set", "lo", "up"])?;
        }
        let c = Some(self.clients.as_str());
        ip(c, &["link", "add", "name", BRIDGE, "type", "bridge"])?;
        // No STP / forwarding delay: ports forward as soon as they are up.
        ip(
            c,
            &[
                "link",
                "set",
                BRIDGE,
                "type",
                "bridge",
                "forward_delay",
                "0",
            ],
        )?;
        // A fixed address: a Linux bridge whose address was not set takes the lowest of its
        // ports' addresses, so the primary's tap leaving (its host dies) would change the
        // clients' MAC under the resumed guest, which keeps sending to the old one until its
        // neighbour entry expires (a 10+ s stall of every connection; libvirt pins its
        // bridges' addresses for the same reason).
        ip(c, &["link", "set", BRIDGE, "address", BRIDGE_MAC])?;
        ip(c, &["addr", "add", "10.77.0.1/24", "dev", BRIDGE])?;
        ip(c, &["link", "set", BRIDGE, "up"])?;
        ip(
            Some(&self.primary),
            &[
                "link",
                "add",
                "name",
                "rep0",
                "type",
                "veth",
                "peer",
                "name",
                "rep0",
                "netns",
                &self.backup,
            ],
        )?;
        for (ns, addr) in [
            (&self.primary, "10.78.0.1/24"),
            (&self.backup, "10.78.0.2/24"),
        ] {
            ip(Some(ns), &["addr", "add", addr, "dev", "rep0"])?;
            ip(Some(ns), &["link", "set", "rep0", "up"])?;
        }
        if rate_mbit == 0 {
            return Ok("none".into());
        }
        let rate = format!("{rate_mbit}mbit");
        let mut shaping = format!("netem rate {rate}");
        for ns in [&self.primary, &self.backup] {
            if tc(
                ns,
                &[
                    "qdisc", "add", "dev", "rep0", "root", "netem", "rate", &rate,
                ],
            )
            .is_err()
            {
                // Kernels built without CONFIG_NET_SCH_NETEM: a token bucket gives the same
                // rate limit (no delay emulation is needed here).
                let burst = format!("{}kb", (rate_mbit * 1000 / 8 / 100).max(64));
                tc(
                    ns,
                    &[
                        "qdisc", "add", "dev", "rep0", "root", "tbf", "rate", &rate, "burst",
                        &burst, "latency", "100ms",
                    ],
                )?;
                shaping = format!("tbf rate {rate} (this kernel has no netem)");
            }
        }
        Ok(shaping)
    }

    /// Adds the etcd segment: namespace `<p>-et` with bridge `ebr0` (10.79.0.1/24) holding the
    /// members' addresses [`ETCD_IPS`], and a link `etc0` from the primary's namespace
    /// (10.79.0.2) and from the backup's (10.79.0.3) to it — separate from the replication
    /// link, so each can be cut alone.
    pub fn add_etcd(&mut self) -> Result<String, LabError> {
        let ns = self.primary.replace("-pr", "-et");
        let _ = ip(None, &["netns", "del", &ns]);
        ip(None, &["netns", "add", &ns])?;
        self.etcd = Some(ns.clone());
        let e = Some(ns.as_str());
        ip(e, &["link", "set", "lo", "up"])?;
        ip(e, &["link", "add", "name", "ebr0", "type", "bridge"])?;
        ip(
            e,
            &[
                "link",
                "set",
                "ebr0",
                "type",
                "bridge",
                "forward_delay",
                "0",
            ],
        )?;
        // Pinned like the clients' bridge (see there).
        ip(e, &["link", "set", "ebr0", "address", ETCD_BRIDGE_MAC])?;
        ip(e, &["addr", "add", "10.79.0.1/24", "dev", "ebr0"])?;
        for a in ETCD_IPS {
            ip(e, &["addr", "add", &format!("{a}/24"), "dev", "ebr0"])?;
        }
        ip(e, &["link", "set", "ebr0", "up"])?;
        for (host, port, addr) in [
            (&self.primary, "ep0", "10.79.0.2/24"),
            (&self.backup, "eb0", "10.79.0.3/24"),
        ] {
            ip(
                Some(host),
                &[
                    "link", "add", "name", "etc0", "type", "veth", "peer", "name", port, "netns",
                    &ns,
                ],
            )?;
            ip(Some(host), &["addr", "add", addr, "dev", "etc0"])?;
            ip(Some(host), &["link", "set", "etc0", "up"])?;
            ip(e, &["link", "set", port, "master", "ebr0"])?;
            ip(e, &["link", "set", port, "up"])?;
        }
        Ok(ns)
    }

    /// Leaves the namespaces in place when dropped (`tandem lab up`).
    pub fn keep(self) {
        std::mem::forget(self);
    }

    /// Deletes the namespaces of the lab with `prefix`, if any.
    pub fn remove(prefix: &str) {
        for suffix in ["cl", "pr", "bk", "et"] {
            let _ = ip(None, &["netns", "del", &format!("{prefix}-{suffix}")]);
        }
    }

    fn delete(&self) {
        for ns in [&self.clients, &self.primary, &self.backup]
            .into_iter()
            .chain(&self.etcd)
        {
            let _ = ip(None, &["netns", "del", ns]);
        }
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        self.delete();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_product_defaults_name_this_labs_bridge_and_guest_address() {
        let site = tandem_protect::site::SiteConfig::default();
        assert_eq!(site.bridge, super::BRIDGE);
        assert_eq!(site.guest_ip, super::GUEST_CIDR);
    }
}
