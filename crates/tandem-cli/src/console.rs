//! `tandem console`: attach the terminal to a guest's serial console, as `virsh console` does.
//! The daemon's QEMU serves ttyS0 on a unix socket (its runtime directory; a link to it sits
//! next to the console log, `DIR/guest-console.sock`) and logs everything to the console log
//! whether anyone is attached or not. Ctrl-] detaches.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Args)]
pub struct Args {
    /// The daemon's --dir (its guest's console is DIR/guest-console.sock), or the console
    /// socket itself.
    pub dir: PathBuf,
}

/// Ctrl-], as virsh console.
const ESCAPE: u8 = 0x1d;

pub fn run(a: Args) -> anyhow::Result<()> {
    let path = if a.dir.is_dir() {
        a.dir.join("guest-console.sock")
    } else {
        a.dir.clone()
    };
    let sock = UnixStream::connect(&path).with_context(|| {
        format!(
            "connecting to the guest's console at {} (is a tandem daemon running its guest there? `tandem status` names its --dir)",
            path.display()
        )
    })?;
    eprintln!(
        "connected to the guest's console at {} (escape character is ^])",
        path.display()
    );
    let raw = RawTerminal::new();
    let saved = raw.0;
    let mut from = sock.try_clone()?;
    std::thread::spawn(move || {
        let mut out = std::io::stdout();
        let mut buf = [0u8; 4096];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 || out.write_all(&buf[..n]).and_then(|()| out.flush()).is_err() {
                break;
            }
        }
        // The guest's QEMU went away: nothing more to show.
        if let Some(t) = &saved {
            restore(t);
        }
        eprintln!("\r\nthe console closed (the guest's QEMU ended)");
        std::process::exit(0);
    });
    let mut to = sock;
    let mut stdin = std::io::stdin();
    let mut buf = [0u8; 1024];
    loop {
        let n = stdin.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        let chunk = &buf[..n];
        let (send, detach) = match chunk.iter().position(|&b| b == ESCAPE) {
            Some(i) => (&chunk[..i], true),
            None => (chunk, false),
        };
        to.write_all(send)?;
        if detach {
            return Ok(());
        }
    }
}

/// The terminal in raw mode while attached (keys go to the guest as typed), restored on drop.
struct RawTerminal(Option<libc::termios>);

impl RawTerminal {
    fn new() -> RawTerminal {
        let fd = std::io::stdin().as_raw_fd();
        // SAFETY: termios is plain data; tcgetattr fills it and fails on a non-terminal.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd is stdin, valid for the process; t is a valid termios to fill.
        if unsafe { libc::tcgetattr(fd, &mut t) } != 0 {
            return RawTerminal(None);
        }
        let saved = t;
        // SAFETY: t is a valid termios read above.
        unsafe { libc::cfmakeraw(&mut t) };
        // SAFETY: fd is stdin; t is a valid termios.
        unsafe { libc::tcsetattr(fd, libc::TCSANOW, &t) };
        RawTerminal(Some(saved))
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            restore(t);
        }
    }
}

/// Puts the terminal back as `t` (what tcgetattr returned before raw mode).
fn restore(t: &libc::termios) {
    // SAFETY: fd is stdin; t is a valid termios.
    unsafe { libc::tcsetattr(std::io::stdin().as_raw_fd(), libc::TCSANOW, t) };
}
