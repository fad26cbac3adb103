//! Adopting a running VM without a reboot: QEMU's own live migration from the QEMU that runs
//! the guest now (started by hand or by libvirt) into one that tandem starts on the same host,
//! with guest RAM in tandem's shared file and its dirty log armed.
//!
//! ```text
//!  running QEMU (source)                        tandem's QEMU (destination)
//!  ─ query-status: running                      ─ same devices, same disk files,
//!  ─ one memory backend, same size and name       RAM = shared file, -incoming defer, no -S
//!  ─ migrate-set-parameters (downtime,          ─ migration capabilities = the source's
//!    bandwidth), migrate unix:SOCK  ──────────► ─ migrate-incoming unix:SOCK
//!  ─ pre-copy rounds while the guest runs
//!  ─ stop, last pages, devices ─ postmigrate ─► ─ loads them, activates the disks, runs
//!  ─ quit                                       ─ x-ignore-shared on: device-state capture
//! ```
//!
//! A migration that fails, is cancelled or does not converge in time leaves the guest running
//! in its own QEMU, its migration parameters as they were. One that completes but whose guest
//! does not run in the new QEMU resumes the source (`cont`, which takes its disks back).

mod hardware;
mod monitor;

pub use monitor::{Libvirt, Monitor, Source};

use std::time::{Duration, Instant};

use std::os::fd::AsFd;

use serde_json::{json, Value};

use crate::qmp::{Qmp, QmpError};
use crate::vm::{Vm, VmConfig, VmError};

/// The name the migration's connection has in the source QEMU (`getfd`).
const FD_NAME: &str = "tandem-adopt";

/// How an adoption migrates.
#[derive(Debug, Clone)]
pub struct AdoptOptions {
    /// The longest the guest may stop for its last pages and devices (QEMU's
    /// `downtime-limit`).
    pub downtime_limit: Duration,
    /// Bytes per second the migration may use (QEMU's `max-bandwidth`; its default of
    /// 128 MiB/s is far below a same-host socket).
    pub max_bandwidth: u64,
    /// The migration is cancelled (the guest runs on where it ran) when it has not completed
    /// within this long.
    pub timeout: Duration,
    /// Quit the source QEMU once the guest runs in tandem's (false: leave it in QEMU's
    /// `postmigrate` state for whoever manages it).
    pub quit_source: bool,
}

impl Default for AdoptOptions {
    fn default() -> Self {
        AdoptOptions {
            downtime_limit: Duration::from_millis(300),
            max_bandwidth: 1 << 40,
            timeout: Duration::from_secs(600),
            quit_source: true,
        }
    }
}

/// How far a migration got.
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    /// Bytes of RAM sent.
    pub transferred: u64,
    /// Bytes of RAM still to send in this round.
    pub remaining: u64,
    /// Guest RAM in bytes.
    pub total: u64,
    /// Pre-copy rounds begun (QEMU's `dirty-sync-count`).
    pub rounds: u64,
}

/// What an adoption did.
#[derive(Debug, Clone, Copy)]
pub struct Adopted {
    /// From the first QMP command to the guest running in tandem's QEMU.
    pub total: Duration,
    /// How long the source stopped the guest, as its QEMU measured it (last pages and
    /// devices sent).
    pub qemu_downtime: Duration,
    /// From the source's migration seen complete to the guest seen running in tandem's QEMU
    /// (an upper bound of the time the destination took to load and start it).
    pub switch: Duration,
    /// The migration's last progress.
    pub progress: Progress,
    /// The source QEMU was told to quit.
    pub source_quit: bool,
}

impl Adopted {
    /// The guest's downtime: QEMU's plus the switch (an upper bound).
    pub fn downtime(&self) -> Duration {
        self.qemu_downtime + self.switch
    }
}

/// Why an adoption did not happen. Every variant but [`AdoptError::Resume`] leaves the guest
/// running in its own QEMU.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// The source's monitor did not answer.
    #[error("reaching {0} ({1})")]
    Connect(String, &'static str, #[source] QmpError),
    /// A query of the source failed.
    #[error("asking the running QEMU")]
    Source(#[from] QmpError),
    /// The source's guest does not run.
    #[error("the running QEMU's guest is {0}, not running: tandem adopts a running guest (resume it first)")]
    NotRunning(String),
    /// The sizes differ.
    #[error("the running guest has {source_mib} MiB of RAM, the description {described_mib} MiB: describe the VM as it runs")]
    Memory {
        /// The source's guest RAM.
        source_mib: u64,
        /// The description's.
        described_mib: u64,
    },
    /// Not exactly one memory backend.
    #[error("the running QEMU has {} memory backends ({}): tandem adopts a guest whose RAM is one backend (no NUMA nodes, no hotplugged memory)", .0.len(), .0.join(", "))]
    RamBlocks(Vec<String>),
    /// The RAM block names differ.
    #[error("the running QEMU names its guest RAM {running:?}, the description {described:?}: set ram_block = {running:?} in the description")]
    RamBlock {
        /// The running QEMU's name.
        running: String,
        /// The description's.
        described: String,
    },
    /// tandem's QEMU would show the guest other hardware.
    #[error("tandem's QEMU would change the hardware the guest sees:\n  {}\ndescribe the VM as it runs (docs/VM_DESCRIPTION.md, \"Adopting a running VM\"); nothing was migrated", .0.join("\n  "))]
    Hardware(Vec<String>),
    /// tandem's QEMU did not start.
    #[error("starting tandem's QEMU for the guest")]
    Start(#[source] VmError),
    /// QEMU's migration failed.
    #[error("QEMU's migration failed: {0}; the guest runs on in its own QEMU, unchanged")]
    Migration(String),
    /// The migration did not complete in time.
    #[error("the migration did not complete within {} s (the guest writes its memory faster than it is copied, or the downtime limit is too tight); cancelled: the guest runs on in its own QEMU", .0.as_secs())]
    Timeout(Duration),
    /// The migration completed but the guest did not run in tandem's QEMU.
    #[error("the guest did not run in tandem's QEMU after the migration ({why}); {source_state}")]
    Resume {
        /// What went wrong.
        why: String,
        /// What became of the source.
        source_state: String,
    },
}

/// Puts the guest that the QEMU at `source` runs into a new QEMU started from `config` (the same devices and disk files; RAM in tandem's shared file), by a live
/// migration over a unix socket. `progress` is called while the pre-copy rounds run. The
/// returned VM runs the guest, its dirty log armed and device-state capture prepared.
pub fn adopt(
    config: &VmConfig,
    source: &Source,
    opts: &AdoptOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<(Vm, Adopted), AdoptError> {
    let t0 = Instant::now();
    let connect = |e| AdoptError::Connect(source.to_string(), source.hint(), e);
    let mut src: Box<dyn Monitor> = match source {
        Source::Qmp(path) => Box::new(Qmp::connect(path, Duration::from_secs(5)).map_err(connect)?),
        Source::Libvirt(l) => {
            let mut l = l.clone();
            l.status().map_err(connect)?;
            Box::new(l)
        }
    };
    let src = src.as_mut();
    check_source(src, config)?;
    let caps: Vec<String> = src
        .execute("query-migrate-capabilities", None)?
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["state"].as_bool() == Some(true))
        .filter_map(|c| c["capability"].as_str().map(str::to_string))
        .collect();
    let before = src.execute("query-migrate-parameters", None)?;
    let restore = json!({
        "downtime-limit": before["downtime-limit"],
        "max-bandwidth": before["max-bandwidth"],
    });

    let mut vm = Vm::adopting(config).map_err(AdoptError::Start)?;
    let running = hardware::Hardware::of(src)?;
    let new =
        hardware::Hardware::of(&mut vm.qmp).map_err(|e| AdoptError::Start(vm.explain(e.into())))?;
    let differences = running.differences(&new);
    if !differences.is_empty() {
        return Err(AdoptError::Hardware(differences));
    }
    let sock = vm.runtime_dir().join("adopt.sock");
    let uri = format!("unix:{}", sock.display());
    let flags: Vec<(&str, bool)> = caps.iter().map(|c| (c.as_str(), true)).collect();
    (|| {
        if !flags.is_empty() {
            vm.qmp.set_migrate_caps(&flags)?;
        }
        vm.qmp
            .execute("migrate-incoming", Some(json!({ "uri": uri })))
            .map(|_| ())
    })()
    .map_err(|e| AdoptError::Start(vm.explain(e.into())))?;
    src.execute(
        "migrate-set-parameters",
        Some(json!({
            "downtime-limit": opts.downtime_limit.as_millis() as u64,
            "max-bandwidth": opts.max_bandwidth,
        })),
    )?;
    // The source gets the connection as a descriptor: a QEMU libvirt runs (its own user,
    // confined) cannot open a socket in tandem's private runtime directory.
    let conn = std::os::unix::net::UnixStream::connect(&sock).map_err(|e| {
        let _ = src.execute("migrate-set-parameters", Some(restore.clone()));
        AdoptError::Start(vm.explain(VmError::Io(e)))
    })?;
    let migrated = (|| {
        src.send_fd(FD_NAME, conn.as_fd())?;
        src.execute("migrate", Some(json!({ "uri": format!("fd:{FD_NAME}") })))
            .inspect_err(|_| {
                let _ = src.execute("closefd", Some(json!({ "fdname": FD_NAME })));
            })?;
        follow(src, &mut vm, opts, progress)
    })();
    let (qemu_downtime, last) = match migrated {
        Ok(done) => done,
        Err(e) => {
            let _ = src.execute("migrate-set-parameters", Some(restore));
            return Err(match e {
                Followed::Qmp(e) => AdoptError::Source(e),
                Followed::Failed(why) => AdoptError::Migration(why),
                Followed::Timeout => AdoptError::Timeout(opts.timeout),
            });
        }
    };
    let done = Instant::now();
    if let Err(why) = wait_running(&mut vm) {
        // tandem's QEMU goes first: its disk locks must be gone before the old QEMU takes
        // its disks back (`cont` re-activates them).
        drop(vm);
        let source_state = resume_source(src);
        let _ = src.execute("migrate-set-parameters", Some(restore));
        return Err(AdoptError::Resume { why, source_state });
    }
    let switch = done.elapsed();
    // The migration is over: its capabilities go, device-state capture's come.
    let off: Vec<(&str, bool)> = caps.iter().map(|c| (c.as_str(), false)).collect();
    let prepared = (|| {
        if !off.is_empty() {
            vm.qmp.set_migrate_caps(&off)?;
        }
        crate::devstate::prepare(&mut vm.qmp)?;
        Ok::<_, VmError>(())
    })();
    if let Err(e) = prepared {
        // The guest runs here, the source is stopped: its stopped copy is the one to keep.
        let why = format!("preparing device-state capture: {e}");
        drop(vm);
        let source_state = resume_source(src);
        let _ = src.execute("migrate-set-parameters", Some(restore));
        return Err(AdoptError::Resume { why, source_state });
    }
    let source_quit = opts.quit_source && src.execute("quit", None).is_ok();
    Ok((
        vm,
        Adopted {
            total: t0.elapsed(),
            qemu_downtime,
            switch,
            progress: last,
            source_quit,
        },
    ))
}

/// Runs the guest in the old QEMU again after a completed migration whose guest did not run
/// in tandem's (already gone); says what became of it.
fn resume_source(src: &mut dyn Monitor) -> String {
    match src.execute("cont", None) {
        Ok(_) => "the guest runs on in its own QEMU again (resumed there)".to_string(),
        Err(e) => format!(
            "resuming it in its own QEMU failed too ({e}): the guest is stopped; `cont` on that QEMU's monitor"
        ),
    }
}

/// The source runs a guest this description can take.
fn check_source(src: &mut dyn Monitor, config: &VmConfig) -> Result<(), AdoptError> {
    let status = src.status()?;
    if status != "running" {
        return Err(AdoptError::NotRunning(status));
    }
    let mem = src.execute("query-memory-size-summary", None)?;
    let bytes =
        mem["base-memory"].as_u64().unwrap_or(0) + mem["plugged-memory"].as_u64().unwrap_or(0);
    if bytes != config.mem_mib << 20 {
        return Err(AdoptError::Memory {
            source_mib: bytes >> 20,
            described_mib: config.mem_mib,
        });
    }
    let ids: Vec<String> = src
        .execute("query-memdev", None)?
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| m["id"].as_str().unwrap_or("(unnamed)").to_string())
        .collect();
    match ids.as_slice() {
        [id] if *id == config.ram_block => Ok(()),
        [id] => Err(AdoptError::RamBlock {
            running: id.clone(),
            described: config.ram_block.clone(),
        }),
        _ => Err(AdoptError::RamBlocks(ids)),
    }
}

/// How following a migration ended badly.
enum Followed {
    Qmp(QmpError),
    Failed(String),
    Timeout,
}

impl From<QmpError> for Followed {
    fn from(e: QmpError) -> Self {
        Followed::Qmp(e)
    }
}

/// Polls the source's migration until it completes (QEMU's downtime and the last progress),
/// fails, or times out (then cancels it).
fn follow(
    src: &mut dyn Monitor,
    vm: &mut Vm,
    opts: &AdoptOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<(Duration, Progress), Followed> {
    let t = Instant::now();
    let mut last = Progress::default();
    loop {
        let r = src.execute("query-migrate", None)?;
        if let Some(p) = read_progress(&r) {
            last = p;
        }
        match r["status"].as_str().unwrap_or("") {
            "completed" => {
                let ms = r["downtime"].as_u64().unwrap_or(0);
                return Ok((Duration::from_millis(ms), last));
            }
            "failed" | "cancelled" => {
                let why = r["error-desc"]
                    .as_str()
                    .unwrap_or("no description")
                    .to_string();
                return Err(Followed::Failed(with_log(vm, why)));
            }
            _ => {}
        }
        if let Some(s) = vm.exit_status() {
            let _ = src.execute("migrate_cancel", None);
            let _ = wait_ended(src);
            return Err(Followed::Failed(with_log(
                vm,
                format!("tandem's QEMU exited ({s})"),
            )));
        }
        if t.elapsed() > opts.timeout {
            let _ = src.execute("migrate_cancel", None);
            return match wait_ended(src) {
                // It completed before the cancel took.
                Ok(Some(done)) => Ok((done, last)),
                _ => Err(Followed::Timeout),
            };
        }
        progress(&last);
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits for a cancelled migration to end: `Some(downtime)` if it completed after all.
fn wait_ended(src: &mut dyn Monitor) -> Result<Option<Duration>, QmpError> {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        let r = src.execute("query-migrate", None)?;
        match r["status"].as_str().unwrap_or("") {
            "completed" => {
                return Ok(Some(Duration::from_millis(
                    r["downtime"].as_u64().unwrap_or(0),
                )))
            }
            "cancelled" | "failed" => return Ok(None),
            _ => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    Ok(None)
}

fn read_progress(r: &Value) -> Option<Progress> {
    let ram = r.get("ram")?;
    Some(Progress {
        transferred: ram["transferred"].as_u64().unwrap_or(0),
        remaining: ram["remaining"].as_u64().unwrap_or(0),
        total: ram["total"].as_u64().unwrap_or(0),
        rounds: ram["dirty-sync-count"].as_u64().unwrap_or(0),
    })
}

/// `why`, plus tandem's QEMU's log if it exited (a destination that refused the stream
/// exits within moments, saying why).
fn with_log(vm: &mut Vm, why: String) -> String {
    let t = Instant::now();
    while vm.exit_status().is_none() && t.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(20));
    }
    match vm.explain(VmError::Guest(why.clone())) {
        VmError::Exited { log, .. } => format!("{why}; tandem's QEMU said: {}", log.trim()),
        _ => why,
    }
}

/// Waits for tandem's QEMU to run the guest it loaded.
fn wait_running(vm: &mut Vm) -> Result<(), String> {
    let t = Instant::now();
    loop {
        match vm.qmp.status() {
            Ok(s) if s == "running" => return Ok(()),
            Ok(s) if s == "inmigrate" && t.elapsed() < Duration::from_secs(60) => {}
            Ok(s) => return Err(with_log(vm, format!("its state is {s}"))),
            Err(e) => return Err(with_log(vm, e.to_string())),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_read_from_query_migrate() {
        let r = json!({"status": "active", "ram": {"transferred": 10, "remaining": 5,
            "total": 100, "dirty-sync-count": 2}});
        let p = read_progress(&r).unwrap();
        assert_eq!(
            (p.transferred, p.remaining, p.total, p.rounds),
            (10, 5, 100, 2)
        );
        assert!(read_progress(&json!({"status": "setup"})).is_none());
    }

    #[test]
    fn the_downtime_is_qemus_plus_the_switch() {
        let a = Adopted {
            total: Duration::from_secs(2),
            qemu_downtime: Duration::from_millis(40),
            switch: Duration::from_millis(3),
            progress: Progress::default(),
            source_quit: true,
        };
        assert_eq!(a.downtime(), Duration::from_millis(43));
    }
}
