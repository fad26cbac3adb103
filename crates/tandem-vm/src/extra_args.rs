//! Extra QEMU arguments of a VM description (`extra_args`, and libvirt's
//! `<qemu:commandline>` through `tandem vm import`) are checked against an **allow-list**.
//!
//! Anything that could carry guest I/O past tandem is refused: a disk or firmware store whose
//! writes tandem would not capture (`-drive`, `-fda`, `-pflash`, a bare image path), a NIC or
//! socket whose output would not wait for the backup's acknowledgement (`-netdev`,
//! `-chardev`, `-device vhost-vsock-pci`, a virtio-serial port), a shared host directory
//! (`-virtfs`, `-fsdev`), a display or audio device. What remains are options that shape the
//! machine the guest sees (CPU model, clock, SMBIOS, boot order, firmware file, watchdog, a few
//! devices without a backend) — which is what libvirt domains typically pass. The one
//! exception to "no character devices": a virtio-serial port on a `null,id=ID` character
//! device, so that the guest keeps the port it was started with (a migration needs it) while
//! nothing it writes there leaves the host. A value that repeats a key, or names its model
//! twice (`usb-tablet,driver=...`), is refused: QEMU would take the last.

use crate::desc::DescError;

/// QEMU options tandem sets itself, with what to use instead.
const OWNED: &[(&str, &str)] = &[
    ("-m", "tandem sizes guest RAM itself: use `mem`"),
    (
        "-machine",
        "tandem sets the machine and its memory backend: use `machine`",
    ),
    (
        "-M",
        "tandem sets the machine and its memory backend: use `machine`",
    ),
    ("-mem-path", "guest RAM is tandem's shared memory backend"),
    (
        "-mem-prealloc",
        "guest RAM is tandem's shared memory backend",
    ),
    ("-numa", "guest RAM is one shared memory backend"),
    ("-smp", "use `vcpus`"),
    (
        "-incoming",
        "tandem starts standbys and restores with -incoming itself",
    ),
    (
        "-S",
        "tandem starts QEMU paused and runs it when its dirty log is armed",
    ),
    ("-daemonize", "tandem supervises QEMU as its child"),
    ("-qmp", "tandem owns QEMU's QMP socket"),
    ("-qmp-pretty", "tandem owns QEMU's QMP socket"),
    ("-monitor", "tandem owns QEMU's monitors"),
    ("-mon", "tandem owns QEMU's monitors"),
    (
        "-serial",
        "tandem owns the first serial port (the console it reads)",
    ),
    ("-accel", "use `accel`"),
    ("-enable-kvm", "use `accel = \"kvm\"`"),
    (
        "-snapshot",
        "writes would never reach the disk tandem replicates",
    ),
    ("-loadvm", "tandem restores checkpoints itself"),
    ("-kernel", "use [boot] kernel"),
    ("-initrd", "use [boot] initrd"),
    ("-append", "use [boot] cmdline"),
    ("-name", "tandem names its QEMU processes"),
    ("-nodefaults", "tandem sets it"),
    ("-drive", DEVICES),
    ("-blockdev", DEVICES),
    ("-hda", DEVICES),
    ("-hdb", DEVICES),
    ("-hdc", DEVICES),
    ("-hdd", DEVICES),
    ("-cdrom", DEVICES),
    ("-netdev", DEVICES),
    ("-nic", DEVICES),
    ("-net", DEVICES),
];

/// Why disks and NICs must not come in through extra arguments.
const DEVICES: &str = "describe disks and NICs with [[disk]] and [[nic]]: tandem must capture every disk's writes and hold every NIC's output";

/// Options allowed with one value, and what their value may hold.
const WITH_VALUE: &[&str] = &[
    "-cpu",
    "-rtc",
    "-smbios",
    "-uuid",
    "-boot",
    "-k",
    "-vga",
    "-global",
    "-bios",
    "-L",
    "-fw_cfg",
    "-watchdog-action",
    "-action",
    "-sandbox",
    "-device",
    "-object",
    "-msg",
    "-chardev",
];

/// Options allowed without a value.
const FLAGS: &[&str] = &["-no-hpet", "-no-reboot", "-no-user-config"];

/// Device models that have no backend on the host: nothing of the guest's I/O leaves through
/// them.
const DEVICE_MODELS: &[&str] = &[
    "virtio-rng-pci",
    "virtio-balloon-pci",
    "virtio-balloon",
    "pvpanic",
    "pvpanic-pci",
    "i6300esb",
    "ib700",
    "qemu-xhci",
    "nec-usb-xhci",
    "usb-ehci",
    "ich9-usb-ehci1",
    "piix3-usb-uhci",
    "usb-tablet",
    "usb-kbd",
    "usb-mouse",
    "pcie-root-port",
    "pci-bridge",
    "pcie-pci-bridge",
    "ioh3420",
    "virtio-serial-pci",
    "VGA",
    "cirrus-vga",
    "bochs-display",
    "virtio-vga",
    "virtio-gpu-pci",
    "intel-iommu",
    "vmcoreinfo",
    "sga",
];

/// `-object` types without a backend that carries guest output.
const OBJECT_TYPES: &[&str] = &["rng-random", "rng-builtin", "secret", "iothread"];

/// Device properties that attach a host backend (a disk, a character device, a network or
/// file system backend, audio): refused wherever they appear.
const BACKEND_PROPERTIES: &[&str] = &[
    "drive", "chardev", "netdev", "fsdev", "audiodev", "memdev", "vhostfd", "fd",
];

/// What every refusal of an unknown option says.
const NOT_LISTED: &str = "not on tandem's allow-list of extra QEMU arguments (CPU, clock, SMBIOS, boot order, firmware file, watchdog and devices without a host backend): a device or backend there could carry guest I/O past disk capture or output commit; describe disks and NICs with [[disk]] and [[nic]]";

fn refuse(arg: &str, why: impl Into<String>) -> DescError {
    DescError::NotAllowed {
        arg: arg.to_string(),
        why: why.into(),
    }
}

/// Refuses extra QEMU arguments that collide with what tandem owns or are not on the
/// allow-list.
pub fn check_extra_args(args: &[String]) -> Result<(), DescError> {
    // The null character devices, by id: the only host end a serial port may have
    // (exactly `null,id=ID`: nothing else that could give it a host end, like a logfile).
    let nulls: Vec<&str> = args
        .windows(2)
        .filter(|w| opt_name(&w[0]) == "-chardev")
        .filter_map(|w| null_chardev(&w[1]))
        .collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let opt = opt_name(a);
        if let Some((_, why)) = OWNED.iter().find(|(o, _)| *o == opt) {
            return Err(DescError::Owned {
                arg: a.clone(),
                why,
            });
        }
        if a.contains("memory-backend") {
            return Err(DescError::MemoryBackend(a.clone()));
        }
        if !opt.starts_with('-') {
            return Err(refuse(
                a,
                "QEMU takes a bare path as the first disk image, whose writes tandem would not capture; describe disks with [[disk]]",
            ));
        }
        if FLAGS.contains(&opt) {
            continue;
        }
        if !WITH_VALUE.contains(&opt) {
            return Err(refuse(a, NOT_LISTED));
        }
        let Some(v) = it.next() else {
            return Err(refuse(a, "it needs a value"));
        };
        check_value(opt, v, &nulls).map_err(|why| refuse(&format!("{a} {v}"), why))?;
    }
    Ok(())
}

/// An option's name as QEMU reads it (`--device` is `-device`).
fn opt_name(a: &str) -> &str {
    let opt = a.split_once('=').map_or(a, |(o, _)| o);
    match opt.strip_prefix("--") {
        Some(rest) => &opt[opt.len() - rest.len() - 1..],
        None => opt,
    }
}

/// The id of a character device that is exactly `null,id=ID`.
fn null_chardev(v: &str) -> Option<&str> {
    match v.split(',').collect::<Vec<_>>().as_slice() {
        ["null", id] | ["backend=null", id] => id.strip_prefix("id="),
        _ => None,
    }
}

/// The value of an allowed option: devices and objects by model, no backend properties.
fn check_value(opt: &str, v: &str, nulls: &[&str]) -> Result<(), String> {
    if v.contains("memory-backend") {
        return Err("guest RAM is tandem's shared memory backend; remove it".into());
    }
    let mut parts = v.split(',');
    let first = parts.next().unwrap_or("");
    let props: Vec<(&str, &str)> = parts.filter_map(|p| p.split_once('=')).collect();
    // QEMU takes the last of a repeated key: a second `driver=` (or `qom-type=`,
    // `backend=`) would replace the model checked here.
    let mut keys: Vec<&str> = props.iter().map(|(k, _)| *k).collect();
    if let Some((k, _)) = first.split_once('=') {
        keys.push(k);
    }
    keys.sort_unstable();
    if let Some(w) = keys.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!(
            "it sets {}= twice (QEMU would take the last)",
            w[0]
        ));
    }
    if !first.contains('=') {
        if let Some((k, _)) = props
            .iter()
            .find(|(k, _)| ["driver", "qom-type", "backend", "type"].contains(k))
        {
            return Err(format!(
                "{k}= would replace the model {first:?} checked here"
            ));
        }
    }
    let backend = |key: &str| BACKEND_PROPERTIES.contains(&key);
    match opt {
        "-device" => {
            let model = first.strip_prefix("driver=").unwrap_or(first);
            if ["virtserialport", "virtconsole"].contains(&model) {
                let chardev = props.iter().find(|(k, _)| *k == "chardev").map(|(_, v)| *v);
                return match chardev {
                    Some(c) if nulls.contains(&c) => Ok(()),
                    _ => Err(format!(
                        "{model} with chardev {}: a serial port's host end must be a `-chardev null` (what the guest writes there would leave unheld)",
                        chardev.unwrap_or("(none)")
                    )),
                };
            }
            if !DEVICE_MODELS.contains(&model) {
                return Err(format!(
                    "device {model:?} is not on the allow-list of devices without a host backend ({}); disks and NICs go in [[disk]] and [[nic]]",
                    DEVICE_MODELS.join(", ")
                ));
            }
            if let Some((k, _)) = props.iter().find(|(k, _)| backend(k)) {
                return Err(format!(
                    "property {k}= attaches a host backend whose I/O tandem would not capture or hold"
                ));
            }
        }
        "-object" => {
            let ty = first.strip_prefix("qom-type=").unwrap_or(first);
            if !OBJECT_TYPES.contains(&ty) {
                return Err(format!(
                    "object type {ty:?} is not allowed (only {})",
                    OBJECT_TYPES.join(", ")
                ));
            }
        }
        "-chardev" if null_chardev(v).is_none() => {
            return Err(format!(
                "character device {v:?}: only `null,id=ID` ones (no host end) are on the allow-list; a socket, file, pty or logfile would carry guest I/O past output commit"
            ));
        }
        "-global" => {
            let prop = first.split_once('=').map_or(first, |(k, _)| k);
            let key = prop.rsplit('.').next().unwrap_or(prop);
            if backend(key) || key.starts_with("drive") {
                return Err(format!(
                    "{prop} attaches a host backend whose I/O tandem would not capture or hold"
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn owned_arguments_are_refused_with_what_to_use() {
        for a in [
            "-m",
            "-incoming",
            "-S",
            "-daemonize",
            "-qmp",
            "--qmp",
            "-snapshot",
        ] {
            let e = check_extra_args(&[a.to_string()]).unwrap_err();
            assert!(e.to_string().contains(a.trim_start_matches('-')), "{e}");
        }
        let e = check_extra_args(&["-object".into(), "memory-backend-ram,id=m,size=1G".into()])
            .unwrap_err();
        assert!(e.to_string().contains("memory backend"), "{e}");
        check_extra_args(&["-rtc".into(), "base=utc".into()]).unwrap();
    }

    #[test]
    fn machine_shaping_arguments_pass() {
        check_extra_args(&args(&[
            "-cpu",
            "Skylake-Server,+avx2",
            "-rtc",
            "base=localtime,clock=host",
            "-smbios",
            "type=1,serial=abc",
            "-uuid",
            "0f6c2b52-7a38-4c7f-9d7e-3b8d7c1f0a11",
            "-boot",
            "order=c,menu=on",
            "-no-hpet",
            "-device",
            "virtio-rng-pci,id=rng0",
            "-object",
            "rng-random,id=r,filename=/dev/urandom",
            "-device",
            "i6300esb",
            "-watchdog-action",
            "reset",
            "-global",
            "kvm-pit.lost_tick_policy=delay",
        ]))
        .unwrap();
    }

    #[test]
    fn io_paths_past_capture_or_output_commit_are_refused() {
        for (bad, says) in [
            (&["-fda", "floppy.img"][..], "allow-list"),
            (&["-pflash", "vars.fd"][..], "allow-list"),
            (
                &["-virtfs", "local,path=/srv,mount_tag=h"][..],
                "allow-list",
            ),
            (&["-fsdev", "local,id=f,path=/srv"][..], "allow-list"),
            (&["-chardev", "socket,id=c,path=/tmp/s"][..], "allow-list"),
            (
                &["-device", "vhost-vsock-pci,guest-cid=3"][..],
                "vhost-vsock-pci",
            ),
            (
                &["-device", "virtserialport,chardev=c"][..],
                "virtserialport",
            ),
            (
                &[
                    "-chardev",
                    "socket,id=c,path=/s",
                    "-device",
                    "virtconsole,chardev=c",
                ][..],
                "allow-list",
            ),
            (&["-device", "usb-tablet,chardev=c"][..], "chardev="),
            (&["-device", "e1000,netdev=n"][..], "e1000"),
            (
                &["-object", "filter-dump,id=f,netdev=n,file=x"][..],
                "filter-dump",
            ),
            (&["-global", "isa-fdc.driveA=d"][..], "driveA"),
            (&["-vnc", ":0"][..], "allow-list"),
            (&["-audiodev", "pa,id=a"][..], "allow-list"),
            (&["disk.img"][..], "bare path"),
            (&["-cpu"][..], "needs a value"),
        ] {
            let e = check_extra_args(&args(bad)).unwrap_err().to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_serial_port_with_a_null_host_end_passes() {
        check_extra_args(&args(&[
            "-device",
            "virtio-serial-pci,id=virtio-serial0,bus=pci.3,addr=0x0",
            "-chardev",
            "null,id=charchannel0",
            "-device",
            "virtserialport,bus=virtio-serial0.0,nr=1,chardev=charchannel0,id=channel0,name=org.qemu.guest_agent.0",
        ]))
        .unwrap();
        let e = check_extra_args(&args(&[
            "-chardev",
            "null,id=n",
            "-device",
            "virtserialport,chardev=other",
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("chardev other"), "{e}");
    }

    #[test]
    fn a_model_or_backend_cannot_be_replaced_later_in_the_value() {
        for (bad, says) in [
            (
                &["-chardev", "null,id=c,backend=socket,path=/tmp/x,server=on"][..],
                "backend=",
            ),
            (
                &["-chardev", "null,id=c,logfile=/etc/passwd"][..],
                "logfile",
            ),
            (
                &["-device", "usb-tablet,driver=vhost-vsock-pci,guest-cid=3"][..],
                "driver=",
            ),
            (&["-device", "virtio-rng-pci,id=a,id=b"][..], "twice"),
            (
                &["-object", "rng-random,id=r,qom-type=filter-dump"][..],
                "qom-type=",
            ),
        ] {
            let e = check_extra_args(&args(bad)).unwrap_err().to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        // --chardev is -chardev.
        check_extra_args(&args(&[
            "--chardev",
            "null,id=n",
            "-device",
            "virtserialport,chardev=n",
        ]))
        .unwrap();
    }
}
