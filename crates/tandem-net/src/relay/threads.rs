//! The relay's threads: frames from the guest (QEMU's stream socket or, through a packet
//! socket, its tap) into the hold queues or out at once, and frames from the outside to the
//! guest.

use super::*;

pub(super) fn accept_loop(listener: UnixListener, s: Arc<Shared>) {
    for conn in listener.incoming() {
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else { continue };
        let Ok(reader) = conn.try_clone() else {
            continue;
        };
        *lock(&s.guest) = Some(GuestConn::Stream(conn));
        let s2 = s.clone();
        std::thread::spawn(move || guest_loop(reader, s2));
    }
}

/// Frames from the guest.
fn guest_loop(mut r: UnixStream, s: Arc<Shared>) {
    let mut len = [0u8; 4];
    loop {
        if r.read_exact(&mut len).is_err() {
            break;
        }
        let n = u32::from_be_bytes(len) as usize;
        if n > 65_536 + 64 {
            tracing::warn!("relay: frame of {n} bytes from QEMU; closing its connection");
            break;
        }
        let mut frame = vec![0u8; n];
        if r.read_exact(&mut frame).is_err() {
            break;
        }
        if s.stop.load(Ordering::SeqCst) {
            break;
        }
        from_guest(&s, frame);
    }
    tracing::debug!("relay: QEMU disconnected");
    *lock(&s.guest) = None;
}

/// Frames from the guest's tap (a packet socket with virtio-net headers).
pub(super) fn packet_loop(fd: Arc<OwnedFd>, s: Arc<Shared>) {
    let mut buf = vec![0u8; 65_536 + 64];
    while !s.stop.load(Ordering::SeqCst) {
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is a valid pollfd for one descriptor that `fd` keeps open.
        if unsafe { libc::poll(&mut pfd, 1, 100) } <= 0 {
            continue;
        }
        // SAFETY: `buf` is valid for writes of its length; `fd` is an open socket.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n <= 0 {
            continue;
        }
        from_guest(&s, buf[..n as usize].to_vec());
    }
}

/// A frame from the guest, as the policy says.
fn from_guest(s: &Shared, frame: Vec<u8>) {
    let n = frame.len();
    match *lock(&s.policy) {
        Policy::Hold => {
            let mut q = lock(&s.queues);
            if q.held_bytes + n as u64 > s.hold_limit.load(Ordering::Relaxed) {
                s.overflow.fetch_add(1, Ordering::Relaxed);
            } else {
                q.held_bytes += n as u64;
                q.open.push(frame);
            }
        }
        Policy::Pass if !s.open() => {
            // Not allowed out now: lost like on a wire that is down (TCP resends).
            s.dropped.fetch_add(1, Ordering::Relaxed);
        }
        Policy::Pass => {
            if let Err(e) = write_outside(s, &frame) {
                tracing::warn!("relay: {e}: {:?}", std::error::Error::source(&e));
                s.dropped.fetch_add(1, Ordering::Relaxed);
            } else {
                s.released.fetch_add(1, Ordering::Relaxed);
            }
        }
        Policy::Standby => {
            s.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Frames to the guest.
pub(super) fn outside_loop(s: Arc<Shared>) {
    // The stream's length prefix, a virtio-net header, a frame of up to 64 KiB (a GSO one).
    let mut buf = vec![0u8; 4 + 65_536 + 64];
    let fd = s.outside.as_raw_fd();
    while !s.stop.load(Ordering::SeqCst) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is a valid pollfd for one descriptor that `s` keeps open.
        let r = unsafe { libc::poll(&mut pfd, 1, 100) };
        if r <= 0 {
            continue;
        }
        let n = match (&s.outside).read(&mut buf[4..]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!("relay: reading the outside: {e}");
                break;
            }
        };
        if *lock(&s.policy) == Policy::Standby {
            s.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let mut g = lock(&s.guest);
        if let Some(conn) = g.as_mut() {
            match conn.send(&mut buf[..4 + n]) {
                Ok(()) => {
                    s.inbound.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) if matches!(conn, GuestConn::Packet(_)) => {
                    // QEMU has not opened the tap yet, or its queue is full: lost like on a
                    // wire.
                    s.dropped.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => *g = None,
            }
        }
    }
}

const ETH_P_ALL: u16 = 0x0003;
const PACKET_VNET_HDR: libc::c_int = 15;
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;

/// A raw packet socket bound to `ifname` of this namespace, whose frames carry a
/// `struct virtio_net_hdr` both ways and which does not see its own sends.
pub(super) fn packet_socket(ifname: &str) -> std::io::Result<OwnedFd> {
    let name = std::ffi::CString::new(ifname).map_err(std::io::Error::other)?;
    // SAFETY: `name` is a NUL-terminated string that outlives the call.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: plain socket(2) call; the result is checked before use.
    let raw = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            ETH_P_ALL.to_be() as libc::c_int,
        )
    };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor this function owns from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let set = |level: libc::c_int, opt: libc::c_int, v: libc::c_int| {
        // SAFETY: `v` is a valid c_int for the length given; `fd` is an open socket.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                level,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    set(libc::SOL_PACKET, PACKET_VNET_HDR, 1)?;
    set(libc::SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)?;
    // Room for a burst of the guest's frames while the relay thread is busy.
    set(libc::SOL_SOCKET, libc::SO_RCVBUF, 4 << 20)?;
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid value to fill in.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as libc::c_ushort;
    addr.sll_protocol = ETH_P_ALL.to_be();
    addr.sll_ifindex = index as libc::c_int;
    // SAFETY: `addr` is a valid sockaddr_ll of the length given; `fd` is an open socket.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}
