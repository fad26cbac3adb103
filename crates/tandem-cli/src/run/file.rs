//! The configuration file of `tandem run`: its keys, the flags its sections hold, and the
//! inline VM description.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use super::Args;

/// Keys whose flag is not `--KEY`: (section, key) → flag.
const RENAMED: &[(&str, &str, &str)] = &[
    ("fencing", "prefix", "etcd-prefix"),
    ("fencing", "ca", "etcd-ca"),
    ("fencing", "cert", "etcd-cert"),
    ("fencing", "key", "etcd-key"),
    ("fencing", "timeout_ms", "etcd-timeout-ms"),
    ("tls", "dir", "tls-dir"),
    ("tls", "ca", "tls-ca"),
    ("tls", "cert", "tls-cert"),
    ("tls", "key", "tls-key"),
    ("tls", "server_name", "tls-server-name"),
    ("metrics", "listen", "metrics-listen"),
    ("metrics", "jsonl", "metrics-jsonl"),
    ("control", "socket", "control"),
];

/// Sections whose keys are flags.
const FLAG_SECTIONS: &[&str] = &[
    "adopt",
    "replication",
    "schedule",
    "network",
    "fencing",
    "tls",
    "metrics",
    "control",
];

/// Top-level keys that are not flags.
const OWN_KEYS: &[&str] = &[
    "vm_id",
    "primary",
    "nodes",
    "paths",
    "vm",
    "vm_config",
    "node",
];

fn flag_for(section: &str, key: &str) -> String {
    RENAMED
        .iter()
        .find(|(s, k, _)| *s == section && *k == key)
        .map_or_else(|| key.replace('_', "-"), |(_, _, f)| f.to_string())
}

fn value_text(v: &toml::Value) -> Option<String> {
    Some(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(_) => return None,
        toml::Value::Array(a) => a
            .iter()
            .filter_map(value_text)
            .collect::<Vec<_>>()
            .join(","),
        _ => return None,
    })
}

/// The flags of the file's flag sections, as (flag, value) (`None`: a switch).
pub(super) fn file_flags(
    t: &toml::Table,
    file: &Path,
) -> anyhow::Result<Vec<(String, Option<String>)>> {
    let mut out = Vec::new();
    for (section, v) in t {
        if OWN_KEYS.contains(&section.as_str()) {
            continue;
        }
        let Some(table) = v.as_table() else {
            bail!(
                "{}: unknown top-level key {section:?} (flags go in a section: {})",
                file.display(),
                FLAG_SECTIONS.join(", ")
            );
        };
        if !FLAG_SECTIONS.contains(&section.as_str()) {
            bail!(
                "{}: unknown section [{section}] (use {}, nodes, paths, vm)",
                file.display(),
                FLAG_SECTIONS.join(", ")
            );
        }
        for (key, value) in table {
            let flag = flag_for(section, key);
            match value {
                toml::Value::Boolean(true) => out.push((flag, None)),
                toml::Value::Boolean(false) => {}
                v => match value_text(v) {
                    Some(text) => out.push((flag, Some(text))),
                    None => bail!(
                        "{}: [{section}] {key}: a table is not a value",
                        file.display()
                    ),
                },
            }
        }
    }
    Ok(out)
}

/// What the file says.
pub struct Config {
    /// This node's name.
    pub me: String,
    /// The node that boots a new VM.
    pub preferred: String,
    /// The VM.
    pub vm_id: u64,
    /// Every node's replication address.
    pub nodes: BTreeMap<String, String>,
    /// The VM description file (written from [vm] into the state directory if inline).
    pub vm_config: PathBuf,
    /// The backup's RAM mirror directory.
    pub mirror_dir: PathBuf,
    /// The primary's working directory.
    pub state_dir: PathBuf,
    /// The flag sections' flags.
    pub flags: Vec<(String, Option<String>)>,
    /// `[adopt] qmp = ...` or `libvirt = ...`: a new VM that runs already (in a QEMU at that
    /// QMP socket, or as that libvirt domain) is adopted by the node that would boot it,
    /// instead of booted.
    pub adopt: bool,
}

/// Reads and checks the file (an inline [vm] is written to STATE_DIR/vm.toml).
pub fn read(a: &Args) -> anyhow::Result<Config> {
    let f = &a.config;
    let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
    let t: toml::Table =
        toml::from_str(&text).with_context(|| format!("{} is not valid TOML", f.display()))?;
    let vm_id = t
        .get("vm_id")
        .and_then(|v| v.as_integer())
        .and_then(|v| u64::try_from(v).ok())
        .with_context(|| format!("{}: vm_id = N is required", f.display()))?;
    let nodes: BTreeMap<String, String> = match t.get("nodes").and_then(|n| n.as_table()) {
        Some(n) => n
            .iter()
            .map(|(k, v)| {
                v.as_str()
                    .map(|s| (k.clone(), s.to_string()))
                    .with_context(|| format!("{}: [nodes] {k} must be \"host:port\"", f.display()))
            })
            .collect::<anyhow::Result<_>>()?,
        None => bail!(
            "{}: [nodes] with both nodes' replication addresses is required",
            f.display()
        ),
    };
    if nodes.len() != 2 {
        bail!(
            "{}: [nodes] must name exactly two nodes (this one and its peer)",
            f.display()
        );
    }
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let me = a
        .node
        .clone()
        .or_else(|| t.get("node").and_then(|v| v.as_str()).map(String::from))
        .unwrap_or(host);
    if !nodes.contains_key(&me) {
        bail!(
            "{}: this node {me:?} is not in [nodes] ({}); name it with --node",
            f.display(),
            nodes.keys().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    let preferred = t
        .get("primary")
        .and_then(|v| v.as_str())
        .map(String::from)
        .unwrap_or_else(|| nodes.keys().next().cloned().unwrap_or_default());
    if !nodes.contains_key(&preferred) {
        bail!("{}: primary = {preferred:?} is not in [nodes]", f.display());
    }
    let paths = t.get("paths").and_then(|p| p.as_table());
    let path = |k: &str, default: String| {
        paths
            .and_then(|p| p.get(k))
            .and_then(|v| v.as_str())
            .map_or_else(|| PathBuf::from(default), PathBuf::from)
    };
    let mirror_dir = path("mirror_dir", format!("/dev/shm/tandem-vm{vm_id}"));
    let state_dir = path("state_dir", format!("/var/lib/tandem/vm{vm_id}"));
    let vm_config = match (t.get("vm_config").and_then(|v| v.as_str()), t.get("vm")) {
        (Some(p), None) => PathBuf::from(p),
        (None, Some(toml::Value::Table(vm))) => {
            tandem_vm::private_dir(&state_dir)?;
            let p = state_dir.join("vm.toml");
            let body = toml::to_string(vm).context("the [vm] table")?;
            std::fs::write(
                &p,
                format!("# written by tandem run from {}\n{body}", f.display()),
            )
            .with_context(|| format!("writing {}", p.display()))?;
            p
        }
        (Some(_), Some(_)) => bail!("{}: give either vm_config or [vm], not both", f.display()),
        _ => bail!(
            "{}: the VM is described by vm_config = \"FILE\" or a [vm] table",
            f.display()
        ),
    };
    let flags = file_flags(&t, f)?;
    let adopt = t
        .get("adopt")
        .and_then(|v| v.as_table())
        .is_some_and(|a| a.contains_key("qmp") || a.contains_key("libvirt"));
    if t.get("adopt").is_some() && !adopt {
        bail!(
            "{}: [adopt] needs qmp = \"SOCKET\" (the running QEMU's QMP socket) or libvirt = \"DOMAIN\" (a libvirt domain)",
            f.display()
        );
    }
    Ok(Config {
        me,
        preferred,
        vm_id,
        nodes,
        vm_config,
        mirror_dir,
        state_dir,
        flags,
        adopt,
    })
}
