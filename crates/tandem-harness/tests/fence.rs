//! The ownership record against a real 3-member etcd cluster on 127.0.0.1 (Debian's
//! etcd-server), with a proxy that drops or delays one member's replies for the ambiguous
//! outcomes.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::free_port;
use tandem_fence::{Fence, FenceConfig, FenceError, Refusal, State};
use tandem_harness::etcd_cluster::{Cluster, Member, Proxy, ProxyMode};

fn cluster(dir: &std::path::Path) -> Cluster {
    common::local_etcd(dir)
}

fn fence(endpoints: Vec<String>, vm: u64, node: &str) -> Arc<Fence> {
    Fence::connect(FenceConfig::new(endpoints, vm, node)).unwrap()
}

fn refusal(e: FenceError) -> Refusal {
    match e {
        FenceError::Refused { refusal, .. } => refusal,
        other => panic!("expected a refusal, got {other}"),
    }
}

/// A proxy in front of the first member, listed first, so every request goes through it
/// while it answers.
fn proxied(c: &Cluster) -> (Proxy, Vec<String>) {
    let up: SocketAddr = c.endpoints()[0]
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let p = Proxy::start("127.0.0.1:0".parse().unwrap(), up).unwrap();
    let mut eps = vec![format!("http://{}", p.addr())];
    eps.extend(c.endpoints()[1..].iter().cloned());
    (p, eps)
}

#[test]
fn only_the_recorded_session_takes_over_and_the_old_owner_is_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path());
    let a = fence(c.endpoints(), 7, "primary").boot().unwrap();
    assert_eq!(a.generation(), 1);
    // A second copy cannot boot while the VM runs.
    let e = refusal(fence(c.endpoints(), 7, "other").boot().err().unwrap());
    assert!(matches!(e, Refusal::Owned(_)), "{e}");
    // Unprotected: no backup may take over.
    let b = fence(c.endpoints(), 7, "backup");
    let e = refusal(b.take_over(0xabc).err().unwrap());
    assert!(matches!(e, Refusal::NotEligible(_)), "{e}");
    a.protect(0xabc).unwrap();
    assert_eq!(a.record().state, State::Protected);
    // Only the backup of the recorded session.
    let e = refusal(b.take_over(0x999).err().unwrap());
    assert!(matches!(e, Refusal::NotEligible(_)), "{e}");
    let t = Instant::now();
    let owner_b = b.take_over(0xabc).unwrap();
    // One compare-and-swap: no lease to wait out.
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(owner_b.generation(), 2);
    assert_eq!(owner_b.record().state, State::Unprotected);
    // The old owner can change nothing any more and knows it.
    assert!(!a.is_fenced());
    for r in [a.unprotect(), a.protect(0x1), a.stop()] {
        assert!(matches!(refusal(r.err().unwrap()), Refusal::Fenced(_)));
    }
    assert!(a.is_fenced());
    assert!(
        a.fenced().unwrap().contains("\"backup\""),
        "{:?}",
        a.fenced()
    );
}

#[test]
fn a_stale_node_never_boots_over_a_takeover_and_an_override_names_the_generation() {
    // Finding 2: "no replica" once meant both "the holder has the only state" and "there is
    // no state"; a node restarted after a takeover could boot the pre-failover image.
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path());
    let a = fence(c.endpoints(), 3, "a").boot().unwrap();
    a.protect(1).unwrap();
    let b = fence(c.endpoints(), 3, "b").take_over(1).unwrap();
    // The old primary restarts (a unit's Restart=) and tries to boot: refused, whatever
    // state the new owner is in.
    for step in 0..2 {
        let e = refusal(fence(c.endpoints(), 3, "a").boot().err().unwrap());
        match e {
            Refusal::Owned(r) => assert_eq!((r.node.as_str(), r.gen), ("b", 2), "{step}"),
            other => panic!("{other}"),
        }
        b.protect(2).unwrap();
    }
    // An operator override must name the current generation...
    let op = fence(c.endpoints(), 3, "operator");
    let e = refusal(op.override_stop(1).err().unwrap());
    assert!(matches!(e, Refusal::Generation { named: 1, .. }), "{e}");
    let r = op.override_stop(2).unwrap();
    assert_eq!((r.state, r.gen), (State::Stopped, 2));
    // ... and then a fresh boot is allowed (a new generation).
    let again = fence(c.endpoints(), 3, "a").boot().unwrap();
    assert_eq!(again.generation(), 3);
    // A guest shut down on purpose may be booted again too.
    again.stop().unwrap();
    assert_eq!(fence(c.endpoints(), 3, "c").boot().unwrap().generation(), 4);
}

#[test]
fn a_takeover_whose_reply_is_lost_counts_as_won() {
    // Finding 3: a transaction committed on one member whose reply was lost, resent to the
    // next member, failed its compare there; the old campaign gave its lease back and the
    // VM stayed down. Reading the record back finds our own op id: won.
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path());
    let (proxy, eps) = proxied(&c);
    let a = fence(c.endpoints(), 4, "a").boot().unwrap();
    a.protect(5).unwrap();
    let b = fence(eps, 4, "b");
    proxy.set(ProxyMode::DropTxnReplies(1));
    let owner = b
        .take_over(5)
        .expect("our own write read back counts as won");
    assert_eq!(proxy.mode(), ProxyMode::Pass, "the reply was dropped");
    assert_eq!(owner.generation(), 2);
    let r = fence(c.endpoints(), 4, "x").read().unwrap().unwrap();
    assert_eq!((r.node.as_str(), r.gen), ("b", 2));
    assert!(matches!(
        refusal(a.unprotect().err().unwrap()),
        Refusal::Fenced(_)
    ));
}

#[test]
fn an_unknown_outcome_is_resolved_when_etcd_answers_again() {
    // Finding 4: the old record() forgot what it had recorded before the transaction; an
    // unknown outcome then left the guest paused for good. Now the write stays pending and
    // is resolved by the next call.
    let dir = tempfile::tempdir().unwrap();
    let mut c = cluster(dir.path());
    let (proxy, eps) = proxied(&c);
    let a = fence(eps.clone(), 6, "a").boot().unwrap();
    proxy.set(ProxyMode::DropTxnReplies(1));
    a.protect(77).expect("a lost reply is read back");
    assert_eq!(proxy.mode(), ProxyMode::Pass, "the reply was dropped");
    // Quorum lost: the outcome is unknown, nothing is decided.
    c.kill(1);
    c.kill(2);
    let e = a.unprotect().err().unwrap();
    assert!(e.unknown(), "{e}");
    assert!(!a.is_fenced());
    c.restart(1).unwrap();
    c.restart(2).unwrap();
    let t = Instant::now();
    loop {
        match a.unprotect() {
            Ok(()) => break,
            Err(e) if e.unknown() && t.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(a.record().state, State::Unprotected);
    // The backup of session 77 may not take over now, whichever write committed first.
    let e = refusal(fence(eps, 6, "b").take_over(77).err().unwrap());
    assert!(matches!(e, Refusal::NotEligible(_)), "{e}");
}

#[test]
fn the_owner_notices_a_change_it_did_not_make() {
    // Finding 6: the holder only renewed its lease and never read the key back.
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path());
    let mut cfg = FenceConfig::new(c.endpoints(), 8, "a");
    cfg.watch_every = Duration::from_millis(100);
    let a = Fence::connect(cfg).unwrap().boot().unwrap();
    a.watch();
    std::thread::sleep(Duration::from_millis(400));
    assert!(!a.is_fenced());
    fence(c.endpoints(), 8, "operator")
        .override_stop(1)
        .unwrap();
    let t = Instant::now();
    while !a.is_fenced() {
        assert!(t.elapsed() < Duration::from_secs(3), "not noticed");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(a.fenced().unwrap().contains("stopped"), "{:?}", a.fenced());
}

#[test]
fn a_slow_member_does_not_decide_anything() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path());
    let (proxy, eps) = proxied(&c);
    // Slower than the request timeout: every request through it is resent to the next.
    proxy.set(ProxyMode::Delay(Duration::from_millis(600)));
    let a = fence(eps.clone(), 9, "a").boot().unwrap();
    a.protect(3).unwrap();
    let b = fence(eps, 9, "b").take_over(3).unwrap();
    assert_eq!(b.generation(), 2);
    assert!(a.protect(4).is_err());
}

#[test]
fn a_corrupt_record_is_named_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path());
    let client =
        tandem_fence::etcd::Client::new(&c.endpoints(), Duration::from_millis(500)).unwrap();
    client
        .txn(
            &[],
            &[tandem_fence::etcd::Op::Put(
                "/tandem/vm/2/owner".into(),
                b"garbage".to_vec(),
                0,
            )],
            &[],
        )
        .unwrap();
    let e = fence(c.endpoints(), 2, "a").boot().err().unwrap();
    assert!(matches!(e, FenceError::Corrupt { .. }), "{e}");
    assert!(
        e.to_string().contains("etcdctl get /tandem/vm/2/owner"),
        "{e}"
    );
}

#[test]
fn an_unreachable_cluster_is_named() {
    let f = fence(vec![format!("http://127.0.0.1:{}", free_port())], 1, "p");
    let e = f.boot().err().unwrap();
    assert!(e.unknown());
    assert!(format!("{e}: {}", std::error::Error::source(&e).unwrap())
        .contains("no etcd endpoint answered"));
    let e = Fence::connect(FenceConfig::new(vec![], 1, "p"))
        .err()
        .unwrap();
    assert!(std::error::Error::source(&e)
        .unwrap()
        .to_string()
        .contains("--etcd"));
}

#[test]
fn etcd_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let tls =
        tandem_harness::etcd_cluster::ClusterTls::generate(&dir.path().join("keys"), &[]).unwrap();
    let members = vec![Member {
        name: "e1".into(),
        ip: "127.0.0.1".into(),
        client_port: free_port(),
        peer_port: free_port(),
    }];
    let c = Cluster::start_with(members, dir.path(), None, Some(tls.clone()))
        .expect("etcd cluster with TLS");
    assert!(c.endpoints()[0].starts_with("https://"));
    let mut cfg = FenceConfig::new(c.endpoints(), 9, "primary");
    cfg.tls = Some(tls.client.clone());
    let f = Fence::connect(cfg.clone()).unwrap();
    let a = f.boot().unwrap();
    a.protect(1).unwrap();
    a.stop().unwrap();
    assert_ne!(
        f.descriptor().cluster_id,
        0,
        "the cluster id comes with the answers"
    );
    // Without a client certificate the cluster refuses (client-cert-auth).
    let mut no_cert = cfg.clone();
    no_cert.tls = Some(tandem_fence::EtcdTls {
        cert: None,
        key: None,
        ..tls.client.clone()
    });
    assert!(Fence::connect(no_cert)
        .unwrap()
        .boot()
        .err()
        .unwrap()
        .unknown());
    // Without TLS at all the https endpoint is refused before any request.
    let mut plain = cfg.clone();
    plain.tls = None;
    assert!(Fence::connect(plain).is_err());
    // Unreadable material is named.
    let mut missing = cfg.clone();
    missing.tls = Some(tandem_fence::EtcdTls {
        ca: dir.path().join("nope.pem"),
        cert: None,
        key: None,
    });
    let e = Fence::connect(missing).err().unwrap();
    assert!(format!("{e}: {:?}", e).contains("nope.pem"), "{e:?}");
}
