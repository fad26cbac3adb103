//! tandem's NBD server against QEMU's own NBD client (`qemu-io`, from qemu-utils) and against
//! a minimal hand-written client; writes appear in the epoch log exactly.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::sync::Arc;

use tandem_disk::{decode_writes, encode_writes, Image};

fn server(size: u64) -> (tempfile::TempDir, std::path::PathBuf, Arc<Image>) {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(size).unwrap();
    let image = Arc::new(Image::open(&img).unwrap());
    let sock = dir.path().join("nbd.sock");
    let l = UnixListener::bind(&sock).unwrap();
    let i = image.clone();
    std::thread::spawn(move || tandem_disk::nbd::serve(l, i));
    (dir, sock, image)
}

fn qemu_io(sock: &std::path::Path, cmds: &[&str]) -> String {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(format!("nbd+unix:///?socket={}", sock.display()));
    let o = c
        .output()
        .expect("qemu-io (package qemu-utils; run `./tandem setup`)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "qemu-io failed: {text}");
    text
}

#[test]
fn qemu_client_reads_writes_flushes_and_trims() {
    let (_d, sock, image) = server(1 << 20);
    let out = qemu_io(
        &sock,
        &[
            "write -P 0xab 4096 8192",
            "read -P 0xab 4096 8192",
            "flush",
            "discard 4096 4096",
            "read -P 0 4096 4096",
            "read -P 0xab 8192 4096",
        ],
    );
    assert!(!out.contains("Pattern verification failed"), "{out}");
    let writes = image.take_epoch_writes();
    assert_eq!(
        writes.len(),
        2,
        "one write and one trim expected: {:?}",
        writes.iter().map(|w| (w.0, w.1.len())).collect::<Vec<_>>()
    );
    assert_eq!((writes[0].0, writes[0].1.len()), (4096, 8192));
    assert!(writes[0].1.iter().all(|&b| b == 0xab));
    assert_eq!((writes[1].0, writes[1].1.len()), (4096, 4096));
    assert!(writes[1].1.iter().all(|&b| b == 0));
    assert!(image.take_epoch_writes().is_empty(), "the log is per epoch");
    // Out-of-range access is refused by the server (qemu-io reports an error).
    let o = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 1048000 4096"])
        .arg(format!("nbd+unix:///?socket={}", sock.display()))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("error")
            || String::from_utf8_lossy(&o.stderr).contains("rror")
            || !o.status.success()
    );
}

#[test]
fn qemu_img_sees_the_export_size() {
    let (_d, sock, _image) = server(3 << 20);
    let o = Command::new("qemu-img")
        .args(["info", "--output=json"])
        .arg(format!("nbd+unix:///?socket={}", sock.display()))
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&o.stderr)));
    assert_eq!(v["virtual-size"], 3 << 20);
}

fn be16(s: &mut UnixStream) -> u16 {
    let mut b = [0; 2];
    s.read_exact(&mut b).unwrap();
    u16::from_be_bytes(b)
}

#[test]
fn minimal_client_export_name_and_commands() {
    let (_d, sock, image) = server(64 << 10);
    let mut s = UnixStream::connect(&sock).unwrap();
    let mut hello = [0u8; 16];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], b"NBDMAGIC");
    assert_eq!(be16(&mut s), 3);
    s.write_all(&3u32.to_be_bytes()).unwrap(); // fixed newstyle, no zeroes
    s.write_all(&0x4948_4156_454F_5054u64.to_be_bytes())
        .unwrap();
    s.write_all(&1u32.to_be_bytes()).unwrap(); // EXPORT_NAME
    s.write_all(&0u32.to_be_bytes()).unwrap();
    let mut size = [0u8; 8];
    s.read_exact(&mut size).unwrap();
    assert_eq!(u64::from_be_bytes(size), 64 << 10);
    assert_eq!(be16(&mut s) & 1, 1);
    let req = |s: &mut UnixStream, cmd: u16, handle: u64, off: u64, len: u32, data: &[u8]| {
        let mut r = Vec::new();
        r.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&cmd.to_be_bytes());
        r.extend_from_slice(&handle.to_be_bytes());
        r.extend_from_slice(&off.to_be_bytes());
        r.extend_from_slice(&len.to_be_bytes());
        r.extend_from_slice(data);
        s.write_all(&r).unwrap();
        let mut h = [0u8; 16];
        s.read_exact(&mut h).unwrap();
        assert_eq!(&h[..4], &0x6744_6698u32.to_be_bytes());
        assert_eq!(u64::from_be_bytes(h[8..].try_into().unwrap()), handle);
        u32::from_be_bytes(h[4..8].try_into().unwrap())
    };
    assert_eq!(req(&mut s, 1, 7, 512, 4, b"abcd"), 0);
    assert_eq!(req(&mut s, 3, 8, 0, 0, &[]), 0);
    assert_eq!(req(&mut s, 0, 9, 512, 4, &[]), 0);
    let mut back = [0u8; 4];
    s.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"abcd");
    assert_eq!(
        req(&mut s, 0, 10, 64 << 10, 1, &[]),
        22,
        "read past the end must fail with EINVAL"
    );
    // DISC: no reply; the server closes the connection.
    let mut disc = 0x2560_9513u32.to_be_bytes().to_vec();
    disc.extend_from_slice(&0u16.to_be_bytes());
    disc.extend_from_slice(&2u16.to_be_bytes());
    disc.extend_from_slice(&[0u8; 20]);
    s.write_all(&disc).unwrap();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "DISC must not be answered");
    let writes = image.take_epoch_writes();
    let bytes = encode_writes(&writes);
    let back = decode_writes(&bytes, 64 << 10).unwrap();
    assert_eq!(back, vec![(512u64, &b"abcd"[..])]);
    assert!(
        decode_writes(&bytes, 512).is_none(),
        "a write outside the disk must be refused"
    );
    assert!(decode_writes(&bytes[..bytes.len() - 1], 64 << 10).is_none());
}
