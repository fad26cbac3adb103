//! Framing `xen-save-devices-state` files, and the pause's check of them.

use super::*;

/// The RAM section of a migrate stream (the ROM pages): start, its id, a body, its footer.
fn ram_section() -> Vec<u8> {
    [
        &[SECTION_START, 0, 0, 0, 2, 3][..],
        b"ram",
        &[1, 2, 3, SECTION_FOOTER, 0, 0, 0, 2],
    ]
    .concat()
}

/// A full section of device `name` (instance 0, version 1) with `body`.
fn device_section(name: u8, body: &[u8]) -> Vec<u8> {
    [
        &[SECTION_FULL, 0, 0, 0, 9, 1, name, 0, 0, 0, 0, 0, 0, 0, 1][..],
        body,
    ]
    .concat()
}

/// What `xen-save-devices-state` writes: the stream header, `sections`, the end marker.
fn saved(sections: &[u8]) -> Vec<u8> {
    [&b"QEVM\0\0\0\x03"[..], sections, &[VM_EOF]].concat()
}

fn migrate_stream(caps: &[&str]) -> Vec<u8> {
    let mut s = b"QEVM\0\0\0\x03\x07".to_vec();
    s.extend_from_slice(&13u32.to_be_bytes());
    s.extend_from_slice(b"pc-i440fx-7.2");
    s.push(SUBSECTION);
    let id = b"configuration/capabilities";
    s.push(id.len() as u8);
    s.extend_from_slice(id);
    s.extend_from_slice(&1u32.to_be_bytes());
    s.extend_from_slice(&(caps.len() as u32).to_be_bytes());
    for c in caps {
        s.push(c.len() as u8);
        s.extend_from_slice(c.as_bytes());
    }
    s.extend_from_slice(&ram_section());
    s.extend_from_slice(&device_section(b'x', &[7, 7]));
    s.push(VM_EOF);
    let json = br#"{"page_size":4096}"#;
    s.push(VMDESCRIPTION);
    s.extend_from_slice(&(json.len() as u32).to_be_bytes());
    s.extend_from_slice(json);
    s
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).unwrap()
}

#[test]
fn frames_a_device_save_with_the_migrate_streams_configuration_and_description() {
    let m = migrate_stream(&["x-ignore-shared"]);
    let f = StreamFrame::learn(&m).unwrap();
    let save = saved(&[SECTION_FULL, 0, 0, 0, 9, 1, b'y', 8]);
    let mut out = Vec::new();
    f.wrap(&save, &mut out).unwrap();
    let head_len = find(&m, &[SECTION_START, 0, 0, 0, 2, 3, b'r']);
    assert_eq!(out[..head_len], m[..head_len]);
    assert_eq!(out[head_len..head_len + 9], save[8..]);
    assert!(out.ends_with(br#"{"page_size":4096}"#));
    assert_eq!(out[head_len + 9], VMDESCRIPTION);
}

#[test]
fn the_pauses_check_in_place_agrees_with_framing() {
    let m = migrate_stream(&["x-ignore-shared"]);
    let f = StreamFrame::learn(&m).unwrap();
    let good = saved(&[SECTION_FULL, 0, 0, 0, 9, 1, b'y', 8]);
    let mut saves: Vec<Vec<u8>> = (0..=good.len()).map(|n| good[..n].to_vec()).collect();
    for i in 0..good.len() {
        let mut bad = good.clone();
        bad[i] ^= 0x5a;
        saves.push(bad);
    }
    let dir = tempfile::tempdir().unwrap();
    for save in saves {
        let path = dir.path().join("d");
        std::fs::write(&path, &save).unwrap();
        let file = File::open(&path).unwrap();
        let in_place = check_saved_file(&file).unwrap();
        let framed = f.wrap(&save, &mut Vec::new());
        assert_eq!(in_place, framed, "{save:?}");
    }
}

#[test]
fn keeps_the_rom_pages_between_configuration_and_devices() {
    let m = migrate_stream(&["x-ignore-shared"]);
    let same = saved(&device_section(b'x', &[6, 6]));
    // Its device state differs from the stream's (a later moment): the boundary is the
    // first device section's header.
    let f = StreamFrame::learn(&m).unwrap().with_rom(&m, &same).unwrap();
    let ram = ram_section();
    assert_eq!(f.rom_len(), ram.len());
    // A later save is framed with them: loading it restores the ROMs too.
    let later = saved(&device_section(b'y', &[8]));
    let mut out = Vec::new();
    f.wrap(&later, &mut out).unwrap();
    let head_len = find(&m, &ram);
    assert_eq!(out[..head_len + ram.len()], m[..head_len + ram.len()]);
    assert_eq!(out[head_len + ram.len()..][..17], later[8..]);
    // A device the stream does not have: refused, never a guessed boundary.
    let other = StreamFrame::learn(&m).unwrap().with_rom(&m, &later);
    assert!(other.unwrap_err().contains("no device section"));
    assert!(StreamFrame::learn(&m)
        .unwrap()
        .with_rom(&m, b"QEVM")
        .is_err());
}

#[test]
fn refuses_what_it_does_not_understand() {
    assert!(
        StreamFrame::learn(b"QEVM\0\0\0\x03\x04").is_err(),
        "no configuration"
    );
    let mut m = migrate_stream(&[]);
    let at = find(&m, b"configuration/");
    m[at] = b'k'; // "konfiguration/capabilities"
    assert!(StreamFrame::learn(&m).unwrap_err().contains("unknown"));
    let f = StreamFrame::learn(&migrate_stream(&[])).unwrap();
    let mut out = Vec::new();
    assert!(
        f.wrap(b"QEVM\0\0\0\x03\x04\x01", &mut out).is_err(),
        "no EOF"
    );
    assert!(f.wrap(b"nope", &mut out).is_err());
    for cut in 0..migrate_stream(&["a"]).len() - 40 {
        let _ = StreamFrame::learn(&migrate_stream(&["a"])[..cut]);
    }
}
