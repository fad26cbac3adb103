//! Entry points shared by the cargo-fuzz target and the corpus replay test.

use crate::etcd::{keepalive_ttl, range_kv, txn_result};
use crate::Replica;

/// Runs `data` through everything tandem-fence parses from etcd — a reply body (JSON of the
/// gateway: range, transaction, keepalive) and a stored replica record: never a panic.
pub fn etcd_input(data: &[u8]) {
    let _ = Replica::parse(data);
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = keepalive_ttl(&v);
        if let Some(kv) = range_kv(&v) {
            let _ = Replica::parse(&kv.value);
        }
        if let Some(t) = txn_result(&v) {
            for kv in t.reads.into_iter().flatten() {
                let _ = Replica::parse(&kv.value);
            }
        }
    }
}
