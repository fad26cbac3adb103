//! Per-epoch replication metrics: JSON lines and a Prometheus text endpoint.
//!
//! The exporter is std-only: `metrics-exporter-prometheus` would bring hyper and tokio for one
//! plain-text page, which a 40-line HTTP/1.0 responder serves just as well.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use crate::stats::quantile;

/// One epoch as the primary saw it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EpochMetrics {
    pub epoch: u64,
    pub stop_us: u32,
    pub harvest_us: u32,
    pub copy_us: u32,
    pub devstate_us: u32,
    pub cont_us: u32,
    pub pause_us: u32,
    pub dirty_pages: u64,
    pub raw_bytes: u64,
    pub sent_bytes: u64,
    pub encode_us: u64,
    pub transfer_us: u64,
    /// From handing the epoch to the link to the backup's acknowledgement.
    pub ack_latency_us: Option<u64>,
    /// Guest frames the relay held when this epoch was sealed (waiting for acknowledgements).
    pub held_frames: u64,
    /// Their bytes.
    pub held_bytes: u64,
    /// Guest frames released to the outside so far.
    pub released_frames: u64,
    /// Disk writes of this epoch and their bytes.
    pub disk_writes: u64,
    pub disk_bytes: u64,
}

#[derive(Default)]
struct State {
    epochs: u64,
    acked: u64,
    dirty: u64,
    raw: u64,
    sent: u64,
    encode_us: u64,
    transfer_us: u64,
    pauses_ms: Vec<f64>,
    ack_ms: Vec<f64>,
    disk_bytes: u64,
    released: u64,
    last: EpochMetrics,
}

/// Shared metrics of a running primary.
#[derive(Default, Clone)]
pub struct Registry(Arc<Mutex<State>>);

impl Registry {
    /// Records an epoch once it was sent.
    pub fn sent(&self, m: &EpochMetrics) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.epochs += 1;
        s.dirty += m.dirty_pages;
        s.raw += m.raw_bytes;
        s.sent += m.sent_bytes;
        s.encode_us += m.encode_us;
        s.transfer_us += m.transfer_us;
        s.disk_bytes += m.disk_bytes;
        s.pauses_ms.push(m.pause_us as f64 / 1000.0);
        s.last = m.clone();
    }

    /// Records an acknowledgement and its latency.
    pub fn acked(&self, epoch: u64, latency_us: u64, released_frames: u64) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.acked = s.acked.max(epoch);
        s.released = s.released.max(released_frames);
        s.ack_ms.push(latency_us as f64 / 1000.0);
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut o = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, lines: Vec<(String, f64)>| {
            o.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (labels, v) in lines {
                o.push_str(&format!("{name}{labels} {v}\n"));
            }
        };
        let one = |v: f64| vec![(String::new(), v)];
        metric(
            "tandem_epochs_total",
            "counter",
            "Epochs checkpointed and sent.",
            one(s.epochs as f64),
        );
        metric(
            "tandem_acked_epoch",
            "gauge",
            "Last epoch the backup acknowledged.",
            one(s.acked as f64),
        );
        metric(
            "tandem_dirty_pages_total",
            "counter",
            "Dirty pages harvested.",
            one(s.dirty as f64),
        );
        metric(
            "tandem_raw_bytes_total",
            "counter",
            "Dirty page and device-state bytes before encoding.",
            one(s.raw as f64),
        );
        metric(
            "tandem_sent_bytes_total",
            "counter",
            "Bytes sent to the backup.",
            one(s.sent as f64),
        );
        metric(
            "tandem_encode_seconds_total",
            "counter",
            "Time spent encoding epochs.",
            one(s.encode_us as f64 / 1e6),
        );
        metric(
            "tandem_transfer_seconds_total",
            "counter",
            "Time spent writing epochs to the link.",
            one(s.transfer_us as f64 / 1e6),
        );
        metric(
            "tandem_disk_bytes_total",
            "counter",
            "Guest disk-write bytes shipped with epochs.",
            one(s.disk_bytes as f64),
        );
        metric(
            "tandem_held_frames",
            "gauge",
            "Guest network frames held at the last seal, waiting for acknowledgements.",
            one(s.last.held_frames as f64),
        );
        metric(
            "tandem_released_frames_total",
            "counter",
            "Guest network frames released after their epoch was acknowledged.",
            one(s.released as f64),
        );
        let summary = |v: &[f64]| {
            let mut l: Vec<(String, f64)> = [0.5, 0.9, 0.99]
                .iter()
                .map(|q| (format!("{{quantile=\"{q}\"}}"), quantile(v, *q) / 1000.0))
                .collect();
            l.push(("_sum".into(), v.iter().sum::<f64>() / 1000.0));
            l.push(("_count".into(), v.len() as f64));
            l
        };
        metric(
            "tandem_pause_seconds",
            "summary",
            "Guest pause per epoch (type II downtime).",
            summary(&s.pauses_ms),
        );
        metric(
            "tandem_ack_latency_seconds",
            "summary",
            "From handing an epoch to the link to its acknowledgement.",
            summary(&s.ack_ms),
        );
        let l = &s.last;
        let comps = [
            ("stop", l.stop_us),
            ("harvest", l.harvest_us),
            ("copy", l.copy_us),
            ("device_state", l.devstate_us),
            ("cont", l.cont_us),
        ];
        metric(
            "tandem_last_pause_component_seconds",
            "gauge",
            "Pause components of the last epoch.",
            comps
                .iter()
                .map(|(c, v)| (format!("{{component=\"{c}\"}}"), *v as f64 / 1e6))
                .collect(),
        );
        o
    }
}

/// Serves `GET /metrics` on `addr` from a background thread; returns the bound address.
pub fn serve(addr: &str, reg: Registry) -> std::io::Result<std::net::SocketAddr> {
    let l = TcpListener::bind(addr)?;
    let bound = l.local_addr()?;
    std::thread::spawn(move || {
        for mut c in l.incoming().map_while(Result::ok) {
            let mut req = [0u8; 1024];
            let n = c.read(&mut req).unwrap_or(0);
            let ok = req[..n].starts_with(b"GET /metrics");
            let (status, body) = if ok {
                ("200 OK", reg.render())
            } else {
                ("404 Not Found", "try /metrics\n".into())
            };
            let _ = write!(
                c,
                "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_serves_prometheus_text() {
        let r = Registry::default();
        r.sent(&EpochMetrics {
            epoch: 1,
            pause_us: 7000,
            stop_us: 500,
            dirty_pages: 10,
            raw_bytes: 40960,
            sent_bytes: 900,
            ..Default::default()
        });
        r.acked(1, 1500, 0);
        let text = r.render();
        assert!(text.contains("tandem_epochs_total 1\n"));
        assert!(text.contains("tandem_pause_seconds{quantile=\"0.5\"} 0.007\n"));
        assert!(text.contains("tandem_last_pause_component_seconds{component=\"stop\"} 0.0005\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(name.starts_with("tandem_"), "{line}");
            value.parse::<f64>().unwrap();
        }
        let addr = serve("127.0.0.1:0", r).unwrap();
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut resp = String::new();
        c.read_to_string(&mut resp).unwrap();
        assert!(
            resp.starts_with("HTTP/1.0 200 OK") && resp.contains("tandem_acked_epoch 1"),
            "{resp}"
        );
    }
}
