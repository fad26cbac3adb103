//! Integration tests that run the real `tandem` binary (and, for some, real QEMU guests).

use std::process::{Command, Output};

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .output()
        .expect("run tandem")
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
    let o = tandem(&[
        "primary",
        "--backup",
        "127.0.0.1:1",
        "--encoder-threads",
        "0",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--encoder-threads"), "{}", text(&o));
}

#[test]
fn a_pgbench_trace_without_the_debian_vm_says_how_to_build_it() {
    let cache = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_tandem"))
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

#[test]
fn doctor_passes_here() {
    let o = tandem(&["doctor", "--json"]);
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|_| panic!("{}", text(&o)));
    assert!(o.status.success() && v["ok"] == true, "{}", text(&o));
    let selftest = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "self-test")
        .unwrap();
    assert_eq!(selftest["status"], "ok", "{selftest}");
}

#[test]
fn doctor_fails_clearly_without_prerequisites() {
    let o = tandem(&[
        "doctor",
        "--json",
        "--no-selftest",
        "--qemu",
        "/nonexistent/qemu-system-x86_64",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let q = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "qemu")
        .unwrap();
    assert_eq!(q["status"], "fail");
    assert!(q["fix"].as_str().unwrap().contains("tandem setup"));

    let empty = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["doctor", "--no-selftest"])
        .env("TANDEM_CACHE", empty.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("guest image") && text(&o).contains("run `tandem setup`"),
        "{}",
        text(&o)
    );
}

#[test]
fn vm_description_files_are_checked() {
    let d = tempfile::tempdir().unwrap();
    let bad = d.path().join("bad.toml");
    std::fs::write(&bad, "workload = \"kv\"\nmemory = 256\n").unwrap();
    let o = tandem(&[
        "checkpoint",
        "save",
        "--dir",
        d.path().join("s").to_str().unwrap(),
        "--vm-config",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let t = text(&o);
    assert!(t.contains("bad.toml") && t.contains("memory"), "{t}");
    // A valid file is applied: its workload name is checked like the flag's.
    let wrong = d.path().join("wrong.toml");
    std::fs::write(&wrong, "workload = \"nope\"\nmem = 128\n").unwrap();
    let o = tandem(&[
        "checkpoint",
        "save",
        "--dir",
        d.path().join("s2").to_str().unwrap(),
        "--vm-config",
        wrong.to_str().unwrap(),
    ]);
    assert!(text(&o).contains("unknown workload"), "{}", text(&o));
}

#[test]
fn stores_that_are_not_stores_are_named() {
    let d = tempfile::tempdir().unwrap();
    let o = tandem(&["checkpoint", "list", d.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("not a usable checkpoint store"),
        "{}",
        text(&o)
    );
}

#[test]
fn vm_descriptions_import_show_and_refuse() {
    let fixtures = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tandem-protect/tests/fixtures"
    );
    let o = tandem(&["vm", "import", &format!("{fixtures}/web-virt-install.xml")]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("vcpus = 2") && out.contains("[[disk]]"),
        "{out}"
    );
    assert!(
        text(&o).contains("not mapped: devices/graphics[vnc]"),
        "{}",
        text(&o)
    );
    let o = tandem(&["vm", "import", "/etc/hostname"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("XML") && !text(&o).contains("panicked"),
        "{}",
        text(&o)
    );
    let o = tandem(&["vm", "show", "--workload", "idle", "--vcpus", "2"]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("vcpus = 2"),
        "{}",
        text(&o)
    );
    let dir = tempfile::tempdir().unwrap();
    let desc = dir.path().join("vm.toml");
    std::fs::write(&desc, "extra_args = [\"-daemonize\"]\n[[disk]]\npath = \"/nonexistent.qcow2\"\nformat = \"qcow2\"\n").unwrap();
    let o = tandem(&["vm", "check", "--vm-config", desc.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("/nonexistent.qcow2"), "{}", text(&o));
}
