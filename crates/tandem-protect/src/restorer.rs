//! Restoring a checkpoint: rebuild guest RAM from the store's chain (base + deltas, RAM
//! checksum verified) into a file in /dev/shm, start QEMU on it with `-incoming defer`, load
//! the checkpoint's device state and let the guest run.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use tandem_store::format::RecordKind;
use tandem_store::{Store, StoreError};
use tandem_vm::{DirtyMode, MirrorFile, Vm, VmError};

use crate::vmspec::{VmSpec, VmSpecError};

/// What a restore did (times in milliseconds).
#[derive(Debug, Serialize)]
pub struct RestoreSummary {
    /// The checkpoint restored.
    pub id: u64,
    /// Records replayed (base + deltas).
    pub chain_records: usize,
    /// Rebuilding RAM.
    pub rebuild_ms: f64,
    /// Starting QEMU on it.
    pub qemu_start_ms: f64,
    /// Loading the device state and `cont`.
    pub resume_ms: f64,
    /// All of it (disks included).
    pub total_ms: f64,
    /// The rebuilt RAM matched the checkpoint's checksum.
    pub ram_checksum_verified: bool,
    /// QEMU's run state after the resume (`running`), as QMP `query-status` says.
    pub status_after_resume: String,
    /// The file holding the restored disks (raw, each disk a slice of it), if any.
    pub disk_image: Option<String>,
    /// Rebuilding the disks.
    pub disk_rebuild_ms: f64,
}

/// The restore failed; nothing is left running.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The VM description is unusable.
    #[error(transparent)]
    Spec(#[from] VmSpecError),
    /// A writable disk, and checkpoints without disks.
    #[error("disk {0} is writable, and these checkpoints hold no disks (saved from a VM without writable disks): restoring would pair the checkpoint's memory with today's disk. Mark it `readonly = true`, or restore with the description the checkpoints were saved with")]
    WritableDisk(PathBuf),
    /// The VM's writable disks are not the checkpoints' disks.
    #[error("the VM does not match the checkpoints' disks: {0}; restore with the description the checkpoints were saved with")]
    DiskMismatch(String),
    /// A disk's size could not be read.
    #[error("reading the VM's disks")]
    Disks(#[source] crate::site::SiteError),
    /// The file for the restored disks exists.
    #[error("{0} exists: choose another --disk-out (a restore never overwrites a file)")]
    DiskOutExists(PathBuf),
    /// The checkpoint's disks could not be rebuilt.
    #[error("rebuilding the disks of checkpoint {0}")]
    DiskRebuild(u64, #[source] StoreError),
    /// The store holds another guest size.
    #[error("checkpoint is of a {0} MiB guest; pass --mem {0}")]
    Size(u64),
    /// The RAM file could not be created.
    #[error("creating the RAM file")]
    Ram(#[source] tandem_vm::ram::RamError),
    /// The checkpoint could not be rebuilt.
    #[error("restoring checkpoint {0}")]
    Store(u64, #[source] StoreError),
    /// QEMU did not start on the restored memory.
    #[error("starting QEMU on the restored memory")]
    Start(#[source] VmError),
    /// The device state was refused.
    #[error("loading the checkpoint's device state")]
    Resume(#[source] VmError),
}

/// Checks the VM's writable disks against the store's and writes checkpoint `id`'s disks
/// into `out` (default: `restore-<id>-<time>.img` in the store), pointing `cfg` at it.
fn restore_disks(
    store: &Store,
    id: u64,
    cfg: &mut tandem_vm::VmConfig,
    out: Option<&Path>,
) -> Result<Option<PathBuf>, RestoreError> {
    let Some(layout) = store.disks() else {
        return match cfg.writable_disk() {
            Some(d) => Err(RestoreError::WritableDisk(d.path.clone())),
            None => Ok(None),
        };
    };
    let (slices, total) = crate::site::capture_slices(cfg).map_err(RestoreError::Disks)?;
    let mine = tandem_store::disks::DiskLayout::new(
        slices
            .iter()
            .map(|m| tandem_store::disks::DiskSpec {
                index: m.disk as u32,
                offset: m.offset,
                size: m.size,
                path: cfg.disks[m.disk].path.display().to_string(),
            })
            .collect(),
        total.max(1),
    );
    let mine = mine.map_err(|_| {
        RestoreError::DiskMismatch(
            "the checkpoints include disks, this VM has no writable disk".into(),
        )
    })?;
    crate::checkpoint::disks::check_layout(layout, &mine).map_err(RestoreError::DiskMismatch)?;
    let path = out.map(Path::to_path_buf).unwrap_or_else(|| {
        store
            .dir()
            .join(format!("restore-{id}-{}.img", crate::unix_ms()))
    });
    if path.exists() {
        return Err(RestoreError::DiskOutExists(path));
    }
    store
        .materialize_disks(id, &path)
        .map_err(|e| RestoreError::DiskRebuild(id, e))?;
    crate::site::open_slices(cfg, &slices, &path);
    Ok(Some(path))
}

/// Restores checkpoint `id` of `store` into a running guest described by `vm`; with disks
/// in the checkpoints, their state goes into a new file (`disk_out`), never into the VM's own
/// images.
pub fn restore(
    store: &Store,
    id: u64,
    vm: &VmSpec,
    disk_out: Option<&Path>,
) -> Result<(Vm, RestoreSummary), RestoreError> {
    let mut cfg = vm.config("restore")?;
    cfg.dirty = DirtyMode::None;
    if cfg.mem_mib << 20 != store.mem_bytes() {
        return Err(RestoreError::Size(store.mem_bytes() >> 20));
    }
    if !store.entries().iter().any(|e| e.id == id) {
        return Err(RestoreError::Store(
            id,
            StoreError::NoCheckpoint(id, format!("{} checkpoints", store.entries().len())),
        ));
    }
    let td = Instant::now();
    let disk_image = restore_disks(store, id, &mut cfg, disk_out)?;
    let disk_rebuild = td.elapsed();
    // A restore that fails from here on leaves no rebuilt disk file behind.
    let mut guard = RemoveOnDrop(disk_image.clone());
    let chain = chain_len(store, id);
    let t = Instant::now();
    let path = PathBuf::from(format!(
        "/dev/shm/tandem-restore-{}.ram",
        std::process::id()
    ));
    let dev = rebuild(store, id, &path)?;
    let rebuilt = t.elapsed();
    let started = Instant::now();
    let vm = Vm::standby(&cfg, &path);
    let _ = std::fs::remove_file(&path);
    let mut vm = vm.map_err(RestoreError::Start)?;
    let qemu_start = started.elapsed();
    let r = Instant::now();
    vm.resume(&dev).map_err(RestoreError::Resume)?;
    let resumed = r.elapsed();
    let total = td.elapsed();
    let status = vm
        .qmp
        .status()
        .map_err(|e| RestoreError::Resume(e.into()))?;
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let summary = RestoreSummary {
        id,
        chain_records: chain,
        rebuild_ms: ms(rebuilt),
        qemu_start_ms: ms(qemu_start),
        resume_ms: ms(resumed),
        total_ms: ms(total),
        ram_checksum_verified: true,
        status_after_resume: status,
        disk_image: disk_image.map(|p| p.display().to_string()),
        disk_rebuild_ms: ms(disk_rebuild),
    };
    guard.0 = None;
    Ok((vm, summary))
}

/// Removes a file when dropped (emptied once the restore succeeded).
struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Records from the last base up to checkpoint `id` (0 if there is no such checkpoint).
fn chain_len(store: &Store, id: u64) -> usize {
    let idx = store.entries().iter().position(|e| e.id == id);
    idx.map_or(0, |i| {
        i + 1
            - store.entries()[..=i]
                .iter()
                .rposition(|e| e.kind == RecordKind::Base)
                .unwrap_or(0)
    })
}

/// Rebuilds checkpoint `id`'s RAM into a new file at `path`; returns its device state. The
/// file is removed again if the rebuild fails.
fn rebuild(store: &Store, id: u64, path: &Path) -> Result<Vec<u8>, RestoreError> {
    // SAFETY: this process is the file's only writer until QEMU starts on it afterwards.
    let mut ram =
        unsafe { MirrorFile::create(path, store.mem_bytes()) }.map_err(RestoreError::Ram)?;
    match store.materialize_zeroed(id, ram.as_mut()) {
        Ok(d) => Ok(d),
        Err(e) => {
            let _ = std::fs::remove_file(path);
            Err(RestoreError::Store(id, e))
        }
    }
}
