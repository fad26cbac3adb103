//! A small NBD server (fixed newstyle handshake; READ, WRITE, FLUSH, TRIM, DISC) on a unix
//! socket, serving one raw image whose writes are logged per epoch.
//!
//! Handshake: `NBDMAGIC`, `IHAVEOPT`, flags FIXED_NEWSTYLE|NO_ZEROES; the client's flags; then
//! options: EXPORT_NAME (any name), INFO/GO (NBD_INFO_EXPORT + ACK), ABORT; anything else is
//! answered NBD_REP_ERR_UNSUP. Transmission uses simple replies.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use crate::image::Image;

const NBDMAGIC: &[u8; 8] = b"NBDMAGIC";
const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = 0x8000_0001;
const INFO_EXPORT: u16 = 0;
/// HAS_FLAGS | SEND_FLUSH | SEND_TRIM
const TX_FLAGS: u16 = 1 | (1 << 2) | (1 << 5);
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const EIO: u32 = 5;
const EINVAL: u32 = 22;
/// Largest single request served (QEMU uses at most 32 MiB).
const MAX_REQUEST: u32 = 32 << 20;

/// Errors of one NBD connection.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    /// Socket failure or the client went away.
    #[error("NBD connection")]
    Io(#[from] std::io::Error),
    /// The client broke the protocol.
    #[error("NBD protocol violation: {0}")]
    Protocol(String),
}

fn u16_of(r: &mut impl Read) -> std::io::Result<u16> {
    let mut b = [0; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}
fn u32_of(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}
fn u64_of(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn opt_reply(w: &mut impl Write, opt: u32, kind: u32, data: &[u8]) -> std::io::Result<()> {
    w.write_all(&REPLY_MAGIC.to_be_bytes())?;
    w.write_all(&opt.to_be_bytes())?;
    w.write_all(&kind.to_be_bytes())?;
    w.write_all(&(data.len() as u32).to_be_bytes())?;
    w.write_all(data)?;
    w.flush()
}

/// Runs the handshake; `Ok(true)` when the client entered transmission.
fn handshake(s: &mut UnixStream, image: &Image) -> Result<bool, NbdError> {
    s.write_all(NBDMAGIC)?;
    s.write_all(&IHAVEOPT.to_be_bytes())?;
    s.write_all(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes())?;
    let client = u32_of(s)?;
    if client & !3 != 0 {
        return Err(NbdError::Protocol(format!(
            "unknown client flags {client:#x}"
        )));
    }
    let no_zeroes = client & 2 != 0;
    loop {
        if u64_of(s)? != IHAVEOPT {
            return Err(NbdError::Protocol("option without IHAVEOPT".into()));
        }
        let opt = u32_of(s)?;
        let len = u32_of(s)?;
        if len > 64 << 10 {
            return Err(NbdError::Protocol(format!("option data of {len} bytes")));
        }
        let mut data = vec![0; len as usize];
        s.read_exact(&mut data)?;
        match opt {
            OPT_EXPORT_NAME => {
                s.write_all(&image.size().to_be_bytes())?;
                s.write_all(&TX_FLAGS.to_be_bytes())?;
                if !no_zeroes {
                    s.write_all(&[0u8; 124])?;
                }
                return Ok(true);
            }
            OPT_INFO | OPT_GO => {
                let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&image.size().to_be_bytes());
                info.extend_from_slice(&TX_FLAGS.to_be_bytes());
                opt_reply(s, opt, REP_INFO, &info)?;
                opt_reply(s, opt, REP_ACK, &[])?;
                if opt == OPT_GO {
                    return Ok(true);
                }
            }
            OPT_ABORT => {
                opt_reply(s, opt, REP_ACK, &[])?;
                return Ok(false);
            }
            _ => opt_reply(s, opt, REP_ERR_UNSUP, &[])?,
        }
    }
}

fn reply(s: &mut UnixStream, handle: u64, error: u32, data: &[u8]) -> std::io::Result<()> {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    h[4..8].copy_from_slice(&error.to_be_bytes());
    h[8..].copy_from_slice(&handle.to_be_bytes());
    s.write_all(&h)?;
    s.write_all(data)
}

/// Serves one client until it disconnects.
pub fn serve_client(mut s: UnixStream, image: &Image) -> Result<(), NbdError> {
    if !handshake(&mut s, image)? {
        return Ok(());
    }
    let mut buf = Vec::new();
    loop {
        let magic = match u32_of(&mut s) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if magic != REQUEST_MAGIC {
            return Err(NbdError::Protocol(format!("bad request magic {magic:#x}")));
        }
        let _flags = u16_of(&mut s)?;
        let cmd = u16_of(&mut s)?;
        let handle = u64_of(&mut s)?;
        let offset = u64_of(&mut s)?;
        let len = u32_of(&mut s)?;
        let in_range = offset
            .checked_add(len as u64)
            .is_some_and(|e| e <= image.size())
            && len <= MAX_REQUEST;
        match cmd {
            CMD_READ => {
                if !in_range {
                    reply(&mut s, handle, EINVAL, &[])?;
                    continue;
                }
                buf.resize(len as usize, 0);
                match image.read_at(&mut buf, offset) {
                    Ok(()) => reply(&mut s, handle, 0, &buf)?,
                    Err(_) => reply(&mut s, handle, EIO, &[])?,
                }
            }
            CMD_WRITE => {
                if len > MAX_REQUEST {
                    return Err(NbdError::Protocol(format!("write of {len} bytes")));
                }
                buf.resize(len as usize, 0);
                s.read_exact(&mut buf)?;
                let err = if !in_range {
                    EINVAL
                } else if image.write_at(&buf, offset).is_err() {
                    EIO
                } else {
                    0
                };
                reply(&mut s, handle, err, &[])?;
            }
            CMD_TRIM => {
                let err = if !in_range {
                    EINVAL
                } else if image.write_at(&vec![0u8; len as usize], offset).is_err() {
                    EIO
                } else {
                    0
                };
                reply(&mut s, handle, err, &[])?;
            }
            CMD_FLUSH => {
                let err = if image.flush().is_ok() { 0 } else { EIO };
                reply(&mut s, handle, err, &[])?;
            }
            CMD_DISC => return Ok(()),
            other => {
                reply(&mut s, handle, EINVAL, &[])?;
                return Err(NbdError::Protocol(format!("unknown command {other}")));
            }
        }
    }
}

/// Accepts clients on `listener` forever, one thread each.
pub fn serve(listener: UnixListener, image: Arc<Image>) {
    serve_until(
        listener,
        image,
        Arc::new(std::sync::atomic::AtomicBool::new(false)),
    )
}

/// Like [`serve`], until `stop` is set: the next connection (a wake-up) ends the accept loop
/// and drops this server's hold on the image (clients still connected keep theirs).
pub fn serve_until(
    listener: UnixListener,
    image: Arc<Image>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    for s in listener.incoming().map_while(Result::ok) {
        if stop.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let image = image.clone();
        std::thread::spawn(move || {
            if let Err(e) = serve_client(s, &image) {
                tracing::warn!("NBD client: {e}");
            }
        });
    }
}
