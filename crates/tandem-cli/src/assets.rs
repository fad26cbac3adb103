//! What a package ships next to the binary, generated from the command-line definition itself:
//! shell completions (`tandem completions bash`) and man pages (`tandem manpages DIR`, hidden;
//! dist/deb/build.sh calls it).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::CommandFactory;

/// Print the completion script for a shell.
#[derive(clap::Args)]
pub struct CompletionArgs {
    /// bash, zsh, fish, elvish or powershell
    shell: clap_complete::Shell,
}

/// Write man pages: tandem(1) and one per subcommand (tandem-primary(1), ...).
#[derive(clap::Args)]
pub struct ManArgs {
    /// Directory to write the *.1 files into.
    dir: PathBuf,
}

pub fn completions(a: CompletionArgs) -> anyhow::Result<()> {
    let mut cmd = crate::Cli::command();
    clap_complete::generate(a.shell, &mut cmd, "tandem", &mut std::io::stdout());
    Ok(())
}

pub fn manpages(a: ManArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    let cmd = crate::Cli::command();
    write_page(&a.dir, &cmd, "tandem")?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("tandem-{}", sub.get_name());
        write_page(&a.dir, &sub.clone().name(name.clone()), &name)?;
        for subsub in sub.get_subcommands().filter(|s| !s.is_hide_set()) {
            let name = format!("tandem-{}-{}", sub.get_name(), subsub.get_name());
            write_page(&a.dir, &subsub.clone().name(name.clone()), &name)?;
        }
    }
    Ok(())
}

fn write_page(dir: &Path, cmd: &clap::Command, name: &str) -> anyhow::Result<()> {
    let path = dir.join(format!("{name}.1"));
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd.clone())
        .render(&mut out)
        .with_context(|| format!("rendering {name}(1)"))?;
    std::fs::write(&path, out).with_context(|| format!("writing {}", path.display()))
}
