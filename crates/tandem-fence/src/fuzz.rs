//! Entry points shared by the cargo-fuzz target and the corpus replay test.

use crate::etcd::{range_kv, range_kvs, txn_result};
use crate::Record;

/// Runs `data` through everything tandem-fence parses from etcd — a reply body (JSON of the
/// gateway: range, transaction) and a stored ownership record: never a panic.
pub fn etcd_input(data: &[u8]) {
    let _ = Record::parse(data);
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        if let Some(kv) = range_kv(&v) {
            let _ = Record::parse(&kv.value);
        }
        for (_, kv) in range_kvs(&v) {
            let _ = Record::parse(&kv.value);
        }
        if let Some(t) = txn_result(&v) {
            for kv in t.reads.into_iter().flatten() {
                let _ = Record::parse(&kv.value);
            }
        }
    }
}
