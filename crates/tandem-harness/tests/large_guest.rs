//! A large, busy guest (issue 39), as real processes: 4 GiB whose workload (`memheavy`)
//! rewrites a 1 GiB buffer. The initial sync's pre-copy rounds throttle it until it converges
//! (when it writes faster than the link ships), and it is held while the encoder's reference
//! is built (seconds for 4 GiB), so the first checkpoint is small instead of carrying the whole
//! buffer; its epochs go in parts of 1 MiB; then the primary's host dies and the backup resumes
//! the guest.

mod common;

use std::time::{Duration, Instant};

use common::{is_event, spawn, wait_event};

#[test]
fn a_large_busy_guest_converges_by_pre_copy_and_fails_over() {
    let vm = common::lab_vm("memheavy", 0);
    let dir = tempfile::Builder::new()
        .prefix("tandem-large-")
        .tempdir_in("/dev/shm")
        .unwrap();
    let addr = format!("127.0.0.1:{}", tandem_test_support::free_port());
    let bdir = dir.path().join("b");
    let (_backup, brx) = spawn(&[
        "backup",
        "--listen",
        &addr,
        "--dir",
        bdir.to_str().unwrap(),
        "--vm-config",
        &vm,
        "--mem",
        "4096",
        "--timeout-ms",
        "2000",
        "--json-events",
    ]);
    wait_event(&brx, "listening", Duration::from_secs(120), |_| true);
    let jsonl = dir.path().join("epochs.jsonl");
    let (mut primary, prx) = spawn(&[
        "primary",
        "--backup",
        &addr,
        "--dir",
        dir.path().join("p").to_str().unwrap(),
        "--vm-config",
        &vm,
        "--mem",
        "4096",
        "--metrics-jsonl",
        jsonl.to_str().unwrap(),
        // Parts of 1 MiB: the first checkpoint and the busy epochs after it go in parts.
        "--epoch-part-mib",
        "1",
        "--json-events",
    ]);
    let ready = wait_event(&prx, "guest_running", Duration::from_secs(300), |_| true);
    let qemu = ready["qemu_pid"].as_u64().unwrap();
    // Until the third acknowledged epoch: the rounds' lines, in order.
    let (mut rounds, mut throttled, mut in_parts) = (Vec::new(), false, 0);
    let mut held = false;
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = prx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("not protected in time; rounds: {rounds:#?}"));
        in_parts += usize::from(line.contains(" parts"));
        held |= line.contains("guest held");
        if line.contains("pre-copy round") {
            throttled |= line.contains("throttled");
            rounds.push(line);
        } else if is_event(&line, "acked") {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            if v["epoch"].as_u64() >= Some(3) {
                break;
            }
        }
    }
    assert!(rounds.len() >= 2, "{rounds:#?}");
    // Throttled by the rounds (a link slower than the buffer's rewriting), or held once the
    // rounds converged and the guest wrote their target again while the encoder was built.
    assert!(
        throttled || held,
        "the guest was neither throttled nor held: {rounds:#?}"
    );
    // The first checkpoint carried what the throttled guest left, not the 262 144 pages of
    // its buffer (the pre-copy's bound is 65 536 when its rounds run out).
    let lines = std::fs::read_to_string(&jsonl).unwrap();
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    let pages = first["dirty_pages"].as_u64().unwrap();
    assert!(pages <= 100_000, "first epoch: {pages} pages; {rounds:#?}");
    let parts: u64 = lines
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| v["parts"].as_u64().unwrap_or(0))
        .sum();
    assert!(
        parts > 0 && in_parts > 0,
        "epochs of more than 256 pages go in parts: {parts} parts, {in_parts} lines"
    );

    // The host dies; the backup resumes the guest from its last committed epoch.
    primary.kill().unwrap();
    // SAFETY: plain kill(2) of a process id we read from the primary's output.
    unsafe { libc::kill(qemu as i32, libc::SIGKILL) };
    let failed = wait_event(&brx, "failed_over", Duration::from_secs(60), |_| true);
    assert!(failed["epoch"].as_u64() >= Some(3), "{failed}");
}
