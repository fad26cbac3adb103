//! Where the guest image lives, and checking that it was built.

use std::path::{Path, PathBuf};

/// The workloads the guest image can run (`tandem.workload=` on the kernel command line).
pub const WORKLOADS: &[&str] = &["idle", "memtouch", "compile", "sqlite", "kv", "disk"];

/// Errors locating the guest image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A file of the image is missing.
    #[error("guest image file {0} is missing: run `./tandem setup` to build the guest image")]
    Missing(String),
    /// The workload name is unknown.
    #[error("unknown workload {0:?}: choose one of idle, memtouch, compile, sqlite, kv, disk")]
    UnknownWorkload(String),
}

/// tandem's cache directory: `$TANDEM_CACHE`, else `$XDG_CACHE_HOME/tandem`, else
/// `~/.cache/tandem`.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("tandem");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/tmp".into());
    home.join(".cache").join("tandem")
}

/// Where `./tandem setup --debian` keeps the Debian test VM: `cache_dir()/debian`.
pub fn debian_dir() -> PathBuf {
    cache_dir().join("debian")
}

/// The kernel, initramfs and apps disk that `./tandem setup` builds.
#[derive(Debug, Clone)]
pub struct GuestImage {
    /// Directory holding the files.
    pub dir: PathBuf,
}

impl GuestImage {
    /// The image in the default cache directory.
    pub fn default_location() -> Self {
        GuestImage {
            dir: cache_dir().join("guest"),
        }
    }

    /// Kernel path.
    pub fn kernel(&self) -> PathBuf {
        self.dir.join("vmlinuz")
    }
    /// Initramfs path.
    pub fn initrd(&self) -> PathBuf {
        self.dir.join("initramfs.cpio.gz")
    }
    /// Read-only apps disk path.
    pub fn apps(&self) -> PathBuf {
        self.dir.join("apps.img")
    }

    /// Fails with a clear message if any file is missing.
    pub fn check(&self) -> Result<(), ImageError> {
        for p in [self.kernel(), self.initrd(), self.apps()] {
            if !Path::new(&p).is_file() {
                return Err(ImageError::Missing(p.display().to_string()));
            }
        }
        Ok(())
    }
}

/// Validates a workload name.
pub fn check_workload(name: &str) -> Result<(), ImageError> {
    if WORKLOADS.contains(&name) {
        Ok(())
    } else {
        Err(ImageError::UnknownWorkload(name.into()))
    }
}
