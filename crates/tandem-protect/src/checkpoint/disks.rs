//! Checkpoints of your own VM's writable disks (docs/STORE.md, "Disks"): the disks are
//! captured as the primary captures them (a `blockdev-mirror` per disk into tandem's replica,
//! whose write log is each checkpoint's disk section); the first checkpoint's disk base is
//! the replica copied while the guest runs, finished with the writes of the first pause.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use tandem_disk::image::Write;
use tandem_disk::Image;
use tandem_store::disks::{DiskLayout, DiskSpec};
use tandem_vm::{Vm, VmConfig};

use crate::site::Site;

/// The capture of a saver's writable disks.
pub struct DiskCapture {
    site: Site,
    image: Arc<Image>,
    layout: DiskLayout,
}

/// The disks could not be captured or copied.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The replica could not be set up.
    #[error(transparent)]
    Site(#[from] crate::site::SiteError),
    /// The layout does not fit the store's format.
    #[error("the VM's writable disks cannot be stored: {0}")]
    Layout(String),
    /// The mirrors could not start.
    #[error("starting the disk mirrors")]
    Mirror(#[source] tandem_vm::VmError),
    /// Copying the replica into the disk base failed.
    #[error("writing the first disk base {0}")]
    Copy(String, #[source] std::io::Error),
}

impl DiskCapture {
    /// Points `cfg`'s writable disks at a capture whose replica lives in `dir` (its name is
    /// removed at once; tandem's NBD server keeps it open).
    pub fn prepare(dir: &Path, cfg: &mut VmConfig) -> Result<DiskCapture, CaptureError> {
        let site = Site::capture_only(dir, cfg)?;
        let Some(image) = site.disk.clone() else {
            return Err(CaptureError::Layout("no writable disk to capture".into()));
        };
        let disks = site
            .mirrors
            .iter()
            .map(|m| DiskSpec {
                index: m.disk as u32,
                offset: m.offset,
                size: m.size,
                path: cfg.disks[m.disk].path.display().to_string(),
            })
            .collect();
        let layout = DiskLayout::new(disks, image.size()).map_err(CaptureError::Layout)?;
        Ok(DiskCapture {
            site,
            image,
            layout,
        })
    }

    /// The layout the store records.
    pub fn layout(&self) -> &DiskLayout {
        &self.layout
    }

    /// Starts the mirrors (their full pass fills the replica), then copies the replica into
    /// `scratch` while the guest runs; every write from the start of the copy on is in the
    /// log, which the first checkpoint's pause applies ([`DiskCapture::take`]).
    pub fn start(&self, vm: &mut Vm, scratch: &Path) -> Result<(), CaptureError> {
        self.site.start_capture(vm).map_err(CaptureError::Mirror)?;
        self.image.reset_log();
        let err = |e| CaptureError::Copy(scratch.display().to_string(), e);
        let _ = std::fs::remove_file(scratch);
        let out = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(scratch)
            .map_err(err)?;
        out.set_len(self.image.size()).map_err(err)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0;
        while off < self.image.size() {
            let n = (self.image.size() - off).min(buf.len() as u64) as usize;
            self.image.read_at(&mut buf[..n], off).map_err(err)?;
            if buf[..n].iter().any(|&b| b != 0) {
                out.write_all_at(&buf[..n], off).map_err(err)?;
            }
            off += n as u64;
        }
        Ok(())
    }

    /// In a pause: the writes since the previous take, or why they are incomplete (a mirror
    /// failed, or the replica could not be read back).
    pub fn take(&self) -> Result<Vec<Write>, String> {
        let w = self
            .image
            .try_take_epoch_writes()
            .map_err(|e| e.to_string());
        match self.site.mirror_health.broken() {
            Some(why) => Err(why),
            None => w,
        }
    }

    /// Disk bytes written since the last take.
    pub fn log_bytes(&self) -> u64 {
        self.site.disk_log_bytes()
    }

    /// Applies `writes` to the disk base being prepared at `scratch`.
    pub fn apply(scratch: &Path, writes: &[Write]) -> Result<(), CaptureError> {
        let err = |e| CaptureError::Copy(scratch.display().to_string(), e);
        let f = OpenOptions::new().write(true).open(scratch).map_err(err)?;
        for (o, d) in writes {
            f.write_all_at(d, *o).map_err(err)?;
        }
        Ok(())
    }
}

/// Checks that the VM's writable disks are the store's: same disks, same sizes, in order.
pub fn check_layout(store: &DiskLayout, vm: &DiskLayout) -> Result<(), String> {
    let same = store.disks.len() == vm.disks.len()
        && store
            .disks
            .iter()
            .zip(&vm.disks)
            .all(|(a, b)| a.index == b.index && a.size == b.size && a.offset == b.offset);
    if same {
        return Ok(());
    }
    let show = |l: &DiskLayout| {
        l.disks
            .iter()
            .map(|d| format!("disk {} {} ({} bytes)", d.index, d.path, d.size))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Err(format!(
        "the store's checkpoints hold {}; this VM's writable disks are {}",
        show(store),
        show(vm)
    ))
}
