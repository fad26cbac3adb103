//! What an operator's service manager and log reader see: journal priorities, no colour off a
//! terminal, private files.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Command, Stdio};

/// Runs `tandem args` with stderr to a file and, if `journal`, JOURNAL_STREAM naming that file
/// (what systemd does for a service logging to the journal); returns stderr.
fn stderr_of(args: &[&str], journal: bool) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stderr");
    let file = std::fs::File::create(&path).unwrap();
    let meta = file.metadata().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
    cmd.args(args)
        .stdout(Stdio::null())
        .stderr(file)
        .env_remove("RUST_LOG")
        .env_remove("JOURNAL_STREAM");
    if journal {
        cmd.env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()));
    }
    cmd.status().unwrap();
    std::fs::read_to_string(&path).unwrap()
}

#[test]
fn the_journal_gets_priorities_and_no_escapes() {
    // A RAM file of a dead process: removing it is logged at info.
    let stale = "/dev/shm/tandem-journaltest-999999999-0.ram";
    let args = [
        "--log",
        "info",
        "checkpoint",
        "list",
        "/nonexistent/tandem-store",
    ];
    std::fs::write(stale, b"").unwrap();
    let journal = stderr_of(&args, true);
    assert!(!journal.contains('\x1b'), "escape codes in {journal:?}");
    assert!(
        journal
            .lines()
            .any(|l| l.starts_with("<6>") && l.contains("removed")),
        "no info line with priority 6: {journal:?}"
    );
    assert!(
        journal
            .lines()
            .any(|l| l.starts_with("<3>error:") && l.contains("/nonexistent/tandem-store")),
        "no error line with priority 3: {journal:?}"
    );
    // Not the journal (a file, or a service whose stderr was redirected): plain lines.
    std::fs::write(stale, b"").unwrap();
    let plain = stderr_of(&args, false);
    assert!(!plain.contains('\x1b'), "escape codes in {plain:?}");
    assert!(
        plain.lines().all(|l| !l.starts_with('<')),
        "priority prefixes off the journal: {plain:?}"
    );
    assert!(plain.contains("error:"), "{plain:?}");
}

#[test]
fn files_are_private_to_tandems_user() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    let o = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["keys", "--dir"])
        .arg(&keys)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&keys), 0o700);
    for f in std::fs::read_dir(&keys).unwrap() {
        let p = f.unwrap().path();
        assert_eq!(mode(&p), 0o600, "{}", p.display());
    }
}
