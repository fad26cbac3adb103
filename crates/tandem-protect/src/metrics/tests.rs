//! Tests of the histograms, the exposition and the endpoint's bounds.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::http::{CLIENT_TIMEOUT, MAX_CLIENTS};
use super::*;

#[test]
fn histogram_buckets_and_quantile_estimates() {
    let mut h = Histogram::new(PAUSE_BUCKETS);
    assert_eq!(h.quantile(0.5), 0.0, "empty");
    for _ in 0..50 {
        h.observe(0.0015); // bucket (1 ms, 2 ms]
    }
    for _ in 0..50 {
        h.observe(0.004); // bucket (3 ms, 5 ms]
    }
    h.observe(f64::NAN);
    h.observe(f64::INFINITY);
    let b: Vec<(f64, u64)> = h.buckets().collect();
    assert_eq!(b.len(), PAUSE_BUCKETS.len() + 1);
    assert_eq!(b[0], (0.0005, 0));
    assert_eq!(b[1], (0.001, 0));
    assert_eq!(b[2], (0.002, 50));
    assert_eq!(b[3], (0.003, 50));
    assert_eq!(b[4], (0.005, 100));
    assert_eq!(b.last(), Some(&(f64::INFINITY, 100)));
    assert_eq!(h.count(), 100);
    assert!((h.sum() - 0.275).abs() < 1e-9);
    // Linear interpolation inside the bucket holding the rank.
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(close(h.quantile(0.25), 0.0015), "{}", h.quantile(0.25));
    assert!(close(h.quantile(0.5), 0.002), "{}", h.quantile(0.5));
    assert!(close(h.quantile(0.75), 0.004), "{}", h.quantile(0.75));
    // Never outside what was observed.
    assert!(close(h.quantile(0.0), 0.0015));
    assert!(close(h.quantile(0.99), 0.004));
    assert!(close(h.quantile(7.0), 0.004) && close(h.quantile(f64::NAN), 0.002));
    // Beyond the last bound: interpolated up to the largest observation.
    let mut h = Histogram::new(ACK_BUCKETS);
    h.observe(0.0001);
    h.observe(50.0);
    assert_eq!(h.buckets().next(), Some((0.001, 1)));
    assert_eq!(h.buckets().nth(ACK_BUCKETS.len() - 1), Some((30.0, 1)));
    assert!(close(h.quantile(1.0), 50.0) && close(h.quantile(0.75), 40.0));
    // Exact on a bound: `le` is inclusive.
    let mut h = Histogram::new(ACK_BUCKETS);
    h.observe(0.001);
    assert_eq!(h.buckets().next(), Some((0.001, 1)));
}

/// The exposition without the `vm` and `node` labels every sample carries.
fn unlabelled(text: &str) -> String {
    let base = process::identity_labels(0, None);
    text.replace(&format!("{{{base},"), "{")
        .replace(&format!("{{{base}}}"), "")
}

fn registry() -> Registry {
    let r = Registry::default();
    r.sent(&EpochMetrics {
        epoch: 1,
        pause_us: 7000,
        pause: tandem_types::PauseTiming {
            stop_us: 500,
            stopped_us: 400,
            ..Default::default()
        },
        dirty_pages: 10,
        raw_bytes: 40960,
        sent_bytes: 900,
        level: -3,
        held_frames: 3,
        held_bytes: 180,
        cut: tandem_vm::schedule::Reason::Output,
        ran_us: 4200,
        waited: Some(tandem_vm::schedule::Wait::Budget),
        prefix_off: true,
        ..Default::default()
    });
    r.acked(1, 1500, 0);
    r
}

#[test]
fn renders_prometheus_text_with_histograms_and_daemon_state() {
    let r = registry();
    let p = r.pause_histogram();
    assert!((p.quantile(0.5) - 0.007).abs() < 1e-9 && p.count() == 1);
    assert_eq!(r.ack_latency_histogram().count(), 1);
    r.set_link_up(true);
    r.set_protected(true);
    r.set_backup_can_failover(true);
    r.set_held(4, 240);
    r.inc_reconnects();
    r.inc_reconnects();
    r.inc_resyncs();
    r.set_dropped_frames(9);
    let text = unlabelled(&r.render());
    for want in [
        "tandem_epochs_total 1\n",
        "tandem_acked_epoch 1\n",
        "# TYPE tandem_pause_seconds histogram\n",
        "tandem_pause_seconds_bucket{le=\"0.005\"} 0\n",
        "tandem_pause_seconds_bucket{le=\"0.0075\"} 1\n",
        "tandem_pause_seconds_bucket{le=\"+Inf\"} 1\n",
        "tandem_pause_seconds_sum 0.007\n",
        "tandem_pause_seconds_count 1\n",
        "tandem_ack_latency_seconds_bucket{le=\"0.002\"} 1\n",
        "tandem_ack_latency_seconds_count 1\n",
        "tandem_link_up 1\n",
        "tandem_protected 1\n",
        "tandem_backup_can_failover 1\n",
        "tandem_held_frames 4\n",
        "tandem_held_bytes 240\n",
        "tandem_zstd_level -3\n",
        "tandem_reconnects_total 2\n",
        "tandem_resyncs_total 1\n",
        "tandem_hold_dropped_frames_total 9\n",
        "tandem_raw_bytes_total 40960\n",
        "tandem_last_pause_component_seconds{component=\"stop\"} 0.0005\n",
        "tandem_last_guest_stopped_seconds 0.0004\n",
        "tandem_epochs_cut_total{reason=\"output\"} 1\n",
        "tandem_epochs_cut_total{reason=\"time\"} 0\n",
        "tandem_output_held_epochs_total{rule=\"budget\"} 1\n",
        "tandem_output_held_epochs_total{rule=\"busy\"} 0\n",
        "tandem_prefix_off_epochs_total 1\n",
        "tandem_word_delta_epochs_total 0\n",
    ] {
        assert!(text.contains(want), "{want:?} missing in\n{text}");
    }
    let mut last_bucket = 0.0;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            match kind {
                "counter" => assert!(name.ends_with("_total"), "{line}"),
                "gauge" | "histogram" => assert!(!name.ends_with("_total"), "{line}"),
                _ => panic!("{line}"),
            }
            last_bucket = 0.0;
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (name, value) = line.rsplit_once(' ').unwrap();
        assert!(
            name.starts_with("tandem_") || name.starts_with("process_"),
            "{line}"
        );
        let v: f64 = value.parse().unwrap();
        if name.contains("_bucket{") {
            assert!(v >= last_bucket, "buckets are cumulative: {line}");
            last_bucket = v;
        }
    }
}

fn scrape(addr: SocketAddr) -> String {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut resp = String::new();
    c.read_to_string(&mut resp).unwrap();
    resp
}

fn is_scrape(resp: &str) -> bool {
    resp.starts_with("HTTP/1.0 200 OK\r\n")
        && resp.contains("\r\nContent-Type: text/plain; version=0.0.4\r\n")
        && unlabelled(resp).contains("\ntandem_acked_epoch 1\n")
}

#[test]
fn slow_and_silent_clients_do_not_block_a_scrape() {
    let addr = serve("127.0.0.1:0", registry()).unwrap();
    let t = Instant::now();
    let mut silent = TcpStream::connect(addr).unwrap();
    // A client dripping its request a byte at a time, never finishing it.
    let drip = std::thread::spawn(move || {
        let mut c = TcpStream::connect(addr).unwrap();
        for b in b"GET /metrics HTTP/1.0\r\n".iter().cycle() {
            if c.write_all(&[*b]).is_err() || t.elapsed() > Duration::from_secs(10) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        t.elapsed()
    });
    std::thread::sleep(Duration::from_millis(100));
    let resp = scrape(addr);
    assert!(is_scrape(&resp), "{resp}");
    assert!(t.elapsed() < CLIENT_TIMEOUT, "{:?}", t.elapsed());
    // 404 for other paths, still HTTP/1.0.
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut r = String::new();
    c.read_to_string(&mut r).unwrap();
    assert!(r.starts_with("HTTP/1.0 404"), "{r}");
    // Both slow clients are cut off at the timeout.
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 64];
    assert_eq!(silent.read(&mut buf).unwrap_or(0), 0);
    let waited = t.elapsed();
    assert!(
        waited >= CLIENT_TIMEOUT && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    let dripped = drip.join().unwrap();
    assert!(dripped < Duration::from_secs(6), "{dripped:?}");
}

#[test]
fn nine_silent_clients_do_not_stop_the_endpoint() {
    let addr = serve("127.0.0.1:0", registry()).unwrap();
    let t = Instant::now();
    let mut silent: Vec<TcpStream> = (0..MAX_CLIENTS + 1)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    // The ninth is refused at once, without waiting for its request.
    let ninth = silent.last_mut().unwrap();
    ninth
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let mut resp = Vec::new();
    let _ = ninth.read_to_end(&mut resp);
    assert!(
        resp.is_empty() || resp.starts_with(b"HTTP/1.0 503"),
        "{}",
        String::from_utf8_lossy(&resp)
    );
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // Once the silent ones time out, scrapes are served again.
    let resp = loop {
        let r = scrape(addr);
        if is_scrape(&r) {
            break r;
        }
        assert!(r.is_empty() || r.starts_with("HTTP/1.0 503"), "{r}");
        assert!(t.elapsed() < Duration::from_secs(6), "endpoint stuck");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(is_scrape(&resp));
    // Many scrapes in a row: slots are given back.
    for _ in 0..3 * MAX_CLIENTS {
        assert!(is_scrape(&scrape(addr)));
    }
    drop(silent);
}

/// A daemon's registry with every family it can render (but the ownership ones, which need a
/// fenced daemon: [`OWNER_ONLY`]).
fn daemon_registry() -> Registry {
    let r = registry();
    r.set_identity("backup", 7, Some("host-a".into()));
    r.set_memory(Some(tandem_consolidate::Usage {
        pages: 4,
        plain: 1,
        zero: 1,
        shared: 1,
        patched: 1,
        ..Default::default()
    }));
    r
}

/// Families rendered only by a daemon that runs with fencing.
const OWNER_ONLY: &[&str] = &["tandem_owner_generation", "tandem_fenced"];

fn family_names(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap().to_string())
        .collect()
}

#[test]
fn every_sample_names_its_vm_and_node_and_the_process() {
    let text = daemon_registry().render();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            line.contains("{vm=\"7\",node=\"host-a\""),
            "unlabelled sample: {line}"
        );
    }
    for want in [
        "tandem_info{vm=\"7\",node=\"host-a\",version=\"",
        "tandem_epochs_total{vm=\"7\",node=\"host-a\"} 1\n",
        "tandem_pause_seconds_bucket{vm=\"7\",node=\"host-a\",le=\"+Inf\"} 1\n",
        "tandem_replica_pages{vm=\"7\",node=\"host-a\",kind=\"zero\"} 1\n",
        "process_resident_memory_bytes{vm=\"7\",node=\"host-a\"} ",
        "process_cpu_seconds_total{vm=\"7\",node=\"host-a\"} ",
    ] {
        assert!(text.contains(want), "{want:?} missing in\n{text}");
    }
}

/// `promtool check metrics` (Prometheus' own linter, Debian's `prometheus` package, which
/// `tandem-lab setup` installs) accepts the exposition.
#[test]
fn promtool_accepts_the_exposition() {
    tandem_test_support::promtool_check_metrics(&daemon_registry().render());
}

/// The dashboard and the alert rules in dist/ name only metrics a daemon exports.
#[test]
fn dashboard_and_rules_name_only_exported_metrics() {
    let mut exported = family_names(&daemon_registry().render());
    exported.extend(OWNER_ONLY.iter().map(|s| s.to_string()));
    let dist = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dist");
    for file in ["grafana/tandem.json", "prometheus/tandem.rules.yml"] {
        let text = std::fs::read_to_string(dist.join(file)).unwrap();
        let mut used = std::collections::BTreeSet::new();
        let bytes = text.as_bytes();
        for (i, _) in text
            .match_indices("tandem_")
            .chain(text.match_indices("process_"))
        {
            if i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_') {
                continue;
            }
            let end = text[i..]
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .map_or(text.len(), |e| i + e);
            used.insert(text[i..end].to_string());
        }
        assert!(used.len() > 5, "{file}: {used:?}");
        for name in used {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|f| exported.contains(*f))
                .unwrap_or(&name);
            assert!(
                exported.contains(family),
                "{file} names {name}, which no daemon exports ({exported:?})"
            );
        }
    }
}

/// The alert rules load (`promtool check rules`) and fire as their unit tests say
/// (`promtool test rules`, dist/prometheus/tandem.rules.test.yml).
#[test]
fn alert_rules_load_and_pass_their_unit_tests() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dist/prometheus");
    for args in [
        ["check", "rules", "tandem.rules.yml"],
        ["test", "rules", "tandem.rules.test.yml"],
    ] {
        let o = std::process::Command::new("promtool")
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("promtool (Debian package prometheus) is missing: run `tandem-lab setup`");
        assert!(
            o.status.success(),
            "promtool {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
fn json_lines_name_the_reason_and_the_rule() {
    let mut m = EpochMetrics {
        cut: tandem_vm::schedule::Reason::Output,
        waited: Some(tandem_vm::schedule::Wait::Busy),
        ..Default::default()
    };
    let v = serde_json::to_value(&m).unwrap();
    assert_eq!(
        (v["cut"].as_str(), v["waited"].as_str()),
        (Some("output"), Some("busy"))
    );
    m.waited = None;
    assert!(serde_json::to_value(&m).unwrap()["waited"].is_null());
}
