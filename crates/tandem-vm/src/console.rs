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

/// Incremental reader of a console log file.
pub struct Console {
    path: PathBuf,
    offset: u64,
    text: String,
}

impl Console {
    /// Follows the console file at `path` from its start.
    pub fn new(path: &Path) -> Self {
        Console {
            path: path.to_path_buf(),
            offset: 0,
            text: String::new(),
        }
    }

    /// Reads what the guest printed since the last call; returns all text seen so far.
    pub fn poll(&mut self) -> Result<&str, ConsoleError> {
        let err = |e| ConsoleError::Io(self.path.display().to_string(), e);
        match File::open(&self.path) {
            Ok(mut f) => {
                f.seek(SeekFrom::Start(self.offset)).map_err(err)?;
                let mut buf = Vec::new();
                f.read_to_end(&mut buf).map_err(err)?;
                self.offset += buf.len() as u64;
                self.text.push_str(&String::from_utf8_lossy(&buf));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
        Ok(&self.text)
    }

    /// Everything seen so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The last `n` lines seen.
    pub fn tail(&self, n: usize) -> String {
        let lines: Vec<&str> = self.text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Waits until a line containing `needle` appears after byte `from` of the text; returns
    /// that line. A `TANDEM-ERROR` line from the guest fails the wait at once.
    pub fn wait_for(
        &mut self,
        needle: &str,
        from: usize,
        timeout: Duration,
    ) -> Result<String, ConsoleError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.poll()?;
            let seen = self.text.get(from..).unwrap_or("");
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
