//! `libtandem_preload.so`: loaded into an unmodified QEMU with `LD_PRELOAD`.
//!
//! Its constructor starts one thread that waits for the guest-RAM mapping (the file named by
//! `TANDEM_RAM_PATH`) to appear in `/proc/self/maps`, then registers it with a userfaultfd in
//! asynchronous write-protect mode (`UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED`) and
//! write-protects the whole range. From then on the kernel itself records which pages QEMU (or
//! the guest through QEMU's mapping) writes, and tandem harvests them from outside with the
//! `PAGEMAP_SCAN` ioctl on `/proc/<pid>/pagemap`. No fault handling happens in QEMU: async
//! write-protect resolves faults in the kernel. The thread reports the outcome in the file named
//! by `TANDEM_UFFD_STATUS` (`ok start=0x.. len=.. features=0x..` or `err MESSAGE`) and exits,
//! keeping the userfaultfd open for the life of the process.
//!
//! QEMU must be started with `-S` so the guest does not run before registration is confirmed.
//!
//! With `TANDEM_UFFD_MODE=missing` (a backup's standby whose mirror is consolidated) it
//! registers the mapping for *missing* faults instead and reports the descriptor's number
//! (`ok start=.. len=.. fd=N`): the backup takes a copy with `pidfd_getfd(2)` and, at a
//! failover, serves the pages the guest touches first from its consolidated store while it
//! installs the rest (tandem-consolidate's lazy restore, as QEMU's postcopy does).

#![warn(missing_docs)]

use std::fs;
use std::io;
use std::time::{Duration, Instant};

/// Kernel ABI constants missing from Debian 12's headers (from linux/userfaultfd.h, 6.7+).
pub mod abi {
    /// `UFFD_API`.
    pub const UFFD_API: u64 = 0xAA;
    /// `UFFD_FEATURE_WP_HUGETLBFS_SHMEM`.
    pub const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
    /// `UFFD_FEATURE_WP_UNPOPULATED`.
    pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
    /// `UFFD_FEATURE_WP_ASYNC`.
    pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
    /// `UFFDIO_API = _IOWR(0xAA, 0x3F, struct uffdio_api)`.
    pub const UFFDIO_API: u64 = 0xC018_AA3F;
    /// `UFFDIO_REGISTER = _IOWR(0xAA, 0x00, struct uffdio_register)`.
    pub const UFFDIO_REGISTER: u64 = 0xC020_AA00;
    /// `UFFDIO_WRITEPROTECT = _IOWR(0xAA, 0x06, struct uffdio_writeprotect)`.
    pub const UFFDIO_WRITEPROTECT: u64 = 0xC018_AA06;
    /// `UFFD_FEATURE_MISSING_SHMEM`.
    pub const UFFD_FEATURE_MISSING_SHMEM: u64 = 1 << 5;
    /// `UFFDIO_REGISTER_MODE_MISSING`.
    pub const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
    /// `UFFDIO_REGISTER_MODE_WP`.
    pub const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
    /// `UFFDIO_WRITEPROTECT_MODE_WP`.
    pub const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;

    /// `struct uffdio_api`.
    #[repr(C)]
    #[derive(Default)]
    pub struct UffdioApi {
        /// API version requested.
        pub api: u64,
        /// Features requested / granted.
        pub features: u64,
        /// ioctls supported (out).
        pub ioctls: u64,
    }
    /// `struct uffdio_range`.
    #[repr(C)]
    #[derive(Default)]
    pub struct UffdioRange {
        /// Start address.
        pub start: u64,
        /// Length in bytes.
        pub len: u64,
    }
    /// `struct uffdio_register`.
    #[repr(C)]
    #[derive(Default)]
    pub struct UffdioRegister {
        /// Range to register.
        pub range: UffdioRange,
        /// Registration mode.
        pub mode: u64,
        /// ioctls available on the range (out).
        pub ioctls: u64,
    }
    /// `struct uffdio_writeprotect`.
    #[repr(C)]
    #[derive(Default)]
    pub struct UffdioWriteprotect {
        /// Range to (un)protect.
        pub range: UffdioRange,
        /// Mode bits.
        pub mode: u64,
    }
}

/// Finds the mapping of `path` in a `/proc/<pid>/maps` text: `(start, len)` of the first line
/// whose pathname is exactly `path`, merged with directly following lines of the same file.
pub fn find_mapping(maps: &str, path: &str) -> Option<(u64, u64)> {
    let mut found: Option<(u64, u64)> = None;
    for line in maps.lines() {
        let mut parts = line.split_whitespace();
        let range = parts.next()?;
        let name = parts.nth(4).unwrap_or("");
        let (s, e) = range.split_once('-')?;
        let (s, e) = (
            u64::from_str_radix(s, 16).ok()?,
            u64::from_str_radix(e, 16).ok()?,
        );
        match found {
            None if name == path => found = Some((s, e)),
            Some((fs, fe)) if name == path && s == fe => found = Some((fs, e)),
            Some(_) => break,
            None => {}
        }
    }
    found.map(|(s, e)| (s, e - s))
}

fn ioctl<T>(fd: i32, req: u64, arg: &mut T) -> io::Result<()> {
    // SAFETY: `arg` is a valid, exclusively borrowed #[repr(C)] struct of the size encoded in
    // `req`; the kernel reads and writes only within it.
    let r = unsafe { libc::ioctl(fd, req as _, arg as *mut T) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Registers `[start, start+len)` of this process for async write-protect; returns the fd and
/// granted features. The fd must stay open for the tracking to continue.
pub fn register(start: u64, len: u64) -> io::Result<(i32, u64)> {
    register_as(start, len, false)
}

/// Registers `[start, start+len)` (shared memory) for missing faults, which the process
/// holding a copy of the returned fd must serve; returns the fd and granted features.
pub fn register_missing(start: u64, len: u64) -> io::Result<(i32, u64)> {
    register_as(start, len, true)
}

fn register_as(start: u64, len: u64, missing: bool) -> io::Result<(i32, u64)> {
    use abi::*;
    // SAFETY: plain syscall with integer flags; returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = fd as i32;
    let wanted = if missing {
        UFFD_FEATURE_MISSING_SHMEM
    } else {
        UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED
    };
    let mut api = UffdioApi {
        api: UFFD_API,
        features: wanted,
        ioctls: 0,
    };
    let res = (|| {
        ioctl(fd, UFFDIO_API, &mut api).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("UFFDIO_API (async write-protect unsupported?): {e}"),
            )
        })?;
        let range = UffdioRange { start, len };
        let mut reg = UffdioRegister {
            range,
            mode: if missing {
                UFFDIO_REGISTER_MODE_MISSING
            } else {
                UFFDIO_REGISTER_MODE_WP
            },
            ioctls: 0,
        };
        ioctl(fd, UFFDIO_REGISTER, &mut reg)
            .map_err(|e| io::Error::new(e.kind(), format!("UFFDIO_REGISTER: {e}")))?;
        if missing {
            return Ok(());
        }
        let range = UffdioRange { start, len };
        let mut wp = UffdioWriteprotect {
            range,
            mode: UFFDIO_WRITEPROTECT_MODE_WP,
        };
        ioctl(fd, UFFDIO_WRITEPROTECT, &mut wp)
            .map_err(|e| io::Error::new(e.kind(), format!("UFFDIO_WRITEPROTECT: {e}")))
    })();
    match res {
        Ok(()) => Ok((fd, api.features)),
        Err(e) => {
            // SAFETY: fd is ours and not used after this point.
            unsafe { libc::close(fd) };
            Err(e)
        }
    }
}

fn report(status: &str, text: &str) {
    let tmp = format!("{status}.tmp");
    if fs::write(&tmp, text).is_ok() {
        let _ = fs::rename(&tmp, status);
    }
}

/// The file a `/proc/<pid>/fd/<n>` path stands for, as `/proc/self/maps` names it (a
/// restarted standby opens the backup's mirror through its descriptor after the name was
/// removed; maps then shows the original path followed by ` (deleted)`).
pub fn mapped_name(path: &str) -> String {
    if !path.starts_with("/proc/") {
        return path.to_string();
    }
    match fs::read_link(path) {
        Ok(t) => {
            let t = t.to_string_lossy().into_owned();
            t.strip_suffix(" (deleted)")
                .map(str::to_string)
                .unwrap_or(t)
        }
        Err(_) => path.to_string(),
    }
}

fn run(ram_path: String, status: String, missing: bool) {
    let ram_path = mapped_name(&ram_path);
    let deadline = Instant::now() + Duration::from_secs(30);
    let (start, len) = loop {
        if let Ok(maps) = fs::read_to_string("/proc/self/maps") {
            if let Some(m) = find_mapping(&maps, &ram_path) {
                break m;
            }
        }
        if Instant::now() > deadline {
            report(
                &status,
                &format!("err guest RAM mapping of {ram_path} not found in 30 s\n"),
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    match register_as(start, len, missing) {
        Ok((fd, features)) => report(
            &status,
            &format!("ok start={start:#x} len={len} features={features:#x} fd={fd}\n"),
        ),
        Err(e) => report(&status, &format!("err {e}\n")),
    }
}

extern "C" fn tandem_preload_init() {
    let (Ok(ram), Ok(status)) = (
        std::env::var("TANDEM_RAM_PATH"),
        std::env::var("TANDEM_UFFD_STATUS"),
    ) else {
        return;
    };
    // Children QEMU might spawn must not register anything.
    std::env::remove_var("LD_PRELOAD");
    let missing = std::env::var("TANDEM_UFFD_MODE").is_ok_and(|m| m == "missing");
    let _ = std::thread::Builder::new()
        .name("tandem-uffd".into())
        .spawn(move || run(ram, status, missing));
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = tandem_preload_init;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_and_merges_mapping() {
        let maps = "\
7f0000000000-7f0000100000 rw-s 00000000 00:1a 12 /dev/shm/vm\n\
7f0000100000-7f0000200000 rw-s 00100000 00:1a 12 /dev/shm/vm\n\
7f0000200000-7f0000201000 ---p 00000000 00:00 0 \n";
        assert_eq!(
            find_mapping(maps, "/dev/shm/vm"),
            Some((0x7f00_0000_0000, 0x20_0000))
        );
        assert_eq!(find_mapping(maps, "/dev/shm/other"), None);
    }

    #[test]
    fn descriptor_paths_resolve_to_the_mapped_name() {
        let d = std::env::temp_dir().join(format!("tandem-preload-{}", std::process::id()));
        std::fs::write(&d, b"x").unwrap();
        let f = std::fs::File::open(&d).unwrap();
        std::fs::remove_file(&d).unwrap();
        let by_fd = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&f));
        assert_eq!(mapped_name(&by_fd), d.display().to_string());
        assert_eq!(mapped_name("/dev/shm/vm"), "/dev/shm/vm");
    }

    #[test]
    fn registers_own_anonymous_memory() {
        let len = 16 * 4096;
        // SAFETY: fresh private anonymous mapping, unmapped at the end of the test.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        match register(p as u64, len as u64) {
            Ok((fd, features)) => {
                assert_ne!(features & abi::UFFD_FEATURE_WP_ASYNC, 0);
                // Writing must not block: async mode resolves the fault in the kernel.
                // SAFETY: p points to `len` writable bytes.
                unsafe { std::ptr::write_bytes(p as *mut u8, 7, len) };
                // SAFETY: fd is ours.
                unsafe { libc::close(fd) };
            }
            Err(e) => eprintln!("kernel lacks async uffd-wp here: {e}"),
        }
        // SAFETY: unmapping the mapping created above.
        unsafe { libc::munmap(p, len) };
    }
}
