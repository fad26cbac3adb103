//! Sessions one after another: waiting for the backup (plain TCP or mutual TLS, retried while
//! the guest runs with its output held; fencing and a broken disk capture are dealt with
//! meanwhile), then a session over the link until it ends; a lost link starts the next.

use super::*;
/// Sessions until one ends for good (`None`: stopped or out of time while no backup was
/// connected).
pub(super) fn sessions(d: &mut Daemon<'_>, vm: &mut Vm) -> Result<Option<End>, PrimaryError> {
    if d.fencing.is_some() && d.site.relays.is_empty() {
        d.status
            .warn("fencing without a bridged NIC: there is no output to gate");
    }
    // Sessions that end before any acknowledgement back off (0.2 s doubling to 5 s), so a
    // backup that refuses this VM (wrong size, another VM id) is not flooded with copies.
    let mut backoff = Duration::ZERO;
    let mut count = 0u64;
    loop {
        let Some(stream) = wait_for_backup(d, vm)? else {
            return Ok(d.fenced_by.take().map(End::FencedBy));
        };
        if count > 0 {
            d.registry.inc_reconnects();
            d.registry.inc_resyncs();
        }
        count += 1;
        let why = match d.session(vm, stream)? {
            End::Lost(why) => why,
            end => return Ok(Some(end)),
        };
        let held = d.site.relays.stats();
        d.status.warn(format!(
            "link to the backup lost after epoch {} ({why}); the guest runs on with its output {} ({} frames); reconnecting for a full re-sync",
            d.epoch, if d.fencing.is_some() { "held (for up to the ack timeout, then etcd records that it runs without a replica and it passes)" } else { "HELD" }, held.held_frames
        ));
        if d.deadline.is_some_and(|t| Instant::now() >= t) {
            return Ok(None);
        }
        backoff = if d.last_session_acked {
            Duration::ZERO
        } else {
            (backoff * 2).clamp(Duration::from_millis(200), Duration::from_secs(5))
        };
        let until = Instant::now() + backoff;
        while Instant::now() < until && !d.status.stop().stopping() {
            d.watchdog.beat();
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Connects to the backup, retrying until it answers. Meanwhile the guest runs with its
/// output held; the disk write log is dropped (the next session copies the whole disk).
/// Returns `None` when the daemon is asked to stop first.
fn wait_for_backup(d: &mut Daemon<'_>, vm: &mut Vm) -> Result<Option<Conn>, PrimaryError> {
    let addr = d.opts.backup.as_str();
    let mut said = None::<Instant>;
    let since = d.no_backup_since;
    loop {
        d.watchdog.beat();
        if d.status.stop().stopping() || d.deadline.is_some_and(|t| Instant::now() >= t) {
            return Ok(None);
        }
        if let Some(st) = vm.exit_status() {
            return Err(PrimaryError::QemuExited(st.to_string()));
        }
        if d.status.stop().switchover_requested() {
            d.status.stop().clear_switchover();
            d.status
                .warn("switchover refused: no backup is connected to take the guest over");
        }
        if let Some(f) = &mut d.fencing {
            if let Some(what) = f.fenced() {
                d.fenced_by = Some(what);
                return Ok(None);
            }
            // No backup for the ack timeout: etcd records that nobody may take over, then
            // the output passes unprotected.
            if since.elapsed() >= d.opts.ack_timeout {
                d.watchdog.allow(Duration::from_secs(3));
                if let Err(what) = f.go_unprotected(d.site) {
                    d.fenced_by = Some(what);
                    return Ok(None);
                }
            }
        }
        let broken = d.site.mirror_health.broken().or_else(|| {
            d.recapture
                .then(|| "the first capture after the resume failed".to_string())
        });
        if let Some(why) = broken {
            d.status.warn(format!(
                "{why}: the disk capture missed writes; mirroring every disk again before the re-sync"
            ));
            d.watchdog
                .allow(d.site.capture_timeout() + Duration::from_secs(30));
            let mut progress = None;
            let r = d.site.start_capture_with(vm, &mut |done, total| {
                progress
                    .get_or_insert_with(|| {
                        crate::progress::Progress::new(
                            "disk re-mirror",
                            total,
                            &d.status,
                            &d.registry,
                        )
                    })
                    .update(done)
            });
            drop(progress);
            d.watchdog.beat();
            d.recapture &= r.is_err();
            if let Err(e) = r {
                // Output stays held; try again (the guest keeps running meanwhile).
                d.status.warn(format!(
                    "re-mirroring failed ({}); retrying in 5 s",
                    crate::chain(&e)
                ));
                std::thread::sleep(Duration::from_secs(5));
                continue;
            }
        }
        if let Some(disk) = &d.site.disk {
            disk.reset_log();
        }
        // Recording in etcd, connecting and the TLS handshake take up to ~7 s together: that
        // is progress for the watchdog, not a hung QEMU.
        d.watchdog.allow(Duration::from_secs(10));
        let conn = link::connect_once(addr, Duration::from_secs(1))
            .map_err(|e| crate::chain(&e))
            .and_then(|tcp| match &d.opts.tls {
                Some(t) => {
                    client_tls(t, addr)
                        .and_then(|(c, name)| {
                            crate::tls::connect(tcp, &c, name, Duration::from_secs(5))
                        })
                        .map_err(|e| crate::chain(&e))
                        .and_then(|conn| {
                            let vm = d.opts.vm_id;
                            if conn.peer_valid_for_vm(vm) {
                                Ok(conn)
                            } else {
                                Err(format!("the backup's certificate does not name VM {vm} ({} or {}): refusing it", crate::tls::vm_name(vm), crate::tls::ANY_VM))
                            }
                        })
                }
                None => Conn::plain(tcp).map_err(|e| e.to_string()),
            });
        match conn {
            Ok(s) => {
                let tls = if s.is_tls() { " (mutual TLS)" } else { "" };
                d.status
                    .info(format!("connected to the backup at {addr}{tls}"));
                d.registry.set_peer(Some(addr.to_string()));
                return Ok(Some(s));
            }
            Err(e) => {
                if said.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    d.status.warn(format!("waiting for the backup ({e})"));
                    said = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// The rustls configuration and server name of `t` for the backup at `addr` (read from the
/// files now).
pub(super) fn client_tls(
    t: &ClientTls,
    addr: &str,
) -> Result<
    (
        Arc<rustls::ClientConfig>,
        rustls::pki_types::ServerName<'static>,
    ),
    crate::tls::TlsError,
> {
    Ok((
        crate::tls::client_config(&t.files)?,
        crate::tls::server_name(addr, t.server_name.as_deref())?,
    ))
}
