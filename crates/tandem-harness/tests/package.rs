//! The Debian package: dist/deb/build.sh builds it (the product alone), and
//! dist/deb/test-install.sh installs it into a fresh Debian 12 root made by debootstrap and runs
//! `tandem --help`, a man page, the completions and `tandem doctor` there — whose self-test
//! boots QEMU with the preload library from the package's fixed path. Then the root boots under
//! a real systemd (systemd-nspawn) on two hosts joined by a veth link, and OPERATIONS.md's "One
//! unit per VM" is followed there (dist/deb/test-systemd.sh): `systemctl enable --now
//! tandem@web1` runs the lab guest, `tandem status` and `journalctl -p warning` answer,
//! `systemctl stop` records it stopped in etcd, `systemctl start` runs it again; the units of
//! one VM on both hosts hand the guest over on a restart and on `tandem switchover`, fail it
//! over when its host is lost (and protect it onto that host when it boots again) or its
//! daemon is killed, and refuse with status 3 when the running node dies during the backup's
//! first copy.

use std::path::Path;
use std::process::Command;

#[test]
fn the_deb_installs_into_a_fresh_debian_root_and_doctor_passes_there() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = tempfile::tempdir().unwrap();
    let build = Command::new(repo.join("dist/deb/build.sh"))
        .arg("--debug")
        .arg("--out")
        .arg(out.path())
        .output()
        .expect("run dist/deb/build.sh");
    assert!(
        build.status.success(),
        "build.sh: {}",
        String::from_utf8_lossy(&build.stderr)
    );
    let deb = String::from_utf8(build.stdout).unwrap().trim().to_string();
    assert!(
        deb.ends_with("_amd64.deb") && Path::new(&deb).is_file(),
        "{deb}"
    );
    // What the package holds.
    let list = Command::new("dpkg-deb")
        .arg("-c")
        .arg(&deb)
        .output()
        .unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    for want in [
        "./usr/bin/tandem",
        "./usr/lib/tandem/libtandem_preload.so",
        "./lib/systemd/system/tandem-primary@.service",
        "./lib/systemd/system/tandem@.service",
        "./usr/share/doc/tandem/examples/tandem.toml.example",
        "./usr/share/man/man1/tandem-run.1.gz",
        "./usr/share/man/man1/tandem.1.gz",
        "./usr/share/man/man1/tandem-primary.1.gz",
        "./usr/share/bash-completion/completions/tandem",
        "./usr/share/doc/tandem/OPERATIONS.md",
        "./usr/share/tandem/prometheus/tandem.rules.yml",
        "./usr/share/tandem/grafana/tandem.json",
        "./usr/share/tandem/libvirt/qemu-hook",
    ] {
        assert!(
            list.contains(want),
            "{want} missing from the package:\n{list}"
        );
    }
    let guest = tandem_labguest::GuestImage::default();
    guest
        .check()
        .expect("the lab guest (tandem-lab setup builds it)");
    let guest_dir = guest.kernel().parent().unwrap().to_path_buf();
    let run = Command::new(repo.join("dist/deb/test-install.sh"))
        .arg(&deb)
        .arg(&guest_dir)
        .output()
        .expect("run dist/deb/test-install.sh");
    let stderr = String::from_utf8_lossy(&run.stderr);
    let doctor: serde_json::Value =
        serde_json::from_slice(&run.stdout).unwrap_or_else(|_| panic!("no doctor JSON: {stderr}"));
    assert!(run.status.success(), "{doctor:#}\n{stderr}");
    assert_eq!(doctor["ok"], true, "{doctor:#}");
    let check = |name: &str| {
        doctor["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} check: {doctor:#}"))
    };
    assert_eq!(
        check("preload-library")["detail"],
        "/usr/lib/tandem/libtandem_preload.so"
    );
    assert_eq!(check("self-test")["status"], "ok", "{doctor:#}");
    // The unit's runbook under systemd passed every check (test-systemd.sh exits non-zero,
    // and so test-install.sh, on the first that fails).
    assert!(stderr.contains("==> systemd: OK"), "{stderr}");
    // The steps, for `cargo test -- --nocapture`.
    eprintln!("{stderr}");
}
