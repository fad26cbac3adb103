//! `tandem backup-host`: one backup process for many primaries (N:1). Each replica is a
//! complete `tandem backup` (its own VM id, listen address, mirror, disk copy, standby QEMU,
//! fencing, control socket and metrics) running on its own thread; the replicas share one
//! pool of consolidated pages, so identical and similar pages across VMs are kept once.
//! A lost primary fails over its own VM only.

use std::collections::HashSet;

use anyhow::{bail, Context};
use clap::Parser;
use tandem_protect::Event;

use tandem_protect::backup::BackupConfig;

use crate::daemons::{backup_config, BackupArgs, ConsolidateArgs};

#[derive(clap::Args)]
pub struct Args {
    /// The replicas as a TOML file: one `[[replica]]` table per protected VM (a backup's
    /// configuration: vm_id, listen, dir, timeout, [replica.vm], [replica.fence], ...) and
    /// an optional `[consolidate]` table for the pool they share (docs/OPERATIONS.md).
    #[arg(
        long,
        conflicts_with = "replicas",
        required_unless_present = "replicas"
    )]
    pub config: Option<std::path::PathBuf>,
    /// One protected VM: its `tandem backup` flags as one shell-quoted string (repeat for each
    /// VM), e.g. --replica "--vm-id 2 --listen 10.0.0.2:7002 --dir /dev/shm/tandem-vm2
    /// --vm-config /etc/tandem/vm2.toml".
    #[arg(long = "replica", allow_hyphen_values = true)]
    pub replicas: Vec<String>,
    #[command(flatten)]
    pub consolidation: ConsolidateArgs,
}

/// `backup-host --config`: the replicas and their pool.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HostFile {
    /// One pool of consolidated pages for every replica.
    consolidate: Option<tandem_protect::backup::Consolidate>,
    /// The backups.
    replica: Vec<BackupConfig>,
}

/// The replicas a TOML file describes, each consolidating into the file's one pool.
fn from_file(path: &std::path::Path, flags: &ConsolidateArgs) -> anyhow::Result<Vec<BackupConfig>> {
    if flags.given() {
        bail!("with --config, the pool is the file's [consolidate] table, not --consolidate/--clock-s/--restore");
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the replicas file {}", path.display()))?;
    let f: HostFile =
        toml::from_str(&text).with_context(|| format!("the replicas file {}", path.display()))?;
    if f.replica.is_empty() {
        bail!(
            "{} has no [[replica]] table: nothing to protect",
            path.display()
        );
    }
    let mut cfgs = Vec::new();
    for (i, mut b) in f.replica.into_iter().enumerate() {
        let n = i + 1;
        if b.consolidate.is_some() {
            bail!("[[replica]] {n}: consolidation is the file's one [consolidate] table (the replicas share its pool)");
        }
        if b.listen.is_empty() || b.dir.as_os_str().is_empty() {
            bail!("[[replica]] {n}: listen and dir are required");
        }
        if let Some(fc) = &b.fence {
            if fc.vm_id != b.vm_id {
                bail!(
                    "[[replica]] {n}: its fence names VM {} but the replica is VM {}",
                    fc.vm_id,
                    b.vm_id
                );
            }
        }
        b.consolidate = f.consolidate.clone();
        cfgs.push(b);
    }
    Ok(cfgs)
}

/// The replicas `--replica` strings give, each parsed as `tandem backup` flags.
fn from_flags(a: &Args) -> anyhow::Result<Vec<BackupConfig>> {
    let pool = a.consolidation.config()?;
    let mut cfgs = Vec::new();
    for (i, r) in a.replicas.iter().enumerate() {
        let n = i + 1;
        let words = shlex::split(r)
            .with_context(|| format!("--replica {n}: unbalanced quotes in {r:?}"))?;
        let one = Replica::try_parse_from(words)
            .map_err(|e| anyhow::anyhow!("--replica {n} ({r:?}):\n{e}"))?;
        let b = one.b;
        if b.peer.is_some() {
            bail!("--replica {n}: --peer (a node that protects the guest again after a failover) is not available in backup-host; run that VM's backup as its own `tandem backup`");
        }
        if b.json_events {
            bail!("--replica {n}: --json-events is not available per replica in backup-host (its replicas' events are printed as text lines prefixed with the VM); run that VM's backup as its own `tandem backup` for JSON events");
        }
        if b.consolidation.given() {
            bail!("--replica {n}: give --consolidate, --clock-s and --restore to backup-host itself: the replicas share one pool");
        }
        cfgs.push(backup_config(&b, pool.clone())?);
    }
    Ok(cfgs)
}

/// Every replica has its own VM id, listen address and directory.
fn distinct(cfgs: &[BackupConfig]) -> anyhow::Result<()> {
    let (mut ids, mut listens, mut dirs) = (HashSet::new(), HashSet::new(), HashSet::new());
    for (i, b) in cfgs.iter().enumerate() {
        let n = i + 1;
        if !ids.insert(b.vm_id) {
            bail!(
                "replica {n}: VM id {} is given twice (each replica needs its own)",
                b.vm_id
            );
        }
        if !listens.insert(b.listen.clone()) {
            bail!("replica {n}: listen address {} is given twice", b.listen);
        }
        if !dirs.insert(b.dir.clone()) {
            bail!(
                "replica {n}: directory {} is given twice (each replica needs its own)",
                b.dir.display()
            );
        }
    }
    Ok(())
}

/// A `--replica` string parsed as `tandem backup` flags.
#[derive(Parser)]
#[command(name = "--replica", no_binary_name = true)]
struct Replica {
    #[command(flatten)]
    b: BackupArgs,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let cfgs = match &a.config {
        Some(path) => from_file(path, &a.consolidation)?,
        None => from_flags(&a)?,
    };
    distinct(&cfgs)?;
    println!(
        "backup host: {} replicas{}",
        cfgs.len(),
        match cfgs.first().and_then(|c| c.consolidate.as_ref()) {
            Some(c) => format!(
                ", consolidated in one pool (NRU clock {} s)",
                c.revolution.as_secs_f64()
            ),
            None => String::new(),
        }
    );
    let mut running: Vec<_> = cfgs
        .into_iter()
        .map(|cfg| (cfg.vm_id, tandem_protect::backup::spawn(cfg)))
        .collect();
    for (_, h) in &running {
        crate::signals::forward_to(h.stopper());
    }
    let mut failed = Vec::new();
    while !running.is_empty() {
        let mut i = 0;
        while i < running.len() {
            let (id, h) = &running[i];
            let finished = h.is_finished();
            while let Ok(e) = h.events().try_recv() {
                match e {
                    Event::Info { text } => println!("vm {id}: {text}"),
                    Event::Warn { text } => eprintln!("vm {id}: {text}"),
                    _ => {}
                }
            }
            if !finished {
                i += 1;
                continue;
            }
            let (id, h) = running.swap_remove(i);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.join()));
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    eprintln!("vm {id}: error: {:#}", anyhow::Error::from(e));
                    failed.push(id);
                }
                Err(_) => {
                    eprintln!("vm {id}: the replica's thread panicked");
                    failed.push(id);
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    if !failed.is_empty() {
        bail!("the replicas of VM(s) {failed:?} ended with an error (above); the others stopped cleanly");
    }
    Ok(())
}
