//! A program that embeds tandem: a primary and a backup in this one process, each a
//! `DaemonHandle`, protecting a real QEMU guest (the lab guest `tandem-lab setup` builds).
//! A link cut makes the backup fail over; the handles' typed events tell the test what
//! happened, and their stop requests end both daemons.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::wait_for;
use tandem_protect::backup::BackupConfig;
use tandem_protect::primary::PrimaryConfig;
use tandem_protect::{backup, primary, Event, VmSpec};
use tandem_test_support::free_port;

/// A TCP relay from `listen` to `upstream` that the test cuts: then every connection is
/// closed and new ones are refused.
struct Link {
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Link {
    fn start(listen: u16, upstream: u16) -> Link {
        let l = TcpListener::bind(("127.0.0.1", listen)).unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::<TcpStream>::new()));
        let (c, cs) = (cut.clone(), conns.clone());
        std::thread::spawn(move || {
            for down in l.incoming() {
                let Ok(down) = down else { continue };
                let up = match TcpStream::connect(("127.0.0.1", upstream)) {
                    Ok(up) if !c.load(Ordering::SeqCst) => up,
                    _ => continue, // dropped: refused
                };
                let _ = (down.set_nodelay(true), up.set_nodelay(true));
                {
                    let mut v = cs.lock().unwrap();
                    v.push(down.try_clone().unwrap());
                    v.push(up.try_clone().unwrap());
                }
                pipe(down.try_clone().unwrap(), up.try_clone().unwrap());
                pipe(up, down);
            }
        });
        Link { cut, conns }
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 || to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Both);
    });
}

#[test]
fn a_primary_and_a_backup_in_one_process_fail_over_through_their_handles() {
    let (backup_port, link_port) = (free_port(), free_port());
    let dir = tempfile::Builder::new()
        .prefix("tandem-embed-")
        .tempdir_in("/dev/shm")
        .unwrap();
    let image = tandem_labguest::GuestImage::default();
    let desc = tandem_labguest::write_description(dir.path(), "memtouch", &image, 0).unwrap();
    let mut vm = VmSpec::described(desc);
    vm.mem = 192;

    let mut bc = BackupConfig::new(format!("127.0.0.1:{backup_port}"), dir.path(), vm.clone());
    bc.vm_id = 41;
    let b = backup::spawn(bc);
    let link = Link::start(link_port, backup_port);

    let mut pc = PrimaryConfig::new(format!("127.0.0.1:{link_port}"), vm);
    pc.vm_id = 41;
    pc.ack_timeout = Duration::from_secs(2);
    let p = primary::spawn(pc);

    let (mut ps, mut bs) = (Vec::new(), Vec::new());
    wait_for(&p, &mut ps, Duration::from_secs(240), |e| {
        *e == Event::Protected
    });
    // The initial sync ran pre-copy rounds while memtouch kept writing (initial.rs): the
    // first was sent before the guest was protected.
    let said = |what: &str| {
        ps.iter()
            .any(|e| matches!(e, Event::Info { text } if text.contains(what)))
    };
    assert!(said("pre-copy round 1:"), "{ps:#?}");
    let acked = |ps: &[Event]| {
        ps.iter()
            .filter_map(|e| match e {
                Event::Acked { epoch } => Some(*epoch),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    // Epochs keep being acknowledged, in order.
    wait_for(
        &p,
        &mut ps,
        Duration::from_secs(60),
        |e| matches!(e, Event::Acked { epoch } if *epoch >= 10),
    );
    let a = acked(&ps);
    assert!(a.windows(2).all(|w| w[0] < w[1]), "{a:?}");
    let Event::Committed { epoch: committed } = wait_for(
        &b,
        &mut bs,
        Duration::from_secs(30),
        |e| matches!(e, Event::Committed { epoch } if *epoch >= 10),
    ) else {
        unreachable!()
    };
    assert!(bs.contains(&Event::Role { role: "backup" }), "{bs:#?}");

    // The link goes: the backup fails over from its last committed epoch; the primary's guest
    // is no longer protected.
    link.cut();
    let failed = wait_for(&b, &mut bs, Duration::from_secs(60), |e| {
        matches!(e, Event::FailedOver { .. })
    });
    let Event::FailedOver { epoch, .. } = failed else {
        unreachable!()
    };
    assert!(
        epoch >= committed,
        "resumed from {epoch}, committed {committed} before the cut"
    );
    wait_for(&p, &mut ps, Duration::from_secs(30), |e| {
        *e == Event::Unprotected
    });

    // Both end on request, each its own: nothing process-wide.
    p.request_shutdown();
    p.join().expect("the primary ends cleanly");
    assert!(
        !b.is_finished(),
        "stopping the primary stopped the backup too"
    );
    b.request_shutdown();
    b.join().expect("the backup ends cleanly");
}
