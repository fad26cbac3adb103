//! Giving the memory behind mirror pages back to the kernel, and taking it back.

/// Frees the memory behind `mirror[start..start + len]` (page-aligned offsets) and leaves it
/// reading as zeros. On a shared tmpfs mapping (the backup's mirror file) `MADV_REMOVE`
/// punches a hole in the file: returns true. Anything else (a file system that cannot punch,
/// anonymous or heap memory in a test) is zero-filled and keeps its memory: returns false.
pub fn release(mirror: &mut [u8], start: usize, len: usize) -> bool {
    let range = &mut mirror[start..start + len];
    let ptr = range.as_mut_ptr();
    if (ptr as usize).is_multiple_of(crate::PAGE) {
        // SAFETY: `ptr..ptr + len` lies inside `mirror`, which we borrow exclusively, so no
        // other reference into it exists during or after the call. MADV_REMOVE only punches
        // the range out of the file behind a shared mapping (which the caller owns); the
        // range then reads as zeros, a valid value for bytes. It fails, changing nothing, on
        // any other mapping.
        let punched =
            unsafe { rustix::mm::madvise(ptr.cast(), len, rustix::mm::Advice::LinuxRemove) };
        if punched.is_ok() {
            return true;
        }
    }
    range.fill(0);
    false
}

/// A zeroed shared-memory mapping of `len` bytes (an unlinked memfd, i.e. tmpfs) whose pages
/// [`release`] can punch: a mirror for tests, fuzzing and benchmarks.
pub fn shm(len: usize) -> std::io::Result<memmap2::MmapMut> {
    let fd = rustix::fs::memfd_create("tandem-mirror", rustix::fs::MemfdFlags::CLOEXEC)?;
    let f = std::fs::File::from(fd);
    f.set_len(len as u64)?;
    // SAFETY: the memfd is this function's own, unnamed and never resized; the mapping keeps
    // it alive and nothing else can reach it.
    unsafe { memmap2::MmapMut::map_mut(&f) }
}

/// Faults in `mirror[start..start + len]` for reading before it is read, so that a full tmpfs
/// is an error (a hole needs a page even to be read) and not a SIGBUS; like [`populate`].
pub fn populate_read(mirror: &mut [u8], start: usize, len: usize) -> std::io::Result<()> {
    advise_populate(mirror, start, len, rustix::mm::Advice::LinuxPopulateRead)
}

/// Allocates the memory behind `mirror[start..start + len]` (page-aligned offsets) before it
/// is written, so that a full tmpfs is an error here and not a SIGBUS in the middle of a
/// write through the mapping (`MADV_POPULATE_WRITE`, Linux 5.14+; on an older kernel or an
/// unaligned test buffer this does nothing). Contents are unchanged.
pub fn populate(mirror: &mut [u8], start: usize, len: usize) -> std::io::Result<()> {
    advise_populate(mirror, start, len, rustix::mm::Advice::LinuxPopulateWrite)
}

fn advise_populate(
    mirror: &mut [u8],
    start: usize,
    len: usize,
    advice: rustix::mm::Advice,
) -> std::io::Result<()> {
    let range = &mut mirror[start..start + len];
    let ptr = range.as_mut_ptr();
    if len == 0 || !(ptr as usize).is_multiple_of(crate::PAGE) {
        return Ok(());
    }
    // SAFETY: `ptr..ptr + len` lies inside `mirror`, which we borrow exclusively. Populating
    // only allocates (and maps) what is not there yet; no byte changes.
    match unsafe { rustix::mm::madvise(ptr.cast(), len, advice) } {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::INVAL) => Ok(()), // a kernel older than 5.14
        Err(e) => Err(std::io::Error::other(format!(
            "no memory for {len} bytes of the mirror ({e}; is its tmpfs full?)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_anonymous_page_reads_zero() {
        let mut m = memmap2::MmapMut::map_anon(4 * crate::PAGE).unwrap();
        m.fill(7);
        assert!(
            !release(&mut m, crate::PAGE, 2 * crate::PAGE),
            "nothing to punch"
        );
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
