//! `tandem run --config /etc/tandem/VM.toml`: the one daemon per VM per host (the unit
//! `tandem@VM`), whatever this node's role. It reads the configuration file, asks etcd's
//! ownership record who runs the VM, and starts as the node running the guest (`tandem
//! primary` that can serve as a backup after a switchover) or as the backup of the node that
//! runs it (`tandem backup` that protects the guest in turn after a failover) — the same file
//! on both hosts. Flags after the file override its keys.
//!
//! ```toml
//! vm_id = 1
//! primary = "host-a"                  # the node that boots a new VM
//! [nodes]                             # every node: its replication address
//! host-a = "10.0.0.1:7000"
//! host-b = "10.0.0.2:7000"
//! [paths]
//! mirror_dir = "/dev/shm/tandem-web1" # the backup's RAM mirror (a tmpfs)
//! state_dir = "/var/lib/tandem/web1"  # real storage: the primary's working directory,
//!                                     # and the guest's disks after a failover here
//! [vm]                                # the VM description (docs/VM_DESCRIPTION.md), or
//! mem = 1024                          # vm_config = "/etc/tandem/web1.vm.toml" above
//! [fencing]
//! etcd = ["https://etcd1:2379"]
//! [replication]                       # any flag of tandem primary/backup, e.g.
//! time_budget_pct = 20
//! [metrics]
//! listen = "127.0.0.1:9471"
//! ```

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::CommandFactory;

mod file;
pub use file::{read, Config};

/// `tandem run`.
#[derive(clap::Args)]
pub struct Args {
    /// The VM's configuration file (TOML; docs/OPERATIONS.md, "One unit per VM").
    #[arg(long)]
    pub config: PathBuf,
    /// This node's name in [nodes] (default: the host name).
    #[arg(long)]
    pub node: Option<String>,
    /// Print the role chosen and the daemon's command line, and exit.
    #[arg(long)]
    pub dry_run: bool,
    /// Flags of `tandem primary` / `tandem backup` that override the file's keys.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub rest: Vec<String>,
}

/// The role this node starts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// It runs the guest (boots it).
    Primary,
    /// It serves as the backup of the node running it.
    Backup,
}

/// Who starts as what, from the ownership record (`None`: a new VM); `peer` is the other
/// node of [nodes].
pub fn decide(
    record: Option<&tandem_fence::Record>,
    me: &str,
    peer: &str,
    preferred: &str,
) -> Result<Role, String> {
    use tandem_fence::State;
    let by_preference = if me == preferred {
        Role::Primary
    } else {
        Role::Backup
    };
    match record {
        None => Ok(by_preference),
        // Stopped on purpose: the node that stopped it has the newest disks; stopped by an
        // operator's override (or a node not in [nodes]): the preferred node boots it.
        Some(r) if r.state == State::Stopped => Ok(if r.node == me {
            Role::Primary
        } else if r.node == peer {
            Role::Backup
        } else {
            by_preference
        }),
        Some(r) if r.node != me => Ok(Role::Backup),
        // This node ran a protected guest, its daemon ended, and the backup did not take the
        // guest over while `run` waited ([`await_takeover`]): its session never committed an
        // epoch (the node died during the first copy), or the backup is down or cut off from
        // etcd too. Nobody runs the guest: a human decides.
        Some(r) if r.state == State::Protected => Err(format!(
            "etcd still says this node ({me}) runs the VM protected by {peer}'s session ({}), but {peer} did not take the guest over: it had no complete copy yet (its first epoch had not committed), or it is down or cut off from etcd too. Nobody runs the guest now. If {peer} takes it over later, start this unit again (it then serves as the backup); otherwise declare the guest gone with `tandem fence stop --vm-id ID --generation {}` and start the unit of the node whose disks are newest (this one: it ran the guest last)",
            r.describe(),
            r.gen
        )),
        Some(r) => Err(format!(
            "etcd says this node ({me}) ran the VM's only copy ({}) and its daemon ended: no other copy can take over. If the guest cannot come back, declare it gone with `tandem fence stop --vm-id ID --generation {}` (what it did since is lost), then start this unit again",
            r.describe(),
            r.gen
        )),
    }
}

fn given(rest: &[String], flag: &str) -> bool {
    let long = format!("--{flag}");
    rest.iter()
        .any(|a| a == &long || a.starts_with(&format!("{long}=")))
}

/// The command line of the daemon `tandem run` starts (without the program name). `new_vm`:
/// etcd has no record of the VM (then a node that runs it adopts it if the file has
/// `[adopt]`).
pub fn command_line(
    a: &Args,
    role: Role,
    file: &Config,
    new_vm: bool,
) -> anyhow::Result<Vec<OsString>> {
    let me = &file.me;
    let other = file
        .nodes
        .iter()
        .find(|(n, _)| *n != me)
        .map(|(_, addr)| addr.clone())
        .context("[nodes] needs the other node too")?;
    let own = file.nodes[me].clone();
    let mut args: Vec<(String, Option<String>)> = vec![
        ("vm-id".into(), Some(file.vm_id.to_string())),
        ("node".into(), Some(me.clone())),
        (
            "vm-config".into(),
            Some(file.vm_config.display().to_string()),
        ),
    ];
    match role {
        Role::Primary => {
            args.push(("backup".into(), Some(other)));
            args.push(("listen".into(), Some(own)));
            args.push(("dir".into(), Some(file.state_dir.display().to_string())));
            args.push((
                "backup-dir".into(),
                Some(file.mirror_dir.display().to_string()),
            ));
        }
        Role::Backup => {
            args.push(("listen".into(), Some(own)));
            args.push(("peer".into(), Some(other)));
            args.push(("dir".into(), Some(file.mirror_dir.display().to_string())));
            args.push((
                "disk-dir".into(),
                Some(file.state_dir.display().to_string()),
            ));
        }
    }
    args.extend(file.flags.iter().cloned());
    let sub = match role {
        Role::Primary if new_vm && file.adopt => "adopt",
        Role::Primary => "primary",
        Role::Backup => "backup",
    };
    // Keys the chosen role has no flag for are the other role's (the file serves both).
    let cmd = crate::Cli::command();
    let sc = cmd.find_subcommand(sub).context("no daemon subcommand")?;
    let known = |f: &str| sc.get_arguments().any(|x| x.get_long() == Some(f));
    let both = ["primary", "backup", "adopt"].map(|s| cmd.find_subcommand(s).cloned());
    let mut line: Vec<OsString> = vec![sub.into()];
    for (flag, value) in args {
        if given(&a.rest, &flag) {
            continue; // the command line overrides the file
        }
        if !known(&flag) {
            let elsewhere = both.iter().flatten().any(|c| {
                c.get_arguments()
                    .any(|x| x.get_long() == Some(flag.as_str()))
            });
            if !elsewhere {
                bail!(
                    "{}: no flag --{flag} on tandem primary, tandem backup or tandem adopt (see `tandem primary --help`)",
                    a.config.display()
                );
            }
            continue;
        }
        line.push(format!("--{flag}").into());
        if let Some(v) = value {
            line.push(v.into());
        }
    }
    // The command line's flags, but those only the other role has (with their values).
    let mut rest = a.rest.iter().peekable();
    while let Some(arg) = rest.next() {
        let name = arg
            .strip_prefix("--")
            .map(|n| n.split('=').next().unwrap_or(n));
        let other_only = name.and_then(|n| {
            if known(n) {
                return None;
            }
            both.iter()
                .flatten()
                .flat_map(|c| c.get_arguments())
                .find(|x| x.get_long() == Some(n))
        });
        match other_only {
            Some(x) => {
                let takes_value = x.get_action().takes_values();
                if takes_value && !arg.contains('=') {
                    rest.next();
                }
            }
            None => line.push(arg.into()),
        }
    }
    Ok(line)
}

/// The fencing flags of the file (and of the command line), for reading the record.
fn fence_args(a: &Args, cfg: &Config) -> anyhow::Result<tandem_args::FenceArgs> {
    #[derive(clap::Parser)]
    struct Fencing {
        #[command(flatten)]
        f: tandem_args::FenceArgs,
        #[arg(allow_hyphen_values = true, trailing_var_arg = true)]
        _rest: Vec<String>,
    }
    let mut argv: Vec<String> = vec!["tandem-run".into()];
    for (flag, v) in &cfg.flags {
        if flag.starts_with("etcd") && !given(&a.rest, flag) {
            argv.push(format!("--{flag}"));
            argv.extend(v.clone());
        }
    }
    let mut rest = a.rest.iter();
    while let Some(arg) = rest.next() {
        if arg.starts_with("--etcd") {
            argv.push(arg.clone());
            if !arg.contains('=') {
                argv.extend(rest.next().cloned());
            }
        }
    }
    let mut f = <Fencing as clap::Parser>::try_parse_from(argv)
        .map_err(|e| anyhow::anyhow!("{}: the fencing keys: {e}", a.config.display()))?
        .f;
    f.node = Some(cfg.me.clone());
    Ok(f)
}

/// How long a node that ran a protected guest waits, when its daemon starts again, for the
/// backup to take the guest over: the backup declares its primary lost after `timeout_ms`
/// (`stall_ms` for one that hangs) and then writes etcd; four times that, at least 10 s.
fn takeover_wait(cfg: &Config) -> Duration {
    let ms = |flag: &str| {
        cfg.flags
            .iter()
            .find(|(f, _)| f == flag)
            .and_then(|(_, v)| v.as_deref()?.parse::<u64>().ok())
    };
    let timeout = ms("timeout-ms").unwrap_or(500);
    let stall = ms("stall-ms").unwrap_or(3 * timeout);
    Duration::from_millis(4 * timeout.max(stall)).max(Duration::from_secs(10))
}

/// While etcd's record says this node runs a protected guest — its daemon ended (a crash, a
/// kill, its host lost), so the guest it ran is gone — waits up to `wait` for the backup to
/// take the guest over, and returns the record then. A record that does not change means the
/// backup could not take over, which [`decide`] refuses.
fn await_takeover(
    f: &tandem_fence::Fence,
    mut record: Option<tandem_fence::Record>,
    me: &str,
    peer: &str,
    wait: Duration,
) -> Option<tandem_fence::Record> {
    let ours = |r: &Option<tandem_fence::Record>| {
        r.as_ref()
            .is_some_and(|r| r.state == tandem_fence::State::Protected && r.node == me)
    };
    if !ours(&record) {
        return record;
    }
    tracing::warn!(
        "etcd says this node ran the guest protected by {peer} and its daemon ended: waiting up to {} s for {peer} to take the guest over",
        wait.as_secs()
    );
    let until = Instant::now() + wait;
    while ours(&record) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(250));
        match f.read() {
            Ok(r) => record = r,
            Err(e) => tracing::warn!("reading etcd's record: {e}; retrying"),
        }
    }
    record
}

/// What `peer` last reported into etcd (its role, state and the report's age), for a refusal.
fn peer_said(f: &tandem_fence::Fence, peer: &str) -> String {
    let doc = match f.report_of(peer) {
        Ok(Some(d)) => d,
        Ok(None) => return format!(" ({peer} has written no status report)"),
        Err(_) => return String::new(),
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&doc) else {
        return String::new();
    };
    let age = v["updated_unix_ms"]
        .as_u64()
        .map(|t| tandem_protect::unix_ms().saturating_sub(t) / 1000);
    format!(
        " ({peer} last reported, {} s ago: {} {})",
        age.map_or("?".into(), |a| a.to_string()),
        v["role"].as_str().unwrap_or("?"),
        v["state"].as_str().unwrap_or("?")
    )
}

/// `tandem run`: decide the role, then run that daemon.
pub fn run(a: Args) -> anyhow::Result<()> {
    let cfg = read(&a)?;
    let fence = fence_args(&a, &cfg)?;
    let role = match fence.config(cfg.vm_id, "node") {
        None => bail!(
            "{}: tandem run decides this node's role from etcd's ownership record: give [fencing] etcd = [...] (or run tandem primary / tandem backup directly)",
            a.config.display()
        ),
        Some(fc) => {
            let f = tandem_fence::Fence::connect(fc)?;
            // Wait for etcd: starting without knowing who runs the VM could boot a second copy.
            let record = loop {
                match f.read() {
                    Ok(r) => break r,
                    Err(e) if e.unknown() => {
                        tracing::warn!("etcd does not answer yet ({e}); retrying");
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            let peer = cfg.nodes.keys().find(|n| **n != cfg.me).cloned().unwrap_or_default();
            if let Some(r) = record.as_ref().filter(|r| {
                a.dry_run && r.node == cfg.me && r.state != tandem_fence::State::Stopped
            }) {
                // The unit here may well be running: say what a start would do, not more.
                let then = match r.state {
                    tandem_fence::State::Protected => format!(
                        "if its daemon has ended, a start here waits up to {} s for {peer} to take the guest over and then serves as its backup, or exits 3 when nobody did",
                        takeover_wait(&cfg).as_secs()
                    ),
                    _ => "if its daemon has ended, a start here exits 3: it ran the only copy".into(),
                };
                println!(
                    "tandem run: VM {} on node {}: etcd says this node runs the guest ({}); {then}",
                    cfg.vm_id,
                    cfg.me,
                    r.describe()
                );
                return Ok(());
            }
            let record = await_takeover(&f, record, &cfg.me, &peer, takeover_wait(&cfg));
            let role = decide(record.as_ref(), &cfg.me, &peer, &cfg.preferred).map_err(|why| {
                let said = peer_said(&f, &peer);
                let why = why.replace("--vm-id ID", &format!("--vm-id {}", cfg.vm_id));
                anyhow::Error::new(crate::Fenced(format!("{why}{said}")))
            })?;
            let new_vm = record.is_none();
            eprintln!(
                "tandem run: VM {} on node {}: {} ({})",
                cfg.vm_id,
                cfg.me,
                match role {
                    Role::Primary if new_vm && cfg.adopt => "adopts the running guest",
                    Role::Primary => "runs the guest",
                    Role::Backup => "serves as the backup",
                },
                record.map_or("a new VM".into(), |r| r.describe())
            );
            (role, new_vm)
        }
    };
    let (role, new_vm) = role;
    let line = command_line(&a, role, &cfg, new_vm)?;
    if a.dry_run {
        let text: Vec<String> = line
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        println!("tandem {}", text.join(" "));
        return Ok(());
    }
    let mut argv: Vec<OsString> = vec!["tandem".into()];
    argv.extend(line);
    let cli = <crate::Cli as clap::Parser>::try_parse_from(argv)
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.config.display()))?;
    match cli.cmd {
        crate::Cmd::Primary(p) => crate::daemons::primary(p),
        crate::Cmd::Backup(b) => crate::daemons::backup(b),
        crate::Cmd::Adopt(p) => crate::daemons::adopt(p),
        _ => unreachable!("run starts primary, adopt or backup"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_fence::{Record, State};

    fn rec(state: State, node: &str) -> Record {
        Record {
            gen: 3,
            state,
            node: node.into(),
            session: (state == State::Protected).then_some(7),
            op: 1,
            at_ms: 0,
        }
    }

    #[test]
    fn roles_follow_the_ownership_record() {
        use Role::*;
        let d = |r: Option<&Record>, me: &str| {
            let peer = if me == "a" { "b" } else { "a" };
            decide(r, me, peer, "a")
        };
        assert_eq!(d(None, "a"), Ok(Primary));
        assert_eq!(d(None, "b"), Ok(Backup));
        let stopped_b = rec(State::Stopped, "b");
        assert_eq!(
            d(Some(&stopped_b), "b"),
            Ok(Primary),
            "b has the newest disks"
        );
        assert_eq!(d(Some(&stopped_b), "a"), Ok(Backup));
        let by_operator = rec(State::Stopped, "operator");
        assert_eq!(d(Some(&by_operator), "a"), Ok(Primary));
        assert_eq!(d(Some(&by_operator), "b"), Ok(Backup));
        for s in [State::Protected, State::Unprotected] {
            assert_eq!(d(Some(&rec(s, "b")), "a"), Ok(Backup));
        }
        // Restarted after running a protected guest, and the backup did not take it over
        // (`run` waited for that): nobody runs the guest; the operator decides.
        let e = d(Some(&rec(State::Protected, "a")), "a").unwrap_err();
        assert!(
            e.contains("did not take the guest over") && e.contains("--generation 3"),
            "{e}"
        );
        // Restarted after running the only copy: nothing to resume; the operator decides.
        let e = d(Some(&rec(State::Unprotected, "a")), "a").unwrap_err();
        assert!(
            e.contains("fence stop") && e.contains("--generation 3"),
            "{e}"
        );
    }

    fn args(text: &str, node: &str, rest: &[&str]) -> (tempfile::TempDir, Args) {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("vm.toml");
        let text = text.replace("STATE", &dir.path().display().to_string());
        std::fs::write(&config, text).unwrap();
        let a = Args {
            config,
            node: Some(node.into()),
            dry_run: true,
            rest: rest.iter().map(|s| s.to_string()).collect(),
        };
        (dir, a)
    }

    const FILE: &str = "vm_id = 4\n[nodes]\na = \"10.0.0.1:7000\"\nb = \"10.0.0.2:7000\"\n\
        [paths]\nstate_dir = \"STATE/state\"\nmirror_dir = \"STATE/mirror\"\n\
        [vm]\nmem = 512\n[fencing]\netcd = [\"http://e1:2379\", \"http://e2:2379\"]\n\
        [replication]\nschedule = \"adaptive\"\ntimeout_ms = 400\n[metrics]\nlisten = \"127.0.0.1:9471\"\n";

    fn line(a: &Args, role: Role) -> String {
        line_new(a, role, false)
    }

    fn line_new(a: &Args, role: Role, new_vm: bool) -> String {
        let cfg = read(a).unwrap();
        command_line(a, role, &cfg, new_vm)
            .unwrap()
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn the_file_becomes_each_roles_flags_and_the_command_line_wins() {
        let (dir, a) = args(FILE, "a", &["--timeout-ms", "250", "--epoch-ms=20"]);
        let p = line(&a, Role::Primary);
        assert!(
            p.starts_with("primary --vm-id 4 --node a --vm-config "),
            "{p}"
        );
        for want in [
            "--backup 10.0.0.2:7000",
            "--listen 10.0.0.1:7000",
            "--etcd http://e1:2379,http://e2:2379",
            "--schedule adaptive",
            "--metrics-listen 127.0.0.1:9471",
            "--timeout-ms 250",
            "--epoch-ms=20",
        ] {
            assert!(p.contains(want), "{want} not in {p}");
        }
        assert!(!p.contains("--timeout-ms 400"), "{p}");
        // The inline [vm] became a description file in the state directory.
        let vm = std::fs::read_to_string(dir.path().join("state/vm.toml")).unwrap();
        assert!(vm.contains("mem = 512"), "{vm}");
        // The backup has no --schedule: left out.
        let b = line(&a, Role::Backup);
        assert!(
            b.starts_with("backup ") && b.contains("--peer 10.0.0.2:7000"),
            "{b}"
        );
        assert!(!b.contains("--schedule"), "{b}");
    }

    #[test]
    fn a_new_vm_with_adopt_is_adopted_by_the_node_that_would_boot_it() {
        let text = format!("{FILE}[adopt]\nqmp = \"/run/web.qmp\"\ndowntime_ms = 200\n");
        let (_dir, a) = args(&text, "a", &[]);
        let p = line_new(&a, Role::Primary, true);
        assert!(p.starts_with("adopt "), "{p}");
        for want in [
            "--qmp /run/web.qmp",
            "--downtime-ms 200",
            "--listen 10.0.0.1:7000",
            "--schedule adaptive",
        ] {
            assert!(p.contains(want), "{want} not in {p}");
        }
        // A VM etcd knows runs already under tandem (or ran): never adopted again.
        let p = line_new(&a, Role::Primary, false);
        assert!(p.starts_with("primary ") && !p.contains("--qmp"), "{p}");
        let b = line_new(&a, Role::Backup, true);
        assert!(b.starts_with("backup ") && !b.contains("--qmp"), "{b}");
        // A libvirt domain, through libvirt's monitor.
        let text = format!("{FILE}[adopt]\nlibvirt = \"web\"\nconnect = \"qemu:///system\"\n");
        let (_dir, a) = args(&text, "a", &[]);
        let p = line_new(&a, Role::Primary, true);
        assert!(
            p.starts_with("adopt ")
                && p.contains("--libvirt web")
                && p.contains("--connect qemu:///system"),
            "{p}"
        );
        // The backup gives its host's libvirt the domain (whatever the record says).
        for new_vm in [true, false] {
            let b = line_new(&a, Role::Backup, new_vm);
            assert!(
                b.contains("--libvirt web") && b.contains("--connect qemu:///system"),
                "{b}"
            );
        }
    }

    #[test]
    fn mistakes_in_the_file_are_named() {
        for (text, says) in [
            (
                FILE.replace("[metrics]", "[metric]"),
                "unknown section [metric]",
            ),
            (
                FILE.replace("timeout_ms = 400", "timeout = 400"),
                "no flag --timeout",
            ),
            (FILE.replace("vm_id = 4", ""), "vm_id = N is required"),
            (
                format!("{FILE}[adopt]\ndowntime_ms = 200\n"),
                "[adopt] needs qmp",
            ),
            (
                FILE.replace("b = \"10.0.0.2:7000\"", ""),
                "exactly two nodes",
            ),
        ] {
            let (_d, a) = args(&text, "a", &[]);
            let e = read(&a)
                .and_then(|cfg| command_line(&a, Role::Primary, &cfg, true))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{says}: {e}");
        }
        let (_d, a) = args(FILE, "c", &[]);
        assert!(read(&a)
            .err()
            .unwrap()
            .to_string()
            .contains("not in [nodes]"));
    }
}
