//! `tandem demo --vm debian --adopt`: the Debian VM is not booted by tandem but by hand — a
//! plain QEMU in the clients' namespace with anonymous RAM and a tap of its own on the clients'
//! bridge, as a libvirt-less operator would run it — and `tandem adopt` takes it over while
//! PostgreSQL commits and an SSH session ticks, then protects it until the host is killed.
//! With `--libvirt` a real libvirtd runs it instead ([`super::libvirt`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;

use super::daemon::Daemon;
use super::libvirt::{Imported, Libvirtd, DOMAIN};
use super::pg::{self, Committer, Pgbench, Ticker};
use crate::netlab::{BRIDGE, GUEST_IP};

/// The source QEMU's tap on the clients' bridge.
const TAP: &str = "tsrc0";

/// The QEMU that runs the VM before the adoption: started by hand (with its tap, removed on
/// drop), or by libvirt.
pub struct Source {
    run: Runner,
    console: PathBuf,
    ns: String,
}

enum Runner {
    ByHand { qemu: Daemon, qmp: PathBuf },
    Libvirt(Libvirtd),
}

/// Who runs the VM before the adoption.
pub enum Via<'a> {
    /// A plain QEMU started by hand.
    Hand,
    /// A libvirtd of the round's own; its qemu hook runs `tandem`.
    Libvirt { tandem: &'a Path },
}

/// What libvirt showed of the adopted domain.
#[derive(Serialize, Debug, Clone)]
pub struct LibvirtView {
    /// What `tandem vm import` named as not carried over.
    pub unmapped: Vec<String>,
    /// The bridge import found for the NIC on a libvirt network.
    pub nic_bridge: Option<String>,
    /// The domain's state after the adoption.
    pub state_after: String,
    /// `virsh start` was refused by tandem's hook.
    pub start_refused: bool,
    /// The domain's title after the adoption (tandem's mark).
    pub title: String,
    /// Its autostart after the adoption.
    pub autostart: String,
}

/// What the adoption did, as the demo saw it.
#[derive(Serialize, Debug, Clone)]
pub struct Adoption {
    /// The hand-started QEMU's boot to the guest's ready marker.
    pub boot_s: f64,
    /// `tandem adopt` started to the guest running in tandem's QEMU (its process start,
    /// the backup's connection and the whole migration).
    pub adopt_s: f64,
    /// The guest's downtime as tandem reported it (QEMU's own plus the switch).
    pub downtime_ms: f64,
    /// The longest time between two acknowledged commits while it moved (one psql session
    /// committing one row at a time: what a client saw of the switch).
    pub commit_gap_ms: f64,
    /// The hand-started QEMU quit after the migration.
    pub source_quit: bool,
    /// With --libvirt: what libvirt showed.
    pub libvirt: Option<LibvirtView>,
}

impl Source {
    /// Starts the VM of `desc` by hand in namespace `ns`, its NIC on a tap of its own on the
    /// clients' bridge.
    pub fn start(ns: &str, desc: &Path, rdir: &Path) -> anyhow::Result<Source> {
        let ip = |args: &[&str]| -> anyhow::Result<()> {
            let ok = Command::new("ip")
                .args(["-n", ns])
                .args(args)
                .status()?
                .success();
            if !ok {
                bail!("ip -n {ns} {}", args.join(" "));
            }
            Ok(())
        };
        let _ = Command::new("ip")
            .args(["-n", ns, "link", "del", TAP])
            .status();
        ip(&["tuntap", "add", "dev", TAP, "mode", "tap"])?;
        ip(&["link", "set", TAP, "master", BRIDGE, "up"])?;
        let cfg = tandem_protect::VmSpec::described(desc).config("source")?;
        let (qmp, console) = (
            rdir.join("source-qmp.sock"),
            rdir.join("source-console.log"),
        );
        let netdev = format!("tap,id=n0,ifname={TAP},script=no,downscript=no");
        let args = tandem_vm::qemu_args::by_hand(&cfg, &qmp, &console, &[&netdev]);
        std::fs::write(
            rdir.join("source-command.txt"),
            format!("qemu-system-x86_64 {}\n", args.join(" ")),
        )?;
        let qemu = Daemon::spawn(
            "source",
            ns,
            Path::new("qemu-system-x86_64"),
            &args,
            rdir.join("source-qemu.log"),
        )
        .context("starting the VM by hand")?;
        Ok(Source {
            run: Runner::ByHand { qemu, qmp },
            console,
            ns: ns.into(),
        })
    }

    /// Starts the VM in a libvirtd of its own in namespace `ns` (virt-install from the
    /// round's disk), then writes the description `tandem vm import` makes of it to `desc`.
    pub fn libvirt(
        ns: &str,
        desc: &Path,
        rdir: &Path,
        tandem: &Path,
        mem_mib: u64,
    ) -> anyhow::Result<(Source, Imported)> {
        let l = Libvirtd::start(ns, &rdir.join("libvirt"), tandem)?;
        let console = rdir.join("source-console.log");
        l.install(
            &rdir.join("disk.qcow2"),
            mem_mib,
            tandem_labguest::MAC,
            &console,
        )?;
        let imported = l.import(desc)?;
        Ok((
            Source {
                run: Runner::Libvirt(l),
                console,
                ns: ns.into(),
            },
            imported,
        ))
    }

    /// Whether the VM's old QEMU is gone.
    fn exited(&mut self) -> bool {
        match &mut self.run {
            Runner::ByHand { qemu, .. } => qemu.exited(),
            Runner::Libvirt(l) => l.state() == "shut off",
        }
    }

    /// Waits for the guest's ready marker on its console.
    pub fn wait_ready(&mut self, marker: &str, timeout: Duration) -> anyhow::Result<()> {
        let mut c = tandem_vm::console::Console::new(&self.console);
        c.wait_for(marker, 0, timeout)
            .with_context(|| format!("the VM started by hand did not say {marker}"))?;
        Ok(())
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        if matches!(self.run, Runner::Libvirt(_)) {
            return;
        }
        let _ = Command::new("ip")
            .args(["-n", &self.ns, "link", "del", TAP])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// The round's VM booted by hand, with the clients that run while it moves: a psql session
/// committing, an SSH session ticking, and with --pgbench a pgbench run.
pub struct ByHand {
    source: Source,
    ticker: Ticker,
    committer: Committer,
    postmaster_start: String,
    boot_s: f64,
    pgbench: Option<std::thread::JoinHandle<anyhow::Result<Pgbench>>>,
    /// With --libvirt: what import made of the domain.
    imported: Imported,
    hardware_before: Option<Vec<String>>,
}

impl ByHand {
    /// Boots the VM of `desc` by hand in namespace `ns` (or libvirt does, and `desc` becomes
    /// its import), waits for PostgreSQL and starts the clients (`pgbench`: its seconds and
    /// scale), then lets them run 3 s.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        ns: &str,
        desc: &Path,
        rdir: &Path,
        key: &Path,
        round: u64,
        pgbench: Option<(u64, u32)>,
        via: Via<'_>,
        mem_mib: u64,
    ) -> anyhow::Result<ByHand> {
        let t = Instant::now();
        let (mut source, imported) = match via {
            Via::Hand => (Source::start(ns, desc, rdir)?, Imported::default()),
            Via::Libvirt { tandem } => Source::libvirt(ns, desc, rdir, tandem, mem_mib)?,
        };
        source.wait_ready("TANDEM-READY", Duration::from_secs(400))?;
        let boot_s = t.elapsed().as_secs_f64();
        pg::wait_ready(ns, GUEST_IP, Duration::from_secs(60))?;
        let postmaster_start = pg::query(ns, GUEST_IP, "SELECT pg_postmaster_start_time()")?;
        // What the guest sees of its hardware under libvirt, to compare after a reboot under
        // tandem (the import's round trip).
        let hardware_before = match source.run {
            Runner::Libvirt(_) => Some(guest_hardware(ns, key)?),
            Runner::ByHand { .. } => None,
        };
        let ticker = Ticker::start(ns, key, GUEST_IP)?;
        let committer = Committer::start(ns, GUEST_IP, round)?;
        // With --pgbench the move happens under pgbench's load too.
        let pgbench = match pgbench {
            Some((secs, scale)) => {
                pg::pgbench_init(pg::PgAt::Netns { ns, host: GUEST_IP }, scale)?;
                let ns = ns.to_string();
                Some(std::thread::spawn(move || {
                    pg::pgbench(&ns, GUEST_IP, 4, secs)
                }))
            }
            None => None,
        };
        std::thread::sleep(Duration::from_secs(3));
        Ok(ByHand {
            source,
            ticker,
            committer,
            postmaster_start,
            boot_s,
            pgbench,
            imported,
            hardware_before,
        })
    }

    /// How `tandem adopt` reaches the VM's QEMU.
    pub fn adopt_args(&self) -> Vec<String> {
        match &self.source.run {
            Runner::ByHand { qmp, .. } => vec!["--qmp".into(), qmp.display().to_string()],
            Runner::Libvirt(l) => vec![
                "--libvirt".into(),
                DOMAIN.into(),
                "--connect".into(),
                l.uri.clone(),
            ],
        }
    }

    /// Waits for `tandem adopt` (`primary`, started at `started`) to say the guest moved;
    /// returns its line and what the clients saw of the move.
    pub fn adopted(
        &mut self,
        primary: &mut Daemon,
        started: Instant,
    ) -> anyhow::Result<(String, Adoption)> {
        let line = primary.wait_line("adopted the running guest", Duration::from_secs(600))?;
        let moved = Instant::now();
        let adopt_s = started.elapsed().as_secs_f64();
        // The committer's view of the move: from the adoption's start to a second after.
        std::thread::sleep(Duration::from_secs(2));
        let acked = self
            .committer
            .acked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let commit_gap_ms = gap_ms(&acked, started, moved + Duration::from_secs(1));
        let quit = Instant::now();
        while !self.source.exited() && quit.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let libvirt = match &self.source.run {
            Runner::Libvirt(l) => {
                // tandem marks the domain just after the line; give it a moment.
                let _ = primary.wait_line("marked as protected by tandem", Duration::from_secs(30));
                let start = l.virsh(&["start", DOMAIN]);
                Some(LibvirtView {
                    unmapped: self.imported.unmapped.clone(),
                    nic_bridge: self.imported.nic_bridge.clone(),
                    state_after: l.state(),
                    start_refused: matches!(&start, Err(e) if e.to_string().contains("protected by tandem")),
                    title: l
                        .virsh(&["desc", DOMAIN, "--title"])
                        .unwrap_or_default()
                        .trim()
                        .to_string(),
                    autostart: l
                        .virsh(&["dominfo", DOMAIN])
                        .unwrap_or_default()
                        .lines()
                        .find_map(|x| x.strip_prefix("Autostart:"))
                        .unwrap_or("?")
                        .trim()
                        .to_string(),
                })
            }
            Runner::ByHand { .. } => None,
        };
        let a = Adoption {
            boot_s: self.boot_s,
            adopt_s,
            downtime_ms: downtime_ms(&line).unwrap_or(f64::NAN),
            commit_gap_ms,
            source_quit: self.source.exited(),
            libvirt,
        };
        Ok((line, a))
    }

    /// pgbench's result (waiting for it to end), and the clients that go on with the round.
    pub fn finish(self) -> anyhow::Result<(Option<Pgbench>, Clients)> {
        let pgbench = match self.pgbench {
            Some(h) => Some(
                h.join()
                    .map_err(|_| anyhow::anyhow!("pgbench's thread panicked"))??,
            ),
            None => None,
        };
        let clients = Clients {
            ticker: self.ticker,
            committer: self.committer,
            postmaster_start: self.postmaster_start,
            hardware_before: self.hardware_before,
        };
        Ok((pgbench, clients))
    }
}

/// The clients started before the move, and the postmaster's start time then.
pub struct Clients {
    pub ticker: Ticker,
    pub committer: Committer,
    pub postmaster_start: String,
    /// With --libvirt: the guest's view of its hardware under libvirt.
    pub hardware_before: Option<Vec<String>>,
}

/// The hardware the guest sees, read inside it: every PCI function (address, vendor, device,
/// subsystem, class, as `lspci -n` shows them), every NIC (name, which follows its PCI path,
/// and MAC), the vCPU count and the first vCPU's flags.
pub fn guest_hardware(ns: &str, key: &Path) -> anyhow::Result<Vec<String>> {
    guest_hardware_within(ns, key, Duration::ZERO)
}

/// [`guest_hardware`], trying ssh again every 2 s for up to `patience` while it cannot connect
/// (ssh's status 255): after a reboot PostgreSQL can answer before sshd listens.
fn guest_hardware_within(ns: &str, key: &Path, patience: Duration) -> anyhow::Result<Vec<String>> {
    const SCRIPT: &str = "for d in /sys/bus/pci/devices/*; do echo \"pci $(basename $d) $(cat $d/vendor $d/device $d/subsystem_vendor $d/subsystem_device $d/class | tr '\\n' ' ')\"; done; \
        for n in /sys/class/net/*; do echo \"nic $(basename $n) $(cat $n/address)\"; done; \
        echo \"cpus $(nproc)\"; grep -m1 '^flags' /proc/cpuinfo";
    let t = Instant::now();
    let out = loop {
        let out = pg::ssh(ns, key, GUEST_IP)
            .arg(SCRIPT)
            .output()
            .context("running ssh")?;
        if out.status.code() == Some(255) && t.elapsed() < patience {
            std::thread::sleep(Duration::from_secs(2));
            continue;
        }
        break out;
    };
    if !out.status.success() {
        bail!(
            "reading the guest's hardware over ssh: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect())
}

/// The import's round trip: the guest's hardware under libvirt, and after a reboot under
/// tandem's QEMU built from the imported description.
#[derive(Serialize, Debug, Clone)]
pub struct HardwareRoundTrip {
    /// Under libvirt (PCI functions, NICs, vCPUs and flags).
    pub before: Vec<String>,
    /// After the reboot under tandem.
    pub after_reboot: Vec<String>,
    /// Lines only one side has.
    pub differences: Vec<String>,
    /// The guest came back with another postmaster (it did reboot).
    pub rebooted: bool,
}

impl HardwareRoundTrip {
    /// Reboots the guest (running under tandem) and reads its hardware again.
    pub fn after_reboot(
        ns: &str,
        key: &Path,
        before: Vec<String>,
        postmaster_before: &str,
    ) -> anyhow::Result<HardwareRoundTrip> {
        // systemd answers and then reboots; ssh may see the connection drop.
        let _ = pg::ssh(ns, key, GUEST_IP).arg("systemctl reboot").output();
        // Until PostgreSQL answers with another start time: the old postmaster may still
        // answer for a moment while the guest shuts down.
        let t = Instant::now();
        let postmaster = loop {
            std::thread::sleep(Duration::from_secs(2));
            if let Ok(p) = pg::query(ns, GUEST_IP, "SELECT pg_postmaster_start_time()") {
                if p != postmaster_before {
                    break p;
                }
            }
            if t.elapsed() > Duration::from_secs(400) {
                bail!("the guest did not come back with a new PostgreSQL within 400 s of its reboot under tandem");
            }
        };
        let after_reboot = guest_hardware_within(ns, key, Duration::from_secs(120))?;
        let only = |a: &[String], b: &[String], side: &str| -> Vec<String> {
            a.iter()
                .filter(|x| !b.contains(x))
                .map(|x| format!("{side}: {x}"))
                .collect()
        };
        let mut differences = only(&before, &after_reboot, "only under libvirt");
        differences.extend(only(&after_reboot, &before, "only under tandem"));
        Ok(HardwareRoundTrip {
            before,
            after_reboot,
            differences,
            rebooted: postmaster != postmaster_before,
        })
    }
}

/// tandem's report of the adoption: the guest's downtime in ms.
pub fn downtime_ms(line: &str) -> Option<f64> {
    line.split("guest stopped ")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The longest time between two consecutive acknowledgements in `acked` that overlaps
/// `[from, to]`.
pub fn gap_ms(acked: &[(Instant, u64)], from: Instant, to: Instant) -> f64 {
    acked
        .windows(2)
        .filter(|w| w[1].0 >= from && w[0].0 <= to)
        .map(|w| w[1].0.duration_since(w[0].0).as_secs_f64() * 1000.0)
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_downtime_is_read_from_the_adopted_line() {
        let l = "primary: adopted the running guest without a reboot: migrated 1024 MiB in 2.5 s (4 pre-copy round(s)), guest stopped 101 ms (QEMU's 100 ms + 1 ms to run here); QEMU pid 7, the old QEMU quit";
        assert_eq!(downtime_ms(l), Some(101.0));
        assert_eq!(super::super::daemon::qemu_pid(l), 7);
    }

    #[test]
    fn the_gap_counts_only_acknowledgements_around_the_move() {
        let t = Instant::now();
        let at = |ms| t + Duration::from_millis(ms);
        let acked = [
            (at(0), 1),
            (at(10), 2),
            (at(500), 3),
            (at(510), 4),
            (at(2000), 5),
        ];
        assert_eq!(gap_ms(&acked, at(400), at(505)), 490.0);
        assert_eq!(gap_ms(&acked, at(400), at(600)), 1490.0);
    }
}
