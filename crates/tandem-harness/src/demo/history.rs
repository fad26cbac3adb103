//! A history of list appends and its checker, in the manner of Jepsen's list-append workload
//! (single writer per key): each appender appends 1, 2, 3, ... to its own redis list, one
//! request in flight (the client's reply timeout, 30 s, outlasts any failover), and records
//! every operation's invocation and outcome — ok (with the
//! length redis returned), failed (never sent) or unknown (sent, no reply). After the round
//! the lists are read back and checked:
//!
//! - every acknowledged append is present, at the position its reply said (a value before it
//!   that redis counted and then lost is caught too);
//! - no value that was never invoked, no value twice;
//! - values in the order they were appended.
//!
//! With one writer per key these checks are complete for the list-append model: a history
//! that passes them is linearizable (every read of the final list is consistent with an
//! order of the appends that respects real time).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::client::connect;
use crate::kv::KvClient;

/// How an append ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Acknowledged; redis said the list then had this many elements.
    Ok(u64),
    /// Never sent (no connection).
    Failed,
    /// Sent; the connection broke before the reply.
    Unknown,
}

/// One append: its value, outcome and when it was invoked and completed (ms since the start).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Op {
    /// The appender (its list is `h<appender>`).
    pub appender: usize,
    /// The value appended.
    pub value: u64,
    /// What came of it.
    pub outcome: Outcome,
    /// Invocation, ms since the history began.
    pub invoke_ms: f64,
    /// Completion, ms since the history began.
    pub complete_ms: f64,
}

/// Appenders running in the clients' namespace.
pub struct Appenders {
    stop: Arc<AtomicBool>,
    ops: Arc<Mutex<Vec<Op>>>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

fn key(appender: usize) -> Vec<u8> {
    format!("h{appender}").into_bytes()
}

impl Appenders {
    /// Starts `n` appenders against redis at `addr` from namespace `ns`.
    pub fn start(ns: &str, addr: SocketAddr, n: usize) -> Appenders {
        let stop = Arc::new(AtomicBool::new(false));
        let ops: Arc<Mutex<Vec<Op>>> = Arc::default();
        let t0 = Instant::now();
        let handles = (0..n)
            .map(|a| {
                let (stop, ops, ns) = (stop.clone(), ops.clone(), ns.to_string());
                std::thread::spawn(move || {
                    let ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1000.0;
                    let mut conn: Option<KvClient> = None;
                    let mut value = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        value += 1;
                        let invoked = Instant::now();
                        if conn.is_none() {
                            conn = connect(&ns, addr).ok();
                        }
                        let outcome = match conn.as_mut() {
                            None => Outcome::Failed,
                            Some(c) => {
                                let v = value.to_string();
                                let cmd = [&b"RPUSH"[..], &key(a), v.as_bytes()];
                                match c.send_pipeline(&[cmd.to_vec()]) {
                                    Err(_) => Outcome::Unknown,
                                    Ok(()) => match c.read_reply() {
                                        Ok(Some(len)) => std::str::from_utf8(&len)
                                            .ok()
                                            .and_then(|l| l.parse().ok())
                                            .map_or(Outcome::Unknown, Outcome::Ok),
                                        _ => Outcome::Unknown,
                                    },
                                }
                            }
                        };
                        if outcome != Outcome::Failed && !matches!(outcome, Outcome::Ok(_)) {
                            conn = None;
                        }
                        if outcome == Outcome::Failed {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        ops.lock().unwrap_or_else(|e| e.into_inner()).push(Op {
                            appender: a,
                            value,
                            outcome,
                            invoke_ms: ms(invoked),
                            complete_ms: ms(Instant::now()),
                        });
                    }
                })
            })
            .collect();
        Appenders { stop, ops, handles }
    }

    /// Stops the appenders (each finishes its append) and returns the history.
    pub fn stop(mut self) -> Vec<Op> {
        self.stop.store(true, Ordering::SeqCst);
        for h in std::mem::take(&mut self.handles) {
            let _ = h.join();
        }
        std::mem::take(&mut *self.ops.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for Appenders {
    /// Appenders given up on (their guest is gone) stop at their next append instead of
    /// appending to the next round's guest at the same address.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// What the checker found.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Check {
    /// Appends invoked, acknowledged, failed and unknown.
    pub invoked: u64,
    /// Acknowledged.
    pub ok: u64,
    /// Never sent.
    pub failed: u64,
    /// Outcome unknown.
    pub unknown: u64,
    /// Acknowledged appends missing from the list.
    pub lost: u64,
    /// Acknowledged appends present at another position than their reply said.
    pub misplaced: u64,
    /// Values in a list that were never appended.
    pub never_written: u64,
    /// Values present twice.
    pub duplicated: u64,
    /// Values out of the order they were appended in.
    pub out_of_order: u64,
    /// The first anomaly, described.
    pub first: Option<String>,
}

impl Check {
    /// Anomalies found (0: the history is valid).
    pub fn anomalies(&self) -> u64 {
        self.lost + self.misplaced + self.never_written + self.duplicated + self.out_of_order
    }
}

/// Checks `history` against the lists read back (`lists[a]` is appender `a`'s list).
pub fn check(history: &[Op], lists: &[Vec<u64>]) -> Check {
    let mut c = Check::default();
    let note = |c: &mut Check, what: String| {
        c.first.get_or_insert(what);
    };
    for op in history {
        c.invoked += 1;
        match op.outcome {
            Outcome::Ok(_) => c.ok += 1,
            Outcome::Failed => c.failed += 1,
            Outcome::Unknown => c.unknown += 1,
        }
    }
    for (a, list) in lists.iter().enumerate() {
        let mine: Vec<&Op> = history.iter().filter(|o| o.appender == a).collect();
        let invoked: std::collections::HashMap<u64, &Op> =
            mine.iter().map(|o| (o.value, *o)).collect();
        let mut seen = std::collections::HashSet::new();
        let mut last = 0u64;
        for (i, &v) in list.iter().enumerate() {
            match invoked.get(&v) {
                None => {
                    c.never_written += 1;
                    note(
                        &mut c,
                        format!("list h{a} holds {v}, which was never appended"),
                    );
                }
                Some(op) if op.outcome == Outcome::Failed => {
                    c.never_written += 1;
                    note(
                        &mut c,
                        format!("list h{a} holds {v}, whose append was never sent"),
                    );
                }
                Some(_) => {}
            }
            if !seen.insert(v) {
                c.duplicated += 1;
                note(&mut c, format!("list h{a} holds {v} twice"));
            } else if v <= last {
                c.out_of_order += 1;
                note(
                    &mut c,
                    format!("list h{a} holds {v} after {last} (position {i})"),
                );
            }
            last = last.max(v);
        }
        let position: std::collections::HashMap<u64, usize> =
            list.iter().enumerate().map(|(i, &v)| (v, i)).collect();
        for op in &mine {
            let Outcome::Ok(len) = op.outcome else {
                continue;
            };
            match position.get(&op.value) {
                None => {
                    c.lost += 1;
                    note(
                        &mut c,
                        format!("acknowledged append {} to h{a} is missing", op.value),
                    );
                }
                Some(&i) if i as u64 + 1 != len => {
                    c.misplaced += 1;
                    note(
                        &mut c,
                        format!("acknowledged append {} to h{a} is at position {} but its reply said length {len}", op.value, i + 1),
                    );
                }
                Some(_) => {}
            }
        }
    }
    c
}

/// Reads every appender's list back.
pub fn read_lists(c: &mut KvClient, n: usize) -> anyhow::Result<Vec<Vec<u64>>> {
    (0..n)
        .map(|a| {
            Ok(c.lrange(&key(a))?
                .iter()
                .map(|v| {
                    std::str::from_utf8(v)
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(u64::MAX)
                })
                .collect())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(a: usize, value: u64, outcome: Outcome) -> Op {
        Op {
            appender: a,
            value,
            outcome,
            invoke_ms: value as f64,
            complete_ms: value as f64 + 0.5,
        }
    }

    #[test]
    fn a_valid_history_passes_and_each_anomaly_is_found() {
        let h = vec![
            op(0, 1, Outcome::Ok(1)),
            op(0, 2, Outcome::Unknown),
            op(0, 3, Outcome::Ok(3)),
            op(0, 4, Outcome::Failed),
            op(0, 5, Outcome::Unknown),
        ];
        // 2 committed though its reply was lost, 5 did not: both fine.
        let ok = check(&h, &[vec![1, 2, 3]]);
        assert_eq!(ok.anomalies(), 0, "{ok:?}");
        assert_eq!((ok.ok, ok.unknown, ok.failed), (2, 2, 1));
        // An acknowledged append lost.
        assert_eq!(check(&h, &[vec![1, 2]]).lost, 1);
        // One that redis counted (3's reply said length 3), then lost.
        assert_eq!(check(&h, &[vec![1, 3]]).misplaced, 1);
        // A value never sent, one never invoked, one twice, one out of order.
        assert_eq!(check(&h, &[vec![1, 2, 3, 4]]).never_written, 1);
        assert_eq!(check(&h, &[vec![1, 2, 3, 9]]).never_written, 1);
        assert_eq!(check(&h, &[vec![1, 2, 3, 3]]).duplicated, 1);
        let c = check(&h, &[vec![2, 1, 3]]);
        assert!(c.out_of_order >= 1 && c.first.is_some(), "{c:?}");
    }
}
