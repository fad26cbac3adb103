//! The QEMU command line of a tandem guest: q35, guest RAM in a shared file (so tandem maps
//! it too), the guest image, NIC (user networking or tandem's relay), optional NBD data disk,
//! serial console to a file, QMP on a unix socket.

use std::path::Path;

use crate::vm::VmConfig;

/// The QEMU command line for `config`.
pub fn qemu_args(
    config: &VmConfig,
    ram: &Path,
    qmp: &Path,
    serial: &Path,
    incoming: bool,
) -> Vec<String> {
    let mem = format!("{}M", config.mem_mib);
    let mut net = String::from("user,id=n0");
    let mut append = format!(
        "console=ttyS0 quiet panic=-1 tandem.workload={}",
        config.workload
    );
    match &config.relay_net {
        Some((sock, cidr)) => {
            net = format!(
                "stream,id=n0,server=off,addr.type=unix,addr.path={}",
                sock.display()
            );
            append.push_str(&format!(" tandem.ip={cidr}"));
        }
        None => {
            if let Some(p) = config.kv_port {
                net.push_str(&format!(",hostfwd=tcp:127.0.0.1:{p}-10.0.2.15:6379"));
            }
        }
    }
    let mut a: Vec<String> = vec![
        "-name".into(),
        format!("tandem-{}", config.name),
        "-accel".into(),
        config.accel.clone(),
        "-machine".into(),
        "q35,memory-backend=ram0".into(),
        "-object".into(),
        format!(
            "memory-backend-file,id=ram0,size={mem},mem-path={},share=on",
            ram.display()
        ),
        "-m".into(),
        mem,
        "-smp".into(),
        "1".into(),
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        "-S".into(),
        "-kernel".into(),
        config.image.kernel().display().to_string(),
        "-initrd".into(),
        config.image.initrd().display().to_string(),
        "-append".into(),
        append,
        "-drive".into(),
        format!(
            "file={},format=raw,if=none,id=apps,readonly=on",
            config.image.apps().display()
        ),
        "-device".into(),
        "virtio-blk-pci,drive=apps".into(),
        "-netdev".into(),
        net,
        "-device".into(),
        "virtio-net-pci,netdev=n0,mac=52:54:00:12:34:56".into(),
        "-chardev".into(),
        format!("file,id=ser0,path={}", serial.display()),
        "-serial".into(),
        "chardev:ser0".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", qmp.display()),
    ];
    if let Some(sock) = &config.data_disk {
        a.extend([
            "-drive".into(),
            format!(
                "file=nbd+unix:///?socket={},format=raw,if=none,id=data",
                sock.display()
            ),
            "-device".into(),
            "virtio-blk-pci,drive=data".into(),
        ]);
    }
    if incoming {
        a.extend(["-incoming".into(), "defer".into()]);
    }
    a
}
