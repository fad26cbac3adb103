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

/// Allocates the memory behind `mirror[start..start + len]` (page-aligned offsets) before it
/// is written, so that a full tmpfs is an error here and not a SIGBUS in the middle of a
/// write through the mapping (`MADV_POPULATE_WRITE`, Linux 5.14+; on an older kernel or an
/// unaligned test buffer this does nothing). Contents are unchanged.
pub fn populate(mirror: &mut [u8], start: usize, len: usize) -> std::io::Result<()> {
    let range = &mut mirror[start..start + len];
    let ptr = range.as_mut_ptr();
    if len == 0 || !(ptr as usize).is_multiple_of(crate::PAGE) {
        return Ok(());
    }
    // SAFETY: `ptr..ptr + len` lies inside `mirror`, which we borrow exclusively. Populating
    // for write only allocates (and maps) what is not there yet; no byte changes.
    match unsafe { rustix::mm::madvise(ptr.cast(), len, rustix::mm::Advice::LinuxPopulateWrite) } {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::INVAL) => Ok(()), // kernel without MADV_POPULATE_WRITE
        Err(e) => Err(std::io::Error::other(format!(
            "no memory for {len} bytes of the mirror ({e}; is its tmpfs full?)"
        ))),
    }
}

/// [`populate`] for every page of `pfns` (sorted), a run of consecutive pages at a time.
pub fn populate_pages(mirror: &mut [u8], pfns: &[u64]) -> std::io::Result<()> {
    let mut i = 0;
    while i < pfns.len() {
        let mut j = i + 1;
        while j < pfns.len() && pfns[j] == pfns[j - 1] + 1 {
            j += 1;
        }
        let n = (pfns[j - 1] - pfns[i] + 1) as usize;
        populate(mirror, pfns[i] as usize * crate::PAGE, n * crate::PAGE)?;
        i = j;
    }
    Ok(())
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

    #[test]
    fn a_full_tmpfs_is_an_error_before_the_write_not_a_sigbus() {
        let dir = std::path::Path::new("/dev/shm")
            .join(format!("tandem-populate-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            let _ = std::fs::remove_dir(&dir);
            return eprintln!("cannot mount a small tmpfs here (not root?)");
        }
        let r = (|| {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.join("mirror"))?;
            f.set_len(32 * crate::PAGE as u64)?;
            // SAFETY: the file is private to this test and not resized while mapped.
            let mut m = unsafe { memmap2::MmapMut::map_mut(&f) }?;
            populate(&mut m, 0, 8 * crate::PAGE)?; // fits in 64 KiB
            Ok::<_, std::io::Error>(populate(&mut m, 0, 32 * crate::PAGE).is_err())
        })();
        let _ = std::process::Command::new("umount").arg(&dir).status();
        let _ = std::fs::remove_dir(&dir);
        assert!(r.unwrap(), "populating past a full tmpfs must fail");
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
