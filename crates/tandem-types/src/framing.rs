//! The small framing helper under tandem's four binary formats (replication frames, codec
//! records, the checkpoint store, traces): magic checks, CRC32C over a header and its body,
//! and little-endian fields at fixed offsets. Reads are bounds-checked: a field past the end
//! reads as 0 (callers check lengths first and never act on a short buffer; no read panics).

/// Whether `b` starts with `magic`.
pub fn has_magic(b: &[u8], magic: &[u8]) -> bool {
    b.get(..magic.len()) == Some(magic)
}

/// CRC32C (Castagnoli) of the concatenation of `parts`.
pub fn crc32c(parts: &[&[u8]]) -> u32 {
    parts.iter().fold(0, |c, p| crc32c::crc32c_append(c, p))
}

fn array<const N: usize>(b: &[u8], o: usize) -> [u8; N] {
    o.checked_add(N)
        .and_then(|end| b.get(o..end))
        .and_then(|s| s.try_into().ok())
        .unwrap_or([0; N])
}

/// The little-endian `u16` at offset `o` (0 past the end).
pub fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(array(b, o))
}

/// The little-endian `u32` at offset `o` (0 past the end).
pub fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(array(b, o))
}

/// The little-endian `u64` at offset `o` (0 past the end).
pub fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(array(b, o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_read_little_endian_and_past_the_end_as_zero() {
        let b = [1u8, 2, 3, 4, 5, 6, 7, 8, 9];
        assert_eq!(u16_at(&b, 0), 0x0201);
        assert_eq!(u32_at(&b, 1), 0x0504_0302);
        assert_eq!(u64_at(&b, 1), 0x0908_0706_0504_0302);
        assert_eq!(u64_at(&b, 2), 0);
        assert_eq!(u32_at(&b, usize::MAX), 0);
        assert!(has_magic(&b, &[1, 2]) && !has_magic(&b, &[2]) && !has_magic(&b[..1], &[1, 2]));
    }

    #[test]
    fn crc_of_parts_is_the_crc_of_their_concatenation() {
        let (a, b) = (b"header".as_slice(), b"and its body".as_slice());
        assert_eq!(crc32c(&[a, b]), crc32c::crc32c(b"headerand its body"));
        assert_eq!(crc32c(&[]), crc32c::crc32c(b""));
    }
}
