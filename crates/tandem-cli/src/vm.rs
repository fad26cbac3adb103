//! `tandem vm import|show|check`: VM descriptions (docs/VM_DESCRIPTION.md).

use std::path::PathBuf;

use anyhow::Context;
use tandem_protect::vmfile::VmFile;

use tandem_args::VmArgs;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Turn a libvirt domain XML (`virsh dumpxml NAME`) into a tandem VM description; every
    /// element that is not mapped is named on stderr with the reason.
    #[command(group(clap::ArgGroup::new("domain").required(true).args(["xml", "libvirt"])))]
    Import {
        /// The domain XML.
        xml: Option<PathBuf>,
        /// Ask libvirt for the domain's live XML instead (`virsh dumpxml DOMAIN`).
        #[arg(long, value_name = "DOMAIN")]
        libvirt: Option<String>,
        /// libvirt's connection URI (virsh -c). With it or --libvirt, NICs on a libvirt
        /// network are put on that network's bridge (`virsh net-dumpxml`).
        #[arg(long, value_name = "URI")]
        connect: Option<String>,
        /// Write the description here (default: stdout).
        #[arg(short = 'o', long)]
        output: Option<PathBuf>,
        /// Print {"description": ..., "unmapped": [...]} as JSON instead (on stdout).
        #[arg(long, conflicts_with = "output")]
        json: bool,
    },
    /// Print the VM the flags (and --vm-config) describe, as a description file.
    Show {
        #[command(flatten)]
        vm: VmArgs,
    },
    /// Print the QEMU command line that runs the VM the flags (and --vm-config) describe as
    /// a person would start it, to be adopted later (`tandem adopt`, or `[adopt] qmp` of
    /// `tandem run`): plain `-m` RAM (describe it with `ram_block = "pc.ram"`), QMP and the
    /// console log where given. One line, quoted for a POSIX shell.
    QemuCommand {
        #[command(flatten)]
        vm: VmArgs,
        /// The QMP socket tandem adopts the VM through.
        #[arg(long)]
        qmp: PathBuf,
        /// Where the guest's console is logged.
        #[arg(long)]
        serial: PathBuf,
        /// NIC i's QEMU backend instead of the description's (`-netdev` value with
        /// `id=n<i>`, e.g. `tap,id=n0,ifname=tap0,script=no,downscript=no`), once per NIC.
        #[arg(long)]
        netdev: Vec<String>,
    },
    /// Check a description: files, formats, machine, vCPUs, MACs, extra arguments.
    Check {
        #[command(flatten)]
        vm: VmArgs,
    },
    /// libvirt's qemu hook (install dist/libvirt/qemu as /etc/libvirt/hooks/qemu): refuses
    /// to start a domain that tandem adopted and runs (docs/VM_DESCRIPTION.md, "libvirt").
    /// Reads the domain XML on stdin.
    LibvirtHook {
        /// DOMAIN OPERATION SUB-OPERATION EXTRA, as libvirt passes them.
        #[arg(num_args = 0.., allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

pub fn run(c: Cmd) -> anyhow::Result<()> {
    match c {
        Cmd::Import {
            xml,
            libvirt,
            connect,
            output,
            json,
        } => {
            let lv = (libvirt.is_some() || connect.is_some()).then(|| tandem_vm::adopt::Libvirt {
                domain: libvirt.clone().unwrap_or_default(),
                uri: connect,
            });
            let (text, from) = match (&xml, &lv) {
                (Some(p), _) => (
                    std::fs::read_to_string(p)
                        .with_context(|| format!("reading {}", p.display()))?,
                    p.display().to_string(),
                ),
                (None, Some(l)) => (
                    l.run(["dumpxml", &l.domain])
                        .with_context(|| format!("asking libvirt for domain {}", l.domain))?,
                    format!("libvirt domain {}", l.domain),
                ),
                (None, None) => unreachable!("clap requires XML or --libvirt"),
            };
            let bridge_of = |net: &str| {
                lv.as_ref()
                    .and_then(|l| tandem_protect::libvirt::inloop::network_bridge(l, net))
            };
            let (file, unmapped) = tandem_protect::libvirt::import_with(&text, &bridge_of)
                .with_context(|| format!("importing {from}"))?;
            if json {
                let v = serde_json::json!({"description": file, "unmapped": unmapped});
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            for u in &unmapped {
                eprintln!("not mapped: {}: {}", u.element, u.why);
            }
            let text = format!(
                "# imported by `tandem vm import` from {from}\n{}",
                file.to_toml()
            );
            match output {
                Some(p) => {
                    std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?
                }
                None => print!("{text}"),
            }
            Ok(())
        }
        Cmd::QemuCommand {
            vm,
            qmp,
            serial,
            netdev,
        } => {
            let c = vm.spec().config("by-hand")?;
            let netdevs: Vec<&str> = netdev.iter().map(String::as_str).collect();
            let mut line = vec![c.qemu.display().to_string()];
            line.extend(tandem_vm::qemu_args::by_hand(&c, &qmp, &serial, &netdevs));
            let quoted: Vec<String> = line.iter().map(|a| shell_quote(a)).collect();
            println!("{}", quoted.join(" "));
            Ok(())
        }
        Cmd::Show { vm } => {
            let c = vm.spec().config("show")?;
            print!("{}", VmFile::from_config(&c).to_toml());
            Ok(())
        }
        Cmd::LibvirtHook { args } => {
            use std::io::Read;
            // Only a domain about to start is looked at; every other operation passes.
            if args.get(1).map(String::as_str) != Some("prepare") {
                return Ok(());
            }
            let mut xml = String::new();
            std::io::stdin()
                .read_to_string(&mut xml)
                .context("reading the domain XML libvirt passes on stdin")?;
            if let Err(refusal) = tandem_protect::libvirt::inloop::hook(&args, &xml) {
                eprintln!("{refusal}");
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Check { vm } => {
            let c = vm.spec().config("check")?;
            println!(
                "VM description OK: {} MiB, {} vCPU(s), machine {}, {} disk(s), {} NIC(s)",
                c.mem_mib,
                c.vcpus,
                c.machine,
                c.disks.len(),
                c.nics.len()
            );
            Ok(())
        }
    }
}

/// `a` as one word of a POSIX shell.
fn shell_quote(a: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_,./=:@%+-".contains(c);
    if !a.is_empty() && a.chars().all(plain) {
        a.to_string()
    } else {
        format!("'{}'", a.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn shell_quote_keeps_plain_words_and_quotes_the_rest() {
        use super::shell_quote as q;
        assert_eq!(q("-m"), "-m");
        assert_eq!(q("file=/a b,if=none"), "'file=/a b,if=none'");
        assert_eq!(q("it's"), "'it'\\''s'");
        assert_eq!(q(""), "''");
    }
}
