//! `tandem backup-host`: one backup process for many primaries (N:1). Each replica is a
//! complete `tandem backup` (its own VM id, listen address, mirror, disk copy, standby QEMU,
//! fencing, control socket and metrics) running on its own thread; the replicas share one
//! pool of consolidated pages, so identical and similar pages across VMs are kept once.
//! A lost primary fails over its own VM only.

use std::collections::HashSet;

use anyhow::{bail, Context};
use clap::Parser;
use tandem_protect::Event;

use crate::daemons::{backup_config, BackupArgs, ConsolidateArgs};

#[derive(clap::Args)]
pub struct Args {
    /// One protected VM: its `tandem backup` flags as one shell-quoted string (repeat for each
    /// VM), e.g. --replica "--vm-id 2 --listen 10.0.0.2:7002 --dir /dev/shm/tandem-vm2
    /// --workload kv".
    #[arg(long = "replica", required = true, allow_hyphen_values = true)]
    pub replicas: Vec<String>,
    #[command(flatten)]
    pub consolidation: ConsolidateArgs,
}

/// A `--replica` string parsed as `tandem backup` flags.
#[derive(Parser)]
#[command(name = "--replica", no_binary_name = true)]
struct Replica {
    #[command(flatten)]
    b: BackupArgs,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let pool = a.consolidation.config()?;
    let mut cfgs = Vec::new();
    let (mut ids, mut listens, mut dirs) = (HashSet::new(), HashSet::new(), HashSet::new());
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
        if b.consolidation.given() {
            bail!("--replica {n}: give --consolidate, --clock-s and --restore to backup-host itself: the replicas share one pool");
        }
        if !ids.insert(b.vm_id) {
            bail!(
                "--replica {n}: VM id {} is given twice (each replica needs its own --vm-id)",
                b.vm_id
            );
        }
        if !listens.insert(b.listen.clone()) {
            bail!("--replica {n}: listen address {} is given twice", b.listen);
        }
        if !dirs.insert(b.dir.clone()) {
            bail!(
                "--replica {n}: directory {} is given twice (each replica needs its own --dir)",
                b.dir.display()
            );
        }
        cfgs.push(backup_config(&b, pool.clone())?);
    }
    println!(
        "backup host: {} replicas{}",
        cfgs.len(),
        if pool.is_some() {
            format!(
                ", consolidated in one pool (NRU clock {} s)",
                a.consolidation.clock_s
            )
        } else {
            String::new()
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
