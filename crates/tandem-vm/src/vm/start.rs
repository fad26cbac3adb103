//! Starting QEMU: its runtime directory, the guest RAM file (fresh, copied or a standby's
//! mirror in place), the command line, QMP, the dirty log and the device-state path.

use super::*;

impl Vm {
    pub(super) fn start(config: &VmConfig, ram: RamSource<'_>, run: bool) -> Result<Vm, VmError> {
        config.check()?;
        let runtime = crate::stale::owned_tempdir("tandem-vm-", None)?;
        let bytes = config.mem_mib << 20;
        let (ram_path, keep_ram) = ram_file(config, &ram, bytes)?;
        let start = match ram {
            RamSource::Fresh => Start::Paused,
            RamSource::Adopting => Start::IncomingRun,
            RamSource::Copy(_) | RamSource::InPlace(_) => Start::Incoming,
        };
        let mode = dirty_mode(config.dirty);
        let qmp_path = runtime.path().join("qmp.sock");
        let serial = config
            .console
            .clone()
            .unwrap_or_else(|| runtime.path().join("serial.log"));
        // A console file kept from an earlier guest must not be read as this one's (its
        // ready marker above all).
        let _ = fs::remove_file(&serial);
        if let Some(c) = &config.console {
            // The console's socket, where operators look: next to its log (`tandem console`).
            let link = c.with_extension("sock");
            let _ = fs::remove_file(&link);
            if let Err(e) =
                std::os::unix::fs::symlink(crate::qemu_args::console_socket(&qmp_path), &link)
            {
                tracing::warn!(
                    "linking the guest's console socket at {}: {e}",
                    link.display()
                );
            }
        }
        let status = runtime.path().join("uffd.status");
        let log = fs::File::create(runtime.path().join("qemu.log"))?;
        let mut cmd = Command::new(&config.qemu);
        cmd.args(qemu_args(config, &ram_path, &qmp_path, &serial, start));
        cmd.args(crate::qemu_args::armed_monitors(&qmp_path));
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // QEMU dies with the tandem thread that started it (a killed daemon must not leave a
        // guest running that nobody checkpoints or whose output nobody holds).
        // SAFETY: the closure runs in the child between fork and exec and only calls prctl(2)
        // and getppid(2), both async-signal-safe; it allocates nothing.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() == 1 {
                    return Err(std::io::Error::other("tandem exited while starting QEMU"));
                }
                Ok(())
            });
        }
        let lazy = config.lazy_ram && mode == DirtyMode::None;
        if lazy {
            cmd.env("TANDEM_UFFD_MODE", "missing");
        }
        if mode == DirtyMode::Uffd || lazy {
            let so = preload_path().ok_or_else(|| {
                VmError::Registration("libtandem_preload.so not found (next to the tandem binary, in ../lib/tandem or /usr/lib/tandem): install the tandem package, build the whole workspace (cargo build --workspace) or set TANDEM_PRELOAD".into())
            })?;
            cmd.env("LD_PRELOAD", so)
                .env("TANDEM_RAM_PATH", &ram_path)
                .env("TANDEM_UFFD_STATUS", &status);
        }
        let ram = match GuestRam::open(&ram_path) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                return Err(Self::fail_early(
                    runtime,
                    (!keep_ram).then_some(ram_path.as_path()),
                    e.into(),
                ))
            }
        };
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let e = VmError::Spawn(config.qemu.display().to_string(), e);
                return Err(Self::fail_early(
                    runtime,
                    (!keep_ram).then_some(ram_path.as_path()),
                    e,
                ));
            }
        };
        let qmp = match Qmp::connect(&qmp_path, Duration::from_secs(20)) {
            Ok(q) => q,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Self::fail_early(
                    runtime,
                    (!keep_ram).then_some(ram_path.as_path()),
                    e.into(),
                ));
            }
        };
        // From here on `vm` owns the child and the RAM file: errors clean both up in Drop.
        // The device-state file lives in a directory of its own in /dev/shm (QEMU's other
        // runtime files if that cannot be made); both are removed with the VM, and found by
        // `clean_stale` after a kill.
        let devstate = devstate::Capturer::new(runtime.path(), config.fast_devstate).armed_on(
            crate::qemu_args::armed_socket(&qmp_path, devstate::fast::XEN_SAVE),
        );
        let arm = |command| match Armed::connect(
            &crate::qemu_args::armed_socket(&qmp_path, command),
            command,
            None,
        ) {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::warn!("QMP: {command} not armed ahead ({e}); sent whole in the pause");
                None
            }
        };
        let (armed_stop, armed_cont) = (arm("stop"), arm("cont"));
        let mut vm = Vm {
            child,
            qmp,
            ram,
            dirty: None,
            console: Console::new(&serial),
            runtime,
            ram_path,
            keep_ram,
            config: config.clone(),
            mirrors: Vec::new(),
            mirror_health: Default::default(),
            devstate,
            last_devstate: None,
            suspended: false,
            armed_stop,
            armed_cont,
            vcpu_clock: None,
            lazy: None,
            life: Arc::new(()),
        };
        // An adopting QEMU's migration capabilities must match its source's until the
        // migration is done; the adoption prepares device-state capture afterwards.
        if start != Start::IncomingRun {
            devstate::prepare(&mut vm.qmp)?;
        }
        if lazy {
            let (start, len, fd) = wait_registration(&status, &mut vm.child)?;
            if len != bytes {
                return Err(VmError::Registration(format!(
                    "registered {len} bytes, guest RAM is {bytes}"
                )));
            }
            let fd = fd.ok_or_else(|| {
                VmError::Registration("the preloaded library did not report its descriptor".into())
            })?;
            vm.lazy = Some(LazyRam { start, len, fd });
        }
        vm.dirty = match mode {
            DirtyMode::Uffd => {
                let (start, len, _) = wait_registration(&status, &mut vm.child)?;
                if len != bytes {
                    return Err(VmError::Registration(format!(
                        "registered {len} bytes, guest RAM is {bytes}"
                    )));
                }
                Some(Box::new(UffdWpLog::new(vm.child.id(), start, len)?))
            }
            DirtyMode::Hash => Some(Box::new(HashLog::new(vm.ram.clone(), config.hash_threads))),
            _ => None,
        };
        if !vm.keep_ram {
            // QEMU and this process have the file mapped (the in-band QMP commands above ran
            // after QEMU's memory backends exist, and the dirty log is registered): unlink it
            // now so that nothing is left in /dev/shm when QEMU and tandem are killed.
            let _ = fs::remove_file(&vm.ram_path);
        }
        if run {
            vm.cont()?;
        }
        Ok(vm)
    }

    fn fail_early(runtime: tempfile::TempDir, remove: Option<&Path>, e: VmError) -> VmError {
        if let Some(p) = remove {
            let _ = fs::remove_file(p);
        }
        let log = fs::read_to_string(runtime.path().join("qemu.log")).unwrap_or_default();
        if log.trim().is_empty() {
            e
        } else {
            VmError::Exited {
                status: e.to_string(),
                log,
            }
        }
    }
}

/// The guest RAM file for a new QEMU: a fresh or copied file in /dev/shm (removed once QEMU
/// maps it), or a standby's mirror used in place (kept).
fn ram_file(
    config: &VmConfig,
    ram: &RamSource<'_>,
    bytes: u64,
) -> Result<(PathBuf, bool), VmError> {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let fresh_path = || {
        PathBuf::from(format!(
            "{}/tandem-{}-{}-{n}.ram",
            crate::stale::TMPFS,
            config.name,
            std::process::id()
        ))
    };
    Ok(match *ram {
        RamSource::Fresh | RamSource::Adopting => {
            let p = fresh_path();
            drop(GuestRam::create(&p, bytes)?);
            (p, false)
        }
        RamSource::Copy(img) => {
            let p = fresh_path();
            fs::copy(img, &p)?;
            if fs::metadata(&p)?.len() != bytes {
                let _ = fs::remove_file(&p);
                return Err(VmError::Ram(RamError::BadSize(fs::metadata(img)?.len())));
            }
            (p, false)
        }
        RamSource::InPlace(p) => {
            if fs::metadata(p)?.len() != bytes {
                return Err(VmError::Ram(RamError::BadSize(fs::metadata(p)?.len())));
            }
            (p.to_path_buf(), true)
        }
    })
}

/// The dirty log to arm: `Auto` probes for async write-protect and falls back to hashing.
fn dirty_mode(m: DirtyMode) -> DirtyMode {
    match m {
        DirtyMode::Auto => match probe_pagemap_scan() {
            Ok(()) => DirtyMode::Uffd,
            Err(why) => {
                tracing::warn!("async write-protect dirty log unavailable ({why}); falling back to hashing every page, which costs a full read of guest RAM per epoch");
                DirtyMode::Hash
            }
        },
        m => m,
    }
}
