//! Reference-prefix compression: the record's data section is one zstd frame compressed with
//! the pre-epoch content of chosen pages as its prefix (zstd's `refPrefix`), so zstd finds the
//! new bytes in the old ones, shifted or not, in the same page or another. The decoder holds
//! the whole pre-epoch mirror and rebuilds the same prefix from the page list in the record.
//!
//! The prefix and the data lie in one buffer, prefix first, so zstd sees one contiguous window
//! (its faster no-external-dictionary path on both sides). Level-1 defaults index too little
//! of a multi-megabyte prefix to find anything in it; [`HASH_LOG`] is sized for it.

use zstd::zstd_safe::{CCtx, CParameter, DCtx, DParameter, ResetDirective};

use crate::format::PAGE;
use crate::runs::{get_uleb, put_uleb};

/// zstd hash table bits (2 MiB of table): indexes a prefix of a few thousand pages densely
/// enough for level 1 to find the old versions (the default at level 1 is 13 to 17 bits).
pub const HASH_LOG: u32 = 19;

/// Appends the prefix list: count, then the page numbers in prefix order.
pub fn write_list(pfns: &[u64], out: &mut Vec<u8>) {
    put_uleb(out, pfns.len() as u64);
    for &p in pfns {
        put_uleb(out, p);
    }
}

/// Reads a prefix list at `*pos`: at most `max` pages, each below `pages`.
pub fn read_list(ops: &[u8], pos: &mut usize, pages: u64, max: u64) -> Result<Vec<u64>, String> {
    let n = get_uleb(ops, pos).ok_or("prefix list truncated")?;
    if n == 0 || n > max {
        return Err(format!("prefix of {n} pages (1 to {max} allowed)"));
    }
    // Every page number takes at least one byte: refuse counts the section cannot hold.
    if n > (ops.len() - *pos) as u64 {
        return Err(format!("prefix of {n} pages in a shorter ops section"));
    }
    let mut v = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let p = get_uleb(ops, pos).ok_or("prefix page truncated")?;
        if p >= pages {
            return Err(format!("prefix page {p} outside the guest's {pages} pages"));
        }
        v.push(p);
    }
    Ok(v)
}

/// Window bits covering `len` bytes (zstd's bounds 10..=30).
fn window_log(len: usize) -> u32 {
    (usize::BITS - len.max(1024).saturating_sub(1).leading_zeros()).clamp(10, 30)
}

/// A reusable zstd compression context for prefix frames.
pub struct Compressor {
    cctx: CCtx<'static>,
}

impl Default for Compressor {
    fn default() -> Self {
        Compressor {
            cctx: CCtx::create(),
        }
    }
}

fn io(code: usize) -> std::io::Error {
    std::io::Error::other(zstd::zstd_safe::get_error_name(code))
}

impl Compressor {
    /// Compresses `buf[plen..]` as one frame whose reference prefix is `buf[..plen]`, at
    /// `level`, into `out` (cleared first).
    pub fn compress(
        &mut self,
        buf: &[u8],
        plen: usize,
        level: i32,
        out: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        let (prefix, data) = buf.split_at(plen.min(buf.len()));
        let c = &mut self.cctx;
        c.reset(ResetDirective::SessionAndParameters).map_err(io)?;
        c.set_parameter(CParameter::CompressionLevel(level))
            .map_err(io)?;
        c.set_parameter(CParameter::WindowLog(window_log(buf.len())))
            .map_err(io)?;
        if plen > 0 {
            c.set_parameter(CParameter::HashLog(HASH_LOG)).map_err(io)?;
            // SAFETY: the context keeps a reference-prefix pointer only for the next frame,
            // which `compress2` below completes before this function returns; on any error the
            // reset that follows drops the reference (`SessionAndParameters` clears prefixes
            // and dictionaries). So the pointer never outlives `buf`, which outlives this call;
            // the 'static lifetime is only what the context's type demands.
            let prefix: &'static [u8] = unsafe { &*(prefix as *const [u8]) };
            c.ref_prefix(prefix).map_err(io)?;
        }
        out.clear();
        out.reserve(zstd::zstd_safe::compress_bound(data.len()));
        let r = c.compress2(out, data).map(|_| ()).map_err(io);
        c.reset(ResetDirective::SessionAndParameters).map_err(io)?;
        r
    }
}

/// Decompresses `frame` into `buf[plen..]` with `buf[..plen]` as the reference prefix;
/// returns the bytes written.
pub fn decompress(frame: &[u8], buf: &mut [u8], plen: usize) -> Result<usize, String> {
    let (prefix, dst) = buf.split_at_mut(plen.min(buf.len()));
    let mut d = DCtx::create();
    d.set_parameter(DParameter::WindowLogMax(31))
        .map_err(|c| zstd::zstd_safe::get_error_name(c).to_string())?;
    if !prefix.is_empty() {
        d.ref_prefix(prefix)
            .map_err(|c| zstd::zstd_safe::get_error_name(c).to_string())?;
    }
    d.decompress(dst, frame)
        .map_err(|c| zstd::zstd_safe::get_error_name(c).to_string())
}

/// Appends the pre-epoch content of `pfns` from `mirror` to `out`.
pub fn build(mirror: &[u8], pfns: &[u64], out: &mut Vec<u8>) {
    for &p in pfns {
        out.extend_from_slice(&mirror[p as usize * PAGE..(p as usize + 1) * PAGE]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shifted_page_compresses_against_its_old_version() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let old: Vec<u8> = (0..PAGE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let mut new = vec![0xabu8; 100];
        new.extend_from_slice(&old[..PAGE - 100]);
        let mut buf = old.clone();
        buf.extend_from_slice(&new);
        let mut out = Vec::new();
        let mut c = Compressor::default();
        c.compress(&buf, PAGE, 1, &mut out).unwrap();
        assert!(out.len() < 160, "{} bytes", out.len());
        // Without the prefix it stays incompressible.
        let mut plain = Vec::new();
        c.compress(&new, 0, 1, &mut plain).unwrap();
        assert!(plain.len() > PAGE - 200, "{}", plain.len());
        let mut back = old.clone();
        back.resize(2 * PAGE, 0);
        assert_eq!(decompress(&out, &mut back, PAGE), Ok(PAGE));
        assert_eq!(&back[PAGE..], &new[..]);
        // The wrong prefix decodes to other bytes or fails, never to `new`.
        let mut wrong = vec![0u8; 2 * PAGE];
        if decompress(&out, &mut wrong, PAGE).is_ok() {
            assert_ne!(&wrong[PAGE..], &new[..]);
        }
    }

    #[test]
    fn prefix_lists_roundtrip_and_bad_ones_are_refused() {
        let mut b = Vec::new();
        write_list(&[5, 300, 2], &mut b);
        let mut pos = 0;
        assert_eq!(read_list(&b, &mut pos, 1000, 10), Ok(vec![5, 300, 2]));
        assert_eq!(pos, b.len());
        assert!(read_list(&b, &mut 0, 300, 10).is_err());
        assert!(read_list(&b, &mut 0, 1000, 2).is_err());
        assert!(read_list(&b[..2], &mut 0, 1000, 10).is_err());
        assert!(read_list(&[0], &mut 0, 1000, 10).is_err());
    }
}
