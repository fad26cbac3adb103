//! The namespace lab's clients' bridge with a real tap and tandem's relay on it (root).

use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use tandem_harness::netlab::{self, NetLab};
use tandem_net::{Policy, Relay};

#[test]
fn tap_on_a_lab_bridge_carries_frames() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc_geteuid() } != 0 {
        panic!("this test needs root (network namespaces); CI runs as root");
    }
    let lab = NetLab::create(&format!("tr{}", std::process::id() % 100_000), 100).unwrap();
    let tap = tandem_net::open_tap(Some(&lab.clients), "tpt0", Some(netlab::BRIDGE)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let relay =
        Relay::listen(&dir.path().join("n.sock"), OwnedFd::from(tap), Policy::Pass).unwrap();
    let mut qemu = UnixStream::connect(relay.socket()).unwrap();
    qemu.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // An ARP request from the bridge's address for a "guest" at 10.77.0.9 reaches the relay.
    let ns = lab.clients.clone();
    let pinger = std::thread::spawn(move || {
        for _ in 0..30 {
            let _ = tandem_net::netns::in_netns(Some(&ns), || {
                let u = std::net::UdpSocket::bind("10.77.0.1:0")?;
                u.send_to(b"hello", "10.77.0.9:9")
            });
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    // IPv6 neighbour/router chatter may come first; wait for the ARP request.
    let arp = loop {
        let mut len = [0u8; 4];
        qemu.read_exact(&mut len).unwrap();
        let mut f = vec![0u8; u32::from_be_bytes(len) as usize];
        qemu.read_exact(&mut f).unwrap();
        if f.len() >= 42 && f[12..14] == [0x08, 0x06] {
            break f;
        }
    };
    assert_eq!(&arp[38..42], &[10, 77, 0, 9], "asking for 10.77.0.9");
    let _ = pinger.join();
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

#[test]
fn the_clients_bridge_keeps_its_address_when_a_port_leaves() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc_geteuid() } != 0 {
        panic!("this test needs root (network namespaces); CI runs as root");
    }
    let lab = NetLab::create(&format!("tm{}", std::process::id() % 100_000), 0).unwrap();
    let ip = |args: &[&str]| {
        let out = std::process::Command::new("ip")
            .args(["-n", &lab.clients])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "ip {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mac = || {
        let show = ip(&["link", "show", netlab::BRIDGE]);
        show.split("link/ether ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(mac(), netlab::BRIDGE_MAC);
    // A port with the lowest address there is (as a host's tap may have), then gone: an
    // unpinned bridge would take its address and then change it again under the guests.
    ip(&[
        "link",
        "add",
        "lowp",
        "address",
        "00:00:00:00:00:01",
        "type",
        "veth",
        "peer",
        "name",
        "lowq",
    ]);
    ip(&["link", "set", "lowp", "master", netlab::BRIDGE, "up"]);
    assert_eq!(mac(), netlab::BRIDGE_MAC);
    ip(&["link", "del", "lowp"]);
    assert_eq!(mac(), netlab::BRIDGE_MAC);
}
