//! Fast device-state capture with QMP `xen-save-devices-state`, framed into a stream that
//! `migrate-incoming` accepts.
//!
//! `migrate` spends most of its ~4–5 ms on migration set-up (thread, state machine, RAM block
//! list), not on the ~0.5 MB of device state. Stock QEMU's `xen-save-devices-state` (compiled
//! into every build, `live: false`) writes the same device sections of a stopped VM to a file
//! directly. Its file is not a loadable stream on its own:
//!
//! ```text
//!  migrate fd:  | magic | version | 07 configuration | 01 "ram" start … | 04 device … | 00 EOF | 06 vmdesc |
//!  xen-save:    | magic | version |                                      | 04 device … | 00 EOF |
//!  framed:      | magic | version | 07 configuration | 01 "ram" … (ROMs)  | 04 device … | 00 EOF | 06 vmdesc |
//! ```
//!
//! The configuration section (machine type, the capabilities the destination must share —
//! `x-ignore-shared`) is required by `migrate-incoming`; the trailing description is read and
//! ignored. The RAM sections carry no page of guest RAM (shared: the standby's RAM file holds
//! it) but every page of the machine's other RAM blocks — firmware, option ROMs, ACPI tables.
//! A QEMU waiting for a migration frees its own copy of those ROMs and takes them from the
//! stream: without them a guest restored or failed over runs, but cannot reboot (its reset
//! vector would be zeros). They do not change while the guest runs, so the first capture of a
//! VM goes through `migrate`, and [`StreamFrame::learn`] keeps its configuration section and
//! description, and [`StreamFrame::with_rom`] its RAM sections, found by an
//! `xen-save-devices-state` of the same stopped guest (the stream's device sections are that
//! file's); every later capture is `xen-save-devices-state` between them. Anything unexpected
//! (a command QEMU does not have, a stream that does not parse, device sections that differ)
//! falls back to `migrate` for good, with the reason.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde_json::json;

use super::DeviceStateError;
use crate::qmp::{Armed, Qmp, QmpError, Sent};

/// The tmpfs the state file is written to (guest RAM files live there too).
pub const STATE_DIR: &str = crate::stale::TMPFS;

/// Device state above this size gets a hint in the log (the lab guest with legacy virtio
/// saves ~35 KB, the same devices in modern mode ~170 KB).
const LARGE_STATE: usize = 96 << 10;
const MAGIC: [u8; 4] = *b"QEVM";
const VERSION: [u8; 4] = [0, 0, 0, 3];
const VM_EOF: u8 = 0x00;
const SECTION_START: u8 = 0x01;
const SECTION_FULL: u8 = 0x04;
const SUBSECTION: u8 = 0x05;
const VMDESCRIPTION: u8 = 0x06;
const CONFIGURATION: u8 = 0x07;
const SECTION_FOOTER: u8 = 0x7e;

/// What a `migrate` device-state stream has around its device sections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamFrame {
    /// Magic, version and the configuration section.
    head: Vec<u8>,
    /// The RAM sections: the pages of the RAM blocks that are not guest RAM (ROMs).
    rom: Vec<u8>,
    /// The VM description after the end-of-stream byte (may be empty).
    tail: Vec<u8>,
}

fn take<'a>(s: &'a [u8], at: &mut usize, n: usize) -> Result<&'a [u8], String> {
    let r = s
        .get(*at..*at + n)
        .ok_or_else(|| format!("stream ends at byte {} inside the configuration", s.len()))?;
    *at += n;
    Ok(r)
}

fn be32(s: &[u8], at: &mut usize) -> Result<u32, String> {
    let b = take(s, at, 4)?;
    Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

impl StreamFrame {
    /// Learns the frame from a complete `migrate` stream of this QEMU (RAM-less, as
    /// [`super::capture`] writes it). Errors name what did not parse.
    pub fn learn(stream: &[u8]) -> Result<StreamFrame, String> {
        if stream.len() < 9 || stream[..4] != MAGIC || stream[4..8] != VERSION {
            return Err("no QEMU migration stream header (magic/version 3)".into());
        }
        let mut at = 8;
        if take(stream, &mut at, 1)?[0] != CONFIGURATION {
            return Err("no configuration section after the header".into());
        }
        let len = be32(stream, &mut at)? as usize;
        if len > 256 {
            return Err(format!("machine type name of {len} bytes"));
        }
        take(stream, &mut at, len)?;
        while stream.get(at) == Some(&SUBSECTION) {
            at += 1;
            let n = take(stream, &mut at, 1)?[0] as usize;
            let id = take(stream, &mut at, n)?.to_vec();
            be32(stream, &mut at)?; // version
            match id.as_slice() {
                b"configuration/target-page-bits" => {
                    be32(stream, &mut at)?;
                }
                b"configuration/capabilities" => {
                    let count = be32(stream, &mut at)?;
                    if count > 64 {
                        return Err(format!("{count} capabilities in the configuration"));
                    }
                    for _ in 0..count {
                        let n = take(stream, &mut at, 1)?[0] as usize;
                        take(stream, &mut at, n)?;
                    }
                }
                b"configuration/uuid" => {
                    take(stream, &mut at, 16)?;
                }
                other => {
                    return Err(format!(
                        "unknown configuration subsection {:?}",
                        String::from_utf8_lossy(other)
                    ))
                }
            }
        }
        match stream.get(at) {
            Some(&SECTION_START) | Some(&SECTION_FULL) => {}
            other => {
                return Err(format!(
                    "configuration followed by {other:?}, not a section"
                ))
            }
        }
        let head = stream[..at].to_vec();
        Ok(StreamFrame {
            head,
            rom: Vec::new(),
            tail: description(stream),
        })
    }

    /// Keeps the RAM sections of `stream` (the one the frame was learned from): what lies
    /// between its configuration and its first device section, whose header is the first one
    /// of `saved` (an `xen-save-devices-state` file of the same guest). The RAM sections must
    /// start there with a section start and end with the RAM section's footer.
    pub fn with_rom(mut self, stream: &[u8], saved: &[u8]) -> Result<StreamFrame, String> {
        if saved.len() < 9 || saved[..4] != MAGIC || saved[4..8] != VERSION {
            return Err("xen-save-devices-state wrote no stream header".into());
        }
        // The first device section's header: type, id, name, instance, version.
        let mut at = 8;
        if take(saved, &mut at, 1)?[0] != SECTION_FULL {
            return Err("xen-save-devices-state wrote no device section".into());
        }
        be32(saved, &mut at)?;
        let n = take(saved, &mut at, 1)?[0] as usize;
        take(saved, &mut at, n + 8)?;
        let header = &saved[8..at];
        let end = stream.len().saturating_sub(self.tail.len());
        let region = stream.get(self.head.len()..end).unwrap_or_default();
        // The last occurrence: the device sections follow all RAM pages.
        let Some(pos) = region.windows(header.len()).rposition(|w| w == header) else {
            return Err(
                "the migrate stream has no device section xen-save-devices-state has".into(),
            );
        };
        let rom = &region[..pos];
        if !rom.is_empty() {
            let id = rom.get(1..5).ok_or("a cut RAM section")?;
            let footer = [&[SECTION_FOOTER][..], id].concat();
            if rom[0] != SECTION_START || !rom.ends_with(&footer) {
                return Err(
                    "no whole RAM section between the configuration and the devices".into(),
                );
            }
        }
        self.rom = rom.to_vec();
        Ok(self)
    }

    /// Bytes of ROM pages the frame carries.
    pub fn rom_len(&self) -> usize {
        self.rom.len()
    }

    /// Frames a `xen-save-devices-state` file into a loadable stream in `out` (cleared).
    pub fn wrap(&self, saved: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        self.wrap_from(&mut &saved[..], out)
            .unwrap_or_else(|e| Err(e.to_string()))
    }

    /// [`Frame::wrap`] reading the saved file from `r` straight into `out`, behind the head:
    /// one copy of the device state in the pause. The outer error is the reader's; the inner
    /// one says the file is not a complete device save (`out` then holds a partial frame).
    fn wrap_from(
        &self,
        r: &mut impl Read,
        out: &mut Vec<u8>,
    ) -> std::io::Result<Result<(), String>> {
        let mut header = [0u8; 8];
        match r.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(check_header(&[]))
            }
            Err(e) => return Err(e),
        }
        if let Err(why) = check_header(&header) {
            return Ok(Err(why));
        }
        out.clear();
        out.extend_from_slice(&self.head);
        out.extend_from_slice(&self.rom);
        let body = out.len();
        r.read_to_end(out)?;
        let sections = &out[body..];
        if let Err(why) = check_sections(sections.first().copied(), sections.last().copied()) {
            return Ok(Err(why));
        }
        out.extend_from_slice(&self.tail);
        Ok(Ok(()))
    }
}

/// Whether `header` (the first 8 bytes of an `xen-save-devices-state` file) is a stream's.
fn check_header(header: &[u8]) -> Result<(), String> {
    if header.len() == 8 && header[..4] == MAGIC && header[4..] == VERSION {
        Ok(())
    } else {
        Err("xen-save-devices-state wrote no stream header".into())
    }
}

/// Whether a save whose bytes after the header begin with `first` and end with `last` holds
/// complete device sections: a section first, the end-of-stream marker last.
fn check_sections(first: Option<u8>, last: Option<u8>) -> Result<(), String> {
    if first == Some(SECTION_FULL) && last == Some(VM_EOF) {
        Ok(())
    } else {
        Err("xen-save-devices-state wrote no complete device sections".into())
    }
}

/// [`check_header`] and [`check_sections`] of a saved file, read in place (a few bytes).
fn check_saved_file(file: &File) -> std::io::Result<Result<(), String>> {
    use std::os::unix::fs::FileExt;
    let len = file.metadata()?.len();
    let mut header = [0u8; 8];
    if len < 8 {
        return Ok(check_header(&[]));
    }
    file.read_exact_at(&mut header, 0)?;
    if let Err(why) = check_header(&header) {
        return Ok(Err(why));
    }
    if len == 8 {
        return Ok(check_sections(None, None));
    }
    let mut first = [0u8; 1];
    let mut last = [0u8; 1];
    file.read_exact_at(&mut first, 8)?;
    file.read_exact_at(&mut last, len - 1)?;
    Ok(check_sections(Some(first[0]), Some(last[0])))
}

/// The trailing VM description of a stream (`06`, be32 size, JSON), or empty if there is none.
fn description(stream: &[u8]) -> Vec<u8> {
    // The JSON is at most a few hundred KB; search backwards for a header whose size reaches
    // exactly the end of the stream.
    let low = stream.len().saturating_sub(1 << 20);
    for p in (low.max(1)..stream.len().saturating_sub(5)).rev() {
        if stream[p] == VMDESCRIPTION && stream[p - 1] == VM_EOF {
            let size =
                u32::from_be_bytes([stream[p + 1], stream[p + 2], stream[p + 3], stream[p + 4]]);
            if p + 5 + size as usize == stream.len() && stream.get(p + 5) == Some(&b'{') {
                return stream[p..].to_vec();
            }
        }
    }
    Vec::new()
}

/// The QMP command that saves the devices without RAM into a file (stock QEMU's, built into
/// every build, not only Xen ones).
pub const XEN_SAVE: &str = "xen-save-devices-state";

/// A VM's device-state capturer: `migrate` first, `xen-save-devices-state` afterwards.
#[derive(Debug)]
pub struct Capturer {
    fast: bool,
    frame: Option<StreamFrame>,
    file: Option<(PathBuf, File)>,
    /// Where the state file goes when [`STATE_DIR`] cannot hold it.
    dir: PathBuf,
    /// The state file's own directory in [`STATE_DIR`] (owned, so `clean_stale` removes it
    /// after a kill); dropped after the file.
    shm: Option<tempfile::TempDir>,
    /// Why the fast path is off (set once it fell back).
    pub fallback: Option<String>,
    /// A fast capture checked in the pause and not framed yet ([`Capturer::complete`]).
    unframed: bool,
    /// The monitor `xen-save-devices-state` is armed on ([`Armed`]), and the command once
    /// armed; `None` after it failed.
    armed_on: Option<PathBuf>,
    armed: Option<Armed>,
}

/// A capture [`Capturer::begin`] started.
#[must_use = "finish the capture with Capturer::finish"]
#[derive(Debug)]
pub enum Begun {
    /// Sent whole on the VM's main monitor.
    Sent(Sent),
    /// Fired on its own monitor.
    Armed,
}

/// Which path a capture took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `migrate fd:` (first capture, or the fallback).
    Migrate,
    /// `xen-save-devices-state`, framed.
    Fast,
}

impl Capturer {
    /// A capturer whose state file goes into a directory of its own in [`STATE_DIR`], or into
    /// `dir` if that cannot be made; `fast` false always uses `migrate`.
    pub fn new(dir: &Path, fast: bool) -> Self {
        Capturer {
            fast,
            frame: None,
            file: None,
            dir: dir.to_path_buf(),
            shm: None,
            fallback: (!fast).then(|| "disabled".to_string()),
            unframed: false,
            armed_on: None,
            armed: None,
        }
    }

    /// Arms `xen-save-devices-state` on the monitor at `socket` once the fast path is ready.
    pub fn armed_on(mut self, socket: PathBuf) -> Self {
        self.armed_on = Some(socket);
        self
    }

    /// Turns the fast path on (unless it already failed on this QEMU) or off.
    pub fn set_fast(&mut self, fast: bool) {
        self.fast = fast;
        if fast && self.fallback.as_deref() == Some("disabled") {
            self.fallback = None;
        } else if !fast && self.fallback.is_none() {
            self.fallback = Some("disabled".into());
        }
    }

    /// Captures the stopped guest's device state into `out`.
    pub fn capture(
        &mut self,
        qmp: &mut Qmp,
        out: &mut Vec<u8>,
    ) -> Result<Method, DeviceStateError> {
        let started = self.begin(qmp, true);
        let method = self.finish(qmp, started, out)?;
        self.complete(out)?;
        Ok(method)
    }

    /// Starts a fast capture of the stopped guest without waiting for it (QEMU serialises
    /// its devices while the caller copies the dirty pages); `None` if the fast path is not
    /// ready (the first capture) or off. Finish with [`Capturer::finish`] before the next QMP
    /// command and before the guest runs again. `stopped`: the guest is stopped already, so
    /// the armed command may go (QEMU runs different monitors' commands in no promised
    /// order); otherwise the command follows the caller's `stop` on `qmp`.
    pub fn begin(&mut self, qmp: &mut Qmp, stopped: bool) -> Option<Begun> {
        if !self.fast || self.fallback.is_some() || self.frame.is_none() {
            return None;
        }
        if let Err(e) = self.ensure_file() {
            self.fall_back(e);
            return None;
        }
        // Built only for a command sent whole (the armed one holds its own).
        let path = &self.file.as_ref().expect("set above").0;
        let args = || json!({ "filename": path.to_string_lossy(), "live": false });
        if stopped {
            if let Some(socket) = self.armed.is_none().then(|| self.armed_on.take()).flatten() {
                match Armed::connect(&socket, XEN_SAVE, Some(args())) {
                    Ok(a) => self.armed = Some(a),
                    Err(e) => tracing::warn!(
                        "device state: xen-save-devices-state not armed ahead ({e}); sent \
                         whole in the pause"
                    ),
                }
            }
            // A monitor that failed is dropped: the main one takes the command.
            if let Some(Ok(())) = Armed::run_in(&mut self.armed, Armed::fire) {
                return Some(Begun::Armed);
            }
        }
        match qmp.start(XEN_SAVE, Some(args())) {
            Ok(sent) => Some(Begun::Sent(sent)),
            Err(e) => {
                self.fall_back(e.to_string());
                None
            }
        }
    }

    /// Arms the device-state command again after a capture's reply ([`Armed::arm`]); a
    /// monitor that failed is dropped (the main one takes the command from then on).
    pub fn rearm(&mut self) {
        let _ = Armed::run_in(&mut self.armed, Armed::arm);
    }

    /// Completes a capture begun with [`Capturer::begin`], or captures into `out` with
    /// `migrate` if none was begun or it failed (the guest is still stopped). A fast capture
    /// is only checked here (its header and its end, a few bytes): [`Capturer::complete`]
    /// frames it into `out` after the guest runs again, since QEMU writes the file only when
    /// asked for the next capture. That takes the copy of the frame (~0.5 MB with the ROM
    /// pages, ~60 µs here) out of the pause.
    pub fn finish(
        &mut self,
        qmp: &mut Qmp,
        started: Option<Begun>,
        out: &mut Vec<u8>,
    ) -> Result<Method, DeviceStateError> {
        // A capture left unframed by an abandoned checkpoint is not this one's.
        self.unframed = false;
        if let Some(sent) = started {
            match self.check(qmp, sent) {
                Ok(Ok(())) => {
                    // Framed by `complete`; nothing of an earlier capture stays in `out`.
                    out.clear();
                    return Ok(Method::Fast);
                }
                Ok(Err(e)) => self.fall_back(e),
                Err(DeviceStateError::Qmp(QmpError::Command { desc, .. })) => self.fall_back(desc),
                // The QMP connection itself failed: migrate would fail the same way.
                Err(e) => return Err(e),
            }
        }
        super::capture(qmp, out)?;
        if self.fast && self.frame.is_none() && self.fallback.is_none() {
            match StreamFrame::learn(out).and_then(|f| self.rom_of(qmp, f, out)) {
                Ok(f) => self.frame = Some(f),
                Err(e) => self.fall_back(e),
            }
        }
        Ok(Method::Migrate)
    }

    /// The frame `f` of the `migrate` stream `stream` just captured, with its RAM sections
    /// (the ROMs), found by an `xen-save-devices-state` of the same stopped guest.
    fn rom_of(
        &mut self,
        qmp: &mut Qmp,
        f: StreamFrame,
        stream: &[u8],
    ) -> Result<StreamFrame, String> {
        self.ensure_file()?;
        let (path, file) = self.file.as_mut().expect("made above");
        let args = json!({ "filename": path.to_string_lossy(), "live": false });
        qmp.execute(XEN_SAVE, Some(args))
            .map_err(|e| e.to_string())?;
        let mut saved = Vec::new();
        file.seek(SeekFrom::Start(0))
            .and_then(|_| file.read_to_end(&mut saved))
            .map_err(|e| format!("reading the state file: {e}"))?;
        let f = f.with_rom(stream, &saved)?;
        tracing::debug!(
            "device state: {} bytes of ROM pages framed with every capture",
            f.rom_len()
        );
        if saved.len() > LARGE_STATE {
            // QEMU serialises this in every pause (~20 ns a byte here): say what makes it
            // large and what shrinks it (docs/VM_LAB.md, "Legacy virtio for the lab guest").
            tracing::info!(
                "device state: {} KiB serialised by QEMU in every checkpoint pause; modern \
                 virtio-pci devices save arrays of 1 024 queues each: if the guest's drivers \
                 speak legacy virtio (Linux's do), `legacy_virtio = true` in its description \
                 shrinks that about five times and shortens every pause \
                 (docs/VM_DESCRIPTION.md)",
                saved.len() >> 10
            );
        } else {
            tracing::debug!("device state: {} bytes per capture", saved.len());
        }
        Ok(f)
    }

    /// The state file `xen-save-devices-state` writes (made once): in a tmpfs, because QEMU
    /// opens it with `O_TRUNC` and closes it inside every pause, and on a disk file system
    /// (ext4's `auto_da_alloc`) that truncate-and-close frees its blocks and starts
    /// write-back each time: a third of the capture's wall time (docs/VM_LAB.md).
    fn ensure_file(&mut self) -> Result<(), String> {
        if self.file.is_none() {
            if self.shm.is_none() {
                self.shm = crate::stale::owned_tempdir("tandem-ds-", Some(Path::new(STATE_DIR)))
                    .map_err(|e| tracing::debug!("device state: no directory in {STATE_DIR}: {e}"))
                    .ok();
            }
            let dir = self.shm.as_ref().map_or(self.dir.as_path(), |d| d.path());
            // A short name (both directories are this VM's own): QEMU parses the command
            // that names it byte by byte (qmp/armed.rs).
            let path = dir.join("devstate");
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(|e| format!("state file {}: {e}", path.display()))?;
            self.file = Some((path, file));
        }
        Ok(())
    }

    fn fall_back(&mut self, why: String) {
        tracing::warn!("device state: xen-save-devices-state unusable ({why}); using migrate");
        self.fallback = Some(why);
        self.armed = None;
        self.remove_file();
    }

    /// Frames the fast capture [`Capturer::finish`] checked into `out`; nothing to do after a
    /// `migrate` capture (it wrote `out` itself).
    pub fn complete(&mut self, out: &mut Vec<u8>) -> Result<(), DeviceStateError> {
        if !std::mem::take(&mut self.unframed) {
            return Ok(());
        }
        let (Some(frame), Some((_, file))) = (self.frame.as_ref(), self.file.as_mut()) else {
            return Err(DeviceStateError::Changed("no file to frame".into()));
        };
        let framed = file
            .seek(SeekFrom::Start(0))
            .and_then(|_| frame.wrap_from(file, out))
            .map_err(DeviceStateError::File)?;
        // The file was complete when the pause checked it, and nothing writes it between.
        framed.map_err(DeviceStateError::Changed)
    }

    /// Waits for QEMU's reply and checks the file it wrote: the header, the first section
    /// and the end marker a complete device save has (what framing checks, read in place).
    fn check(
        &mut self,
        qmp: &mut Qmp,
        begun: Begun,
    ) -> Result<Result<(), String>, DeviceStateError> {
        match begun {
            Begun::Sent(sent) => qmp.reply(sent).map(drop)?,
            Begun::Armed => {
                Armed::run_in(&mut self.armed, Armed::reply).expect("fired")?;
            }
        }
        let (_, file) = self.file.as_mut().expect("begun");
        // QEMU opened the path with O_TRUNC and wrote from 0; our descriptor reads the same
        // inode.
        if let Err(why) = check_saved_file(file)? {
            return Ok(Err(why));
        }
        self.unframed = true;
        Ok(Ok(()))
    }

    fn remove_file(&mut self) {
        if let Some((path, _)) = self.file.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for Capturer {
    fn drop(&mut self) {
        self.remove_file();
    }
}

/// Fuzz entry (target `devstate_frame`): the first byte splits the rest into a `migrate`
/// stream to learn a frame from and a `xen-save-devices-state` file to wrap; never a panic.
/// Returns whether it framed a stream.
#[cfg(feature = "fuzz")]
pub fn fuzz_frame(data: &[u8]) -> bool {
    let Some((&split, rest)) = data.split_first() else {
        return false;
    };
    let at = (rest.len() * split as usize / 255).min(rest.len());
    let (stream, saved) = rest.split_at(at);
    if let Ok(f) = StreamFrame::learn(stream) {
        // With the ROM pages, when `saved` holds the stream's device sections.
        let f = f.clone().with_rom(stream, saved).unwrap_or(f);
        let mut out = Vec::new();
        if f.wrap(saved, &mut out).is_ok() {
            assert!(out.len() >= saved.len() - 8 + f.head.len());
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests;
