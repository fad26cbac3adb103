//! `tandem vm import|show|check`: VM descriptions (docs/VM_DESCRIPTION.md).

use std::path::PathBuf;

use anyhow::Context;
use tandem_protect::vmfile::VmFile;

use tandem_args::VmArgs;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Turn a libvirt domain XML (`virsh dumpxml NAME`) into a tandem VM description; every
    /// element that is not mapped is named on stderr with the reason.
    Import {
        /// The domain XML.
        xml: PathBuf,
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
        Cmd::Import { xml, output, json } => {
            let text = std::fs::read_to_string(&xml)
                .with_context(|| format!("reading {}", xml.display()))?;
            let (file, unmapped) = tandem_protect::libvirt::import(&text)
                .with_context(|| format!("importing {}", xml.display()))?;
            if json {
                let v = serde_json::json!({"description": file, "unmapped": unmapped});
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            for u in &unmapped {
                eprintln!("not mapped: {}: {}", u.element, u.why);
            }
            let text = format!(
                "# imported by `tandem vm import` from {}\n{}",
                xml.display(),
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
        Cmd::Show { vm } => {
            let c = vm.spec().config("show")?;
            print!("{}", VmFile::from_config(&c).to_toml());
            Ok(())
        }
        Cmd::LibvirtHook { args } => {
            use std::io::Read;
            let mut xml = String::new();
            // libvirt gives the XML for every operation; a hook that cannot read it lets the
            // domain through only if it is not starting.
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
