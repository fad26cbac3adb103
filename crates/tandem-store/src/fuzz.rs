//! Entry point shared by the cargo-fuzz target and the corpus replay test: arbitrary bytes as
//! a store's index and one segment; opening, listing, verifying and restoring must give
//! errors, never panic.

/// Writes `data` split into an index and a segment into a scratch store and exercises it.
pub fn store_files(data: &[u8]) {
    let Ok(dir) = tempfile_dir() else { return };
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let (index, seg) = rest.split_at((n as usize * 4).min(rest.len()));
    let mut idx = crate::format::index_header(16 * 4096).to_vec();
    idx.extend_from_slice(index);
    let _ = std::fs::write(dir.join("index"), &idx);
    let _ = std::fs::write(dir.join("seg-00000001.tseg"), seg);
    if let Ok(s) = crate::Store::open(&dir) {
        let _ = s.verify(|_| {});
        let mut ram = vec![0u8; 16 * 4096];
        for e in s.entries() {
            let _ = s.materialize(e.id, &mut ram);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bytes as a store with disks: `[n: u16 LE][disks file: n bytes][m][index entries: 4m
/// bytes][segment]`, with a disk base for checkpoint 1 of the layout's size (when small). Opening,
/// verifying and rebuilding RAM and disks must give errors, never panic.
pub fn store_disks(data: &[u8]) {
    let Ok(dir) = tempfile_dir() else { return };
    let take = |d: &[u8]| -> (Vec<u8>, Vec<u8>) {
        let Some((&n, rest)) = d.split_first() else {
            return (Vec::new(), Vec::new());
        };
        let (a, b) = rest.split_at((n as usize * 4).min(rest.len()));
        (a.to_vec(), b.to_vec())
    };
    let Some(n) = data
        .get(..2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
    else {
        let _ = std::fs::remove_dir_all(&dir);
        return;
    };
    let (disks, rest) = data[2..].split_at(n.min(data.len() - 2));
    let (index, seg) = take(rest);
    let mut idx = crate::format::index_header_version(16 * 4096, 2).to_vec();
    idx.extend_from_slice(&index);
    let _ = std::fs::write(dir.join("index"), &idx);
    let _ = std::fs::write(dir.join("disks"), disks);
    let _ = std::fs::write(dir.join("seg-00000001.tseg"), &seg);
    if let Ok(l) = crate::disks::DiskLayout::decode(disks) {
        if l.total <= 1 << 20 {
            let base: Vec<u8> = (0..l.total).map(|i| i as u8).collect();
            let _ = std::fs::write(dir.join(crate::disks::base_name(1)), base);
        }
    }
    if let Ok(s) = crate::Store::open(&dir) {
        let _ = s.verify(|_| {});
        let mut ram = vec![0u8; 16 * 4096];
        let small = s.disks().is_some_and(|l| l.total <= 1 << 20);
        for e in s.entries() {
            let _ = s.materialize(e.id, &mut ram);
            if small {
                let out = dir.join("out.img");
                let _ = std::fs::remove_file(&out);
                let _ = s.materialize_disks(e.id, &out);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir() -> std::io::Result<std::path::PathBuf> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "tandem-store-fuzz-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
