//! `tandem fence`: what etcd's ownership records say, and the operator's override that
//! declares a copy gone (docs/FENCING.md, "Operator override").

use anyhow::Context;

use tandem_args::FenceArgs;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// The ownership record of one VM (--vm-id), or of every VM under the prefix.
    Show(ShowArgs),
    /// Declare the copy of generation G gone for good, so that a fresh boot may claim the VM.
    /// Whatever that copy did since its generation began (acknowledged writes included) is
    /// thrown away: use it only when the node that ran it is dead and will not come back.
    Stop(StopArgs),
}

#[derive(clap::Args)]
pub struct ShowArgs {
    #[command(flatten)]
    fence: FenceArgs,
    /// The VM (default: every VM under --etcd-prefix).
    #[arg(long)]
    vm_id: Option<u64>,
    /// JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct StopArgs {
    #[command(flatten)]
    fence: FenceArgs,
    /// The VM.
    #[arg(long)]
    vm_id: u64,
    /// The generation whose copy is declared gone (`tandem fence show` prints it); a record
    /// at another generation is left alone.
    #[arg(long)]
    generation: u64,
}

fn connect(f: &FenceArgs, vm_id: u64) -> anyhow::Result<std::sync::Arc<tandem_fence::Fence>> {
    let cfg = f
        .config(vm_id, "operator")
        .context("give the etcd cluster with --etcd URL[,URL...]")?;
    Ok(tandem_fence::Fence::connect(cfg)?)
}

/// A client of the cluster and the prefix every VM's keys are under (`PREFIX/vm/`).
pub fn cluster(f: &FenceArgs) -> anyhow::Result<(tandem_fence::etcd::Client, String)> {
    let cfg = f
        .config(0, "operator")
        .context("give the etcd cluster with --etcd URL[,URL...]")?;
    let client = tandem_fence::etcd::Client::with_tls(
        &cfg.endpoints,
        cfg.request_timeout,
        cfg.tls.as_ref(),
    )?;
    Ok((client, format!("{}/vm/", cfg.prefix)))
}

pub fn run(c: Cmd) -> anyhow::Result<()> {
    match c {
        Cmd::Show(a) => show(a),
        Cmd::Stop(a) => stop(a),
    }
}

fn show(a: ShowArgs) -> anyhow::Result<()> {
    // `Err`: the key holds something that is not a record.
    let records: Vec<(u64, Result<Option<tandem_fence::Record>, String>)> = match a.vm_id {
        Some(id) => vec![(
            id,
            match connect(&a.fence, id)?.read() {
                Ok(r) => Ok(r),
                Err(e @ tandem_fence::FenceError::Corrupt { .. }) => Err(e.to_string()),
                Err(e) => return Err(e.into()),
            },
        )],
        None => {
            let (client, prefix) = cluster(&a.fence)?;
            let mut v = Vec::new();
            for (key, kv) in client.range_prefix(&prefix, 10_000)? {
                let Some(id) = key
                    .strip_prefix(&prefix)
                    .and_then(|r| r.strip_suffix("/owner"))
                    .and_then(|id| id.parse().ok())
                else {
                    continue;
                };
                let r = tandem_fence::Record::parse(&kv.value)
                    .map(Some)
                    .ok_or_else(|| {
                        format!(
                            "{key} holds {:?}, which is not a tandem ownership record",
                            String::from_utf8_lossy(&kv.value)
                                .chars()
                                .take(80)
                                .collect::<String>()
                        )
                    });
                v.push((id, r));
            }
            v
        }
    };
    if a.json {
        let docs: Vec<_> = records
            .iter()
            .map(|(id, r)| match r {
                Ok(r) => serde_json::json!({"vm_id": id, "record": r}),
                Err(e) => serde_json::json!({"vm_id": id, "record": null, "error": e}),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&docs)?);
        return Ok(());
    }
    if records.is_empty() {
        println!("no ownership record in etcd");
    }
    for (id, r) in records {
        match r {
            Ok(Some(r)) => println!("vm {id}: {}", r.describe()),
            Ok(None) => println!("vm {id}: no record (a new VM: a fresh boot may claim it)"),
            Err(e) => println!("vm {id}: {e}: nothing may change it until it is repaired"),
        }
    }
    Ok(())
}

fn stop(a: StopArgs) -> anyhow::Result<()> {
    let f = connect(&a.fence, a.vm_id)?;
    let before = f.read()?;
    let r = f.override_stop(a.generation)?;
    if let Some(b) = before {
        eprintln!(
            "vm {}: was {}; the copy of generation {} is declared gone and what it did since that generation began is thrown away",
            a.vm_id,
            b.describe(),
            a.generation
        );
    }
    println!("vm {}: {}", a.vm_id, r.describe());
    Ok(())
}
