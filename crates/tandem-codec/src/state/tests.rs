//! Unit tests of the page stores.

use super::*;

/// A compressible page: a counter of `pfn`, `round` and the word's eighth in every 8-byte word.
fn counter_page(pfn: u64, round: u64) -> Vec<u8> {
    (0..PAGE / 8)
        .flat_map(|w| ((round << 32) | pfn << 12 | (w as u64 / 8)).to_le_bytes())
        .collect()
}

#[test]
fn lru_evicts_least_recent() {
    let mut s = PrevStore::Lru(Box::new(Lru::new(2)));
    let p = |b: u8| vec![b; PAGE];
    s.put(1, &p(1));
    s.put(2, &p(2));
    assert_eq!(s.get(1).unwrap()[0], 1);
    s.put(1, &p(11)); // 1 becomes most recent
    s.put(3, &p(3)); // evicts 2
    assert!(s.get(2).is_none());
    assert_eq!(s.get(1).unwrap()[0], 11);
    assert_eq!(s.get(3).unwrap()[0], 3);
}

#[test]
fn a_cycle_larger_than_the_store_keeps_a_held_sample() {
    let page = [7u8; PAGE];
    let (cap, cycle) = (100usize, 150u64);
    let mut plain = PrevStore::Lru(Box::new(Lru::new(cap)));
    let mut resistant = PrevStore::Lru(Box::new(Lru::scan_resistant(cap, 1000)));
    let (mut hits_plain, mut hits) = (0, 0);
    for round in 0..10 {
        for pfn in 0..cycle {
            if round > 2 {
                hits_plain += plain.get(pfn).is_some() as usize;
                hits += resistant.get(pfn).is_some() as usize;
            }
            plain.put(pfn, &page);
            resistant.put(pfn, &page);
        }
    }
    // LRU evicts each page just before it comes back; the sample (cap/(2 cycle) of the
    // pages by number, here about 50) and what it leaves held are hit every round.
    assert_eq!(hits_plain, 0);
    let per_round = hits / 7;
    assert!(
        (40..=100).contains(&per_round),
        "{per_round} hits per round"
    );
    // Pages that come back within the capacity are held as by LRU.
    let mut s = PrevStore::Lru(Box::new(Lru::scan_resistant(2, 1000)));
    s.put(1, &[1; PAGE]);
    s.put(2, &[2; PAGE]);
    s.put(1, &[11; PAGE]);
    s.put(3, &[3; PAGE]); // first seen: taken in, evicts 2
    assert!(s.get(2).is_none());
    assert_eq!(s.get(1).unwrap()[0], 11);
    assert_eq!(s.get(3).unwrap()[0], 3);
    // A page number outside the guest is taken in (no history to judge it by).
    s.put(5000, &[5; PAGE]);
    assert!(s.get(5000).is_some());
    // A page turned away waits in probation: written again soon, it is held and promoted.
    let mut s = Lru::scan_resistant(64, 1000);
    (0..62).for_each(|p| s.put(p, &page)); // main: 62 pages, probation: 2
    (100..200).for_each(|p| s.put(p, &page)); // first seen: taken in as by LRU
                                              // Page 3 (rank 874 of 1024 in the sample order) comes back 162 pages later: turned
                                              // away from main, held in probation.
    assert!(s.get(3).is_none());
    s.put(3, &[9; PAGE]);
    assert_eq!(s.seg[s.map[&3] as usize], 1);
    s.put(1, &page);
    assert_eq!(s.get(3).unwrap()[0], 9, "held in probation");
    s.put(3, &[10; PAGE]); // 2 pages later: taken in
    assert_eq!(s.seg[s.map[&3] as usize], 0, "promoted");
    assert_eq!(s.get(3).unwrap()[0], 10);
    assert!(s.map.len() <= 64 && s.data.len() <= 64 * PAGE);
}

#[test]
fn a_tiered_store_holds_a_compressible_cycle_larger_than_its_raw_slots() {
    // Compressible pages (a counter in every 8-byte word), a cycle of more than 3 × the
    // store's raw pages: the compressed tier holds what the main list pushes out.
    let page = counter_page;
    let (cap, cycle) = (64usize, 160u64);
    let mut tiered = PrevStore::Lru(Box::new(Lru::tiered(cap, 1000)));
    let mut flat = PrevStore::Lru(Box::new(Lru::scan_resistant(cap, 1000)));
    let (mut hits, mut hits_flat) = (0, 0);
    // The tier takes in a sample of the pages at first (none has come back from it yet),
    // then all of them once the sample does.
    for round in 0..7 {
        for pfn in 0..cycle {
            tiered.promote(&[pfn], None);
            if let Some(old) = tiered.get(pfn) {
                assert_eq!(
                    old,
                    page(pfn, round - 1),
                    "the held version is the last put"
                );
                hits += (round > 2) as usize;
            }
            hits_flat += (round > 2 && flat.get(pfn).is_some()) as usize;
            tiered.put(pfn, &page(pfn, round));
            tiered.settle(None);
            flat.put(pfn, &page(pfn, round));
        }
    }
    assert_eq!(hits, 4 * cycle as usize, "the whole cycle stays held");
    assert!(hits_flat < hits / 2, "{hits_flat} hits without the tier");
    // Within the same bytes.
    let PrevStore::Lru(l) = &tiered else {
        unreachable!()
    };
    assert!(l.data.len() <= (cap - cap / 4) * PAGE);
    // Switched off, the tier drops what it holds (its bytes become raw slots), and a newer
    // version always wins.
    tiered.set_compressing(false);
    for pfn in 1000..1100 {
        tiered.put(pfn, &page(pfn, 9));
    }
    tiered.settle(None);
    tiered.promote(&[0, 1], None);
    assert!(tiered.get(0).is_none_or(|p| p == page(0, 6)));
    tiered.put(2, &page(2, 7));
    tiered.settle(None);
    tiered.promote(&[2], None);
    assert_eq!(tiered.get(2).unwrap(), page(2, 7));
}

#[test]
fn direct_mapped_like_qemu() {
    let mut s = PrevStore::direct(3 * PAGE); // rounds down to 2 slots
    s.put(4, &[4; PAGE]);
    s.put(6, &[6; PAGE]); // same slot as 4
    assert!(s.get(4).is_none());
    assert_eq!(s.get(6).unwrap()[0], 6);
}

#[test]
fn a_batch_of_puts_holds_what_single_puts_hold() {
    // A cycle much larger than the store (most pages go to probation and out again within
    // the batch), pages that come back soon, and a tier: after every epoch the batch-filled
    // store holds exactly what the one filled page by page holds.
    let page = counter_page;
    let guest = 4000u64;
    for make in [
        |_: u64| Lru::new(96),
        |g: u64| Lru::scan_resistant(96, g),
        |g: u64| Lru::tiered(192, g),
    ] {
        let (mut one, mut batch) = (
            PrevStore::Lru(Box::new(make(guest))),
            PrevStore::Lru(Box::new(make(guest))),
        );
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 1..40u64 {
            // A scan over a third of the guest, and a few hot pages.
            let mut pfns: Vec<u64> = (0..300).map(|k| (round * 300 + k) % guest).collect();
            for _ in 0..20 {
                x = crate::xorshift64(x);
                pfns.push(x % 64);
            }
            pfns.sort_unstable();
            pfns.dedup();
            let pages: Vec<Vec<u8>> = pfns.iter().map(|&p| page(p, round)).collect();
            for s in [&mut one, &mut batch] {
                s.promote(&pfns, None);
            }
            for (&pfn, p) in pfns.iter().zip(&pages) {
                one.put(pfn, p);
            }
            batch.put_batch(pfns.iter().copied().zip(pages.iter().map(|p| &p[..])));
            for s in [&mut one, &mut batch] {
                s.settle(None);
            }
            let all: Vec<u64> = (0..guest).collect();
            for s in [&mut one, &mut batch] {
                s.promote(&all, None);
            }
            for pfn in 0..guest {
                assert_eq!(
                    one.get(pfn),
                    batch.get(pfn),
                    "page {pfn} after round {round}"
                );
            }
            for s in [&mut one, &mut batch] {
                s.settle(None);
            }
        }
    }
}

/// The lists of `l` are consistent: each links its `len` slots both ways, every listed slot
/// is the map's slot of its page, and the slab holds no slot past the bounds.
fn check_lists(l: &Lru) {
    let mut listed = 0;
    for list in 0..2 {
        let (mut s, mut prev, mut n) = (l.lists[list].head, NIL, 0);
        while s != NIL {
            assert_eq!(l.seg[s as usize] as usize, list);
            assert_eq!(l.prev[s as usize], prev);
            assert_eq!(l.map.get(&l.pfn[s as usize]), Some(&s));
            (prev, s, n) = (s, l.next[s as usize], n + 1);
        }
        assert_eq!(l.lists[list].tail, prev);
        assert_eq!(n, l.lists[list].len);
        assert!(n <= l.caps[list]);
        listed += n;
    }
    assert_eq!(listed, l.map.len());
    assert!(l.pfn.len() <= l.caps[0] + l.caps[1]);
    assert!(l.data.len() <= (l.caps[0] + l.caps[1]) * PAGE);
}

#[test]
fn a_tiered_store_without_compression_holds_raw_pages_in_all_its_bytes() {
    // Switched off, the main list takes the tier's quarter as raw slots (the store of
    // `cold=off`); switched on again, it shrinks back, pages move down the slab, and every
    // page held is still its last version. Random pages, puts and switches.
    let (cap, guest) = (64usize, 400u64);
    let mut s = PrevStore::Lru(Box::new(Lru::tiered(cap, guest)));
    let mut last: HashMap<u64, u64> = HashMap::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x = crate::xorshift64(x);
        x
    };
    let mut most_raw = 0;
    for epoch in 1..200u64 {
        if epoch % 23 == 0 {
            s.set_compressing(epoch % 46 != 0);
        }
        // Mostly a hot set larger than three quarters of the store, sometimes anywhere.
        let mut pfns: Vec<u64> = (0..24)
            .map(|_| match next() % 4 {
                0 => next() % guest,
                _ => next() % 60,
            })
            .collect();
        pfns.sort_unstable();
        pfns.dedup();
        s.promote(&pfns, None);
        for &p in &pfns {
            if let Some(v) = s.get(p) {
                assert_eq!(v, counter_page(p, last[&p]), "page {p} in epoch {epoch}");
            }
            s.put(p, &counter_page(p, epoch));
            last.insert(p, epoch);
        }
        s.settle(None);
        let PrevStore::Lru(l) = &s else {
            unreachable!()
        };
        check_lists(l);
        let raw = l.map.len();
        let tier = l.cold.as_ref().unwrap();
        if !tier.active {
            most_raw = most_raw.max(raw);
            assert_eq!(tier.bytes(), 0, "nothing compressed while off");
        } else {
            assert!(raw <= cap - cap / 4);
        }
    }
    assert!(
        most_raw > cap - cap / 4,
        "off, it held {most_raw} pages raw"
    );
}
