//! A daemon started in its own thread, as a program that embeds tandem runs it: the handle
//! asks it to stop, shut down or switch over, and hands out its [`Event`]s.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tandem_protect::{backup, primary, Event, VmSpec};
//!
//! let b = backup::spawn(backup::BackupConfig::new(
//!     "127.0.0.1:7000",
//!     "/dev/shm/tandem-vm1",
//!     VmSpec::default(),
//! ));
//! let p = primary::spawn(primary::PrimaryConfig::new("127.0.0.1:7000", VmSpec::default()));
//! for e in p.events() {
//!     if e == Event::Protected {
//!         break;
//!     }
//! }
//! p.request_stop(); // hand the guest over to the backup
//! p.join()?;
//! # b.request_shutdown(); b.join()?;
//! # Ok(()) }
//! ```

use std::sync::mpsc::{sync_channel, Receiver};
use std::thread::JoinHandle;

use crate::events::Event;
use crate::stop::Stop;
use crate::Status;

/// Events a handle keeps for its owner before it drops new ones (about seven minutes of
/// epochs at ten a second).
pub const EVENT_BACKLOG: usize = 4096;

/// A running daemon: its requests, its events and its thread.
pub struct DaemonHandle<T> {
    stop: Stop,
    events: Receiver<Event>,
    thread: JoinHandle<T>,
}

impl<T: Send + 'static> DaemonHandle<T> {
    /// Runs `body` in a thread named `name`; `who` prefixes its status lines.
    pub(crate) fn spawn(
        name: String,
        who: &'static str,
        body: impl FnOnce(Status) -> T + Send + 'static,
    ) -> Self {
        let stop = Stop::new();
        let (tx, events) = sync_channel::<Event>(EVENT_BACKLOG);
        let status = Status::with_events(who, move |e| {
            // The daemon never waits for its owner: an owner that reads no events loses the
            // newest beyond the backlog, and one that dropped the receiver loses them all.
            let _ = tx.try_send(e.clone());
        })
        .with_stop(stop.clone());
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || body(status))
            .unwrap_or_else(|e| panic!("cannot start a daemon thread: {e}"));
        DaemonHandle {
            stop,
            events,
            thread,
        }
    }
}

impl<T> DaemonHandle<T> {
    /// Asks the daemon to stop: a primary hands its guest over to a backup that can take it
    /// (or shuts it down when there is none); a backup stops without failing over.
    pub fn request_stop(&self) {
        self.stop.request_stop();
    }

    /// Asks the daemon to end protection: a primary shuts its guest down.
    pub fn request_shutdown(&self) {
        self.stop.request_shutdown();
    }

    /// Asks a primary node for a planned switchover (refused, with a warning, when no backup
    /// can take the guest or the node cannot serve as a backup afterwards).
    pub fn request_switchover(&self) {
        self.stop.request_switchover();
    }

    /// The requests, for an owner that forwards them from elsewhere (signals, a control API).
    pub fn stopper(&self) -> Stop {
        self.stop.clone()
    }

    /// The daemon's events, in order; the iterator ends when the daemon has ended. Up to
    /// [`EVENT_BACKLOG`] unread events are kept; newer ones are dropped until some are read.
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    /// Whether the daemon has ended.
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Waits for the daemon to end and returns what it returned (a panic in the daemon is
    /// resumed here).
    pub fn join(self) -> T {
        match self.thread.join() {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        }
    }
}
