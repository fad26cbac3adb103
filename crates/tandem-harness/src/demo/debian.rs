//! `tandem demo --vm debian`: your own VM under protection. The Debian 12 test VM (`tandem
//! setup --debian`: firmware boot from a qcow2 disk, 2 vCPUs, 1 GiB, systemd, PostgreSQL,
//! OpenSSH) runs under `tandem primary`/`tandem backup` in the demo's namespaces, its disk
//! captured with blockdev-mirror and its NIC on the clients' bridge with output held until
//! acknowledged. Each round boots it from a fresh copy-on-write overlay of the image, starts a
//! `psql` session committing rows and an SSH session from the clients' namespace, kills the
//! primary host (its tandem and QEMU, SIGKILL) at a random time, and checks after failover:
//! every acknowledged commit is in the database, the postmaster was not restarted (same start
//! time), both sessions survived, `pg_amcheck` finds no corruption, and nothing of the
//! primary's copy got out once the backup ran the guest.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::netlab::NetLab;
use crate::netlab::{BACKUP_IP, GUEST_IP};
use anyhow::bail;
use indicatif::ProgressBar;
use serde::Serialize;
use tandem_types::stats::quantile;

use super::adopt;
use super::capture::Capture;
use super::daemon::{qemu_pid, Daemon};
use super::libvirt;
use super::pg::{self, Committer, DebianVm, Ticker};
use super::phases::{copy_stopped, field, Clock};
use super::round::{Epochs, MIB};
use super::steps::{leftovers, read_report};

/// What a Debian round found.
#[derive(Serialize, Debug)]
pub struct DebianRound {
    pub round: usize,
    /// Boot to the guest's ready marker, under the primary.
    pub boot_s: f64,
    /// Ready to the third acknowledged epoch (disk mirror pass + RAM copy).
    pub protect_s: f64,
    pub kill_after_s: f64,
    pub epochs_acked: u64,
    pub raw_mib: f64,
    pub sent_mib: f64,
    pub pause_ms_p50: f64,
    pub pause_ms_p99: f64,
    /// Median time QEMU had the guest stopped in a pause (its STOP to RESUME events).
    pub stopped_ms_p50: f64,
    /// Shares of the time from protection to the kill that the guest spent paused or
    /// suspended, and of the vCPU time it lost to them (what the guest-time budget counts).
    pub paused_share: f64,
    pub cpu_lost_share: f64,
    /// Commits per second acknowledged while replicated, and on the backup after failover
    /// (unprotected: the same VM's native rate in the same round).
    pub commits_per_s_replicated: f64,
    pub commits_per_s_after_failover: f64,
    pub commit_latency_ms_p50: f64,
    pub commit_latency_ms_p99: f64,
    pub commits_acked: u64,
    pub commits_lost: u64,
    pub first_lost: Option<u64>,
    pub psql_session_survived: bool,
    pub psql_error: Option<String>,
    pub postmaster_start_before: String,
    pub postmaster_start_after: String,
    pub ssh_session_survived: bool,
    pub ssh_ticks_after_failover: usize,
    pub amcheck: String,
    pub detection_ms: f64,
    pub resume_after_detection_ms: f64,
    pub kill_to_running_ms: f64,
    /// Longest time between two acknowledged commits around the kill.
    pub commit_gap_ms: f64,
    pub primary_frames_after_failover: u64,
    pub primary_copy_stopped: bool,
    pub leftovers: Vec<String>,
    /// pgbench replicated (output held until acknowledged) and after failover (native).
    pub pgbench_replicated: Option<pg::Pgbench>,
    pub pgbench_after_failover: Option<pg::Pgbench>,
    /// With --adopt: the VM was booted by hand and adopted (then `boot_s` is the adoption).
    pub adoption: Option<adopt::Adoption>,
    /// With --adopt --libvirt: the guest's hardware under libvirt and after a reboot under
    /// tandem.
    pub hardware: Option<adopt::HardwareRoundTrip>,
    /// With --adopt and --pgbench: pgbench while the guest moved (from just before `tandem
    /// adopt` started, for --pgbench seconds).
    pub pgbench_during_adoption: Option<pg::Pgbench>,
    /// With --adopt --libvirt: what the backup host's libvirt showed after the failover.
    pub libvirt_backup: Option<libvirt::BackupView>,
}

impl DebianRound {
    pub fn ok(&self) -> bool {
        self.commits_lost == 0
            && self.commits_acked > 0
            && self.psql_session_survived
            && !self.postmaster_start_before.is_empty()
            && self.postmaster_start_before == self.postmaster_start_after
            && self.ssh_session_survived
            && self.ssh_ticks_after_failover > 0
            && self.amcheck == "ok"
            && self.primary_frames_after_failover == 0
            && self.primary_copy_stopped
            && self.leftovers.is_empty()
            && self
                .adoption
                .as_ref()
                .is_none_or(|a| a.source_quit && a.libvirt.as_ref().is_none_or(|l| l.start_refused))
            && self.libvirt_backup.as_ref().is_none_or(|b| b.ok())
    }
}

/// The demo's settings for the Debian VM.
pub struct DebianOpts<'a> {
    pub exe: PathBuf,
    pub lab: &'a NetLab,
    pub vm: DebianVm,
    /// The rounds' overlays and logs (on disk).
    pub dir: PathBuf,
    /// The daemons' directories: the backup's RAM mirror must be in memory (/dev/shm).
    pub shm: PathBuf,
    pub epoch_ms: u64,
    /// The primary's `--schedule`.
    pub schedule: String,
    /// More flags for the primary (`--primary-arg`).
    pub primary_args: Vec<String>,
    pub timeout_ms: u64,
    pub codec: String,
    pub before: Duration,
    pub after: Duration,
    /// Also run pgbench (4 clients, this many seconds) replicated before the kill and on the
    /// backup after failover (the same VM unprotected: the native baseline).
    pub pgbench: Option<u64>,
    /// pgbench's scale factor (its database is about 15 MiB per unit), loaded replicated.
    pub pgbench_scale: u32,
    /// Guest RAM, MiB.
    pub mem: u64,
    /// Its virtio devices in legacy mode only (the description's `legacy_virtio`).
    pub legacy_virtio: bool,
    /// Boot the VM by hand (a plain QEMU) and `tandem adopt` it instead of booting it under
    /// the primary.
    pub adopt: bool,
    /// With `adopt`: libvirt runs the VM before (and the daemons are fenced with `etcd`,
    /// through which the backup host's libvirt learns the domain).
    pub libvirt: bool,
    /// Fence the daemons with this etcd cluster (each round another VM id).
    pub etcd: Option<&'a super::etcdlab::EtcdLab>,
}

/// The round's description: the image as a fresh overlay, no forwards (the NIC goes on the
/// clients' bridge through `--tap-netns`).
fn describe(o: &DebianOpts<'_>, rdir: &Path) -> anyhow::Result<PathBuf> {
    let overlay = rdir.join("disk.qcow2");
    tandem_vm::desc::create_overlay(&o.vm.image, &overlay)?;
    let desc = format!(
        "# The Debian test VM on a copy-on-write overlay of {image}\n\
         {ram_block}mem = {mem}\nvcpus = 2\nready = \"TANDEM-READY\"\n{legacy}\n[boot]\nfirmware = \"seabios\"\n\n\
         [[disk]]\npath = \"{disk}\"\nformat = \"qcow2\"\ncache = \"writeback\"\n\n\
         [[nic]]\nmac = \"{mac}\"\n",
        // A VM started with plain -m (to be adopted) names its RAM pc.ram, and its virtio NIC
        // on a tap uses virtio-net headers.
        ram_block = if o.adopt {
            "ram_block = \"pc.ram\"\nvnet_hdr = true\n"
        } else {
            ""
        },
        legacy = if o.legacy_virtio {
            "legacy_virtio = true\n"
        } else {
            ""
        },
        image = o.vm.image.display(),
        disk = overlay.display(),
        mac = tandem_labguest::MAC,
        mem = o.mem,
    );
    let path = rdir.join("vm.toml");
    std::fs::write(&path, desc)?;
    Ok(path)
}

fn daemon_args(o: &DebianOpts<'_>, r: usize, desc: &Path, v: &mut Vec<String>) {
    v.extend(["--vm-config".into(), desc.display().to_string()]);
    v.extend(["--tap-netns", &o.lab.clients].map(String::from));
    if let Some(e) = o.etcd {
        v.extend(e.daemon_args(r as u64));
    }
}

/// One round: boot, protect, commit, kill, fail over, check.
pub fn round(r: usize, o: &DebianOpts<'_>, pb: &ProgressBar) -> anyhow::Result<DebianRound> {
    let rdir = o.dir.join(format!("round{r}"));
    std::fs::create_dir_all(&rdir)?;
    let desc = describe(o, &rdir)?;
    let report = rdir.join("failover.json");
    let jsonl = rdir.join("epochs.jsonl");
    // With --adopt the VM is booted by hand (or by libvirt, which also describes it), and a
    // client commits while it moves; the backup starts from that description.
    let ns = o.lab.clients.as_str();
    let mut by_hand = if o.adopt {
        pb.set_message(if o.libvirt {
            format!("round {r}: libvirtd and virt-install boot Debian (q35, libvirt's defaults; TCG is slow)")
        } else {
            format!("round {r}: booting Debian by hand (a plain QEMU, its own tap on the bridge; TCG is slow)")
        });
        let via = if o.libvirt {
            adopt::Via::Libvirt { tandem: &o.exe }
        } else {
            adopt::Via::Hand
        };
        let pgbench = o.pgbench.map(|secs| (secs, o.pgbench_scale));
        Some(adopt::ByHand::start(
            ns, &desc, &rdir, &o.vm.key, r as u64, pgbench, via, o.mem,
        )?)
    } else {
        None
    };
    let mut bargs: Vec<String> = vec!["backup".into(), "--listen".into()];
    bargs.push(format!("{BACKUP_IP}:7000"));
    bargs.extend([
        "--dir".into(),
        o.shm.join(format!("round{r}-backup")).display().to_string(),
    ]);
    bargs.extend(["--timeout-ms".into(), o.timeout_ms.to_string()]);
    bargs.extend(["--report".into(), report.display().to_string()]);
    daemon_args(o, r, &desc, &mut bargs);
    // With --libvirt the backup host has a libvirtd too (with the same network): the backup
    // gives it the domain. (It runs where the domain's NIC reaches the clients' bridge.)
    let backup_libvirt = match o.libvirt {
        true => {
            let l = libvirt::Libvirtd::start(ns, &rdir.join("libvirt-backup"), &o.exe)?;
            l.define_network()?;
            bargs.extend([
                "--libvirt".into(),
                libvirt::DOMAIN.into(),
                "--connect".into(),
                l.uri.clone(),
            ]);
            Some(l)
        }
        false => None,
    };
    pb.set_message(format!("round {r}: starting the backup"));
    let mut backup = Daemon::spawn(
        "backup",
        &o.lab.backup,
        &o.exe,
        &bargs,
        rdir.join("backup.log"),
    )?;
    backup.wait_line("listening on", Duration::from_secs(60))?;
    let backup_addr: SocketAddr = format!("{BACKUP_IP}:7000").parse()?;
    let mut pargs: Vec<String> = match &by_hand {
        Some(b) => [
            vec!["adopt".to_string()],
            b.adopt_args(),
            vec!["--backup".into()],
        ]
        .concat(),
        None => vec!["primary".into(), "--backup".into()],
    };
    pargs.push(backup_addr.to_string());
    pargs.extend([
        "--dir".into(),
        o.shm
            .join(format!("round{r}-primary"))
            .display()
            .to_string(),
    ]);
    pargs.extend(["--codec".into(), o.codec.clone()]);
    pargs.extend(["--epoch-ms".into(), o.epoch_ms.to_string()]);
    pargs.extend(["--schedule".into(), o.schedule.clone()]);
    pargs.extend(["--metrics-jsonl".into(), jsonl.display().to_string()]);
    daemon_args(o, r, &desc, &mut pargs);
    pargs.extend(o.primary_args.iter().cloned());
    pb.set_message(if o.adopt {
        format!("round {r}: tandem adopt: live migration into tandem's QEMU while psql commits")
    } else {
        format!(
            "round {r}: booting Debian under the primary (firmware, GRUB, systemd, PostgreSQL; TCG is slow)"
        )
    });
    let t = Instant::now();
    let mut primary = Daemon::spawn(
        "primary",
        &o.lab.primary,
        &o.exe,
        &pargs,
        rdir.join("primary.log"),
    )?;
    let (ready, boot_s, adoption) = match &mut by_hand {
        Some(b) => {
            let (line, a) = b.adopted(&mut primary, t)?;
            (line, a.boot_s, Some(a))
        }
        None => {
            let line = primary.wait_line("guest ready", Duration::from_secs(400))?;
            (line, t.elapsed().as_secs_f64(), None)
        }
    };
    let qemu = qemu_pid(&ready);
    let mut ep = Epochs::default();
    let t = Instant::now();
    while ep.acked < 3 {
        pb.set_message(format!(
            "round {r}: copying the disk (blockdev-mirror) and RAM to the backup, {:.0} s",
            t.elapsed().as_secs_f64()
        ));
        if primary.exited() || backup.exited() || t.elapsed() > Duration::from_secs(600) {
            bail!(
                "the pair did not reach protection; logs in {}",
                rdir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
        ep.poll(&jsonl);
    }
    let protect_s = t.elapsed().as_secs_f64();
    let protected_at = Instant::now();
    let (pgbench_during_adoption, early) = match by_hand {
        Some(b) => {
            let (pgbench, clients) = b.finish()?;
            (pgbench, Some(clients))
        }
        None => (None, None),
    };
    let hardware_before = early.as_ref().and_then(|c| c.hardware_before.clone());
    let postmaster_start_before = match &early {
        Some(c) => c.postmaster_start.clone(),
        None => {
            pg::wait_ready(ns, GUEST_IP, Duration::from_secs(60))?;
            pg::query(ns, GUEST_IP, "SELECT pg_postmaster_start_time()")?
        }
    };
    let pgbench_replicated = match o.pgbench {
        Some(secs) => {
            pb.set_message(format!(
                "round {r}: pgbench replicated ({secs} s, 4 clients)"
            ));
            let at = pg::PgAt::Netns { ns, host: GUEST_IP };
            pg::pgbench_init(at, o.pgbench_scale)?;
            Some(pg::pgbench(ns, GUEST_IP, 4, secs)?)
        }
        None => None,
    };
    let capture = Capture::start(ns, "tdp0")?;
    let clock = Clock::now();
    let (mut ticker, committer) = match early {
        Some(c) => (c.ticker, c.committer),
        None => (
            Ticker::start(ns, &o.vm.key, GUEST_IP)?,
            Committer::start(ns, GUEST_IP, r as u64)?,
        ),
    };
    let commits_at_start = committer.count();
    let started = Instant::now();
    let mut last = Instant::now();
    while started.elapsed() < o.before {
        std::thread::sleep(Duration::from_millis(100));
        ep.poll(&jsonl);
        if last.elapsed() >= Duration::from_secs(1) {
            last = Instant::now();
            pb.set_message(format!(
                "round {r}: replicating | epoch {} acked | {} commits acknowledged | pause p50 {:.1} ms",
                ep.acked,
                committer.count(),
                quantile(&ep.pauses, 0.5)
            ));
        }
        if primary.exited() || backup.exited() {
            bail!(
                "a daemon exited during replication; logs in {}",
                rdir.display()
            );
        }
    }
    let commits_at_kill = committer.count();
    let kill_after_s = started.elapsed().as_secs_f64();
    let replicated_s = protected_at.elapsed().as_secs_f64();
    pb.set_message(format!("round {r}: killing the primary host"));
    let (kill_at, kill_unix) = (Instant::now(), tandem_protect::unix_ms());
    primary.kill_host();
    let deadline = Instant::now() + Duration::from_secs(60);
    let rep = loop {
        if let Some(v) = read_report(&report) {
            break v;
        }
        if backup.exited() || Instant::now() > deadline {
            bail!("the backup did not fail over; see {}", backup.log.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let primary_copy_stopped = copy_stopped(qemu);
    let running = clock.at(field(&rep, "running_at_ms"));
    let commits_at_running = committer.count();
    let t = Instant::now();
    while t.elapsed() < o.after {
        std::thread::sleep(Duration::from_millis(200));
        pb.set_message(format!(
            "round {r}: running on the backup | {} commits since failover",
            committer.count() - commits_at_running
        ));
    }
    let after_s = t.elapsed().as_secs_f64();
    let (ssh_alive, ssh_ticks) = ticker.alive_and_ticks_after(running);
    drop(ticker);
    let (acked, psql_error) = committer.stop();
    let pgbench_after_failover = match o.pgbench {
        Some(secs) => {
            pb.set_message(format!(
                "round {r}: pgbench on the backup after failover ({secs} s)"
            ));
            Some(pg::pgbench(ns, GUEST_IP, 4, secs)?)
        }
        None => None,
    };
    pb.set_message(format!(
        "round {r}: checking every acknowledged commit, the postmaster, pg_amcheck"
    ));
    let ids: Vec<u64> = acked.iter().map(|a| a.1).collect();
    let lost = pg::missing(ns, GUEST_IP, &ids)?;
    let postmaster_start_after = pg::query(ns, GUEST_IP, "SELECT pg_postmaster_start_time()")?;
    let amcheck = match pg::amcheck(ns, &o.vm.key, GUEST_IP)? {
        Ok(()) => "ok".to_string(),
        Err(e) => e,
    };
    // With --libvirt: the backup host's libvirt knows the domain, guarded, on its copy.
    let mut libvirt_backup = backup_libvirt
        .as_ref()
        .map(|l| l.backup_view(Duration::from_secs(30)));
    // With --libvirt: the import's round trip — the guest reboots under tandem's QEMU (built
    // from the description import made) and must find the hardware libvirt gave it.
    let hardware = match hardware_before {
        Some(before) => {
            pb.set_message(format!(
                "round {r}: rebooting the guest under tandem to compare its hardware with libvirt's"
            ));
            Some(adopt::HardwareRoundTrip::after_reboot(
                ns,
                &o.vm.key,
                before,
                &postmaster_start_after,
            )?)
        }
        None => None,
    };
    // Latency: time between consecutive acknowledgements before the kill (one session, one
    // commit at a time); the gap: the longest pause in acknowledgements around the kill.
    let lat: Vec<f64> = acked
        .windows(2)
        .filter(|w| w[1].0 < kill_at)
        .map(|w| w[1].0.duration_since(w[0].0).as_secs_f64() * 1000.0)
        .collect();
    let gap = acked
        .windows(2)
        .filter(|w| w[1].0 > kill_at)
        .map(|w| w[1].0.duration_since(w[0].0).as_secs_f64() * 1000.0)
        .take(50)
        .fold(0.0, f64::max);
    let after_failover = capture.after(running + Duration::from_millis(200)) as u64;
    drop(capture);
    backup.terminate(Duration::from_secs(15));
    // With --libvirt: protection ended (the guest shut down under tandem), the domain is given
    // back to the backup host's libvirt and boots from the backup's copy with every commit.
    if let (Some(l), Some(view)) = (backup_libvirt, libvirt_backup.as_mut()) {
        pb.set_message(format!(
            "round {r}: giving the domain back to the backup host's libvirt (virsh start)"
        ));
        match l.give_back() {
            Ok(()) => view.given_back = true,
            Err(e) => view.give_back_error = Some(format!("{e:#}")),
        }
        if view.given_back {
            pg::wait_ready(ns, GUEST_IP, Duration::from_secs(240))?;
            view.given_back_lost = Some(pg::missing(ns, GUEST_IP, &ids)?.len() as u64);
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut left = leftovers(&rdir, &[backup.pid(), primary.pid()]);
    for side in ["backup", "primary"] {
        let d = o.shm.join(format!("round{r}-{side}"));
        left.extend(
            leftovers(&d, &[])
                .into_iter()
                .filter(|l| !l.starts_with("process")),
        );
        for f in ["mirror.ram", "disk.img"] {
            if d.join(f).exists() {
                left.push(format!("file {}", d.join(f).display()));
            }
        }
        let _ = std::fs::remove_dir_all(&d);
    }
    let detected = field(&rep, "detected_at_ms");
    Ok(DebianRound {
        round: r,
        boot_s,
        protect_s,
        kill_after_s,
        epochs_acked: ep.acked,
        raw_mib: ep.raw as f64 / MIB,
        sent_mib: ep.sent as f64 / MIB,
        pause_ms_p50: quantile(&ep.pauses, 0.5),
        pause_ms_p99: quantile(&ep.pauses, 0.99),
        stopped_ms_p50: quantile(&ep.stopped, 0.5),
        paused_share: (ep.pauses.iter().sum::<f64>() + ep.suspended_ms) / 1000.0 / replicated_s,
        cpu_lost_share: ep.lost_cpu_ms / 1000.0 / replicated_s,
        commits_per_s_replicated: (commits_at_kill - commits_at_start) as f64 / kill_after_s,
        commits_per_s_after_failover: (ids.len() as u64 - commits_at_running) as f64 / after_s,
        commit_latency_ms_p50: quantile(&lat, 0.5),
        commit_latency_ms_p99: quantile(&lat, 0.99),
        commits_acked: ids.len() as u64,
        commits_lost: lost.len() as u64,
        first_lost: lost.first().copied(),
        psql_session_survived: psql_error.is_none(),
        psql_error,
        postmaster_start_before,
        postmaster_start_after,
        ssh_session_survived: ssh_alive,
        ssh_ticks_after_failover: ssh_ticks,
        amcheck,
        detection_ms: detected.saturating_sub(kill_unix) as f64,
        resume_after_detection_ms: rep
            .get("resume_ms")
            .and_then(|v| v.as_f64())
            .unwrap_or(f64::NAN),
        kill_to_running_ms: field(&rep, "running_at_ms").saturating_sub(kill_unix) as f64,
        commit_gap_ms: gap,
        primary_frames_after_failover: after_failover,
        primary_copy_stopped,
        leftovers: left,
        pgbench_replicated,
        pgbench_after_failover,
        adoption,
        pgbench_during_adoption,
        hardware,
        libvirt_backup,
    })
}
