//! What a primary or backup attaches to its QEMU besides RAM: the network relay (a tap on the
//! clients' bridge) and the data disk (tandem's NBD server on a unix socket).

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use tandem_disk::Image;
use tandem_net::{Policy, Relay};
use tandem_vm::VmConfig;

#[derive(clap::Args, Clone, Debug)]
pub struct SiteArgs {
    /// Network namespace holding the clients' bridge. The guest's NIC then goes through
    /// tandem's relay and a tap on that bridge, and its output is held until acknowledged
    /// (needs root). Without it the guest uses QEMU user networking and nothing is held.
    #[arg(long)]
    pub tap_netns: Option<String>,
    /// Bridge inside --tap-netns.
    #[arg(long, default_value = tandem_net::lab::BRIDGE)]
    pub bridge: String,
    /// Tap device name (default: tdp0 on the primary, tdb0 on the backup).
    #[arg(long)]
    pub tap: Option<String>,
    /// Guest address on the bridge (CIDR).
    #[arg(long, default_value = tandem_net::lab::GUEST_CIDR)]
    pub guest_ip: String,
    /// Data disk served by tandem's NBD server, in MiB (0 = none). Both sides must agree.
    #[arg(long, default_value_t = 64)]
    pub disk_mib: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Primary,
    Backup,
}

/// The relay and disk of one side. Dropping it removes the tap and stops serving.
pub struct Site {
    pub relay: Option<Arc<Relay>>,
    pub disk: Option<Arc<Image>>,
    pub disk_path: Option<PathBuf>,
    nbd_sock: Option<PathBuf>,
}

impl Drop for Site {
    fn drop(&mut self) {
        if let Some(s) = &self.nbd_sock {
            let _ = std::fs::remove_file(s);
        }
    }
}

impl Site {
    /// Sets up the relay and the data disk in `dir` and points `cfg` at them. Call before QEMU
    /// starts (QEMU connects to both at start-up).
    pub fn prepare(
        a: &SiteArgs,
        dir: &Path,
        role: Role,
        cfg: &mut VmConfig,
    ) -> anyhow::Result<Site> {
        let relay = match &a.tap_netns {
            Some(ns) => {
                let (name, policy) = match role {
                    Role::Primary => ("tdp0", Policy::Hold),
                    Role::Backup => ("tdb0", Policy::Standby),
                };
                let name = a.tap.clone().unwrap_or_else(|| name.into());
                let tap =
                    tandem_net::open_tap(Some(ns), &name, Some(&a.bridge)).with_context(|| {
                        format!("creating tap {name} on {} in namespace {ns}", a.bridge)
                    })?;
                let sock = dir.join("net.sock");
                let relay = Relay::listen(&sock, OwnedFd::from(tap), policy)?;
                cfg.relay_net = Some((sock, a.guest_ip.clone()));
                cfg.kv_port = None;
                Some(Arc::new(relay))
            }
            None => {
                if role == Role::Primary {
                    tracing::warn!("no --tap-netns: the guest uses QEMU user networking and its network output is NOT held until acknowledged");
                }
                None
            }
        };
        let (disk, disk_path) = if a.disk_mib == 0 {
            (None, None)
        } else {
            if a.disk_mib > 1 << 20 {
                bail!("--disk-mib {} is too large", a.disk_mib);
            }
            let path = dir.join("disk.img");
            let f = std::fs::File::create(&path)
                .with_context(|| format!("creating {}", path.display()))?;
            f.set_len(a.disk_mib << 20)?;
            drop(f);
            let image = match role {
                Role::Primary => {
                    // A fresh ext4 (no lazy init: no background writes after mount).
                    let out = std::process::Command::new("mkfs.ext4")
                        .args([
                            "-q",
                            "-F",
                            "-L",
                            "tandem-data",
                            "-E",
                            "lazy_itable_init=0,lazy_journal_init=0",
                        ])
                        .arg(&path)
                        .output()
                        .context("running mkfs.ext4 (install e2fsprogs with `tandem setup`)")?;
                    if !out.status.success() {
                        bail!("mkfs.ext4 failed: {}", String::from_utf8_lossy(&out.stderr));
                    }
                    Image::open(&path)
                }
                // The backup's copy starts empty; the primary sends its contents.
                Role::Backup => Image::open_unlogged(&path),
            }
            .with_context(|| format!("opening {}", path.display()))?;
            if role == Role::Primary {
                // The scratch disk lives on in the NBD server's open file: a killed primary
                // leaves nothing behind. (The backup removes its copy once it opened it too.)
                let _ = std::fs::remove_file(&path);
            }
            let image = Arc::new(image);
            let sock = dir.join("nbd.sock");
            let _ = std::fs::remove_file(&sock);
            let listener = UnixListener::bind(&sock)
                .with_context(|| format!("listening on {}", sock.display()))?;
            let served = image.clone();
            std::thread::spawn(move || tandem_disk::nbd::serve(listener, served));
            cfg.data_disk = Some(sock.clone());
            (Some(image), Some((path, sock)))
        };
        let (disk_path, nbd_sock) = disk_path.unzip();
        Ok(Site {
            relay,
            disk,
            disk_path,
            nbd_sock,
        })
    }
}
