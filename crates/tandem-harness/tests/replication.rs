//! Replication against real QEMU: a primary guest's epochs go through the codec and the
//! replication protocol into a backup mirror file; after k epochs the mirror equals the
//! primary's RAM (checksums taken while stopped); then the primary is killed and a standby
//! QEMU, pre-started on the mirror file, resumes the guest from the last committed epoch.

mod common;

use std::time::Duration;

use common::free_port;
use tandem_codec::{Codec, Config};
use tandem_harness::kv::wait_for_server;
use tandem_harness::{kv_port, lab_config};
use tandem_replication::{Applied, Backup, EpochInput, Frame, Primary};
use tandem_vm::{DirtyMode, Guest, MirrorFile, NicNet, Vm};

/// Ships a frame through the wire format (as the link would) into the backup.
fn ship(bk: &mut Backup<MirrorFile>, f: Frame) -> Applied {
    let mut bytes = Vec::new();
    f.write_to(&mut bytes).unwrap();
    let f = Frame::read_from(&mut &bytes[..]).unwrap().unwrap();
    bk.handle(&f).unwrap()
}

#[test]
fn mirror_matches_primary_and_standby_takes_over() {
    const VM_ID: u64 = 42;
    let mut cfg = lab_config("repl-primary", "kv", 256).unwrap();
    cfg.dirty = DirtyMode::Uffd;
    let mut primary = Vm::launch(&cfg).unwrap();
    primary.wait_ready(Duration::from_secs(120)).unwrap();
    let mut client = wait_for_server(kv_port(&cfg).unwrap(), Duration::from_secs(60)).unwrap();

    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let mirror_path = dir.path().join("mirror.ram");
    let bytes = cfg.mem_mib << 20;
    // SAFETY: only this test writes the file; the standby QEMU maps it but does not run until
    // `resume`, which happens after the last write.
    let mirror = unsafe { MirrorFile::create(&mirror_path, bytes) }.unwrap();
    let mut backup = Backup::new(mirror);
    let mut standby_cfg = cfg.clone();
    standby_cfg.name = "repl-standby".into();
    standby_cfg.dirty = DirtyMode::None;
    standby_cfg.nics[0].net = NicNet::User {
        forwards: vec![format!("tcp:127.0.0.1:{}-:6379", free_port())],
    };
    let mut standby = Vm::standby(&standby_cfg, &mirror_path).unwrap();

    // Initial copy, taken while stopped, with the dirty log reset in the same pause; frames
    // built by the library's `Primary`, as the daemon does.
    let mut proto = Primary::new(VM_ID, Codec::Tandem, Config::default());
    let base = Guest::initial_copy(&mut primary, &mut || {}).unwrap();
    ship(&mut backup, proto.begin(0, &base, 0).unwrap());
    for f in proto.base_frames(&base, 1024) {
        ship(&mut backup, f);
    }
    drop(base);

    let (mut pfns, mut pages, mut dev) = (Vec::new(), Vec::new(), Vec::new());
    let epochs = 20u64;
    for seq in 1..=epochs {
        std::thread::sleep(Duration::from_millis(100));
        if seq == epochs {
            client.set(b"committed", b"before-failover").unwrap();
        }
        // The last checkpoint keeps the primary stopped so its RAM can be compared.
        Guest::pause(
            &mut primary,
            &mut pfns,
            &mut pages,
            &mut dev,
            &mut |_, _| {},
            seq < epochs,
        )
        .unwrap();
        let input = EpochInput {
            seq,
            pfns: &pfns,
            pages: &pages,
            device_state: &dev,
            disk_writes: None,
        };
        let (f, _) = proto.epoch(&input).unwrap();
        assert_eq!(ship(&mut backup, f), Applied::Committed(seq));
    }
    // SAFETY: the primary is stopped.
    let primary_sum = xxhash_rust::xxh3::xxh3_128(unsafe { primary.ram().as_slice() });
    assert_eq!(
        xxhash_rust::xxh3::xxh3_128(backup.mirror()),
        primary_sum,
        "mirror differs from the primary at epoch {epochs}"
    );
    primary.console.poll().unwrap();
    let tick = tandem_labguest::last_tick(&primary.console).unwrap();

    // Host failure: the primary's QEMU dies; the standby resumes from the committed epoch.
    primary.kill();
    drop(client);
    let state = backup.device_state().to_vec();
    drop(backup);
    standby.resume(&state).unwrap();
    let first = tandem_labguest::wait_tick(&mut standby.console, Duration::from_secs(30)).unwrap();
    assert!(
        first >= tick,
        "standby restarted the guest: tick {first} after checkpoint tick {tick}"
    );
    assert!(
        !standby.console.text().contains("Linux version"),
        "guest rebooted"
    );
    let mut c = wait_for_server(kv_port(&standby_cfg).unwrap(), Duration::from_secs(60)).unwrap();
    assert_eq!(
        c.get(b"committed").unwrap().as_deref(),
        Some(&b"before-failover"[..])
    );
}
