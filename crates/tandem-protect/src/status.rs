//! A daemon's side of its owner: the [`Event`]s it says (status lines among them) and the
//! [`Stop`] requests it hears. The caller decides where events go (the binary prints info
//! lines on stdout and warnings on stderr; a [`DaemonHandle`] puts them on a channel).
//!
//! [`DaemonHandle`]: crate::DaemonHandle

use std::sync::Arc;

use crate::events::Event;
use crate::stop::Stop;

/// One status line.
#[derive(Debug, Clone, Copy)]
pub enum Line<'a> {
    /// Progress and state changes.
    Info(&'a str),
    /// Something is wrong but the daemon goes on (or explains why it stops).
    Warn(&'a str),
}

/// A cloneable sink for a daemon's events, its lines prefixed with the daemon's role
/// (`primary: ...`), and the requests its owner makes.
#[derive(Clone)]
pub struct Status {
    who: &'static str,
    out: Arc<dyn Fn(&Event) + Send + Sync>,
    stop: Stop,
}

impl Status {
    /// Lines of `who` (e.g. `"primary"`) go to `out`; typed events are dropped.
    pub fn new(who: &'static str, out: impl Fn(Line<'_>) + Send + Sync + 'static) -> Self {
        Status::with_events(who, move |e| match e {
            Event::Info { text } => out(Line::Info(text)),
            Event::Warn { text } => out(Line::Warn(text)),
            _ => {}
        })
    }

    /// Every event of `who` goes to `out`.
    pub fn with_events(who: &'static str, out: impl Fn(&Event) + Send + Sync + 'static) -> Self {
        Status {
            who,
            out: Arc::new(out),
            stop: Stop::new(),
        }
    }

    /// The same sink, its daemon answering to `stop`.
    pub fn with_stop(mut self, stop: Stop) -> Self {
        self.stop = stop;
        self
    }

    /// The same sink with another role prefix.
    pub fn with_role(&self, who: &'static str) -> Self {
        Status {
            who,
            out: self.out.clone(),
            stop: self.stop.clone(),
        }
    }

    /// A sink that drops every line.
    pub fn quiet() -> Self {
        Status::new("", |_| {})
    }

    /// The requests the daemon's owner makes.
    pub fn stop(&self) -> &Stop {
        &self.stop
    }

    /// A progress or state line.
    pub fn info(&self, msg: impl AsRef<str>) {
        (self.out)(&Event::Info {
            text: self.prefixed(msg.as_ref()),
        });
    }

    /// A warning line.
    pub fn warn(&self, msg: impl AsRef<str>) {
        (self.out)(&Event::Warn {
            text: self.prefixed(msg.as_ref()),
        });
    }

    /// A typed event.
    pub fn event(&self, e: Event) {
        (self.out)(&e);
    }

    fn prefixed(&self, msg: &str) -> String {
        if self.who.is_empty() {
            msg.to_string()
        } else {
            format!("{}: {msg}", self.who)
        }
    }
}
