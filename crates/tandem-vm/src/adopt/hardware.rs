//! What the guest sees must not change when it moves: QEMU's migration refuses a stream with a
//! device the new QEMU lacks, but not a new QEMU with a device more, another CPU model or other
//! MACs (the guest would find them under its feet). Both QEMUs are asked before anything
//! moves: PCI functions on the root bus (address, vendor, device, subsystem, class) and
//! behind bridges (path and device model), vCPUs (count, model,
//! every CPUID feature word), NIC MACs, and the features each virtio device offers (which also
//! depend on its backend: a virtio NIC on a tap with virtio-net headers offers checksum and
//! segmentation offloads, one on a backend without them does not, and QEMU would refuse to
//! load its state only after the guest stopped).

use serde_json::{json, Value};

use super::Monitor;
use crate::qmp::QmpError;

/// The hardware a QEMU shows its guest, as comparable lines.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Hardware {
    pci: Vec<String>,
    cpus: Vec<String>,
    macs: Vec<String>,
    virtio: Vec<String>,
}

impl Hardware {
    /// Asks `q`.
    pub(super) fn of(q: &mut dyn Monitor) -> Result<Hardware, QmpError> {
        let mut pci = Vec::new();
        for bus in q
            .execute("query-pci", None)?
            .as_array()
            .into_iter()
            .flatten()
        {
            pci_devices(&bus["devices"], &mut pci);
        }
        pci.extend(pci_behind_bridges(q)?);
        pci.sort();
        let cpus = q.execute("query-cpus-fast", None)?;
        let list = cpus.as_array().cloned().unwrap_or_default();
        let mut c = vec![format!("{} vCPU(s)", list.len())];
        if let Some(path) = list.first().and_then(|c| c["qom-path"].as_str()) {
            let get = |q: &mut dyn Monitor, p: &str| {
                q.execute("qom-get", Some(json!({ "path": path, "property": p })))
            };
            c.push(format!("model {}", get(q, "type")?.as_str().unwrap_or("?")));
            let mut words: Vec<String> = get(q, "feature-words")?
                .as_array()
                .into_iter()
                .flatten()
                .map(|w| {
                    format!(
                        "CPUID {:#x}.{} {}={:#010x}",
                        w["cpuid-input-eax"].as_u64().unwrap_or(0),
                        w["cpuid-input-ecx"]
                            .as_u64()
                            .map_or("-".into(), |e| e.to_string()),
                        w["cpuid-register"].as_str().unwrap_or("?"),
                        w["features"].as_u64().unwrap_or(0)
                    )
                })
                .collect();
            words.sort();
            c.extend(words);
        }
        // Only virtio-net answers this; other models' MACs are not compared.
        let mut macs: Vec<String> = match q.execute("query-rx-filter", None) {
            Ok(v) => v
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|n| n["main-mac"].as_str().map(str::to_string))
                .collect(),
            Err(_) => Vec::new(),
        };
        macs.sort();
        Ok(Hardware {
            pci,
            cpus: c,
            macs,
            virtio: virtio_features(q),
        })
    }

    /// What differs between the running QEMU (`self`) and tandem's (`new`), one line each.
    pub(super) fn differences(&self, new: &Hardware) -> Vec<String> {
        let mut out = Vec::new();
        diff("PCI", &self.pci, &new.pci, &mut out);
        diff("CPU", &self.cpus, &new.cpus, &mut out);
        diff("NIC MAC", &self.macs, &new.macs, &mut out);
        diff("virtio", &self.virtio, &new.virtio, &mut out);
        if out
            .iter()
            .any(|l| l.contains("virtio-net") && l.contains("_TSO"))
        {
            out.push(
                "hint: a virtio NIC with offloads on one side only is a tap with virtio-net headers (vnet_hdr: QEMU's default for a tap, libvirt's for a virtio NIC) against a backend without them: set vnet_hdr = true in the description when the running VM's NIC is on such a tap".into(),
            );
        }
        out
    }
}

/// One line per virtio device: its kind and the features it offers, in QEMU's words
/// (`x-query-virtio`; an older QEMU without it compares none).
fn virtio_features(q: &mut dyn Monitor) -> Vec<String> {
    let Ok(list) = q.execute("x-query-virtio", None) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for d in list.as_array().into_iter().flatten() {
        let (Some(name), Some(path)) = (d["name"].as_str(), d["path"].as_str()) else {
            continue;
        };
        let Ok(st) = q.execute("x-query-virtio-status", Some(json!({ "path": path }))) else {
            continue;
        };
        let hf = &st["host-features"];
        let mut f: Vec<String> = ["transports", "dev-features"]
            .iter()
            .flat_map(|k| hf[*k].as_array().cloned().unwrap_or_default())
            .filter_map(|v| {
                v.as_str()
                    .map(|s| s.split(':').next().unwrap_or(s).to_string())
            })
            .collect();
        f.sort();
        out.push(format!("{name} offering {}", f.join(" ")));
    }
    out.sort();
    out
}

/// One line per PCI function on the root bus (`query-pci`).
fn pci_devices(devices: &Value, out: &mut Vec<String>) {
    for d in devices.as_array().into_iter().flatten() {
        let id = &d["id"];
        out.push(format!(
            "{:02x}:{:02x}.{} {:04x}:{:04x} (subsystem {:04x}:{:04x}) class {:04x} {}",
            d["bus"].as_u64().unwrap_or(0),
            d["slot"].as_u64().unwrap_or(0),
            d["function"].as_u64().unwrap_or(0),
            id["vendor"].as_u64().unwrap_or(0),
            id["device"].as_u64().unwrap_or(0),
            id["subsystem-vendor"].as_u64().unwrap_or(0),
            id["subsystem"].as_u64().unwrap_or(0),
            d["class_info"]["class"].as_u64().unwrap_or(0),
            d["class_info"]["desc"].as_str().unwrap_or(""),
        ));
    }
}

/// One line per PCI function behind a bridge or root port, named by its path
/// (`00:01.3/00.0 virtio-blk-pci`) from QOM: `query-pci` finds such functions by the bus
/// numbers the guest's firmware gave, and a QEMU that has not run its guest has none.
fn pci_behind_bridges(q: &mut dyn Monitor) -> Result<Vec<String>, QmpError> {
    let mut devices = Vec::new();
    for base in ["/machine/peripheral", "/machine/peripheral-anon"] {
        let list = q.execute("qom-list", Some(json!({ "path": base })))?;
        for c in list.as_array().into_iter().flatten() {
            let (Some(name), Some(ty)) = (c["name"].as_str(), c["type"].as_str()) else {
                continue;
            };
            if let Some(ty) = ty.strip_prefix("child<").and_then(|t| t.strip_suffix('>')) {
                devices.push((format!("{base}/{name}"), ty.to_string()));
            }
        }
    }
    let mut paths = std::collections::HashMap::new();
    let mut out = Vec::new();
    for (dev, ty) in devices {
        if let Some(p) = pci_path(q, &dev, &mut paths)? {
            if p.contains('/') {
                out.push(format!("{p} {ty}"));
            }
        }
    }
    Ok(out)
}

/// The PCI path of the QOM device `dev` (None: not a PCI function), through its buses' owners.
fn pci_path(
    q: &mut dyn Monitor,
    dev: &str,
    known: &mut std::collections::HashMap<String, Option<String>>,
) -> Result<Option<String>, QmpError> {
    if let Some(p) = known.get(dev) {
        return Ok(p.clone());
    }
    let get = |q: &mut dyn Monitor, p: &str| {
        q.execute("qom-get", Some(json!({ "path": dev, "property": p })))
    };
    let devfn = match get(q, "addr") {
        Ok(v) => v.as_u64(),
        // No such property: not a PCI function (the machine, an ISA or USB device).
        Err(QmpError::Command { desc, .. }) if desc.contains("not found") => None,
        Err(e) => return Err(e),
    };
    let path = match devfn {
        None => None,
        Some(devfn) => {
            let here = format!("{:02x}.{}", devfn >> 3, devfn & 7);
            let bus = get(q, "parent_bus")?;
            let owner = bus
                .as_str()
                .and_then(|b| b.rsplit_once('/'))
                .map(|(o, _)| o.to_string());
            let parent = match owner {
                Some(o) if !o.is_empty() => pci_path(q, &o, known)?,
                _ => None,
            };
            Some(match parent {
                Some(p) => format!("{p}/{here}"),
                None => format!("00:{here}"),
            })
        }
    };
    known.insert(dev.to_string(), path.clone());
    Ok(path)
}

/// Lines only one side has, at most 8 per kind.
fn diff(what: &str, running: &[String], new: &[String], out: &mut Vec<String>) {
    let only = |a: &[String], b: &[String]| -> Vec<String> {
        a.iter().filter(|x| !b.contains(x)).cloned().collect()
    };
    let (gone, added) = (only(running, new), only(new, running));
    let n = gone.len() + added.len();
    out.extend(
        gone.iter()
            .map(|l| format!("{what}: the running VM has {l}, tandem's QEMU does not"))
            .chain(
                added.iter().map(|l| {
                    format!("{what}: tandem's QEMU would have {l}, the running VM does not")
                }),
            )
            .take(8),
    );
    if n > 8 {
        out.push(format!("{what}: {} more", n - 8));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_lines_name_root_bus_functions() {
        let devs = json!([{"bus": 0, "slot": 2, "function": 0,
            "id": {"vendor": 0x1af4, "device": 0x1000, "subsystem-vendor": 0x1af4, "subsystem": 1},
            "class_info": {"class": 0x200, "desc": "Ethernet controller"},
            "pci_bridge": {"devices": [{"bus": 1, "slot": 0, "function": 0,
                "id": {"vendor": 0x1af4, "device": 0x1001, "subsystem-vendor": 0x1af4, "subsystem": 2},
                "class_info": {"class": 0x100}}]}}]);
        let mut out = Vec::new();
        pci_devices(&devs, &mut out);
        // Functions behind the bridge come from QOM (pci_behind_bridges).
        assert_eq!(out.len(), 1);
        assert!(out[0].starts_with("00:02.0 1af4:1000"), "{out:?}");
    }

    #[test]
    fn differences_name_each_side() {
        let a = Hardware {
            pci: vec!["00:02.0 x".into()],
            cpus: vec!["1 vCPU(s)".into()],
            macs: vec![],
            virtio: vec![],
        };
        let b = Hardware {
            pci: vec!["00:02.0 x".into(), "00:03.0 y".into()],
            cpus: vec!["2 vCPU(s)".into()],
            macs: vec![],
            virtio: vec![],
        };
        let d = a.differences(&b);
        assert_eq!(d.len(), 3, "{d:?}");
        assert!(
            d[0].contains("the running VM has 1 vCPU(s)")
                || d[1].contains("the running VM has 1 vCPU(s)"),
            "{d:?}"
        );
        assert!(
            d.iter()
                .any(|l| l.contains("tandem's QEMU would have 00:03.0 y")),
            "{d:?}"
        );
        assert!(a.differences(&a).is_empty());
    }
}
