//! `tandem adopt`: a primary that starts from a running guest (a QEMU started by hand, or a
//! libvirt domain) instead of a boot.

use std::path::PathBuf;
use std::time::Duration;

use super::{primary_with, PrimaryArgs};

/// `tandem adopt`: a primary that starts from a running guest instead of a boot.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("running").required(true).args(["qmp", "libvirt"])))]
pub struct AdoptArgs {
    /// The QMP socket of the QEMU that runs the guest now (started with `-qmp
    /// unix:PATH,server=on,wait=off`; no other client may be connected). Its devices, disk
    /// files and memory must be those of --vm-config (docs/VM_DESCRIPTION.md, "Adopting a
    /// running VM"); its guest moves into tandem's QEMU by a live migration, no reboot.
    #[arg(long, help_heading = "Adoption")]
    pub qmp: Option<PathBuf>,
    /// The libvirt domain that runs the guest now (describe it with `tandem vm import`
    /// first). tandem reaches its QEMU through libvirt's monitor, moves the guest, then marks
    /// the domain in libvirt as protected (docs/VM_DESCRIPTION.md, "libvirt").
    #[arg(long, value_name = "DOMAIN", help_heading = "Adoption")]
    pub libvirt: Option<String>,
    /// libvirt's connection URI for --libvirt (virsh -c; default: virsh's own).
    #[arg(
        long,
        value_name = "URI",
        requires = "libvirt",
        help_heading = "Adoption"
    )]
    pub connect: Option<String>,
    /// The longest the guest may stop for the switch, in ms (QEMU's downtime-limit).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(10..=10_000), help_heading = "Adoption")]
    pub downtime_ms: u64,
    /// Cancel the migration after this many seconds (the guest then runs on in its own
    /// QEMU).
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Adoption")]
    pub migrate_timeout_s: u64,
    /// Leave the old QEMU in its postmigrate state (paused, its guest gone) instead of telling
    /// it to quit: for a manager that ends it itself (not with --libvirt: libvirt could
    /// resume the old guest on the same disks).
    #[arg(long, conflicts_with = "libvirt", help_heading = "Adoption")]
    pub keep_source: bool,
    #[command(flatten)]
    pub primary: PrimaryArgs,
}

pub fn adopt(a: AdoptArgs) -> anyhow::Result<()> {
    use tandem_vm::adopt::{Libvirt, Source};
    let source = match (a.qmp, a.libvirt) {
        (Some(q), _) => Source::Qmp(q),
        (None, Some(domain)) => Source::Libvirt(Libvirt {
            domain,
            uri: a.connect,
        }),
        (None, None) => unreachable!("clap requires --qmp or --libvirt"),
    };
    let mut adopt = tandem_protect::primary::AdoptConfig::from(source);
    adopt.downtime_limit = Duration::from_millis(a.downtime_ms);
    adopt.timeout = Duration::from_secs(a.migrate_timeout_s);
    adopt.keep_source = a.keep_source;
    primary_with(a.primary, Some(adopt))
}
