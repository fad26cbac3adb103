//! Faults the demo (and `tandem bench --faults`, and the fault tests) inject into a running
//! primary/backup pair, the way they happen: a process alone, a hang, a partition, a corrupt
//! frame on the link, a backup that restarts, a full file system, a planned handover.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};

/// One injected fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL of the primary's tandem and QEMU together (a host failure).
    HostKill,
    /// SIGKILL of the primary's QEMU alone (a crash or an OOM kill).
    QemuKill,
    /// SIGKILL of the primary's tandem process alone.
    TandemKill,
    /// SIGKILL of the primary's QEMU while the guest is stopped in a checkpoint pause.
    PauseKill,
    /// SIGSTOP of the primary's QEMU (a hang).
    QemuStop,
    /// SIGTERM of the primary: planned handover to the backup.
    Handover,
    /// All replication traffic dropped for this many milliseconds.
    Partition(u64),
    /// One byte flipped on the link by a proxy between primary and backup.
    CorruptFrame,
    /// SIGKILL of the backup (tandem and standby), then a new backup on the same address.
    BackupRestart,
    /// The primary's host cut from the backup and from etcd for this many milliseconds
    /// (needs `--etcd`): the backup takes the VM over in etcd; the primary, unable to record
    /// anything, holds its output until it learns it was fenced.
    Isolate(u64),
    /// The backup's host cut from etcd for this many milliseconds (needs `--etcd`).
    BackupEtcdCut(u64),
    /// One etcd member killed (and restarted after the round's next check).
    EtcdMemberKill,
    /// Two of three etcd members down for this many milliseconds: quorum lost, then back.
    EtcdQuorumLoss(u64),
    /// SIGSTOP of the primary's tandem process (not its QEMU) for this many milliseconds,
    /// then SIGCONT: a daemon that hangs past the backup's promise.
    DaemonStop(u64),
    /// The primary's host cut from etcd (not from the backup) for this many milliseconds.
    PrimaryEtcdCut(u64),
    /// The primary's frames to the backup dropped (the other way passes) for this long.
    OneWay(u64),
    /// The replication link cut and healed every 300 ms for this many milliseconds.
    Flap(u64),
    /// The etcd member that leads the cluster killed (restarted at the next round).
    EtcdLeaderKill,
    /// One etcd member's replies delayed past the daemons' request timeout for this long
    /// (a slow member: requests time out after it may have committed them).
    EtcdSlow(u64),
    /// One etcd member's replies dropped for this long (requests may commit; the client
    /// cannot know).
    EtcdAmbiguous(u64),
    /// The backup's tmpfs kept full by another writer for this long while a corrupt frame
    /// forces a new session: the hello's zeroing of the disk copy fails with ENOSPC (needs
    /// the backup on a small tmpfs).
    EnospcHello(u64),
    /// A host kill of the primary while the first etcd member drops every reply: the
    /// backup's takeover may commit without its reply reaching it.
    AmbiguousKill,
    /// The primary's daemon stops itself right after reading an acknowledgement, before it
    /// releases its output, and is continued after this many milliseconds.
    AckStop(u64),
}

impl Fault {
    /// Whether the primary is certainly gone after this fault (the backup must fail over).
    pub fn ends_primary(self) -> bool {
        matches!(
            self,
            Fault::HostKill
                | Fault::QemuKill
                | Fault::TandemKill
                | Fault::QemuStop
                | Fault::Handover
                | Fault::Isolate(_)
                | Fault::AmbiguousKill
        )
    }

    /// Whether the fault needs the demo's etcd cluster.
    pub fn needs_etcd(self) -> bool {
        matches!(
            self,
            Fault::Isolate(_)
                | Fault::BackupEtcdCut(_)
                | Fault::EtcdMemberKill
                | Fault::EtcdQuorumLoss(_)
                | Fault::PrimaryEtcdCut(_)
                | Fault::EtcdLeaderKill
                | Fault::EtcdSlow(_)
                | Fault::EtcdAmbiguous(_)
                | Fault::AmbiguousKill
        )
    }

    /// Whether the fault needs the proxy in front of an etcd member.
    pub fn needs_etcd_proxy(self) -> bool {
        matches!(
            self,
            Fault::EtcdSlow(_) | Fault::EtcdAmbiguous(_) | Fault::AmbiguousKill
        )
    }

    /// Whether the fault needs the proxy on the replication link.
    pub fn needs_link_proxy(self) -> bool {
        matches!(self, Fault::CorruptFrame | Fault::EnospcHello(_))
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::HostKill => write!(f, "host-kill"),
            Fault::QemuKill => write!(f, "qemu-kill"),
            Fault::PauseKill => write!(f, "pause-kill"),
            Fault::TandemKill => write!(f, "tandem-kill"),
            Fault::QemuStop => write!(f, "qemu-stop"),
            Fault::Handover => write!(f, "handover"),
            Fault::Partition(ms) => write!(f, "partition:{ms}"),
            Fault::CorruptFrame => write!(f, "corrupt-frame"),
            Fault::BackupRestart => write!(f, "backup-restart"),
            Fault::Isolate(ms) => write!(f, "isolate:{ms}"),
            Fault::BackupEtcdCut(ms) => write!(f, "backup-etcd-cut:{ms}"),
            Fault::EtcdMemberKill => write!(f, "etcd-member-kill"),
            Fault::EtcdQuorumLoss(ms) => write!(f, "etcd-quorum-loss:{ms}"),
            Fault::DaemonStop(ms) => write!(f, "daemon-stop:{ms}"),
            Fault::PrimaryEtcdCut(ms) => write!(f, "primary-etcd-cut:{ms}"),
            Fault::OneWay(ms) => write!(f, "one-way:{ms}"),
            Fault::Flap(ms) => write!(f, "flap:{ms}"),
            Fault::EtcdLeaderKill => write!(f, "etcd-leader-kill"),
            Fault::EtcdSlow(ms) => write!(f, "etcd-slow:{ms}"),
            Fault::EtcdAmbiguous(ms) => write!(f, "etcd-ambiguous:{ms}"),
            Fault::EnospcHello(ms) => write!(f, "enospc-hello:{ms}"),
            Fault::AmbiguousKill => write!(f, "ambiguous-host-kill"),
            Fault::AckStop(ms) => write!(f, "ack-stop:{ms}"),
        }
    }
}

impl std::str::FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "host-kill" => Fault::HostKill,
            "qemu-kill" => Fault::QemuKill,
            "pause-kill" => Fault::PauseKill,
            "tandem-kill" => Fault::TandemKill,
            "qemu-stop" => Fault::QemuStop,
            "handover" => Fault::Handover,
            "corrupt-frame" => Fault::CorruptFrame,
            "backup-restart" => Fault::BackupRestart,
            "etcd-member-kill" => Fault::EtcdMemberKill,
            "etcd-leader-kill" => Fault::EtcdLeaderKill,
            "ambiguous-host-kill" => Fault::AmbiguousKill,
            p if p.contains(':') => {
                let (name, ms) = p.split_once(':').unwrap_or_default();
                let ms = ms
                    .parse()
                    .map_err(|_| format!("{p}: {name}:MILLISECONDS"))?;
                match name {
                    "partition" => Fault::Partition(ms),
                    "isolate" => Fault::Isolate(ms),
                    "backup-etcd-cut" => Fault::BackupEtcdCut(ms),
                    "etcd-quorum-loss" => Fault::EtcdQuorumLoss(ms),
                    "daemon-stop" => Fault::DaemonStop(ms),
                    "ack-stop" => Fault::AckStop(ms),
                    "primary-etcd-cut" => Fault::PrimaryEtcdCut(ms),
                    "one-way" => Fault::OneWay(ms),
                    "flap" => Fault::Flap(ms),
                    "etcd-slow" => Fault::EtcdSlow(ms),
                    "etcd-ambiguous" => Fault::EtcdAmbiguous(ms),
                    "enospc-hello" => Fault::EnospcHello(ms),
                    _ => return Err(format!("unknown fault {p:?}")),
                }
            }
            other => {
                return Err(format!(
                    "unknown fault {other:?}; one of host-kill, qemu-kill, pause-kill, tandem-kill, qemu-stop, handover, daemon-stop:MS, ack-stop:MS, partition:MS, one-way:MS, flap:MS, corrupt-frame, backup-restart, enospc-hello:MS, and with --etcd isolate:MS, backup-etcd-cut:MS, primary-etcd-cut:MS, etcd-member-kill, etcd-leader-kill, etcd-quorum-loss:MS, etcd-slow:MS, etcd-ambiguous:MS, ambiguous-host-kill"
                ))
            }
        })
    }
}

/// Sends `sig` to `pid`.
pub fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) of a process this harness started (or its QEMU).
    unsafe { libc::kill(pid as i32, sig) };
}

/// Whether process `pid` exists.
pub fn alive(pid: u32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks for existence.
    let r = unsafe { libc::kill(pid as i32, 0) };
    r == 0 && !is_zombie(pid)
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Drops every packet between namespace `ns` and each of `peers` (addresses or prefixes, both
/// ways) with nftables, until [`heal`].
pub fn partition(ns: &str, peers: &[&str]) -> anyhow::Result<()> {
    partition_ways(ns, peers, true, true)
}

/// Like [`partition`], dropping only what `ns` sends (`out`) and/or receives (`inward`).
pub fn partition_ways(ns: &str, peers: &[&str], out: bool, inward: bool) -> anyhow::Result<()> {
    let nft = |args: &[&str]| -> anyhow::Result<()> {
        let out = Command::new("ip")
            .args(["netns", "exec", ns, "nft"])
            .args(args)
            .output()
            .context("running nft (install nftables with `tandem setup`)")?;
        if !out.status.success() {
            bail!(
                "nft {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    };
    nft(&["add", "table", "inet", "tandem_fault"])?;
    nft(&[
        "add chain inet tandem_fault out { type filter hook output priority 0; policy accept; }",
    ])?;
    nft(&["add chain inet tandem_fault in { type filter hook input priority 0; policy accept; }"])?;
    for peer in peers {
        if out {
            nft(&[
                "add",
                "rule",
                "inet",
                "tandem_fault",
                "out",
                "ip",
                "daddr",
                peer,
                "drop",
            ])?;
        }
        if inward {
            nft(&[
                "add",
                "rule",
                "inet",
                "tandem_fault",
                "in",
                "ip",
                "saddr",
                peer,
                "drop",
            ])?;
        }
    }
    Ok(())
}

/// Ends a [`partition`].
pub fn heal(primary_ns: &str) {
    let _ = Command::new("ip")
        .args([
            "netns",
            "exec",
            primary_ns,
            "nft",
            "delete",
            "table",
            "inet",
            "tandem_fault",
        ])
        .output();
}

/// A TCP proxy inside the primary's namespace between the primary and the backup; flips one
/// byte of the stream towards the backup when [`Proxy::corrupt`] is called.
pub struct Proxy {
    pub addr: SocketAddr,
    flip: Arc<AtomicBool>,
}

impl Proxy {
    pub fn start(primary_ns: &str, backup: SocketAddr) -> anyhow::Result<Proxy> {
        let ns = primary_ns.to_string();
        let listener =
            tandem_net::netns::in_netns(Some(&ns), || TcpListener::bind("127.0.0.1:0"))??;
        let addr = listener.local_addr()?;
        let flip = Arc::new(AtomicBool::new(false));
        let f = flip.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(down) = conn else { continue };
                let ns = ns.clone();
                let up = tandem_net::netns::in_netns(Some(&ns), move || {
                    TcpStream::connect_timeout(&backup, Duration::from_secs(2))
                });
                let Ok(Ok(up)) = up else {
                    continue;
                };
                pipe(down, up, f.clone());
            }
        });
        Ok(Proxy { addr, flip })
    }

    /// Flips one byte of the next data towards the backup.
    pub fn corrupt(&self) {
        self.flip.store(true, Ordering::SeqCst);
    }
}

fn pipe(down: TcpStream, up: TcpStream, flip: Arc<AtomicBool>) {
    let (Ok(mut d2), Ok(mut u2)) = (down.try_clone(), up.try_clone()) else {
        return;
    };
    let (mut d, mut u) = (down, up);
    std::thread::spawn(move || {
        // Frame by frame (32-byte header, length at bytes 24..28), so the flip lands in the
        // payload of an epoch: the backup's checksum must catch it.
        let mut h = [0u8; 32];
        let mut payload = Vec::new();
        loop {
            if d.read_exact(&mut h).is_err() {
                break;
            }
            let len = u32::from_le_bytes([h[24], h[25], h[26], h[27]]) as usize;
            payload.resize(len.min(1 << 30), 0);
            if d.read_exact(&mut payload).is_err() {
                break;
            }
            if h[6] == 3 && !payload.is_empty() && flip.swap(false, Ordering::SeqCst) {
                let i = payload.len() / 2;
                payload[i] ^= 0x40;
            }
            if u.write_all(&h)
                .and_then(|()| u.write_all(&payload))
                .is_err()
            {
                break;
            }
        }
        let _ = u.shutdown(std::net::Shutdown::Both);
        let _ = d.shutdown(std::net::Shutdown::Both);
    });
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut u2, &mut d2);
        let _ = d2.shutdown(std::net::Shutdown::Both);
        let _ = u2.shutdown(std::net::Shutdown::Both);
    });
}
