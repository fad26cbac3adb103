//! `tandem backup` + `tandem primary` as real processes: the primary replicates a kv guest
//! whose NIC sits on a bridge in a network namespace (relay + tap), then it and its QEMU are
//! SIGKILLed as a host failure would; the backup must resume the guest on its standby QEMU from
//! the last committed epoch, and redis must answer there over the same bridge.

mod common;

use std::sync::mpsc::Receiver;
use std::time::Duration;

use common::{spawn, wait_event, wait_line};

/// Starts `tandem backup` for the VM described in `vm` on a free port with its mirror in a fresh /dev/shm
/// directory, and waits until it listens. Returns the child, its output, address and directory.
fn start_backup(
    vm: &str,
    timeout_ms: u64,
    extra: &[&str],
) -> (common::Proc, Receiver<String>, String, tempfile::TempDir) {
    let port = tandem_test_support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let timeout = timeout_ms.to_string();
    let mut args = vec![
        "backup",
        "--listen",
        &addr,
        "--dir",
        dir.path().to_str().unwrap(),
        "--vm-config",
        vm,
        "--timeout-ms",
        &timeout,
        "--json-events",
    ];
    args.extend_from_slice(extra);
    let (backup, brx) = spawn(&args);
    wait_event(&brx, "listening", Duration::from_secs(60), |_| true);
    (backup, brx, addr, dir)
}

#[test]
fn primary_killed_backup_resumes_the_guest() {
    // Detection time is not what this test checks: a long timeout avoids spurious failover under load.
    let lab =
        tandem_harness::netlab::NetLab::create(&format!("tf{}", std::process::id() % 100_000), 0)
            .expect("network lab (this test needs root)");
    let run = tempfile::tempdir().unwrap();
    let (bsock, psock) = (run.path().join("b.sock"), run.path().join("p.sock"));
    let vm = common::lab_vm("kv", 32);
    let (mut backup, brx, addr, dir) = start_backup(
        &vm,
        2000,
        &[
            "--tap-netns",
            &lab.clients,
            "--control",
            bsock.to_str().unwrap(),
        ],
    );
    let jsonl = dir.path().join("epochs.jsonl");
    let (mut primary, prx) = spawn(&[
        "primary",
        // The encoder with a worker pool (epochs of 1 024 pages or more use it).
        "--encoder-threads",
        "2",
        "--metrics-jsonl",
        jsonl.to_str().unwrap(),
        "--metrics-listen",
        "127.0.0.1:0",
        "--backup",
        &addr,
        "--vm-config",
        &vm,
        "--tap-netns",
        &lab.clients,
        "--control",
        psock.to_str().unwrap(),
        "--json-events",
    ]);
    // The metrics endpoint is served from the start, before the guest boots.
    let metrics = wait_line(&prx, "metrics on http://", Duration::from_secs(30));
    let metrics = serde_json::from_str::<serde_json::Value>(&metrics)
        .ok()
        .and_then(|v| v["text"].as_str().map(String::from))
        .unwrap_or(metrics);
    let ready = wait_event(&prx, "guest_running", Duration::from_secs(180), |_| true);
    let qemu = ready["qemu_pid"].as_u64().unwrap();
    let metrics_addr = metrics
        .split("http://")
        .nth(1)
        .unwrap()
        .trim_end_matches("/metrics")
        .to_string();
    // A client on the clients' bridge writes a key; its reply was released after an ack.
    let ns = lab.clients.clone();
    let connect = move || common::guest_redis(&ns, Duration::from_secs(30));
    let mut kv = connect();
    kv.set(b"before-failover", b"acked").unwrap();
    // Let some epochs commit.
    wait_event(&prx, "acked", Duration::from_secs(60), |v| {
        v["epoch"].as_u64() >= Some(10)
    });
    // Metrics: Prometheus text on the endpoint, one JSON line per acknowledged epoch.
    let mut c = std::net::TcpStream::connect(&metrics_addr).unwrap();
    std::io::Write::write_all(&mut c, b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut c, &mut text).unwrap();
    let sample = |prefix: &str, suffix: &str| {
        text.lines()
            .any(|l| l.starts_with(prefix) && l.contains(suffix))
    };
    // Every sample names the VM (--vm-id, 1 by default) and the node (the host name without
    // --node).
    assert!(
        sample(
            "tandem_pause_seconds_bucket{vm=\"1\",node=\"",
            ",le=\"+Inf\"}"
        ) && sample("tandem_acked_epoch{vm=\"1\",node=\"", "} ")
            && sample("process_resident_memory_bytes{vm=\"1\"", "} "),
        "{text}"
    );
    // Prometheus' own linter accepts the live endpoint's page.
    let body = text.split_once("\r\n\r\n").expect("HTTP response").1;
    tandem_test_support::promtool_check_metrics(body);
    let lines = std::fs::read_to_string(&jsonl).unwrap();
    let first: serde_json::Value =
        serde_json::from_str(lines.lines().next().expect("no JSON lines")).unwrap();
    for k in [
        "pause_us",
        "harvest_us",
        "devstate_us",
        "dirty_pages",
        "raw_bytes",
        "sent_bytes",
        "encode_us",
        "transfer_us",
        "ack_latency_us",
        "held_frames",
        "held_bytes",
        "released_frames",
        "disk_writes",
        "disk_bytes",
        "lost_cpu_us",
        "stopped_us",
    ] {
        assert!(
            first.get(k).is_some_and(|v| v.is_number()),
            "{k} missing in {first}"
        );
    }
    // The adaptive schedule (the default) read the real QEMU's vCPU threads: each epoch says
    // how busy the guest was, and what its pause cost is that share of it.
    let epochs: Vec<serde_json::Value> = lines
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let busy: Vec<(f64, u64, u64)> = epochs
        .iter()
        .filter_map(|v| {
            Some((
                v.get("busy_pct")?.as_f64()?,
                v.get("lost_cpu_us")?.as_u64()?,
                v.get("pause_us")?.as_u64()? + v.get("suspended_us")?.as_u64()?,
            ))
        })
        .collect();
    assert!(
        busy.len() * 2 >= lines.lines().count(),
        "most epochs measured the guest's vCPU time: {} of {}",
        busy.len(),
        lines.lines().count()
    );
    for &(pct, lost, paused) in &busy {
        assert!((0.0..=100.0).contains(&pct), "busy {pct} %");
        assert!(lost <= paused, "charged {lost} µs for {paused} µs paused");
    }
    // QEMU's STOP and RESUME events timed most pauses: the guest was stopped for part of
    // each, never longer than the pause.
    let stopped: Vec<(u64, u64)> = epochs
        .iter()
        .filter_map(|v| Some((v.get("stopped_us")?.as_u64()?, v.get("pause_us")?.as_u64()?)))
        .collect();
    let timed = stopped.iter().filter(|&&(s, _)| s > 0).count();
    assert!(
        timed * 2 >= stopped.len(),
        "QEMU's events timed {timed} of {} pauses",
        stopped.len()
    );
    // (QEMU stamps events with the wall clock, the pause is timed on the monotonic one: a
    // millisecond allows for the wall clock being slewed meanwhile.)
    for &(s, pause) in &stopped {
        assert!(s <= pause + 1000, "stopped {s} µs in a pause of {pause} µs");
    }
    assert!(
        sample("tandem_role{vm=\"1\",", ",role=\"primary\"} 1"),
        "{text}"
    );
    // `tandem status`: every daemon's control socket in the run directory.
    let st = status(run.path());
    assert_eq!(st.len(), 2, "{st:#?}");
    let (b, p) = (&st[0], &st[1]);
    assert_eq!(
        (b["role"].as_str(), p["role"].as_str()),
        (Some("backup"), Some("primary"))
    );
    assert_eq!(p["state"], "protected", "{p:#}");
    assert_eq!(p["link"], "up", "{p:#}");
    assert!(p["committed_epoch"].as_u64().unwrap() >= 10, "{p:#}");
    // The level the last epoch was encoded at (chosen per epoch), on the primary only.
    let level = p["zstd_level"]
        .as_i64()
        .expect("primary reports its zstd level");
    assert!((-7..=19).contains(&level), "{p:#}");
    assert!(b["zstd_level"].is_null(), "{b:#}");
    // The trial's choice and how busy the guest was, on the primary only.
    assert!(p["long_patches"].is_boolean(), "{p:#}");
    assert!(b["long_patches"].is_null(), "{b:#}");
    assert!(p["word_deltas"].is_boolean(), "{p:#}");
    assert!(b["word_deltas"].is_null(), "{b:#}");
    assert!(p["prefix_off"].is_boolean(), "{p:#}");
    assert!(b["prefix_off"].is_null(), "{b:#}");
    assert!(
        p["guest_busy_pct"]
            .as_f64()
            .is_some_and(|v| (0.0..=100.0).contains(&v)),
        "{p:#}"
    );
    // Why the epochs ended: the session's first at once, every later one for a reason.
    let cuts = p["epochs_cut"]
        .as_object()
        .expect("primary counts its epochs' cuts");
    assert_eq!(cuts.get("start").and_then(|n| n.as_u64()), Some(1), "{p:#}");
    assert!(
        cuts.values().filter_map(|n| n.as_u64()).sum::<u64>() >= 10,
        "{p:#}"
    );
    assert!(b["epochs_cut"].is_null(), "{b:#}");
    assert!(sample("tandem_zstd_level{", "} "), "{text}");
    assert!(
        sample("tandem_epochs_cut_total{", "reason=\"start\"} 1"),
        "{text}"
    );
    assert!(
        b["state"].as_str().unwrap().starts_with("protecting"),
        "{b:#}"
    );
    assert!(b["committed_epoch"].as_u64().unwrap() >= 10, "{b:#}");
    // Host failure: the primary's tandem process and its QEMU die at once.
    primary.kill().unwrap();
    // SAFETY: plain kill(2) of a process id we read from the primary's output.
    unsafe { libc::kill(qemu as i32, libc::SIGKILL) };
    primary.wait().unwrap();
    let failed = wait_event(&brx, "failed_over", Duration::from_secs(30), |_| true);
    let epoch = failed["epoch"].as_u64().unwrap();
    assert!(epoch >= 10, "resumed from epoch {epoch}");
    // The same TCP connection carries on against the resumed guest.
    assert_eq!(
        kv.get(b"before-failover").unwrap().as_deref(),
        Some(&b"acked"[..])
    );
    kv.set(b"after-failover", b"ok").unwrap();
    assert_eq!(
        kv.get(b"after-failover").unwrap().as_deref(),
        Some(&b"ok"[..])
    );
    // The dead primary's socket is cleaned up; the backup tells what happened.
    let st = status(run.path());
    assert_eq!(st.len(), 1, "{st:#?}");
    assert_eq!(st[0]["failovers"], 1, "{:#}", st[0]);
    assert_eq!(st[0]["last_failover"]["epoch"], epoch, "{:#}", st[0]);
    assert!(st[0]["state"]
        .as_str()
        .unwrap()
        .starts_with("running the guest"));
    assert!(!psock.exists());
    // SAFETY: SIGTERM to our own child asks it to shut its standby QEMU down.
    unsafe { libc::kill(backup.id() as i32, libc::SIGTERM) };
    let st = backup.wait().unwrap();
    assert!(st.success(), "backup exited with {st}");
    assert!(!bsock.exists(), "the backup removes its control socket");
}

/// `tandem status --json` over the control sockets in `run`.
fn status(run: &std::path::Path) -> Vec<serde_json::Value> {
    common::status_json(&[], Some(run))
}
