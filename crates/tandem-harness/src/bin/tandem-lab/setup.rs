//! `tandem setup`: install missing Debian packages, fetch the compile workload's sources from
//! crates.io, build the guest image into the cache. Idempotent: a stamp of every input decides
//! whether the image is rebuilt.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};

/// Debian packages tandem needs on the host (and copies into the guest image).
pub const PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "qemu-utils",
    "linux-image-cloud-amd64",
    "busybox-static",
    "cpio",
    "gzip",
    "kmod",
    "e2fsprogs",
    "redis-server",
    "redis-tools",
    "sqlite3",
    "gcc",
    "make",
    "libc6-dev",
    "binutils",
    "iproute2",
    "nftables",    // fault tests: partitions of the replication link
    "etcd-server", // fencing: the lab's 3-member cluster (docs/FENCING.md)
    "etcd-client", // etcdctl: the lab's health checks and operators
    "zstd",
    // The Debian test VM (`tandem setup --debian`) and its clients.
    "debootstrap",
    "dpkg-dev", // dpkg-shlibdeps: the Debian package's dependencies (dist/deb/build.sh)
    "grub-pc-bin",
    "fdisk",
    "openssh-client",
    "postgresql-client",
    // A real libvirtd for the adoption tests (`demo --vm debian --adopt --libvirt`); the
    // tests run their own in a private mount namespace, never the host's.
    "libvirt-daemon-system",
    "libvirt-clients",
    "virtinst",
    // promtool: the metrics endpoint, alert rules and their unit tests (dist/prometheus).
    "prometheus",
    // systemd-nspawn: the package's root boots under a real systemd for the unit's runbook
    // test (dist/deb/test-systemd.sh).
    "systemd-container",
];

const DEBIAN_BUILDER: &str = include_str!("../../../../../guest/debian/build-debian.sh");

const GUEST_FILES: &[(&str, &str)] = &[
    (
        "build-image.sh",
        include_str!("../../../../../guest/build-image.sh"),
    ),
    (
        "initramfs-init",
        include_str!("../../../../../guest/initramfs-init"),
    ),
    (
        "tandem-init",
        include_str!("../../../../../guest/tandem-init"),
    ),
    (
        "workload.sh",
        include_str!("../../../../../guest/workload.sh"),
    ),
    ("lua.mk", include_str!("../../../../../guest/lua.mk")),
    ("luarun.c", include_str!("../../../../../guest/luarun.c")),
    (
        "memtouch.c",
        include_str!("../../../../../guest/memtouch.c"),
    ),
    (
        "allocchurn.c",
        include_str!("../../../../../guest/allocchurn.c"),
    ),
    ("luaexec.c", include_str!("../../../../../guest/luaexec.c")),
    (
        "luatext.lua",
        include_str!("../../../../../guest/luatext.lua"),
    ),
    ("luagc.lua", include_str!("../../../../../guest/luagc.lua")),
];
const CODEBASE_MANIFEST: &str = include_str!("../../../../../guest/codebase/Cargo.toml");

#[derive(clap::Args)]
pub struct Args {
    /// Do not install packages; only check them and build the image.
    #[arg(long)]
    pub no_install: bool,
    /// Rebuild the guest image even if it is up to date.
    #[arg(long)]
    pub force: bool,
    /// Also build the Debian 12 test VM (qcow2, GRUB, systemd, openssh, PostgreSQL) with
    /// debootstrap; a few minutes, cached.
    #[arg(long)]
    pub debian: bool,
}

fn spinner(msg: &str) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    pb.enable_steady_tick(Duration::from_millis(120));
    pb.set_message(msg.to_string());
    pb
}

pub fn missing_packages() -> Vec<&'static str> {
    PACKAGES
        .iter()
        .copied()
        .filter(|p| {
            let out = Command::new("dpkg-query").args(["-W", "-f=${Status}", p]).output();
            !matches!(out, Ok(o) if String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        })
        .collect()
}

fn install_packages(no_install: bool) -> anyhow::Result<()> {
    let missing = missing_packages();
    if missing.is_empty() {
        println!("[1/3] Debian packages: all {} present", PACKAGES.len());
        return Ok(());
    }
    let cmd = format!(
        "apt-get update && apt-get install -y --no-install-recommends {}",
        missing.join(" ")
    );
    if no_install {
        bail!(
            "missing Debian packages: {}; install them with: {cmd}",
            missing.join(" ")
        );
    }
    if !rustix::process::geteuid().is_root() {
        bail!(
            "missing Debian packages: {}; run `tandem setup` as root, or: sudo sh -c '{cmd}'",
            missing.join(" ")
        );
    }
    println!("[1/3] Debian packages: installing {}", missing.join(" "));
    let pb = spinner("apt-get update");
    let log = std::env::temp_dir().join("tandem-apt.log");
    let run = |args: &[&str]| -> anyhow::Result<()> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let st = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .status()
            .context("running apt-get")?;
        if !st.success() {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(12).collect();
            bail!(
                "apt-get {} failed ({st}); last lines of {}:\n{}",
                args[0],
                log.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Ok(())
    };
    run(&["update", "-q"])?;
    pb.set_message(format!("apt-get install {}", missing.join(" ")));
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    args.extend(missing.iter().copied());
    run(&args)?;
    pb.finish_with_message("packages installed");
    Ok(())
}

/// Fetches lua-src from crates.io with cargo and returns the directory holding lua-5.*.
fn lua_sources(cache: &Path) -> anyhow::Result<PathBuf> {
    let dir = cache.join("codebase");
    std::fs::create_dir_all(dir.join("src"))?;
    std::fs::write(dir.join("Cargo.toml"), CODEBASE_MANIFEST)?;
    std::fs::write(dir.join("src/lib.rs"), "")?;
    let manifest = dir.join("Cargo.toml");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = Command::new(&cargo)
        .args(["fetch", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .status()
        .with_context(|| format!("running {cargo} (needed to fetch Lua sources from crates.io)"))?;
    if !st.success() {
        bail!("cargo fetch of the compile workload's sources (lua-src) failed: {st}");
    }
    let out = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(&manifest)
        .output()?;
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("cargo metadata output")?;
    let path = meta["packages"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "lua-src"))
        .and_then(|p| p["manifest_path"].as_str())
        .map(|p| {
            PathBuf::from(p)
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default()
        })
        .context("lua-src not found in cargo metadata")?;
    Ok(path)
}

fn stamp(lua: &Path) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for (name, text) in GUEST_FILES {
        h.update(name.as_bytes());
        h.update(text.as_bytes());
    }
    h.update(lua.display().to_string().as_bytes());
    let kernels = std::fs::read_dir("/lib/modules")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let mut kernels = kernels;
    kernels.sort();
    h.update(kernels.join(",").as_bytes());
    format!("{:032x}", h.digest128())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    install_packages(args.no_install)?;
    let cache = tandem_labguest::cache_dir();
    std::fs::create_dir_all(&cache)
        .with_context(|| format!("creating cache {}", cache.display()))?;
    let pb = spinner("fetching Lua sources (crates.io: lua-src) for the compile workload");
    let lua = lua_sources(&cache)?;
    pb.finish_and_clear();
    println!("[2/3] compile workload sources: {}", lua.display());
    let image = tandem_labguest::GuestImage::default();
    let want = stamp(&lua);
    let stamp_path = image.dir.join("stamp");
    if !args.force
        && image.check().is_ok()
        && std::fs::read_to_string(&stamp_path).ok().as_deref() == Some(want.as_str())
    {
        println!("[3/3] guest image up to date: {}", image.dir.display());
    } else {
        build_lab_image(&image, &lua, &want)?;
    }
    if args.debian {
        build_debian(args.force)?;
    }
    Ok(())
}

/// The Debian test VM: debian.qcow2, root's SSH key and a description (vm.toml).
fn build_debian(force: bool) -> anyhow::Result<()> {
    let dir = tandem_labguest::debian_dir();
    let want = format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(DEBIAN_BUILDER.as_bytes())
    );
    let stamp = dir.join("stamp");
    if !force
        && dir.join("debian.qcow2").is_file()
        && std::fs::read_to_string(&stamp).ok().as_deref() == Some(want.as_str())
    {
        println!("[4/4] Debian test VM up to date: {}", dir.display());
        return save_booted(&dir, &want);
    }
    if !rustix::process::geteuid().is_root() {
        bail!("building the Debian test VM needs root (debootstrap chroots): run `tandem setup --debian` as root");
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let script = dir.join("build-debian.sh");
    std::fs::write(&script, DEBIAN_BUILDER)?;
    let pb = spinner("building the Debian 12 test VM (debootstrap, PostgreSQL, GRUB)");
    let mut child = Command::new("sh")
        .arg(&script)
        .arg(&dir)
        .arg(tandem_harness::netlab::GUEST_CIDR)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("running the Debian VM builder")?;
    let mut log = String::new();
    if let Some(err) = child.stderr.take() {
        use std::io::BufRead;
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            if line.starts_with("step ") {
                pb.set_message(format!("Debian test VM: {line}"));
            }
            log.push_str(&line);
            log.push('\n');
        }
    }
    let st = child.wait()?;
    pb.finish_and_clear();
    if !st.success() {
        bail!("Debian test VM build failed ({st}):\n{log}");
    }
    std::fs::write(dir.join("vm.toml"), DEBIAN_VM)?;
    std::fs::write(&stamp, &want)?;
    let size = std::fs::metadata(dir.join("debian.qcow2")).map_or(0, |m| m.len() >> 20);
    println!(
        "[4/4] Debian test VM built in {}: debian.qcow2 ({size} MiB), vm.toml",
        dir.display()
    );
    save_booted(&dir, &want)
}

/// A checkpoint of the Debian test VM booted to PostgreSQL-ready, its disk included, in
/// `debian/booted/`: tests restore it in seconds instead of booting for half a minute
/// (`tandem checkpoint restore debian/booted --id 1 --vm-config ...`). Taken from a
/// copy-on-write overlay, so debian.qcow2 is not written.
fn save_booted(dir: &Path, image_stamp: &str) -> anyhow::Result<()> {
    let booted = dir.join("booted");
    let stamp = booted.join("stamp");
    if booted.join("index").is_file()
        && std::fs::read_to_string(&stamp).ok().as_deref() == Some(image_stamp)
    {
        println!("      booted checkpoint up to date: {}", booted.display());
        return Ok(());
    }
    let _ = std::fs::remove_dir_all(&booted);
    let overlay = dir.join("booted-overlay.qcow2");
    let _ = std::fs::remove_file(&overlay);
    tandem_vm::desc::create_overlay(&dir.join("debian.qcow2"), &overlay)?;
    let desc = dir.join("booted-vm.toml");
    let text = DEBIAN_VM
        .replace(
            "path = \"debian.qcow2\"",
            &format!("path = {:?}", overlay.display().to_string()),
        )
        .replace(
            "forward = [\"tcp:127.0.0.1:2222-:22\", \"tcp:127.0.0.1:5432-:5432\"]\n",
            "",
        );
    std::fs::write(&desc, text)?;
    let pb = spinner("booting the Debian test VM once for its booted checkpoint (TCG, ~30 s)");
    let status = {
        let pb = pb.clone();
        tandem_protect::Status::new("", move |l| {
            let (tandem_protect::Line::Info(m) | tandem_protect::Line::Warn(m)) = l;
            pb.set_message(format!("Debian booted checkpoint: {m}"));
        })
    };
    let mut cfg = tandem_protect::checkpoint::SaveConfig::new(
        booted.clone(),
        tandem_protect::vmspec::VmSpec::described(desc.clone()),
    );
    cfg.count = Some(1);
    let r = tandem_protect::checkpoint::save(cfg, status);
    pb.finish_and_clear();
    let _ = std::fs::remove_file(&overlay);
    let _ = std::fs::remove_file(&desc);
    r.context("saving the Debian test VM's booted checkpoint")?;
    std::fs::write(&stamp, image_stamp)?;
    println!("      booted checkpoint saved: {}", booted.display());
    Ok(())
}

/// The Debian test VM's description (next to its disk).
const DEBIAN_VM: &str = r#"# tandem's Debian 12 test VM, built by `tandem setup --debian`.
mem = 1024
vcpus = 2
ready = "TANDEM-READY"

[boot]
firmware = "seabios"

[[disk]]
path = "debian.qcow2"
format = "qcow2"
cache = "writeback"

[[nic]]
mac = "52:54:00:12:34:56"
forward = ["tcp:127.0.0.1:2222-:22", "tcp:127.0.0.1:5432-:5432"]
"#;

fn build_lab_image(
    image: &tandem_labguest::GuestImage,
    lua: &Path,
    want: &str,
) -> anyhow::Result<()> {
    let work = tempfile::Builder::new()
        .prefix("tandem-guest-src-")
        .tempdir()?;
    for (name, text) in GUEST_FILES {
        let p = work.path().join(name);
        std::fs::write(&p, text)?;
        rustix::fs::chmod(&p, rustix::fs::Mode::from_raw_mode(0o755))?;
    }
    let pb = spinner("building guest image (kernel, initramfs, apps disk)");
    let out = Command::new("bash")
        .arg(work.path().join("build-image.sh"))
        .arg(&image.dir)
        .arg(lua)
        .output()
        .context("running the guest image builder")?;
    pb.finish_and_clear();
    if !out.status.success() {
        bail!(
            "guest image build failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::write(image.dir.join("stamp"), want)?;
    let size = |p: PathBuf| std::fs::metadata(p).map(|m| m.len() >> 20).unwrap_or(0);
    println!(
        "[3/3] guest image built in {}: kernel {} MiB, initramfs {} MiB, apps disk {} MiB",
        image.dir.display(),
        size(image.kernel()),
        size(image.initrd()),
        size(image.apps())
    );
    Ok(())
}
