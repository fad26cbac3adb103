//! `tandem vm import`: a libvirt domain XML (`virsh dumpxml NAME`) as a tandem VM description.
//! What maps: memory, vCPUs and their topology, machine, the CPU model and its flags (`-cpu`),
//! the UUID, direct kernel boot, file and block-device disks (qcow2/raw on virtio or
//! virtio-scsi with their cache and io modes), bridged and user NICs (MAC, model), PCI
//! addresses, controllers, balloon, RNG, channels, clock and power management
//! ([`devices`]), the emulator and `<qemu:commandline>` arguments; a UEFI domain is described
//! as `firmware = "ovmf"`, which `tandem vm check` refuses. Every other element is named with
//! the reason it is not mapped, so the operator sees what the protected VM will lack.

mod devices;
pub mod inloop;
pub mod keeper;

use std::path::PathBuf;

use roxmltree::{Document, Node};

use crate::vmfile::{BootFile, DiskFile, NicFile, VmFile};

/// An element of the domain that the description does not carry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Unmapped {
    /// Where it is (`devices/graphics[vnc]`).
    pub element: String,
    /// Why, and what to do about it.
    pub why: String,
}

/// The XML cannot be imported at all.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// Not well-formed XML.
    #[error("not well-formed XML")]
    Xml(#[from] roxmltree::Error),
    /// Not a libvirt domain.
    #[error("not a libvirt domain: the root element is <{0}>, expected <domain> (from `virsh dumpxml NAME`)")]
    NotDomain(String),
    /// Not a QEMU/KVM domain.
    #[error("domain type {0:?}: tandem runs QEMU (libvirt type kvm or qemu)")]
    DomainType(String),
    /// A value that must be a number (or a known unit) is not.
    #[error("<{0}> holds {1:?}, not a usable number or unit")]
    Number(&'static str, String),
}

/// Converts a domain XML to a description; also returns what was not mapped.
pub fn import(xml: &str) -> Result<(VmFile, Vec<Unmapped>), ImportError> {
    import_with(xml, &|_| None)
}

/// [`import`], with `<interface type='network'>` resolved to its bridge by `bridge_of` (the
/// network's name → its bridge; [`inloop::network_bridge`] asks libvirt).
pub fn import_with(
    xml: &str,
    bridge_of: &dyn Fn(&str) -> Option<String>,
) -> Result<(VmFile, Vec<Unmapped>), ImportError> {
    let doc = Document::parse(xml)?;
    let dom = doc.root_element();
    if dom.tag_name().name() != "domain" {
        return Err(ImportError::NotDomain(dom.tag_name().name().into()));
    }
    let kind = dom.attribute("type").unwrap_or("kvm");
    if !["kvm", "qemu"].contains(&kind) {
        return Err(ImportError::DomainType(kind.into()));
    }
    let mut im = Importer {
        bridge_of,
        file: VmFile::default(),
        unmapped: Vec::new(),
        buses_made: Vec::new(),
        bridges: Vec::new(),
        buses_used: Vec::new(),
        channels: 0,
        rngs: 0,
        serial: false,
        serial_controllers: Vec::new(),
        usb: false,
        sockets_only: true,
    };
    im.file.accel = Some(if kind == "kvm" { "kvm" } else { "tcg" }.into());
    for n in dom.children().filter(Node::is_element) {
        im.top(n)?;
    }
    im.check_buses();
    // Buses exist before the devices on them: parents (lower indexes) first.
    im.bridges.sort_by_key(|(i, _)| *i);
    let mut args: Vec<String> = std::mem::take(&mut im.bridges)
        .into_iter()
        .flat_map(|(_, a)| ["-device".to_string(), a])
        .collect();
    args.append(&mut im.file.extra_args);
    im.file.extra_args = args;
    // libvirt lays out vCPUs without a <topology> as one socket each.
    if let (Some(n), true) = (im.file.vcpus, im.sockets_only) {
        im.file.topology = Some(format!("sockets={n},cores=1,threads=1"));
    }
    Ok((im.file, im.unmapped))
}

struct Importer<'r> {
    /// A libvirt network's bridge.
    bridge_of: &'r dyn Fn(&str) -> Option<String>,
    file: VmFile,
    unmapped: Vec<Unmapped>,
    /// Indexes of the PCI controllers created (their buses are `pci.N`).
    buses_made: Vec<u32>,
    /// The `-device` values of the PCI controllers created, by index.
    bridges: Vec<(u32, String)>,
    /// Buses that created controllers sit on.
    buses_used: Vec<u32>,
    /// Channels and RNGs so far (their ids).
    channels: u32,
    rngs: u32,
    /// The first serial port was seen.
    serial: bool,
    /// The first USB controller was created.
    usb: bool,
    /// The virtio-serial controllers created, by index.
    serial_controllers: Vec<u32>,
    /// No `<cpu><topology>`.
    sockets_only: bool,
}

/// Top-level elements that need no mapping (tandem or QEMU's defaults cover them).
const QUIET: &[&str] = &[
    "name",
    "title",
    "description",
    "metadata",
    "currentMemory",
    "on_poweroff",
    "on_reboot",
    "on_crash",
    "resource",
    "seclabel",
];

impl Importer<'_> {
    fn skip(&mut self, element: impl Into<String>, why: impl Into<String>) {
        self.unmapped.push(Unmapped {
            element: element.into(),
            why: why.into(),
        });
    }

    fn top(&mut self, n: Node<'_, '_>) -> Result<(), ImportError> {
        let name = n.tag_name().name();
        match name {
            "memory" => {
                self.file.mem = Some(mib(n)?);
                // libvirt's name for guest RAM: the domain, running, can be adopted.
                self.file.ram_block = Some("pc.ram".into());
            }
            "vcpu" => {
                let t = n.text().unwrap_or("").trim();
                let v = t.parse().map_err(|_| ImportError::Number("vcpu", t.into()))?;
                self.file.vcpus = Some(v);
                if n.attribute("current").is_some_and(|c| c.trim() != t) {
                    self.skip(
                        "vcpu[current]",
                        format!("all {v} vCPUs are online under tandem (libvirt starts fewer and hotplugs the rest)"),
                    );
                }
            }
            "os" => self.os(n),
            "devices" => {
                for d in n.children().filter(Node::is_element) {
                    self.device(d);
                }
            }
            "memoryBacking" => self.skip(
                "memoryBacking",
                "tandem backs guest RAM with its own shared file (the backing libvirt needs to run the VM under tandem is described in docs/VM_DESCRIPTION.md)",
            ),
            "commandline" => {
                let args: Vec<String> = n
                    .children()
                    .filter(|c| c.tag_name().name() == "arg")
                    .filter_map(|a| a.attribute("value").map(String::from))
                    .collect();
                // The allow-list decides (tandem_vm::extra_args): arguments that could carry
                // guest I/O past capture or output commit are named, not carried over.
                match tandem_vm::desc::check_extra_args(&args) {
                    Ok(()) => self.file.extra_args.extend(args),
                    Err(e) => self.skip(
                        format!("qemu:commandline {}", args.join(" ")),
                        format!("{e}; none of these arguments was carried over"),
                    ),
                }
            }
            "features" => {
                let other: Vec<&str> = n
                    .children()
                    .filter(Node::is_element)
                    .map(|c| c.tag_name().name())
                    .filter(|f| !["acpi", "apic", "pae"].contains(f))
                    .collect();
                if !other.is_empty() {
                    self.skip(
                        format!("features/{}", other.join(",")),
                        "QEMU's defaults are used (acpi, apic are on by default)",
                    );
                }
            }
            "cpu" => self.cpu(n),
            "clock" => self.clock(n),
            "pm" => self.pm(n),
            "uuid" => {
                // The guest reads it from SMBIOS (cloud-init, licences).
                if let Some(u) = n.text() {
                    self.file
                        .extra_args
                        .extend(["-uuid".to_string(), u.trim().to_string()]);
                }
            }
            n if QUIET.contains(&n) => {}
            other => self.skip(other, "no tandem equivalent"),
        }
        Ok(())
    }

    /// `<cpu>` as `-cpu`: the guest keeps the CPU model and flags it runs with.
    fn cpu(&mut self, n: Node<'_, '_>) {
        let mode = n.attribute("mode").unwrap_or("custom");
        let arg = match mode {
            // What libvirt runs for host-passthrough with KVM; under TCG QEMU refuses `host`
            // (vm check and the adoption's CPU comparison say so).
            "host-passthrough" => "host".to_string(),
            "host-model" => {
                self.skip(
                    "cpu[host-model]",
                    "described as -cpu host: libvirt runs host-model as a named model expanded from this host's CPU, which can differ; import the running domain's XML (`virsh dumpxml` of a running domain shows that model)",
                );
                "host".to_string()
            }
            _ => {
                let Some(model) = n
                    .children()
                    .find(|c| c.tag_name().name() == "model")
                    .and_then(|m| m.text())
                    .map(str::trim)
                else {
                    // <cpu> with topology only: QEMU's default model, as libvirt runs it.
                    return self.topology(n);
                };
                let mut arg = model.to_string();
                for f in n.children().filter(|c| c.tag_name().name() == "feature") {
                    let Some(name) = f.attribute("name") else {
                        continue;
                    };
                    match f.attribute("policy").unwrap_or("require") {
                        "require" | "force" => arg.push_str(&format!(",+{name}")),
                        "disable" | "forbid" => arg.push_str(&format!(",-{name}")),
                        _ => {}
                    }
                }
                arg
            }
        };
        self.file.extra_args.extend(["-cpu".to_string(), arg]);
        self.topology(n);
        if n.children().any(|c| c.tag_name().name() == "numa") {
            self.skip(
                "cpu/numa",
                "NUMA cells are not created: tandem backs guest RAM with one shared file",
            );
        }
    }

    fn os(&mut self, n: Node<'_, '_>) {
        let mut boot = BootFile::default();
        let mut uefi = n.attribute("firmware") == Some("efi");
        for c in n.children().filter(Node::is_element) {
            let text = || c.text().unwrap_or("").trim().to_string();
            match c.tag_name().name() {
                "type" => {
                    if let Some(m) = c.attribute("machine") {
                        self.file.machine = Some(m.into());
                    }
                }
                "kernel" => boot.kernel = Some(PathBuf::from(text())),
                "initrd" => boot.initrd = Some(PathBuf::from(text())),
                "cmdline" => boot.cmdline = Some(text()),
                "loader" | "nvram" => uefi = true,
                "boot" | "bootmenu" | "smbios" | "bios" => {}
                other => self.skip(format!("os/{other}"), "no tandem equivalent"),
            }
        }
        if uefi {
            // Never silently SeaBIOS: the description says UEFI and `vm check` refuses it.
            self.skip(
                "os/loader",
                "UEFI firmware is not supported yet (its variable store is not replicated): the description says firmware = \"ovmf\", which `tandem vm check` refuses",
            );
            self.file.boot = Some(BootFile {
                firmware: Some("ovmf".into()),
                ..BootFile::default()
            });
        } else if boot.kernel.is_some() {
            self.file.boot = Some(boot);
        } else {
            self.file.boot = Some(BootFile {
                firmware: Some("seabios".into()),
                ..BootFile::default()
            });
        }
    }

    fn device(&mut self, d: Node<'_, '_>) {
        match d.tag_name().name() {
            "emulator" => {
                self.file.qemu = d.text().map(|t| PathBuf::from(t.trim()));
            }
            "disk" => self.disk(d),
            "interface" => self.interface(d),
            "controller" => self.controller(d),
            "serial" => self.serial(d),
            // The serial port again, as libvirt lists it.
            "console"
                if d.children().any(|c| {
                    c.tag_name().name() == "target" && c.attribute("type") == Some("serial")
                }) => {}
            "channel" => self.channel(d),
            "memballoon" => self.memballoon(d),
            "rng" => self.rng(d),
            "input" => self.input(d),
            "audio" if d.attribute("type") == Some("none") => {}
            other => {
                let kind = d
                    .attribute("type")
                    .map(|t| format!("[{t}]"))
                    .unwrap_or_default();
                self.skip(
                    format!("devices/{other}{kind}"),
                    "not created: tandem runs QEMU with -nodefaults -display none; add it to extra_args if the guest needs it",
                );
            }
        }
    }

    fn disk(&mut self, d: Node<'_, '_>) {
        let child = |name: &str| d.children().find(|c| c.tag_name().name() == name);
        let target = child("target")
            .and_then(|t| t.attribute("dev"))
            .unwrap_or("?");
        let here = format!("devices/disk[{target}]");
        if d.attribute("device").unwrap_or("disk") != "disk" {
            return self.skip(
                here,
                "only disks are attached (no cdrom or floppy): read-only media are not replicated",
            );
        }
        let block = match d.attribute("type").unwrap_or("file") {
            "file" => false,
            // An LVM volume or a partition: a raw disk.
            "block" => true,
            _ => {
                return self.skip(
                    here,
                    "only file and block-device disks are supported (network disks are not)",
                )
            }
        };
        let source = child("source").and_then(|s| s.attribute(if block { "dev" } else { "file" }));
        let Some(path) = source else {
            return self.skip(
                here,
                if block {
                    "no <source dev=...>"
                } else {
                    "no <source file=...>"
                },
            );
        };
        let driver = child("driver");
        let bus = child("target")
            .and_then(|t| t.attribute("bus"))
            .unwrap_or("virtio");
        let bus = match bus {
            "virtio" => "virtio-blk",
            "scsi" => "virtio-scsi",
            other => {
                return self.skip(
                    here,
                    format!("bus {other}: tandem attaches disks on virtio-blk or virtio-scsi; the guest needs virtio drivers"),
                )
            }
        };
        let pci = if bus == "virtio-blk" {
            self.pci_address(d, &here)
        } else {
            None
        };
        self.file.disk.push(DiskFile {
            path: path.into(),
            format: driver
                .and_then(|x| x.attribute("type"))
                .map(Into::into)
                .or_else(|| block.then(|| "raw".into())),
            bus: Some(bus.into()),
            cache: driver
                .and_then(|x| x.attribute("cache"))
                .filter(|c| *c != "default")
                .map(Into::into),
            aio: driver
                .and_then(|x| x.attribute("io"))
                .filter(|c| *c != "default")
                .map(Into::into),
            readonly: child("readonly").is_some(),
            pci,
        });
    }

    fn interface(&mut self, i: Node<'_, '_>) {
        let child = |name: &str| i.children().find(|c| c.tag_name().name() == name);
        let kind = i.attribute("type").unwrap_or("");
        let Some(mac) = child("mac").and_then(|m| m.attribute("address")) else {
            return self.skip(
                format!("devices/interface[{kind}]"),
                "no <mac address=...>: give the NIC a fixed MAC (failover moves it between hosts)",
            );
        };
        let model = match child("model").and_then(|m| m.attribute("type")) {
            None | Some("virtio") => "virtio-net-pci".to_string(),
            Some(m) => m.to_string(),
        };
        let source = child("source");
        let bridge = match kind {
            "bridge" => match source.and_then(|s| s.attribute("bridge")) {
                Some(b) => Some(b.to_string()),
                None => {
                    return self.skip(
                        format!("devices/interface[bridge,{mac}]"),
                        "no <source bridge=...>: name the bridge in a [[nic]]",
                    )
                }
            },
            "user" => None,
            "network" => {
                let net = source.and_then(|s| s.attribute("network")).unwrap_or("?");
                // A running domain's XML names the network's bridge; else libvirt is asked.
                let live = source.and_then(|s| s.attribute("bridge")).map(String::from);
                match live.or_else(|| (self.bridge_of)(net)) {
                    // tandem's tap goes on the network's bridge, as libvirt's does.
                    Some(b) => Some(b),
                    None => {
                        return self.skip(
                            format!("devices/interface[network={net}]"),
                            format!("libvirt network {net} was not resolved to its bridge (import with --connect or --libvirt to ask libvirt): add a [[nic]] with mac = \"{mac}\" and bridge = the network's bridge (`virsh net-info {net}`)"),
                        )
                    }
                }
            }
            other => {
                return self.skip(
                    format!("devices/interface[{other}]"),
                    "only bridge and user interfaces are supported",
                )
            }
        };
        let here = format!("devices/interface[{mac}]");
        let pci = self.pci_address(i, &here);
        if let Some(q) = child("driver")
            .and_then(|d| d.attribute("queues"))
            .filter(|q| *q != "1")
        {
            self.skip(
                format!("{here}/driver[queues={q}]"),
                "one queue pair under tandem (its relay's tap has one): the guest sees a NIC without multiqueue",
            );
        }
        if let Some(v) = child("virtualport") {
            self.skip(
                format!("{here}/virtualport[{}]", v.attribute("type").unwrap_or("?")),
                "tandem's tap goes on the bridge as a plain port: an Open vSwitch bridge needs the port added (ovs-vsctl add-port) by the operator",
            );
        }
        if bridge.is_some() && model == "virtio-net-pci" {
            // libvirt opens a virtio NIC's tap with virtio-net headers: the guest's offloads
            // stay, and the running domain can be adopted.
            self.file.vnet_hdr = Some(true);
        }
        self.file.nic.push(NicFile {
            mac: mac.into(),
            model: Some(model),
            bridge,
            netns: None,
            forward: Vec::new(),
            pci,
        });
    }
}

impl Importer<'_> {
    /// `<cpu><topology>` as QEMU's `-smp` layout.
    fn topology(&mut self, n: Node<'_, '_>) {
        let Some(t) = n.children().find(|c| c.tag_name().name() == "topology") else {
            return;
        };
        let parts: Vec<String> = ["sockets", "dies", "cores", "threads"]
            .iter()
            .filter_map(|k| t.attribute(*k).map(|v| format!("{k}={v}")))
            .collect();
        if !parts.is_empty() {
            self.sockets_only = false;
            self.file.topology = Some(parts.join(","));
        }
    }

    /// A disk's or NIC's PCI `<address>` (`SLOT.FN` on the root bus, `BUS:SLOT.FN` behind
    /// the controller libvirt calls `pci.BUS`): the guest sees the same layout.
    fn pci_address(&mut self, d: Node<'_, '_>, here: &str) -> Option<String> {
        let a = d
            .children()
            .find(|c| c.tag_name().name() == "address" && c.attribute("type") == Some("pci"))?;
        let num = |k: &str| a.attribute(k).map_or(Some(0), devices::hex);
        if let (Some(0), Some(bus), Some(slot), Some(f)) =
            (num("domain"), num("bus"), num("slot"), num("function"))
        {
            let kept = match bus {
                0 => format!("0x{slot:02x}.{f}"),
                b => format!("{b:02x}:{slot:02x}.{f}"),
            };
            if tandem_vm::PciAddr::parse(&kept).is_ok() {
                return Some(kept);
            }
        }
        self.skip(
            format!("{here}/address"),
            "not a usable PCI address: QEMU places the device",
        );
        None
    }
}

/// `<memory unit='KiB'>N</memory>` in MiB.
fn mib(n: Node<'_, '_>) -> Result<u64, ImportError> {
    let t = n.text().unwrap_or("").trim();
    let v: u64 = t
        .parse()
        .map_err(|_| ImportError::Number("memory", t.into()))?;
    let unit = n.attribute("unit").unwrap_or("KiB");
    let scale: u64 = match unit {
        "b" | "bytes" => 1,
        "KB" => 1000,
        "k" | "KiB" => 1 << 10,
        "MB" => 1_000_000,
        "M" | "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "G" | "GiB" => 1 << 30,
        "TB" => 1_000_000_000_000,
        "T" | "TiB" => 1 << 40,
        _ => return Err(ImportError::Number("memory unit", unit.into())),
    };
    let bytes = v
        .checked_mul(scale)
        .ok_or(ImportError::Number("memory", t.into()))?;
    Ok(bytes >> 20)
}
