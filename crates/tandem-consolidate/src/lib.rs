//! Consolidated replica memory: seed 001 (Difference Engine) applied to the backup's mirrors.
//!
//! A backup keeps each protected VM's memory as a mirror file that a standby QEMU maps. A
//! replica does not run until a failover, so most of its pages are cold. An NRU clock
//! ([`Replica::scan`]) walks each mirror; a page not written or read by an epoch since the
//! hand last passed is moved out of the file (its memory released with `MADV_REMOVE`) into the
//! host-wide [`Pool`]:
//!
//! ```text
//!  mirror file (per VM)             pool (one per backup host)
//!  +------+------+------+------+    +--------------------------------------------+
//!  |plain | hole | hole | hole |    | entry: refs, xxh3-128, LZ4 page (or raw)   |
//!  +------+--+---+--+---+--+---+    |   found by full-page hash (sharing)        |
//!     Zero --+      |      |        |   and by two sampled 64 B blocks           |
//!     Pooled(id) ---+------|------> |   (HashSimilarityDetector(2,1): patching)  |
//!     Patched: base id + LZ4(page XOR base) in the replica's map                 |
//!                                   +--------------------------------------------+
//! ```
//!
//! Before an epoch is decoded, the pages it reads (`tandem_codec::pages_read`) are restored
//! into the file ([`Replica::restore`]); the epoch then commits as on a plain mirror. At a
//! failover the standby either resumes at once and gets its pages on demand ([`Lazy`]:
//! userfaultfd missing faults, served first, the rest installed behind them) or after every
//! consolidated page was restored ([`Replica::restore_all`]). Zero pages stay holes: they
//! read as zeros.

#![warn(missing_docs)]

#[cfg(feature = "fuzz")]
pub mod fuzz;
mod keeper;
mod lazy;
pub mod pool;
mod release;
mod replica;

pub use keeper::Consolidated;
pub use lazy::{Lazy, LazyError, LazyStats};
pub use pool::Pool;
pub use release::{populate, release, shm};
pub use replica::{Replica, Scan, Usage, PATCH_MAX};

/// Guest page size.
pub const PAGE: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const PAGES: u64 = 48;

    /// Page contents from a small family, so that equal and similar pages occur.
    fn content(kind: u8, tweak: u16) -> Vec<u8> {
        let mut p: Vec<u8> = match kind % 4 {
            0 => vec![0; PAGE],
            1 => (0..PAGE).map(|i| (i / 16) as u8).collect(),
            2 => (0..PAGE)
                .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[3])
                .collect(),
            _ => (0..PAGE).map(|i| (i as u8) ^ kind).collect(),
        };
        if tweak != 0 {
            let at = tweak as usize % PAGE;
            p[at] = p[at].wrapping_add(1);
        }
        p
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Replica, page, content kind, tweak: an epoch restores then writes the page.
        Write(usize, u64, u8, u16),
        /// Replica, budget.
        Scan(usize, u64),
        /// Replica, page: an epoch reads it.
        Read(usize, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..2usize, 0..PAGES, any::<u8>(), any::<u16>()).prop_map(|(r, p, k, t)| Op::Write(r, p, k, t)),
            2 => (0..2usize, 1..2 * PAGES).prop_map(|(r, b)| Op::Scan(r, b)),
            1 => (0..2usize, 0..PAGES).prop_map(|(r, p)| Op::Read(r, p)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Two replicas sharing one pool: whatever the clock consolidated, restoring a page
        /// gives its last written content, and restoring all gives the whole memory back.
        #[test]
        fn consolidated_memory_restores_exactly(ops in proptest::collection::vec(op(), 1..200)) {
            let mut pool = Pool::new();
            let mut truth = [vec![0u8; PAGES as usize * PAGE], vec![0u8; PAGES as usize * PAGE]];
            let len = PAGES as usize * PAGE;
            let mut mirror = [shm(len).unwrap(), shm(len).unwrap()];
            let mut reps = [Replica::new(PAGES), Replica::new(PAGES)];
            for op in ops {
                match op {
                    Op::Write(r, p, k, t) => {
                        reps[r].restore(&mut pool, &mut mirror[r], &[p]).unwrap();
                        let c = content(k, t);
                        let range = p as usize * PAGE..(p as usize + 1) * PAGE;
                        truth[r][range.clone()].copy_from_slice(&c);
                        mirror[r][range].copy_from_slice(&c);
                        reps[r].written(&[p]);
                    }
                    Op::Scan(r, b) => { reps[r].scan(&mut pool, &mut mirror[r], b); }
                    Op::Read(r, p) => {
                        reps[r].restore(&mut pool, &mut mirror[r], &[p]).unwrap();
                        let range = p as usize * PAGE..(p as usize + 1) * PAGE;
                        prop_assert!(mirror[r][range.clone()] == truth[r][range]);
                    }
                }
            }
            for r in 0..2 {
                let u = reps[r].usage(&pool);
                prop_assert_eq!(u.plain + u.zero + u.shared + u.patched + u.compressed + u.pooled_raw, PAGES);
                reps[r].restore_all(&mut pool, &mut mirror[r]).unwrap();
                prop_assert!(mirror[r][..] == truth[r][..]);
                reps[r].forget(&mut pool);
            }
            prop_assert!(pool.is_empty());
            prop_assert_eq!(pool.bytes(), 0);
        }
    }

    #[test]
    fn cold_pages_are_shared_patched_and_compressed() {
        let mut pool = Pool::new();
        let mut m = shm(8 * PAGE).unwrap();
        let pages = [
            content(0, 0),
            content(1, 0),
            content(1, 0),
            content(1, 77),
            content(2, 0),
            content(3, 0),
            content(3, 0),
            content(2, 5),
        ];
        for (i, p) in pages.iter().enumerate() {
            m[i * PAGE..(i + 1) * PAGE].copy_from_slice(p);
        }
        let mut r = Replica::new(8);
        r.written(&[5]); // used since the last pass: spared once
        let s = r.scan(&mut pool, &mut m, 8);
        assert_eq!(s.recent, 1);
        assert_eq!(s.zeroed, 1);
        assert!(s.shared >= 1 && s.patched >= 2, "{s:?}");
        let u = r.usage(&pool);
        assert_eq!(u.plain, 1);
        assert!(u.resident() < 3.0 * PAGE as f64, "{u:?}");
        let s = r.scan(&mut pool, &mut m, 8);
        assert_eq!(s.visited, 8);
        assert_eq!(r.consolidated(), 8);
        r.restore_all(&mut pool, &mut m).unwrap();
        for (i, p) in pages.iter().enumerate() {
            assert!(m[i * PAGE..(i + 1) * PAGE] == p[..], "page {i}");
        }
    }

    #[test]
    fn a_mirror_that_cannot_punch_holes_keeps_its_pages_plain() {
        let mut pool = Pool::new();
        let mut m = vec![0u8; 4 * PAGE]; // heap memory: release() can only zero-fill
        m[PAGE..2 * PAGE].copy_from_slice(&content(2, 0));
        let before = m.clone();
        let mut r = Replica::new(4);
        r.scan(&mut pool, &mut m, 4);
        assert_eq!(r.consolidated(), 0);
        assert!(m == before);
        assert!(pool.is_empty());
    }
}
