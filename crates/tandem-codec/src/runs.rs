//! Run-length patches: alternating runs of unchanged and replaced units against a base.
//!
//! Stream: `skip₀ len₀ lit₀ skip₁ len₁ lit₁ …`, each count ULEB128, `lit` = `len × unit` bytes
//! of new content. With a 1-byte unit and maximal runs this is byte-for-byte QEMU's XBZRLE
//! encoding (zero run, non-zero run, trailing zero run omitted); with an 8-byte unit it is
//! FITDOC's word delta; against an all-zero base it is FGBI's sparse block (offset/value).

/// Appends `v` as ULEB128.
pub fn put_uleb(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads a ULEB128 value at `*pos`; `None` if truncated or longer than 10 bytes.
pub fn get_uleb(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..70).step_by(7) {
        let b = *buf.get(*pos)?;
        *pos += 1;
        if shift == 63 && b > 1 {
            return None;
        }
        v |= ((b & 0x7f) as u64) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// Appends `v − from` as a zigzag ULEB128 (0, −1, 1, −2, … → 0, 1, 2, 3, …); page numbers,
/// which differ by far less than 2⁶³.
pub(crate) fn put_rel(out: &mut Vec<u8>, v: u64, from: u64) {
    let d = v.wrapping_sub(from) as i64;
    put_uleb(out, ((d << 1) ^ (d >> 63)) as u64);
}

/// Reads a value written by [`put_rel`] against `from`; `None` if truncated or out of range.
pub(crate) fn get_rel(buf: &[u8], pos: &mut usize, from: u64) -> Option<u64> {
    let z = get_uleb(buf, pos)?;
    if z & 1 == 0 {
        from.checked_add(z >> 1)
    } else {
        from.checked_sub((z >> 1) + 1)
    }
}

#[inline]
fn word(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default())
}

/// First index `>= i` where `old` and `new` differ (byte granularity), or `len`.
#[inline]
fn first_diff(old: &[u8], new: &[u8], mut i: usize) -> usize {
    let n = new.len();
    // Skip equal 64-byte stretches with the library's vectorised comparison.
    while i + 64 <= n && old[i..i + 64] == new[i..i + 64] {
        i += 64;
    }
    while i + 8 <= n {
        let x = word(old, i) ^ word(new, i);
        if x != 0 {
            return i + (x.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && old[i] == new[i] {
        i += 1;
    }
    i
}

/// [`first_diff`] on a 4 KiB page whose differing 64-byte blocks are the set bits of `mask`
/// (bit b: bytes b·64..b·64+64): unchanged blocks are skipped without reading them.
#[inline]
fn first_diff_masked(old: &[u8], new: &[u8], mut i: usize, mask: u64) -> usize {
    let n = new.len();
    while i < n {
        let b = i / 64;
        let rest = mask >> b;
        if rest == 0 {
            return n;
        }
        let next = b + rest.trailing_zeros() as usize;
        if next > b {
            i = next * 64;
        }
        let end = (i / 64 + 1) * 64;
        while i + 8 <= end {
            let x = word(old, i) ^ word(new, i);
            if x != 0 {
                return i + (x.trailing_zeros() / 8) as usize;
            }
            i += 8;
        }
        while i < end {
            if old[i] != new[i] {
                return i;
            }
            i += 1;
        }
    }
    n
}

/// First index `>= i` where `old` and `new` are equal (byte granularity), or `len`.
#[inline]
fn first_same(old: &[u8], new: &[u8], mut i: usize) -> usize {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let n = new.len();
    while i + 8 <= n {
        let x = word(old, i) ^ word(new, i);
        // Lowest zero byte of x (the lowest flagged byte of this classic test is exact).
        let z = x.wrapping_sub(LO) & !x & HI;
        if z != 0 {
            return i + (z.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && old[i] != new[i] {
        i += 1;
    }
    i
}

/// First 8-byte-aligned word index `>= i` (a byte offset) whose words differ / are equal.
#[inline]
fn first_word(old: &[u8], new: &[u8], mut i: usize, differ: bool) -> usize {
    if differ {
        while i + 64 <= new.len() && old[i..i + 64] == new[i..i + 64] {
            i += 64;
        }
    }
    while i < new.len() && ((word(old, i) != word(new, i)) != differ) {
        i += 8;
    }
    i
}

/// Encodes `new` against `old` with `unit`-byte granularity (1 or 8), appending to `out`.
/// Returns `None` as soon as the output would exceed `limit` bytes (then `out` is restored).
pub fn encode(
    old: &[u8],
    new: &[u8],
    unit: usize,
    limit: usize,
    out: &mut Vec<u8>,
) -> Option<usize> {
    debug_assert!(
        old.len() == new.len() && new.len().is_multiple_of(unit) && (unit == 1 || unit == 8)
    );
    if unit == 1 {
        emit(
            new,
            1,
            Bounds::plain(limit),
            out,
            |i| first_diff(old, new, i),
            |i| first_same(old, new, i),
        )
    } else {
        emit(
            new,
            unit,
            Bounds::plain(limit),
            out,
            |i| first_word(old, new, i, true),
            |i| first_word(old, new, i, false),
        )
    }
}

/// [`encode`] with 1-byte units of a 4 KiB page whose differing 64-byte blocks are exactly the
/// set bits of `mask`, without reading the unchanged blocks. With `gap` 0 this is the same
/// stream; otherwise unchanged stretches of at most `gap` bytes inside a changed region are
/// sent as part of it: one run instead of two saves a run header (2 bytes or more) and keeps a
/// changed structure in one piece for the record's zstd pass.
///
/// A patch may grow past `limit` up to `regular` bytes while it is regular: 16 runs or more,
/// at least half of them repeating the previous run's header, and at most 4 bytes of patch per
/// run: one short field changed in every element of an array (a counter, a timestamp, a
/// flag). Its headers then compress to almost nothing, where the record's zstd pass over the
/// page and its previous version would pay for a match per run.
#[allow(clippy::too_many_arguments)]
pub fn encode_masked(
    old: &[u8],
    new: &[u8],
    mask: u64,
    gap: usize,
    limit: usize,
    regular: usize,
    out: &mut Vec<u8>,
) -> Option<usize> {
    let b = Bounds {
        gap,
        limit,
        regular,
        whole: false,
    };
    emit_masked(old, new, mask, b, out)
}

/// [`encode_masked`] with maximal runs (gap 0) whose regularity counts only runs that repeat
/// the run before exactly, header and literal: one field set to the same value in every
/// element of an array (a generation number, a flag). Such a patch compresses to almost
/// nothing in the record, where the record's zstd pass over the page would pay for a match
/// per element. A patch that is not such stops at `limit`, one that is may grow to
/// `regular` bytes.
pub fn encode_masked_repeating(
    old: &[u8],
    new: &[u8],
    mask: u64,
    limit: usize,
    regular: usize,
    out: &mut Vec<u8>,
) -> Option<usize> {
    let b = Bounds {
        gap: 0,
        limit,
        regular,
        whole: true,
    };
    emit_masked(old, new, mask, b, out)
}

/// [`emit`] over a 4 KiB page whose differing 64-byte blocks are the set bits of `mask`.
fn emit_masked(old: &[u8], new: &[u8], mask: u64, b: Bounds, out: &mut Vec<u8>) -> Option<usize> {
    debug_assert!(old.len() == 4096 && new.len() == 4096);
    emit(
        new,
        1,
        b,
        out,
        |i| first_diff_masked(old, new, i, mask),
        |i| first_same(old, new, i),
    )
}

/// How a run stream is cut and how far it may grow (see [`emit`]).
#[derive(Debug, Clone, Copy)]
struct Bounds {
    /// Unchanged stretches of at most this many bytes join two replaced runs.
    gap: usize,
    /// Largest patch while it is not regular.
    limit: usize,
    /// Largest patch while it is regular.
    regular: usize,
    /// Regularity counts only runs equal to the run before in header *and* literal.
    whole: bool,
}

impl Bounds {
    /// Maximal runs, one limit.
    fn plain(limit: usize) -> Self {
        Bounds {
            gap: 0,
            limit,
            regular: limit,
            whole: false,
        }
    }
}

/// The run stream of `new`: `diff(i)` / `same(i)` find the next replaced / unchanged unit at
/// or after byte `i`. An unchanged stretch of at most `b.gap` bytes between two replaced runs
/// joins them (0: maximal runs, XBZRLE's stream). Stops with `None` (and `out` restored) past
/// `b.limit` bytes, or past `b.regular` bytes while the patch so far is regular (see
/// [`encode_masked`]).
#[inline]
fn emit(
    new: &[u8],
    unit: usize,
    b: Bounds,
    out: &mut Vec<u8>,
    diff: impl Fn(usize) -> usize,
    same: impl Fn(usize) -> usize,
) -> Option<usize> {
    let start = out.len();
    let n = new.len();
    // Runs so far, and how many had the same header (skip, length) as the run before (and,
    // with `b.whole`, the same literal: `last_at` is where the previous one started).
    let (mut runs, mut repeats, mut last, mut last_at) = (0usize, 0usize, (usize::MAX, 0), 0);
    // Regular: at least REGULAR_MIN_RUNS runs, half of them repeating the previous header,
    // and short literals (at most 4 bytes of patch per run on average: where a long literal
    // would rather be found elsewhere by the prefix path).
    let cap = |runs: usize, repeats: usize, len: usize| {
        if runs >= REGULAR_MIN_RUNS && 2 * repeats >= runs && len <= 4 * runs {
            b.regular.max(b.limit)
        } else {
            b.limit
        }
    };
    // `at`: end of the previous replaced run; `next`: start of the next one (n: none left;
    // the trailing unchanged run is implicit).
    let mut at = 0;
    let mut next = diff(0);
    while next < n {
        let l = next;
        let mut e = same(l);
        loop {
            next = if e < n { diff(e) } else { n };
            if next >= n || next - e > b.gap {
                break;
            }
            e = same(next);
            // A long joined run (a rewritten page with a few equal bytes) stops at the limit
            // as soon as maximal runs would.
            if out.len() - start + (e - l) > cap(runs, repeats, out.len() - start) {
                out.truncate(start);
                return None;
            }
        }
        let head = (l - at, e - l);
        let same_run = head == last && (!b.whole || new[l..e] == new[last_at..last_at + head.1]);
        repeats += same_run as usize;
        runs += 1;
        last = head;
        last_at = l;
        put_uleb(out, (head.0 / unit) as u64);
        put_uleb(out, (head.1 / unit) as u64);
        if out.len() - start + (e - l) > cap(runs, repeats, out.len() - start) {
            out.truncate(start);
            return None;
        }
        out.extend_from_slice(&new[l..e]);
        at = e;
    }
    Some(out.len() - start)
}

/// Fewest runs before a patch counts as regular (its headers then compress to almost nothing,
/// whatever its length).
const REGULAR_MIN_RUNS: usize = 16;

/// Splits the encoder's own 1-byte-unit run stream into its run headers (appended to
/// `heads`) and its literals (appended to `lits`): the split form of FLAG_SPLIT records.
pub fn split(stream: &[u8], heads: &mut Vec<u8>, lits: &mut Vec<u8>) {
    debug_assert!(check(stream, 1, 4096));
    let mut pos = 0;
    while pos < stream.len() {
        let s = pos;
        let (Some(_), Some(n)) = (get_uleb(stream, &mut pos), get_uleb(stream, &mut pos)) else {
            break;
        };
        heads.extend_from_slice(&stream[s..pos]);
        let end = pos.saturating_add(n as usize).min(stream.len());
        lits.extend_from_slice(&stream[pos..end]);
        pos = end;
    }
}

/// Walks the split form of a run stream of exactly `len` bytes: run headers read from
/// `heads` at `*h`, literals from `lits` at `*l` (both advanced), calling
/// `f(from, header bytes, literal)` for each replaced run of a `page_len`-byte page. Fails
/// when the headers run out, a run is empty or leaves the page, or the pieces do not add up
/// to `len`.
pub fn walk_split(
    heads: &[u8],
    h: &mut usize,
    lits: &[u8],
    l: &mut usize,
    len: usize,
    page_len: usize,
    mut f: impl FnMut(usize, &[u8], &[u8]),
) -> Result<(), &'static str> {
    let (mut done, mut at) = (0usize, 0usize);
    while done < len {
        let s = *h;
        let (Some(skip), Some(n)) = (get_uleb(heads, h), get_uleb(heads, h)) else {
            return Err("run headers truncated");
        };
        let head = *h - s;
        let n = usize::try_from(n).map_err(|_| "run length too large")?;
        if n == 0 || n > lits.len() - *l || head + n > len - done {
            return Err("run literal empty or longer than its payload");
        }
        let from = usize::try_from(skip)
            .ok()
            .and_then(|k| k.checked_add(at))
            .filter(|&from| from <= page_len && n <= page_len - from)
            .ok_or("run past the end of the page")?;
        f(from, &heads[s..*h], &lits[*l..*l + n]);
        *l += n;
        at = from + n;
        done += head + n;
    }
    Ok(())
}

/// Rebuilds a run stream of exactly `len` bytes from its split form ([`walk_split`]) and
/// appends it to `out`.
pub fn join(
    heads: &[u8],
    h: &mut usize,
    lits: &[u8],
    l: &mut usize,
    len: usize,
    out: &mut Vec<u8>,
) -> Result<(), &'static str> {
    walk_split(heads, h, lits, l, len, usize::MAX, |_, head, lit| {
        out.extend_from_slice(head);
        out.extend_from_slice(lit);
    })
}

/// Walks a run stream for a page of `page_len` bytes, calling `f(from, literal)` for each
/// replaced run. `false` if the stream is malformed or runs past the page (runs seen before
/// the fault have been passed to `f`).
fn walk(stream: &[u8], unit: usize, page_len: usize, mut f: impl FnMut(usize, &[u8])) -> bool {
    let mut pos = 0;
    let mut at = 0usize;
    while pos < stream.len() {
        let (Some(skip), Some(len)) = (get_uleb(stream, &mut pos), get_uleb(stream, &mut pos))
        else {
            return false;
        };
        let (Some(skip), Some(len)) = (usize::try_from(skip).ok(), usize::try_from(len).ok())
        else {
            return false;
        };
        let Some(from) = skip.checked_mul(unit).and_then(|s| s.checked_add(at)) else {
            return false;
        };
        let Some(to) = len.checked_mul(unit).and_then(|l| l.checked_add(from)) else {
            return false;
        };
        if to > page_len || len == 0 || stream.len() - pos < to - from {
            return false;
        }
        f(from, &stream[pos..pos + (to - from)]);
        pos += to - from;
        at = to;
    }
    true
}

/// Applies a run stream to `page` (which holds the base). `false` if the stream is malformed
/// or runs past the page.
pub fn apply(stream: &[u8], unit: usize, page: &mut [u8]) -> bool {
    let len = page.len();
    walk(stream, unit, len, |from, lit| {
        page[from..from + lit.len()].copy_from_slice(lit)
    })
}

/// Whether `stream` is a well-formed run stream that stays inside `page_len` bytes, i.e.
/// exactly when [`apply`] on such a page would return `true`.
pub fn check(stream: &[u8], unit: usize, page_len: usize) -> bool {
    walk(stream, unit, page_len, |_, _| {})
}

#[cfg(test)]
mod tests;
