//! `tandem demo --vm debian --adopt --libvirt`: the Debian VM run by a real libvirtd (Debian's
//! libvirt-daemon-system), defined and started by virt-install, then adopted with `tandem
//! adopt --libvirt` from the description `tandem vm import` made of its defined XML (asking
//! libvirt for its network's bridge).
//!
//! The libvirtd is the round's own: it runs in the clients' network namespace (its domain's
//! NIC goes on the clients' bridge, `<interface type='bridge'>`) and in a mount namespace of
//! its own where /etc/libvirt, /run/libvirt, /var/lib/libvirt, /var/log/libvirt and
//! /var/cache/libvirt are directories of the round: the host's libvirt is not touched, and
//! tandem's hook (`tandem vm libvirt-hook`) is installed only there.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::netlab::BRIDGE;

/// The domain's name.
pub const DOMAIN: &str = "tandem-debian";

/// The libvirt network the domain's NIC is on: the clients' bridge, in bridge mode (what
/// virt-install's `--network network=NAME` uses; import resolves it through libvirt).
pub const NETWORK: &str = "tandem-lab";

/// qemu.conf for a libvirtd in a container: QEMU as root, no cgroups, namespaces or
/// security labels (none of which a CI container offers), logs in files.
const QEMU_CONF: &str =
    "user = \"root\"\ngroup = \"root\"\ndynamic_ownership = 0\nremember_owner = 0\n\
security_driver = \"none\"\nnamespaces = [ ]\ncgroup_controllers = [ ]\nstdio_handler = \"file\"\n";

/// dist/libvirt/qemu, the hook the package ships.
const HOOK: &str = include_str!("../../../../dist/libvirt/qemu");

const LIBVIRTD_CONF: &str =
    "unix_sock_group = \"root\"\nunix_sock_rw_perms = \"0700\"\nauth_unix_rw = \"none\"\nlog_outputs = \"3:stderr\"\n";

/// What `tandem vm import` made of the domain.
#[derive(Debug, Clone, Default)]
pub struct Imported {
    /// What it named as not carried over (`element: why`).
    pub unmapped: Vec<String>,
    /// The bridge it found for the NIC on a libvirt network.
    pub nic_bridge: Option<String>,
}

/// What the backup host's libvirt shows of the adopted domain (defined there by the backup
/// from the definition the adopting node recorded in etcd).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct BackupView {
    /// The domain is defined there.
    pub defined: bool,
    /// Its state (`shut off`: the guest runs under tandem).
    pub state: String,
    /// It carries tandem's mark.
    pub marked: bool,
    /// Its disk is a slice of the backup's copy (`guest-disks.raw`).
    pub disk_on_copy: bool,
    /// `virsh start` there was refused by tandem's hook.
    pub start_refused: bool,
    /// Given back to libvirt once protection ended (the guest shut down under tandem, the
    /// mark removed): `virsh start` there booted it from the backup's copy.
    pub given_back: bool,
    /// Why giving it back failed, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub give_back_error: Option<String>,
    /// Of the commits acknowledged under tandem, how many the guest booted by libvirt from the
    /// backup's copy lacks (None: not checked).
    pub given_back_lost: Option<u64>,
}

impl BackupView {
    /// All as it should be.
    pub fn ok(&self) -> bool {
        self.defined
            && self.state == "shut off"
            && self.marked
            && self.disk_on_copy
            && self.start_refused
            && self.given_back
            && self.given_back_lost == Some(0)
    }
}

/// A libvirtd of the round's own (killed on drop, with its domain).
pub struct Libvirtd {
    child: Child,
    /// `virsh -c` for it.
    pub uri: String,
    dir: PathBuf,
}

impl Libvirtd {
    /// Starts libvirtd in network namespace `ns`, its state under `dir`, with tandem's qemu
    /// hook calling `tandem` (the product binary).
    pub fn start(ns: &str, dir: &Path, tandem: &Path) -> anyhow::Result<Libvirtd> {
        if Command::new("libvirtd").arg("--version").output().is_err() {
            bail!("libvirtd is not installed: `tandem-lab setup --debian` installs libvirt-daemon-system, libvirt-clients and virtinst");
        }
        for d in ["etc/hooks/qemu.d", "run", "lib", "log", "cache"] {
            std::fs::create_dir_all(dir.join(d))?;
        }
        std::fs::write(dir.join("etc/qemu.conf"), QEMU_CONF)?;
        std::fs::write(dir.join("etc/libvirtd.conf"), LIBVIRTD_CONF)?;
        // tandem's hook as the package ships it, calling this build's binary.
        let hook = dir.join("etc/hooks/qemu.d/tandem");
        std::fs::write(
            &hook,
            HOOK.replace("/usr/bin/tandem", &format!("'{}'", tandem.display())),
        )?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755))?;
        let mounts: Vec<String> = [
            ("etc", "/etc/libvirt"),
            ("run", "/run/libvirt"),
            ("lib", "/var/lib/libvirt"),
            ("log", "/var/log/libvirt"),
            ("cache", "/var/cache/libvirt"),
        ]
        .iter()
        .map(|(from, to)| {
            format!(
                "mkdir -p {to} && mount --bind '{}' {to}",
                dir.join(from).display()
            )
        })
        .collect();
        // Its own pid file: two rounds' libvirtds (the adopting and the backup host's) run at
        // once, and /run/libvirtd.pid would be the same file.
        let script = format!(
            "mount --make-rprivate / && {} && exec libvirtd --pid-file '{}'",
            mounts.join(" && "),
            dir.join("libvirtd.pid").display()
        );
        let log = std::fs::File::create(dir.join("libvirtd.log"))?;
        let child = Command::new("ip")
            .args(["netns", "exec", ns, "unshare", "-m", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting libvirtd")?;
        let sock = dir.join("run/libvirt-sock");
        let uri = format!("qemu+unix:///system?socket={}", sock.display());
        let mut l = Libvirtd {
            child,
            uri,
            dir: dir.to_path_buf(),
        };
        let t = Instant::now();
        while l.virsh(&["version"]).is_err() {
            if t.elapsed() > Duration::from_secs(30) || l.child.try_wait()?.is_some() {
                bail!(
                    "libvirtd did not start; its log is {}",
                    dir.join("libvirtd.log").display()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(l)
    }

    /// `virsh -c URI ARGS`: its output, or its error.
    pub fn virsh(&self, args: &[&str]) -> anyhow::Result<String> {
        Ok(self.libvirt().run(args)?)
    }

    /// The round's domain, as tandem reaches it.
    pub fn libvirt(&self) -> tandem_vm::adopt::Libvirt {
        tandem_vm::adopt::Libvirt {
            domain: DOMAIN.into(),
            uri: Some(self.uri.clone()),
        }
    }

    /// Defines and starts the Debian VM with virt-install from `disk` (its serial port to
    /// `console`): q35 with libvirt's defaults (PCIe root ports, USB, balloon, RNG, the guest
    /// agent's channel), its NIC on libvirt network [`NETWORK`], the clients' bridge.
    pub fn install(
        &self,
        disk: &Path,
        mem_mib: u64,
        mac: &str,
        console: &Path,
    ) -> anyhow::Result<()> {
        self.define_network()?;
        let out = Command::new("virt-install")
            .args(["--connect", &self.uri, "--name", DOMAIN])
            .args(["--memory", &mem_mib.to_string(), "--vcpus", "2", "--import"])
            .args(["--virt-type", "qemu", "--osinfo", "debian11"])
            .arg("--disk")
            .arg(format!(
                "path={},format=qcow2,bus=virtio,cache=writeback",
                disk.display()
            ))
            .arg("--network")
            .arg(format!("network={NETWORK},model=virtio,mac={mac}"))
            .args(["--graphics", "none", "--noautoconsole"])
            .arg("--serial")
            .arg(format!("file,path={}", console.display()))
            .output()
            .context("running virt-install")?;
        if !out.status.success() {
            bail!(
                "virt-install: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Defines and starts libvirt network [`NETWORK`] on the clients' bridge (each host's
    /// libvirt needs it to run the domain).
    pub fn define_network(&self) -> anyhow::Result<()> {
        let net = self.dir.join("network.xml");
        std::fs::write(
            &net,
            format!("<network><name>{NETWORK}</name><forward mode='bridge'/><bridge name='{BRIDGE}'/></network>\n"),
        )?;
        self.virsh(&["net-define", &net.display().to_string()])?;
        self.virsh(&["net-start", NETWORK])?;
        Ok(())
    }

    /// Gives the domain back to libvirt as docs/VM_DESCRIPTION.md says, once protection ended
    /// and the guest is shut down: its mark removed, `virsh start`.
    pub fn give_back(&self) -> anyhow::Result<()> {
        let ns = tandem_protect::libvirt::inloop::XMLNS;
        self.virsh(&["metadata", DOMAIN, "--config", "--uri", ns, "--remove"])?;
        self.virsh(&["start", DOMAIN])?;
        Ok(())
    }

    /// The domain's defined XML imported as a tandem description at `path` (its NIC's libvirt
    /// network resolved to its bridge through libvirt, as `tandem vm import --libvirt`
    /// does), then the NIC left to the daemons' `--tap-netns` (the clients' bridge in their
    /// namespace). Returns what import named as not carried over, and the NIC's bridge.
    pub fn import(&self, path: &Path) -> anyhow::Result<Imported> {
        // The defined XML (the live one names its network's bridge): import asks libvirt for
        // the bridge of the NIC's network, as `tandem vm import --libvirt` does.
        let xml = self.virsh(&["dumpxml", "--inactive", DOMAIN])?;
        std::fs::write(self.dir.join("domain.xml"), &xml)?;
        let lv = self.libvirt();
        let bridge_of = |net: &str| tandem_protect::libvirt::inloop::network_bridge(&lv, net);
        let (mut f, unmapped) = tandem_protect::libvirt::import_with(&xml, &bridge_of)?;
        let bridge = f.nic.first().and_then(|n| n.bridge.clone());
        for n in &mut f.nic {
            n.bridge = None;
            n.netns = None;
        }
        f.ready = Some("TANDEM-READY".into());
        std::fs::write(path, f.to_toml())?;
        let unmapped = unmapped
            .into_iter()
            .map(|u| format!("{}: {}", u.element, u.why))
            .collect();
        Ok(Imported {
            unmapped,
            nic_bridge: bridge,
        })
    }

    /// As the backup host's libvirt: what it shows of the domain, once the backup defined it
    /// (waiting up to `timeout` for that).
    pub fn backup_view(&self, timeout: Duration) -> BackupView {
        let t = Instant::now();
        let xml = loop {
            match self.virsh(&["dumpxml", "--inactive", DOMAIN]) {
                Ok(x) => break x,
                Err(_) if t.elapsed() < timeout => std::thread::sleep(Duration::from_millis(500)),
                Err(_) => return BackupView::default(),
            }
        };
        let start = self.virsh(&["start", DOMAIN]);
        BackupView {
            defined: true,
            state: self.state(),
            marked: tandem_protect::libvirt::inloop::marked(&xml).is_some(),
            disk_on_copy: xml.contains(tandem_protect::disk_copy::FILE) && xml.contains("<slice "),
            start_refused: matches!(&start, Err(e) if e.to_string().contains("protected by tandem")),
            ..BackupView::default()
        }
    }

    /// The domain's state (`running`, `shut off`, ...).
    pub fn state(&self) -> String {
        self.virsh(&["domstate", DOMAIN])
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|e| e.to_string())
    }
}

impl Drop for Libvirtd {
    fn drop(&mut self) {
        let _ = self.virsh(&["destroy", DOMAIN]);
        let _ = self.child.kill();
        // `ip netns exec` ends with libvirtd (exec'd in the same process).
        let _ = self.child.wait();
    }
}
