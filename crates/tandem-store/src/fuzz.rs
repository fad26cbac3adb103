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
