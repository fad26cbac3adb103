//! `tandem`: the command-line front end. Thin glue over the library crates.

mod assets;
mod checkpoint;
mod console;
mod daemons;
mod doctor;
mod doctor_site;
mod fence;
mod host;
mod list;
mod run;
mod signals;
mod switchover;
mod vm;
mod watch;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "High availability and cheap, frequent checkpoints for unmodified QEMU virtual machines"
)]
pub(crate) struct Cli {
    /// Log level filter (e.g. info, debug, tandem_vm=trace); also RUST_LOG.
    #[arg(long, global = true, default_value = "warn")]
    log: String,
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

#[derive(Subcommand)]
pub(crate) enum Cmd {
    /// Check kernel, KVM, QEMU, /dev/shm and the preload library, run a
    /// boot/log/checkpoint/restore self-test; with flags, also a VM description and room for
    /// its disk replica, the bridge, the peer and etcd.
    Doctor(doctor::Args),
    /// Boot a guest, checkpoint it every epoch (no replication) and show live statistics.
    Watch(watch::Args),
    /// The one daemon per VM per host (unit tandem@VM): reads /etc/tandem/VM.toml, asks etcd
    /// who runs the VM and starts as that node or as its backup.
    Run(run::Args),
    /// Replicate a VM to a backup: epochs over TCP, network and disk output commit.
    Primary(daemons::PrimaryArgs),
    /// Protect a VM that a QEMU already runs, without a reboot: live-migrate its guest into
    /// tandem's QEMU on this host (same disks, RAM in shared memory, NIC behind tandem's
    /// relay), then replicate it like `tandem primary`.
    Adopt(daemons::AdoptArgs),
    /// Receive epochs into a mirror and fail over onto a standby QEMU when the primary is lost.
    Backup(daemons::BackupArgs),
    /// One backup for many primaries (N:1): a `tandem backup` per --replica, in one process,
    /// sharing one pool of consolidated pages.
    BackupHost(host::Args),
    /// Make a lab CA and TLS certificates for the replication link (--tls-dir).
    Keys(daemons::KeysArgs),
    /// What the daemons on this host are doing (role, committed epoch, lag, ownership, link).
    Status(daemons::StatusArgs),
    /// Every VM of the cluster from etcd: where it runs, its backup, protected or not, its
    /// committed epoch and lag (what each node's daemon last reported).
    List(list::Args),
    /// The VMs' ownership records in etcd, and the operator's override.
    #[command(subcommand)]
    Fence(fence::Cmd),
    /// Planned maintenance: the primary on this host hands the guest over to its backup and
    /// serves as its backup (started with --listen); run it again to fail back.
    Switchover(switchover::Args),
    /// Incremental checkpoints on disk: save, list, restore, verify.
    #[command(subcommand)]
    Checkpoint(checkpoint::Cmd),
    /// VM descriptions: import from libvirt, show, check.
    #[command(subcommand)]
    Vm(vm::Cmd),
    /// Attach the terminal to a running guest's serial console (ttyS0), as `virsh console`
    /// does; Ctrl-] detaches. Everything it prints is also in DIR/guest-console.log.
    Console(console::Args),
    /// Print a shell completion script (the package installs them).
    Completions(assets::CompletionArgs),
    /// Write man pages (tandem(1), tandem-primary(1), ...) into a directory.
    #[command(hide = true)]
    Manpages(assets::ManArgs),
}

impl Cmd {
    /// Commands that only ask or print (no daemon, no guest): SIGPIPE kills them quietly and
    /// they leave other processes' leftovers alone.
    fn only_prints(&self) -> bool {
        matches!(
            self,
            Cmd::Vm(_)
                | Cmd::Status(_)
                | Cmd::List(_)
                | Cmd::Keys(_)
                | Cmd::Switchover(_)
                | Cmd::Fence(_)
                | Cmd::Completions(_)
                | Cmd::Manpages(_)
        )
    }
}

fn main() {
    let cli = Cli::parse();
    // Commands that only print behave like other Unix tools when stdout is a closed pipe
    // (`tandem trace info F | head`): die quietly from SIGPIPE instead of failing a write.
    // Never the daemons: a peer that closes its socket must not kill them (writes fail with
    // EPIPE instead).
    if cli.cmd.only_prints() {
        // SAFETY: called in main before any other thread exists; SIG_DFL is valid.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    // Private by default: guest RAM, disk copies, checkpoints, keys and sockets are created
    // for tandem's user alone (directories 0700, files 0600).
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    tandem_args::logging::init(&cli.log);
    // Whatever killed tandem processes left behind (QEMU runtime directories, working
    // directories, RAM files) goes first.
    if !cli.cmd.only_prints() {
        tandem_vm::clean_stale();
    }
    let result = match cli.cmd {
        Cmd::Doctor(a) => doctor::run(a),
        Cmd::Watch(a) => watch::run(a),
        Cmd::Checkpoint(c) => checkpoint::run(c),
        Cmd::Vm(c) => vm::run(c),
        Cmd::Console(a) => console::run(a),
        Cmd::Run(a) => run::run(a),
        Cmd::Primary(a) => daemons::primary(a),
        Cmd::Adopt(a) => daemons::adopt(a),
        Cmd::Backup(a) => daemons::backup(a),
        Cmd::BackupHost(a) => host::run(a),
        Cmd::Status(a) => daemons::status(a),
        Cmd::Keys(a) => daemons::keys(a),
        Cmd::Switchover(a) => switchover::run(a),
        Cmd::Fence(c) => fence::run(c),
        Cmd::List(a) => list::run(a),
        Cmd::Completions(a) => assets::completions(a),
        Cmd::Manpages(a) => assets::manpages(a),
    };
    if let Err(e) = result {
        tandem_args::logging::report_error(&format_args!("{e:#}"));
        std::process::exit(exit_code(&e));
    }
}

/// `tandem run` refuses to start: etcd's record says this node ran the only copy (status 3).
#[derive(Debug)]
pub struct Fenced(pub String);

impl std::fmt::Display for Fenced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Fenced {}

/// Exit status 3: the ownership record in etcd says this node must not run the VM (another
/// copy runs, or ran last): restarting would change nothing (the units'
/// RestartPreventExitStatus). 1: any other error.
fn exit_code(e: &anyhow::Error) -> i32 {
    use tandem_protect::{backup::BackupError, node::NodeError, primary::PrimaryError};
    let fenced_primary = |p: &PrimaryError| match p {
        PrimaryError::Fenced(_) | PrimaryError::FencedBy(_) => true,
        PrimaryError::Fence(f) => f.refusal().is_some(),
        _ => false,
    };
    let fenced_backup = |b: &BackupError| matches!(b, BackupError::FencedBy(_));
    let fenced = e.chain().any(|c| c.is::<Fenced>())
        || e.chain().any(|c| {
            c.downcast_ref::<PrimaryError>().is_some_and(fenced_primary)
                || c.downcast_ref::<BackupError>().is_some_and(fenced_backup)
                || c.downcast_ref::<NodeError>().is_some_and(|n| match n {
                    NodeError::Primary(p) => fenced_primary(p),
                    NodeError::Backup(b) => fenced_backup(b),
                    NodeError::Metrics(..) => false,
                })
        });
    if fenced {
        3
    } else {
        1
    }
}
