//! Giving the memory behind mirror pages back to the kernel.

/// Frees the memory behind `mirror[start..start + len]` (page-aligned offsets) and leaves it
/// reading as zeros: `MADV_REMOVE` punches the hole in a shared tmpfs mapping (the backup's
/// mirror file), `MADV_DONTNEED` frees a private anonymous one; anything else (a heap buffer
/// in a test) is zero-filled. Returns whether memory was actually freed.
pub fn release(mirror: &mut [u8], start: usize, len: usize) -> bool {
    let range = &mut mirror[start..start + len];
    let ptr = range.as_mut_ptr();
    if (ptr as usize).is_multiple_of(crate::PAGE) {
        for advice in [
            rustix::mm::Advice::LinuxRemove,
            rustix::mm::Advice::LinuxDontNeed,
        ] {
            // SAFETY: `ptr..ptr + len` lies inside `mirror`, which we borrow exclusively, so
            // no other reference into it exists during or after the call. Both advices only
            // replace the range's contents with zeros (for REMOVE by punching the file's
            // hole, which the caller owns), which is a valid value for bytes.
            if unsafe { rustix::mm::madvise(ptr.cast(), len, advice) }.is_ok() {
                return true;
            }
        }
    }
    range.fill(0);
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_anonymous_page_reads_zero_and_is_freed() {
        let mut m = memmap2::MmapMut::map_anon(4 * crate::PAGE).unwrap();
        m.fill(7);
        assert!(release(&mut m, crate::PAGE, 2 * crate::PAGE));
        assert!(m[crate::PAGE..3 * crate::PAGE].iter().all(|&b| b == 0));
        assert!(m[..crate::PAGE].iter().all(|&b| b == 7));
        assert!(m[3 * crate::PAGE..].iter().all(|&b| b == 7));
    }

    #[test]
    fn a_released_tmpfs_page_is_a_hole() {
        use std::os::unix::fs::MetadataExt;
        let f = tempfile_in_shm();
        f.set_len(8 * crate::PAGE as u64).unwrap();
        // SAFETY: the file is private to this test and not resized while mapped.
        let mut m = unsafe { memmap2::MmapMut::map_mut(&f) }.unwrap();
        m.fill(1);
        let before = f.metadata().unwrap().blocks();
        assert!(release(&mut m, 0, 4 * crate::PAGE));
        let after = f.metadata().unwrap().blocks();
        assert!(m[..4 * crate::PAGE].iter().all(|&b| b == 0));
        assert_eq!(before - after, (4 * crate::PAGE / 512) as u64);
    }

    fn tempfile_in_shm() -> std::fs::File {
        let p = std::path::Path::new("/dev/shm")
            .join(format!("tandem-consolidate-test-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        std::fs::remove_file(&p).unwrap();
        f
    }
}
