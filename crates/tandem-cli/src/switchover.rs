//! `tandem switchover`: planned maintenance. Asks the primary on this host (over its control
//! socket) to hand the guest over to its backup — a last checkpoint with the guest stopped,
//! acknowledged before the backup resumes it, so no acknowledged output is lost — and to
//! serve as the backup of the guest there; waits until it is protected again.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;
use tandem_protect::control;

#[derive(clap::Args)]
pub struct Args {
    /// The VM to switch over (its primary on this host).
    #[arg(long, default_value_t = 1)]
    pub vm_id: u64,
    /// Ask this control socket (default: the primary of --vm-id in /run/tandem or
    /// $TANDEM_RUN_DIR).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Give up waiting after this many seconds (the switchover itself goes on).
    #[arg(long, default_value_t = 180)]
    pub timeout_s: u64,
    /// Print the result as one JSON document.
    #[arg(long)]
    pub json: bool,
}

fn field<'a>(v: &'a Value, k: &str) -> &'a Value {
    v.get(k).unwrap_or(&Value::Null)
}

/// The primary's control socket for `vm_id` on this host.
fn find_primary(vm_id: u64) -> anyhow::Result<PathBuf> {
    let all = control::ask_all(&control::run_dir())?;
    let found: Vec<_> = all
        .iter()
        .filter(|(_, v)| field(v, "vm_id").as_u64() == Some(vm_id))
        .collect();
    let primaries: Vec<_> = found
        .iter()
        .filter(|(_, v)| field(v, "role").as_str() == Some("primary"))
        .collect();
    match primaries.as_slice() {
        [(p, _)] => Ok(p.clone()),
        [] if found.is_empty() => bail!(
            "no tandem daemon for VM {vm_id} runs on this host (no control socket in {}); run switchover on the primary's host, or give --socket",
            control::run_dir().display()
        ),
        [] => bail!(
            "the daemon of VM {vm_id} on this host is not its primary ({}); run switchover on the primary's host",
            control::describe(&found[0].1)
        ),
        _ => bail!("several primaries of VM {vm_id} answer on this host: give --socket"),
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let sock = match &a.socket {
        Some(p) => p.clone(),
        None => find_primary(a.vm_id)?,
    };
    // Counted before the request: a fast handover may be done by the first poll.
    let before = control::ask(&sock)
        .map(|v| field(&v, "switchovers").as_u64().unwrap_or(0))
        .with_context(|| format!("asking the primary at {}", sock.display()))?;
    let t = Instant::now();
    let reply = control::command(&sock, "switchover")
        .with_context(|| format!("asking the primary at {}", sock.display()))?;
    if field(&reply, "ok").as_bool() != Some(true) {
        bail!(
            "the primary refused the switchover: {}",
            field(&reply, "error").as_str().unwrap_or("no reason given")
        );
    }
    let pid = field(&reply, "pid").as_u64().unwrap_or(0);
    if !a.json {
        eprintln!("switchover: the primary (pid {pid}) hands the guest over to its backup");
    }
    let deadline = t + Duration::from_secs(a.timeout_s);
    let (mut handed, mut epoch) = (None::<Duration>, 0u64);
    loop {
        if Instant::now() > deadline {
            bail!(
                "no re-protection within {} s (handed over: {}); see `tandem status` and the daemons' logs",
                a.timeout_s,
                handed.map_or("not yet".into(), |d| format!("after {} ms", d.as_millis()))
            );
        }
        std::thread::sleep(Duration::from_millis(50));
        // A node keeps its control socket across roles.
        let Ok(v) = control::ask(&sock) else {
            if handed.is_some() {
                continue;
            }
            bail!("the primary (pid {pid}) ended during the switchover; see its log");
        };
        let role = field(&v, "role").as_str().unwrap_or("");
        if handed.is_none() && field(&v, "switchovers").as_u64().unwrap_or(0) > before {
            handed = Some(t.elapsed());
            epoch = field(field(&v, "last_switchover"), "epoch")
                .as_u64()
                .unwrap_or(0);
            if !a.json {
                eprintln!(
                    "switchover: handed over at epoch {epoch} after {} ms; this node becomes the backup and receives a full copy",
                    t.elapsed().as_millis()
                );
            }
        }
        let committed = field(&v, "committed_epoch").as_u64().unwrap_or(0);
        let state = field(&v, "state").as_str().unwrap_or("");
        if handed.is_some()
            && role == "backup"
            && state.starts_with("protecting")
            && committed > epoch
        {
            let done = t.elapsed();
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "vm_id": a.vm_id, "handover_epoch": epoch,
                        "handed_over_ms": handed.map(|d| d.as_millis() as u64),
                        "protected_again_ms": done.as_millis() as u64,
                        "committed_epoch": committed,
                    })
                );
            } else {
                println!(
                    "switchover done: the guest runs on the former backup from epoch {epoch}; this node is its backup and committed epoch {committed} ({:.1} s in all)",
                    done.as_secs_f64()
                );
            }
            return Ok(());
        }
    }
}
