//! Where a daemon's status lines go. The daemons say what they are doing (guest ready,
//! connected, epoch progress, failover) in one-line messages; the caller decides where they
//! go (the binary prints info lines on stdout and warnings on stderr).

use std::sync::Arc;

/// One status line.
#[derive(Debug, Clone, Copy)]
pub enum Line<'a> {
    /// Progress and state changes.
    Info(&'a str),
    /// Something is wrong but the daemon goes on (or explains why it stops).
    Warn(&'a str),
}

/// A cloneable sink for status lines, prefixed with the daemon's role (`primary: ...`).
#[derive(Clone)]
pub struct Status {
    who: &'static str,
    out: Arc<dyn Fn(Line<'_>) + Send + Sync>,
}

impl Status {
    /// Lines of `who` (e.g. `"primary"`) go to `out`.
    pub fn new(who: &'static str, out: impl Fn(Line<'_>) + Send + Sync + 'static) -> Self {
        Status {
            who,
            out: Arc::new(out),
        }
    }

    /// The same sink with another role prefix.
    pub fn with_role(&self, who: &'static str) -> Self {
        Status {
            who,
            out: self.out.clone(),
        }
    }

    /// A sink that drops every line.
    pub fn quiet() -> Self {
        Status::new("", |_| {})
    }

    /// A progress or state line.
    pub fn info(&self, msg: impl AsRef<str>) {
        (self.out)(Line::Info(&self.prefixed(msg.as_ref())));
    }

    /// A warning line.
    pub fn warn(&self, msg: impl AsRef<str>) {
        (self.out)(Line::Warn(&self.prefixed(msg.as_ref())));
    }

    fn prefixed(&self, msg: &str) -> String {
        if self.who.is_empty() {
            msg.to_string()
        } else {
            format!("{}: {msg}", self.who)
        }
    }
}
