//! Tap devices (`/dev/net/tun`, `IFF_TAP | IFF_NO_PI`), created in a chosen network namespace.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::process::Command;

use crate::netns::{in_netns, NetnsError};

/// Tap errors.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// `/dev/net/tun` missing or not permitted.
    #[error("cannot open /dev/net/tun (needs the tun module and root)")]
    Open(#[source] std::io::Error),
    /// Bad interface name.
    #[error("tap name {0:?} must be 1..15 bytes")]
    Name(String),
    /// `TUNSETIFF` failed.
    #[error("cannot create tap {0:?}")]
    Create(String, #[source] std::io::Error),
    /// Namespace problem.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// `ip link set` failed.
    #[error("`ip {0}` failed: {1}")]
    Ip(String, String),
}

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

fn create(name: &str) -> Result<File, TapError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(TapError::Open)?;
    let mut req = IfReq {
        name: [0; 16],
        flags: IFF_TAP | IFF_NO_PI,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: `req` is a properly sized, initialised `struct ifreq` that outlives the call and
    // `file` is an open tun control descriptor.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) };
    if r != 0 {
        return Err(TapError::Create(
            name.into(),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(file)
}

/// Runs `ip` with `args` (inside `netns` if given), mapping failure to an error with its output.
pub fn ip(netns: Option<&str>, args: &[&str]) -> Result<(), TapError> {
    let mut cmd = Command::new("ip");
    if let Some(ns) = netns {
        cmd.args(["-n", ns]);
    }
    let out = cmd
        .args(args)
        .output()
        .map_err(|e| TapError::Ip(args.join(" "), format!("cannot run ip: {e}")))?;
    if !out.status.success() {
        return Err(TapError::Ip(
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(())
}

/// Creates tap `name` in namespace `netns` (or the current one), attaches it to `bridge` if
/// given and brings it up. The device disappears when the returned file is closed (or the
/// process dies).
pub fn open_tap(netns: Option<&str>, name: &str, bridge: Option<&str>) -> Result<File, TapError> {
    if name.is_empty() || name.len() > 15 {
        return Err(TapError::Name(name.into()));
    }
    let owned = name.to_string();
    let file = in_netns(netns, move || create(&owned))??;
    if let Some(br) = bridge {
        ip(netns, &["link", "set", name, "master", br])?;
    }
    ip(netns, &["link", "set", name, "up"])?;
    Ok(file)
}
