//! A packet capture on the primary's tap, on the clients' bridge: every guest frame the
//! primary's relay lets out, with its arrival time. The fault checks use it to prove that no
//! output of the primary reaches the clients once the backup runs the guest.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;

pub struct Capture {
    stop: Arc<AtomicBool>,
    /// Arrival times of the frames the relay wrote into the tap (towards the clients).
    pub frames: Arc<Mutex<Vec<Instant>>>,
}

impl Capture {
    /// Captures on interface `ifname` in namespace `ns`.
    pub fn start(ns: &str, ifname: &str) -> anyhow::Result<Capture> {
        let name = ifname.to_string();
        let fd = tandem_net::netns::in_netns(Some(ns), move || open(&name))??;
        let stop = Arc::new(AtomicBool::new(false));
        let frames: Arc<Mutex<Vec<Instant>>> = Arc::default();
        let (s, f) = (stop.clone(), frames.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536];
            while !s.load(Ordering::SeqCst) {
                // SAFETY: sockaddr_ll is plain old data; all-zero is a valid value.
                let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
                // SAFETY: buf and from are valid for writes of the lengths passed; fd is open.
                let n = unsafe {
                    libc::recvfrom(
                        fd.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                        (&mut from as *mut libc::sockaddr_ll).cast(),
                        &mut len,
                    )
                };
                if n < 0 {
                    let e = std::io::Error::last_os_error();
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) {
                        continue;
                    }
                    break; // the tap is gone with its primary
                }
                // Frames the relay writes into the tap enter the host stack on this interface;
                // PACKET_OUTGOING ones go from the bridge towards the guest.
                if from.sll_pkttype != libc::PACKET_OUTGOING {
                    f.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(Instant::now());
                }
            }
        });
        Ok(Capture { stop, frames })
    }

    /// Frames captured after `t`.
    pub fn after(&self, t: Instant) -> usize {
        let f = self.frames.lock().unwrap_or_else(|e| e.into_inner());
        f.iter().filter(|x| **x > t).count()
    }

    pub fn total(&self) -> usize {
        self.frames.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn open(ifname: &str) -> anyhow::Result<OwnedFd> {
    let proto = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain socket(2) call; the result is checked.
    let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto as i32) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error()).context("AF_PACKET socket (needs root)");
    }
    // SAFETY: raw is a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let cname = std::ffi::CString::new(ifname)?;
    // SAFETY: cname is a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    if idx == 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("interface {ifname}"));
    }
    // SAFETY: sockaddr_ll is plain old data; all-zero is a valid value.
    let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sa.sll_family = libc::AF_PACKET as u16;
    sa.sll_protocol = proto;
    sa.sll_ifindex = idx as i32;
    // SAFETY: sa is a valid sockaddr_ll of the length passed; fd is open.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("binding to {ifname}"));
    }
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 200_000,
    };
    // SAFETY: tv is a valid timeval of the length passed.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    Ok(fd)
}
