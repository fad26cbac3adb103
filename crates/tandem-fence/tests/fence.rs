//! Fencing against a real 3-member etcd cluster on 127.0.0.1 (Debian's etcd-server).

use std::time::{Duration, Instant};

use tandem_fence::cluster::{Cluster, Member};
use tandem_fence::{campaign, Claim, FenceConfig, FenceError, Outcome, Replica};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn cluster(dir: &std::path::Path) -> Cluster {
    let members = (1..=3)
        .map(|i| Member {
            name: format!("e{i}"),
            ip: "127.0.0.1".into(),
            client_port: free_port(),
            peer_port: free_port(),
        })
        .collect();
    Cluster::start(members, dir, None).expect("etcd cluster (tandem setup installs etcd-server)")
}

fn won(o: Outcome) -> tandem_fence::Holder {
    match o {
        Outcome::Won(h) => h,
        Outcome::Held(by) => panic!("held by {by}"),
    }
}

#[test]
fn one_holder_replica_record_and_guarded_takeover() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path());
    let cfg = |node: &str| FenceConfig::new(c.endpoints(), 7, node);
    let primary = won(campaign(&cfg("primary"), Claim::Fresh).unwrap());
    assert!(primary.valid());
    // The right runs from when the grant was asked for, so the round trips since have used
    // some of it.
    let left = primary.remaining();
    assert!(
        left > Duration::ZERO && left <= cfg("primary").right(),
        "{left:?}"
    );
    // A second fresh boot is refused while the key is held.
    match campaign(&cfg("other"), Claim::Fresh).unwrap() {
        Outcome::Held(by) => assert_eq!(by, "primary"),
        Outcome::Won(_) => panic!("two holders"),
    }
    primary.record(Replica::Session(0xabc)).unwrap();
    assert_eq!(primary.recorded(), Some(Replica::Session(0xabc)));
    // The backup may not take over while the primary holds the key...
    assert!(matches!(
        campaign(&cfg("backup"), Claim::Takeover(0xabc)).unwrap(),
        Outcome::Held(_)
    ));
    // ... nor may a fresh guest be booted over a recorded replica once the key is free.
    primary.resign().unwrap();
    assert!(!primary.valid());
    let e = campaign(&cfg("again"), Claim::Fresh).err().unwrap();
    assert!(matches!(e, FenceError::ReplicaExists { .. }), "{e}");
    // A backup of another session is not eligible; the right one wins and records `none`.
    let e = campaign(&cfg("stale"), Claim::Takeover(0x999))
        .err()
        .unwrap();
    assert!(matches!(e, FenceError::NotEligible { .. }), "{e}");
    let backup = won(campaign(&cfg("backup"), Claim::Takeover(0xabc)).unwrap());
    assert_eq!(backup.recorded(), Some(Replica::None));
    // The old primary cannot record anything any more.
    assert!(primary.record(Replica::None).is_err());
    assert!(backup.valid());
}

#[test]
fn losing_quorum_closes_the_gate_and_quorum_back_reopens_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cluster(dir.path());
    let cfg = FenceConfig::new(c.endpoints(), 9, "primary");
    let h = won(campaign(&cfg, Claim::Fresh).unwrap());
    // One member down: the holder keeps renewing.
    c.kill(0);
    std::thread::sleep(cfg.ttl + Duration::from_millis(500));
    assert!(h.valid(), "one member down must not stop the holder");
    // Quorum lost: the gate closes no later than right() after the last renewal.
    let t = Instant::now();
    c.kill(1);
    while h.valid() {
        assert!(
            t.elapsed() < cfg.right() + cfg.keepalive_every() + Duration::from_millis(500),
            "gate still open {:?} after quorum was lost",
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Quorum back: the new leader refreshes leases, the holder renews and the gate reopens.
    c.restart(0).unwrap();
    c.restart(1).unwrap();
    let t = Instant::now();
    while !h.valid() {
        assert!(
            !h.expired(),
            "lease expired although etcd refreshes leases at election"
        );
        assert!(t.elapsed() < Duration::from_secs(15), "gate did not reopen");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_unreachable_cluster_is_named() {
    let cfg = FenceConfig::new(vec![format!("http://127.0.0.1:{}", free_port())], 1, "p");
    let e = campaign(&cfg, Claim::Fresh).err().unwrap();
    let msg = e.to_string();
    assert!(msg.contains("no etcd endpoint answered"), "{msg}");
    let e = FenceConfig::new(vec![], 1, "p");
    assert!(campaign(&e, Claim::Fresh)
        .err()
        .unwrap()
        .to_string()
        .contains("--etcd"));
}

#[test]
fn a_holder_takes_its_key_back_only_if_nobody_ran_the_vm_since() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path());
    let cfg = |node: &str| FenceConfig::new(c.endpoints(), 3, node);
    let a = won(campaign(&cfg("a"), Claim::Fresh).unwrap());
    a.record(Replica::Session(1)).unwrap();
    let claim = a.reacquire_claim().unwrap();
    a.resign().unwrap();
    // Nobody took over: the same record is still there, the key comes back.
    let a2 = won(campaign(&cfg("a"), claim).unwrap());
    assert_eq!(a2.recorded(), Some(Replica::Session(1)));
    let claim2 = a2.reacquire_claim().unwrap();
    a2.resign().unwrap();
    // The backup of session 1 takes over (and later loses its lease) ...
    let b = won(campaign(&cfg("b"), Claim::Takeover(1)).unwrap());
    b.resign().unwrap();
    // ... so the old holder's claim must not revive its stale copy.
    let e = campaign(&cfg("a"), claim2).err().unwrap();
    assert!(matches!(e, FenceError::Lost(3)), "{e}");
}

#[test]
fn etcd_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let tls = tandem_fence::cluster::ClusterTls::generate(&dir.path().join("keys"), &[]).unwrap();
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
    // A holder over TLS: campaign, keepalives keep it valid, records, resign.
    let h = won(campaign(&cfg, Claim::Fresh).unwrap());
    // Longer than the lease's TTL: only renewals keep it valid.
    std::thread::sleep(cfg.ttl + Duration::from_millis(500));
    assert!(h.valid(), "keepalives over TLS");
    h.record(Replica::None).unwrap();
    h.resign().unwrap();
    // Without a client certificate the cluster refuses (client-cert-auth), named as such.
    let mut no_cert = cfg.clone();
    no_cert.tls = Some(tandem_fence::EtcdTls {
        cert: None,
        key: None,
        ..tls.client.clone()
    });
    let e = campaign(&no_cert, Claim::Fresh).err().expect("refused");
    assert!(matches!(e, FenceError::Etcd(_)), "{e}");
    // Without TLS at all the https endpoint does not answer.
    let mut plain = cfg.clone();
    plain.tls = None;
    assert!(campaign(&plain, Claim::Fresh).is_err());
    // Unreadable material is named.
    let mut missing = cfg.clone();
    missing.tls = Some(tandem_fence::EtcdTls {
        ca: dir.path().join("nope.pem"),
        cert: None,
        key: None,
    });
    let e = campaign(&missing, Claim::Fresh).err().unwrap();
    assert!(
        format!("{e:#}").contains("nope.pem") || format!("{:?}", e).contains("nope.pem"),
        "{e:?}"
    );
}
