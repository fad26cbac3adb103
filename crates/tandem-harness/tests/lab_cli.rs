//! The lab binary `tandem-lab` from the outside: bad arguments, traces recorded from a real
//! guest and inspected, corrupt traces named.

use std::process::{Command, Output};

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem-lab"))
        .args(args)
        .output()
        .expect("run tandem-lab")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn bad_arguments_are_usage_errors() {
    let o = tandem(&["record", "--epoch-ms", "abc", "-o", "x"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = tandem(&["record", "--workload", "nope", "-o", "/tmp/x.trace"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("unknown workload"), "{}", text(&o));
}

#[test]
fn a_pgbench_trace_without_the_debian_vm_says_how_to_build_it() {
    let cache = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_tandem-lab"))
        .args(["traces", "--workloads", "pgbench"])
        .env("TANDEM_CACHE", cache.path())
        .output()
        .expect("run tandem");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("tandem setup --debian"), "{}", text(&o));
    let o = tandem(&["traces", "--workloads", "nope"]);
    assert!(text(&o).contains("unknown workload"), "{}", text(&o));
}

#[test]
fn corrupt_traces_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.trace");
    std::fs::write(&garbage, b"this is not a trace at all").unwrap();
    let o = tandem(&["trace", "info", garbage.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("not a tandem trace"), "{}", text(&o));
    assert!(!text(&o).contains("panicked"));
}

/// Records a real memtouch guest, checks `trace info --json`, then truncates and corrupts it.
#[test]
fn record_and_inspect_a_real_trace() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("memtouch.trace");
    let o = tandem(&[
        "record",
        "--workload",
        "memtouch",
        "--duration",
        "3",
        "--epoch-ms",
        "100",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = tandem(&["trace", "info", "--json", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let epochs = v["epochs"].as_u64().unwrap();
    assert!(
        (15..=35).contains(&epochs),
        "{epochs} epochs in 3 s of 100 ms"
    );
    assert_eq!(v["guest_memory_bytes"].as_u64(), Some(256 << 20));
    let per: u64 = v["per_epoch"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["dirty_pages"].as_u64().unwrap())
        .sum();
    assert_eq!(per, v["dirty_pages"].as_u64().unwrap());
    // memtouch writes 256 pages every 20 ms: about 1280 pages per 100 ms epoch.
    assert!(
        per / epochs > 500,
        "memtouch dirtied only {} pages per epoch",
        per / epochs
    );

    let bytes = std::fs::read(&out).unwrap();
    let cut = dir.path().join("cut.trace");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let o = tandem(&["trace", "info", cut.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("truncated trace") && text(&o).contains("offset"),
        "{}",
        text(&o)
    );

    let mut flipped = bytes.clone();
    let n = flipped.len();
    flipped[n / 2] ^= 0xff;
    let bad = dir.path().join("flipped.trace");
    std::fs::write(&bad, &flipped).unwrap();
    let o = tandem(&["trace", "info", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("offset"), "{}", text(&o));
}
