//! Shared by the integration tests that run daemons in this process.

use std::time::{Duration, Instant};

use tandem_protect::{DaemonHandle, Event};

/// Reads `h`'s events until `want` matches one (returned) or `within` passes (panics with
/// the events seen). Every event is also kept in `seen`.
pub fn wait_for<T>(
    h: &DaemonHandle<T>,
    seen: &mut Vec<Event>,
    within: Duration,
    want: impl Fn(&Event) -> bool,
) -> Event {
    let t = Instant::now();
    while t.elapsed() < within {
        let Ok(e) = h.events().recv_timeout(Duration::from_millis(100)) else {
            assert!(!h.is_finished(), "the daemon ended; saw {seen:#?}");
            continue;
        };
        if let Event::Info { text } | Event::Warn { text } = &e {
            eprintln!("{text}");
        }
        seen.push(e.clone());
        if want(&e) {
            return e;
        }
    }
    panic!("no such event within {within:?}; saw {seen:#?}");
}
