//! The hardware of a domain besides its disks and NICs, kept as libvirt runs it: PCIe root
//! ports and PCI bridges with libvirt's ids (`pci.N`, so disks and NICs keep their place
//! behind them), USB, virtio-serial, balloon and RNG controllers at their addresses, the
//! guest agent's port with no host end, the clock, power management and the vCPU topology.
//! What the guest sees stays the same, which a live migration (`tandem adopt`) requires and
//! a reboot under tandem keeps. Every device that carries no guest I/O past tandem goes to
//! `extra_args`, where the allow-list checks it again.

use roxmltree::Node;

use super::Importer;

use tandem_vm::desc::PCI_BUS_MODELS;

/// libvirt's USB controller models and QEMU's drivers.
const USB: &[(&str, &str)] = &[
    ("qemu-xhci", "qemu-xhci"),
    ("nec-xhci", "nec-usb-xhci"),
    ("piix3-uhci", "piix3-usb-uhci"),
];

fn child<'a, 'i>(n: Node<'a, 'i>, name: &str) -> Option<Node<'a, 'i>> {
    n.children().find(|c| c.tag_name().name() == name)
}

/// A number as libvirt reads its attributes (`strtoul` base 0): `0x..` hex, a leading `0`
/// octal, else decimal.
pub(super) fn hex(v: &str) -> Option<u32> {
    let v = v.trim();
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        u32::from_str_radix(h, 16).ok()
    } else if v.len() > 1 && v.starts_with('0') {
        u32::from_str_radix(&v[1..], 8).ok()
    } else {
        v.parse().ok()
    }
}

impl Importer<'_> {
    /// The name of the machine's root PCI bus.
    fn root_bus(&self) -> &'static str {
        match &self.file.machine {
            Some(m) if m.contains("q35") => "pcie.0",
            _ => "pci.0",
        }
    }

    /// A device's PCI `<address>` as QEMU's `bus=...,addr=...[,multifunction=on]`; None
    /// (and named) without one.
    fn device_pci(&mut self, d: Node<'_, '_>, here: &str) -> Option<String> {
        let Some(a) = d
            .children()
            .find(|c| c.tag_name().name() == "address" && c.attribute("type") == Some("pci"))
        else {
            self.skip(
                format!("{here}/address"),
                "no PCI address: QEMU places the device, which may not be where libvirt did",
            );
            return None;
        };
        let num = |k: &str| a.attribute(k).map_or(Some(0), hex);
        let (Some(0), Some(bus @ 0..=255), Some(slot @ 0..=0x1f), Some(f @ 0..=7)) =
            (num("domain"), num("bus"), num("slot"), num("function"))
        else {
            self.skip(format!("{here}/address"), "not a usable PCI address");
            return None;
        };
        if bus != 0 {
            self.buses_used.push(bus);
        }
        let bus = match bus {
            0 => self.root_bus().to_string(),
            n => format!("pci.{n}"),
        };
        let mut s = format!("bus={bus},addr={slot:#x}.{f:#x}");
        if a.attribute("multifunction") == Some("on") {
            s.push_str(",multifunction=on");
        }
        Some(s)
    }

    fn device_arg(&mut self, arg: String) {
        self.file.extra_args.extend(["-device".to_string(), arg]);
    }

    /// `<controller>`: the buses and controllers the guest sees.
    pub(super) fn controller(&mut self, d: Node<'_, '_>) {
        let t = d.attribute("type").unwrap_or("");
        let index = d.attribute("index").and_then(hex).unwrap_or(0);
        let model = d.attribute("model").unwrap_or("");
        let here = format!("devices/controller[{t},{index}]");
        match t {
            "pci" => {
                if ["pci-root", "pcie-root"].contains(&model) {
                    return;
                }
                let name = child(d, "model")
                    .and_then(|m| m.attribute("name"))
                    .unwrap_or(model);
                // libvirt's `<model name>` is QEMU's driver for all of them.
                let Some(driver) = PCI_BUS_MODELS.iter().find(|m| **m == name) else {
                    return self.skip(
                        here,
                        format!("PCI controller {model} ({name}) is not created: devices behind it are named too"),
                    );
                };
                let Some(addr) = self.device_pci(d, &here) else {
                    return;
                };
                let target = child(d, "target");
                let get = |k: &str| target.and_then(|t| t.attribute(k)).and_then(hex);
                let mut arg = format!("{driver},id=pci.{index},{addr}");
                match *driver {
                    "pci-bridge" => arg.push_str(&format!(
                        ",chassis_nr={}",
                        get("chassisNr").unwrap_or(index)
                    )),
                    "pcie-pci-bridge" => {}
                    _ => {
                        arg.push_str(&format!(",chassis={}", get("chassis").unwrap_or(index)));
                        if let Some(p) = get("port") {
                            arg.push_str(&format!(",port={p:#x}"));
                        }
                    }
                }
                self.buses_made.push(index);
                // Created before the devices behind them (import puts them first).
                self.bridges.push((index, arg));
            }
            "usb" => {
                if model == "none" {
                    return;
                }
                let Some((_, driver)) = USB.iter().find(|(m, _)| *m == model) else {
                    return self.skip(here, format!("USB controller model {model:?} is not created (qemu-xhci, nec-xhci and piix3-uhci are)"));
                };
                let Some(addr) = self.device_pci(d, &here) else {
                    return;
                };
                let id = if index == 0 {
                    "usb".to_string()
                } else {
                    format!("usb{index}")
                };
                self.usb = self.usb || index == 0;
                let mut arg = format!("{driver},id={id},{addr}");
                if let Some(p) = d.attribute("ports").and_then(hex) {
                    if driver.contains("xhci") {
                        arg.push_str(&format!(",p2={p},p3={p}"));
                    }
                }
                self.device_arg(arg);
            }
            "virtio-serial" => {
                let Some(addr) = self.device_pci(d, &here) else {
                    return;
                };
                let mut arg = format!("virtio-serial-pci,id=virtio-serial{index},{addr}");
                if let Some(p) = d.attribute("ports").and_then(hex) {
                    arg.push_str(&format!(",max_ports={p}"));
                }
                if let Some(v) = d.attribute("vectors").and_then(hex) {
                    arg.push_str(&format!(",vectors={v}"));
                }
                self.serial_controllers.push(index);
                self.device_arg(arg);
            }
            // The machine's own: q35's AHCI, i440fx's IDE.
            "sata" | "ide" if index == 0 => {}
            // tandem creates the virtio-scsi controller of its scsi disks, where QEMU places it.
            "scsi" if model == "virtio-scsi" => {
                if child(d, "address").is_some() {
                    self.skip(
                        format!("{here}/address"),
                        "tandem creates the virtio-scsi controller where QEMU places it (tandem adopt compares both QEMUs and refuses a difference)",
                    );
                }
            }
            _ => self.skip(
                here,
                "not created (disks on virtio-blk or virtio-scsi only)",
            ),
        }
    }

    /// `<channel>`: a virtio-serial port. The guest keeps it (a migration needs it), with a
    /// null host end: nothing the guest writes there leaves unheld.
    pub(super) fn channel(&mut self, d: Node<'_, '_>) {
        let target = child(d, "target");
        let name = target.and_then(|t| t.attribute("name")).unwrap_or("");
        let here = format!("devices/channel[{}]", d.attribute("type").unwrap_or("?"));
        let a = d.children().find(|c| {
            c.tag_name().name() == "address" && c.attribute("type") == Some("virtio-serial")
        });
        let (Some("virtio"), Some(a)) = (target.and_then(|t| t.attribute("type")), a) else {
            return self.skip(here, "only virtio-serial channels are kept");
        };
        let get = |k: &str| a.attribute(k).and_then(hex).unwrap_or(0);
        if !self.serial_controllers.contains(&get("controller")) {
            return self.skip(here, "its virtio-serial controller is not created");
        }
        let k = self.channels;
        self.channels += 1;
        self.file.extra_args.extend([
            "-chardev".to_string(),
            format!("null,id=charchannel{k}"),
            "-device".to_string(),
            format!(
                "virtserialport,bus=virtio-serial{}.{},nr={},chardev=charchannel{k},id=channel{k},name={}",
                get("controller"),
                get("bus"),
                get("port").max(1),
                // QEMU's option syntax doubles commas inside values.
                name.replace(',', ",,")
            ),
        ]);
        self.skip(
            format!("{here}/source"),
            format!("the guest keeps port {name} with no host end under tandem (anything on it, a guest agent, is unreachable): its traffic would not wait for the backup"),
        );
    }

    /// `<memballoon model='virtio'>`.
    pub(super) fn memballoon(&mut self, d: Node<'_, '_>) {
        match d.attribute("model") {
            Some("none") => {}
            Some("virtio") => {
                if let Some(addr) = self.device_pci(d, "devices/memballoon") {
                    let mut arg = format!("virtio-balloon-pci,id=balloon0,{addr}");
                    // Features the guest sees.
                    if d.attribute("autodeflate") == Some("on") {
                        arg.push_str(",deflate-on-oom=on");
                    }
                    if d.attribute("freePageReporting") == Some("on") {
                        arg.push_str(",free-page-reporting=on");
                    }
                    self.device_arg(arg);
                }
            }
            m => self.skip(
                "devices/memballoon",
                format!("model {m:?} is not created (virtio is)"),
            ),
        }
    }

    /// `<rng model='virtio'>` with a random or builtin backend.
    pub(super) fn rng(&mut self, d: Node<'_, '_>) {
        let here = "devices/rng";
        let backend = child(d, "backend");
        let k = self.rngs;
        let object = match backend.and_then(|b| b.attribute("model")) {
            Some("random") => {
                let file = backend
                    .and_then(|b| b.text())
                    .map(str::trim)
                    .unwrap_or("/dev/urandom");
                format!("rng-random,id=objrng{k},filename={file}")
            }
            Some("builtin") => format!("rng-builtin,id=objrng{k}"),
            m => {
                return self.skip(
                    here,
                    format!("backend {m:?} is not created (random and builtin are)"),
                )
            }
        };
        if d.attribute("model") != Some("virtio") {
            return self.skip(here, "only virtio RNGs are created");
        }
        let Some(addr) = self.device_pci(d, here) else {
            return;
        };
        self.rngs += 1;
        self.file.extra_args.extend(["-object".to_string(), object]);
        self.device_arg(format!("virtio-rng-pci,rng=objrng{k},id=rng{k},{addr}"));
    }

    /// `<input>`: PS/2 is the machine's own; a USB tablet, mouse or keyboard is created.
    pub(super) fn input(&mut self, d: Node<'_, '_>) {
        let kind = d.attribute("type").unwrap_or("?");
        match d.attribute("bus") {
            Some("ps2") | None => {}
            Some("usb") if !self.usb => self.skip(
                format!("devices/input[{kind},usb]"),
                "not created: its USB controller is not",
            ),
            Some("usb") => {
                let driver = match kind {
                    "tablet" => "usb-tablet",
                    "mouse" => "usb-mouse",
                    "keyboard" => "usb-kbd",
                    _ => return self.skip(format!("devices/input[{kind}]"), "not created"),
                };
                let a = d.children().find(|c| {
                    c.tag_name().name() == "address" && c.attribute("type") == Some("usb")
                });
                let port = a
                    .and_then(|a| a.attribute("port"))
                    .map(|p| format!(",port={p}"))
                    .unwrap_or_default();
                // libvirt's USB controller N has id usb (N = 0) or usbN.
                let bus = match a
                    .and_then(|a| a.attribute("bus"))
                    .and_then(hex)
                    .unwrap_or(0)
                {
                    0 => "usb.0".to_string(),
                    n => format!("usb{n}.0"),
                };
                self.device_arg(format!("{driver},bus={bus}{port}"));
            }
            Some(b) => self.skip(
                format!("devices/input[{kind},{b}]"),
                "not created (PS/2 and USB are)",
            ),
        }
    }

    /// `<serial>`: the first one stays the guest's ttyS0; its host end is tandem's console.
    pub(super) fn serial(&mut self, d: Node<'_, '_>) {
        let port = child(d, "target")
            .and_then(|t| t.attribute("port"))
            .unwrap_or("0");
        if port == "0" && !self.serial {
            self.serial = true;
            return self.skip(
                "devices/serial",
                format!(
                    "kept as the guest's ttyS0; its host end ({}) becomes tandem's console: `tandem console DIR` attaches to it (as `virsh console`), DIR/guest-console.log keeps all it prints",
                    d.attribute("type").unwrap_or("?")
                ),
            );
        }
        self.skip(
            format!("devices/serial[{port}]"),
            "not created: tandem gives the guest one serial port",
        );
    }

    /// `<clock>`: the RTC's base and drift policy, the PIT's tick policy, the HPET.
    pub(super) fn clock(&mut self, n: Node<'_, '_>) {
        let mut rtc = match n.attribute("offset").unwrap_or("utc") {
            "utc" => "base=utc".to_string(),
            "localtime" => "base=localtime".to_string(),
            other => {
                self.skip(
                    format!("clock[offset={other}]"),
                    "QEMU's default (UTC) is used",
                );
                "base=utc".to_string()
            }
        };
        for t in n.children().filter(|c| c.tag_name().name() == "timer") {
            let policy = t.attribute("tickpolicy");
            match (
                t.attribute("name").unwrap_or(""),
                policy,
                t.attribute("present"),
            ) {
                ("rtc", Some("catchup"), _) => rtc.push_str(",driftfix=slew"),
                ("pit", Some("delay"), _) => self.file.extra_args.extend([
                    "-global".to_string(),
                    "kvm-pit.lost_tick_policy=delay".to_string(),
                ]),
                ("hpet", _, Some("no")) => self.file.extra_args.push("-no-hpet".to_string()),
                ("hpet" | "rtc" | "pit", None, _) | ("hpet", _, Some("yes")) => {}
                (name, _, _) => self.skip(
                    format!("clock/timer[{name}]"),
                    "QEMU's default for this timer is used",
                ),
            }
        }
        self.file.extra_args.extend(["-rtc".to_string(), rtc]);
    }

    /// `<pm>`: whether the guest may suspend to RAM or disk (in its ACPI tables).
    pub(super) fn pm(&mut self, n: Node<'_, '_>) {
        let lpc = if self.root_bus() == "pcie.0" {
            "ICH9-LPC"
        } else {
            "PIIX4_PM"
        };
        for (tag, prop) in [
            ("suspend-to-mem", "disable_s3"),
            ("suspend-to-disk", "disable_s4"),
        ] {
            if let Some(e) = child(n, tag).and_then(|c| c.attribute("enabled")) {
                let v = if e == "no" { 1 } else { 0 };
                self.file
                    .extra_args
                    .extend(["-global".to_string(), format!("{lpc}.{prop}={v}")]);
            }
        }
    }

    /// After every device: a disk or NIC behind a bus that was not created goes on the root
    /// bus, named.
    pub(super) fn check_buses(&mut self) {
        let made = self.buses_made.clone();
        let mut moved = Vec::new();
        for d in &mut self.file.disk {
            if let Some(p) = d.pci.take_if(|p| !behind_made(p, &made)) {
                moved.push(format!("devices/disk[{}]/address[{p}]", d.path.display()));
            }
        }
        for n in &mut self.file.nic {
            if let Some(p) = n.pci.take_if(|p| !behind_made(p, &made)) {
                moved.push(format!("devices/interface[{}]/address[{p}]", n.mac));
            }
        }
        for m in moved {
            self.skip(
                m,
                "behind a PCI controller tandem does not create: the device goes on the root bus (tandem adopt compares both QEMUs and refuses the difference)",
            );
        }
        let missing: Vec<u32> = self
            .buses_used
            .iter()
            .copied()
            .filter(|b| !made.contains(b))
            .collect();
        if !missing.is_empty() {
            self.skip(
                "devices/controller[pci]",
                format!("buses {missing:?} are used but their controllers are not created: QEMU will refuse to start; describe them in extra_args"),
            );
        }
    }
}

/// Whether the address `p` (`BUS:SLOT.FN` or `SLOT.FN`) is on the root bus or a created one.
fn behind_made(p: &str, made: &[u32]) -> bool {
    match p.split_once(':') {
        Some((bus, _)) => u32::from_str_radix(bus, 16).is_ok_and(|b| made.contains(&b)),
        None => true,
    }
}
