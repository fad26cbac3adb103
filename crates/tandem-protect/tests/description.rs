//! VM descriptions: the TOML file, its checks, and libvirt import. No QEMU.

use std::path::Path;

use tandem_protect::libvirt::import;
use tandem_protect::vmfile::VmFile;
use tandem_protect::VmSpec;
use tandem_vm::{Boot, DiskBus, DiskFormat, NicNet};

fn fixture(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read_to_string(p).unwrap()
}

/// A description file in `dir` with a raw and a qcow2 image next to it.
fn described(dir: &Path, body: &str) -> VmSpec {
    std::fs::write(dir.join("root.raw"), vec![0u8; 1 << 20]).unwrap();
    let mut q = b"QFI\xfb".to_vec();
    q.resize(1 << 16, 0);
    std::fs::write(dir.join("web.qcow2"), q).unwrap();
    std::fs::write(dir.join("vm.toml"), body).unwrap();
    VmSpec::described(dir.join("vm.toml"))
}

/// A network namespace for a bridged NIC to name (removed again on drop).
struct Netns(String);

impl Netns {
    fn new() -> Netns {
        let name = format!("tdd{}", std::process::id());
        let ok = std::process::Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap()
            .success();
        assert!(ok, "ip netns add {name} (the tests need root)");
        Netns(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .status();
    }
}

#[test]
fn own_vm_from_a_description() {
    let d = tempfile::tempdir().unwrap();
    let ns = Netns::new();
    let s = described(
        d.path(),
        &r#"
mem = 512
vcpus = 1
extra_args = ["-rtc", "base=utc"]
machine = "pc"
ready = "login:"
[[disk]]
path = "web.qcow2"
bus = "virtio-scsi"
cache = "none"
aio = "native"
[[disk]]
path = "root.raw"
readonly = true
[[nic]]
mac = "52:54:00:aa:00:01"
forward = ["tcp:127.0.0.1:2222-:22"]
[[nic]]
mac = "52:54:00:aa:00:02"
model = "e1000"
bridge = "br0"
netns = "NETNS"
"#
        .replace("NETNS", &ns.0),
    );
    let c = s.config("t").unwrap();
    assert_eq!((c.mem_mib, c.vcpus, c.machine.as_str()), (512, 1, "pc"));
    assert_eq!(c.boot, Boot::Firmware);
    assert_eq!(c.label(), "custom");
    assert_eq!(c.scratch_disk_mib, 0);
    assert_eq!(c.ready.as_deref(), Some("login:"));
    assert_eq!(c.disks[0].format, DiskFormat::Qcow2, "detected");
    assert_eq!(c.disks[0].bus, DiskBus::VirtioScsi);
    assert_eq!(
        c.disks[0].path,
        d.path().join("web.qcow2"),
        "relative to the file"
    );
    assert!(c.disks[1].readonly);
    assert!(matches!(&c.nics[0].net, NicNet::User { forwards } if forwards.len() == 1));
    assert!(
        matches!(&c.nics[1].net, NicNet::Bridge { bridge, netns } if bridge == "br0" && netns.as_deref() == Some(ns.0.as_str()))
    );
    assert_eq!(c.extra_args, ["-rtc", "base=utc"]);
    // Shown and read back, it is the same VM.
    let shown = VmFile::from_config(&c).to_toml();
    std::fs::write(d.path().join("again.toml"), &shown).unwrap();
    let again = VmSpec::described(d.path().join("again.toml"));
    let c2 = again.config("t").unwrap();
    assert_eq!(
        (c2.disks, c2.nics, c2.boot),
        (c.disks, c.nics, c.boot),
        "{shown}"
    );
    // A bridge or namespace that does not exist is named before anything starts.
    for (net, needle) in [
        ("bridge = \"nosuchbr7\"", "bridge nosuchbr7 does not exist"),
        (
            "bridge = \"br0\"\nnetns = \"nosuchns7\"",
            "namespace nosuchns7 does not exist",
        ),
    ] {
        let body = format!(
            "[[disk]]\npath = \"web.qcow2\"\n[[nic]]\nmac = \"52:54:00:aa:00:03\"\n{net}\n"
        );
        let e = described(d.path(), &body)
            .config("t")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{e}");
    }
}

fn refused(body: &str) -> String {
    let d = tempfile::tempdir().unwrap();
    let s = described(d.path(), body);
    let e = s.config("t").unwrap_err();
    // The whole chain, as the binary prints it.
    tandem_protect::chain(&e)
}

#[test]
fn descriptions_that_cannot_be_honoured_are_refused_clearly() {
    let disk = "[[disk]]\npath = \"root.raw\"\n";
    for (body, want) in [
        (
            format!("extra_args = [\"-incoming\", \"defer\"]\n{disk}"),
            "-incoming",
        ),
        (
            format!("extra_args = [\"-m\", \"4G\"]\n{disk}"),
            "use `mem`",
        ),
        (
            format!("extra_args = [\"-object\", \"memory-backend-ram,id=x,size=1G\"]\n{disk}"),
            "memory backend",
        ),
        (format!("vcpus = 4096\n{disk}"), "4096 vCPUs"),
        (
            "[[disk]]\npath = \"nope.qcow2\"\n".to_string(),
            "nope.qcow2",
        ),
        (
            "[[disk]]\npath = \"root.raw\"\nformat = \"qcow2\"\n".to_string(),
            "described as qcow2 but the file is raw",
        ),
        (
            "[[disk]]\npath = \"root.raw\"\nformat = \"vmdk\"\n".to_string(),
            "qemu-img convert",
        ),
        (
            format!("{disk}[[nic]]\nmac = \"01:00:5e:00:00:01\"\n"),
            "multicast",
        ),
        (
            format!("{disk}[[nic]]\nmac = \"52:54:00:00:00:01\"\nmodel = \"ne2k\"\n"),
            "NIC model",
        ),
        (format!("{disk}[boot]\nfirmware = \"ovmf\"\n"), "UEFI"),
        (format!("workload = \"kv\"\n{disk}"), "workload"),
        ("mem = 256\n".to_string(), "no [boot] and no [[disk]]"),
        (
            "scratch_disk_mib = 64\n[[disk]]\npath = \"root.raw\"\nformat = \"raw\"\n".to_string(),
            "scratch_disk_mib",
        ),
        (format!("{disk}[boot]\naddress_arg = \"ip\"\n"), "need a `kernel`"),
        (format!("colour = \"blue\"\n{disk}"), "colour"),
        (format!("ram_block = \"pc ram,x=1\"\n{disk}"), "ram_block"),
        (format!("{disk}pci = \"0x20\"\n"), "PCI address"),
        (
            format!("{disk}pci = \"0x05\"\n[[nic]]\nmac = \"52:54:00:00:00:01\"\npci = \"5\"\n"),
            "PCI address 05.0 is given to both",
        ),
        (
            "[[disk]]\npath = \"root.raw\"\nbus = \"virtio-scsi\"\npci = \"0x05\"\n".to_string(),
            "needs bus virtio-blk",
        ),
        (format!("extra_args = [\"-drive\", \"file=x.img\"]\n{disk}"), "[[disk]]"),
        (format!("extra_args = [\"-netdev\", \"tap,id=t\"]\n{disk}"), "[[nic]]"),
        (format!("machine = \"pc-q35-7.2,accel=kvm\"\n{disk}"), "q35 or pc"),
        (format!("{disk}[[nic]]\nmac = \"52:54:00:00:00:01\"\nforward = [\"tcp:127.0.0.1:1-:2,guestfwd=x\"]\n"), "host forward"),
        (format!("{disk}[boot]\ninitrd = \"root.raw\"\n"), "need a `kernel`"),
        (
            "[boot]\nfirmware = \"seabios\"\n".to_string(),
            "needs a disk",
        ),
    ] {
        let e = refused(&body);
        assert!(e.contains(want), "{body:?}: {e}");
    }
}

#[test]
fn a_kernel_boot_with_what_tandem_acts_on() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("vmlinuz"), b"k").unwrap();
    let s = described(
        d.path(),
        r#"
label = "kv"
ready = "TANDEM-READY"
echo = [" txns="]
legacy_virtio = true
scratch_disk_mib = 64
[boot]
kernel = "vmlinuz"
cmdline = "console=ttyS0 app=kv"
address_arg = "app.ip"
[[disk]]
path = "root.raw"
readonly = true
[[nic]]
mac = "52:54:00:12:34:56"
"#,
    );
    let c = s.config("t").unwrap();
    assert_eq!(c.label(), "kv");
    assert_eq!(c.echo, [" txns="]);
    assert!(c.legacy_virtio);
    assert_eq!(c.scratch_disk_mib, 64);
    assert_eq!(c.address_arg.as_deref(), Some("app.ip"));
    assert!(
        matches!(&c.boot, Boot::Kernel { kernel, cmdline, .. } if kernel == &d.path().join("vmlinuz") && cmdline == "console=ttyS0 app=kv")
    );
    // Shown and read back, it is the same VM.
    let shown = VmFile::from_config(&c).to_toml();
    std::fs::write(d.path().join("vm.toml"), &shown).unwrap();
    let again = VmSpec::described(d.path().join("vm.toml"))
        .config("t")
        .unwrap();
    assert_eq!(format!("{c:?}"), format!("{again:?}"), "{shown}");
}

#[test]
fn no_description_no_vm() {
    let e = tandem_protect::chain(&VmSpec::default().config("t").unwrap_err());
    assert!(e.contains("--vm-config"), "{e}");
}

#[test]
fn libvirt_domain_as_written_by_virt_install() {
    let (f, unmapped) = import(&fixture("web-virt-install.xml")).unwrap();
    assert_eq!((f.mem, f.vcpus), (Some(1024), Some(2)));
    assert_eq!(f.machine.as_deref(), Some("pc-q35-7.2"));
    assert_eq!(
        f.ram_block.as_deref(),
        Some("pc.ram"),
        "libvirt's name: adoptable"
    );
    assert_eq!(f.accel.as_deref(), Some("kvm"));
    assert_eq!(
        f.qemu.as_deref(),
        Some(Path::new("/usr/bin/qemu-system-x86_64"))
    );
    assert_eq!(
        f.boot.as_ref().unwrap().firmware.as_deref(),
        Some("seabios")
    );
    assert_eq!(f.disk.len(), 2, "the cdrom is not a disk");
    assert_eq!(
        f.disk[0].path,
        Path::new("/var/lib/libvirt/images/web.qcow2")
    );
    assert_eq!(f.disk[0].format.as_deref(), Some("qcow2"));
    assert_eq!(f.disk[0].cache.as_deref(), Some("none"));
    assert_eq!(f.disk[0].aio.as_deref(), Some("native"));
    assert_eq!(f.disk[1].bus.as_deref(), Some("virtio-scsi"));
    // Both NICs, in order: the one on libvirt's network on the bridge its live XML names.
    assert_eq!(f.nic.len(), 2);
    assert_eq!(f.nic[0].mac, "52:54:00:6b:3c:58");
    assert_eq!(f.nic[0].bridge.as_deref(), Some("br0"));
    assert_eq!(f.nic[1].bridge.as_deref(), Some("virbr0"));
    assert_eq!(f.nic[1].model.as_deref(), Some("e1000e"));
    // The CPU the guest runs with (host-passthrough), its UUID, clock and power management
    // are kept; the domain's own <qemu:commandline> comes last.
    let args = f.extra_args.join(" ");
    for want in [
        "-uuid ",
        "-cpu host",
        "-rtc base=utc,driftfix=slew",
        "-global kvm-pit.lost_tick_policy=delay",
        "-no-hpet",
        "-global ICH9-LPC.disable_s3=1",
    ] {
        assert!(args.contains(want), "{want} not in {args}");
    }
    assert!(args.ends_with("-rtc base=utc"), "{args}");
    let named: Vec<&str> = unmapped.iter().map(|u| u.element.as_str()).collect();
    for want in [
        "devices/disk[sdb]",
        "devices/serial",
        "devices/graphics[vnc]",
        "devices/video",
        "devices/channel[unix]",
        "features/vmport",
        // Without an address (hand-written XML), the USB controller is not created, nor
        // the tablet on it.
        "devices/controller[usb,0]/address",
        "devices/input[tablet,usb]",
    ] {
        assert!(named.contains(&want), "{want} not named in {named:?}");
    }
    // Nothing dropped silently: the disk behind a PCIe root port (bus 4) that the XML does
    // not define is named, and goes on the root bus.
    assert!(
        named.contains(&"devices/disk[/var/lib/libvirt/images/web.qcow2]/address[04:00.0]"),
        "{named:?}"
    );
    assert_eq!(f.disk[0].pci, None);
    // It renders as a description file.
    let text = f.to_toml();
    assert!(
        text.contains("[[disk]]") && text.contains("52:54:00:6b:3c:58"),
        "{text}"
    );
}

#[test]
fn libvirt_direct_kernel_boot_and_refusals() {
    let (f, unmapped) = import(&fixture("kernel-boot.xml")).unwrap();
    let b = f.boot.unwrap();
    assert_eq!(
        b.kernel.as_deref(),
        Some(Path::new("/var/lib/tiny/vmlinuz"))
    );
    assert_eq!(b.cmdline.as_deref(), Some("console=ttyS0 root=/dev/vda"));
    assert_eq!((f.mem, f.accel.as_deref()), (Some(512), Some("tcg")));
    assert_eq!(f.nic[0].bridge, None, "user networking");
    assert!(unmapped.is_empty(), "{unmapped:?}");

    // A UEFI guest is never silently described as SeaBIOS: its description says ovmf, which
    // `vm check` refuses; its LVM volume is a raw disk.
    let (f, unmapped) = import(&fixture("uefi.xml")).unwrap();
    assert_eq!(f.boot.as_ref().unwrap().firmware.as_deref(), Some("ovmf"));
    assert_eq!(f.disk[0].path, Path::new("/dev/vg0/efi"));
    assert_eq!(f.disk[0].format.as_deref(), Some("raw"));
    let named: Vec<&str> = unmapped.iter().map(|u| u.element.as_str()).collect();
    for want in ["os/loader", "memoryBacking"] {
        assert!(named.contains(&want), "{want} not named in {named:?}");
    }
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("efi.toml"), f.to_toml()).unwrap();
    let e = VmSpec::described(d.path().join("efi.toml"))
        .config("t")
        .unwrap_err();
    assert!(tandem_protect::chain(&e).contains("UEFI"), "{e}");
    for bad in [
        "<domain",
        "<network/>",
        "<domain type='xen'/>",
        "<domain><memory>lots</memory></domain>",
        "<domain><memory unit='PiB'>1</memory></domain>",
        "<domain><memory unit='GB'>18446744073709551615</memory></domain>",
    ] {
        let e = import(bad).unwrap_err();
        assert!(!e.to_string().is_empty());
    }
}

#[test]
fn libvirt_commandline_goes_through_the_allow_list() {
    let domain = |args: &str| {
        format!(
            "<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>\
             <memory unit='MiB'>512</memory>\
             <os><type>hvm</type><kernel>/var/lib/tiny/vmlinuz</kernel></os>\
             <qemu:commandline>{args}</qemu:commandline></domain>"
        )
    };
    let arg = |v: &str| format!("<qemu:arg value='{v}'/>");
    let ok = domain(&[arg("-cpu"), arg("host"), arg("-no-hpet")].concat());
    let (f, unmapped) = import(&ok).unwrap();
    assert_eq!(f.extra_args, ["-cpu", "host", "-no-hpet"]);
    assert!(unmapped.is_empty(), "{unmapped:?}");
    // A virtio-serial channel to a host socket would carry guest output past output commit.
    let bad = domain(
        &[
            arg("-chardev"),
            arg("socket,id=agent,path=/run/agent.sock"),
            arg("-device"),
            arg("virtio-serial-pci"),
        ]
        .concat(),
    );
    let (f, unmapped) = import(&bad).unwrap();
    assert!(f.extra_args.is_empty(), "{:?}", f.extra_args);
    let u = unmapped
        .iter()
        .find(|u| u.element.starts_with("qemu:commandline"))
        .expect("the refused arguments are named");
    assert!(
        u.why.contains("-chardev") && u.why.contains("allow-list"),
        "{}",
        u.why
    );
    // Root-bus PCI addresses (an i440fx domain) are kept: the guest sees the same slots.
    let pc = "<domain type='kvm'><memory unit='MiB'>512</memory>\
              <os><type machine='pc'>hvm</type><kernel>/k</kernel></os><devices>\
              <disk type='file' device='disk'><source file='/d.raw'/><target dev='vda' bus='virtio'/>\
              <address type='pci' domain='0x0000' bus='0x00' slot='0x07' function='0x0'/></disk>\
              <interface type='bridge'><mac address='52:54:00:00:00:01'/><source bridge='br0'/>\
              <model type='virtio'/><address type='pci' domain='0x0000' bus='0x00' slot='0x03' function='0x0'/>\
              </interface></devices></domain>";
    let (f, unmapped) = import(pc).unwrap();
    assert_eq!(f.disk[0].pci.as_deref(), Some("0x07.0"));
    assert_eq!(f.nic[0].pci.as_deref(), Some("0x03.0"));
    assert!(unmapped.is_empty(), "{unmapped:?}");
    // A named CPU model with its required and disabled flags.
    let cpu = "<domain type='kvm'><memory unit='MiB'>512</memory>\
               <os><type>hvm</type><kernel>/k</kernel></os>\
               <cpu mode='custom' match='exact'><model fallback='forbid'>Skylake-Client</model>\
               <feature policy='require' name='pcid'/><feature policy='disable' name='hle'/>\
               </cpu></domain>";
    let (f, unmapped) = import(cpu).unwrap();
    assert_eq!(f.extra_args, ["-cpu", "Skylake-Client,+pcid,-hle"]);
    assert!(unmapped.is_empty(), "{unmapped:?}");
}

#[test]
fn a_block_device_is_a_raw_disk() {
    // An LVM volume or a partition: here a loop device over a file.
    let d = tempfile::tempdir().unwrap();
    let img = d.path().join("lv.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let out = std::process::Command::new("losetup")
        .args(["-f", "--show"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "losetup (the tests need root): {out:?}"
    );
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let body = format!("[[disk]]\npath = \"{dev}\"\nformat = \"raw\"\n");
    let c = described(d.path(), &body).config("t");
    let _ = std::process::Command::new("losetup")
        .args(["-d", &dev])
        .status();
    let c = c.unwrap();
    assert_eq!(c.disks[0].path, Path::new(&dev));
    assert_eq!(c.disks[0].format, DiskFormat::Raw);
    // A character device is neither.
    let e = refused("[[disk]]\npath = \"/dev/null\"\nformat = \"raw\"\n");
    assert!(
        e.contains("neither a regular file nor a block device"),
        "{e}"
    );
}

#[test]
fn libvirt_live_q35_domain_keeps_its_whole_device_tree() {
    // `virsh dumpxml` of a running domain that virt-install defined (q35 with libvirt's
    // defaults), recorded from the libvirt adoption test.
    let (f, unmapped) = import(&fixture("virt-install-q35-live.xml")).unwrap();
    assert_eq!(f.machine.as_deref(), Some("pc-q35-7.2"));
    assert_eq!(f.topology.as_deref(), Some("sockets=2,cores=1,threads=1"));
    assert_eq!(f.vnet_hdr, Some(true));
    // Disk and NIC keep their places behind root ports 4 and 1.
    assert_eq!(f.disk[0].pci.as_deref(), Some("04:00.0"));
    assert_eq!(f.nic[0].pci.as_deref(), Some("01:00.0"));
    let args = &f.extra_args;
    // The 14 root ports come first (the buses exist before the devices on them).
    let ports = args
        .iter()
        .take(28)
        .filter(|a| a.starts_with("pcie-root-port,id=pci."))
        .count();
    assert_eq!(ports, 14, "{args:?}");
    let text = args.join(" ");
    for want in [
        "qemu-xhci,id=usb,bus=pci.2,addr=0x0.0x0,p2=15,p3=15",
        "virtio-serial-pci,id=virtio-serial0,bus=pci.3",
        "-chardev null,id=charchannel0",
        "virtserialport,bus=virtio-serial0.0,nr=1,chardev=charchannel0",
        "virtio-balloon-pci,id=balloon0,bus=pci.5",
        "rng-random,id=objrng0,filename=/dev/urandom",
        "virtio-rng-pci,rng=objrng0,id=rng0,bus=pci.6",
        "-cpu qemu64,+hypervisor,+lahf_lm",
        "-no-hpet",
    ] {
        assert!(text.contains(want), "{want} not in {text}");
    }
    // Everything passes the allow-list, and only the serial port's host end and the guest
    // agent's channel are named.
    tandem_vm::desc::check_extra_args(args).unwrap();
    let named: Vec<&str> = unmapped.iter().map(|u| u.element.as_str()).collect();
    assert_eq!(
        named,
        ["devices/serial", "devices/channel[unix]/source"],
        "{unmapped:#?}"
    );
}

#[test]
fn libvirt_network_interfaces_go_on_the_networks_bridge_when_libvirt_is_asked() {
    // A running domain's XML names the network's bridge.
    let live = fixture("web-virt-install.xml");
    let (f, _) = import(&live).unwrap();
    assert!(f.nic.iter().any(|n| n.bridge.as_deref() == Some("virbr0")));
    // A defined domain's does not: offline, named with what to do.
    let xml = live.replace(" bridge='virbr0'", "");
    let (_, unmapped) = import(&xml).unwrap();
    let net = unmapped
        .iter()
        .find(|u| u.element == "devices/interface[network=default]")
        .expect("named");
    assert!(net.why.contains("virsh net-info default"), "{}", net.why);
    // With libvirt asked (`tandem vm import --libvirt/--connect`): on the network's bridge.
    let bridge_of = |net: &str| (net == "default").then(|| "virbr0".to_string());
    let (f, unmapped) = tandem_protect::libvirt::import_with(&xml, &bridge_of).unwrap();
    assert!(
        !unmapped.iter().any(|u| u.element.contains("network=")),
        "{unmapped:?}"
    );
    let nic = f
        .nic
        .iter()
        .find(|n| n.bridge.as_deref() == Some("virbr0"))
        .expect("the network's NIC on virbr0");
    assert!(nic.mac.starts_with("52:54:00:"), "{}", nic.mac);
}

#[test]
fn libvirt_numbers_are_read_as_libvirt_reads_them() {
    // Controller 10 written in decimal, the disk's bus in hex: the same bus, pci.10.
    let xml = "<domain type='kvm'><memory unit='MiB'>512</memory>\
        <os><type machine='pc-q35-7.2'>hvm</type><kernel>/k</kernel></os><devices>\
        <disk type='file' device='disk'><source file='/d.raw'/><target dev='vda' bus='virtio'/>\
        <address type='pci' domain='0x0000' bus='0x0a' slot='0x00' function='0x0'/></disk>\
        <controller type='pci' index='10' model='pcie-root-port'><model name='pcie-root-port'/>\
        <target chassis='10' port='0x19'/>\
        <address type='pci' domain='0x0000' bus='0x00' slot='03' function='0'/></controller>\
        </devices></domain>";
    let (f, unmapped) = import(xml).unwrap();
    assert_eq!(f.disk[0].pci.as_deref(), Some("0a:00.0"));
    let args = f.extra_args.join(" ");
    // slot='03': octal, as libvirt reads it.
    assert!(
        args.contains("pcie-root-port,id=pci.10,bus=pcie.0,addr=0x3.0x0"),
        "{args}"
    );
    assert!(unmapped.is_empty(), "{unmapped:?}");
    tandem_vm::desc::check_pci_buses(
        &[tandem_vm::PciAddr::parse("0a:00.0").unwrap()],
        &f.extra_args,
    )
    .unwrap();
}
