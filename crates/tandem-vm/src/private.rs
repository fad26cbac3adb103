//! Files of guest state are private to tandem's user: its working directories are created
//! mode 0700 and checked before use, guest RAM files are created exclusively with mode 0600.
//!
//! A directory given with `--dir` may already exist (a restarted daemon reuses it). It is used
//! only if it is a real directory (not a symbolic link) owned by this process's user; a
//! looser mode of a directory we own is tightened to 0700, with a warning.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why a directory cannot hold guest state.
#[derive(Debug, thiserror::Error)]
pub enum PrivateDirError {
    /// Creating or inspecting it failed.
    #[error("{0}")]
    Io(PathBuf, #[source] std::io::Error),
    /// It exists and is not a directory (or is a symbolic link).
    #[error("{0} is not a directory (or is a symbolic link): remove it or choose another --dir")]
    NotDir(PathBuf),
    /// It is a shared directory such as /tmp (sticky bit set).
    #[error("{0} is a shared directory (sticky bit, like /tmp or a tmpfs mounted without mode=0700): give tandem a directory of its own (a subdirectory, or mount the tmpfs with -o mode=0700)")]
    Shared(PathBuf),
    /// It belongs to another user.
    #[error(
        "{path} belongs to uid {owner}, not to tandem's uid {me}: another user could read guest \
         memory there; remove it or choose another --dir"
    )]
    Owner {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// This process's effective uid.
        me: u32,
    },
}

/// Creates `path` (and its parents) with mode 0700, or checks an existing one: a directory,
/// not a symbolic link, owned by this process's effective uid; a group- or world-accessible
/// mode is tightened to 0700.
pub fn private_dir(path: &Path) -> Result<(), PrivateDirError> {
    let io = |e| PrivateDirError::Io(path.to_path_buf(), e);
    match std::fs::DirBuilder::new()
        .recursive(false)
        .mode(0o700)
        .create(path)
    {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Parents are ordinary directories (e.g. /var/lib/tandem): the usual 0755 of a
            // recursive create, then this one private.
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(io)?;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(e)),
            }
        }
        Err(e) => return Err(io(e)),
    }
    let meta = std::fs::symlink_metadata(path).map_err(io)?;
    if !meta.file_type().is_dir() {
        return Err(PrivateDirError::NotDir(path.to_path_buf()));
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        return Err(PrivateDirError::Owner {
            path: path.to_path_buf(),
            owner: meta.uid(),
            me,
        });
    }
    if meta.mode() & 0o1000 != 0 {
        return Err(PrivateDirError::Shared(path.to_path_buf()));
    }
    if meta.mode() & 0o077 != 0 {
        tracing::warn!(
            "{} had mode {:o}; made it 0700 (it holds guest state)",
            path.display(),
            meta.mode() & 0o777
        );
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_private_and_tightens_loose_modes() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("a/b");
        private_dir(&d).unwrap();
        let mode = std::fs::metadata(&d).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&d).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
    }

    #[test]
    fn refuses_symlinks_and_files() {
        let root = tempfile::tempdir().unwrap();
        let real = root.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(matches!(
            private_dir(&link),
            Err(PrivateDirError::NotDir(_))
        ));
        let shared = root.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(matches!(
            private_dir(&shared),
            Err(PrivateDirError::Shared(_))
        ));
        let file = root.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(
            private_dir(&file),
            Err(PrivateDirError::NotDir(_))
        ));
    }

    #[test]
    fn refuses_another_users_directory() {
        if !rustix::process::geteuid().is_root() {
            return; // chown needs root; the suite runs as root
        }
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("theirs");
        std::fs::create_dir(&d).unwrap();
        std::os::unix::fs::chown(&d, Some(65534), None).unwrap();
        let e = private_dir(&d).unwrap_err();
        assert!(e.to_string().contains("uid 65534"), "{e}");
    }
}
