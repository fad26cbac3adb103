//! A VM started the way a person starts one, to be adopted (`tandem adopt`): the QEMU command
//! line tandem would use for a description, with what tandem owns taken out — RAM from plain
//! `-m` (QEMU's anonymous memory, whose RAM block is `pc.ram`), no `-S`, and the NICs on
//! whatever network the person gives them.

use std::path::Path;

use tandem_vm::VmConfig;

/// The command line (without the binary) of a QEMU running `c` by hand:
/// [`tandem_vm::qemu_args::by_hand`].
pub fn qemu_command(c: &VmConfig, qmp: &Path, serial: &Path, netdevs: &[&str]) -> Vec<String> {
    tandem_vm::qemu_args::by_hand(c, qmp, serial, netdevs)
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
