//! The guest's serial console, written by QEMU to a file and read by tandem.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Errors waiting on the console.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// Reading the console file failed.
    #[error("cannot read guest console {0}")]
    Io(String, #[source] std::io::Error),
    /// The guest reported an error line.
    #[error("guest reported: {0}")]
    Guest(String),
    /// The expected line did not appear in time.
    #[error("guest did not print {needle:?} within {timeout:?}; last console lines:\n{tail}")]
    Timeout {
        /// What was awaited.
        needle: String,
        /// How long.
        timeout: Duration,
        /// The end of the console output.
        tail: String,
    },
}

/// Most console text a [`Console`] keeps in memory (the newest; older lines are dropped).
pub const KEEP_BYTES: usize = 256 << 10;

/// Incremental reader of a console log file. Memory is bounded: it keeps the newest
/// [`KEEP_BYTES`] of text (a guest that prints for weeks costs no more), and a file that shrank
/// (rotated, truncated) is followed from its new start.
pub struct Console {
    path: PathBuf,
    offset: u64,
    text: String,
    /// Bytes of text dropped from the front so far.
    dropped: usize,
}

impl Console {
    /// Follows the console file at `path` from its start.
    pub fn new(path: &Path) -> Self {
        Console {
            path: path.to_path_buf(),
            offset: 0,
            text: String::new(),
            dropped: 0,
        }
    }

    /// Reads what the guest printed since the last call; returns the text kept (the newest
    /// [`KEEP_BYTES`] at most).
    pub fn poll(&mut self) -> Result<&str, ConsoleError> {
        let path = self.path.display().to_string();
        let err = |e| ConsoleError::Io(path.clone(), e);
        match File::open(&self.path) {
            Ok(mut f) => {
                let len = f.metadata().map_err(err)?.len();
                if len < self.offset {
                    self.offset = 0; // rotated or truncated: its new content is new text
                }
                // Skip what would be dropped at once anyway.
                let keep = KEEP_BYTES as u64;
                if len - self.offset > keep {
                    self.drop_front(self.text.len());
                    self.dropped += (len - keep - self.offset) as usize;
                    self.offset = len - keep;
                }
                f.seek(SeekFrom::Start(self.offset)).map_err(err)?;
                let mut buf = Vec::new();
                f.take(keep).read_to_end(&mut buf).map_err(err)?;
                self.offset += buf.len() as u64;
                self.text.push_str(&String::from_utf8_lossy(&buf));
                if self.text.len() > KEEP_BYTES {
                    let cut = self.text.len() - KEEP_BYTES;
                    // At a line start (or a character boundary in a very long line).
                    let cut = self.text[cut..]
                        .find('\n')
                        .map(|i| cut + i + 1)
                        .unwrap_or_else(|| {
                            (cut..)
                                .find(|&i| self.text.is_char_boundary(i))
                                .unwrap_or(cut)
                        });
                    self.drop_front(cut);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
        Ok(&self.text)
    }

    fn drop_front(&mut self, n: usize) {
        self.text.drain(..n);
        self.dropped += n;
    }

    /// Position of the first byte kept, counted over all text ever read (positions of
    /// [`Console::text`] are this plus their index).
    pub fn start(&self) -> usize {
        self.dropped
    }

    /// The text kept (the newest [`KEEP_BYTES`] at most).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The last `n` lines seen.
    pub fn tail(&self, n: usize) -> String {
        let lines: Vec<&str> = self.text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Waits until a line containing `needle` appears after position `from` (see
    /// [`Console::start`]; 0: anything kept); returns that line. A `TANDEM-ERROR` line from the guest fails the wait at once.
    pub fn wait_for(
        &mut self,
        needle: &str,
        from: usize,
        timeout: Duration,
    ) -> Result<String, ConsoleError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.poll()?;
            let seen = self
                .text
                .get(from.saturating_sub(self.dropped)..)
                .unwrap_or("");
            for line in seen.lines() {
                if line.contains(needle) {
                    return Ok(line.trim().to_string());
                }
                if line.contains("TANDEM-ERROR") {
                    return Err(ConsoleError::Guest(line.trim().to_string()));
                }
            }
            if Instant::now() > deadline {
                return Err(ConsoleError::Timeout {
                    needle: needle.into(),
                    timeout,
                    tail: self.tail(15),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn memory_is_bounded_and_rotation_is_followed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.log");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        let mut c = Console::new(&path);
        for i in 0..20_000 {
            writeln!(f, "line {i} of a chatty guest").unwrap();
            if i % 5000 == 0 {
                c.poll().unwrap();
            }
        }
        let text = c.poll().unwrap().to_string();
        assert!(text.len() <= KEEP_BYTES, "{}", text.len());
        assert!(text.starts_with("line ") && text.ends_with("line 19999 of a chatty guest\n"));
        assert_eq!(
            c.start() + text.len(),
            std::fs::metadata(&path).unwrap().len() as usize
        );
        // Rotated (truncated under an O_APPEND writer): the new lines are read from the start.
        f.set_len(0).unwrap();
        writeln!(f, "after rotation").unwrap();
        assert!(c.poll().unwrap().ends_with("after rotation\n"));
        assert_eq!(
            c.wait_for("after rotation", 0, Duration::from_secs(1))
                .unwrap(),
            "after rotation"
        );
    }
}
