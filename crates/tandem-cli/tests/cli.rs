//! The product binary `tandem` from the outside: doctor, VM descriptions, checkpoint stores
//! that are not (the lab's commands are tested in tandem-harness/tests/lab_cli.rs).

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
    assert!(q["fix"].as_str().unwrap().contains("qemu-system-x86"));

    // Nothing to run: the product has no built-in guest; it names the flag and the doc.
    let o = tandem(&["vm", "check"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("--vm-config") && text(&o).contains("VM_DESCRIPTION.md"),
        "{}",
        text(&o)
    );
}

#[test]
fn vm_description_files_are_checked() {
    let d = tempfile::tempdir().unwrap();
    let bad = d.path().join("bad.toml");
    std::fs::write(&bad, "mem = 256\nmemory = 256\n").unwrap();
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
    // A valid file that describes nothing to boot.
    let wrong = d.path().join("wrong.toml");
    std::fs::write(&wrong, "mem = 128\n").unwrap();
    let o = tandem(&[
        "checkpoint",
        "save",
        "--dir",
        d.path().join("s2").to_str().unwrap(),
        "--vm-config",
        wrong.to_str().unwrap(),
    ]);
    assert!(
        text(&o).contains("no [boot] and no [[disk]]"),
        "{}",
        text(&o)
    );
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
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("boot.raw");
    std::fs::write(&raw, vec![0u8; 1 << 20]).unwrap();
    let desc = dir.path().join("small.toml");
    std::fs::write(
        &desc,
        format!(
            "label = \"web\"\n[[disk]]\npath = {:?}\n",
            raw.display().to_string()
        ),
    )
    .unwrap();
    let o = tandem(&[
        "vm",
        "show",
        "--vm-config",
        desc.to_str().unwrap(),
        "--vcpus",
        "2",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("vcpus = 2")
            && out.contains("label = \"web\"")
            && out.contains("format = \"raw\""),
        "{}",
        text(&o)
    );
    let desc = dir.path().join("vm.toml");
    std::fs::write(&desc, "extra_args = [\"-daemonize\"]\n[[disk]]\npath = \"/nonexistent.qcow2\"\nformat = \"qcow2\"\n").unwrap();
    let o = tandem(&["vm", "check", "--vm-config", desc.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("/nonexistent.qcow2"), "{}", text(&o));
}

#[test]
fn backup_host_files_are_checked_before_anything_starts() {
    let d = tempfile::tempdir().unwrap();
    let run = |name: &str, body: &str| {
        let p = d.path().join(name);
        std::fs::write(&p, body).unwrap();
        let o = tandem(&["backup-host", "--config", p.to_str().unwrap()]);
        assert!(!o.status.success(), "{name} was accepted");
        text(&o)
    };
    let one = "[[replica]]\nvm_id = 2\nlisten = \"127.0.0.1:1\"\ndir = \"/dev/shm/tandem-t2\"\n";
    let t = run("twice.toml", &format!("{one}{one}"));
    assert!(t.contains("VM id 2 is given twice"), "{t}");
    let t = run(
        "nodir.toml",
        "[[replica]]\nvm_id = 3\nlisten = \"127.0.0.1:1\"\n",
    );
    assert!(t.contains("listen and dir are required"), "{t}");
    let t = run("typo.toml", &format!("{one}timeout_ms = 5\n"));
    assert!(t.contains("timeout_ms"), "{t}");
    let t = run(
        "pool.toml",
        &format!("{one}[replica.consolidate]\nlazy = false\n"),
    );
    assert!(t.contains("[consolidate] table"), "{t}");
    let t = run("empty.toml", "");
    assert!(t.contains("replica"), "{t}");
    let o = tandem(&["backup-host"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--config"), "{}", text(&o));
}

#[test]
fn bad_arguments_are_usage_errors() {
    let o = tandem(&[
        "primary",
        "--backup",
        "127.0.0.1:1",
        "--encoder-threads",
        "0",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--encoder-threads"), "{}", text(&o));
    let o = tandem(&["backup", "--listen", "not-an-address"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

#[test]
fn doctor_checks_what_production_needs_when_asked() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = listener.local_addr().unwrap().to_string();
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let run = |peer: &str| {
        let o = tandem(&[
            "doctor",
            "--json",
            "--no-selftest",
            "--bridge",
            "tandem-nonexistent",
            "--peer",
            peer,
        ]);
        let v: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|_| panic!("{}", text(&o)));
        (o.status.success(), v)
    };
    let status = |v: &serde_json::Value, name: &str| {
        v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no {name} check in {v:#}"))["status"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (ok, v) = run(&peer);
    assert!(!ok, "a missing bridge fails: {v:#}");
    assert_eq!(status(&v, "bridge"), "fail");
    assert_eq!(status(&v, "peer"), "ok");
    assert!(["ok", "warn"].contains(&status(&v, "kvm").as_str()));
    let (_, v) = run(&closed);
    assert_eq!(status(&v, "peer"), "fail", "{v:#}");
    drop(listener);
}
