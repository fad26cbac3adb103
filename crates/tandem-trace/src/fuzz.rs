//! Entry points shared by the cargo-fuzz targets and the corpus replay test.

use crate::TraceReader;

/// Reads every frame of `data`; returns how many frames were valid before an error or the end.
pub fn read_all(data: &[u8]) -> usize {
    let Ok(mut r) = TraceReader::new(data) else {
        return 0;
    };
    let mut n = 0;
    while let Ok(Some(_)) = r.next_frame() {
        n += 1;
    }
    n
}
