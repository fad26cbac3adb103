//! A VM started the way a person starts one, to be adopted (`tandem adopt`): the QEMU command
//! line tandem would use for a description, with what tandem owns taken out — RAM from plain
//! `-m` (QEMU's anonymous memory, whose RAM block is `pc.ram`), no `-S`, and the NICs on
//! whatever network the person gives them.

use std::path::Path;

use tandem_vm::qemu_args::{qemu_args, Start};
use tandem_vm::VmConfig;

/// The command line (without the binary) of a QEMU running `c` by hand: its QMP socket at
/// `qmp`, its console in `serial`, and NIC `i`'s backend `-netdev` replaced by `netdevs[i]`
/// (e.g. `tap,id=n0,ifname=tap0,script=no,downscript=no`; the id must stay `n{i}`) where
/// given.
pub fn qemu_command(c: &VmConfig, qmp: &Path, serial: &Path, netdevs: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = qemu_args(c, "/unused".as_ref(), qmp, serial, Start::Paused).into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-S" => {}
            // tandem's memory backend: plain -m names guest RAM pc.ram.
            "-object" => drop(it.next()),
            "-machine" => {
                let m = it.next().unwrap_or_default();
                let kept: Vec<&str> = m
                    .split(',')
                    .filter(|o| !o.starts_with("memory-backend="))
                    .collect();
                out.extend(["-machine".to_string(), kept.join(",")]);
            }
            "-netdev" => {
                let n = it.next().unwrap_or_default();
                let i: Option<usize> = n
                    .split(',')
                    .find_map(|o| o.strip_prefix("id=n"))
                    .and_then(|i| i.parse().ok());
                let given = i.and_then(|i| netdevs.get(i));
                out.extend(["-netdev".to_string(), given.map_or(n, |g| g.to_string())]);
            }
            _ => out.push(a),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_vm::{NicDesc, NicNet};

    #[test]
    fn tandems_memory_backend_and_pause_go_and_the_nic_goes_on_the_given_network() {
        let mut c = VmConfig::custom("h");
        c.nics = vec![NicDesc {
            mac: "52:54:00:00:00:09".into(),
            model: "virtio-net-pci".into(),
            net: NicNet::User {
                forwards: Vec::new(),
            },
            pci: None,
        }];
        let a = qemu_command(
            &c,
            "/q".as_ref(),
            "/s".as_ref(),
            &["tap,id=n0,ifname=t0,script=no,downscript=no"],
        )
        .join(" ");
        assert!(a.contains("-machine q35 "), "{a}");
        assert!(a.contains("-m 256M"), "{a}");
        assert!(!a.contains("memory-backend"), "{a}");
        assert!(!a.contains(" -S"), "{a}");
        assert!(a.contains("-netdev tap,id=n0,ifname=t0"), "{a}");
        assert!(
            a.contains("virtio-net-pci,netdev=n0,mac=52:54:00:00:00:09"),
            "{a}"
        );
    }
}
