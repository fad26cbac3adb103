//! `tandem list`: every VM of a cluster, from etcd — its ownership record and what each
//! node's daemon last reported (`PREFIX/vm/ID/node/NODE`, written every 2 s by fenced
//! daemons; docs/OPERATIONS.md).

use std::collections::BTreeMap;

use serde_json::{json, Value};
use tandem_args::FenceArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    fence: FenceArgs,
    /// One JSON document (an array, a VM each) on stdout.
    #[arg(long)]
    json: bool,
}

/// A report older than this is stale: its daemon stopped reporting.
const STALE_MS: u64 = tandem_protect::report::STALE_AFTER.as_millis() as u64;

#[derive(Default)]
struct Vm {
    record: Option<Result<tandem_fence::Record, String>>,
    nodes: BTreeMap<String, Value>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let (client, prefix) = crate::fence::cluster(&a.fence)?;
    let mut vms: BTreeMap<u64, Vm> = BTreeMap::new();
    for (key, kv) in client.range_prefix(&prefix, 100_000)? {
        let Some(rest) = key.strip_prefix(&prefix) else {
            continue;
        };
        let mut parts = rest.splitn(3, '/');
        let (Some(id), Some(kind)) = (parts.next().and_then(|i| i.parse().ok()), parts.next())
        else {
            continue;
        };
        let vm = vms.entry(id).or_default();
        match (kind, parts.next()) {
            ("owner", None) => {
                vm.record = Some(tandem_fence::Record::parse(&kv.value).ok_or_else(|| {
                    format!("{key} holds something that is not an ownership record")
                }))
            }
            ("node", Some(node)) => {
                if let Ok(v) = serde_json::from_slice::<Value>(&kv.value) {
                    vm.nodes.insert(node.to_string(), v);
                }
            }
            _ => {}
        }
    }
    let now = tandem_protect::unix_ms();
    let docs: Vec<Value> = vms.iter().map(|(id, vm)| summary(*id, vm, now)).collect();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&docs)?);
        return Ok(());
    }
    if docs.is_empty() {
        println!("no VM under {prefix} in etcd");
        return Ok(());
    }
    println!(
        "{:<5} {:<22} {:<22} {:<10} {:>9} {:>5}  OWNERSHIP",
        "VM", "RUNS ON", "BACKUP", "PROTECTED", "EPOCH", "LAG"
    );
    for d in &docs {
        let s = |k: &str| d[k].as_str().unwrap_or("-").to_string();
        let n = |k: &str| d[k].as_u64().map_or("-".into(), |v| v.to_string());
        println!(
            "{:<5} {:<22} {:<22} {:<10} {:>9} {:>5}  {}",
            d["vm_id"].as_u64().unwrap_or(0),
            s("runs_on"),
            s("backup"),
            match d["protected"].as_bool() {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            },
            n("committed_epoch"),
            n("lag_epochs"),
            s("ownership")
        );
        for (node, r) in d["nodes"].as_object().into_iter().flatten() {
            println!(
                "      {node}: {} {}{}",
                r["role"].as_str().unwrap_or("?"),
                r["state"].as_str().unwrap_or("?"),
                if r["stale"] == true {
                    format!(
                        " (STALE: no report for {} s)",
                        r["report_age_ms"].as_u64().unwrap_or(0) / 1000
                    )
                } else {
                    String::new()
                }
            );
        }
    }
    Ok(())
}

/// One VM: who runs it (the record), its backup and progress (the fresh reports).
fn summary(id: u64, vm: &Vm, now: u64) -> Value {
    let fresh = |r: &Value| {
        r["updated_unix_ms"]
            .as_u64()
            .is_some_and(|t| now.saturating_sub(t) <= STALE_MS)
    };
    let (record, ownership, runs_on) = match &vm.record {
        None => (Value::Null, "no record".to_string(), None),
        Some(Err(e)) => (Value::Null, e.clone(), None),
        Some(Ok(r)) => (
            json!(r),
            r.describe(),
            (r.state != tandem_fence::State::Stopped).then(|| r.node.clone()),
        ),
    };
    let running = runs_on
        .as_ref()
        .and_then(|n| vm.nodes.get(n))
        .filter(|r| fresh(r));
    let backup = vm
        .nodes
        .iter()
        .find(|(n, r)| Some(*n) != runs_on.as_ref() && r["role"] == "backup" && fresh(r))
        .map(|(n, _)| n.clone());
    let protected = match (&vm.record, running) {
        (Some(Ok(r)), Some(rep)) => Some(
            r.state == tandem_fence::State::Protected
                && rep["state"].as_str().is_some_and(|s| s == "protected"),
        ),
        (Some(Ok(r)), None) if r.state != tandem_fence::State::Stopped => Some(false),
        _ => None,
    };
    let nodes: serde_json::Map<String, Value> = vm
        .nodes
        .iter()
        .map(|(n, r)| {
            let age = r["updated_unix_ms"].as_u64().map(|t| now.saturating_sub(t));
            (
                n.clone(),
                json!({
                    "role": r["role"], "state": r["state"], "pid": r["pid"],
                    "committed_epoch": r["committed_epoch"], "lag_epochs": r["lag_epochs"],
                    "link": r["link"], "peer": r["peer"], "progress": r["progress"],
                    "version": r["version"], "report_age_ms": age, "stale": !fresh(r),
                }),
            )
        })
        .collect();
    json!({
        "vm_id": id,
        "runs_on": runs_on,
        "backup": backup,
        "protected": protected,
        "committed_epoch": running.map(|r| r["committed_epoch"].clone()),
        "lag_epochs": running.map(|r| r["lag_epochs"].clone()),
        "ownership": ownership,
        "record": record,
        "nodes": nodes,
    })
}
