//! The demo's redis client, run inside the clients' network namespace: several connections,
//! writing numbered values over its own 4096 keys in pipelined batches and remembering how
//! many of its writes were acknowledged, so that after failover every key can be checked to
//! hold its last acknowledged write (or a later one).

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::kv::KvClient;
use anyhow::Context;

/// Reply timeout: longer than any failover, so connections survive it.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

pub fn connect(netns: &str, addr: SocketAddr) -> anyhow::Result<KvClient> {
    let s = tandem_net::netns::in_netns(Some(netns), move || {
        TcpStream::connect_timeout(&addr, Duration::from_secs(3))
    })??;
    Ok(KvClient::from_stream(s, REPLY_TIMEOUT)?)
}

/// Waits until redis answers PING.
pub fn wait_ready(netns: &str, addr: SocketAddr, timeout: Duration) -> anyhow::Result<KvClient> {
    let deadline = Instant::now() + timeout;
    loop {
        match connect(netns, addr).and_then(|mut c| Ok(c.ping().map(|_| c)?)) {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() > deadline => {
                return Err(e).with_context(|| format!("redis at {addr} does not answer"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// Keys per connection: write `seq` goes to key `seq % SLOTS`, so the data set stays bounded
/// (no eviction under redis's maxmemory, no full disk from its append-only file) however long
/// the client runs.
const SLOTS: u64 = 4096;

fn key(conn: usize, seq: u64) -> Vec<u8> {
    format!("w{conn}:{}", seq % SLOTS).into_bytes()
}

fn value(conn: usize, seq: u64) -> Vec<u8> {
    format!("{conn}-{seq}-tandem-acknowledged-write").into_bytes()
}

/// The write sequence number stored in a value of connection `conn`.
fn seq_of(conn: usize, v: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(v).ok()?;
    let mut f = s.split('-');
    (f.next()? == conn.to_string()).then_some(())?;
    let seq = f.next()?.parse().ok()?;
    (value(conn, seq) == v).then_some(seq)
}

/// Shared state of the writers.
pub struct Writers {
    stop: Arc<AtomicBool>,
    /// Acknowledged writes per connection (keys 0..n of that connection).
    pub acked: Arc<Vec<AtomicU64>>,
    /// Completed operations (all connections).
    pub ops: Arc<AtomicU64>,
    /// Batch round-trip times in ms.
    pub latencies: Arc<Mutex<Vec<(Instant, f64)>>>,
    /// Reconnects after a broken connection.
    pub reconnects: Arc<AtomicU64>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Writers {
    pub fn start(netns: &str, addr: SocketAddr, conns: usize, batch: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let acked: Arc<Vec<AtomicU64>> = Arc::new((0..conns).map(|_| AtomicU64::new(0)).collect());
        let ops = Arc::new(AtomicU64::new(0));
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let reconnects = Arc::new(AtomicU64::new(0));
        let handles = (0..conns)
            .map(|c| {
                let (stop, acked, ops, lat, rec) = (
                    stop.clone(),
                    acked.clone(),
                    ops.clone(),
                    latencies.clone(),
                    reconnects.clone(),
                );
                let ns = netns.to_string();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        let Ok(mut cl) = connect(&ns, addr) else {
                            std::thread::sleep(Duration::from_millis(100));
                            continue;
                        };
                        loop {
                            if stop.load(Ordering::SeqCst) {
                                return;
                            }
                            let base = acked[c].load(Ordering::SeqCst);
                            let kv: Vec<(Vec<u8>, Vec<u8>)> = (base..base + batch as u64)
                                .map(|s| (key(c, s), value(c, s)))
                                .collect();
                            let cmds: Vec<Vec<&[u8]>> =
                                kv.iter().map(|(k, v)| vec![&b"SET"[..], k, v]).collect();
                            let t = Instant::now();
                            if cl.send_pipeline(&cmds).is_err() {
                                break;
                            }
                            let mut ok = true;
                            for i in 0..batch as u64 {
                                match cl.read_reply() {
                                    Ok(Some(r)) if r == b"OK" => {
                                        acked[c].store(base + i + 1, Ordering::SeqCst);
                                        ops.fetch_add(1, Ordering::Relaxed);
                                    }
                                    _ => {
                                        ok = false;
                                        break;
                                    }
                                }
                            }
                            if !ok {
                                break;
                            }
                            let ms = t.elapsed().as_secs_f64() * 1000.0;
                            lat.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((Instant::now(), ms));
                        }
                        rec.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        Writers {
            stop,
            acked,
            ops,
            latencies,
            reconnects,
            handles,
        }
    }

    /// Stops the writers (each finishes its batch) and returns the acknowledged counts.
    pub fn stop(mut self) -> Vec<u64> {
        self.stop.store(true, Ordering::SeqCst);
        for h in std::mem::take(&mut self.handles) {
            let _ = h.join();
        }
        self.acked
            .iter()
            .map(|a| a.load(Ordering::SeqCst))
            .collect()
    }
}

impl Drop for Writers {
    /// Writers given up on stop at their next batch instead of writing to the next round's
    /// guest at the same address.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Checks every key the writers used: it must hold the last write the client saw acknowledged
/// for it, or a later write of the same connection (written, not yet acknowledged when the
/// client stopped). Returns (keys checked, keys that lost an acknowledged write, first such).
pub fn verify(c: &mut KvClient, acked: &[u64]) -> anyhow::Result<(u64, u64, Option<String>)> {
    let (mut checked, mut lost, mut first) = (0, 0, None);
    for (conn, &n) in acked.iter().enumerate() {
        // The last acknowledged write of each slot: seq in [n - SLOTS, n).
        let seqs: Vec<u64> = (n.saturating_sub(SLOTS)..n).collect();
        for chunk in seqs.chunks(500) {
            let keys: Vec<Vec<u8>> = chunk.iter().map(|&s| key(conn, s)).collect();
            let cmds: Vec<Vec<&[u8]>> = keys.iter().map(|k| vec![&b"GET"[..], k]).collect();
            let replies = c
                .pipeline(&cmds)
                .context("reading back acknowledged writes")?;
            for (&s, r) in chunk.iter().zip(replies) {
                checked += 1;
                let ok = r
                    .as_deref()
                    .and_then(|v| seq_of(conn, v))
                    .is_some_and(|got| got >= s && got % SLOTS == s % SLOTS);
                if !ok {
                    lost += 1;
                    first.get_or_insert_with(|| {
                        format!(
                            "{} (acknowledged write {s})",
                            String::from_utf8_lossy(&key(conn, s))
                        )
                    });
                }
            }
        }
    }
    Ok((checked, lost, first))
}

/// redis `run_id` and `uptime_in_seconds`.
pub fn server_identity(c: &mut KvClient) -> anyhow::Result<(String, u64)> {
    let info = c.info("server")?;
    let field = |k: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    Ok((
        field("run_id:"),
        field("uptime_in_seconds:").parse().unwrap_or(0),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_carry_their_sequence() {
        assert_eq!(seq_of(3, &value(3, 12345)), Some(12345));
        assert_eq!(seq_of(4, &value(3, 12345)), None);
        assert_eq!(seq_of(3, b"3-12-garbage"), None);
        assert_eq!(key(1, 5), key(1, 5 + SLOTS));
    }
}
