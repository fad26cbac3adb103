//! Helpers shared by tandem's tests. A dev-dependency only: nothing of it reaches a product
//! crate or binary, and it depends on none of them (so any crate's tests may use it).

#![warn(missing_docs)]

use std::path::Path;

/// A TCP port on 127.0.0.1 that was free a moment ago, and that nobody else in this test
/// process was handed.
///
/// Ports come from below the kernel's ephemeral range (32768 and up): a port the kernel picked
/// for `bind(0)` and released is soon handed again to an outgoing connection (an etcd member
/// dialling its peers, a client), which then holds the port the test meant for a listener.
/// A per-process counter, started at an offset from the pid, keeps parallel tests of one
/// binary apart.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(7919)) % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = (LOW + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN) as u16;
        let free = std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok();
        if free {
            return port;
        }
    }
    panic!("no free local port in {LOW}..{}", LOW + SPAN)
}

/// Runs `f` on every input of the committed corpus of fuzz target `target` (`fuzz/corpus/`),
/// and checks the corpus has at least `min` inputs.
pub fn replay_corpus(target: &str, min: usize, f: impl Fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("corpus entry").path();
        f(&std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())));
        n += 1;
    }
    assert!(n >= min, "corpus {target} has {n} inputs");
}

/// Page size of the fake guest.
pub const PAGE: usize = 4096;

/// Dirty page numbers, their contents and the epoch's disk writes (offset, bytes).
pub type Step = (Vec<u64>, Vec<u8>, Vec<(u64, Vec<u8>)>);

/// A guest that writes its memory and disk in a fixed pattern, for protocol tests without
/// QEMU: its memory and disk are what a backup must end up with.
pub struct FakeGuest {
    /// Guest memory.
    pub mem: Vec<u8>,
    /// Guest data disk.
    pub disk: Vec<u8>,
}

impl FakeGuest {
    /// `pages` pages of patterned memory and a patterned disk of `disk_bytes`.
    pub fn new(pages: usize, disk_bytes: usize) -> FakeGuest {
        FakeGuest {
            mem: (0..pages * PAGE).map(|i| (i / 7 % 253) as u8).collect(),
            disk: (0..disk_bytes).map(|i| (i / 3 % 13) as u8).collect(),
        }
    }

    /// Writes some pages and disk blocks for `epoch`: returns the dirty pages (ascending),
    /// their contents and the disk writes.
    pub fn step(&mut self, epoch: u64) -> Step {
        let pages = (self.mem.len() / PAGE) as u64;
        let mut pfns: Vec<u64> = (0..20).map(|k| (epoch * 31 + k * 5) % pages).collect();
        pfns.sort_unstable();
        pfns.dedup();
        let mut out = Vec::new();
        for &p in &pfns {
            let pg = &mut self.mem[p as usize * PAGE..(p as usize + 1) * PAGE];
            pg[(epoch as usize * 17) % PAGE] ^= 0xa5;
            out.extend_from_slice(pg);
        }
        let mut writes = Vec::new();
        let blocks = (self.disk.len() / 1024).saturating_sub(4) as u64;
        if blocks > 0 {
            for k in 0..3u64 {
                let off = ((epoch * 7 + k * 13) % blocks) * 1024;
                let data = vec![(epoch + k) as u8; 1536];
                self.disk[off as usize..off as usize + data.len()].copy_from_slice(&data);
                writes.push((off, data));
            }
        }
        (pfns, out, writes)
    }
}

/// Checks a Prometheus exposition with `promtool check metrics` (Prometheus' own linter,
/// Debian's `prometheus` package, which `tandem-lab setup` installs); panics with its findings
/// and the page when it refuses it.
pub fn promtool_check_metrics(text: &str) {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus) is missing: run `tandem-lab setup`");
    child
        .stdin
        .take()
        .expect("promtool's stdin")
        .write_all(text.as_bytes())
        .expect("writing to promtool");
    let o = child.wait_with_output().expect("promtool's result");
    assert!(
        o.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}
