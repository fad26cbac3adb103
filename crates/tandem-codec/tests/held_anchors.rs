//! A held page rewritten with content moved in from another page (a journal's copy of a
//! database page, shifted by its record header) finds that page through its anchors, and the
//! page goes into the record's reference prefix: a few bytes instead of the whole page.

use tandem_codec::{decode, pages_read, Codec, Config, Encoder, Plan};

const P: usize = 4096;
const PAGES: usize = 64;

/// A page of incompressible bytes.
fn noise(seed: u64) -> Vec<u8> {
    (0..P as u64 / 8)
        .flat_map(|i| xxhash_rust::xxh3::xxh3_64(&(seed << 32 | i).to_le_bytes()).to_le_bytes())
        .collect()
}

/// Bytes of the second epoch's record and the pages it reads (it must decode exactly).
fn journal_copy(cfg: Config) -> (usize, Vec<u64>) {
    copy_into(cfg, 20)
}

/// The same, the copy written to page `to` (20: held; another page: new to the store).
fn copy_into(cfg: Config, to: u64) -> (usize, Vec<u64>) {
    let base = vec![0u8; PAGES * P];
    let mut enc = Encoder::new(Codec::Tandem, &base, cfg).unwrap();
    let mut mirror = base.clone();
    let mut plan = Plan::default();
    // Epoch 1: pages 10 ("database") and 20 ("journal") get new content; both are held after.
    let (db, journal) = (noise(1), noise(2));
    let mut data = db.clone();
    data.extend_from_slice(&journal);
    let mut rec = Vec::new();
    enc.encode(1, &[10, 20], &data, &mut rec).unwrap();
    decode(&rec, &mirror, &mut plan).unwrap();
    plan.commit(&mut mirror);
    // Epoch 2: the journal page is rewritten with an 8-byte header and a copy of page 10.
    let mut copy = 77u64.to_le_bytes().to_vec();
    copy.extend_from_slice(&db[..P - 8]);
    rec.clear();
    enc.encode(2, &[to], &copy, &mut rec).unwrap();
    let read = pages_read(&rec, PAGES as u64).unwrap().unwrap_or_default();
    decode(&rec, &mirror, &mut plan).unwrap();
    plan.commit(&mut mirror);
    let to = to as usize;
    assert_eq!(&mirror[to * P..(to + 1) * P], &copy[..], "decoded exactly");
    (rec.len(), read)
}

#[test]
fn moved_content_of_a_held_page_is_found_by_its_anchors() {
    let (with, read) = journal_copy(Config::default());
    let mut off = Config::default();
    off.budget.held_anchors = usize::MAX;
    let (without, read_off) = journal_copy(off);
    assert!(read.contains(&10), "page 10 in the prefix: {read:?}");
    assert!(!read_off.contains(&10), "{read_off:?}");
    assert!(
        with * 8 < without,
        "{with} bytes with anchors, {without} without"
    );
}

#[test]
fn at_negative_levels_held_pages_are_not_scanned() {
    let cfg = Config {
        zstd_level: -1,
        ..Config::default()
    };
    let (_, read) = journal_copy(cfg);
    assert!(!read.contains(&10), "{read:?}");
}

#[test]
fn at_the_lowest_level_no_page_is_scanned() {
    // A page new to the store is still scanned at negative levels, and no longer at the
    // lowest one (the encoder is the slower stage at its fastest setting); both decode.
    let at = |zstd_level| {
        let cfg = Config {
            zstd_level,
            ..Config::default()
        };
        copy_into(cfg, 30).1
    };
    assert!(at(-1).contains(&10), "{:?}", at(-1));
    assert!(!at(tandem_codec::level::MIN).contains(&10));
}
