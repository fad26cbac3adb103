//! Each fenced daemon reports what it is doing into etcd, next to the VM's ownership record,
//! so that `tandem list` shows every VM of a cluster from anywhere (as `patronictl list`
//! does): `PREFIX/vm/ID/node/NODE` holds this node's status document (the one `tandem
//! status` prints) with the time it was written. A report older than [`STALE_AFTER`] means the
//! daemon stopped reporting (dead, hung, or cut off from etcd).

use std::sync::Arc;
use std::time::Duration;

use crate::metrics::Registry;

/// How often a daemon writes its report.
pub const EVERY: Duration = Duration::from_secs(2);

/// A report older than this is shown as stale.
pub const STALE_AFTER: Duration = Duration::from_secs(10);

/// Reports `registry`'s status into etcd every [`EVERY`] until `alive` is dropped; errors are
/// ignored (etcd may be away; the ownership record, not the report, decides anything).
pub(crate) fn spawn(
    cfg: tandem_fence::FenceConfig,
    registry: Registry,
    alive: std::sync::Weak<()>,
) {
    let Ok(fence) = tandem_fence::Fence::connect(cfg) else {
        return;
    };
    let _ = std::thread::Builder::new()
        .name("etcd-report".into())
        .spawn(move || report_until(&fence, &registry, &alive));
}

fn report_until(
    fence: &Arc<tandem_fence::Fence>,
    registry: &Registry,
    alive: &std::sync::Weak<()>,
) {
    while alive.upgrade().is_some() {
        let mut doc = registry.status();
        doc["updated_unix_ms"] = crate::unix_ms().into();
        doc["version"] = env!("CARGO_PKG_VERSION").into();
        let _ = fence.report(doc.to_string().as_bytes());
        std::thread::sleep(EVERY);
    }
}
