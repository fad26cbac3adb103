//! What a daemon shows the operator whatever its role: the metrics registry (Prometheus
//! endpoint), the control socket (`tandem status`, `tandem switchover`) and its link to
//! systemd. A node that changes role (docs/REPLICATION.md, "Re-protection and switchover")
//! keeps one frontend for its whole life, so its socket, endpoint and service stay up.

use std::path::Path;

use crate::control::{Control, Handler};
use crate::metrics::Registry;
use crate::service::{Beat, Service};
use crate::{Status, Stop};

/// The registry, control socket, metrics endpoint and systemd link of one daemon.
pub struct Frontend {
    /// What the daemon reports.
    pub registry: Registry,
    /// The main loop's progress (systemd's watchdog pings only while it moves).
    pub beat: Beat,
    _control: Option<Control>,
    service: Service,
    /// Dropped with the frontend: the etcd reporter ends.
    _reporting: std::sync::Arc<()>,
}

/// Where and how a daemon serves its frontend.
pub struct FrontendConfig<'a> {
    /// `primary` or `backup` (the role it starts in).
    pub role: &'static str,
    /// The protected VM.
    pub vm_id: u64,
    /// The VM's fencing (this node's name in etcd, and where it reports for `tandem list`).
    pub fence: Option<tandem_fence::FenceConfig>,
    /// The control socket (default in the run directory).
    pub control: Option<&'a Path>,
    /// Serve Prometheus metrics on this address.
    pub metrics_listen: Option<&'a str>,
    /// Take `switchover` on the control socket (`Some(can_become_backup)`, a primary).
    pub switchover: Option<bool>,
}

impl Frontend {
    /// Starts the frontend; a metrics address that cannot be bound is an error, a control
    /// socket that cannot be created a warning.
    pub fn start(c: FrontendConfig<'_>, status: &Status) -> std::io::Result<Frontend> {
        let registry = Registry::default();
        registry.set_events(status.clone());
        let node = c.fence.as_ref().map(|f| f.node.clone());
        registry.set_identity(c.role, c.vm_id, node);
        let reporting = std::sync::Arc::new(());
        if let Some(f) = c.fence {
            crate::report::spawn(f, registry.clone(), std::sync::Arc::downgrade(&reporting));
        }
        if let Some(addr) = c.metrics_listen {
            let bound = crate::metrics::serve(addr, registry.clone())?;
            status.info(format!("metrics on http://{bound}/metrics"));
        }
        let handler = c
            .switchover
            .map(|can| switchover_handler(registry.clone(), can, status.stop().clone()));
        let control = Control::serve_or_warn_with(
            c.control,
            c.role,
            c.vm_id,
            registry.clone(),
            handler,
            status,
        );
        let beat = Beat::default();
        let b = beat.clone();
        let service = Service::start(registry.clone(), move || b.idle());
        Ok(Frontend {
            registry,
            beat,
            _control: control,
            service,
            _reporting: reporting,
        })
    }

    /// The daemon serves (READY=1 under systemd).
    pub fn ready(&self) {
        self.service.ready();
    }
}

/// The primary's `switchover` command: accepted only while the guest is protected by a backup
/// that can fail over, and only on a node that can then serve as that backup.
pub fn switchover_handler(registry: Registry, can_become_backup: bool, stop: Stop) -> Handler {
    std::sync::Arc::new(move |cmd: &str| match cmd {
        "switchover" if !can_become_backup => serde_json::json!({
            "ok": false,
            "error": "this primary was started without --listen: it cannot serve as the backup afterwards (stop it with SIGTERM for a handover that ends it)",
        }),
        "switchover" if !registry.is_protected() => serde_json::json!({
            "ok": false,
            "error": "the guest is not protected now (no backup that can fail over acknowledged the last epoch): nothing can take it over; see `tandem status`",
        }),
        "switchover" => {
            stop.request_switchover();
            serde_json::json!({"ok": true, "pid": std::process::id()})
        }
        other => serde_json::json!({"ok": false, "error": format!("unknown command {other:?}")}),
    })
}
