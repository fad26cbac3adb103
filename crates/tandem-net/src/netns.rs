//! Running code inside a named network namespace (`/run/netns/NAME`, as `ip netns` creates).

use std::fs::File;
use std::os::fd::AsRawFd;

/// Network-namespace errors.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file does not exist or cannot be opened.
    #[error("network namespace {0:?} not found (create it with `ip netns add`, as root)")]
    Open(String, #[source] std::io::Error),
    /// `setns` failed (needs CAP_SYS_ADMIN).
    #[error("cannot enter network namespace {0:?} (run as root)")]
    Enter(String, #[source] std::io::Error),
    /// The helper thread panicked.
    #[error("helper thread for namespace {0:?} failed")]
    Thread(String),
}

/// Runs `f` on a new thread that has entered network namespace `name` (sockets and tap
/// devices it creates belong to that namespace and stay usable from any thread). `None`
/// runs `f` in the caller's namespace.
pub fn in_netns<T: Send + 'static>(
    name: Option<&str>,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, NetnsError> {
    let Some(name) = name else {
        return Ok(f());
    };
    let file =
        File::open(format!("/run/netns/{name}")).map_err(|e| NetnsError::Open(name.into(), e))?;
    let owned = name.to_string();
    std::thread::spawn(move || {
        // SAFETY: `file` is an open namespace file descriptor for the whole call; setns only
        // changes this helper thread's network namespace.
        let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        if r != 0 {
            return Err(NetnsError::Enter(owned, std::io::Error::last_os_error()));
        }
        Ok(f())
    })
    .join()
    .map_err(|_| NetnsError::Thread(name.into()))?
}
