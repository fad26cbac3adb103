//! Entry points shared by the cargo-fuzz target and the corpus replay test.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use crate::{decode_writes, Image};

/// Runs `data` as a client's byte stream against the NBD server on a 64 KiB image and decodes
/// it as an epoch's disk writes: both must refuse or succeed, never panic.
pub fn disk_input(data: &[u8]) {
    let _ = decode_writes(data, 64 << 10);
    let Ok(file) = tempfile_in_shm() else { return };
    let Ok(image) = Image::open(&file.0) else {
        return;
    };
    let Ok((mut client, server)) = UnixStream::pair() else {
        return;
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            let _ = crate::nbd::serve_client(server, &image);
        });
        let _ = client.write_all(data);
        let _ = client.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = client.read_to_end(&mut sink);
    });
}

struct TempFile(std::path::PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn tempfile_in_shm() -> std::io::Result<TempFile> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let p = std::env::temp_dir().join(format!(
        "tandem-nbd-fuzz-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::File::create(&p)?.set_len(64 << 10)?;
    Ok(TempFile(p))
}
