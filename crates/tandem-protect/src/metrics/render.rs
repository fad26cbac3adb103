//! The Prometheus text exposition of a [`Registry`].

use std::fmt::Write as _;

use super::*;

/// Writes one metric family with its HELP and TYPE lines.
fn family(o: &mut String, name: &str, kind: &str, help: &str, lines: &[(String, String)]) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, v) in lines {
        let _ = writeln!(o, "{name}{labels} {v}");
    }
}

fn histogram(o: &mut String, name: &str, help: &str, h: &Histogram) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (le, n) in h.buckets() {
        let le = if le.is_infinite() {
            "+Inf".to_string()
        } else {
            le.to_string()
        };
        let _ = writeln!(o, "{name}_bucket{{le=\"{le}\"}} {n}");
    }
    let _ = writeln!(o, "{name}_sum {}\n{name}_count {}", h.sum, h.count);
}

impl Registry {
    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let s = self.lock().clone();
        let (c, g) = ("counter", "gauge");
        let secs = |us: u64| (us as f64 / 1e6).to_string();
        let b = |v: bool| u8::from(v).to_string();
        #[rustfmt::skip]
        let rows = [
            ("tandem_epochs_total", c, s.epochs.to_string(), "Epochs checkpointed and sent."),
            ("tandem_acked_epoch", g, s.acked.to_string(), "Last epoch the backup acknowledged."),
            ("tandem_dirty_pages_total", c, s.dirty.to_string(), "Dirty pages harvested."),
            ("tandem_raw_bytes_total", c, s.raw.to_string(),
                "Dirty page, device-state and disk-write bytes before encoding."),
            ("tandem_sent_bytes_total", c, s.sent.to_string(), "Bytes sent to the backup."),
            ("tandem_encode_seconds_total", c, secs(s.encode_us), "Time spent encoding epochs."),
            ("tandem_encode_cpu_seconds_total", c, secs(s.encode_cpu_us),
                "CPU time the encoding thread spent encoding epochs."),
            ("tandem_transfer_seconds_total", c, secs(s.transfer_us),
                "Time spent writing epochs to the link."),
            ("tandem_suspended_seconds_total", c, secs(s.suspended_us),
                "Guest time lost to early suspend (output waited, dirty set at the stop threshold)."),
            ("tandem_long_patch_epochs_total", c, s.long_patch_epochs.to_string(),
                "Epochs whose memory record took long run patches (the codec's per-epoch trial)."),
            ("tandem_word_delta_epochs_total", c, s.word_delta_epochs.to_string(),
                "Epochs whose memory record sent whole pages as word deltas (the codec's per-epoch measurement)."),
            ("tandem_prefix_off_epochs_total", c, s.prefix_off_epochs.to_string(),
                "Epochs whose memory record went without the reference prefix (the codec's check found it saving too little)."),
            ("tandem_guest_cpu_lost_seconds_total", c, secs(s.lost_cpu_us),
                "vCPU time the guest lost to pauses and early suspends: their length x the busiest vCPU's busy share before them (what the budget's vcpu clock charges)."),
            ("tandem_disk_writes_total", c, s.disk_writes.to_string(),
                "Guest disk writes shipped with epochs."),
            ("tandem_disk_bytes_total", c, s.disk_bytes.to_string(),
                "Guest disk-write bytes shipped with epochs."),
            ("tandem_held_frames", g, s.held_frames.to_string(),
                "Guest network frames held, waiting for acknowledgements."),
            ("tandem_held_bytes", g, s.held_bytes.to_string(),
                "Bytes of the guest network frames held."),
            ("tandem_released_frames_total", c, s.released.to_string(),
                "Guest network frames released after their epoch was acknowledged."),
            ("tandem_hold_dropped_frames_total", c, s.hold_dropped.to_string(),
                "Guest network frames dropped because the hold queue was full."),
            ("tandem_release_deferred_total", c, s.release_deferred.to_string(),
                "Acknowledgements that arrived after the backup's promise ran out: their output waited for the next one."),
            ("tandem_link_up", g, b(s.link_up), "1 while the replication link to the backup is up."),
            ("tandem_protected", g, b(s.protected),
                "1 while the guest is protected (output held for a backup that can fail over)."),
            ("tandem_backup_can_failover", g, b(s.backup_can_failover),
                "1 while the backup holds a complete committed copy it could fail over to."),
            ("tandem_runs_guest", g, b(s.who.role == "primary" || s.who.failovers > 0),
                "1 while this daemon runs the guest (a primary, or a backup that failed over)."),
            ("tandem_unreplicated", g, b(s.who.unprotected),
                "1 while the guest runs without a replica and its output passes (recorded in etcd)."),
            ("tandem_reconnects_total", c, s.reconnects.to_string(), "Reconnections to the backup."),
            ("tandem_resyncs_total", c, s.resyncs.to_string(), "Full re-syncs of the backup."),
        ];
        let mut o = String::with_capacity(4096);
        for (name, kind, v, help) in rows {
            family(&mut o, name, kind, help, &[(String::new(), v)]);
        }
        let help = "The daemon's role (label), always 1.";
        let role = (format!("{{role=\"{}\"}}", s.who.role), "1".to_string());
        family(&mut o, "tandem_role", "gauge", help, &[role]);
        let cuts = Reason::ALL.map(|r| {
            let label = format!("{{reason=\"{}\"}}", r.name());
            (label, s.cuts[r.index()].to_string())
        });
        let help = "Epochs by why they ended: time (their longest wait), output (network output waited), disk (the write log's limit), converged (the dirty set stopped growing), start (a session's first), handover (a planned stop's last).";
        family(&mut o, "tandem_epochs_cut_total", c, help, &cuts);
        let waits = Wait::ALL.map(|w| {
            let label = format!("{{rule=\"{}\"}}", w.name());
            (label, s.waits[w.index()].to_string())
        });
        let help = "Epochs whose waiting network output was last held back by: min_run (the guest's minimum run after a pause), budget (the guest-time budget), busy (the busy hold), ack (the previous checkpoint's acknowledgement).";
        family(&mut o, "tandem_output_held_epochs_total", c, help, &waits);
        let help = "Failovers this daemon performed (the backup resumed the guest).";
        family(
            &mut o,
            "tandem_failovers_total",
            "counter",
            help,
            &[(String::new(), s.who.failovers.to_string())],
        );
        if s.epochs > 0 {
            let help = "zstd level of the last epoch's memory record (chosen per epoch from whether the encoder or the link is slower, unless --zstd-level fixes it).";
            let v = s.last.level.to_string();
            family(&mut o, "tandem_zstd_level", g, help, &[(String::new(), v)]);
        }
        if let Some(h) = &s.owner {
            let help = "Generation of the VM's ownership record in etcd that this node runs.";
            let v = h.generation().to_string();
            family(
                &mut o,
                "tandem_owner_generation",
                g,
                help,
                &[(String::new(), v)],
            );
            let help = "1 once this node learned that another node owns the VM (its copy stops).";
            let v = b(h.is_fenced());
            family(&mut o, "tandem_fenced", g, help, &[(String::new(), v)]);
        }
        if let Some(u) = &s.who.memory {
            let page = tandem_consolidate::PAGE as f64;
            let kinds = [
                ("plain", (u.plain + u.pooled_raw) as f64 * page),
                ("shared", u.shared_bytes),
                ("patched", u.patch_bytes),
                ("compressed", u.compressed_bytes as f64),
            ]
            .map(|(k, v)| (format!("{{kind=\"{k}\"}}"), format!("{v:.0}")));
            let help = "Backup memory of this replica by how its pages are kept (shared and patch references split among their users).";
            family(&mut o, "tandem_replica_memory_bytes", g, help, &kinds);
            let pages = [
                ("plain", u.plain + u.pooled_raw),
                ("zero", u.zero),
                ("shared", u.shared),
                ("patched", u.patched),
                ("compressed", u.compressed),
            ]
            .map(|(k, v)| (format!("{{kind=\"{k}\"}}"), v.to_string()));
            let help = "Replica pages by how the backup keeps them.";
            family(&mut o, "tandem_replica_pages", g, help, &pages);
        }
        let help = "Guest pause per epoch (type II downtime).";
        histogram(&mut o, "tandem_pause_seconds", help, &s.pause);
        let help = "From handing an epoch to the link to its acknowledgement.";
        histogram(&mut o, "tandem_ack_latency_seconds", help, &s.ack);
        let l = &s.last;
        let comps = [
            ("stop", l.pause.stop_us),
            ("harvest", l.pause.harvest_us),
            ("copy", l.pause.copy_us),
            ("device_state", l.pause.devstate_us),
            ("cont", l.pause.cont_us),
        ]
        .map(|(c, v)| (format!("{{component=\"{c}\"}}"), secs(v.into())));
        let help = "Pause components of the last epoch.";
        family(
            &mut o,
            "tandem_last_pause_component_seconds",
            g,
            help,
            &comps,
        );
        let stopped = [(String::new(), secs(l.pause.stopped_us.into()))];
        let help = "How long QEMU held the guest stopped in the last pause, STOP to RESUME event (0: unknown).";
        family(
            &mut o,
            "tandem_last_guest_stopped_seconds",
            g,
            help,
            &stopped,
        );
        process::render(&mut o, s.who.role);
        let base = process::identity_labels(s.who.vm_id, s.who.node.as_deref());
        process::with_labels(&o, &base)
    }
}
