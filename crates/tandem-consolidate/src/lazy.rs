//! Lazy restore at a failover, as QEMU's postcopy does it: the standby QEMU's guest RAM is
//! registered for userfaultfd *missing* faults (by the preloaded library; the backup holds a
//! copy of the descriptor). The guest resumes at once; a page it touches that is still in the
//! consolidated store is decompressed and installed with `UFFDIO_COPY` (atomically: the
//! guest never sees a half-written page), and between faults the rest are installed in page
//! order. Once every consolidated page is in, the range is unregistered: the holes left are
//! zero pages, which the kernel fills by itself from then on.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::{Pool, Replica, PAGE};

const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
/// `_IOWR(0xAA, 0x03, struct uffdio_copy)`.
const UFFDIO_COPY: u64 = 0xC028_AA03;
/// `_IOR(0xAA, 0x02, struct uffdio_range)`.
const UFFDIO_WAKE: u64 = 0x8010_AA02;
/// `_IOR(0xAA, 0x01, struct uffdio_range)`.
const UFFDIO_UNREGISTER: u64 = 0x8010_AA01;
/// Background pages installed between two looks at the fault queue.
const BATCH: usize = 16;

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

/// A page-aligned page (`UFFDIO_COPY` wants an aligned source).
#[repr(C, align(4096))]
struct Page([u8; PAGE]);

/// What the lazy restore did.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct LazyStats {
    /// Faults of the guest served (pages it touched before the background reached them).
    pub faults: u64,
    /// Of which on pages the mirror held as holes (zeros).
    pub zero_faults: u64,
    /// Pages installed in the background.
    pub background: u64,
    /// From the start of serving to the first fault, ms.
    pub first_fault_ms: Option<f64>,
    /// From the start of serving to the last consolidated page installed, ms.
    pub done_ms: f64,
}

/// Why the lazy restore stopped early (QEMU gone, in practice). The range stays registered
/// and nobody serves it any more: the caller must stop the guest.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    /// Reading the fault queue failed.
    #[error("reading the userfaultfd")]
    Read(#[source] io::Error),
    /// A page still in the store was present in the guest's memory already, with other
    /// content: it cannot be installed without the guest having seen the wrong one.
    #[error("guest page {pfn} was present before its content was installed")]
    Present {
        /// The page.
        pfn: u64,
    },
    /// Installing a page failed.
    #[error("installing guest page {pfn} with UFFDIO_COPY")]
    Copy {
        /// The page.
        pfn: u64,
        /// The error.
        #[source]
        source: io::Error,
    },
}

/// The serving thread.
pub struct Lazy {
    thread: std::thread::JoinHandle<(Replica, Result<LazyStats, LazyError>)>,
}

impl Lazy {
    /// Starts serving `uffd` for guest RAM at `start` (the standby QEMU's address) from
    /// `replica`'s consolidated pages. Call before the guest resumes: loading its device state
    /// already reads guest memory.
    pub fn start(
        uffd: OwnedFd,
        start: u64,
        replica: Replica,
        pool: Arc<Mutex<Pool>>,
    ) -> io::Result<Lazy> {
        let thread = std::thread::Builder::new()
            .name("lazy-restore".into())
            .spawn(move || {
                let mut s = Server {
                    uffd,
                    start,
                    replica,
                    pool,
                    page: Box::new(Page([0; PAGE])),
                    stats: LazyStats::default(),
                    t0: Instant::now(),
                };
                let r = s.run();
                if r.is_ok() {
                    // Every consolidated page is in: the holes left are zero pages, which
                    // the kernel fills by itself from now on. (On an error the range stays
                    // registered, so that the guest blocks rather than read a missing page
                    // as zeros, until the caller stops it.)
                    let _ = s.ioctl(
                        UFFDIO_UNREGISTER,
                        &mut UffdioRange {
                            start,
                            len: s.replica.pages() * PAGE as u64,
                        },
                    );
                }
                (s.replica, r)
            })?;
        Ok(Lazy { thread })
    }

    /// Waits until every consolidated page is installed; returns the replica (now all plain)
    /// and what was done.
    pub fn wait(self) -> (Option<Replica>, Result<LazyStats, LazyError>) {
        match self.thread.join() {
            Ok((r, s)) => (Some(r), s),
            Err(_) => (
                None,
                Err(LazyError::Read(io::Error::other(
                    "the lazy-restore thread panicked",
                ))),
            ),
        }
    }
}

struct Server {
    uffd: OwnedFd,
    start: u64,
    replica: Replica,
    pool: Arc<Mutex<Pool>>,
    page: Box<Page>,
    stats: LazyStats,
    t0: Instant,
}

impl Server {
    fn run(&mut self) -> Result<LazyStats, LazyError> {
        let pages = self.replica.pages();
        let mut next = 0u64;
        loop {
            self.drain_faults()?;
            let mut n = 0;
            while next < pages && n < BATCH {
                if self.replica.is_consolidated(next) {
                    self.install(next, false)?;
                    self.stats.background += 1;
                    n += 1;
                }
                next += 1;
            }
            if next >= pages {
                self.drain_faults()?;
                self.stats.done_ms = self.t0.elapsed().as_secs_f64() * 1000.0;
                return Ok(self.stats);
            }
        }
    }

    /// Serves every fault queued now.
    fn drain_faults(&mut self) -> Result<(), LazyError> {
        let mut msg = [0u8; 32];
        loop {
            match rustix::io::read(&self.uffd, &mut msg) {
                Ok(32) => {}
                Ok(_) => return Ok(()),
                Err(rustix::io::Errno::AGAIN) => return Ok(()),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(LazyError::Read(e.into())),
            }
            if msg[0] != UFFD_EVENT_PAGEFAULT {
                continue;
            }
            let addr = u64::from_le_bytes(msg[16..24].try_into().unwrap_or_default());
            let off = addr.wrapping_sub(self.start);
            let pfn = off / PAGE as u64;
            if off >= self.replica.pages() * PAGE as u64 {
                continue; // not ours (cannot happen: only guest RAM is registered)
            }
            if self.stats.faults == 0 {
                self.stats.first_fault_ms = Some(self.t0.elapsed().as_secs_f64() * 1000.0);
            }
            self.stats.faults += 1;
            self.install(pfn, true)?;
        }
    }

    /// Installs page `pfn`: its consolidated content, or zeros for a hole (on a fault).
    fn install(&mut self, pfn: u64, fault: bool) -> Result<(), LazyError> {
        let has = {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            self.replica.take(&mut pool, pfn, &mut self.page.0)
        };
        if !has {
            if !fault {
                return Ok(());
            }
            self.stats.zero_faults += 1;
            self.page.0.fill(0);
        }
        let dst = self.start + pfn * PAGE as u64;
        let mut c = UffdioCopy {
            dst,
            src: self.page.0.as_ptr() as u64,
            len: PAGE as u64,
            mode: 0,
            copy: 0,
        };
        loop {
            match self.ioctl(UFFDIO_COPY, &mut c) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) && has => {
                    return Err(LazyError::Present { pfn });
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    // Present already (a plain page of the mirror): wake whoever faulted.
                    let mut r = UffdioRange {
                        start: dst,
                        len: PAGE as u64,
                    };
                    return self
                        .ioctl(UFFDIO_WAKE, &mut r)
                        .map_err(|source| LazyError::Copy { pfn, source });
                }
                Err(source) => return Err(LazyError::Copy { pfn, source }),
            }
        }
    }

    fn ioctl<T>(&self, req: u64, arg: &mut T) -> io::Result<()> {
        // SAFETY: `arg` is an exclusively borrowed #[repr(C)] struct of the size `req`
        // encodes; the kernel reads and writes only within it. UFFDIO_COPY's `src` points to
        // `self.page`, a live page-aligned buffer of `len` bytes.
        let r = unsafe { libc::ioctl(self.uffd.as_raw_fd(), req as _, arg as *mut T) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    /// A userfaultfd with `[start, start+len)` of this process registered for missing faults
    /// on shared memory (what the preloaded library does in the standby QEMU).
    fn register_missing(start: u64, len: u64) -> io::Result<OwnedFd> {
        // SAFETY: plain syscall with integer flags; returns a new fd or -1.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let mut api = [0xAAu64, 1 << 5, 0]; // UFFD_API, UFFD_FEATURE_MISSING_SHMEM
                                            // SAFETY: `api` is a struct uffdio_api (three u64) the kernel reads and writes.
        if unsafe { libc::ioctl(fd.as_raw_fd(), 0xC018_AA3Fu64 as _, api.as_mut_ptr()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut reg = [start, len, 1, 0]; // range, UFFDIO_REGISTER_MODE_MISSING, ioctls
                                          // SAFETY: `reg` is a struct uffdio_register (four u64) the kernel reads and writes.
        if unsafe { libc::ioctl(fd.as_raw_fd(), 0xC020_AA00u64 as _, reg.as_mut_ptr()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(fd)
    }

    #[test]
    fn a_guest_touching_consolidated_pages_reads_their_content() {
        const PAGES: u64 = 64;
        let len = PAGES as usize * PAGE;
        let file = memfd();
        file.set_len(len as u64).unwrap();
        // SAFETY: the memfd is private to this test and not resized while mapped.
        let mut mirror = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
        // SAFETY: as above; this second mapping plays the standby QEMU's.
        let guest = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
        let truth: Vec<u8> = (0..len)
            .map(|i| {
                if (i / PAGE).is_multiple_of(5) {
                    0
                } else {
                    (i / 64 % 7) as u8 + (i / PAGE) as u8
                }
            })
            .collect();
        mirror.copy_from_slice(&truth);
        let pool = Arc::new(Mutex::new(Pool::new()));
        let mut r = Replica::new(PAGES);
        r.written(&[3]); // stays plain
        r.scan(&mut pool.lock().unwrap(), &mut mirror, PAGES);
        assert!(r.consolidated() > PAGES / 2);
        let uffd = match register_missing(guest.as_ptr() as u64, len as u64) {
            Ok(fd) => fd,
            Err(e) => return eprintln!("no userfaultfd for shared memory here: {e}"),
        };
        let lazy = Lazy::start(uffd, guest.as_ptr() as u64, r, pool.clone()).unwrap();
        // The "guest" reads its pages while the restore runs: every read is served.
        assert!(guest[..] == truth[..], "the guest read wrong content");
        let (r, stats) = lazy.wait();
        let stats = stats.unwrap();
        let u = r.unwrap().usage(&pool.lock().unwrap());
        assert_eq!(
            u.shared + u.patched + u.compressed + u.pooled_raw,
            0,
            "{u:?}"
        );
        assert!(stats.faults + stats.background > 0, "{stats:?}");
        assert!(mirror[..] == truth[..]);
        assert!(pool.lock().unwrap().is_empty());
    }

    fn memfd() -> std::fs::File {
        let fd =
            rustix::fs::memfd_create("tandem-lazy-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        std::fs::File::from(fd)
    }
}
