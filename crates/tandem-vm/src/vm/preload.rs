//! The preloaded library's side of a launch: where `libtandem_preload.so` is, and waiting for
//! it to report the guest RAM it registered inside QEMU.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use super::VmError;

/// Where a package installs `libtandem_preload.so` (dist/deb/build.sh).
pub const INSTALLED_PRELOAD: &str = "/usr/lib/tandem/libtandem_preload.so";

/// Where `libtandem_preload.so` is: `$TANDEM_PRELOAD`; else next to the running executable or
/// one directory up (a build tree: tests run from `target/*/deps`); else in `../lib/tandem`
/// beside the executable's directory (`/usr/local/bin` → `/usr/local/lib/tandem`); else
/// [`INSTALLED_PRELOAD`].
pub fn preload_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TANDEM_PRELOAD") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let up = dir.parent()?;
    [
        dir.join("libtandem_preload.so"),
        up.join("libtandem_preload.so"),
        up.join("lib/tandem/libtandem_preload.so"),
        PathBuf::from(INSTALLED_PRELOAD),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// Waits for the status file the preloaded library writes once it has registered guest RAM:
/// its start, length and (lazy mode) userfaultfd number.
pub(super) fn wait_registration(
    status: &Path,
    child: &mut Child,
) -> Result<(u64, u64, Option<i32>), VmError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(text) = fs::read_to_string(status) {
            let text = text.trim();
            if let Some(err) = text.strip_prefix("err ") {
                return Err(VmError::Registration(err.into()));
            }
            let field = |k: &str| {
                text.split_whitespace()
                    .find_map(|f| f.strip_prefix(k))
                    .map(|v| v.to_string())
            };
            let start = field("start=0x").and_then(|v| u64::from_str_radix(&v, 16).ok());
            let len = field("len=").and_then(|v| v.parse().ok());
            let fd = field("fd=").and_then(|v| v.parse().ok());
            if let (Some(s), Some(l)) = (start, len) {
                return Ok((s, l, fd));
            }
            return Err(VmError::Registration(format!("unreadable status {text:?}")));
        }
        if let Ok(Some(st)) = child.try_wait() {
            return Err(VmError::Registration(format!(
                "QEMU exited ({st}) before registering"
            )));
        }
        if Instant::now() > deadline {
            return Err(VmError::Registration(
                "no answer from the preloaded library in 20 s (was it loaded? check LD_PRELOAD)"
                    .into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
