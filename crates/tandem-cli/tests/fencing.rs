//! Fencing with a real 3-member etcd cluster (issue 11, docs/FENCING.md), in the namespace
//! lab with a replicated `kv` guest (`tandem demo --etcd`): the partitions that decide which
//! copy may run, each run in two rounds. Every round also passes the common checks (every
//! acknowledged write reads back, never two copies releasing output — packet capture on the
//! primary's tap — exactly one copy left, nothing left behind) and ends with a host kill whose
//! failover waits for the primary's lease.

mod common;

use common::{demo_rounds, outcomes};

fn lease_wait(r: &serde_json::Value) -> f64 {
    r["lease_wait_ms"].as_f64().unwrap()
}

#[test]
fn replication_link_cut_while_both_reach_etcd_keeps_the_primary() {
    for r in demo_rounds("partition:4000", &["--etcd", "--rounds", "2"]) {
        // The backup sees the primary's key held and does not take over; the primary records
        // that it runs without a replica, goes on, and re-syncs once the link is back.
        assert_eq!(
            outcomes(&r),
            vec![
                "partition:4000: replication carried on",
                "host-kill: failover"
            ],
            "{r:#}"
        );
        assert!(r["resyncs"].as_u64().unwrap() >= 1, "{r:#}");
        let w = lease_wait(&r);
        assert!(w > 0.0 && w < 4500.0, "lease wait {w} ms: {r:#}");
    }
}

#[test]
fn primary_cut_from_backup_and_etcd_is_replaced_after_its_lease() {
    for r in demo_rounds("isolate:6000", &["--rounds", "2"]) {
        assert_eq!(outcomes(&r), vec!["isolate:6000: failover"], "{r:#}");
        // The backup waited for the lease (TTL 3 s) and did not resume before it expired.
        let w = lease_wait(&r);
        assert!(w > 0.0 && w < 4500.0, "lease wait {w} ms: {r:#}");
    }
}

#[test]
fn backup_cut_from_etcd_one_member_down_and_quorum_lost_then_back() {
    let rounds = demo_rounds(
        "backup-etcd-cut:2000,etcd-member-kill,etcd-quorum-loss:3000",
        &["--rounds", "1"],
    );
    let o = outcomes(&rounds[0]);
    assert_eq!(
        o,
        vec![
            "backup-etcd-cut:2000: replication carried on",
            "etcd-member-kill: replication carried on",
            "etcd-quorum-loss:3000: replication carried on",
            "host-kill: failover",
        ],
        "{:#}",
        rounds[0]
    );
}

#[test]
fn a_primary_whose_qemu_died_gives_its_key_up_at_once() {
    let r = demo_rounds("qemu-kill", &["--etcd"]).remove(0);
    assert_eq!(outcomes(&r), vec!["qemu-kill: failover"], "{r:#}");
    // No wait for the lease: the primary revoked it when its QEMU was gone.
    let w = lease_wait(&r);
    assert!(w < 1000.0, "lease wait {w} ms: {r:#}");
}
