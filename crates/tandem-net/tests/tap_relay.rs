//! The relay with a tap guest side (what QEMU opens with `vnet_hdr=on`), in a network namespace
//! of its own: this test plays QEMU on the tap's descriptor, a unix datagram socket plays the
//! outside tap. Every frame keeps its 10-byte virtio-net header both ways, and held output
//! waits for its epoch as with the stream guest side. Needs root (namespaces, taps).

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_net::{Policy, Relay};

/// A virtio-net header (no offload) and an Ethernet frame carrying `tag`.
fn frame(tag: u8) -> Vec<u8> {
    let mut f = vec![0u8; 10];
    f.extend([0x52, 0x54, 0x00, 0, 0, 1]); // to
    f.extend([0x52, 0x54, 0x00, 0, 0, 2]); // from
    f.extend([0x88, 0xb5]); // local experimental ethertype: nothing in the kernel answers
    f.extend(std::iter::repeat_n(tag, 60));
    f
}

/// Reads frames from `read` until one equals `want` (the kernel may send its own on a new
/// link) or a second passes.
fn expect(read: &mut dyn FnMut(&mut [u8]) -> Option<usize>, want: &[u8]) -> bool {
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    while t.elapsed() < Duration::from_secs(1) {
        if let Some(n) = read(&mut buf) {
            if &buf[..n] == want {
                return true;
            }
        }
    }
    false
}

#[test]
fn frames_keep_their_virtio_net_headers_and_held_ones_wait_for_their_epoch() {
    let ns = format!("tdtap{}", std::process::id() % 100_000);
    let ok = Command::new("ip")
        .args(["netns", "add", &ns])
        .status()
        .unwrap()
        .success();
    assert!(ok, "ip netns add {ns} (the tests need root)");
    let result = tandem_net::netns::in_netns(Some(&ns), || {
        tandem_net::guest_tap("tqtest0").unwrap();
        let (outside, world) = UnixDatagram::pair().unwrap();
        world
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let relay = Relay::attach_tap("tqtest0", OwnedFd::from(outside), Policy::Hold).unwrap();
        // QEMU's side: the same tap, opened with virtio-net headers.
        let mut qemu = tandem_net::open_tap_with(None, "tqtest0", None, true).unwrap();
        // SAFETY: fcntl on an open descriptor this test owns.
        unsafe {
            let fd = std::os::fd::AsRawFd::as_raw_fd(&qemu);
            libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK);
        }
        let mut from_world = |buf: &mut [u8]| world.recv(buf).ok();

        // Guest output: held until its epoch is sealed and released.
        qemu.write_all(&frame(1)).unwrap();
        assert!(
            !expect(&mut from_world, &frame(1)),
            "left before its epoch was acked"
        );
        relay.seal(1);
        relay.release(1).unwrap();
        assert!(
            expect(&mut from_world, &frame(1)),
            "released frame missing outside"
        );

        // Input passes at once, header included.
        world.send(&frame(2)).unwrap();
        let mut from_tap = |buf: &mut [u8]| match qemu.read(buf) {
            Ok(n) => Some(n),
            Err(_) => {
                std::thread::sleep(Duration::from_millis(5));
                None
            }
        };
        assert!(
            expect(&mut from_tap, &frame(2)),
            "inbound frame missing on the tap"
        );

        // Unprotected: output passes at once.
        relay.set_policy(Policy::Pass).unwrap();
        qemu.write_all(&frame(3)).unwrap();
        let mut from_world = |buf: &mut [u8]| world.recv(buf).ok();
        assert!(
            expect(&mut from_world, &frame(3)),
            "passing frame missing outside"
        );
        let there = |name: &str| {
            Command::new("ip")
                .args(["link", "show", name])
                .output()
                .unwrap()
                .status
                .success()
        };
        assert!(there("tqtest0"));
        drop(qemu);
        drop(relay);
        // The relay owned the guest tap.
        !there("tqtest0")
    });
    let _ = Command::new("ip").args(["netns", "del", &ns]).status();
    assert!(result.unwrap(), "the guest tap outlived its relay");
}
