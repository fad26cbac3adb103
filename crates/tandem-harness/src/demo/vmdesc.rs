//! The demo's guest described as your own VM would be (`--disk-capture mirror`): the lab
//! kernel and apps disk plus a writable raw ext4 disk of its own, which the primary captures
//! through QEMU's block layer (blockdev-mirror) instead of serving it over NBD.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tandem_labguest::GuestImage;

/// Writes `dir/data.raw` (a fresh 64 MiB ext4) and `dir/vm.toml`; returns the description.
pub fn described_vm(dir: &Path, mem: u64) -> anyhow::Result<PathBuf> {
    let image = GuestImage::default();
    image.check()?;
    let data = dir.join("data.raw");
    let f = std::fs::File::create(&data).with_context(|| format!("creating {}", data.display()))?;
    f.set_len(64 << 20)?;
    drop(f);
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "tandem-data"])
        .args(["-E", "lazy_itable_init=0,lazy_journal_init=0"])
        .arg(&data)
        .output()
        .context("running mkfs.ext4")?;
    if !out.status.success() {
        bail!("mkfs.ext4 failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let desc = format!(
        r#"# The lab guest as your own VM: its data disk is a raw file captured by blockdev-mirror.
mem = {mem}
label = "kv"
ready = "{ready}"
echo = {echo:?}

[boot]
kernel = "{kernel}"
initrd = "{initrd}"
cmdline = "console=ttyS0 quiet panic=-1 tandem.workload=kv"
address_arg = "{address_arg}"

[[disk]]
path = "{apps}"
format = "raw"
readonly = true

[[disk]]
path = "{data}"
format = "raw"

[[nic]]
mac = "{mac}"
"#,
        kernel = image.kernel().display(),
        initrd = image.initrd().display(),
        apps = image.apps().display(),
        data = data.display(),
        mac = tandem_labguest::MAC,
        ready = tandem_labguest::READY,
        echo = tandem_labguest::ECHO,
        address_arg = tandem_labguest::ADDRESS_ARG,
    );
    let path = dir.join("vm.toml");
    std::fs::write(&path, desc)?;
    Ok(path)
}
