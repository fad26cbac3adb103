//! A node's copy of the VM's writable disks, and whether it is the guest's disks.
//!
//! A backup applies each epoch's disk writes to one raw file, [`FILE`], that holds every
//! writable disk at 1 MiB-aligned offsets (the capture's layout, [`crate::site`]). After a
//! failover or handover the guest runs from slices of that file, so the file must be on real
//! storage (the backup's `--disk-dir`) and must not be overwritten by the next initial copy
//! until the guest has left it. A small record next to it, [`RECORD`], says which it is:
//!
//! ```text
//!   DIR/guest-disks.raw    the disks, slice after slice
//!   DIR/guest-disks.json   {"vm_id": 7, "state": "copy" | "guest", "epoch": 4711,
//!                           "at_unix_ms": ..., "slices": [{"disk": 0, "offset": 0,
//!                           "size": 4294967296}, ...]}
//! ```
//!
//! - `copy`: a backup is receiving epochs into it (written before the file is truncated). It
//!   is not a disk anybody may boot.
//! - `guest`: the guest resumed here from it (written just after the resume). A primary
//!   started on this directory boots from it instead of the description's disks, because
//!   those are older: the VM ran on the other node since they were last written.
//!
//! The record is replaced atomically (written aside, synced, renamed, directory synced).

use std::io::Write;
use std::path::{Path, PathBuf};

use tandem_vm::MirrorSlice;

/// The copy's file name in its directory.
pub const FILE: &str = "guest-disks.raw";
/// The record's file name in its directory.
pub const RECORD: &str = "guest-disks.json";
/// A record larger than this is not one of ours.
const RECORD_LIMIT: u64 = 64 << 10;

/// What the copy is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// A backup's copy, receiving epochs.
    Copy,
    /// The guest's disks: it resumed here from this copy.
    Guest,
}

/// One writable disk's place in the copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Slice {
    /// Index of the disk in the VM's description.
    pub disk: usize,
    /// Where it starts in the file.
    pub offset: u64,
    /// Its size.
    pub size: u64,
}

/// The record next to the copy.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// The VM whose disks these are.
    pub vm_id: u64,
    /// What the copy is.
    pub state: State,
    /// The last epoch applied (`guest`: the epoch the guest resumed from).
    pub epoch: u64,
    /// When the record was written (Unix milliseconds).
    pub at_unix_ms: u64,
    /// Where each disk lies in the copy.
    pub slices: Vec<Slice>,
}

/// The copy's record could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// Reading or writing a file failed.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// The record is not one of ours.
    #[error("{0} is not a disk-copy record of tandem (move it away if you know what it is)")]
    Corrupt(PathBuf, #[source] serde_json::Error),
    /// The record is far too large.
    #[error("{0} is larger than {RECORD_LIMIT} bytes: not a disk-copy record of tandem")]
    TooLarge(PathBuf),
    /// The record is of another VM.
    #[error(
        "{path} holds the disks of VM {found}, not of VM {want}: give each VM its own directory"
    )]
    OtherVm {
        /// The record.
        path: PathBuf,
        /// Its VM.
        found: u64,
        /// The VM asked for.
        want: u64,
    },
    /// The description's writable disks do not match the copy.
    #[error("the guest's disks are the copy {path} (it ran here after a failover), but the VM description's writable disks no longer match it ({why}); restore the description the VM ran with")]
    Mismatch {
        /// The copy.
        path: PathBuf,
        /// What differs.
        why: String,
    },
}

impl Record {
    /// A record of `vm_id`'s copy laid out as `slices`.
    pub fn new(vm_id: u64, state: State, epoch: u64, slices: &[MirrorSlice]) -> Self {
        Record {
            vm_id,
            state,
            epoch,
            at_unix_ms: crate::unix_ms(),
            slices: slices
                .iter()
                .map(|s| Slice {
                    disk: s.disk,
                    offset: s.offset,
                    size: s.size,
                })
                .collect(),
        }
    }

    /// The slices as the VM layer takes them.
    pub fn mirror_slices(&self) -> Vec<MirrorSlice> {
        self.slices
            .iter()
            .map(|s| MirrorSlice {
                disk: s.disk,
                offset: s.offset,
                size: s.size,
            })
            .collect()
    }
}

/// The copy's path in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// Reads the record in `dir` (`None`: there is none).
pub fn read(dir: &Path) -> Result<Option<Record>, CopyError> {
    let p = dir.join(RECORD);
    let f = match std::fs::File::open(&p) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CopyError::Io(format!("opening {}", p.display()), e)),
    };
    let len = f
        .metadata()
        .map_err(|e| CopyError::Io(format!("reading {}", p.display()), e))?
        .len();
    if len > RECORD_LIMIT {
        return Err(CopyError::TooLarge(p));
    }
    serde_json::from_reader(std::io::BufReader::new(f))
        .map(Some)
        .map_err(|e| CopyError::Corrupt(p, e))
}

/// Replaces the record in `dir` atomically and durably.
pub fn write(dir: &Path, r: &Record) -> Result<(), CopyError> {
    let p = dir.join(RECORD);
    let tmp = dir.join(format!(".{RECORD}.new"));
    let io = |what: &str, e| CopyError::Io(format!("{what} {}", p.display()), e);
    let body = serde_json::to_vec_pretty(r).map_err(|e| io("encoding", e.into()))?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| io("writing", e))?;
    f.write_all(&body).map_err(|e| io("writing", e))?;
    f.sync_all().map_err(|e| io("syncing", e))?;
    std::fs::rename(&tmp, &p).map_err(|e| io("renaming into", e))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io("syncing the directory of", e))
}

/// The guest's disks in `dir`, if the guest of `vm_id` last ran from this node's copy there:
/// the copy's path and its slices, checked against the description's writable disks
/// (`expected`: their indexes and sizes).
pub fn guest_disks(
    dir: &Path,
    vm_id: u64,
    expected: &[MirrorSlice],
) -> Result<Option<(PathBuf, Vec<MirrorSlice>)>, CopyError> {
    let Some(r) = read(dir)? else {
        return Ok(None);
    };
    if r.vm_id != vm_id {
        return Err(CopyError::OtherVm {
            path: dir.join(RECORD),
            found: r.vm_id,
            want: vm_id,
        });
    }
    if r.state != State::Guest {
        return Ok(None);
    }
    let file = path(dir);
    let slices = r.mirror_slices();
    let shape = |s: &[MirrorSlice]| s.iter().map(|m| (m.disk, m.size)).collect::<Vec<_>>();
    if shape(&slices) != shape(expected) {
        return Err(CopyError::Mismatch {
            path: file,
            why: format!(
                "copy has (disk, bytes) {:?}, description {:?}",
                shape(&slices),
                shape(expected)
            ),
        });
    }
    let len = std::fs::metadata(&file)
        .map_err(|e| CopyError::Io(format!("opening {}", file.display()), e))?
        .len();
    if let Some(end) = slices.iter().map(|s| s.offset + s.size).max() {
        if end > len {
            return Err(CopyError::Mismatch {
                path: file,
                why: format!("it is {len} bytes, its slices end at {end}"),
            });
        }
    }
    Ok(Some((file, slices)))
}

/// The guest left this node (handed over to the other one): a copy in `dir` that was its disks
/// is only a copy again, and a primary started here must not boot from it.
pub fn guest_left(dir: &Path) -> Result<(), CopyError> {
    match read(dir)? {
        Some(mut r) if r.state == State::Guest => {
            r.state = State::Copy;
            r.at_unix_ms = crate::unix_ms();
            write(dir, &r)
        }
        _ => Ok(()),
    }
}

/// What [`begin`] found of an earlier guest in the directory.
#[derive(Debug, PartialEq, Eq)]
pub enum Earlier {
    /// Nothing to keep: no record, or a copy only.
    Nothing,
    /// The guest's disks, moved aside to `to` (the epoch it ran from).
    Kept {
        /// Where they are now.
        to: PathBuf,
        /// The epoch it had resumed from.
        epoch: u64,
    },
    /// The record said the guest ran from the copy, but the file is gone (deleted by hand).
    Gone {
        /// The epoch it had resumed from.
        epoch: u64,
    },
}

/// A backup of `vm_id` begins a copy in `dir`: a record of another VM is refused; the disks
/// of a guest that ran here are moved aside to `guest-disks.raw.prev` (never overwritten);
/// then the record says `copy` (epoch 0) for `slices`.
pub fn begin(dir: &Path, vm_id: u64, slices: &[MirrorSlice]) -> Result<Earlier, CopyError> {
    let mut earlier = Earlier::Nothing;
    if let Some(r) = read(dir)? {
        if r.vm_id != vm_id {
            return Err(CopyError::OtherVm {
                path: dir.join(RECORD),
                found: r.vm_id,
                want: vm_id,
            });
        }
        if r.state == State::Guest {
            let (from, to) = (path(dir), dir.join(format!("{FILE}.prev")));
            earlier = if from.exists() {
                std::fs::rename(&from, &to)
                    .map_err(|e| CopyError::Io(format!("moving {} aside", from.display()), e))?;
                Earlier::Kept { to, epoch: r.epoch }
            } else {
                Earlier::Gone { epoch: r.epoch }
            };
        }
    }
    write(dir, &Record::new(vm_id, State::Copy, 0, slices))?;
    Ok(earlier)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slices() -> Vec<MirrorSlice> {
        vec![
            MirrorSlice {
                disk: 0,
                offset: 0,
                size: 3 << 20,
            },
            MirrorSlice {
                disk: 2,
                offset: 3 << 20,
                size: 1 << 20,
            },
        ]
    }

    #[test]
    fn a_backup_keeps_the_disks_a_guest_ran_from() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(begin(d.path(), 7, &slices()).unwrap(), Earlier::Nothing);
        assert_eq!(read(d.path()).unwrap().unwrap().state, State::Copy);
        // The guest ran here from the copy: a new backup moves it aside.
        write(d.path(), &Record::new(7, State::Guest, 9, &slices())).unwrap();
        std::fs::write(path(d.path()), b"disks").unwrap();
        let to = d.path().join("guest-disks.raw.prev");
        assert_eq!(
            begin(d.path(), 7, &slices()).unwrap(),
            Earlier::Kept {
                to: to.clone(),
                epoch: 9
            }
        );
        assert_eq!(std::fs::read(&to).unwrap(), b"disks");
        assert!(!path(d.path()).exists());
        assert_eq!(read(d.path()).unwrap().unwrap().state, State::Copy);
        // A record whose file was deleted by hand: nothing to keep, a fresh copy begins.
        write(d.path(), &Record::new(7, State::Guest, 10, &slices())).unwrap();
        assert_eq!(
            begin(d.path(), 7, &slices()).unwrap(),
            Earlier::Gone { epoch: 10 }
        );
        assert_eq!(read(d.path()).unwrap().unwrap().state, State::Copy);
        // Another VM's directory is refused and left alone.
        assert!(matches!(
            begin(d.path(), 8, &slices()),
            Err(CopyError::OtherVm {
                found: 7,
                want: 8,
                ..
            })
        ));
    }

    #[test]
    fn record_round_trips_and_only_guest_is_booted() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(read(d.path()).unwrap(), None);
        let r = Record::new(7, State::Copy, 12, &slices());
        write(d.path(), &r).unwrap();
        assert_eq!(read(d.path()).unwrap(), Some(r));
        std::fs::File::create(path(d.path()))
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        assert!(guest_disks(d.path(), 7, &slices()).unwrap().is_none());
        write(d.path(), &Record::new(7, State::Guest, 13, &slices())).unwrap();
        let (p, s) = guest_disks(d.path(), 7, &slices()).unwrap().unwrap();
        assert_eq!(p, path(d.path()));
        assert_eq!(s, slices());
    }

    #[test]
    fn refuses_other_vm_other_shape_short_file_and_garbage() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), &Record::new(7, State::Guest, 1, &slices())).unwrap();
        std::fs::File::create(path(d.path()))
            .unwrap()
            .set_len(2 << 20)
            .unwrap();
        let e = guest_disks(d.path(), 8, &slices()).unwrap_err();
        assert!(matches!(e, CopyError::OtherVm { found: 7, .. }), "{e}");
        let e = guest_disks(d.path(), 7, &slices()[..1]).unwrap_err();
        assert!(matches!(e, CopyError::Mismatch { .. }), "{e}");
        let e = guest_disks(d.path(), 7, &slices()).unwrap_err();
        assert!(e.to_string().contains("slices end at"), "{e}");
        std::fs::write(
            d.path().join(RECORD),
            b"{\"vm_id\": 7, \"state\": \"sure\"}",
        )
        .unwrap();
        let e = read(d.path()).unwrap_err();
        assert!(matches!(e, CopyError::Corrupt(..)), "{e}");
    }
}
