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

/// Most zstd hash table bits (2 MiB of table): indexes a prefix of a few thousand pages densely
/// enough for level 1 to find the old versions (the default at level 1 is 13 to 17 bits).
pub const HASH_LOG: u32 = 19;

/// Hash table bits for a frame of `len` bytes (prefix and data): one slot per 2 bytes, at
/// most [`HASH_LOG`]. zstd clears its table for every frame, so a small record with a 2 MiB
/// table spends more time clearing it than compressing.
pub fn hash_log(len: usize) -> u32 {
    let slots = (len / 2).max(1);
    (usize::BITS - (slots - 1).leading_zeros()).clamp(12, HASH_LOG)
}

/// Most zstd frames in one record's data section.
pub const MAX_FRAMES: u64 = 64;

/// One zstd frame of the data section: its reference prefix (pre-epoch pages, in order) and
/// its decoded and stored lengths. The frames' outputs, concatenated, are the payloads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FrameSpec {
    /// Pages whose pre-epoch content, concatenated, is the frame's prefix.
    pub pfns: Vec<u64>,
    /// Bytes the frame decodes to.
    pub raw: u64,
    /// Bytes of the frame.
    pub stored: u64,
}

/// Appends the frame table: count, then per frame its prefix list and lengths.
pub fn write_frames(frames: &[FrameSpec], compact: bool, out: &mut Vec<u8>) {
    put_uleb(out, frames.len() as u64);
    let mut last = 0;
    for f in frames {
        put_uleb(out, f.pfns.len() as u64);
        for &p in &f.pfns {
            if compact {
                crate::runs::put_rel(out, p, last);
                last = p;
            } else {
                put_uleb(out, p);
            }
        }
        put_uleb(out, f.raw);
        put_uleb(out, f.stored);
    }
}

/// Reads a frame table at `*pos`: 1 to [`MAX_FRAMES`] frames and at most `max` prefix pages
/// in all, each below `pages`.
pub fn read_frames(
    ops: &[u8],
    pos: &mut usize,
    pages: u64,
    max: u64,
    compact: bool,
) -> Result<Vec<FrameSpec>, String> {
    let n = get_uleb(ops, pos).ok_or("frame table truncated")?;
    if n == 0 || n > MAX_FRAMES {
        return Err(format!("{n} zstd frames (1 to {MAX_FRAMES} allowed)"));
    }
    let mut left = max;
    let mut last = compact.then_some(0);
    let mut v = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let pfns = read_list(ops, pos, pages, left, &mut last)?;
        left -= pfns.len() as u64;
        let raw = get_uleb(ops, pos).ok_or("frame length truncated")?;
        let stored = get_uleb(ops, pos).ok_or("frame length truncated")?;
        v.push(FrameSpec { pfns, raw, stored });
    }
    Ok(v)
}

/// Reads a prefix list at `*pos`: at most `max` pages, each below `pages`. `last`: in the
/// compact form, the page the next one is written relative to.
fn read_list(
    ops: &[u8],
    pos: &mut usize,
    pages: u64,
    max: u64,
    last: &mut Option<u64>,
) -> Result<Vec<u64>, String> {
    let n = get_uleb(ops, pos).ok_or("prefix list truncated")?;
    if n > max {
        return Err(format!("prefix of {n} pages (at most {max} allowed)"));
    }
    // Every page number takes at least one byte: refuse counts the section cannot hold.
    if n > (ops.len() - *pos) as u64 {
        return Err(format!("prefix of {n} pages in a shorter ops section"));
    }
    let mut v = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let p = match last {
            Some(l) => {
                let p = crate::runs::get_rel(ops, pos, *l)
                    .ok_or("prefix page truncated or below page 0")?;
                *l = p;
                p
            }
            None => get_uleb(ops, pos).ok_or("prefix page truncated")?,
        };
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
    /// Compresses `data` as one frame whose reference prefix is `prefix`, at `level`, into
    /// `out` (cleared first). When `prefix` ends where `data` starts in memory, zstd sees one
    /// contiguous window.
    pub fn compress(
        &mut self,
        prefix: &[u8],
        data: &[u8],
        level: i32,
        out: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        let plen = prefix.len();
        let c = &mut self.cctx;
        c.reset(ResetDirective::SessionAndParameters).map_err(io)?;
        c.set_parameter(CParameter::CompressionLevel(level))
            .map_err(io)?;
        c.set_parameter(CParameter::WindowLog(window_log(plen + data.len())))
            .map_err(io)?;
        if plen > 0 {
            c.set_parameter(CParameter::HashLog(hash_log(plen + data.len())))
                .map_err(io)?;
            // SAFETY: the context keeps a reference-prefix pointer only for the next frame,
            // which `compress2` below completes before this function returns; on any error the
            // reset that follows drops the reference (`SessionAndParameters` clears prefixes
            // and dictionaries). So the pointer never outlives `prefix`, which outlives this call;
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

    /// Compresses `data` as one frame at `level` with zstd's own parameters for that level
    /// and size (what `zstd::bulk::compress` writes: a window any zstd tool reads without
    /// `--long`), into `out` (cleared first).
    pub fn compress_plain(
        &mut self,
        data: &[u8],
        level: i32,
        out: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        let c = &mut self.cctx;
        c.reset(ResetDirective::SessionAndParameters).map_err(io)?;
        c.set_parameter(CParameter::CompressionLevel(level))
            .map_err(io)?;
        out.clear();
        out.reserve(zstd::zstd_safe::compress_bound(data.len()));
        c.compress2(out, data).map(|_| ()).map_err(io)
    }
}

thread_local! {
    /// One decompression context per thread, reused by every frame it decodes: creating one
    /// allocates (and the kernel zeroes) ~160 KiB each time.
    static DCTX: std::cell::RefCell<Option<DCtx<'static>>> = const { std::cell::RefCell::new(None) };
    /// One compression context per thread ([`compress_frame`]).
    static CCTX: std::cell::RefCell<Option<Compressor>> = const { std::cell::RefCell::new(None) };
}

/// Compresses `data` as one frame with `prefix` as its reference prefix (see
/// [`Compressor::compress`]), with this thread's reused context: one context per thread for
/// the frames it compresses (a record's, a device state's, a checkpoint's sections), so their
/// memory stays one context per thread however many frames there are. (The compressed tier
/// keeps a context of its own per thread for its many page-sized frames.)
pub fn compress_frame(
    prefix: &[u8],
    data: &[u8],
    level: i32,
    out: &mut Vec<u8>,
) -> std::io::Result<()> {
    with_cctx(|c| c.compress(prefix, data, level, out))
}

/// One frame of `data` alone at `level` with zstd's own parameters
/// ([`Compressor::compress_plain`]), with this thread's reused context: for small, frequent
/// frames (a page's patch, a device state, a checkpoint's sections), where creating a context
/// each time costs more than compressing.
pub fn compress_alone(data: &[u8], level: i32, out: &mut Vec<u8>) -> std::io::Result<()> {
    with_cctx(|c| c.compress_plain(data, level, out))
}

/// Runs `f` with this thread's compression context.
fn with_cctx<R>(f: impl FnOnce(&mut Compressor) -> R) -> R {
    CCTX.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => f(slot.get_or_insert_with(Compressor::default)),
        // Only if a compression on this thread were interrupted by another (it is not:
        // nothing inside one waits on the worker pool); a context of its own then.
        Err(_) => f(&mut Compressor::default()),
    })
}

/// Decompresses `frame` into `dst` with `prefix` as its reference prefix; returns the bytes
/// written.
pub fn decompress(frame: &[u8], prefix: &[u8], dst: &mut [u8]) -> Result<usize, String> {
    decompress_into(frame, prefix, dst)
}

/// Decompresses a frame without a prefix into a new buffer of at most `cap` bytes, with this
/// thread's reused context. A frame that would decode to more than `cap` is an error. The
/// buffer is the frame's declared size when that is within `cap` (a frame that decodes to
/// more than it declares is an error too).
pub fn decompress_alone(frame: &[u8], cap: usize) -> Result<Vec<u8>, String> {
    let declared = zstd::zstd_safe::get_frame_content_size(frame)
        .ok()
        .flatten()
        .and_then(|n| usize::try_from(n).ok());
    let mut out = Vec::with_capacity(declared.map_or(cap, |n| n.min(cap)));
    decompress_into(frame, &[], &mut out)?;
    Ok(out)
}

/// [`decompress`] into any of zstd's output buffers (a slice, or a vector from its start up
/// to its capacity).
fn decompress_into<C: zstd::zstd_safe::WriteBuf + ?Sized>(
    frame: &[u8],
    prefix: &[u8],
    dst: &mut C,
) -> Result<usize, String> {
    let name = |c| zstd::zstd_safe::get_error_name(c).to_string();
    DCTX.with(|cell| {
        let mut slot = cell.borrow_mut();
        let d = match slot.as_mut() {
            Some(d) => d,
            None => {
                let mut d = DCtx::create();
                d.set_parameter(DParameter::WindowLogMax(31))
                    .map_err(name)?;
                slot.insert(d)
            }
        };
        // A frame that failed half-way leaves the context mid-frame: start a new session
        // (parameters stay).
        d.reset(ResetDirective::SessionOnly).map_err(name)?;
        if !prefix.is_empty() {
            // SAFETY: a reference prefix is single-use: zstd reads it for the next frame only
            // and marks it unused when that frame starts. `decompress` below is that frame and
            // completes (or fails) before this function returns; the next `ref_prefix` on this
            // context replaces the stale pointer without reading it. So zstd never reads
            // `prefix` after this call; the 'static lifetime is only what the context's type
            // demands.
            let prefix: &'static [u8] = unsafe { &*(prefix as *const [u8]) };
            d.ref_prefix(prefix).map_err(name)?;
        }
        let r = d.decompress(dst, frame).map_err(name);
        d.reset(ResetDirective::SessionOnly).map_err(name)?;
        r
    })
}

/// Copies the pre-epoch content of `pfns` from `mirror` into `out` (exactly their length).
pub fn fill(mirror: &[u8], pfns: &[u64], out: &mut [u8]) {
    for (&p, d) in pfns.iter().zip(out.chunks_exact_mut(PAGE)) {
        d.copy_from_slice(&mirror[p as usize * PAGE..(p as usize + 1) * PAGE]);
    }
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
        let old = crate::test_bytes(0x9e37_79b9_7f4a_7c15u64, PAGE);
        let mut new = vec![0xabu8; 100];
        new.extend_from_slice(&old[..PAGE - 100]);
        let mut buf = old.clone();
        buf.extend_from_slice(&new);
        let mut out = Vec::new();
        let mut c = Compressor::default();
        let (p, d) = buf.split_at(PAGE);
        c.compress(p, d, 1, &mut out).unwrap();
        assert!(out.len() < 160, "{} bytes", out.len());
        // Without the prefix it stays incompressible.
        let mut plain = Vec::new();
        c.compress(&[], &new, 1, &mut plain).unwrap();
        assert!(plain.len() > PAGE - 200, "{}", plain.len());
        // Contiguous and separate prefixes decode alike.
        let mut back = old.clone();
        back.resize(2 * PAGE, 0);
        let (p, d) = back.split_at_mut(PAGE);
        assert_eq!(decompress(&out, p, d), Ok(PAGE));
        assert_eq!(&back[PAGE..], &new[..]);
        let mut sep = vec![0u8; PAGE];
        assert_eq!(decompress(&out, &old, &mut sep), Ok(PAGE));
        assert_eq!(sep, new);
        // The wrong prefix decodes to other bytes or fails, never to `new`.
        let mut wrong = vec![0u8; PAGE];
        if decompress(&out, &[0u8; PAGE], &mut wrong).is_ok() {
            assert_ne!(wrong, new);
        }
    }

    #[test]
    fn frame_tables_roundtrip_and_bad_ones_are_refused() {
        let frames = vec![
            FrameSpec {
                pfns: vec![5, 300, 2],
                raw: 4096,
                stored: 100,
            },
            FrameSpec {
                pfns: vec![],
                raw: 64,
                stored: 30,
            },
        ];
        for compact in [false, true] {
            let mut b = Vec::new();
            write_frames(&frames, compact, &mut b);
            let mut pos = 0;
            assert_eq!(
                read_frames(&b, &mut pos, 1000, 10, compact),
                Ok(frames.clone())
            );
            assert_eq!(pos, b.len());
            assert!(
                read_frames(&b, &mut 0, 300, 10, compact).is_err(),
                "page outside the guest"
            );
            assert!(
                read_frames(&b, &mut 0, 1000, 2, compact).is_err(),
                "too many prefix pages"
            );
            assert!(
                read_frames(&b[..4], &mut 0, 1000, 10, compact).is_err(),
                "truncated"
            );
        }
        // Compact: a page below zero (the first, 5, then −6) is refused.
        assert!(read_frames(&[1, 2, 10, 11, 0, 0], &mut 0, 1000, 10, true).is_err());
        assert!(
            read_frames(&[0], &mut 0, 1000, 10, true).is_err(),
            "no frame"
        );
        assert!(
            read_frames(&[65], &mut 0, 1000, 10, true).is_err(),
            "too many frames"
        );
    }
}
