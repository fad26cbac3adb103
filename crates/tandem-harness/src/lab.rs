//! `tandem lab up|down`: the network namespaces a replicated VM and its clients run in.

use crate::netlab::NetLab;
use crate::netlab::{BACKUP_IP, GUEST_IP, PRIMARY_IP};

/// `tandem lab` subcommands.
#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Create namespaces <prefix>-cl (clients, bridge br0), <prefix>-pr and <prefix>-bk (the
    /// two hosts, joined by a rate-limited veth link). Needs root.
    Up {
        /// Namespace name prefix.
        #[arg(long, default_value = "tdm")]
        prefix: String,
        /// Replication link rate in Mbit/s (0 = unlimited).
        #[arg(long, default_value_t = 1000)]
        rate_mbit: u64,
    },
    /// Remove the namespaces (and every tap, bridge and veth in them).
    Down {
        /// Namespace name prefix.
        #[arg(long, default_value = "tdm")]
        prefix: String,
    },
}

/// Runs a lab subcommand.
pub fn run(c: Cmd) -> anyhow::Result<()> {
    match c {
        Cmd::Up { prefix, rate_mbit } => {
            let lab = NetLab::create(&prefix, rate_mbit)?;
            println!(
                "lab {prefix}: clients in netns {} (bridge br0, guest {GUEST_IP}); primary host {} ({PRIMARY_IP}), backup host {} ({BACKUP_IP}); link {}",
                lab.clients, lab.primary, lab.backup, lab.shaping
            );
            println!("run the daemons with `ip netns exec {} tandem backup ... --tap-netns {}` and `ip netns exec {} tandem primary --backup {BACKUP_IP}:7000 ... --tap-netns {}`", lab.backup, lab.clients, lab.primary, lab.clients);
            lab.keep();
        }
        Cmd::Down { prefix } => NetLab::remove(&prefix),
    }
    Ok(())
}
