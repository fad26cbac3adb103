//! Tap devices (`/dev/net/tun`, `IFF_TAP | IFF_NO_PI`), created in a chosen network namespace:
//! the outside of a relay (on a bridge), and the guest side of a relay whose QEMU NIC is a tap
//! with virtio-net headers ([`guest_tap`]).

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
const IFF_VNET_HDR: libc::c_short = 0x4000;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

fn create(name: &str, vnet_hdr: bool) -> Result<File, TapError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(TapError::Open)?;
    let mut req = IfReq {
        name: [0; 16],
        flags: IFF_TAP | IFF_NO_PI | if vnet_hdr { IFF_VNET_HDR } else { 0 },
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
    open_tap_with(netns, name, bridge, false)
}

/// [`open_tap`], its frames read and written with a 10-byte `struct virtio_net_hdr` in front
/// (`IFF_VNET_HDR`) when `vnet_hdr`: a relay whose guest side carries them passes them through.
pub fn open_tap_with(
    netns: Option<&str>,
    name: &str,
    bridge: Option<&str>,
    vnet_hdr: bool,
) -> Result<File, TapError> {
    if name.is_empty() || name.len() > 15 {
        return Err(TapError::Name(name.into()));
    }
    let owned = name.to_string();
    let file = in_netns(netns, move || create(&owned, vnet_hdr))??;
    if let Some(br) = bridge {
        ip(netns, &["link", "set", name, "master", br])?;
    }
    ip(netns, &["link", "set", name, "up"])?;
    Ok(file)
}

/// Creates (or takes over, if an earlier run left it) the persistent tap `name` in this
/// process's network namespace for QEMU to open (`-netdev tap,ifname=NAME,vnet_hdr=on`): no
/// address, IPv6 off, up. The relay reads and writes the guest's frames on it through a packet
/// socket ([`crate::Relay::attach_tap`]). Remove it with [`remove_tap`].
pub fn guest_tap(name: &str) -> Result<(), TapError> {
    if name.is_empty() || name.len() > 15 {
        return Err(TapError::Name(name.into()));
    }
    let file = create(name, true)?;
    // SAFETY: TUNSETPERSIST takes an integer argument; `file` is the tap's open descriptor.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETPERSIST, 1 as libc::c_ulong) };
    if r != 0 {
        return Err(TapError::Create(
            name.into(),
            std::io::Error::last_os_error(),
        ));
    }
    drop(file);
    // Nothing of the host's own talks on it: the guest's frames are the relay's alone.
    let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
    ip(None, &["link", "set", name, "up"])
}

/// Deletes tap `name` of this process's namespace (a [`guest_tap`]); gone already is fine.
pub fn remove_tap(name: &str) {
    let _ = ip(None, &["link", "del", name]);
}
