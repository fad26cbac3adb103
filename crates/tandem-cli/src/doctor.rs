//! `tandem doctor`: what works on this host, what to fix.

use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;
use tandem_vm::{DirtyMode, GuestRam, Vm, VmConfig, PAGE_SIZE};

#[derive(clap::Args)]
pub struct Args {
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// Skip the boot/log/checkpoint/restore self-test.
    #[arg(long)]
    pub no_selftest: bool,
    /// QEMU binary to check.
    #[arg(long, default_value = "qemu-system-x86_64")]
    pub qemu: std::path::PathBuf,
    #[command(flatten)]
    pub site: crate::doctor_site::SiteChecks,
}

#[derive(Serialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Status {
    Ok,
    Warn,
    Fail,
}

#[derive(Serialize)]
struct Check {
    name: &'static str,
    status: Status,
    detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    fix: Option<String>,
}

fn check(name: &'static str, r: Result<String, (Status, String, String)>) -> Check {
    match r {
        Ok(detail) => Check {
            name,
            status: Status::Ok,
            detail,
            fix: None,
        },
        Err((status, detail, fix)) => Check {
            name,
            status,
            detail,
            fix: Some(fix),
        },
    }
}

fn kernel() -> Result<String, (Status, String, String)> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    match tandem_vm::dirty::probe_pagemap_scan() {
        Ok(()) => Ok(format!("Linux {}: userfaultfd async write-protect and PAGEMAP_SCAN work", release.trim())),
        Err(e) => Err((
            Status::Warn,
            format!("Linux {}: {e}; the dirty log falls back to hashing all guest RAM every epoch", release.trim()),
            "use Linux 6.7 or newer with CONFIG_USERFAULTFD and CONFIG_PTE_MARKER_UFFD_WP, and run as root (or set vm.unprivileged_userfaultfd=1)".into(),
        )),
    }
}

fn qemu(bin: &std::path::Path) -> Result<String, (Status, String, String)> {
    let fix = "install Debian's qemu-system-x86 package (`apt-get install qemu-system-x86`), or name the binary with --qemu".to_string();
    let out = Command::new(bin).arg("--version").output().map_err(|e| {
        (
            Status::Fail,
            format!("{} not runnable: {e}", bin.display()),
            fix.clone(),
        )
    })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text.lines().next().unwrap_or("").to_string();
    let ver: Vec<u32> = first
        .split_whitespace()
        .nth(3)
        .unwrap_or("0")
        .split('.')
        .filter_map(|s| s.parse().ok())
        .collect();
    if ver < vec![7, 2] {
        return Err((
            Status::Fail,
            format!("{first}: need QEMU 7.2 or newer (x-ignore-shared, memory-backend=)"),
            fix,
        ));
    }
    Ok(first)
}

fn shm(mem_mib: u64) -> Result<String, (Status, String, String)> {
    let st = rustix::fs::statvfs("/dev/shm").map_err(|e| {
        (
            Status::Fail,
            format!("/dev/shm unusable: {e}"),
            "mount a tmpfs on /dev/shm".into(),
        )
    })?;
    let free = st.f_bavail * st.f_frsize;
    let need = 3 * (mem_mib << 20);
    if free < need {
        return Err((
            Status::Fail,
            format!(
                "/dev/shm has {} MiB free; a {mem_mib} MiB guest with a restore copy needs {} MiB",
                free >> 20,
                need >> 20
            ),
            "free space in /dev/shm or remount it larger (mount -o remount,size=2G /dev/shm)"
                .into(),
        ));
    }
    Ok(format!("{} MiB free", free >> 20))
}

fn preload() -> Result<String, (Status, String, String)> {
    tandem_vm::vm::preload_path()
        .map(|p| p.display().to_string())
        .ok_or((
            Status::Fail,
            "libtandem_preload.so not found (next to the tandem binary, in ../lib/tandem or /usr/lib/tandem)".into(),
            "install the tandem package (it puts it in /usr/lib/tandem), or build the whole workspace: cargo build --release --workspace".into(),
        ))
}

/// The BIOS data area's timer tick counter (0x46C), which SeaBIOS's timer interrupt counts.
fn bios_ticks(ram: &GuestRam) -> u32 {
    let mut page = vec![0u8; PAGE_SIZE];
    ram.copy_page(0, &mut page);
    u32::from_le_bytes([page[0x46c], page[0x46d], page[0x46e], page[0x46f]])
}

/// Boots a VM from a blank disk (SeaBIOS finds nothing to boot and waits, its timer interrupt
/// counting in the BIOS data area), logs its writes for five epochs, saves and restores it,
/// and checks that the restored guest's counter goes on: QEMU, guest RAM in a shared file,
/// the dirty log, device state and restore, without any guest image.
fn selftest(qemu: &std::path::Path) -> Result<String, (Status, String, String)> {
    let fix = "see the error; `tandem doctor` checks above name the usual causes".to_string();
    let fail = |e: String| (Status::Fail, e, fix.clone());
    // A blank disk: nothing on it to boot, which is the point.
    let blank = tempfile::NamedTempFile::new_in("/dev/shm").map_err(|e| fail(e.to_string()))?;
    blank
        .as_file()
        .set_len(1 << 20)
        .map_err(|e| fail(e.to_string()))?;
    let mut cfg = VmConfig::custom("doctor");
    cfg.mem_mib = 64;
    cfg.disks = vec![tandem_vm::DiskDesc {
        path: blank.path().to_path_buf(),
        format: tandem_vm::DiskFormat::Raw,
        bus: tandem_vm::DiskBus::VirtioBlk,
        cache: None,
        aio: None,
        readonly: true,
        slice: None,
        pci: None,
    }];
    cfg.qemu = qemu.to_path_buf();
    cfg.dirty = DirtyMode::Auto;
    let t = Instant::now();
    let mut vm = Vm::launch(&cfg).map_err(|e| fail(format!("boot: {e}")))?;
    vm.wait_ready(Duration::from_secs(60))
        .map_err(|e| fail(format!("boot: {e}")))?;
    let boot = t.elapsed();
    let (mut pfns, mut pages, mut dev) = (Vec::new(), Vec::new(), Vec::new());
    let mut dirty = 0;
    let mut pause = Vec::new();
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(100));
        let tm = vm
            .checkpoint(&mut pfns, &mut pages, &mut dev)
            .map_err(|e| fail(format!("checkpoint: {e}")))?;
        dirty += pfns.len();
        pause.push(tm.total_us());
    }
    if dirty == 0 {
        return Err(fail(
            "the dirty log reported no written pages while the firmware ran".into(),
        ));
    }
    vm.stop().map_err(|e| fail(e.to_string()))?;
    vm.capture_device_state(&mut dev)
        .map_err(|e| fail(format!("device state: {e}")))?;
    let tick = bios_ticks(vm.ram());
    let img = tempfile::NamedTempFile::new_in("/dev/shm").map_err(|e| fail(e.to_string()))?;
    vm.save_ram(img.path()).map_err(|e| fail(e.to_string()))?;
    let log = vm.dirty_log_name().unwrap_or("none");
    vm.kill();
    drop(vm);
    let t = Instant::now();
    let mut r = Vm::restore(&cfg, img.path(), &dev).map_err(|e| fail(format!("restore: {e}")))?;
    r.cont().map_err(|e| fail(e.to_string()))?;
    let restore = t.elapsed();
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        std::thread::sleep(Duration::from_millis(100));
        let after = bios_ticks(r.ram());
        if after > tick || Instant::now() > deadline {
            break after;
        }
    };
    if after <= tick {
        return Err(fail(format!(
            "the restored guest did not run on: its timer count stayed at {after} (saved at {tick})"
        )));
    }
    Ok(format!(
        "boot {:.2} s, dirty log {log}: {dirty} pages in 5 epochs, pause max {:.1} ms, device state {} KiB, restore {:.0} ms, the restored firmware's timer count went on ({tick} → {after})",
        boot.as_secs_f64(),
        *pause.iter().max().unwrap_or(&0) as f64 / 1000.0,
        dev.len() >> 10,
        restore.as_secs_f64() * 1000.0
    ))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    use crate::doctor_site as site;
    let s = &args.site;
    let described = s.vm_config.as_ref().map(|p| site::vm(p, &s.state_dir));
    let mem = described.as_ref().and_then(|d| d.1).unwrap_or(256);
    let mut checks = vec![
        check("kernel", kernel()),
        check("kvm", site::kvm()),
        check("qemu", qemu(&args.qemu)),
        check("dev-shm", shm(mem)),
        check("preload-library", preload()),
    ];
    if let Some((desc, _, room)) = described {
        checks.push(check("vm-description", desc));
        checks.push(check("disk-replica-room", room));
    }
    if let Some(b) = &s.bridge {
        checks.push(check("bridge", site::bridge(b, s.tap_netns.as_deref())));
    }
    if let Some(p) = &s.peer {
        checks.push(check("peer", site::peer(p)));
    }
    if !s.fence.etcd.is_empty() {
        checks.push(check("etcd", site::etcd(&s.fence, s.vm_id)));
    }
    let blocking = checks.iter().any(|c| c.status == Status::Fail);
    if !args.no_selftest {
        checks.push(if blocking {
            Check {
                name: "self-test",
                status: Status::Fail,
                detail: "skipped: fix the failures above first".into(),
                fix: None,
            }
        } else {
            check("self-test", selftest(&args.qemu))
        });
    }
    let failed = checks.iter().any(|c| c.status == Status::Fail);
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "ok": !failed, "checks": checks }))?
        );
    } else {
        for c in &checks {
            let tag = match c.status {
                Status::Ok => "ok  ",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
            };
            println!("[{tag}] {:<18} {}", c.name, c.detail);
            if let Some(f) = &c.fix {
                println!("       {:<18} fix: {f}", "");
            }
        }
        println!(
            "{}",
            if failed {
                "tandem cannot run here yet: fix the FAIL lines above."
            } else {
                "tandem is ready on this host."
            }
        );
    }
    if failed {
        std::process::exit(1);
    }
    Ok(())
}
