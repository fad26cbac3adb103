//! Progress of long copies (the first pass of the disk mirrors, a session's initial copy):
//! logged with percentage, rate and time left every few seconds, and shown by `tandem status`
//! (the status document's `progress`) while it runs; dropping the [`Progress`] ends it.

use std::time::{Duration, Instant};

use crate::metrics::Registry;
use crate::Status;

/// How often a running copy logs a line.
pub const LOG_EVERY: Duration = Duration::from_secs(5);

/// One long copy's progress.
pub struct Progress {
    what: &'static str,
    total: u64,
    done: u64,
    started: Instant,
    logged: Instant,
    status: Status,
    registry: Registry,
}

impl Progress {
    /// Starts reporting `what` (e.g. "initial copy") of `total` bytes.
    pub fn new(what: &'static str, total: u64, status: &Status, registry: &Registry) -> Progress {
        let now = Instant::now();
        let p = Progress {
            what,
            total,
            done: 0,
            started: now,
            logged: now,
            status: status.clone(),
            registry: registry.clone(),
        };
        p.publish();
        p
    }

    /// `done` bytes of the total are copied.
    pub fn update(&mut self, done: u64) {
        self.done = done.min(self.total);
        self.publish();
        if self.logged.elapsed() >= LOG_EVERY {
            self.logged = Instant::now();
            self.status.info(self.line());
        }
    }

    fn rate(&self) -> f64 {
        let s = self.started.elapsed().as_secs_f64();
        if s > 0.0 {
            self.done as f64 / s
        } else {
            0.0
        }
    }

    fn eta_s(&self) -> Option<f64> {
        let r = self.rate();
        (r > 0.0).then(|| (self.total - self.done) as f64 / r)
    }

    fn percent(&self) -> f64 {
        if self.total == 0 {
            100.0
        } else {
            self.done as f64 * 100.0 / self.total as f64
        }
    }

    /// `initial copy: 340 of 1024 MiB (33 %), 61 MB/s, about 11 s left`
    pub fn line(&self) -> String {
        let eta = self.eta_s().map_or("time left unknown".into(), |s| {
            format!("about {s:.0} s left")
        });
        format!(
            "{}: {} of {} MiB ({:.0} %), {:.0} MB/s, {eta}",
            self.what,
            self.done >> 20,
            self.total >> 20,
            self.percent(),
            self.rate() / 1e6
        )
    }

    fn publish(&self) {
        self.registry.set_progress(Some(serde_json::json!({
            "what": self.what,
            "done_bytes": self.done,
            "total_bytes": self.total,
            "percent": (self.percent() * 10.0).round() / 10.0,
            "bytes_per_s": self.rate().round(),
            "eta_s": self.eta_s().map(|s| (s * 10.0).round() / 10.0),
        })));
    }
}

/// The copy ended (or failed): nothing more is shown.
impl Drop for Progress {
    fn drop(&mut self) {
        self.registry.set_progress(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_rate_and_time_left() {
        let status = Status::new("test", |_| {});
        let registry = Registry::default();
        let mut p = Progress::new("initial copy", 1000 << 20, &status, &registry);
        assert_eq!(registry.status()["progress"]["percent"], 0.0);
        std::thread::sleep(Duration::from_millis(50));
        p.update(250 << 20);
        let doc = registry.status();
        assert_eq!(doc["progress"]["percent"], 25.0, "{doc}");
        assert_eq!(doc["progress"]["what"], "initial copy");
        let eta = doc["progress"]["eta_s"].as_f64().unwrap();
        // 750 of the 1000 MiB are left at the rate of the first 250: three times the time
        // taken so far (at least 50 ms).
        assert!(eta >= 0.1, "{doc}");
        assert!(
            p.line().starts_with("initial copy: 250 of 1000 MiB (25 %)"),
            "{}",
            p.line()
        );
        drop(p);
        assert!(registry.status()["progress"].is_null());
    }
}
