//! The machine's shape beyond its devices: PCI addresses (on the root bus, or behind a root
//! port or bridge created in `extra_args` with libvirt's id `pci.N`) and the vCPU topology.

use super::{invalid, DescError, DiskBus, DiskDesc, NicDesc};

/// A PCI address: the slot and function a device keeps, so that the guest sees the layout it
/// was installed with (libvirt's `<address type='pci'>`), on the machine's root bus or behind
/// a PCIe root port or bridge that the description's `extra_args` create with libvirt's id
/// (`pci.N`, as `tandem vm import` writes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PciAddr {
    /// The bus: 0 the root bus, N the bus of the controller with QEMU id `pci.N`.
    pub bus: u8,
    /// Slot, 1..=0x1f on the root bus, 0..=0x1f behind a controller.
    pub slot: u8,
    /// Function, 0..=7.
    pub function: u8,
}

impl PciAddr {
    /// Parses `[BUS:]SLOT[.FUNCTION]` in hex (`0x05`, `5`, `05.0`, `0x1f.7`, `04:00.0`).
    pub fn parse(s: &str) -> Result<PciAddr, DescError> {
        let bad = || {
            invalid(format!(
                "PCI address {s:?}: [BUS:]SLOT[.FUNCTION] in hex, slot 1..1f on the root bus (0..1f behind bus pci.N) and function 0..7 (e.g. \"0x05\", \"05.0\" or \"04:00.0\")"
            ))
        };
        let hex = |v: &str| u8::from_str_radix(v.trim().trim_start_matches("0x"), 16);
        let t = s.trim();
        let (bus, t) = match t.split_once(':') {
            Some((b, rest)) => (hex(b).map_err(|_| bad())?, rest),
            None => (0, t),
        };
        let (slot, function) = t.split_once('.').unwrap_or((t, "0"));
        let slot = hex(slot).map_err(|_| bad())?;
        let function = hex(function).map_err(|_| bad())?;
        let first = if bus == 0 { 1 } else { 0 };
        if !(first..=0x1f).contains(&slot) || function > 7 {
            return Err(bad());
        }
        Ok(PciAddr {
            bus,
            slot,
            function,
        })
    }

    /// QEMU's `bus=` (behind a controller) and `addr=` values, as `-device` options.
    pub fn qemu(&self) -> String {
        let addr = format!("addr=0x{:x}.{:x}", self.slot, self.function);
        match self.bus {
            0 => addr,
            b => format!("bus=pci.{b},{addr}"),
        }
    }
}

impl std::fmt::Display for PciAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.bus != 0 {
            write!(f, "{:02x}:", self.bus)?;
        }
        write!(f, "{:02x}.{}", self.slot, self.function)
    }
}

/// PCI addresses: only on virtio-blk disks (a virtio-scsi disk sits on its controller), and
/// each used once.
pub(super) fn check_pci(disks: &[DiskDesc], nics: &[NicDesc]) -> Result<(), DescError> {
    let mut used = std::collections::HashMap::new();
    for d in disks {
        if let Some(a) = d.pci {
            if d.bus != DiskBus::VirtioBlk {
                return Err(invalid(format!(
                    "disk {}: a PCI address needs bus virtio-blk (a virtio-scsi disk sits on its controller)",
                    d.path.display()
                )));
            }
            if let Some(other) = used.insert(a, d.path.display().to_string()) {
                return Err(invalid(format!(
                    "PCI address {a} is given to both {other} and disk {}",
                    d.path.display()
                )));
            }
        }
    }
    for n in nics {
        if let Some(a) = n.pci {
            if let Some(other) = used.insert(a, format!("NIC {}", n.mac)) {
                return Err(invalid(format!(
                    "PCI address {a} is given to both {other} and NIC {}",
                    n.mac
                )));
            }
        }
    }
    Ok(())
}

/// QEMU device models that create a PCI bus for the devices behind them (created before the
/// described disks and NICs).
pub const PCI_BUS_MODELS: &[&str] = &["pcie-root-port", "ioh3420", "pci-bridge", "pcie-pci-bridge"];

/// Every bus an address behind a controller names (`pci.N`) is created by a `-device` of a
/// [`PCI_BUS_MODELS`] model with that id in `extra_args`.
pub fn check_pci_buses(addrs: &[PciAddr], extra_args: &[String]) -> Result<(), DescError> {
    let made: Vec<&str> = extra_args
        .windows(2)
        .filter(|w| w[0].trim_start_matches('-') == "device")
        .filter(|w| {
            let model = w[1].split(',').next().unwrap_or("");
            PCI_BUS_MODELS.contains(&model.strip_prefix("driver=").unwrap_or(model))
        })
        .flat_map(|w| w[1].split(','))
        .filter_map(|p| p.strip_prefix("id="))
        .collect();
    for a in addrs.iter().filter(|a| a.bus != 0) {
        let id = format!("pci.{}", a.bus);
        if !made.contains(&id.as_str()) {
            return Err(invalid(format!(
                "PCI address {a} is behind bus {id}, which no extra_args `-device pcie-root-port,id={id},...` (or another bridge) creates"
            )));
        }
    }
    Ok(())
}

/// A vCPU topology (`sockets=2,cores=1,threads=1`) of `vcpus` vCPUs: `sockets`, `dies`,
/// `cores` and `threads`, each a number, whose product is `vcpus`.
pub fn check_topology(t: &str, vcpus: u32) -> Result<(), DescError> {
    let bad = |why: &str| {
        invalid(format!(
            "topology {t:?}: {why} (e.g. \"sockets=2,cores=1,threads=1\" for 2 vCPUs)"
        ))
    };
    let mut product: u64 = 1;
    for part in t.split(',') {
        let (k, v) = part.split_once('=').ok_or_else(|| bad("KEY=N items"))?;
        if !["sockets", "dies", "cores", "threads"].contains(&k.trim()) {
            return Err(bad("keys are sockets, dies, cores and threads"));
        }
        let n: u64 = v.trim().parse().map_err(|_| bad("each value a number"))?;
        if n == 0 {
            return Err(bad("each value at least 1"));
        }
        product = product.saturating_mul(n);
    }
    if product != u64::from(vcpus) {
        return Err(bad(&format!(
            "it lays out {product} vCPUs, vcpus is {vcpus}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_parse_as_libvirt_and_qemu_write_them() {
        for (text, slot, f) in [
            ("0x05", 5, 0),
            ("5", 5, 0),
            ("05.0", 5, 0),
            ("0x1f.7", 0x1f, 7),
        ] {
            let a = PciAddr::parse(text).unwrap();
            assert_eq!((a.slot, a.function), (slot, f), "{text}");
        }
        assert_eq!(PciAddr::parse("0x0a.1").unwrap().qemu(), "addr=0xa.1");
        let behind = PciAddr::parse("04:00.0").unwrap();
        assert_eq!((behind.bus, behind.slot, behind.function), (4, 0, 0));
        assert_eq!(behind.qemu(), "bus=pci.4,addr=0x0.0");
        assert_eq!(behind.to_string(), "04:00.0");
        assert_eq!(PciAddr::parse(&behind.to_string()).unwrap(), behind);
        for bad in ["0", "0x20", "5.8", "x", "", "1:x", "0:0.0", "100:1.0"] {
            assert!(PciAddr::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn topologies_must_lay_out_every_vcpu() {
        assert!(check_topology("sockets=2,cores=1,threads=1", 2).is_ok());
        assert!(check_topology("sockets=1,dies=1,cores=2,threads=2", 4).is_ok());
        for (bad, n) in [
            ("sockets=2,cores=2", 2),
            ("sockets=2,cpus=1", 2),
            ("sockets=two", 2),
            ("sockets=0", 0),
            ("", 1),
        ] {
            assert!(check_topology(bad, n).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_bus_behind_an_address_must_be_created() {
        let a = [
            PciAddr::parse("04:00.0").unwrap(),
            PciAddr::parse("0x05").unwrap(),
        ];
        let port = [
            "-device",
            "pcie-root-port,id=pci.4,bus=pcie.0,addr=0x1.0x3,chassis=4",
        ]
        .map(String::from);
        check_pci_buses(&a, &port).unwrap();
        let e = check_pci_buses(&a, &[]).unwrap_err();
        assert!(e.to_string().contains("bus pci.4"), "{e}");
    }
}
