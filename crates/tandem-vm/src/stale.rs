//! Files a killed tandem leaves behind, found and removed by the next one.
//!
//! A daemon killed with SIGKILL cannot clean up. Its large files are already gone (guest RAM
//! files are unlinked as soon as QEMU and tandem map them; QEMU dies with its parent), but
//! small ones remain: QEMU's runtime directory (QMP socket, console and QEMU logs), the
//! device-state file's directory in `/dev/shm` (`devstate::fast`), and the working
//! directories of the daemons and the demo. Each such directory holds an
//! [`OWNER_FILE`] with the owner's pid; [`clean_stale`] removes those whose owner is dead, and
//! guest RAM files (`/dev/shm/tandem-NAME-PID-N.ram`) of dead processes.

use std::path::{Path, PathBuf};

/// Name of the file holding the pid of a directory's owner.
pub const OWNER_FILE: &str = "owner.pid";

/// Marks `dir` as owned by this process.
pub fn mark_owned(dir: &Path) -> std::io::Result<()> {
    std::fs::write(dir.join(OWNER_FILE), std::process::id().to_string())
}

/// A new directory `PREFIX…` in `dir` (the temporary directory if `None`), marked as owned by
/// this process so that [`clean_stale`] removes it once this process is dead. Removed on drop.
pub fn owned_tempdir(prefix: &str, dir: Option<&Path>) -> std::io::Result<tempfile::TempDir> {
    let mut b = tempfile::Builder::new();
    b.prefix(prefix);
    let d = match dir {
        Some(dir) => b.tempdir_in(dir)?,
        None => b.tempdir()?,
    };
    mark_owned(d.path())?;
    Ok(d)
}

/// [`owned_tempdir`] in [`TMPFS`].
pub fn owned_tmpfs_dir(prefix: &str) -> std::io::Result<tempfile::TempDir> {
    owned_tempdir(prefix, Some(Path::new(TMPFS)))
}

fn alive(pid: i32) -> bool {
    if pid <= 0 {
        return true;
    }
    // SAFETY: kill(2) with signal 0 only checks whether the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn owner(dir: &Path) -> Option<i32> {
    std::fs::read_to_string(dir.join(OWNER_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The pid in a guest RAM file name `tandem-NAME-PID-N.ram`.
fn ram_file_pid(name: &str) -> Option<i32> {
    let stem = name.strip_prefix("tandem-")?.strip_suffix(".ram")?;
    let mut parts = stem.rsplit('-');
    let _n: u64 = parts.next()?.parse().ok()?;
    parts.next()?.parse().ok()
}

/// The tmpfs that holds guest RAM files, device-state files and owned scratch directories
/// (swept by [`clean_stale`] with the temporary directory).
pub const TMPFS: &str = "/dev/shm";

/// Removes what dead tandem processes left in [`TMPFS`] and the temporary directory;
/// returns the paths removed.
pub fn clean_stale() -> Vec<PathBuf> {
    let mut removed = Vec::new();
    for root in [PathBuf::from(TMPFS), std::env::temp_dir()] {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with("tandem-") {
                continue;
            }
            let path = e.path();
            let stale = if path.is_dir() {
                owner(&path).is_some_and(|p| !alive(p))
            } else {
                ram_file_pid(&name).is_some_and(|p| !alive(p))
            };
            if !stale {
                continue;
            }
            let r = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            if r.is_ok() {
                tracing::info!("removed {} left by a dead tandem process", path.display());
                removed.push(path);
            }
        }
    }
    removed
}

/// Removes the directories in `root` named `prefix…` whose owner is dead but for the newest
/// `keep` of them (by modification time); returns the paths removed. For logs a run keeps on
/// purpose (the Debian demo's rounds), which would otherwise pile up run after run.
pub fn prune_kept(root: &Path, prefix: &str, keep: usize) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut dead: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .filter(|p| p.is_dir() && owner(p).is_none_or(|pid| !alive(pid)))
        .map(|p| {
            let t = p.metadata().and_then(|m| m.modified());
            (t.unwrap_or(std::time::UNIX_EPOCH), p)
        })
        .collect();
    dead.sort_by_key(|d| std::cmp::Reverse(d.0));
    let mut removed = Vec::new();
    for (_, p) in dead.into_iter().skip(keep) {
        if std::fs::remove_dir_all(&p).is_ok() {
            tracing::info!("removed {}: older than the last {keep} kept", p.display());
            removed.push(p);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_file_names_parse() {
        assert_eq!(ram_file_pid("tandem-primary-1234-0.ram"), Some(1234));
        assert_eq!(ram_file_pid("tandem-my-vm-77-3.ram"), Some(77));
        assert_eq!(ram_file_pid("tandem-demo-x"), None);
    }

    #[test]
    fn an_owned_tempdir_names_this_process_and_goes_with_its_handle() {
        let d = owned_tempdir("tandem-test-owned-", Some(&std::env::temp_dir())).unwrap();
        let path = d.path().to_path_buf();
        assert!(path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("tandem-test-owned-"));
        assert_eq!(owner(&path), Some(std::process::id() as i32));
        drop(d);
        assert!(!path.exists());
    }

    #[test]
    fn directories_of_dead_owners_are_removed_and_live_ones_kept() {
        let live = tempfile::Builder::new()
            .prefix("tandem-test-live-")
            .tempdir()
            .unwrap();
        mark_owned(live.path()).unwrap();
        let dead = tempfile::Builder::new()
            .prefix("tandem-test-dead-")
            .tempdir()
            .unwrap();
        // A pid that cannot exist (above the kernel's pid_max limit of 2^22).
        std::fs::write(dead.path().join(OWNER_FILE), "99999999").unwrap();
        let removed = clean_stale();
        assert!(removed.iter().any(|p| p == dead.path()), "{removed:?}");
        assert!(live.path().exists());
        assert!(!dead.path().exists());
    }

    #[test]
    fn kept_logs_are_pruned_to_the_newest_and_live_ones_stay() {
        let root = tempfile::tempdir().unwrap();
        let t0 = std::time::SystemTime::now() - std::time::Duration::from_secs(1000);
        for i in 0..5u64 {
            let d = root.path().join(format!("tandem-kept-{i}"));
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join(OWNER_FILE), "99999999").unwrap();
            let f = std::fs::File::open(&d).unwrap();
            f.set_modified(t0 + std::time::Duration::from_secs(i))
                .unwrap();
        }
        let live = root.path().join("tandem-kept-live");
        std::fs::create_dir(&live).unwrap();
        mark_owned(&live).unwrap();
        std::fs::create_dir(root.path().join("other-0")).unwrap();
        let mut removed = prune_kept(root.path(), "tandem-kept-", 2);
        removed.sort();
        let names: Vec<_> = removed
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["tandem-kept-0", "tandem-kept-1", "tandem-kept-2"]);
        assert!(live.exists() && root.path().join("other-0").exists());
        assert!(root.path().join("tandem-kept-4").exists());
    }
}
