//! The relay over real sockets: a unix stream client plays QEMU's stream netdev (same framing),
//! a unix datagram socket plays the tap.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::time::{Duration, Instant};

use tandem_net::{Policy, Relay};

fn frame(i: u8) -> Vec<u8> {
    let mut f = vec![i; 60 + i as usize];
    f[..6].copy_from_slice(&[0xff; 6]);
    f
}

fn send_to_relay(q: &mut UnixStream, f: &[u8]) {
    q.write_all(&(f.len() as u32).to_be_bytes()).unwrap();
    q.write_all(f).unwrap();
}

fn setup(policy: Policy) -> (tempfile::TempDir, Relay, UnixStream, UnixDatagram) {
    let dir = tempfile::tempdir().unwrap();
    let (outside, world) = UnixDatagram::pair().unwrap();
    world
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let relay =
        Relay::listen(&dir.path().join("net.sock"), OwnedFd::from(outside), policy).unwrap();
    let qemu = UnixStream::connect(relay.socket()).unwrap();
    let t = Instant::now();
    while !relay.guest_connected() {
        assert!(t.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    }
    (dir, relay, qemu, world)
}

fn wait_held(relay: &Relay, n: u64) {
    let t = Instant::now();
    while relay.stats().held_frames != n {
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", relay.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn guest_output_waits_for_its_epoch_and_input_passes_at_once() {
    let (_d, relay, mut qemu, world) = setup(Policy::Hold);
    let mut buf = [0u8; 2048];
    for i in 0..3 {
        send_to_relay(&mut qemu, &frame(i));
    }
    wait_held(&relay, 3);
    relay.seal(1);
    send_to_relay(&mut qemu, &frame(3));
    wait_held(&relay, 4);
    relay.seal(2);
    assert!(
        world.recv(&mut buf).is_err(),
        "nothing leaves before an ack"
    );
    assert_eq!(relay.release(1).unwrap(), 3);
    for i in 0..3 {
        let n = world.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], &frame(i)[..]);
    }
    assert!(
        world.recv(&mut buf).is_err(),
        "epoch 2 is not acknowledged yet"
    );
    assert_eq!(relay.release(2).unwrap(), 1);
    let n = world.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], &frame(3)[..]);
    // Inbound: at once, framed for QEMU.
    world.send(&frame(9)).unwrap();
    let mut len = [0u8; 4];
    qemu.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    qemu.read_exact(&mut len).unwrap();
    let mut f = vec![0u8; u32::from_be_bytes(len) as usize];
    qemu.read_exact(&mut f).unwrap();
    assert_eq!(f, frame(9));
    let t = Instant::now();
    while relay.stats().inbound_frames != 1 {
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", relay.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    let s = relay.stats();
    assert_eq!((s.held_frames, s.released_frames), (0, 4));
}

#[test]
fn standby_passes_nothing_until_switched() {
    let (_d, relay, mut qemu, world) = setup(Policy::Standby);
    let mut buf = [0u8; 2048];
    send_to_relay(&mut qemu, &frame(1));
    world.send(&frame(2)).unwrap();
    let t = Instant::now();
    while relay.stats().dropped_frames != 2 {
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", relay.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(world.recv(&mut buf).is_err());
    relay.set_policy(Policy::Pass).unwrap();
    send_to_relay(&mut qemu, &frame(3));
    let n = world.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], &frame(3)[..]);
}

#[test]
fn switching_to_pass_releases_what_was_held() {
    let (_d, relay, mut qemu, world) = setup(Policy::Hold);
    let mut buf = [0u8; 2048];
    send_to_relay(&mut qemu, &frame(5));
    wait_held(&relay, 1);
    relay.set_policy(Policy::Pass).unwrap();
    let n = world.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], &frame(5)[..]);
}

fn wait_stats(relay: &Relay, ok: impl Fn(&tandem_net::RelayStats) -> bool) {
    let t = Instant::now();
    while !ok(&relay.stats()) {
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", relay.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Nothing (no frame of non-zero length) reaches the outside within the read timeout.
fn assert_nothing_leaves(world: &UnixDatagram) {
    let mut buf = [0u8; 2048];
    if let Ok(n) = world.recv(&mut buf) {
        assert_eq!(n, 0, "a held frame left the relay: {:?}", &buf[..n.min(16)]);
    }
}

#[test]
fn hold_limit_drops_guest_frames_beyond_it() {
    let (_d, relay, mut qemu, world) = setup(Policy::Hold);
    assert_eq!(relay.hold_limit(), tandem_net::relay::DEFAULT_HOLD_LIMIT);
    // Frames 0, 1, 2 are 60 + 61 + 62 = 183 bytes; 63 and 64 would take it past 200.
    relay.set_hold_limit(200);
    for i in 0..5 {
        send_to_relay(&mut qemu, &frame(i));
    }
    wait_stats(&relay, |s| s.held_frames + s.overflow_frames == 5);
    let s = relay.stats();
    assert_eq!(
        (s.held_frames, s.held_bytes, s.overflow_frames),
        (3, 183, 2)
    );
    assert_eq!(s.dropped_frames, 0, "overflow is counted on its own");
    relay.seal(1);
    assert_eq!(relay.release(1).unwrap(), 3);
    let mut buf = [0u8; 2048];
    for i in 0..3 {
        let n = world.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], &frame(i)[..]);
    }
    // Released bytes make room again.
    send_to_relay(&mut qemu, &frame(7));
    wait_held(&relay, 1);
    relay.seal(2);
    assert_eq!(relay.release(2).unwrap(), 1);
    let n = world.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], &frame(7)[..]);
    assert_eq!(relay.stats().overflow_frames, 2);
}

#[test]
fn discard_held_drops_sealed_and_open_frames_without_writing_them() {
    let (_d, relay, mut qemu, world) = setup(Policy::Hold);
    send_to_relay(&mut qemu, &frame(1));
    send_to_relay(&mut qemu, &frame(2));
    wait_held(&relay, 2);
    relay.seal(1);
    send_to_relay(&mut qemu, &frame(3));
    wait_held(&relay, 3);
    assert_eq!(relay.discard_held(), 3);
    let s = relay.stats();
    assert_eq!(
        (
            s.held_frames,
            s.held_bytes,
            s.dropped_frames,
            s.released_frames
        ),
        (0, 0, 3, 0)
    );
    // Neither an acknowledgement nor a switch to pass brings them back.
    assert_eq!(relay.release(u64::MAX).unwrap(), 0);
    relay.set_policy(Policy::Pass).unwrap();
    assert_nothing_leaves(&world);
    // New output passes.
    send_to_relay(&mut qemu, &frame(4));
    let mut buf = [0u8; 2048];
    let n = world.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], &frame(4)[..]);
}

#[test]
fn only_acknowledged_epochs_leave_and_drop_writes_nothing() {
    let (_d, relay, mut qemu, world) = setup(Policy::Hold);
    send_to_relay(&mut qemu, &frame(1));
    wait_held(&relay, 1);
    relay.seal(1);
    send_to_relay(&mut qemu, &frame(2));
    wait_held(&relay, 2);
    relay.seal(2);
    send_to_relay(&mut qemu, &frame(3));
    wait_held(&relay, 3);
    // Standby and back, and releasing an older epoch, release nothing of epochs 1..=2 or
    // the open queue.
    relay.set_policy(Policy::Standby).unwrap();
    relay.set_policy(Policy::Hold).unwrap();
    assert_eq!(relay.release(0).unwrap(), 0);
    assert_nothing_leaves(&world);
    assert_eq!(relay.stats().held_frames, 3);
    drop(relay);
    assert_nothing_leaves(&world);
    drop(qemu);
}

#[test]
fn a_closed_gate_keeps_released_epochs_held_and_drops_passing_frames() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let (_d, relay, mut qemu, world) = setup(Policy::Hold);
    let open = Arc::new(AtomicBool::new(false));
    let o = open.clone();
    relay.set_gate(Some(Arc::new(move || o.load(Ordering::SeqCst))));
    let mut buf = [0u8; 2048];
    for i in 0..2 {
        send_to_relay(&mut qemu, &frame(i));
    }
    wait_held(&relay, 2);
    relay.seal(1);
    assert_eq!(relay.release(1).unwrap(), 0, "the gate is closed");
    assert!(world.recv(&mut buf).is_err());
    assert_eq!(relay.stats().held_frames, 2);
    assert!(relay.gated() >= 1);
    open.store(true, Ordering::SeqCst);
    assert_eq!(relay.release(1).unwrap(), 2);
    for i in 0..2 {
        let n = world.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], &frame(i)[..], "in order once the gate opens");
    }
    // Passing: a closed gate drops the frame instead of letting it out.
    relay.set_policy(Policy::Pass).unwrap();
    open.store(false, Ordering::SeqCst);
    send_to_relay(&mut qemu, &frame(5));
    let t = Instant::now();
    while relay.stats().dropped_frames != 1 {
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", relay.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(world.recv(&mut buf).is_err());
    open.store(true, Ordering::SeqCst);
    send_to_relay(&mut qemu, &frame(6));
    let n = world.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], &frame(6)[..]);
}

#[test]
fn a_release_whose_deadline_passes_keeps_the_rest_held_in_order() {
    // The primary's session releases an acknowledgement's output only until the backup's
    // promise runs out: what is left waits, in order, for the next acknowledgement.
    let (_d, relay, mut qemu, world) = setup(Policy::Hold);
    let mut buf = [0u8; 2048];
    for i in 0..4 {
        send_to_relay(&mut qemu, &frame(i));
    }
    wait_held(&relay, 4);
    relay.seal(1);
    let left = std::cell::Cell::new(2u32);
    let allowed = || {
        let n = left.get();
        left.set(n.saturating_sub(1));
        n > 0
    };
    assert_eq!(relay.release_while(1, &allowed).unwrap(), (2, false));
    for i in 0..2 {
        let n = world.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], &frame(i)[..]);
    }
    assert!(world.recv(&mut buf).is_err(), "nothing past the deadline");
    assert_eq!(relay.stats().held_frames, 2);
    // Everything after a quiesce sees what `allowed` says by then.
    relay.quiesce();
    assert_eq!(relay.release_while(1, &|| true).unwrap(), (2, true));
    for i in 2..4 {
        let n = world.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], &frame(i)[..], "the rest, in order");
    }
}
